"""The drafter-family seam of the engine: how a family turns drafter hidden states into drafts.

The engine (``engine.evaluate``) runs the drafter's blocks, reads hidden rows (block positions of any blocks)
and hands them to the family's ``Proposer``. A proposer answers, per row, the draft at that depth given the
row's predecessor (the target's token one depth up, the anchor at depth 1: the teacher-forced draft, whose
leading matches are the loop's accepted length whenever the family's draft at depth k depends only on the
hidden state at k and the token before it), and whatever its own diagnostics need per row: whether each of
its extra replay walks accepts the depth, and its extra per-depth statistics (``RowDrafts``). Per block it
builds the DDTree its family verifies and the block a server proposes (for the drafts shown in tables).

``ArgmaxProposer`` here is DFlash's: the target head's argmax, DDTree over the head's top-K. DFlash 2's is
``dflash2.model.SelectorProposer``; each family gives its own (``DrafterFamily.proposer``). What a family adds to
the counts (its walks and per-depth columns) it names once, on its proposer (``Proposer.walks``,
``Proposer.depth_counts``).
No I/O, no modules beyond the weights they are given.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..loop.ddtree import ddtree_accepted
from ..loop.finite import check_finite_logits
from .base import FamilyFigures
from .spec import DrafterSpec, draft_logits

# ---------------------------------------------------------------------------
# Output head, reduced on the fly
# ---------------------------------------------------------------------------


@dataclass
class HeadOutputs:
    argmax: torch.Tensor  # [N]
    topk_ids: torch.Tensor | None  # [N, K]
    topk_logprobs: torch.Tensor | None  # [N, K] float32
    overlap: torch.Tensor | None  # [N] sum_x min(p_target(x), q_draft(x)) over the target's stored top-K


def head_rows(vocab: int, mem_bytes: int) -> int:
    """Rows per head call so that a chunk's logits stay under ``mem_bytes``: the matmul's output, its
    float32 copy and one float32 temporary (soft-cap, log-sum-exp) of [rows, vocab] each."""
    return max(1, mem_bytes // (vocab * 4 * 3))


def logit_chunks(hidden: torch.Tensor, lm_head: torch.Tensor, spec: DrafterSpec, mem_bytes: int
                 ) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(row slice, float32 logits)`` of ``hidden`` [N, H] in chunks of ``head_rows`` rows (``model.draft_logits``);
    each chunk's logits a tensor of its own, which the caller may change in place.

    The matmul runs in the head's own dtype, outside any autocast: autocast would otherwise cast the
    whole [vocab, hidden] head at every call (a transient copy of the largest tensor there is)."""
    rows = head_rows(lm_head.shape[0], mem_bytes)
    hidden = hidden.to(lm_head.dtype)
    for i in range(0, hidden.shape[0], rows):
        with torch.autocast(hidden.device.type, enabled=False):
            logits = draft_logits(hidden[i:i + rows], lm_head, spec)
        check_finite_logits(logits, hidden.dtype)  # finite weights (checked first), so an overflow
        yield slice(i, i + rows), logits
        del logits  # one chunk of logits alive at a time


def stored_overlap(target_ids: torch.Tensor, target_logprobs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the target's stored top-K ids [N, T] (-1: none) and log-probabilities,
    with the draft's probabilities of those ids ``draft_probs`` [N, T]: [N]."""
    p = torch.exp(target_logprobs.double())
    terms = torch.where(target_ids >= 0, torch.minimum(p, draft_probs.double()), torch.zeros_like(p))
    total = torch.zeros(terms.shape[:-1], dtype=torch.float64, device=terms.device)
    for j in range(terms.shape[-1]):  # one fixed order per row, whatever the batch (docs/metrics.md, "Floats")
        total = total + terms[..., j]
    return total


def apply_head(hidden: torch.Tensor, lm_head: torch.Tensor, spec: DrafterSpec, k: int,
               mem_bytes: int = 512 << 20, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> HeadOutputs:
    """Logits ``lm_head(hidden) * output_multiplier`` (soft-capped if configured) in row chunks (``logit_chunks``),
    reduced to their argmax, top ``k`` (ids and log-probabilities) and, with the target's stored top-K, the
    temperature-1 overlap."""
    k = min(k, lm_head.shape[0])
    argmaxes, ids, lps, ovl = [], [], [], []
    for at, logits in logit_chunks(hidden, lm_head, spec, mem_bytes):
        argmaxes.append(logits.argmax(dim=-1))
        if k > 0 or target_topk is not None:
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        if k > 0:
            v, j = torch.topk(logits, k, dim=-1)
            ids.append(j)
            lps.append(v - lse)
        if target_topk is not None:
            t_ids, t_lp = target_topk[0][at], target_topk[1][at]
            ovl.append(stored_overlap(t_ids, t_lp, torch.exp(logits.gather(-1, t_ids.clamp(min=0)) - lse)))
        del logits
    cat = torch.cat
    return HeadOutputs(cat(argmaxes), cat(ids) if ids else None, cat(lps) if lps else None,
                       cat(ovl) if ovl else None)


# ---------------------------------------------------------------------------
# The seam
# ---------------------------------------------------------------------------

@dataclass
class RowDrafts:
    """What a proposer gives for M hidden rows (``Proposer.rows``)."""

    tokens: torch.Tensor  # [M] the draft at the row's depth given its predecessor
    hits: torch.Tensor  # [M, W] bool: the family's extra walks (``Proposer.walks``) accept the row's depth
    # [M, C] the family's extra per-depth statistics (``Proposer.depth_counts``): booleans, or non-negative integers
    # below 2**15 (a count per row, summed per depth)
    counts: torch.Tensor
    specforge: torch.Tensor | None  # [M] the tokens SpecForge's accuracy scores; None: ``tokens``
    overlap: torch.Tensor | None  # [M] temperature-1 overlap with the target's stored top-K (when given)
    parts: Any = None  # row-aligned inputs of ``tree`` and ``block`` (when asked)


def predecessors(anchor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[N, D]: the token before each depth under teacher forcing: the anchor, then the target's tokens at
    depths 1 .. D - 1 (negative where unknown)."""
    return torch.cat([anchor[:, None], target[:, :-1]], dim=1)


class Proposer:
    """How one drafter family drafts, for the replay (module docstring). Subclasses implement ``rows``;
    ``walks`` and ``depth_counts`` are what their family's figures add (``FamilyFigures``), in that order."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int,
                 figures: FamilyFigures | None = None):
        self.spec, self.lm_head, self.mem_bytes = spec, lm_head, mem_bytes
        self.figures = figures or FamilyFigures()

    @property
    def walks(self) -> tuple[str, ...]:
        """The family's replay walks besides the greedy one and the DDTree budgets (their tau keys)."""
        return self.figures.walk_keys

    @property
    def depth_counts(self) -> tuple[str, ...]:
        """The family's per-depth anchor counts besides the served match and SpecForge's."""
        return self.figures.depth_counts

    # Whether a row's draft may depend on ``previous`` (the token above its depth): a serving loop then drafts
    # a block one depth at a time, each fed the draft above it (``decode.loops.block_drafts``).
    reads_previous: bool = True
    # Whether ``prefix_state`` reads the block's hidden rows of every depth besides the tokens.
    prefix_reads_hidden: bool = False
    # The block position the draft at depth k reads is k - ``position_shift``: 0, its own; 1, the one before it
    # (a drafter trained to predict each position's next token).
    position_shift: int = 0

    def prefix_state(self, previous: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """What the family computes once per block from the teacher-forced tokens before every depth
        (``previous`` [N, D], negative where unknown) and, when ``prefix_reads_hidden``, the hidden rows every
        depth reads (``hidden`` [N, D, H]), as [N, D, S]: the row at depth k then gets ``[:, k - 1]`` as its
        ``state``. None for a family whose drafts read only the previous token."""
        return None

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        """Drafts of hidden rows [M, H]: ``previous`` [M] the token before each row's depth (negative:
        unknown), ``target`` [M] the target's token at it (negative: unknown), ``tree_k`` the largest DDTree
        budget (0: no tree), ``parts``: keep what ``tree`` and ``block`` need, ``state`` [M, S] the rows' share
        of ``prefix_state``. Each row on its own: a row's result does not depend on the rows it is batched
        with."""
        raise NotImplementedError

    def tree(self, parts: Any, anchor: torch.Tensor, depths: torch.Tensor, target: torch.Tensor,
             inside: torch.Tensor, max_budget: int) -> torch.Tensor:
        """Accepted tree depth per block after 1 .. ``max_budget`` pops [N, B], from ``parts`` of the N x D rows
        of N blocks (block-major), the anchor tokens [N], drafted depths [N], the target [N, D] and ``inside``
        [N, D] (the depth is drafted)."""
        raise NotImplementedError

    def block(self, parts: Any, tokens: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The block a server proposes [N, D] (what a sample table shows), from the rows' ``parts`` and drafts."""
        return tokens


class ArgmaxProposer(Proposer):
    """The draft at a depth is the target head's argmax of the drafter's hidden state there (no predecessor),
    DDTree over the head's top-K per depth (``ddtree.ddtree_accepted``): DFlash's, and any block family's that
    drafts the argmax."""

    reads_previous = False

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        out = apply_head(hidden, self.lm_head, self.spec, tree_k, self.mem_bytes, target_topk)
        none = torch.zeros((out.argmax.shape[0], 0), dtype=torch.bool, device=out.argmax.device)
        return RowDrafts(out.argmax, none, none, None, out.overlap,
                         (out.topk_ids, out.topk_logprobs) if parts else None)

    def tree(self, parts: Any, anchor: torch.Tensor, depths: torch.Tensor, target: torch.Tensor,
             inside: torch.Tensor, max_budget: int) -> torch.Tensor:
        ids, logprobs = parts
        n, d = target.shape
        k = ids.shape[-1]
        top_ids = torch.where(inside[..., None], ids.view(n, d, k), -2)
        top_lp = torch.where(inside[..., None], logprobs.view(n, d, k), float("-inf"))
        return ddtree_accepted(top_ids, top_lp, depths, target, max_budget)
