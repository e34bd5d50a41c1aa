"""The examples as a user runs them: ``examples/lightning_cli.py`` with ``configs/train/lightning_cli.yaml``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "train" / "lightning_cli.yaml"


def test_the_training_config_is_the_demos_and_checkpoints_on_the_evaluations_cadence():
    """As printed it runs after ``python tools/demo.py`` (its drafter is the demo's), and its ModelCheckpoint
    saves on the evaluation's cadence (a checkpoint between two evaluations would carry an older tau)."""
    from dflash_cb.demo.demo import DemoConfig, Paths, drafter_config

    cfg = yaml.safe_load(CONFIG.read_text())
    assert cfg["model"]["drafter_config"] == drafter_config(DemoConfig())
    paths = Paths(Path("demo_out"))
    (checkpoint, evaluation) = cfg["trainer"]["callbacks"]
    assert evaluation["class_path"] == "dflash_cb.DFlashEvalCallback"
    assert evaluation["init_args"]["states"] == str(paths.cache_eval)
    assert cfg["model"]["states"] == cfg["data"]["states"] == str(paths.cache_train)
    assert checkpoint["init_args"]["monitor"] == "dflash_eval/tau"
    assert checkpoint["init_args"]["every_n_train_steps"] == evaluation["init_args"]["every_n_train_steps"]


@pytest.mark.e2e
def test_the_lightning_cli_example_trains_and_keeps_the_checkpoint_of_the_best_tau(tmp_path, tiny_cache,
                                                                                  tiny_drafter_config):
    """A real LightningCLI run of the example (a subprocess, the shipped config, its paths and drafter pointed at
    the test cache): it evaluates at the start and on its cadence, logs through the CSV logger, and the checkpoint
    it keeps is the best tau's, named with it; that tau is the one the evaluation of the kept weights gives."""
    from lightning_runs import read_csv_metrics

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.checkpoints.load import extract_drafter, load_drafter
    from dflash_cb.core.replay import evaluate

    overrides = [f"--model.drafter_config={json.dumps(tiny_drafter_config)}", f"--model.states={tiny_cache}",
                 f"--data.states={tiny_cache}", f"--trainer.callbacks.init_args.states={tiny_cache}",
                 "--trainer.max_steps=200"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_cli.py"), "fit", "--config",
                           str(CONFIG), *overrides], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = tmp_path / "lightning_cli_out" / "lightning_logs" / "version_0"
    logged = read_csv_metrics(logs / "metrics.csv")
    taus = {step: m["tau"] for step, m in logged.items() if "tau" in m}
    assert sorted(taus) == [0, 100, 200], sorted(taus)
    (kept,) = (logs / "checkpoints").glob("*.ckpt")  # save_top_k=1: the best
    step, tau = re.fullmatch(r"step(\d+)-tau(\d+\.\d{4})\.ckpt", kept.name).groups()
    assert int(step) in (100, 200) and taus[int(step)] == max(taus[100], taus[200])
    assert float(tau) == pytest.approx(taus[int(step)], abs=5e-5)
    extract_drafter(kept, tmp_path / "kept")
    torch.manual_seed(0)
    report = evaluate(StateCache(tiny_cache), load_drafter(tmp_path / "kept"), budgets=())
    assert report.tau == pytest.approx(taus[int(step)], rel=1e-6)  # the CSV holds float32-printed values
    assert "DFlashEvalCallback setup" in proc.stderr + proc.stdout
