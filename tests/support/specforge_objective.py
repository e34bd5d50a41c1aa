"""SpecForge 0.2.0's own DFlash objective over a drafter's weights: the oracle of ``specforge/acc`` (tests)
and the baseline of ``benchmarks/vs_specforge.py``."""

from __future__ import annotations

from typing import Any

import torch

from dflash_cb.cache.states import TargetHead


def dflash_objective(config: dict[str, Any], state: dict[str, torch.Tensor], head: TargetHead, num_anchors: int,
                     objective: type | None = None) -> Any:
    """SpecForge 0.2.0's DFlash objective (``OnlineDFlashModel``, or the subclass ``objective``) over its own
    ``DFlashDraftModel`` holding a drafter's weights (``config``: the drafter's config dict, ``state``: its
    state dict) and the target's head, sdpa attention, up to ``num_anchors`` anchors per sequence, eval mode."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "sdpa"
    drafter = DFlashDraftModel(cfg).eval()
    drafter.load_state_dict(state)
    lm_head = torch.nn.Linear(head.lm_head.shape[1], head.lm_head.shape[0], bias=False)
    lm_head.weight.data.copy_(head.lm_head)
    embed = torch.nn.Embedding.from_pretrained(head.embed_tokens.clone())
    mask = cfg.dflash_config["mask_token_id"]
    return (objective or OnlineDFlashModel)(drafter, lm_head, embed, mask, block_size=cfg.block_size,
                                            attention_backend="sdpa", num_anchors=num_anchors).eval()
