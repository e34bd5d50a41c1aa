"""The DFlash 2 candidate selector as plain functions on tensors, batched over blocks (docs/method.md,
"DFlash 2").

Shapes: ``N`` blocks (anchors, of any samples), ``D`` drafted depths (block positions 1 .. D), ``K``
candidates per depth (``selector_top_k``), ``R`` the selector's rank, ``V`` the vocabulary. Every function
treats each block on its own: a block's result depends on its own rows only, never on the others in the
batch, so the engine may cut a batch anywhere (e.g. to bound the [N, D, K, R] code temporaries).
No I/O, no modules: the weights come in as tensors (``DFlash2Drafter.codebooks``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...loop.ddtree import best_first_accepted
from ..proposers import predecessors


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` candidates of every position: (ids [..., k] long, unary scores [..., k] float32) of ``logits``
    [..., V] (the drafter's logits: head, ``output_multiplier``, softcap; ``model.draft_logits``).

    Canonical, whatever torch's ``topk`` does with equal values: the set is the ``k`` largest logits, a tie at
    the ``k``-th value going to the lower ids; the order is by unary score descending, then by id ascending.
    A selector ``argmax`` over this order (first maximum) therefore prefers, among equal edge scores, the
    higher unary score, then the lower id. The reference takes ``topk(sorted=False)`` and an argmax over that
    unspecified order: the two agree except where two candidates' scores are exactly equal.
    """
    if k < logits.shape[-1]:
        # One more than asked: a K-th value equal to the next one is a tie at the boundary, where which of the
        # equal ones torch returns is unspecified (cheaper than counting the values >= the K-th over the vocabulary).
        values, ids = torch.topk(logits, k + 1, dim=-1)
        over = values[..., k - 1] == values[..., k]
        values, ids = values[..., :k], ids[..., :k]
    else:
        values, ids = torch.topk(logits, k, dim=-1)
        over = torch.zeros(values.shape[:-1], dtype=torch.bool, device=values.device)
    if bool(over.any()):
        rows = logits[over]
        chosen = torch.sort(rows, dim=-1, descending=True, stable=True).indices[..., :k]  # ties: lower id first
        ids[over], values[over] = chosen, rows.gather(-1, chosen)
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(-1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order), values.gather(-1, order).float()


def edge_scores(unary: torch.Tensor, query: torch.Tensor, predecessor: torch.Tensor,
                successor: torch.Tensor) -> torch.Tensor:
    """``S_t(a, b) = U_t(b) + <A[a] * H(h_t), B[b]>`` for P predecessors and K successors: [..., P, K].

    ``unary`` [..., K] the candidates' unary scores ``U_t``; ``query`` [..., R] ``H(h_t)``; ``predecessor``
    [..., P, R] the predecessors' ``A`` rows; ``successor`` [..., K, R] the candidates' ``B`` rows."""
    pairs = torch.matmul(predecessor * query[..., None, :], successor.transpose(-1, -2))
    return unary[..., None, :] + pairs


def codes(codebook: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of a codebook [V, R] for token ids [...]: [..., R] float32 (scores are summed in float32)."""
    return F.embedding(ids, codebook).float()


def choose(ids: torch.Tensor, unary: torch.Tensor, query: torch.Tensor, predecessor: torch.Tensor,
           predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's pick at positions of any blocks, each given one predecessor token: (tokens [...], edge
    scores [..., K]), the first maximum of ``S`` over the candidate order of ``top_candidates``.

    ``ids``, ``unary`` [..., K], ``query`` [..., R], ``predecessor`` [...] (negative ids are read as token 0:
    the caller's mark for an unknown token, after which nothing the pick decides is scored). The one
    selection rule of the walk, the teacher-forced draft and the engine's rows."""
    scores = edge_scores(unary, query, codes(predecessor_codebook, predecessor.clamp(min=0))[..., None, :],
                         codes(successor_codebook, ids))[..., 0, :]
    return ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0], scores


def forced_draft(ids: torch.Tensor, unary: torch.Tensor, query: torch.Tensor, anchor: torch.Tensor,
                 target: torch.Tensor, predecessor_codebook: torch.Tensor,
                 successor_codebook: torch.Tensor) -> torch.Tensor:
    """The teacher-forced selector draft [N, D]: at depth d the argmax of ``S`` given the target's token at
    depth d - 1 (the anchor at depth 1) as predecessor.

    ``ids``, ``unary`` [N, D, K] (``top_candidates``), ``query`` [N, D, R], ``anchor`` [N], ``target`` [N, D]
    the target's tokens at depths 1 .. D (negative where unknown: the draft one depth further down is then
    scored after token 0 and meaningless, as a mismatch has already ended the run of matches). While the
    greedy walk (``walk_draft``) matches the target its predecessors are the target's, so the leading matches
    of this draft are the walk's accepted length: one batched step instead of D sequential ones.
    """
    return choose(ids, unary, query, predecessors(anchor, target), predecessor_codebook, successor_codebook)[0]


def walk_draft(ids: torch.Tensor, unary: torch.Tensor, query: torch.Tensor, anchor: torch.Tensor,
               predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor) -> torch.Tensor:
    """The free greedy walk from the anchor, the block a server proposes at temperature 0: [N, D] tokens, at
    each depth the argmax of ``S`` given the walk's own previous token (first maximum over the candidate
    order of ``top_candidates``). Shapes as ``forced_draft``."""
    token = anchor
    path = []
    for d in range(ids.shape[1]):  # sequential over depths, batched over every block
        token = choose(ids[:, d], unary[:, d], query[:, d], token, predecessor_codebook, successor_codebook)[0]
        path.append(token)
    return torch.stack(path, dim=1) if path else ids[:, :0, 0]


def transition_logprobs(ids: torch.Tensor, unary: torch.Tensor, query: torch.Tensor, anchor: torch.Tensor,
                        predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's lattice as log-probabilities (float64), for ``lattice_tree_accepted``:
    ``first`` [N, K] over depth 1's candidates given the anchor, and ``steps`` [N, D - 1, K, K] where
    ``steps[n, d - 1, a, b]`` is depth d + 1's candidate b given depth d's candidate a; each a log-softmax over
    the K candidates of ``S`` given the parent. Shapes as ``forced_draft``."""
    successors = codes(successor_codebook, ids)
    first = edge_scores(unary[:, 0], query[:, 0], codes(predecessor_codebook, anchor)[:, None, :],
                        successors[:, 0])[:, 0]
    steps = edge_scores(unary[:, 1:], query[:, 1:], codes(predecessor_codebook, ids[:, :-1]), successors[:, 1:])
    return torch.log_softmax(first.double(), -1), torch.log_softmax(steps.double(), -1)


def lattice_tree_accepted(ids: torch.Tensor, first: torch.Tensor, steps: torch.Tensor, depths: torch.Tensor,
                          target: torch.Tensor, max_budget: int) -> torch.Tensor:
    """DDTree over the selector's lattice: accepted tree depth per block after 1 .. max_budget pops, [N, B] long.

    A node is a path of candidates from the anchor; its children are the next depth's K candidates, ranked by
    their log-probability given the node's own candidate (``first`` for depth 1, ``steps`` below it,
    ``transition_logprobs``; equal log-probabilities rank in candidate order). Best first as
    ``ddtree.ddtree_accepted``: popping a node adds it and pushes its next-ranked sibling under the same
    parent and its rank-0 child; a node's score is the sum of the log-probabilities along its path; equal
    scores pop in push order. Verification follows the target's tokens (``target`` [N, D], negative where
    unknown) down the tree. ``depths`` [N]: drafted depths per block (fewer than D in a shortened block).
    Budgets past the lattice's K + K**2 + ... nodes pop nothing more.
    """
    n, d, k = ids.shape
    # Every depth's ranking as [N, D, parent, rank]; depth 1's single parent (the anchor) sits at parent 0.
    lattice = torch.cat([first[:, None, None, :].expand(n, 1, k, k), steps], dim=1) if d else first.new_zeros(n, 0, k, k)
    lattice = lattice.detach().double().cpu().numpy()
    order = np.argsort(-lattice, axis=-1, kind="stable")  # candidate index of each rank
    ranked = np.take_along_axis(lattice, order, axis=-1)
    # Node code ((depth * K) + parent candidate) * K + rank; per block and code: the candidate, whether its token
    # is the target's, its log-probability, whether it may have a child.
    depth_of = np.repeat(np.arange(d), k * k)
    candidate = order.reshape(n, -1)
    tokens = ids.cpu().numpy()
    hit = np.take_along_axis(tokens, order.reshape(n, d, k * k), axis=-1) == target.cpu().numpy()[:, :, None]
    drafted = depths.cpu().numpy()
    has_child = (depth_of[None, :] + 1) < drafted[:, None]
    child = ((np.minimum(depth_of + 1, max(d - 1, 0)) * k)[None, :] + candidate) * k  # [N, codes]
    number = np.arange(d * k * k)
    out = best_first_accepted(drafted > 0, ranked.reshape(-1), hit.reshape(-1), has_child.reshape(-1),
                              lambda c, node: child.reshape(-1)[node], np.minimum(number + 1, d * k * k - 1),
                              number % k + 1 < k, depth_of + 1, max_budget)
    return torch.from_numpy(out).to(ids.device)
