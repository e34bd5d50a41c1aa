"""DFlash (docs/method.md): the block backbone as published (``DFlashDraftModel``), drafting the target head's
argmax; its family (``family``) and module (``model``). The backbone itself is the block kind's (``drafters.block``)."""
