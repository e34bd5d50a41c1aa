"""Shared fixtures: a tiny Qwen3 target and a cache of its states, built once per test session
through the real precompute (``--reference local --dtype float32``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Keep W&B local and quiet in every test, whatever the machine's configuration.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

TINY_LAYER_IDS = [0, 2]
TINY_MASK = 127  # prompts use ids < 120, so the mask token never appears in them


def build_tiny_cache(root: Path, n_prompts: int = 6, max_new_tokens: int = 24, prompt_seed: int = 1) -> Path:
    """Tiny target + prompts + cache under ``root``; returns the cache folder."""
    from tiny_target import random_prompts, save_tiny_qwen3, write_prompts

    from dflash_cb.cache.precompute import PrecomputeArgs, run_precompute

    target = save_tiny_qwen3(root / "target", seed=0)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(n_prompts, (5, 10), seed=prompt_seed, vocab=120),
                            categories=["code", "chat"])
    out = root / "cache"
    run_precompute(PrecomputeArgs(target=str(target), prompts=str(prompts), out=str(out), layers=TINY_LAYER_IDS,
                                  reference="local", dtype="float32", max_new_tokens=max_new_tokens, progress=False))
    return out


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy CI box spinning OpenMP threads cost seconds."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cache(tmp_path_factory.mktemp("tiny_cache"))


@pytest.fixture(scope="session")
def tiny_drafter_config(tiny_cache: Path) -> dict:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    m = StateCache(tiny_cache).manifest
    return tiny_drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS, TINY_MASK,
                               block_size=6)
