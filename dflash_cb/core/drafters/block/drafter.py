"""The block drafters' backbone module (``BlockDrafter``): loads the published DFlash checkpoint format as it is.

Weight names, config fields and numerics follow the reference ``dflash.model.DFlashDraftModel`` (a Qwen3 config
plus ``num_target_layers``, ``block_size`` and a ``dflash_config`` dict), so a folder saved here loads there and
vice versa. Besides the reference ``forward`` (used for training), the module exposes the two halves the
evaluation engine batches separately: ``context_kv`` / ``stream_context`` (depends only on the cached target
features: computed once per sample, for many samples together) and ``block_rows`` (many anchors' blocks of many
samples in one pass, each block seeing its own sample's context prefix; ``forward_samples`` finishes every row).
The block, its attention and the sliding-window rule: docs/method.md. Each block family's module subclasses it
(its folder's ``model.py``); which family a config is: ``registry.family_of``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from ..layouts import load_state_dict_strict
from ..registry import family_named, family_said
from .attention import (
    PADDING,
    SMALL_PART,
    AttentionPart,
    BlockDecoderLayer,
    ContextKV,
    DeferredBlocks,
    specforge_mask_difference,
)


class BlockDrafter(nn.Module):
    """The block drafters' backbone (DFlash's published module and every family on it): ``layers.N.*``, ``fc``,
    ``hidden_norm``, ``norm``; no vocabulary matrices. A family's module subclasses it and names its family."""

    family: ClassVar[str]  # the family's name (``DrafterFamily.name``), set by each family's module

    def __init__(self, config: Qwen3Config):
        said = family_said(config)
        if said is not None and said.name != self.family:
            raise ValueError(f"the config is a {said.label} drafter's, not a {family_named(self.family).label} "
                             "one: build it with the class of its family (layouts.drafter_from_config, "
                             "checkpoints.load_drafter)")
        super().__init__()
        self.config = config
        self.spec = family_named(self.family).spec(config)
        self.layers = nn.ModuleList(self._layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        n_ctx = len(self.spec.target_layer_ids) * self.spec.target_hidden_size
        self.fc = nn.Linear(n_ctx, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.reset_parameters()

    def _layer(self, config: Qwen3Config, layer_idx: int) -> BlockDecoderLayer:
        return BlockDecoderLayer(config, layer_idx)

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
        True = visible) is optional, as in the reference; without it context and block are fully visible
        (narrowed by each layer's position rule). No branch depends on tensor values, so this traces into
        one graph (``torch.compile(fullgraph=True)``).
        """
        if past_key_values is not None:
            raise NotImplementedError("BlockDrafter does not keep a KV cache; the engine batches anchors instead")
        c = target_hidden.shape[1]
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        ctx = self.hidden_norm(self.fc(target_hidden))
        base = None if attention_mask is None else attention_mask.bool()
        masks = self._layer_masks(base, position_ids[:, c:], position_ids, context_keys=c)
        h = noise_embedding
        for layer, mask in zip(self.layers, masks, strict=True):
            kv = layer.self_attn.project_kv(ctx, cos[:, :c], sin[:, :c])
            h = layer(h, kv, cos[:, c:], sin[:, c:], mask)
        return self.norm(h)

    def _layer_masks(self, base: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     masks: str = "served", context_keys: int = 0) -> list[torch.Tensor | None]:
        """Per layer: ``base`` [B, 1, L, K] (None = all visible) narrowed by the layer's reach under ``masks``.

        Layers with the same reach share one mask. Decided from the config alone (never from mask
        values), so it compiles without graph breaks; an unrestricted layer keeps ``base`` as it is.
        """
        by_reach: dict[tuple[int | None, int | None], torch.Tensor | None] = {}
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            key = attn.reach(masks)
            if key not in by_reach:
                if attn.unrestricted_under(masks):
                    by_reach[key] = base
                else:
                    full = base if base is not None else torch.ones(
                        q_pos.shape[0], 1, q_pos.shape[1], k_pos.shape[1], dtype=torch.bool, device=q_pos.device)
                    by_reach[key] = attn.visibility(full, q_pos, k_pos, masks, context_keys)
            out.append(by_reach[key])
        return out

    def specforge_difference(self, block_size: int | None = None) -> str | None:
        """``specforge_mask_difference`` of this drafter at ``block_size`` (None: its own): None when SpecForge
        trains it under its served masks."""
        return specforge_mask_difference(self.config, block_size or self.spec.block_size)

    # -- engine interface -----------------------------------------------------
    def context_kv(self, target_hidden: torch.Tensor | Sequence[torch.Tensor]) -> ContextKV:
        """Context K/V of one sample's features [T, F] (positions 0..T-1), or of a sequence of samples'."""
        feats = [target_hidden] if isinstance(target_hidden, torch.Tensor) else list(target_hidden)
        return self.stream_context(feats, [f.shape[0] for f in feats])

    def stream_context(self, features: Iterable[torch.Tensor], rows: Sequence[int],
                       batch_bytes: int | None = None) -> ContextKV:
        """Context K/V of samples whose features ([rows[s], F] each) arrive one at a time.

        The projection (``fc``, ``hidden_norm``, each layer's k and v) is token-wise, so the samples are
        projected together, in batches whose features stay under ``batch_bytes`` (None: all at once),
        straight into the flat K/V: one small matmul per layer per batch instead of per sample.
        """
        starts = [0]
        for r in rows[:-1]:
            starts.append(starts[-1] + r)
        total = sum(rows)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        pending: list[torch.Tensor] = []
        done = 0  # flat rows written
        held = 0  # bytes of features pending

        def project() -> None:
            nonlocal done, held
            x = torch.cat(pending) if len(pending) > 1 else pending[0]
            pos = torch.cat([torch.arange(f.shape[0], device=x.device) for f in pending])
            ctx = self.hidden_norm(self.fc(x))
            cos, sin = self.rotary_emb(ctx, pos)
            for li, layer in enumerate(self.layers):
                k, v = layer.self_attn.project_kv(ctx, cos, sin)
                if len(layers) <= li:
                    layers.append((k.new_empty(k.shape[0], total, k.shape[2]),
                                   v.new_empty(v.shape[0], total, v.shape[2])))
                layers[li][0][:, done:done + k.shape[1]] = k
                layers[li][1][:, done:done + v.shape[1]] = v
            done += x.shape[0]
            pending.clear()
            held = 0

        for f in features:
            if f.shape[0] == 0:
                continue
            pending.append(f)
            held += f.numel() * f.element_size()
            if batch_bytes is not None and held >= batch_bytes:
                project()
        if pending:
            project()
        if not layers:  # no sample has a context row
            attn = self.layers[0].self_attn
            w = self.fc.weight
            layers = [(w.new_empty(attn.num_kv_heads, 0, attn.head_dim), w.new_empty(attn.num_kv_heads, 0, attn.head_dim))
                      for _ in self.layers]
        return ContextKV(layers, starts, list(rows))

    def extend_context(self, context: ContextKV, features: torch.Tensor) -> ContextKV:
        """One sample's context K/V with the rows ``features`` [r, F] appended at the positions after its own: the
        token-wise projection of those rows alone, as a server projects each committed token once."""
        if len(context.rows) != 1:
            raise ValueError("extend_context appends to one sample's context")
        start = context.rows[0]
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary_emb(ctx, torch.arange(start, start + features.shape[0], device=features.device))
        layers = []
        for (old_k, old_v), layer in zip(context.layers, self.layers, strict=True):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            layers.append((torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)))
        return ContextKV(layers, [0], [start + features.shape[0]])

    def context_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of context K/V one cached position costs (all layers, keys and values)."""
        attn = self.layers[0].self_attn
        elem = dtype.itemsize
        return len(self.layers) * 2 * attn.num_kv_heads * attn.head_dim * elem

    def forward_blocks(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks [A, L, hidden] anchored at ``anchors`` [A] of one sample; block a sees context rows
        [0, anchors[a]). ``lengths`` [A] (<= L) makes block a behave as a block of that length (the loop's
        shorter tail block): its padding positions are hidden from every query; their outputs are meaningless.
        """
        samples = torch.zeros_like(anchors)
        return self.forward_samples(context, noise_embedding, anchors, samples, lengths)

    def forward_samples(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                        samples: torch.Tensor, lengths: torch.Tensor | None = None, attn_mem_bytes: int | None = None,
                        masks: str = "served") -> torch.Tensor:
        """Hidden states [N, L, hidden] of blocks of several samples in one pass (``block_rows``, every row)."""
        h, attended, carry, at = self._through_last_attention(context, noise_embedding, anchors, samples, lengths,
                                                              attn_mem_bytes, masks)
        out = self.norm(self.layers[-1].finish(h, attended, carry))
        return out if at is None else out[at]

    def block_rows(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                   samples: torch.Tensor, lengths: torch.Tensor | None = None, attn_mem_bytes: int | None = None,
                   masks: str = "served") -> DeferredBlocks:
        """Blocks of several samples in one pass, up to the last layer's attention: block ``i`` is anchored at
        ``anchors[i]`` and sees the context of sample ``samples[i]`` (an index into ``context``; each sample's
        blocks next to each other). What follows (``o_proj``, MLP, norms) is token-wise, so ``DeferredBlocks``
        runs it only on the positions a caller reads.

        Token-wise work (projections, norms, MLP) runs on all rows together; attention runs on parts of rows,
        several samples per kernel call, each block over its own sample's context prefix, with temporaries
        under ``attn_mem_bytes`` (None: no limit). ``masks`` (``MASKS``): "specforge" runs the blocks under
        SpecForge's training masks instead.
        """
        h, attended, _, at = self._through_last_attention(context, noise_embedding, anchors, samples, lengths,
                                                          attn_mem_bytes, masks)
        return DeferredBlocks(self, h, attended, at)

    def _through_last_attention(self, context: ContextKV, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                                samples: torch.Tensor, lengths: torch.Tensor | None, attn_mem_bytes: int | None,
                                masks: str) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor | None]:
        """(the last layer's input, its attention output before ``o_proj``, what its ``finish`` needs
        besides) of every block, and where block i's rows are in them (None: at i; ``_context_order``)."""
        n = noise_embedding.shape[1]
        anchor_list, sample_list = anchors.tolist(), samples.tolist()  # one host sync: plans need the values
        order = self._context_order(anchor_list, sample_list, n)
        at = None
        if order is not None:
            at = torch.empty(len(order), dtype=torch.long)
            at[torch.tensor(order)] = torch.arange(len(order))
            at = at.to(anchors.device)
            index = torch.tensor(order, device=anchors.device)
            noise_embedding, anchors = noise_embedding[index], anchors[index]
            lengths = None if lengths is None else lengths[index]
            anchor_list, sample_list = [anchor_list[r] for r in order], [sample_list[r] for r in order]
        parts = self._attention_parts(context, anchors, lengths, anchor_list, sample_list, n, attn_mem_bytes,
                                      noise_embedding.element_size(), masks, by_context=order is not None)
        q_pos = anchors[:, None] + torch.arange(n, device=anchors.device)[None, :]
        cos, sin = self.rotary_emb(noise_embedding, q_pos)
        h = noise_embedding
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, carry = layer.attention_input(h)
            q = attn.project_q(x, cos, sin)
            bk, bv = attn.project_kv(x, cos, sin)
            ck_all, cv_all = context.layers[li]
            outs = []
            for part in parts:
                if part.context_index is None:
                    s = part.context_start
                    ck, cv = ck_all[:, s:s + part.context], cv_all[:, s:s + part.context]
                else:
                    idx = part.context_index
                    b = idx.shape[0]
                    ck = ck_all.index_select(1, idx.reshape(-1)).view(ck_all.shape[0], b, part.context, -1).transpose(0, 1)
                    cv = cv_all.index_select(1, idx.reshape(-1)).view(cv_all.shape[0], b, part.context, -1).transpose(0, 1)
                o = attn.attend(q[part.rows], bk[part.rows], bv[part.rows], ck, cv, part.masks[li], part.group)
                outs.append(o if part.keep is None else o[part.keep])
            a_out = torch.cat(outs) if len(outs) > 1 else outs[0]
            if li == last:
                return h, a_out, carry, at
            h = layer.finish(h, a_out, carry)
        raise AssertionError("a drafter has at least one layer")

    @staticmethod
    def _context_order(anchor_list: list[int], sample_list: list[int], n: int) -> list[int] | None:
        """The order a pass runs its blocks in, when not the given one (None): by context length, where the
        blocks of a sample could not share one copy of its context anyway (``_attention_part``'s ``group``
        would be 1: short contexts, or a few blocks per sample, as a light evaluation's rounds draft). Each
        attention part then pads its rows' keys to a context close to their own (docs/method.md, "Drafting
        only where the metrics look")."""
        runs = 1 + sum(a != b for a, b in zip(sample_list, sample_list[1:], strict=False))
        if runs == 1 or not (max(anchor_list) < 8 * n or len(anchor_list) < 2 * runs):
            return None
        return sorted(range(len(anchor_list)), key=anchor_list.__getitem__)

    def _attention_parts(self, context: ContextKV, anchors: torch.Tensor, lengths: torch.Tensor | None,
                         anchor_list: list[int], sample_list: list[int], n: int, mem_bytes: int | None, elem: int,
                         masks: str, by_context: bool = False) -> list[AttentionPart]:
        """The rows cut into consecutive parts whose attention temporaries stay under ``mem_bytes``: per block,
        its share of the copied context keys and values, its mask and the kernel's score rows. Rows in order
        of their context (``by_context``) are also cut where a part would pad its keys too much
        (``_context_run``)."""
        total = anchors.shape[0]
        if total == 0:
            return []
        attn = self.layers[0].self_attn
        per_key = 2 * attn.num_kv_heads * attn.head_dim * elem + n + attn.num_heads * n * 4
        parts, i = [], 0
        while i < total:
            if by_context:
                j = self._context_run(anchor_list, i, n, per_key, mem_bytes)
            elif mem_bytes is None:
                j = total
            else:  # the longest run from i whose blocks fit at the run's widest context (cost grows with j)
                widest, j = anchor_list[i], i + 1
                while j < total and (j - i + 1) * (max(widest, anchor_list[j]) + n) * per_key <= mem_bytes:
                    widest = max(widest, anchor_list[j])
                    j += 1
            parts.append(self._attention_part(context, anchors, lengths, anchor_list, sample_list, i, j, n, masks))
            i = j
        return parts

    @staticmethod
    def _context_run(anchor_list: list[int], i: int, n: int, per_key: int, mem_bytes: int | None) -> int:
        """End of the part that starts at row i (rows in order of their context): grown while its temporaries
        fit and its padding (every row attends over the widest context of the part) stays under a quarter of
        the keys its rows need, or the part is still small (a kernel call has a fixed cost)."""
        total = len(anchor_list)
        needed, j = anchor_list[i] + n, i + 1
        while j < total:
            keys = anchor_list[j] + n
            rows = j - i + 1
            if mem_bytes is not None and rows * keys * per_key > mem_bytes:
                break
            if rows > SMALL_PART and rows * keys > PADDING * (needed + keys):
                break
            needed += keys
            j += 1
        return j

    def _attention_part(self, context: ContextKV, anchors: torch.Tensor, lengths: torch.Tensor | None,
                        anchor_list: list[int], sample_list: list[int], i: int, j: int, n: int,
                        masks: str) -> AttentionPart:
        """Rows [i, j): packed ``group`` blocks of one sample per attention row set, with per-layer masks."""
        dev = anchors.device
        c = max(anchor_list[i:j])  # no block sees past its anchor: trim the keys
        runs: list[tuple[int, int]] = []  # (first row, rows) of each sample's run
        for r in range(i, j):
            if runs and sample_list[r] == sample_list[runs[-1][0]]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((r, 1))
        count = j - i
        # Pack ~C / (4 L) blocks of a sample per attention row set (at most its typical run): their extra block
        # keys cost at most a quarter of the context's, and the context keys are copied once per group.
        group = max(1, min(c // (4 * n), count // len(runs)))
        one = len(runs) == 1
        rows: slice | torch.Tensor = slice(i, j)
        set_samples = [sample_list[r] for r, m in runs for _ in range(0, m, group)]
        start = context.starts[set_samples[0]]
        if count == 1 and lengths is None:
            # One whole block over its own prefix: everything is visible but for the layers' reach.
            if all(layer.self_attn.unrestricted_under(masks) for layer in self.layers):
                layer_masks: list[torch.Tensor | None] = [None] * len(self.layers)  # no positions to build
            else:
                q_pos = anchors[i:j, None] + torch.arange(n, device=dev)[None, :]
                k_pos = torch.cat([torch.arange(c, device=dev)[None, :], q_pos], dim=1)
                layer_masks = self._layer_masks(None, q_pos, k_pos, masks, c)
            return AttentionPart(rows, None, c, 1, start, None, layer_masks)
        keep = None
        if group > 1 and any(m % group for _, m in runs):  # pad each run by repeating its last block
            packed, kept = [], []
            for r, m in runs:
                kept.extend(range(len(packed), len(packed) + m))
                packed.extend(range(r, r + m))
                packed.extend([r + m - 1] * ((-m) % group))
            rows = torch.tensor(packed, device=dev)
            keep = torch.tensor(kept, device=dev)
        anc = anchors[rows]
        lens = torch.full_like(anc, n) if lengths is None else lengths[rows]
        b, m = anc.shape[0] // group, group * n
        packed_pos = (anc[:, None] + torch.arange(n, device=dev)[None, :]).reshape(b, m)
        q_anchor = anc.view(b, group, 1).expand(b, group, n).reshape(b, m)
        member = torch.arange(group, device=dev).repeat_interleave(n)  # block of each packed row
        in_block = (torch.arange(n, device=dev)[None, :] < lens[:, None]).reshape(b, m)
        see_ctx = torch.arange(c, device=dev)[None, None, :] < q_anchor[:, :, None]  # [b, m, C]
        see_blk = (member[:, None] == member[None, :])[None] & in_block[:, None, :]  # [b, m, m]
        base = torch.cat([see_ctx, see_blk], dim=2)[:, None]
        k_pos = torch.cat([torch.arange(c, device=dev).expand(b, c), packed_pos], dim=1)
        index = None
        if not one:  # each row set's own sample's rows; keys past a sample's rows are masked (see_ctx)
            first = torch.tensor([context.starts[s] for s in set_samples], device=dev)
            last = max(sum(context.rows) - 1, 0)
            index = (first[:, None] + torch.arange(c, device=dev)[None, :]).clamp(max=last)
        return AttentionPart(rows, keep, c, group, start if one else None, index,
                              self._layer_masks(base, packed_pos, k_pos, masks, c))

    # -- checkpoint format ----------------------------------------------------
    @classmethod
    def from_config_dict(cls, data: dict[str, Any]) -> BlockDrafter:
        return cls(Qwen3Config.from_dict(dict(data)))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> BlockDrafter:
        """Load a drafter folder (``config.json`` + safetensors) into this class; missing or unexpected keys
        are errors (``checkpoints.load.load_drafter`` picks the class from the folder)."""
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
        """The published format: ``model.safetensors`` under this class's key names and ``config.json``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(self._published_config().to_json_string(use_diff=False))

    def _published_config(self) -> Qwen3Config:
        """The config ``save_pretrained`` writes: DFlash's as it is; a family on this backbone names itself
        (``family_config``)."""
        return self.config

    def family_config(self) -> Qwen3Config:
        """A copy of the config whose ``architectures`` names this module's family."""
        import copy

        config = copy.deepcopy(self.config)
        config.architectures = [family_named(self.family).architecture]
        return config



