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

__version__ = "0.1.0"

# name -> (module, attribute): what ``from dflash_cb import name`` gives.
_EXPORTS = {
    "DFlashEvalCallback": ("dflash_cb.integrations.callback", "DFlashEvalCallback"),
    "DFlashEvalTrainerCallback": ("dflash_cb.integrations.hf_callback", "DFlashEvalTrainerCallback"),
    "attach_specforge": ("dflash_cb.integrations.specforge", "attach"),
    "LiveEvaluator": ("dflash_cb.integrations.evaluator", "LiveEvaluator"),
    "EvalConfig": ("dflash_cb.integrations.config", "EvalConfig"),
    "MetricsSink": ("dflash_cb.integrations.sinks", "MetricsSink"),
    "RunInfo": ("dflash_cb.integrations.sinks", "RunInfo"),
    "EvaluationRecord": ("dflash_cb.integrations.sinks", "EvaluationRecord"),
    "StateCache": ("dflash_cb.cache.states", "StateCache"),
    "evaluate": ("dflash_cb.core.engine", "evaluate"),
    "EvalRequest": ("dflash_cb.core.request", "EvalRequest"),
    "load_drafter": ("dflash_cb.core.checkpoints", "load_drafter"),
    "DFlashDrafter": ("dflash_cb.core.model", "DFlashDrafter"),
    "DFlash2Drafter": ("dflash_cb.core.dflash2", "DFlash2Drafter"),
    "DrafterSpec": ("dflash_cb.core.model", "DrafterSpec"),
    "DEFAULT_PREFIX": ("dflash_cb.core.metrics", "DEFAULT_PREFIX"),
    "TAU": ("dflash_cb.core.metrics", "TAU"),
    "TAU_REQUEST_MEAN": ("dflash_cb.core.metrics", "TAU_REQUEST_MEAN"),
    "SPECFORGE_ACC": ("dflash_cb.core.metrics", "SPECFORGE_ACC"),
    "STEP_KEY": ("dflash_cb.core.metrics", "STEP_KEY"),
    "TAU_KEY": ("dflash_cb.core.metrics", "TAU_KEY"),
    "ddtree_tau": ("dflash_cb.core.metrics", "ddtree_tau"),
    "metric_key": ("dflash_cb.core.metrics", "metric_key"),
}

__all__ = [
    "DEFAULT_PREFIX", "SPECFORGE_ACC", "STEP_KEY", "TAU", "TAU_KEY", "TAU_REQUEST_MEAN", "DFlash2Drafter",
    "DFlashDrafter", "DFlashEvalCallback", "DFlashEvalTrainerCallback", "DrafterSpec", "EvalConfig", "EvalRequest",
    "EvaluationRecord", "LiveEvaluator", "MetricsSink", "RunInfo", "StateCache", "__version__", "attach_specforge", "ddtree_tau", "evaluate",
    "load_drafter", "metric_key",
]

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported on first use
    from .cache.states import StateCache
    from .core.checkpoints import load_drafter
    from .core.dflash2 import DFlash2Drafter
    from .core.engine import evaluate
    from .core.metrics import (
        DEFAULT_PREFIX,
        SPECFORGE_ACC,
        STEP_KEY,
        TAU,
        TAU_KEY,
        TAU_REQUEST_MEAN,
        ddtree_tau,
        metric_key,
    )
    from .core.model import DFlashDrafter, DrafterSpec
    from .core.request import EvalRequest
    from .integrations.callback import DFlashEvalCallback
    from .integrations.config import EvalConfig
    from .integrations.evaluator import LiveEvaluator
    from .integrations.hf_callback import DFlashEvalTrainerCallback
    from .integrations.sinks import EvaluationRecord, MetricsSink, RunInfo
    from .integrations.specforge import attach as attach_specforge


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
