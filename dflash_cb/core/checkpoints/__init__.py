"""Checkpoints: reading a drafter (``load``) and its checkpoint files (``files``).

This package was once the module ``dflash_cb/core/checkpoints.py``, whose names are in ``dflash_cb.core.checkpoints.load`` now: until the next release they
import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.core.checkpoints.load")
