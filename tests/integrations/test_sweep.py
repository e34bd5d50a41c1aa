"""``tools/sweep_checkpoints.py`` (``dflash-sweep``) on real training runs' checkpoint folders.

Claims: every entry of a sweep equals ``tools/eval_drafter.py`` on the folder ``tools/extract_drafter.py`` makes of
that checkpoint (a plain loop's ``torch.save``, Lightning's ``ModelCheckpoint``, a Hugging Face ``Trainer``'s
``checkpoint-N/``; a SpecForge checkpoint equals the tool on SpecForge's own export), in step order, with the
step from the checkpoint (else its name) and the best by tau; the cache is opened and hashed once per sweep, a
second run scores only what is new or written again, a killed sweep resumes without scoring again, a damaged
checkpoint among good ones is reported and skipped; ``--watch`` scores checkpoints as another process writes them
(never one half written) and Ctrl-C ends it with the sweep written; the W&B run holds the live evaluation's keys
against its step axis and the panels tool reads it; two gloo ranks share the checkpoints and give one process's
numbers; bad arguments are one line, exit 2, before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from markdown_tables import difference_rows
from processes import run_ranks, sigkill_when
from tiny_target import TINY_LAYER_IDS

from dflash_cb.common.cli import run
from dflash_cb.integrations.cli import eval_drafter as eval_cli
from dflash_cb.integrations.cli import extract as extract_cli
from dflash_cb.integrations.cli import sweep_cli

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ["--ddtree-budgets", "4,8", "--device", "cpu", "--dtype", "float32"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def sweep(cache: Path, out: Path, *paths: Any, extra: tuple[str, ...] = ()) -> int:
    """The tool as a user runs it (``run(main)``: user errors are one line and exit code 2)."""
    return run(sweep_cli.main, [*map(str, paths), "--states", str(cache), "--out", str(out), *OPTIONS, *extra])


def record(out: Path) -> dict[str, Any]:
    return json.loads((out / "sweep.json").read_text())


def figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """An entry's metrics but its wall time."""
    return {k: v for k, v in metrics.items() if k != "eval_time_s"}


def tool_results(cache: Path, checkpoint: Path, work: Path, config: Path | None = None) -> dict[str, Any]:
    """The oracle: ``tools/extract_drafter.py`` on the checkpoint, then ``tools/eval_drafter.py`` on its folder."""
    folder = work / f"extracted_{checkpoint.name}"
    assert run(extract_cli.main, ["--ckpt", str(checkpoint), "--out", str(folder),
                                  *(["--config", str(config)] if config else [])]) == 0
    return eval_results(cache, folder, work / f"tool_{checkpoint.name}.json")


def eval_results(cache: Path, drafter: Path, out: Path) -> dict[str, Any]:
    assert run(eval_cli.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out), *OPTIONS]) == 0
    return json.loads(out.read_text())


def assert_same_numbers(ours: dict[str, Any], theirs: dict[str, Any], where: Any) -> None:
    """Every figure of two results files (metrics, per-sample lengths, per-depth, histogram, breakdowns)."""
    assert ours["metrics"] == theirs["metrics"], where
    assert ours["samples"] == theirs["samples"], where
    for k in ("per_depth", "histogram", "breakdown"):
        assert ours[k] == theirs[k], (where, k)


def assert_entries_equal_the_tool(cache: Path, out: Path, checkpoints: dict[int, Path], work: Path,
                                  config: Path | None = None) -> dict[str, Any]:
    rec = record(out)
    assert [e["step"] for e in rec["entries"]] == sorted(checkpoints)
    for e in rec["entries"]:
        assert e["checkpoint"] == str(checkpoints[e["step"]].resolve()), e["checkpoint"]
        ours = json.loads((out / e["results"]).read_text())
        assert_same_numbers(ours, tool_results(cache, checkpoints[e["step"]], work, config), e["step"])
        assert e["metrics"]["tau"] == ours["metrics"]["tau"]
    taus = {e["step"]: e["metrics"]["tau"] for e in rec["entries"]}
    assert rec["best"]["step"] == min(s for s, t in taus.items() if t == max(taus.values()))
    return rec


# -- real training runs --------------------------------------------------------------------------------

def plain_loop(folder: Path, cache: Path, cfg: dict, steps: int, every: int = 1) -> dict:
    """The hand-written training loop of ``tests/integrations/test_loops.py`` (its evaluator switched off: a run trained without
    the evaluation), its checkpoint ``{"step", "drafter", "optimizer", "evaluator"}`` of every ``every``-th step
    written with ``torch.save`` as ``step_N.pt``; returns {step: file}."""
    from test_loops import plain_loop as train

    _, _, states = train(str(cache), cfg, steps=steps, every=0, eval_on_fit_start=False, eval_on_fit_end=False)
    folder.mkdir(parents=True, exist_ok=True)
    saved = {}
    for step, state in states.items():
        if step % every == 0:
            saved[step] = folder / f"step_{step}.pt"
            torch.save(state, saved[step])
    return saved


@pytest.fixture(scope="module")
def drafter_json(tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "drafter.json"
    path.write_text(json.dumps(tiny_drafter_config))
    return path


@pytest.fixture(scope="module")
def plain_run(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return plain_loop(tmp_path_factory.mktemp("plain") / "ckpts", tiny_cache, tiny_drafter_config, steps=6, every=2)


@pytest.fixture(scope="module")
def lightning_run(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning's ModelCheckpoint every 2 steps (every one kept, and last.ckpt) over 6 steps of the demo module."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_runs import fit

    root = tmp_path_factory.mktemp("lightning")
    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1, save_last=True)
    fit(root, tiny_drafter_config, tiny_cache, [ckpt], max_steps=6, checkpointing=True)
    return root


@pytest.fixture(scope="module")
def hf_run(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Trainer saving checkpoint-N/ every 2 of 6 steps, then its final model in the output folder."""
    from test_loops import DraftTraining
    from transformers import Trainer, TrainingArguments

    from dflash_cb.demo.lightning_module import CachedStatesDataset

    out = tmp_path_factory.mktemp("hf") / "hf_out"
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2,
                             lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="steps",
                             save_steps=2, logging_strategy="no", disable_tqdm=True, seed=0,
                             remove_unused_columns=False, dataloader_num_workers=0)
    trainer = Trainer(model=DraftTraining(tiny_drafter_config, str(tiny_cache)), args=args,
                      train_dataset=CachedStatesDataset(str(tiny_cache)), data_collator=lambda b: {"samples": b})
    trainer.train()
    trainer.save_model()  # the output folder's own weights: a copy of the last step, not a checkpoint to score
    return out


# -- the numbers -----------------------------------------------------------------------------------------

def test_plain_loop_entries_equal_the_tools_in_step_order(tiny_cache, plain_run, drafter_json, tmp_path, capsys,
                                                         monkeypatch):
    """Three ``torch.save`` checkpoints: three entries equal to extract + eval; the shards hashed once for all."""
    from dflash_cb.cache import integrity

    hashed: list[str] = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: hashed.append(Path(p).name) or real(p, *a, **k))
    integrity.VERIFIED.clear()
    folder = next(iter(plain_run.values())).parent
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=("--config", str(drafter_json))) == 0
    out = capsys.readouterr().out
    assert sorted(hashed) == sorted({*hashed}) and hashed  # every file once, for the whole sweep
    rec = assert_entries_equal_the_tool(tiny_cache, tmp_path / "sweep", plain_run, tmp_path, drafter_json)
    assert [e["step_from"] for e in rec["entries"]] == ["checkpoint"] * 3  # the loop's "step" entry
    assert rec["settings"]["cache_manifest_sha256"] and rec["settings"]["series"]["block_size"] == 6
    for e in rec["entries"]:  # one console line per checkpoint: step, tau with its interval, DDTree, best so far
        assert f"step {e['step']}: tau {e['metrics']['tau']:.3f} [" in out
    assert "best: step" in out.splitlines()[0]
    report = (tmp_path / "sweep" / "sweep.md").read_text()
    assert f"**best: step {rec['best']['step']}**" in report and "![tau over the checkpoints](sweep.png)" in report
    assert (tmp_path / "sweep" / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_dflash2_checkpoints_equal_the_tools(tiny_cache, tiny_drafter_config, tmp_path):
    """A plain loop's checkpoints of a DFlash 2 drafter (the live module's state dict, codebooks as embeddings, and
    its config in the checkpoint): scored by its selector's walk, as eval_drafter scores the extracted folder."""
    from test_dflash2 import SELECTOR

    from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter

    cfg = {**tiny_drafter_config, "architectures": ["DFlash2DraftModel"],
           "dflash_config": {**tiny_drafter_config["dflash_config"], **SELECTOR}}
    folder = tmp_path / "ckpts"
    folder.mkdir()
    torch.manual_seed(0)
    drafter = DFlash2Drafter.from_config_dict(cfg)
    saved = {}
    for step in (10, 20):
        with torch.no_grad():  # a selector that matters, other weights at each step
            for p in drafter.codebooks:
                p.normal_(std=0.7)
            drafter.candidate_selector.hidden_projection.weight.normal_(std=0.15)
        saved[step] = folder / f"step_{step}.pt"
        torch.save({"step": step, "model": drafter.state_dict(), "drafter_config": cfg}, saved[step])
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 0
    rec = assert_entries_equal_the_tool(tiny_cache, tmp_path / "sweep", saved, tmp_path)
    assert {json.loads((tmp_path / "sweep" / e["results"]).read_text())["meta"]["drafter_family"]
            for e in rec["entries"]} == {"dflash2"}
    # sweep.md carries the family's own walks beside tau (the selector off, a perfect selector), per entry.
    report = (tmp_path / "sweep" / "sweep.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| step |"))
    assert "selector/unary_tau" in header and "selector/oracle_tau" in header
    for e in rec["entries"]:
        row = next(line for line in report.splitlines() if line.startswith(f"| {e['step']} |"))
        assert f"{e['metrics']['selector/unary_tau']:.3f} [" in row


def test_when_the_best_is_the_last_the_report_says_what_the_run_gained(tiny_cache, tiny_drafter_config, tmp_path):
    """A fresh drafter at step 10, the same trained at step 20: the best is the last, so sweep.md says best minus
    first with its verdict, and the plot's second panel shows that pair (not left empty)."""
    from tiny_target import train_briefly

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.results import sweep_report
    from dflash_cb.core.results.sweep_record import load_sweep

    folder = tmp_path / "ckpts"
    folder.mkdir()
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    torch.save({"step": 10, "model": drafter.state_dict(), "drafter_config": tiny_drafter_config}, folder / "a.pt")
    train_briefly(drafter, StateCache(tiny_cache), epochs=8)
    torch.save({"step": 20, "model": drafter.state_dict(), "drafter_config": tiny_drafter_config}, folder / "b.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 0
    record = load_sweep(tmp_path / "sweep")
    assert record.best is record.entries[-1] and record.best.tau > record.entries[0].tau
    gained = sweep_report.best_vs_first(record, tmp_path / "sweep")
    assert gained is not None and gained.labels == ["first (step 10)", "best (step 20)"]
    report = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "- the best checkpoint is the last one" in report
    assert f"- **{gained.differences[(0, 1)]['tau'].text}**: " in report and "(what the run gained" in report
    assert sweep_report.best_vs_last(record, tmp_path / "sweep") is None


@pytest.mark.e2e
def test_lightning_checkpoints_equal_the_tools(tiny_cache, lightning_run, tmp_path):
    """``epoch=E-step=S.ckpt`` files: the step and config from the checkpoint itself; ``last.ckpt`` is not an entry."""
    ckpts = sorted((lightning_run / "checkpoints").glob("*step=*.ckpt"))
    assert (lightning_run / "checkpoints" / "last.ckpt").is_file() and len(ckpts) == 3
    steps = {torch.load(c, map_location="cpu", weights_only=True)["global_step"]: c for c in ckpts}
    assert sweep(tiny_cache, tmp_path / "sweep", lightning_run) == 0
    rec = assert_entries_equal_the_tool(tiny_cache, tmp_path / "sweep", steps, tmp_path)
    assert sorted(steps) == [2, 4, 6] and {e["step_from"] for e in rec["entries"]} == {"checkpoint"}


@pytest.mark.e2e
def test_hugging_face_checkpoint_folders_equal_the_tools(tiny_cache, hf_run, drafter_json, tmp_path):
    """``checkpoint-N/`` folders (the step from trainer_state.json); the output folder's final model is not one."""
    folders = {int(p.name.split("-")[1]): p for p in hf_run.glob("checkpoint-*")}
    assert sorted(folders) == [2, 4, 6] and (hf_run / "model.safetensors").is_file()
    assert sweep(tiny_cache, tmp_path / "sweep", hf_run, extra=("--config", str(drafter_json))) == 0
    rec = assert_entries_equal_the_tool(tiny_cache, tmp_path / "sweep", folders, tmp_path, drafter_json)
    assert {e["kind"] for e in rec["entries"]} == {"weights folder"}


@pytest.mark.e2e
def test_specforge_checkpoints_equal_the_tool_on_specforges_own_export(tiny_cache, tiny_drafter_config, drafter_json,
                                                                      tmp_path):
    """SpecForge's ``<run>-stepN/`` folders (its ``-latest`` link is not a second entry); each entry equals
    eval_drafter on the folder ``specforge export --to hf`` makes of that checkpoint."""
    import torch.distributed as dist
    from specforge.export.to_hf import export_to_hf
    from test_specforge_loop import RUN, specforge_controller

    from dflash_cb.integrations.loops.specforge_data import train_batches

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        controller, _ = specforge_controller(tiny_cache, tiny_drafter_config, tmp_path / "out", max_steps=4,
                                             save_interval=2)
        controller.fit(train_batches(tiny_cache))
    finally:
        dist.destroy_process_group()
    folders = {int(p.name.rsplit("step", 1)[1]): p for p in (tmp_path / "out").glob(f"{RUN}-step*")}
    assert sorted(folders) == [2, 4] and (tmp_path / "out" / f"{RUN}-latest").is_symlink()
    assert sweep(tiny_cache, tmp_path / "sweep", tmp_path / "out", extra=("--config", str(drafter_json))) == 0
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2, 4] and {e["kind"] for e in rec["entries"]} == {"specforge"}
    for e in rec["entries"]:
        exported = export_to_hf(str(folders[e["step"]]), str(drafter_json), str(tmp_path / f"export_{e['step']}"))
        theirs = eval_results(tiny_cache, Path(exported), tmp_path / f"tool_{e['step']}.json")
        ours = json.loads((tmp_path / "sweep" / e["results"]).read_text())
        assert_same_numbers(ours, theirs, e["step"])
    # tools/extract_drafter.py reads the folder too (its training_state.pt), to the same numbers
    assert_same_numbers(ours, tool_results(tiny_cache, folders[4], tmp_path, drafter_json), "extract_drafter")


# -- resume, damage, kill --------------------------------------------------------------------------------

@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The engine's evaluations, counted (one per checkpoint scored)."""
    from dflash_cb.core import replay as engine  # the one door the tools import evaluate from

    calls: list[int] = []
    real = engine.evaluate

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(engine, "evaluate", counting)
    return calls


def test_a_second_run_scores_only_what_is_new_or_written_again(tiny_cache, plain_run, drafter_json, tmp_path, counted):
    folder = tmp_path / "ckpts"
    shutil.copytree(next(iter(plain_run.values())).parent, folder)
    args = (tiny_cache, tmp_path / "sweep", folder)
    cfg = ("--config", str(drafter_json))
    assert sweep(*args, extra=cfg) == 0 and len(counted) == 3
    first = record(tmp_path / "sweep")
    assert sweep(*args, extra=cfg) == 0 and len(counted) == 3  # nothing new: nothing scored
    assert record(tmp_path / "sweep")["entries"] == first["entries"]
    # A checkpoint written again (SpecForge rewinds a timeline, a copy replaces a file) and a new one.
    shutil.copy(folder / "step_4.pt", tmp_path / "copy.pt")
    os.replace(tmp_path / "copy.pt", folder / "step_4.pt")
    data = torch.load(folder / "step_6.pt", weights_only=True)
    data["step"] = 8
    torch.save(data, folder / "step_8.pt")
    assert sweep(*args, extra=cfg) == 0 and len(counted) == 5
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2, 4, 6, 8]
    assert rec["entries"][1]["identity"] != first["entries"][1]["identity"]
    assert figures(rec["entries"][1]["metrics"]) == figures(first["entries"][1]["metrics"])  # same weights again


def test_a_resume_with_other_options_is_refused_naming_the_option(tiny_cache, plain_run, drafter_json, tmp_path,
                                                                   capsys, counted):
    folder = next(iter(plain_run.values())).parent
    cfg = ("--config", str(drafter_json))
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=cfg) == 0
    capsys.readouterr()
    before = (tmp_path / "sweep" / "sweep.json").read_bytes()
    for extra, option in ((("--anchor-stride", "3"), "--anchor-stride"), (("--tail-blocks", "reference"),
                                                                          "--tail-blocks"),
                          (("--samples", "2"), "--samples"), (("--block-size", "4"), "--block-size")):
        assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=(*cfg, *extra)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {option}") and err.count("\n") == 1, err
        assert str(tmp_path / "sweep" / "sweep.json") in err and "another --out" in err
    assert len(counted) == 3 and (tmp_path / "sweep" / "sweep.json").read_bytes() == before


def test_damaged_checkpoints_are_reported_and_skipped(tiny_cache, plain_run, drafter_json, tmp_path, capsys, counted):
    """A truncated file and a file that is no checkpoint among good ones: both named with why, the others scored."""
    folder = tmp_path / "ckpts"
    shutil.copytree(next(iter(plain_run.values())).parent, folder)
    data = (folder / "step_4.pt").read_bytes()
    (folder / "step_3.pt").write_bytes(data[: len(data) // 2])
    (folder / "step_5.pt").write_text("loss: 0.1\n")
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=("--config", str(drafter_json))) == 0
    err = capsys.readouterr().err
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2, 4, 6] and len(counted) == 3
    failed = {Path(f["checkpoint"]).name: f["error"] for f in rec["failed"]}
    assert sorted(failed) == ["step_3.pt", "step_5.pt"]
    assert "truncated or damaged" in failed["step_3.pt"] and "not a PyTorch checkpoint" in failed["step_5.pt"]
    assert f"{folder / 'step_3.pt'}: not scored: " in err
    report = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "### Not scored" in report and "step_5.pt" in report


def test_a_drafter_that_does_not_fit_the_cache_stops_before_the_cache_is_hashed(tiny_cache, tiny_drafter_config,
                                                                               plain_run, tmp_path, capsys, counted,
                                                                               monkeypatch):
    """Checkpoints of a drafter for other target layers, and checkpoints without a config and no --config: the
    first one read says so (exit 2), nothing is hashed or scored, the others are not read."""
    from dflash_cb.cache import integrity
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    hashed: list[str] = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: hashed.append(Path(p).name) or real(p, *a, **k))
    other = json.loads(json.dumps(tiny_drafter_config))
    other["dflash_config"]["target_layer_ids"] = [i + 1 for i in TINY_LAYER_IDS]  # layers the cache does not hold
    folder = tmp_path / "other"
    folder.mkdir()
    for step in (2, 4):
        torch.save({"step": step, "drafter": DFlashDrafter.from_config_dict(other).state_dict(),
                    "drafter_config": other}, folder / f"step_{step}.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cache {tiny_cache} does not fit the drafter (DFlash): - target_layer_ids") and \
        err.count("\n") == 1, err
    assert sweep(tiny_cache, tmp_path / "sweep2", next(iter(plain_run.values())).parent) == 2
    err = capsys.readouterr().err
    assert "no drafter config stored in the checkpoint" in err and "--config" in err and err.count("\n") == 1, err
    assert hashed == [] and counted == []
    assert record(tmp_path / "sweep")["entries"] == [] and len(record(tmp_path / "sweep")["failed"]) == 0


def test_a_checkpoint_of_another_block_is_reported_and_skipped(tiny_cache, tiny_drafter_config, tmp_path, capsys):
    """Checkpoints carrying their configs, the last one of a drafter with a shorter block: not one series."""
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    folder = tmp_path / "ckpts"
    folder.mkdir()
    for step, block in ((2, 6), (4, 6), (6, 4)):
        cfg = {**tiny_drafter_config, "block_size": block}
        torch.manual_seed(step)
        torch.save({"step": step, "drafter": DFlashDrafter.from_config_dict(cfg).state_dict(), "drafter_config": cfg},
                   folder / f"step_{step}.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 0
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2, 4] and [Path(f["checkpoint"]).name for f in rec["failed"]] == [
        "step_6.pt"]
    assert "drafts blocks of 4, the sweep's entries blocks of 6" in rec["failed"][0]["error"]
    assert "step_6.pt: not scored: its drafter drafts blocks of 4" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_checkpoint_of_another_family_is_reported_and_skipped(tiny_cache, tiny_drafter_config, tmp_path, capsys):
    """A DFlash and a DFlash 2 checkpoint of one block under one folder: one curve is one family's (it drew one)."""
    from test_dflash2 import SELECTOR

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter

    folder = tmp_path / "ckpts"
    folder.mkdir()
    two = {**tiny_drafter_config, "architectures": ["DFlash2DraftModel"],
           "dflash_config": {**tiny_drafter_config["dflash_config"], **SELECTOR}}
    for step, cls, cfg in ((2, DFlashDrafter, tiny_drafter_config), (4, DFlash2Drafter, two)):
        torch.manual_seed(step)
        torch.save({"step": step, "drafter": cls.from_config_dict(cfg).state_dict(), "drafter_config": cfg},
                   folder / f"step_{step}.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 0
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2] and rec["settings"]["series"]["family"] == "dflash"
    assert "a dflash2 drafter, the sweep's entries dflash drafters" in rec["failed"][0]["error"]
    assert "step_4.pt: not scored" in capsys.readouterr().err


def test_the_record_keeps_one_series_and_one_entry_per_step():
    """What two ranks of one wave may bring back (the same step from two files, another block) is refused by the
    record itself; the first entry sets the series; the best is the largest tau, the earliest of equal ones."""
    from dflash_cb.core.results.sweep_record import SweepEntry, SweepRecord

    def entry(path: str, step: int, tau: float, block: int = 6) -> SweepEntry:
        return SweepEntry(path, "file", step, "name", [], f"results/{step}.json", {"tau": tau},
                          {"block_size": block, "tail_blocks": "served", "dtype": "float32", "anchor_stride": 1,
                           "anchor_seed": 0, "family": "dflash"})

    rec = SweepRecord({})
    for e in (entry("/a", 4, 2.0), entry("/b", 2, 2.5), entry("/c", 6, 2.5)):
        assert rec.conflict(e) is None
        rec.add(e)
    assert [e.step for e in rec.entries] == [2, 4, 6] and rec.best.step == 2 and rec.block_size == 6
    assert "step 4 is scored already, from /a" in rec.conflict(entry("/d", 4, 3.0))
    assert "block_size 4 (the sweep's entries: 6)" in rec.conflict(entry("/e", 8, 3.0, block=4))
    other = entry("/f", 10, 3.0)
    other.series["family"] = "dflash2"
    assert "family 'dflash2' (the sweep's entries: 'dflash')" in rec.conflict(other)
    assert rec.conflict(entry("/a", 4, 3.0)) is None  # the same checkpoint written again replaces its entry
    rec.add(entry("/a", 4, 3.0))
    assert len(rec.entries) == 3 and rec.best.checkpoint == "/a"


def test_a_damaged_cache_gives_no_number(tiny_cache, plain_run, drafter_json, tmp_path, capsys, counted):
    """A shard with one byte changed (its size intact) is found by its sha256 when the cache is opened."""
    broken = tmp_path / "cache"
    shutil.copytree(tiny_cache, broken)
    shard = sorted(broken.glob("states-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    folder = next(iter(plain_run.values())).parent
    assert sweep(broken, tmp_path / "sweep", folder, extra=("--config", str(drafter_json))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shard}: sha256") and "does not match" in err and err.count("\n") == 1, err
    assert counted == [] and record(tmp_path / "sweep")["entries"] == []


def test_the_report_compares_the_best_with_the_last(tiny_cache, tiny_drafter_config, plain_run, drafter_json,
                                                     tmp_path):
    """A run whose last checkpoint is worse (its weights reset): the report's paired best-minus-last is
    ``tools/compare_results.py``'s on the two results files."""
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    folder = tmp_path / "ckpts"
    shutil.copytree(next(iter(plain_run.values())).parent, folder)
    torch.manual_seed(99)
    torch.save({"step": 8, "drafter": DFlashDrafter.from_config_dict(tiny_drafter_config).state_dict()},
               folder / "step_8.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=("--config", str(drafter_json))) == 0
    rec = record(tmp_path / "sweep")
    best, last = rec["best"], rec["entries"][-1]
    assert best["step"] != last["step"] == 8
    from dflash_cb.integrations.cli import compare as compare

    assert run(compare.main, [str(tmp_path / "sweep" / last["results"]), str(tmp_path / "sweep" / best["results"]),
                              "--labels", f"last (step 8),best (step {best['step']})",
                              "--out", str(tmp_path / "cmp")]) == 0
    theirs, ours = (tmp_path / "cmp.md").read_text(), (tmp_path / "sweep" / "sweep.md").read_text()
    expected = next(line for line in theirs.splitlines() if line.startswith(f"- **best (step {best['step']}) - "))
    assert expected in ours
    # The same rows, intervals and verdicts (one rule: core/verdicts.py).
    rows = difference_rows(ours, "### Best minus last")
    assert rows and rows == difference_rows(theirs, "### Paired differences")


@pytest.mark.e2e
def test_a_killed_sweep_resumes_without_scoring_again(tiny_cache, tiny_drafter_config, drafter_json, tmp_path,
                                                      counted):
    saved = plain_loop(tmp_path / "ckpts", tiny_cache, tiny_drafter_config, steps=24, every=1)
    out = tmp_path / "sweep"

    def entries() -> int:
        try:
            return len(record(out)["entries"])
        except (OSError, ValueError):
            return 0

    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "sweep_checkpoints.py"), str(tmp_path / "ckpts"),
                             "--states", str(tiny_cache), "--out", str(out), "--config", str(drafter_json), *OPTIONS],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sigkill_when(proc, lambda: entries() >= 3, timeout=120, poll_s=0)
    recorded = entries()
    kept = len(list((out / "results").glob("*.json")))  # a results file may be written before its entry
    assert 3 <= recorded <= kept < len(saved)
    assert sweep(tiny_cache, out, tmp_path / "ckpts", extra=("--config", str(drafter_json))) == 0
    assert len(counted) == len(saved) - kept  # nothing recorded (or written) before the kill is scored again
    rec = record(out)
    assert [e["step"] for e in rec["entries"]] == sorted(saved)
    fresh = tmp_path / "fresh"  # the same checkpoints in one uninterrupted sweep
    assert sweep(tiny_cache, fresh, tmp_path / "ckpts", extra=("--config", str(drafter_json))) == 0
    assert [figures(e["metrics"]) for e in record(fresh)["entries"]] == [figures(e["metrics"]) for e in rec["entries"]]


# -- watching a run as it writes -------------------------------------------------------------------------

WRITER = r"""
import os, sys, time
src, dst, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
names = sorted(os.listdir(src), key=lambda n: int(n.split("_")[1].split(".")[0]))
for name in names:
    data = open(os.path.join(src, name), "rb").read()
    with open(os.path.join(dst, name), "wb") as f:  # written in place, as Lightning writes a .ckpt
        f.write(data[: len(data) // 2])
        f.flush()
        time.sleep(pause)  # half a zip archive on disk, unchanged for several polls
        f.write(data[len(data) // 2:])
    time.sleep(pause)
"""


@pytest.mark.e2e
def test_watch_scores_checkpoints_as_another_process_writes_them(tiny_cache, plain_run, drafter_json, tmp_path):
    """A writer process writes three checkpoints in place, each half written for several polls: the watcher scores
    each once, complete (no failure, the identity of the finished file), and stops at --max-checkpoints."""
    src = next(iter(plain_run.values())).parent
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "writer.py").write_text(WRITER)
    watcher = subprocess.Popen([sys.executable, str(ROOT / "tools" / "sweep_checkpoints.py"), str(run_dir),
                                "--states", str(tiny_cache), "--out", str(tmp_path / "sweep"), "--config",
                                str(drafter_json), *OPTIONS, "--watch", "--poll-seconds", "0.2",
                                "--max-checkpoints", "3"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "sweep" / "sweep.json").is_file() and watcher.poll() is None:
        time.sleep(0.05)  # the watcher is up (its checks passed, the cache opened) before the run writes anything
    writer = subprocess.run([sys.executable, str(tmp_path / "writer.py"), str(src), str(run_dir), "2"],
                            env=ENV, timeout=120)
    assert writer.returncode == 0
    stdout, stderr = watcher.communicate(timeout=120)
    assert watcher.returncode == 0, stderr[-3000:]
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2, 4, 6] and rec["failed"] == []
    from dflash_cb.core.checkpoints.files import CheckpointKind, FoundCheckpoint

    for e in rec["entries"]:
        assert e["identity"] == FoundCheckpoint(Path(e["checkpoint"]), CheckpointKind.FILE).identity()
    assert "its zip archive has no central directory yet" in stdout  # it saw each half-written file and waited


def test_until_step_ends_a_watch(tiny_cache, plain_run, drafter_json, tmp_path, counted):
    """Checkpoints already on disk are settled: the first look scores them, and a scored step 4 or later stops it."""
    folder = next(iter(plain_run.values())).parent
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=("--config", str(drafter_json), "--watch",
                                                                "--poll-seconds", "0.05", "--until-step", "4")) == 0
    assert [e["step"] for e in record(tmp_path / "sweep")["entries"]] == [2, 4, 6] and len(counted) == 3


@pytest.mark.e2e
def test_ctrl_c_ends_a_watch_with_the_sweep_written(tiny_cache, plain_run, drafter_json, tmp_path):
    folder = next(iter(plain_run.values())).parent
    watcher = subprocess.Popen([sys.executable, str(ROOT / "tools" / "sweep_checkpoints.py"), str(folder),
                                "--states", str(tiny_cache), "--out", str(tmp_path / "sweep"), "--config",
                                str(drafter_json), *OPTIONS, "--watch", "--poll-seconds", "0.2"],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "sweep" / "sweep.md").is_file():
        time.sleep(0.1)
    assert watcher.poll() is None  # still watching
    watcher.send_signal(signal.SIGINT)
    stdout, stderr = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, stderr[-3000:]
    assert "stopped: 3 checkpoint(s) in" in stdout and "Traceback" not in stderr
    assert len(record(tmp_path / "sweep")["entries"]) == 3 and (tmp_path / "sweep" / "sweep.png").is_file()


# -- W&B ---------------------------------------------------------------------------------------------------

# What only a live evaluation has: its share of the training's wall time, failures, predictions, setup, and the
# full/ keys of its full evaluations (a sweep's every entry is one evaluation with the options given).
LIVE_ONLY = ("eval_overhead", "failed_evaluations", "predicted/", "setup_time_s", "full/")


@pytest.mark.e2e
def test_the_wandb_run_has_the_live_keys_and_step_axis_and_the_panels(tiny_cache, tiny_drafter_config, plain_run,
                                                                       drafter_json, tmp_path, monkeypatch, capsys):
    """Offline: one row per entry at ``trainer/global_step``, every key the live evaluation logs with the same
    options; ``tools/wandb_panels.py --run DIR --show`` prints the curve and no panel is left empty; a second
    sweep with ``--wandb-run-id`` logs into that run."""
    from test_loops import plain_loop as live_loop
    from wandb_runs import history_and_summary

    from dflash_cb.integrations.tracking import panels

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    folder = next(iter(plain_run.values())).parent
    assert sweep(tiny_cache, tmp_path / "sweep", folder,
                 extra=("--config", str(drafter_json), "--wandb-project", "p", "--wandb-name", "swept")) == 0
    rec = record(tmp_path / "sweep")
    run_dir = Path(rec["wandb"]["dir"]).parent
    history, summary, defined = history_and_summary(run_dir)
    assert ("dflash_eval/*", "trainer/global_step") in defined
    rows = [h for h in history if "dflash_eval/tau" in h]
    assert [h["trainer/global_step"] for h in rows] == [2, 4, 6] == rec["wandb"]["logged_steps"]
    assert [h["dflash_eval/tau"] for h in rows] == [e["metrics"]["tau"] for e in rec["entries"]]
    assert summary["dflash_eval/best/step"] == rec["best"]["step"]
    # The live evaluation with the same profile (every budget and stride 1 under the main keys).
    _, logged, _ = live_loop(str(tiny_cache), tiny_drafter_config, steps=2, every=2, light_ddtree_budgets=[4, 8],
                             light_anchor_stride=1)
    live = {k for k in logged[2] if not any(k.startswith("dflash_eval/" + x) for x in LIVE_ONLY)}
    assert live and live <= set(rows[0]), sorted(live - set(rows[0]))
    capsys.readouterr()
    assert panels.main(["--run", str(run_dir), "--show"]) == 0
    shown = capsys.readouterr().out.splitlines()
    shown = shown[:next(i for i, ln in enumerate(shown) if ln.startswith("every key logged"))]  # the series table
    assert [line.split()[:2] for line in shown[-3:]] == [[str(e["step"]), f"{e['metrics']['tau']:.4f}"]
                                                         for e in rec["entries"]]
    keys = {k for row in history for k in row} | set(summary)
    layout = panels.layout_from_keys(keys, light_budgets=panels.light_budgets(history))
    assert panels.unlogged_panels(panels.panel_plan(layout), keys) == []
    # Into an existing run (e.g. the training run), by its id.
    assert sweep(tiny_cache, tmp_path / "into", folder,
                 extra=("--config", str(drafter_json), "--wandb-run-id", "trainrun1", "--wandb-project", "p")) == 0
    into = record(tmp_path / "into")["wandb"]
    assert into["run_id"] == "trainrun1" and Path(into["dir"]).parent.name.endswith("-trainrun1")
    # The finished sweep run again into another run: nothing to score, every entry logged there all the same.
    assert sweep(tiny_cache, tmp_path / "sweep", folder,
                 extra=("--config", str(drafter_json), "--wandb-run-id", "again2", "--wandb-project", "p2")) == 0
    again = record(tmp_path / "sweep")["wandb"]
    assert again["run_id"] == "again2" and again["logged_steps"] == [2, 4, 6]
    rows = [h for h in history_and_summary(Path(again["dir"]).parent)[0] if "dflash_eval/tau" in h]
    assert [h["trainer/global_step"] for h in rows] == [2, 4, 6]


# -- several ranks --------------------------------------------------------------------------------------------

def _rank(out: str, argv: list[str]) -> None:
    """One rank of the two-rank test (this file run as a script): the sweep, with the files it hashes counted."""
    from dflash_cb.cache import integrity

    hashed: list[str] = []
    real = integrity.sha256_file
    integrity.sha256_file = lambda p, *a, **k: hashed.append(Path(p).name) or real(p, *a, **k)
    code = run(sweep_cli.main, argv)
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({"code": code, "hashed": hashed}))


@pytest.mark.e2e
def test_two_ranks_share_the_checkpoints_and_give_one_process_numbers(tiny_cache, tiny_drafter_config, drafter_json,
                                                                       tmp_path):
    """Two gloo processes: each scores its own checkpoints, each shard is hashed once over both (a shard the other
    rank verified is the same file here), rank zero writes the sweep; the numbers are one process's."""
    saved = plain_loop(tmp_path / "ckpts", tiny_cache, tiny_drafter_config, steps=5, every=1)
    run_ranks(__file__, [str(tmp_path), str(tmp_path / "ckpts"), "--states", str(tiny_cache), "--out",
                         str(tmp_path / "two"), "--config", str(drafter_json), *OPTIONS], tmp_path,
              env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in ranks] == [0, 0]
    shards = sorted(p.name for p in tiny_cache.glob("states-*.safetensors"))
    hashed = sorted(n for r in ranks for n in r["hashed"] if n.startswith("states-"))
    assert hashed == shards and all(ranks[1]["hashed"]) and not any("head" in n for n in ranks[1]["hashed"])
    two = record(tmp_path / "two")
    assert [e["step"] for e in two["entries"]] == sorted(saved)
    assert [e["rank"] for e in two["entries"]] == [0, 1, 0, 1, 0]  # waves of one checkpoint per rank
    assert sweep(tiny_cache, tmp_path / "one", tmp_path / "ckpts", extra=("--config", str(drafter_json))) == 0
    one = record(tmp_path / "one")
    for a, b in zip(one["entries"], two["entries"], strict=True):
        assert_same_numbers(json.loads((tmp_path / "one" / a["results"]).read_text()),
                            json.loads((tmp_path / "two" / b["results"]).read_text()), a["step"])
    assert one["best"]["step"] == two["best"]["step"]


# -- finding checkpoints, and bad arguments ---------------------------------------------------------------------

def test_what_a_folder_holds_and_the_steps_names_carry(tmp_path):
    """Discovery by names and layout alone (no file is read): every kind once, in step order."""
    from dflash_cb.core.checkpoints.files import find_checkpoints, step_from_name

    assert [step_from_name(n) for n in ("checkpoint-500", "epoch=0-step=500.ckpt", "step=500.ckpt", "run-step500",
                                        "step_500.pt", "global_step500", "500.pt", "final", "drafter_v2")] == \
        [500] * 7 + [None, None]
    runs = tmp_path / "runs"
    for f in ("lightning/checkpoints/epoch=0-step=2.ckpt", "lightning/checkpoints/epoch=1-step=4.ckpt",
              "lightning/checkpoints/last.ckpt", "lightning/hparams.yaml", "plain/step_3.pt", "plain/.step_9.pt",
              "hf/checkpoint-6/model.safetensors", "hf/checkpoint-6/optimizer.pt", "hf/checkpoint-6/trainer_state.json",
              "hf/model.safetensors", "hf/training_args.bin", "sf/run-step8/training_state.pt",
              "sf/run-step8/training_state_rank0.pt", "cache/manifest.json", "cache/states-00000.safetensors",
              "drafters/step10/config.json", "drafters/step10/model.safetensors", "sweep/results/x.pt"):
        (runs / f).parent.mkdir(parents=True, exist_ok=True)
        (runs / f).write_bytes(b"")
    (runs / "sf" / "run-latest").symlink_to("run-step8")
    found = find_checkpoints([str(runs)], skip=[runs / "sweep"])
    assert [(str(c.path.relative_to(runs)), c.kind.value) for c in found] == [
        ("lightning/checkpoints/epoch=0-step=2.ckpt", "file"), ("plain/step_3.pt", "file"),
        ("lightning/checkpoints/epoch=1-step=4.ckpt", "file"), ("hf/checkpoint-6", "weights folder"),
        ("sf/run-step8", "specforge"), ("drafters/step10", "weights folder")]
    named = find_checkpoints([str(runs / "lightning/checkpoints/last.ckpt"), str(runs / "**" / "step_*.pt")])
    assert [c.path.name for c in named] == ["step_3.pt", "last.ckpt"]  # named: scored; no step in its name: last


def test_bad_arguments_are_one_line_errors_before_any_work(tiny_cache, plain_run, drafter_dir, drafter_json,
                                                           tmp_path, capsys, counted):
    folder = next(iter(plain_run.values())).parent
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "train.py").write_text("print()\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    twice = tmp_path / "twice"
    twice.mkdir()
    shutil.copy(folder / "step_2.pt", twice / "step_2.pt")
    shutil.copy(folder / "step_2.pt", twice / "epoch=0-step=2.ckpt")
    hf_like = tmp_path / "hf" / "checkpoint-7"
    shutil.copytree(drafter_dir, hf_like)
    cfg = ("--config", str(drafter_json))
    cases = [
        ([tmp_path / "nothing"], (), "no such file or folder"),
        ([str(folder / "*.ckpt")], (), "the pattern matches nothing"),
        ([empty], (), "no checkpoint under it"),
        ([twice], cfg, "both are step 2 by their names"),
        ([a_file], (), "not a checkpoint file"),
        ([folder], ("--max-checkpoints", "2", *cfg), "--max-checkpoints and --until-step stop a --watch"),
        ([folder], ("--watch", "--poll-seconds", "0", *cfg), "--poll-seconds '0'"),
        ([folder], ("--ddtree-budgets", "4,x", *cfg), "--ddtree-budgets '4,x'"),
        ([folder], ("--config", str(a_file)), "not valid JSON"),
        ([folder], ("--anchor-stride", "0", *cfg), "--anchor-stride '0'"),
    ]
    for paths, extra, needle in cases:
        assert sweep(tiny_cache, tmp_path / "out", *paths, extra=extra) == 2, needle
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, (needle, err)
        assert not (tmp_path / "out").exists(), needle  # nothing written
    for out, needle in ((a_file, "is a file"), (foreign, "holds train.py and no sweep.json"),
                        (hf_like / "sweep", f"is inside the checkpoint {hf_like}"),
                        (tiny_cache / "sweep", "is inside the cache"), (folder.parent, "contains PATH")):
        assert run(sweep_cli.main, [str(tmp_path / "hf" if "checkpoint" in needle else folder), "--states",
                                    str(tiny_cache), "--out", str(out), *OPTIONS, *cfg]) == 2, needle
        err = capsys.readouterr().err
        assert err.startswith("error: --out") and err.count("\n") == 1 and needle in err, (needle, err)
    assert sorted(p.name for p in hf_like.iterdir()) == ["config.json", "model.safetensors"]
    assert counted == []


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2:])


@pytest.mark.e2e
def test_steps_a_series_cannot_hold_and_a_second_sweep_into_one_out(tiny_cache, tiny_drafter_config, tmp_path, capsys):
    """A recorded step of -5, 100.5 or beyond int64 is named as such (not "no training step"), and the sweep still
    writes its report; another run sweeping other checkpoints into the same --out is refused before any work."""
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    folder = tmp_path / "ckpts"
    folder.mkdir()
    torch.manual_seed(0)
    state = DFlashDrafter.from_config_dict(tiny_drafter_config).state_dict()
    for name, step in (("a.pt", 2), ("b.pt", -5), ("c.pt", 100.5), ("d.pt", 2**70)):
        torch.save({"step": step, "drafter": state, "drafter_config": tiny_drafter_config}, folder / name)
    torch.save({"drafter": state, "drafter_config": tiny_drafter_config}, folder / f"step_{2**70}.pt")
    assert sweep(tiny_cache, tmp_path / "sweep", folder) == 0
    rec = record(tmp_path / "sweep")
    assert [e["step"] for e in rec["entries"]] == [2]
    errors = {Path(f["checkpoint"]).name: f["error"] for f in rec["failed"]}
    assert "recorded step -5 is not a training step" in errors["b.pt"]
    assert "recorded step 100.5 is not a training step" in errors["c.pt"]
    assert f"recorded step {2**70} is not a training step" in errors["d.pt"]
    assert "neither recorded in the checkpoint nor in its name" in errors[f"step_{2**70}.pt"]
    assert (tmp_path / "sweep" / "sweep.md").is_file() and (tmp_path / "sweep" / "sweep.png").is_file()
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"step": 4, "drafter": state, "drafter_config": tiny_drafter_config}, other / "e.pt")
    capsys.readouterr()
    assert sweep(tiny_cache, tmp_path / "sweep", other) == 2
    assert "two sweeps in one --out would mix their curves" in capsys.readouterr().err
    assert [e["step"] for e in record(tmp_path / "sweep")["entries"]] == [2]


def test_ctrl_c_between_scoring_and_saving_counts_what_the_file_holds(tiny_cache, plain_run, drafter_json, tmp_path,
                                                                    monkeypatch, capsys):
    """Ctrl-C after a checkpoint is scored but before sweep.json holds it: the summary counts the file's entries."""
    from dflash_cb.core.results.sweep_record import SweepRecord

    real, calls = SweepRecord.save, []

    def save(self, folder):
        calls.append(len(self.entries))
        if len(self.entries) == 2 and calls.count(2) == 1:
            raise KeyboardInterrupt  # the second entry is in memory, not on disk
        return real(self, folder)

    monkeypatch.setattr(SweepRecord, "save", save)
    folder = next(iter(plain_run.values())).parent
    assert sweep(tiny_cache, tmp_path / "sweep", folder, extra=("--config", str(drafter_json))) == 130
    on_disk = len(record(tmp_path / "sweep")["entries"])
    assert on_disk == 1 and f"stopped: {on_disk} checkpoint(s) in" in capsys.readouterr().out


def test_watch_does_not_call_a_checkpoint_being_written_damaged(tiny_cache, plain_run, drafter_json, tmp_path,
                                                                 monkeypatch, capsys):
    """A checkpoint whose files change while it is read (a writer still at it) is waited for, said once, and
    scored when it settles: never reported as damaged, never recorded as failed."""
    import shutil

    from dflash_cb.core.checkpoints.load import CheckpointError
    from dflash_cb.integrations.cli import sweep as sweep_module

    src = next(iter(plain_run.values()))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = run_dir / src.name
    shutil.copy(src, ckpt)
    os.utime(ckpt, (time.time() - 60, time.time() - 60))  # settled before the first look
    real, reads = sweep_module.drafter_in_checkpoint, []

    def being_written(path, *a, **k):
        reads.append(path)
        if len(reads) <= 3:  # the writer touches it while it is read, three polls in a row
            os.utime(ckpt, (time.time() - 60 + len(reads), time.time() - 60 + len(reads)))
            raise CheckpointError(f"{path}: not a readable checkpoint, truncated or damaged")
        return real(path, *a, **k)

    monkeypatch.setattr(sweep_module, "drafter_in_checkpoint", being_written)
    assert sweep(tiny_cache, tmp_path / "sweep", run_dir, extra=("--config", str(drafter_json), "--watch",
                                                                "--poll-seconds", "0.05", "--max-checkpoints", "1")) == 0
    rec = record(tmp_path / "sweep")
    assert len(rec["entries"]) == 1 and rec["failed"] == [] and len(reads) == 4
    out = capsys.readouterr()
    assert (out.out + out.err).count("being written") == 1 and "damaged" not in out.out + out.err
