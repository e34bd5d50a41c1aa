"""The block kind's family bases (as ``chain.py`` holds the chain kind's): a family on the block backbone, and one
with a head of its own over the logits. A family folder subclasses one and names itself."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ...loop.limits import MemoryLimits
from ..base import BlockFamily
from ..proposers import ArgmaxProposer, Proposer
from ..registry import family_of
from ..runners import DraftRunner
from ..spec import DrafterSpec, config_value


class BackboneFamily(BlockFamily):
    """A family on the block backbone (``drafter.BlockDrafter``): its runner drives its own module (the fast
    runner), its ``adopt`` any module whose weights are its class's, a plain callable with the published
    forward signature runs one call per anchor. A family folder sets its name, label, architecture and
    ``module_class``."""

    def runner(self, drafter: Any, limits: MemoryLimits) -> DraftRunner | None:
        from .drafter import BlockDrafter
        from .runner import FastRunner

        if isinstance(drafter, BlockDrafter):
            return FastRunner(drafter, limits) if drafter.family == self.name else None
        if isinstance(drafter, nn.Module):
            adopted = self.adopt(drafter)
            if adopted is not None:
                return FastRunner(adopted, limits)
        return None

    def callable_runner(self, fn: Any, spec: DrafterSpec, dtype: torch.dtype | None) -> DraftRunner | None:
        """A plain callable with the published drafter's forward signature, one call per anchor."""
        from .runner import PerAnchorRunner

        return PerAnchorRunner(fn, spec, dtype)

    def adopt(self, module: nn.Module) -> nn.Module | None:
        config = getattr(module, "config", None)
        if config is None:
            return None
        try:
            state = self.published_state(module.state_dict())
            if family_of(config, state) is not self:
                return None
            with torch.device("meta"):
                ours = self.module_class()(config)
        except Exception:
            return None
        if set(ours.state_dict()) != set(state):
            return None
        ours.load_state_dict(state, assign=True, strict=True)
        param = next(iter(state.values()))
        # Non-persistent buffers (rotary inv_freq) are not in a state dict: rebuild them for real.
        ours.rotary_emb = type(ours.rotary_emb)(config).to(param.device)
        return ours

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        return ArgmaxProposer(spec, lm_head, mem_bytes, self.figures)

    def specforge_difference(self, config: Any, block_size: int) -> str | None:
        from .attention import specforge_mask_difference

        return specforge_mask_difference(config, block_size)


class HeadOnBackboneFamily(BackboneFamily):
    """A family on the block backbone with a head of its own over the logits, as SpecForge's ``projector_type``
    names it (Domino, DSpark): recognised by that field or by its head's weights, whose early checkpoints kept
    them under a ``logit_head.`` container. Each depth reads the tokens before it, so no DDTree is verified;
    SpecForge's accuracy of these families scores its own objective, not replayed."""

    supports_tree = False
    specforge_accuracy = False
    projector_type: ClassVar[str]
    head_parts: ClassVar[tuple[str, ...]]  # the submodules only this family has
    placeholders: ClassVar[dict[str, Any]]  # smallest values of its fields (a layout's key names and shapes)

    def config_hints(self, config: Any) -> bool:
        return config_value(config, "projector_type") == self.projector_type or super().config_hints(config)

    def own_key(self, keys: Any) -> str | None:
        return next((k for k in keys if any(f"{part}." in k for part in self.head_parts)), None)

    def build(self, config: dict[str, Any], keys: Any = None) -> nn.Module:
        """As the backbone's, but a folder's config (``keys`` known) must say its block: SpecForge trains these heads
        at the block it is given, and a replay at a guessed block (16) would score another drafter's loop."""
        if keys is not None and config_value(config, "block_size") is None:
            raise ValueError(f"a {self.label} drafter config without block_size (neither top-level nor in "
                             "dflash_config): the block it was trained to draft is unknown; add \"block_size\": N "
                             "(SpecForge's --block-size) to its config.json")
        return super().build(config, keys)

    def relabel(self, config: dict[str, Any]) -> dict[str, Any]:
        fields = {"projector_type": self.projector_type, **self.placeholders}
        return {**super().relabel(config), "dflash_config": {**fields, **(config.get("dflash_config") or {})}}

    def cost_fields(self, config: Any) -> dict[str, int]:
        """The head's weights, counted on a module built without memory: its lookup tables (embeddings) apart
        from the weights it multiplies at every position read."""
        if isinstance(config, dict):
            from transformers import Qwen3Config

            config = Qwen3Config(**config)
        with torch.device("meta"):
            module = self.module_class()(config)
        tables = matmul = 0
        for part in self.head_parts:
            for sub in getattr(module, part, nn.Module()).modules():
                n = sum(p.numel() for p in sub.parameters(recurse=False))
                if isinstance(sub, nn.Embedding):
                    tables += n
                else:
                    matmul += n
        return dict(head_params=matmul, head_tables=tables)

    def published_state(self, state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            name = key
            for part in self.head_parts:
                at = key.find(f"logit_head.{part}.")
                if at >= 0 and (at == 0 or key[at - 1] == "."):
                    name = key[:at] + key[at + len("logit_head."):]
            if name in out:
                raise ValueError(f"{name} appears twice, with and without logit_head.; keep one of them")
            out[name] = value
        return out
