"""The package is layered: each folder of ``dflash_cb/`` imports only from its own layer and the layers below.

common -> cache -> core -> integrations -> demo (see the README's *Repository* section). The check
reads every module's imports (module level and inside functions) from its source, so a lazy import
that climbs a layer is caught too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cb"
LAYERS = ("common", "cache", "core", "integrations", "demo")


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per session: the checks below read every module, several times."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _imports(path: Path) -> frozenset[str]:
    """Absolute names of the dflash_cb modules ``path`` imports."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        package = module.removesuffix(".__init__")
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            else:
                names = [node.module or ""]
            out.update(n for n in names if n == "dflash_cb" or n.startswith("dflash_cb."))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("dflash_cb"))
    return frozenset(out)


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


# Outside every layer, beside the root's re-exports: the table of last release's module paths (old -> new), which
# may name a module of any layer; ``common/moved.py`` serves them and knows no path (tests/test_old_paths.py).
OUTSIDE_LAYERS = ("old_paths.py",)


def test_the_folders_are_the_layers():
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith("__") and p.name not in OUTSIDE_LAYERS)
    assert top == sorted(LAYERS), top  # every module lives in a layer folder; only __init__ (and the table) at the top


def test_no_module_imports_from_a_layer_above_its_own():
    climbing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _layer(".".join(path.relative_to(PACKAGE.parent).parts))
        if own is None:  # dflash_cb/__init__.py: lazy re-exports of the public names
            continue
        for name in sorted(_imports(path)):
            theirs = _layer(name)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(own):
                climbing.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({own} < {theirs})")
    assert not climbing, "\n".join(climbing)


# The integrations' own layers, lowest first: the trackers and their sinks (W&B charts and panels among them);
# the live evaluator; the training loops' adapters; the command-line tools.
INTEGRATION_LAYERS = ("tracking", "evaluator", "loops", "cli")


def test_integrations_are_their_layers_and_none_imports_a_layer_above_its_own():
    folder = PACKAGE / "integrations"
    top = sorted(p.name for p in folder.iterdir() if not p.name.startswith("__"))
    assert top == sorted(INTEGRATION_LAYERS), top

    def layer(name: str) -> str | None:
        parts = name.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "integrations" and parts[2] in INTEGRATION_LAYERS else None

    climbing = []
    for path in sorted(folder.rglob("*.py")):
        own = layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for name in sorted(_imports(path)):
            theirs = layer(name)
            if own and theirs and INTEGRATION_LAYERS.index(theirs) > INTEGRATION_LAYERS.index(own):
                climbing.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({own} < {theirs})")
    assert not climbing, "\n".join(climbing)


# The core's own layers, lowest first: the loop's pure arithmetic; the drafter families (models, runners,
# proposers); the figures (names, counts, intervals); the replay; real decoding (the speed check's loops); then
# checkpoints, costs and results.
CORE_LAYERS = ("loop", "drafters", "figures", "replay", "decode", "checkpoints", "costs", "results")


def _core_layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "core" and parts[2] in CORE_LAYERS else None


def test_core_is_its_layers_and_none_imports_a_layer_above_its_own():
    core = PACKAGE / "core"
    top = sorted(p.name for p in core.iterdir() if not p.name.startswith("__"))
    assert top == sorted(CORE_LAYERS), top  # no module loose in core/: each lives in its layer
    climbing = []
    for path in sorted(core.rglob("*.py")):
        own = _core_layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if own is None:
            continue
        for name in sorted(_imports(path)):
            theirs = _core_layer(name)
            if theirs is not None and CORE_LAYERS.index(theirs) > CORE_LAYERS.index(own):
                climbing.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({own} < {theirs})")
    assert not climbing, "\n".join(climbing)


def test_no_module_climbs_to_the_package_root():
    """The root only re-exports the public names: a module reading one of them from it (``__version__``) would
    import every layer's exports."""
    climbing = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py"))
                if p != PACKAGE / "__init__.py" and "dflash_cb" in _imports(p)]
    assert not climbing, climbing


def test_no_command_line_main_lives_in_core():
    """Command-line tools are integrations: core holds what they call."""
    mains = [str(p.relative_to(PACKAGE.parent)) for p in sorted((PACKAGE / "core").rglob("*.py"))
             if "argparse" in p.read_text() or "def main(" in p.read_text()]
    assert not mains, mains


def _family_words() -> dict[str, str]:
    """Every word that is one family's own -> the family: its name, label and architecture, its config's own
    fields and its figures' own key prefixes (a prefix every drafter logs under, ``specforge/``, is no family's)."""
    from dflash_cb.core.drafters.registry import families
    from dflash_cb.core.figures.metrics import KEY_NAMESPACES

    words: dict[str, str] = {}
    for f in families():
        prefixes = [n for n in f.figures.namespaces() if n not in KEY_NAMESPACES]
        for word in (f.name, f.label, f.architecture, *f.config_fields, *prefixes):
            words.setdefault(word, f.name)
    return words


def test_no_generic_module_names_a_drafter_family():
    """A family lives in its folder (core/drafters/<family>/): outside it no module names a family by a word of
    its own (its name, label, architecture, config fields, figure prefixes) or imports a family's folder, except
    the public re-exports of the drafter classes; and no family's folder imports a sibling's (the shared parts
    of each kind live beside them: ``drafters/block/``, ``drafters/chain.py``)."""
    families = sorted(p.name for p in (PACKAGE / "core" / "drafters").iterdir()
                      if p.is_dir() and (p / "family.py").exists())
    assert {"dflash", "dflash2"} <= set(families)
    words = _family_words()
    assert set(families) <= set(words)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[2] if rel.parts[:2] == ("core", "drafters") and len(rel.parts) > 3 else None
        for name in _imports(path):
            parts = name.split(".")
            if parts[1:3] == ["core", "drafters"] and len(parts) > 3 and parts[3] in families and parts[3] != own \
                    and rel.parts != ("__init__.py",):
                found.append(f"{rel} imports {name}")
        if own in families or rel.parts == ("__init__.py",):
            continue  # the family's own folder; the public names (DFlashDrafter, DFlash2Drafter)
        for node in ast.walk(_tree(path)):
            # A family's word as a value (a comparison, a default): the one default is drafters/spec.py's
            # DEFAULT_FAMILY; SpecForge's own strategy name "dflash" is SpecForge's, not a family of ours.
            if isinstance(node, ast.Constant) and node.value in words and rel.as_posix() not in (
                    "core/drafters/spec.py", "integrations/loops/specforge_data.py"):
                found.append(f"{rel}:{node.lineno} names {node.value!r}, the {words[node.value]} family's")
    assert not found, "\n".join(found)


def test_the_public_names_still_import_from_the_package():
    import dflash_cb

    for name in dflash_cb.__all__:
        assert getattr(dflash_cb, name) is not None, name


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package (the root's lazy re-exports aside) -> the modules it imports."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    del modules["dflash_cb"]

    def module_of(name: str) -> str:  # ``pkg.module.attribute`` -> ``pkg.module``
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {m: {module_of(n) for n in _imports(p)} - {m, ""} for m, p in modules.items()}


def test_no_import_circles():
    """No module imports, directly or through others, a module that imports it back (lazy imports
    count): a shared name belongs in a module both can import."""
    graph = _module_graph()
    circles = []
    for start in sorted(graph):
        path, seen = [start], set()
        stack = [iter(sorted(graph[start]))]
        while stack:  # depth-first from ``start``, looking for ``start`` again
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt == start:
                circles.append(" -> ".join([*path, start]))
                break
            elif nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    assert not circles, "\n".join(circles)


@pytest.mark.e2e  # a subprocess (the fast subset leaves those out)
def test_the_public_api_is_what_a_user_imports():
    """``dflash_cb`` exports the adapters, the evaluator and its config, the sink interface, the offline API and
    the metric names, each resolving to the object of its module; importing the package pulls in neither
    Lightning, transformers' Trainer nor W&B."""
    import subprocess
    import sys

    import dflash_cb
    from dflash_cb import TAU_KEY, metric_key
    from dflash_cb.integrations.loops.lightning import DFlashEvalCallback
    from dflash_cb.integrations.loops.specforge import attach

    assert sorted(dflash_cb.__all__) == sorted([*dflash_cb._EXPORTS, "__version__"])
    for name in dflash_cb.__all__:
        assert getattr(dflash_cb, name) is not None, name
    assert dflash_cb.DFlashEvalCallback is DFlashEvalCallback and dflash_cb.attach_specforge is attach
    assert TAU_KEY == "dflash_eval/tau" == metric_key("tau") and metric_key("tau", "x/") == "x/tau"
    code = ("import sys, dflash_cb; dflash_cb.TAU_KEY; dflash_cb.EvalConfig; "
            "print(sorted(m for m in ('lightning', 'wandb', 'transformers.trainer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
