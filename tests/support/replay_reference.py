"""The replay walk one cycle at a time, in plain Python: the reference the engine's batched walks
(``dflash_cb.core.replay.walks.Walks``) and the position bookkeeping are tested against (docs/method.md, "The loop")."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_cb.core.loop.cycles import SampleBounds


class Walk:
    """One replay of the loop, advanced one cycle at a time as ``produced`` values arrive.

    ``anchor`` is the position whose ``produced`` the walk needs next (None once it has ended);
    ``lengths`` collects the cycles' ``produced`` values: the reference loop's ``acceptance_lengths``.
    """

    def __init__(self, bounds: SampleBounds, tokens: Sequence[int], stops: frozenset[int]):
        self.bounds = bounds
        self.tokens = tokens
        self.stops = stops
        self.lengths: list[int] = []
        self.p = bounds.prompt_len
        # The prefill's token off the known path, or already a stop: no cycle runs.
        self.done = self.p >= bounds.known_end or tokens[self.p] in stops or self.p + 1 >= bounds.loop_end

    @property
    def anchor(self) -> int | None:
        return None if self.done else self.p

    def advance(self, produced: int) -> None:
        start = self.p
        self.lengths.append(produced)
        self.p += produced
        stopped = any(self.tokens[j] in self.stops for j in range(start + 1, self.p + 1))
        self.done = stopped or self.p + 1 >= self.bounds.loop_end


def replay_walk(produced: Sequence[int], tokens: Sequence[int], bounds: SampleBounds,
                stop_token_ids: Sequence[int]) -> list[int]:
    """Cycle-by-cycle ``acceptance_lengths`` of the reference loop from per-anchor ``produced``.

    ``produced[i]`` belongs to anchor ``bounds.prompt_len + i``.
    """
    walk = Walk(bounds, tokens, frozenset(stop_token_ids))
    while not walk.done:
        walk.advance(produced[walk.p - bounds.prompt_len])
    return walk.lengths
