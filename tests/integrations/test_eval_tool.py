"""tools/eval_drafter.py as a user runs it (``run(main)``): bad input is one line naming the file and
the fix, exit code 2, found before the evaluation; a damaged cache or a wrong target never gives a
number."""

from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path

import pytest
import torch

from dflash_cb.cache.selection import select_sample_ids
from dflash_cb.cache.states import StateCache
from dflash_cb.common.cli import run

ROOT = Path(__file__).resolve().parents[2]


from dflash_cb.integrations.cli import eval_drafter as TOOL  # noqa: E402  (the code behind tools/eval_drafter.py)


def evaluate_tool(capsys: pytest.CaptureFixture, cache: Path, drafter: Path, out: Path, *extra: str,
                  budgets: str = "4") -> tuple[int, str, str]:
    code = run(TOOL.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                           "--ddtree-budgets", budgets, "--device", "cpu", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "tau (greedy replay)" not in out  # nothing was evaluated
    for n in needles:
        assert n in err, (n, err)


def test_out_is_checked_before_any_work(tiny_cache, drafter_dir, tmp_path, capsys):
    """An existing folder, a path under a file, an unwritable place: refused first."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, needle in ((tmp_path, "is a folder"), (a_file / "sub.json", "is a file, not a folder"),
                        (Path("/proc/x.json"), "cannot write there")):
        code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, out)
        assert_one_line(code, so, se, f"--out {out}", needle)
    # Checked before the cache is even opened.
    code, so, se = evaluate_tool(capsys, tmp_path / "no_cache", drafter_dir, tmp_path)
    assert_one_line(code, so, se, "--out", "is a folder")


def test_flipped_byte_is_refused_unless_no_verify(tiny_cache, drafter_dir, tmp_path, capsys):
    """A same-size corruption of a shard is found: hashes are checked by default (--no-verify checks sizes)."""
    broken = tmp_path / "cache"
    shutil.copytree(tiny_cache, broken)
    shard = sorted(broken.glob("states-*.safetensors"))[2]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    code, so, se = evaluate_tool(capsys, broken, drafter_dir, tmp_path / "r.json")
    assert_one_line(code, so, se, str(shard), "sha256", "does not match")
    assert not (tmp_path / "r.json").exists()
    code, so, _ = evaluate_tool(capsys, broken, drafter_dir, tmp_path / "r.json", "--no-verify")
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["meta"]["verified"] is False


def test_hand_edited_valid_len_is_refused(tiny_cache, drafter_dir, tmp_path, capsys):
    """Valid_len is recomputed from the stored target_argmax; beyond the sample it is refused
    when the manifest is read (it used to crash)."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["samples"][0]
    real = entry["valid_len"]
    entry["valid_len"] = entry["prompt_len"] + 1 if real > entry["prompt_len"] + 1 else real - 1
    (cache / "manifest.json").write_text(json.dumps(manifest))
    code, so, se = evaluate_tool(capsys, cache, drafter_dir, tmp_path / "r.json")
    assert_one_line(code, so, se, f"the manifest says valid_len {entry['valid_len']}",
                    f"target_argmax gives {real}")
    entry["valid_len"] = entry["prompt_len"] + entry["completion_len"] + 5
    (cache / "manifest.json").write_text(json.dumps(manifest))
    code, so, se = evaluate_tool(capsys, cache, drafter_dir, tmp_path / "r.json")
    assert_one_line(code, so, se, f"valid_len {entry['valid_len']} is outside")


def test_target_is_checked_against_the_cache(tiny_cache, drafter_dir, tmp_path, capsys):
    """An untied target without lm_head.weight, or one of another vocabulary, is refused (never a silent tau
    of 1.0)."""
    from safetensors.torch import load_file, save_file

    target = tiny_cache.parent / "target"
    weights = load_file(str(target / "model.safetensors"))
    no_head = tmp_path / "no_head"
    shutil.copytree(target, no_head)
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(no_head / "model.safetensors"))
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--target", str(no_head))
    assert_one_line(code, so, se, str(no_head / "config.json"), "tie_word_embeddings is false")
    (no_head / "config.json").unlink()  # no config to say so: the cache's manifest knows the target is untied
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--target", str(no_head))
    assert code == 2 and "the cache's target is untied" in se

    other = tmp_path / "other_vocab"
    shutil.copytree(target, other)
    big = {k: (torch.zeros(200, v.shape[1]) if k in ("lm_head.weight", "model.embed_tokens.weight") else v)
           for k, v in weights.items()}
    save_file(big, str(other / "model.safetensors"))
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--target", str(other))
    assert code == 2 and "shape (200, 32), the cache's target is [vocab 128" in se

    # The right target gives the cache-head numbers.
    assert evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "a.json", "--target", str(target))[0] == 0
    assert evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "b.json")[0] == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a["samples"] == b["samples"]


def test_samples_are_positive_stratified_like_the_callback_and_ids_selectable(tiny_cache, drafter_dir, tmp_path,
                                                                             capsys):
    """--samples 0 / -1 are refused; --samples N is the callback's stratified subset;
    --sample-ids picks exactly the given ids."""
    for bad in ("0", "-1", "x"):
        code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--samples", bad)
        assert_one_line(code, so, se, f"--samples {bad!r}", "positive integer")
    cache = StateCache(tiny_cache)
    assert evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--samples", "2")[0] == 0
    got = [s["id"] for s in json.loads((tmp_path / "r.json").read_text())["samples"]]
    assert got == select_sample_ids(cache, num_samples=2, seed=0)  # what DFlashEvalCallback(num_samples=2) scores
    assert sorted(cache.entry(i).category for i in got) == ["chat", "code"]  # not the first two prompts
    assert evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--sample-ids", "p004,p001")[0] == 0
    assert [s["id"] for s in json.loads((tmp_path / "r.json").read_text())["samples"]] == ["p004", "p001"]
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--sample-ids", "p001,nope")
    assert_one_line(code, so, se, "['nope'] are not in the cache")


@pytest.mark.parametrize("option, value, expected", [
    ("--samples", "2.5", "a positive integer"),  # was an argparse usage error, not the shared rule
    ("--ddtree-budgets", "2.7,16", "comma-separated positive integers"),
    ("--sample-ids", " , ", "one or more comma-separated values"),  # was "the list of sample ids is empty"
    ("--sample-seed", "-1", "an integer >= 0"),  # accepted before; the callback's sample_seed refuses it
    ("--anchor-stride", "1.5", "a positive integer"),
    ("--anchor-seed", "-2", "an integer >= 0"),
    ("--position-edges", "0,64,32", "comma-separated integers from 0, strictly increasing"),
])
def test_arguments_follow_the_callbacks_rule(tiny_cache, drafter_dir, tmp_path, capsys, option, value, expected):
    """The tool's numeric and list options are checked by the callback's rule
    (``dflash_cb.common.arguments``): one line ``--option 'value': expected ...``, exit 2, before any work."""
    budgets = value if option == "--ddtree-budgets" else "4"
    extra = () if option == "--ddtree-budgets" else (option, value)
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", *extra, budgets=budgets)
    assert_one_line(code, so, se, f"{option} {value!r}: expected {expected}")
    assert not (tmp_path / "r.json").exists()


def test_user_mistakes_are_one_line_errors(tiny_cache, drafter_dir, tmp_path, capsys):
    """Each of these user mistakes is one line naming the option or file, exit 2 (no traceback)."""
    out = tmp_path / "r.json"
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, out, budgets="0")
    assert_one_line(code, so, se, "--ddtree-budgets '0'", "positive integers")
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, out, "--device", "cuda:99")
    assert_one_line(code, so, se, "--device cuda:99")

    bad_cfg = tmp_path / "bad_cfg"
    shutil.copytree(drafter_dir, bad_cfg)
    (bad_cfg / "config.json").write_text('{"hidden_size": 32,')
    code, so, se = evaluate_tool(capsys, tiny_cache, bad_cfg, out)
    assert_one_line(code, so, se, str(bad_cfg / "config.json"), "not valid JSON")
    (bad_cfg / "config.json").write_text('{"model_type": "llama"}')
    code, so, se = evaluate_tool(capsys, tiny_cache, bad_cfg, out)
    assert_one_line(code, so, se, str(bad_cfg / "config.json"), "not a drafter config")

    truncated = tmp_path / "truncated"
    shutil.copytree(drafter_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, so, se = evaluate_tool(capsys, tiny_cache, truncated, out)
    assert_one_line(code, so, se, str(weights), "truncated")

    for damage in ("deleted shard", "truncated shard", "corrupted head"):
        cache = tmp_path / damage.replace(" ", "_")
        shutil.copytree(tiny_cache, cache)
        shard = sorted(cache.glob("states-*.safetensors"))[0]
        if damage == "deleted shard":
            shard.unlink()
            needle = "shard missing"
        elif damage == "truncated shard":
            shard.write_bytes(shard.read_bytes()[:-7])
            needle = "truncated?"
        else:
            head = cache / "target_head.safetensors"
            head.write_bytes(b"\0" * head.stat().st_size)
            needle = "target_head.safetensors: sha256 does not match"
        code, so, se = evaluate_tool(capsys, cache, drafter_dir, out)
        assert_one_line(code, so, se, needle)
        if damage == "corrupted head":  # without hashes, the reader names the file instead of crashing
            code, so, se = evaluate_tool(capsys, cache, drafter_dir, out, "--no-verify")
            assert_one_line(code, so, se, "target_head.safetensors: cannot read the target head")


def test_baseline_from_another_cache_suggests_a_runnable_command(tiny_cache, drafter_dir, tmp_path, capsys):
    """The suggested eval_drafter.py command is complete (it carries the required --drafter)."""
    from dflash_cb.core.results.results_file import load_results

    baseline = tmp_path / "baseline.json"
    assert evaluate_tool(capsys, tiny_cache, drafter_dir, baseline)[0] == 0
    data = json.loads(baseline.read_text())
    data["meta"]["cache_manifest_sha256"] = data["meta"]["cache_content_sha256"] = "0" * 64
    baseline.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not comparable") as exc:
        load_results(baseline, StateCache(tiny_cache))
    command = str(exc.value).split("rerun ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "tools/eval_drafter.py"] and "--drafter" in argv
    assert run(TOOL.main, argv[2:] + ["--ddtree-budgets", "4", "--device", "cpu"]) == 0
    assert load_results(baseline, StateCache(tiny_cache)).meta["drafter"]["path"] == str(drafter_dir.resolve())


def test_bf16_evaluation_holds_no_float32_head(tiny_cache, drafter_dir, tmp_path, capsys, monkeypatch):
    """``--dtype bfloat16`` with the cache's float32 head: the head reaches the engine in
    bfloat16, no operation allocates a float32 tensor of the head's size (no float32 copy) and no
    head-sized tensor is made beyond the two bf16 matrices themselves (no transient second copy, no
    per-call autocast cast); the summary says the head ran in bfloat16."""
    from allocations import Allocations

    from dflash_cb.core import replay as engine  # the one door the tools import evaluate from

    m = StateCache(tiny_cache).manifest
    assert m.target_head["dtype"] == "float32"
    heads = []
    evaluate = engine.evaluate
    monkeypatch.setattr(engine, "evaluate", lambda cache, drafter, head, *a, **k: heads.append(head) or
                        evaluate(cache, drafter, head, *a, **k))
    shapes = {(m.vocab_size, m.hidden_size), (m.hidden_size, m.vocab_size)}  # the head or its transpose
    with Allocations(lambda t: tuple(t.shape) in shapes) as seen:
        code, out, err = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--dtype", "bfloat16")
    assert code == 0, err
    assert [h.lm_head.dtype for h in heads] == [torch.bfloat16] and heads[0].embed_tokens.dtype == torch.bfloat16
    # Only the two destinations of the chunked read (embedding, head), filled in place; nothing else.
    made = [s for s in seen.seen if s[0] != "aten.copy_.default"]
    assert [(s[0], s[2]) for s in made] == [("aten.empty.memory_format", torch.bfloat16)] * 2, seen.seen
    assert "head=bfloat16" in out
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["head_dtype"] == "bfloat16"


@pytest.mark.e2e
def test_wandb_run_records_the_drafter_cache_and_settings_and_can_be_shown(tiny_cache, drafter_dir, tmp_path,
                                                                             capsys, monkeypatch):
    """``--wandb-project`` (offline): the run's config names the drafter, the cache's hash and the settings,
    and the printed command shows the run's series without network."""
    from dflash_cb.integrations.tracking import panels
    from dflash_cb.integrations.tracking.wandb_offline import offline_config, offline_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    code, out, err = evaluate_tool(capsys, tiny_cache, drafter_dir, tmp_path / "r.json", "--wandb-project", "p",
                                   "--anchor-stride", "3", "--tail-blocks", "reference")
    assert code == 0, err
    command = next(ln for ln in out.splitlines() if ln.startswith("logged to W&B")).split("see it with ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "tools/wandb_panels.py"]
    run_dir = argv[argv.index("--run") + 1]
    # W&B's own service writes the run's file; on a loaded machine its last records can land after the tool
    # returns: read once they are there (a deadline, not a measurement).
    def written() -> bool:
        kinds = {r.WhichOneof("record_type") for r in offline_records(run_dir)}
        return "dflash_eval" in offline_config(run_dir) and "history" in kinds

    deadline = time.monotonic() + 60
    while not written() and time.monotonic() < deadline:
        time.sleep(0.2)
    config = offline_config(run_dir)["dflash_eval"]
    results = json.loads((tmp_path / "r.json").read_text())
    assert config["drafter"]["path"] == results["meta"]["drafter"]["path"] == str(drafter_dir)
    assert config["cache_manifest_sha256"] == StateCache(tiny_cache).manifest_sha256
    assert config["anchor_stride"] == 3 and config["tail_blocks"] == "reference" and config["dtype"] == "float32"
    assert panels.main(argv[2:]) == 0
    shown = capsys.readouterr().out
    assert "config dflash_eval:" in shown and str(drafter_dir) in shown
    # The series row of step 0 (the list of every logged key follows the series table).
    assert ["0", f"{results['metrics']['tau']:.4f}"] in [ln.split()[:2] for ln in shown.splitlines()]


def test_strided_statistics_equal_evaluate_and_record_their_offsets(tiny_cache, drafter_dir, tmp_path, capsys):
    """--anchor-stride / --anchor-seed give what ``evaluate`` gives with the same arguments (as the callback
    calls it); results.json holds the seed and each sample's offset; the summary prints the seed and the
    anchor statistics with their intervals. A stride past most completions warns once, naming it."""
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.figures.metrics import ALL_ANCHOR_TAU, SPECFORGE_ACC, ci_high, ci_low, depth_acc
    from dflash_cb.core.replay import evaluate

    out = tmp_path / "r.json"
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, out, "--anchor-stride", "3", "--anchor-seed", "11")
    assert code == 0 and "warning" not in se, se
    assert "statistics stride 3 (per-sample offsets, seed 11)" in so
    raw = json.loads(out.read_text())
    cache = StateCache(tiny_cache)
    report = evaluate(cache, DFlashDrafter.from_pretrained(drafter_dir).eval(), budgets=[4], anchor_stride=3,
                      anchor_seed=11)
    assert raw["meta"]["anchor_seed"] == 11 and raw["meta"]["anchor_stride"] == 3
    assert [x["anchor_statistics"]["3"]["offset"] for x in raw["samples"]] == [s.anchor_offsets[3] for s in report.samples]
    for name in (SPECFORGE_ACC, ALL_ANCHOR_TAU, depth_acc(1)):
        assert raw["metrics"][name] == report.summary[name], name
        assert raw["metrics"][ci_low(name)] <= raw["metrics"][name] <= raw["metrics"][ci_high(name)], name
    code, so, se = evaluate_tool(capsys, tiny_cache, drafter_dir, out, "--anchor-stride", "4096")
    lines = [x for x in se.splitlines() if x.startswith("warning: ")]
    assert code == 0 and len(lines) == 1, se
    n = len(cache.samples)
    assert lines[0].startswith(f"warning: --anchor-stride 4096: {n} of {n} samples have at most 4096 anchors"), lines


def test_a_drafter_folder_as_the_cache_says_which_is_which(tiny_cache, drafter_dir, tmp_path, capsys):
    """``--states <a drafter folder>`` advised creating a cache in the drafter's folder; it says the folder holds
    a drafter and where each goes (a Lightning checkpoint file as the cache likewise)."""
    code, out, err = evaluate_tool(capsys, drafter_dir, drafter_dir, tmp_path / "r.json")
    assert_one_line(code, out, err, f"{drafter_dir}: a drafter folder", "--drafter", "precompute_states.py")
    assert "Create the cache" not in err
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"PK")
    code, out, err = evaluate_tool(capsys, ckpt, drafter_dir, tmp_path / "r.json")
    assert_one_line(code, out, err, f"{ckpt}: a file", "precompute_states.py")


@pytest.mark.e2e
def test_a_closed_stdout_loses_no_results(tiny_cache, drafter_dir, tmp_path):
    """``eval_drafter ... | head``: the reader of stdout goes away before the summary is printed; the results
    are written first, so results.json is complete, and stderr says where they are (exit 0, no traceback)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "r.json"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the tool prints anything
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "eval_drafter.py"), "--states", str(tiny_cache),
                               "--drafter", str(drafter_dir), "--out", str(out), "--ddtree-budgets", "4", "--device",
                               "cpu", "--threads", "1"], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              timeout=600)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"the results are in {out}" in proc.stderr
    assert json.loads(out.read_text())["metrics"]["tau"] >= 1.0
