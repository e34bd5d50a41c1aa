"""The drafter families this package runs (DFlash, DFlash 2) and what a config says about which one it is.

No torch here: the cost model reads it as well as the drafter classes (docs/method.md, "DFlash 2").
"""

from __future__ import annotations

from typing import Any, Literal

# The drafter families this package runs, and the ``architectures`` name of each in a published config.
Family = Literal["dflash", "dflash2"]
FAMILIES: tuple[Family, ...] = ("dflash", "dflash2")
ARCHITECTURE_FAMILY: dict[str, Family] = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
FAMILY_ARCHITECTURE: dict[Family, str] = {f: a for a, f in ARCHITECTURE_FAMILY.items()}
FAMILY_LABEL: dict[Family, str] = {"dflash": "DFlash", "dflash2": "DFlash 2"}
# The ``dflash_config`` fields a DFlash 2 drafter needs besides DFlash's (docs/method.md, "DFlash 2").
DFLASH2_FIELDS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")


def config_family(config: Any) -> Family | None:
    """The family a drafter config (an object or a ``config.json`` dict) says it is: its ``architectures``
    when they name one of ``ARCHITECTURE_FAMILY``, else "dflash2" when ``dflash_config`` carries a DFlash 2
    field; None when it says nothing (the keys of the weights then decide: ``drafters.drafter_family``)."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    for name in get("architectures", None) or ():
        if name in ARCHITECTURE_FAMILY:
            return ARCHITECTURE_FAMILY[name]
    cfg = get("dflash_config", None) or {}
    if any(f in cfg or get(f, None) is not None for f in DFLASH2_FIELDS):
        return "dflash2"
    return None
