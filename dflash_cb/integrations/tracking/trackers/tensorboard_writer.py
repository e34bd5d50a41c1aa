"""TensorBoard: a ``SummaryWriter``'s scalars, and the rich record of each evaluation as TensorBoard shows it:
the produced-tokens histogram, per-depth acceptance (live and every reference) as a chart, the sample table
as text, and the run's configuration and references as text once."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..record_figures import per_depth_figure
from ..sample_table import TABLE_COLUMNS, make_decoder, record_rows
from ..sinks import EvaluationRecord, MetricsSink, RunInfo
from . import Tracker, lightning_logger_sink


def is_summary_writer(obj: Any) -> bool:
    """torch's (or tensorboardX's) ``SummaryWriter``, told by the methods the sink calls."""
    return all(callable(getattr(obj, m, None)) for m in ("add_scalar", "add_histogram", "add_figure", "add_text",
                                                         "flush"))


class TensorBoardSink(MetricsSink):
    """A TensorBoard ``SummaryWriter``: scalars (unless ``scalars=False``: another sink, such as Lightning's
    ``TensorBoardLogger``, sends them) and the rich record of each evaluation.

    ``writer``: the writer, or a function returning it (None: no writer yet, nothing is written).
    """

    def __init__(self, writer: Any, scalars: bool = True) -> None:
        self._writer = writer
        self.scalars = scalars
        self._tokenizer: Any = None
        self._decode: Callable[[Sequence[int]], str] | None = None

    @property
    def writer(self) -> Any | None:
        if self._writer is None or is_summary_writer(self._writer):
            return self._writer
        return self._writer()

    def begin(self, run: RunInfo) -> None:
        w = self.writer
        self._tokenizer, self._decode = run.tokenizer, None
        if w is None:
            return
        w.add_text(f"{run.prefix}config", _code(json.dumps(run.config, indent=1, default=str)), 0)
        if run.baselines or run.published_skipped:
            lines = [f"| {b.key} | {b.kind} | {b.label} | {b.source} |" for b in run.baselines]
            text = "| key | kind | label | source |\n|---|---|---|---|\n" + "\n".join(lines)
            if run.published_skipped:
                text += "\n\nnot logged: " + "; ".join(run.published_skipped)
            w.add_text(f"{run.prefix}baselines", text, 0)
        w.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        w = self.writer
        if not self.scalars or w is None:
            return
        for k, v in metrics.items():
            w.add_scalar(k, v, int(step))
        w.flush()

    def evaluation(self, record: EvaluationRecord) -> None:
        import numpy as np

        w = self.writer
        if w is None:
            return
        step, prefix = int(record.step), record.prefix
        counts = [int(c) for c in record.histogram]
        if sum(counts[1:]):
            # One value per cycle (the tokens it produced), binned per token count.
            values = np.repeat(np.arange(len(counts)), counts)
            w.add_histogram(f"{prefix}produced_hist", values, step, bins=np.arange(len(counts) + 1) - 0.5)
        figure = per_depth_figure(record)
        if figure is not None:
            w.add_figure(f"{prefix}charts/acceptance_per_depth", figure, step)
        samples = record.table()
        if samples:
            if self._decode is None:
                self._decode = make_decoder(self._tokenizer)
            w.add_text(f"{prefix}sample_table", _markdown_table(record_rows(step, samples, self._decode)), step)
        w.flush()

    def __str__(self) -> str:
        return "TensorBoard writer"


def _code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())  # a code block in TensorBoard's markdown


def _markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        text = f"{v:.4f}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + "---|" * len(TABLE_COLUMNS)
    return head + "\n" + "\n".join("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)


def _from_lightning(logger: Any) -> MetricsSink | None:
    return lightning_logger_sink(logger, "TensorBoardLogger", lambda experiment: TensorBoardSink(experiment, scalars=False))


def _from_hf(trainer: Any) -> MetricsSink | None:
    from transformers.integrations import TensorBoardCallback

    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    for cb in callbacks:
        if isinstance(cb, TensorBoardCallback):
            # Its writer exists from its on_train_begin on (before ours: the Trainer's integrations come first). The
            # scalars too, under the evaluator's names (the Trainer's own log would rename them train/...).
            return TensorBoardSink(lambda cb=cb: getattr(cb, "tb_writer", None))
    return None


def _from_object(obj: Any) -> MetricsSink | None:
    return TensorBoardSink(obj) if is_summary_writer(obj) else None


TRACKER = Tracker("tensorboard", from_lightning=_from_lightning, from_hf=_from_hf, from_object=_from_object)
