"""Last release's module paths still import, each with a DeprecationWarning that names the new path.

``PUBLIC`` lists the names the docs taught, with the old path they were imported from (the docs of the package's
first layout, and of the layout before ``core/`` and ``integrations/`` were split into layers): each resolves to
the very object the package exports today.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import dflash_cb
from dflash_cb.old_paths import MODULES

PACKAGE = Path(dflash_cb.__file__).parent

# (old module, name) -> where the name lives now
PUBLIC = {
    ("dflash_cb.integrations.specforge", "attach"): "dflash_cb.integrations.loops.specforge",
    ("dflash_cb.integrations.panels", "main"): "dflash_cb.integrations.tracking.panels",
    ("dflash_cb.integrations.wandb_offline", "offline_run_history"): "dflash_cb.integrations.tracking.wandb_offline",
    ("dflash_cb.core.checkpoints", "load_drafter"): "dflash_cb.core.checkpoints.load",
    ("dflash_cb.checkpoints", "load_drafter"): "dflash_cb.core.checkpoints.load",
    ("dflash_cb.checkpoints", "extract_drafter"): "dflash_cb.core.checkpoints.load",
    ("dflash_cb.core.training", "batch_loss"): "dflash_cb.core.drafters.training",
    ("dflash_cb.training", "batch_loss"): "dflash_cb.core.drafters.training",
    ("dflash_cb.states", "StateCache"): "dflash_cb.cache.states",
    ("dflash_cb.states", "TargetHead"): "dflash_cb.cache.states",
    ("dflash_cb.engine", "evaluate"): "dflash_cb.core.replay.engine",
    ("dflash_cb.model", "DFlashDrafter"): "dflash_cb.core.drafters.dflash.model",
    ("dflash_cb.callback", "DFlashEvalCallback"): "dflash_cb.integrations.loops.lightning",
    ("dflash_cb.integrations.callback", "DFlashEvalCallback"): "dflash_cb.integrations.loops.lightning",
    ("dflash_cb.integrations.hf_callback", "DFlashEvalTrainerCallback"): "dflash_cb.integrations.loops.hf",
    ("dflash_cb.integrations.evaluator", "LiveEvaluator"): "dflash_cb.integrations.evaluator.live",
    ("dflash_cb.integrations.config", "EvalConfig"): "dflash_cb.integrations.evaluator.config",
    ("dflash_cb.integrations.sinks", "MetricsSink"): "dflash_cb.integrations.tracking.sinks",
    ("dflash_cb.lightning_module", "CachedStatesDataModule"): "dflash_cb.demo.lightning_module",
    ("dflash_cb.lightning_module", "collate_samples"): "dflash_cb.demo.lightning_module",
    ("dflash_cb.metrics", "TAU_KEY"): "dflash_cb.core.figures.metrics",
    ("dflash_cb.core.metrics", "metric_key"): "dflash_cb.core.figures.metrics",
    ("dflash_cb.results", "write_results"): "dflash_cb.core.results.results_file",
    ("dflash_cb.core.results", "write_results"): "dflash_cb.core.results.results_file",
    ("dflash_cb.errors", "DFlashCBError"): "dflash_cb.common.errors",
    ("dflash_cb.demo", "main"): "dflash_cb.demo.demo",
}


def _forget(module: str) -> None:
    """Drop ``module`` (an old path) from the import cache, so importing it again runs the shim again."""
    sys.modules.pop(module, None)
    parent, _, child = module.rpartition(".")
    if parent in sys.modules and child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize(("old", "name"), sorted(PUBLIC))
def test_a_documented_old_import_still_works_and_names_the_new_path(old, name):
    new = PUBLIC[old, name]
    if old in MODULES:
        _forget(old)
    else:  # a package today: the name is served by its __getattr__, cached after the first access
        vars(importlib.import_module(old)).pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)
    moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(moved) == 1 and new in moved[0] and old in moved[0], moved


def test_every_old_module_is_its_new_module_and_no_file_has_an_old_path():
    for old, new in MODULES.items():
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), old  # a file would be stale
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert importlib.import_module(old) is importlib.import_module(new), old


def test_a_current_path_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from dflash_cb.core.checkpoints import files  # a submodule of a package that serves old names
        from dflash_cb.integrations.loops.specforge import attach
    assert files.__name__ == "dflash_cb.core.checkpoints.files" and attach is dflash_cb.attach_specforge


@pytest.mark.e2e  # a subprocess (the fast subset leaves those out)
def test_a_user_script_sees_the_warning_at_its_own_import_line():
    """Python shows a DeprecationWarning by default when it is raised in ``__main__``: the warning must point at
    the script's import line, not at the import machinery."""
    script = "import dflash_cb\nfrom dflash_cb.integrations.specforge import attach\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert out.startswith("<string>:2: DeprecationWarning: dflash_cb.integrations.specforge moved to "
                          "dflash_cb.integrations.loops.specforge"), out
