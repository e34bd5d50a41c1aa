"""Test helpers: a real Lightning ``Trainer`` on CPU with the demo's drafter module and the tiny cache."""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything

from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule


def make_trainer(tmp_path: Path, callbacks: list, max_steps: int, logger=False, checkpointing: bool = False,
                 **kw) -> Trainer:
    return Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpointing,
                   log_every_n_steps=1, default_root_dir=str(tmp_path), **kw)


def make_module(cfg: dict, cache: Path, **kw) -> DFlashDrafterModule:
    return DFlashDrafterModule(cfg, str(cache), lr=1e-2, anchors_per_sample=8, **kw)


def fit(tmp_path: Path, cfg: dict, cache: Path, callbacks: list, max_steps: int, seed: int = 0,
        data_cache: Path | None = None, ckpt_path: str | None = None, **kw) -> tuple[Trainer, DFlashDrafterModule]:
    """Train the demo module ``max_steps`` steps on ``cache`` (or ``data_cache``) with ``callbacks``."""
    seed_everything(seed, verbose=False)
    module = make_module(cfg, cache)
    trainer = make_trainer(tmp_path, callbacks, max_steps, **kw)
    trainer.fit(module, CachedStatesDataModule(str(data_cache or cache), batch_size=2), ckpt_path=ckpt_path)
    return trainer, module


def read_csv_metrics(path: Path, prefix: str = "dflash_eval/") -> dict[int, dict[str, float]]:
    """``{step: {unprefixed metric: value}}`` from a ``CSVLogger``'s metrics.csv."""
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            vals = {k[len(prefix):]: float(v) for k, v in row.items() if k.startswith(prefix) and v != ""}
            if vals:
                out.setdefault(int(row["step"]), {}).update(vals)
    return out
