"""What a family's drafter costs an evaluation beyond the shared backbone: the hooks the cost model
(``costs.evaluation``) asks, none of which it branches on by family. A family with terms of its own returns an
instance of a subclass from ``DrafterFamily.cost_fields`` (key ``own``); the base adds nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CostTerms:
    """A family's own terms (none here). ``shape`` is the ``costs.evaluation.DrafterShape`` asking."""

    def weight_params(self, shape: Any) -> int:
        """Matmul weights the family adds to the backbone's."""
        return 0

    def block_work(self, shape: Any, lattice: bool) -> tuple[float, float] | None:
        """(FLOPs of a block's token-wise pass, FLOPs per position read beyond the output head) when the family's
        block costs other than the backbone's (None: the backbone's, its last layer deferred to the positions
        read); ``lattice``: with DDTree budgets, what a tree adds per position read."""
        return None

    def topk_values(self, shape: Any, read: float) -> float | None:
        """The top-K values the family's proposer takes at ``read`` positions (None: the head's, for the trees)."""
        return None

    def memory_parts(self, shape: Any, max_blocks: int, weight_itemsize: int) -> dict[str, int]:
        """Bytes the family holds beyond the backbone's parts, by part."""
        return {}


NO_COST_TERMS = CostTerms()
