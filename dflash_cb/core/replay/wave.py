"""The samples evaluated together as flat tables: their tokens, one slot per anchor, what was drafted there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...cache.manifest import SampleEntry
from ...cache.states import StateCache
from ..drafters.runners import DraftRunner
from ..figures.metrics import AnchorCounts, anchor_counts_per_sample
from ..loop.cycles import (
    SampleBounds,
    next_stop_positions,
)
from .phases import CONTEXT, LOAD, WALK
from .plan import Plan, anchor_count, bounds_for, stats_anchors
from .report import SampleResult
from .walks import Walks


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lengths))`` without a Python loop."""
    total = int(lengths.sum())
    firsts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - firsts, lengths, output_size=total) + torch.arange(total)


@dataclass
class TokenTables:
    """A wave's token tables on the compute device, where blocks are scored (``Wave``)."""

    token_start: torch.Tensor  # [samples] each sample's first position in ``tokens``
    length: torch.Tensor  # [samples] tokens per sample
    tokens: torch.Tensor  # every sample's tokens end to end
    next_stop: torch.Tensor  # per position: the first stop position at or after it, within its sample
    loop_end: torch.Tensor  # [samples] (``SampleBounds``)
    known_end: torch.Tensor  # [samples]
    topk: tuple[torch.Tensor, torch.Tensor] | None  # the target's stored top-K ids and log-probabilities


@dataclass
class Scored:
    """What drafting a chunk of slots gave (``Scorer.score``), for ``Wave.record``."""

    produced: torch.Tensor  # [N, walks] the cycle's produced per walk (greedy, each budget, the family's walks)
    accepted: torch.Tensor  # [N] greedy leading matches before any cut
    argmax: torch.Tensor | None  # [N, D] the block proposed (-2 past the drafted depths), kept for keep_drafts
    depths: torch.Tensor | None  # [N] drafted depths (block length - 1), with ``argmax``
    stat_rows: torch.Tensor | None  # indexes of the statistics rows among the N
    stat_table: torch.Tensor | None  # [r, StatColumns.width] int16 (CPU)
    t1: torch.Tensor | None  # [r] float64 (CPU): expected accepted length at temperature 1



class Wave:
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
                 plan: Plan):
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
        self.scoring = TokenTables(self.token_start.to(device), torch.tensor(lens, device=device),
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
        self.walks = Walks(self, plan.walks)
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
        (``Walks.window``), and in the first round the statistics sets (every anchor with ``draft_all``); less
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
        walk: walks only move forward). A DDTree is built only there (``Scorer.score``)."""
        s, anchor = self.slot_sample[slots], self.slot_anchor[slots]
        w = self.walks
        pos, live = w.pos[s][:, tree_walks.start:tree_walks.stop], ~w.done[s][:, tree_walks.start:tree_walks.stop]
        return (live & (anchor[:, None] >= pos)).any(dim=1)

    def record(self, slots: torch.Tensor, scored: Scored) -> None:
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


def load_wave(cache: StateCache, ids: list[str], runner: DraftRunner, plan: Plan, timer: Any,
               embed: torch.Tensor) -> Wave:
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
        return Wave(ids, entries, bounds, tokens, topk, context, plan)
