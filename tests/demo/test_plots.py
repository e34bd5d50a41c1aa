"""The demo's plots say what they draw and keep their legends off the data."""

from __future__ import annotations

import math
from pathlib import Path

from drawn import extents, saved_figures

from dflash_cb.core.figures.metrics import (
    ALL_ANCHOR_TAU,
    TAU,
    ci_high,
    ci_low,
    ddtree_tau,
    depth_acc,
    depth_acc_cond,
    hist_frac,
)
from dflash_cb.demo.demo import make_plots


def _history(block_size: int = 8) -> list[dict[str, float]]:
    """A training run's evaluations as the demo logs them: tau rising to its plateau, the band about it."""
    out = []
    for i in range(12):
        tau = 1.2 + 2.2 * (1 - math.exp(-i / 4))
        h = {"step": 100 * i, TAU: tau, ci_low(TAU): tau - 0.15, ci_high(TAU): tau + 0.15, ddtree_tau(16): tau + 0.5,
             ddtree_tau(32): tau + 0.7, ALL_ANCHOR_TAU: tau - 0.1}
        h.update({depth_acc(k): 0.9 ** k * i / 12 for k in range(1, block_size)})
        h.update({depth_acc_cond(k): 0.9 * i / 12 for k in range(1, block_size)})
        h.update({hist_frac(n): 1 / block_size for n in range(1, block_size + 1)})
        out.append(h)
    return out


def test_the_legend_covers_no_data_and_the_histogram_says_it_counts_accepted_plus_one(tmp_path: Path, monkeypatch):
    figures = saved_figures(monkeypatch)
    paths = make_plots(_history(), 8, [16, 32], tmp_path)
    assert [p.name for p in paths.values()] == ["tau_over_steps.png", "per_depth_acceptance.png",
                                                "accepted_lengths_hist.png"]
    tau, _, hist = figures
    (ax,) = tau.axes
    legend, plot = extents([ax.get_legend(), ax], tau)
    assert not legend.overlaps(plot), (legend, plot)  # beside the axes: over neither the band nor a line
    (ax,) = hist.axes
    assert "accepted + 1" in ax.get_title() and "accepted + 1" in ax.get_xlabel()
    assert not extents([ax.get_legend()], hist)[0].overlaps(extents([ax], hist)[0])
