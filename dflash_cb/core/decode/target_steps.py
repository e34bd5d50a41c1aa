"""The target as a speculative server steps it: one K/V cache, a prefill, verify passes over a block or a tree,
and the cache cut back to what a cycle accepted."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...common.errors import DFlashCBError


class DecodeError(DFlashCBError, ValueError):
    """A model the speed check's loops cannot step (said before any work)."""


@dataclass
class Verified:
    """What one target pass gives the loop: the argmax at every input position (the target's next token there)
    and the drafter's target-layer features of those positions [n, F]."""

    argmax: list[int]
    features: torch.Tensor


def check_croppable(model: nn.Module, where: str = "--target") -> None:
    """Refuse a target whose cache cannot be cut back to an accepted prefix (linear-attention layers keep one
    recurrent state, not one entry per token), before any work."""
    text = getattr(model.config, "text_config", None) or model.config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        raise DecodeError(f"{where}: layers of kind {', '.join(other)} keep a recurrent state that a rejected draft "
                          "would have to be rolled out of; the speed check's loops cut K/V caches only (a target of "
                          "full or sliding attention). Check such a target's speed against its server "
                          "(docs/serving.md, \"Checking a projection\")")


class TargetSteps:
    """The target's K/V cache over the committed tokens; ``length`` positions are held.

    ``timing_only``: a target whose layers keep a recurrent state is stepped too, its recurrent layers left as they
    are by ``keep`` (a cost profile times the calls and throws the cache away; a decode needs ``check_croppable``)."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], timing_only: bool = False):
        from transformers import DynamicCache

        if not timing_only:
            check_croppable(model)
        self.model, self.layer_ids = model, [int(i) for i in layer_ids]
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.device = next(model.parameters()).device
        # transformers 5 names the cache argument ``cache`` (``past_key_values`` before, deprecated since).
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, tokens: Sequence[int], depths: Sequence[int] | None = None,
                parents: Sequence[int] | None = None) -> Verified:
        """One pass over ``tokens`` after the cached ones: a run of consecutive tokens, or (``parents``) a tree
        whose token i sits at depth ``depths[i]`` below the first and sees only its ancestors."""
        n = len(tokens)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        step = torch.arange(n) if depths is None else torch.tensor(list(depths))
        positions = (self.length + step).to(self.device)[None]
        mask = None
        if parents is not None:
            allow = torch.zeros(n, self.length + n, dtype=torch.bool)
            allow[:, :self.length] = True
            for i in range(n):
                j = i
                while j >= 0:
                    allow[i, self.length + j] = True
                    j = parents[j]
            mask = allow[None, None].to(self.device)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         output_hidden_states=True, **{self._cache_arg: self.cache})
        self.length += n
        hs = out.hidden_states  # hidden_states[i + 1]: decoder layer i's output (the last one final-normed)
        feats = torch.cat([hs[i + 1][0] for i in self.layer_ids], dim=-1)
        return Verified(out.logits[0].argmax(-1).tolist(), feats)

    def keep(self, length: int, extra: Sequence[int] = ()) -> None:
        """Keep the first ``length`` cached positions and then the entries ``extra`` (cache indices, in order):
        a block's accepted prefix, or a tree's accepted path."""
        # The layers' tensors are cut directly: ``DynamicCache.crop``'s argument changed meaning across
        # transformers releases (a length, then a count to remove).
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None:  # a recurrent layer (timing only) or one not filled yet
                continue
            if extra:
                idx = torch.tensor(list(range(length)) + list(extra), device=self.device)
                layer.keys, layer.values = layer.keys.index_select(2, idx), layer.values.index_select(2, idx)
            else:
                layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
        self.length = length + len(extra)
