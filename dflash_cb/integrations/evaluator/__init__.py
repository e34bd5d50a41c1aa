"""Evaluator: the live evaluator, its session, ranks and publishing.

This package was once the module ``dflash_cb/integrations/evaluator.py``, whose names are in ``dflash_cb.integrations.evaluator.live`` now: until the next release they
import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.integrations.evaluator.live")
