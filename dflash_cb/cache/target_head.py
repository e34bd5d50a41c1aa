"""Read a target's input embedding and output head straight from its safetensors files.

Evaluation needs only these two matrices of the target; loading the whole 52 GB model for them
would be wasteful, so the tensors are located through the checkpoint index and read alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..common.errors import DFlashCBError
from .states import TargetHead, read_tensor
from .target import is_vision_key


class TargetHeadError(DFlashCBError, ValueError):
    """A target folder's embedding or output head cannot be read or is inconsistent with its config."""

_EMBED_SUFFIX = "embed_tokens.weight"
_HEAD_KEYS = ("lm_head.weight",)


def weight_map(folder: Path) -> dict[str, str]:
    """{tensor name: the safetensors file in ``folder`` that holds it}, from the index or the files' headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise TargetHeadError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); "
                                  "copy the target folder again") from None
    if not folder.is_dir():
        raise TargetHeadError(f"--target {folder}: no such folder; pass the target model's folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetHeadError(f"{folder}: no safetensors weights (expected model.safetensors or an index)")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                out.update({k: f.name for k in h.keys()})
        except Exception as e:  # safetensors' own error type on a truncated file
            raise TargetHeadError(f"{f}: not a readable safetensors file ({e}); copy it again") from None
    return out


def _tie_flag(cfg: dict) -> bool | None:
    """``tie_word_embeddings`` of the (text) config, None when the config does not say."""
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c, dict) and "tie_word_embeddings" in c:
            return bool(c["tie_word_embeddings"])
    return None


def load_target_head(path: str | os.PathLike, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> TargetHead:
    """The target's embedding and head in ``dtype`` (as stored if None) on ``device``, each read
    straight into its destination (no float32 copy of a bf16 checkpoint, or the reverse)."""
    folder = Path(path)
    wmap = weight_map(folder)
    # Text embeddings only: a vision-language target also has vision-tower embeddings.
    embeds = sorted(k for k in wmap if k.endswith(_EMBED_SUFFIX) and not is_vision_key(k))
    if not embeds:
        from .needs import is_drafter_config

        try:
            drafter = is_drafter_config(json.loads((folder / "config.json").read_text()))
        except (OSError, ValueError):
            drafter = False
        what = "a drafter's folder (its config.json describes a drafter), not a target's" if drafter else \
            f"no '*{_EMBED_SUFFIX}' tensor in the checkpoint"
        raise TargetHeadError(f"{folder}: {what}; pass the target's own folder (the one the cache was made with)")
    embed_key = min(embeds, key=len)
    head_key = next((k for k in _HEAD_KEYS if k in wmap), None)
    cfg_path = folder / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError as e:
        raise TargetHeadError(f"{cfg_path}: not valid JSON ({e})") from None
    tie = _tie_flag(cfg)
    if head_key is None and tie is False:
        # Using the embedding as the head here would give a plausible but wrong tau.
        raise TargetHeadError(f"{cfg_path}: tie_word_embeddings is false, but the weights hold no "
                              f"{_HEAD_KEYS[0]!r}; the folder is incomplete: copy the target's weights again")
    tied = head_key is None or bool(tie)

    def read(key: str) -> torch.Tensor:
        try:
            with safe_open(str(folder / wmap[key]), framework="pt") as h:
                return read_tensor(h, key, dtype, device)
        except Exception as e:  # truncated file, or the index names a missing one
            raise TargetHeadError(f"{folder / wmap[key]}: cannot read {key!r} ({e}); copy the target again") from None

    embed = read(embed_key)
    head = embed if tied else read(head_key)
    return TargetHead(embed, head, tied)
