"""Domino (SpecForge 0.2.0): DFlash's backbone with a GRU correction of the block's logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..block.kind import HeadOnBackboneFamily
from ..proposers import Proposer
from ..spec import DrafterSpec
from .figures import FIGURES
from .model import ARCHITECTURE


class DominoFamily(HeadOnBackboneFamily):
    name = "domino"
    label = "Domino"
    architecture = ARCHITECTURE
    projector_type = "domino"
    figures = FIGURES
    head_parts = ("prefix_gru", "embed_proj")
    config_fields = ("emb_dim", "gru_hidden_dim")
    placeholders = {"emb_dim": 1, "gru_hidden_dim": 1}

    def module_class(self) -> type[nn.Module]:
        from .model import DominoDrafter

        return DominoDrafter

    def tiny_fields(self, hidden_size: int) -> dict[str, Any]:
        return dict(projector_type="domino", emb_dim=16, gru_hidden_dim=8)

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        from .model import DominoProposer

        if getattr(module, "prefix_gru", None) is None or embed is None:
            raise ValueError("a Domino drafter is scored through its module and the target's embedding")
        return DominoProposer(spec, lm_head, mem_bytes, module, embed)


FAMILY = DominoFamily()
