"""The block kind's attention: which keys a block position sees (served and SpecForge's masks, sliding windows),
one layer's attention over a context prefix and a block, and what a pass hands back (``DeferredBlocks``,
``ContextKV``). Shared by every family on the block backbone (``block.drafter.BlockDrafter``); the rules:
docs/method.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def attention_reach(config: Any, layer_idx: int) -> tuple[int | None, int | None]:
    """How far back and ahead (in positions) a query of layer ``layer_idx`` may look; None = no limit.

    A layer that the config's ``layer_types`` lists as ``sliding_attention`` sees ``sliding_window``
    positions counting its own (no limit when the config carries no window), and only backwards
    unless the config sets ``is_causal`` false (then the window is symmetric). Any other layer sees
    everything, backwards only if ``is_causal`` is set.
    The rule of the public checkpoints, the ``dflash`` reference model and SGLang's DFlash model: the
    served masks. SpecForge 0.2.0 trains under other ones (``specforge_reach``); the two agree only when
    every window is at least the block and the config leaves ``is_causal`` unset (docs/method.md).
    """
    kinds = getattr(config, "layer_types", None) or ()
    sliding = layer_idx < len(kinds) and kinds[layer_idx] == "sliding_attention"
    size = getattr(config, "sliding_window", None) if sliding else None  # Qwen3Config drops it unless enabled
    window = int(size) - 1 if size is not None else None
    causal_flag = getattr(config, "is_causal", None)
    causal = sliding if causal_flag is None else bool(causal_flag)
    return window, (0 if causal else window)


# The masks a drafter's attention runs under: "served" (as SGLang serves it, as dflash's reference model
# runs it, and as the replay reproduces it: ``attention_reach``) or "specforge" (SpecForge 0.2.0's DFlash
# training masks: ``specforge_reach``). docs/method.md, "Attention reach".
MASKS = ("served", "specforge")


def specforge_reach(config: Any, layer_idx: int) -> tuple[int | None, int | None]:
    """SpecForge 0.2.0's training mask for layer ``layer_idx``: how far back a query sees *context* keys
    and how far ahead it sees the block's keys; None = no limit.

    Its DFlash mask (``create_dflash_sdpa_mask``, ``create_dflash_block_mask``) gives a
    ``sliding_attention`` layer the window over the context keys only (``sliding_window`` positions
    counting the query's own), and makes the block causal but not windowed; every other layer sees its
    whole context prefix and its whole block. It does not read ``is_causal``.
    """
    kinds = getattr(config, "layer_types", None) or ()
    sliding = layer_idx < len(kinds) and kinds[layer_idx] == "sliding_attention"
    size = getattr(config, "sliding_window", None) if sliding else None
    if size is None:  # SpecForge then builds the full mask for every layer
        return None, None
    return int(size) - 1, 0


def visible(base: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, back: int | None, ahead: int | None,
            context_keys: int | None = None) -> torch.Tensor:
    """``base`` [A, 1, L, K] (True = visible) narrowed to keys at most ``back`` positions before the query and
    ``ahead`` after it (None = no limit). With ``context_keys`` the ``back`` limit applies to the first
    ``context_keys`` keys only (SpecForge's rule: its window does not reach into the block)."""
    offset = k_pos[:, None, None, :] - q_pos[:, None, :, None]  # key position minus query position
    ok = base
    if back is not None:
        near = offset >= -back
        if context_keys is not None:
            near = near | (torch.arange(k_pos.shape[-1], device=k_pos.device) >= context_keys)
        ok = ok & near
    if ahead is not None:
        ok = ok & (offset <= ahead)
    return ok


def specforge_mask_difference(config: Any, block_size: int) -> str | None:
    """Why SpecForge 0.2.0's training masks differ from the served ones for this drafter, or None when a
    block sees the same keys under both (then ``specforge/acc`` needs no pass of its own).

    They differ when a sliding window is shorter than the block (served, the window also limits the
    block's own keys) or when ``is_causal`` is set (SpecForge ignores it). Decided by comparing the two
    masks of one block with enough context in front, layer by layer.
    """
    n = block_size
    layers = []
    for i in range(int(config.num_hidden_layers)):
        back, ahead = attention_reach(config, i)
        sf_back, sf_ahead = specforge_reach(config, i)
        p = n + max(back or 0, sf_back or 0) + 1  # every offset a block query can reach appears
        q_pos = (p + torch.arange(n))[None]
        k_pos = torch.arange(p + n)[None]
        base = torch.ones(1, 1, n, p + n, dtype=torch.bool)
        if not torch.equal(visible(base, q_pos, k_pos, back, ahead), visible(base, q_pos, k_pos, sf_back, sf_ahead, p)):
            kinds = getattr(config, "layer_types", None) or ()
            kind = kinds[i] if i < len(kinds) else "full_attention"
            what = [kind, f"sliding_window {getattr(config, 'sliding_window', None)}"] if kind == "sliding_attention" \
                else [kind]
            if getattr(config, "is_causal", None) is not None:
                what.append(f"is_causal {config.is_causal}")
            layers.append(f"layer {i} ({', '.join(what)})")
    if not layers:
        return None
    return (f"SpecForge 0.2.0 trains {', '.join(layers)} of this block-{n} drafter under other masks than it is "
            "served with (its sliding window covers the context only, its block is causal in sliding layers and "
            "bidirectional in the others, is_causal ignored)")


class BlockAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.reach_back, self.reach_ahead = attention_reach(config, layer_idx)
        self.specforge_back, self.specforge_ahead = specforge_reach(config, layer_idx)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., L, hidden] -> k, v [..., kv_heads, L, head_dim] (k normed and rotated)."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-2, -3)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        return _rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [A, L, hidden] -> q [A, heads, L, head_dim] (normed and rotated)."""
        a, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(a, n, self.num_heads, self.head_dim)).transpose(1, 2)
        return _rope(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def attend(self, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
               mask: torch.Tensor | None, group: int = 1) -> torch.Tensor:
        """Block queries q [A, H, L, d] over context keys [kv, C, d] (shared) or [A / group, kv, C, d], then
        the blocks' own keys bk / bv [A, kv, L, d]; returns [A, L, H * d] (before ``o_proj``).

        ``group`` > 1 packs that many consecutive blocks into one attention row set sharing a single
        copy of the context keys (A must be a multiple of it): far fewer key copies, at the price of
        each query also scoring the group's other blocks, which ``mask`` hides. ``mask`` (bool
        [A / group, 1, group * L, C + group * L], True = visible, or None = all visible) carries each
        block's context prefix, its own block and the layer's position rule.
        """
        a, h, n, d = q.shape
        kv = self.num_kv_heads
        b = a // group
        if group > 1:
            q = q.view(b, group, h, n, d).transpose(1, 2).reshape(b, h, group * n, d)
            bk = bk.view(b, group, kv, n, d).transpose(1, 2).reshape(b, kv, group * n, d)
            bv = bv.view(b, group, kv, n, d).transpose(1, 2).reshape(b, kv, group * n, d)
        if ctx_k.dim() == 3:
            ctx_k = ctx_k.expand(b, *ctx_k.shape)
            ctx_v = ctx_v.expand(b, *ctx_v.shape)
        k = torch.cat([ctx_k, bk], dim=2)
        v = torch.cat([ctx_v, bv], dim=2)
        # The fused kernel (sdpa) with grouped K/V heads.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=h != kv)
        if group > 1:
            out = out.view(b, h, group, n, d).transpose(1, 2).reshape(a, h, n, d)
        return out.transpose(1, 2).reshape(a, n, h * d)

    @property
    def unrestricted(self) -> bool:
        """True when this layer sees its whole context prefix and whole block (no position rule)."""
        return self.unrestricted_under("served")

    def unrestricted_under(self, masks: str) -> bool:
        return self.reach(masks) == (None, None)

    def reach(self, masks: str) -> tuple[int | None, int | None]:
        """(back, ahead) of this layer under ``masks`` (``MASKS``)."""
        return (self.reach_back, self.reach_ahead) if masks == "served" else (self.specforge_back, self.specforge_ahead)

    def visibility(self, base: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, masks: str = "served",
                   context_keys: int = 0) -> torch.Tensor:
        """``base`` [A, 1, L, K] (prefix visibility) narrowed to the keys within this layer's reach under
        ``masks``; the first ``context_keys`` keys are context (SpecForge's window covers only those)."""
        back, ahead = self.reach(masks)
        return visible(base, q_pos, k_pos, back, ahead, context_keys if masks == "specforge" else None)


@dataclass
class AttentionPart:
    """Rows of a pass (possibly of several samples) that attend in one kernel call (see ``_attention_parts``)."""

    rows: slice | torch.Tensor  # the part's rows; with ``group`` > 1 each sample's run is padded to a multiple
    keep: torch.Tensor | None  # real rows among the packed outputs (None: all of them, in order)
    context: int  # context keys kept: the part's largest anchor
    group: int
    # The context keys: ``(start, None)`` one sample's rows [start, start + context), shared by every row set;
    # ``(None, index)`` [row sets, context] flat context rows of each row set's own sample.
    context_start: int | None
    context_index: torch.Tensor | None
    masks: list[torch.Tensor | None]


# Rows in order of their context are cut into parts that pad each row's keys by at most this share of the keys
# they need, once a part holds more than ``SMALL_PART`` rows (a kernel call has a fixed cost).
PADDING, SMALL_PART = 1.25, 32


class DeferredBlocks:
    """``BlockRows`` of blocks whose last layer stopped after attention (``BlockDrafter.block_rows``).

    The rest of that layer and the final norm are token-wise, so ``rows`` computes the output hidden
    states of any chosen (block, position) pairs alone, the same values a full pass gives them.
    """

    def __init__(self, drafter: nn.Module, residual: torch.Tensor, attended: torch.Tensor,
                 at: torch.Tensor | None = None):
        self.drafter = drafter
        self.residual = residual  # [A, L, hidden]: the last layer's input
        self.attended = attended  # [A, L, heads * head_dim]: its attention output before o_proj
        self.at = at  # where block i's rows are held (None: at i), when the pass ran its blocks in another order

    def rows(self, block: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if self.at is not None:
            block = self.at[block]
        return self.drafter.norm(self.drafter.layers[-1].finish(self.residual[block, position],
                                                                self.attended[block, position]))


@dataclass
class ContextKV:
    """Every drafter layer's context keys and values for one or more samples, end to end: sample ``s``
    holds flat rows ``starts[s] .. starts[s] + rows[s] - 1`` (its positions ``0 .. rows[s] - 1``)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [kv_heads, total rows, head_dim]
    starts: list[int]
    rows: list[int]


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = BlockAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None, group: int = 1) -> torch.Tensor:
        attn = self.self_attn
        x, carry = self.attention_input(h)
        bk, bv = attn.project_kv(x, cos, sin)
        return self.finish(h, attn.attend(attn.project_q(x, cos, sin), bk, bv, *ctx_kv, mask, group), carry)

    def attention_input(self, h: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(what the block's queries, keys and values are projected from, what ``finish`` needs of it):
        the normed layer input, and nothing (a DFlash 2 layer convolves it and carries a kernel)."""
        return self.input_layernorm(h), None

    def finish(self, h: torch.Tensor, attended: torch.Tensor, carry: Any = None) -> torch.Tensor:
        """The layer after its attention, given the layer input ``h`` and the attention output before
        ``o_proj``: token-wise, so it may run on any subset of positions (``DeferredBlocks``)."""
        h = h + self.self_attn.o_proj(attended)
        return h + self.mlp(self.post_attention_layernorm(h))

