"""DSpark (SpecForge 0.2.0): DFlash's backbone with a Markov head of the previous token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..dflash.family import DFlashFamily
from ..proposers import Proposer
from ..spec import DrafterSpec, config_value
from .model import ARCHITECTURE


class DSparkFamily(DFlashFamily):
    name = "dspark"
    label = "DSpark"
    architecture = ARCHITECTURE
    default = False
    config_fields = ("markov_rank", "markov_head_type")
    # Each depth depends on its parent token: a tree of per-depth top-K is not what a server verifies.
    supports_tree = False
    # SpecForge's DSpark objective scores its Markov-corrected logits; that accuracy is not replayed.
    specforge_accuracy = False

    def config_hints(self, config: Any) -> bool:
        return config_value(config, "projector_type") == "dspark" or super().config_hints(config)

    def module_class(self) -> type[nn.Module]:
        from .model import DSparkDrafter

        return DSparkDrafter

    def own_key(self, keys: Any) -> str | None:
        return next((k for k in keys if "markov_head." in k or "confidence_head." in k), None)

    def relabel(self, config: dict[str, Any]) -> dict[str, Any]:
        fields = {"projector_type": "dspark", "markov_rank": 1, "markov_head_type": "vanilla"}
        return {**super().relabel(config), "dflash_config": {**fields, **(config.get("dflash_config") or {})}}

    def tiny_fields(self, hidden_size: int) -> dict[str, Any]:
        return dict(projector_type="dspark", markov_rank=8, markov_head_type="gated")

    def published_state(self, state: dict[str, Any]) -> dict[str, Any]:
        from .model import published_state

        return published_state(state)

    def extra_loss(self, drafter: Any, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                   target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's term: cross-entropy of the corrected logits, each depth given the target's own previous
        token (the block objective alone leaves the head untrained)."""
        import torch.nn.functional as F

        previous = torch.cat([anchor_tokens[:, None], target[:, :-1]], dim=1)
        bias = drafter.markov_head.bias(previous.reshape(-1), hidden.reshape(-1, hidden.shape[-1]))
        corrected = logits.reshape(-1, logits.shape[-1]) + bias.float()
        ce = F.cross_entropy(corrected, target.reshape(-1).clamp(min=0), reduction="none")
        weight = valid.reshape(-1).float()
        return (ce * weight).sum() / weight.sum().clamp(min=1.0)

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int) -> Proposer:
        from .model import MarkovProposer

        head = getattr(module, "markov_head", None)
        if head is None:
            raise ValueError("a DSpark drafter is scored through its module (its markov_head weights)")
        return MarkovProposer(spec, lm_head, mem_bytes, head)


FAMILY = DSparkFamily()
