"""What an evaluation costs, predicted from the drafter's shape: work (anchors, GFLOP) and memory.

Pure arithmetic, no torch state, no I/O: the callback prints the predicted cost at setup, the
benchmarks compare measured peaks against ``memory_bound``, and the README's worked example uses
the same functions (docs/method.md describes what an evaluation drafts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..drafters.cost_terms import NO_COST_TERMS, CostTerms
from ..drafters.registry import family_of
from ..loop.limits import COST_GROUPS, DEFAULT_LIMITS, MemoryLimits


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
    # Chain drafters (docs/method.md, "Chain drafters"): per context position, the state carried to the next step
    # and the head's input besides the K/V (``carry_width`` values); ``token_input``: the token embedding's width
    # that the input projection reads besides the features.
    carry_width: int = 0
    token_input: int = 0
    # A family's own head over the logits (``DrafterFamily.cost_fields``; docs/method.md, "Drafter families"): its
    # matmul weights, applied at every position read, and its lookup tables.
    head_params: int = 0
    head_tables: int = 0
    # Whatever else the family's drafter costs (``drafters.cost_terms.CostTerms``), asked through its hooks: the
    # formulas below never ask which family it is.
    own: CostTerms = NO_COST_TERMS

    @classmethod
    def of(cls, config: Any, block_size: int, features: int) -> DrafterShape:
        """From a Qwen3-style drafter config (``num_hidden_layers``, ``hidden_size`` ...; its family adds its own
        fields and its own terms, ``DrafterFamily.cost_fields``)."""
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        extra = family_of(config).cost_fields(config)  # what the drafter's family adds
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.intermediate_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), head_dim, int(block_size),
                   int(config.vocab_size), int(features), **extra)

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the gated MLP."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def weight_params(self) -> int:
        """Matmul weights of the drafter: its layers, the context projection (fc) and what its family adds
        (``CostTerms.weight_params``)."""
        return self.layers * self.layer_params + (self.features + self.token_input) * self.hidden + \
            self.own.weight_params(self)

    def kv_bytes_per_position(self, itemsize: int) -> int:
        """Context state one position holds: every layer's keys and values (and a chain's carried state)."""
        return (self.layers * 2 * self.kv_heads * self.head_dim + self.carry_width) * itemsize


def block_gflop(shape: DrafterShape, context: int, positions: float, lattice: bool = False) -> float:
    """GFLOP of one drafted block at an anchor ``context`` tokens in, of which ``positions`` depths are
    read: every layer's token-wise matmuls over the block (the last layer's output projection and MLP
    only at the positions read: they are token-wise, docs/method.md), attention over context + block,
    and the output head at the positions read.

    A family whose block costs otherwise says so (``CostTerms.block_work``: its token-wise pass and its work per
    position read; ``lattice``: with DDTree budgets).
    """
    head = 2 * positions * (shape.hidden * shape.vocab + shape.head_params)
    own = shape.own.block_work(shape, lattice)
    if own is not None:
        tokenwise, per_position = own
        return (tokenwise + head + positions * per_position) / 1e9 + attention_gflop(shape, context)
    b = shape.block_size
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = shape.hidden * (q + 2 * kv)
    tail = shape.layer_params - qkv  # o_proj and the MLP
    tokenwise = 2 * b * (shape.layers - 1) * shape.layer_params + 2 * b * qkv + 2 * positions * tail
    return (tokenwise + head) / 1e9 + attention_gflop(shape, context)


def attention_gflop(shape: DrafterShape, context: int) -> float:
    """GFLOP of one block's attention (scores and weighted values) over ``context`` + block positions."""
    b = shape.block_size
    return 4 * b * shape.heads * shape.head_dim * (context + b) * shape.layers / 1e9


def context_gflop(shape: DrafterShape, tokens: int) -> float:
    """GFLOP of a sample's context K/V (the fc projection, then each layer's k and v), once per evaluation."""
    kv = shape.kv_heads * shape.head_dim
    return 2 * tokens * (shape.features * shape.hidden + shape.layers * 2 * shape.hidden * kv) / 1e9



# Seconds per unit of work on one CPU core (fitted on the toy and demo caches: benchmarks/vs_specforge.py,
# docs/performance.md): what a prediction means before any evaluation has been measured. Calibration
# (``Calibration.of``) replaces each group's scale by the measured one, so only the ratios within a group matter.
REFERENCE_SECONDS = {
    "drafter": {"gflop": 0.035, "passes": 1.8e-3, "topk_values": 6e-8},
    "ddtree": {"tree_slots": 4.9e-10, "tree_pops": 1.3e-7, "tree_steps": 1.6e-5},
    "other": {"waves": 5.2e-3, "samples": 1.75e-4, "passes": 7.4e-4, "anchors": 4e-6},
}


@dataclass(frozen=True)
class EvalCost:
    anchors: int  # drafted blocks expected
    gflop: float
    attention_gflop: float = 0.0  # the part of ``gflop`` spent in attention
    samples: int = 0
    waves: int = 0  # groups of samples evaluated together (``MemoryLimits.context_bytes``)
    passes: float = 0.0  # drafter passes: a wave's rounds (at most ``max_blocks`` blocks a pass), summed
    topk_values: float = 0.0  # the head's top-K: tree positions x min(largest budget, vocab), or the family's own
    tree_pops: float = 0.0  # DDTree heap pops: anchors with a tree (``tree_share``) x the largest budget
    tree_slots: float = 0.0  # candidate slots those pops scan: those anchors x the largest budget squared
    tree_steps: float = 0.0  # pops made for every anchor of a pass at once: passes x the largest budget

    def seconds(self, tflops: float) -> float:
        """Wall time at an achieved ``tflops`` (e.g. 40% of a GPU's bf16 peak), the drafter's arithmetic only."""
        return self.gflop / (tflops * 1e3)

    def reference(self, group: str) -> float:
        """Seconds of ``group`` (``COST_GROUPS``) at ``REFERENCE_SECONDS``."""
        return sum(rate * getattr(self, unit) for unit, rate in REFERENCE_SECONDS[group].items())


@dataclass(frozen=True)
class Calibration:
    """Measured seconds per reference second, per cost group: what turns a predicted ``EvalCost`` into seconds
    on this machine (``predicted_seconds``)."""

    rates: dict[str, float]

    @classmethod
    def of(cls, cost: EvalCost, seconds: dict[str, float]) -> Calibration:
        """From one measured evaluation: its predicted ``cost`` (at its measured tau) and its seconds per group.

        A group that had next to no work in it (DDTree off, a tiny share) says little about its own rate: it
        takes the evaluation's overall rate instead."""
        total_ref = sum(cost.reference(g) for g in COST_GROUPS)
        total = sum(seconds.get(g, 0.0) for g in COST_GROUPS)
        overall = total / total_ref if total_ref > 0 else 1.0
        rates = {}
        for g in COST_GROUPS:
            ref = cost.reference(g)
            rates[g] = seconds.get(g, 0.0) / ref if ref > 0.05 * total_ref else overall
        return cls(rates)


def predicted_seconds(cost: EvalCost, calibration: Calibration | None = None) -> float:
    """The seconds ``cost`` takes: at ``REFERENCE_SECONDS`` (one CPU core), or as ``calibration`` measured."""
    return sum(cost.reference(g) * (calibration.rates[g] if calibration is not None else 1.0) for g in COST_GROUPS)


# How often a DDTree walk's anchors are ones the greedy walk or the statistics set did not draft anyway: the
# walks start together and succeed on the same easy tokens (fitted on the toy and demo caches).
TREE_WALK_OVERLAP = 0.7


def missed_share(tau: float, tree_taus: Sequence[float], anchor_stride: int) -> float:
    """The share of a sample's anchors that neither the statistics set nor any walk drafts: a walk of
    acceptance length tau visits one anchor in tau, the statistics set one in ``anchor_stride``."""
    share = (1 - 1 / anchor_stride) * (1 - 1 / max(1.0, tau))
    for t in tree_taus:
        share *= 1 - TREE_WALK_OVERLAP / max(1.0, t)
    return share


def tree_share(taus: Sequence[float], anchor_stride: int, draft_all: bool) -> float:
    """The share of a sample's anchors that get a DDTree (``_Scorer.score``: the statistics anchors and the
    blocks a tree walk may still visit): every drafted anchor when they are all drafted in one round; otherwise
    the statistics set and the tree walks' own anchors (the greedy walk, slower, drafts behind them)."""
    if anchor_stride == 1 or draft_all:
        return 1.0
    share = 1 - 1 / anchor_stride
    for t in taus:
        share *= 1 - 1 / max(1.0, t)
    return 1 - share


def drafting_passes(completions: Sequence[int], taus: Sequence[float], anchor_stride: int, draft_all: bool,
                    drafted: float, max_blocks: int) -> float:
    """Drafter passes of one wave: its rounds, each cut into passes of at most ``max_blocks`` blocks.

    At stride 1 (or with ``draft_all``: ``engine.evaluate(draft_all=True)``) every anchor is drafted in the
    first round. Otherwise each round moves every live walk by at least one cycle, and by more where its next
    anchor was drafted already (a statistics anchor, one in ``anchor_stride``): about ``longest / tau x
    (1 - 1 / stride)`` rounds for the walk with the smallest tau (``taus``: every walk's).
    """
    longest = max(completions, default=0)
    if longest <= 0:
        return 0.0
    if anchor_stride == 1 or draft_all:
        rounds = 1.0
    else:
        rounds = 1 + longest / max(1.0, min(taus)) * (1 - 1 / anchor_stride)
    return rounds + max(0.0, drafted / max_blocks - 1)




def evaluation_cost(shape: DrafterShape, samples: Sequence[tuple[int, int]], tau: float, budgets: Sequence[int],
                    anchor_stride: int, *, tree_taus: Mapping[int, float] | None = None, draft_all: bool = False,
                    limits: MemoryLimits = DEFAULT_LIMITS, state_itemsize: int = 4,
                    counted: tuple[int, int] | None = None) -> EvalCost:
    """Predicted work of one evaluation of ``samples`` ((prompt tokens, scored completion tokens) each).

    A walk of ``C`` completion tokens at acceptance length ``tau`` visits about ``C / tau`` anchors (a DDTree
    walk: at its budget's tau, ``tree_taus``, else ``tau``); the walks and the anchor-statistics set (``C /
    anchor_stride`` anchors) share anchors (``missed_share``), and an untrained drafter, tau 1, drafts every
    anchor. A statistics anchor reads every depth; a greedy walk anchor reads about
    ``tau`` depths, and with DDTree budgets an anchor with a tree (``tree_share``) reads every depth (its top-K).
    Each of those also runs the heap to the largest budget ``B`` (docs/method.md, "DDTree"): ``B`` pops, which
    scan ``B**2`` candidate slots in all, the pops of a pass made together (``tree_steps``: one per pass and
    pop). Samples are evaluated in waves whose context K/V fits
    ``limits.context_bytes`` (at ``state_itemsize`` bytes a value); each wave makes its own passes
    (``drafting_passes``; ``draft_all``: every anchor in the first round). ``counted``: (anchors drafted,
    passes) as an evaluation counted them (``EvalReport``), in place of the predicted ones: the work of an
    evaluation that ran, to calibrate by.
    """
    tau = max(1.0, float(tau))
    taus = [float((tree_taus or {}).get(b, tau)) for b in budgets]
    scale = 1.0
    if counted is not None:  # the drafted anchors as counted, spread over the samples as predicted
        predicted = evaluation_cost(shape, samples, tau, budgets, anchor_stride, tree_taus=tree_taus, draft_all=draft_all,
                                    limits=limits, state_itemsize=state_itemsize)
        scale = counted[0] / predicted.anchors if predicted.anchors else 1.0
    d = shape.block_size - 1
    top = max(budgets, default=0)
    anchors, gflop, attention, passes, waves, read, trees = 0, 0.0, 0.0, 0.0, 1, 0.0, 0.0
    with_tree = tree_share(taus, anchor_stride, draft_all) if budgets else 0.0
    # A family whose tree is over its own candidates (a lattice) pays for it at every depth of an anchor with a tree.
    lattice = bool(budgets) and shape.own.block_work(shape, True) != shape.own.block_work(shape, False)
    wave: list[int] = []
    wave_bytes, wave_drafted = 0, 0.0
    for prompt, scored in samples:
        completion = scored - 1  # anchors: the last scored position starts no cycle
        need = (prompt + max(scored, 0)) * shape.kv_bytes_per_position(state_itemsize)
        if wave and wave_bytes + need > limits.context_bytes:
            passes += drafting_passes(wave, [tau, *taus], anchor_stride, draft_all, wave_drafted, limits.max_blocks)
            wave, wave_bytes, wave_drafted, waves = [], 0, 0.0, waves + 1
        wave_bytes += need
        gflop += context_gflop(shape, prompt + max(scored, 0))
        if completion <= 0:
            continue
        stats = math.ceil(completion / anchor_stride)
        drafted = float(completion) if draft_all else max(float(stats),
                                                      completion * (1 - missed_share(tau, taus, anchor_stride)))
        drafted = min(float(completion), drafted * scale)
        full = min(drafted, max(float(stats), completion * with_tree)) if budgets else float(stats)
        positions = full * d + max(0.0, drafted - full) * min(d, tau)
        trees += full if budgets else 0.0
        mid = prompt + completion // 2  # the average anchor's context
        gflop += drafted * block_gflop(shape, mid, positions / drafted)
        if lattice:
            gflop += full * (block_gflop(shape, mid, d, lattice=True) - block_gflop(shape, mid, d))
        read += positions
        attention += drafted * attention_gflop(shape, mid)
        anchors += math.ceil(drafted)
        wave.append(completion)
        wave_drafted += drafted
    passes += drafting_passes(wave, [tau, *taus], anchor_stride, draft_all, wave_drafted, limits.max_blocks)
    if counted is not None:
        anchors, passes = counted
        if with_tree == 1.0:
            trees = float(anchors)
    trees = round(trees)
    # The head's top-K: for the trees at every depth of every anchor with one, unless the family's proposer takes
    # its own (``CostTerms.topk_values``).
    topk = shape.own.topk_values(shape, read)
    if topk is None:
        topk = trees * d * min(top, shape.vocab)
    return EvalCost(anchors, gflop, attention, len(samples), waves, passes, topk, trees * top, trees * top * top,
                    passes * top)


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
      ``limits.attn_bytes``;
    - ``family head``: the weights of a family's own head over the logits (``shape.head_params`` and
      ``head_tables``), when it has one; its output at a chunk's rows is one of the [rows, vocab] buffers
      ``limits.head_bytes`` bounds (``proposers.head_rows``);
    - what the family holds besides (``CostTerms.memory_parts``: a DFlash 2 drafter's codebooks and lattice,
      ``dflash2.cost_terms.SelectorCostTerms.memory_parts``).
    """
    b = limits.max_blocks * shape.block_size
    parts = {
        "weights": shape.weight_params * weight_itemsize,
        "head": (1 if tied else 2) * shape.vocab * shape.hidden * head_itemsize,
        "context": context_tokens * shape.kv_bytes_per_position(state_itemsize),
        "activations": b * (3 * shape.intermediate + 4 * shape.hidden) * state_itemsize,
        "head_logits": limits.head_bytes,
        "attention": limits.attn_bytes,
    }
    if shape.head_params or shape.head_tables:
        parts["family head"] = (shape.head_params + shape.head_tables) * weight_itemsize
    parts.update(shape.own.memory_parts(shape, limits.max_blocks, weight_itemsize))
    return parts




# ``drafting_passes`` tends to count more rounds than there are (walks meet drafted anchors more often than
# independent walks would), so drafting at once is chosen only when it saves a quarter of the rounds' cost.
ROUNDS_MARGIN = 0.8


def draft_all_is_cheaper(shape: DrafterShape, samples: Sequence[tuple[int, int]], tau: float, budgets: Sequence[int],
                         anchor_stride: int, tree_taus: Mapping[int, float] | None = None, **kwargs: Any) -> bool:
    """Whether drafting every anchor in one round (``engine.evaluate(draft_all=True)``) costs less than
    drafting only where the walks and the statistics set look, round after round, at ``REFERENCE_SECONDS``.

    Each round costs a pass whatever it drafts, so the rounds win only when they spare more blocks than their
    passes cost: with a useful drafter on enough samples. A weak drafter (the walks visit nearly every anchor)
    and a small evaluation (few blocks per pass) draft every anchor at once. From the samples and the taus
    alone (no measured time), so every rank of a distributed evaluation decides alike.
    """
    if anchor_stride == 1:
        return False
    rounds = evaluation_cost(shape, samples, tau, budgets, anchor_stride, tree_taus=tree_taus, **kwargs)
    at_once = evaluation_cost(shape, samples, tau, budgets, anchor_stride, tree_taus=tree_taus, draft_all=True,
                              **kwargs)
    return predicted_seconds(at_once) <= ROUNDS_MARGIN * predicted_seconds(rounds)


class SecondsPredictor:
    """The seconds of a run's next evaluation, predicted from the ones measured before it.

    A profile measured before (a name: "light", "full") is predicted by its own last measurement: the rate of
    its measured seconds to the work the model predicts for it (``Calibration``), so the model's errors for
    that profile cancel and the prediction follows the change of tau. A profile not measured yet takes the
    rates of the last measured one, taken against the work that evaluation counted (its anchors and passes),
    and the model's work for itself. Pure: the caller measures (``engine.group_seconds``) and passes what
    it knows.
    """

    def __init__(self, shape: DrafterShape, samples: Sequence[tuple[int, int]], limits: MemoryLimits = DEFAULT_LIMITS,
                 state_itemsize: int = 4):
        self.shape, self.samples, self.limits, self.state_itemsize = shape, list(samples), limits, state_itemsize
        self.calibrations: dict[str, Calibration] = {}  # per profile: against its predicted work
        self.counted: Calibration | None = None  # the last measured profile's, against its counted work

    def cost(self, budgets: Sequence[int], stride: int, tau: float, tree_taus: Mapping[int, float] | None = None,
             draft_all: bool = False, counted: tuple[int, int] | None = None) -> EvalCost:
        return evaluation_cost(self.shape, self.samples, tau, budgets, stride, tree_taus=tree_taus, draft_all=draft_all,
                               limits=self.limits, state_itemsize=self.state_itemsize, counted=counted)

    def predict(self, profile: str, budgets: Sequence[int], stride: int, tau: float,
                tree_taus: Mapping[int, float] | None = None, draft_all: bool = False) -> float | None:
        """Seconds of the next ``profile`` evaluation at ``tau``; None before any evaluation was measured."""
        calibration = self.calibrations.get(profile, self.counted)
        if calibration is None:
            return None
        return predicted_seconds(self.cost(budgets, stride, tau, tree_taus, draft_all), calibration)

    def measured(self, profile: str, seconds: dict[str, float], budgets: Sequence[int], stride: int, tau: float,
                 tree_taus: Mapping[int, float] | None = None, draft_all: bool = False,
                 counted: tuple[int, int] | None = None) -> None:
        """Calibrate by an evaluation of ``profile``: its ``seconds`` per cost group, the tau it measured, and the
        anchors and passes it ``counted`` (``EvalReport``; None: as predicted)."""
        self.calibrations[profile] = Calibration.of(self.cost(budgets, stride, tau, tree_taus, draft_all), seconds)
        self.counted = Calibration.of(self.cost(budgets, stride, tau, tree_taus, draft_all, counted), seconds)


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
                    profiles: dict[str, tuple[Sequence[int], int]], **kwargs: Any) -> dict[str, EvalCost]:
    """``evaluation_cost`` per named profile (name -> (DDTree budgets, anchor stride)); ``kwargs`` go to it."""
    return {name: evaluation_cost(shape, samples, tau, budgets, stride, **kwargs)
            for name, (budgets, stride) in profiles.items()}


def setup_line(samples: int, files: int, nbytes: int, hash_s: float, setup_s: float, tau: float,
               costs: dict[str, EvalCost]) -> str:
    """The callback's first console line: what setup checked and what the evaluations will cost."""
    parts = [f"setup {setup_s:.2f} s ({samples} samples; sha256 of {files} file(s), {nbytes / 1e9:.2f} GB, "
             f"{hash_s:.2f} s)"]
    if costs:
        parts.append(f"predicted at tau {tau:.2f}: " + "; ".join(format_cost(k, c) for k, c in costs.items()))
    return "  ".join(parts)


def predict(drafter: Any, block_size: int, features: int, samples: Sequence[tuple[int, int]], tau: float,
            profiles: dict[str, tuple[Sequence[int], int]], **kwargs: Any) -> dict[str, EvalCost]:
    """``predicted_costs`` for a drafter with a Qwen3-style ``.config``; empty when its shape is unknown;
    ``kwargs`` go to ``evaluation_cost``."""
    try:
        shape = DrafterShape.of(drafter.config, block_size, features)
    except (AttributeError, TypeError, ValueError):
        return {}
    return predicted_costs(shape, samples, tau, profiles, **kwargs)
