"""Every replay walk of a wave, advanced together as [samples, walks] tensors, and how far each drafts ahead."""

from __future__ import annotations

from typing import Protocol

import torch


class WaveTables(Protocol):
    """What the walks read of their wave (``wave.Wave``): its token and slot tables, what is drafted where."""

    ids: list[str]
    prompt_len: torch.Tensor  # [samples]
    known_end: torch.Tensor  # [samples]
    loop_end: torch.Tensor  # [samples]
    token_start: torch.Tensor  # [samples]
    next_stop: torch.Tensor  # per position of the wave's tokens
    slot_start: torch.Tensor  # [samples]
    slot_end: torch.Tensor  # [samples]
    produced: torch.Tensor  # [slots, walks], -1 until drafted
    visited: torch.Tensor  # [slots] bool

    @property
    def slots(self) -> int: ...


# A walk whose drafts so far commit one token at least this often drafts ahead (``_grow``).
WEAK_SHARE = 0.9


def lookahead_cap(block_size: int) -> int:
    """The most anchors a walk drafts ahead in one round."""
    return 8 * block_size


def _grow(window: torch.Tensor, one_token_share: torch.Tensor, consumed: torch.Tensor, cap: int) -> torch.Tensor:
    """Next lookahead of each walk: anchors drafted from its position on (itself included).

    A walk at p visits p + 1 only if its cycle at p produces one token. When the sample's drafts so
    far say that is nearly certain for this kind of walk (a one-token share of at least ``WEAK_SHARE``) and
    the walk used its whole window last round (every cycle in it produced one token), the window
    doubles; otherwise it is 1: only the anchor the walk needs. So a weak drafter (tau ~ 1) gets a few large
    rounds instead of one round per cycle, while a useful drafter never drafts an anchor it may skip
    (``anchors_drafted / anchors_needed`` stays near 1).
    """
    return torch.where(consumed & (one_token_share >= WEAK_SHARE), (2 * window).clamp(max=cap),
                       torch.ones_like(window))


class Walks:
    """Every walk of a wave (per sample the greedy one, then one per DDTree budget) as [samples, walks]
    tensors, advanced together: the steps of the loop's walk (docs/method.md, "The loop"), one cycle of every walk per step."""

    def __init__(self, wave: WaveTables, n_walks: int):
        self.wave = wave
        n = len(wave.ids)
        p = wave.prompt_len
        inside = p < wave.known_end
        # The prefill's token is a stop exactly when the first stop at or after p is p itself.
        at = (wave.token_start + torch.minimum(p, (wave.known_end - 1).clamp(min=0))).clamp(
            max=max(wave.next_stop.numel() - 1, 0))
        prefill_stop = inside & (wave.next_stop[at] == p) if wave.next_stop.numel() else torch.zeros_like(inside)
        # The prefill's token off the known path, or already a stop, or no room for a cycle: no cycle runs.
        done = ~inside | prefill_stop | (p + 1 >= wave.loop_end)
        self.pos = p[:, None].repeat(1, n_walks)
        self.done = done[:, None].repeat(1, n_walks)
        self.cycles = torch.zeros((n, n_walks), dtype=torch.long)
        longest = int((wave.slot_end - wave.slot_start).max()) if n else 0
        self.lengths = torch.zeros((n, n_walks, max(longest, 1)), dtype=torch.long)  # a cycle moves >= 1 anchor
        self.window = torch.ones((n, n_walks), dtype=torch.long)
        self.one_token = torch.zeros((n, n_walks), dtype=torch.long)  # drafted anchors whose cycle produced one token
        self.scored = torch.zeros((n, n_walks), dtype=torch.long)  # drafted anchors scored for the walk

    def advance(self, cap: int) -> None:
        """Move every walk as far as the drafted anchors allow; update its lookahead (``_grow``).

        The lookahead depends on the sample's own drafts only, so what is drafted for a sample does not
        depend on which other samples share its evaluation (or its rank under DDP).
        """
        wave = self.wave
        start_pos, start_cycles = self.pos.clone(), self.cycles.clone()
        walk = torch.arange(self.pos.shape[1])
        while wave.slots:
            s, j = (~self.done).nonzero(as_tuple=True)
            if not s.numel():
                break
            p = self.pos[s, j]
            slot = wave.slot_start[s] + p - wave.prompt_len[s]
            produced = wave.produced[slot, walk[j]]
            move = produced > 0
            if not bool(move.any()):
                break
            s, j, p, slot, produced = s[move], j[move], p[move], slot[move], produced[move]
            c = self.cycles[s, j]
            self.lengths[s, j, c] = produced
            wave.visited[slot] = True
            new = p + produced
            # A stop token among the committed tokens p + 1 .. new ends the walk, as does the loop's end.
            stopped = wave.next_stop[wave.token_start[s] + p + 1] <= new
            self.done[s, j] = stopped | (new + 1 >= wave.loop_end[s])
            self.pos[s, j] = new
            self.cycles[s, j] = c + 1
        seen = self.scored.clamp(min=1).double()
        consumed = (self.pos - start_pos == self.window) & (self.cycles - start_cycles == self.window)
        self.window = _grow(self.window, self.one_token.double() / seen, consumed, cap)

