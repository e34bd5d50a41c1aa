"""Layer 4, the CPU demo: the synthetic language, the demo's Lightning training module and the
end-to-end run behind ``tools/demo.py``. Imports any layer below.

This package was once the module ``dflash_cb/demo.py``, whose names are in ``dflash_cb.demo.demo`` now: until the
next release they import from here too, with a ``DeprecationWarning``."""

from ..common.moved import names_from

__getattr__ = names_from(__name__, "dflash_cb.demo.demo")
