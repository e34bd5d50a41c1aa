"""What one evaluation may hold at once, and the groups its seconds are timed in: settings the replay and the
drafters' runners read, and the cost model predicts (``costs.evaluation``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...common.arguments import int_at_least

# What an evaluation's seconds are made of, in three groups that are timed apart (``engine.PHASE_GROUPS``)
# and calibrated apart: the drafter (context K/V, the blocks, the head), the DDTree heaps, and the rest
# (reading the cache, the walks and their tables, the statistics).
COST_GROUPS = ("drafter", "ddtree", "other")


@dataclass(frozen=True)
class MemoryLimits:
    """What one evaluation may hold at once besides the weights (``engine.evaluate``; ``memory_bound``).

    ``context_bytes``: context K/V of the samples evaluated together (one *wave*); ``max_blocks``: blocks
    per drafter pass (the token-wise activations); ``attn_bytes``: the temporaries of one attention call
    and of one batch of context features being projected; ``head_bytes``: every vocabulary-sized tensor
    (the head's logits).
    """

    attn_bytes: int = 512 << 20
    head_bytes: int = 512 << 20
    context_bytes: int = 4 << 30
    max_blocks: int = 1024

    def __post_init__(self) -> None:
        for name in ("attn_bytes", "head_bytes", "context_bytes", "max_blocks"):
            int_at_least(f"MemoryLimits.{name}", getattr(self, name), 1)


DEFAULT_LIMITS = MemoryLimits()
