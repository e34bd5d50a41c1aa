"""Cluster bootstrap intervals for ratio metrics (tau and friends), plain and paired.

What an interval means: tau is a ratio ``sum(produced) / sum(cycles)`` over the evaluated
prompts. The 95% interval says how much that number would move if the same drafter were scored
on another set of prompts drawn from the same distribution as this cache's: it is the
uncertainty from the *choice of prompts*. It says nothing about other prompt distributions, and
the replay itself is exact (no noise from the replay).

Why a cluster bootstrap: the cycles of one prompt are correlated (an easy prompt has many long
cycles), so resampling single cycles would give intervals that are far too narrow. Whole
samples are resampled, each with all its cycles; a sample's contribution is then just its two
sums (produced, cycles), and every metric of one resample is a ratio of weighted sums. All
resamples are one ``[R, S]`` index matrix, so 1,000 resamples of 100 samples cost milliseconds.

Paired comparison: two drafters scored on the *same* prompts are compared by resampling the
prompts once and taking the difference of the two ratios on each resample. Prompt difficulty
cancels, so the interval of the difference is much narrower than the two separate intervals
suggest; a drafter against itself gives exactly [0, 0].

Anchor statistics (``specforge/acc``, ``acceptance/depth_KK``, ``all_anchor_tau``) are ratios of
per-sample integer counts too (``SampleResult.anchor_counts``), so they get intervals the same way.
At a stride > 1 each sample's statistics set starts at its own random offset
(``anchor_sets.anchor_offset``); resampling whole samples resamples those independent draws with
them, so the interval of a strided figure includes the noise of the offsets.

Pure numpy: no I/O, no torch, no W&B.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    SPECFORGE_ACC,
    TAU,
    TAU_REQUEST_MEAN,
    category_tau,
    category_tau_request_mean,
    ci_high,
    ci_low,
    ddtree_tau,
    depth_acc,
    family_ratios,
    sample_accept_length_served,
    sample_tau,
)

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Sums:
    """Per-sample sums of one ratio metric: ``value = produced.sum() / cycles.sum()``."""

    produced: np.ndarray  # [S]
    cycles: np.ndarray  # [S]

    @classmethod
    def of(cls, produced: list[float] | np.ndarray, cycles: list[float] | np.ndarray) -> Sums:
        p, c = np.asarray(produced, dtype=np.float64), np.asarray(cycles, dtype=np.float64)
        if p.shape != c.shape or p.ndim != 1:
            raise ValueError(f"produced and cycles must be 1-d and of one length, got {p.shape} and {c.shape}")
        return cls(p, c)

    @property
    def value(self) -> float:
        den = self.cycles.sum()
        return float(self.produced.sum() / den) if den > 0 else math.nan


@dataclass(frozen=True)
class Interval:
    value: float  # the point estimate on the actual samples
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def resample_indices(n_samples: int, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``[R, S]`` sample indices drawn with replacement (a private, seeded generator)."""
    if n_samples < 1:
        raise ValueError("the bootstrap needs at least one sample")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    return np.random.default_rng(seed).integers(0, n_samples, size=(n_resamples, n_samples))


def _multiplicities(idx: np.ndarray) -> np.ndarray:
    """``[R, S]``: how many times each sample is drawn in each resample of ``idx`` (float64)."""
    r, n = idx.shape
    flat = (idx + n * np.arange(r)[:, None]).ravel()
    return np.bincount(flat, minlength=r * n).reshape(r, n).astype(np.float64)


def _resample_sums(x: np.ndarray, idx: np.ndarray, times: np.ndarray | None) -> np.ndarray:
    """The sum of ``x`` over each resample. Counts (non-negative whole numbers: tokens, cycles, matches) add
    exactly in any order while every sum stays below 2**53, so for them a product with the resamples'
    multiplicities ``times`` is the gathered sum to the last bit, at a fraction of its cost; anything else
    (per-request means) is gathered and summed."""
    if (times is not None and bool((x >= 0).all()) and not bool(np.signbit(x).any())
            and bool((x == np.floor(x)).all()) and float(x.max(initial=0.0)) * idx.shape[1] < 2.0**53):
        return times @ x
    return x[idx].sum(axis=1)


def _ratios(s: Sums, idx: np.ndarray, times: np.ndarray | None = None) -> np.ndarray:
    """Metric on each resample; NaN where the resample has no cycles for it (e.g. a missing category).
    ``times``: ``_multiplicities(idx)``, when several metrics share the resamples."""
    num = _resample_sums(s.produced, idx, times)
    den = _resample_sums(s.cycles, idx, times)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    finite = draws[np.isfinite(draws)]
    if finite.size == 0:
        return math.nan, math.nan
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(finite, [a, 1.0 - a])
    return float(lo), float(hi)


def intervals(metrics: Mapping[str, Sums], n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
              level: float = DEFAULT_LEVEL) -> dict[str, Interval]:
    """Percentile intervals of every metric, all from the same resamples of the samples.

    Every ``Sums`` must list the same samples in the same order (one entry per sample, zeros where
    the sample does not count for that metric, e.g. another category).
    """
    if not metrics:
        return {}
    n = {len(s.produced) for s in metrics.values()}
    if len(n) != 1:
        raise ValueError(f"every metric needs one entry per sample; got lengths {sorted(n)}")
    idx = resample_indices(n.pop(), n_resamples, seed)
    times = _multiplicities(idx)
    return {k: Interval(s.value, *_percentiles(_ratios(s, idx, times), level)) for k, s in metrics.items()}


def paired_difference(a: Sums, b: Sums, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                      level: float = DEFAULT_LEVEL) -> Interval:
    """``b - a`` with a paired cluster-bootstrap interval: both on the same resampled samples.

    ``a`` and ``b`` list the same samples in the same order.
    """
    if a.produced.shape != b.produced.shape:
        raise ValueError(f"paired samples differ in number: {a.produced.shape[0]} vs {b.produced.shape[0]}")
    idx = resample_indices(len(a.produced), n_resamples, seed)
    times = _multiplicities(idx)
    diff = _ratios(b, idx, times) - _ratios(a, idx, times)
    return Interval(b.value - a.value, *_percentiles(diff, level))


# -- from scored samples ---------------------------------------------------------------------

def anchor_sums(samples: Sequence[Any], stride: int) -> dict[str, Sums]:
    """Per-sample sums of ``specforge/acc``, each ``acceptance/depth_KK``, ``all_anchor_tau`` and a drafter
    family's own anchor figures (DFlash 2: ``selector/recall``, ``selector/acc``, per depth too) over the
    statistics sets of stride ``stride``; {} unless every sample has counts at that stride."""
    counts = [getattr(s, "anchor_counts", {}).get(stride) for s in samples]
    if not counts or any(c is None for c in counts):
        return {}
    out = {SPECFORGE_ACC: Sums.of([sum(c.specforge_match) for c in counts], [sum(c.specforge_total) for c in counts]),
           ALL_ANCHOR_TAU: Sums.of([c.anchor_produced for c in counts], [c.anchors for c in counts])}
    depths = max(len(c.depth_total) for c in counts)
    for k in range(1, depths + 1):
        out[depth_acc(k)] = Sums.of([c.depth_match[k - 1] if c.depth_match else 0 for c in counts],
                                    [c.depth_total[k - 1] if c.depth_total else 0 for c in counts])
    # A drafter family's own figures (DFlash 2: the selector's recall and accuracy), from the same per-sample
    # integers as the counts' (``metrics.family_ratios``); a sample without anchors adds zeros.
    names = sorted({k for c in counts for k in c.depth_counts})
    if names:
        zero = (0,) * depths
        ratios = [family_ratios({"depth_total": c.depth_total or zero, "depth_match": c.depth_match or zero,
                                 **{k: c.depth_counts.get(k) or zero for k in names}}) for c in counts]
        for metric in ratios[0]:
            out[metric] = Sums.of([r[metric][0] for r in ratios], [r[metric][1] for r in ratios])
    return out


def metric_sums(samples: Sequence[Any], budgets: Sequence[int] = (),
                categories: Sequence[str] = (), anchor_stride: int | None = None) -> dict[str, Sums]:
    """Per-sample sums of ``tau``, the per-request means, each DDTree tau and each category's tau and
    ``tau_request_mean``, and with
    ``anchor_stride`` the anchor statistics of that stride (``anchor_sums``).

    A per-request mean is a ratio too: each sample with a cycle adds its own value over a weight of
    one, a sample without a cycle adds nothing (``metrics.EvalCounts.add_samples``).

    ``samples``: scored samples (``engine.SampleResult`` or ``results.SampleRecord``: ``category``,
    ``acceptance_lengths``, ``ddtree: {budget: lengths}``, ``walks: {tau key: lengths}`` (a drafter family's
    own walks, e.g. ``selector/unary_tau``: each gets its sums too), ``anchor_counts: {stride:
    AnchorCounts}``), in one fixed order.
    """
    produced = [float(sum(s.acceptance_lengths)) for s in samples]
    cycles = [float(len(s.acceptance_lengths)) for s in samples]
    has = [1.0 if s.acceptance_lengths else 0.0 for s in samples]
    out = {TAU: Sums.of(produced, cycles),
           TAU_REQUEST_MEAN: Sums.of([sample_tau(s.acceptance_lengths) if s.acceptance_lengths else 0.0
                                      for s in samples], has),
           ACCEPT_LENGTH_SERVED: Sums.of([sample_accept_length_served(s.acceptance_lengths)
                                          if s.acceptance_lengths else 0.0 for s in samples], has)}
    for b in budgets:
        dd = [s.ddtree.get(b, []) for s in samples]
        out[ddtree_tau(b)] = Sums.of([float(sum(x)) for x in dd], [float(len(x)) for x in dd])
    for name in sorted({k for s in samples for k in getattr(s, "walks", {})}):  # a drafter family's own walks
        w = [s.walks.get(name, []) for s in samples]
        out[name] = Sums.of([float(sum(x)) for x in w], [float(len(x)) for x in w])
    per_request = out[TAU_REQUEST_MEAN]
    for c in categories:
        mask = [s.category == c for s in samples]
        out[category_tau(c)] = Sums.of([p if m else 0.0 for p, m in zip(produced, mask, strict=True)],
                                       [n if m else 0.0 for n, m in zip(cycles, mask, strict=True)])
        out[category_tau_request_mean(c)] = Sums.of(np.where(mask, per_request.produced, 0.0),
                                                    np.where(mask, per_request.cycles, 0.0))
    if anchor_stride is not None:
        out.update(anchor_sums(samples, anchor_stride))
    return out


def request_means(samples: Sequence[Any], categories: Sequence[str] = ()) -> dict[str, float]:
    """``tau_request_mean`` and ``accept_length_served`` of ``samples`` (in their fixed order; a sample
    without a cycle is left out of both, NaN when none has one), and ``tau_request_mean`` per category."""
    sums = metric_sums(samples, (), categories)
    names = (TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED, *(category_tau_request_mean(c) for c in categories))
    return {k: sums[k].value for k in names}


def interval_metrics(samples: Sequence[Any], budgets: Sequence[int] = (), categories: Sequence[str] = (),
                     n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                     level: float = DEFAULT_LEVEL, anchor_stride: int | None = None) -> dict[str, float]:
    """``{<metric>_ci_low, <metric>_ci_high}`` for tau, the per-request means, DDTree taus and category taus,
    and with ``anchor_stride`` for that stride's anchor statistics (finite ends only)."""
    if not samples:
        return {}
    return interval_keys(metric_sums(samples, budgets, categories, anchor_stride), n_resamples, seed, level)


def interval_keys(sums: Mapping[str, Sums], n_resamples: int, seed: int, level: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, iv in intervals(sums, n_resamples, seed, level).items():
        if math.isfinite(iv.low) and math.isfinite(iv.high):
            out[ci_low(k)] = iv.low
            out[ci_high(k)] = iv.high
    return out
