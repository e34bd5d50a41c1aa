"""Drafters: one folder per family, the block and chain bases, the registry.

This package was once the module ``dflash_cb/core/drafters.py``, whose names are in ``dflash_cb.core.drafters.layouts`` now: until the next release they
import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.core.drafters.layouts")
