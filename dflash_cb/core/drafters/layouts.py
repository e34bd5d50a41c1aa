"""The drafter families in one table: which class a config (or, when it does not say, the keys of its
weights) is, how to build one, check a layout against every family, adopt a live training module, and
which proposer scores it (``proposers``: how the engine turns its hidden states into drafts).

``checkpoints.load_drafter`` / ``extract_drafter`` load through here, and the engine drives any module it
is given through ``adopt_module`` when the module has one of these layouts. A new family is a class, a
proposer and a row in each of ``CLASSES`` and ``PROPOSERS`` (and ``metrics.FAMILY_COUNTS`` when it adds figures).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .dflash.model import DFlashDrafter, DrafterSpec, load_state_dict_strict
from .dflash2.model import DFlash2Drafter, SelectorProposer, SelectorWeights, is_dflash2_key, published_state
from .names import DFLASH2_FIELDS, FAMILIES, FAMILY_ARCHITECTURE, Family, config_family
from .proposers import ArgmaxProposer, Proposer

CLASSES: dict[Family, type[DFlashDrafter]] = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter}


def _argmax_proposer(spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int) -> Proposer:
    return ArgmaxProposer(spec, lm_head, mem_bytes)


def _selector_proposer(spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int) -> Proposer:
    return SelectorProposer(spec, lm_head, mem_bytes, SelectorWeights.of(module))


# Per family: ``(spec, drafter module or None, the target's head [V, H], head memory bytes) -> Proposer``.
PROPOSERS: dict[Family, Callable[[DrafterSpec, Any, torch.Tensor, int], Proposer]] = {
    "dflash": _argmax_proposer, "dflash2": _selector_proposer}


def proposer_for(spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int) -> Proposer:
    """The proposer of ``spec.family`` for a drafter (``module``: its weights beyond the blocks, e.g. DFlash 2's
    selector; None for a plain callable) with the target's head ``lm_head``, its logits under ``mem_bytes``."""
    return PROPOSERS[spec.family](spec, module, lm_head, mem_bytes)


def drafter_family(config: Any, keys: Iterable[str] | None = None) -> Family:
    """What a drafter is: what its config says (``model.config_family``), else DFlash 2 when a weight name
    belongs to a DFlash 2 part (``keys``), else DFlash."""
    said = config_family(config)
    if said is not None:
        return said
    return "dflash2" if keys is not None and any(is_dflash2_key(k) for k in keys) else "dflash"


def config_dict(config: Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, dict) else config.to_dict()


def drafter_from_config(config: dict[str, Any], keys: Iterable[str] | None = None) -> DFlashDrafter:
    """A freshly initialised drafter of the family ``drafter_family(config, keys)`` says. Weights of a DFlash 2
    drafter with a config that lacks the DFlash 2 fields: a ValueError saying which to add."""
    keys = None if keys is None else list(keys)
    family = drafter_family(config, keys)
    if family == "dflash2" and config_family(config) is None:
        example = next(k for k in keys or () if is_dflash2_key(k))
        raise ValueError(f"the weights are a DFlash 2 drafter's ({example}), but the config does not say so: set "
                         f"architectures [{FAMILY_ARCHITECTURE['dflash2']!r}] and dflash_config's "
                         f"{', '.join(DFLASH2_FIELDS)}")
    return CLASSES[family].from_config_dict(config)


def as_family(config: dict[str, Any], family: Family) -> dict[str, Any]:
    """``config`` saying ``family``; a DFlash config gets placeholder DFlash 2 fields (key names only)."""
    out = {**config, "architectures": [FAMILY_ARCHITECTURE[family]]}
    if family == "dflash2":
        placeholders = dict(zip(DFLASH2_FIELDS, (int(config["hidden_size"]), 2, 1, 1), strict=True))
        out["dflash_config"] = {**placeholders, **(config.get("dflash_config") or {})}
    return out


def layout_keys(config: Any, family: Family | None = None) -> set[str]:
    """The weight names of a ``family`` drafter (default: the config's) with ``config``'s layers and widths."""
    data = config_dict(config)
    family = family or drafter_family(data)
    with torch.device("meta"):
        return set(CLASSES[family].from_config_dict(as_family(data, family)).state_dict())


def layouts(config: Any) -> dict[Family, set[str]]:
    """``layout_keys`` of every family: what a strict load compares a checkpoint's keys with."""
    return {f: layout_keys(config, f) for f in FAMILIES}


def load_weights(model: DFlashDrafter, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict_strict`` naming the missing and unexpected keys of the closest family's layout."""
    load_state_dict_strict(model, state, source, layouts(model.config))


def adopt_module(module: nn.Module) -> DFlashDrafter | None:
    """Our fast drafter sharing (not copying) the weights of a module in a DFlash or DFlash 2 layout, if it is
    one: the reference ``DFlashDraftModel`` / ``DFlash2DraftModel``, or any module with the same parameter
    names and a DFlash ``.config`` (a training loop's own). None for anything else."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        state = published_state(module.state_dict())
        family = drafter_family(config, state)
        with torch.device("meta"):
            ours = CLASSES[family](config)
    except Exception:
        return None
    if set(ours.state_dict()) != set(state):
        return None
    ours.load_state_dict(state, assign=True, strict=True)
    param = next(iter(state.values()))
    # Non-persistent buffers (rotary inv_freq) are not in a state dict: rebuild them for real.
    ours.rotary_emb = type(ours.rotary_emb)(config).to(param.device)
    return ours
