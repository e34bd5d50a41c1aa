"""What a DSpark drafter's evaluation adds (docs/metrics.md, "DSpark drafters"). No torch: reports and tables read
these names.

- The tau its backbone's head would get with the Markov head off, so the report says what the head buys.
- The confidence head's calibration, since that head decides how much of a block a server verifies: over the
  statistics set's (anchor, depth) rows, teacher forced, the head's predicted acceptance (its sigmoid) against the
  realized one (the draft at that depth matches the target's token given the target's own tokens before it: the
  greedy loop accepts that depth whenever every earlier one was accepted): pooled, per depth (the realized side
  per depth is ``acceptance/depth_KK``), and by predicted-probability bin (a reliability table).

Each row adds its prediction in thousandths (``CONFIDENCE_MILLI``, rounded) to its depth's count, and one to its
bin's count (``confidence_bin(b)``: predictions of ``b/10`` up to ``(b+1)/10``, the last bin holding 1) and, when
it matched, to the bin's hits (``confidence_hit(b)``): integers, exact in any order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..base import DepthFigure, FamilyFigures, Figure, FigureTable

MARKOV_OFF_TAU = "markov/off_tau"
CONFIDENCE_PREDICTED = "confidence/predicted"
CONFIDENCE_REALIZED = "confidence/realized"
BINS = 10
MILLI = 1000  # the predictions' quantum: 1/MILLI
CONFIDENCE_MILLI = "confidence_milli"  # the per-depth counts (``AnchorCounts.depth_counts``)


# Key names by bin b or depth k: the per-depth counts of a bin, its hits; the figures.
confidence_bin = "confidence_bin_{:02d}".format
confidence_hit = "confidence_hit_{:02d}".format
confidence_predicted = "confidence/predicted_depth_{:02d}".format
bin_share = "confidence/bin_{:02d}_share".format
bin_realized = "confidence/bin_{:02d}_realized".format


def confidence_ratios(counts: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of the confidence head's figures from the family's per-depth counts (one
    sample's or a sum's). Over the rows the head scored (a drafter without one scores none: every figure 0/0)."""
    milli = list(counts[CONFIDENCE_MILLI])
    rows = [list(counts[confidence_bin(b)]) for b in range(BINS)]
    hits = [list(counts[confidence_hit(b)]) for b in range(BINS)]
    scored = [sum(col) for col in zip(*rows, strict=True)]  # per depth
    total = sum(scored)
    out = {CONFIDENCE_PREDICTED: (sum(milli) / MILLI, total), CONFIDENCE_REALIZED: (sum(map(sum, hits)), total)}
    for k, (m, n) in enumerate(zip(milli, scored, strict=True), start=1):
        out[confidence_predicted(k)] = (m / MILLI, n)
    for b in range(BINS):
        out[bin_share(b)] = (sum(rows[b]), total)
        out[bin_realized(b)] = (sum(hits[b]), sum(rows[b]))
    return out


FIGURES = FamilyFigures(
    walks=(Figure(MARKOV_OFF_TAU, "tau with the Markov head off (the head's argmax)",
                  above_tau="the Markov head costs tau here: the head's argmax alone accepts more"),),
    depth_counts=(CONFIDENCE_MILLI, *(confidence_bin(b) for b in range(BINS)), *(confidence_hit(b) for b in range(BINS))),
    ratios=confidence_ratios,
    pooled=(Figure(CONFIDENCE_PREDICTED, "confidence head: mean predicted acceptance (pooled)"),
            Figure(CONFIDENCE_REALIZED, "realized acceptance of the same depths (pooled)")),
    per_depth=(DepthFigure("confidence_predicted", "confidence head's mean predicted acceptance per depth",
                           confidence_predicted, "confidence"),),
    tables=(FigureTable("confidence head reliability (every depth, teacher forced)", "predicted",
                        tuple(f"{b / BINS:.1f}-{(b + 1) / BINS:.1f}" for b in range(BINS)),
                        ("share of depths", "realized acceptance"),
                        lambda i, j: (bin_share, bin_realized)[j](i)),),
    section="Markov head: the served drafts are the corrected ones; confidence head: predicted vs realized",
    note_key="confidence",
    note=("DSpark: confidence/* compare the confidence head's predicted acceptance (its sigmoid at each depth's row, "
          "given the target's own tokens before it) with the realized greedy acceptance of the same rows (the "
          "teacher-forced draft matches), pooled, per depth and by bin; SpecForge trains the head towards the "
          "temperature-1 acceptance probability 1 - TV(target, draft) (docs/metrics.md, \"DSpark drafters\")"),
)
