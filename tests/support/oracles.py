"""The test oracles (reference implementations the tests compare against), imported or failed loudly.

A missing oracle is an error, never a skip: a suite that passes without them has checked nothing
against the reference. ``python dev.py test`` installs them (``ORACLE_PINS`` in dev.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"test oracle {module!r} is not importable ({e}); `python dev.py test` installs the "
                          "oracles (ORACLE_PINS in dev.py)") from e
