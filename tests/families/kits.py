"""What the conformance suite needs of each drafter family, registered here by name: a small config, the
family's own reference module with our module's weights, and its own reference generate loop (an oracle not
written by us). A family the registry finds (``dflash_cb.core.drafters.registry``) without a kit here fails the
suite's first test: registering a family means adding its kit, not copying a test file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import oracles
import torch

LAYERS = [1, 3]  # outputs of decoder layers 1 and 3 of the 4-layer tiny target


@dataclass(frozen=True)
class Kit:
    config: Callable[[int, int, int], dict]  # (vocab, hidden, block) -> config.json
    reference: Callable[[Any, dict], Any]  # (our trained module, its config) -> the reference module, same weights
    loop: Callable[..., list[int]]  # (reference, target, prompt [1, P], max_new, stops, block) -> lengths
    loss: Any = None  # tiny_target.train_briefly's extra loss term
    train_epochs: int = 6


def _block_config(architecture: str, **fields: Any) -> Callable[[int, int, int], dict]:
    def config(vocab: int, hidden: int, block: int) -> dict:
        return dict(
            architectures=[architecture], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=4, block_size=block,
            # The second layer is causal with a window shorter than the contexts (docs/method.md).
            layer_types=["full_attention", "sliding_attention"], sliding_window=9, use_sliding_window=True,
            dflash_config={"target_layer_ids": LAYERS, "mask_token_id": vocab - 1, **fields})

    return config


def _dflash_generate(ref: Any, target: Any, prompt: torch.Tensor, max_new: int, stops: list[int],
                     block: int) -> list[int]:
    """dflash's own ``dflash_generate`` (it times itself with CUDA events; a wall clock does that job here)."""
    dm = oracles.require("dflash.model")
    orig = dm._cuda_time
    dm._cuda_time = time.perf_counter
    try:
        run = dm.dflash_generate(ref, target, prompt, max_new, stops, block_size=block, return_stats=True)
    finally:
        dm._cuda_time = orig
    return list(run.acceptance_lengths)


def _dflash_reference(ours: Any, cfg: dict) -> Any:
    from transformers import Qwen3Config

    ref = oracles.require("dflash.model").DFlashDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(ours.state_dict())
    return ref


def _dflash2_reference(ours: Any, cfg: dict) -> Any:
    from transformers import Qwen3Config

    ref = oracles.require("dflash.model").DFlash2DraftModel(Qwen3Config(**cfg)).eval()
    # The reference module's codebooks are embeddings.
    ref.load_state_dict({k + ".weight" if k.endswith("codebook") else k: v for k, v in ours.state_dict().items()})
    return ref


def _selector_loss(*args: Any) -> Any:
    from tiny_target import selector_loss

    return selector_loss(*args)


KITS: dict[str, Kit] = {
    "dflash": Kit(_block_config("DFlashDraftModel"), _dflash_reference, _dflash_generate),
    "dflash2": Kit(_block_config("DFlash2DraftModel", conv_group_size=8, conv_kernel_size=2, selector_rank=8,
                                 selector_top_k=4),
                   _dflash2_reference, _dflash_generate, loss=_selector_loss, train_epochs=20),
}
