"""The measuring side of the live evaluation: what one evaluation of the training drafter measures.

``Measurer`` is built once the drafter is checked against the cache (``session.drafter_fit`` gives the
frozen ``DrafterFit``); it owns what measuring needs across a run: the target head, the cost tracking and
the seconds predicted for the next evaluation, the first evaluation's warm-up, and the clock between
evaluations. ``measure`` hands the engine one frozen ``EvalRequest`` per evaluation, runs it across every
rank (``across_ranks.evaluate_across_ranks``) and returns a ``Measurement`` (or a ``FailedMeasurement``):
what the publishing side (``publish.Publisher``) turns into keys, history and sinks. Nothing here logs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...cache.states import StateCache, TargetHead
from ...common.errors import DFlashCBError
from ...common.timing import PhaseTimer
from ...core.costs.evaluation import (
    DrafterShape,
    EvalCost,
    SecondsPredictor,
    draft_all_is_cheaper,
    eval_overhead,
    predict,
)
from ...core.drafters.registry import spec_of
from ...core.drafters.spec import DrafterSpec
from ...core.figures.metrics import ANCHORS_DRAFTED, TAU, EvalCounts, ddtree_tau, summarize
from ...core.replay import (
    EvalReport,
    EvalRequest,
    SampleResult,
    anchors_per_sample,
    group_seconds,
    resolve_autocast,
)
from .across_ranks import evaluate_across_ranks, rank_share, score_untouched
from .config import EvalConfig
from .drafter_source import target_weight, unwrap
from .schedule import Profile, Reason
from .session import DrafterFit, EvalSession


class DrafterChangedError(DFlashCBError, ValueError):
    """The drafter passed to an evaluation is not the one checked at setup (block size, layers, ...)."""


@dataclass(frozen=True)
class Measurement:
    """One evaluation as measured, before it is published."""

    step: int
    reason: Reason
    profile: Profile
    counts: dict[int, EvalCounts]  # per anchor-statistics stride, summed over every rank
    summaries: dict[int, dict[str, float]]  # summarize(counts[stride]), computed once
    seconds: float
    rank: int
    samples: list[SampleResult]  # rank zero: every rank's samples, in eval_ids order; empty elsewhere
    predicted: float | None = None  # the seconds predicted before it ran (None at a session's first)
    warm_up: float | None = None  # a session's first evaluation: the seconds of it spent warming up
    overhead: float = math.nan  # its share of the wall time since the last one ended (NaN: no training between)

    @property
    def block_size(self) -> int:
        return next(iter(self.counts.values())).block_size

    @property
    def family(self) -> str:
        """The evaluated drafter's family (``registry.family_names``)."""
        return next(iter(self.counts.values())).family


@dataclass(frozen=True)
class FailedMeasurement:
    """An evaluation that raised on some rank (every rank learns the same ``failed_ranks``)."""

    step: int
    reason: Reason
    rank: int
    failed_ranks: int
    error: Exception | None  # this rank's own failure (None: only other ranks failed)


@dataclass
class CostTracking:
    """What a session learns of its evaluations' time: the first evaluation's warm-up, the drafter's last taus
    (counts summed over every rank: what decides ``EvalRequest.draft_all``), and the model that predicts the
    next evaluation's seconds (``costs.evaluation.SecondsPredictor``, this rank's samples)."""

    predictor: SecondsPredictor | None = None
    everything: list[tuple[int, int]] = field(default_factory=list)  # every evaluated sample's (prompt, scored)
    warm_up_seconds: float | None = None  # None until the first evaluation warmed up
    tau: float = 1.0
    tree_taus: dict[int, float] = field(default_factory=dict)
    draft_all: bool = False  # what the last scoring drafted at once
    groups: dict[str, float] | None = None  # the last scoring's seconds per cost group, on this rank
    counted: tuple[int, int] | None = None  # and the anchors it drafted and the passes it made

    def model_of(self, drafter: nn.Module, session: EvalSession, fit: DrafterFit,
                 rank: int, world_size: int) -> SecondsPredictor | None:
        """The cost model of the session's drafter, built once (None for a drafter without a Qwen3-style
        config): the work of every evaluated sample, and this rank's samples for its own seconds."""
        if self.predictor is None and not self.everything:
            spec = fit.spec
            self.everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(session.cache.entry,
                                                                                         session.eval_ids)]
            try:
                shape = DrafterShape.of(drafter.config, fit.block_size,
                                        len(spec.target_layer_ids) * spec.target_hidden_size)
            except (AttributeError, TypeError, ValueError):
                return None
            mine = map(session.cache.entry, rank_share(session.eval_ids, rank, world_size))
            self.predictor = SecondsPredictor(shape, [(e.prompt_len, e.valid_len - e.prompt_len) for e in mine],
                                              state_itemsize=next(drafter.parameters()).element_size())
        return self.predictor

    def draft_all_is_cheaper(self, profile: Profile) -> bool:
        """Whether an evaluation of ``profile`` drafts every anchor at once (``costs.evaluation.draft_all_is_cheaper``):
        from every sample and the taus the last evaluation measured (tau 1 before the first), so every rank
        decides alike."""
        return self.predictor is not None and draft_all_is_cheaper(
            self.predictor.shape, self.everything, self.tau, profile.budgets, profile.stride, self.tree_taus,
            state_itemsize=self.predictor.state_itemsize)

    def measured(self, summary: dict[str, float], profile: Profile) -> None:
        """What an evaluation (its ``summary`` at its own stride) says of the next one: the drafter's taus,
        and the rates the cost model is calibrated by (``costs.evaluation.SecondsPredictor``, per profile)."""
        if math.isfinite(summary[TAU]):
            self.tau = summary[TAU]
        self.tree_taus = {b: summary[ddtree_tau(b)] for b in profile.budgets
                          if math.isfinite(summary[ddtree_tau(b)])}
        if self.predictor is not None and self.groups is not None:
            self.predictor.measured(profile.kind, self.groups, profile.budgets, profile.stride, self.tau,
                                    self.tree_taus, self.draft_all, self.counted)


class HeadCache:
    """The cache's exported target embedding and head, loaded once per (device, dtype) and kept."""

    def __init__(self, cache: StateCache, verify: bool):
        self.cache, self.verify = cache, verify
        self._head: TargetHead | None = None
        self._key: tuple[str, torch.dtype] | None = None

    def get(self, device: torch.device, dtype: torch.dtype) -> TargetHead:
        key = (str(device), dtype)
        if self._head is None or self._key != key:
            # sha256-checked the first time in this process; reloaded only if the device or dtype moves.
            self._head = self.cache.load_head(device=device, dtype=dtype, verify=self.verify)
            self._key = key
        return self._head


Gathered = Callable[[nn.Module, Any], AbstractContextManager[Any]]


class Measurer:
    """Measures the session's drafter: one ``measure`` per evaluation, on every rank alike.

    Args:
        config: the evaluator's ``EvalConfig``.
        session: the run's opened cache and samples.
        fit: the drafter as checked at setup.
        gathered: ``(drafter, model) -> context manager`` that makes sharded parameters whole (FSDP).
        world: ``() -> (rank, world size)``.
        name: names the evaluator in errors.
    """

    def __init__(self, config: EvalConfig, session: EvalSession, fit: DrafterFit, gathered: Gathered,
                 world: Callable[[], tuple[int, int]], name: str = "LiveEvaluator"):
        self.config, self.session, self.fit = config, session, fit
        self.gathered, self.world, self.name = gathered, world, name
        self.cost = CostTracking()
        self.head = HeadCache(session.cache, config.verify_cache)
        self._clock: tuple[float, int] | None = None  # (time, global step) the last evaluation ended at

    def start_clock(self, step: int) -> None:
        """The training between here and the next evaluation is what its overhead is measured against."""
        self._clock = (time.perf_counter(), step)

    def setup_costs(self, drafter: nn.Module, tau: float) -> dict[str, EvalCost]:
        """The predicted work of one light and one full evaluation at ``tau`` (``costs.evaluation.predict``)."""
        s, cfg, fit = self.session, self.config, self.fit
        samples = [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(s.cache.entry, s.eval_ids)]
        return predict(unwrap(drafter), fit.block_size, len(fit.spec.target_layer_ids) * fit.spec.target_hidden_size,
                       samples, tau, {"light": (cfg.light_budgets, cfg.light_stride(fit.block_size)),
                                      "full": (cfg.ddtree_budgets, 1)})

    def measure(self, step: int, reason: Reason, profile: Profile, drafter: nn.Module,
                model: Any) -> Measurement | FailedMeasurement:
        """Every rank scores its share without touching the training state; counts summed across ranks."""
        c = self.cost
        first = c.warm_up_seconds is None
        predictor = c.model_of(unwrap(drafter), self.session, self.fit, *self.world())
        predicted = predictor.predict(profile.kind, profile.budgets, profile.stride, c.tau, c.tree_taus,
                                      c.draft_all_is_cheaper(profile)) if predictor is not None else None
        # The light stride's statistics come from the same pass as a full evaluation's own (one estimator
        # per key: the main keys are the light profile's at every evaluation).
        strides = [profile.stride] + ([profile.light_stride] if profile.light_stride != profile.stride else [])
        templates = {st: EvalCounts(self.fit.block_size, profile.budgets, self.session.categories,
                                    self.fit.spec.family) for st in strides}
        ranked = evaluate_across_ranks(self.session.eval_ids, lambda ids: self._score(ids, drafter, model, profile,
                                                                                     strides),
                                       templates, lambda: self.gathered(drafter, model))
        since = self._clock
        self.start_clock(step)
        if ranked.failed:
            return FailedMeasurement(step, reason, ranked.rank, ranked.failed_ranks, ranked.error)
        assert ranked.counts is not None
        summaries = {st: summarize(counts) for st, counts in ranked.counts.items()}
        c.measured(summaries[profile.stride], profile)
        assert self._clock is not None
        # NaN for an evaluation with no training before it.
        overhead = (eval_overhead(ranked.seconds, self._clock[0] - since[0])
                    if since is not None and since[1] != step else math.nan)
        return Measurement(step, reason, profile, ranked.counts, summaries, ranked.seconds, ranked.rank,
                           ranked.samples or [], predicted, c.warm_up_seconds if first else None, overhead)

    def request(self, profile: Profile, device: torch.device, autocast: torch.dtype | None,
                extra_strides: list[int], keep_drafts: int) -> EvalRequest:
        """The engine's request for ``profile`` on this rank's device."""
        cfg = self.config
        return EvalRequest(budgets=profile.budgets, anchor_stride=profile.stride,
                           extra_anchor_strides=tuple(extra_strides), anchor_seed=cfg.anchor_seed,
                           block_size=self.fit.block_size, tail_blocks=cfg.tail_blocks, device=device,
                           autocast_dtype=autocast, spec=self.fit.spec, verify=cfg.verify_cache,
                           keep_drafts=keep_drafts, draft_all=self.cost.draft_all_is_cheaper(profile))

    def series(self, drafter: nn.Module) -> dict[str, Any]:
        """What identifies the main keys' figures (``EvalRequest.series`` of a light evaluation with the
        drafter where it is now: its device decides what ``autocast_dtype="auto"`` computes in)."""
        param = next(unwrap(drafter).parameters())
        autocast = resolve_autocast(self.config.autocast_dtype, param.device, param.dtype)
        light = self.config.light_stride(self.fit.block_size)
        profile = Profile(False, self.config.light_budgets, light, self.config.light_budgets, light)
        return self.request(profile, param.device, autocast, [], 0).series()

    def _score(self, ids: list[str], drafter: nn.Module, model: Any, profile: Profile,
               strides: list[int]) -> EvalReport:
        s, c = self.session, self.cost
        # Inside the scoring, so that a changed drafter or cache fails this evaluation under the policy.
        module = unwrap(drafter)
        self.check_same_drafter(module)
        s.cache.check_unchanged()  # a folder replaced during training fails here, naming both manifest hashes
        param = next(module.parameters())
        autocast = resolve_autocast(self.config.autocast_dtype, param.device, param.dtype)
        head = self.target_head(model, param.device, autocast or param.dtype)
        table = set(s.table_ids)
        keep = self.config.table_cycles if self.config.table_samples > 0 and table.intersection(ids) else 0
        request = self.request(profile, param.device, autocast, strides[1:], keep)
        if c.warm_up_seconds is None:
            self._warm_up(module, head, ids, request)
        c.draft_all = request.draft_all
        timer = PhaseTimer(sync=torch.cuda.synchronize if param.device.type == "cuda" else None)
        started = time.perf_counter()
        # verify: only a shard whose file identity changed since it was hashed is hashed again.
        report = score_untouched(s.cache, module, head, request.replace(sample_ids=tuple(ids)), timer=timer,
                                 fit=self.fit)
        c.groups = group_seconds(timer.seconds, time.perf_counter() - started)
        c.counted = (int(report.counts.data[ANCHORS_DRAFTED].item()), report.passes)
        for r in report.samples:
            if r.id not in table:
                r.drafts = None  # only the table's drafts travel to rank zero
        return report

    def _warm_up(self, module: nn.Module, head: TargetHead, ids: list[str], request: EvalRequest) -> None:
        """A session's first evaluation starts with one of this rank's samples scored at stride 1: the first
        calls' one-time costs are paid there, timed apart (the first evaluation's console line says how long)."""
        lengths = anchors_per_sample(self.session.cache, ids[:16])
        started = time.perf_counter()
        if lengths:
            longest = max(lengths, key=lengths.__getitem__)
            score_untouched(self.session.cache, module, head,
                            request.replace(sample_ids=(longest,), anchor_stride=1, extra_anchor_strides=(),
                                            keep_drafts=0, draft_all=False), fit=self.fit)
        self.cost.warm_up_seconds = time.perf_counter() - started

    def check_same_drafter(self, drafter: nn.Module) -> DrafterSpec:
        """The drafter of this evaluation has the spec checked at setup (cheap: its config only)."""
        was, now = self.fit.spec, spec_of(drafter)
        changed = [f"{name} {a!r} -> {b!r}" for name, a, b in was.differences(now)]
        if changed:
            raise DrafterChangedError(f"the drafter changed since setup ({'; '.join(changed)}); a drafter of "
                                      "another shape needs a new setup (a new run or a new evaluator)")
        return was

    def target_head(self, model: Any, device: torch.device, dtype: torch.dtype) -> TargetHead:
        """The target's embedding and head: the training model's own when the config names them, else the
        cache's exported head (loaded once per device and dtype)."""
        cfg = self.config
        if not cfg.needs_cache_head:
            embed = target_weight(model, cfg.target_embed, self.name)
            head = target_weight(model, cfg.target_lm_head, self.name) if cfg.target_lm_head is not None else embed
            return TargetHead(embed, head, tied=head is embed)
        return self.head.get(device, dtype)
