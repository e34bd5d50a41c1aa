"""W&B: a run's scalars against ``trainer/global_step``, the samples table, the histogram of produced tokens,
the per-depth chart, the baselines and the best tau in the summary (``wandb_logging``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ....core.figures.metrics import STEP_KEY
from ..sinks import EvaluationRecord, MetricsSink, RunInfo
from . import Tracker, lightning_logger_sink


class WandbSink(MetricsSink):
    """A W&B run: scalars plotted against ``trainer/global_step`` (unless ``scalars=False``: another sink,
    such as Lightning's ``WandbLogger``, sends them), the samples table, the histogram of produced tokens,
    the per-depth chart, the baselines and the best tau in the summary.

    ``run``: the run, or a function returning it (None: no run yet, nothing is logged), for loops whose W&B
    run starts after the evaluator's setup.
    """

    def __init__(self, run: Any, scalars: bool = True) -> None:
        self._run = run
        self.scalars = scalars
        self._decode: Callable[[Sequence[int]], str] | None = None
        self._tokenizer: Any = None

    @property
    def run(self) -> Any | None:
        return self._run() if callable(self._run) and not is_wandb_run(self._run) else self._run

    def begin(self, run: RunInfo) -> None:
        from ..wandb_logging import start_live_run

        wandb_run = self.run
        if wandb_run is not None:
            start_live_run(wandb_run, run.prefix, run.baselines, run.published_skipped, run.config)
        self._tokenizer, self._decode = run.tokenizer, None

    def log(self, metrics: dict[str, float], step: int) -> None:
        wandb_run = self.run
        if self.scalars and wandb_run is not None:
            wandb_run.log({**metrics, STEP_KEY: int(step)})

    def evaluation(self, record: EvaluationRecord) -> None:
        from ..sample_table import make_decoder, record_rows
        from ..wandb_logging import log_best, log_evaluation

        wandb_run = self.run
        if wandb_run is None:
            return
        samples = record.table()
        if samples and self._decode is None:
            self._decode = make_decoder(self._tokenizer)
        rows = record_rows(record.step, samples, self._decode) if samples else []
        log_evaluation(wandb_run, step=record.step, prefix=record.prefix, live_per_depth=record.per_depth,
                       hist=record.histogram, baselines=record.baselines, rows=rows)
        log_best(wandb_run, record.history, record.prefix)

    def __str__(self) -> str:
        return "W&B run"


def is_wandb_run(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("log", "summary", "define_metric", "config"))


def _from_lightning(logger: Any) -> MetricsSink | None:
    return lightning_logger_sink(logger, "WandbLogger", lambda experiment: WandbSink(experiment, scalars=False))


def _current_run() -> Any | None:
    import wandb

    return wandb.run


def _from_hf(trainer: Any) -> MetricsSink:
    # Straight into the run, under the evaluator's own names and step axis (trainer/global_step), as Lightning's
    # WandbLogger and a plain loop log them: the same panels fit every loop (``loops.hf.TrainerLog`` skips
    # the Trainer's own W&B integration, which would rename the keys).
    return WandbSink(_current_run)


def _from_object(obj: Any) -> MetricsSink | None:
    return WandbSink(obj) if is_wandb_run(obj) else None


TRACKER = Tracker("wandb", from_lightning=_from_lightning, from_hf=_from_hf, from_object=_from_object)
