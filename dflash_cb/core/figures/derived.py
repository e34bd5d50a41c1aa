"""Figures computed from per-sample lengths (what a results file and a live evaluation log beyond the counts):
per-request means, bootstrap intervals, the position and cycle-index breakdowns, and the paired difference
against each measured baseline. Stored by ``results.results_file``, sent by ``integrations.tracking``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...common.errors import DFlashCBError
from .bootstrap import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    interval_metrics,
    metric_sums,
    paired_difference,
    request_means,
)
from .metrics import DELTA_TAU, TAU, ci_high, ci_low
from .positions import (
    DEFAULT_CYCLE_BUCKETS,
    DEFAULT_POSITION_EDGES,
    breakdown_metrics,
    cycle_table,
    position_edges_for,
    position_table,
)


class NothingShared(DFlashCBError, ValueError):
    """A baseline and the live evaluation share no scored sample."""


def shared(a: Sequence[Any], b: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The samples scored in both, in ``a``'s order, as two aligned lists."""
    by_id = {s.id: s for s in b}
    ids = [s.id for s in a if s.id in by_id]
    first = {s.id: s for s in a}
    return [first[i] for i in ids], [by_id[i] for i in ids]


def derived_metrics(samples: list[Any], budgets: tuple[int, ...] | list[int], categories: tuple[str, ...] | list[str],
                    position_edges: tuple[int, ...] = DEFAULT_POSITION_EDGES,
                    cycle_buckets: int = DEFAULT_CYCLE_BUCKETS, n_resamples: int = DEFAULT_RESAMPLES,
                    seed: int = DEFAULT_SEED, anchor_stride: int | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """Metrics computed from per-sample lengths: the per-request means, bootstrap intervals (with
    ``anchor_stride``, also of that stride's anchor statistics) and the position / cycle breakdowns.

    Returns (scalars, breakdown tables). Used by ``report_to_results`` and by the callback (on rank
    zero, from the samples gathered from every rank), so both log the same numbers.
    """
    position = position_table(samples, position_edges, categories)
    cycle = cycle_table(samples, cycle_buckets, categories)
    scalars = request_means(samples, categories)
    scalars.update(interval_metrics(samples, budgets, categories, n_resamples, seed, anchor_stride=anchor_stride))
    scalars.update(breakdown_metrics(position, cycle))
    tables = {"position_edges": list(position_edges_for(samples, position_edges)), "position": position, "cycle": cycle,
              "interval": {"method": "cluster bootstrap over samples, percentile", "resamples": n_resamples,
                           "level": DEFAULT_LEVEL, "seed": seed}}
    return scalars, tables


def delta_metrics(live: Sequence[Any], baselines: Sequence[Any], n_resamples: int = DEFAULT_RESAMPLES,
                  seed: int = DEFAULT_SEED) -> dict[str, float]:
    """``<baseline key>/delta_tau`` (live minus baseline) and its interval, for measured baselines.

    Paired on the samples both scored (the baseline is restricted to the live evaluation's
    samples when it is loaded). Published figures have no samples and get none.
    """
    out: dict[str, float] = {}
    for b in baselines:
        if not b.samples or not live:
            continue
        sa, sb = shared(b.samples, live)
        if not sa:
            raise NothingShared(f"{b.name} and live share no scored sample: nothing to compare")
        d = paired_difference(metric_sums(sa)[TAU], metric_sums(sb)[TAU], n_resamples, seed, DEFAULT_LEVEL)
        name = f"{b.key}/{DELTA_TAU}"
        out[name] = d.value
        if math.isfinite(d.low) and math.isfinite(d.high):
            out[ci_low(name)], out[ci_high(name)] = d.low, d.high
    return out


def live_metrics(samples: Sequence[Any], budgets: Sequence[int], categories: Sequence[str],
                 baselines: Sequence[Any] = (), position_edges: Sequence[int] = DEFAULT_POSITION_EDGES,
                 n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                 anchor_stride: int | None = None) -> dict[str, float]:
    """What the callback adds to an evaluation's counts, from the per-sample lengths gathered on rank zero:
    intervals, position / cycle-index taus, and ``delta_tau`` against each measured baseline, and the
    intervals of the anchor statistics (``specforge/acc``, ``acceptance/depth_KK``, ``all_anchor_tau``) at
    ``anchor_stride``; None: the one stride the samples have statistics at (none when they have several)."""
    if not samples:
        return {}
    if anchor_stride is None:
        strides = {k for s in samples for k in getattr(s, "anchor_counts", {})}
        anchor_stride = strides.pop() if len(strides) == 1 else None
    scalars, _ = derived_metrics(list(samples), tuple(budgets), tuple(categories), tuple(position_edges),
                                 n_resamples=n_resamples, seed=seed, anchor_stride=anchor_stride)
    scalars.update(delta_metrics(samples, baselines, n_resamples, seed))
    return scalars
