"""Where in the completion the drafter does well: tau by anchor position and by cycle index.

Each replayed cycle has an anchor: the position whose token the block starts from (the token
the target committed last). The first cycle anchors at ``prompt_len``, on the token the prefill
produced (that token belongs to no cycle); cycle ``i`` anchors ``sum(produced[:i])`` tokens later
(the loop's walk, docs/method.md "The loop": ``p += produced``). So the anchor's *completion position*, counted from
the prefill's token at 0, is the running sum of the earlier cycles' ``produced``: it follows from
``acceptance_lengths`` alone, with no need for the prompt length.

- Position buckets ``[lo, hi)`` over that completion position (default edges 0, 256, 512, 1024,
  2048, then everything beyond) show decay on long completions and the drafter's sliding window.
  Buckets starting beyond the samples' longest completion are omitted (``position_table``). On
  completions too short for them (fewer than three default buckets start within the longest), the
  default edges are halved until three do (``fitted_edges``: 0, 8, 16, 32, 64 on 24-token
  completions), so the table is a curve, not one point; edges a user gives are kept as given.
- Cycle-index buckets (0, 1, 2, 3, then 4 and later) show the first cycles after the prompt,
  where the drafter has seen no completion yet.

Both partition the cycles of every sample, so bucket cycle counts sum to ``cycles`` and the
cycle-weighted mean of bucket taus is ``tau``. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...common.arguments import check_edges
from .metrics import cycle_bucket, cycle_cycles, cycle_tau, position_bucket, position_cycles, position_tau

DEFAULT_POSITION_EDGES: tuple[int, ...] = (0, 256, 512, 1024, 2048)
DEFAULT_CYCLE_BUCKETS = 5  # cycles 0, 1, 2, 3 and "4plus"
FITTED_BUCKETS = 3  # buckets the default edges keep within the longest completion, halved as needed


def position_labels(edges: Sequence[int]) -> list[str]:
    e = check_edges(edges)
    return [position_bucket(lo, hi) for lo, hi in zip(e, (*e[1:], None), strict=True)]


def cycle_labels(n_buckets: int = DEFAULT_CYCLE_BUCKETS) -> list[str]:
    if n_buckets < 1:
        raise ValueError(f"cycle buckets must be >= 1, got {n_buckets}")
    return [cycle_bucket(i, last=i == n_buckets - 1) for i in range(n_buckets)]


def anchor_positions(lengths: Sequence[int]) -> np.ndarray:
    """Completion position of each cycle's anchor: 0, then the running sum of earlier ``produced``."""
    lens = np.asarray(lengths, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lens)[:-1]]) if lens.size else lens


def position_index(lengths: Sequence[int], edges: Sequence[int]) -> np.ndarray:
    """Bucket of each cycle (``len(edges)`` buckets, the last one open)."""
    e = np.asarray(check_edges(edges), dtype=np.int64)
    return np.searchsorted(e, anchor_positions(lengths), side="right") - 1


def cycle_index(lengths: Sequence[int], n_buckets: int = DEFAULT_CYCLE_BUCKETS) -> np.ndarray:
    return np.minimum(np.arange(len(lengths)), n_buckets - 1)


def bucket_sums(lengths: Sequence[int], bucket: np.ndarray, n_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """(produced, cycles) per bucket for one sample."""
    lens = np.asarray(lengths, dtype=np.float64)
    produced = np.bincount(bucket, weights=lens, minlength=n_buckets).astype(np.float64)
    cycles = np.bincount(bucket, minlength=n_buckets).astype(np.float64)
    return produced, cycles


def _all_cycles(samples: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every sample's cycles end to end: their produced [C], each cycle's index within its sample [C] and its
    anchor's completion position there (``anchor_positions``) [C]."""
    counts = np.fromiter((len(s.acceptance_lengths) for s in samples), dtype=np.int64, count=len(samples))
    lens = np.fromiter((n for s in samples for n in s.acceptance_lengths), dtype=np.int64, count=int(counts.sum()))
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each cycle's sample's first cycle
    before = np.cumsum(lens) - lens  # tokens produced before each cycle, over all samples
    return lens, np.arange(lens.size) - first, before - before[first]


def _bucket_table(samples: Sequence[Any], bucket: np.ndarray, lens: np.ndarray, labels: list[str],
                  categories: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The table of cycles ``lens`` (every sample's, end to end) in buckets ``bucket``. The sums are of whole
    numbers, so summing all cycles at once gives what summing sample by sample gives."""
    n = len(labels)
    group = {c: i + 1 for i, c in enumerate(categories)}  # 0: a category the table does not show
    of_cycle = np.repeat(np.fromiter((group.get(s.category, 0) for s in samples), dtype=np.int64, count=len(samples)),
                         np.fromiter((len(s.acceptance_lengths) for s in samples), dtype=np.int64, count=len(samples)))
    at = of_cycle * n + bucket
    produced = np.bincount(at, weights=lens.astype(np.float64), minlength=(len(categories) + 1) * n).reshape(-1, n)
    cycles = np.bincount(at, minlength=(len(categories) + 1) * n).astype(np.float64).reshape(-1, n)
    total_p, total_c = produced.sum(axis=0), cycles.sum(axis=0)
    out: dict[str, dict[str, Any]] = {}
    for i, label in enumerate(labels):
        out[label] = {
            "cycles": int(total_c[i]), "tau": _ratio(total_p[i], total_c[i]),
            "categories": {c: {"cycles": int(cycles[g][i]), "tau": _ratio(produced[g][i], cycles[g][i])}
                           for c, g in group.items()},
        }
    return out


def _ratio(num: float, den: float) -> float | None:
    return float(num / den) if den > 0 else None


def completion_extent(samples: Sequence[Any]) -> int:
    """The longest completion the samples replay (a sample's ``sum(acceptance_lengths)``).

    The walk ends where the cached completion ends, whatever the drafter, so this is a property
    of the samples: every drafter scored on them gets the same extent, hence the same buckets.
    """
    return max((int(sum(s.acceptance_lengths)) for s in samples), default=0)


def fitted_edges(edges: Sequence[int], extent: int) -> tuple[int, ...]:
    """``edges``, or, when they are the default ones and fewer than ``FITTED_BUCKETS`` of their buckets start
    within ``extent`` (the longest completion), the default halved until that many do (at most down to
    0, 1, 2, 4, 8). A property of the samples (``completion_extent``), so every drafter scored on them, and
    every evaluation of a run, gets the same buckets."""
    e = check_edges(edges)
    if e != DEFAULT_POSITION_EDGES:
        return e
    while sum(lo < extent for lo in e) < FITTED_BUCKETS and e[1] > 1:
        e = tuple(x // 2 for x in e)
    return e


def position_edges_for(samples: Sequence[Any], edges: Sequence[int] = DEFAULT_POSITION_EDGES) -> tuple[int, ...]:
    """The edges ``position_table`` uses on ``samples`` (``fitted_edges`` at their longest completion)."""
    return fitted_edges(edges, completion_extent(samples))


def position_table(samples: Sequence[Any], edges: Sequence[int] = DEFAULT_POSITION_EDGES,
                   categories: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """``{bucket: {cycles, tau, categories: {c: {cycles, tau}}}}`` over completion-position buckets.

    Buckets that start at or beyond the longest completion are left out (no anchor can fall there:
    a row of ``n/a (0 cycles)`` says nothing), so reports and logged keys stop where the data stops.
    The default edges are fitted to short completions (``fitted_edges``).
    """
    extent = completion_extent(samples)
    e = fitted_edges(edges, extent)
    kept = max(1, sum(1 for lo in e if lo < extent))
    lens, _, position = _all_cycles(samples)
    bucket = np.searchsorted(np.asarray(e, dtype=np.int64), position, side="right") - 1  # as position_index
    return _bucket_table(samples, bucket, lens, position_labels(e)[:kept], categories)


def cycle_table(samples: Sequence[Any], n_buckets: int = DEFAULT_CYCLE_BUCKETS,
                categories: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """The same over cycle-index buckets (0, 1, ..., ``<n-1>plus``)."""
    labels = cycle_labels(n_buckets)
    lens, index, _ = _all_cycles(samples)
    return _bucket_table(samples, np.minimum(index, n_buckets - 1), lens, labels, categories)  # as cycle_index


def breakdown_metrics(position: dict[str, dict[str, Any]], cycle: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Scalar metrics of both tables (``position/<b>/tau``, ``cycle/<b>/tau`` and their cycle counts)."""
    out: dict[str, float] = {}
    for table, tau_name, cycles_name in ((position, position_tau, position_cycles), (cycle, cycle_tau, cycle_cycles)):
        for label, row in table.items():
            out[cycles_name(label)] = float(row["cycles"])
            if row["tau"] is not None:
                out[tau_name(label)] = row["tau"]
    return out
