"""What a Domino drafter's evaluation adds: the tau its backbone's head would get with the GRU correction off, so
the report says what the correction buys (docs/metrics.md)."""

from __future__ import annotations

from ..base import FamilyFigures, Figure

CORRECTION_OFF_TAU = "correction/off_tau"

FIGURES = FamilyFigures(
    walks=(Figure(CORRECTION_OFF_TAU, "tau with the GRU correction off (the head's argmax)",
                  above_tau="the GRU correction costs tau here: the head's argmax alone accepts more"),),
    section="GRU correction: the served drafts are the corrected ones",
)
