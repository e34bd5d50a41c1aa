"""One training run's evaluation session: everything ``LiveEvaluator.setup`` opens and checks, built fresh.

A session holds what a run needs and a checkpoint does not: the opened cache and the evaluated ids, the
baselines and published figures, the drafter's spec once checked, the target head loaded for it, where the
numbers go (sinks), and the cost of the setup. ``open_session`` builds one from an ``EvalConfig`` and raises,
before any training step, naming the file or field (``CacheError``, ``CacheMismatchError``,
``ArgumentError``). Nothing here survives a new ``setup``: a resumed or re-run fit opens a new session, so
no per-run field can be forgotten in a reset.
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

from ..cache.selection import select_sample_ids, stratified_ids
from ..cache.states import CacheMismatchError, StateCache, TargetHead
from ..core.baselines import Baseline, load_measured, load_published, load_served
from ..core.cost import DrafterShape, SecondsPredictor, draft_all_is_cheaper
from ..core.ddtree import check_ddtree_budgets
from ..core.metrics import TAU, ddtree_tau
from ..core.model import DrafterSpec
from ..core.replay import check_block_size
from .config import EvalConfig
from .distributed import world
from .drafter_source import NotADrafterError, describe_source, target_weight
from .eval_state import selection_record
from .live_eval import SetupCheck, rank_share, verify_across_ranks
from .schedule import Profile
from .sinks import MetricsSink, TableSample


@dataclass
class LoopContext:
    """What the training loop supplies for a run: where the numbers go, its last step, and how to make
    sharded parameters whole (``distributed.full_parameters_of`` when None)."""

    sinks: list[MetricsSink] = field(default_factory=list)
    max_steps: int = -1  # the run's last optimizer step, -1 when unknown
    full_parameters: Callable[[], AbstractContextManager[Any]] | None = None


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


@dataclass
class CostTracking:
    """What a session learns of its evaluations' time: the first evaluation's warm-up, the drafter's last taus
    (counts summed over every rank: what decides ``engine.evaluate(draft_all=...)``), and the model that
    predicts the next evaluation's seconds (``cost.SecondsPredictor``, this rank's samples)."""

    predictor: SecondsPredictor | None = None
    everything: list[tuple[int, int]] = field(default_factory=list)  # every evaluated sample's (prompt, scored)
    warm_up_seconds: float | None = None  # None until the first evaluation warmed up
    tau: float = 1.0
    tree_taus: dict[int, float] = field(default_factory=dict)
    draft_all: bool = False  # what the last scoring drafted at once
    groups: dict[str, float] | None = None  # the last scoring's seconds per cost group, on this rank
    counted: tuple[int, int] | None = None  # and the anchors it drafted and the passes it made

    def model_of(self, drafter: nn.Module, session: EvalSession) -> SecondsPredictor | None:
        """The cost model of the session's drafter, built once (None for a drafter without a Qwen3-style
        config): the work of every evaluated sample, and this rank's samples for its own seconds."""
        if self.predictor is None and not self.everything:
            spec = session.spec
            assert spec is not None
            self.everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(session.cache.entry,
                                                                                         session.eval_ids)]
            try:
                shape = DrafterShape.of(drafter.config, session.block_size,
                                        len(spec.target_layer_ids) * spec.target_hidden_size)
            except (AttributeError, TypeError, ValueError):
                return None
            mine = map(session.cache.entry, rank_share(session.eval_ids, *world()))
            self.predictor = SecondsPredictor(shape, [(e.prompt_len, e.valid_len - e.prompt_len) for e in mine],
                                              state_itemsize=next(drafter.parameters()).element_size())
        return self.predictor

    def draft_all_is_cheaper(self, profile: Profile) -> bool:
        """Whether an evaluation of ``profile`` drafts every anchor at once (``cost.draft_all_is_cheaper``):
        from every sample and the taus the last evaluation measured (tau 1 before the first), so every rank
        decides alike."""
        return self.predictor is not None and draft_all_is_cheaper(
            self.predictor.shape, self.everything, self.tau, profile.budgets, profile.stride, self.tree_taus,
            state_itemsize=self.predictor.state_itemsize)

    def measured(self, summary: dict[str, float], profile: Profile) -> None:
        """What an evaluation (its ``summary`` at its own stride) says of the next one: the drafter's taus,
        and the rates the cost model is calibrated by (``cost.SecondsPredictor``, per profile)."""
        if math.isfinite(summary[TAU]):
            self.tau = summary[TAU]
        self.tree_taus = {b: summary[ddtree_tau(b)] for b in profile.budgets
                          if math.isfinite(summary[ddtree_tau(b)])}
        if self.predictor is not None and self.groups is not None:
            self.predictor.measured("full" if profile.full else "light", self.groups, profile.budgets,
                                    profile.stride, self.tau, self.tree_taus, self.draft_all, self.counted)


@dataclass
class EvalSession:
    """One run's opened cache, selection, references and loop context (``open_session``)."""

    cache: StateCache
    eval_ids: list[str]
    selection: dict[str, Any]  # eval_state.selection_record of eval_ids
    table_ids: list[str]  # the samples shown in the W&B table
    baselines: list[Baseline]  # measured files, the server's own counters, published figures
    published_skipped: list[str]
    loop: LoopContext
    head: HeadCache
    verified: SetupCheck | None  # what the setup hashed (None: verify_cache=False)
    setup_seconds: float = 0.0
    spec: DrafterSpec | None = None  # the drafter as checked against the cache (``LiveEvaluator.validate``)
    block_size: int = 0  # the block evaluated: EvalConfig.block_size, or the drafter's (set by validate)
    setup_reported: bool = False  # the setup's console line and predicted cost
    sinks_begun: bool = False  # the sinks' begin() (the run's configuration)
    failed_in_a_row: int = 0
    # (time, global step) the last evaluation ended at: the training time between evaluations.
    clock: tuple[float, int] | None = None
    cost: CostTracking = field(default_factory=CostTracking)
    _tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def categories(self) -> tuple[str, ...]:
        return self.cache.categories

    def table_sample(self, sample_id: str, lengths: list[int], drafts: list[list[int]] | None) -> TableSample:
        """A W&B table sample; its token ids are read once per run (only ``input_ids``: the features
        can be 100+ MB)."""
        if sample_id not in self._tokens:
            self._tokens[sample_id] = self.cache.token_ids(sample_id)
        entry = self.cache.entry(sample_id)
        return TableSample(sample_id, entry.category, self._tokens[sample_id], entry.prompt_len, lengths, drafts)


def open_session(config: EvalConfig, loop: LoopContext) -> EvalSession:
    """Open and check the cache for ``config``, choose the samples, load the references.

    A collective under ``torch.distributed`` when ``verify_cache`` (each rank hashes the shards it
    scores, rank zero the head): every rank calls it.
    """
    started = time.perf_counter()
    cache = StateCache(config.states)  # CacheError: no or broken manifest
    eval_ids = select_sample_ids(cache, config.num_samples, config.sample_ids, config.sample_seed)
    # A missing or truncated file is found now (a stat each), not inside an evaluation; with
    # verify_cache a changed byte too (sha256; files verified before in this process are not hashed again).
    cache.check_files(eval_ids, head=config.needs_cache_head)
    verified = verify_across_ranks(cache, eval_ids, config.needs_cache_head) if config.verify_cache else None
    cache.check_samples(eval_ids)  # manifest fields against the shards (small tensors only)
    # A file replayed with other tail blocks is warned about (results.tail_blocks_mismatch).
    baselines = [load_measured(p, cache, name=n, sample_ids=eval_ids, tail_blocks=config.tail_blocks)
                 for n, p in config.baselines.items()]
    served = load_served(cache, eval_ids)  # the server's own counters, when the cache has them
    if served is not None:
        baselines.append(served)
    skipped: list[str] = []
    if config.published:
        # A published DDTree figure needs a budget this run logs (its live counterpart).
        published = load_published(config.published, config.published_entries,
                                   budgets=sorted({*config.ddtree_budgets, *config.light_budgets}))
        baselines += published.baselines
        skipped = published.skipped
    table_ids = stratified_ids(eval_ids, lambda i: cache.entry(i).category, config.table_samples, None)
    return EvalSession(cache, eval_ids, selection_record(eval_ids, config.num_samples, config.sample_ids,
                                                         config.sample_seed),
                       table_ids, baselines, skipped, loop, HeadCache(cache, config.verify_cache), verified,
                       time.perf_counter() - started)


def drafter_fit(session: EvalSession, config: EvalConfig, drafter: nn.Module, model: Any,
                owner: str) -> tuple[DrafterSpec, int]:
    """The drafter's spec and the block evaluated, once the drafter is checked against the session's cache:
    layer ids, sizes, vocabulary, mask token, number of target layers, the block size and DDTree budgets,
    and the target's matrices. Raises ``CacheMismatchError`` naming every field that does not fit."""
    try:
        spec = DrafterSpec.of(drafter)
    except TypeError:
        raise NotADrafterError(
            f"{owner}: the drafter is a {type(drafter).__name__} with neither a .spec nor a DFlash .config "
            "(block size, mask token, target layers); point drafter= at the DFlash module inside it (an "
            "attribute path or a function model -> drafter)") from None
    cache, m = session.cache, session.cache.manifest
    cache.check_drafter(spec.as_cache_check())
    block = check_block_size(config.block_size, spec.block_size)
    for name, budgets in (("ddtree_budgets", config.ddtree_budgets), ("periodic_ddtree_budgets", config.light_budgets)):
        check_ddtree_budgets(budgets, block, m.vocab_size, name)  # before any evaluation
    problems = []
    n_target = getattr(getattr(drafter, "config", None), "num_target_layers", None)
    if n_target is not None and m.target.get("num_layers") is not None and int(n_target) != int(m.target["num_layers"]):
        problems.append(f"num_target_layers: drafter was made for a {n_target}-layer target, "
                        f"the cache's target has {m.target['num_layers']}")
    if not config.needs_cache_head:
        for what, source in (("target_embed", config.target_embed), ("target_lm_head", config.target_lm_head)):
            if source is None:
                continue
            t = target_weight(model, source, owner)
            if tuple(t.shape) != (m.vocab_size, m.hidden_size):
                problems.append(f"{what} ({describe_source(source)}): shape {tuple(t.shape)}, the cache's target "
                                f"has [vocab {m.vocab_size}, hidden {m.hidden_size}]")
    elif not cache.has_head:
        problems.append("target head: the cache has no exported head (built with --no-export-head) and no "
                        "target_embed/target_lm_head were given")
    if problems:
        raise CacheMismatchError(f"cache {cache.path} does not fit the drafter:\n  - " + "\n  - ".join(problems))
    return spec, block


__all__ = ["CostTracking", "EvalSession", "HeadCache", "LoopContext", "drafter_fit", "open_session"]
