"""DFlash 2 drafters: DFlash's block drafter with a grouped dynamic causal convolution around every
attention and MLP sublayer, and a pairwise candidate selector on top of the unary head.

The published checkpoint format (``architectures: ["DFlash2DraftModel"]``, the codebooks stored without
``.weight``) loads here as it is, and a folder saved here is that format. The math, as implemented:
docs/method.md, "DFlash 2". The selector's functions on tensors (candidates, edge scores, the walk, the
teacher-forced draft, the tree) are ``selector``; this module holds the weights and the drafter passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from ..block.attention import BlockDecoderLayer, ContextKV
from ..block.drafter import BlockDrafter
from ..proposers import Proposer, RowDrafts, logit_chunks, stored_overlap
from ..runners import HiddenBlocks
from ..spec import DrafterSpec, config_value, draft_logits
from . import selector

# The ``architectures`` entry of a published DFlash 2 config, and the ``dflash_config`` fields it needs besides
# DFlash's (docs/method.md, "DFlash 2").
ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")
# The submodules only a DFlash 2 drafter has: a key naming one of them is a DFlash 2 key.
DFLASH2_MODULES = ("attention_conv", "mlp_conv", "candidate_selector")
# The codebooks: plain parameters here and in the published files, ``nn.Embedding`` weights in the reference
# module (and so ``<name>.weight`` in its state dict and its training checkpoints).
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")

# Blocks whose DFlash 2 selector lattice is built at once (``SelectorProposer.tree``): its code
# temporaries, [blocks, depths, K, rank] float32 each, stay tens of MB at the real width.
LATTICE_BLOCKS = 64


def is_dflash2_key(key: str) -> bool:
    """Whether a weight name belongs to a part only DFlash 2 drafters have."""
    parts = key.split(".")
    return any(m in parts for m in DFLASH2_MODULES)


def published_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the codebooks under their published names (``...codebook``, not ``...codebook.weight``),
    under any prefix; every other key as it is. Both spellings of one codebook are an error."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key
        if key.endswith(".weight") and any(key[: -len(".weight")].endswith(c) for c in CODEBOOKS):
            name = key[: -len(".weight")]
        if name in out:
            raise ValueError(f"{name} appears twice, with and without .weight; keep one of them")
        out[name] = value
    return out


@dataclass(frozen=True)
class DFlash2Settings:
    """The ``dflash_config`` fields of a DFlash 2 drafter (``DFLASH2_FIELDS``)."""

    conv_group_size: int
    conv_kernel_size: int
    selector_rank: int
    selector_top_k: int

    @classmethod
    def of(cls, config: Any) -> DFlash2Settings:
        values = {}
        for name in DFLASH2_FIELDS:
            v = config_value(config, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DFlash 2 drafter config: dflash_config.{name} is {v!r}; it must be a positive "
                                 "integer (the published drafters: conv_group_size 16, conv_kernel_size 2, "
                                 "selector_rank 256, selector_top_k 16)")
            values[name] = v
        out = cls(**values)
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        if hidden % out.conv_group_size:
            raise ValueError(f"DFlash 2 drafter config: conv_group_size {out.conv_group_size} does not divide "
                             f"hidden_size {hidden}; the convolution's groups split the hidden channels evenly")
        if out.selector_top_k > vocab:
            raise ValueError(f"DFlash 2 drafter config: selector_top_k {out.selector_top_k} exceeds vocab_size "
                             f"{vocab}")
        return out


def causal_group_conv(x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, group_size: int) -> torch.Tensor:
    """``y[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group_size]) * x[t - j, c]``, with ``x`` zero before
    position 0 (docs/method.md, "DFlash 2").

    ``x`` [..., L, H] (positions along L, one block per leading index); ``base`` [taps, H];
    ``dynamic`` [..., L, taps, H / group_size]: the kernel offsets of position t, shared by a group's channels.
    """
    taps = base.shape[0]
    length, hidden = x.shape[-2], x.shape[-1]
    groups = hidden // group_size
    past = F.pad(x, (0, 0, taps - 1, 0)).unflatten(-1, (groups, group_size))  # taps - 1 zero rows in front
    base = base.to(x.dtype).unflatten(-1, (groups, group_size))
    out = None
    for j in range(taps):
        start = taps - 1 - j  # row of ``past`` that holds x[t - j] for t = 0
        term = (base[j] + dynamic[..., j, :, None]) * past[..., start:start + length, :, :]
        out = term if out is None else out + term
    return out.flatten(-2)


class GroupedCausalConv(nn.Module):
    """The two convolutions around one sublayer: ``base_kernel`` [2, taps, H] (stage 0 before the sublayer,
    stage 1 after it; tap j reads j positions back) and ``kernel_projection`` (H -> 2 * taps * groups), the
    per-position kernel offsets of both stages, computed from the sublayer's normed input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def reset_parameters(self, std: float) -> None:
        # Identity at the current position, so a fresh drafter starts as the DFlash drafter it extends.
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
        nn.init.normal_(self.kernel_projection.weight, std=std)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stage 0 applied to the normed sublayer input ``x`` [..., L, H], stage 1's kernel offsets)."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return causal_group_conv(x, self.base_kernel[0], dynamic[..., 0, :, :], self.group_size), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """Stage 1 applied to the sublayer's output ``y`` with the offsets ``prepare`` returned."""
        return causal_group_conv(y, self.base_kernel[1], dynamic, self.group_size)


class DFlash2DecoderLayer(BlockDecoderLayer):
    """A DFlash layer whose attention and MLP each sit between the two stages of their own convolution."""

    def __init__(self, config: Qwen3Config, layer_idx: int, settings: DFlash2Settings):
        super().__init__(config, layer_idx)
        h = config.hidden_size
        self.attention_conv = GroupedCausalConv(h, settings.conv_kernel_size, settings.conv_group_size)
        self.mlp_conv = GroupedCausalConv(h, settings.conv_kernel_size, settings.conv_group_size)

    def attention_input(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention_conv.prepare(self.input_layernorm(h))

    def finish(self, h: torch.Tensor, attended: torch.Tensor, carry: Any = None) -> torch.Tensor:
        """The layer after its attention. Not token-wise: both convolutions read earlier block positions."""
        h = h + self.attention_conv.finish(self.self_attn.o_proj(attended), carry)
        x, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), dynamic)


class PairSelector(nn.Module):
    """The selector's weights: ``hidden_projection`` (H -> rank) and the ``predecessor_codebook`` /
    ``successor_codebook`` [vocab, rank] (``selector.edge_scores``)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def reset_parameters(self, std: float) -> None:
        for w in (self.hidden_projection.weight, self.predecessor_codebook, self.successor_codebook):
            nn.init.normal_(w, std=std)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # ``load_state_dict`` of the reference module's state (its codebooks are embeddings: ``.weight``).
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"{prefix}{name}"
            if f"{key}.weight" in state_dict and key not in state_dict:
                state_dict[key] = state_dict.pop(f"{key}.weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class DFlash2Drafter(BlockDrafter):
    """A DFlash 2 drafter: DFlash's weights plus ``layers.N.{attention,mlp}_conv.*`` and ``candidate_selector.*``.

    ``stream_context`` is DFlash's unchanged (the convolutions run on the block stream only, never on the
    context K/V); ``block_rows`` / ``forward_samples`` run the convolutions in every layer (``block_rows``
    returns finished hidden states, see there); the reference ``forward`` signature works as DFlash's.
    """

    family = "dflash2"

    def __init__(self, config: Qwen3Config):
        settings = DFlash2Settings.of(config)  # before any weight is allocated
        super().__init__(config)
        self.settings = settings
        self.candidate_selector = PairSelector(config.hidden_size, config.vocab_size, settings.selector_rank)
        self.candidate_selector.reset_parameters(self._init_std)

    def _layer(self, config: Qwen3Config, layer_idx: int) -> DFlash2DecoderLayer:
        return DFlash2DecoderLayer(config, layer_idx, DFlash2Settings.of(config))

    @property
    def _init_std(self) -> float:
        return float(getattr(self.config, "initializer_range", 0.02))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for layer in self.layers:
            layer.attention_conv.reset_parameters(self._init_std)
            layer.mlp_conv.reset_parameters(self._init_std)
        if hasattr(self, "candidate_selector"):  # the base constructor calls this before the selector exists
            self.candidate_selector.reset_parameters(self._init_std)

    def _published_config(self) -> Qwen3Config:
        return self.family_config()

    # -- engine interface -----------------------------------------------------
    def block_rows(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   samples: torch.Tensor, lengths: torch.Tensor | None = None, attn_mem_bytes: int | None = None,
                   masks: str = "served") -> HiddenBlocks:
        """DFlash's ``block_rows``, every layer with its convolutions; the blocks come back finished.

        DFlash defers its last layer's tail (``o_proj``, MLP, norms) to the positions read because it is
        token-wise. Here it is not: position t of the last layer reads positions t - 3 (taps - 1) .. t through
        the convolution after the attention, the one before the MLP and the one after it, so deferring it
        exactly would recompute a window of 3 (taps - 1) + 1 positions per position read, about the whole of a
        published block of 8 at taps 2. One layer's tail on every position is a small part of the pass; the
        output head, the large part, still runs only on the positions the engine reads.
        """
        return HiddenBlocks(self.forward_samples(context, noise_embedding, anchors, samples, lengths,
                                                 attn_mem_bytes, masks))

    # -- the selector ---------------------------------------------------------
    def selector_inputs(self, hidden: torch.Tensor, lm_head: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(candidate ids [..., K], unary scores [..., K] float32, projected hidden [..., rank] float32) of
        drafter hidden states [..., H] (block positions 1 ..), with the target's head ``lm_head`` [V, H].

        The logits of every position at once: the engine applies the head in row chunks and calls
        ``selector.top_candidates`` per chunk instead."""
        ids, unary = selector.top_candidates(draft_logits(hidden, lm_head, self.spec), self.settings.selector_top_k)
        return ids, unary, self.project(hidden)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``H(h)``: drafter hidden states [..., H] -> [..., rank] float32."""
        return self.candidate_selector.hidden_projection(hidden).float()

    @property
    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(predecessor codebook ``A``, successor codebook ``B``), [vocab, rank] each."""
        return self.candidate_selector.predecessor_codebook, self.candidate_selector.successor_codebook

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The block a server proposes at temperature 0: the selector's greedy walk from ``anchor`` [N] over
        hidden states [N, D, H] of block positions 1 .. D; tokens [N, D]."""
        ids, unary, query = self.selector_inputs(hidden, lm_head)
        return selector.walk_draft(ids, unary, query, anchor, *self.codebooks)



# -- the engine's proposer --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SelectorWeights:
    """The selector's tensors: ``projection`` [R, H] (``hidden_projection.weight``), the codebooks [V, R]."""

    projection: torch.Tensor
    predecessor: torch.Tensor
    successor: torch.Tensor

    @classmethod
    def of(cls, module: Any) -> SelectorWeights:
        """From a module with a ``candidate_selector`` (ours, the reference's ``DFlash2DraftModel`` whose codebooks
        are embeddings, or a training module with those names); the tensors are shared, not copied."""
        selector_module = getattr(module, "candidate_selector", None)
        if selector_module is None:
            raise ValueError(f"a DFlash 2 drafter is scored with its selector, but {type(module).__name__} has no "
                             "candidate_selector (hidden_projection, predecessor_codebook, successor_codebook); "
                             "pass the drafter module itself (dflash_cb.core.drafters.dflash2.model.DFlash2Drafter or the reference "
                             "DFlash2DraftModel)")

        def weight(part: Any) -> torch.Tensor:
            return part if isinstance(part, torch.Tensor) else part.weight

        return cls(weight(selector_module.hidden_projection), weight(selector_module.predecessor_codebook),
                   weight(selector_module.successor_codebook))


# Rows whose selector pick is computed at once (``SelectorProposer.rows``): their candidates' codes, [rows, K, rank]
# float32, stay a few MB (8 MB at K 16 and rank 256), and so in cache.
PICK_ROWS = 256


class SelectorProposer(Proposer):
    """DFlash 2 (docs/method.md, "DFlash 2"): the draft at a depth is the selector's pick among the unary top-K
    candidates given the predecessor (``selector.choose``); DDTree over the selector's lattice
    (``selector.lattice_tree_accepted``); the block shown is the selector's greedy walk.

    Its extra walks (``figures.FIGURES``): the unary argmax path (the selector off: a depth is accepted
    when the head's argmax is the target's token) and a perfect selector over the K candidates (accepted while
    the target's token is among them); its per-depth count: that recall. SpecForge's accuracy scores the unary
    argmax, as SpecForge's inherited DFlash accuracy does."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int, weights: SelectorWeights):
        from .figures import FIGURES

        super().__init__(spec, lm_head, mem_bytes, FIGURES)
        if spec.option("selector_top_k") is None:
            raise ValueError("a DFlash 2 drafter spec needs selector_top_k (DrafterSpec.options)")
        self.weights, self.k = weights, int(spec.option("selector_top_k"))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``H(h)`` [..., R] float32, in the projection's own dtype (no autocast: as the reference module runs)."""
        w = self.weights.projection
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(w.dtype), w).float()

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        w = self.weights
        tokens, unary_first, recall, overlap, kept = [], [], [], [], []
        for at, logits in logit_chunks(hidden, self.lm_head, self.spec, self.mem_bytes):
            ids, unary = selector.top_candidates(logits, self.k)
            del logits
            query = self.project(hidden[at])
            with torch.autocast(hidden.device.type, enabled=False):
                # ``PICK_ROWS`` rows at a time: their [rows, K, R] code temporaries stay in cache (a few MB).
                picks = [selector.choose(ids[i:i + PICK_ROWS], unary[i:i + PICK_ROWS], query[i:i + PICK_ROWS],
                                         previous[at][i:i + PICK_ROWS], w.predecessor, w.successor)
                         for i in range(0, ids.shape[0], PICK_ROWS)]
            token, scores = (torch.cat(x) for x in zip(*picks, strict=True))
            tokens.append(token)
            unary_first.append(ids[:, 0])  # the head's argmax: the first of the canonical order
            recall.append((ids == target[at, None]).any(-1))
            if target_topk is not None:
                t_ids = target_topk[0][at]
                # The selector's temperature-1 proposal: a softmax of S over the candidates, zero elsewhere.
                q = torch.softmax(scores, -1)
                drawn = (ids[:, None, :] == t_ids[:, :, None]).to(q.dtype) @ q[:, :, None]
                overlap.append(stored_overlap(t_ids, target_topk[1][at], drawn[..., 0]))
            if parts:
                kept.append((ids, unary, query))
        cat = torch.cat
        unary_argmax, hit = cat(unary_first), cat(recall)
        # In the order of metrics.FAMILY_COUNTS["dflash2"]: walks (unary path, perfect selector), then the count.
        walks = torch.stack([unary_argmax == target, hit], dim=1)
        return RowDrafts(cat(tokens), walks, hit[:, None], unary_argmax, cat(overlap) if overlap else None,
                         tuple(cat(x) for x in zip(*kept, strict=True)) if parts else None)

    def _lattice(self, parts: Any, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, unary, query = parts
        return ids.view(n, d, self.k), unary.view(n, d, self.k), query.view(n, d, -1)

    def tree(self, parts: Any, anchor: torch.Tensor, depths: torch.Tensor, target: torch.Tensor,
             inside: torch.Tensor, max_budget: int) -> torch.Tensor:
        n, d = target.shape
        ids, unary, query = self._lattice(parts, n, d)
        firsts, steps = [], []
        with torch.autocast(ids.device.type, enabled=False):
            # ``LATTICE_BLOCKS`` blocks at a time: their [blocks, D, K, R] code temporaries stay small (and in cache).
            for i in range(0, n, LATTICE_BLOCKS):
                at = slice(i, i + LATTICE_BLOCKS)
                f, s = selector.transition_logprobs(ids[at], unary[at], query[at], anchor[at], self.weights.predecessor,
                                                    self.weights.successor)
                firsts.append(f)
                steps.append(s)
        return selector.lattice_tree_accepted(torch.where(inside[..., None], ids, -2), torch.cat(firsts),
                                              torch.cat(steps), depths, target, max_budget)

    def block(self, parts: Any, tokens: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ids, unary, query = self._lattice(parts, *tokens.shape)
        with torch.autocast(ids.device.type, enabled=False):
            return selector.walk_draft(ids, unary, query, anchor, self.weights.predecessor, self.weights.successor)
