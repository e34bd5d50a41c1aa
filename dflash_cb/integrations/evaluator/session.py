"""One training run's evaluation session: everything ``LiveEvaluator.setup`` opens and checks, built fresh.

A session holds what a run opened and a checkpoint does not carry: the opened cache and the evaluated ids,
the baselines and published figures, where the numbers go (sinks), and what the setup checked and cost.
Nothing in it changes after ``open_session``; the drafter's check against it is a ``DrafterFit`` of its own
(``drafter_fit``). Both raise before any training step, naming the file or field (``CacheError``,
``CacheMismatchError``, ``ArgumentError``). Nothing here survives a new ``setup``: a resumed or re-run fit
opens a new session, so no per-run field can be forgotten in a reset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...cache.selection import select_sample_ids, stratified_ids
from ...cache.states import CacheMismatchError, StateCache
from ...common import log
from ...core.costs.serving import CostProfile
from ...core.drafters.registry import family_named, spec_of
from ...core.replay import DEFAULT_BUDGETS, FittedDrafter, fit_drafter
from ...core.results.baselines import Baseline, load_measured, load_published, load_served
from ..tracking.sinks import MetricsSink
from .across_ranks import SetupCheck, verify_across_ranks
from .config import EvalConfig
from .drafter_source import NotADrafterError, describe_source, target_weight
from .eval_state import selection_record
from .projection import read_profile, refuse_other_target


@dataclass
class LoopContext:
    """What the training loop supplies for a run: where the numbers go, its last step, and how to make
    sharded parameters whole (``distributed.full_parameters_of`` when None)."""

    sinks: list[MetricsSink] = field(default_factory=list)
    max_steps: int = -1  # the run's last optimizer step, -1 when unknown
    full_parameters: Callable[[], AbstractContextManager[Any]] | None = None


# The drafter as checked against the session's cache (``drafter_fit``), set once per session: the replay's fit.
DrafterFit = FittedDrafter


@dataclass(frozen=True)
class EvalSession:
    """One run's opened cache, selection, references and loop context (``open_session``)."""

    cache: StateCache
    eval_ids: list[str]
    selection: dict[str, Any]  # eval_state.selection_record of eval_ids
    table_ids: list[str]  # the samples shown in the W&B table
    baselines: list[Baseline]  # measured files, the server's own counters, published figures
    published_skipped: list[str]
    loop: LoopContext
    verified: SetupCheck | None  # what the setup hashed (None: verify_cache=False)
    setup_seconds: float = 0.0
    cost_profile: CostProfile | None = None  # checked against the cache's target (EvalConfig.cost_profile)

    @property
    def categories(self) -> tuple[str, ...]:
        return self.cache.categories


def chosen_samples(cache: StateCache, config: EvalConfig, option: str = "num_samples",
                   warn: Callable[[str], Any] | None = None) -> list[str]:
    """The evaluated sample ids (``selection.select_sample_ids``), with a warning when ``num_samples`` asks for
    more samples than the cache holds (``option`` names it as the caller spells it; ``warn`` says it, by
    default a Python warning; a tool prints it)."""
    ids = select_sample_ids(cache, config.num_samples, config.sample_ids, config.sample_seed)
    if config.sample_ids is None and config.num_samples is not None and config.num_samples > len(cache.samples):
        message = (f"{option} {config.num_samples}: the cache {cache.path} has only {len(cache.samples)} samples; "
                   f"scoring all {len(cache.samples)}")
        if warn is not None:
            warn(message)
        else:
            log.warn(message, stacklevel=3)
    return ids


def open_session(config: EvalConfig, loop: LoopContext, cache: StateCache | None = None,
                 eval_ids: list[str] | None = None) -> EvalSession:
    """Open and check the cache for ``config``, choose the samples, load the references.

    ``cache`` / ``eval_ids``: the cache and samples a caller opened and chose already (``chosen_samples``).
    A collective under ``torch.distributed`` when ``verify_cache`` (each rank hashes the shards it
    scores, rank zero the head): every rank calls it.
    """
    started = time.perf_counter()
    cache = cache if cache is not None else StateCache(config.states)  # CacheError: no or broken manifest
    eval_ids = eval_ids if eval_ids is not None else chosen_samples(cache, config)
    # A missing or truncated file is found now (a stat each), not inside an evaluation; with
    # verify_cache a changed byte too (sha256; files verified before in this process are not hashed again).
    cache.check_files(eval_ids, head=config.needs_cache_head)
    verified = verify_across_ranks(cache, eval_ids, config.needs_cache_head) if config.verify_cache else None
    cache.check_samples(eval_ids)  # manifest fields against the shards (small tensors only)
    # A file measured with other settings is warned about once the drafter's block is known (the evaluator's
    # validate: results.series_mismatch).
    baselines = [load_measured(p, cache, name=n, sample_ids=eval_ids) for n, p in config.baselines.items()]
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
    profile = None
    if config.cost_profile:
        where = f"cost_profile={config.cost_profile}"
        profile = read_profile(config.cost_profile, "cost_profile")
        refuse_other_target(profile, cache.manifest.target, where)
    return EvalSession(cache, eval_ids, selection_record(eval_ids, config.num_samples, config.sample_ids,
                                                         config.sample_seed),
                       table_ids, baselines, skipped, loop, verified, time.perf_counter() - started, profile)


def without_default_trees(config: EvalConfig, drafter: Any) -> tuple[EvalConfig, str | None]:
    """``config`` with no DDTree budgets when the drafter's family drafts no DDTree (a chain, a head on the
    backbone) and the budgets are the defaults, which the user did not choose, and the line that says so (None:
    ``config`` as it is); budgets the user set are kept (``drafter_fit`` then refuses them, naming why). Anything
    that is not a drafter: ``config`` as it is."""
    try:
        spec = spec_of(drafter)
    except TypeError:
        return config, None
    family = family_named(spec.family)
    if family.supports_tree or tuple(config.ddtree_budgets) != tuple(DEFAULT_BUDGETS) or \
            not set(config.light_budgets) <= set(DEFAULT_BUDGETS):
        return config, None
    return (config.replace(ddtree_budgets=(), light_ddtree_budgets=()),
            f"a {family.label} drafter drafts no DDTree: evaluating without the default DDTree budgets")


def drafter_fit(cache: StateCache, config: EvalConfig, drafter: nn.Module, model: Any, owner: str,
                head_given: bool = False, names: Mapping[str, str] | None = None) -> DrafterFit:
    """The drafter's spec and the block evaluated, once the drafter is checked against the cache: layer ids,
    sizes, vocabulary, mask token, number of target layers, the block size and DDTree budgets, and the target's
    matrices (not when ``head_given``: a head the caller loads and checks itself, ``eval_drafter.py --target``).
    Raises ``CacheMismatchError`` naming every field that does not fit; ``names`` spells options as the caller
    takes them (``{"block_size": "--block-size"}``). Cheap: configs and the manifest only,
    so a caller runs it before hashing or loading anything large. The one check of the live evaluator and of
    ``eval_drafter.py``."""
    try:
        spec_of(drafter)
    except TypeError:
        raise NotADrafterError(
            f"{owner}: the drafter is a {type(drafter).__name__} with neither a .spec nor a drafter .config "
            "(block size, target layers); point drafter= at the drafter module inside it (an "
            "attribute path or a function model -> drafter)") from None
    m = cache.manifest
    # The replay's own checks, once (layers, widths, block, DDTree budgets); the session adds the head's.
    fit = fit_drafter(cache, drafter, block_size=config.block_size, names=names,
                      budgets={"ddtree_budgets": config.ddtree_budgets, "light_ddtree_budgets": config.light_budgets})
    problems = []
    if head_given:
        pass
    elif not config.needs_cache_head:
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
    return fit
