"""Every dotted reference a docstring or comment of the package cites (``module.name``, ``Class.attribute``) names
something that exists: a module of the package (by its last names, as the docs cite them) and its attribute, or a
class of the package and its attribute. A reference whose first name is a module this package once had
(``dflash_cb.old_paths``) and has no longer is stale too. Names of variables (``config.block_size``) and of other
packages are not checked: they are not ours to resolve."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cb"
CITED = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?``")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, str]:
    return {_module_name(p): str(p) for p in PACKAGE.rglob("*.py")}


@functools.cache
def _classes() -> dict[str, list[str]]:
    """Top-level class name -> the modules defining it."""
    out: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(Path(path).read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(name)
    return out


def _old_module_names() -> set[str]:
    from dflash_cb.old_paths import MODULES

    return {old.rsplit(".", 1)[-1] for old in MODULES}


_MISSING = object()
FILE_SUFFIXES = {"json", "jsonl", "py", "md", "png", "safetensors", "yaml", "yml", "csv", "txt", "final", "pt", "bin"}


@functools.cache
def _assigned(module: str, klass: str) -> frozenset[str]:
    """Attributes a class of the package sets on its instances (``self.name = ...`` in any method)."""
    tree = ast.parse(Path(_modules()[module]).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == klass:
            return frozenset(t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
    return frozenset()


def _has(obj: object, name: str) -> object:
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, type):
        for klass in obj.__mro__:  # a dataclass field, an annotated attribute, one set in a method
            if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__dataclass_fields__", {}):
                return object()
            if klass.__module__ in _modules() and name in _assigned(klass.__module__, klass.__name__):
                return object()
    if hasattr(obj, "__path__"):  # a package: its submodule
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            return _MISSING
    return _MISSING


def _resolves(base: object, rest: list[str]) -> bool:
    obj = base
    for name in rest:
        obj = _has(obj, name)
        if obj is _MISSING:
            return False
    return True


def _an_instance_attribute(rest: list[str]) -> bool:
    """``rest`` resolves on some class of the package: ``limits.head_bytes`` names a ``MemoryLimits``'."""
    for name, modules in _classes().items():
        for m in modules:
            if _resolves(getattr(importlib.import_module(m), name), rest):
                return True
    return False


@functools.cache
def _outside(first: str) -> bool:
    """``first`` is another package (``dflash.model.DFlashDraftModel`` is the reference package's)."""
    try:
        return importlib.util.find_spec(first) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _check(ref: str) -> str | None:
    """None when ``ref`` resolves or is not ours to resolve; else why not."""
    parts = ref.split(".")
    if parts[-1] in FILE_SUFFIXES:  # a file name
        return None
    if parts[0] == "dflash_cb":
        return None if _resolves(importlib.import_module("dflash_cb"), parts[1:]) else "no such name"
    if _outside(parts[0]):
        return None  # another package's name (``dflash.model.DFlashDraftModel``: the reference package's)
    modules = _modules()
    # The longest tail of a module path the reference starts with: ``replay.engine.evaluate``, ``engine.evaluate``.
    for k in range(len(parts) - 1, 0, -1):
        tail = ".".join(parts[:k])
        found = [m for m in modules if m == f"dflash_cb.{tail}" or m.endswith(f".{tail}")]
        if found:
            if any(_resolves(importlib.import_module(m), parts[k:]) for m in found):
                return None
            if k == 1 and _an_instance_attribute(parts[1:]):
                return None  # a variable named like a module (``limits``, ``spec``), or another package's module
            return f"not in {', '.join(found)}"
    if parts[0] in _classes():
        owners = _classes()[parts[0]]
        if any(_resolves(getattr(importlib.import_module(m), parts[0]), parts[1:]) for m in owners):
            return None
        return f"{parts[0]} ({', '.join(owners)}) has no {'.'.join(parts[1:])}"
    if parts[0] in _old_module_names():
        return f"{parts[0]} is a module this package no longer has (dflash_cb.old_paths)"
    return None  # a variable's attribute or another package's name


def _cited(path: Path) -> list[tuple[int, str]]:
    """(line, reference) of every ``dotted.name`` in the module's docstrings and comments."""
    text = path.read_text()
    found: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            if tok.type == tokenize.STRING and not tok.string.lstrip("rbuRBU").startswith(('"""', "'''", "#")):
                if "``" not in tok.string:
                    continue
            for m in CITED.finditer(tok.string):
                found.append((tok.start[0] + tok.string[:m.start()].count("\n"), m.group(1)))
    return found


@pytest.mark.parametrize("layer", ["common", "cache", "core", "integrations", "demo"])
def test_every_dotted_reference_names_what_exists(layer: str) -> None:
    stale = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, ref in _cited(path):
            why = _check(ref)
            if why:
                stale.append(f"{path.relative_to(PACKAGE.parent)}:{line} ``{ref}``: {why}")
    assert not stale, f"{len(stale)} stale references:\n" + "\n".join(stale)


def test_the_check_catches_a_stale_reference() -> None:
    assert _check("engine.evaluate") is None
    assert _check("replay.engine.evaluate") is None
    assert _check("EvalReport.counts_at") is None
    assert _check("DrafterSpec.family") is None  # a dataclass field
    assert _check("engine._Walks") is not None  # the class moved to walks.py
    assert _check("cost.COST_GROUPS") is not None  # core/cost.py is costs/evaluation.py now
    assert _check("config.block_size") is None  # a variable: not ours to resolve
