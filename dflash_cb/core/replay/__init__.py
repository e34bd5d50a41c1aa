"""Replay: the engine and its request.

This package was once the module ``dflash_cb/core/replay.py``, whose names are in ``dflash_cb.core.loop.cycles`` now: until the next release they
import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.core.loop.cycles")
