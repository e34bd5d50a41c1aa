"""What an evaluation costs, predicted from the drafter's shape: work (anchors, GFLOP) and memory.

Pure arithmetic, no torch state, no I/O: the callback prints the predicted cost at setup, the
benchmarks compare measured peaks against ``memory_bound``, and the README's worked example uses
the same functions (docs/method.md describes what an evaluation drafts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..common.arguments import int_at_least


@dataclass(frozen=True)
class DrafterShape:
    """The sizes that set an evaluation's cost."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    vocab: int
    features: int  # context width: target layers x target hidden size

    @classmethod
    def of(cls, config: Any, block_size: int, features: int) -> DrafterShape:
        """From a Qwen3-style drafter config (``num_hidden_layers``, ``hidden_size`` ...)."""
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.intermediate_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), head_dim, int(block_size),
                   int(config.vocab_size), int(features))

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the gated MLP."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def weight_params(self) -> int:
        """Matmul weights of the drafter: its layers and the context projection (fc)."""
        return self.layers * self.layer_params + self.features * self.hidden

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Context K/V one position holds: every layer's keys and values."""
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def block_gflop(shape: DrafterShape, context: int, positions: float) -> float:
    """GFLOP of one drafted block at an anchor ``context`` tokens in, of which ``positions`` depths are
    read: every layer's token-wise matmuls over the block (the last layer's output projection and MLP
    only at the positions read: they are token-wise, docs/method.md), attention over context + block,
    and the output head at the positions read."""
    b = shape.block_size
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = shape.hidden * (q + 2 * kv)
    tail = shape.layer_params - qkv  # o_proj and the MLP
    tokenwise = 2 * b * (shape.layers - 1) * shape.layer_params + 2 * b * qkv + 2 * positions * tail
    head = 2 * positions * shape.hidden * shape.vocab
    return (tokenwise + head) / 1e9 + attention_gflop(shape, context)


def attention_gflop(shape: DrafterShape, context: int) -> float:
    """GFLOP of one block's attention (scores and weighted values) over ``context`` + block positions."""
    b = shape.block_size
    return 4 * b * shape.heads * shape.head_dim * (context + b) * shape.layers / 1e9


def context_gflop(shape: DrafterShape, tokens: int) -> float:
    """GFLOP of a sample's context K/V (the fc projection, then each layer's k and v), once per evaluation."""
    kv = shape.kv_heads * shape.head_dim
    return 2 * tokens * (shape.features * shape.hidden + shape.layers * 2 * shape.hidden * kv) / 1e9


@dataclass(frozen=True)
class EvalCost:
    anchors: int  # drafted blocks expected
    gflop: float
    attention_gflop: float = 0.0  # the part of ``gflop`` spent in attention

    def seconds(self, tflops: float) -> float:
        """Wall time at an achieved ``tflops`` (e.g. 40% of a GPU's bf16 peak)."""
        return self.gflop / (tflops * 1e3)


def evaluation_cost(shape: DrafterShape, samples: Sequence[tuple[int, int]], tau: float, budgets: Sequence[int],
                    anchor_stride: int) -> EvalCost:
    """Predicted work of one evaluation of ``samples`` ((prompt tokens, scored completion tokens) each).

    A walk of ``C`` completion tokens at acceptance length ``tau`` visits about ``C / tau`` anchors;
    the greedy walk and each DDTree budget's walk share anchors, so their union is bounded by the
    sum and by ``C`` (an untrained drafter, tau 1, drafts every anchor). The anchor-statistics set
    adds ``C / anchor_stride`` anchors and reads every depth; a greedy walk anchor reads about
    ``tau`` depths, and with DDTree budgets every drafted anchor reads every depth (its top-K tree).
    """
    tau = max(1.0, float(tau))
    d = shape.block_size - 1
    anchors, gflop, attention = 0, 0.0, 0.0
    for prompt, scored in samples:
        completion = scored - 1  # anchors: the last scored position starts no cycle
        if completion <= 0:
            gflop += context_gflop(shape, prompt + max(scored, 0))
            continue
        stats = math.ceil(completion / anchor_stride)
        walk = completion / tau
        drafted = min(completion, stats + walk * (1 + len(budgets)))
        if budgets:
            positions = drafted * d
        else:
            positions = stats * d + max(0.0, drafted - stats) * min(d, tau)
        mid = prompt + completion // 2  # the average anchor's context
        gflop += context_gflop(shape, prompt + scored)
        gflop += drafted * block_gflop(shape, mid, positions / drafted)
        attention += drafted * attention_gflop(shape, mid)
        anchors += math.ceil(drafted)
    return EvalCost(anchors, gflop, attention)


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


def memory_bound(shape: DrafterShape, context_tokens: int, *, weight_itemsize: int, head_itemsize: int,
                 state_itemsize: int, tied: bool = False, limits: MemoryLimits = DEFAULT_LIMITS) -> dict[str, int]:
    """Bytes an evaluation holds at most, by part (the engine's memory model, ``engine.evaluate``):

    - ``weights``: the drafter's matmul weights;
    - ``head``: the target's embedding and output head, [vocab, hidden] each (one when tied), in the
      dtype the head computes in;
    - ``context``: context K/V of the samples evaluated together (``context_tokens`` positions,
      bounded by ``limits.context_bytes``);
    - ``activations``: the token-wise pass of ``limits.max_blocks`` blocks (MLP input, gate and up);
    - ``head_logits`` and ``attention``: the chunked temporaries, ``limits.head_bytes`` and
      ``limits.attn_bytes``.
    """
    b = limits.max_blocks * shape.block_size
    return {
        "weights": shape.weight_params * weight_itemsize,
        "head": (1 if tied else 2) * shape.vocab * shape.hidden * head_itemsize,
        "context": context_tokens * shape.kv_bytes_per_position(state_itemsize),
        "activations": b * (3 * shape.intermediate + 4 * shape.hidden) * state_itemsize,
        "head_logits": limits.head_bytes,
        "attention": limits.attn_bytes,
    }


def format_cost(name: str, cost: EvalCost) -> str:
    gflop = f"{cost.gflop:,.0f}" if cost.gflop >= 100 else f"{cost.gflop:.3g}"
    return f"{name}: ~{cost.anchors:,} anchors, ~{gflop} GFLOP"


def eval_overhead(eval_seconds: float, wall_seconds: float) -> float:
    """The evaluation's share of the wall time since the previous evaluation ended (this one included);
    NaN when no training ran in between (``wall_seconds`` not larger than the evaluation)."""
    if not wall_seconds > eval_seconds > 0:
        return math.nan
    return eval_seconds / wall_seconds


def predicted_costs(shape: DrafterShape, samples: Sequence[tuple[int, int]], tau: float,
                    profiles: dict[str, tuple[Sequence[int], int]]) -> dict[str, EvalCost]:
    """``evaluation_cost`` per named profile (name -> (DDTree budgets, anchor stride))."""
    return {name: evaluation_cost(shape, samples, tau, budgets, stride) for name, (budgets, stride) in profiles.items()}


def setup_line(samples: int, files: int, nbytes: int, hash_s: float, setup_s: float, tau: float,
               costs: dict[str, EvalCost]) -> str:
    """The callback's first console line: what setup checked and what the evaluations will cost."""
    parts = [f"setup {setup_s:.2f} s ({samples} samples; sha256 of {files} file(s), {nbytes / 1e9:.2f} GB, "
             f"{hash_s:.2f} s)"]
    if costs:
        parts.append(f"predicted at tau {tau:.2f}: " + "; ".join(format_cost(k, c) for k, c in costs.items()))
    return "  ".join(parts)


def predict(drafter: Any, block_size: int, features: int, samples: Sequence[tuple[int, int]], tau: float,
            profiles: dict[str, tuple[Sequence[int], int]]) -> dict[str, EvalCost]:
    """``predicted_costs`` for a drafter with a Qwen3-style ``.config``; empty when its shape is unknown."""
    try:
        shape = DrafterShape.of(drafter.config, block_size, features)
    except (AttributeError, TypeError, ValueError):
        return {}
    return predicted_costs(shape, samples, tau, profiles)
