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


def _layer_sections(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The sections of a drafter config that name its target layers: a top-level ``*_config`` mapping holding a
    ``*layer_ids`` field (the block format's ``dflash_config``; SpecForge's drafters keep theirs likewise). Their
    ids are layer outputs, as a cache's; a family with another convention reads its own (its ``spec``)."""
    return [v for k, v in config.items() if isinstance(k, str) and k.endswith("_config") and isinstance(v, Mapping)
            and any(isinstance(f, str) and f.endswith("layer_ids") for f in v)]


def is_drafter_config(config: Any) -> bool:
    """Whether a ``config.json`` (a dict) is a drafter's rather than a model's: the published drafter formats
    carry ``dflash_config`` (the block format) or another section naming target layers (``_layer_sections``), or
    name a drafter family (``drafter_family``)."""
    return isinstance(config, Mapping) and (isinstance(config.get("dflash_config"), Mapping)
                                            or bool(_layer_sections(config))
                                            or isinstance(config.get("drafter_family"), str))


def config_layer_ids(config: Mapping[str, Any]) -> Any:
    """The target layer ids a drafter ``config.json`` names (``dflash_config`` wins over the top level, which wins
    over another section's ``*layer_ids``: ``_layer_sections``), as written (None when it names none): the
    precompute plans its layers from this."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    sections = _layer_sections(config) if ids is None else []
    if sections:
        ids = next(v for f, v in sections[0].items() if isinstance(f, str) and f.endswith("layer_ids"))
    return ids
