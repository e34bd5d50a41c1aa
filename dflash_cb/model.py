"""A DFlash block-diffusion drafter that loads the public checkpoint format as it is.

Weight names, config fields and numerics follow the reference ``dflash.model.DFlashDraftModel``
(a Qwen3 config plus ``num_target_layers``, ``block_size`` and a ``dflash_config`` dict), so a
folder saved here loads there and vice versa. Besides the reference ``forward`` (used for
training), the drafter exposes the two halves the evaluation engine batches separately:
``context_kv`` (depends only on the cached target features: computed once per sample) and
``forward_blocks`` (many anchors' blocks in one pass, each seeing its own context prefix).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    # dflash_config wins over a top-level attribute, as in the reference.
    cfg = getattr(config, "dflash_config", None) or {}
    return cfg.get(name, getattr(config, name, default))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's spread of target layers when a config names none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterSpec:
    """What the engine and the cache checks need to know of any drafter, whatever its class."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    vocab_size: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> DrafterSpec:
        ids = _dflash_value(config, "target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        mask = _dflash_value(config, "mask_token_id")
        if mask is None:
            raise ValueError("drafter config has no mask_token_id (expected in dflash_config)")
        softcap = _dflash_value(config, "final_logit_softcapping")
        return cls(
            block_size=int(_dflash_value(config, "block_size", 16)),
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            # The context features are target hidden states; the reference assumes equal widths.
            target_hidden_size=int(getattr(config, "target_hidden_size", None) or config.hidden_size),
            vocab_size=int(config.vocab_size),
            input_embedding_scale=float(_dflash_value(config, "input_embedding_scale", 1.0) or 1.0),
            output_multiplier=float(_dflash_value(config, "output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def as_cache_check(self) -> dict[str, Any]:
        return {
            "target_layer_ids": list(self.target_layer_ids),
            "target_hidden_size": self.target_hidden_size,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
        }


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
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
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., L, hidden] -> k, v [..., kv_heads, L, head_dim] (k normed and rotated)."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-2, -3)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        return _rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, ctx_mask: torch.Tensor | None, q_pos: torch.Tensor,
                ctx_pos: torch.Tensor) -> torch.Tensor:
        """Blocks x [A, L, hidden] attend to shared context keys [kv, C, d] (or per-block [A, kv, C, d]).

        ``ctx_mask`` [A, 1, 1, C] marks the context rows each block may see (its own prefix); positions
        give the sliding-window/causal masks. Scores are computed in float32 for exactness.
        """
        a, n, _ = x.shape
        g = self.num_heads // self.num_kv_heads
        q = self.q_norm(self.q_proj(x).view(a, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos.unsqueeze(1), sin.unsqueeze(1))  # [A, H, L, d]
        bk, bv = self.project_kv(x, cos, sin)  # [A, kv, L, d]
        q = q.reshape(a, self.num_kv_heads, g * n, self.head_dim)
        if ctx_k.dim() == 3:
            s_ctx = torch.einsum("akqd,kcd->akqc", q, ctx_k)
        else:
            s_ctx = torch.einsum("akqd,akcd->akqc", q, ctx_k)
        s_blk = torch.einsum("akqd,akcd->akqc", q, bk)
        s_ctx = s_ctx.float().view(a, self.num_kv_heads, g, n, -1) * self.scaling
        s_blk = s_blk.float().view(a, self.num_kv_heads, g, n, n) * self.scaling
        neg = torch.finfo(torch.float32).min
        if ctx_mask is not None:
            s_ctx = s_ctx.masked_fill(~ctx_mask.view(a, 1, 1, 1, -1), neg)
        if self.is_causal or self.sliding_window is not None:
            qp = q_pos.view(a, 1, 1, n, 1)
            ok_ctx = torch.ones_like(s_ctx, dtype=torch.bool)
            ok_blk = torch.ones_like(s_blk, dtype=torch.bool)
            kp_blk = q_pos.view(a, 1, 1, 1, n)
            kp_ctx = ctx_pos.view(-1, 1, 1, 1, ctx_pos.shape[-1]) if ctx_pos.dim() > 1 else ctx_pos.view(1, 1, 1, 1, -1)
            if self.is_causal:
                ok_ctx = ok_ctx & (kp_ctx <= qp)
                ok_blk = ok_blk & (kp_blk <= qp)
            if self.sliding_window is not None:
                w = self.sliding_window
                ok_ctx = ok_ctx & (qp - kp_ctx < w)
                ok_blk = ok_blk & (qp - kp_blk < w)
                if not self.is_causal:
                    ok_ctx = ok_ctx & (kp_ctx - qp < w)
                    ok_blk = ok_blk & (kp_blk - qp < w)
            s_ctx = s_ctx.masked_fill(~ok_ctx, neg)
            s_blk = s_blk.masked_fill(~ok_blk, neg)
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(bv.dtype)
        c = s_ctx.shape[-1]
        p_ctx = p[..., :c].reshape(a, self.num_kv_heads, g * n, c)
        p_blk = p[..., c:].reshape(a, self.num_kv_heads, g * n, n)
        if ctx_v.dim() == 3:
            out = torch.einsum("akqc,kcd->akqd", p_ctx, ctx_v)
        else:
            out = torch.einsum("akqc,akcd->akqd", p_ctx, ctx_v)
        out = out + torch.einsum("akqc,akcd->akqd", p_blk, bv)
        out = out.reshape(a, self.num_heads, n, self.head_dim).transpose(1, 2).reshape(a, n, -1)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, ctx_mask: torch.Tensor | None, q_pos: torch.Tensor,
                ctx_pos: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), *ctx_kv, cos, sin, ctx_mask, q_pos, ctx_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash drafter: ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``; no vocabulary matrices."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.spec = DrafterSpec.from_config(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        n_ctx = len(self.spec.target_layer_ids) * self.spec.target_hidden_size
        self.fc = nn.Linear(n_ctx, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.spec.target_layer_ids)

    def reset_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Qwen3RMSNorm):
                nn.init.ones_(m.weight)

    # -- reference interface (training, foreign callers) ----------------------
    def forward(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """Reference signature: blocks [B, L, hidden] after ``target_hidden`` [B, C, F] -> hidden [B, L, hidden].

        ``position_ids`` [B, C + L] run over context then block. ``attention_mask`` (bool [B, 1, L, C + L],
        True = visible) is optional, as in the reference; without it context and block are fully visible.
        """
        if past_key_values is not None:
            raise NotImplementedError("DFlashDrafter does not keep a KV cache; the engine batches anchors instead")
        b, n, _ = noise_embedding.shape
        c = target_hidden.shape[1]
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        ctx = self.hidden_norm(self.fc(target_hidden))
        ctx_cos, ctx_sin = cos[:, :c], sin[:, :c]
        cos_b, sin_b = cos[:, c:], sin[:, c:]
        q_pos, ctx_pos = position_ids[:, c:], position_ids[:, :c]
        if attention_mask is not None:
            ctx_mask = attention_mask[:, 0, 0, :c]  # context visibility is the same for every block row
        else:
            ctx_mask = None
        h = noise_embedding
        for layer in self.layers:
            kv = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            h = layer(h, kv, cos_b, sin_b, ctx_mask, q_pos, ctx_pos)
        return self.norm(h)

    # -- engine interface -----------------------------------------------------
    def context_kv(self, target_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [kv_heads, T, d] for one sample's features [T, F] (positions 0..T-1)."""
        t = target_hidden.shape[0]
        pos = torch.arange(t, device=target_hidden.device)
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(ctx, pos)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward_blocks(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], noise_embedding: torch.Tensor,
                       anchors: torch.Tensor) -> torch.Tensor:
        """Blocks [A, L, hidden] anchored at ``anchors`` [A]; block a sees context rows [0, anchors[a])."""
        a, n, _ = noise_embedding.shape
        c = int(anchors.max().item())  # no block sees past the last anchor: trim the keys
        kv = [(k[:, :c], v[:, :c]) for k, v in ctx_kv]
        ctx_pos = torch.arange(c, device=anchors.device)
        ctx_mask = ctx_pos[None, :] < anchors[:, None]
        q_pos = anchors[:, None] + torch.arange(n, device=anchors.device)[None, :]
        cos, sin = self.rotary_emb(noise_embedding, q_pos)
        h = noise_embedding
        for layer, layer_kv in zip(self.layers, kv, strict=True):
            h = layer(h, layer_kv, cos, sin, ctx_mask, q_pos, ctx_pos)
        return self.norm(h)

    # -- checkpoint format ----------------------------------------------------
    @classmethod
    def from_config_dict(cls, data: dict[str, Any]) -> DFlashDrafter:
        return cls(Qwen3Config.from_dict(dict(data)))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> DFlashDrafter:
        """Load a drafter folder (``config.json`` + safetensors); missing or unexpected keys are errors."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path}: no drafter config; a drafter folder holds config.json and "
                                    "model.safetensors (tools/extract_drafter.py makes one from a checkpoint)")
        model = cls.from_config_dict(json.loads(cfg_path.read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights next to config.json")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        load_state_dict_strict(model, state, source=str(path))
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(self.config.to_json_string(use_diff=False))


def load_state_dict_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{source}: drafter weights do not match the DFlash layout: "
                         f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for k, v in state.items():
        want = model.state_dict()[k].shape
        if tuple(v.shape) != tuple(want):
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, the config implies {tuple(want)}")
    model.load_state_dict(state, strict=True)
