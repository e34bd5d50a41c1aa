"""The evaluation engine: drafts only where the replays and the anchor statistics look, batched
across samples (the method, and why the replay is exact: docs/method.md).

The replays (the greedy walk and one walk per DDTree budget, for every sample) advance in rounds.
Each round collects the anchors that the live walks need next, plus, in the first round, the
fixed anchor-statistics set (every ``anchor_stride``-th anchor from ``prompt_len``); each
distinct (sample, anchor) is drafted once and its per-walk ``produced`` values are kept, so a
walk that lands on an anchor drafted earlier (by another walk or for the statistics) reuses it.
When the drafts so far say a walk almost always advances by one token (tau ~ 1), the round also
drafts the next few anchors that walk will need with high probability (``_grow``), so a
weak drafter does not cost one round per cycle.

Within a round the token-wise work (projections, MLP, norms, the output head and its argmax /
top-K reduction) runs on the blocks of all samples together; attention runs per sample against
that sample's context K/V, computed once per sample per evaluation. The head is applied in row
chunks and reduced on the fly, so ``[blocks x depth x vocab]`` logits never exist. The last drafter
layer stops after its attention (``BlockRows``): its ``o_proj``, MLP and the final norm are
token-wise, so they run, with the head, only on the block positions that are read.
No Lightning, W&B or HTTP here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..cache.states import CachedSample, Manifest, StateCache, TargetHead
from ..cache.target import DTYPES
from .ddtree import ddtree_accepted
from .metrics import TAU, EvalCounts, summarize
from .model import DFlashDrafter, DrafterSpec, draft_logits
from .replay import (
    SampleBounds,
    Walk,
    block_lengths,
    check_block_size,
    check_tail_blocks,
    cut_produced,
    leading_matches,
    next_stop_positions,
    sample_bounds,
)

DEFAULT_BUDGETS = (16, 32, 64)
# Rows per greedy head call: below about this many, a call costs what reading the head matrix costs.
_HEAD_ROWS = 16


# ---------------------------------------------------------------------------
# Drafter runners: the only place that knows how a drafter is called
# ---------------------------------------------------------------------------

class DraftRunner:
    """Turns (context features, block embeddings, anchors) into drafter hidden states."""

    spec: DrafterSpec

    def prepare(self, features: torch.Tensor) -> Any:
        """Per-sample state from its context features [T, F] (rows 0..T-1)."""
        return features

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Memory one sample's prepared state of ``tokens`` positions holds (for evaluation waves)."""
        return 0

    def hidden(self, state: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[A, L, hidden] for blocks of one sample; ``lengths`` [A] marks blocks shorter than L."""
        raise NotImplementedError

    def hidden_samples(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       segments: Sequence[tuple[int, int]], lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[N, L, hidden] for blocks of several samples: rows ``segments[s]`` use ``states[s]``."""
        outs = [self.hidden(st, noise_embedding[lo:hi], anchors[lo:hi], None if lengths is None else lengths[lo:hi])
                for st, (lo, hi) in zip(states, segments, strict=True) if hi > lo]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def block_rows(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   segments: Sequence[tuple[int, int]], lengths: torch.Tensor | None = None) -> BlockRows:
        """Like ``hidden_samples``, but a runner may leave the token-wise tail of the pass undone until
        ``rows`` asks for the (block, position) pairs a caller reads."""
        return BlockRows(self.hidden_samples(states, noise_embedding, anchors, segments, lengths))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


class BlockRows:
    """Drafter hidden states of a batch of blocks, read by (block, position) pairs."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden

    def rows(self, block: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[..., hidden] at ``(block, position)`` (index tensors broadcast together)."""
        return self.hidden[block, position]


class FastRunner(DraftRunner):
    """Our ``DFlashDrafter``: context K/V once per sample, blocks of many samples per forward."""

    def __init__(self, drafter: DFlashDrafter, attn_mem_bytes: int = 512 << 20):
        self.drafter = drafter
        self.spec = drafter.spec
        self.attn_mem_bytes = attn_mem_bytes

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def prepare(self, features: torch.Tensor) -> Any:
        return self.drafter.context_kv(features)

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.drafter.context_bytes_per_token(dtype)

    def hidden(self, state: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.hidden_samples([state], noise_embedding, anchors, [(0, anchors.shape[0])], lengths)

    def hidden_samples(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       segments: Sequence[tuple[int, int]], lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.drafter.forward_samples(states, noise_embedding, anchors, segments, lengths, self.attn_mem_bytes)

    def block_rows(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   segments: Sequence[tuple[int, int]], lengths: torch.Tensor | None = None) -> BlockRows:
        # The last layer's o_proj, MLP and norms run later, on the positions read (DeferredBlocks).
        return self.drafter.forward_samples(states, noise_embedding, anchors, segments, lengths, self.attn_mem_bytes,
                                            defer_last=True)


class ReferenceRunner(DraftRunner):
    """Any module or function with the reference forward signature
    ``f(target_hidden=[1, p, F], noise_embedding=[1, L, H], position_ids=[1, p + L]) -> [1, L, H]``.

    One call per anchor, as the reference loop makes: exact for any implementation, not fast.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], spec: DrafterSpec, dtype: torch.dtype | None = None):
        self.fn = fn
        self.spec = spec
        self._dtype = dtype or torch.float32

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        # The state is the context features themselves, stored in the runner's dtype (not ``dtype``).
        features = len(self.spec.target_layer_ids) * self.spec.target_hidden_size
        return tokens * features * self.dtype.itemsize

    def hidden(self, state: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        n = noise_embedding.shape[1]
        out = noise_embedding.new_zeros(noise_embedding.shape)
        for i, p in enumerate(anchors.tolist()):
            m = n if lengths is None else int(lengths[i])
            pos = torch.arange(p + m, device=noise_embedding.device)[None]
            h = self.fn(target_hidden=state[None, :p], noise_embedding=noise_embedding[i:i + 1, :m], position_ids=pos)
            out[i, :m] = h[0, -m:]
        return out


def _drafter_config(module: Any) -> Any:
    return getattr(module, "config", None)


def adopt_reference_module(module: nn.Module) -> DFlashDrafter | None:
    """Our fast drafter sharing (not copying) the weights of a module in the DFlash layout, if it is one."""
    config = _drafter_config(module)
    if config is None:
        return None
    state = module.state_dict()
    with torch.device("meta"):
        try:
            ours = DFlashDrafter(config)
        except Exception:
            return None
    if set(ours.state_dict()) != set(state):
        return None
    ours.load_state_dict(state, assign=True, strict=True)
    param = next(iter(state.values()))
    # Non-persistent buffers (rotary inv_freq) are not in a state dict: rebuild them for real.
    ours.rotary_emb = type(ours.rotary_emb)(config).to(param.device)
    return ours


def as_runner(drafter: Any, spec: DrafterSpec | None = None, attn_mem_bytes: int = 512 << 20) -> DraftRunner:
    """Pick the fastest exact way to drive ``drafter`` (our class, a module in our layout, or a callable)."""
    if isinstance(drafter, DraftRunner):
        return drafter
    if isinstance(drafter, DFlashDrafter):
        return FastRunner(drafter, attn_mem_bytes)
    if isinstance(drafter, nn.Module):
        adopted = adopt_reference_module(drafter)
        if adopted is not None:
            return FastRunner(adopted, attn_mem_bytes)
    spec = spec or DrafterSpec.of(drafter)
    dtype = None
    if isinstance(drafter, nn.Module):
        p = next(drafter.parameters(), None)
        dtype = p.dtype if p is not None else None
    return ReferenceRunner(drafter, spec, dtype)


# ---------------------------------------------------------------------------
# Output head, reduced on the fly
# ---------------------------------------------------------------------------

@dataclass
class HeadOutputs:
    argmax: torch.Tensor  # [N]
    topk_ids: torch.Tensor | None  # [N, K]
    topk_logprobs: torch.Tensor | None  # [N, K] float32
    overlap: torch.Tensor | None  # [N] sum_x min(p_target(x), q_draft(x)) over the target's stored top-K


def head_rows(vocab: int, mem_bytes: int) -> int:
    """Rows per head call so that a chunk's logits stay under ``mem_bytes``: the matmul's output, its
    float32 copy and one float32 temporary (soft-cap, log-sum-exp) of [rows, vocab] each."""
    return max(1, mem_bytes // (vocab * 4 * 3))


def apply_head(hidden: torch.Tensor, lm_head: torch.Tensor, spec: DrafterSpec, k: int,
               mem_bytes: int = 512 << 20, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> HeadOutputs:
    """Logits ``lm_head(hidden) * output_multiplier`` (soft-capped if configured) in row chunks.

    The matmul runs in the head's own dtype, outside any autocast: autocast would otherwise cast the
    whole [vocab, hidden] head at every call (a transient copy of the largest tensor there is)."""
    n = hidden.shape[0]
    vocab = lm_head.shape[0]
    rows = head_rows(vocab, mem_bytes)
    k = min(k, vocab)
    am, ids, lps, ovl = [], [], [], []
    hidden = hidden.to(lm_head.dtype)
    for i in range(0, n, rows):
        with torch.autocast(hidden.device.type, enabled=False):
            logits = draft_logits(hidden[i:i + rows], lm_head, spec)
        am.append(logits.argmax(dim=-1))
        if k > 0 or target_topk is not None:
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        if k > 0:
            v, j = torch.topk(logits, k, dim=-1)
            ids.append(j)
            lps.append(v - lse)
        if target_topk is not None:
            t_ids, t_lp = target_topk[0][i:i + rows], target_topk[1][i:i + rows]
            q = torch.exp(logits.gather(-1, t_ids.clamp(min=0)) - lse)
            p = torch.exp(t_lp.float())
            ovl.append(torch.where(t_ids >= 0, torch.minimum(p, q), torch.zeros_like(p)).sum(-1))
        del logits
    cat = torch.cat
    return HeadOutputs(cat(am), cat(ids) if ids else None, cat(lps) if lps else None, cat(ovl) if ovl else None)


# ---------------------------------------------------------------------------
# Demand-driven evaluation
# ---------------------------------------------------------------------------

@dataclass
class SampleResult:
    id: str
    category: str
    acceptance_lengths: list[int]
    ddtree: dict[int, list[int]] = field(default_factory=dict)
    anchors: int = 0  # anchors in this sample's statistics set
    # The drafter's block (argmax per depth) at each of the first cycles, when asked (keep_drafts).
    drafts: list[list[int]] | None = None
    anchors_drafted: int = 0  # distinct anchors the drafter ran at
    anchors_needed: int = 0  # distinct anchors the walks visited or the statistics set holds
    # Per greedy cycle: drafts equal to the target's tokens before the stop / max_new_tokens cut (only
    # tokens the cache knows can match), SGLang's "correct drafts" (served.py).
    correct_drafts: list[int] = field(default_factory=list)


def block_embeddings(tokens: torch.Tensor, anchors: torch.Tensor, length: int, spec: DrafterSpec,
                     embed: torch.Tensor) -> torch.Tensor:
    """Input embeddings of blocks at ``anchors``: the verified token, then mask tokens."""
    ids = torch.full((anchors.numel(), length), spec.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[anchors]
    emb = torch.nn.functional.embedding(ids, embed)
    return emb * spec.input_embedding_scale if spec.input_embedding_scale != 1.0 else emb


def stats_anchors(bounds: SampleBounds, stride: int) -> range:
    """The fixed anchor-statistics set: every ``stride``-th anchor from ``prompt_len``."""
    return bounds.anchors[::stride]


@dataclass
class _Live:
    """One sample while it is being evaluated."""

    id: str
    category: str
    bounds: SampleBounds
    state: Any
    stats: range
    walks: list[Walk]
    # anchor -> produced of a cycle there, per walk (greedy first, then each DDTree budget)
    known: dict[int, tuple[int, ...]] = field(default_factory=dict)
    correct: dict[int, int] = field(default_factory=dict)  # anchor -> greedy leading matches before any cut
    rows: dict[int, list[int]] | None = None  # anchor -> argmax block (keep_drafts only)
    window: list[int] = field(default_factory=list)  # per walk: anchors to draft from its position on
    ones: list[int] = field(default_factory=list)  # per walk kind: drafted anchors whose cycle produced one token


class _Wave:
    """The samples evaluated together: flat token / stop / top-K tables indexed by per-sample offsets."""

    def __init__(self, lives: list[_Live], tokens: list[torch.Tensor], topk: list[tuple[torch.Tensor, torch.Tensor]
                 | None], stop_token_ids: Sequence[int], device: torch.device):
        self.lives = lives
        lens = [t.shape[0] for t in tokens]
        self.offset = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)
        self.length = torch.tensor(lens, device=device)
        self.tokens = torch.cat(tokens).to(device)
        self.next_stop = torch.cat([next_stop_positions(t, stop_token_ids) for t in tokens]).to(device)
        self.has_stops = bool(stop_token_ids)
        self.loop_end = torch.tensor([lv.bounds.loop_end for lv in lives], device=device)
        self.known_end = torch.tensor([lv.bounds.known_end for lv in lives], device=device)
        self.prompt_len = torch.tensor([lv.bounds.prompt_len for lv in lives], device=device)
        self.topk = None
        if any(t is not None for t in topk):
            k = max(t[0].shape[1] for t in topk if t is not None)
            ids, lps = [], []
            for t, n in zip(topk, lens, strict=True):
                # Samples without stored top-K get ids -1: they add nothing to the overlap.
                i = torch.full((n, k), -1, dtype=torch.long) if t is None else t[0].long()
                lp = torch.zeros((n, k)) if t is None else t[1].float()
                ids.append(torch.nn.functional.pad(i, (0, k - i.shape[1]), value=-1))
                lps.append(torch.nn.functional.pad(lp, (0, k - lp.shape[1])))
            self.topk = (torch.cat(ids).to(device), torch.cat(lps).to(device))


def _grow(window: int, one_token_share: float, consumed: bool, cap: int) -> int:
    """Next lookahead of a walk: anchors drafted from its position on (itself included).

    A walk at p visits p + 1 only if its cycle at p produces one token. When the sample's drafts so
    far say that is nearly certain for this kind of walk (a one-token share of at least 0.9) and
    the walk used its whole window last round (every cycle in it produced one token), the window
    doubles; otherwise it is 1: only the anchor the walk needs. So a weak drafter (tau ~ 1) gets a few large
    rounds instead of one round per cycle, while a useful drafter never drafts an anchor it may skip
    (``anchors_drafted / anchors_needed`` stays near 1).
    """
    if consumed and one_token_share >= 0.9:
        return min(cap, 2 * window)
    return 1


class _Drafting:
    """Drafts (sample, anchor) requests of a wave and scores them: per-walk ``produced`` values kept per
    sample, anchor statistics added to ``counts`` for anchors of the statistics set."""

    def __init__(self, runner: DraftRunner, head: TargetHead, spec: DrafterSpec, budgets: tuple[int, ...],
                 counts: EvalCounts, stride: int, head_mem_bytes: int, max_blocks: int, tail_blocks: str):
        self.runner, self.head, self.spec, self.budgets = runner, head, spec, budgets
        self.tail_blocks = tail_blocks
        self.counts, self.stride, self.head_mem_bytes, self.max_blocks = counts, stride, head_mem_bytes, max_blocks

    def run(self, wave: _Wave, requests: list[tuple[int, int]]) -> None:
        requests.sort()
        for i in range(0, len(requests), self.max_blocks):
            self._chunk(wave, requests[i:i + self.max_blocks])

    def _chunk(self, wave: _Wave, requests: list[tuple[int, int]]) -> None:
        spec, head = self.spec, self.head
        dev = head.embed_tokens.device
        n, d = spec.block_size, spec.block_size - 1
        who = [w for w, _ in requests]
        segments, lives = [], []
        for w in sorted(set(who)):
            lo = who.index(w)
            segments.append((lo, lo + who.count(w)))
            lives.append(wave.lives[w])
        sample = torch.tensor(who, device=dev)
        anchors = torch.tensor([p for _, p in requests], device=dev)
        base = wave.offset[sample]
        lengths = block_lengths(wave.loop_end[sample], anchors, n, self.tail_blocks)
        emb = block_embeddings(wave.tokens, base + anchors, n, spec, head.embed_tokens).to(self.runner.dtype)
        short = lengths if bool((lengths < n).any()) else None
        blocks = self.runner.block_rows([lv.state for lv in lives], emb, anchors, segments, short)
        depth = torch.arange(1, d + 1, device=dev)[None, :]
        pos = anchors[:, None] + depth  # positions of depths 1..D
        last = (wave.length[sample] - 1)[:, None]
        target = wave.tokens[base[:, None] + torch.minimum(pos, last)]
        target = torch.where(pos < wave.known_end[sample][:, None], target, -1)
        tk = None
        if wave.topk is not None:
            # The target's distribution for the token at p + k sits at position p + k - 1.
            at = (base[:, None] + torch.minimum(pos - 1, last)).reshape(-1)
            tk = (wave.topk[0][at], wave.topk[1][at])
        sel = (anchors - wave.prompt_len[sample]) % self.stride == 0  # rows of the anchor-statistics set
        keep_rows = any(lv.rows is not None for lv in lives)
        out = None
        if self.budgets or keep_rows or bool(sel.all()):
            every = torch.arange(len(requests), device=dev)[:, None]
            flat = blocks.rows(every, depth).reshape(len(requests) * d, -1)
            out = apply_head(flat, head.lm_head, spec, max(self.budgets, default=0), self.head_mem_bytes, tk)
            raw, overlap = out.argmax.view(-1, d), None if out.overlap is None else out.overlap.view(-1, d)
        else:
            raw, overlap = self._greedy_head(blocks, target, sel, tk)
        # Depths past a (tail) block's length get values that never match or score: -2, -inf, 0.
        inside = depth < lengths[:, None]
        argmax = torch.where(inside, raw, -2)
        accepted = leading_matches(argmax, target)
        first_stop = None
        if wave.has_stops:
            nxt = base + torch.minimum(anchors + 1, wave.length[sample] - 1)
            first_stop = wave.next_stop[nxt]
        loop_end = wave.loop_end[sample]
        produced = [cut_produced(accepted, anchors, loop_end, first_stop)]
        if self.budgets:
            assert out is not None
            kk = out.topk_ids.shape[-1]
            top_ids = torch.where(inside[..., None], out.topk_ids.view(-1, d, kk), -2)
            top_lp = torch.where(inside[..., None], out.topk_logprobs.view(-1, d, kk), float("-inf"))
            tree = ddtree_accepted(top_ids, top_lp, lengths - 1, target, max(self.budgets))
            produced += [cut_produced(tree[:, b - 1], anchors, loop_end, first_stop) for b in self.budgets]
        table = torch.stack(produced, dim=1)  # [N, walks]
        rows = argmax.tolist() if keep_rows else None
        depths = (lengths - 1).tolist() if keep_rows else None
        for r, ((w, p), vals, a) in enumerate(zip(requests, table.tolist(), accepted.tolist(), strict=True)):
            lv = wave.lives[w]
            lv.known[p] = tuple(vals)
            lv.correct[p] = a
            for j, v in enumerate(vals):
                lv.ones[j] += v == 1
            if lv.rows is not None:
                lv.rows[p] = rows[r][: depths[r]]
        # Anchor statistics on the fixed set only.
        if bool(sel.any()):
            valid = inside & (target >= 0)
            self.counts.add_anchors(accepted[sel], produced[0][sel], valid[sel], (argmax == target)[sel])
            if overlap is not None:
                alpha = torch.where(valid, overlap, 0.0)[sel]
                self.counts.add_t1(torch.cumprod(alpha.double(), dim=1).sum(dim=1))

    def _greedy_head(self, blocks: BlockRows, target: torch.Tensor, sel: torch.Tensor,
                     tk: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy-only argmax [N, D]: every depth for the statistics rows ``sel``; for the others only as
        deep as the leading matches reach (the replay reads depth k only when depths 1..k-1 matched),
        -2 past that. The head (and the last layer's token-wise tail, ``BlockRows``) is most of a
        block's cost, and tau ~ 4 reads about a third of it. The live rows go a few depths per head
        call, about ``_HEAD_ROWS`` rows a call: a call on a handful of rows costs as much as reading
        the head matrix once. Returns the argmax and, for ``sel`` rows when ``tk`` is given, the
        temperature-1 overlap."""
        n, d = target.shape
        head, spec = self.head, self.spec
        dev = target.device
        raw = torch.full((n, d), -2, dtype=torch.long, device=dev)
        overlap = None
        rows = sel.nonzero()[:, 0]
        if rows.numel():
            sub = None if tk is None else tuple(t.view(n, d, -1)[rows].reshape(rows.numel() * d, -1) for t in tk)
            hid = blocks.rows(rows[:, None], torch.arange(1, d + 1, device=dev)[None, :])
            out = apply_head(hid.reshape(rows.numel() * d, -1), head.lm_head, spec, 0, self.head_mem_bytes, sub)
            raw[rows] = out.argmax.view(-1, d)
            if out.overlap is not None:
                overlap = torch.zeros((n, d), device=dev)
                overlap[rows] = out.overlap.view(-1, d)
        live = (~sel).nonzero()[:, 0]
        k = 0
        while k < d and live.numel():
            c = min(d - k, max(1, _HEAD_ROWS // live.numel()))
            hid = blocks.rows(live[:, None], torch.arange(k + 1, k + c + 1, device=dev)[None, :])
            # Row-chunked like the statistics rows: at tau ~ 1 every block is live, and a call on all of
            # them at once would hold [max_blocks, vocab] logits (1 GB at the real vocabulary).
            am = apply_head(hid.reshape(live.numel() * c, -1), head.lm_head, spec, 0, self.head_mem_bytes)
            am = am.argmax.view(-1, c)
            lead = leading_matches(am, target[live, k:k + c])
            # Depths up to the first miss are read (the miss decides the cycle); the rest stay -2.
            raw[live, k:k + c] = torch.where(torch.arange(c, device=dev)[None, :] <= lead[:, None], am, -2)
            live = live[lead == c]
            k += c
        return raw, overlap


def _advance(lv: _Live, cap: int) -> None:
    """Move every walk of a sample as far as the drafted anchors allow; update its lookahead.

    The lookahead depends on this sample's drafts only, so what is drafted for a sample does not
    depend on which other samples share its evaluation (or its rank under DDP).
    """
    seen = max(len(lv.known), 1)
    for j, walk in enumerate(lv.walks):
        start, cycles = walk.p, len(walk.lengths)
        while walk.anchor is not None and walk.anchor in lv.known:
            walk.advance(lv.known[walk.anchor][j])
        w = lv.window[j]
        consumed = walk.p - start == w and len(walk.lengths) - cycles == w  # w one-token cycles
        lv.window[j] = _grow(w, lv.ones[j] / seen, consumed, cap)


def _requests(wave: _Wave, first: bool) -> list[tuple[int, int]]:
    out: set[tuple[int, int]] = set()
    for w, lv in enumerate(wave.lives):
        if first:
            out.update((w, p) for p in lv.stats if p not in lv.known)
        last = lv.bounds.anchors.stop
        for j, walk in enumerate(lv.walks):
            p = walk.anchor
            if p is not None:
                out.update((w, q) for q in range(p, max(p + 1, min(last, p + lv.window[j]))) if q not in lv.known)
    return list(out)


def _anchors_in_order(lengths: Sequence[int], start: int) -> list[int]:
    out, p = [], start
    for k in lengths:
        out.append(p)
        p += k
    return out


def _visited(lengths: Sequence[int], start: int) -> set[int]:
    return set(_anchors_in_order(lengths, start))


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
    tail_blocks: str = "served"
    head_dtype: str = ""  # the dtype the output head computed in

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


def bounds_for(sample: CachedSample, manifest: Manifest) -> SampleBounds:
    e = sample.entry
    last = int(sample.input_ids[-1]) if e.total_len > 0 else None
    return sample_bounds(e.prompt_len, e.total_len, e.valid_len, manifest.max_new_tokens, last,
                         manifest.stop_token_ids)


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


def evaluate(cache: StateCache, drafter: Any, head: TargetHead | None = None, *,
             sample_ids: Iterable[str] | None = None, budgets: Sequence[int] = DEFAULT_BUDGETS,
             anchor_stride: int = 1, device: torch.device | str | None = None,
             autocast_dtype: torch.dtype | None = None, spec: DrafterSpec | None = None, verify: bool = False,
             progress: bool = False, attn_mem_bytes: int = 512 << 20, head_mem_bytes: int = 512 << 20,
             context_mem_bytes: int = 4 << 30, max_blocks: int = 1024, keep_drafts: int = 0,
             tail_blocks: str = "served", block_size: int | None = None) -> EvalReport:
    """Score ``drafter`` on ``cache``: exact greedy replay, DDTree per budget, anchor statistics.

    ``anchor_stride`` picks the anchor-statistics set (per-depth acceptance, ``specforge/acc``,
    ``all_anchor_tau``, the chain and temperature-1 estimates): every ``anchor_stride``-th anchor from
    ``prompt_len``, the same at every evaluation; 1 = every anchor. The replays are exact whatever
    the stride. ``head`` defaults to the cache's exported target head. ``autocast_dtype`` (e.g.
    bfloat16 on GPU) trades exactness for speed; exactness tests use float32. ``keep_drafts`` > 0
    keeps, per sample, the draft blocks of that many first cycles (``SampleResult.drafts``).
    ``tail_blocks`` (``replay.TAIL_BLOCKS``): "served" drafts full blocks up to the end, as SGLang;
    "reference" shortens the last blocks, as ``dflash_generate`` (docs/method.md, "Tail blocks").
    ``block_size`` (``replay.check_block_size``: 2 .. the drafter's, None = the drafter's) is the block
    every cycle drafts, as a server started with a smaller block does; the tail rules and the
    per-depth statistics follow it (``EvalReport.block_size``).

    The head runs in its own dtype: a head loaded here (``head`` None) is read in the compute dtype
    (``autocast_dtype``, else the drafter's), so a bf16 evaluation never holds a float32 head; a
    given head is used as it is (``EvalReport.head_dtype`` says which).

    Memory model (``cost.memory_bound`` computes it; the README's memory section gives the figures),
    for the Qwen3.6-27B drafter in bf16 (5 layers, hidden 5120, vocabulary 248,320, block 16):

    - drafter weights: 1.73 B parameters, 3.5 GB;
    - target embedding + output head, in the compute dtype: 2 x 248,320 x 5,120 x 2 bytes = 5.1 GB
      (2.5 GB when tied);
    - context K/V, 5 layers x 2 x 8 KV heads x 128 x 2 bytes = 20 KiB per position: 42 MB per
      2,048-token sample, 2.7 GB for 64; samples are evaluated in waves whose K/V fit
      ``context_mem_bytes`` together (4 GiB default: 64 such samples are one wave);
    - bounded buffers: a round drafts at most ``max_blocks`` blocks per pass (token-wise activations
      ~ ``max_blocks`` x block_size x (3 x intermediate + 4 x hidden): 2.4 GB at 1,024 blocks in bf16); attention
      temporaries stay under ``attn_mem_bytes`` per chunk, and every vocabulary-sized tensor (the
      head's logits, greedy and statistics rows alike) under ``head_mem_bytes``.
    """
    start = time.perf_counter()
    check_tail_blocks(tail_blocks)
    if anchor_stride < 1:
        raise ValueError(f"anchor_stride must be >= 1 (1 = every anchor), got {anchor_stride}")
    runner = as_runner(drafter, spec, attn_mem_bytes)
    spec = runner.spec
    cache.check_drafter(spec.as_cache_check())
    block = check_block_size(block_size, spec.block_size)
    drafting_spec = dataclasses.replace(spec, block_size=block)  # what the cycles draft; the report keeps spec
    if device is None:
        p = getattr(getattr(runner, "drafter", None), "fc", None)
        device = p.weight.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    if head is None:
        head = cache.load_head(device=device, dtype=autocast_dtype or runner.dtype)
    elif head.embed_tokens.device != device:
        head = head.to(device)
    budgets = tuple(sorted({int(b) for b in budgets}))
    if any(b < 1 for b in budgets):
        raise ValueError(f"DDTree budgets must be positive, got {budgets}")
    ids = list(sample_ids) if sample_ids is not None else [s.id for s in cache.samples]
    categories = cache.categories
    counts = EvalCounts(block, budgets, categories)
    manifest = cache.manifest
    stops = frozenset(manifest.stop_token_ids)
    drafting = _Drafting(runner, head, drafting_spec, budgets, counts, anchor_stride, head_mem_bytes, max_blocks, tail_blocks)
    state_dtype = autocast_dtype or runner.dtype
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="evaluating", unit="sample")
    results: dict[str, SampleResult] = {}
    with torch.no_grad(), autocast_context(device, autocast_dtype):
        for wave_ids in _waves(cache, ids, runner, state_dtype, context_mem_bytes):
            wave = _load_wave(cache, wave_ids, runner, manifest, stops, anchor_stride, len(budgets), device,
                              verify, keep_drafts > 0)
            first = True
            while True:
                for lv in wave.lives:
                    _advance(lv, 8 * block)
                requests = _requests(wave, first)
                first = False
                if not requests:
                    break
                drafting.run(wave, requests)
            for lv in wave.lives:
                results[lv.id] = _finish(lv, budgets, keep_drafts)
                lv.state = None  # the context K/V of this wave can go
            if bar is not None:
                bar.update(len(wave_ids))
    if bar is not None:
        bar.close()
    samples = [results[sid] for sid in ids]
    for r in samples:  # in sample order: the integer counts do not depend on waves or rounds
        counts.add_cycles(r.acceptance_lengths, r.category)
        for i, b in enumerate(budgets):
            counts.add_ddtree(i, r.ddtree[b])
        counts.add_cost(r.anchors_drafted, r.anchors_needed)
    return EvalReport(counts, samples, time.perf_counter() - start, spec, budgets, anchor_stride, tail_blocks,
                      str(head.lm_head.dtype).removeprefix("torch."))


def _load_wave(cache: StateCache, ids: list[str], runner: DraftRunner, manifest: Manifest, stops: frozenset[int],
               stride: int, n_budgets: int, device: torch.device, verify: bool, keep_rows: bool) -> _Wave:
    lives, tokens, topk = [], [], []
    for sid in ids:
        sample = cache.load(sid, verify=verify)
        bounds = bounds_for(sample, manifest)
        tok_list = sample.input_ids.tolist()
        state = None
        if len(bounds.anchors):
            # Block at p sees context rows [0, p): the last anchor bounds the rows any block needs.
            rows = bounds.anchors[-1]
            state = runner.prepare(sample.hidden[:rows].to(device=device, dtype=runner.dtype))
        walks = [Walk(bounds, tok_list, stops) for _ in range(1 + n_budgets)]
        lives.append(_Live(sid, sample.entry.category, bounds, state, stats_anchors(bounds, stride), walks,
                           rows={} if keep_rows else None, window=[1] * len(walks), ones=[0] * len(walks)))
        tokens.append(sample.input_ids.long())
        topk.append(None if sample.topk_ids is None else (sample.topk_ids, sample.topk_logprobs))
        del sample  # the features are no longer needed: the state holds what the drafter uses
    return _Wave(lives, tokens, topk, sorted(stops), device)


def _finish(lv: _Live, budgets: tuple[int, ...], keep_drafts: int) -> SampleResult:
    greedy = lv.walks[0].lengths
    res = SampleResult(lv.id, lv.category, greedy, {b: w.lengths for b, w in zip(budgets, lv.walks[1:], strict=True)},
                       len(lv.stats))
    res.correct_drafts = [lv.correct[p] for p in _anchors_in_order(greedy, lv.bounds.prompt_len)]
    if keep_drafts and lv.rows is not None:
        res.drafts = [lv.rows[p] for p in sorted(_visited(greedy[:keep_drafts], lv.bounds.prompt_len))]
    needed = set(lv.stats)
    for w in lv.walks:
        needed |= _visited(w.lengths, lv.bounds.prompt_len)
    res.anchors_drafted = len(lv.known)
    res.anchors_needed = len(needed)
    return res
