"""Chain drafters: one small decoder layer run step by step, step k fed its own state from step k - 1 and the
embedding of the token before it (the target's MTP head, EAGLE-3). ``ChainFamily`` is their base and
``ChainRunner`` drives any of them in the replay (docs/method.md, "Chain drafters").

Why a K-step unroll from every anchor is exact: a server rebuilds the chain's context (its layer's K/V over the
committed positions) from the target's features of the committed tokens only, and a step only matters when
every step before it matched, so its inputs are the target's own tokens. The chain's context row ``t`` is the
step fed the target's feature at ``t`` and the token at ``t + 1``; the first step of a cycle whose verified
token sits at ``a`` is row ``a - 1`` itself, and step ``k`` sits at position ``a + k - 2``, attending to rows
``0 .. a - 1`` and to the cycle's own steps. A block of ``K + 1`` positions (the verified token, then ``K``
drafts) is what the engine reads, so a chain of K steps is a block of K + 1.

A chain module implements ``ChainSteps``; everything else (the causal context pass, the batched unroll, the
attention over a sample's context and a block's own steps) is here, once for every chain family.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ...common.fileio import atomic_paths
from ...common.tensorfile import write_safetensors
from ..loop.limits import DEFAULT_LIMITS, MemoryLimits
from .base import DrafterFamily, _get
from .proposers import ArgmaxProposer, Proposer
from .runners import DraftRunner, HiddenBlocks
from .spec import DrafterSpec, config_value, int_field, layer_id_list

# What a config holding none says: the servers' common chain length (vLLM's and SGLang's MTP examples).
DEFAULT_SPECULATIVE_TOKENS = 3


class ChainSteps(Protocol):
    """What a chain drafter's module computes; ``ChainRunner`` does the rest."""

    num_heads: int  # query heads of the chain's attention
    num_kv_heads: int
    head_dim: int
    scaling: float

    def first_carry(self, features: torch.Tensor) -> torch.Tensor:
        """[r, H]: what the first step reads besides a token, from the cache's features [r, F] of the
        drafter's target layers (``DrafterSpec.target_layer_ids``)."""
        ...

    def embed(self, ids: torch.Tensor, target_embed: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ``ids`` (the drafter's own table, or the target's ``target_embed``)."""
        ...

    def step_qkv(self, embedded: torch.Tensor, carry: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """A step's attention inputs for n rows: q [n, heads, d], k and v [n, kv_heads, d] (position-encoded at
        ``positions`` [n]) and what ``step_out`` needs."""
        ...

    def step_out(self, attended: torch.Tensor, kept: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next step's carry [n, H], the hidden state the family's head drafts from [n, H']) from the
        attention's output [n, heads * d]."""
        ...


def save_chain_folder(module: nn.Module, path: str | os.PathLike, config: dict[str, Any]) -> None:
    """A drafter folder of a chain module: ``model.safetensors`` under its own weight names, ``config`` as
    ``config.json``, the two renamed into place together."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    with atomic_paths(path / "model.safetensors", path / "config.json") as (weights, config_file):
        write_safetensors(weights, state, {"format": "pt"})
        config_file.write_text(json.dumps(config, indent=2) + "\n")


@dataclass
class ChainContext:
    """A wave's chain context: per sample (at ``start[s]`` in the flat rows) its layer's K/V and each row's
    outputs (the step a cycle's first draft comes from)."""

    keys: torch.Tensor  # [rows, kv, d]
    values: torch.Tensor
    carry: torch.Tensor  # [rows, H]
    head_in: torch.Tensor  # [rows, H']
    start: torch.Tensor  # [samples] first flat row
    rows: torch.Tensor  # [samples]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            own_k: torch.Tensor | None, own_v: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Softmax attention of n queries [n, heads, d] over shared keys [r, kv, d] (``visible`` [n, r]) and, per
    query, its own keys [n, j, kv, d] (all visible). Float32 scores; [n, heads * d] out."""
    n, heads, d = q.shape
    kv = keys.shape[1]
    g = heads // kv
    qg = q.float().view(n, kv, g, d)
    scores = torch.einsum("nkgd,rkd->nkgr", qg, keys.float()) * scaling
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if own_k is not None:
        own = torch.einsum("nkgd,njkd->nkgj", qg, own_k.float()) * scaling
        scores = torch.cat([scores, own], dim=-1)
    p = torch.softmax(scores, dim=-1)
    r = keys.shape[0]
    out = torch.einsum("nkgr,rkd->nkgd", p[..., :r], values.float())
    if own_v is not None:
        out = out + torch.einsum("nkgj,njkd->nkgd", p[..., r:], own_v.float())
    return out.reshape(n, heads * d).to(q.dtype)


def attend_steps(module: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                 own_k: torch.Tensor | None = None, own_v: torch.Tensor | None = None) -> torch.Tensor:
    """A chain module's attention of steps ``q`` over shared context keys and, per step, its own earlier steps'
    (the replay's unroll and a serving loop's, ``decode.loops``)."""
    return _attend(q, keys, values, visible, own_k, own_v, module.scaling)


class ChainRunner(DraftRunner):
    """Drives any ``ChainSteps`` module: the context pass (one causal pass of the chain's layer over each
    sample's rows), then per block the K-step unroll, each step batched over all the blocks (module docstring)."""

    context_reads_tokens = True

    def __init__(self, module: nn.Module, spec: DrafterSpec, limits: MemoryLimits = DEFAULT_LIMITS):
        self.module, self.spec, self.limits = module, spec, limits

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def token_embeddings(self, ids: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        return self.module.embed(ids, embed)

    def block_inputs(self, tokens: torch.Tensor, anchors: torch.Tensor, length: int,
                     embed: torch.Tensor) -> torch.Tensor:
        # The target's tokens from the verified one on: a step only matters when the drafts before it matched.
        at = (anchors[:, None] + torch.arange(length, device=anchors.device)[None, :]).clamp(max=tokens.numel() - 1)
        return self.module.embed(tokens[at], embed)

    def state_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        m = self.module
        # K/V, the carried state and the head's input (an upper bound: MTP's are one tensor)
        width = 2 * m.num_kv_heads * m.head_dim + 2 * int(m.config.hidden_size)
        return tokens * width * torch.finfo(dtype).bits // 8

    def _chunk(self, keys: int) -> int:
        """Queries per attention call, its float32 scores under ``limits.attn_bytes``."""
        return max(1, self.limits.attn_bytes // max(1, 4 * self.module.num_heads * (keys + 16)))

    def context(self, features: Iterable[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[int]) -> ChainContext:
        m = self.module
        parts: list[tuple[torch.Tensor, ...]] = []
        for (feats, nxt), r in zip(features, rows, strict=True):
            dev = feats.device
            carry0 = m.first_carry(feats[:r])
            q, k, v, kept = m.step_qkv(nxt[:r].to(carry0.dtype), carry0, torch.arange(r, device=dev))
            attended = torch.empty((r, m.num_heads * m.head_dim), dtype=q.dtype, device=dev)
            step = self._chunk(r)
            for i in range(0, r, step):
                j = min(r, i + step)
                visible = torch.arange(r, device=dev)[None, :] <= torch.arange(i, j, device=dev)[:, None]
                attended[i:j] = _attend(q[i:j], k, v, visible, None, None, m.scaling)
            carry, head_in = m.step_out(attended, kept)
            parts.append((k, v, carry, head_in))
        n_rows = torch.tensor([int(r) for r in rows], dtype=torch.long)
        start = torch.cumsum(n_rows, 0) - n_rows
        if not parts:
            raise ValueError("a wave without samples")
        keys, values, carry = (torch.cat([p[i] for p in parts]) for i in range(3))
        # One tensor when the next step is fed what the head drafts from (MTP's normed output).
        head_in = carry if all(p[3] is p[2] for p in parts) else torch.cat([p[3] for p in parts])
        return ChainContext(keys, values, carry, head_in, start.to(keys.device), n_rows.to(keys.device))

    def block_rows(self, context: ChainContext, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   samples: torch.Tensor, lengths: torch.Tensor | None = None) -> HiddenBlocks:
        m, ctx = self.module, context
        n, length = noise_embedding.shape[:2]
        first = ctx.start[samples] + anchors - 1  # the cycle's first step is context row a - 1
        carry = ctx.carry[first]
        out = torch.zeros((n, length, ctx.head_in.shape[-1]), dtype=ctx.head_in.dtype, device=ctx.head_in.device)
        out[:, 1] = ctx.head_in[first]
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        for step in range(2, length):
            q, k, v, kept = m.step_qkv(noise_embedding[:, step - 1], carry, anchors + step - 2)
            own_k.append(k)
            own_v.append(v)
            ok, ov = torch.stack(own_k, dim=1), torch.stack(own_v, dim=1)
            attended = torch.empty((n, m.num_heads * m.head_dim), dtype=q.dtype, device=q.device)
            for s in torch.unique(samples).tolist():
                idx = (samples == s).nonzero()[:, 0]
                lo, r = int(ctx.start[s]), int(ctx.rows[s])
                keys, values = ctx.keys[lo:lo + r], ctx.values[lo:lo + r]
                step_n = self._chunk(r)
                for i in range(0, idx.numel(), step_n):
                    sel = idx[i:i + step_n]
                    visible = torch.arange(r, device=q.device)[None, :] < anchors[sel][:, None]
                    attended[sel] = _attend(q[sel], keys, values, visible, ok[sel], ov[sel], m.scaling)
            carry, head_in = m.step_out(attended, kept)
            out[:, step] = head_in
        return HiddenBlocks(out)


def first_step_loss(runner: ChainRunner, features: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor,
                    lm_head: torch.Tensor) -> torch.Tensor:
    """Teacher-forced cross-entropy of a chain's first step over one sample (context row t drafts the token at
    t + 2), through the replay's own context pass: how a small chain drafter is trained for a demo or a test."""
    r = ids.numel() - 2
    nxt = runner.token_embeddings(ids[1:r + 1], embed)
    ctx = runner.context(iter([(features, nxt)]), [r])
    return nn.functional.cross_entropy((ctx.head_in @ lm_head.T.to(ctx.head_in.dtype)).float(), ids[2:r + 2])


def train_first_step(module: nn.Module, cache: Any, epochs: int, lr: float) -> nn.Module:
    """AdamW on ``first_step_loss`` over every sample of ``cache`` (read once), one step a sample, for ``epochs``:
    a small chain drafter for a demo or a test (a stand-in for a target's own head)."""
    head = cache.load_head()
    runner = ChainRunner(module, module.spec)
    columns = cache.feature_columns(module.spec.target_layer_ids)
    data = [((s.hidden if columns is None else s.hidden.index_select(1, columns)).float(), s.input_ids.long())
            for s in cache.load_many([e.id for e in cache.samples])]
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    for _ in range(epochs):
        for feats, ids in data:
            loss = first_step_loss(runner, feats, ids, head.embed_tokens, head.lm_head)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return module.eval()


class ChainFamily(DrafterFamily):
    """A family of chain drafters (module docstring). Its configs say ``drafter_family`` and name the target
    layers they read (``target_layer_ids``) and the chain's length (``num_speculative_tokens``, K: a block of
    K + 1). Drafts depend on the token before them, so no DDTree of per-depth top-K is what a server verifies."""

    kind = "chain"
    supports_tree = False
    specforge_accuracy = False
    # The longest chain the replay unrolls when asked for more steps than the config's K.
    max_speculative_tokens: ClassVar[int] = 15

    def config_says(self, config: Any) -> bool:
        return _get(config, "drafter_family") == self.name or super().config_says(config)

    def tiny_config(self, target_config: dict[str, Any], layer_ids: Sequence[int],
                    speculative_tokens: int) -> dict[str, Any] | None:
        """A small drafter ``config.json`` of this family for a tiny target (``target_config``) whose cache holds
        ``layer_ids``, K = ``speculative_tokens`` (the demo's and the tests' drafters); None: the family has none."""
        return None

    def module_class(self) -> type[nn.Module]:
        raise NotImplementedError

    def spec(self, config: Any) -> DrafterSpec:
        ids = self.target_layers(config)
        k = int_field(config_value(config, "num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS),
                      "num_speculative_tokens")
        if not 1 <= k <= self.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens is {k}; a {self.label} chain drafts 1 .. "
                             f"{self.max_speculative_tokens} tokens per cycle")
        return DrafterSpec(
            block_size=k + 1,
            target_layer_ids=tuple(ids),
            target_hidden_size=int(_get(config, "target_hidden_size") or _get(config, "hidden_size")),
            vocab_size=int_field(_get(config, "vocab_size"), "vocab_size"),
            family=self.name,
            options=self.spec_options(config),
        )

    def target_layers(self, config: Any) -> list[int]:
        """The cache layer ids (docs/cache-format.md, "Layer id convention") a config's drafter reads, in the
        order its features are concatenated: ``target_layer_ids``; a family whose format names them otherwise
        maps its own field here."""
        return layer_id_list(config_value(config, "target_layer_ids"), "target_layer_ids")

    def spec_options(self, config: Any) -> tuple[tuple[str, Any], ...]:
        return ()

    def block_cap(self, spec: DrafterSpec) -> int:
        return self.max_speculative_tokens + 1

    def cost_fields(self, config: Any) -> dict[str, int]:
        hidden = int(_get(config, "hidden_size"))
        return dict(carry_width=2 * hidden, token_input=hidden)  # the carried state and head input; fc's token half

    def draft_passes(self, block_size: int) -> int:
        return block_size - 1  # one step per draft

    def setting_label(self, block_size: int) -> str:
        return f"chain K={block_size - 1}"

    def runner(self, drafter: Any, limits: MemoryLimits) -> DraftRunner | None:
        if isinstance(drafter, self.module_class()):
            return ChainRunner(drafter, drafter.spec, limits)
        adopted = self.adopt(drafter) if isinstance(drafter, nn.Module) else None  # a training loop's module
        return ChainRunner(adopted, adopted.spec, limits) if adopted is not None else None

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        return ArgmaxProposer(spec, lm_head, mem_bytes, self.figures)
