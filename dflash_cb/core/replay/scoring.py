"""Drafting a chunk of a wave's slots and scoring it: the only room the family's runner and proposer enter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...cache.states import TargetHead
from ..drafters.proposers import Proposer, RowDrafts, apply_head, predecessors
from ..drafters.runners import BlockRows, DraftRunner
from ..drafters.spec import DrafterSpec
from ..loop.cycles import (
    TailBlocks,
    block_lengths,
    cut_produced,
    leading_matches,
)
from .phases import DDTREE, FORWARD, HEAD, STATISTICS
from .request import SpecForgePass
from .wave import Scored, Wave

# Rows per greedy head call: below about this many, a call costs what reading the head matrix costs.
_HEAD_ROWS = 16


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


@dataclass
class DepthDrafts:
    """A proposer's ``RowDrafts`` of N blocks as [N, D] tables (-2 / False where a depth was not read)."""

    tokens: torch.Tensor  # [N, D]
    hits: torch.Tensor  # [N, D, W] bool
    counts: torch.Tensor  # [N, D, C] small non-negative integers (booleans mostly)
    specforge: torch.Tensor | None  # [N, D], None: ``tokens``
    overlap: torch.Tensor | None  # [N, D]
    parts: Any = None
    full_rows: torch.Tensor | None = None  # the blocks read at every depth, whose ``parts`` these are (None: all)

    @classmethod
    def of(cls, out: RowDrafts, n: int, d: int) -> DepthDrafts:
        def view(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.view(n, d, *x.shape[1:])

        return cls(out.tokens.view(n, d), view(out.hits), view(out.counts), view(out.specforge),
                   view(out.overlap), out.parts)

    @classmethod
    def unread(cls, n: int, d: int, walks: int, counts: int, specforge: bool, device: torch.device) -> DepthDrafts:
        def table(*shape: int, fill: Any) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.bool if isinstance(fill, bool) else torch.long, device=device)

        return cls(table(n, d, fill=-2), table(n, d, walks, fill=False), table(n, d, counts, fill=0),
                   table(n, d, fill=-2) if specforge else None, None)

    def put(self, rows: torch.Tensor, out: RowDrafts) -> None:
        """Every depth of blocks ``rows`` from their ``RowDrafts`` (the overlap is set by the caller)."""
        n, d = rows.numel(), self.tokens.shape[1]
        got = DepthDrafts.of(out, n, d)
        self.tokens[rows], self.hits[rows], self.counts[rows] = got.tokens, got.hits, got.counts.long()
        if self.specforge is not None and got.specforge is not None:
            self.specforge[rows] = got.specforge


def _flat(state: torch.Tensor | None) -> torch.Tensor | None:
    """A [N, D, S] prefix state as rows [N * D, S] (block-major, as the hidden rows)."""
    return None if state is None else state.reshape(-1, state.shape[-1])


def _leading(hits: torch.Tensor) -> torch.Tensor:
    """[N, D] booleans -> [N]: how many leading depths are True (the accepted length of a chain of them)."""
    return hits.long().cumprod(dim=1).sum(dim=1)


class Scorer:
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

    def score(self, wave: Wave, slots: torch.Tensor) -> Scored:
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
                drafts = DepthDrafts.of(proposer.rows(flat, previous.reshape(-1), target.reshape(-1), tree_k=tree_k,
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
        scored = Scored(torch.stack(produced, dim=1), accepted, shown, lengths - 1 if self.keep_drafts else None,
                        None, None, None)
        if bool(in_stats.any()):
            with timer.phase(STATISTICS):
                scored.stat_rows, scored.stat_table, scored.t1 = self._statistics(
                    wave, sample, anchors, lengths, emb, in_stats, known, target, argmax, inside, drafts, accepted,
                    produced[0])
        return scored

    def _statistics(self, wave: Wave, sample: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor,
                    emb: torch.Tensor, in_stats: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
                    argmax: torch.Tensor, inside: torch.Tensor, drafts: DepthDrafts, accepted: torch.Tensor,
                    produced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-anchor statistics of the statistics rows (small integers, on the CPU) and their temperature-1
        estimate: the sums over each stride's set are taken when the wave is done (``Wave.anchor_counts``)."""
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

    def _specforge_argmax(self, wave: Wave, sample: torch.Tensor, anchors: torch.Tensor, emb: torch.Tensor,
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
                     tree_k: int = 0) -> DepthDrafts:
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
        table = DepthDrafts.unread(n, d, walks, counts, out is not None and out.specforge is not None, dev)
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
