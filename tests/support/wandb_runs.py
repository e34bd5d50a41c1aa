"""Test helpers: what an offline W&B run holds (read with ``dflash_cb.integrations.tracking.wandb_offline``), and a
published-figures file of test data."""

from __future__ import annotations

import time
from pathlib import Path

import yaml


def wandb_records(run_dir: Path) -> list:
    """Records of an offline run's ``.wandb`` file (``dflash_cb.integrations.tracking.wandb_offline``, also used by the panels tool)."""
    from dflash_cb.integrations.tracking.wandb_offline import offline_records

    return offline_records(run_dir)


def finished_records(run_dir: Path, timeout: float = 30.0) -> list:
    """The records once the run's ``exit`` record is on disk (W&B's writer process may still be flushing)."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history_and_summary(run_dir: Path) -> tuple[list[dict], dict, list]:
    from dflash_cb.integrations.tracking.wandb_offline import offline_history

    records = finished_records(run_dir)  # waits for the exit record: the log is complete
    history, summary = offline_history(run_dir)
    metrics = [(r.metric.name or r.metric.glob_name, r.metric.step_metric) for r in records
               if r.WhichOneof("record_type") == "metric"]
    return history, summary, metrics


def write_published(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"entries": [
        {"name": "paper-x", "source": "TEST DATA, not a real paper", "convention": "pooled",
         "metrics": {"tau": 3.5, "ddtree/tau_b8": 4.0}, "per_depth": [0.9, 0.8, 0.7, 0.6, 0.5]},
        # A mean over requests: shown only beside the live tau_request_mean, never beside the pooled tau.
        {"name": "paper-y", "source": "TEST DATA, not a real paper", "convention": "request_mean",
         "metrics": {"tau": 3.25}},
        {"name": "unknown-drafter", "source": "model card", "placeholder": True, "convention": "pooled",
         "metrics": {"tau": None}},
    ]}))
    return path
