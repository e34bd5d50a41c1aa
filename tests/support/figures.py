"""How tests compare the figures of two evaluations that batched the same work differently.

Every figure but one is a ratio of integer counts (or a bootstrap over per-sample integers): equal to the
last bit, or the engine has a bug. The one float figure, the temperature-1 estimate (``t1_tau_estimate``,
counts' ``t1_sum``), sums per-anchor values that come out of the drafter's float32 forward pass, and a CPU's
matrix kernels round a row differently with the shape of the batch it is in (one row, a few, many; more
threads): about 1e-9 per anchor on this project's machines. Its reduction is exact in any order
(``metrics.quantize_t1``), so what is left is that rounding: compared to ``T1_RTOL`` (docs/metrics.md, "Floats").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from dflash_cb.core.figures.metrics import T1_TAU_ESTIMATE

# The forward's batch-shape rounding (~1e-9 per anchor) averaged over a sample's anchors, with room to spare.
T1_RTOL = 1e-6
# Two evaluations of the same drafter whose blocks sit in other passes (another statistics stride, every anchor at
# once): only the attention's padding and the matmuls' batch shapes differ, about 1e-9 relative (docs/metrics.md,
# "Floats"): ten times that, a hundredth of T1_RTOL.
SAME_DRAFTS_T1_RTOL = 1e-8
T1_COUNT = "t1_sum"


def is_float_figure(key: str) -> bool:
    return key.endswith((T1_TAU_ESTIMATE, T1_COUNT))


def assert_same_figures(a: Mapping[str, Any], b: Mapping[str, Any], ignore: Iterable[str] = ()) -> None:
    """Two summaries (or any figure dicts): the same keys; every integer-derived figure equal to the last bit;
    the float figure within ``T1_RTOL``."""
    skip = set(ignore)
    keys = set(a) - skip
    assert keys == set(b) - skip, sorted(keys ^ (set(b) - skip))
    for k in sorted(keys):
        x, y = a[k], b[k]
        if is_float_figure(k):
            assert math.isclose(x, y, rel_tol=T1_RTOL), (k, x, y)
        elif isinstance(x, float) and isinstance(y, float) and math.isnan(x):
            assert math.isnan(y), (k, x, y)
        else:
            assert x == y, (k, x, y)


def without_t1(counts: Any) -> Any:
    """An ``AnchorCounts`` with its float sum zeroed (compare the rest exactly, ``t1_sum`` with ``T1_RTOL``)."""
    return dataclasses.replace(counts, t1_sum=0.0)
