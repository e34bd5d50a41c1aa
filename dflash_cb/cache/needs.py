"""What a drafter needs from a cache, and whether a cache has it: the one place a drafter is fitted to a cache.

A drafter family declares its needs (``core/drafters/base.py``, ``DrafterFamily.cache_needs``): the target
layers it reads and which state each is, the target's widths, a filler token if it drafts with one, target
weights beyond the embedding and head. ``StateCache.check_fit`` compares them with the manifest and names
every field that differs and the drafter's family, never a family of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .manifest import Manifest

# The state a cache holds for each captured layer: the layer's output, before any final norm
# (``hidden_states[i + 1]`` of a transformers forward), docs/method.md "Cached states".
LAYER_OUTPUT = "layer_output"


@dataclass(frozen=True)
class CacheNeeds:
    """What one drafter reads from a cache. ``family``: its family's label, for messages."""

    family: str
    layer_ids: tuple[int, ...]
    target_hidden_size: int | None = None
    vocab_size: int | None = None
    num_target_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    state: str = LAYER_OUTPUT  # which state of each layer (``LAYER_OUTPUT``: what every cache holds)
    # Target weights beyond the embedding and the head, by name prefix (a chain drafter's ``mtp.``).
    target_weights: tuple[str, ...] = ()


def fit_problems(manifest: Manifest, needs: CacheNeeds) -> list[str]:
    """Every way ``needs`` does not fit the cache of ``manifest``, one line each (empty: it fits)."""
    m, who = manifest, "the drafter"
    problems = []
    missing = list(dict.fromkeys(i for i in needs.layer_ids if i not in m.layer_ids))
    if missing:  # a cache may hold more layers than a drafter reads (one cache for several drafters)
        problems.append(f"target_layer_ids: {who} reads layers {list(needs.layer_ids)}; the cache holds "
                        f"{m.layer_ids}, without {missing}")
    if needs.state != LAYER_OUTPUT:
        problems.append(f"state: {who} reads each layer's {needs.state}; the cache holds layer outputs")
    if needs.target_hidden_size is not None and int(needs.target_hidden_size) != m.hidden_size:
        problems.append(f"target hidden size: {who} expects {needs.target_hidden_size}, cache has {m.hidden_size}")
    if needs.vocab_size is not None and int(needs.vocab_size) != m.vocab_size:
        problems.append(f"vocab_size: {who} {needs.vocab_size}, cache target {m.vocab_size}")
    n_target = m.target.get("num_layers")
    if needs.num_target_layers is not None and n_target is not None and int(needs.num_target_layers) != int(n_target):
        problems.append(f"num_target_layers: drafter was made for a {needs.num_target_layers}-layer target, "
                        f"the cache's target has {n_target}")
    if needs.block_size is not None and int(needs.block_size) < 2:
        problems.append(f"block_size: {who} {needs.block_size}, must be at least 2")
    if needs.mask_token_id is not None and not 0 <= int(needs.mask_token_id) < m.vocab_size:
        problems.append(f"mask_token_id: drafter {needs.mask_token_id} is outside the cache target's vocab "
                        f"[0, {m.vocab_size})")
    exported = set((m.target_head or {}).get("extra_weights") or ())
    for prefix in needs.target_weights:
        if not any(name.startswith(prefix) for name in exported):
            problems.append(f"target weights: {who} reads the target's {prefix}* weights; the cache exports the "
                            "embedding and head only")
    return problems


# Where SpecForge's EAGLE-3 drafter config names its target layers (SGLang's ids: layer outputs, as ours).
EAGLE_CONFIG = "eagle_config"
EAGLE_LAYERS = "eagle_aux_hidden_state_layer_ids"


def is_drafter_config(config: Any) -> bool:
    """Whether a ``config.json`` (a dict) is a drafter's rather than a model's: the published drafter formats
    carry ``dflash_config`` (block drafters) or ``eagle_config`` (SpecForge's EAGLE-3), or name a drafter family
    (``drafter_family``)."""
    return isinstance(config, Mapping) and (isinstance(config.get("dflash_config"), Mapping)
                                            or isinstance(config.get(EAGLE_CONFIG), Mapping)
                                            or isinstance(config.get("drafter_family"), str))


def config_layer_ids(config: Mapping[str, Any]) -> Any:
    """The target layer ids a drafter ``config.json`` names (``dflash_config`` wins over the top level; SpecForge's
    EAGLE-3 names them in ``eagle_config``), as written (None when it names none): the precompute plans its
    layers from this."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    if ids is None and isinstance(config.get(EAGLE_CONFIG), Mapping):
        ids = config[EAGLE_CONFIG].get(EAGLE_LAYERS)
    return ids
