"""The replay walk against a literal transcription of the loop in docs/method.md ("The loop")."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from replay_reference import replay_walk

from dflash_cb.core.loop.cycles import (
    SampleBounds,
    cut_produced,
    leading_matches,
    next_stop_positions,
    sample_bounds,
)


# Whole-table helpers (the engine computes the same per round): one produced value per anchor.
def block_lengths(anchors: torch.Tensor, loop_end: int, block_size: int) -> torch.Tensor:
    """Block length the loop uses at each anchor: shorter only at the tail."""
    return torch.clamp(loop_end - anchors, max=block_size)


def target_windows(tokens: torch.Tensor, anchors: torch.Tensor, depth: int, known_end: int) -> torch.Tensor:
    """[A, depth] target tokens at p+1..p+depth; -1 (never a token) at or beyond ``known_end``."""
    pos = anchors[:, None] + torch.arange(1, depth + 1, device=anchors.device)[None, :]
    ok = pos < known_end
    out = tokens[pos.clamp(max=tokens.shape[0] - 1)]
    return torch.where(ok, out, torch.full_like(out, -1))


def produced_per_anchor(accepted: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor,
                        bounds: SampleBounds, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """``produced`` a cycle anchored at each p would commit: min(a + 1, end - p - 1), cut at a stop."""
    first = None
    if stop_token_ids:
        nxt = next_stop_positions(tokens, stop_token_ids)
        first = nxt[(anchors + 1).clamp(max=tokens.shape[0] - 1)]
    return cut_produced(accepted, anchors, bounds.loop_end, first)


def literal_loop(tokens, drafts, n, end, block_size, stops):
    """drafts[p] = the drafter's tokens at depths 1..L-1 for a block of length L = min(bs, end - p)."""
    p = n
    out = []
    if tokens[p] in stops:
        return out
    while p + 1 < end:
        length = min(block_size, end - p)
        d = drafts[p][: length - 1]
        a = 0
        while a < len(d) and p + a + 1 < len(tokens) and d[a] == tokens[p + a + 1]:
            a += 1
        produced = min(a + 1, end - p - 1)
        stopped = False
        for j in range(1, produced + 1):
            if tokens[p + j] in stops:
                produced, stopped = j, True
                break
        out.append(produced)
        p += produced
        if stopped:
            break
    return out


def test_walk_matches_literal_loop() -> None:
    rng = random.Random(0)
    bs, vocab, stop = 5, 6, 0
    for trial in range(300):
        n = rng.randint(1, 6)
        max_new = rng.randint(1, 25)
        comp = [rng.randint(1, vocab - 1) for _ in range(max_new)]
        if trial % 3 == 0:  # ended by a stop token
            cut = rng.randint(1, max_new)
            comp = comp[: cut - 1] + [stop]
        tokens = [rng.randint(1, vocab - 1) for _ in range(n)] + comp
        total = len(tokens)
        bounds = sample_bounds(n, total, total, max_new, tokens[-1], [stop])
        drafts = {}
        for p in range(n, total):
            length = min(bs, bounds.loop_end - p)
            # drafts copy the target with some noise, so runs of matches happen
            drafts[p] = [tokens[p + k] if p + k < total and rng.random() < 0.7 else rng.randint(1, vocab - 1)
                         for k in range(1, length)]
        want = literal_loop(tokens, drafts, n, bounds.loop_end, bs, {stop})
        t = torch.tensor(tokens)
        anchors = torch.tensor(list(bounds.anchors), dtype=torch.long)
        if anchors.numel() == 0:
            assert replay_walk([], tokens, bounds, [stop]) == want
            continue
        lengths = block_lengths(anchors, bounds.loop_end, bs)
        table = torch.full((anchors.numel(), bs - 1), -2)
        for i, p in enumerate(anchors.tolist()):
            table[i, : lengths[i] - 1] = torch.tensor(drafts[p][: lengths[i] - 1])
        acc = leading_matches(table, target_windows(t, anchors, bs - 1, bounds.known_end))
        produced = produced_per_anchor(acc, anchors, t, bounds, [stop])
        assert replay_walk(produced.tolist(), tokens, bounds, [stop]) == want, trial


def test_bounds() -> None:
    # Full greedy path ended by a stop: the loop keeps the reference's end for tail block lengths.
    b = sample_bounds(4, 10, 10, 32, last_token=2, stop_token_ids=[2])
    assert (b.loop_end, b.known_end) == (36, 10)
    # Length-limited completion.
    b = sample_bounds(4, 36, 36, 32, last_token=7, stop_token_ids=[2])
    assert (b.loop_end, b.known_end) == (36, 36)
    # Served completion left the target's greedy path at position 20: scoring stops there.
    b = sample_bounds(4, 36, 20, 32, last_token=7, stop_token_ids=[2])
    assert (b.loop_end, b.known_end) == (20, 20)
    assert list(b.anchors) == list(range(4, 19))


def test_next_stops_of_samples_end_to_end_are_each_samples_own() -> None:
    """A wave's samples end to end (``lengths``): each position's first stop at or after it within its own sample,
    from the sample's start (its length when none), as a literal scan gives; never a stop of the next sample."""
    rng = random.Random(0)
    for _ in range(200):
        samples = [[rng.randrange(6) for _ in range(rng.randrange(0, 12))] for _ in range(rng.randrange(1, 6))]
        stops = rng.choice([[], [2], [1, 4]])
        want = [next((j for j in range(i, len(s)) if s[j] in stops), len(s)) for s in samples for i in range(len(s))]
        got = next_stop_positions(torch.tensor([t for s in samples for t in s], dtype=torch.long), stops,
                                  torch.tensor([len(s) for s in samples]))
        assert got.tolist() == want, (samples, stops)
