"""What DFlash 2 adds to the block training objective (``training.dflash_loss``): its selector's loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import selector


def selector_loss(drafter: Any, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                  target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A DFlash 2 selector's loss: the cross-entropy of its edge scores over the unary top-K (the candidates the
    walk chooses among, docs/method.md "DFlash 2"), given the target's own previous token (the anchor's at
    depth 1), at the depths whose target token is a candidate; 0 where none is. ``hidden`` [A, D, H] and
    ``logits`` [A, D, V] of the blocks' drafted depths, ``target`` [A, D], ``valid`` [A, D]."""
    with torch.no_grad():
        ids = selector.top_candidates(logits, drafter.spec.option("selector_top_k"))[0]
    previous = torch.cat([anchor_tokens[:, None], target[:, :-1]], dim=1)
    predecessor, successor = drafter.codebooks
    scores = selector.edge_scores(logits.gather(-1, ids), drafter.project(hidden),
                                  selector.codes(predecessor, previous)[..., None, :],
                                  selector.codes(successor, ids))[..., 0, :]
    label = ids == target[..., None]
    scored = label.any(-1) & valid
    if not bool(scored.any()):
        return scores.sum() * 0.0
    return F.cross_entropy(scores[scored], label[scored].float().argmax(-1))
