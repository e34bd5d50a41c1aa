"""Synthetic caches and drafters of any size for the benchmarks (random weights, random features)."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import save
from transformers import Qwen3Config

from dflash_cb.cache.manifest import HEAD_NAME, Manifest, SampleEntry, ShardEntry, shard_name
from dflash_cb.cache.states import StateCache, TargetHead
from dflash_cb.common.fileio import atomic_write_bytes
from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.drafters.dflash.runner import FastRunner
from dflash_cb.core.drafters.proposers import apply_head
from dflash_cb.core.drafters.runners import block_embeddings

PRESETS = {
    # The Qwen3.6-27B drafter's shape: 5 layers, hidden 5120, 32/8 heads of 128, vocab 248,320.
    "qwen36-27b": dict(hidden=5120, layers=5, heads=32, kv=8, head_dim=128, inter=17408, vocab=248320,
                       target_layers=[1, 16, 31, 46, 61], block=16),
    # Demo scale: the size a CPU run actually evaluates; per-call overhead dominates a per-cycle loop.
    "cpu-tiny": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128, vocab=512,
                     target_layers=[1, 3], block=16),
    # Compute-bound on CPU: batching buys less, all-anchor work costs more.
    "cpu": dict(hidden=256, layers=2, heads=4, kv=2, head_dim=64, inter=512, vocab=4096,
                target_layers=[1, 3, 5], block=16),
}


def cache_arguments(ap: argparse.ArgumentParser, samples: int = 4) -> None:
    """The options of a benchmark on a synthetic cache: the preset (the real width is not run on a CPU) and the
    cache's samples and lengths."""
    ap.add_argument("--preset", default="cpu", choices=[k for k in PRESETS if k != "qwen36-27b"])
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=320, help="prompt + completion tokens per sample")


def drafter_config(p: dict) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv"],
        head_dim=p["head_dim"], max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e7,
        num_target_layers=max(p["target_layers"]) + 3, block_size=p["block"],
        dflash_config={"target_layer_ids": p["target_layers"], "mask_token_id": p["vocab"] - 1},
    )


def make_head(p: dict, seed: int, device: str, dtype: torch.dtype) -> TargetHead:
    g = torch.Generator(device=device).manual_seed(seed)
    embed = (torch.randn(p["vocab"], p["hidden"], generator=g, device=device) * 0.02).to(dtype)
    head = (torch.randn(p["vocab"], p["hidden"], generator=g, device=device) * 0.02).to(dtype)
    return TargetHead(embed, head, tied=False)


def write_cache(folder: str | os.PathLike, p: dict, samples: int, prompt_len: int, total_len: int,
                head: TargetHead, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                planted: FastRunner | None = None, write_head: bool = True) -> StateCache:
    """Random features and tokens; with ``planted``, completions follow the drafter for a random
    number of tokens per cycle, so acceptance is > 1 and the loop has a realistic cycle structure."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    gen_dev = head.embed_tokens.device  # random features are made where they are fast to make
    gd = torch.Generator(device=gen_dev).manual_seed(seed)
    fdim = len(p["target_layers"]) * p["hidden"]
    vocab = p["vocab"]
    feats_all = [torch.randn(total_len, fdim, generator=gd, device=gen_dev, dtype=dtype) for _ in range(samples)]
    tokens_all = [torch.randint(0, vocab - 1, (total_len,), generator=g) for _ in range(samples)]
    if planted is not None:
        plant(planted, head, feats_all, tokens_all, prompt_len, g)
    shards, entries = [], []
    for i in range(samples):
        feats, tokens = feats_all[i].cpu(), tokens_all[i]
        sid = f"syn-{i:04d}"
        name = shard_name(i)
        data = save({f"{sid}/input_ids": tokens.contiguous(), f"{sid}/hidden": feats.contiguous(),
                     f"{sid}/target_argmax": torch.roll(tokens, -1).contiguous()})
        atomic_write_bytes(folder / name, data)
        shards.append(ShardEntry(name, hashlib.sha256(data).hexdigest(), len(data), [sid]))
        entries.append(SampleEntry(sid, ["math", "code", "chat"][i % 3], name, prompt_len,
                                   total_len - prompt_len, total_len, "length", i))
    head_info = None
    if write_head:
        head_bytes = save({"embed_tokens.weight": head.embed_tokens.cpu().contiguous(),
                           "lm_head.weight": head.lm_head.cpu().contiguous()})
        atomic_write_bytes(folder / HEAD_NAME, head_bytes)
        head_info = {"file": HEAD_NAME, "sha256": hashlib.sha256(head_bytes).hexdigest(), "tied": False,
                     "vocab_size": vocab, "hidden_size": p["hidden"], "dtype": str(head.lm_head.dtype)}
    Manifest(
        target={"name_or_path": "synthetic", "architecture": "synthetic", "num_layers": max(p["target_layers"]) + 3,
                "hidden_size": p["hidden"], "vocab_size": vocab, "config_sha256": "synthetic"},
        layer_ids=list(p["target_layers"]), dtype=str(dtype).removeprefix("torch."),
        reference={"kind": "synthetic", "max_new_tokens": total_len - prompt_len, "stop_token_ids": []},
        shards=shards, samples=entries,
        target_head=head_info,
    ).write(folder)
    return StateCache(folder)


def plant(runner: FastRunner, head: TargetHead, feats: list[torch.Tensor], tokens: list[torch.Tensor],
          prompt_len: int, g: torch.Generator) -> None:
    """Make each completion copy the drafter's block for 0-7 tokens per cycle, then mismatch.

    All samples advance together, one batched drafter pass per cycle (fast on a GPU even for 64
    samples of 2,048 tokens); ``tokens`` are edited in place.
    """
    dev = head.embed_tokens.device
    spec = runner.spec
    block, vocab = spec.block_size, head.lm_head.shape[0]
    context = runner.context((f.to(dev, runner.dtype) for f in feats), [f.shape[0] for f in feats])
    pos = [prompt_len] * len(tokens)
    while True:
        live = [i for i, t in enumerate(tokens) if pos[i] + 1 < t.shape[0]]
        if not live:
            return
        anchors = torch.tensor([pos[i] for i in live], device=dev)
        ends = torch.tensor([tokens[i].shape[0] for i in live], device=dev)
        lengths = torch.clamp(ends - anchors, max=block)
        first = torch.stack([tokens[i][pos[i]] for i in live]).to(dev)
        emb = block_embeddings(first, torch.arange(len(live), device=dev), block, spec, head.embed_tokens)
        blocks = runner.block_rows(context, emb.to(runner.dtype), anchors, torch.tensor(live, device=dev), lengths)
        hid = blocks.rows(torch.arange(len(live), device=dev)[:, None], torch.arange(1, block, device=dev)[None, :])
        drafts = apply_head(hid.reshape(-1, hid.shape[-1]).to(head.lm_head.dtype), head.lm_head, spec, 0
                            ).argmax.view(len(live), -1).cpu()
        for j, i in enumerate(live):
            p, length, draft, t = pos[i], int(lengths[j]), drafts[j], tokens[i]
            k = min(int(torch.randint(0, 8, (1,), generator=g)), length - 1)
            t[p + 1: p + 1 + k] = draft[:k]
            if k < length - 1 and p + k + 1 < t.shape[0]:
                t[p + k + 1] = (draft[k] + 1) % (vocab - 1)  # a guaranteed mismatch
            pos[i] = p + k + 1


def make_drafter(p: dict, seed: int, device: str, dtype: torch.dtype) -> DFlashDrafter:
    torch.manual_seed(seed)
    with torch.device(device):
        d = DFlashDrafter(drafter_config(p))
    return d.to(dtype=dtype).eval()
