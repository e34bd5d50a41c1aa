"""MLflow: a run's scalars at their training step, and the rich record of each evaluation as artifacts of the
run: the per-depth chart and the produced-tokens histogram (PNG, with the histogram's counts as a table), the
sample table (an MLflow table, JSON), and the run's configuration and references once.

Artifacts of the evaluation at step ``s`` (``prefix`` is the evaluator's, ``dflash_eval/``)::

    {prefix}config.json                                  the evaluator's settings and the cache's identity (begin)
    {prefix}baselines.json                               the references and the published entries not logged
    {prefix}charts/acceptance_per_depth/step_{s:07d}.png  live and reference per-depth acceptance
    {prefix}produced_hist/step_{s:07d}.png               cycles per number of tokens produced
    {prefix}produced_hist/step_{s:07d}.json              the same counts, as a table
    {prefix}sample_table/step_{s:07d}.json               the sample table (columns: ``sample_table.TABLE_COLUMNS``)

The optional dependency is ``mlflow`` (or ``mlflow-skinny``): ``pip install 'dflash-cb[mlflow]'``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..record_figures import per_depth_figure, produced_histogram_figure
from ..sample_table import TABLE_COLUMNS, make_decoder, record_rows
from ..sinks import EvaluationRecord, MetricsSink, RunInfo
from . import Tracker, lightning_logger_sink

Target = tuple[Any, str]  # an ``mlflow.MlflowClient`` and the run id it writes to


class MlflowSink(MetricsSink):
    """An MLflow run: scalars (unless ``scalars=False``: another sink, such as Lightning's ``MLFlowLogger``,
    sends them) and each evaluation's record as artifacts.

    ``target``: ``() -> (client, run_id)``, read at every call (None: no run yet, nothing is logged), for loops
    whose run starts after the evaluator's setup.
    """

    def __init__(self, target: Callable[[], Target | None], scalars: bool = True) -> None:
        self._target = target
        self.scalars = scalars
        self._tokenizer: Any = None
        self._decode: Callable[[Sequence[int]], str] | None = None

    def begin(self, run: RunInfo) -> None:
        self._tokenizer, self._decode = run.tokenizer, None
        target = self._target()
        if target is None:
            return
        client, run_id = target
        client.log_dict(run_id, run.config, f"{run.prefix}config.json")
        if run.baselines or run.published_skipped:
            client.log_dict(run_id, {"baselines": [{"key": b.key, "kind": b.kind, "label": b.label, "source": b.source}
                                                   for b in run.baselines],
                                     "not_logged": list(run.published_skipped)}, f"{run.prefix}baselines.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        target = self._target()
        if not self.scalars or target is None:
            return
        from mlflow.entities import Metric

        client, run_id = target
        now = int(time.time() * 1000)  # MLflow's metric timestamp (milliseconds); the step is the axis
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, int(step)) for k, v in metrics.items()])

    def evaluation(self, record: EvaluationRecord) -> None:
        target = self._target()
        if target is None:
            return
        client, run_id = target
        name, prefix = f"step_{int(record.step):07d}", record.prefix
        figure = per_depth_figure(record)
        if figure is not None:
            client.log_figure(run_id, figure, f"{prefix}charts/acceptance_per_depth/{name}.png")
        figure = produced_histogram_figure(record)
        if figure is not None:
            client.log_figure(run_id, figure, f"{prefix}produced_hist/{name}.png")
            counts = [int(c) for c in record.histogram]
            client.log_table(run_id, {"tokens_produced": list(range(len(counts))), "cycles": counts},
                             f"{prefix}produced_hist/{name}.json")
        samples = record.table()
        if samples:
            if self._decode is None:
                self._decode = make_decoder(self._tokenizer)
            rows = record_rows(record.step, samples, self._decode)
            client.log_table(run_id, {c: [r[i] for r in rows] for i, c in enumerate(TABLE_COLUMNS)},
                             f"{prefix}sample_table/{name}.json")

    def __str__(self) -> str:
        return "MLflow run"


def _from_lightning(logger: Any) -> MetricsSink | None:
    # The logger's client and run (created on first use, from the fit on); the scalars reach MLflow through it.
    return lightning_logger_sink(logger, "MLFlowLogger",
                                 lambda experiment: MlflowSink(lambda: (experiment(), logger.run_id), scalars=False))


def _active_run() -> Target | None:
    import mlflow

    run = mlflow.active_run()
    return (mlflow.MlflowClient(), run.info.run_id) if run is not None else None


def _from_hf(trainer: Any) -> MetricsSink | None:
    # Hugging Face's MLflowCallback starts the active run at on_train_begin and sends the scalars it gets from
    # the Trainer's log (``loops.hf.TrainerLog``): the sink adds the artifacts.
    from transformers.integrations import MLflowCallback

    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    return MlflowSink(_active_run, scalars=False) if any(isinstance(cb, MLflowCallback) for cb in callbacks) else None


def _from_object(obj: Any) -> MetricsSink | None:
    """``mlflow.start_run()``'s ``ActiveRun`` (or any ``mlflow.entities.Run``): its run, in the client of the
    current tracking URI."""
    if not type(obj).__module__.startswith("mlflow"):  # mlflow is imported only for its own objects
        return None
    import mlflow

    if not isinstance(obj, mlflow.entities.Run):
        return None
    client, run_id = mlflow.MlflowClient(), obj.info.run_id
    return MlflowSink(lambda: (client, run_id))


TRACKER = Tracker("mlflow", from_lightning=_from_lightning, from_hf=_from_hf, from_object=_from_object)
