"""The trackers a training loop may already use, each mapped to its sink: one file per tracker, here.

A tracker's module in this folder defines ``TRACKER``, a ``Tracker``: its name (as Hugging Face's
``report_to`` spells it) and how to find the tracker's own object in each loop and make its sink:

- ``from_lightning(logger)``: a Lightning logger of the trainer (``WandbLogger``, ``TensorBoardLogger``, ``MLFlowLogger``) ->
  a sink for the rich record (the scalars already reach every logger through ``trainer.loggers``);
- ``from_hf(trainer)``: a Hugging Face ``Trainer`` whose ``report_to`` names the tracker -> its sink;
- ``from_object(obj)``: an object a user passes as ``log=`` or ``sinks=`` (a W&B run, a ``SummaryWriter``, an MLflow run).

The functions below ask every module of this folder (``pkgutil``), so a new tracker is one new file here,
and a tracker the registry does not know is any object with the sink interface (``sinks.MetricsSink``)
passed as ``sinks=[...]`` to an adapter. A tracker's library is imported only inside its functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..sinks import CallableSink, EvaluationRecord, MetricsSink, RunInfo

SinkOf = Callable[[Any], MetricsSink | None]


def _none(_: Any) -> MetricsSink | None:
    return None


@dataclass(frozen=True)
class Tracker:
    """One tracker's sinks in each loop (a function returns None where the object is not this tracker's)."""

    name: str
    from_lightning: SinkOf = _none
    from_hf: SinkOf = _none
    from_object: SinkOf = _none


def lightning_logger_sink(logger: Any, logger_class: str, make: Callable[[Callable[[], Any]], MetricsSink]
                          ) -> MetricsSink | None:
    """``make(experiment getter)`` when ``logger`` is Lightning's ``logger_class`` (its ``experiment``, read when
    first used: the run or writer exists from the fit on); the scalars reach it through the logger itself."""
    try:
        from lightning.pytorch import loggers
    except ImportError:  # pragma: no cover
        return None
    cls = getattr(loggers, logger_class, None)
    return make(lambda: logger.experiment) if cls is not None and isinstance(logger, cls) else None


def trackers() -> list[Tracker]:
    """Every tracker of this folder, in file-name order."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        tracker = getattr(module, "TRACKER", None)
        if isinstance(tracker, Tracker):
            found.append(tracker)
    return found


def lightning_sinks(trainer: Any) -> list[MetricsSink]:
    """The rich-record sinks of a Lightning trainer's loggers (rank zero only: the others log nothing)."""
    if getattr(trainer, "global_rank", 0) != 0:
        return []
    out = []
    for logger in getattr(trainer, "loggers", None) or []:
        for t in trackers():
            sink = t.from_lightning(logger)
            if sink is not None:
                out.append(sink)
                break
    return out


def hf_sinks(trainer: Any) -> list[MetricsSink]:
    """The sinks of the trackers a Hugging Face ``Trainer`` reports to (``TrainingArguments.report_to``)."""
    report_to = getattr(getattr(trainer, "args", None), "report_to", None) or []
    if isinstance(report_to, str):
        report_to = [report_to]
    out = []
    for t in trackers():
        if t.name in report_to or "all" in report_to:
            sink = t.from_hf(trainer)
            if sink is not None:
                out.append(sink)
    return out


def object_sink(obj: Any) -> MetricsSink | None:
    """The sink of a tracker's own object (a W&B run, a TensorBoard ``SummaryWriter``, an MLflow run), or None."""
    for t in trackers():
        sink = t.from_object(obj)
        if sink is not None:
            return sink
    return None


def as_sinks(log: Any, option: str = "log") -> list[MetricsSink]:
    """Sinks from what a user passes as ``log=`` or ``sinks=`` (``option`` names it in errors): None, a sink (any
    object with a ``log`` method; ``begin`` and ``evaluation`` are optional), a tracker's own object (a W&B run, a
    TensorBoard ``SummaryWriter``, an MLflow run: ``trackers``), a function, or a list of these."""
    from ....common.arguments import ArgumentError

    if log is None:
        return []
    if isinstance(log, type):  # a class is callable too: it would be constructed at every evaluation
        raise ArgumentError(f"{option}={log.__name__}: a class, not a sink; pass an instance, e.g. "
                            f"{option}={log.__name__}(...)")
    if isinstance(log, MetricsSink):
        return [log]
    tracked = object_sink(log)
    if tracked is not None:
        return [tracked]
    if _has_sink_interface(log):
        return [_OwnSink(log)]
    if callable(log):
        return [CallableSink(log)]
    if isinstance(log, Sequence) and not isinstance(log, (str, bytes)):
        return [s for i, item in enumerate(log) for s in as_sinks(item, f"{option}[{i}]")]
    raise ArgumentError(f"{option}={_shown(log)}: expected a function log(metrics, step), a W&B run, a "
                        "TensorBoard SummaryWriter, an MLflow run, a MetricsSink (or any object with a log(metrics, "
                        "step) method) or a list of them")


def _shown(obj: Any) -> str:
    return type(obj).__name__ if not isinstance(obj, (int, float, str)) else repr(obj)


class _OwnSink(MetricsSink):
    """A user's object with the sink's methods but not its base: the methods it lacks do nothing."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def begin(self, run: RunInfo) -> None:
        if callable(getattr(self.obj, "begin", None)):
            self.obj.begin(run)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.obj.log(metrics, step)

    def evaluation(self, record: EvaluationRecord) -> None:
        if callable(getattr(self.obj, "evaluation", None)):
            self.obj.evaluation(record)

    def __str__(self) -> str:
        return str(self.obj)


def _has_sink_interface(obj: Any) -> bool:
    """An object of the user's own with the sink's ``log`` method (``begin``/``evaluation`` are optional)."""
    return callable(getattr(obj, "log", None))
