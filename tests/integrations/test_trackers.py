"""Trackers through one registry: one file per tracker, the rich record in TensorBoard, a user's own sink.

TensorBoard runs for real (torch's ``SummaryWriter``, read back with TensorBoard's own ``EventAccumulator``);
the loops are a plain ``LiveEvaluator`` and a real Lightning ``Trainer`` with its ``TensorBoardLogger``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning_runs import fit

from dflash_cb import DFlashDrafter, DFlashEvalCallback, LiveEvaluator
from dflash_cb.integrations.tracking import trackers

PREFIX = "dflash_eval/"


def events(folder: Path) -> dict[str, dict]:
    """What TensorBoard reads from ``folder``: per kind (scalars, histograms, images, tensors = text) tag -> events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return {"scalars": {t: acc.Scalars(t) for t in tags["scalars"]},
            "histograms": {t: acc.Histograms(t) for t in tags["histograms"]},
            "images": {t: acc.Images(t) for t in tags["images"]},
            "text": {t.removesuffix("/text_summary"): acc.Tensors(t) for t in tags["tensors"]}}


def text_of(event) -> str:
    return event.tensor_proto.string_val[0].decode()


def test_the_registry_finds_every_tracker_file_and_a_new_tracker_is_one_file(tmp_path, monkeypatch):
    """``trackers/`` holds one module per tracker; dropping one more file there is all a new tracker needs:
    the adapters' ``as_sinks`` (``log=``/``sinks=``) then map its objects to its sink."""
    assert [t.name for t in trackers.trackers()] == ["mlflow", "tensorboard", "wandb"]
    extra = tmp_path / "extra_trackers"
    extra.mkdir()
    (extra / "ledger.py").write_text(
        "from dflash_cb.integrations.tracking.sinks import MetricsSink\n"
        "from dflash_cb.integrations.tracking.trackers import Tracker\n\n"
        "class Ledger:\n    lines = None\n\n"
        "class LedgerSink(MetricsSink):\n"
        "    def __init__(self, ledger):\n        self.ledger = ledger\n"
        "    def log(self, metrics, step):\n        self.ledger.lines.append((step, dict(metrics)))\n\n"
        "TRACKER = Tracker('ledger', from_object=lambda o: LedgerSink(o) if isinstance(o, Ledger) else None)\n")
    monkeypatch.setattr(trackers, "__path__", [*trackers.__path__, str(extra)])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ledger" in [t.name for t in trackers.trackers()]
    module = sys.modules["dflash_cb.integrations.tracking.trackers.ledger"]
    ledger = module.Ledger()
    ledger.lines = []
    (sink,) = trackers.as_sinks(ledger)
    sink.log({"x": 1.0}, 3)
    assert ledger.lines == [(3, {"x": 1.0})]


def test_a_plain_loop_logging_to_a_summary_writer_gets_scalars_and_the_rich_record(tmp_path, tiny_cache,
                                                                                    tiny_drafter_config):
    """``log=SummaryWriter(...)``: every scalar at its step, and per evaluation the produced-tokens histogram,
    per-depth acceptance as a chart (an image), the sample table as text; the configuration once."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=2, ddtree_budgets=[4], table_samples=2, console=False,
                       log=writer)
    ev.start(0, drafter)
    for step in (1, 2):
        ev.step(step, drafter)
    ev.finish(2, drafter)
    writer.close()
    seen = events(tmp_path / "tb")
    assert [e.step for e in seen["scalars"][PREFIX + "tau"]] == [0, 2, 2]  # fit start, step 2, its full evaluation
    assert [e.value for e in seen["scalars"][PREFIX + "tau"]][:2] == [h["tau"] for h in ev.history][:2]
    hist = seen["histograms"][PREFIX + "produced_hist"]
    assert [e.step for e in hist] == [0, 2, 2] and hist[0].histogram_value.num == ev.history[0]["cycles"]
    assert [e.step for e in seen["images"][PREFIX + "charts/acceptance_per_depth"]] == [0, 2, 2]
    table = seen["text"][PREFIX + "sample_table"]
    assert len(table) == 3 and "| step | sample | category |" in text_of(table[0])
    assert ev.eval_ids[0] in text_of(table[0]) or ev.eval_ids[-1] in text_of(table[0])
    assert [text_of(e) for e in seen["text"][PREFIX + "config"]][0].count(str(tiny_cache)) == 1


@pytest.mark.e2e
def test_lightning_tensorboard_logger_gets_the_rich_record_beside_its_scalars(tmp_path, tiny_cache,
                                                                              tiny_drafter_config):
    """With a ``TensorBoardLogger`` the scalars come once (through the logger), and the callback adds the
    histogram, the chart and the table to the same event files, found through the tracker registry."""
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(str(tmp_path / "logs"), name="run")
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], table_samples=2,
                            console=False)
    fit(tmp_path, tiny_drafter_config, tiny_cache, [cb], max_steps=4, logger=logger)
    seen = events(Path(logger.log_dir))
    steps = [h["step"] for h in cb.history]
    assert [e.step for e in seen["scalars"][PREFIX + "tau"]] == steps  # once each: the sink sends no scalars
    assert [e.step for e in seen["histograms"][PREFIX + "produced_hist"]] == steps
    assert [e.step for e in seen["images"][PREFIX + "charts/acceptance_per_depth"]] == steps
    assert [e.step for e in seen["text"][PREFIX + "sample_table"]] == steps


class OpensItsRunInBegin:
    """A user's sink (not a ``MetricsSink`` subclass) that opens its run in ``begin``, as an MLflow or a database
    sink would: a ``log`` or ``evaluation`` before ``begin`` raises, as it would with no run open."""

    def __init__(self):
        self.calls: list[tuple[str, int | str]] = []
        self.run_open = False

    def begin(self, run):
        self.run_open = True
        self.calls.append(("begin", run.prefix))

    def log(self, metrics, step):
        if not self.run_open:
            raise RuntimeError("log() before begin(): no run is open")
        self.calls.append(("log", step))

    def evaluation(self, record):
        if not self.run_open:
            raise RuntimeError("evaluation() before begin(): no run is open")
        self.calls.append(("evaluation", record.step))


def no_sink_failed(rec) -> bool:
    return not [w for w in rec if "failed" in str(w.message)]


@pytest.mark.e2e
def test_a_users_own_sink_beside_the_loggers(tmp_path, tiny_cache, tiny_drafter_config):
    """``sinks=[...]`` takes any object with the sink's methods (no base class needed): it gets the run's
    configuration once, before anything is logged (the setup's predicted cost included), then every
    evaluation's scalars and its rich record, beside the trainer's loggers."""
    mine, partial = OpensItsRunInBegin(), type("Partial", (), {"log": lambda self, m, s: None,
                                                               "begin": lambda self, r: None})()
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], console=False,
                            sinks=[mine, partial])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fit(tmp_path, tiny_drafter_config, tiny_cache, [cb], max_steps=4)
    assert no_sink_failed(rec)  # nothing before begin(); the partial one lacks evaluation(): not an error
    steps = [h["step"] for h in cb.history]
    assert mine.calls[0] == ("begin", PREFIX) and [c for c in mine.calls if c[0] == "begin"] == [mine.calls[0]]
    assert [s for k, s in mine.calls if k == "log"] == [0, *steps]  # the setup's predicted cost, then each evaluation
    assert [s for k, s in mine.calls if k == "evaluation"] == steps


def test_the_plain_evaluator_begins_before_its_first_log_even_when_the_first_evaluation_is_later(
        tiny_cache, tiny_drafter_config):
    """Without an evaluation at the start, the setup's predicted cost is logged at ``start`` (step 0), two steps
    before the first evaluation: ``begin`` still comes first, once."""
    mine = OpensItsRunInBegin()
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=2, ddtree_budgets=[4], eval_on_fit_start=False,
                       eval_on_fit_end=False, console=False, log=[mine])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ev.start(0, drafter)
        for step in (1, 2):
            ev.step(step, drafter)
    assert no_sink_failed(rec)
    assert mine.calls == [("begin", PREFIX), ("log", 0), ("log", 2), ("evaluation", 2)]


def mlflow_artifacts(client, run_id: str, folder: str) -> list[str]:
    return sorted(f.path for f in client.list_artifacts(run_id, folder))


def test_a_plain_loop_logging_to_an_mlflow_run_gets_scalars_and_the_record_as_artifacts(
        mlflow_store, tmp_path, tiny_cache, tiny_drafter_config):
    """``log=mlflow.start_run()``: every scalar at its step (read back with MLflow's client), and per evaluation
    the per-depth chart and histogram as PNG, the histogram's counts and the sample table as MLflow tables, the
    configuration once."""
    import json

    import mlflow

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    with mlflow.start_run() as run:
        ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=2, ddtree_budgets=[4], table_samples=2,
                           console=False, log=run)
        ev.start(0, drafter)
        for step in (1, 2):
            ev.step(step, drafter)
    client, run_id = mlflow.MlflowClient(mlflow_store), run.info.run_id
    tau = client.get_metric_history(run_id, PREFIX + "tau")
    assert [(m.step, m.value) for m in tau] == [(h["step"], h["tau"]) for h in ev.history] and len(tau) == 2
    chart = PREFIX + "charts/acceptance_per_depth"
    assert mlflow_artifacts(client, run_id, chart) == [f"{chart}/step_0000000.png", f"{chart}/step_0000002.png"]
    hist = PREFIX + "produced_hist"
    assert mlflow_artifacts(client, run_id, hist) == [f"{hist}/step_0000000.{e}" for e in ("json", "png")] + [
        f"{hist}/step_0000002.{e}" for e in ("json", "png")]
    local = Path(client.download_artifacts(run_id, "", str(tmp_path / "down")))
    counts = json.loads((local / hist / "step_0000002.json").read_text())
    cycles = [row[counts["columns"].index("cycles")] for row in counts["data"]]
    assert sum(cycles) == ev.history[1]["cycles"] and cycles[0] == 0  # every cycle produces a token
    table = json.loads((local / PREFIX / "sample_table" / "step_0000002.json").read_text())
    assert table["columns"][:3] == ["step", "sample", "category"] and len(table["data"]) == 2
    assert {row[1] for row in table["data"]} <= set(ev.eval_ids)
    config = json.loads((local / PREFIX / "config.json").read_text())
    assert config["states"] == str(tiny_cache)


@pytest.mark.e2e
def test_lightning_mlflow_logger_gets_the_record_as_artifacts_beside_its_scalars(mlflow_store, tmp_path,
                                                                                 tiny_cache, tiny_drafter_config):
    """With Lightning's ``MLFlowLogger`` the scalars come through the logger, and the callback adds the charts
    and the table to the same run, found through the tracker registry."""
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow import MlflowClient

    logger = MLFlowLogger(experiment_name="dflash", tracking_uri=mlflow_store)
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], table_samples=2,
                            console=False)
    fit(tmp_path, tiny_drafter_config, tiny_cache, [cb], max_steps=4, logger=logger)
    client, steps = MlflowClient(mlflow_store), [h["step"] for h in cb.history]
    assert [m.step for m in client.get_metric_history(logger.run_id, PREFIX + "tau")] == steps  # once each
    chart = PREFIX + "charts/acceptance_per_depth"
    assert mlflow_artifacts(client, logger.run_id, chart) == [f"{chart}/step_{s:07d}.png" for s in steps]
    table = PREFIX + "sample_table"
    assert mlflow_artifacts(client, logger.run_id, table) == [f"{table}/step_{s:07d}.json" for s in steps]
