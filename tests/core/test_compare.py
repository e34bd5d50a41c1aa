"""Paired comparison of evaluations: tools/compare_results.py as a user runs it, and the verdict logic."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from markdown_tables import difference_rows

from dflash_cb.common.cli import run
from dflash_cb.core.results.compare import compare, delta_metrics, render_markdown
from dflash_cb.core.results.results_file import (
    Results,
    SampleRecord,
    load_results,
    report_to_results,
    write_results,
)
from dflash_cb.integrations.cli.compare import main

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compare_results.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    """The tool as a user runs it (a subprocess: seconds of imports, so only once)."""
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, env=dict(os.environ), capture_output=True,
                          text=True, timeout=120)


def _run_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """What tools/compare_results.py does (``cli.run(compare.main)``), in this process."""
    code = run(main, list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def two_results(tiny_cache, tiny_drafter_config, tmp_path_factory) -> tuple[Path, Path]:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    cache = StateCache(tiny_cache)
    out = tmp_path_factory.mktemp("cmp")
    paths = []
    for seed, name in ((1, "first"), (2, "second")):
        torch.manual_seed(seed)
        report = evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(), budgets=[4, 8])
        write_results(report_to_results(report, cache, meta={"drafter": {"path": name, "kind": "folder",
                                                                         "global_step": seed}}), out / f"{name}.json")
        paths.append(out / f"{name}.json")
    return paths[0], paths[1]


@pytest.mark.e2e
def test_tool_writes_markdown_and_png(two_results, tmp_path):
    a, b = two_results
    proc = _run(str(a), str(b), "--out", str(tmp_path / "cmp"), "--resamples", "300")
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "cmp.md").read_text()
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ra, rb = load_results(a), load_results(b)
    assert f"**second - first = {rb.tau - ra.tau:+.3f} [" in md
    assert "| tau (pooled over cycles) |" in md and "DDTree tau, budget 8" in md and "tau, code" in md
    assert "### By position in the completion" in md and "| 0_8 |" in md and "| 4plus |" in md
    assert "global step 2" in md and md in proc.stdout


def test_published_figures_sit_beside_their_own_convention(two_results, tmp_path, capsys):
    """A published figure is listed only beside the live figure of its declared convention."""
    import yaml

    from dflash_cb.core.figures.metrics import ACCEPT_LENGTH_SERVED, TAU_REQUEST_MEAN, ci_high, ci_low

    a, b = two_results
    pub = tmp_path / "pub.yaml"
    pub.write_text(yaml.safe_dump({"entries": [
        {"name": "bench-mean", "source": "TEST DATA", "convention": "request_mean", "metrics": {"tau": 6.5}},
        {"name": "sglang-mean", "source": "TEST DATA", "convention": "served_request_mean", "metrics": {"tau": 7.25}},
        {"name": "pooled-x", "source": "TEST DATA", "convention": "pooled", "metrics": {"tau": 5.75}}]}))
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"),
                               "--published", str(pub))
    assert code == 0, err
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith(
        ("| bench-mean", "| sglang-mean", "| pooled-x"))}
    ra, rb = load_results(a), load_results(b)
    assert "| tau, mean over requests (dflash.benchmark) | 6.500 |" in rows["bench-mean"]
    assert "| served accept length, mean over requests (SGLang) | 7.250 |" in rows["sglang-mean"]
    assert "| tau (pooled over cycles) | 5.750 |" in rows["pooled-x"]
    for name, metric in (("bench-mean", TAU_REQUEST_MEAN), ("sglang-mean", ACCEPT_LENGTH_SERVED)):
        for r in (ra, rb):  # the live cells are that convention's figure, with its interval
            assert f"{r.metric(metric):.3f} [{r.metric(ci_low(metric)):.2f}, {r.metric(ci_high(metric)):.2f}]" \
                in rows[name], (name, rows[name])
    # A published figure without a convention is refused, naming the entry and the choices.
    pub.write_text(yaml.safe_dump({"entries": [{"name": "nameless", "source": "TEST DATA", "metrics": {"tau": 6.0}}]}))
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "cmp2"), "--published", str(pub))
    assert code == 2 and "'nameless'" in err and "request_mean" in err and not (tmp_path / "cmp2.md").exists()


def test_a_drafter_against_itself_differs_by_exactly_zero(two_results, tmp_path, capsys):
    a, _ = two_results
    shutil.copy(a, tmp_path / "again.json")
    code, out, err = _run_here(capsys, str(a), str(tmp_path / "again.json"), "--out", str(tmp_path / "self"))
    assert code == 0, err
    n = len(load_results(a).samples)
    assert f"again - first = +0.000 [+0.000, +0.000]**: no difference detectable with {n} prompts" in out


def test_files_from_different_caches_are_refused_naming_the_field_or_both_hashes(two_results, tmp_path, capsys):
    a, b = two_results
    data = json.loads(b.read_text())
    data["meta"]["cache_manifest_sha256"] = data["meta"]["cache_content_sha256"] = "ab" * 32
    data["meta"]["cache_identity"]["dtype"] = "bfloat16"
    (tmp_path / "other.json").write_text(json.dumps(data))
    code, _, err = _run_here(capsys, str(a), str(tmp_path / "other.json"), "--out", str(tmp_path / "x"))
    assert code == 2
    assert err.startswith("error: ") and "the caches differ in dtype;" in err
    assert "not comparable" in err and not (tmp_path / "x.md").exists()
    del data["meta"]["cache_identity"]  # no identity to diff: both content hashes
    (tmp_path / "other.json").write_text(json.dumps(data))
    code, _, err = _run_here(capsys, str(a), str(tmp_path / "other.json"), "--out", str(tmp_path / "x"))
    mine = load_results(a).meta["cache_content_sha256"][:12]
    assert code == 2 and mine in err and "abababababab" in err and "not comparable" in err
    code, _, err = _run_here(capsys, str(a), "--out", str(tmp_path / "x"))
    assert code == 2 and "at least two" in err
    code, _, err = _run_here(capsys, str(a), str(b), "--position-edges", "5,3")
    assert code == 2 and "--position-edges '5,3'" in err


def _synthetic(rng: np.random.Generator, gain: float) -> tuple[Results, Results]:
    """Two drafters on the same 40 prompts; B commits one more token in a fraction ``gain`` of the cycles."""
    a_s, b_s = [], []
    for i in range(40):
        p = rng.beta(2, 2)
        lens = (1 + rng.binomial(7, p, rng.integers(20, 80))).tolist()
        extra = rng.random(len(lens)) < gain
        a_s.append(SampleRecord(f"s{i}", "cat", lens))
        b_s.append(SampleRecord(f"s{i}", "cat", [k + int(e) for k, e in zip(lens, extra, strict=True)]))
    meta = {"cache_manifest_sha256": "c" * 64, "ddtree_budgets": []}
    mk = lambda s: Results({}, s, {"unconditional": [0.5]}, {}, dict(meta))  # noqa: E731
    return mk(a_s), mk(b_s)


def test_verdicts_better_worse_and_undetectable():
    rng = np.random.default_rng(0)
    a, b = _synthetic(rng, 0.3)
    c = compare(["A", "B"], [a, b], n_resamples=500)
    d = c.differences[(0, 1)]["tau"]
    assert d.interval.low > 0 and d.verdict == "B is better"
    assert "**B - A = +" in render_markdown(c) and ": B is better" in render_markdown(c)
    c = compare(["B", "A"], [b, a], n_resamples=500)
    assert c.differences[(0, 1)]["tau"].verdict == "B is better"  # A - B < 0
    a, b = _synthetic(rng, 0.0)
    d = compare(["A", "B"], [a, b], n_resamples=500).differences[(0, 1)]["tau"]
    assert d.verdict == "no difference detectable with 40 prompts" and d.interval.value == 0


def test_delta_tau_of_the_live_drafter_against_a_baseline(two_results, tiny_cache):
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_measured

    a, b = two_results
    cache = StateCache(tiny_cache)
    ids = [s.id for s in cache.samples][:4]
    base = load_measured(a, cache, name="zlab", sample_ids=ids)
    live = [s for s in load_results(b).samples if s.id in ids]
    out = delta_metrics(live, [base], n_resamples=300)
    expected = (sum(sum(s.acceptance_lengths) for s in live) / sum(len(s.acceptance_lengths) for s in live)
                - base.metrics["tau"])
    assert out["baseline/zlab/delta_tau"] == pytest.approx(expected)
    assert out["baseline/zlab/delta_tau_ci_low"] <= out["baseline/zlab/delta_tau"] <= out["baseline/zlab/delta_tau_ci_high"]
    assert delta_metrics(base.samples, [base])["baseline/zlab/delta_tau_ci_high"] == 0.0


def _edited(src: Path, dst: Path, edit) -> Path:
    """A copy of a results.json with ``edit(data)`` applied (a damaged or hand-edited file)."""
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data))
    return dst


def _one_line_refusal(capsys, out: Path, *args: str) -> str:
    code, _, err = _run_here(capsys, *args, "--out", str(out))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.with_suffix(".md").exists() and not out.with_suffix(".png").exists()
    return err


def test_a_sample_id_twice_in_one_file_is_refused_naming_it(two_results, tmp_path, capsys):
    """A sample id twice in one file is refused naming it, not resolved by the last copy."""
    a, b = two_results

    def twice(d):
        d["samples"].append({**d["samples"][-1], "acceptance_lengths": [1] * 5})

    dup = _edited(b, tmp_path / "dup.json", twice)
    err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(dup))
    first_id = json.loads(dup.read_text())["samples"][-1]["id"]
    assert str(dup) in err and repr(first_id) in err and "more than once" in err
    with pytest.raises(ValueError, match="more than once"):  # every reader of results files refuses it
        load_results(dup)


def test_impossible_lengths_and_malformed_ddtree_entries_are_one_line(two_results, tmp_path, capsys):
    """Acceptance lengths outside 1..block_size, a malformed per-sample ``ddtree``."""
    a, b = two_results
    block = load_results(b).block_size
    cases = {
        "zero": (lambda d: d["samples"][0].__setitem__("acceptance_lengths", [0, 2]), "outside 1.."),
        "long": (lambda d: d["samples"][1].__setitem__("acceptance_lengths", [block + 1]), f"outside 1..{block}"),
        "ddlong": (lambda d: d["samples"][1]["ddtree"].__setitem__("4", [block + 3]), "ddtree budget 4 holds"),
        "ddlist": (lambda d: d["samples"][0].__setitem__("ddtree", [1, 2]), "'ddtree' is a list"),
        "ddkey": (lambda d: d["samples"][0].__setitem__("ddtree", {"b4": [1]}), "budget 'b4' is not an integer"),
        "ddvals": (lambda d: d["samples"][0].__setitem__("ddtree", {"4": 3}), "must be a list of integers"),
        "text": (lambda d: d["samples"][0].__setitem__("acceptance_lengths", ["x"]), "must be a list of integers"),
    }
    for name, (edit, needle) in cases.items():
        bad = _edited(b, tmp_path / f"{name}.json", edit)
        err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(bad))
        assert str(bad) in err and needle in err and "tools/eval_drafter.py" in err, (name, err)


def test_few_resamples_still_write_the_markdown_and_the_plot(two_results, tmp_path, capsys):
    """Very few bootstrap resamples (--resamples 1, 2, 5) still write the markdown and the plot."""
    a, b = two_results
    for n in (1, 2, 5):
        out = tmp_path / f"r{n}"
        code, _, err = _run_here(capsys, str(a), str(b), "--resamples", str(n), "--out", str(out))
        assert code == 0, err
        assert "## Drafter comparison" in out.with_suffix(".md").read_text()
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_labels_out_hashes_and_categories_are_checked(two_results, tmp_path, capsys):
    """Duplicate or blank --labels, an --out under a file, files without a cache hash, and shared ids filed
    under different categories: each one line naming what to fix."""
    a, b = two_results
    out = tmp_path / "cmp"
    assert "given more than once" in _one_line_refusal(capsys, out, str(a), str(b), "--labels", "x,x")
    assert "name 2 is blank" in _one_line_refusal(capsys, out, str(a), str(b), "--labels", "x, ")
    assert "name 1 is blank" in _one_line_refusal(capsys, out, str(a), str(b), "--labels", ",y")
    a_file = tmp_path / "plain"
    a_file.write_text("not a folder")
    err = _one_line_refusal(capsys, a_file / "cmp", str(a), str(b))
    assert f"{a_file} is a file, not a folder" in err and a_file.read_text() == "not a folder"

    def no_hash(d):
        d["meta"].pop("cache_manifest_sha256")

    na, nb = _edited(a, tmp_path / "na.json", no_hash), _edited(b, tmp_path / "nb.json", no_hash)
    err = _one_line_refusal(capsys, out, str(na), str(nb))
    assert "na, nb: no cache manifest hash" in err and "--states" in err

    def recategorise(d):
        d["samples"][2]["category"] = "elsewhere"

    moved = _edited(b, tmp_path / "moved.json", recategorise)
    sid = json.loads(moved.read_text())["samples"][2]["id"]
    err = _one_line_refusal(capsys, out, str(a), str(moved))
    assert f"{sid!r}: 'elsewhere' in moved" in err and "not describe the same prompts" in err


def test_position_buckets_stop_where_the_completions_stop(two_results, tmp_path, capsys):
    """Buckets past the longest completion printed rows of ``n/a (0 cycles)``. The tiny cache's completions
    are 24 tokens: the default edges, fitted to them, are 0, 8, 16, 32, 64 (``positions.fitted_edges``)."""
    from dflash_cb.core.figures.derived import live_metrics
    from dflash_cb.core.results.report import format_results

    a, b = two_results
    res = load_results(a)
    longest = max(sum(s.acceptance_lengths) for s in res.samples)
    assert 16 < longest <= 32  # every anchor in the first three fitted buckets
    kept = ["0_8", "8_16", "16_32"]
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"), "--resamples", "50")
    assert code == 0, err
    assert all(f"| {k} |" in out for k in kept) and "32_64" not in out and "64_end" not in out
    assert "n/a (0)" not in out and "0_256" not in out
    text = format_results(res)  # the console report of tools/eval_drafter.py
    assert all(k in text for k in kept) and "32_64" not in text and "(0 cycles)" not in text
    assert list(res.breakdown["position"]) == kept
    assert not [k for k in res.metrics if k.startswith("position/") and k.split("/")[1] not in kept]
    live = live_metrics(res.samples, res.budgets, res.categories, n_resamples=50)  # what the callback logs
    assert sum(live[f"position/{k}/cycles"] for k in kept) == sum(len(s.acceptance_lengths) for s in res.samples)
    assert not [k for k in live if k.startswith("position/") and k.split("/")[1] not in kept]
    # Edges within the data keep every bucket up to the one holding the last anchor.
    cut = longest // 2
    edges = (0, cut, longest, longest + 5)
    t = live_metrics(res.samples, [], [], position_edges=edges, n_resamples=20)
    assert f"position/{cut}_{longest}/cycles" in t and f"position/{longest}_{longest + 5}/cycles" not in t


# -- the .md and the .png together ----------------------------------------------------------------

@pytest.mark.e2e
def test_a_full_disk_replaces_neither_the_markdown_nor_the_plot(two_results, tmp_path, capsys):
    """With room for the new .md but not the .png, the old comparison stays whole (the new .md would
    embed the old plot) and the error names the .png."""
    import resource
    import signal

    a, b = two_results
    out = tmp_path / "cmp"
    code, _, err = _run_here(capsys, str(a), str(b), "--out", str(out), "--resamples", "50", "--labels", "old1,old2")
    assert code == 0, err
    md, png = out.with_suffix(".md").read_bytes(), out.with_suffix(".png").read_bytes()
    limit = 2 * len(md) + 4096
    assert limit < len(png)  # room for a new .md, not for a new .png

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, str(TOOL), str(a), str(b), "--out", str(out), "--resamples", "50",
                           "--labels", "new1,new2"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=cap)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"error: {out.with_suffix('.png')}: File too large (")
    assert out.with_suffix(".md").read_bytes() == md and out.with_suffix(".png").read_bytes() == png
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.md", "cmp.png"]  # no temporaries left


def test_a_failed_second_rename_puts_the_first_file_back(two_results, tmp_path):
    from dflash_cb.core.results.compare import write_comparison

    a, b = two_results
    c = compare(["A", "B"], [load_results(a), load_results(b)], n_resamples=20)
    md, png = tmp_path / "cmp.md", tmp_path / "cmp.png"
    md.write_text("the previous comparison\n")
    png.mkdir()  # a folder (not empty) where the plot goes: its rename fails after the .md's succeeded
    (png / "keep").write_text("x")
    with pytest.raises(OSError) as e:
        write_comparison(c, md, png)
    assert e.value.filename == str(png) or e.value.filename2 == str(png)
    assert md.read_text() == "the previous comparison\n" and (png / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.md", "cmp.png"]
    png_new = tmp_path / "fresh.png"  # and with nothing in the way both are written
    write_comparison(c, md, png_new)
    assert "![comparison](fresh.png)" in md.read_text() and png_new.read_bytes()[:4] == b"\x89PNG"


# -- tail blocks ---------------------------------------------------------------------------------

def test_other_tail_blocks_are_warned_about_and_shown(two_results, tmp_path, capsys):
    """Near max_new_tokens the two conventions replay different blocks: a comparison across them is
    flagged (stderr and the Markdown), each evaluation's convention is listed, an unknown one refused."""
    a, b = two_results
    assert load_results(a).tail_blocks == "served"
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "same"), "--resamples", "20")
    assert code == 0 and "warning" not in err and "Warning" not in out
    assert out.count(", tail blocks served") == 2

    ref = _edited(b, tmp_path / "ref.json", lambda d: d["meta"].__setitem__("tail_blocks", "reference"))
    code, out, err = _run_here(capsys, str(a), str(ref), "--out", str(tmp_path / "mixed"), "--resamples", "20")
    assert code == 0, err
    assert err.startswith("warning: tail_blocks differ (first 'served', ref 'reference')") and "--tail-blocks" in err
    md = (tmp_path / "mixed.md").read_text()
    assert "**Warning:** tail_blocks differ" in md and ", tail blocks reference" in md and ", tail blocks served" in md

    unsaid = _edited(b, tmp_path / "unsaid.json", lambda d: d["meta"].pop("tail_blocks"))
    code, out, err = _run_here(capsys, str(a), str(unsaid), "--out", str(tmp_path / "unsaid"), "--resamples", "20")
    assert code == 0 and "unsaid (not recorded)" in err and ", tail blocks not recorded" in out

    junk = _edited(b, tmp_path / "junk.json", lambda d: d["meta"].__setitem__("tail_blocks", "junk"))
    err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(junk))
    assert f"{junk}: meta.tail_blocks is 'junk', expected one of served, reference" in err


def test_a_baseline_with_other_tail_blocks_is_warned_about(two_results, tiny_cache, tmp_path):
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_measured

    a, _ = two_results
    cache = StateCache(tiny_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_measured(a, cache, series={"tail_blocks": "served"}).details["tail_blocks"] == "served"
    with pytest.warns(RuntimeWarning, match=r"tail_blocks differ \(this run 'reference', baseline .*first.json "
                                            r"'served'\)"):
        load_measured(a, cache, series={"tail_blocks": "reference"})
    old = _edited(a, tmp_path / "old.json", lambda d: (d.__setitem__("version", 3), d["meta"].pop("tail_blocks")))
    # A file that does not say how it replayed the tail blocks is compared with a warning, never silently.
    assert load_results(old).tail_blocks is None
    with pytest.warns(RuntimeWarning, match=r"this run 'served', baseline .*old.json \(not recorded\)"):
        load_measured(old, cache, series={"tail_blocks": "served"})


def test_a_baseline_or_comparison_at_another_block_or_dtype_says_so(two_results, tiny_cache, tmp_path, capsys):
    """The series fields that change the measured quantity (block drafted, tail convention, compute dtype) are
    compared wherever two evaluations meet: a baseline of the live run and compare_results. A block-6 drafter
    beside one scored at --block-size 3 is not 'better' without a word; the Evaluations list shows the block."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_measured

    a, b = two_results
    cache = StateCache(tiny_cache)
    block = load_results(a).block_size
    with pytest.warns(RuntimeWarning, match=rf"block_size differ \(this run 3, baseline .*first.json {block}\).*"
                                            r"--block-size"):
        load_measured(a, cache, series={**load_results(a).series, "block_size": 3})
    with pytest.warns(RuntimeWarning, match=r"dtype differ \(this run 'bfloat16', baseline .* 'float32'\).*--dtype"):
        load_measured(a, cache, series={**load_results(a).series, "dtype": "bfloat16"})
    with warnings.catch_warnings():  # the anchor set is how the statistics estimate, not what they measure
        warnings.simplefilter("error")
        load_measured(a, cache, series={**load_results(a).series, "anchor_stride": 8})
    small = _edited(b, tmp_path / "small.json", lambda d: d["meta"].__setitem__("block_size", 3))
    code, out, err = _run_here(capsys, str(a), str(small), "--out", str(tmp_path / "cmp3"), "--resamples", "20")
    assert code == 0 and f"block_size differ (first {block}, small 3)" in err + out
    assert f", block {block}, " in out and ", block 3, " in out


# -- malformed fields of a results file --------------------------------------------------------

def test_malformed_meta_and_metrics_are_one_line_naming_file_and_field(two_results, tiny_cache, tmp_path, capsys):
    """Budgets, block size, figures and histogram as readers use them: never coerced, never dropped."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_measured
    from dflash_cb.core.results.results_file import ResultsError

    a, b = two_results

    cases = {
        "int": (lambda d: d["meta"].__setitem__("ddtree_budgets", 32), "meta.ddtree_budgets is 32"),
        "strs": (lambda d: d["meta"].__setitem__("ddtree_budgets", ["16", "x"]), "meta.ddtree_budgets is ['16', 'x']"),
        "bool": (lambda d: d["meta"].__setitem__("ddtree_budgets", [True, 8]), "meta.ddtree_budgets is [True, 8]"),
        "twice": (lambda d: d["meta"].__setitem__("ddtree_budgets", [4, 4, 8]), "distinct positive integers"),
        "extra": (lambda d: d["meta"].__setitem__("ddtree_budgets", [4, 8, 16]), "lists [16] but no sample holds"),
        "fewer": (lambda d: d["meta"].__setitem__("ddtree_budgets", [4]), "budget(s) [8], not in meta.ddtree_budgets"),
        "block": (lambda d: d["meta"].__setitem__("block_size", "6"), "meta.block_size is '6', expected a positive"),
        "tau": (lambda d: d["metrics"].__setitem__("tau", "abc"), "metrics.tau is 'abc', not a number"),
        "flag": (lambda d: d["metrics"].__setitem__("ddtree/tau_b8", True), "metrics.ddtree/tau_b8 is True"),
        "depth": (lambda d: d["per_depth"].__setitem__("unconditional", ["x"]), "per_depth.unconditional is ['x']"),
        "hist": (lambda d: d["histogram"].__setitem__("two", 3), "histogram entry 'two': 3"),
        "v2": (lambda d: d.update(version=2), "results version 2, a development format"),
    }
    cache = StateCache(tiny_cache)
    for name, (edit, needle) in cases.items():
        bad = _edited(b, tmp_path / f"{name}.json", edit)
        err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(bad))
        assert str(bad) in err and needle in err and "tools/eval_drafter.py" in err, (name, err)
        with pytest.raises(ResultsError, match=re.escape(needle)):  # the callback's baselines read it the same way
            load_measured(bad, cache)


# -- published figures through the tool ----------------------------------------------------------

def test_published_files_that_cannot_be_used_are_one_line_naming_file_entry_and_field(two_results, tmp_path, capsys):
    import yaml

    a, b = two_results
    pub = tmp_path / "pub.yaml"
    pub.write_text("entries:\n  - name: x\n    source: [unclosed\n")
    err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(b), "--published", str(pub))
    assert f"--published: {pub}:4:1: not valid YAML" in err, err

    def refused(entry: dict, needle: str) -> None:
        pub.write_text(yaml.safe_dump({"entries": [entry]}))
        err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(b), "--published", str(pub))
        assert f"--published: {pub}: entry {entry['name']!r}" in err and needle in err, err

    base = {"source": "TEST DATA", "convention": "pooled"}
    refused({**base, "name": "comma", "metrics": {"tau": "6,5"}}, "metrics.tau is '6,5', not a number")
    refused({**base, "name": "low", "metrics": {"tau": 0.5}}, "metrics.tau is 0.5: an acceptance length is at least 1")
    refused({**base, "name": "typo", "metrics": {"tua": 6.0}}, "metrics.tua: not a figure dflash-cb logs")
    # Budget 23 is not one the evaluations have (they have 4 and 8): it would stand beside nothing.
    refused({**base, "name": "b23", "metrics": {"ddtree/tau_b23": 6.0}},
            "metrics.ddtree/tau_b23 has no live counterpart (the DDTree budgets evaluated are [4, 8])")
    pub.write_text(yaml.safe_dump({"entries": [{**base, "name": "b8", "metrics": {"ddtree/tau_b8": 2.5}}]}))
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "ok"), "--published", str(pub),
                               "--resamples", "20")
    assert code == 0 and "| b8 | DDTree tau, budget 8 | 2.500 |" in out, err


def test_a_tool_run_inside_another_program_leaves_its_thread_count(two_results, tmp_path):
    """``--threads`` sets torch's threads for the tool; run in-process (the demo runs the precompute so),
    the caller's count is back afterwards."""
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import compare as tool

    a, b = two_results
    torch.set_num_threads(1)
    assert run(tool.main, [str(a), str(b), "--out", str(tmp_path / "cmp"), "--threads", "2"]) == 0
    assert torch.get_num_threads() == 1


# -- many small comparisons, odd seeds and labels ------------------------------------------------------------------

def _null_categories(rng: np.random.Generator, n_categories: int = 10, per: int = 6,
                     gain: float = 0.0) -> tuple[Results, Results]:
    """Two drafters on ``n_categories`` x ``per`` prompts: each cycle commits one more token with chance 1/2 in
    either, independently, and in ``gain`` of B's cycles one more still: no difference at ``gain`` 0."""
    a_s, b_s = [], []
    for i in range(n_categories * per):
        lens = 1 + rng.binomial(7, rng.beta(2, 2), rng.integers(20, 60))
        extra = (rng.random(len(lens)) < gain).astype(int)
        a_s.append(SampleRecord(f"s{i}", f"c{i % n_categories}", (lens + rng.integers(0, 2, len(lens))).tolist()))
        b_s.append(SampleRecord(f"s{i}", f"c{i % n_categories}",
                                (lens + rng.integers(0, 2, len(lens)) + extra).tolist()))
    meta = {"cache_manifest_sha256": "c" * 64, "ddtree_budgets": []}
    mk = lambda s: Results({}, s, {"unconditional": [0.5]}, {}, dict(meta))  # noqa: E731
    return mk(a_s), mk(b_s)


def test_category_verdicts_are_many_small_comparisons():
    """Ten categories of six prompts, no difference anywhere: at 95% each, a category's interval misses zero by
    chance (the trap); its row gives no verdict, since the overall tau has none. With a real gain the overall
    tau has a verdict, and each category's is taken from an interval corrected for ten comparisons (Bonferroni:
    99.5% each), the level shown in its row."""
    from dflash_cb.core.figures.bootstrap import metric_sums, paired_difference
    from dflash_cb.core.figures.metrics import category_tau

    cats = [f"c{i}" for i in range(10)]
    a, b = _null_categories(np.random.default_rng(2))
    c = compare(["A", "B"], [a, b])
    d = c.differences[(0, 1)]
    sa, sb = metric_sums(a.samples, (), cats), metric_sums(b.samples, (), cats)
    by_chance = [x for x in cats if paired_difference(sa[category_tau(x)], sb[category_tau(x)]).excludes_zero()]
    assert d["tau"].verdict.startswith("no difference detectable") and by_chance  # the trap is there
    for x in cats:
        assert d[category_tau(x)].verdict == "no verdict: the overall tau has none (10 categories are 10 comparisons)"
    md = render_markdown(c)
    assert "no verdict: the overall tau has none" in md and "Bonferroni" in md
    assert "is better" not in md
    a, b = _null_categories(np.random.default_rng(2), gain=0.5)
    d = compare(["A", "B"], [a, b]).differences[(0, 1)]
    assert d["tau"].verdict == "B is better"
    sa, sb = metric_sums(a.samples, (), cats), metric_sums(b.samples, (), cats)
    for x in cats:
        want = paired_difference(sa[category_tau(x)], sb[category_tau(x)], level=1 - 0.05 / 10)
        got = d[category_tau(x)]
        assert (got.interval.low, got.interval.high) == (want.low, want.high)
        assert got.verdict.endswith("(Bonferroni over 10 categories: 99.5% interval)"), got.verdict
    assert "[99.5%]" in render_markdown(compare(["A", "B"], [a, b]))
    assert "\n".join(line for line in render_markdown(c).splitlines() if "By position" in line)  # the tables stay


def test_a_negative_seed_is_one_line(two_results, tmp_path, capsys):
    a, b = two_results
    err = _one_line_refusal(capsys, tmp_path / "cmp", str(a), str(b), "--seed", "-1")
    assert "--seed -1: expected an integer >= 0" in err


def test_the_same_file_twice_is_refused_and_labels_are_told_apart(two_results, tmp_path, capsys, monkeypatch):
    """The same file compared with itself says so (it used to print ``/first - /first``); files of one name in
    other folders get the shortest path that tells them apart, never a label starting with '/'."""
    a, _ = two_results
    monkeypatch.chdir(a.parent)
    err = _one_line_refusal(capsys, tmp_path / "cmp", a.name, a.name)
    assert f"{a.name} is given twice" in err and "two different results files" in err
    err = _one_line_refusal(capsys, tmp_path / "cmp", a.name, str(a))
    assert "given twice" in err
    for sub in ("x/run", "y/run"):
        (tmp_path / sub).mkdir(parents=True)
        shutil.copy(a, tmp_path / sub / "first.json")
    code, out, err = _run_here(capsys, str(tmp_path / "x/run/first.json"), str(tmp_path / "y/run/first.json"),
                               "--out", str(tmp_path / "cmp"))
    assert code == 0 and "**y/run/first - x/run/first = +0.000" in out, err
    code, out, err = _run_here(capsys, a.name, str(tmp_path / "x/run/first.json"), "--out", str(tmp_path / "cmp"))
    assert code == 0 and "**run/first - first = +0.000" in out, (out[:400], err)


def test_published_figures_per_category_stand_beside_that_category_or_the_overall_figure(two_results, tmp_path,
                                                                                          capsys):
    """A published per-benchmark request mean stands beside the evaluations' request mean of that category where
    the prompts have it, and beside their request mean over all prompts (said so) where they do not."""
    import yaml

    from dflash_cb.core.figures.metrics import TAU_REQUEST_MEAN

    a, b = two_results
    pub = tmp_path / "pub.yaml"
    pub.write_text(yaml.safe_dump({"entries": [{"name": "authors", "source": "TEST DATA", "convention": "request_mean",
                                                "metrics": {"category/code/tau": 6.0, "category/gsm8k/tau": 6.55}}]}))
    code, out, err = _run_here(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"), "--published", str(pub))
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| authors |")]
    ra, rb = load_results(a), load_results(b)
    code_row = next(r for r in rows if "code" in r)
    assert "| tau, code, mean over requests (dflash.benchmark) | 6.000 |" in code_row
    assert all(f"{r.metric('category/code/tau_request_mean'):.3f} [" in code_row for r in (ra, rb))
    gsm = next(r for r in rows if "gsm8k" in r)
    assert "| tau, gsm8k, mean over requests (dflash.benchmark) | 6.550 |" in gsm
    assert all(f"{r.metric(TAU_REQUEST_MEAN):.3f} [" in gsm for r in (ra, rb)) and gsm.count("(all prompts)") == 2


def test_the_sweep_and_compare_results_judge_one_pair_by_one_rule(tmp_path, capsys):
    """The issue's case: ten categories, no difference anywhere, and two categories' means over requests miss
    zero by chance at 95% while the overall tau has no verdict. The sweep's best-vs-last table once gave those
    rows "best is better"; now neither tool gives a category a verdict the headline lacks, and on the same two
    files both show the same rows with the same intervals and verdicts."""
    from dflash_cb.core.figures.bootstrap import metric_sums, paired_difference
    from dflash_cb.core.figures.metrics import category_tau_request_mean
    from dflash_cb.core.results import sweep_report
    from dflash_cb.core.results.sweep_record import SweepEntry, SweepRecord

    cats = [f"c{i}" for i in range(10)]
    last, best = _null_categories(np.random.default_rng(2))
    sa, sb = metric_sums(last.samples, (), cats), metric_sums(best.samples, (), cats)
    trap = [x for x in cats if paired_difference(sa[category_tau_request_mean(x)],
                                                 sb[category_tau_request_mean(x)]).excludes_zero()]
    assert trap and not paired_difference(sa["tau"], sb["tau"]).excludes_zero()  # the case is there
    write_results(last, tmp_path / "last.json")
    write_results(best, tmp_path / "best.json")
    entries = [SweepEntry(str(tmp_path / f"step_{s}.pt"), "plain", s, "name", [], name, {"tau": tau}, {})
               for s, name, tau in ((4, "best.json", 2.0), (8, "last.json", 1.0))]
    record = SweepRecord({}, entries)
    comparison = sweep_report.best_vs_last(record, tmp_path)
    d = comparison.differences[(0, 1)]
    assert all(x.verdict.startswith("no verdict: the overall tau has none") for k, x in d.items()
               if k.startswith("category/"))  # the request means too
    sweep_md = sweep_report.render_markdown(record, comparison, plot=None)
    assert run(main, [str(tmp_path / "last.json"), str(tmp_path / "best.json"), "--labels",
                      "last (step 8),best (step 4)", "--out", str(tmp_path / "cmp")]) == 0
    capsys.readouterr()
    compare_md = (tmp_path / "cmp.md").read_text()
    rows = difference_rows(sweep_md, "### Best minus last")
    assert rows == difference_rows(compare_md, "### Paired differences") and len(rows) == 1 + 2 + 10
    assert "is better" not in sweep_md and "is better" not in compare_md
    assert "Bonferroni-corrected for 10 comparisons" in sweep_md


# -- a cache's identity is its content -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def caches_in_two_folders(tiny_drafter_config, tmp_path_factory) -> dict[str, Path]:
    """One tiny cache built twice, its target saved in ``demo_out/target`` and in ``demo2_out/target`` (the same
    checkpoint, two folders), one built with other settings, and one results file of the same drafter on each."""
    from tiny_target import build_tiny_cache

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    root = tmp_path_factory.mktemp("identity")
    out = {"a": build_tiny_cache(root / "demo_out"), "b": build_tiny_cache(root / "demo2_out"),
           "other": build_tiny_cache(root / "other_out", max_new_tokens=16)}
    for name in ("a", "b", "other"):
        cache = StateCache(out[name])
        torch.manual_seed(0)
        report = evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(), budgets=[4])
        out[f"{name}.json"] = root / f"{name}.json"
        write_results(report_to_results(report, cache, meta={"drafter": {"path": "d", "kind": "folder"}}),
                      out[f"{name}.json"])
    return out


def test_the_same_cache_built_in_two_folders_compares_and_serves_as_a_baseline(caches_in_two_folders, tmp_path,
                                                                                capsys):
    """The two manifests differ only in the target's path (so in their file hash); by content they are one cache:
    compare_results compares them and a results file of one is a baseline on the other."""
    from dflash_cb.cache.states import StateCache

    c = caches_in_two_folders
    a, b = StateCache(c["a"]), StateCache(c["b"])
    assert a.manifest.target["name_or_path"] != b.manifest.target["name_or_path"]
    assert a.manifest_sha256 != b.manifest_sha256 and a.content_sha256 == b.content_sha256
    code, out, err = _run_here(capsys, str(c["a.json"]), str(c["b.json"]), "--labels", "demo,demo2",
                               "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    n = len(a)
    assert f"demo2 - demo = +0.000 [+0.000, +0.000]**: no difference detectable with {n} prompts" in out
    assert load_results(c["a.json"], b).manifest_sha256 == a.manifest_sha256  # a baseline across folders


def test_caches_that_really_differ_are_refused_naming_the_field(caches_in_two_folders, tmp_path, capsys):
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.results_file import ResultsError

    c = caches_in_two_folders
    code, _, err = _run_here(capsys, str(c["a.json"]), str(c["other.json"]), "--out", str(tmp_path / "cmp"))
    assert code == 2 and "the caches differ in " in err and "reference.max_new_tokens" in err, err
    assert "not comparable" in err and "demo_out" in err and "other_out" in err
    with pytest.raises(ResultsError, match=r"the caches differ in .*reference\.max_new_tokens"):
        load_results(c["other.json"], StateCache(c["a"]))


def test_results_written_before_the_identity_still_compare_by_the_manifest_hash(caches_in_two_folders, tmp_path,
                                                                                capsys):
    """A results file without ``cache_content_sha256`` (written before it was recorded) is compared by the
    manifest's hash, as before: against a file of the same cache it compares, against the same content built
    elsewhere it is refused with the fix (score it again)."""
    c = caches_in_two_folders
    data = json.loads(c["a.json"].read_text())
    for key in ("cache_content_sha256", "cache_identity"):
        del data["meta"][key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    code, _, err = _run_here(capsys, str(old), str(c["a.json"]), "--out", str(tmp_path / "same"))
    assert code == 0, err
    code, _, err = _run_here(capsys, str(old), str(c["b.json"]), "--out", str(tmp_path / "elsewhere"))
    assert code == 2 and "written before dflash-cb recorded the cache's content identity" in err, err


def test_a_results_file_reads_back_as_written_one_sample_a_line(two_results) -> None:
    """results.json: the figures indented, each sample on a line of its own; it reads back to what was written."""
    import json

    from dflash_cb.core.results.results_file import results_text

    a, _ = two_results
    text = a.read_text()
    res = load_results(a)
    assert json.loads(text) == res.to_dict() and results_text(res.to_dict()) == text
    lines = text.splitlines()
    first = lines.index(' "samples": [')
    assert [json.loads(line.rstrip(",")) for line in lines[first + 1:-2]] == [s.to_dict() for s in res.samples]
    assert lines[-2:] == [" ]", "}"] and len(res.samples) > 1
    assert '\n "metrics": {\n  "' in text  # the figures stay one a line


def _as_chain(src: Path, dst: Path, k: int) -> Path:
    """``src`` as a chain drafter's file would be: the MTP head at K = ``k`` (a block of K + 1), no DDTree."""
    def edit(data: dict) -> None:
        data["meta"].update(drafter_family="mtp", block_size=k + 1, ddtree_budgets=[])
        data["metrics"] = {m: v for m, v in data["metrics"].items() if not m.startswith("ddtree/")}
        for s in data["samples"]:
            s["ddtree"] = {}

    return _edited(src, dst, edit)


def test_a_chain_drafter_beside_block_drafters_keeps_their_ddtree_rows(two_results, tmp_path, capsys, monkeypatch):
    """A DDTree budget some files lack is a row with "n/a" where a file lacks it (as a family's walks are), not a
    row dropped for every file; the paired difference on it is between the files that have it; a chain drafter
    is named by its family and K, not by its block. In the plot's tau by position, the cycle counts of three
    evaluations at one point do not overlap."""
    from drawn import overlapping, saved_figures

    figures = saved_figures(monkeypatch)
    a, b = two_results
    mtp = _as_chain(a, tmp_path / "mtp.json", 1)
    code, out, err = _run_here(capsys, str(a), str(b), str(mtp), "--labels", "dflash,dflash2,mtp-k1", "--out",
                               str(tmp_path / "cmp"), "--resamples", "200")
    assert code == 0, err
    md = (tmp_path / "cmp.md").read_text()
    for budget in (4, 8):
        row = next(line for line in md.splitlines() if line.startswith(f"| DDTree tau, budget {budget} |"))
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells[2] == "n/a" and all(c != "n/a" and c[0].isdigit() for c in cells[:2]), row
        assert f"| dflash2 - dflash | DDTree tau, budget {budget} |" in md
        assert f"| mtp-k1 - dflash | DDTree tau, budget {budget} |" not in md
    evaluations = md.split("### Evaluations", 1)[1]
    assert "mtp-k1: drafter" in evaluations and "MTP, K = 1 (block 2)" in evaluations
    assert "block 2," not in evaluations
    by_position = figures[0].axes[2]
    assert by_position.get_title() == "tau by position" and len(by_position.texts) == 9
    assert not overlapping(list(by_position.texts), figures[0])
