"""Where the live evaluator's numbers go: a small sink interface, whatever the training loop.

A sink gets three calls, each optional but ``log``:

- ``begin(run)`` once per run, before its first ``log`` (the setup's predicted cost comes first): the settings
  and the references (``RunInfo``);
- ``log(metrics, step)`` for every set of scalars (prefixed names, ``dflash_cb.core.figures.metrics``) at the
  training step they measure;
- ``evaluation(record)`` after each evaluation's scalars: what a richer tracker can show beyond scalars
  (the histogram of produced tokens, acceptance per depth, sample blocks: ``EvaluationRecord``).

Implementations: a plain function ``log(metrics, step)`` (``CallableSink``); each tracker's own
(``trackers/``: a W&B run, a TensorBoard writer, an MLflow run; one file per tracker); the Lightning loggers
(``loops.lightning.LightningLoggers``); the Hugging Face trainer's own log (``loops.hf.TrainerLog``). A sink of a
user's own is any object with these methods (``MetricsSink`` need not be its base), passed as ``sinks=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...core.results.baselines import Baseline


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

    def copy(self) -> EvaluationRecord:
        """A copy whose containers are its own: what one sink changes, no other sink and no history sees."""
        return replace(self, scalars=dict(self.scalars), per_depth=list(self.per_depth),
                       histogram=list(self.histogram), baselines=tuple(self.baselines),
                       history=[dict(h) for h in self.history])


class MetricsSink:
    """One destination of the evaluator's numbers (subclass it, or pass a function or a W&B run)."""

    def begin(self, run: RunInfo) -> None:
        """Once per run, before the first ``log``: a sink may open its run or file here."""

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


def sink_name(sink: Any) -> str:
    """A sink as a warning names it; its class when its own ``str``/``repr`` raises."""
    try:
        return str(sink)
    except Exception:
        inner = getattr(sink, "obj", sink)
        return f"a {type(inner).__name__} sink"
