"""Reference numbers to show next to a live drafter: measured baselines and published figures.

Two kinds, never mixed up:

- **measured**: a ``results.json`` written by ``tools/eval_drafter.py`` for a reference drafter
  (e.g. the public z-lab drafter) *on the same cache*. It is refused when its cache manifest hash
  differs (``results.load_results``). When the live evaluation scores only a subset of the
  samples, the baseline's tau, DDTree tau and per-category tau are recomputed on that same subset
  from its per-sample acceptance lengths, so "ours vs reference" compares like with like.
- **published**: figures reported by papers (``configs/baselines/published.yaml``), with their
  source. They were measured on other prompts and hardware: context, not a like-for-like
  comparison. Entries marked ``placeholder: true`` or whose values are null are never logged.
  Each entry declares the convention of its acceptance length (``CONVENTIONS``: pooled over cycles,
  mean over requests, or SGLang's served per-request figure) and is shown only beside the live
  figure of that convention (docs/method.md, "Conventions").
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..cache.states import StateCache
from .bootstrap import metric_sums
from .metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    CHAIN_TAU_ESTIMATE,
    CI_HIGH_SUFFIX,
    CI_LOW_SUFFIX,
    SERVED_BASELINE,
    SPECFORGE_ACC,
    TAU,
    TAU_REQUEST_MEAN,
)
from .results import Results, SampleRecord, load_results

MEASURED = "measured"
PUBLISHED = "published"
SERVED = "served"  # the server's own counters, stored by the precompute (dflash_cb/cache/served.py)

# A published acceptance length's convention -> the live metric that uses the same one.
CONVENTIONS = {
    "pooled": TAU,  # all committed tokens over all cycles
    "request_mean": TAU_REQUEST_MEAN,  # dflash.benchmark "Average Acceptance length"
    "served_request_mean": ACCEPT_LENGTH_SERVED,  # mean of SGLang's per-request spec_accept_length
}


@dataclass
class Baseline:
    """One reference: unprefixed metric names (as in ``metrics.summarize``) and where they come from."""

    name: str
    kind: str  # MEASURED or PUBLISHED
    metrics: dict[str, float]
    per_depth: list[float] | None = None  # unconditional acceptance at depths 1..block_size-1
    source: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    # Measured baselines: the per-sample lengths (restricted to the live evaluation's samples), for
    # the paired difference ``live - baseline`` (``compare.paired_delta``).
    samples: list[SampleRecord] | None = None
    budgets: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == SERVED:
            return f"{self.name} (served, measured online)"
        if self.kind == PUBLISHED:
            return f"{self.name} (published, not measured here; {self.details.get('convention', 'pooled')})"
        return f"{self.name} (reference)"

    @property
    def key(self) -> str:
        """Metric-name segment: ``baseline/<name>``, ``baseline/served`` or ``published/<name>``."""
        if self.kind == SERVED:
            return SERVED_BASELINE
        return f"{'published' if self.kind == PUBLISHED else 'baseline'}/{_slug(self.name)}"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_") or "unnamed"


def _finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# -- measured -----------------------------------------------------------------------------

def load_measured(path: str | os.PathLike, cache: StateCache, name: str | None = None,
                  sample_ids: Sequence[str] | None = None) -> Baseline:
    """A ``results.json`` as a baseline; refused if it was measured on another cache.

    ``sample_ids``: the samples the live evaluation scores. Tau, DDTree tau and per-category tau
    are recomputed on them; per-depth acceptance (stored aggregated) stays the whole-cache figure.
    """
    res = load_results(path, cache)
    name = name or Path(path).stem
    # Every scalar the file holds (one place: ``Results.metrics``), intervals and breakdowns included.
    metrics = {k: v for k, v in ((k, _finite(x)) for k, x in res.metrics.items()) if v is not None}
    per_depth = [(_finite(v) if _finite(v) is not None else math.nan)
                 for v in res.per_depth.get("unconditional") or []] or None
    details: dict[str, Any] = {
        "path": str(path),
        "cache_manifest_sha256": res.manifest_sha256,
        "drafter": res.drafter_path,
        "dtype": res.meta.get("dtype"),
        "samples_in_file": len(res.samples),
    }
    samples = res.samples
    if sample_ids is not None:
        samples = _restrict(metrics, res, list(sample_ids), details)
    return Baseline(name, MEASURED, metrics, per_depth, source=f"tools/eval_drafter.py -> {path}", details=details,
                    samples=samples, budgets=tuple(res.budgets))


def _restrict(metrics: dict[str, float], res: Results, ids: list[str], details: dict[str, Any]) -> list[SampleRecord]:
    """Recompute the per-sample-derived metrics on ``ids`` (the live evaluation's samples); returns those samples."""
    by_id = {s.id: s for s in res.samples}
    if set(ids) == set(by_id):
        return [by_id[i] for i in ids]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"{details['path']}: the baseline has no results for {len(missing)} of the evaluated "
                         f"samples (e.g. {missing[:3]}); rerun tools/eval_drafter.py on the whole cache")
    chosen = [by_id[i] for i in ids]
    # Whole-file figures that depend on which samples were scored are dropped; tau, DDTree and
    # per-category tau are recomputed on the subset (the same per-sample sums as the intervals).
    for k in [k for k in metrics if k.startswith(("category/", "position/", "cycle/")) or k.endswith(
            (CI_LOW_SUFFIX, CI_HIGH_SUFFIX))]:
        del metrics[k]
    for k, sums in metric_sums(chosen, res.budgets, sorted({s.category for s in chosen})).items():
        if sums.cycles.sum() > 0:
            metrics[k] = sums.value
    # Aggregated in the file: cannot be restricted, so they describe the whole cache.
    details["subset"] = f"{len(ids)} of {len(by_id)} samples (tau, DDTree, per-category recomputed on the subset; " \
                        "per-depth and all-anchor figures are whole-cache)"
    return chosen


def load_served(cache: StateCache, sample_ids: Sequence[str] | None = None) -> Baseline | None:
    """The served drafter's online tau from the counters the precompute stored, or None if there are none.

    Tau in the replay's convention (``served.served_rounds_and_tau``), pooled over ``sample_ids``
    that have counters. Measured by the server on its hardware, not replayed here.
    """
    from ..cache.served import served_block_size, served_tau

    config = cache.manifest.served_spec_config or {}
    got = served_tau(cache.samples, sample_ids, served_block_size(config))
    if got is None:
        return None
    tau, rounds, n = got
    path = config.get("draft_model_path")
    name = Path(str(path).rstrip("/")).name if path else "served"
    return Baseline(name, SERVED, {TAU: tau}, None,
                    source=f"SGLang spec_verify_ct stored in {cache.path} by the precompute",
                    details={"samples": n, "rounds": rounds, "server": config})


# -- published ----------------------------------------------------------------------------

@dataclass
class PublishedFile:
    baselines: list[Baseline]
    skipped: list[str]  # "name: why" for placeholder or empty entries


def load_published(path: str | os.PathLike, names: Sequence[str] | None = None) -> PublishedFile:
    """Read the published-figures YAML. Placeholders and entries without numbers are skipped, not logged.

    Format: ``entries: [{name, source, url?, target?, drafter?, setting?, placeholder?,
    convention, metrics: {tau: 6.5, ddtree/tau_b32: ...}, per_depth: [...]?, note?}]``. Metric names are
    the unprefixed names of ``dflash_cb.core.metrics`` (``tau``, ``ddtree/tau_b<B>``, ...). ``convention``
    (required, ``CONVENTIONS``) says how the paper averaged its ``tau``; it is stored under the live
    metric of that convention (``published_metric``), so it is only ever shown beside that one.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such published-figures file (see configs/baselines/published.yaml)") from None
    entries = (data or {}).get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level 'entries:' list")
    wanted = set(names) if names is not None else None
    out: list[Baseline] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not e.get("name") or not e.get("source"):
            raise ValueError(f"{path}: entry {i} needs at least 'name' and 'source'")
        name = str(e["name"])
        if name in seen:
            raise ValueError(f"{path}: duplicate entry name {name!r}")
        seen.add(name)
        convention = e.get("convention")
        if convention not in CONVENTIONS:
            raise ValueError(f"{path}: entry {name!r} has convention {convention!r}; declare how its acceptance "
                             f"length was averaged: one of {sorted(CONVENTIONS)} (docs/method.md, \"Conventions\")")
        if wanted is not None and name not in wanted:
            continue
        if e.get("placeholder"):
            skipped.append(f"{name}: placeholder ({e.get('note', 'value not verified')})")
            continue
        metrics = {published_metric(str(k), str(convention), f"{path}: entry {name!r}"): float(v)
                   for k, v in ((e.get("metrics") or {}).items()) if _finite(v) is not None}
        per_depth = e.get("per_depth")
        per_depth = [float(v) for v in per_depth] if isinstance(per_depth, list) and all(
            _finite(v) is not None for v in per_depth) and per_depth else None
        if not metrics and not per_depth:
            skipped.append(f"{name}: no numbers")
            continue
        details = {k: e[k] for k in ("url", "target", "drafter", "setting", "note", "convention")
                   if e.get(k) is not None}
        out.append(Baseline(name, PUBLISHED, metrics, per_depth, source=str(e["source"]), details=details))
    if wanted is not None:
        unknown = sorted(wanted - seen)
        if unknown:
            raise ValueError(f"{path}: no entries named {unknown}; known: {sorted(seen)}")
    return PublishedFile(out, skipped)


def published_metric(metric: str, convention: str, where: str) -> str:
    """The live metric a published figure stands beside: its ``tau`` goes to the convention's metric.

    Other figures (DDTree tau, ...) exist live only pooled, so a non-pooled entry may give ``tau`` only.
    """
    if metric == TAU:
        return CONVENTIONS[convention]
    if convention != "pooled":
        raise ValueError(f"{where}: {metric!r} under convention {convention!r}: dflash-cb measures it pooled only; "
                         "give it in an entry with convention: pooled, or drop it")
    return metric


# -- what gets logged -----------------------------------------------------------------------

# Headline figures logged as constant series next to the live ones (per-depth goes to the chart).
def is_headline(metric: str) -> bool:
    if metric.endswith((CI_LOW_SUFFIX, CI_HIGH_SUFFIX)):
        return False  # a baseline's own intervals stay in the run summary, not as series
    return metric in (TAU, TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED, ALL_ANCHOR_TAU, SPECFORGE_ACC,
                      CHAIN_TAU_ESTIMATE) or metric.startswith(("ddtree/", "category/"))


def baseline_scalars(baselines: Sequence[Baseline], prefix: str) -> dict[str, float]:
    """``{prefix}{baseline|published}/<name>/<metric>`` for the headline metrics of every baseline."""
    out: dict[str, float] = {}
    for b in baselines:
        for k, v in b.metrics.items():
            if is_headline(k):
                out[f"{prefix}{b.key}/{k}"] = v
    return out
