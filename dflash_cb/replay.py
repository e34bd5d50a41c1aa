"""Offline replay of the greedy DFlash speculative loop (DFLASH_NOTES.md, section 2).

With greedy verification the target accepts draft token k exactly when it equals the target's
token at ``p + k``; with the target's greedy path cached, the draft at anchor ``p`` depends only on
cached data. So the loop is a walk over per-anchor accepted counts: ``p -> p + produced(p)``.
Pure functions on lists and tensors; no model here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleBounds:
    """Where the loop runs for one cached sample.

    ``loop_end`` is the reference loop's ``end`` (prompt_len + max_new_tokens) and sets the tail
    block lengths; ``known_end`` is the cached ``valid_len``: tokens at or past it are unknown or off
    the target's greedy path and never count as a match.
    """

    prompt_len: int
    loop_end: int
    known_end: int

    @property
    def anchors(self) -> range:
        # The walk never anchors at the last known token: p + 1 < end, and a stop at known_end - 1 ends it.
        return range(self.prompt_len, max(self.prompt_len, min(self.loop_end, self.known_end) - 1))


def sample_bounds(prompt_len: int, total_len: int, valid_len: int, max_new_tokens: int,
                  last_token: int | None, stop_token_ids: Sequence[int]) -> SampleBounds:
    full_end = prompt_len + max_new_tokens
    if valid_len >= total_len and (total_len >= full_end or last_token in set(stop_token_ids)):
        # The cached completion is the whole greedy path: reproduce the reference exactly,
        # tail blocks included (a completion ended by a stop token keeps the full ``end``).
        return SampleBounds(prompt_len, full_end, total_len)
    # Off the greedy path (or cut short for another reason): score up to valid_len only.
    return SampleBounds(prompt_len, min(full_end, valid_len), valid_len)


def block_lengths(anchors: torch.Tensor, loop_end: int, block_size: int) -> torch.Tensor:
    """Block length the loop uses at each anchor: shorter only at the tail."""
    return torch.clamp(loop_end - anchors, max=block_size)


def target_windows(tokens: torch.Tensor, anchors: torch.Tensor, depth: int, known_end: int) -> torch.Tensor:
    """[A, depth] target tokens at p+1..p+depth; -1 (never a token) at or beyond ``known_end``."""
    pos = anchors[:, None] + torch.arange(1, depth + 1, device=anchors.device)[None, :]
    ok = pos < known_end
    out = tokens[pos.clamp(max=tokens.shape[0] - 1)]
    return torch.where(ok, out, torch.full_like(out, -1))


def leading_matches(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[A, D] draft and target tokens (padding -1 / -2 never match) -> [A] accepted draft tokens."""
    return (draft == target).long().cumprod(dim=1).sum(dim=1)


def produced_per_anchor(accepted: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor,
                        bounds: SampleBounds, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """``produced`` a cycle anchored at each p would commit: min(a + 1, end - p - 1), cut at a stop."""
    produced = torch.minimum(accepted + 1, bounds.loop_end - anchors - 1)
    if stop_token_ids:
        n = tokens.shape[0]
        stops = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=tokens.device))
        idx = torch.arange(n, device=tokens.device)
        # next_stop[i] = first stop position >= i (n when none): reverse cumulative min.
        cand = torch.where(stops, idx, torch.full_like(idx, n))
        next_stop = torch.flip(torch.cummin(torch.flip(cand, [0]), 0).values, [0])
        first = next_stop[(anchors + 1).clamp(max=n - 1)]
        produced = torch.minimum(produced, first - anchors)
    return produced


def replay_walk(produced: Sequence[int], tokens: Sequence[int], bounds: SampleBounds,
                stop_token_ids: Sequence[int]) -> list[int]:
    """Cycle-by-cycle ``acceptance_lengths`` of the reference loop from per-anchor ``produced``.

    ``produced[i]`` belongs to anchor ``bounds.prompt_len + i`` (see ``produced_per_anchor``).
    """
    stop = set(stop_token_ids)
    p, n = bounds.prompt_len, bounds.prompt_len
    if p >= bounds.known_end or tokens[p] in stop:
        return []  # the prefill's token is off the path, or already a stop: no cycle runs
    out = []
    while p + 1 < bounds.loop_end:
        k = produced[p - n]
        out.append(k)
        p += k
        if any(tokens[j] in stop for j in range(p - k + 1, p + 1)):
            break
    return out
