"""Paired comparison of evaluations: tools/compare_results.py as a user runs it, and the verdict logic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_cb.cli import run
from dflash_cb.compare import compare, delta_metrics, main, render_markdown
from dflash_cb.results import Results, SampleRecord, load_results, report_to_results, write_results

ROOT = Path(__file__).resolve().parents[1]
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
    from dflash_cb.engine import evaluate
    from dflash_cb.model import DFlashDrafter
    from dflash_cb.states import StateCache

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


def test_tool_writes_markdown_and_png(two_results, tmp_path):
    a, b = two_results
    proc = _run(str(a), str(b), "--out", str(tmp_path / "cmp"), "--resamples", "300")
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "cmp.md").read_text()
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ra, rb = load_results(a), load_results(b)
    assert f"**second - first = {rb.tau - ra.tau:+.3f} [" in md
    assert "| tau (pooled over cycles) |" in md and "DDTree tau, budget 8" in md and "tau, code" in md
    assert "### By position in the completion" in md and "| 0_256 |" in md and "| 4plus |" in md
    assert "global step 2" in md and md in proc.stdout


def test_published_figures_sit_beside_their_own_convention(two_results, tmp_path, capsys):
    """Issue 15 item 2: a published figure is listed only beside the live figure of its declared convention."""
    import yaml

    from dflash_cb.metrics import ACCEPT_LENGTH_SERVED, TAU_REQUEST_MEAN, ci_high, ci_low

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


def test_files_from_different_caches_are_refused_naming_both_hashes(two_results, tmp_path, capsys):
    a, b = two_results
    data = json.loads(b.read_text())
    data["meta"]["cache_manifest_sha256"] = "ab" * 32
    (tmp_path / "other.json").write_text(json.dumps(data))
    code, _, err = _run_here(capsys, str(a), str(tmp_path / "other.json"), "--out", str(tmp_path / "x"))
    assert code == 2
    mine = load_results(a).manifest_sha256[:12]
    assert err.startswith("error: ") and mine in err and "abababababab" in err
    assert "not comparable" in err and not (tmp_path / "x.md").exists()
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
    from dflash_cb.baselines import load_measured
    from dflash_cb.states import StateCache

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
