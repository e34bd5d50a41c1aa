"""The end-to-end CPU demo, in its reduced CI form (``tools/demo.py --quick``), run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "tools" / "demo.py"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(DEMO), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _non_empty(path: Path) -> bool:
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and any(p.is_file() and p.stat().st_size > 0 for p in path.rglob("*"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("demo") / "out with spaces"  # the printed commands must survive a paste
    proc = _run("--quick", "--out", str(out), "--seed", "0")
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, proc


@pytest.mark.e2e
def test_tau_rises_and_every_promised_file_exists(demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, proc = demo
    summary = json.loads((out / "summary.json").read_text())
    for key in ("tau_first", "tau_last", "ddtree_tau_last", "paths"):
        assert key in summary, key
    assert summary["tau_last"] > summary["tau_first"], summary["evaluations"]
    assert summary["ddtree_tau_last"] >= summary["tau_last"]  # a tree holds the greedy chain
    assert len(summary["evaluations"]) >= 3
    # A checkpoint at every evaluation: what dflash-sweep reads to draw the run's curve (the README's command).
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*.ckpt"))
    assert saved == [f"step_{e['step']:06d}.ckpt" for e in summary["evaluations"]]
    promised = ["target", "prompts_train", "prompts_eval", "cache_train", "cache_eval", "drafter_config",
                "checkpoint", "drafter", "results", "metrics_csv", "wandb_run", "plot_tau_over_steps",
                "plot_per_depth_acceptance", "plot_accepted_lengths_hist", "summary"]
    for name in promised:
        path = Path(summary["paths"][name])
        assert _non_empty(path), f"{name}: {path} missing or empty"
    for name, path in summary["paths"].items():
        assert _non_empty(Path(path)), f"{name}: {path} missing or empty"
    for plot in ("plot_tau_over_steps", "plot_per_depth_acceptance", "plot_accepted_lengths_hist"):
        assert Path(summary["paths"][plot]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The W&B run is a real offline run with data in it, the CSV logger got the callback's metrics.
    assert any(Path(summary["paths"]["wandb_run"]).glob("run-*.wandb"))
    assert "dflash_eval/tau" in Path(summary["paths"]["metrics_csv"]).read_text().splitlines()[0]
    # The cache was written by the real precompute tool, with the target's own greedy completions.
    manifest = json.loads((Path(summary["paths"]["cache_eval"]) / "manifest.json").read_text())
    assert manifest["reference"]["kind"] == "local" and manifest["dtype"] == "float32"
    assert {s["category"] for s in manifest["samples"]} == {"count", "repeat", "pairs"}
    # results.json of the extracted drafter equals the callback's last evaluation.
    results = json.loads(Path(summary["paths"]["results"]).read_text())
    assert results["metrics"]["tau"] == pytest.approx(summary["tau_last"], abs=1e-12)
    # The printed table and summary.
    assert "step    tau [95% interval]" in proc.stdout and "first evaluation" in proc.stdout
    # Last vs first checkpoint, paired on the same prompts (tools/compare_results.py): the interval excludes 0.
    fvl = summary["first_vs_last"]
    assert fvl["low"] > 0 and fvl["verdict"].endswith("is better") and fvl["text"] in proc.stdout
    assert fvl["delta"] == pytest.approx(summary["tau_last"] - summary["tau_first"], abs=1e-12)
    assert fvl["text"] in Path(summary["paths"]["comparison_md"]).read_text()
    lo, hi = summary["tau_last_interval"]
    assert lo <= summary["tau_last"] <= hi and lo < hi


@pytest.mark.e2e
def test_a_dflash2_drafter_trains_its_tau_rises_and_the_summary_says_where_it_is_lost(
        tmp_path: Path, demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``--drafter dflash2``: the same pipeline with a DFlash 2 drafter (convolutions, a path selector trained with
    its own loss); its tau rises, the extracted drafter's results equal the callback's last evaluation, and the
    summary prints the selector's diagnosis (unary path, perfect selector, recall, pick given recall)."""
    out = tmp_path / "d2"
    proc = _run("--quick", "--drafter", "dflash2", "--steps", "60", "--eval-every", "30", "--out", str(out), "--seed", "0",
                "--target-from", str(demo[0]))  # the first demo's target and caches: every family on the same states
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter"] == "dflash2" and summary["tau_last"] > summary["tau_first"], summary["evaluations"]
    results = json.loads(Path(summary["paths"]["results"]).read_text())
    assert results["meta"]["drafter_family"] == "dflash2"
    assert results["metrics"]["tau"] == pytest.approx(summary["tau_last"], abs=1e-12)
    m = results["metrics"]
    assert m["selector/oracle_tau"] >= m["tau"] and 0 < m["selector/recall"] <= 1
    assert "training the DFlash 2 drafter" in proc.stdout and "DFlash 2: tau with the selector off (unary argmax)" in proc.stdout
    # Where the selector costs tau (its walk below the unary argmax path), the demo and comparison.md say so.
    costs = m["selector/unary_tau"] > m["tau"]
    assert ("the selector costs tau here" in proc.stdout) == costs
    assert ("the selector costs tau here" in (out / "comparison.md").read_text()) == costs
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]


@pytest.mark.e2e
@pytest.mark.parametrize(("family", "label", "untrained"), [("domino", "Domino", ["embed_proj.*", "prefix_gru.*"]),
                                                             ("dspark", "DSpark", [])])
def test_a_drafter_without_trees_runs_end_to_end_and_says_what_its_training_left_untrained(
        tmp_path: Path, family: str, label: str, untrained: list[str],
        demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``--drafter domino|dspark``: the same pipeline, scored without DDTree (said why in one line, no budget in the
    summary); its tau rises, the extracted drafter's results equal the callback's last evaluation, the head's "off"
    tau is printed, and the parts the demo's objective leaves at their init (Domino's GRU correction; DSpark's
    Markov head has its own loss term) are named in the summary and the output."""
    out = tmp_path / family
    proc = _run("--quick", "--drafter", family, "--steps", "30", "--eval-every", "30", "--out", str(out), "--seed", "0",
                "--target-from", str(demo[0]))
    assert "reused from" in proc.stdout  # the first demo's target and caches, copied byte for byte
    for name in ("target/model.safetensors", "cache/eval/manifest.json", "cache/train/states-00000.safetensors"):
        assert (out / name).read_bytes() == (demo[0] / name).read_bytes(), name
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter"] == family and summary["tau_last"] > summary["tau_first"], summary["evaluations"]
    assert summary["ddtree_budget"] is None and summary["ddtree_tau_last"] is None
    assert not any(k.startswith("ddtree") for e in summary["evaluations"] for k in e)
    assert f"DDTree: not scored (a {label} drafter drafts each depth from its parent token" in proc.stdout
    results = json.loads(Path(summary["paths"]["results"]).read_text())
    assert results["meta"]["drafter_family"] == family and results["meta"]["ddtree_budgets"] == []
    assert results["metrics"]["tau"] == pytest.approx(summary["tau_last"], abs=1e-12)
    off = "correction/off_tau" if family == "domino" else "markov/off_tau"
    assert f"{label}: tau with the" in proc.stdout and results["metrics"][off] is not None
    assert summary["untrained_parts"] == untrained
    assert ("left at their initial weights" in proc.stdout) == bool(untrained)
    for part in untrained:
        assert part in proc.stdout


@pytest.mark.e2e
@pytest.mark.parametrize(("family", "label", "architecture"), [("eagle3", "EAGLE-3", "LlamaForCausalLMEagle3"),
                                                               ("mtp", "MTP", "Qwen3_5MTPDrafter")])
def test_a_chain_drafter_runs_end_to_end(tmp_path: Path, family: str, label: str, architecture: str,
                                        demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``--drafter eagle3|mtp``: a runnable EAGLE-3 route and an MTP route on the CPU demo. The chain drafter trains
    on its first step, its tau rises, it is scored without DDTree (said why), and the extracted drafter (SpecForge's
    or the MTP's config) scores what the callback logged last."""
    out = tmp_path / family
    proc = _run("--quick", "--drafter", family, "--steps", "60", "--eval-every", "30", "--out", str(out), "--seed", "0",
                "--target-from", str(demo[0]))
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter"] == family and summary["tau_last"] > summary["tau_first"], summary["evaluations"]
    assert summary["ddtree_budget"] is None
    assert f"training the {label} drafter (1 layer, K = 7 steps, trained on its first step" in proc.stdout
    assert f"DDTree: not scored (a{'n' if family == 'eagle3' else ''} {label} drafter drafts each depth from its " \
        "parent token" in proc.stdout
    # Its vocabulary mapping (EAGLE-3's d2t, t2d) is no weight: not named as left untrained.
    assert summary["untrained_parts"] == [] and "left at their initial weights" not in proc.stdout
    results = json.loads(Path(summary["paths"]["results"]).read_text())
    assert results["meta"]["drafter_family"] == family and results["meta"]["ddtree_budgets"] == []
    assert results["metrics"]["tau"] == pytest.approx(summary["tau_last"], abs=1e-12)
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["drafter_family"] == family


@pytest.mark.parametrize("family", ["eagle3", "mtp"])
def test_the_chain_drafters_read_layers_the_demo_caches(family: str) -> None:
    """The demo's caches hold layers 0, 1 and 2 of its 3-layer target: the MTP head reads the last one (its
    final-normed state, as a target's own head does), EAGLE-3 three outputs other than the last."""
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.demo.demo import DRAFTERS, DemoConfig, drafter_config
    from dflash_cb.demo.synthetic import TargetSpec

    cfg = DemoConfig.resolve(drafter=family)
    spec = drafter_from_config(drafter_config(cfg)).spec
    last = TargetSpec().num_layers - 1
    assert family in DRAFTERS and set(spec.target_layer_ids) <= set(cfg.layer_ids)
    assert spec.block_size == cfg.block_size and cfg.ddtree_budgets == ()
    assert list(spec.target_layer_ids) == ([last] if family == "mtp" else [0, 1, 1])


@pytest.mark.e2e
def test_printed_commands_paste_into_a_shell(demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    """The follow-up commands are quoted: split as a shell splits them, each path is one argument, and
    the comparison command, run as printed, writes the demo's comparison again, byte for byte."""
    import shlex

    out, proc = demo
    lines = proc.stdout.splitlines()
    sync = next(line for line in lines if "upload later with: " in line).split("upload later with: ")[1]
    assert shlex.split(sync)[:2] == ["wandb", "sync"] and Path(shlex.split(sync)[2]).is_dir()
    caches = [shlex.split(line.strip()) for line in lines if "tools/precompute_states.py --target" in line]
    assert len(caches) == 2 and all(Path(c[c.index("--out") + 1]).parent == out / "cache" for c in caches)
    again = shlex.split(next(line for line in lines if "again: " in line).split("again: ")[1])
    md = (out / "comparison.md").read_bytes()
    (out / "comparison.md").unlink()
    rerun = subprocess.run([sys.executable, *again[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "comparison.md").read_bytes() == md


@pytest.mark.e2e
def test_refuses_to_overwrite_without_flag(demo: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = demo
    before = (out / "summary.json").read_bytes()
    proc = _run("--quick", "--out", str(out), timeout=120)
    assert proc.returncode == 2
    assert "--overwrite" in proc.stderr
    assert (out / "summary.json").read_bytes() == before


@pytest.mark.e2e
def test_never_deletes_a_folder_it_did_not_write(tmp_path: Path) -> None:
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "data.txt").write_text("keep me")
    proc = _run("--quick", "--out", str(foreign), "--overwrite", timeout=120)
    assert proc.returncode == 2
    assert "not written by the demo" in proc.stderr
    assert (foreign / "data.txt").read_text() == "keep me"


def test_synthetic_target_writes_structured_text(tmp_path: Path) -> None:
    """The language itself: deterministic, three families, prompts disjoint from held-out ones."""
    from dflash_cb.demo import synthetic as S

    a = S.make_prompts(5, seed=3, prefix="eval-")
    b = S.make_prompts(5, seed=3, prefix="eval-")
    assert a == b
    train = S.make_prompts(20, seed=3, prefix="train-", exclude=[r["input_ids"] for r in a])
    assert not {tuple(r["input_ids"]) for r in a} & {tuple(r["input_ids"]) for r in train}
    assert {r["category"] for r in a} == set(S.FAMILIES)
    for r in a:
        done = S.expected_completion(r["input_ids"])
        assert done[-1] == S.EOS and len(set(done)) >= 3
        assert S.MASK_TOKEN_ID not in r["input_ids"] + done


def test_target_from_refuses_other_settings_before_writing_anything(
        tmp_path: Path, demo: tuple[Path, subprocess.CompletedProcess], capsys) -> None:
    """``--target-from DIR``: another seed or --quick than DIR's is refused in one line before anything is written
    (the target and caches depend on them); a folder that is no finished demo likewise. (A reusing run trains on
    copies of DIR's states: the family tests above run that way and check the copies.)"""
    from dflash_cb.demo.demo import main

    src, _ = demo
    for args, words in ((["--quick", "--seed", "1"], "seed 0 there, 1 here"), (["--seed", "0"], "quick True there"),
                        (["--quick", "--seed", "0", "--target-from", str(tmp_path)], "not a finished demo")):
        out = tmp_path / "refused"
        argv = [*args, "--out", str(out)] + ([] if "--target-from" in args else ["--target-from", str(src)])
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
