"""``LiveEvaluator``: the drafter's exact offline tau while it trains, in any training loop.

It owns everything but the loop: the cache and the target head, the schedule and its light/full
profiles, the failure policy, the history and best values, the baselines and published figures,
and its resumable state. A loop calls it once per optimizer step::

    evaluator = LiveEvaluator("cached_states/qwen36-27b-v1", every_n_train_steps=500, log=wandb_run)
    evaluator.start(step, drafter)            # before the first step: the untrained (or resumed) drafter
    for batch in data:
        ...; optimizer.step(); step += 1
        evaluator.step(step, drafter)          # the metrics dict when it evaluated, else None
    evaluator.finish(step, drafter)            # the full evaluation at the end
    # checkpoints: save evaluator.state_dict(), restore with evaluator.load_state_dict()

The adapters are thin: ``DFlashEvalCallback`` (Lightning, ``callback.py``) and
``DFlashEvalTrainerCallback`` (Hugging Face ``Trainer``, ``hf_callback.py``).

Under ``torch.distributed`` (any loop) every rank calls the same methods at the same steps: rank r
scores ``samples[r::world]``, the integer counts are summed with one ``all_reduce`` before any
ratio (the numbers equal a single process's exactly), the per-sample lengths are gathered to rank
zero for the intervals, and only rank zero logs (``live_eval``, ``distributed``). Sharded
parameters (FSDP) are gathered with ``full_parameters``, by default ``distributed.full_parameters_of``
the ``model`` passed to the calls (or the drafter).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from ..cache.states import CacheMismatchError, StateCache, TargetHead, select_sample_ids, stratified_ids
from ..common import arguments as check
from ..common.errors import DFlashCBError
from ..core.baselines import Baseline, baseline_scalars, load_measured, load_published, load_served
from ..core.compare import live_metrics
from ..core.cost import eval_overhead, predict, setup_line
from ..core.ddtree import check_ddtree_budgets
from ..core.engine import AUTOCAST_NAMES, DEFAULT_BUDGETS, EvalReport, SampleResult, resolve_autocast
from ..core.metrics import (
    ANCHOR_STRIDE,
    EVAL_OVERHEAD,
    EVAL_TIME,
    FAILED_EVALS,
    SETUP_TIME,
    TAU,
    EvalCounts,
    per_depth,
    predicted_anchors,
    predicted_gflop,
    summarize,
)
from ..core.model import DrafterSpec
from ..core.positions import DEFAULT_POSITION_EDGES
from ..core.replay import check_tail_blocks
from ..core.report import evaluation_line
from .distributed import full_parameters_of, world
from .eval_state import EvalState, MalformedStateError, new_series_reason, selection_record
from .live_eval import RankedEvaluation, evaluate_across_ranks, score_untouched, verify_across_ranks
from .sinks import MetricsSink, as_sinks
from .wandb_logging import log_best, log_evaluation, make_decoder, sample_rows, start_live_run

WeightSource = str | nn.Module | torch.Tensor
DrafterSource = str | Callable[[Any], nn.Module] | None


class DFlashEvalError(DFlashCBError, RuntimeError):
    """An evaluation failed (raised only with ``fail_on_error=True``; otherwise a warning)."""


class LiveEvaluator:
    """Evaluate a DFlash drafter on cached target states during training; framework-neutral.

    Args:
        states: cache folder written by ``tools/precompute_states.py``.
        every_n_train_steps: evaluate after every N optimizer steps (``global_step % N == 0``);
            0 disables the periodic evaluations (start/end ones still run). An integer.
        eval_on_fit_start: evaluate before the first training step (the untrained baseline). Done
            once per run: a resumed run does not repeat it.
        eval_on_fit_end: evaluate after the last step (unless that step was just evaluated).
        target_embed, target_lm_head: the target's input embedding and output head, when the training
            model holds them (no copy): an ``nn.Embedding``/``nn.Linear``, a ``[vocab, hidden]`` tensor, or
            an attribute path on the ``model`` passed to ``start``/``step``/``finish``. Without them the
            cache's exported head is loaded once, onto the drafter's device, and kept there
            (Qwen3.6-27B: embedding + head = 5.1 GB in bf16). ``target_lm_head`` may be omitted only when
            the target ties embedding and head.
        ddtree_budgets: DDTree node budgets (empty: no DDTree) of the full evaluations.
        periodic_ddtree_budgets: DDTree budgets of the periodic (light) evaluations; None = the largest of
            ``ddtree_budgets`` only (each budget's walk visits its own anchors: extra budgets cost nearly a
            full replay each).
        periodic_anchor_stride: anchor-statistics stride of the periodic evaluations (per-depth acceptance,
            all-anchor and estimated taus on every N-th anchor from the prompt end; the tau replays are
            exact whatever the stride); None = the drafter's block size. Full evaluations use 1.
        full_every_n_evals: every N-th evaluation is a full one (``anchor_stride=1``, every budget); 0 = only
            the one at fit end. Full evaluations log the same keys, and again under ``{prefix}full/``.
        num_samples: evaluate a fixed subset of this many samples (stratified by category, chosen
            with ``sample_seed``, the same at every evaluation); None = every sample.
        sample_ids: evaluate exactly these sample ids (overrides ``num_samples``).
        sample_seed: seed of the subset choice (a private generator: training RNG is not touched).
        prefix: metric name prefix.
        baselines: reference ``results.json`` files from ``tools/eval_drafter.py`` on the same cache:
            ``{name: path}`` or a list of paths (name = file stem). Logged as constant series
            ``{prefix}baseline/<name>/...`` and in the W&B summary. A file measured on another cache is
            refused at setup. When the cache holds the server's speculative counters (``served_spec``), the
            served drafter's online tau is logged too, as ``{prefix}baseline/served/tau`` ("served,
            measured online").
        published: YAML of published figures (format: ``configs/baselines/published.yaml`` in the
            repository), logged as ``{prefix}published/<name>/...``, marked as published, not measured
            here. Placeholder entries are not logged. Default: none.
        published_entries: names of the published entries to log (default: every non-placeholder entry).
        fail_on_error: raise when an evaluation fails instead of warning and going on.
        max_failed_evaluations: raise ``DFlashEvalError`` when this many evaluations in a row failed
            (0: never; each failure is still a warning and counts in ``{prefix}failed_evaluations``).
        autocast_dtype: ``"auto"`` (bfloat16 autocast on CUDA for a float32 drafter, none on CPU),
            ``"bfloat16"``, ``"float16"``, or ``"float32"``/None (no autocast: exact float32).
        table_samples: samples shown in the W&B table at each evaluation (0 = no table).
        table_cycles: cycles (draft blocks) shown per table sample.
        tokenizer: decodes tokens in the W&B table: a Hugging Face tokenizer path or object, or a function
            ``ids -> str``; None shows token ids.
        verify_cache: check the sha256 of every shard to evaluate (and of the exported head) at setup,
            and before each evaluation hash again any of them that changed (size, modification or status-change time, inode).
            False skips the hashing (a large cache on a slow disk); sizes are always checked at setup.
        position_edges: completion-position bucket edges for ``{prefix}position/<lo>_<hi>/tau``
            (the last bucket is open-ended).
        console: print one line per evaluation on rank zero (step, tau with its 95% interval, DDTree tau
            at the largest budget, difference to each measured baseline, wall time).
        tail_blocks: ``"served"`` (full blocks near the end, cut after verification, as SGLang serves) or
            ``"reference"`` (shortened blocks, as dflash's ``dflash_generate``); docs/method.md, "Tail blocks".
        log: where the numbers go (each evaluation's scalars; once, at the first call, the setup's
            predicted cost; after a failure, the failure counter alone): a function ``log(metrics, step)``,
            a W&B run (scalars, tables and charts), a ``sinks.MetricsSink``, or a list of these. None:
            nowhere but ``history``.
        max_steps: the run's last step, if known: its evaluation is the full fit-end one.
        full_parameters: ``() -> context manager`` that makes sharded parameters whole on every rank
            (default: ``distributed.full_parameters_of(model or drafter)``: FSDP 1 and 2).
        say: prints the console line (rank zero; default ``print``).
        name: names the evaluator in warnings and console lines.

    Intervals: ``{prefix}<metric>_ci_low``/``_ci_high`` are 95% cluster-bootstrap intervals over the
    evaluated samples (``dflash_cb.core.bootstrap``): the uncertainty from the choice of prompts. Under
    ``torch.distributed`` the per-sample acceptance lengths (integers, not tensors) are gathered to
    rank zero for them.
    """

    def __init__(
        self,
        states: str | os.PathLike,
        every_n_train_steps: int = 500,
        *,
        eval_on_fit_start: bool = True,
        eval_on_fit_end: bool = True,
        target_embed: WeightSource | None = None,
        target_lm_head: WeightSource | None = None,
        ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS,
        periodic_ddtree_budgets: Sequence[int] | None = None,
        periodic_anchor_stride: int | None = None,
        full_every_n_evals: int = 0,
        num_samples: int | None = None,
        sample_ids: Sequence[str] | None = None,
        sample_seed: int = 0,
        prefix: str = "dflash_eval/",
        baselines: dict[str, str] | Sequence[str] | None = None,
        published: str | os.PathLike | None = None,
        published_entries: Sequence[str] | None = None,
        fail_on_error: bool = False,
        max_failed_evaluations: int = 3,
        autocast_dtype: str | None = "auto",
        table_samples: int = 4,
        table_cycles: int = 4,
        tokenizer: Any = None,
        verify_cache: bool = True,
        position_edges: Sequence[int] = DEFAULT_POSITION_EDGES,
        console: bool = True,
        tail_blocks: str = "served",
        log: Any = None,
        max_steps: int = -1,
        full_parameters: Callable[[], AbstractContextManager[Any]] | None = None,
        say: Callable[[str], Any] = print,
        name: str = "LiveEvaluator",
    ) -> None:
        # Only cheap argument checks here (no file access), so a config parses anywhere; one rule
        # (dflash_cb.common.arguments) for the evaluator, its adapters and the tools, each error naming the argument.
        budgets = tuple(sorted(set(check.int_list("ddtree_budgets", ddtree_budgets, 1, note="[] = no DDTree"))))
        periodic = check.int_list("periodic_ddtree_budgets", periodic_ddtree_budgets, 1,
                                  none="the largest of ddtree_budgets")
        periodic = tuple(sorted(set(periodic))) if periodic is not None else budgets[-1:]
        target_embed = None if isinstance(target_embed, str) and not target_embed else target_embed
        target_lm_head = None if isinstance(target_lm_head, str) and not target_lm_head else target_lm_head
        if target_lm_head is not None and target_embed is None:
            raise ValueError("target_lm_head needs target_embed too (the block embeddings come from the target)")
        if autocast_dtype not in (None, "auto", *AUTOCAST_NAMES):
            raise ValueError(f"autocast_dtype must be 'auto', None or one of {sorted(AUTOCAST_NAMES)}, "
                             f"got {autocast_dtype!r}")
        self.states = check.file_path("states", states)
        self.every_n_train_steps = check.int_at_least("every_n_train_steps", every_n_train_steps, 0,
                                                      note="0 = no periodic evaluations")
        self.eval_on_fit_start = check.flag("eval_on_fit_start", eval_on_fit_start)
        self.eval_on_fit_end = check.flag("eval_on_fit_end", eval_on_fit_end)
        self.target_embed = target_embed
        self.target_lm_head = target_lm_head
        self.ddtree_budgets = budgets
        self.periodic_ddtree_budgets = periodic
        self.periodic_anchor_stride = check.int_at_least("periodic_anchor_stride", periodic_anchor_stride, 1,
                                                         none="the drafter's block size")
        self.tail_blocks = check_tail_blocks(tail_blocks)
        self.full_every_n_evals = check.int_at_least("full_every_n_evals", full_every_n_evals, 0,
                                                     note="0 = only the fit-end evaluation is full")
        self.last_eval_full = False  # the last evaluation's profile (full: stride 1, every budget)
        self.last_eval_stride = 1
        self.last_eval_budgets = budgets
        self.num_samples = check.int_at_least("num_samples", num_samples, 1, none="every sample")
        self.sample_ids = check.str_list("sample_ids", sample_ids, none="num_samples decides")
        self.sample_seed = check.int_at_least("sample_seed", sample_seed, 0)
        if not isinstance(prefix, str):
            raise check.ArgumentError(f"prefix={prefix!r}: expected a string, e.g. 'dflash_eval/'")
        self.prefix = prefix
        self.baselines = check.baseline_paths("baselines", baselines)
        self.published = check.path_or_none("published", published)
        self.published_entries = check.str_list("published_entries", published_entries,
                                                none="every non-placeholder entry")
        self.fail_on_error = check.flag("fail_on_error", fail_on_error)
        self.max_failed_evaluations = check.int_at_least("max_failed_evaluations", max_failed_evaluations, 0,
                                                         note="0 = never stop")
        self.autocast_dtype = autocast_dtype
        self.table_samples = check.int_at_least("table_samples", table_samples, 0, note="0 = no table")
        self.table_cycles = check.int_at_least("table_cycles", table_cycles, 1)
        self.tokenizer = tokenizer
        self.verify_cache = check.flag("verify_cache", verify_cache)
        self.position_edges = check.position_edges("position_edges", position_edges)
        self.console = check.flag("console", console)
        self.sinks: list[MetricsSink] = as_sinks(log)
        self.max_steps = int(max_steps)
        self.full_parameters = full_parameters
        self.say = say
        self.name = name

        # Persistent (state_dict): the schedule and what was measured.
        self.last_eval_step = -1
        self.num_evals = 0
        self.start_done = False
        self.history: list[dict[str, float]] = []  # rank zero: {"step": s, metric: value, ...} per evaluation
        self.failed_evaluations = 0
        self.cache_manifest_sha256: str | None = None  # the cache the history was measured on
        self.sample_selection: dict[str, Any] | None = None  # and the samples (eval_state.selection_record)
        # Per run (setup).
        self.cache: StateCache | None = None
        self.eval_ids: list[str] = []
        self._selection: dict[str, Any] = {}
        self.table_ids: list[str] = []
        self.reference: list[Baseline] = []
        self.published_skipped: list[str] = []
        self.last_metrics: dict[str, float] = {}
        self.last_shared: dict[str, float] = {}  # every rank: the last evaluation's counts-based metrics
        self.last_samples: list[SampleResult] = []  # rank zero: every evaluated sample, in eval_ids order
        self._spec: DrafterSpec | None = None
        self._categories: tuple[str, ...] = ()
        self._head: TargetHead | None = None
        self._head_key: tuple[Any, ...] | None = None
        self._decoder: Callable[[Sequence[int]], str] | None = None
        self._table_tokens: dict[str, list[int]] = {}
        self._wandb_ready = False
        self._failed_in_a_row = 0
        self._setup_note: tuple[int, int, float, float] | None = None  # hashed files, bytes, hash s, setup s
        self._announced = False
        self._clock: tuple[float, int] | None = None  # (time, global step) the last evaluation ended at

    # -- resumable state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        ours = self.cache is not None  # after setup: the cache and selection this run measures
        return EvalState(self.last_eval_step, self.num_evals, self.start_done, list(self.history), self.last_eval_full,
                         self.failed_evaluations,
                         self.cache.manifest_sha256 if self.cache is not None else self.cache_manifest_sha256,
                         self._selection if ours else self.sample_selection).to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and the history. A malformed state (a missing field, a wrong type, a
        history that is not a list of evaluations) warns, naming the field, and a new series starts
        here, as on another cache: the resumed training goes on and its weights are evaluated at
        once; the checkpoint file is left as it is."""
        try:
            saved = EvalState.from_dict(state_dict)
        except MalformedStateError as e:
            warnings.warn(f"{self.name}: the checkpoint's evaluation state is malformed ({e}); it is "
                          "ignored and a new series starts here (the checkpoint was edited, damaged, or written by "
                          "an incompatible version).", RuntimeWarning, stacklevel=2)
            saved = EvalState()
        self._restore(saved)
        if self.cache is not None:  # restored after setup
            self.check_resumed_series()

    def _restore(self, s: EvalState) -> None:
        self.last_eval_step, self.num_evals, self.start_done = s.last_eval_step, s.num_evals, s.start_done
        self.history, self.last_eval_full, self.failed_evaluations = s.history, s.last_eval_full, s.failed_evaluations
        self.cache_manifest_sha256, self.sample_selection = s.cache_manifest_sha256, s.sample_selection

    def check_resumed_series(self) -> None:
        """A state from a run on another cache (same path, replaced contents) or another sample
        selection (``num_samples``, ``sample_ids``, ``sample_seed``): start a new series."""
        assert self.cache is not None
        reason = new_series_reason(self.cache_manifest_sha256, self.sample_selection, self.cache.manifest_sha256,
                                   self._selection, self.cache.path)
        if reason is not None:
            warnings.warn(f"{self.name}: the checkpoint's evaluations were {reason}. Its {len(self.history)} "
                          "evaluation(s) are dropped and a new series starts here; numbers from different caches or "
                          "sample selections are not comparable.", RuntimeWarning, stacklevel=2)
            self._restore(EvalState())  # and the resumed weights are evaluated at once
        self.cache_manifest_sha256, self.sample_selection = self.cache.manifest_sha256, self._selection

    # -- the loop's calls -------------------------------------------------------------------
    def setup(self, drafter: nn.Module | None = None, model: Any = None) -> None:
        """Open and check the cache, load the baselines; with ``drafter``, check it against the cache.

        Raises before any training step (``CacheError``, ``CacheMismatchError``, ``ValueError``),
        naming the file or field. ``start``/``step`` call it if the loop did not.
        """
        started = time.perf_counter()
        self.cache = StateCache(self.states)  # CacheError: no or broken manifest
        self._categories = self.cache.categories
        self.eval_ids = select_sample_ids(self.cache, self.num_samples, self.sample_ids, self.sample_seed)
        self._selection = selection_record(self.eval_ids, self.num_samples, self.sample_ids, self.sample_seed)
        # Found now rather than inside every evaluation: a missing or truncated file (a stat each),
        # and with verify_cache a changed byte (sha256).
        needs_head = self.target_embed is None
        self.cache.check_files(self.eval_ids, head=needs_head)
        # Each rank hashes the shards it scores, rank zero the head; files verified earlier in this
        # process (an earlier run, unchanged size and mtime) are not hashed again.
        verified = verify_across_ranks(self.cache, self.eval_ids, needs_head) if self.verify_cache else None
        self.cache.check_samples(self.eval_ids)  # manifest fields against the shards (small tensors only)
        if self.cache_manifest_sha256 is not None or self.sample_selection is not None:  # a state loaded before
            self.check_resumed_series()
        self.cache_manifest_sha256, self.sample_selection = self.cache.manifest_sha256, self._selection
        self._failed_in_a_row = 0
        self.table_ids = _stratified(self.eval_ids, self.cache, self.table_samples, None)
        self.reference = [load_measured(p, self.cache, name=n, sample_ids=self.eval_ids)
                          for n, p in self.baselines.items()]
        served = load_served(self.cache, self.eval_ids)  # the server's own counters, when the cache has them
        if served is not None:
            self.reference.append(served)
        if self.published:
            pf = load_published(self.published, self.published_entries)
            self.reference += pf.baselines
            self.published_skipped = pf.skipped
        self._spec = None
        self._head = None
        self._head_key = None
        self._table_tokens = {}
        self._wandb_ready = False
        self._announced = False
        if drafter is not None:
            self.validate(drafter, model)
        self._setup_note = (verified.files if verified else 0, verified.bytes if verified else 0,
                            verified.seconds if verified else 0.0, time.perf_counter() - started)

    def start(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """Before the first training step: the evaluation of the untrained (or resumed) drafter, once per
        run (``eval_on_fit_start``; a resumed run does not repeat it). Metrics, or None."""
        self._ready(global_step, drafter, model)
        self.check_resumed_series()
        self._clock = (time.perf_counter(), global_step)
        due = fit_start_eval_due(global_step, self.last_eval_step, self.start_done, self.eval_on_fit_start)
        self.start_done = True
        return self._evaluate(global_step, drafter, model, "fit start") if due else None

    def step(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After optimizer step ``global_step``: evaluate if it is due. Metrics (rank zero: everything
        logged; other ranks: the counts-based ones), or None (not due, or failed: a warning)."""
        self._ready(global_step, drafter, model)
        reason = periodic_eval_reason(global_step, self.every_n_train_steps, self.last_eval_step,
                                      self.eval_on_fit_end, self.max_steps)
        return self._evaluate(global_step, drafter, model, reason) if reason is not None else None

    def finish(self, global_step: int, drafter: nn.Module, model: Any = None) -> dict[str, float] | None:
        """After the last step: the full evaluation (``eval_on_fit_end``), unless that step had one."""
        if not fit_end_eval_due(global_step, self.last_eval_step, self.last_eval_full, self.eval_on_fit_end):
            return None
        self._ready(global_step, drafter, model)
        return self._evaluate(global_step, drafter, model, FIT_END)

    def _ready(self, global_step: int, drafter: nn.Module, model: Any) -> None:
        if self.cache is None:
            self.setup()
        if not self.validated:
            with self._gathered(drafter, model):  # under FSDP, shapes are only right with whole parameters
                self.validate(drafter, model)
        self.announce(global_step, drafter)

    def announce(self, global_step: int, drafter: nn.Module) -> None:
        """Once per setup, on rank zero: the first console line (setup time, hashing, predicted cost of a
        periodic and a full evaluation, ``cost.predict``), and the predicted figures logged."""
        if self._announced or self._setup_note is None or self._spec is None:
            return
        self._announced = True
        if world()[0] != 0:
            return
        assert self.cache is not None
        spec = self._spec
        last = [h.get(TAU) for h in self.history[-1:]] or [self.last_metrics.get(TAU)]
        tau = last[0] if isinstance(last[0], float) and math.isfinite(last[0]) else 1.0
        costs = predict(unwrap(drafter), spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size,
                        [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(self.cache.entry, self.eval_ids)],
                        tau, {"periodic": (self.periodic_ddtree_budgets, self.periodic_anchor_stride
                                           or spec.block_size), "full": (self.ddtree_budgets, 1)})
        files, nbytes, hash_s, setup_s = self._setup_note
        if self.console:
            self.say(f"{self.name} " + setup_line(len(self.eval_ids), files, nbytes, hash_s, setup_s, tau, costs))
        scalars = {self.prefix + SETUP_TIME: setup_s}
        for kind, c in costs.items():
            scalars[self.prefix + predicted_anchors(kind)] = float(c.anchors)
            scalars[self.prefix + predicted_gflop(kind)] = c.gflop
        for sink in self.sinks:
            sink.log(scalars, global_step)

    def _gathered(self, drafter: nn.Module, model: Any) -> AbstractContextManager[Any]:
        if self.full_parameters is not None:
            return self.full_parameters()
        return full_parameters_of(model if isinstance(model, nn.Module) else drafter)

    # -- configuration ----------------------------------------------------------------------
    @property
    def validated(self) -> bool:
        """Whether the drafter was checked against the cache (``validate``) since ``setup``."""
        return self._spec is not None

    def validate(self, drafter: nn.Module, model: Any = None) -> None:
        """Cache vs drafter (and head) compatibility; raises CacheMismatchError naming every field."""
        assert self.cache is not None
        drafter = unwrap(drafter)
        spec = DrafterSpec.of(drafter)
        config = getattr(drafter, "config", None)
        self.cache.check_drafter(spec.as_cache_check())
        m = self.cache.manifest
        for name, budgets in (("ddtree_budgets", self.ddtree_budgets),
                              ("periodic_ddtree_budgets", self.periodic_ddtree_budgets)):
            check_ddtree_budgets(budgets, spec.block_size, m.vocab_size, name)  # before any evaluation
        problems = []
        n_target = getattr(config, "num_target_layers", None)
        if n_target is not None and m.target.get("num_layers") is not None and int(n_target) != int(m.target["num_layers"]):
            problems.append(f"num_target_layers: drafter was made for a {n_target}-layer target, "
                            f"the cache's target has {m.target['num_layers']}")
        if self.target_embed is not None:
            for what, source in (("target_embed", self.target_embed), ("target_lm_head", self.target_lm_head)):
                if source is None:
                    continue
                t = self._weight(model, source)
                if tuple(t.shape) != (m.vocab_size, m.hidden_size):
                    problems.append(f"{what} ({_describe(source)}): shape {tuple(t.shape)}, the cache's target has "
                                    f"[vocab {m.vocab_size}, hidden {m.hidden_size}]")
        elif not self.cache.has_head:
            problems.append("target head: the cache has no exported head (built with --no-export-head) and no "
                            "target_embed/target_lm_head were given")
        if problems:
            raise CacheMismatchError(f"cache {self.cache.path} does not fit the drafter:\n  - " + "\n  - ".join(problems))
        self._spec = spec

    def _weight(self, model: Any, source: WeightSource) -> torch.Tensor:
        if isinstance(source, str):
            if model is None:
                raise ValueError(f"{self.name}: {source!r} is an attribute path; pass the model that holds it "
                                 "(model=...) or the tensor itself")
            try:
                source = attrgetter(source)(model)
            except AttributeError:
                raise AttributeError(f"{self.name}: the model ({type(model).__name__}) has no attribute "
                                     f"{source!r}") from None
        if isinstance(source, (nn.Embedding, nn.Linear)):
            return source.weight
        if isinstance(source, torch.Tensor):
            return source
        raise TypeError(f"{self.name}: the target weight is a {type(source).__name__}; expected nn.Embedding, "
                        "nn.Linear or a [vocab, hidden] tensor")

    # -- evaluation -------------------------------------------------------------------------
    def _target_head(self, model: Any, device: torch.device, dtype: torch.dtype) -> TargetHead:
        if self.target_embed is not None:
            embed = self._weight(model, self.target_embed)
            head = self._weight(model, self.target_lm_head) if self.target_lm_head is not None else embed
            return TargetHead(embed, head, tied=head is embed)
        key = (str(device), dtype)
        if self._head is None or self._head_key != key:
            assert self.cache is not None
            # Loaded once (sha256-checked the first time) and kept; reloaded only if the device moves.
            self._head = self.cache.load_head(device=device, dtype=dtype, verify=self.verify_cache)
            self._head_key = key
        return self._head

    def _profile(self, reason: str) -> tuple[bool, tuple[int, ...], int]:
        """(full?, DDTree budgets, anchor stride) of the evaluation about to run."""
        if is_full_evaluation(reason, self.num_evals, self.full_every_n_evals):
            return True, self.ddtree_budgets, 1
        assert self._spec is not None
        return False, self.periodic_ddtree_budgets, self.periodic_anchor_stride or self._spec.block_size

    def _local_eval(self, drafter: nn.Module, model: Any, ids: list[str], budgets: tuple[int, ...],
                    anchor_stride: int) -> EvalReport:
        """This rank's share, scored without touching the training state (``live_eval.score_untouched``)."""
        assert self.cache is not None and self._spec is not None
        self.cache.check_unchanged()  # a folder replaced during training fails here, naming both manifest hashes
        drafter = unwrap(drafter)
        param = next(drafter.parameters())
        device = param.device
        autocast = resolve_autocast(self.autocast_dtype, device, param.dtype)
        head = self._target_head(model, device, autocast or param.dtype)
        keep = self.table_cycles if self.table_samples > 0 and set(ids) & set(self.table_ids) else 0
        # verify: only a shard whose size or mtime changed since it was hashed is hashed again.
        report = score_untouched(self.cache, drafter, head, ids, device=device, budgets=budgets,
                                 anchor_stride=anchor_stride, autocast_dtype=autocast, spec=self._spec,
                                 keep_drafts=keep, verify=self.verify_cache, tail_blocks=self.tail_blocks)
        table = set(self.table_ids)
        for s in report.samples:
            if s.id not in table:
                s.drafts = None
        return report

    def _evaluate(self, step: int, drafter: nn.Module, model: Any, reason: str) -> dict[str, float] | None:
        # Recorded first: a failed evaluation is not retried at the next micro-batch of the same step.
        self.last_eval_step = step
        full, budgets, stride = self._profile(reason) if self._spec is not None else (True, self.ddtree_budgets, 1)
        self.last_eval_full, self.last_eval_stride, self.last_eval_budgets = full, stride, budgets
        template = EvalCounts(self._spec.block_size if self._spec else 2, budgets, self._categories)
        result = evaluate_across_ranks(self.eval_ids, lambda ids: self._local_eval(drafter, model, ids, budgets, stride),
                                       template, lambda: self._gathered(drafter, model))
        since, self._clock = self._clock, (time.perf_counter(), step)
        if result.failed:
            self._on_failure(step, reason, result)
            return None
        self._failed_in_a_row = 0
        assert result.counts is not None
        summary = summarize(result.counts)
        summary[EVAL_TIME] = result.seconds
        trained = since is not None and since[1] != step  # NaN for an evaluation with no training before it
        summary[EVAL_OVERHEAD] = eval_overhead(result.seconds, self._clock[0] - since[0]) if trained else math.nan
        self.num_evals += 1
        # Every rank gets the numbers, so a loop can act on them anywhere (ModelCheckpoint, early stopping).
        finite = {self.prefix + k: v for k, v in summary.items() if isinstance(v, float) and math.isfinite(v)}
        if full:  # the same keys again under full/, so a panel can show the full evaluations apart
            finite.update({f"{self.prefix}full/{k[len(self.prefix):]}": v for k, v in list(finite.items())})
        self.last_shared = dict(finite)
        if result.rank != 0:
            return finite
        self.last_samples = result.samples or []
        self._add_sample_metrics(step, summary, finite)
        if full:  # the rank-zero figures (intervals, position taus) under full/ too
            full_prefix = self.prefix + "full/"
            finite.update({full_prefix + k[len(self.prefix):]: v for k, v in list(finite.items())
                           if not k.startswith(full_prefix)})
        self.last_metrics = dict(summary)
        self.history.append({"step": step, **summary})
        metrics = dict(finite)
        metrics[self.prefix + ANCHOR_STRIDE] = float(self.last_eval_stride)
        metrics[self.prefix + FAILED_EVALS] = float(self.failed_evaluations)
        metrics.update(baseline_scalars(self.reference, self.prefix))
        try:
            self._log(step, metrics, summary, result.counts)
        except Exception as e:  # a logging problem must not end the training either
            if self.fail_on_error:
                raise
            warnings.warn(f"{self.name}: logging the evaluation at step {step} failed: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        return metrics

    def _on_failure(self, step: int, reason: str, result: RankedEvaluation) -> None:
        """Count the failed evaluation, then raise (``fail_on_error``, too many in a row) or warn."""
        # Every rank sees the same failed_ranks, so every rank counts (and raises) alike.
        error = result.error
        self.failed_evaluations += 1
        self._failed_in_a_row += 1
        msg = f"{self.name}: evaluation at {reason} (global step {step}) failed"
        if error is not None:
            msg += f" on rank {result.rank}: {type(error).__name__}: {error}"
        else:
            msg += f" on {result.failed_ranks} other rank(s); see their warnings"
        if result.rank == 0:
            self._log_failures(step)
        if self.fail_on_error:
            raise DFlashEvalError(msg) from error
        k = self.max_failed_evaluations
        if k and self._failed_in_a_row >= k:
            raise DFlashEvalError(f"{msg}. {self._failed_in_a_row} evaluations in a row failed "
                                  f"(max_failed_evaluations={k}): stopping rather than training on "
                                  "without measurements") from error
        warnings.warn(msg + f". Training continues (failure {self._failed_in_a_row} in a row; "
                      f"max_failed_evaluations={k}).", RuntimeWarning, stacklevel=4)

    def _add_sample_metrics(self, step: int, summary: dict[str, float], finite: dict[str, float]) -> None:
        """Rank zero: intervals, position/cycle taus and paired deltas (they need the per-sample lengths,
        gathered from every rank), then the console line."""
        try:
            extra = live_metrics(self.last_samples, self.last_eval_budgets, self._categories, self.reference,
                                 self.position_edges)
        except Exception as e:  # an extra figure must not end the training
            if self.fail_on_error:
                raise
            warnings.warn(f"{self.name}: intervals at step {step} failed: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
            extra = {}
        summary.update(extra)
        finite.update({self.prefix + k: v for k, v in extra.items() if math.isfinite(v)})
        if self.console:
            self.say(f"{self.name} " + evaluation_line(step, summary, self.last_eval_budgets,
                                                       [b.key for b in self.reference if b.samples]))

    # -- logging (rank zero) ----------------------------------------------------------------
    def _log_failures(self, step: int) -> None:
        """The failure counter alone, so a panel (or a W&B alert on it) shows evaluations that failed."""
        try:
            for sink in self.sinks:
                sink.log({self.prefix + FAILED_EVALS: float(self.failed_evaluations)}, step)
        except Exception as e:  # logging must not hide the evaluation's own error
            warnings.warn(f"{self.name}: logging the failure counter failed: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)

    def _log(self, step: int, metrics: dict[str, float], summary: dict[str, float], counts: EvalCounts) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)
        run = next((r for r in (s.wandb_run() for s in self.sinks) if r is not None), None)
        if run is None:
            return
        if not self._wandb_ready:
            start_live_run(run, self.prefix, self.reference, self.published_skipped, self._describe())
            self._wandb_ready = True
        rows: list[list[Any]] = []
        if self.table_ids:
            if self._decoder is None:
                self._decoder = make_decoder(self.tokenizer)
            assert self.cache is not None
            rows = sample_rows(step, self.last_samples, self.table_ids, self.cache, self._tokens, self._decoder)
        assert self._spec is not None
        live = per_depth(summary, self._spec.block_size)["unconditional"]
        log_evaluation(run, step=step, prefix=self.prefix, live_per_depth=live,
                       hist=counts.data["hist"].tolist(), baselines=self.reference, rows=rows)
        log_best(run, self.history, self.prefix)

    def _tokens(self, sample_id: str) -> list[int]:
        """A table sample's token ids, read once (only ``input_ids``: the features can be 100+ MB)."""
        if sample_id not in self._table_tokens:
            assert self.cache is not None
            self._table_tokens[sample_id] = self.cache.token_ids(sample_id)
        return self._table_tokens[sample_id]

    def _describe(self) -> dict[str, Any]:
        """The configuration recorded in the W&B run's config."""
        assert self.cache is not None
        return {
            "states": self.states, "cache_manifest_sha256": self.cache.manifest_sha256,
            "samples_evaluated": len(self.eval_ids), "samples_in_cache": len(self.cache),
            "every_n_train_steps": self.every_n_train_steps, "ddtree_budgets": list(self.ddtree_budgets),
            "periodic_ddtree_budgets": list(self.periodic_ddtree_budgets),
            "periodic_anchor_stride": self.periodic_anchor_stride or (self._spec.block_size if self._spec else None),
            "full_every_n_evals": self.full_every_n_evals, "tail_blocks": self.tail_blocks,
            "autocast_dtype": self.autocast_dtype, "position_edges": list(self.position_edges),
        }


# -- finding the drafter in a training model ------------------------------------------------------

def unwrap(module: nn.Module) -> nn.Module:
    """The module under a ``torch.compile`` wrapper."""
    return getattr(module, "_orig_mod", module)


def find_drafter(model: Any, source: DrafterSource, owner: str, required: bool = True) -> nn.Module | None:
    """The drafter inside the training ``model``: an attribute path (``"drafter"``, ``"model.draft"``), a
    function ``model -> drafter``, or None/"" for the model itself. ``owner`` names the caller in errors."""
    if source is None or source == "":
        module = model
    elif isinstance(source, str):
        try:
            module = attrgetter(source)(model)
        except AttributeError:
            if not required:
                return None
            children = ", ".join(n for n, _ in model.named_children()) or "none"
            raise AttributeError(f"{owner}: the {type(model).__name__} has no attribute {source!r} "
                                 f"(its submodules: {children}); set drafter= to the drafter's attribute "
                                 "path or to a function model -> drafter") from None
    else:
        module = source(model)
    if module is None:
        if required:
            raise AttributeError(f"{owner}: drafter {source!r} resolved to None")
        return None
    return unwrap(module)


# -- the schedule: pure decisions, acted on by the loop's calls -----------------------------------
FIT_END = "fit end"  # the reason of the fit-end evaluation (always a full one)


def fit_start_eval_due(step: int, last_eval_step: int, start_done: bool, eval_on_fit_start: bool) -> bool:
    """Evaluate before the first training step? Once per run: a resumed run does not repeat it, nor
    evaluate again a step already evaluated."""
    return eval_on_fit_start and not start_done and step != last_eval_step


def periodic_eval_reason(step: int, every_n_train_steps: int, last_eval_step: int, eval_on_fit_end: bool,
                         max_steps: int) -> str | None:
    """The reason of the evaluation due as optimizer step ``step``'s batch ends (None: no evaluation)."""
    n = every_n_train_steps
    # step > 0: with gradient accumulation the first micro-batches end at step 0, before any update.
    if not (n > 0 and step > 0 and step % n == 0 and step != last_eval_step):
        return None
    # The last step's evaluation is the fit-end one: full, and not repeated by finish().
    return FIT_END if eval_on_fit_end and 0 < max_steps <= step else f"step {step}"


def fit_end_eval_due(step: int, last_eval_step: int, last_eval_full: bool, eval_on_fit_end: bool) -> bool:
    """Evaluate after the last step? Unless that step was just evaluated with the full profile."""
    return eval_on_fit_end and (step != last_eval_step or not last_eval_full)


def is_full_evaluation(reason: str, evals_done: int, full_every_n_evals: int) -> bool:
    """Full profile (anchor stride 1, every DDTree budget) at fit end and for every N-th evaluation
    (``full_every_n_evals``; 0 = only at fit end); otherwise the light periodic profile."""
    n = full_every_n_evals
    return reason == FIT_END or (n > 0 and (evals_done + 1) % n == 0)


def _describe(source: WeightSource) -> str:
    return source if isinstance(source, str) else type(source).__name__


def _stratified(ids: Sequence[str], cache: StateCache, n: int, seed: int | None) -> list[str]:
    """``n`` of ``ids`` stratified by category (``states.stratified_ids``), in cache order."""
    return stratified_ids(ids, lambda i: cache.entry(i).category, n, seed)


__all__ = ["FIT_END", "DFlashEvalError", "LiveEvaluator", "find_drafter", "fit_end_eval_due", "fit_start_eval_due",
           "is_full_evaluation", "periodic_eval_reason", "unwrap"]
