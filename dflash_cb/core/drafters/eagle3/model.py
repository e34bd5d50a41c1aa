"""EAGLE-3 (SpecForge 0.2.0's ``LlamaForCausalLMEagle3``, as SGLang and vLLM serve it) as a chain drafter
(docs/method.md, "Chain drafters"), its weights under SpecForge's names so a folder SpecForge saves loads as is.

A step normalises the token's embedding (``midlayer.input_layernorm``, the drafter's own ``embed_tokens``) and
the state it is fed (``midlayer.hidden_norm``), concatenates them (embedding first) as the 2H-wide input of the
attention's q/k/v, adds the attention's output to the fed state (the residual) and runs the MLP; the draft is
the argmax of the drafter's own head over its draft vocabulary (``lm_head`` of ``norm`` of the output, unless
``norm_output`` is false), mapped to a target token by ``d2t`` (target id = draft id + ``d2t[draft id]``). The
first step is fed ``fc`` of three target layers' states concatenated (each normed first under ``fc_norm``);
every later step the layer's output before ``norm`` (SpecForge's ``backbone`` output; vLLM's ``hidden_prenorm``).

Target layers. SpecForge captures its EAGLE-3 states through SGLang's ``set_eagle3_layers_to_capture``, which
stores the residual stream entering decoder layer ``i + 1`` for each id ``i`` of
``eagle_config.eagle_aux_hidden_state_layer_ids``: the output of decoder layer ``i``, which is a cache's layer
id ``i`` (docs/cache-format.md), unchanged. vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` as the
state entering layer ``i`` (``hidden_states + residual`` before layer ``i``): the output of layer ``i - 1``.
With no ids, both servers' and SpecForge's default is the outputs of layers ``[1, L // 2 - 1, L - 4]`` of an
L-layer target (SGLang's ``[2, L // 2, L - 3]`` and vLLM's ``(2, L // 2, L - 3)`` are the layers they enter).
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch
from torch import nn

from ..base import FamilyFigures, _get
from ..chain import save_chain_folder
from ..proposers import Proposer, RowDrafts, apply_head
from ..registry import family_named
from ..spec import DrafterSpec, config_value, int_field, layer_id_list

ARCHITECTURE = "LlamaForCausalLMEagle3"
FAMILY_NAME = "eagle3"
EMBED_KEY = "embed_tokens.weight"


def eagle_layer_ids(config: Any) -> list[int]:
    """The cache layer ids an EAGLE-3 config reads (module docstring), in its features' order: our
    ``target_layer_ids``; else SpecForge's / SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer
    outputs, unchanged); else vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` (layer inputs, minus one);
    else the default of a ``num_target_layers``-layer target. Exactly three."""
    ours = config_value(config, "target_layer_ids")
    eagle = _get(config, "eagle_config") or {}
    sglang = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    vllm = _get(config, "eagle_aux_hidden_state_layer_ids")
    n = _get(config, "num_target_layers")
    if ours is not None:
        ids, field = layer_id_list(ours, "target_layer_ids"), "target_layer_ids"
        named = layer_id_list(sglang, "eagle_config.eagle_aux_hidden_state_layer_ids") if sglang is not None else None
        if named is not None and named != ids:  # both are layer outputs, a cache's ids: one must be stale
            raise ValueError(f"target_layer_ids {ids} and eagle_config.eagle_aux_hidden_state_layer_ids {named} "
                             "disagree (a server reads eagle_config's): make them the same layers, the ones it was "
                             "trained on")
    elif sglang is not None:
        ids, field = layer_id_list(sglang, "eagle_config.eagle_aux_hidden_state_layer_ids"), "eagle_config"
    elif vllm is not None:
        ids, field = layer_id_list(vllm, "eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
        if 0 in ids:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids}: vLLM's id 0 is the embedding output, which "
                             "a cache does not hold")
        ids = [i - 1 for i in ids]
    elif n is not None:
        n = int_field(n, "num_target_layers")
        ids, field = [1, n // 2 - 1, n - 4], "num_target_layers"
        if not 1 < n // 2 - 1 < n - 4:  # too few layers for SpecForge's default: it would name [1, 0, -1]
            raise ValueError(f"num_target_layers {n}: too few layers for SpecForge's default [1, L // 2 - 1, L - 4] "
                             f"(it gives {ids}); name the three layers the drafter was trained on in \"eagle_config\": "
                             "{\"eagle_aux_hidden_state_layer_ids\": [...]}")
    else:
        raise ValueError("an EAGLE-3 config names no target layers: add \"eagle_config\": "
                         "{\"eagle_aux_hidden_state_layer_ids\": [1, L // 2 - 1, L - 4]} (SpecForge's default for an "
                         "L-layer target; the layers it was trained on) or \"num_target_layers\": L")
    if len(ids) != 3:
        raise ValueError(f"{field} names {len(ids)} target layers {ids}; an EAGLE-3 drafter's fc reads three")
    last = _get(config, "num_target_layers")
    if last is not None and int(last) - 1 in ids:
        # A cache's last layer is the final-normed state (docs/cache-format.md); SGLang captures the stream
        # entering the norm there, so the two differ.
        raise ValueError(f"{field} {ids} names the target's last layer ({int(last) - 1}): a cache holds its state "
                         "after the final norm, not the residual stream an EAGLE-3 server captures there")
    return ids


def llama_config(config: Any) -> Any:
    """A ``LlamaConfig`` of an EAGLE-3 config (a dict or a config object), checked for what the replay runs."""
    from transformers import LlamaConfig

    if isinstance(config, LlamaConfig):
        cfg = copy.deepcopy(config)  # a live module's own: not to be changed here
    else:
        cfg = LlamaConfig.from_dict(dict(config) if isinstance(config, dict) else config.to_dict())
    layers = int(cfg.num_hidden_layers)
    if layers != 1:
        raise ValueError(f"num_hidden_layers is {layers}: the replay runs EAGLE-3's one layer (SpecForge's "
                         "midlayer); a drafter of several layers keeps a K/V cache per layer, not replayed")
    eagle = getattr(cfg, "eagle_config", None) or {}
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        raise ValueError("eagle_config.use_aux_hidden_state is false: vLLM's variant fed the target's last state "
                         "without fc; SpecForge 0.2.0's EAGLE-3, the one replayed, reads three layers through fc")
    if getattr(cfg, "norm_before_residual", False):
        raise ValueError("norm_before_residual is true: vLLM's variant adds the normed state to the attention "
                         "output, SpecForge 0.2.0's layer the state itself; only SpecForge's is replayed")
    if getattr(cfg, "draft_vocab_size", None) is None:
        cfg.draft_vocab_size = cfg.vocab_size  # the servers' default: the target's vocabulary
    if not 1 <= int(cfg.draft_vocab_size) <= int(cfg.vocab_size):
        raise ValueError(f"draft_vocab_size is {cfg.draft_vocab_size}, the target's vocab_size {cfg.vocab_size}: a "
                         "draft vocabulary is a subset of the target's (1 to vocab_size ids); fix config.json")
    return cfg


class _Attention(nn.Module):
    """``midlayer.self_attn``: q/k/v over the 2H-wide [embedding; state], no biases (SpecForge's)."""

    def __init__(self, cfg: Any):
        super().__init__()
        h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or h // heads
        self.q_proj = nn.Linear(2 * h, heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)


class _Mlp(nn.Module):
    def __init__(self, cfg: Any):
        from transformers.activations import ACT2FN

        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Any):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter (module docstring), driven by ``chain.ChainRunner`` (``chain.ChainSteps``)."""

    family = FAMILY_NAME

    def __init__(self, config: Any, own_embedding: bool = True):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        cfg = self.config = llama_config(config)
        self.spec = family_named(self.family).spec(cfg)
        h, t = cfg.hidden_size, self.spec.target_hidden_size
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h, cfg.pad_token_id)
        elif h != t:
            raise ValueError(f"the weights hold no {EMBED_KEY}, so the drafter embeds with the target's table "
                             f"(width {t}), but its hidden_size is {h}: add the drafter's own {EMBED_KEY}")
        else:
            self.embed_tokens = None  # the target's table, as SGLang and vLLM embed for it
        self.midlayer = _MidLayer(cfg)
        self.fc = nn.Linear(3 * t, h, bias=False)
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(t, eps=cfg.rms_norm_eps) for _ in range(3)])
                        if getattr(cfg, "fc_norm", False) else None)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.norm_output = bool(getattr(cfg, "norm_output", True))
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = self.midlayer.self_attn.q_proj.out_features // self.num_heads
        self.scaling = 1.0 / math.sqrt(self.head_dim)

    def check_loaded(self) -> None:
        """The loaded ``d2t`` is a vocabulary mapping (``d2t_problem``): refused at load, before any scoring."""
        why = d2t_problem(self.d2t, int(self.spec.vocab_size))
        if why is not None:
            raise ValueError(why)

    # -- chain.ChainSteps ----------------------------------------------------
    def first_carry(self, features: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            features = torch.cat([n(c) for n, c in zip(self.fc_norm, features.chunk(3, dim=-1), strict=True)], -1)
        return self.fc(features)

    def embed(self, ids: torch.Tensor, target_embed: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return nn.functional.embedding(ids, target_embed)
        return self.embed_tokens(ids)  # EAGLE-3's own table (SpecForge loads it from the target and freezes it)

    def step_qkv(self, embedded: torch.Tensor, carry: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.midlayer
        attn = layer.self_attn
        x = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(carry)], dim=-1)
        n, d = x.shape[0], self.head_dim
        q = attn.q_proj(x).view(n, -1, d)
        k = attn.k_proj(x).view(n, -1, d)
        v = attn.v_proj(x).view(n, -1, d)
        cos, sin = self.rotary_emb(x, positions[None])
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v, carry  # the residual is the un-normed state

    def step_out(self, attended: torch.Tensor, kept: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.midlayer
        x = kept + layer.self_attn.o_proj(attended)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, self.norm(x) if self.norm_output else x  # fed on before the norm; drafted after it

    # -- checkpoint format ---------------------------------------------------
    @classmethod
    def from_config_dict(cls, data: dict[str, Any]) -> Eagle3Drafter:
        return cls(dict(data))

    def drafter_config(self) -> dict[str, Any]:
        """SpecForge's ``config.json`` of this drafter, naming its layers for SGLang (``eagle_config``) and for
        this package (``target_layer_ids``, ``drafter_family``, ``num_speculative_tokens``)."""
        own = self.config.to_dict()
        for k in ("_name_or_path", "transformers_version", "eagle_aux_hidden_state_layer_ids"):
            own.pop(k, None)  # vLLM's field would shift the layers by one for vLLM; eagle_config says them
        ids = list(self.spec.target_layer_ids)
        eagle = dict(own.get("eagle_config") or {})
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
        return {**own, "architectures": [ARCHITECTURE], "drafter_family": self.family, "eagle_config": eagle,
                "target_layer_ids": ids, "num_speculative_tokens": self.spec.block_size - 1,
                "draft_vocab_size": self.config.draft_vocab_size}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``model.safetensors`` under SpecForge's names and ``config.json`` (``drafter_config``)."""
        save_chain_folder(self, path, self.drafter_config())


def d2t_problem(d2t: torch.Tensor, vocab_size: int) -> str | None:
    """Why ``d2t`` is not a vocabulary mapping SpecForge writes (target id = draft id + d2t[draft id], each in the
    target's vocabulary, no two onto one), naming the first bad draft id; None when it is one."""
    draft = torch.arange(d2t.numel(), device=d2t.device)
    mapped = draft + d2t.to(torch.long)
    fix = "regenerate the drafter's vocab mapping (SpecForge's d2t)"
    outside = ((mapped < 0) | (mapped >= vocab_size)).nonzero()
    if outside.numel():
        i = int(outside[0, 0])
        return (f"d2t maps draft id {i} to target id {int(mapped[i])}, outside the target's vocabulary "
                f"[0, {vocab_size}) ({outside.shape[0]} such ids); {fix}")
    values, counts = mapped.unique(return_counts=True)
    if bool((counts > 1).any()):
        t = int(values[counts > 1][0])
        ids = (mapped == t).nonzero().flatten()[:2].tolist()
        return f"d2t maps draft ids {ids[0]} and {ids[1]} onto one target id {t}; {fix}"
    return None


class DraftVocabProposer(Proposer):
    """The draft at a depth: the argmax of the drafter's own head over its draft vocabulary, mapped to the
    target's by ``d2t`` (as SpecForge's accuracy, SGLang and vLLM map it). Its overlap with the target's stored
    top-K gives a target token outside the draft vocabulary a draft probability of 0."""

    def __init__(self, spec: DrafterSpec, lm_head: torch.Tensor, mem_bytes: int, module: Eagle3Drafter,
                 figures: FamilyFigures | None = None):
        super().__init__(spec, lm_head, mem_bytes, figures)
        self.head = module.lm_head.weight
        self.d2t = module.d2t
        draft = torch.arange(self.d2t.numel(), device=self.d2t.device)
        mapped = draft + self.d2t
        why = d2t_problem(self.d2t, int(spec.vocab_size))
        if why is not None:
            raise ValueError(why)
        # target id -> draft id, -1 outside the draft vocabulary
        self.t2d_index = torch.full((spec.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        self.t2d_index[mapped] = draft

    def rows(self, hidden: torch.Tensor, previous: torch.Tensor, target: torch.Tensor, *, tree_k: int = 0,
             parts: bool = False, target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
             state: torch.Tensor | None = None) -> RowDrafts:
        topk = None
        if target_topk is not None:
            ids, logprobs = target_topk
            index = self.t2d_index.to(ids.device)
            topk = (torch.where(ids >= 0, index[ids.clamp(min=0)], -1), logprobs)
        out = apply_head(hidden, self.head, self.spec, 0, self.mem_bytes, topk)
        tokens = out.argmax + self.d2t.to(out.argmax.device)[out.argmax]
        none = torch.zeros((tokens.shape[0], 0), dtype=torch.bool, device=tokens.device)
        return RowDrafts(tokens, none, none, None, out.overlap, None)
