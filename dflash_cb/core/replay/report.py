"""What an evaluation returns: per-sample results and the report summed from them in sample order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...common.errors import DFlashCBError
from ..drafters.base import DrafterFamily
from ..drafters.spec import DEFAULT_FAMILY, DrafterSpec
from ..figures.metrics import TAU, AnchorCounts, EvalCounts, summarize
from ..loop.anchor_sets import DEFAULT_ANCHOR_SEED
from ..loop.cycles import (
    TailBlocks,
)


@dataclass
class SampleResult:
    id: str
    category: str
    acceptance_lengths: list[int]
    ddtree: dict[int, list[int]] = field(default_factory=dict)
    anchors: int = 0  # anchors in this sample's statistics set (at the evaluation's anchor_stride)
    # Per statistics stride (the evaluation's anchor_stride and each extra one): this sample's offset
    # (anchor_sets.anchor_offset) and its anchor-statistic counts over anchors[offset::stride].
    anchor_offsets: dict[int, int] = field(default_factory=dict)
    anchor_counts: dict[int, AnchorCounts] = field(default_factory=dict)
    # The block the drafter proposed at each of the first cycles, when asked (keep_drafts): DFlash's argmax per
    # depth, DFlash 2's selector walk (``proposers.Proposer.block``).
    drafts: list[list[int]] | None = None
    anchors_drafted: int = 0  # distinct anchors the drafter ran at
    anchors_needed: int = 0  # distinct anchors the walks visited or the statistics set holds
    # Per greedy cycle: drafts equal to the target's tokens before the stop / max_new_tokens cut (only
    # tokens the cache knows can match), SGLang's "correct drafts" (served.py).
    correct_drafts: list[int] = field(default_factory=list)
    # The drafter family's own walks (``Proposer.walks``; DFlash 2: the unary path, a perfect selector):
    # their cycles' produced, by the walk's tau key.
    walks: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EvalReport:
    counts: EvalCounts
    samples: list[SampleResult]
    wall_time_s: float
    spec: DrafterSpec
    budgets: tuple[int, ...]
    anchor_stride: int = 1
    tail_blocks: TailBlocks = "served"
    head_dtype: str = ""  # the dtype the output head computed in
    anchor_seed: int = DEFAULT_ANCHOR_SEED
    extra_anchor_strides: tuple[int, ...] = ()
    # How ``specforge/acc`` was computed: "" when SpecForge's masks are the served ones; else why they
    # differ and that it had its own pass, or was left out (``SPECFORGE_OWN_PASS`` / ``SPECFORGE_LEFT_OUT``).
    specforge_note: str = ""
    passes: int = 0  # drafter passes made (rounds of every wave, at most max_blocks blocks each)
    series: dict[str, Any] = field(default_factory=dict)  # what identifies these figures (EvalRequest.series)
    # The drafter's family (``fit.FittedDrafter.family``): what reads the report asks it, not the registry.
    family: DrafterFamily | None = field(default=None, compare=False, repr=False)

    @property
    def summary(self) -> dict[str, float]:
        return summarize(self.counts)

    @property
    def tau(self) -> float:
        return self.summary[TAU]

    @property
    def block_size(self) -> int:
        """The block every cycle drafted (``evaluate(block_size=...)``); ``spec.block_size`` is the drafter's."""
        return self.counts.block_size

    @property
    def anchor_strides(self) -> tuple[int, ...]:
        """Every stride with statistics in this report: ``anchor_stride`` first, then the extra ones."""
        return (self.anchor_stride, *self.extra_anchor_strides)

    def counts_at(self, stride: int) -> EvalCounts:
        """The counts with the anchor statistics of stride ``stride`` (``anchor_stride`` or an extra one); the
        cycle, DDTree and cost counts are ``counts``'."""
        if stride == self.anchor_stride:
            return self.counts
        if stride not in self.extra_anchor_strides:
            raise DFlashCBError(f"stride {stride}: this evaluation has anchor statistics at strides "
                                f"{list(self.anchor_strides)} only; pass extra_anchor_strides=[{stride}] to evaluate")
        c = self.counts
        return summed_counts(self.samples, c.block_size, c.budgets, c.categories, stride, c.family)



SPECFORGE_OWN_PASS = "specforge/acc is computed under SpecForge's masks, with a drafter pass of its own"
SPECFORGE_LEFT_OUT = "specforge/acc is left out: this drafter's runner cannot run SpecForge's masks"


def summed_counts(samples: Sequence[SampleResult], block_size: int, budgets: Sequence[int],
                  categories: Sequence[str], stride: int, family: str = DEFAULT_FAMILY) -> EvalCounts:
    """``EvalCounts`` of scored samples, summed in their order from per-sample integers, with the anchor
    statistics of ``stride``: the same whichever samples were evaluated together (or on which rank)."""
    counts = EvalCounts(block_size, tuple(budgets), tuple(categories), family)
    counts.add_samples([r.acceptance_lengths for r in samples], [r.category for r in samples],
                       [[r.ddtree[b] for b in counts.budgets] for r in samples],
                       [(r.anchors_drafted, r.anchors_needed) for r in samples],
                       [r.anchor_counts[stride] for r in samples],
                       [[r.walks[w] for w in counts.walks] for r in samples] if counts.walks else ())
    return counts
