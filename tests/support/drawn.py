"""What a figure drew, for tests of plots: each figure saved while ``saved_figures`` is patched in, kept to inspect
(its texts, legend and axes, measured with the renderer that drew them)."""

from __future__ import annotations

from typing import Any

import pytest


def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A list that every ``Figure.savefig`` from now on appends its figure to (the file is still written)."""
    from matplotlib.figure import Figure

    figures: list[Any] = []
    real = Figure.savefig

    def savefig(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        figures.append(self)
        return out

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def extents(artists: list[Any], figure: Any) -> list[Any]:
    """Each artist's box on the figure drawn again as it was saved (its layout kept), in pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # a closed pyplot figure keeps no renderer of its own
    canvas.draw()
    renderer = canvas.get_renderer()
    return [a.get_window_extent(renderer) for a in artists]


def overlapping(artists: list[Any], figure: Any) -> list[tuple[str, str]]:
    """The pairs of texts among ``artists`` whose boxes overlap."""
    boxes = extents(artists, figure)
    return [(artists[i].get_text(), artists[j].get_text()) for i in range(len(boxes))
            for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
