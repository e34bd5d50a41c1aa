"""The publishing side on synthetic measurements: keys, history, console line and sinks, no engine run."""

from __future__ import annotations

import math

import pytest

from dflash_cb.core.figures.metrics import AnchorCounts, EvalCounts, summarize
from dflash_cb.core.replay import SampleResult
from dflash_cb.integrations.evaluator.config import EvalConfig
from dflash_cb.integrations.evaluator.measure import Measurement
from dflash_cb.integrations.evaluator.publish import Publisher
from dflash_cb.integrations.evaluator.schedule import Profile, Reason, Trigger
from dflash_cb.integrations.evaluator.session import LoopContext, open_session
from dflash_cb.integrations.tracking.sinks import EvaluationRecord, MetricsSink, RunInfo

PREFIX = "dflash_eval/"
BLOCK = 4


class Recorder(MetricsSink):
    def __init__(self) -> None:
        self.begun: list[RunInfo] = []
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.records: list[EvaluationRecord] = []

    def begin(self, run: RunInfo) -> None:
        self.begun.append(run)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def evaluation(self, record: EvaluationRecord) -> None:
        self.records.append(record)


class Broken(MetricsSink):
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise OSError("the tracker is down")

    def __str__(self) -> str:
        return "the broken tracker"


def counts(categories: tuple[str, ...], cycles: list[list[int]], cats: list[str], depth_match: tuple[int, ...],
           budgets: tuple[int, ...] = (8,)) -> EvalCounts:
    """Counts of synthetic samples: their cycles and one set of anchor statistics (3 depths)."""
    c = EvalCounts(BLOCK, budgets, categories)
    c.add_samples(cycles, cats, [[lengths] * len(budgets) for lengths in cycles], [(5, 5)] * len(cycles),
                  [AnchorCounts(anchors=10, anchor_produced=20, depth_total=(10, 10, 10), depth_match=depth_match,
                                cond_num=depth_match, cond_den=(10, 10, 10), specforge_total=(10, 10, 10),
                                specforge_match=depth_match, t1_sum=0.0, t1_anchors=0)] + [AnchorCounts(
                      anchors=0, anchor_produced=0, depth_total=(0, 0, 0), depth_match=(0, 0, 0),
                      cond_num=(0, 0, 0), cond_den=(0, 0, 0), specforge_total=(0, 0, 0),
                      specforge_match=(0, 0, 0))] * (len(cycles) - 1))
    return c


@pytest.fixture
def session(tiny_cache):
    sinks = [Recorder(), Broken(), Recorder()]
    return open_session(EvalConfig(tiny_cache, table_samples=2), LoopContext(sinks=sinks))


def measurement(session, full: bool, step: int = 4, rank: int = 0) -> Measurement:
    ids = session.eval_ids
    cats = [session.cache.entry(i).category for i in ids]
    cycles = [[2, 3, 1]] * len(ids)
    light = counts(session.categories, cycles, cats, (8, 5, 2))
    exact = counts(session.categories, cycles, cats, (9, 6, 3), budgets=(4, 8))
    profile = Profile(True, (4, 8), 1, (8,), BLOCK) if full else Profile(False, (8,), BLOCK, (8,), BLOCK)
    by_stride = {1: exact, BLOCK: light} if full else {BLOCK: light}
    samples = [SampleResult(i, c, [2, 3, 1], {b: [2, 3, 1] for b in profile.budgets}) for i, c in zip(ids, cats, strict=True)]
    reason = Reason(Trigger.FIT_END if full else Trigger.PERIODIC, step)
    return Measurement(step, reason, profile, by_stride, {s: summarize(c) for s, c in by_stride.items()}, 1.5,
                       rank, samples if rank == 0 else [], predicted=1.25, overhead=0.1)


def publisher(session, lines: list[str], **config) -> Publisher:
    cfg = EvalConfig(session.cache.path, table_samples=2, **config)
    return Publisher(cfg, session, lambda: {"what": "synthetic"}, "Test", lines.append)


def test_a_light_measurement_gives_the_main_keys_history_console_line_and_every_sink(session):
    lines: list[str] = []
    history: list[dict[str, float]] = []
    with pytest.warns(RuntimeWarning, match="logging the evaluation at step 4 to the broken tracker failed"):
        last = publisher(session, lines).publish(measurement(session, full=False), history, failed_evaluations=2)
    m = last.metrics
    assert m[PREFIX + "tau"] == 2.0 and m[PREFIX + "acceptance/depth_01"] == 0.8 and m[PREFIX + "step"] == 4.0
    assert m[PREFIX + "eval_time_s"] == 1.5 and m[PREFIX + "predicted/seconds"] == 1.25
    assert m[PREFIX + "failed_evaluations"] == 2.0 and m[PREFIX + "anchor_stride"] == float(BLOCK)
    assert not any(k.startswith(PREFIX + "full/") for k in m)
    assert all(math.isfinite(v) for v in m.values())  # NaN figures (empty buckets) are left out
    assert [h["step"] for h in history] == [4] and history[0]["tau"] == 2.0
    assert len(lines) == 1 and lines[0].startswith("Test step 4")
    first, _, second = session.loop.sinks
    for sink in (first, second):  # the broken one does not stop the others
        assert [s for s, _ in sink.logged] == [4] and sink.logged[0][1] == m
        assert len(sink.begun) == 1 and sink.begun[0].config == {"what": "synthetic"}
        record = sink.records[0]
        assert record.per_depth == [0.8, 0.5, 0.2] and record.histogram == [0] + [len(session.eval_ids)] * 3 + [0]
        assert [t.id for t in record.table()] == session.table_ids  # read on demand, tokens included
        assert record.table()[0].input_ids == session.cache.token_ids(session.table_ids[0])


def test_a_full_measurement_adds_its_exact_figures_under_full(session):
    with pytest.warns(RuntimeWarning, match="broken tracker"):
        last = publisher(session, []).publish(measurement(session, full=True), [], 0)
    m = last.metrics
    assert m[PREFIX + "acceptance/depth_01"] == 0.8  # the main keys stay the light estimator's
    assert m[PREFIX + "full/acceptance/depth_01"] == 0.9 and m[PREFIX + "full/anchor_stride"] == 1.0
    assert PREFIX + "full/ddtree/tau_b4" in m and PREFIX + "ddtree/tau_b4" not in m  # budget 4 is full-only
    assert m[PREFIX + "full/eval_time_s"] == m[PREFIX + "eval_time_s"] == 1.5  # the cost of the pass that ran


def test_other_ranks_get_the_counts_based_figures_and_publish_nothing(session):
    lines: list[str] = []
    history: list[dict[str, float]] = []
    last = publisher(session, lines).publish(measurement(session, full=False, rank=1), history, 0)
    assert last.metrics[PREFIX + "tau"] == 2.0 and last.shared == last.metrics and last.samples == []
    assert not any("_ci_" in k for k in last.metrics)  # intervals need the samples, on rank zero
    assert history == [] and lines == [] and all(not getattr(s, "logged", []) for s in session.loop.sinks)


def test_console_off_and_the_setup_line_once(session):
    lines: list[str] = []
    quiet = publisher(session, lines, console=False)
    with pytest.warns(RuntimeWarning, match="broken tracker"):
        quiet.publish(measurement(session, full=False), [], 0)
    assert lines == []
    loud = publisher(session, lines)
    from dflash_cb.core.costs.evaluation import EvalCost

    cost = EvalCost(anchors=12, gflop=0.5)
    with pytest.warns(RuntimeWarning, match="broken tracker"):
        loud.setup(0, 1.0, {"light": cost, "full": cost})
    loud.setup(0, 1.0, {"light": cost})  # once per session
    assert len(lines) == 1 and "light: ~12 anchors" in lines[0]
    logged = session.loop.sinks[0].logged
    assert logged[1:] == [(0, {PREFIX + "setup_time_s": session.setup_seconds, PREFIX + "predicted/light_anchors": 12.0,
                           PREFIX + "predicted/light_gflop": 0.5, PREFIX + "predicted/full_anchors": 12.0,
                           PREFIX + "predicted/full_gflop": 0.5})]


def test_the_failure_counter_alone(session):
    with pytest.warns(RuntimeWarning, match="the failure counter"):
        publisher(session, []).failure_counter(6, 3)
    assert session.loop.sinks[0].logged == [(6, {PREFIX + "failed_evaluations": 3.0})]  # nothing else
