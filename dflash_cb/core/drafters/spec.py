"""What the replay and the cache checks know of any drafter, whatever its family: ``DrafterSpec``, and the
helpers a family reads its config with. The family builds the spec (``base.DrafterFamily.spec``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """A drafter config's field: ``dflash_config`` wins over a top-level attribute, as in the published format."""
    cfg = (config.get("dflash_config") if isinstance(config, dict) else getattr(config, "dflash_config", None)) or {}
    if name in cfg:
        return cfg[name]
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def int_field(value: Any, field: str) -> int:
    """An integer field of a drafter config, or a ValueError naming it (``int()`` alone names nothing)."""
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    return int(value)


def layer_id_list(value: Any, field: str) -> list[int]:
    """A config's list of target layer ids, or a ValueError naming ``field`` and what it holds (an int, a string
    or an empty list would otherwise fail as ``int()`` over characters or as a weight shape mismatch)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{field} must be a list of layer ids, e.g. [1, 16, 31, 46, 61], not {value!r}")
    if not value:
        raise ValueError(f"{field} is empty: name the target layers the drafter reads, e.g. [1, 16, 31, 46, 61]")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ValueError(f"{field} must hold non-negative integers, got {bad[:3]!r} in {list(value)!r}")
    return [int(v) for v in value]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published format's spread of target layers when a config names none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# The family a drafter, a config of the published block format or a record (results, counts) is when it names
# none: DFlash's, whose format came first (``registry.default_family``).
DEFAULT_FAMILY = "dflash"


@dataclass(frozen=True)
class DrafterSpec:
    """What the replay and the cache checks need to know of any drafter, whatever its class. ``family`` names
    its family (``registry.family_named``; ``registry.spec_of`` builds the spec of any drafter); ``options`` holds what only that family reads, as ``(name, value)``
    pairs (``option``), so this dataclass names no family."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    vocab_size: int
    mask_token_id: int | None = None  # the block's filler token, for families that draft with one
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    family: str = DEFAULT_FAMILY
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        """The family's own setting ``name`` (``options``)."""
        return dict(self.options).get(name, default)

    def differences(self, other: DrafterSpec) -> list[tuple[str, Any, Any]]:
        """``(field, this value, other value)`` for every field that differs."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


def draft_logits(hidden: torch.Tensor, lm_head: torch.Tensor, spec: DrafterSpec) -> torch.Tensor:
    """Float32 logits of drafter hidden states: the target's output head, times ``output_multiplier``,
    soft-capped when the config says so (the published drafters' ``compute_logits``)."""
    logits = (hidden @ lm_head.T.to(hidden.dtype)).float()
    if spec.output_multiplier != 1.0:
        logits = logits * spec.output_multiplier
    if spec.final_logit_softcapping:
        cap = spec.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits
