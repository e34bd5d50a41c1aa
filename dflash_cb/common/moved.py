"""Old module paths kept importable for a release after a move, each with a ``DeprecationWarning`` naming the new one.

Two cases, one warning text:

- a module that moved (``dflash_cb.integrations.specforge`` -> ``dflash_cb.integrations.loops.specforge``): a
  finder, first on ``sys.meta_path``, answers only for the old names it is given and hands back the new module
  itself (no copy: ``old.attach is new.attach``);
- a module that became a package of the same name (``dflash_cb.core.checkpoints``): the package's
  ``__getattr__`` (:func:`names_from`) serves the names that used to live in it from the module that holds them now.

This module knows no paths: the table of moved modules is ``dflash_cb/old_paths.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def _warn(old: str, new: str) -> None:
    # stacklevel 3, the caller's caller: the warnings module skips importlib's own frames, so the warning points
    # at the user's ``import`` line (shown by default when that line is in ``__main__``).
    warnings.warn(f"{old} moved to {new}: import it from there ({old} goes away in the next release)",
                  DeprecationWarning, stacklevel=3)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds each old module name and loads it as the module it became."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        _warn(fullname, self.moved[fullname])
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.moved[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module is already executed


def install(moved: Mapping[str, str]) -> None:
    """Serve each old module name of ``moved`` (old -> new) as its new module, once per process."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules(moved))  # first: an old name is never a file, so nothing is shadowed


def names_from(package: str, module: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` serving the public names of ``module``, which the package used to be."""

    def __getattr__(name: str) -> Any:
        value = None if name.startswith("_") else getattr(importlib.import_module(module), name, None)
        if value is None or isinstance(value, ModuleType):  # a submodule's name: the import system loads it
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{module}.{name}")
        setattr(sys.modules[package], name, value)  # warned once: ``from package import name`` asks twice
        return value

    return __getattr__
