"""The drafter families this package runs, found as the trackers are: every folder here whose ``family.py``
defines ``FAMILY`` (a ``base.DrafterFamily``). A new family is a new folder; nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from .base import DrafterFamily
from .spec import DEFAULT_FAMILY, DrafterSpec


@cache
def families() -> tuple[DrafterFamily, ...]:
    """Every registered family, in folder-name order."""
    found = []
    here = str(Path(__file__).parent)
    for info in sorted(pkgutil.iter_modules([here]), key=lambda m: m.name):
        if not info.ispkg:
            continue
        try:
            module = importlib.import_module(f"{__package__}.{info.name}.family")
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.{info.name}.family":
                continue  # a helper package, not a family
            raise
        family = getattr(module, "FAMILY", None)
        if isinstance(family, DrafterFamily):
            found.append(family)
    return tuple(found)


def family_names() -> tuple[str, ...]:
    """The names ``results.json`` and ``DrafterSpec.family`` may hold."""
    return tuple(f.name for f in families())


def family_named(name: str) -> DrafterFamily:
    """The family called ``name``; a ValueError naming the registered ones otherwise."""
    for f in families():
        if f.name == name:
            return f
    raise ValueError(f"unknown drafter family {name!r}; registered: {', '.join(family_names())}")


def default_family() -> DrafterFamily:
    """The family of a published block-format config that names none."""
    return family_named(DEFAULT_FAMILY)


def family_said(config: Any) -> DrafterFamily | None:
    """The family ``config`` (an object or a ``config.json`` dict) says it is: its ``architectures``, else a
    field only one family's configs carry; None when it says nothing."""
    for f in families():
        if f.config_says(config):
            return f
    for f in families():
        if f.config_hints(config):
            return f
    return None


def family_of(config: Any, keys: Iterable[str] | None = None) -> DrafterFamily:
    """What a drafter is: what its config says (``family_said``), else the family a weight name in ``keys``
    belongs to, else the default family."""
    said = family_said(config)
    if said is not None:
        return said
    return key_family(keys) or default_family()


def key_family(keys: Iterable[str] | None) -> DrafterFamily | None:
    """The family a weight name in ``keys`` belongs to only (``DrafterFamily.own_key``), or None."""
    if keys is None:
        return None
    keys = list(keys)
    return next((f for f in families() if f.own_key(keys) is not None), None)


def spec_of(drafter: Any) -> DrafterSpec:
    """The spec of any drafter: its ``.spec`` if it has one, else the one its family builds from its ``.config``."""
    spec = getattr(drafter, "spec", None)
    if isinstance(spec, DrafterSpec):
        return spec
    config = getattr(drafter, "config", None)
    if config is None:
        raise TypeError(f"{type(drafter).__name__} has neither .spec nor a drafter .config, so its block size, "
                        "target layers and family are unknown: pass spec=DrafterSpec(...)")
    return spec_from_config(config)


def spec_from_config(config: Any) -> DrafterSpec:
    """The spec the family of ``config`` (``family_of``) builds from it."""
    return family_of(config).spec(config)
