"""What a DSpark drafter's evaluation adds: the tau its backbone's head would get with the Markov head off, so the
report says what the head buys (docs/metrics.md)."""

from __future__ import annotations

from ..base import FamilyFigures, Figure

MARKOV_OFF_TAU = "markov/off_tau"

FIGURES = FamilyFigures(
    walks=(Figure(MARKOV_OFF_TAU, "tau with the Markov head off (the head's argmax)",
                  above_tau="the Markov head costs tau here: the head's argmax alone accepts more"),),
    section="Markov head: the served drafts are the corrected ones",
)
