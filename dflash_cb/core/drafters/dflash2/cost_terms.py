"""What a DFlash 2 drafter costs beyond the backbone (docs/method.md, "DFlash 2"): its convolutions, its last
layer at every position, the selector and, with DDTree budgets, the selector's lattice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost_terms import CostTerms


@dataclass(frozen=True)
class SelectorCostTerms(CostTerms):
    conv_taps: int  # taps of each grouped causal convolution (two per layer)
    conv_groups: int  # channel groups of each: hidden / conv_group_size
    selector_rank: int
    selector_top_k: int
    lattice_blocks: int  # blocks whose selector lattice is built at once (its temporaries' bound)

    def conv_params(self, shape: Any) -> int:
        """The convolutions, two per layer: ``base_kernel`` [2, taps, hidden] and ``kernel_projection``
        [2 x taps x groups, hidden] each."""
        return shape.layers * 2 * (2 * self.conv_taps * shape.hidden + 2 * self.conv_taps * self.conv_groups * shape.hidden)

    def codebook_params(self, shape: Any) -> int:
        """The selector's predecessor and successor codebooks, [vocab, rank] each."""
        return 2 * shape.vocab * self.selector_rank

    def weight_params(self, shape: Any) -> int:
        # The convolutions and the selector's hidden projection (its codebooks are tables: ``memory_parts``).
        return self.conv_params(shape) + shape.hidden * self.selector_rank

    def block_work(self, shape: Any, lattice: bool) -> tuple[float, float]:
        """Its last layer runs at every position (its convolutions mix neighbouring positions, so nothing of it
        is deferred), each layer's two convolutions at every position (their kernel projections and the two stages
        of taps), and at every position read the selector (the hidden projection and the K candidates' pair
        scores given one predecessor); with ``lattice`` the pair scores of every candidate given each of the K
        candidates one depth up (``selector.transition_logprobs``)."""
        h, r, k, taps = shape.hidden, self.selector_rank, self.selector_top_k, self.conv_taps
        # Per position and layer, two convolutions: a kernel projection (h -> 2 x taps x groups) and two stages of
        # taps multiply-adds with the per-group offset added to the base kernel.
        conv = shape.layers * 2 * (2 * h * 2 * taps * self.conv_groups + 2 * 3 * taps * h)
        b = shape.block_size
        tokenwise = 2 * b * shape.layers * shape.layer_params + b * conv
        pick = 2 * h * r + r + 2 * k * r  # H(h), A[previous] * H(h), its product with the K successor codes
        tree = (k * r + 2 * k * k * r) if lattice else 0
        return tokenwise, pick + tree

    def topk_values(self, shape: Any, read: float) -> float:
        return read * self.selector_top_k  # its K candidates at every position read, with or without trees

    def memory_parts(self, shape: Any, max_blocks: int, weight_itemsize: int) -> dict[str, int]:
        """``codebooks``: the selector's two [vocab, rank] codebooks in the weights' dtype; ``selector``: the
        temporaries of its lattice (DDTree budgets; ``selector.transition_logprobs``), built ``lattice_blocks``
        blocks at a time: four float32 [blocks, depths, K, rank] tensors (the candidates' successor codes, a
        transposed copy the matmul makes, their predecessor codes, and those times ``H(h)``) and three 8-byte
        [blocks, depths, K, K] ones (the edge scores, in float32 and float64, and their log-softmax), plus the
        lattice's log-probabilities of the pass (float64 [max_blocks, depths, K, K]) that the tree reads. The
        selector's pick makes its candidates' codes a few hundred rows at a time (``dflash2.model.PICK_ROWS``):
        megabytes, not counted."""
        k, d = self.selector_top_k, shape.block_size - 1
        chunk = min(max_blocks, self.lattice_blocks) * d * k
        return {"codebooks": self.codebook_params(shape) * weight_itemsize,
                "selector": chunk * (4 * self.selector_rank * 4 + 3 * k * 8) + max_blocks * d * k * k * 8}
