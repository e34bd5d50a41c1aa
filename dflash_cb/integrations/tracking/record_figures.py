"""An evaluation's record drawn for trackers that show images (TensorBoard, MLflow): matplotlib ``Figure``
objects, made without pyplot's global state."""

from __future__ import annotations

import math
from typing import Any

from .sinks import EvaluationRecord


def per_depth_figure(record: EvaluationRecord) -> Any | None:
    """Live and reference per-depth acceptance on one line chart; None when no series has a value."""
    from matplotlib.figure import Figure

    series = [(f"live @ step {record.step}", record.per_depth)] + [(b.label, b.per_depth) for b in record.baselines]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    drawn = 0
    for name, values in series:
        pts = [(k, float(v)) for k, v in enumerate(values or [], start=1)
               if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            drawn += 1
    if not drawn:
        return None
    ax.set_xlabel("depth")
    ax.set_ylabel("acceptance (unconditional)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def produced_histogram_figure(record: EvaluationRecord) -> Any | None:
    """Cycles per number of tokens produced (0..block_size) as bars; None when no cycle was counted."""
    from matplotlib.figure import Figure

    counts = [int(c) for c in record.histogram]
    if not sum(counts):
        return None
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.bar(range(len(counts)), counts)
    ax.set_xlabel("tokens produced by a cycle")
    ax.set_ylabel("cycles")
    ax.set_title(f"step {record.step}")
    fig.tight_layout()
    return fig
