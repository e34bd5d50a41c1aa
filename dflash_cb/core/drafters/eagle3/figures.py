"""EAGLE-3's own figures: SpecForge's accuracy of the drafter as SpecForge 0.2.0 computes it in its EAGLE-3
training and evaluation (``accuracy.py``), beside the replay's exact tau (docs/metrics.md)."""

from __future__ import annotations

from ..base import FamilyFigures, Figure

SIMULATED_ACC_LEN = "specforge/simulated_acc_len"


POSITION_ACC = "specforge/acc_position_"


def position_acc_key(k: int) -> str:
    """SpecForge's accuracy at TTT position ``k`` (1-based: the chain's step ``k``)."""
    return f"{POSITION_ACC}{k:02d}"


FIGURES = FamilyFigures(
    own_pass=(Figure(SIMULATED_ACC_LEN, "SpecForge's simulated_acc_len (no bonus token; tau is 1 + at most it)"),),
    own_pass_prefix=POSITION_ACC,
    section="(SpecForge's own EAGLE-3 accuracy, its own pass)",
    note_key="specforge_eagle3",
    note=("specforge/simulated_acc_len and specforge/acc_position_KK are SpecForge 0.2.0's EAGLE-3 figures, counted as "
          "its offline training and evaluation count them (every completion position, each step fed the data's own "
          "tokens, the target's argmax as the label): a product of per-position accuracies without the bonus "
          "token, not the loop's acceptance; tau is the exact figure"),
)
