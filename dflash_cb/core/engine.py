"""The evaluation engine: drafts only where the replays and the anchor statistics look, batched
across samples (the method, and why the replay is exact: docs/method.md).

The replays (the greedy walk and one walk per DDTree budget, for every sample) advance in rounds.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..cache.manifest import Manifest, SampleEntry
from ..cache.states import CachedSample, StateCache, TargetHead
from ..cache.target import DTYPES
from ..common import arguments as check
from ..common.errors import DFlashCBError
from .anchor_sets import DEFAULT_ANCHOR_SEED, check_anchor_offsets, offsets_for, strided
from .ddtree import ddtree_accepted
from .metrics import TAU, AnchorCounts, EvalCounts, count_anchors, summarize
from .model import DFlashDrafter, DrafterSpec, draft_logits, specforge_mask_difference
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

    def specforge_difference(self, block_size: int) -> str | None:
        """Why SpecForge 0.2.0 trains this drafter under other masks than it is served with at ``block_size``
        (None: the same masks, or nothing known of them; ``model.specforge_mask_difference``)."""
        return None

    def specforge_rows(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       segments: Sequence[tuple[int, int]]) -> BlockRows:
        """Full blocks under SpecForge's training masks (what its DFlash accuracy scores). A runner that cannot
        change its masks runs its own: the engine asks it only when they are SpecForge's (``has_specforge_masks``)."""
        return self.block_rows(states, noise_embedding, anchors, segments)

    # Whether ``specforge_rows`` can run SpecForge's masks where they differ from the served ones.
    has_specforge_masks = False


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

    def specforge_difference(self, block_size: int) -> str | None:
        return self.drafter.specforge_difference(block_size)

    def specforge_rows(self, states: Sequence[Any], noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       segments: Sequence[tuple[int, int]]) -> BlockRows:
        return self.drafter.forward_samples(states, noise_embedding, anchors, segments, None, self.attn_mem_bytes,
                                            defer_last=True, masks="specforge")

    has_specforge_masks = True


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

    def specforge_difference(self, block_size: int) -> str | None:
        config = _drafter_config(self.fn)
        return None if config is None else specforge_mask_difference(config, block_size)

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
    anchors: int = 0  # anchors in this sample's statistics set (at the evaluation's anchor_stride)
    # Per statistics stride (the evaluation's anchor_stride and each extra one): this sample's offset
    # (anchor_sets.anchor_offset) and its anchor-statistic counts over anchors[offset::stride].
    anchor_offsets: dict[int, int] = field(default_factory=dict)
    anchor_counts: dict[int, AnchorCounts] = field(default_factory=dict)
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


def stats_anchors(bounds: SampleBounds, stride: int, offset: int = 0) -> range:
    """One sample's anchor-statistics set: every ``stride``-th anchor from its ``offset``-th
    (``anchor_sets``: the offset is drawn per sample, so the first anchor is not always in)."""
    return strided(bounds.anchors, stride, offset)


@dataclass
class _Live:
    """One sample while it is being evaluated."""

    id: str
    category: str
    bounds: SampleBounds
    state: Any
    offsets: tuple[int, ...]  # per statistics stride (``_Drafting.strides``): this sample's offset
    stats: list[int]  # the union of its statistics sets, in anchor order
    walks: list[Walk]
    has_topk: bool = False
    # anchor -> produced of a cycle there, per walk (greedy first, then each DDTree budget)
    known: dict[int, tuple[int, ...]] = field(default_factory=dict)
    correct: dict[int, int] = field(default_factory=dict)  # anchor -> greedy leading matches before any cut
    rows: dict[int, list[int]] | None = None  # anchor -> argmax block (keep_drafts only)
    window: list[int] = field(default_factory=list)  # per walk: anchors to draft from its position on
    ones: list[int] = field(default_factory=list)  # per walk kind: drafted anchors whose cycle produced one token
    # Scored statistics anchors, per drafting chunk: (anchors [r], int16 table [r, 2 + 3 D] of accepted, produced
    # and per depth valid, match, SpecForge match; t1 [r] or None).
    scored: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


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
        self.stat_offsets = torch.tensor([lv.offsets for lv in lives], device=device).view(len(lives), -1)
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
    sample, and, for anchors of a statistics set, their per-anchor statistics (``_Live.scored``).

    ``specforge``: "served" when SpecForge's masks are the served ones (its accuracy comes from the same
    drafts, but for shortened tail blocks, which it drafts again in full), "own pass" when they differ (every
    statistics anchor is drafted again under its masks), "none" when the runner cannot run them.
    """

    def __init__(self, runner: DraftRunner, head: TargetHead, spec: DrafterSpec, budgets: tuple[int, ...],
                 strides: tuple[int, ...], head_mem_bytes: int, max_blocks: int, tail_blocks: str, specforge: str):
        self.runner, self.head, self.spec, self.budgets = runner, head, spec, budgets
        self.tail_blocks, self.specforge = tail_blocks, specforge
        self.strides = torch.tensor(strides, device=head.embed_tokens.device)
        self.head_mem_bytes, self.max_blocks = head_mem_bytes, max_blocks

    def run(self, wave: _Wave, requests: list[tuple[int, int]]) -> None:
        requests.sort()
        for i in range(0, len(requests), self.max_blocks):
            self._chunk(wave, requests[i:i + self.max_blocks])

    def _chunk(self, wave: _Wave, requests: list[tuple[int, int]]) -> None:
        spec, head = self.spec, self.head
        dev = head.embed_tokens.device
        n, d = spec.block_size, spec.block_size - 1
        who = [w for w, _ in requests]
        order, segments = _segments(who)
        lives = [wave.lives[w] for w in order]
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
        # Rows of a statistics set: anchors[offset::stride] of their sample, for any of the strides.
        rel = (anchors - wave.prompt_len[sample])[:, None] - wave.stat_offsets[sample]
        sel = (rel % self.strides[None, :] == 0).any(dim=1)
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
        if bool(sel.any()):
            self._keep_statistics(wave, sample, anchors, lengths, emb, sel, inside & (target >= 0), target, argmax,
                                  accepted, produced[0], overlap)

    def _keep_statistics(self, wave: _Wave, sample: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor,
                         emb: torch.Tensor, sel: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
                         argmax: torch.Tensor, accepted: torch.Tensor, produced: torch.Tensor,
                         overlap: torch.Tensor | None) -> None:
        """Per-anchor statistics of the statistics rows ``sel``, kept per sample (on the CPU, small integers):
        the sums over each stride's set are taken when the sample is finished (``_anchor_counts``)."""
        match = argmax == target
        sf_match = match
        if self.specforge != "none":
            # SpecForge drafts full blocks under its own masks: draft again where that changes the drafts.
            again = sel if self.specforge == "own pass" else sel & (lengths < self.spec.block_size)
            if bool(again.any()):
                sf_match = match.clone()
                sf_match[again] = self._specforge_argmax(wave, sample, anchors, emb, again) == target[again]
        table = torch.cat([accepted[:, None], produced[:, None], valid, match & valid, sf_match & valid], dim=1)
        rows = sel.nonzero()[:, 0]
        table = table[rows].to(device="cpu", dtype=torch.int16)
        at = anchors[rows].cpu()
        t1 = None
        if overlap is not None:
            alpha = torch.where(valid, overlap, 0.0)[rows]
            t1 = torch.cumprod(alpha.double(), dim=1).sum(dim=1).cpu()  # expected accepted at temperature 1
        who = sample[rows].cpu()
        for w in torch.unique_consecutive(who).tolist():
            m = who == w
            lv = wave.lives[w]
            lv.scored.append((at[m], table[m], t1[m] if t1 is not None and lv.has_topk else None))

    def _specforge_argmax(self, wave: _Wave, sample: torch.Tensor, anchors: torch.Tensor, emb: torch.Tensor,
                          rows: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [r, D] of the blocks ``rows`` drafted in full under SpecForge's training masks."""
        idx = rows.nonzero()[:, 0]
        order, segments = _segments(sample[idx].tolist())
        states = [wave.lives[w].state for w in order]
        d = self.spec.block_size - 1
        blocks = self.runner.specforge_rows(states, emb[idx], anchors[idx], segments)
        depth = torch.arange(1, d + 1, device=idx.device)[None, :]
        hid = blocks.rows(torch.arange(idx.numel(), device=idx.device)[:, None], depth)
        out = apply_head(hid.reshape(idx.numel() * d, -1), self.head.lm_head, self.spec, 0, self.head_mem_bytes)
        return out.argmax.view(-1, d)

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


def _segments(who: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The samples of sorted rows ``who`` and each one's rows (start, stop)."""
    order: list[int] = []
    segments: list[tuple[int, int]] = []
    for i, w in enumerate(who):
        if not order or order[-1] != w:
            order.append(w)
            segments.append((i, i + 1))
        else:
            segments[-1] = (segments[-1][0], i + 1)
    return order, segments


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
    anchor_seed: int = DEFAULT_ANCHOR_SEED
    extra_anchor_strides: tuple[int, ...] = ()
    # How ``specforge/acc`` was computed: "" when SpecForge's masks are the served ones; else why they
    # differ and that it had its own pass, or was left out (``SPECFORGE_OWN_PASS`` / ``SPECFORGE_LEFT_OUT``).
    specforge_note: str = ""

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
        return summed_counts(self.samples, c.block_size, c.budgets, c.categories, stride)


SPECFORGE_OWN_PASS = "specforge/acc is computed under SpecForge's masks, with a drafter pass of its own"
SPECFORGE_LEFT_OUT = "specforge/acc is left out: this drafter's runner cannot run SpecForge's masks"


def summed_counts(samples: Sequence[SampleResult], block_size: int, budgets: Sequence[int],
                  categories: Sequence[str], stride: int) -> EvalCounts:
    """``EvalCounts`` of scored samples, summed in their order from per-sample integers, with the anchor
    statistics of ``stride``: the same whichever samples were evaluated together (or on which rank)."""
    counts = EvalCounts(block_size, tuple(budgets), tuple(categories))
    for r in samples:
        counts.add_cycles(r.acceptance_lengths, r.category)
        for i, b in enumerate(counts.budgets):
            counts.add_ddtree(i, r.ddtree[b])
        counts.add_cost(r.anchors_drafted, r.anchors_needed)
        counts.add_anchor_counts(r.anchor_counts[stride])
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


def evaluate(cache: StateCache, drafter: Any, head: TargetHead | None = None, *,
             sample_ids: Iterable[str] | None = None, budgets: Sequence[int] = DEFAULT_BUDGETS,
             anchor_stride: int = 1, device: torch.device | str | None = None,
             autocast_dtype: torch.dtype | None = None, spec: DrafterSpec | None = None, verify: bool = False,
             progress: bool = False, attn_mem_bytes: int = 512 << 20, head_mem_bytes: int = 512 << 20,
             context_mem_bytes: int = 4 << 30, max_blocks: int = 1024, keep_drafts: int = 0,
             tail_blocks: str = "served", block_size: int | None = None, anchor_seed: int = DEFAULT_ANCHOR_SEED,
             extra_anchor_strides: Sequence[int] = (), anchor_offsets: Mapping[str, int] | None = None
             ) -> EvalReport:
    """Score ``drafter`` on ``cache``: exact greedy replay, DDTree per budget, anchor statistics.

    ``anchor_stride`` picks the anchor-statistics set (per-depth acceptance, ``specforge/acc``,
    ``all_anchor_tau``, the chain and temperature-1 estimates): per sample ``anchors[o::anchor_stride]``
    with an offset ``o = anchor_sets.anchor_offset(anchor_seed, sample id, anchor_stride)`` in
    ``[0, anchor_stride)``, the same at every evaluation whatever else is evaluated with it; 1 = every
    anchor. ``anchor_offsets`` ({sample id: offset}) replaces the drawn offsets of the samples it names
    (others keep theirs). ``extra_anchor_strides``: more statistics sets from the same pass (each with its
    own drawn offsets; what is drafted is the union); ``EvalReport.counts_at(stride)`` gives their counts.
    The replays are exact whatever the strides. ``specforge/acc`` is SpecForge 0.2.0's accuracy: when
    its training masks differ from the served ones (``model.specforge_mask_difference``), the statistics
    anchors are drafted once more under its masks (``EvalReport.specforge_note``). ``head`` defaults to the cache's exported target head. ``autocast_dtype`` (e.g.
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
    if not check.is_int(anchor_stride) or anchor_stride < 1:
        raise check.ArgumentError(f"anchor_stride must be >= 1 (1 = every anchor), got {anchor_stride!r}")
    anchor_seed = check.int_at_least("anchor_seed", anchor_seed, 0)
    extra = check.int_list("extra_anchor_strides", list(extra_anchor_strides), 1)
    strides = (anchor_stride, *sorted(set(extra) - {anchor_stride}))
    anchor_offsets = check_anchor_offsets("anchor_offsets", anchor_offsets, anchor_stride)
    runner = as_runner(drafter, spec, attn_mem_bytes)
    spec = runner.spec
    cache.check_drafter(spec.as_cache_check())
    block = check_block_size(block_size, spec.block_size)
    drafting_spec = dataclasses.replace(spec, block_size=block)  # what the cycles draft; the report keeps spec
    difference = runner.specforge_difference(block)
    specforge = "served" if difference is None else "own pass" if runner.has_specforge_masks else "none"
    note = "" if difference is None else f"{difference}: " + (
        SPECFORGE_OWN_PASS if specforge == "own pass" else SPECFORGE_LEFT_OUT)
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
    manifest = cache.manifest
    stops = frozenset(manifest.stop_token_ids)
    offsets = {s: offsets_for(ids, s, anchor_seed, anchor_offsets if s == anchor_stride else None) for s in strides}
    drafting = _Drafting(runner, head, drafting_spec, budgets, strides, head_mem_bytes, max_blocks, tail_blocks,
                         specforge)
    state_dtype = autocast_dtype or runner.dtype
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="evaluating", unit="sample")
    results: dict[str, SampleResult] = {}
    with torch.no_grad(), autocast_context(device, autocast_dtype):
        for wave_ids in _waves(cache, ids, runner, state_dtype, context_mem_bytes):
            wave = _load_wave(cache, wave_ids, runner, manifest, stops, strides, offsets, len(budgets), device,
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
                results[lv.id] = _finish(lv, budgets, keep_drafts, strides, block, specforge != "none")
                lv.state = None  # the context K/V of this wave can go
            if bar is not None:
                bar.update(len(wave_ids))
    if bar is not None:
        bar.close()
    samples = [results[sid] for sid in ids]
    # In sample order, from per-sample integers: the counts do not depend on waves, rounds or ranks.
    counts = summed_counts(samples, block, budgets, categories, anchor_stride)
    return EvalReport(counts, samples, time.perf_counter() - start, spec, budgets, anchor_stride, tail_blocks,
                      str(head.lm_head.dtype).removeprefix("torch."), anchor_seed, strides[1:], note)


def _load_wave(cache: StateCache, ids: list[str], runner: DraftRunner, manifest: Manifest, stops: frozenset[int],
               strides: tuple[int, ...], offsets: dict[int, dict[str, int]], n_budgets: int, device: torch.device,
               verify: bool, keep_rows: bool) -> _Wave:
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
        own = tuple(offsets[s][sid] for s in strides)
        stats = sorted(set().union(*(stats_anchors(bounds, s, o) for s, o in zip(strides, own, strict=True))))
        lives.append(_Live(sid, sample.entry.category, bounds, state, own, stats, walks,
                           has_topk=sample.topk_ids is not None, rows={} if keep_rows else None,
                           window=[1] * len(walks), ones=[0] * len(walks)))
        tokens.append(sample.input_ids.long())
        topk.append(None if sample.topk_ids is None else (sample.topk_ids, sample.topk_logprobs))
        del sample  # the features are no longer needed: the state holds what the drafter uses
    return _Wave(lives, tokens, topk, sorted(stops), device)


def _anchor_counts(lv: _Live, stride: int, offset: int, depths: int, specforge: bool) -> AnchorCounts:
    """The sample's counts over its statistics set at ``stride`` from its scored per-anchor rows."""
    if not lv.scored:
        return count_anchors(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, depths, dtype=torch.bool), torch.zeros(0, depths, dtype=torch.bool),
                             specforge=specforge, t1=torch.zeros(0) if lv.has_topk else None)
    at = torch.cat([a for a, _, _ in lv.scored])
    order = torch.argsort(at)  # anchor order: the float t1 sum does not depend on how rounds chunked them
    at, table = at[order], torch.cat([t for _, t, _ in lv.scored])[order].long()
    t1 = torch.cat([x for _, _, x in lv.scored])[order] if lv.has_topk and lv.scored[0][2] is not None else None
    m = (at - lv.bounds.prompt_len - offset) % stride == 0
    d = depths
    table = table[m]
    return count_anchors(table[:, 0], table[:, 1], table[:, 2:2 + d].bool(), table[:, 2 + d:2 + 2 * d].bool(),
                         table[:, 2 + 2 * d:].bool(), specforge, None if t1 is None else t1[m])


def _finish(lv: _Live, budgets: tuple[int, ...], keep_drafts: int, strides: tuple[int, ...], block_size: int,
            specforge: bool) -> SampleResult:
    greedy = lv.walks[0].lengths
    res = SampleResult(lv.id, lv.category, greedy, {b: w.lengths for b, w in zip(budgets, lv.walks[1:], strict=True)},
                       len(stats_anchors(lv.bounds, strides[0], lv.offsets[0])))
    res.anchor_offsets = dict(zip(strides, lv.offsets, strict=True))
    res.anchor_counts = {s: _anchor_counts(lv, s, o, block_size - 1, specforge)
                         for s, o in zip(strides, lv.offsets, strict=True)}
    lv.scored = []
    res.correct_drafts = [lv.correct[p] for p in _anchors_in_order(greedy, lv.bounds.prompt_len)]
    if keep_drafts and lv.rows is not None:
        res.drafts = [lv.rows[p] for p in sorted(_visited(greedy[:keep_drafts], lv.bounds.prompt_len))]
    needed = set(lv.stats)
    for w in lv.walks:
        needed |= _visited(w.lengths, lv.bounds.prompt_len)
    res.anchors_drafted = len(lv.known)
    res.anchors_needed = len(needed)
    return res
