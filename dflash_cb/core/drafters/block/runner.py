"""How the replay drives the block backbone's drafters: ``FastRunner`` (our module: a wave's context K/V in a few
batched projections, blocks of many samples per pass) and ``PerAnchorRunner`` (any callable with the published
drafter's forward signature, one call per anchor, as the reference loop makes them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ...loop.limits import DEFAULT_LIMITS, MemoryLimits
from ..runners import DraftRunner, HiddenBlocks
from ..spec import DrafterSpec
from .attention import ContextKV, DeferredBlocks, specforge_mask_difference
from .drafter import BlockDrafter


class FastRunner(DraftRunner):
    """Our ``BlockDrafter`` (and every module on its backbone): a wave's context K/V in a few batched projections, blocks of many samples per pass."""

    has_specforge_masks = True

    def __init__(self, drafter: BlockDrafter, limits: MemoryLimits = DEFAULT_LIMITS):
        self.drafter = self.module = drafter
        self.spec = drafter.spec
        self.limits = limits

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    def context(self, features: Iterable[torch.Tensor], rows: Sequence[int]) -> ContextKV:
        # Features are projected in batches no larger than an attention call's temporaries.
        return self.drafter.stream_context(features, rows, batch_bytes=self.limits.attn_bytes)

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.drafter.context_bytes_per_token(dtype)

    def extend(self, context: ContextKV, features: torch.Tensor) -> ContextKV:
        return self.drafter.extend_context(context, features)

    def block_rows(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   samples: torch.Tensor, lengths: torch.Tensor | None = None) -> DeferredBlocks:
        # The last layer's o_proj, MLP and norms run later, on the positions read.
        return self.drafter.block_rows(context, noise_embedding, anchors, samples, lengths, self.limits.attn_bytes)

    def specforge_difference(self, block_size: int) -> str | None:
        return self.drafter.specforge_difference(block_size)

    def specforge_rows(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       samples: torch.Tensor) -> DeferredBlocks:
        return self.drafter.block_rows(context, noise_embedding, anchors, samples, None, self.limits.attn_bytes,
                                       masks="specforge")


class PerAnchorRunner(DraftRunner):
    """Any module or function with the forward signature of dflash's own drafter (``DFlashDraftModel``)
    ``f(target_hidden=[1, p, F], noise_embedding=[1, L, H], position_ids=[1, p + L]) -> [1, L, H]``.

    One call per anchor, as dflash's ``dflash_generate`` makes them: exact for any implementation, not fast.
    Its wave state is the samples' context features themselves.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], spec: DrafterSpec, dtype: torch.dtype | None = None):
        self.fn = self.module = fn
        self.spec = spec
        self._dtype = dtype or torch.float32

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def context(self, features: Iterable[torch.Tensor], rows: Sequence[int]) -> list[torch.Tensor]:
        return list(features)

    def specforge_difference(self, block_size: int) -> str | None:
        config = getattr(self.fn, "config", None)
        return None if config is None else specforge_mask_difference(config, block_size)

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        # The state is the context features themselves, stored in the runner's dtype (not ``dtype``).
        features = len(self.spec.target_layer_ids) * self.spec.target_hidden_size
        return tokens * features * self.dtype.itemsize

    def block_rows(self, context: list[torch.Tensor], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   samples: torch.Tensor, lengths: torch.Tensor | None = None) -> HiddenBlocks:
        n = noise_embedding.shape[1]
        out = noise_embedding.new_zeros(noise_embedding.shape)
        for i, (s, p) in enumerate(zip(samples.tolist(), anchors.tolist(), strict=True)):
            m = n if lengths is None else int(lengths[i])
            pos = torch.arange(p + m, device=noise_embedding.device)[None]
            h = self.fn(target_hidden=context[s][None, :p], noise_embedding=noise_embedding[i:i + 1, :m],
                        position_ids=pos)
            out[i, :m] = h[0, -m:]
        return HiddenBlocks(out)
