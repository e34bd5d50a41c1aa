"""The publishing side of the live evaluation: what a measurement becomes in the run.

``Publisher`` turns a ``measure.Measurement`` into the metric keys (the main keys, ``full/``, intervals and
paired comparisons), the history entry, the console line and what every sink receives (scalars, the run's
configuration once, the histogram, per-depth acceptance and sample table as an ``EvaluationRecord``). It
also logs the setup's predicted cost and the failure counter. One policy for every sink: a sink that raises
is named in a warning, the others still get everything, and the training goes on. It measures nothing, so
it is tested on synthetic measurements (``tests/integrations/test_publish.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...common import log
from ...core.costs.evaluation import EvalCost, setup_line
from ...core.figures.derived import live_metrics
from ...core.figures.metrics import (
    ANCHOR_STRIDE,
    EVAL_OVERHEAD,
    EVAL_STEP,
    EVAL_TIME,
    FAILED_EVALS,
    FULL_PREFIX,
    PREDICTED_SECONDS,
    SETUP_TIME,
    ddtree_tau,
    per_depth,
    predicted_anchors,
    predicted_gflop,
)
from ...core.replay import SampleResult
from ...core.results.baselines import baseline_scalars
from ...core.results.report import evaluation_line
from ..tracking.sinks import EvaluationRecord, MetricsSink, RunInfo, TableSample, sink_name
from .config import EvalConfig
from .measure import Measurement
from .projection import projected_metrics
from .schedule import Profile
from .session import EvalSession


@dataclass
class LastEvaluation:
    """The last successful evaluation, as this rank knows it."""

    step: int
    metrics: dict[str, float]  # what the call returned (rank zero: everything logged; others: counts-based)
    shared: dict[str, float]  # every rank: the counts-based figures, the same on each (callback_metrics)
    summary: dict[str, float]  # rank zero: unprefixed figures, intervals included ({} elsewhere)
    samples: list[SampleResult]  # rank zero: every evaluated sample, in eval_ids order ([] elsewhere)


class Publisher:
    """Publishes a session's measurements (rank zero logs; every rank gets the counts-based figures).

    Args:
        config: the evaluator's ``EvalConfig`` (prefix, console, position edges, failure policy).
        session: the run's opened cache, samples, baselines and sinks.
        describe: ``() -> dict``, the run's configuration for the sinks' ``begin``.
        name: names the evaluator in console lines and warnings.
        say: receives each console line (default: the package's console logger, ``common.log``).
    """

    def __init__(self, config: EvalConfig, session: EvalSession, describe: Callable[[], dict[str, Any]],
                 name: str = "LiveEvaluator", say: Callable[[str], Any] | None = None):
        self.config, self.session, self.describe, self.name = config, session, describe, name
        if say is None:
            log.ensure_console()
        self._say = say or log.say
        self._begun = False  # the sinks' begin() (the run's configuration)
        self.setup_reported = False
        self._tokens: dict[str, list[int]] = {}

    @property
    def prefix(self) -> str:
        return self.config.prefix

    @property
    def sinks(self) -> list[MetricsSink]:
        return self.session.loop.sinks

    def say(self, line: str) -> None:
        if self.config.console:
            self._say(f"{self.name} {line}")

    # -- once per session ---------------------------------------------------------------------------
    def setup(self, step: int, tau: float, costs: dict[str, EvalCost]) -> None:
        """Once per session (rank zero): the setup's console line (time, hashing, predicted cost of a light and a
        full evaluation) and the predicted figures logged at ``step``."""
        if self.setup_reported:
            return
        self.setup_reported = True
        s, v = self.session, self.session.verified
        self.say(setup_line(len(s.eval_ids), v.files if v else 0, v.bytes if v else 0, v.seconds if v else 0.0,
                            s.setup_seconds, tau, costs))
        scalars = {self.prefix + SETUP_TIME: s.setup_seconds}
        for kind, c in costs.items():
            scalars[self.prefix + predicted_anchors(kind)] = float(c.anchors)
            scalars[self.prefix + predicted_gflop(kind)] = c.gflop
        self._begin()  # before any log(): a sink may open its run in begin()
        self._to_sinks("the setup's predicted cost", lambda sink: sink.log(dict(scalars), step))

    # -- one evaluation ------------------------------------------------------------------------------
    def publish(self, m: Measurement, history: list[dict[str, float]], failed_evaluations: int) -> LastEvaluation:
        """The metric keys of a measurement, the history entry (appended to ``history`` on rank zero), the
        console line and the sinks.

        Main keys: the light profile's figures at every evaluation (the strided statistics, the light
        budgets), so a series never mixes estimators; a full evaluation adds its exact figures (stride 1,
        every budget) under ``{prefix}full/``. The cost keys (time, overhead, anchors drafted) describe the
        pass that ran, under the main keys at every evaluation (and under ``full/`` too at a full one)."""
        prefix, p = self.prefix, m.profile
        cost = {EVAL_TIME: m.seconds, EVAL_OVERHEAD: m.overhead}
        if m.predicted is not None:
            cost[PREDICTED_SECONDS] = m.predicted
        summary = {**_light_only(m.summaries[p.light_stride], p), **cost}
        full = {**m.summaries[p.stride], **cost} if p.full else None
        shared = _prefixed(summary, prefix)
        if full is not None:
            shared.update(_prefixed(full, prefix + FULL_PREFIX))
        shared[prefix + EVAL_STEP] = float(m.step)
        # Every rank gets the counts-based numbers, so a loop can act on them anywhere (ModelCheckpoint, ...).
        if m.rank != 0:
            return LastEvaluation(m.step, dict(shared), dict(shared), {}, [])
        summary.update(self._sample_metrics(m, p.light_budgets, p.light_stride))
        metrics = dict(shared)
        metrics.update(_prefixed(summary, prefix))
        if full is not None:
            full.update(self._sample_metrics(m, p.budgets, p.stride))
            metrics.update(_prefixed(full, prefix + FULL_PREFIX))
            metrics[prefix + FULL_PREFIX + ANCHOR_STRIDE] = float(p.stride)
        history.append({"step": m.step, **summary, **{FULL_PREFIX + k: v for k, v in (full or {}).items()}})
        shown, budgets = (full, p.budgets) if full is not None else (summary, p.light_budgets)
        self.say(evaluation_line(m.step, shown, budgets, [b.key for b in self.session.baselines if b.samples],
                                 self._first_note(m)))
        metrics[prefix + ANCHOR_STRIDE] = float(p.light_stride)
        metrics[prefix + FAILED_EVALS] = float(failed_evaluations)
        metrics.update(baseline_scalars(self.session.baselines, prefix))
        self._begin()
        what = f"the evaluation at step {m.step}"
        self._to_sinks(what, lambda sink: sink.log(dict(metrics), m.step))  # a sink that edits its dict edits its own
        record = EvaluationRecord(m.step, prefix, metrics, per_depth(summary, m.block_size)["unconditional"],
                                  m.counts[p.light_stride].data["hist"].tolist(), self.session.baselines, history,
                                  lambda: self._table(m.samples))
        self._to_sinks(what, lambda sink: sink.evaluation(record.copy()))
        return LastEvaluation(m.step, dict(metrics), dict(shared), dict(summary), m.samples)

    def failure_counter(self, step: int, failed_evaluations: int) -> None:
        """The failure counter alone (rank zero), so a panel (or a W&B alert on it) shows failed evaluations."""
        counter = {self.prefix + FAILED_EVALS: float(failed_evaluations)}
        self._begin()
        self._to_sinks("the failure counter", lambda sink: sink.log(dict(counter), step))

    def _first_note(self, m: Measurement) -> str:
        """What a session's first evaluation spent besides scoring: its warm-up, and the setup before it."""
        if m.warm_up is None:
            return ""
        s, v = self.session, self.session.verified
        hashed = f", sha256 of {v.files} file(s) {v.seconds:.2f} s" if v is not None and v.files else ""
        return f"first evaluation: {m.warm_up:.2f} s of it warm-up; setup {s.setup_seconds:.2f} s before it{hashed}"

    def _sample_metrics(self, m: Measurement, budgets: tuple[int, ...], stride: int) -> dict[str, float]:
        """Rank zero: intervals (the anchor statistics' at ``stride``), position/cycle taus and paired deltas,
        from the per-sample results."""
        s = self.session
        try:
            out = live_metrics(m.samples, budgets, s.categories, s.baselines, self.config.position_edges,
                               anchor_stride=stride)
            if s.cost_profile is not None:
                out.update(projected_metrics(s.cost_profile, s.cache, m.samples, m.block_size, budgets,
                                             m.family))
            return out
        except Exception as e:  # an extra figure must not end the training
            if self.config.fail_on_error:
                raise
            log.warn(f"{self.name}: intervals at step {m.step} failed: {type(e).__name__}: {e}", stacklevel=4)
            return {}

    def _table(self, samples: Sequence[SampleResult]) -> list[TableSample]:
        by_id = {r.id: r for r in samples}
        return [self._table_sample(i, by_id[i]) for i in self.session.table_ids if i in by_id]

    def _table_sample(self, sample_id: str, result: SampleResult) -> TableSample:
        """A table sample; its token ids are read once per run (only ``input_ids``: the features can be 100+ MB)."""
        cache = self.session.cache
        if sample_id not in self._tokens:
            self._tokens[sample_id] = cache.token_ids(sample_id)
        entry = cache.entry(sample_id)
        return TableSample(sample_id, entry.category, self._tokens[sample_id], entry.prompt_len,
                           result.acceptance_lengths, result.drafts)

    # -- the sinks (rank zero) ----------------------------------------------------------------------
    def _begin(self) -> None:
        """The sinks' ``begin`` once, before the first ``log`` (the setup's, an evaluation's or a failure's)."""
        if self._begun:
            return
        self._begun = True
        s = self.session
        info = RunInfo(self.prefix, self.describe(), s.baselines, s.published_skipped, self.config.tokenizer)
        self._to_sinks("the run's configuration", lambda sink: sink.begin(info))

    def _to_sinks(self, what: str, call: Callable[[MetricsSink], Any]) -> None:
        """One policy for every sink: a sink that raises is named in a warning, the others still get the
        numbers, and the training goes on."""
        for sink in self.sinks:
            try:
                call(sink)
            except Exception as e:
                log.warn(f"{self.name}: logging {what} to {sink_name(sink)} failed: {type(e).__name__}: "
                         f"{_said(e)}; the other sinks still get it and the training goes on", stacklevel=3)


def _said(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:
        return "(its message cannot be shown)"


def _light_only(summary: dict[str, float], profile: Profile) -> dict[str, float]:
    """A full pass's summary at the light stride, less the DDTree budgets a light evaluation does not run."""
    extra = set(profile.budgets) - set(profile.light_budgets)
    return {k: v for k, v in summary.items() if k not in {ddtree_tau(b) for b in extra}}


def _prefixed(values: dict[str, float], prefix: str) -> dict[str, float]:
    """The finite values under ``prefix`` (a NaN is a figure that does not exist, e.g. an empty bucket)."""
    return {prefix + k: v for k, v in values.items() if isinstance(v, float) and math.isfinite(v)}
