"""One evaluation of the live (training) drafter, across every rank: what ``LiveEvaluator`` runs.

The evaluator decides when to evaluate and with which profile, and what to log; this module does
the evaluation itself (the design of the collectives is in ``dflash_cb.integrations.evaluator.distributed``):

- ``score_untouched``: ``engine.evaluate`` on this rank's samples such that nothing training
  depends on changes (eval mode restored per submodule, RNG states restored, no gradients).
- ``evaluate_across_ranks``: rank r scores ``ids[r::world]`` with the full parameters gathered
  (FSDP), the integer counts and an error flag are summed with ONE ``all_reduce``, and, when no rank
  failed, the per-sample results are gathered to rank zero (for the intervals and the W&B table).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...cache.manifest import CacheError
from ...cache.states import StateCache, TargetHead
from ...common.timing import PhaseTimer
from ...core.figures.metrics import EvalCounts
from ...core.replay import EvalReport, EvalRequest, FittedDrafter, SampleResult, evaluate
from .distributed import all_gather, all_reduce_sum, gather_to_zero, world


def rank_share(ids: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The samples rank ``rank`` scores (and hashes): every ``world_size``-th from its own position."""
    return list(ids[rank::world_size])


@dataclass
class SetupCheck:
    """What ``verify_across_ranks`` hashed, over every rank."""

    files: int
    bytes: int
    seconds: float  # the slowest rank's hashing time


def verify_across_ranks(cache: StateCache, ids: Sequence[str], head: bool) -> SetupCheck:
    """sha256 of the shards each rank scores (its ``rank_share``) and, on rank zero, of the exported
    head; the head's result is shared with the other ranks, which do not hash it. A collective over
    ``torch.distributed``'s default group (a single process without one): every rank calls it. A file
    verified before in this process (unchanged ``integrity.file_identity``) is not hashed again.

    A mismatch on any rank raises ``CacheError`` on every rank (no rank trains on while another stops).
    """
    rank, ws = world()
    start, before = time.perf_counter(), len(cache.hashed)
    error: CacheError | None = None
    try:
        cache.verify(cache.shards_of(rank_share(ids, rank, ws)), head=head and rank == 0)
    except CacheError as e:
        error = e
    mine = cache.hashed[before:]
    parts = all_gather((str(error) if error else None, len(mine), sum(b for _, b in mine),
                        time.perf_counter() - start))
    if error is not None:
        raise error
    failed = [msg for msg, *_ in parts if msg]
    if failed:
        raise CacheError(f"another rank: {failed[0]}")
    if head and rank != 0:
        cache.head_verified_elsewhere()
    return SetupCheck(sum(p[1] for p in parts), sum(p[2] for p in parts), max(p[3] for p in parts))


def score_untouched(cache: StateCache, drafter: nn.Module, head: TargetHead, request: EvalRequest, *,
                    timer: PhaseTimer | None = None, fit: FittedDrafter | None = None) -> EvalReport:
    """``replay.evaluate`` of ``drafter`` for ``request`` (its device set; ``fit``: the drafter as checked once),
    leaving the training state as it was.

    The drafter runs in eval mode (each submodule's mode is restored afterwards, whatever happens),
    under ``torch.no_grad``, and the CPU (and this CUDA device's) RNG state is restored afterwards.
    """
    device = request.device if request.device is not None else torch.device("cpu")
    modes = [(m, m.training) for m in drafter.modules()]
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    drafter.eval()
    try:
        # fork_rng: the CPU (and this CUDA device's) RNG state is restored afterwards, whatever happens.
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            return evaluate(cache, drafter, head, request, timer=timer, fit=fit)
    finally:
        for m, was_training in modes:
            m.training = was_training


@dataclass
class RankedEvaluation:
    """What every rank learns from ``evaluate_across_ranks``."""

    rank: int
    failed_ranks: int  # ranks whose scoring raised (the same number on every rank)
    error: Exception | None  # this rank's own failure, if any
    counts: dict[int, EvalCounts] | None  # per anchor stride, summed over every rank; None when a rank failed
    seconds: float  # wall time up to the summed counts (the per-sample gather not included)
    samples: list[SampleResult] | None  # rank zero, when no rank failed: every rank's samples, in ``ids`` order

    @property
    def failed(self) -> bool:
        return self.failed_ranks > 0


def evaluate_across_ranks(ids: Sequence[str], score: Callable[[list[str]], EvalReport],
                          templates: dict[int, EvalCounts],
                          full_parameters: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                          ) -> RankedEvaluation:
    """Rank r runs ``score(ids[r::world])`` with the full parameters on every rank; counts are summed.

    A collective over ``torch.distributed``'s default group (a single process without one): every
    rank must call it at the same step. ``full_parameters`` makes sharded parameters whole for the
    duration (e.g. ``distributed.full_parameters_of(model)`` under FSDP; itself a collective).
    ``templates``: an empty ``EvalCounts`` of the evaluation's shape (block size, budgets, categories) per
    anchor-statistics stride the report holds (``EvalReport.counts_at``); they stand in for a rank that
    failed and receive the summed counts. A failure on any rank is known on every rank (the
    ``all_reduce`` carries an error flag), so nobody waits in a collective that will never come, and every
    rank returns the same ``failed_ranks``; then nothing is gathered.
    """
    rank, ws = world()
    start = time.perf_counter()
    report, error = None, None
    try:
        with (full_parameters or contextlib.nullcontext)():  # collective under FSDP: every rank is here at the same step
            try:
                report = score(rank_share(ids, rank, ws))
            except Exception as e:  # reported to every rank through the all_reduce below
                error = e
    except Exception as e:
        error = error or e
    parts = [report.counts_at(s).flat() if report is not None else torch.zeros_like(t.flat())
             for s, t in templates.items()]
    # ONE all_reduce: every stride's counts, plus the number of ranks that failed.
    total = all_reduce_sum(torch.cat([*parts, torch.tensor([1.0 if error else 0.0], dtype=torch.float64)]))
    failed = int(total[-1].item())
    if failed:
        return RankedEvaluation(rank, failed, error, None, time.perf_counter() - start, None)
    at = 0
    for t, part in zip(templates.values(), parts, strict=True):
        t.load_flat(total[at:at + part.numel()])
        at += part.numel()
    seconds = time.perf_counter() - start
    gathered = gather_to_zero(report.samples if report is not None else [])
    samples = None
    if gathered is not None:
        by_id = {s.id: s for part in gathered for s in part}
        samples = [by_id[i] for i in ids if i in by_id]
    return RankedEvaluation(rank, 0, error, dict(templates), seconds, samples)


