"""What a DFlash 2 drafter's evaluation adds to every drafter's figures: where its tau is lost (docs/metrics.md,
"DFlash 2 drafters"). No torch: reports and tables read these names.

The replay with the selector switched off (each depth drafts the head's argmax) and with a perfect selector over
the K candidates (a depth is accepted while the target's token is among them): the backbone's ceiling. Pooled
over the statistics set's (anchor, depth): the target's token among the K candidates (recall), and the
selector's pick given the target's own predecessors equal to it, among the depths where it is a candidate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..base import DepthFigure, FamilyFigures, Figure

SELECTOR_UNARY_TAU = "selector/unary_tau"
SELECTOR_ORACLE_TAU = "selector/oracle_tau"
SELECTOR_RECALL = "selector/recall"
SELECTOR_ACC = "selector/acc"
# The per-depth anchor count behind them (``AnchorCounts.depth_counts``): depths whose target is a candidate.
SELECTOR_RECALL_COUNT = "selector_recall"


def selector_recall(k: int) -> str:
    return f"selector/recall_depth_{k:02d}"


def selector_acc(k: int) -> str:
    return f"selector/acc_depth_{k:02d}"


def selector_ratios(counts: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of the selector's recall and accuracy given recall, pooled and per depth, from
    ``depth_total``, ``depth_match`` and ``selector_recall`` (one sample's or a sum's)."""
    total, match, recall = (list(counts[k]) for k in ("depth_total", "depth_match", SELECTOR_RECALL_COUNT))
    # The served match of a DFlash 2 drafter is the selector's (teacher-forced) pick: a candidate, so a recall.
    out = {SELECTOR_RECALL: (sum(recall), sum(total)), SELECTOR_ACC: (sum(match), sum(recall))}
    for k, (t, m, r) in enumerate(zip(total, match, recall, strict=True), start=1):
        out[selector_recall(k)] = (r, t)
        out[selector_acc(k)] = (m, r)
    return out


FIGURES = FamilyFigures(
    walks=(Figure(SELECTOR_UNARY_TAU, "tau with the selector off (unary argmax)",
                  above_tau="the selector costs tau here: the head's argmax alone accepts more (docs/metrics.md, "
                            "\"DFlash 2 drafters\")"),
           Figure(SELECTOR_ORACLE_TAU, "tau with a perfect selector over the candidates")),
    depth_counts=(SELECTOR_RECALL_COUNT,),
    ratios=selector_ratios,
    pooled=(Figure(SELECTOR_RECALL, "target among the unary top-K (pooled)"),
            Figure(SELECTOR_ACC, "selector's pick given recall (pooled)")),
    per_depth=(DepthFigure("selector_recall", "unary top-K recall per depth", selector_recall, "top-K recall"),
               DepthFigure("selector_acc", "the selector's pick given recall, per depth", selector_acc,
                           "pick|recall")),
    section="selector (docs/metrics.md): the served drafts are the selector's walk",
    note_key="selector",
    note=("DFlash 2: tau, the DDTree taus and acceptance/depth_KK score the selector's drafts (teacher "
          "forced: the target's own tokens as predecessors; DDTree over the selector's lattice); "
          "specforge/acc scores the unary argmax (the selector off), as SpecForge's inherited DFlash accuracy "
          "does; selector/* says where tau is lost (docs/metrics.md, \"DFlash 2 drafters\")"),
    specforge_scores="the unary argmax, selector off",
)
