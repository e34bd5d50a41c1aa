"""The evaluation engine: drafts at every anchor of every cached sample, then replays the loop.

For each sample the drafter runs once per anchor block, all anchors batched (each block sees
only its own context prefix), with the context projection computed once per sample. The output
head is applied in row chunks and reduced on the fly to what the metrics need (argmax, top-K
log-probs for DDTree, the temperature-1 overlap), so ``[anchors x depth x vocab]`` logits never
exist. Greedy and DDTree replays are then walks over per-anchor accepted counts (replay.py).
No Lightning, W&B or HTTP here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .ddtree import ddtree_accepted
from .metrics import TAU, EvalCounts, summarize
from .model import DFlashDrafter, DrafterSpec, draft_logits
from .replay import (
    SampleBounds,
    block_lengths,
    leading_matches,
    produced_per_anchor,
    replay_walk,
    sample_bounds,
    target_windows,
)
from .states import CachedSample, Manifest, StateCache, TargetHead

DEFAULT_BUDGETS = (16, 32, 64)


# ---------------------------------------------------------------------------
# Drafter runners: the only place that knows how a drafter is called
# ---------------------------------------------------------------------------

class DraftRunner:
    """Turns (context features, block embeddings, anchors) into drafter hidden states."""

    spec: DrafterSpec

    def prepare(self, features: torch.Tensor) -> Any:
        return features

    def hidden(self, state: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """[A, L, hidden]; ``lengths`` [A] marks blocks shorter than L (outputs past them are ignored)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


class FastRunner(DraftRunner):
    """Our ``DFlashDrafter``: context K/V once per sample, many anchors per forward."""

    def __init__(self, drafter: DFlashDrafter, attn_mem_bytes: int = 512 << 20):
        self.drafter = drafter
        self.spec = drafter.spec
        self.attn_mem_bytes = attn_mem_bytes

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def prepare(self, features: torch.Tensor) -> Any:
        return self.drafter.context_kv(features)

    def hidden(self, state: Any, noise_embedding: torch.Tensor, anchors: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        a, n, _ = noise_embedding.shape
        attn = self.drafter.layers[0].self_attn
        ctx = int(anchors.max().item())
        elem = noise_embedding.element_size()
        # Per anchor: its expanded context K and V (the fused kernel needs them per block), the mask,
        # and the kernel's own per-head temporaries.
        per_anchor = (ctx + n) * (2 * attn.num_kv_heads * attn.head_dim * elem + n + attn.num_heads * n * 4)
        chunk = max(1, self.attn_mem_bytes // max(per_anchor, 1))
        outs = [self.drafter.forward_blocks(state, noise_embedding[i:i + chunk], anchors[i:i + chunk],
                                            None if lengths is None else lengths[i:i + chunk])
                for i in range(0, a, chunk)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]


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
    if spec is None:
        config = _drafter_config(drafter)
        if config is None:
            raise TypeError("cannot tell block size, mask token and layer ids of this drafter: pass spec=DrafterSpec(...)")
        spec = DrafterSpec.from_config(config)
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


def apply_head(hidden: torch.Tensor, lm_head: torch.Tensor, spec: DrafterSpec, k: int,
               mem_bytes: int = 512 << 20, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> HeadOutputs:
    """Logits ``lm_head(hidden) * output_multiplier`` (soft-capped if configured) in row chunks."""
    n = hidden.shape[0]
    vocab = lm_head.shape[0]
    rows = max(1, mem_bytes // (vocab * 4 * 3))
    k = min(k, vocab)
    am, ids, lps, ovl = [], [], [], []
    for i in range(0, n, rows):
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
# Per-sample drafting and scoring
# ---------------------------------------------------------------------------

@dataclass
class DraftTable:
    """Per-anchor drafter outputs, padded to ``block_size - 1`` depths."""

    anchors: torch.Tensor  # [A]
    depths: torch.Tensor  # [A] drafted depths (block length - 1)
    argmax: torch.Tensor  # [A, D] (-2 past the block)
    topk_ids: torch.Tensor | None  # [A, D, K]
    topk_logprobs: torch.Tensor | None  # [A, D, K] (-inf past the block)
    overlap: torch.Tensor | None  # [A, D] (0 past the block)


@dataclass
class SampleResult:
    id: str
    category: str
    acceptance_lengths: list[int]
    ddtree: dict[int, list[int]] = field(default_factory=dict)
    anchors: int = 0
    # The drafter's block (argmax per depth) at each of the first cycles, when asked (keep_drafts).
    drafts: list[list[int]] | None = None


def block_embeddings(tokens: torch.Tensor, anchors: torch.Tensor, length: int, spec: DrafterSpec,
                     embed: torch.Tensor) -> torch.Tensor:
    ids = torch.full((anchors.numel(), length), spec.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[anchors]
    emb = torch.nn.functional.embedding(ids, embed)
    return emb * spec.input_embedding_scale if spec.input_embedding_scale != 1.0 else emb


def draft_sample(runner: DraftRunner, head: TargetHead, sample: CachedSample, bounds: SampleBounds,
                 topk: int, head_mem_bytes: int = 512 << 20, use_target_topk: bool = True) -> DraftTable:
    spec = runner.spec
    dev = head.embed_tokens.device
    n, d = spec.block_size, spec.block_size - 1
    anchors = torch.tensor(list(bounds.anchors), dtype=torch.long, device=dev)
    a = anchors.numel()
    lengths = block_lengths(anchors, bounds.loop_end, n)
    t_topk = None
    if use_target_topk and sample.topk_ids is not None:
        t_topk = (sample.topk_ids.to(dev), sample.topk_logprobs.to(dev))
    if a == 0:
        k = min(topk, head.lm_head.shape[0])
        return DraftTable(anchors, lengths - 1, torch.empty((0, d), dtype=torch.long, device=dev),
                          torch.empty((0, d, k), dtype=torch.long, device=dev) if topk else None,
                          torch.empty((0, d, k), device=dev) if topk else None,
                          torch.empty((0, d), device=dev) if t_topk is not None else None)
    tokens = sample.input_ids.to(dev)
    state = runner.prepare(sample.hidden[: int(anchors.max().item())].to(device=dev, dtype=runner.dtype))
    # One pass for all anchors: tail anchors run as shorter blocks through the padding mask.
    emb = block_embeddings(tokens, anchors, n, spec, head.embed_tokens).to(runner.dtype)
    hid = runner.hidden(state, emb, anchors, lengths if bool((lengths < n).any()) else None)[:, 1:]
    flat = hid.reshape(-1, hid.shape[-1]).to(head.lm_head.dtype)
    tk = None
    if t_topk is not None:
        # The target's distribution for the token at p + k sits at position p + k - 1.
        pos = (anchors[:, None] + torch.arange(d, device=dev)[None, :]).reshape(-1)
        pos = pos.clamp(max=t_topk[0].shape[0] - 1)
        tk = (t_topk[0][pos], t_topk[1][pos])
    out = apply_head(flat, head.lm_head, spec, topk, head_mem_bytes, tk)
    # Depths past a (tail) block's length get values that never match or score: -2, -inf, 0.
    inside = torch.arange(1, n, device=dev)[None, :] < lengths[:, None]  # [A, D]
    argmax = torch.where(inside, out.argmax.view(a, d), -2)
    top_ids = top_lp = overlap = None
    if topk:
        kk = out.topk_ids.shape[-1]
        top_ids = torch.where(inside[..., None], out.topk_ids.view(a, d, kk), -2)
        top_lp = torch.where(inside[..., None], out.topk_logprobs.view(a, d, kk), float("-inf"))
    if tk is not None:
        overlap = torch.where(inside, out.overlap.view(a, d), 0.0)
    return DraftTable(anchors, lengths - 1, argmax, top_ids, top_lp, overlap)


def cycle_drafts(table: DraftTable, bounds: SampleBounds, lengths: Sequence[int], n: int) -> list[list[int]]:
    """The draft block at the anchor of each of the first ``n`` replayed cycles (for display)."""
    out, p = [], bounds.prompt_len
    for k in lengths[:n]:
        i = p - bounds.prompt_len  # anchors are consecutive from prompt_len
        out.append(table.argmax[i, : int(table.depths[i])].tolist())
        p += k
    return out


def score_sample(table: DraftTable, sample: CachedSample, bounds: SampleBounds, spec: DrafterSpec,
                 stop_token_ids: Sequence[int], budgets: Sequence[int], counts: EvalCounts,
                 keep_drafts: int = 0) -> SampleResult:
    entry = sample.entry
    dev = table.anchors.device
    tokens = sample.input_ids.to(dev)
    tok_list = sample.input_ids.tolist()
    d = spec.block_size - 1
    result = SampleResult(entry.id, entry.category, [], {}, int(table.anchors.numel()))
    target = target_windows(tokens, table.anchors, d, bounds.known_end)
    accepted = leading_matches(table.argmax, target)
    produced = produced_per_anchor(accepted, table.anchors, tokens, bounds, stop_token_ids)
    result.acceptance_lengths = replay_walk(produced.tolist(), tok_list, bounds, stop_token_ids)
    if keep_drafts:
        result.drafts = cycle_drafts(table, bounds, result.acceptance_lengths, keep_drafts)
    counts.add_cycles(result.acceptance_lengths, entry.category)
    depth_idx = torch.arange(1, d + 1, device=dev)
    valid = (depth_idx[None, :] <= table.depths[:, None]) & (target >= 0)
    counts.add_anchors(accepted, produced, valid, table.argmax == target)
    if budgets and table.topk_ids is not None:
        tree = ddtree_accepted(table.topk_ids, table.topk_logprobs, table.depths, target, max(budgets))
        for i, b in enumerate(budgets):
            prod_b = produced_per_anchor(tree[:, b - 1], table.anchors, tokens, bounds, stop_token_ids)
            result.ddtree[b] = replay_walk(prod_b.tolist(), tok_list, bounds, stop_token_ids)
            counts.add_ddtree(i, result.ddtree[b])
    if table.overlap is not None:
        alpha = torch.where(valid, table.overlap, torch.zeros_like(table.overlap))
        counts.add_t1(torch.cumprod(alpha.double(), dim=1).sum(dim=1))
    return result


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

    @property
    def summary(self) -> dict[str, float]:
        return summarize(self.counts)

    @property
    def tau(self) -> float:
        return self.summary[TAU]


def bounds_for(sample: CachedSample, manifest: Manifest) -> SampleBounds:
    e = sample.entry
    last = int(sample.input_ids[-1]) if e.total_len > 0 else None
    return sample_bounds(e.prompt_len, e.total_len, e.valid_len, manifest.max_new_tokens, last,
                         manifest.stop_token_ids)


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate(cache: StateCache, drafter: Any, head: TargetHead | None = None, *,
             sample_ids: Iterable[str] | None = None, budgets: Sequence[int] = DEFAULT_BUDGETS,
             device: torch.device | str | None = None, autocast_dtype: torch.dtype | None = None,
             spec: DrafterSpec | None = None, verify: bool = False, progress: bool = False,
             attn_mem_bytes: int = 512 << 20, head_mem_bytes: int = 512 << 20,
             keep_drafts: int = 0) -> EvalReport:
    """Score ``drafter`` on ``cache``: exact greedy replay, DDTree, all-anchor statistics.

    ``head`` defaults to the cache's exported target head. ``autocast_dtype`` (e.g. bfloat16 on
    GPU) trades exactness for speed; exactness tests use float32. ``keep_drafts`` > 0 keeps, per
    sample, the draft blocks of that many first cycles (``SampleResult.drafts``, for display).
    """
    start = time.perf_counter()
    runner = as_runner(drafter, spec, attn_mem_bytes)
    spec = runner.spec
    cache.check_drafter(spec.as_cache_check())
    if device is None:
        p = getattr(getattr(runner, "drafter", None), "fc", None)
        device = p.weight.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    if head is None:
        head = cache.load_head(device=device, dtype=runner.dtype)
    elif head.embed_tokens.device != device:
        head = head.to(device)
    budgets = tuple(sorted({int(b) for b in budgets}))
    if any(b < 1 for b in budgets):
        raise ValueError(f"DDTree budgets must be positive, got {budgets}")
    ids = list(sample_ids) if sample_ids is not None else [s.id for s in cache.samples]
    categories = tuple(sorted({s.category for s in cache.samples}))
    counts = EvalCounts(spec.block_size, budgets, categories)
    results: list[SampleResult] = []
    manifest = cache.manifest
    topk = max(budgets) if budgets else 0
    iterator: Iterable[str] = ids
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(ids, desc="evaluating", unit="sample")
    with torch.no_grad(), autocast_context(device, autocast_dtype):
        for sid in iterator:
            sample = cache.load(sid, verify=verify)
            bounds = bounds_for(sample, manifest)
            table = draft_sample(runner, head, sample, bounds, topk, head_mem_bytes)
            res = score_sample(table, sample, bounds, spec, manifest.stop_token_ids, budgets, counts,
                               keep_drafts)
            results.append(res)
    return EvalReport(counts, results, time.perf_counter() - start, spec, budgets)
