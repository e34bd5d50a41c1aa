"""DFlash 2 (docs/method.md, "DFlash 2"): DFlash's backbone with grouped convolutions in every layer and a
selector that picks each depth's draft among the head's top-K given the previous token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..block.kind import BackboneFamily
from ..proposers import Proposer
from ..spec import DrafterSpec, config_value, int_field
from .cost_terms import SelectorCostTerms
from .figures import FIGURES
from .model import ARCHITECTURE, DFLASH2_FIELDS, LATTICE_BLOCKS


class DFlash2Family(BackboneFamily):
    name = "dflash2"
    label = "DFlash 2"
    architecture = ARCHITECTURE
    figures = FIGURES
    config_fields = DFLASH2_FIELDS

    def module_class(self) -> type[nn.Module]:
        from .model import DFlash2Drafter

        return DFlash2Drafter

    def own_key(self, keys: Any) -> str | None:
        from .model import is_dflash2_key

        return next((k for k in keys if is_dflash2_key(k)), None)

    def relabel(self, config: dict[str, Any]) -> dict[str, Any]:
        placeholders = dict(zip(DFLASH2_FIELDS, (int(config["hidden_size"]), 2, 1, 1), strict=True))
        return {**super().relabel(config),
                "dflash_config": {**placeholders, **(config.get("dflash_config") or {})}}

    def tiny_fields(self, hidden_size: int) -> dict[str, Any]:
        return dict(conv_group_size=8, conv_kernel_size=2, selector_rank=16, selector_top_k=8)

    def published_state(self, state: dict[str, Any]) -> dict[str, Any]:
        from .model import published_state

        return published_state(state)

    def spec_options(self, config: Any) -> tuple[tuple[str, Any], ...]:
        top_k = config_value(config, "selector_top_k")
        if top_k is None:
            raise ValueError("a DFlash 2 drafter config has no selector_top_k (expected in dflash_config)")
        return (("selector_top_k", int_field(top_k, "selector_top_k")),)

    def tree_candidates(self, spec: DrafterSpec) -> int | None:
        return int(spec.option("selector_top_k"))  # its tree is over the selector's lattice

    def tree_candidates_why(self, spec: DrafterSpec, block_size: int) -> str:
        k = self.tree_candidates(spec)
        return (f"the nodes of a DFlash 2 drafter's selector lattice with block size {block_size} and "
                f"selector_top_k {k} ({' + '.join(f'{k}^{d}' for d in range(1, block_size))}; "
                "its tree is over the selector's candidates, docs/method.md \"DFlash 2\")")

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        from .model import SelectorProposer, SelectorWeights

        return SelectorProposer(spec, lm_head, mem_bytes, SelectorWeights.of(module))

    def cost_fields(self, config: Any) -> dict[str, int]:
        field = (config.get("dflash_config") if isinstance(config, dict) else getattr(config, "dflash_config", None)) or {}
        hidden = int(config["hidden_size"] if isinstance(config, dict) else config.hidden_size)
        return dict(own=SelectorCostTerms(int(field["conv_kernel_size"]), hidden // int(field["conv_group_size"]),
                                          int(field["selector_rank"]), int(field["selector_top_k"]), LATTICE_BLOCKS))

    def extra_loss(self, drafter: Any, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                   target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        from .training import selector_loss

        return selector_loss(drafter, hidden, logits, anchor_tokens, target, valid)


FAMILY = DFlash2Family()
