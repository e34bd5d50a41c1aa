"""``LiveEvaluator``: the drafter's exact offline tau while it trains, in any training loop.

It owns everything but the loop, in three parts: its configuration (``config.EvalConfig``, frozen, checked
once), its resumable state (``eval_state.EvalState``: the schedule and the history, what a checkpoint
carries) and the run's session (``session.EvalSession``: the opened cache, the samples, the references,
the drafter's spec, the sinks), built fresh at every ``setup``. A loop calls it once per optimizer step::

    evaluator = LiveEvaluator("cached_states/qwen36-27b-v1", every_n_train_steps=500, log=wandb_run)
    evaluator.start(step, drafter)            # before the first step: the untrained (or resumed) drafter
    for batch in data:
        ...; optimizer.step(); step += 1
        evaluator.step(step, drafter)          # the metrics dict when it evaluated, else None
    evaluator.finish(step, drafter)            # the full evaluation at the end
    # checkpoints: save evaluator.state_dict(), restore with evaluator.load_state_dict()

An evaluation is measured (``_measure``: every rank scores its share, the counts are summed) and then
published (``_publish``: the metric keys, the history, the console line, the sinks). The adapters are
thin: ``DFlashEvalCallback`` (Lightning, ``callback.py``) and ``DFlashEvalTrainerCallback`` (Hugging Face
``Trainer``, ``hf_callback.py``).

Under ``torch.distributed`` (any loop) every rank calls the same methods at the same steps: rank r
scores ``samples[r::world]``, the integer counts are summed with one ``all_reduce`` before any
ratio (the numbers equal a single process's exactly), the per-sample lengths are gathered to rank
zero for the intervals, and only rank zero logs (``live_eval``, ``distributed``). Sharded
parameters (FSDP) are gathered with the loop's ``full_parameters``, by default
``distributed.full_parameters_of`` the ``model`` passed to the calls (or the drafter).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..cache.states import TargetHead
from ..common import arguments as check
from ..common.errors import DFlashCBError
from ..common.timing import PhaseTimer
from ..core.anchor_sets import sparse_stride_warning
from ..core.baselines import baseline_scalars
from ..core.compare import live_metrics
from ..core.cost import (
    eval_overhead,
    predict,
    setup_line,
)
from ..core.engine import (
    EvalReport,
    SampleResult,
    anchors_per_sample,
    group_seconds,
    resolve_autocast,
)
from ..core.metrics import (
    ANCHOR_STRIDE,
    ANCHORS_DRAFTED,
    EVAL_OVERHEAD,
    EVAL_STEP,
    EVAL_TIME,
    FAILED_EVALS,
    FULL_PREFIX,
    PREDICTED_SECONDS,
    SETUP_TIME,
    TAU,
    EvalCounts,
    ddtree_tau,
    per_depth,
    predicted_anchors,
    predicted_gflop,
    summarize,
)
from ..core.model import DrafterSpec
from ..core.report import evaluation_line
from .config import EvalConfig
from .distributed import full_parameters_of, world
from .drafter_source import target_weight, unwrap
from .eval_state import EvalState, MalformedStateError, estimator_record, new_series_reason
from .live_eval import RankedEvaluation, evaluate_across_ranks, score_untouched
from .schedule import (
    FIT_END,
    Profile,
    choose_profile,
    fit_end_eval_due,
    fit_start_eval_due,
    periodic_eval_reason,
)
from .session import EvalSession, LoopContext, drafter_fit, open_session
from .sinks import EvaluationRecord, MetricsSink, RunInfo, TableSample, as_sinks


class DFlashEvalError(DFlashCBError, RuntimeError):
    """An evaluation failed (raised only with ``fail_on_error=True``; otherwise a warning)."""


class DrafterChangedError(DFlashCBError, ValueError):
    """The drafter passed to an evaluation is not the one checked at setup (block size, layers, ...)."""


@dataclass
class LastEvaluation:
    """The last successful evaluation, as this rank knows it."""

    step: int
    metrics: dict[str, float]  # what the call returned (rank zero: everything logged; others: counts-based)
    shared: dict[str, float]  # every rank: the counts-based figures, the same on each (callback_metrics)
    summary: dict[str, float]  # rank zero: unprefixed figures, intervals included ({} elsewhere)
    samples: list[SampleResult]  # rank zero: every evaluated sample, in eval_ids order ([] elsewhere)


@dataclass
class Measurement:
    """One evaluation as measured, before it is published."""

    step: int
    reason: str
    profile: Profile
    counts: dict[int, EvalCounts]  # per anchor-statistics stride, summed over every rank
    seconds: float
    rank: int
    samples: list[SampleResult]  # rank zero: every rank's samples, in eval_ids order; empty elsewhere
    predicted: float | None = None  # the seconds predicted before it ran (None at a session's first)
    warm_up: float | None = None  # a session's first evaluation: the seconds of it spent warming up


class LiveEvaluator:
    """Evaluate a DFlash drafter on cached target states during training; framework-neutral.

    Args:
        config: an ``EvalConfig`` (every option, documented there), or the cache folder (also as
            ``states=``): then ``every_n_train_steps`` and ``options`` are the config's other fields.
        log: where the numbers go (each evaluation's scalars; once, at the first call, the setup's
            predicted cost; after a failure, the failure counter alone): a function ``log(metrics, step)``,
            a W&B run (scalars, tables and charts), a ``sinks.MetricsSink``, or a list of these. None:
            nowhere but ``history``. An adapter passes its loop's sinks to ``setup`` instead.
        max_steps: the run's last step, if known (None or -1: unknown): its evaluation is the full fit-end one.
        full_parameters: ``() -> context manager`` that makes sharded parameters whole on every rank
            (default: ``distributed.full_parameters_of(model or drafter)``: FSDP 1 and 2).
        say: prints the console line (rank zero; default ``print``).
        name: names the evaluator in warnings and console lines.
    """

    def __init__(
        self,
        config: EvalConfig | str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        *,
        log: Any = None,
        max_steps: int | None = None,
        full_parameters: Callable[[], AbstractContextManager[Any]] | None = None,
        say: Callable[[str], Any] = print,
        name: str = "LiveEvaluator",
        **options: Any,
    ) -> None:
        if config is None:  # LiveEvaluator(states=..., ...), as the adapters spell it
            if "states" not in options:
                raise check.ArgumentError("LiveEvaluator: give the cache folder (states=...) or an EvalConfig")
            config = options.pop("states")
        if isinstance(config, EvalConfig):
            if every_n_train_steps is not None or options:
                given = sorted(options) + (["every_n_train_steps"] if every_n_train_steps is not None else [])
                raise check.ArgumentError(f"LiveEvaluator: {', '.join(given)} given beside an EvalConfig; set them "
                                          "in the config (config.replace(...))")
        else:
            if every_n_train_steps is not None:
                options["every_n_train_steps"] = every_n_train_steps
            config = EvalConfig(config, **options)
        self.config: EvalConfig = config
        self.name = name
        self.say = say
        self._default_loop = LoopContext(as_sinks(log), _check_max_steps(max_steps), full_parameters)
        self.state = EvalState()  # what a checkpoint carries (state_dict / load_state_dict)
        self.session: EvalSession | None = None  # the run's, built by setup
        self.last: LastEvaluation | None = None  # the last evaluation that succeeded, in this process
        self._last_seen_step: int | None = None  # the loop's last call, to refuse steps that go back

    # -- read-only views ------------------------------------------------------------------------
    @property
    def history(self) -> list[dict[str, float]]:
        """Rank zero: ``{"step": s, metric: value, ...}`` per evaluation of this series."""
        return self.state.history

    @property
    def prefix(self) -> str:
        return self.config.prefix

    @property
    def eval_ids(self) -> list[str]:
        """The evaluated sample ids (after ``setup``)."""
        return self.session.eval_ids if self.session is not None else []

    @property
    def validated(self) -> bool:
        """Whether the drafter was checked against the cache (``validate``) since ``setup``."""
        return self.session is not None and self.session.spec is not None

    # -- resumable state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and the history. A malformed state (a missing field, a wrong type, a
        history that is not a list of evaluations) warns, naming the field, and a new series starts
        here, as on another cache: the resumed training goes on and its weights are evaluated at
        once; the checkpoint file is left as it is."""
        try:
            self.state = EvalState.from_dict(state_dict)
        except MalformedStateError as e:
            warnings.warn(f"{self.name}: the checkpoint's evaluation state is malformed ({e}); it is "
                          "ignored and a new series starts here (the checkpoint was edited, damaged, or written by "
                          "an incompatible version).", RuntimeWarning, stacklevel=2)
            self.state = EvalState()
        self._last_seen_step = None
        if self.session is not None:  # restored after setup
            self._continue_series()

    def _continue_series(self) -> None:
        """A state from a run on another cache (same path, replaced contents) or another sample
        selection (``num_samples``, ``sample_ids``, ``sample_seed``) starts a new series; then the state
        records this run's cache and selection."""
        s = self.session
        assert s is not None
        estimator = self._estimator()
        reason = new_series_reason(self.state.cache_manifest_sha256, self.state.sample_selection,
                                   s.cache.manifest_sha256, s.selection, s.cache.path, self.state.estimator, estimator)
        if reason is not None:
            warnings.warn(f"{self.name}: the checkpoint's evaluations were {reason}. Its {len(self.history)} "
                          "evaluation(s) are dropped and a new series starts here; numbers from different caches or "
                          "sample selections are not comparable.", RuntimeWarning, stacklevel=3)
            self.state = EvalState()  # and the resumed weights are evaluated at once
        self.state.cache_manifest_sha256, self.state.sample_selection = s.cache.manifest_sha256, s.selection
        if estimator is not None:
            self.state.estimator = estimator

    def _estimator(self) -> dict[str, int] | None:
        """The main keys' estimator (``eval_state.estimator_record``), once the drafter's block is known."""
        s = self.session
        if s is None or s.spec is None:
            return None
        return estimator_record(s.block_size, self.config.light_stride(s.block_size), self.config.anchor_seed)

    # -- the loop's calls -----------------------------------------------------------------------
    def setup(self, drafter: nn.Module | None = None, model: Any = None, *, sinks: list[MetricsSink] | None = None,
              max_steps: int | None = None,
              full_parameters: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        """Open a new session: the cache checked, the samples chosen, the baselines loaded; with ``drafter``,
        the drafter checked against the cache. ``sinks``, ``max_steps`` and ``full_parameters`` are the
        loop's for this run (default: the constructor's).

        Raises before any training step (``CacheError``, ``CacheMismatchError``, ``ArgumentError``),
        naming the file or field. ``start``/``step`` call it if the loop did not.
        """
        d = self._default_loop
        loop = LoopContext(list(sinks) if sinks is not None else list(d.sinks),
                           _check_max_steps(max_steps) if max_steps is not None else d.max_steps,
                           full_parameters if full_parameters is not None else d.full_parameters)
        self.session = open_session(self.config, loop)
        self._last_seen_step = None
        self._continue_series()
        if drafter is not None:
            self.validate(drafter, model)

    def start(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """Before the first training step: the evaluation of the untrained (or resumed) drafter, once per
        run (``eval_on_fit_start``; a resumed run does not repeat it). Metrics, or None."""
        self._ready(global_step, drafter, model, "start")
        assert self.session is not None
        if global_step < self.state.last_eval_step:
            # A loop that starts again from an earlier step without restoring a checkpoint (a second
            # trainer.train(), a restart without resume) is a new run: its numbers are a new series.
            warnings.warn(f"{self.name}: start at global step {global_step}, before the last evaluated step "
                          f"{self.state.last_eval_step}, without a restored state: a new training run, so a new "
                          f"series starts (the {len(self.history)} earlier evaluation(s) are dropped)",
                          RuntimeWarning, stacklevel=2)
            self.state = EvalState()
            self._continue_series()
        self.session.clock = (time.perf_counter(), global_step)
        due = fit_start_eval_due(global_step, self.state.last_eval_step, self.state.start_done,
                                 self.config.eval_on_fit_start)
        self.state.start_done = True
        return self._evaluate(global_step, drafter, model, "fit start") if due else None

    def step(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After optimizer step ``global_step``: evaluate if it is due. Metrics (rank zero: everything
        logged; other ranks: the counts-based ones), or None (not due, or failed: a warning)."""
        self._ready(global_step, drafter, model, "step")
        assert self.session is not None
        reason = periodic_eval_reason(global_step, self.config.every_n_train_steps, self.state.last_eval_step,
                                      self.config.eval_on_fit_end, self.session.loop.max_steps)
        return self._evaluate(global_step, drafter, model, reason) if reason is not None else None

    def finish(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After the last step: the full evaluation (``eval_on_fit_end``), unless that step had one."""
        self._check_step(global_step, "finish")
        if not fit_end_eval_due(global_step, self.state.last_eval_step, self.state.last_eval_full,
                                self.config.eval_on_fit_end):
            return None
        self._ready(global_step, drafter, model, "finish")
        return self._evaluate(global_step, drafter, model, FIT_END)

    def metrics_at(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """The metrics of step ``global_step``: the last evaluation's when it measured this step, else an
        evaluation now (light, logged like the others). For a loop that picks its best checkpoint at its own
        evaluations (Hugging Face's ``metric_for_best_model``, SpecForge's best metric): the checkpoint then
        carries the tau of its own step. None when this step's evaluation failed."""
        self._ready(global_step, drafter, model, "metrics_at")
        if self.state.last_eval_step == global_step:
            return dict(self.last.metrics) if self.last is not None and self.last.step == global_step else None
        return self._evaluate(global_step, drafter, model, f"step {global_step}")

    def _check_step(self, global_step: Any, call: str) -> None:
        """Steps are integers that never go back within a session (a resumed run opens a new one)."""
        if not check.is_int(global_step) or global_step < 0:
            raise check.ArgumentError(f"{self.name}.{call}(global_step={global_step!r}): expected the loop's "
                                      "optimizer step, an integer >= 0")
        last = self._last_seen_step
        if last is not None and global_step < last:
            raise check.ArgumentError(
                f"{self.name}.{call}(global_step={global_step}) after step {last}: steps must not go back. A new "
                "training run needs setup() (or a new LiveEvaluator); a resumed one, load_state_dict() first")
        if call == "step" and self.session is not None and not self.state.start_done and self.config.eval_on_fit_start:
            raise check.ArgumentError(f"{self.name}.step(global_step={global_step}) before start(): call start() "
                                      "once before the first training step (it evaluates the untrained drafter)")
        self._last_seen_step = int(global_step)

    def _ready(self, global_step: int, drafter: nn.Module, model: Any, call: str) -> None:
        if self.session is None:
            self.setup()
        self._check_step(global_step, call)
        if not self.validated:
            with self._gathered(drafter, model):  # under FSDP, shapes are only right with whole parameters
                self.validate(drafter, model)
        self.report_setup(global_step, drafter)

    def report_setup(self, global_step: int, drafter: nn.Module) -> None:
        """Once per session, on rank zero: the setup's console line (time, hashing, predicted cost of a
        periodic and a full evaluation, ``cost.predict``), and the predicted figures logged."""
        s = self.session
        if s is None or s.setup_reported or s.spec is None:
            return
        s.setup_reported = True
        if world()[0] != 0:
            return
        spec, cfg, block = s.spec, self.config, s.block_size
        last = self.history[-1].get(TAU) if self.history else None
        tau = last if isinstance(last, float) and math.isfinite(last) else 1.0
        costs = predict(unwrap(drafter), block, len(spec.target_layer_ids) * spec.target_hidden_size,
                        [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(s.cache.entry, s.eval_ids)],
                        tau, {"periodic": (cfg.light_budgets, cfg.light_stride(block)),
                              "full": (cfg.ddtree_budgets, 1)})
        v = s.verified
        if cfg.console:
            self.say(f"{self.name} " + setup_line(len(s.eval_ids), v.files if v else 0, v.bytes if v else 0,
                                                  v.seconds if v else 0.0, s.setup_seconds, tau, costs))
        scalars = {self.prefix + SETUP_TIME: s.setup_seconds}
        for kind, c in costs.items():
            scalars[self.prefix + predicted_anchors(kind)] = float(c.anchors)
            scalars[self.prefix + predicted_gflop(kind)] = c.gflop
        self._to_sinks("the setup's predicted cost", global_step, lambda sink: sink.log(scalars, global_step))

    def _gathered(self, drafter: nn.Module, model: Any) -> AbstractContextManager[Any]:
        assert self.session is not None
        if self.session.loop.full_parameters is not None:
            return self.session.loop.full_parameters()
        return full_parameters_of(model if isinstance(model, nn.Module) else drafter)

    # -- the drafter against the cache -----------------------------------------------------------
    def validate(self, drafter: nn.Module, model: Any = None) -> None:
        """Cache vs drafter (and head) compatibility; raises CacheMismatchError naming every field."""
        s = self.session
        assert s is not None, "setup() first"
        s.spec, s.block_size = drafter_fit(s, self.config, unwrap(drafter), model, self.name)
        light = self.config.light_stride(s.block_size)
        sparse = sparse_stride_warning(anchors_per_sample(s.cache, s.eval_ids), light, self.config.anchor_seed,
                                       option="periodic_anchor_stride")
        if sparse is not None:
            warnings.warn(f"{self.name}: {sparse}", RuntimeWarning, stacklevel=2)
        self._continue_series()  # the block and anchor set are known now

    def _check_same_drafter(self, drafter: nn.Module) -> DrafterSpec:
        """The drafter of this evaluation has the spec checked at setup (cheap: its config only)."""
        assert self.session is not None and self.session.spec is not None
        was, now = self.session.spec, DrafterSpec.of(drafter)
        changed = [f"{name} {a!r} -> {b!r}" for name, a, b in was.differences(now)]
        if changed:
            raise DrafterChangedError(f"the drafter changed since setup ({'; '.join(changed)}); a drafter of "
                                      "another shape needs a new setup (a new run or a new evaluator)")
        return was

    def _target_head(self, model: Any, device: torch.device, dtype: torch.dtype) -> TargetHead:
        cfg = self.config
        if not cfg.needs_cache_head:
            embed = target_weight(model, cfg.target_embed, self.name)
            head = target_weight(model, cfg.target_lm_head, self.name) if cfg.target_lm_head is not None else embed
            return TargetHead(embed, head, tied=head is embed)
        assert self.session is not None
        return self.session.head.get(device, dtype)

    # -- one evaluation: measure, then publish ------------------------------------------------------
    def _evaluate(self, step: int, drafter: nn.Module, model: Any, reason: str) -> dict[str, float] | None:
        s = self.session
        assert s is not None and s.spec is not None
        # Recorded first: a failed evaluation is not retried at the next micro-batch of the same step.
        self.state.last_eval_step = step
        cfg = self.config
        profile = choose_profile(reason, self.state.num_evals, cfg.full_every_n_evals, cfg.ddtree_budgets,
                                 cfg.light_budgets, cfg.light_stride(s.block_size))
        self.state.last_eval_full = profile.full
        kind = "full" if profile.full else "light"
        c = s.cost
        first = c.warm_up_seconds is None
        predictor = c.model_of(unwrap(drafter), s)
        predicted = predictor.predict(kind, profile.budgets, profile.stride, c.tau, c.tree_taus,
                                      c.draft_all_is_cheaper(profile)) if predictor is not None else None
        ranked = self._measure(step, drafter, model, profile)
        since, s.clock = s.clock, (time.perf_counter(), step)
        if ranked.failed:
            self._on_failure(step, reason, ranked)
            return None
        s.failed_in_a_row = 0
        assert ranked.counts is not None
        m = Measurement(step, reason, profile, ranked.counts, ranked.seconds, ranked.rank, ranked.samples or [],
                        predicted, c.warm_up_seconds if first else None)
        c.measured(summarize(m.counts[profile.stride]), profile)
        # NaN for an evaluation with no training before it.
        overhead = eval_overhead(m.seconds, s.clock[0] - since[0]) if since is not None and since[1] != step else math.nan
        return self._publish(m, overhead)

    def _measure(self, step: int, drafter: nn.Module, model: Any, profile: Profile) -> RankedEvaluation:
        """Every rank scores its share without touching the training state; counts summed across ranks."""
        s = self.session
        assert s is not None and s.spec is not None
        # The light stride's statistics come from the same pass as a full evaluation's own (one estimator
        # per key: the main keys are the light profile's at every evaluation).
        strides = [profile.stride] + ([profile.light_stride] if profile.light_stride != profile.stride else [])
        templates = {st: EvalCounts(s.block_size, profile.budgets, s.categories) for st in strides}

        def score(ids: list[str]) -> EvalReport:
            # Inside the scoring, so that a changed drafter or cache fails this evaluation under the policy.
            spec = self._check_same_drafter(unwrap(drafter))
            s.cache.check_unchanged()  # a folder replaced during training fails here, naming both manifest hashes
            module = unwrap(drafter)
            param = next(module.parameters())
            autocast = resolve_autocast(self.config.autocast_dtype, param.device, param.dtype)
            head = self._target_head(model, param.device, autocast or param.dtype)
            table = set(s.table_ids)
            keep = self.config.table_cycles if self.config.table_samples > 0 and table.intersection(ids) else 0
            run = dict(device=param.device, budgets=profile.budgets, autocast_dtype=autocast, spec=spec,
                       verify=self.config.verify_cache, tail_blocks=self.config.tail_blocks, block_size=s.block_size)
            if s.cost.warm_up_seconds is None:
                self._warm_up(module, head, ids, run)
            s.cost.draft_all = s.cost.draft_all_is_cheaper(profile)
            timer = PhaseTimer(sync=torch.cuda.synchronize if param.device.type == "cuda" else None)
            started = time.perf_counter()
            # verify: only a shard whose file identity changed since it was hashed is hashed again.
            report = score_untouched(s.cache, module, head, ids, anchor_stride=profile.stride,
                                     extra_anchor_strides=strides[1:], anchor_seed=self.config.anchor_seed,
                                     keep_drafts=keep, draft_all=s.cost.draft_all, timer=timer, **run)
            s.cost.groups = group_seconds(timer.seconds, time.perf_counter() - started)
            s.cost.counted = (int(report.counts.data[ANCHORS_DRAFTED].item()), report.passes)
            for r in report.samples:
                if r.id not in table:
                    r.drafts = None  # only the table's drafts travel to rank zero
            return report

        return evaluate_across_ranks(s.eval_ids, score, templates, lambda: self._gathered(drafter, model))

    def _warm_up(self, module: nn.Module, head: TargetHead, ids: list[str], run: dict[str, Any]) -> None:
        """A session's first evaluation starts with one of this rank's samples scored at stride 1: the first
        calls' one-time costs are paid there, timed apart (the first evaluation's console line says how long)."""
        s = self.session
        assert s is not None
        lengths = anchors_per_sample(s.cache, ids[:16])
        started = time.perf_counter()
        if lengths:
            score_untouched(s.cache, module, head, [max(lengths, key=lengths.__getitem__)], anchor_stride=1, **run)
        s.cost.warm_up_seconds = time.perf_counter() - started

    def _publish(self, m: Measurement, overhead: float) -> dict[str, float]:
        """The metric keys of a measurement, the history, the console line and the sinks.

        Main keys: the light profile's figures at every evaluation (the strided statistics, the light
        budgets), so a series never mixes estimators; a full evaluation adds its exact figures (stride 1,
        every budget) under ``{prefix}full/``. The cost keys (time, overhead, anchors drafted) describe the
        pass that ran, under the main keys at every evaluation (and under ``full/`` too at a full one)."""
        s = self.session
        assert s is not None and s.spec is not None
        prefix, p = self.prefix, m.profile
        cost = {EVAL_TIME: m.seconds, EVAL_OVERHEAD: overhead}
        if m.predicted is not None:
            cost[PREDICTED_SECONDS] = m.predicted
        summary = {**_light_only(summarize(m.counts[p.light_stride]), p), **cost}
        full = {**summarize(m.counts[p.stride]), **cost} if p.full else None
        self.state.num_evals += 1
        shared = _prefixed(summary, prefix)
        if full is not None:
            shared.update(_prefixed(full, prefix + FULL_PREFIX))
        shared[prefix + EVAL_STEP] = float(m.step)
        # Every rank gets the counts-based numbers, so a loop can act on them anywhere (ModelCheckpoint, ...).
        if m.rank != 0:
            self.last = LastEvaluation(m.step, dict(shared), dict(shared), {}, [])
            return shared
        summary.update(self._sample_metrics(m, p.light_budgets, p.light_stride))
        metrics = dict(shared)
        metrics.update(_prefixed(summary, prefix))
        if full is not None:
            full.update(self._sample_metrics(m, p.budgets, p.stride))
            metrics.update(_prefixed(full, prefix + FULL_PREFIX))
            metrics[prefix + FULL_PREFIX + ANCHOR_STRIDE] = float(p.stride)
        self.state.history.append({"step": m.step, **summary,
                                   **{FULL_PREFIX + k: v for k, v in (full or {}).items()}})
        if self.config.console:
            shown, budgets = (full, p.budgets) if full is not None else (summary, p.light_budgets)
            self.say(f"{self.name} " + evaluation_line(m.step, shown, budgets,
                                                       [b.key for b in s.baselines if b.samples],
                                                       self._first_note(m)))
        metrics[prefix + ANCHOR_STRIDE] = float(p.light_stride)
        metrics[prefix + FAILED_EVALS] = float(self.state.failed_evaluations)
        metrics.update(baseline_scalars(s.baselines, prefix))
        self._begin_run()
        self._to_sinks(f"the evaluation at step {m.step}", m.step, lambda sink: sink.log(metrics, m.step))
        record = EvaluationRecord(m.step, prefix, metrics, per_depth(summary, s.block_size)["unconditional"],
                                  m.counts[p.light_stride].data["hist"].tolist(), s.baselines, self.history,
                                  lambda: self._table(m.samples))
        self._to_sinks(f"the evaluation at step {m.step}", m.step, lambda sink: sink.evaluation(record))
        self.last = LastEvaluation(m.step, dict(metrics), dict(shared), dict(summary), m.samples)
        return metrics

    def _first_note(self, m: Measurement) -> str:
        """What a session's first evaluation spent besides scoring: its warm-up, and the setup before it."""
        s = self.session
        if m.warm_up is None or s is None:
            return ""
        v = s.verified
        hashed = f", sha256 of {v.files} file(s) {v.seconds:.2f} s" if v is not None and v.files else ""
        return f"first evaluation: {m.warm_up:.2f} s of it warm-up; setup {s.setup_seconds:.2f} s before it{hashed}"

    def _sample_metrics(self, m: Measurement, budgets: tuple[int, ...], stride: int) -> dict[str, float]:
        """Rank zero: intervals (the anchor statistics' at ``stride``), position/cycle taus and paired deltas,
        from the per-sample results."""
        s = self.session
        assert s is not None
        try:
            return live_metrics(m.samples, budgets, s.categories, s.baselines, self.config.position_edges,
                                anchor_stride=stride)
        except Exception as e:  # an extra figure must not end the training
            if self.config.fail_on_error:
                raise
            warnings.warn(f"{self.name}: intervals at step {m.step} failed: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=4)
            return {}

    def _table(self, samples: list[SampleResult]) -> list[TableSample]:
        s = self.session
        assert s is not None
        by_id = {r.id: r for r in samples}
        return [s.table_sample(i, by_id[i].acceptance_lengths, by_id[i].drafts) for i in s.table_ids if i in by_id]

    def _on_failure(self, step: int, reason: str, result: RankedEvaluation) -> None:
        """Count the failed evaluation, then raise (``fail_on_error``, too many in a row) or warn."""
        # Every rank sees the same failed_ranks, so every rank counts (and raises) alike.
        s = self.session
        assert s is not None
        error = result.error
        self.state.failed_evaluations += 1
        s.failed_in_a_row += 1
        msg = f"{self.name}: evaluation at {reason} (global step {step}) failed"
        if error is not None:
            msg += f" on rank {result.rank}: {type(error).__name__}: {error}"
        else:
            msg += f" on {result.failed_ranks} other rank(s); see their warnings"
        if result.rank == 0:
            # The failure counter alone, so a panel (or a W&B alert on it) shows evaluations that failed.
            counter = {self.prefix + FAILED_EVALS: float(self.state.failed_evaluations)}
            self._to_sinks("the failure counter", step, lambda sink: sink.log(counter, step))
        if self.config.fail_on_error:
            raise DFlashEvalError(msg) from error
        k = self.config.max_failed_evaluations
        if k and s.failed_in_a_row >= k:
            raise DFlashEvalError(f"{msg}. {s.failed_in_a_row} evaluations in a row failed "
                                  f"(max_failed_evaluations={k}): stopping rather than training on "
                                  "without measurements") from error
        warnings.warn(msg + f". Training continues (failure {s.failed_in_a_row} in a row; "
                      f"max_failed_evaluations={k}).", RuntimeWarning, stacklevel=4)

    # -- the sinks (rank zero) ----------------------------------------------------------------------
    def _begin_run(self) -> None:
        s = self.session
        assert s is not None
        if s.sinks_begun:
            return
        s.sinks_begun = True
        info = RunInfo(self.prefix, self.describe(), s.baselines, s.published_skipped, self.config.tokenizer)
        self._to_sinks("the run's configuration", None, lambda sink: sink.begin(info))

    def _to_sinks(self, what: str, step: int | None, call: Callable[[MetricsSink], Any]) -> None:
        """One policy for every sink: a sink that raises is named in a warning, the others still get the
        numbers, and the training goes on."""
        assert self.session is not None
        for sink in self.session.loop.sinks:
            try:
                call(sink)
            except Exception as e:
                warnings.warn(f"{self.name}: logging {what} to {sink} failed: {type(e).__name__}: {e}; the other "
                              "sinks still get it and the training goes on", RuntimeWarning, stacklevel=3)

    def describe(self) -> dict[str, Any]:
        """The configuration recorded in the run's config (W&B ``{prefix}config``)."""
        s = self.session
        assert s is not None
        return {
            "states": self.config.states, "cache_manifest_sha256": s.cache.manifest_sha256,
            "samples_evaluated": len(s.eval_ids), "samples_in_cache": len(s.cache),
            **self.config.describe(s.block_size if s.spec is not None else None),
            "drafter_block_size": s.spec.block_size if s.spec is not None else None,
        }


def _light_only(summary: dict[str, float], profile: Profile) -> dict[str, float]:
    """A full pass's summary at the light stride, less the DDTree budgets a light evaluation does not run."""
    extra = set(profile.budgets) - set(profile.light_budgets)
    return {k: v for k, v in summary.items() if k not in {ddtree_tau(b) for b in extra}}


def _prefixed(values: dict[str, float], prefix: str) -> dict[str, float]:
    """The finite values under ``prefix`` (a NaN is a figure that does not exist, e.g. an empty bucket)."""
    return {prefix + k: v for k, v in values.items() if isinstance(v, float) and math.isfinite(v)}


def _check_max_steps(max_steps: Any) -> int:
    if max_steps is None:
        return -1
    if not check.is_int(max_steps) or max_steps < -1:
        raise check.ArgumentError(f"max_steps={max_steps!r}: expected the run's last optimizer step (an integer "
                                  ">= 1), or None / -1 when unknown")
    return int(max_steps)


__all__ = ["DFlashEvalError", "DrafterChangedError", "LastEvaluation", "LiveEvaluator", "Measurement"]
