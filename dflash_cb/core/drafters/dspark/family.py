"""DSpark (SpecForge 0.2.0): DFlash's backbone with a Markov head of the previous token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..block.kind import HeadOnBackboneFamily
from ..proposers import Proposer
from ..spec import DrafterSpec
from .figures import FIGURES
from .model import ARCHITECTURE


class DSparkFamily(HeadOnBackboneFamily):
    name = "dspark"
    label = "DSpark"
    architecture = ARCHITECTURE
    projector_type = "dspark"
    figures = FIGURES
    served_methods = ("DSPARK",)  # vLLM's speculative method "dspark" (a DFlash worker ignores the Markov head)
    head_parts = ("markov_head", "confidence_head")
    config_fields = ("markov_rank", "markov_head_type")
    placeholders = {"markov_rank": 1, "markov_head_type": "vanilla"}

    def module_class(self) -> type[nn.Module]:
        from .model import DSparkDrafter

        return DSparkDrafter

    def build(self, config: dict[str, Any], keys: Any = None) -> nn.Module:
        """As the head families', but a config that says no ``markov_head_type`` (read as SpecForge's default
        ``vanilla``) over the weights of a gated or rnn head is named by the field to set, not as unexpected keys."""
        if keys is not None:
            from ..spec import config_value

            keys = [f".{k}" for k in keys]
            held = ("gated" if any(".markov_head.gate_proj." in k for k in keys) else
                    "rnn" if any(".markov_head.joint_proj." in k for k in keys) else None)
            if held is not None and config_value(config, "markov_head_type") is None:
                raise ValueError(f"DSpark drafter config has no markov_head_type (read as 'vanilla'), but the weights "
                                 f"hold a {held} Markov head: set dflash_config.markov_head_type {held!r} in its "
                                 "config.json")
        return super().build(config, keys and [k[1:] for k in keys])

    def tiny_fields(self, hidden_size: int) -> dict[str, Any]:
        return dict(projector_type="dspark", markov_rank=8, markov_head_type="gated")

    def extra_loss(self, drafter: Any, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                   target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's term: cross-entropy of the corrected logits, each depth given the target's own previous
        token (the block objective alone leaves the head untrained)."""
        import torch.nn.functional as F

        from ..proposers import predecessors

        bias = drafter.markov_head.block_bias(predecessors(anchor_tokens, target), hidden)
        corrected = (logits + bias.float()).reshape(-1, logits.shape[-1])
        ce = F.cross_entropy(corrected, target.reshape(-1).clamp(min=0), reduction="none")
        weight = valid.reshape(-1).float()
        return (ce * weight).sum() / weight.sum().clamp(min=1.0)

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        from .model import MarkovProposer

        head = getattr(module, "markov_head", None)
        if head is None:
            raise ValueError("a DSpark drafter is scored through its module (its markov_head weights)")
        settings = getattr(module, "settings", None)
        return MarkovProposer(spec, lm_head, mem_bytes, head, getattr(module, "confidence_head", None),
                              bool(getattr(settings, "confidence_with_markov", False)))


FAMILY = DSparkFamily()
