"""SpecForge's own EAGLE-3 figures on a cache: its per-position accuracy and ``simulated_acc_len``, counted as
SpecForge 0.2.0 counts them in its offline EAGLE-3 training and evaluation (``OnlineEagle3Model`` behind
``Eagle3TrainStrategy``, summed by ``eval.Evaluator``), beside the replay's exact tau.

SpecForge unrolls K test-time-training steps from every row of a sequence at once, each fed the data's own
tokens: step ``j`` (0-based) of row ``i`` drafts the token at ``i + j + 2`` (the chain of a cycle whose
verified token sits at ``a = i + 1``, depth ``j + 1``) and is correct when its draft, mapped by ``d2t``, is the
target's argmax at ``i + j + 1``. It is counted where the loss mask, shifted left ``j`` times, is set at row
``i``: the mask of position ``i + j``, which the offline reader sets on the completion but its last token. So
every depth scores the same drafted positions (``prompt_len + 2 .. T``), some from cycles that would start in
the prompt, and never conditions a depth on the ones before it: ``per_position_acc[j]`` = correct / counted,
pooled over the set, and ``simulated_acc_len = sum_k prod_{j <= k} per_position_acc[j]`` (no bonus token).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ....cache.states import StateCache, TargetHead
from ..chain import ChainRunner
from ..proposers import Proposer


@dataclass
class PositionCounts:
    """Per depth (SpecForge's TTT position): matches and counted rows, integers, summable over samples."""

    correct: torch.Tensor  # int64 [K]
    counted: torch.Tensor  # int64 [K]

    def __add__(self, other: PositionCounts) -> PositionCounts:
        return PositionCounts(self.correct + other.correct, self.counted + other.counted)

    @property
    def per_position_acc(self) -> list[float]:
        return (self.correct.double() / self.counted.clamp(min=1).double()).tolist()

    @property
    def simulated_acc_len(self) -> float:
        """SpecForge's ``eval/simulated_acc_len``: ``a0 + a0 a1 + ...`` over ``per_position_acc``."""
        total, cumulative = 0.0, 1.0
        for acc in self.per_position_acc:
            cumulative *= acc
            total += cumulative
        return total


def sample_position_counts(runner: ChainRunner, proposer: Proposer, features: torch.Tensor,
                           input_ids: torch.Tensor, target_argmax: torch.Tensor, prompt_len: int, steps: int,
                           embed: torch.Tensor) -> PositionCounts:
    """SpecForge's counts (module docstring) of one sample: its drafter features [T, F] (the drafter's layers),
    tokens [T], the target's argmax [T] and prompt length, ``steps`` TTT positions."""
    ids = input_ids.long()
    t = ids.numel()
    correct = torch.zeros(steps, dtype=torch.long)
    counted = torch.zeros(steps, dtype=torch.long)
    rows = t - 1  # row i is fed the token at i + 1; the last row, fed padding, is never counted
    first = max(0, prompt_len - steps + 1)  # the first row any depth counts (mask at i + j >= prompt_len)
    if rows <= first:
        return PositionCounts(correct, counted)
    nxt = runner.token_embeddings(ids[1:rows + 1], embed).to(runner.dtype)
    context = runner.context(iter([(features[:rows].to(runner.dtype), nxt)]), [rows])
    anchors = torch.arange(first + 1, rows + 1, device=features.device)  # a = i + 1
    blocks = runner.block_rows(context, runner.block_inputs(ids.to(features.device), anchors, steps + 1, embed),
                               anchors, torch.zeros_like(anchors))
    for j in range(steps):
        position = anchors - 1 + j  # the shifted loss mask's position
        keep = (position >= prompt_len) & (position <= t - 2)
        if not bool(keep.any()):
            continue
        depth = torch.full_like(anchors, j + 1)
        hidden = blocks.rows(torch.arange(anchors.numel(), device=anchors.device)[keep], depth[keep])
        target = target_argmax.to(hidden.device)[position[keep] + 1]
        drafts = proposer.rows(hidden, target.new_full(target.shape, -1), target).tokens
        correct[j] = int((drafts == target).sum())
        counted[j] = int(keep.sum())
    return PositionCounts(correct, counted)


def position_counts(runner: ChainRunner, proposer: Proposer,
                    samples: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], steps: int,
                    embed: torch.Tensor) -> PositionCounts:
    """``sample_position_counts`` summed over ``samples`` of (features, tokens, target argmax, prompt length): what
    SpecForge's ``Evaluator`` sums before its ratios."""
    total = PositionCounts(torch.zeros(steps, dtype=torch.long), torch.zeros(steps, dtype=torch.long))
    with torch.no_grad():
        for features, ids, argmax, prompt_len in samples:
            total = total + sample_position_counts(runner, proposer, features, ids, argmax, prompt_len, steps, embed)
    return total


def cache_position_counts(cache: StateCache, drafter: nn.Module, steps: int | None = None,
                          mem_bytes: int = 512 << 20, sample_ids: Iterable[str] | None = None,
                          head: TargetHead | None = None) -> PositionCounts:
    """SpecForge's counts of an EAGLE-3 ``drafter`` over every sample of ``cache`` (the loss mask: each
    completion, all of it, as SpecForge's offline reader masks the assistant's tokens), over ``steps`` TTT
    positions (default: the drafter's K); ``sample_ids``: only those samples; ``head``: the target head the
    evaluation holds (None: the cache's), where the samples are read to."""
    from ..registry import family_named

    spec = drafter.spec
    steps = spec.block_size - 1 if steps is None else steps
    cache.check_fit(family_named(spec.family).cache_needs(spec, drafter.config))
    head = head if head is not None else cache.load_head()
    runner = ChainRunner(drafter, spec)
    proposer = family_named(spec.family).proposer(spec, drafter, head.lm_head, mem_bytes, head.embed_tokens)
    columns = cache.feature_columns(spec.target_layer_ids)

    chosen = None if sample_ids is None else set(sample_ids)
    ids = [e.id for e in cache.samples if chosen is None or e.id in chosen]

    def samples() -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        for s in cache.load_many(ids, device=head.lm_head.device):  # each shard opened once
            yield (s.hidden if columns is None else s.hidden.index_select(1, columns.to(s.hidden.device)),
                   s.input_ids, s.target_argmax, s.entry.prompt_len)

    return position_counts(runner, proposer, samples(), steps, head.embed_tokens)
