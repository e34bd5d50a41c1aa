"""DFlash's published module: the block backbone (``block.drafter.BlockDrafter``) as it is, under its family's name.

Weight names, config fields and numerics follow the reference ``dflash.model.DFlashDraftModel``, so a folder saved
here loads there and vice versa. The backbone's parts lived here before the block kind's shared parts moved to
``block/``: their names import from here too.
"""

from __future__ import annotations

from typing import ClassVar

from ..block.attention import (
    MASKS,
    BlockAttention,
    BlockDecoderLayer,
    ContextKV,
    DeferredBlocks,
    attention_reach,
    specforge_mask_difference,
    specforge_reach,
    visible,
)
from ..block.drafter import BlockDrafter

# The backbone's parts under the names they had here.
DFlashAttention, DFlashDecoderLayer = BlockAttention, BlockDecoderLayer


class DFlashDrafter(BlockDrafter):
    """DFlash drafter: ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``; no vocabulary matrices."""

    family: ClassVar[str] = "dflash"


__all__ = ["MASKS", "ContextKV", "DFlashAttention", "DFlashDecoderLayer", "DFlashDrafter", "DeferredBlocks",
           "attention_reach", "specforge_mask_difference", "specforge_reach", "visible"]
