"""``LiveEvaluator``: the drafter's exact offline tau while it trains, in any training loop.

It keeps the loop's calls, the schedule, the series and the failure policy; the rest is in parts of their
own: the configuration (``config.EvalConfig``, frozen, checked once), the resumable state
(``eval_state.EvalState``: the schedule and the history, what a checkpoint carries), the run's session
(``session.EvalSession``: the opened cache, the samples, the references, the sinks; built fresh at every
``setup``), the drafter's check (``session.DrafterFit``, set once per session), the measuring side
(``measure.Measurer``: cost tracking, warm-up, head, the engine's request) and the publishing side
(``publish.Publisher``: keys, history, console line, sinks). A loop calls it once per optimizer step::

    evaluator = LiveEvaluator("cached_states/qwen36-27b-v1", every_n_train_steps=500, log=wandb_run)
    evaluator.start(step, drafter)            # before the first step: the untrained (or resumed) drafter
    for batch in data:
        ...; optimizer.step(); step += 1
        evaluator.step(step, drafter)          # the metrics dict when it evaluated, else None
    evaluator.finish(step, drafter)            # the full evaluation at the end
    # checkpoints: save evaluator.state_dict(), restore with evaluator.load_state_dict()

The adapters are thin: ``DFlashEvalCallback`` (Lightning, ``callback.py``), ``DFlashEvalTrainerCallback``
(Hugging Face ``Trainer``, ``hf_callback.py``) and SpecForge's ``attach`` (``specforge.py``).

Under ``torch.distributed`` (any loop) every rank calls the same methods at the same steps: rank r
scores ``samples[r::world]``, the integer counts are summed with one ``all_reduce`` before any
ratio (the numbers equal a single process's exactly), the per-sample lengths are gathered to rank
zero for the intervals, and only rank zero logs (``live_eval``, ``distributed``). Sharded
parameters (FSDP) are gathered with the loop's ``full_parameters``, by default
``distributed.full_parameters_of`` the ``model`` passed to the calls (or the drafter).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from ...common import arguments as check
from ...common import log
from ...common.errors import DFlashCBError
from ...core.figures.metrics import TAU
from ...core.loop.anchor_sets import sparse_stride_warning
from ...core.replay import anchors_per_sample
from ...core.results.baselines import MEASURED
from ...core.results.results_file import series_mismatch
from ..tracking.sinks import MetricsSink
from ..tracking.trackers import as_sinks
from .config import EvalConfig
from .distributed import full_parameters_of, world
from .drafter_source import unwrap
from .eval_state import EvalState, MalformedStateError, new_series_reason
from .measure import FailedMeasurement, Measurer
from .projection import cache_contexts, checked_settings, drafter_identity
from .publish import LastEvaluation, Publisher
from .schedule import (
    Reason,
    Trigger,
    choose_profile,
    fit_end_eval_due,
    fit_start_eval_due,
    periodic_eval_reason,
)
from .session import DrafterFit, EvalSession, LoopContext, drafter_fit, open_session, without_default_trees


class DFlashEvalError(DFlashCBError, RuntimeError):
    """An evaluation failed (raised only with ``fail_on_error=True``; otherwise a warning)."""


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
        say: receives the console lines (rank zero; default: the package's console logger, shown on stdout
            unless the program configured logging, ``dflash_cb.common.log``).
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
        say: Callable[[str], Any] | None = None,
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
        self.fit: DrafterFit | None = None  # the drafter as checked against the session's cache
        self._series: dict[str, Any] | None = None  # what identifies the main keys' figures, with fit
        self.last: LastEvaluation | None = None  # the last evaluation that succeeded, in this process
        self._measurer: Measurer | None = None  # built with fit
        self._publisher: Publisher | None = None  # built with the session
        self._last_seen_step: int | None = None  # the loop's last call, to refuse steps that go back
        self._failed_in_a_row = 0

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
        return self.fit is not None

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
            log.warn(f"{self.name}: the checkpoint's evaluation state is malformed ({e}); it is "
                     "ignored and a new series starts here (the checkpoint was edited, damaged, or written by "
                     "an incompatible version).")
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
        series = self._series
        reason = new_series_reason(self.state.cache_manifest_sha256, self.state.sample_selection,
                                   s.cache.manifest_sha256, s.selection, s.cache.path, self.state.series, series)
        if reason is not None:
            log.warn(f"{self.name}: the checkpoint's evaluations were {reason}. Its {len(self.history)} "
                     "evaluation(s) are dropped and a new series starts here; numbers from different caches or "
                     "sample selections are not comparable.", stacklevel=3)
            self.state = EvalState()  # and the resumed weights are evaluated at once
        self.state.cache_manifest_sha256, self.state.sample_selection = s.cache.manifest_sha256, s.selection
        if series is not None:
            self.state.series = series

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
        self.fit, self._measurer, self._series = None, None, None
        self._publisher = Publisher(self.config, self.session, self.describe, self.name, self.say)
        self._failed_in_a_row = 0
        self._last_seen_step = None
        self._continue_series()
        if drafter is not None:
            self.validate(drafter, model)

    def start(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """Before the first training step: the evaluation of the untrained (or resumed) drafter, once per
        run (``eval_on_fit_start``; a resumed run does not repeat it). Metrics, or None."""
        measurer = self._ready(global_step, drafter, model, "start")
        if global_step < self.state.last_eval_step:
            # A loop that starts again from an earlier step without restoring a checkpoint (a second
            # trainer.train(), a restart without resume) is a new run: its numbers are a new series.
            log.warn(f"{self.name}: start at global step {global_step}, before the last evaluated step "
                     f"{self.state.last_eval_step}, without a restored state: a new training run, so a new "
                     f"series starts (the {len(self.history)} earlier evaluation(s) are dropped)")
            self.state = EvalState()
            self._continue_series()
        measurer.start_clock(global_step)
        due = fit_start_eval_due(global_step, self.state.last_eval_step, self.state.start_done,
                                 self.config.eval_on_fit_start)
        self.state.start_done = True
        return self._evaluate(drafter, model, Reason(Trigger.FIT_START, global_step)) if due else None

    def step(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After optimizer step ``global_step``: evaluate if it is due. Metrics (rank zero: everything
        logged; other ranks: the counts-based ones), or None (not due, or failed: a warning)."""
        self._ready(global_step, drafter, model, "step")
        assert self.session is not None
        reason = periodic_eval_reason(global_step, self.config.every_n_train_steps, self.state.last_eval_step,
                                      self.config.eval_on_fit_end, self.session.loop.max_steps)
        return self._evaluate(drafter, model, reason) if reason is not None else None

    def finish(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After the last step: the full evaluation (``eval_on_fit_end``), unless that step had one."""
        self._check_step(global_step, "finish")
        if not fit_end_eval_due(global_step, self.state.last_eval_step, self.state.last_eval_full,
                                self.config.eval_on_fit_end):
            return None
        self._ready(global_step, drafter, model, "finish")
        return self._evaluate(drafter, model, Reason(Trigger.FIT_END, global_step))

    def metrics_at(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """The metrics of step ``global_step``: the last evaluation's when it measured this step, else an
        evaluation now (light, logged like the others). For a loop that picks its best checkpoint at its own
        evaluations (Hugging Face's ``metric_for_best_model``, SpecForge's best metric): the checkpoint then
        carries the tau of its own step. None when this step's evaluation failed."""
        self._ready(global_step, drafter, model, "metrics_at")
        if self.state.last_eval_step == global_step:
            return dict(self.last.metrics) if self.last is not None and self.last.step == global_step else None
        return self._evaluate(drafter, model, Reason(Trigger.PERIODIC, global_step))

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

    def _ready(self, global_step: int, drafter: nn.Module, model: Any, call: str) -> Measurer:
        if self.session is None:
            self.setup()
        self._check_step(global_step, call)
        if self._measurer is None:
            with self._gathered(drafter, model):  # under FSDP, shapes are only right with whole parameters
                self.validate(drafter, model)
        self.report_setup(global_step, drafter)
        assert self._measurer is not None
        return self._measurer

    def report_setup(self, global_step: int, drafter: nn.Module) -> None:
        """Once per session, on rank zero: the setup's console line (time, hashing, predicted cost of a
        light and a full evaluation, ``costs.evaluation.predict``), and the predicted figures logged."""
        p = self._publisher
        if self._measurer is None or p is None or p.setup_reported or world()[0] != 0:
            return
        last = self.history[-1].get(TAU) if self.history else None
        tau = last if isinstance(last, float) and math.isfinite(last) else 1.0
        p.setup(global_step, tau, self._measurer.setup_costs(drafter, tau))

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
        config, note = without_default_trees(self.config, unwrap(drafter))
        if note is not None:  # a family without trees: the default budgets go, said once
            self._publisher.say(f"({note})")
            self.config = self._publisher.config = config
        fit = drafter_fit(s.cache, self.config, unwrap(drafter), model, self.name)
        if s.cost_profile is not None:  # every setting a pass scores within the profile's rows
            own = s.cost_profile.for_drafter(drafter_identity(unwrap(drafter)))  # a profile of several: its passes
            if own is not s.cost_profile:
                s = self.session = dataclasses.replace(s, cost_profile=own)
                self._publisher.session = s
            checked_settings(s.cost_profile, unwrap(drafter), fit.block_size,
                             sorted({*self.config.ddtree_budgets, *self.config.light_budgets}),
                             f"{self.name}: cost_profile={self.config.cost_profile}",
                             "lower ddtree_budgets= (and light_ddtree_budgets=)", "block_size=",
                             cache_contexts(s.cache, s.eval_ids))
        self.fit = fit
        self._measurer = Measurer(self.config, s, fit, self._gathered, world, self.name)
        self._series = self._measurer.series(unwrap(drafter))
        for b in s.baselines:
            if b.kind == MEASURED:  # a reference measured with another block, tail convention or dtype
                theirs = b.series
                if b.details.get("family") not in (None, fit.spec.family):  # another family drafts its own block
                    theirs = {k: v for k, v in theirs.items() if k != "block_size"}
                mismatch = series_mismatch([("this run", self._series), (f"baseline {b.details.get('path')}", theirs)])
                if mismatch:
                    log.warn(f"{self.name}: {mismatch}")
        light = self.config.light_stride(fit.block_size)
        sparse = sparse_stride_warning(anchors_per_sample(s.cache, s.eval_ids), light, self.config.anchor_seed,
                                       option="light_anchor_stride")
        if sparse is not None:
            log.warn(f"{self.name}: {sparse}")
        self._continue_series()  # the block and anchor set are known now

    # -- one evaluation: measure, then publish ------------------------------------------------------
    def _evaluate(self, drafter: nn.Module, model: Any, reason: Reason) -> dict[str, float] | None:
        assert self._measurer is not None and self._publisher is not None and self.fit is not None
        step = reason.step
        # Recorded first: a failed evaluation is not retried at the next micro-batch of the same step.
        self.state.last_eval_step = step
        cfg = self.config
        profile = choose_profile(reason, self.state.num_evals, cfg.full_every_n_evals, cfg.ddtree_budgets,
                                 cfg.light_budgets, cfg.light_stride(self.fit.block_size))
        self.state.last_eval_full = profile.full
        m = self._measurer.measure(step, reason, profile, drafter, model)
        if isinstance(m, FailedMeasurement):
            self._on_failure(m)
            return None
        self._failed_in_a_row = 0
        self.state.num_evals += 1
        self.last = self._publisher.publish(m, self.state.history, self.state.failed_evaluations)
        return dict(self.last.metrics)

    def _on_failure(self, failed: FailedMeasurement) -> None:
        """Count the failed evaluation, then raise (``fail_on_error``, too many in a row) or warn."""
        # Every rank sees the same failed_ranks, so every rank counts (and raises) alike.
        assert self._publisher is not None
        error = failed.error
        self.state.failed_evaluations += 1
        self._failed_in_a_row += 1
        msg = f"{self.name}: evaluation at {failed.reason} (global step {failed.step}) failed"
        if error is not None:
            msg += f" on rank {failed.rank}: {type(error).__name__}: {error}"
        else:
            msg += f" on {failed.failed_ranks} other rank(s); see their warnings"
        if failed.rank == 0:
            self._publisher.failure_counter(failed.step, self.state.failed_evaluations)
        if self.config.fail_on_error:
            raise DFlashEvalError(msg) from error
        k = self.config.max_failed_evaluations
        if k and self._failed_in_a_row >= k:
            raise DFlashEvalError(f"{msg}. {self._failed_in_a_row} evaluations in a row failed "
                                  f"(max_failed_evaluations={k}): stopping rather than training on "
                                  "without measurements") from error
        # Each rank that failed says why (rank zero names the others); the others stay quiet.
        if error is not None or failed.rank == 0:
            log.warn(msg + f". Training continues (failure {self._failed_in_a_row} in a row; "
                     f"max_failed_evaluations={k}).", stacklevel=4, every_rank=True)

    def describe(self) -> dict[str, Any]:
        """The configuration recorded in the run's config (W&B ``{prefix}config``)."""
        s = self.session
        assert s is not None
        fit = self.fit
        return {
            "states": self.config.states, "cache_manifest_sha256": s.cache.manifest_sha256,
            "samples_evaluated": len(s.eval_ids), "samples_in_cache": len(s.cache),
            **self.config.describe(fit.block_size if fit is not None else None),
            "drafter_block_size": fit.spec.block_size if fit is not None else None,
        }


def _check_max_steps(max_steps: Any) -> int:
    if max_steps is None:
        return -1
    if not check.is_int(max_steps) or max_steps < -1:
        raise check.ArgumentError(f"max_steps={max_steps!r}: expected the run's last optimizer step (an integer "
                                  ">= 1), or None / -1 when unknown")
    return int(max_steps)
