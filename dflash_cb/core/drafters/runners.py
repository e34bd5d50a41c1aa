"""How the replay drives a drafter: a runner builds a wave's drafter state from the cached context features and
runs blocks of many samples per call. The runner is the family's (``DrafterFamily.runner``; ``as_runner`` asks
every family), so the replay knows no drafter class, filler token or weight name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..loop.limits import DEFAULT_LIMITS, MemoryLimits
from .registry import families, family_named, spec_of
from .spec import DrafterSpec


class BlockRows(Protocol):
    """Drafter hidden states of a batch of blocks, read by (block, position) pairs (what the replay reads)."""

    def rows(self, block: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[..., hidden] at ``(block, position)`` (index tensors broadcast together)."""
        ...


class HiddenBlocks:
    """``BlockRows`` over finished hidden states [blocks, L, hidden]."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden

    def rows(self, block: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.hidden[block, position]


def block_embeddings(tokens: torch.Tensor, anchors: torch.Tensor, length: int, spec: DrafterSpec,
                     embed: torch.Tensor) -> torch.Tensor:
    """Input embeddings of blocks at ``anchors``: the verified token, then mask tokens."""
    ids = torch.full((anchors.numel(), length), spec.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[anchors]
    emb = torch.nn.functional.embedding(ids, embed)
    return emb * spec.input_embedding_scale if spec.input_embedding_scale != 1.0 else emb


class DraftRunner:
    """How the engine drives a drafter: a wave's drafter state from its samples' context features
    (``context``), then blocks of many samples per call (``block_rows``, read through ``BlockRows``)."""

    spec: DrafterSpec
    # Whether ``specforge_rows`` can run SpecForge's masks where they differ from the served ones.
    has_specforge_masks = False
    # The drafter's module, for what a family's proposer reads besides the blocks (DFlash 2's selector); None
    # for a plain callable.
    module: Any = None
    # Whether ``context`` reads each context row's next token besides its features (a chain drafter's row t
    # is fed the token at t + 1): each item of ``features`` is then (features [r, F], embeddings [r, H]) of
    # ``token_embeddings``.
    context_reads_tokens = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        """Where the drafter's weights are (the evaluation runs there unless told otherwise)."""
        p = next(self.module.parameters(), None) if isinstance(self.module, nn.Module) else None
        return p.device if p is not None else torch.device("cpu")

    def block_inputs(self, tokens: torch.Tensor, anchors: torch.Tensor, length: int,
                     embed: torch.Tensor) -> torch.Tensor:
        """Input embeddings of blocks at ``anchors`` [N, length, H] (flat positions into ``tokens``): the
        verified token, then the family's filler token (``DrafterSpec.mask_token_id``)."""
        return block_embeddings(tokens, anchors, length, self.spec, embed)

    def token_embeddings(self, ids: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ``ids`` (the target's ``embed`` unless the drafter has its own table)."""
        emb = torch.nn.functional.embedding(ids, embed)
        return emb * self.spec.input_embedding_scale if self.spec.input_embedding_scale != 1.0 else emb

    def context(self, features: Iterable[torch.Tensor], rows: Sequence[int]) -> Any:
        """The drafter state of a wave: sample ``s``'s context features [rows[s], F] (its positions
        0 .. rows[s] - 1) arrive one at a time, in wave order."""
        raise NotImplementedError

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Memory one sample's share of a wave's state of ``tokens`` positions holds (for evaluation waves)."""
        return 0

    def extend(self, context: Any, features: torch.Tensor) -> Any | None:
        """One sample's ``context`` with rows appended after its own (``features`` [r, F]: a serving loop's newly
        committed rows, ``decode.loops``), or None when this runner can only build a context whole."""
        return None

    def block_rows(self, context: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor, samples: torch.Tensor,
                   lengths: torch.Tensor | None = None) -> BlockRows:
        """Blocks [N, L]: block ``i`` anchored at ``anchors[i]`` over the context of wave sample ``samples[i]``
        (each sample's blocks next to each other); ``lengths`` [N] marks blocks shorter than L."""
        raise NotImplementedError

    def specforge_difference(self, block_size: int) -> str | None:
        """Why SpecForge 0.2.0 trains this drafter under other masks than it is served with at ``block_size``
        (None: the same masks, or nothing known of them; ``DrafterFamily.specforge_difference``)."""
        return None

    def specforge_rows(self, context: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       samples: torch.Tensor) -> BlockRows:
        """Full blocks under SpecForge's training masks (what its DFlash accuracy scores). A runner that cannot
        change its masks runs its own: the engine asks it only when they are SpecForge's (``has_specforge_masks``)."""
        return self.block_rows(context, noise_embedding, anchors, samples)


def as_runner(drafter: Any, spec: DrafterSpec | None = None, limits: MemoryLimits = DEFAULT_LIMITS) -> DraftRunner:
    """The fastest exact way to drive ``drafter``: a runner as it is; else the first family whose ``runner``
    takes it (our modules, a training loop's module in a family's layout); else a plain callable, driven per
    anchor by the family its ``spec`` (or ``.config``) names."""
    if isinstance(drafter, DraftRunner):
        return drafter
    for family in families():
        runner = family.runner(drafter, limits)
        if runner is not None:
            return runner
    spec = spec or spec_of(drafter)
    dtype = None
    if isinstance(drafter, nn.Module):
        p = next(drafter.parameters(), None)
        dtype = p.dtype if p is not None else None
    family = family_named(spec.family)
    runner = family.callable_runner(drafter, spec, dtype)
    if runner is None:
        raise TypeError(f"a {family.label} drafter is driven through its module; {type(drafter).__name__} is not "
                        f"one ({family.how_to_say()} in its config)")
    return runner
