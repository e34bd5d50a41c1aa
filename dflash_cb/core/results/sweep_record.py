"""``sweep.json``: a run's checkpoints scored on one cache, the one record a sweep resumes from.

One typed, versioned schema (``SweepRecord``), written by ``save`` (atomically, after every checkpoint) and read
by ``load_sweep``, nowhere else. ``settings`` hold what every entry shares (the cache's manifest hash, the
evaluated block, the sample selection, every evaluation option): a sweep resumed with other settings is refused,
naming the option, rather than mixing two series in one curve. ``entries`` are the scored checkpoints in step
order, each with its checkpoint's path and file identity (``checkpoints.files.FoundCheckpoint.identity``: a
checkpoint written again is scored again), its step and where the step came from, its ``results.json`` (the
format of ``results.py``) and its metrics; ``best`` is the entry with the largest tau; ``failed`` the
checkpoints that could not be scored, with why.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...common.errors import DFlashCBError
from ...common.fileio import atomic_write_json
from ..figures.metrics import TAU
from ..replay import series_differences

SWEEP_FORMAT = "dflash-cb-sweep"
SWEEP_VERSION = 1
SWEEP_FILE = "sweep.json"
RESULTS_FOLDER = "results"

# The settings every entry shares, and the option that sets each (a resume with another value is refused).
SETTING_OPTIONS = {
    "cache_manifest_sha256": "--states", "ddtree_budgets": "--ddtree-budgets", "anchor_stride": "--anchor-stride",
    "anchor_seed": "--anchor-seed", "block_size_option": "--block-size", "tail_blocks": "--tail-blocks",
    "dtype": "--dtype", "device_type": "--device", "sample_selection": "--samples / --sample-ids / --sample-seed",
    "position_edges": "--position-edges", "head_source": "--target", "drafter_config_sha256": "--config",
    "prefix": "--prefix",
}


class SweepError(DFlashCBError, ValueError):
    """A sweep record that cannot be read, or that does not go with this sweep's settings."""


def config_digest(config: dict[str, Any] | None) -> str | None:
    """The sha256 of a drafter config as JSON with sorted keys (None: the checkpoints' own configs)."""
    if config is None:
        return None
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def settings_digest(settings: dict[str, Any]) -> str:
    """What a results file of the sweep records, so that a resume recognises the files of its own settings."""
    shared = {k: settings.get(k) for k in SETTING_OPTIONS}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()


@dataclass
class SweepEntry:
    """One scored checkpoint."""

    checkpoint: str  # absolute path
    kind: str  # checkpoint_files.CheckpointKind value
    step: int
    step_from: str  # "checkpoint" (recorded in it) or "name"
    identity: list[list[Any]]
    results: str  # the results.json, relative to the sweep's folder
    metrics: dict[str, float | None]
    series: dict[str, Any]  # what identifies its figures (``results.Results.series``: the block drafted, ...)
    rank: int = 0  # the process that scored it (under torchrun)

    @property
    def block_size(self) -> int | None:
        return self.series.get("block_size")

    @property
    def tau(self) -> float | None:
        v = self.metrics.get(TAU)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepEntry:
        return cls(str(d["checkpoint"]), str(d["kind"]), int(d["step"]), str(d["step_from"]), list(d["identity"]),
                   str(d["results"]), dict(d["metrics"]), dict(d["series"]), int(d.get("rank", 0)))


@dataclass
class SweepFailure:
    """A checkpoint that could not be scored (reported and skipped; retried when its files change, or by a new
    run of the sweep)."""

    checkpoint: str
    identity: list[list[Any]]
    error: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepFailure:
        return cls(str(d["checkpoint"]), list(d["identity"]), str(d["error"]))


@dataclass
class SweepRecord:
    """The content of ``sweep.json``."""

    settings: dict[str, Any]
    entries: list[SweepEntry] = field(default_factory=list)
    failed: list[SweepFailure] = field(default_factory=list)
    wandb: dict[str, Any] = field(default_factory=dict)  # {"project", "run_id", "logged_steps"}

    @property
    def series(self) -> dict[str, Any] | None:
        """What identifies every entry's figures (``request.series_fields``), set by the first entry."""
        return self.settings.get("series")

    @property
    def block_size(self) -> int | None:
        """The block every entry drafted (the first scored drafter's, unless ``--block-size``)."""
        return (self.series or {}).get("block_size")

    @property
    def family(self) -> str | None:
        """The drafter family of every entry (the first scored drafter's)."""
        return (self.series or {}).get("family")

    @property
    def best(self) -> SweepEntry | None:
        """The entry with the largest tau (the earliest of equal ones)."""
        scored = [e for e in self.entries if e.tau is not None]
        return max(scored, key=lambda e: (e.tau, -e.step)) if scored else None

    def scored(self, checkpoint: str, identity: list[list[Any]]) -> SweepEntry | None:
        """The entry of this checkpoint as it is now, if it was scored."""
        return next((e for e in self.entries if e.checkpoint == checkpoint and e.identity == identity), None)

    def failed_as(self, checkpoint: str, identity: list[list[Any]]) -> SweepFailure | None:
        return next((f for f in self.failed if f.checkpoint == checkpoint and f.identity == identity), None)

    def at_step(self, step: int) -> SweepEntry | None:
        return next((e for e in self.entries if e.step == step), None)

    def conflict(self, entry: SweepEntry) -> str | None:
        """Why ``entry`` cannot join the series (another checkpoint of its step, other figures: another block
        drafted, another compute dtype), or None."""
        other = self.at_step(entry.step)
        if other is not None and other.checkpoint != entry.checkpoint:
            return (f"step {entry.step} is scored already, from {other.checkpoint}: two checkpoints of one step would "
                    "be two points at one step of the curve; remove one of them (or sweep them apart)")
        if self.series is not None and any(e.checkpoint != entry.checkpoint for e in self.entries):
            differ = series_differences(self.series, entry.series)
            if self.family is not None and entry.series.get("family") not in (None, self.family):
                differ.append(("family", self.family, entry.series.get("family")))
            if differ:
                shown = ", ".join(f"{name} {theirs!r} (the sweep's entries: {ours!r})" for name, ours, theirs in differ)
                return (f"its figures are not the sweep's series: {shown}; one sweep is one series (for another "
                        "block, sweep it into another --out, or pass --block-size to both)")
        return None

    def add(self, entry: SweepEntry) -> None:
        """Record a scored checkpoint (replacing the entry of an earlier version of it), in step order; the
        first entry sets the sweep's block (``conflict`` says what cannot be added)."""
        if self.settings.get("series") is None:
            self.settings["series"] = dict(entry.series)
        self.entries = [e for e in self.entries if e.checkpoint != entry.checkpoint] + [entry]
        self.entries.sort(key=lambda e: (e.step, e.checkpoint))
        self.failed = [f for f in self.failed if f.checkpoint != entry.checkpoint]

    def fail(self, failure: SweepFailure) -> None:
        self.failed = [f for f in self.failed if f.checkpoint != failure.checkpoint] + [failure]

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"format": SWEEP_FORMAT, "version": SWEEP_VERSION, "settings": self.settings,
                "entries": [asdict(e) for e in self.entries], "best": asdict(best) if best is not None else None,
                "failed": [asdict(f) for f in self.failed], "wandb": self.wandb}

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``folder/sweep.json`` atomically (a reader or a crash sees the old record or the new one)."""
        path = Path(folder) / SWEEP_FILE
        atomic_write_json(path, self.to_dict())
        return path

    def check_settings(self, settings: dict[str, Any], out: str | os.PathLike) -> None:
        """Refuse to add entries made with other settings, naming the first option that differs."""
        for key, option in SETTING_OPTIONS.items():
            mine, theirs = self.settings.get(key), settings.get(key)
            if mine != theirs:
                raise SweepError(
                    f"{option}: {Path(out) / SWEEP_FILE} was scored with {key} {_shown(mine)}, this run has "
                    f"{_shown(theirs)}; rerun with the same {option} to add to it, or choose another --out (one "
                    "sweep is one series: its entries share the cache, the samples and every option)")


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_sweep(folder: str | os.PathLike) -> SweepRecord | None:
    """``folder/sweep.json``, or None when the folder has none."""
    path = Path(folder) / SWEEP_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepError(f"{path}: not valid JSON ({e}); move it away (its results/ files are picked up again) "
                         "or choose another --out") from None
    if not isinstance(data, dict) or data.get("format") != SWEEP_FORMAT:
        raise SweepError(f"{path}: not a dflash-cb sweep record; choose another --out")
    if data.get("version") != SWEEP_VERSION:
        raise SweepError(f"{path}: sweep version {data.get('version')!r}, this dflash-cb reads {SWEEP_VERSION}; "
                         "choose another --out")
    try:
        return SweepRecord(dict(data["settings"]), [SweepEntry.from_dict(e) for e in data.get("entries") or []],
                           [SweepFailure.from_dict(f) for f in data.get("failed") or []], dict(data.get("wandb") or {}))
    except (KeyError, TypeError, ValueError) as e:
        raise SweepError(f"{path}: damaged sweep record ({type(e).__name__}: {e}); move it away (its results/ files "
                         "are picked up again) or choose another --out") from None


def results_name(checkpoint: str | os.PathLike, step: int) -> str:
    """``results/step00000500-checkpoint-500-1a2b3c4d.json``: sorted by step, one per checkpoint path (the same
    path written again replaces its file)."""
    path = os.fspath(checkpoint)
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", Path(path).name).strip("_.") or "checkpoint"
    tag = hashlib.sha256(path.encode()).hexdigest()[:8]
    return f"{RESULTS_FOLDER}/step{step:08d}-{safe[:80]}-{tag}.json"
