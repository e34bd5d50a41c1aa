"""The target's own MTP head (Qwen3.5 / Qwen3.6, ``mtp_num_hidden_layers: 1``, weights under ``mtp.*`` in the
target's checkpoint) as the servers run it (docs/method.md, "Chain drafters"): a step normalises the token's
embedding and the hidden state it is fed, concatenates them (embedding first), projects them back to the hidden
size (``fc``), runs one full-attention Qwen3.5 decoder layer (transformers' own ``Qwen3_5DecoderLayer``) and the
MTP's final norm, and drafts with the target's head. The first step is fed the target's last hidden state after
its final norm (layer id ``num_layers - 1`` of a cache: docs/method.md, "Cached states"); every later step the
MTP's own normed output.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..chain import save_chain_folder
from ..registry import family_named

ARCHITECTURE = "Qwen3_5MTPDrafter"
# Config fields of the target's text config the MTP layer needs (and a drafter folder keeps).
TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "attention_dropout",
               "max_position_embeddings", "rope_parameters", "tie_word_embeddings", "pad_token_id")


def text_config(config: Any) -> Any:
    """A ``Qwen3_5TextConfig`` of a drafter config (a dict or a config object) whose one layer is full attention."""
    from transformers import Qwen3_5TextConfig

    data = dict(config) if isinstance(config, dict) else config.to_dict()
    layers = int(data.get("mtp_num_hidden_layers") or 1)
    if layers != 1:
        raise ValueError(f"mtp_num_hidden_layers is {layers}: the replay runs one MTP layer (Qwen3.5 and Qwen3.6 "
                         "have one); a head of several layers keeps a K/V cache per layer, not replayed")
    data.update(num_hidden_layers=1, layer_types=["full_attention"], mtp_num_hidden_layers=1)
    return Qwen3_5TextConfig.from_dict(data)


class _MtpHead(nn.Module):
    """The ``mtp.*`` weights under their published names."""

    def __init__(self, config: Any):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)


class MtpDrafter(nn.Module):
    """A Qwen3.5 / Qwen3.6 MTP head (module docstring), driven by ``chain.ChainRunner`` (``chain.ChainSteps``)."""

    family = "mtp"

    def __init__(self, config: Any):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        super().__init__()
        self.config = text_config(config)
        self.spec = family_named(self.family).spec(self.config)
        self.mtp = _MtpHead(self.config)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(self.config)
        attn = self.mtp.layers[0].self_attn
        self.num_heads, self.num_kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling

    # -- chain.ChainSteps ----------------------------------------------------
    def first_carry(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the target's final-normed state, as the servers hand it to the MTP

    def embed(self, ids: torch.Tensor, target_embed: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, target_embed)  # the MTP shares the target's embedding

    def step_qkv(self, embedded: torch.Tensor, carry: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        m = self.mtp
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(embedded), m.pre_fc_norm_hidden(carry)], dim=-1))
        layer = m.layers[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        n, d = h.shape[0], self.head_dim
        q, gate = torch.chunk(attn.q_proj(h).view(n, -1, 2 * d), 2, dim=-1)
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(h).view(n, -1, d))
        v = attn.v_proj(h).view(n, -1, d)
        cos, sin = self.rotary_emb(x, positions[None])
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v, (x, gate.reshape(n, -1))

    def step_out(self, attended: torch.Tensor, kept: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, gate = kept
        layer = self.mtp.layers[0]
        x = x + layer.self_attn.o_proj(attended * torch.sigmoid(gate))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.mtp.norm(x)
        return out, out  # the next step is fed the normed output, and the target's head drafts from it

    # -- checkpoint format ---------------------------------------------------
    @classmethod
    def from_config_dict(cls, data: dict[str, Any]) -> MtpDrafter:
        return cls(dict(data))

    def drafter_config(self) -> dict[str, Any]:
        """The ``config.json`` of a drafter folder: the MTP layer's text config and the chain's settings."""
        own = self.config.to_dict()
        keep = {k: own[k] for k in TEXT_FIELDS if k in own}
        extra = {k: own[k] for k in ("target_layer_ids", "num_target_layers", "num_speculative_tokens",
                                      "target_hidden_size") if own.get(k) is not None}
        return {"architectures": [ARCHITECTURE], "drafter_family": self.family, "model_type": "qwen3_5_text",
                "mtp_num_hidden_layers": 1, "num_hidden_layers": 1, **keep, **extra}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``model.safetensors`` under the target checkpoint's ``mtp.*`` names and ``config.json``."""
        save_chain_folder(self, path, self.drafter_config())


def mtp_config_from_target(target_config: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
    """A drafter ``config.json`` for the MTP head of a target whose ``config.json`` is ``target_config``
    (a Qwen3.5 / Qwen3.6 model's, with or without its vision wrapper)."""
    text = target_config.get("text_config") or target_config
    layers = text.get("mtp_num_hidden_layers")
    if not layers:
        raise ValueError("the target's config has no mtp_num_hidden_layers: it ships no MTP head")
    if int(layers) != 1:
        raise ValueError(f"the target's MTP head has mtp_num_hidden_layers {layers}; dflash-cb reads a one-layer "
                         "head (Qwen3.5 / Qwen3.6's); a deeper one is not supported yet")
    n = int(text["num_hidden_layers"])
    keep = {k: text[k] for k in TEXT_FIELDS if k in text}
    return {"architectures": [ARCHITECTURE], "drafter_family": "mtp", "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": int(layers), "num_hidden_layers": 1, **keep, "target_layer_ids": [n - 1], "num_target_layers": n,
            "num_speculative_tokens": int(speculative_tokens)}
