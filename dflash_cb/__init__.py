"""dflash-cb: exact offline acceptance (tau) of a DFlash drafter from cached target states.

What a user imports is here (the rest of the package is its implementation)::

    from dflash_cb import DFlashEvalCallback, TAU_KEY
    trainer = Trainer(callbacks=[DFlashEvalCallback(states="cached_states/qwen36-27b-v1"),
                                 ModelCheckpoint(monitor=TAU_KEY, mode="max")])

- the training-loop adapters: ``DFlashEvalCallback`` (Lightning), ``DFlashEvalTrainerCallback`` (Hugging Face),
  ``attach_specforge`` (SpecForge's ``TrainerController``), and the loop-neutral ``LiveEvaluator`` with its
  ``EvalConfig``;
- ``MetricsSink``, the interface of a destination of your own (``sinks=[...]`` on every adapter), with what its
  methods receive: ``RunInfo`` (``begin``) and ``EvaluationRecord`` (``evaluation``);
- the offline side: ``StateCache``, ``evaluate`` with its ``EvalRequest``, ``load_drafter``, ``DFlashDrafter``,
  ``DFlash2Drafter``, ``DrafterSpec``;
- the metric names: ``DEFAULT_PREFIX``, ``TAU``, ``TAU_REQUEST_MEAN``, ``SPECFORGE_ACC``, ``ddtree_tau(budget)``,
  ``metric_key(name, prefix)``, and the default keys ``TAU_KEY`` (``"dflash_eval/tau"``) and ``STEP_KEY``.

Imports are lazy: ``import dflash_cb`` pulls in neither Lightning, transformers' Trainer nor W&B.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .common.moved import install as _install_moved
from .common.version import __version__
from .old_paths import MODULES as _OLD_MODULES

_install_moved(_OLD_MODULES)  # last release's module paths still import, with a DeprecationWarning naming the new one

# name -> (module, attribute): what ``from dflash_cb import name`` gives.
_EXPORTS = {
    "DFlashEvalCallback": ("dflash_cb.integrations.loops.lightning", "DFlashEvalCallback"),
    "DFlashEvalTrainerCallback": ("dflash_cb.integrations.loops.hf", "DFlashEvalTrainerCallback"),
    "attach_specforge": ("dflash_cb.integrations.loops.specforge", "attach"),
    "LiveEvaluator": ("dflash_cb.integrations.evaluator.live", "LiveEvaluator"),
    "EvalConfig": ("dflash_cb.integrations.evaluator.config", "EvalConfig"),
    "MetricsSink": ("dflash_cb.integrations.tracking.sinks", "MetricsSink"),
    "RunInfo": ("dflash_cb.integrations.tracking.sinks", "RunInfo"),
    "EvaluationRecord": ("dflash_cb.integrations.tracking.sinks", "EvaluationRecord"),
    "StateCache": ("dflash_cb.cache.states", "StateCache"),
    "evaluate": ("dflash_cb.core.replay.engine", "evaluate"),
    "EvalRequest": ("dflash_cb.core.replay.request", "EvalRequest"),
    "load_drafter": ("dflash_cb.core.checkpoints.load", "load_drafter"),
    "DFlashDrafter": ("dflash_cb.core.drafters.dflash.model", "DFlashDrafter"),
    "DFlash2Drafter": ("dflash_cb.core.drafters.dflash2.model", "DFlash2Drafter"),
    "DrafterSpec": ("dflash_cb.core.drafters.spec", "DrafterSpec"),
    "DEFAULT_PREFIX": ("dflash_cb.core.figures.metrics", "DEFAULT_PREFIX"),
    "TAU": ("dflash_cb.core.figures.metrics", "TAU"),
    "TAU_REQUEST_MEAN": ("dflash_cb.core.figures.metrics", "TAU_REQUEST_MEAN"),
    "SPECFORGE_ACC": ("dflash_cb.core.figures.metrics", "SPECFORGE_ACC"),
    "STEP_KEY": ("dflash_cb.core.figures.metrics", "STEP_KEY"),
    "TAU_KEY": ("dflash_cb.core.figures.metrics", "TAU_KEY"),
    "ddtree_tau": ("dflash_cb.core.figures.metrics", "ddtree_tau"),
    "metric_key": ("dflash_cb.core.figures.metrics", "metric_key"),
}

__all__ = [
    "DEFAULT_PREFIX", "SPECFORGE_ACC", "STEP_KEY", "TAU", "TAU_KEY", "TAU_REQUEST_MEAN", "DFlash2Drafter",
    "DFlashDrafter", "DFlashEvalCallback", "DFlashEvalTrainerCallback", "DrafterSpec", "EvalConfig", "EvalRequest",
    "EvaluationRecord", "LiveEvaluator", "MetricsSink", "RunInfo", "StateCache", "__version__", "attach_specforge", "ddtree_tau", "evaluate",
    "load_drafter", "metric_key",
]

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported on first use
    from .cache.states import StateCache
    from .core.checkpoints.load import load_drafter
    from .core.drafters.dflash.model import DFlashDrafter
    from .core.drafters.dflash2.model import DFlash2Drafter
    from .core.drafters.spec import DrafterSpec
    from .core.figures.metrics import (
        DEFAULT_PREFIX,
        SPECFORGE_ACC,
        STEP_KEY,
        TAU,
        TAU_KEY,
        TAU_REQUEST_MEAN,
        ddtree_tau,
        metric_key,
    )
    from .core.replay import EvalRequest, evaluate
    from .integrations.evaluator.config import EvalConfig
    from .integrations.evaluator.live import LiveEvaluator
    from .integrations.loops.hf import DFlashEvalTrainerCallback
    from .integrations.loops.lightning import DFlashEvalCallback
    from .integrations.loops.specforge import attach as attach_specforge
    from .integrations.tracking.sinks import EvaluationRecord, MetricsSink, RunInfo


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
