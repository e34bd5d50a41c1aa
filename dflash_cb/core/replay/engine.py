"""The evaluation engine: drafts only where the replays and the anchor statistics look, batched
across samples (the method, and why the replay is exact: docs/method.md).

What a drafter's hidden states draft is its family's ``proposers.Proposer`` (``drafters.PROPOSERS``): DFlash's
head argmax, DFlash 2's selector given the target's own predecessor (docs/method.md, "DFlash 2"); the engine
reads hidden rows, hands them to it, and walks what it answers. A family may add walks of its own (DFlash 2:
the unary-argmax path and a perfect selector) and per-depth statistics (``metrics.FAMILY_COUNTS``).

The replays (the greedy walk, one walk per DDTree budget and the family's own walks, for every sample)
advance in rounds.
Each round collects the anchors that the live walks need next, plus, in the first round, the
fixed anchor-statistics set (per sample every ``anchor_stride``-th anchor from a drawn offset,
``anchor_sets``; the union over the extra strides); each distinct (sample, anchor) is drafted once
and its per-walk ``produced`` values are kept, so a walk that lands on an anchor drafted earlier
(by another walk or for the statistics) reuses it. The statistics are kept per anchor and summed
per sample and stride when the sample is done, so the counts are per-sample integers summed in
sample order. ``specforge/acc`` drafts its anchors again only where SpecForge's drafts differ from
the served ones (its masks, or a shortened tail block).
When the drafts so far say a walk almost always advances by one token (tau ~ 1), the round also
drafts the next few anchors that walk will need with high probability (``_grow``), so a
weak drafter does not cost one round per cycle.

The samples evaluated together (a *wave*, ``_Wave``) are flat tables: their tokens end to end, one
slot per anchor, every walk as a row of tensors (``_Walks``), so a round costs a few tensor operations
whatever the number of samples. The context K/V of a wave is projected in a few batched matmuls.
Within a round the token-wise work (projections, MLP, norms, the output head and its argmax /
top-K reduction) runs on the blocks of all samples together, and attention on parts of several
samples per kernel call, each block over its own sample's context prefix. The head is applied in row
chunks and reduced on the fly, so ``[blocks x depth x vocab]`` logits never exist. The last drafter
layer stops after its attention (``model.DeferredBlocks``): its ``o_proj``, MLP and the final norm
are token-wise, so they run, with the head, only on the block positions that are read.
No Lightning, W&B or HTTP here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...cache.manifest import Manifest, SampleEntry
from ...cache.states import CachedSample, StateCache, TargetHead
from ...cache.target import DTYPES
from ...common.errors import DFlashCBError
from ...common.timing import NO_TIMER, PhaseTimer
from ..drafters.layouts import proposer_for
from ..drafters.proposers import Proposer, RowDrafts, apply_head, predecessors
from ..drafters.registry import family_named
from ..drafters.runners import BlockRows, DraftRunner, as_runner
from ..drafters.spec import DEFAULT_FAMILY, DrafterSpec
from ..figures.metrics import TAU, AnchorCounts, EvalCounts, anchor_counts_per_sample, summarize
from ..loop.anchor_sets import DEFAULT_ANCHOR_SEED, offsets_for, strided
from ..loop.cycles import (
    SampleBounds,
    TailBlocks,
    block_lengths,
    check_block_size,
    cut_produced,
    leading_matches,
    next_stop_positions,
    sample_bounds,
)
from ..loop.finite import check_finite_weights
from ..loop.limits import COST_GROUPS
from .request import EvalRequest, SpecForgePass

# Rows per greedy head call: below about this many, a call costs what reading the head matrix costs.
_HEAD_ROWS = 16

# The phases an evaluation's timer reports (``evaluate(timer=...)``), exclusive of each other: reading
# the cache; the context K/V; the drafter's blocks up to the last layer's attention; the rest of that layer
# and the output head at the positions read; the DDTree heaps; the walks and their tables; the statistics.
LOAD, CONTEXT, FORWARD, HEAD, DDTREE, WALK, STATISTICS = (
    "load", "context K/V", "drafter forward", "head", "DDTree", "replay walk", "statistics")
PHASES = (LOAD, CONTEXT, FORWARD, HEAD, DDTREE, WALK, STATISTICS)
# The cost group of each phase (``cost.COST_GROUPS``): what ``cost.Calibration`` measures apart.
PHASE_GROUPS = {LOAD: "other", CONTEXT: "drafter", FORWARD: "drafter", HEAD: "drafter", DDTREE: "ddtree",
                WALK: "other", STATISTICS: "other"}


def group_seconds(phases: Mapping[str, float], total: float) -> dict[str, float]:
    """An evaluation's seconds per cost group from its phase timer's seconds; what no phase timed (checks,
    setup) counts as "other", so the groups sum to ``total``."""
    out = dict.fromkeys(COST_GROUPS, 0.0)
    for name, seconds in phases.items():
        out[PHASE_GROUPS.get(name, "other")] += seconds
    out["other"] += max(0.0, total - sum(phases.values()))
    return out


# ---------------------------------------------------------------------------
# Demand-driven evaluation
# ---------------------------------------------------------------------------

@dataclass
class SampleResult:
    id: str
    category: str
    acceptance_lengths: list[int]
    ddtree: dict[int, list[int]] = field(default_factory=dict)
    anchors: int = 0  # anchors in this sample's statistics set (at the evaluation's anchor_stride)
    # Per statistics stride (the evaluation's anchor_stride and each extra one): this sample's offset
    # (anchor_sets.anchor_offset) and its anchor-statistic counts over anchors[offset::stride].
    anchor_offsets: dict[int, int] = field(default_factory=dict)
    anchor_counts: dict[int, AnchorCounts] = field(default_factory=dict)
    # The block the drafter proposed at each of the first cycles, when asked (keep_drafts): DFlash's argmax per
    # depth, DFlash 2's selector walk (``proposers.Proposer.block``).
    drafts: list[list[int]] | None = None
    anchors_drafted: int = 0  # distinct anchors the drafter ran at
    anchors_needed: int = 0  # distinct anchors the walks visited or the statistics set holds
    # Per greedy cycle: drafts equal to the target's tokens before the stop / max_new_tokens cut (only
    # tokens the cache knows can match), SGLang's "correct drafts" (served.py).
    correct_drafts: list[int] = field(default_factory=list)
    # The drafter family's own walks (``metrics.FAMILY_COUNTS``; DFlash 2: the unary path, a perfect selector):
    # their cycles' produced, by the walk's tau key.
    walks: dict[str, list[int]] = field(default_factory=dict)


def stats_anchors(bounds: SampleBounds, stride: int, offset: int = 0) -> range:
    """One sample's anchor-statistics set: every ``stride``-th anchor from its ``offset``-th
    (``anchor_sets``: the offset is drawn per sample, so the first anchor is not always in)."""
    return strided(bounds.anchors, stride, offset)


def expected_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts at temperature 1, ``sum_k prod_{j<=k} alpha_j``, of per-depth acceptance
    probabilities ``alpha`` [r, D]: in float64, depth after depth, so that a row's value is the same whatever
    rows it is computed with (a reduction kernel may group a row's terms by the batch's shape or threads)."""
    alpha = alpha.double()
    total = torch.zeros(alpha.shape[0], dtype=torch.float64, device=alpha.device)
    chain = torch.ones_like(total)
    for k in range(alpha.shape[1]):
        chain = chain * alpha[:, k]
        total = total + chain
    return total


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop."""
    total = int(lengths.sum())
    firsts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - firsts, lengths, output_size=total) + torch.arange(total)


@dataclass(frozen=True)
class _Plan:
    """What every wave of one evaluation shares."""

    strides: tuple[int, ...]  # the statistics strides: ``anchor_stride`` first, then the extra ones
    offsets: dict[int, dict[str, int]]  # per stride: each sample's offset (``anchor_sets``)
    budgets: tuple[int, ...]  # the DDTree budgets: one walk each
    family_walks: tuple[str, ...]  # the drafter family's own walks (``Proposer.walks``)
    depth_counts: tuple[str, ...]  # the drafter family's per-depth statistics (``Proposer.depth_counts``)
    depths: int  # drafted depths of a full block (block size - 1)
    keep_drafts: bool
    draft_all: bool  # the first round drafts every anchor (``evaluate(draft_all=True)``)
    stop_token_ids: tuple[int, ...]
    device: torch.device
    verify: bool

    @property
    def walks(self) -> int:
        """Walks per sample: the greedy one, one per DDTree budget, then the family's own, in that order."""
        return 1 + len(self.budgets) + len(self.family_walks)


@dataclass
class _TokenTables:
    """A wave's token tables on the compute device, where blocks are scored (``_Wave``)."""

    token_start: torch.Tensor  # [samples] each sample's first position in ``tokens``
    length: torch.Tensor  # [samples] tokens per sample
    tokens: torch.Tensor  # every sample's tokens end to end
    next_stop: torch.Tensor  # per position: the first stop position at or after it, within its sample
    loop_end: torch.Tensor  # [samples] (``SampleBounds``)
    known_end: torch.Tensor  # [samples]
    topk: tuple[torch.Tensor, torch.Tensor] | None  # the target's stored top-K ids and log-probabilities


class _Wave:
    """The samples evaluated together, as flat tables.

    Tokens: every sample's tokens end to end (sample ``s`` from ``token_start[s]``), with each position's
    next stop token and, when stored, the target's top-K (on the compute device, where blocks are scored).
    Anchors: one *slot* per anchor of every sample, end to end (anchor ``p`` of sample ``s`` is slot
    ``slot_start[s] + p - prompt_len[s]``), holding what was drafted there: each walk's ``produced`` (-1
    until drafted), the greedy leading matches, the statistics row; and whether a walk visited it (on the
    CPU, where the walks read them).
    """

    def __init__(self, ids: list[str], entries: list[SampleEntry], bounds: list[SampleBounds],
                 tokens: list[torch.Tensor], topk: list[tuple[torch.Tensor, torch.Tensor] | None], context: Any,
                 plan: _Plan):
        self.ids, self.entries, self.bounds, self.context = ids, entries, bounds, context
        strides, stop_token_ids, device, depths = plan.strides, plan.stop_token_ids, plan.device, plan.depths
        self.offsets = [tuple(plan.offsets[k][i] for k in strides) for i in ids]
        self.has_topk = [t is not None for t in topk]
        self.has_stops = bool(stop_token_ids)
        lens = [t.shape[0] for t in tokens]
        # -- token tables (compute device) -------------------------------------------------------
        self.token_start = torch.tensor([0, *lens[:-1]]).cumsum(0)
        self.next_stop = next_stop_positions(torch.cat(tokens), stop_token_ids, torch.tensor(lens))
        self.loop_end = torch.tensor([b.loop_end for b in bounds])
        self.known_end = torch.tensor([b.known_end for b in bounds])
        self.prompt_len = torch.tensor([b.prompt_len for b in bounds])
        self.scoring = _TokenTables(self.token_start.to(device), torch.tensor(lens, device=device),
                                    torch.cat(tokens).to(device), self.next_stop.to(device), self.loop_end.to(device),
                                    self.known_end.to(device), _topk_table(topk, lens, device))
        # -- slot tables (CPU) ---------------------------------------------------------------------
        n_slots = torch.tensor([len(b.anchors) for b in bounds])
        self.slot_start = torch.cumsum(n_slots, 0) - n_slots
        self.slot_end = self.slot_start + n_slots
        slots = int(n_slots.sum())
        self.slot_sample = torch.repeat_interleave(torch.arange(len(ids)), n_slots, output_size=slots)
        self.slot_index = torch.arange(slots) - self.slot_start[self.slot_sample]  # anchor - prompt_len
        self.slot_anchor = self.slot_index + self.prompt_len[self.slot_sample]
        self.stat_offsets = torch.tensor(self.offsets, dtype=torch.long).view(len(ids), len(strides))
        self.strides = strides
        self.stats = torch.zeros(slots, dtype=torch.bool)  # the union of the statistics sets
        for k, stride in enumerate(strides):
            self.stats |= self.in_set(k, stride)
        self.produced = torch.full((slots, plan.walks), -1, dtype=torch.long)
        self.correct = torch.zeros(slots, dtype=torch.long)  # greedy leading matches before any cut
        # Per statistics slot: its row of ``StatColumns``; t1.
        self.columns = StatColumns(depths, plan.depth_counts)
        self.stat_table = torch.zeros((slots, self.columns.width), dtype=torch.int16)
        self.t1 = torch.zeros(slots, dtype=torch.float64)
        self.drafts = torch.zeros((slots, depths), dtype=torch.long) if plan.keep_drafts else None
        self.draft_depths = torch.zeros(slots, dtype=torch.long) if plan.keep_drafts else None
        self.visited = torch.zeros(slots, dtype=torch.bool)
        self.drafted = torch.zeros(len(ids), dtype=torch.long)  # per sample: distinct anchors drafted
        self.walks = _Walks(self, plan.walks)
        self.family_walks = plan.family_walks
        self.draft_all = plan.draft_all

    @property
    def slots(self) -> int:
        return self.produced.shape[0]

    def in_set(self, k: int, stride: int) -> torch.Tensor:
        """[slots] bool: the anchors of each sample's statistics set at stride ``strides[k]``."""
        rel = self.slot_index - self.stat_offsets[self.slot_sample, k]
        return (rel >= 0) & (rel % stride == 0)

    def requests(self, first: bool) -> torch.Tensor:
        """The slots to draft this round, in (sample, anchor) order: every live walk's anchor and its lookahead
        (``_Walks.window``), and in the first round the statistics sets (every anchor with ``draft_all``); less
        what is drafted already."""
        if first and self.draft_all:
            return torch.arange(self.slots)
        want = self.stats.clone() if first else torch.zeros(self.slots, dtype=torch.bool)
        w = self.walks
        live = ~w.done
        if bool(live.any()):
            s, j = live.nonzero(as_tuple=True)
            first_slot = self.slot_start[s] + w.pos[s, j] - self.prompt_len[s]
            last = torch.minimum(first_slot + w.window[s, j], self.slot_end[s])
            want[_ranges(first_slot, (last - first_slot).clamp(min=1))] = True
        want &= self.produced[:, 0] < 0
        return want.nonzero()[:, 0]

    def tree_reachable(self, slots: torch.Tensor, tree_walks: range) -> torch.Tensor:
        """[len(slots)] bool: a live walk of ``tree_walks`` may still visit the slot (its anchor is not behind the
        walk: walks only move forward). A DDTree is built only there (``_Scorer.score``)."""
        s, anchor = self.slot_sample[slots], self.slot_anchor[slots]
        w = self.walks
        pos, live = w.pos[s][:, tree_walks.start:tree_walks.stop], ~w.done[s][:, tree_walks.start:tree_walks.stop]
        return (live & (anchor[:, None] >= pos)).any(dim=1)

    def record(self, slots: torch.Tensor, scored: _Scored) -> None:
        """Keep what a drafted chunk gave: per walk ``produced``, the greedy matches, the statistics rows."""
        table = scored.produced.cpu()
        self.produced[slots] = table
        self.correct[slots] = scored.accepted.cpu()
        sample = self.slot_sample[slots]
        self.drafted.index_add_(0, sample, torch.ones_like(sample))
        self.walks.one_token.index_add_(0, sample, (table == 1).long())
        self.walks.scored.index_add_(0, sample, (table >= 0).long())
        if self.drafts is not None and self.draft_depths is not None:
            self.drafts[slots] = scored.argmax.cpu()
            self.draft_depths[slots] = scored.depths.cpu()
        if scored.stat_rows is not None:
            at = slots[scored.stat_rows.cpu()]
            self.stat_table[at] = scored.stat_table
            if scored.t1 is not None:
                self.t1[at] = scored.t1

    def results(self, budgets: tuple[int, ...], keep_drafts: int, block_size: int, specforge: bool) -> list[SampleResult]:
        """Every sample's ``SampleResult`` once its walks have ended."""
        w = self.walks
        cycles = w.cycles.tolist()
        lengths = w.lengths.tolist()
        # The anchor of each greedy cycle: the prompt's end plus the cycles before it.
        greedy = w.lengths[:, 0, :]
        at = (self.slot_start[:, None] + torch.cumsum(greedy, 1) - greedy).clamp(max=max(self.slots - 1, 0))
        correct = self.correct[at].tolist() if self.slots else [[] for _ in self.ids]
        needed = torch.zeros(len(self.ids), dtype=torch.long).index_add_(
            0, self.slot_sample, (self.stats | self.visited).long()).tolist()
        drafted = self.drafted.tolist()
        counts = [self.anchor_counts(k, stride, block_size - 1, specforge) for k, stride in enumerate(self.strides)]
        out = []
        for s, sid in enumerate(self.ids):
            g = lengths[s][0][:cycles[s][0]]
            first = 1 + len(budgets)  # the family's walks follow the budgets'
            res = SampleResult(sid, self.entries[s].category, g,
                               {b: lengths[s][1 + i][:cycles[s][1 + i]] for i, b in enumerate(budgets)},
                               len(stats_anchors(self.bounds[s], self.strides[0], self.offsets[s][0])))
            res.walks = {name: lengths[s][first + i][:cycles[s][first + i]] for i, name in enumerate(self.family_walks)}
            res.anchor_offsets = dict(zip(self.strides, self.offsets[s], strict=True))
            res.anchor_counts = {stride: c[s] for stride, c in zip(self.strides, counts, strict=True)}
            res.correct_drafts = correct[s][:len(g)]
            if keep_drafts and self.drafts is not None and self.draft_depths is not None:
                shown = at[s, :min(keep_drafts, len(g))]
                res.drafts = [row[:n] for row, n in zip(self.drafts[shown].tolist(),
                                                        self.draft_depths[shown].tolist(), strict=True)]
            res.anchors_drafted, res.anchors_needed = drafted[s], needed[s]
            out.append(res)
        return out

    def anchor_counts(self, k: int, stride: int, depths: int, specforge: bool) -> list[AnchorCounts]:
        """Each sample's counts over its statistics set at stride ``strides[k]``, from the per-anchor rows
        (``metrics.anchor_counts_per_sample``)."""
        rows = (self.stats & self.in_set(k, stride)).nonzero()[:, 0]  # in (sample, anchor) order
        t, cols = self.stat_table[rows], self.columns
        return anchor_counts_per_sample(self.slot_sample[rows], len(self.ids), cols.get(t, "accepted"),
                                        cols.get(t, "produced"), cols.get(t, "valid"), cols.get(t, "match"),
                                        cols.get(t, "specforge_match"), specforge, self.t1[rows], self.has_topk,
                                        {name: cols.get(t, name) for name in cols.extra})


class StatColumns:
    """The columns of the engine's per-anchor statistics table (int16, one row per statistics anchor), named
    once: the scalars ``accepted`` (leading matches) and ``produced``, then per depth ``valid`` (the depth
    exists and its target token is known), ``match`` and ``specforge_match`` (booleans), then the drafter
    family's own per-depth counts ``extra`` (``Proposer.depth_counts``: booleans or small integers)."""

    SCALARS = ("accepted", "produced")
    PER_DEPTH = ("valid", "match", "specforge_match")

    def __init__(self, depths: int, extra: Sequence[str] = ()):
        self.depths, self.extra = depths, tuple(extra)
        self.per_depth = (*self.PER_DEPTH, *self.extra)
        self._at: dict[str, int | slice] = {name: i for i, name in enumerate(self.SCALARS)}
        for j, name in enumerate(self.per_depth):
            first = len(self.SCALARS) + j * depths
            self._at[name] = slice(first, first + depths)

    @property
    def width(self) -> int:
        return len(self.SCALARS) + len(self.per_depth) * self.depths

    def pack(self, **columns: torch.Tensor) -> torch.Tensor:
        """The [rows, width] int16 table (CPU) of ``columns``, one per name."""
        if set(columns) != set(self._at):
            raise ValueError(f"statistics columns {sorted(columns)}, expected {sorted(self._at)}")
        parts = [columns[n][:, None] for n in self.SCALARS] + [columns[n] for n in self.per_depth]
        return torch.cat([p.long() for p in parts], dim=1).to(device="cpu", dtype=torch.int16)

    def get(self, table: torch.Tensor, name: str) -> torch.Tensor:
        return table[:, self._at[name]].long()


def _topk_table(topk: list[tuple[torch.Tensor, torch.Tensor] | None], lens: list[int],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The wave's stored top-K ids and log-probabilities end to end; samples without them get ids -1 (they
    add nothing to the overlap)."""
    if all(t is None for t in topk):
        return None
    k = max(t[0].shape[1] for t in topk if t is not None)
    ids, lps = [], []
    for t, n in zip(topk, lens, strict=True):
        i = torch.full((n, k), -1, dtype=torch.long) if t is None else t[0].long()
        lp = torch.zeros((n, k)) if t is None else t[1].float()
        ids.append(torch.nn.functional.pad(i, (0, k - i.shape[1]), value=-1))
        lps.append(torch.nn.functional.pad(lp, (0, k - lp.shape[1])))
    return torch.cat(ids).to(device), torch.cat(lps).to(device)


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


class _Walks:
    """Every walk of a wave (per sample the greedy one, then one per DDTree budget) as [samples, walks]
    tensors, advanced together: the steps of ``replay.Walk``, one cycle of every walk per step."""

    def __init__(self, wave: _Wave, n_walks: int):
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


@dataclass
class _Scored:
    """What drafting a chunk of slots gave (``_Scorer.score``), for ``_Wave.record``."""

    produced: torch.Tensor  # [N, walks] the cycle's produced per walk (greedy, each budget, the family's walks)
    accepted: torch.Tensor  # [N] greedy leading matches before any cut
    argmax: torch.Tensor | None  # [N, D] the block proposed (-2 past the drafted depths), kept for keep_drafts
    depths: torch.Tensor | None  # [N] drafted depths (block length - 1), with ``argmax``
    stat_rows: torch.Tensor | None  # indexes of the statistics rows among the N
    stat_table: torch.Tensor | None  # [r, StatColumns.width] int16 (CPU)
    t1: torch.Tensor | None  # [r] float64 (CPU): expected accepted length at temperature 1


@dataclass
class _DepthDrafts:
    """A proposer's ``RowDrafts`` of N blocks as [N, D] tables (-2 / False where a depth was not read)."""

    tokens: torch.Tensor  # [N, D]
    hits: torch.Tensor  # [N, D, W] bool
    counts: torch.Tensor  # [N, D, C] small non-negative integers (booleans mostly)
    specforge: torch.Tensor | None  # [N, D], None: ``tokens``
    overlap: torch.Tensor | None  # [N, D]
    parts: Any = None
    full_rows: torch.Tensor | None = None  # the blocks read at every depth, whose ``parts`` these are (None: all)

    @classmethod
    def of(cls, out: RowDrafts, n: int, d: int) -> _DepthDrafts:
        def view(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.view(n, d, *x.shape[1:])

        return cls(out.tokens.view(n, d), view(out.hits), view(out.counts), view(out.specforge),
                   view(out.overlap), out.parts)

    @classmethod
    def unread(cls, n: int, d: int, walks: int, counts: int, specforge: bool, device: torch.device) -> _DepthDrafts:
        def table(*shape: int, fill: Any) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.bool if isinstance(fill, bool) else torch.long, device=device)

        return cls(table(n, d, fill=-2), table(n, d, walks, fill=False), table(n, d, counts, fill=0),
                   table(n, d, fill=-2) if specforge else None, None)

    def put(self, rows: torch.Tensor, out: RowDrafts) -> None:
        """Every depth of blocks ``rows`` from their ``RowDrafts`` (the overlap is set by the caller)."""
        n, d = rows.numel(), self.tokens.shape[1]
        got = _DepthDrafts.of(out, n, d)
        self.tokens[rows], self.hits[rows], self.counts[rows] = got.tokens, got.hits, got.counts.long()
        if self.specforge is not None and got.specforge is not None:
            self.specforge[rows] = got.specforge


def _flat(state: torch.Tensor | None) -> torch.Tensor | None:
    """A [N, D, S] prefix state as rows [N * D, S] (block-major, as the hidden rows)."""
    return None if state is None else state.reshape(-1, state.shape[-1])


def _leading(hits: torch.Tensor) -> torch.Tensor:
    """[N, D] booleans -> [N]: how many leading depths are True (the accepted length of a chain of them)."""
    return hits.long().cumprod(dim=1).sum(dim=1)


class _Scorer:
    """Drafts chunks of a wave's slots and scores them: per walk the ``produced`` of a cycle there, and for
    anchors of a statistics set their per-anchor statistics. What the drafter's hidden states draft is the
    family's ``proposer`` (``proposers.Proposer``): the engine only reads rows and walks them.

    ``specforge`` (``SpecForgePass``): how SpecForge's accuracy is drafted.
    """

    def __init__(self, runner: DraftRunner, head: TargetHead, spec: DrafterSpec, proposer: Proposer,
                 budgets: tuple[int, ...], head_mem_bytes: int, tail_blocks: TailBlocks, specforge: SpecForgePass,
                 keep_drafts: bool, timer: Any):
        self.runner, self.head, self.spec, self.proposer, self.budgets = runner, head, spec, proposer, budgets
        self.tail_blocks, self.specforge, self.keep_drafts = tail_blocks, specforge, keep_drafts
        self.head_mem_bytes, self.timer = head_mem_bytes, timer

    def score(self, wave: _Wave, slots: torch.Tensor) -> _Scored:
        spec, head, timer, proposer = self.spec, self.head, self.timer, self.proposer
        tables = wave.scoring
        dev = head.embed_tokens.device
        n, d = spec.block_size, spec.block_size - 1
        sample = wave.slot_sample[slots].to(dev)
        anchors = wave.slot_anchor[slots].to(dev)
        in_stats = wave.stats[slots].to(dev)
        base = tables.token_start[sample]
        lengths = block_lengths(tables.loop_end[sample], anchors, n, self.tail_blocks)
        with timer.phase(FORWARD):
            emb = self.runner.block_inputs(tables.tokens, base + anchors, n, head.embed_tokens).to(self.runner.dtype)
            short = lengths if bool((lengths < n).any()) else None
            blocks = self.runner.block_rows(wave.context, emb, anchors, sample, short)
        depth = torch.arange(1, d + 1, device=dev)[None, :]
        read = depth - proposer.position_shift  # the block position each depth's draft reads
        pos = anchors[:, None] + depth  # positions of depths 1..D
        last = (tables.length[sample] - 1)[:, None]
        target = tables.tokens[base[:, None] + torch.minimum(pos, last)]
        target = torch.where(pos < tables.known_end[sample][:, None], target, -1)
        anchor_tokens = tables.tokens[base + anchors]
        previous = predecessors(anchor_tokens, target)  # teacher forced: the target's own tokens
        every = torch.arange(len(slots), device=dev)[:, None]
        with timer.phase(HEAD):  # a family's prefix scan is its head's work
            hidden_rows = blocks.rows(every, read) if proposer.prefix_reads_hidden else None  # [N, D, H]
            # [N, D, S] or None: what a family reads of a block's prefix
            state = proposer.prefix_state(previous, hidden_rows)
        target_topk = None
        if tables.topk is not None:
            # The target's distribution for the token at p + k sits at position p + k - 1.
            at = (base[:, None] + torch.minimum(pos - 1, last)).reshape(-1)
            target_topk = (tables.topk[0][at], tables.topk[1][at])
        # Rows read at every depth: the statistics anchors, and with DDTree budgets the blocks a tree walk may
        # still visit; the others only as deep as their walks read (``_greedy_head``).
        full = in_stats
        if self.budgets:
            full = in_stats | wave.tree_reachable(slots, range(1, 1 + len(self.budgets))).to(dev)
        tree_k = max(self.budgets, default=0)
        with timer.phase(HEAD):
            if self.keep_drafts or bool(full.all()):
                flat = (blocks.rows(every, read) if hidden_rows is None else hidden_rows).reshape(len(slots) * d, -1)
                drafts = _DepthDrafts.of(proposer.rows(flat, previous.reshape(-1), target.reshape(-1), tree_k=tree_k,
                                                       parts=bool(self.budgets) or self.keep_drafts,
                                                       target_topk=target_topk, state=_flat(state)), len(slots), d)
            else:
                drafts = self._greedy_head(blocks, target, previous, full, target_topk, state, hidden_rows, tree_k)
        # Depths past a (tail) block's length get values that never match or score: -2, -inf, 0.
        inside = depth < lengths[:, None]
        known = inside & (target >= 0)
        argmax = torch.where(inside, drafts.tokens, -2)
        accepted = leading_matches(argmax, target)
        first_stop = None
        if wave.has_stops:
            nxt = base + torch.minimum(anchors + 1, tables.length[sample] - 1)
            first_stop = tables.next_stop[nxt]
        loop_end = tables.loop_end[sample]
        produced = [cut_produced(accepted, anchors, loop_end, first_stop)]
        if self.budgets:
            with timer.phase(DDTREE):
                at = drafts.full_rows  # None: every block has a tree; elsewhere no tree walk visits (-1)
                if at is None:
                    tree = proposer.tree(drafts.parts, anchor_tokens, lengths - 1, target, inside, tree_k)
                else:
                    tree = torch.zeros((len(slots), tree_k), dtype=torch.long, device=dev)
                    if at.numel():
                        tree[at] = proposer.tree(drafts.parts, anchor_tokens[at], lengths[at] - 1, target[at],
                                                 inside[at], tree_k)
                for b in self.budgets:
                    cut = cut_produced(tree[:, b - 1], anchors, loop_end, first_stop)
                    produced.append(cut if at is None else torch.where(full, cut, -1))
        for w in range(len(proposer.walks)):  # the family's own walks, under the loop's cut rules
            produced.append(cut_produced(_leading(drafts.hits[..., w] & known), anchors, loop_end, first_stop))
        shown = None
        if self.keep_drafts:
            shown = torch.where(inside, proposer.block(drafts.parts, drafts.tokens, anchor_tokens), -2)
        scored = _Scored(torch.stack(produced, dim=1), accepted, shown, lengths - 1 if self.keep_drafts else None,
                         None, None, None)
        if bool(in_stats.any()):
            with timer.phase(STATISTICS):
                scored.stat_rows, scored.stat_table, scored.t1 = self._statistics(
                    wave, sample, anchors, lengths, emb, in_stats, known, target, argmax, inside, drafts, accepted,
                    produced[0])
        return scored

    def _statistics(self, wave: _Wave, sample: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor,
                    emb: torch.Tensor, in_stats: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
                    argmax: torch.Tensor, inside: torch.Tensor, drafts: _DepthDrafts, accepted: torch.Tensor,
                    produced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-anchor statistics of the statistics rows (small integers, on the CPU) and their temperature-1
        estimate: the sums over each stride's set are taken when the wave is done (``_Wave.anchor_counts``)."""
        match = argmax == target
        # What SpecForge's accuracy scores from the served drafts: the draft itself, or the family's own choice
        # (DFlash 2: the unary argmax, the selector off).
        sf_match = match if drafts.specforge is None else torch.where(inside, drafts.specforge, -2) == target
        if self.specforge is not SpecForgePass.LEFT_OUT:
            # SpecForge drafts full blocks under its own masks: draft again where that changes the drafts.
            again = in_stats if self.specforge is SpecForgePass.OWN_PASS else in_stats & (lengths < self.spec.block_size)
            if bool(again.any()):
                sf_match = sf_match.clone()
                sf_match[again] = self._specforge_argmax(wave, sample, anchors, emb, again) == target[again]
        rows = in_stats.nonzero()[:, 0]
        extra = {name: (drafts.counts[..., j].long() * valid)[rows] for j, name in enumerate(self.proposer.depth_counts)}
        table = wave.columns.pack(accepted=accepted[rows], produced=produced[rows], valid=valid[rows],
                                  match=(match & valid)[rows], specforge_match=(sf_match & valid)[rows], **extra)
        t1 = None
        if drafts.overlap is not None:
            t1 = expected_accepted(torch.where(valid, drafts.overlap, 0.0)[rows]).cpu()
        return rows, table, t1

    def _specforge_argmax(self, wave: _Wave, sample: torch.Tensor, anchors: torch.Tensor, emb: torch.Tensor,
                          rows: torch.Tensor) -> torch.Tensor:
        """The head's argmax [r, D] (what SpecForge's DFlash accuracy scores, for every family) of the blocks
        ``rows`` drafted in full under SpecForge's training masks."""
        idx = rows.nonzero()[:, 0]
        d = self.spec.block_size - 1
        with self.timer.phase(FORWARD):
            blocks = self.runner.specforge_rows(wave.context, emb[idx], anchors[idx], sample[idx])
        with self.timer.phase(HEAD):
            depth = torch.arange(1, d + 1, device=idx.device)[None, :]
            hid = blocks.rows(torch.arange(idx.numel(), device=idx.device)[:, None], depth)
            out = apply_head(hid.reshape(idx.numel() * d, -1), self.head.lm_head, self.spec, 0, self.head_mem_bytes)
        return out.argmax.view(-1, d)

    def _greedy_head(self, blocks: BlockRows, target: torch.Tensor, previous: torch.Tensor, full: torch.Tensor,
                     target_topk: tuple[torch.Tensor, torch.Tensor] | None,
                     state: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                     tree_k: int = 0) -> _DepthDrafts:
        """Drafts [N, D]: every depth for the rows ``full`` (the statistics rows, and the blocks a tree walk may
        visit: with ``tree_k`` > 0 their DDTree ``parts`` too); for the others only as deep as a walk
        reads (the greedy walk reads depth k only when depths 1..k-1 matched; a family's own walks, by their
        own hits), -2 past that.
        The head (and the last layer's token-wise tail, ``model.DeferredBlocks``) is most of a block's cost,
        and tau ~ 4 reads about a third of it. The live rows go a few depths per head call, about
        ``_HEAD_ROWS`` rows a call: a call on a handful of rows costs as much as reading the head matrix
        once. For the rows ``full``, when ``target_topk`` is given, the temperature-1 overlap too."""
        n, d = target.shape
        proposer, shift = self.proposer, self.proposer.position_shift
        dev = target.device

        def hidden_at(at: torch.Tensor, first: int, count: int) -> torch.Tensor:
            """Hidden rows [len(at), count, H] of blocks ``at`` at depths first .. first + count - 1 (from ``hidden``,
            every depth's rows, when the proposer's prefix state read them already)."""
            if hidden is not None:
                return hidden[at, first - 1:first - 1 + count]
            return blocks.rows(at[:, None], torch.arange(first, first + count, device=dev)[None, :] - shift)

        rows = full.nonzero()[:, 0]
        out = None
        if rows.numel():
            sub = None if target_topk is None else tuple(
                t.view(n, d, -1)[rows].reshape(rows.numel() * d, -1) for t in target_topk)
            hid = hidden_at(rows, 1, d)
            out = proposer.rows(hid.reshape(rows.numel() * d, -1), previous[rows].reshape(-1),
                                target[rows].reshape(-1), tree_k=tree_k, parts=tree_k > 0, target_topk=sub,
                                state=None if state is None else _flat(state[rows]))
        walks, counts = len(proposer.walks), len(proposer.depth_counts)
        table = _DepthDrafts.unread(n, d, walks, counts, out is not None and out.specforge is not None, dev)
        table.full_rows = rows
        if out is not None:
            table.put(rows, out)
            table.parts = out.parts
            if out.overlap is not None:
                table.overlap = torch.zeros((n, d), dtype=torch.float64, device=dev)
                table.overlap[rows] = out.overlap.view(-1, d)
        live = (~full).nonzero()[:, 0]
        k = 0
        while k < d and live.numel():
            c = min(d - k, max(1, _HEAD_ROWS // live.numel()))
            hid = hidden_at(live, k + 1, c)
            # Row-chunked like the statistics rows: at tau ~ 1 every block is live, and a call on all of
            # them at once would hold [max_blocks, vocab] logits (1 GB at the real vocabulary).
            got = proposer.rows(hid.reshape(live.numel() * c, -1), previous[live, k:k + c].reshape(-1),
                                target[live, k:k + c].reshape(-1),
                                state=None if state is None else _flat(state[live, k:k + c]))
            drafts, hits = got.tokens.view(-1, c), got.hits.view(live.numel(), c, walks)
            # Each walk's leading run: the greedy one's matches, then the family's walks' hits.
            chains = torch.cat([(drafts == target[live, k:k + c])[..., None], hits], dim=-1)
            read = chains.long().cumprod(dim=1).sum(dim=1).max(dim=-1).values
            # Depths up to the first miss of the walk reading deepest are read (the miss decides the cycle).
            keep = torch.arange(c, device=dev)[None, :] <= read[:, None]
            table.tokens[live, k:k + c] = torch.where(keep, drafts, -2)
            table.hits[live, k:k + c] = hits & keep[..., None]
            live = live[read == c]
            k += c
        return table


# ---------------------------------------------------------------------------
# Whole-cache evaluation
# ---------------------------------------------------------------------------

@dataclass
class EvalReport:
    counts: EvalCounts
    samples: list[SampleResult]
    wall_time_s: float
    spec: DrafterSpec
    budgets: tuple[int, ...]
    anchor_stride: int = 1
    tail_blocks: TailBlocks = "served"
    head_dtype: str = ""  # the dtype the output head computed in
    anchor_seed: int = DEFAULT_ANCHOR_SEED
    extra_anchor_strides: tuple[int, ...] = ()
    # How ``specforge/acc`` was computed: "" when SpecForge's masks are the served ones; else why they
    # differ and that it had its own pass, or was left out (``SPECFORGE_OWN_PASS`` / ``SPECFORGE_LEFT_OUT``).
    specforge_note: str = ""
    passes: int = 0  # drafter passes made (rounds of every wave, at most max_blocks blocks each)
    series: dict[str, Any] = field(default_factory=dict)  # what identifies these figures (EvalRequest.series)

    @property
    def summary(self) -> dict[str, float]:
        return summarize(self.counts)

    @property
    def tau(self) -> float:
        return self.summary[TAU]

    @property
    def block_size(self) -> int:
        """The block every cycle drafted (``evaluate(block_size=...)``); ``spec.block_size`` is the drafter's."""
        return self.counts.block_size

    @property
    def anchor_strides(self) -> tuple[int, ...]:
        """Every stride with statistics in this report: ``anchor_stride`` first, then the extra ones."""
        return (self.anchor_stride, *self.extra_anchor_strides)

    def counts_at(self, stride: int) -> EvalCounts:
        """The counts with the anchor statistics of stride ``stride`` (``anchor_stride`` or an extra one); the
        cycle, DDTree and cost counts are ``counts``'."""
        if stride == self.anchor_stride:
            return self.counts
        if stride not in self.extra_anchor_strides:
            raise DFlashCBError(f"stride {stride}: this evaluation has anchor statistics at strides "
                                f"{list(self.anchor_strides)} only; pass extra_anchor_strides=[{stride}] to evaluate")
        c = self.counts
        return summed_counts(self.samples, c.block_size, c.budgets, c.categories, stride, c.family)


SPECFORGE_OWN_PASS = "specforge/acc is computed under SpecForge's masks, with a drafter pass of its own"
SPECFORGE_LEFT_OUT = "specforge/acc is left out: this drafter's runner cannot run SpecForge's masks"


def summed_counts(samples: Sequence[SampleResult], block_size: int, budgets: Sequence[int],
                  categories: Sequence[str], stride: int, family: str = DEFAULT_FAMILY) -> EvalCounts:
    """``EvalCounts`` of scored samples, summed in their order from per-sample integers, with the anchor
    statistics of ``stride``: the same whichever samples were evaluated together (or on which rank)."""
    counts = EvalCounts(block_size, tuple(budgets), tuple(categories), family)
    counts.add_samples([r.acceptance_lengths for r in samples], [r.category for r in samples],
                       [[r.ddtree[b] for b in counts.budgets] for r in samples],
                       [(r.anchors_drafted, r.anchors_needed) for r in samples],
                       [r.anchor_counts[stride] for r in samples],
                       [[r.walks[w] for w in counts.walks] for r in samples] if counts.walks else ())
    return counts


def bounds_for(sample: CachedSample, manifest: Manifest) -> SampleBounds:
    e = sample.entry
    last = int(sample.input_ids[-1]) if e.total_len > 0 else None
    return sample_bounds(e.prompt_len, e.total_len, e.valid_len, manifest.max_new_tokens, last,
                         manifest.stop_token_ids)


def anchor_count(entry: SampleEntry, manifest: Manifest) -> int:
    """How many anchors a sample has (``len(bounds_for(...).anchors)``) from its manifest entry alone: the
    last token, which ``bounds_for`` reads from the shard, moves the loop's end but never the anchors."""
    return len(sample_bounds(entry.prompt_len, entry.total_len, entry.valid_len, manifest.max_new_tokens, None,
                             ()).anchors)


def anchors_per_sample(cache: StateCache, ids: Iterable[str]) -> dict[str, int]:
    """``{sample id: anchors}`` without reading a shard (for ``anchor_sets.sparse_stride_warning``)."""
    return {i: anchor_count(cache.entry(i), cache.manifest) for i in ids}


# Names an evaluation's autocast dtype may be given by: the project's dtype table plus short spellings.
AUTOCAST_NAMES = {**DTYPES, "bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"], "fp32": DTYPES["float32"]}


def resolve_autocast(requested: str | torch.dtype | None, device: torch.device,
                     param_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of an evaluation: the one rule for the callback and ``eval_drafter.py``.

    ``"auto"``: bfloat16 on CUDA for a float32 drafter (speed where it is cheap), none elsewhere (CPU
    stays exact float32). None or float32: none. Another name (``AUTOCAST_NAMES``) or dtype: that one.
    """
    if requested is None:
        return None
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" and param_dtype == torch.float32 else None
    dt = requested if isinstance(requested, torch.dtype) else AUTOCAST_NAMES[requested]
    return None if dt == torch.float32 else dt


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _waves(cache: StateCache, ids: list[str], runner: DraftRunner, dtype: torch.dtype, budget: int) -> list[list[str]]:
    """Split ``ids`` (in order) into groups whose prepared states fit ``budget`` bytes together."""
    waves: list[list[str]] = [[]]
    used = 0
    for sid in ids:
        need = runner.state_bytes(cache.entry(sid).total_len, dtype)
        if waves[-1] and used + need > budget:
            waves.append([])
            used = 0
        waves[-1].append(sid)
        used += need
    return [w for w in waves if w]


def evaluate(cache: StateCache, drafter: Any, head: TargetHead | None = None, request: EvalRequest | None = None, *,
             progress: bool = False, timer: PhaseTimer | None = None, **options: Any) -> EvalReport:
    """Score ``drafter`` on ``cache``: exact greedy replay, DDTree per budget, anchor statistics.

    What to compute is an ``EvalRequest`` (``request``; keyword ``options`` replace its fields, so
    ``evaluate(cache, drafter, budgets=(16,), anchor_stride=8)`` reads as before). Its fields:

    ``anchor_stride`` picks the anchor-statistics set (per-depth acceptance, ``specforge/acc``,
    ``all_anchor_tau``, the chain and temperature-1 estimates): per sample ``anchors[o::anchor_stride]``
    with an offset ``o = anchor_sets.anchor_offset(anchor_seed, sample id, anchor_stride)`` in
    ``[0, anchor_stride)``, the same at every evaluation whatever else is evaluated with it; 1 = every
    anchor. ``anchor_offsets`` ({sample id: offset}) replaces the drawn offsets of the samples it names
    (others keep theirs). ``extra_anchor_strides``: more statistics sets from the same pass (each with its
    own drawn offsets; what is drafted is the union); ``EvalReport.counts_at(stride)`` gives their counts.
    The replays are exact whatever the strides. ``specforge/acc`` is SpecForge 0.2.0's accuracy: when
    its training masks differ from the served ones (``DrafterFamily.specforge_difference``), the statistics
    anchors are drafted once more under its masks (``EvalReport.specforge_note``). ``head`` defaults to
    the cache's exported target head. ``autocast_dtype`` (e.g. bfloat16 on GPU) trades exactness for
    speed; exactness tests use float32. ``keep_drafts`` > 0 keeps, per sample, the draft blocks of that
    many first cycles (``SampleResult.drafts``).
    ``tail_blocks`` (``replay.TAIL_BLOCKS``): "served" drafts full blocks up to the end, as SGLang;
    "reference" shortens the last blocks, as ``dflash_generate`` (docs/method.md, "Tail blocks").
    ``block_size`` (``replay.check_block_size``: 2 .. the drafter's, a chain drafter's up to its family's
    ``block_cap``; None = the drafter's) is the block
    every cycle drafts, as a server started with a smaller block does; the tail rules and the
    per-depth statistics follow it (``EvalReport.block_size``). ``draft_all``: the first round drafts every
    anchor, as stride 1 does, whatever the statistics stride: one round instead of one per cycle, cheaper when
    the walks would draft most anchors anyway (a weak drafter) or a pass costs more than the blocks it
    spares (few samples; ``cost.draft_all_is_cheaper`` decides for the live evaluator). Only what is drafted
    changes, never a figure. ``timer`` (``common.timing.PhaseTimer``) collects the seconds of each phase
    (``PHASES``); ``progress`` shows a progress bar over the samples.

    The head runs in its own dtype: a head loaded here (``head`` None) is read in the compute dtype
    (``autocast_dtype``, else the drafter's), so a bf16 evaluation never holds a float32 head; a
    given head is used as it is (``EvalReport.head_dtype`` says which).

    Memory model (``limits``, a ``cost.MemoryLimits``; ``cost.memory_bound`` computes it; the README's
    memory section gives the figures), for the Qwen3.6-27B drafter in bf16 (5 layers, hidden 5120,
    vocabulary 248,320, block 16):

    - drafter weights: 1.73 B parameters, 3.5 GB;
    - target embedding + output head, in the compute dtype: 2 x 248,320 x 5,120 x 2 bytes = 5.1 GB
      (2.5 GB when tied);
    - context K/V, 5 layers x 2 x 8 KV heads x 128 x 2 bytes = 20 KiB per position: 42 MB per
      2,048-token sample, 2.7 GB for 64; samples are evaluated in waves whose K/V fit
      ``limits.context_bytes`` together (4 GiB default: 64 such samples are one wave); their features are
      projected in batches under ``limits.attn_bytes``;
    - bounded buffers: a round drafts at most ``limits.max_blocks`` blocks per pass (token-wise activations
      ~ ``max_blocks`` x block_size x (3 x intermediate + 4 x hidden): 2.4 GB at 1,024 blocks in bf16); attention
      temporaries stay under ``limits.attn_bytes`` per call, and every vocabulary-sized tensor (the
      head's logits, greedy and statistics rows alike) under ``limits.head_bytes``;
    - a DFlash 2 drafter adds its selector's codebooks (2 x vocabulary x rank in the weights' dtype: 254 MB
      at 248,320 x 256 in bf16) and, with DDTree budgets, the lattice of a pass (``cost.memory_bound``).

    A DFlash 2 drafter (``DrafterSpec.family``) is scored by its selector (docs/method.md, "DFlash 2"): the
    replays, the DDTree taus (over the selector's lattice) and the per-depth acceptance score the selector's
    drafts; ``specforge/acc`` the unary argmax; ``selector/...`` says where tau is lost (docs/metrics.md).
    """
    start = time.perf_counter()
    timer = timer if timer is not None else NO_TIMER
    req = EvalRequest.of(request, options)
    limits, budgets = req.limits, req.budgets
    runner = as_runner(drafter, req.spec, limits)
    spec = runner.spec
    cache.check_fit(family_named(spec.family).cache_needs(spec, getattr(drafter, "config", None)))
    if isinstance(drafter, torch.nn.Module):  # NaN weights would still get a tau (the argmax of NaN is a token)
        check_finite_weights(drafter.named_parameters(), f"the drafter ({type(drafter).__name__})")
    block = check_block_size(req.block_size, spec.block_size, cap=family_named(spec.family).block_cap(spec))
    check_tree_support(spec, budgets)
    drafting_spec = dataclasses.replace(spec, block_size=block)  # what the cycles draft; the report keeps spec
    specforge, note = specforge_pass(runner, block)
    device = req.device
    if device is None:
        device = runner.device
    with timer.phase(LOAD):
        if head is None:
            head = cache.load_head(device=device, dtype=req.autocast_dtype or runner.dtype)
        elif head.embed_tokens.device != device:
            head = head.to(device)
    ids = list(req.sample_ids) if req.sample_ids is not None else [s.id for s in cache.samples]
    categories = cache.categories
    manifest = cache.manifest
    strides = req.strides
    offsets = {s: offsets_for(ids, s, req.anchor_seed, req.anchor_offsets if s == req.anchor_stride else None)
               for s in strides}
    # The family's proposer: what the drafter's hidden states draft, and the family's own walks and statistics.
    proposer = proposer_for(drafting_spec, runner.module, head.lm_head, limits.head_bytes, head.embed_tokens)
    plan = _Plan(strides, offsets, budgets, proposer.walks, proposer.depth_counts, block - 1, req.keep_drafts > 0,
                 req.draft_all, tuple(manifest.stop_token_ids), device, req.verify)
    scorer = _Scorer(runner, head, drafting_spec, proposer, budgets, limits.head_bytes, req.tail_blocks, specforge,
                     req.keep_drafts > 0, timer)
    state_dtype = req.autocast_dtype or runner.dtype
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="evaluating", unit="sample")
    results: dict[str, SampleResult] = {}
    passes = 0
    with torch.no_grad(), autocast_context(device, req.autocast_dtype):
        for wave_ids in _waves(cache, ids, runner, state_dtype, limits.context_bytes):
            wave = _load_wave(cache, wave_ids, runner, plan, timer, head.embed_tokens)
            first = True
            while True:
                with timer.phase(WALK):
                    wave.walks.advance(lookahead_cap(block))
                    slots = wave.requests(first)
                first = False
                if not slots.numel():
                    break
                for i in range(0, slots.numel(), limits.max_blocks):
                    chunk = slots[i:i + limits.max_blocks]
                    scored = scorer.score(wave, chunk)
                    passes += 1
                    with timer.phase(WALK):
                        wave.record(chunk, scored)
            with timer.phase(STATISTICS):
                for r in wave.results(budgets, req.keep_drafts, block, specforge is not SpecForgePass.LEFT_OUT):
                    results[r.id] = r
            del wave  # the context K/V of this wave can go
            if bar is not None:
                bar.update(len(wave_ids))
    if bar is not None:
        bar.close()
    samples = [results[sid] for sid in ids]
    with timer.phase(STATISTICS):
        # In sample order, from per-sample integers: the counts do not depend on waves, rounds or ranks.
        counts = summed_counts(samples, block, budgets, categories, req.anchor_stride, spec.family)
    return EvalReport(counts, samples, time.perf_counter() - start, spec, budgets, req.anchor_stride, req.tail_blocks,
                      str(head.lm_head.dtype).removeprefix("torch."), req.anchor_seed, strides[1:], note, passes,
                      req.series(block_size=block))


def check_tree_support(spec: DrafterSpec, budgets: Sequence[int], option: str = "budgets") -> None:
    """Refuse DDTree budgets for a family whose drafts make no DDTree (``DrafterFamily.supports_tree``)."""
    family = family_named(spec.family)
    if budgets and not family.supports_tree:
        raise DFlashCBError(f"{option} {list(budgets)}: {family.tree_refusal()}; pass no budgets "
                            "(--ddtree-budgets '' / ddtree_budgets=())")


def specforge_pass(runner: DraftRunner, block_size: int) -> tuple[SpecForgePass, str]:
    """How ``specforge/acc`` is computed for ``runner``'s drafter at ``block_size`` and the report's note on
    it ("" when SpecForge's masks are the served ones)."""
    family = family_named(runner.spec.family)
    if not family.specforge_accuracy:
        return SpecForgePass.LEFT_OUT, (f"specforge/acc is left out: SpecForge's {family.label} accuracy scores its "
                                        "own objective, which is not replayed")
    difference = runner.specforge_difference(block_size)
    if difference is None:
        return SpecForgePass.SAME_DRAFTS, ""
    if runner.has_specforge_masks:
        return SpecForgePass.OWN_PASS, f"{difference}: {SPECFORGE_OWN_PASS}"
    return SpecForgePass.LEFT_OUT, f"{difference}: {SPECFORGE_LEFT_OUT}"


def _load_wave(cache: StateCache, ids: list[str], runner: DraftRunner, plan: _Plan, timer: Any,
               embed: torch.Tensor) -> _Wave:
    """Read a wave's samples (each shard opened once) and build its drafter state as they arrive."""
    manifest, device = cache.manifest, plan.device
    entries = [cache.entry(i) for i in ids]
    # Block at p sees context rows [0, p): the last anchor bounds the rows any block needs.
    rows = [e.prompt_len + n - 1 if n else 0 for e, n in ((e, anchor_count(e, manifest)) for e in entries)]
    bounds, tokens, topk = [], [], []

    # The drafter's own layers of the cache's (a cache may hold more, for several drafters).
    columns = cache.feature_columns(runner.spec.target_layer_ids)

    def features() -> Iterator[torch.Tensor]:
        with contextlib.closing(cache.load_many(ids, verify=plan.verify, argmax=False)) as samples:
            for r in rows:
                with timer.phase(LOAD):
                    sample = next(samples)
                    bounds.append(bounds_for(sample, manifest))
                    tokens.append(sample.input_ids.long())
                    topk.append(None if sample.topk_ids is None else (sample.topk_ids, sample.topk_logprobs))
                    feats = sample.hidden[:r] if columns is None else sample.hidden[:r].index_select(1, columns)
                    feats = feats.to(device=device, dtype=runner.dtype)
                    nxt = None
                    if runner.context_reads_tokens:  # row t's next token (the sample's last token pads)
                        token_ids = tokens[-1].to(device)
                        nxt = runner.token_embeddings(token_ids[torch.arange(1, r + 1, device=device).clamp(
                            max=token_ids.numel() - 1)], embed).to(runner.dtype)
                    del sample  # the features are no longer needed once projected
                yield feats if nxt is None else (feats, nxt)

    with timer.phase(CONTEXT):
        context = runner.context(features(), rows)
    with timer.phase(WALK):
        return _Wave(ids, entries, bounds, tokens, topk, context, plan)
