"""Where the live evaluator's numbers go: a small sink interface, whatever the training loop.

A sink receives each evaluation's scalars (prefixed names, ``dflash_cb.core.metrics``) at the training
step; a sink that knows a W&B run hands it out through ``wandb_run``, and the evaluator then adds
what only W&B shows (samples table, histogram, per-depth chart, summary; ``wandb_logging``).

- a plain function ``log(metrics, step)``: ``CallableSink``
- a W&B run (``wandb.init(...)``): ``WandbSink``
- the Lightning loggers: ``callback.LightningLoggers``; the Hugging Face trainer's own logging:
  ``hf_callback.TrainerLog``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .wandb_logging import STEP_KEY


class MetricsSink:
    """One destination of the evaluator's scalars (subclass it, or pass a function or a W&B run)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def wandb_run(self) -> Any | None:
        """The W&B run that should also get the tables and charts, if any."""
        return None


class CallableSink(MetricsSink):
    """``fn(metrics, step)`` for every evaluation: a tracker of your own, a list, ``print``."""

    def __init__(self, fn: Callable[[dict[str, float], int], Any]) -> None:
        self.fn = fn

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.fn(dict(metrics), step)


class WandbSink(MetricsSink):
    """Scalars, tables and charts into a W&B run, plotted against ``trainer/global_step``."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP_KEY: int(step)})

    def wandb_run(self) -> Any | None:
        return self.run


def is_wandb_run(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("log", "summary", "define_metric", "config"))


def as_sinks(log: Any) -> list[MetricsSink]:
    """Sinks from what a user passes as ``log=``: None, a sink, a W&B run, a function, or a list of these."""
    if log is None:
        return []
    if isinstance(log, MetricsSink):
        return [log]
    if is_wandb_run(log):
        return [WandbSink(log)]
    if callable(log):
        return [CallableSink(log)]
    if isinstance(log, Sequence) and not isinstance(log, (str, bytes)):
        return [s for item in log for s in as_sinks(item)]
    raise TypeError(f"log must be a function log(metrics, step), a W&B run, a MetricsSink or a list of them; "
                    f"got {type(log).__name__}")


__all__ = ["CallableSink", "MetricsSink", "WandbSink", "as_sinks", "is_wandb_run"]
