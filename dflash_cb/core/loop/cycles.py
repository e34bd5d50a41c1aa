"""Offline replay of the greedy DFlash speculative loop (docs/method.md, "The loop" and "Why the
replay is exact").

With greedy verification the target accepts draft token k exactly when it equals the target's
token at ``p + k``; with the target's greedy path cached, the draft at anchor ``p`` depends only on
cached data. So the loop is a walk over per-anchor produced counts: ``p -> p + produced(p)``, and a
walk only ever needs ``produced`` at the anchors it visits (the engine's ``_Walks``, fed on demand; a plain
one-walk reference for the tests: ``tests/support/replay_reference.py``).
Pure functions on lists and tensors; no model here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from ...common.arguments import int_between


@dataclass(frozen=True)
class SampleBounds:
    """Where the loop runs for one cached sample.

    ``loop_end`` is the reference loop's ``end`` (prompt_len + max_new_tokens): it cuts each cycle's
    ``produced`` and, under ``tail_blocks="reference"``, shortens the last blocks; ``known_end`` is the cached ``valid_len``: tokens at or past it are unknown or off
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


# How long a cycle's draft block is near the end of the loop (docs/method.md, "Tail blocks"):
# "served" drafts a full block every cycle and cuts what verification accepts, as SGLang's DFlash
# worker does; "reference" shortens the block to the tokens left, as dflash's ``dflash_generate``.
# Only bidirectional drafter layers see the difference (a shorter block changes their earlier drafts).
TailBlocks = Literal["served", "reference"]
TAIL_BLOCKS: tuple[TailBlocks, ...] = get_args(TailBlocks)


def check_tail_blocks(tail_blocks: str) -> str:
    if tail_blocks not in TAIL_BLOCKS:
        raise ValueError(f"tail_blocks={tail_blocks!r}: expected one of {', '.join(TAIL_BLOCKS)}")
    return tail_blocks


def check_block_size(block_size: Any, drafter_block_size: int, name: str = "block_size", cap: int | None = None) -> int:
    """The block the loop drafts with: ``block_size`` (None: the drafter's own ``drafter_block_size``).

    A server can draft with a block shorter than the drafter's trained one (SGLang's
    ``--speculative-dflash-block-size`` / ``--speculative-num-draft-tokens``): every cycle then drafts
    the anchor and ``block_size - 1`` mask positions, and its tau is capped by that block. A block
    holds the anchor and at least one draft (>= 2) and no mask position the drafter was not trained
    for (<= ``drafter_block_size``). Raises ``ArgumentError`` naming ``name`` (``"--block-size"`` on a
    command line). The one rule for the engine, the evaluator and ``eval_drafter.py``. ``cap``: the largest block
    when the drafter can draft beyond its own (a chain drafter unrolls more steps: ``DrafterFamily.block_cap``).
    """
    if block_size is None:
        return drafter_block_size
    if cap is not None and cap != drafter_block_size:
        return int_between(name, block_size, 2, cap, note=f"a block is the anchor and at least one draft; this "
                                                          f"drafter unrolls at most {cap - 1} steps")
    return int_between(name, block_size, 2, drafter_block_size,
                       note=f"a block is the anchor and at least one draft, and at most the drafter's trained "
                            f"block ({drafter_block_size}); omit it for the drafter's")


def block_lengths(loop_end: torch.Tensor, anchors: torch.Tensor, block_size: int, tail_blocks: str) -> torch.Tensor:
    """[A] drafted block length (anchor included) of a cycle at each anchor under ``tail_blocks``."""
    if tail_blocks == "served":
        return torch.full_like(anchors, block_size)
    return torch.clamp(loop_end - anchors, max=block_size)


def leading_matches(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[A, D] draft and target tokens (padding -1 / -2 never match) -> [A] accepted draft tokens."""
    return (draft == target).long().cumprod(dim=1).sum(dim=1)


def next_stop_positions(tokens: torch.Tensor, stop_token_ids: Sequence[int],
                        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[T]: the first stop-token position >= i for each i (T when there is none). With ``lengths`` [S],
    ``tokens`` holds S samples end to end, and each position gets the first stop at or after it within its own
    sample, counted from the sample's start (the sample's length when there is none)."""
    n = tokens.shape[0]
    dev = tokens.device
    lengths = torch.tensor([n], device=dev) if lengths is None else lengths.to(dev)
    own_length = torch.repeat_interleave(lengths, lengths, output_size=n)  # each position's sample's length
    if not stop_token_ids:
        return own_length
    start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=n)
    stops = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=dev))
    # Positions as flat indices, a sample's end where no stop is: a reverse cumulative min then never crosses
    # into the sample before (every later sample's values are at least this one's end).
    cand = torch.where(stops, torch.arange(n, device=dev), start + own_length)
    return torch.flip(torch.cummin(torch.flip(cand, [0]), 0).values, [0]) - start


def cut_produced(accepted: torch.Tensor, anchors: torch.Tensor, loop_end: torch.Tensor | int,
                 first_stop: torch.Tensor | None) -> torch.Tensor:
    """``produced`` of a cycle at each anchor: min(a + 1, end - p - 1), ending at the first stop token.

    ``first_stop`` [A]: the first stop position after each anchor (None: no stop tokens).
    """
    produced = torch.minimum(accepted + 1, loop_end - anchors - 1)
    return produced if first_stop is None else torch.minimum(produced, first_stop - anchors)
