"""The world the served-check tests share (test_served.py for SGLang, test_served_vllm.py for vLLM): a
tiny target, a local cache to train on, a briefly trained drafter (the one the fake servers serve, run
by the reference ``dflash.model.DFlashDraftModel``) and an untrained one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import oracles
import torch
from full_block_loop import FullBlockRun, full_block_generate

LAYERS = [1, 3]
MAX_NEW = 40
BLOCK = 6
N_PROMPTS = 6


def drafter_config(vocab: int, hidden: int) -> dict:
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=4, block_size=BLOCK,
        dflash_config={"target_layer_ids": LAYERS, "mask_token_id": vocab - 1},
    )


def precompute(*args: str) -> int:
    from dflash_cb.cache.precompute import main

    return main([*args, "--layers", ",".join(map(str, LAYERS)), "--dtype", "float32",
                 "--max-new-tokens", str(MAX_NEW), "--no-progress"])


def build_world(root: Path) -> dict[str, Any]:
    """Tiny target, a local cache to train on, the served drafter (trained) and another one (untrained)."""
    from tiny_target import random_prompts, save_tiny_qwen3, train_briefly, write_prompts
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    dm = oracles.require("dflash.model")
    target_dir = save_tiny_qwen3(root / "target", seed=3)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(N_PROMPTS, (4, 12), seed=5, vocab=120),
                            categories=["math", "code"])
    assert precompute("--target", str(target_dir), "--prompts", str(prompts), "--out", str(root / "local"),
                      "--reference", "local") == 0
    cache = StateCache(root / "local")
    m = cache.manifest
    cfg = drafter_config(m.vocab_size, m.hidden_size)
    torch.manual_seed(0)
    other = DFlashDrafter.from_config_dict(cfg).eval()
    served = train_briefly(DFlashDrafter.from_config_dict(cfg), cache)  # partial acceptance: rounds informative
    served.save_pretrained(root / "drafter-served")
    other.save_pretrained(root / "drafter-other")
    ref = dm.DFlashDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(served.state_dict())
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return dict(root=root, target_dir=target_dir, prompts=prompts, ref=ref, target=target, mask=m.vocab_size - 1,
                stop=m.stop_token_ids, drafter=root / "drafter-served", other=root / "drafter-other", runs={})


def served_run(world: dict[str, Any], prompt: Sequence[int], max_tokens: int, stops: Iterable[int],
               block: int) -> FullBlockRun:
    """What the fake servers run for a request: the reference full-block loop (tests/support/full_block_loop.py) with the
    served drafter at ``block``. It is deterministic, and the tests send the same requests to many servers: each
    request's run is computed once per session (``world["runs"]``). Read it, never change it."""
    key = (tuple(prompt), int(max_tokens), frozenset(stops), int(block))
    if key not in world["runs"]:
        world["runs"][key] = full_block_generate(world["ref"], world["target"], list(prompt), max_tokens, sorted(key[2]),
                                                 LAYERS, block, world["mask"])
    return world["runs"][key]


def edited_cache(src: Path, dst: Path, edit) -> Path:
    """A copy of the cache at ``src`` whose manifest ``edit(manifest_dict)`` changed (the shards are the same)."""
    from dflash_cb.cache.manifest import MANIFEST_NAME

    shutil.copytree(src, dst)
    data = json.loads((dst / MANIFEST_NAME).read_text())
    edit(data)
    (dst / MANIFEST_NAME).write_text(json.dumps(data))
    return dst
