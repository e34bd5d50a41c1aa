"""DDTree (Diffusion Draft Tree) acceptance from one drafter pass, for many anchors at once.

Best-first construction under a node budget (docs/method.md, "DDTree"): popping a node adds it
to the tree and pushes (a) its next-rank sibling under the same parent and (b) its rank-0 child.
The heap is simulated on tensors, one pop per step for all anchors: a node's slot index is its
push order, so ``argmax`` (first maximum) breaks score ties exactly like a heap keyed on
``(-score, push_counter)``. One run to the largest budget gives the accepted length after every
pop, hence every smaller budget too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..common.errors import DFlashCBError

# Popping costs a pass over all 1 + 2 * B candidate slots, so a run to budget B costs O(B**2) per anchor:
# 1024 takes seconds per thousand anchors on a CPU core, 100000 took minutes on a 20-token sample. Trees
# verified in one target forward are far smaller (tens to a few hundred nodes).
DDTREE_MAX_BUDGET = 1024


class DDTreeBudgetError(DFlashCBError, ValueError):
    """A DDTree node budget larger than any tree of the block and vocabulary can use."""


def max_ddtree_budget(block_size: int | None = None, vocab_size: int | None = None) -> int:
    """The largest DDTree node budget worth running for this block size and vocabulary.

    A tree holds at most ``vocab_size ** d`` distinct nodes at depth ``d`` (each node has at most
    one child per token), for ``d = 1 .. block_size - 1``; past that every pop is empty. The
    result is that count, or ``DDTREE_MAX_BUDGET`` when it is smaller (or either is not known yet).
    """
    if block_size is None or vocab_size is None:
        return DDTREE_MAX_BUDGET
    total, level = 0, 1
    for _ in range(block_size - 1):
        level *= vocab_size
        total += level
        if total >= DDTREE_MAX_BUDGET:
            return DDTREE_MAX_BUDGET
    return total


def check_ddtree_budgets(budgets: Iterable[int], block_size: int | None, vocab_size: int | None, name: str) -> None:
    """Refuse budgets above ``max_ddtree_budget`` (the tools and the callback, before any work)."""
    limit = max_ddtree_budget(block_size, vocab_size)
    over = sorted(b for b in budgets if b > limit)
    if over:
        why = ("the documented maximum (dflash_cb.core.ddtree.DDTREE_MAX_BUDGET: the cost grows with the square of "
               "the budget)"
               if limit == DDTREE_MAX_BUDGET else
               f"the most distinct nodes a tree can have with block size {block_size} and vocabulary {vocab_size}")
        raise DDTreeBudgetError(f"{name} {over}: above {limit}, {why}; use budgets of at most {limit}")


def ddtree_accepted(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, depths: torch.Tensor,
                    target: torch.Tensor, max_budget: int) -> torch.Tensor:
    """Accepted tree depth per anchor after 1..max_budget pops.

    Args:
        topk_ids: [A, D, K] the drafter's top-K tokens per depth (rank order).
        topk_logprobs: [A, D, K] their log-probabilities (descending along K).
        depths: [A] number of drafted depths at each anchor (block length - 1).
        target: [A, D] the target's tokens at depths 1..D (-1 where unknown).
        max_budget: largest node budget B.

    Returns:
        [A, max_budget] long: accepted nodes walked along the target path in a tree of b + 1 nodes.
    """
    a, d, k = topk_ids.shape
    dev = topk_ids.device
    logp = topk_logprobs.double()  # float64 sums: tie order independent of summation rounding
    slots = 1 + 2 * max_budget
    neg = float("-inf")
    score = torch.full((a, slots), neg, dtype=torch.float64, device=dev)
    depth = torch.zeros((a, slots), dtype=torch.long, device=dev)
    rank = torch.zeros((a, slots), dtype=torch.long, device=dev)
    par_on = torch.zeros((a, slots), dtype=torch.bool, device=dev)
    par_score = torch.zeros((a, slots), dtype=torch.float64, device=dev)
    has_depth = depths > 0
    score[:, 0] = torch.where(has_depth, logp[:, 0, 0], torch.full_like(logp[:, 0, 0], neg))
    par_on[:, 0] = True
    rows = torch.arange(a, device=dev)
    acc = torch.zeros(a, dtype=torch.long, device=dev)
    out = torch.empty((a, max_budget), dtype=torch.long, device=dev)
    for step in range(max_budget):
        idx = score.argmax(dim=1)
        s = score[rows, idx]
        valid = s > neg
        dep, rk, pon, psc = depth[rows, idx], rank[rows, idx], par_on[rows, idx], par_score[rows, idx]
        score[rows, idx] = neg
        token = topk_ids[rows, dep, rk]
        on = valid & pon & (token == target[rows, dep])
        acc = torch.maximum(acc, torch.where(on, dep + 1, torch.zeros_like(dep)))
        out[:, step] = acc
        # (a) next sibling under the same parent
        sib_ok = valid & (rk + 1 < k)
        sib_rank = (rk + 1).clamp(max=k - 1)
        j = 2 * step + 1
        score[:, j] = torch.where(sib_ok, psc + logp[rows, dep, sib_rank], torch.full_like(s, neg))
        depth[:, j], rank[:, j], par_on[:, j], par_score[:, j] = dep, sib_rank, pon, psc
        # (b) first child one depth down
        child_ok = valid & (dep + 1 < depths)
        child_dep = (dep + 1).clamp(max=d - 1)
        score[:, j + 1] = torch.where(child_ok, s + logp[rows, child_dep, 0], torch.full_like(s, neg))
        depth[:, j + 1], rank[:, j + 1], par_on[:, j + 1], par_score[:, j + 1] = child_dep, 0, on, s
    return out
