"""DDTree (Diffusion Draft Tree) acceptance from one drafter pass, for many anchors at once.

Best-first construction under a node budget (docs/method.md, "DDTree"): popping a node adds it
to the tree and pushes (a) its next-rank sibling under the same parent and (b) its rank-0 child.
The heap is simulated on arrays, one pop per step for all anchors: a node's slot index is its
push order, so ``argmax`` (first maximum) breaks score ties exactly like a heap keyed on
``(-score, push_counter)``. One run to the largest budget gives the accepted length after every
pop, hence every smaller budget too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from ...common.errors import DFlashCBError

# Popping costs a pass over all 1 + 2 * B candidate slots, so a run to budget B costs O(B**2) per anchor:
# 1024 takes seconds per thousand anchors on a CPU core, 100000 took minutes on a 20-token sample. Trees
# verified in one target forward are far smaller (tens to a few hundred nodes).
DDTREE_MAX_BUDGET = 1024


class DDTreeBudgetError(DFlashCBError, ValueError):
    """A DDTree node budget larger than any tree of the block and vocabulary can use."""


def max_ddtree_budget(block_size: int | None = None, vocab_size: int | None = None,
                      candidates: int | None = None) -> int:
    """The largest DDTree node budget worth running for this block size and vocabulary.

    A tree holds at most ``width ** d`` distinct nodes at depth ``d`` (each node has at most one child per
    token it may be followed by), for ``d = 1 .. block_size - 1``; past that every pop is empty. ``width`` is
    the vocabulary, or ``candidates`` when a node's children are drawn from that many (a DFlash 2 drafter's
    selector lattice: ``selector_top_k`` per position). The result is that count, or ``DDTREE_MAX_BUDGET``
    when it is smaller (or the block or width is not known yet).
    """
    width = candidates if candidates is not None else vocab_size
    if block_size is None or width is None:
        return DDTREE_MAX_BUDGET
    total, level = 0, 1
    for _ in range(block_size - 1):
        level *= width
        total += level
        if total >= DDTREE_MAX_BUDGET:
            return DDTREE_MAX_BUDGET
    return total


def check_ddtree_budgets(budgets: Iterable[int], block_size: int | None, vocab_size: int | None, name: str,
                         candidates: int | None = None, candidates_why: str = "") -> None:
    """Refuse budgets above ``max_ddtree_budget`` (the tools and the callback, before any work). ``candidates``:
    the children a node may have per position when fewer than the vocabulary (a family whose tree is over its
    own candidates, ``DrafterFamily.tree_candidates``), and ``candidates_why`` the family's words for that
    limit (``DrafterFamily.tree_candidates_why``)."""
    limit = max_ddtree_budget(block_size, vocab_size, candidates)
    over = sorted(b for b in budgets if b > limit)
    if over:
        if limit == DDTREE_MAX_BUDGET:
            why = ("the documented maximum (dflash_cb.core.loop.ddtree.DDTREE_MAX_BUDGET: the cost grows with the square "
                   "of the budget)")
        elif candidates is not None:
            why = candidates_why or (f"the most distinct nodes a tree of {candidates} candidates per position can "
                                     f"have with block size {block_size}")
        else:
            why = f"the most distinct nodes a tree can have with block size {block_size} and vocabulary {vocab_size}"
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
        [A, max_budget] long, on the inputs' device: accepted nodes walked along the target path in a tree
        of b + 1 nodes.

    The pops are sequential and each touches a few numbers per anchor, so they run in numpy on the CPU,
    whatever the device: a numpy call costs a fraction of a torch call's dispatch (and of a kernel launch).
    """
    a, d, k = topk_ids.shape
    # A node is its code depth * K + rank; per anchor and code: its log-probability, whether its token is the
    # target's at its depth, whether it may have a child (its depth + 1 is drafted).
    codes = np.arange(d * k)
    logp = topk_logprobs.detach().double().cpu().numpy().reshape(-1)  # float64: ties independent of rounding
    hit = (topk_ids == target[:, :, None]).cpu().numpy().reshape(-1)
    drafted = depths.cpu().numpy()
    has_child = np.repeat((np.arange(d)[None, :] + 1) < drafted[:, None], k, axis=1).reshape(-1)
    child_code = np.minimum(codes // k + 1, d - 1) * k
    out = best_first_accepted(drafted > 0, logp, hit, has_child, lambda c, node: child_code[c],
                              np.minimum(codes + 1, d * k - 1), codes % k + 1 < k, codes // k + 1, max_budget)
    return torch.from_numpy(out).to(topk_ids.device)


def best_first_accepted(rooted: np.ndarray, logp: np.ndarray, hit: np.ndarray, has_child: np.ndarray,
                        child_of: Callable[[np.ndarray, np.ndarray], np.ndarray], sibling_code: np.ndarray,
                        has_sibling: np.ndarray, depth_of: np.ndarray, max_budget: int) -> np.ndarray:
    """The best-first heap of docs/method.md's DDTree for a tree whose nodes each anchor numbers with codes
    ``0 .. C - 1`` (code 0: the first node pushed), then the walk along the target: [A, max_budget] accepted.

    Per node (``anchor * C + code``, flat): ``logp`` its log-probability given its parent, ``hit`` whether its
    token is the target's at its depth, ``has_child`` whether it may have a child. Per code: ``sibling_code``
    and ``has_sibling`` (the next rank under the same parent), ``depth_of`` (its depth, 1 ..).
    ``child_of(codes, nodes)``: the code of each popped node's rank-0 child. ``rooted`` [A]: anchors with a
    first node at all. Candidate slots are numbered in push order and ``argmax`` takes the first maximum,
    so score ties go to the earliest push, as in a heap keyed on ``(-score, push counter)``.
    """
    a = rooted.shape[0]
    n_codes = logp.shape[0] // a if a else 0
    neg = -np.inf
    slots = 1 + 2 * max_budget
    # Candidate slots in push order: score, node code, whether the parent is on the target path, parent score.
    score = np.full((a, slots), neg)
    code = np.zeros((a, slots), dtype=np.int64)
    par_on = np.zeros((a, slots), dtype=bool)
    par_score = np.zeros((a, slots))
    row_code = np.arange(a) * n_codes  # flat index of each anchor's code 0
    row_slot = np.arange(a) * slots  # flat index of each anchor's slot 0
    if a and n_codes:
        score[:, 0] = np.where(rooted, logp[row_code], neg)
    par_on[:, 0] = True
    flat_score, flat_code, flat_on, flat_par = (x.reshape(-1) for x in (score, code, par_on, par_score))
    acc = np.zeros(a, dtype=np.int64)
    out = np.zeros((a, max_budget), dtype=np.int64)
    for step in range(max_budget if a and n_codes else 0):
        j = 2 * step + 1  # slots 0 .. j - 1 hold every candidate pushed so far
        at = row_slot + score[:, :j].argmax(axis=1)  # first maximum: the earliest push among equal scores
        s, c, pon, psc = flat_score[at], flat_code[at], flat_on[at], flat_par[at]
        flat_score[at] = neg
        valid = s > neg
        node = row_code + c
        on = valid & pon & hit[node]
        # Target-path nodes are popped in depth order (a node is pushed only once its parent is popped).
        acc = np.where(on, depth_of[c], acc)
        out[:, step] = acc
        # (a) next sibling under the same parent
        sib = sibling_code[c]
        score[:, j] = np.where(valid & has_sibling[c], psc + logp[row_code + sib], neg)
        code[:, j], par_on[:, j], par_score[:, j] = sib, pon, psc
        # (b) first child one depth down
        child = child_of(c, node)
        score[:, j + 1] = np.where(valid & has_child[node], s + logp[row_code + child], neg)
        code[:, j + 1], par_on[:, j + 1], par_score[:, j + 1] = child, on, s
    return out
