"""Drafter weights across families: which family a config (or, when it does not say, the keys of its weights)
is, a fresh module of it, its weights checked against every registered family's layout (a checkpoint of another
family is named as such), a training loop's module adopted, and the proposer that scores it. Everything here asks
the registry (``registry``); no family is named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ...cache.needs import CacheNeeds
from .proposers import Proposer
from .registry import (
    default_family,
    families,
    family_named,
    family_of,
    family_said,
    key_family,
    spec_of,
)
from .spec import DrafterSpec


def drafter_family(config: Any, keys: Iterable[str] | None = None) -> str:
    """The name of the family a drafter is (``registry.family_of``)."""
    return family_of(config, keys).name


def config_dict(config: Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, dict) else config.to_dict()


def drafter_from_config(config: dict[str, Any], keys: Iterable[str] | None = None) -> nn.Module:
    """A freshly initialised drafter of the family ``family_of(config, keys)`` says. Weights of a family whose
    config does not say so: a ValueError saying what to add."""
    keys = None if keys is None else list(keys)
    said, owner = family_said(config), key_family(keys)
    if said is None and owner is not None:
        raise ValueError(f"the weights are a {owner.label} drafter's ({owner.own_key(keys)}), but the config "
                         f"does not say so: set {owner.how_to_say()}")
    try:
        return family_of(config, keys).build(config, keys)
    except ValueError:
        # The family the config names cannot be built from its fields because the weights are another family's
        # (a Domino folder labelled DSpark lacks DSpark's fields): say that, not which field is missing.
        if said is not None and owner is not None and owner is not said and said.own_key(keys) is None:
            raise ValueError(f"the weights are a {owner.label} drafter's ({owner.own_key(keys)}), but the config "
                             f"says {said.label}: set {owner.how_to_say()}") from None
        raise


def layout_keys(config: Any, family: str | None = None) -> set[str]:
    """The weight names of a ``family`` drafter (default: the config's) with ``config``'s layers and widths."""
    data = config_dict(config)
    fam = family_named(family) if family else family_of(data)
    with torch.device("meta"):
        return set(fam.build(fam.relabel(data)).state_dict())


def layouts(config: Any) -> dict[str, set[str]]:
    """``layout_keys`` of every family whose layout ``config``'s format gives: what a strict load compares a
    checkpoint's keys with."""
    out = {}
    for f in families():
        try:
            out[f.name] = layout_keys(config, f.name)
        except (ValueError, KeyError, TypeError):  # a family of another config format
            continue
    return out


def published_spelling(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every family's keys as the published checkpoints spell them (``published_state``; DFlash 2:
    a live module's codebook embeddings), so every layout is compared in one spelling."""
    for f in families():
        state = f.published_state(state)
    return state


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict_strict`` naming the missing and unexpected keys of the closest family's layout."""
    load_state_dict_strict(model, state, source, lambda: layouts(model.config))


def adopt_module(module: nn.Module) -> nn.Module | None:
    """Our fast drafter sharing (not copying) the weights of a module in a registered family's layout (the
    reference classes, a training loop's own), or None."""
    for f in families():
        adopted = f.adopt(module)
        if adopted is not None:
            return adopted
    return None


def cache_needs(drafter: Any, spec: DrafterSpec | None = None) -> CacheNeeds:
    """What ``drafter`` (of ``spec``, default its own) reads from a cache, as its family declares it: what
    ``StateCache.check_fit`` checks, the one fit check of every tool and loop."""
    spec = spec or spec_of(drafter)
    return family_named(spec.family).cache_needs(spec, getattr(drafter, "config", None))


def proposer_for(spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
    """The proposer of ``spec.family`` for a drafter (``module``: its weights beyond the blocks; None for a plain
    callable) with the target's head ``lm_head``, its logits under ``mem_bytes``."""
    return family_named(spec.family).proposer(spec, module, lm_head, mem_bytes, embed)


def _listed(keys: list[str]) -> str:
    return f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"


def load_state_dict_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str,
                           layouts: dict[str, set[str]] | Callable[[], dict[str, set[str]]] | None = None) -> None:
    """Load ``state`` into ``model`` when its keys and shapes are exactly the model's; else a ValueError naming
    the missing and unexpected keys of the closest layout: the model's own, or one of ``layouts`` (the key
    names of the other families for the same config, ``layouts``), whichever differs least. ``layouts`` may be a
    function giving them: it is called only then (``load_weights``: building them takes a module per family)."""
    spec = getattr(model, "spec", None)
    own = family_named(spec.family if spec is not None else default_family().name)
    state = own.published_state(state)  # the family's key spellings (DFlash 2's codebooks, early heads' names)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        best, best_missing, best_unexpected = own, missing, unexpected
        for name, keys in (layouts() if callable(layouts) else layouts or {}).items():
            m, u = sorted(keys - set(state)), sorted(set(state) - keys)
            if name != own.name and len(m) + len(u) < len(best_missing) + len(best_unexpected):
                best, best_missing, best_unexpected = family_named(name), m, u
        if best is own:
            raise ValueError(f"{source}: drafter weights do not match the {own.label} layout: "
                             f"missing {_listed(missing)}, unexpected {_listed(unexpected)}")
        said = f"the config says {own.label}"
        if not best_missing and not best_unexpected:
            raise ValueError(f"{source}: the weights are a {best.label} drafter's, but {said}: set "
                             f"{best.how_to_say()} in its config.json")
        raise ValueError(f"{source}: drafter weights fit no family's layout; the closest is {best.label} "
                         f"({said}): missing {_listed(best_missing)}, unexpected {_listed(best_unexpected)}")
    for k, v in state.items():
        want = model.state_dict()[k].shape
        if tuple(v.shape) != tuple(want):
            hint = ""
            if k == "fc.weight" and spec is not None and v.shape[1] % spec.target_hidden_size == 0:
                layers = v.shape[1] // spec.target_hidden_size  # fc reads one hidden state per target layer
                hint = (f": the weights read {layers} target layer(s), the config's target_layer_ids "
                        f"{list(spec.target_layer_ids)} name {len(spec.target_layer_ids)}; set "
                        "dflash_config.target_layer_ids to the layers the drafter was trained on")
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, the config implies {tuple(want)}{hint}")
    model.load_state_dict(state, strict=True)
