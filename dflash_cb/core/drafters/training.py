"""The DFlash training objective on cached target states (used by the demo and the tests).

A training example is a block anchored at a random position ``p`` of a sample: the block holds the
verified token at ``p`` and mask tokens after it; the drafter, conditioned on the target features
of positions ``< p``, must predict the target's tokens at ``p + 1 .. p + block_size - 1``. Anchors
are batched exactly as in evaluation (a block drafter's ``forward_blocks``), so training sees the same
computation the engine scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ...cache.states import TargetHead
from .registry import family_named
from .runners import block_embeddings
from .spec import draft_logits


def sample_anchors(prompt_len: int, valid_len: int, count: int, generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` random anchors in [prompt_len, valid_len - 1) (sorted; may repeat)."""
    hi = valid_len - 1
    if hi <= prompt_len:
        return torch.empty(0, dtype=torch.long, device=device)
    a = torch.randint(prompt_len, hi, (count,), generator=generator)
    return torch.sort(a).values.to(device)


def dflash_loss(drafter: Any, head: TargetHead, features: torch.Tensor, tokens: torch.Tensor,
                anchors: torch.Tensor, valid_len: int, decay: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the drafts at every block depth against the target's tokens.

    ``decay`` > 0 down-weights deep positions by ``exp(-decay * (k - 1))`` (as DFlash training
    recipes do: early positions matter most for acceptance). A family adds its own term
    (``DrafterFamily.extra_loss``; DFlash 2: its selector's loss). Returns (loss, per-depth accuracy of the unary argmax).
    """
    spec = drafter.spec
    n = spec.block_size
    ctx = drafter.context_kv(features[: int(anchors.max().item())])
    emb = block_embeddings(tokens, anchors, n, spec, head.embed_tokens).to(features.dtype)
    hidden = drafter.forward_blocks(ctx, emb, anchors)[:, 1:]
    logits = draft_logits(hidden, head.lm_head, spec)
    pos = anchors[:, None] + torch.arange(1, n, device=anchors.device)[None, :]
    valid = pos < valid_len
    target = tokens[pos.clamp(max=tokens.shape[0] - 1)]
    weight = valid.float()
    if decay > 0:
        weight = weight * torch.exp(-decay * torch.arange(n - 1, device=anchors.device, dtype=torch.float32))[None]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    loss = (ce * weight.reshape(-1)).sum() / weight.sum().clamp(min=1.0)
    extra = family_named(spec.family).extra_loss(drafter, hidden, logits, tokens[anchors], target, valid)
    if extra is not None:  # what the family adds to the block objective (DFlash 2: its selector's loss)
        loss = loss + extra
    with torch.no_grad():
        hit = (logits.argmax(-1) == target) & valid
        acc = hit.sum(0).float() / valid.sum(0).clamp(min=1).float()
    return loss, acc


def batch_loss(drafter: Any, head: TargetHead, batch: Sequence[dict[str, Any]], anchors_per_sample: int,
               decay: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash loss of a batch of cached samples (``lightning_module.CachedStatesDataset`` items):
    ``anchors_per_sample`` random anchors each, from the global RNG. Returns (mean loss, mean depth-1
    accuracy); a batch with nothing to learn gives a zero loss that still touches the graph."""
    device = head.embed_tokens.device
    losses, accs = [], []
    for s in batch:
        anchors = sample_anchors(int(s["prompt_len"]), int(s["valid_len"]), anchors_per_sample, device=device)
        if anchors.numel() == 0:
            continue
        hidden = s["hidden"].to(device=device, dtype=head.embed_tokens.dtype)
        loss, acc = dflash_loss(drafter, head, hidden, s["input_ids"].to(device), anchors, int(s["valid_len"]), decay)
        losses.append(loss)
        accs.append(acc[0])
    if not losses:
        zero = sum(p.sum() for p in drafter.parameters()) * 0.0
        return zero, torch.zeros((), device=device)
    return torch.stack(losses).mean(), torch.stack(accs).mean()
