"""Where the live evaluator's numbers go: a small sink interface, whatever the training loop.

A sink gets three calls, each optional but ``log``:

- ``begin(run)`` once per run, before the first evaluation is logged: the settings and the references
  (``RunInfo``);
- ``log(metrics, step)`` for every set of scalars (prefixed names, ``dflash_cb.core.metrics``) at the
  training step they measure;
- ``evaluation(record)`` after each evaluation's scalars: what a richer tracker can show beyond scalars
  (the histogram of produced tokens, acceptance per depth, sample blocks: ``EvaluationRecord``).

Implementations: a plain function ``log(metrics, step)`` (``CallableSink``); a W&B run (``WandbSink``:
scalars, tables and charts); the Lightning loggers (``callback.LightningLoggers``); the Hugging Face
trainer's own log (``hf_callback.TrainerLog``). W&B specifics live in ``WandbSink`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.baselines import Baseline
from ..core.metrics import STEP_KEY


@dataclass
class RunInfo:
    """What a run is measuring, for a sink's ``begin``."""

    prefix: str
    config: dict[str, Any]  # the evaluator's settings and the cache's identity
    baselines: Sequence[Baseline]  # measured files, the server's counters, published figures
    published_skipped: Sequence[str]  # "name: why" of published entries not logged
    tokenizer: Any = None  # EvalConfig.tokenizer: decodes the table's tokens


@dataclass
class TableSample:
    """One evaluated sample as a table shows it: its tokens, where the completion starts, its cycles."""

    id: str
    category: str
    input_ids: list[int]
    prompt_len: int
    acceptance_lengths: list[int]
    drafts: list[list[int]] | None  # the drafter's block at each of the first cycles, when kept


@dataclass
class EvaluationRecord:
    """One evaluation beyond its scalars, for a sink's ``evaluation``."""

    step: int
    prefix: str
    scalars: dict[str, float]  # what ``log`` received
    per_depth: list[float]  # the live drafter's unconditional acceptance at depths 1..block_size-1
    histogram: list[float]  # cycles that produced n tokens, n = 0..block_size
    baselines: Sequence[Baseline]
    history: Sequence[dict[str, float]]  # every evaluation so far ({"step": s, metric: value})
    table: Callable[[], list[TableSample]] = field(default=list)  # read on demand: only a table needs tokens


class MetricsSink:
    """One destination of the evaluator's numbers (subclass it, or pass a function or a W&B run)."""

    def begin(self, run: RunInfo) -> None:
        """Once per run, before the first evaluation is logged."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def evaluation(self, record: EvaluationRecord) -> None:
        """After each evaluation's scalars."""

    def __str__(self) -> str:
        return type(self).__name__


class CallableSink(MetricsSink):
    """``fn(metrics, step)`` for every evaluation: a tracker of your own, a list, ``print``."""

    def __init__(self, fn: Callable[[dict[str, float], int], Any]) -> None:
        self.fn = fn

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.fn(dict(metrics), step)

    def __str__(self) -> str:
        return f"log function {getattr(self.fn, '__qualname__', None) or type(self.fn).__name__}"


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
        from .wandb_logging import start_live_run

        wandb_run = self.run
        if wandb_run is not None:
            start_live_run(wandb_run, run.prefix, run.baselines, run.published_skipped, run.config)
        self._tokenizer, self._decode = run.tokenizer, None

    def log(self, metrics: dict[str, float], step: int) -> None:
        wandb_run = self.run
        if self.scalars and wandb_run is not None:
            wandb_run.log({**metrics, STEP_KEY: int(step)})

    def evaluation(self, record: EvaluationRecord) -> None:
        from .wandb_logging import log_best, log_evaluation, make_decoder, table_row

        wandb_run = self.run
        if wandb_run is None:
            return
        samples = record.table()
        if samples and self._decode is None:
            self._decode = make_decoder(self._tokenizer)
        rows = [table_row(record.step, s.id, s.category, s.input_ids, s.prompt_len, s.acceptance_lengths, s.drafts,
                          self._decode) for s in samples] if samples else []
        log_evaluation(wandb_run, step=record.step, prefix=record.prefix, live_per_depth=record.per_depth,
                       hist=record.histogram, baselines=record.baselines, rows=rows)
        log_best(wandb_run, record.history, record.prefix)

    def __str__(self) -> str:
        return "W&B run"


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
    from ..common.arguments import ArgumentError

    raise ArgumentError(f"log={type(log).__name__}: expected a function log(metrics, step), a W&B run, a "
                        "MetricsSink or a list of them")


__all__ = ["CallableSink", "EvaluationRecord", "MetricsSink", "RunInfo", "TableSample", "WandbSink", "as_sinks",
           "is_wandb_run"]
