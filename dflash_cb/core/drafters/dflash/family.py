"""DFlash (docs/method.md): a block drafter over the target's layer outputs, drafting the head's argmax."""

from __future__ import annotations

from torch import nn

from ..block.kind import BackboneFamily, HeadOnBackboneFamily


class DFlashFamily(BackboneFamily):
    """DFlash's published format (``DFlashDraftModel``): the block backbone as it is, drafting the head's argmax."""

    name = "dflash"
    label = "DFlash"
    architecture = "DFlashDraftModel"

    def module_class(self) -> type[nn.Module]:
        from .model import DFlashDrafter

        return DFlashDrafter


# Where the block kind's family bases were before they moved to ``block/kind.py``.
__all__ = ["FAMILY", "DFlashFamily", "HeadOnBackboneFamily"]

FAMILY = DFlashFamily()
