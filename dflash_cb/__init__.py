"""dflash-cb: exact offline acceptance (tau) of a DFlash drafter from cached target states."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["DFlashDrafter", "DFlashEvalCallback", "DFlashEvalTrainerCallback", "DrafterSpec", "LiveEvaluator",
           "StateCache", "evaluate", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not pull in Lightning, transformers' Trainer or W&B for the pure core.
    if name == "DFlashEvalCallback":
        from .integrations.callback import DFlashEvalCallback

        return DFlashEvalCallback
    if name == "DFlashEvalTrainerCallback":
        from .integrations.hf_callback import DFlashEvalTrainerCallback

        return DFlashEvalTrainerCallback
    if name == "LiveEvaluator":
        from .integrations.evaluator import LiveEvaluator

        return LiveEvaluator
    if name in ("DFlashDrafter", "DrafterSpec"):
        from .core import model

        return getattr(model, name)
    if name == "StateCache":
        from .cache.states import StateCache

        return StateCache
    if name == "evaluate":
        from .core.engine import evaluate

        return evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
