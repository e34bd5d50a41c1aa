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

from .states import TargetHead

_EMBED_SUFFIX = "embed_tokens.weight"
_HEAD_KEYS = ("lm_head.weight",)


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors weights (expected model.safetensors or an index)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f.name for k in h.keys()})
    return out


def load_target_head(path: str | os.PathLike, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> TargetHead:
    folder = Path(path)
    wmap = _weight_map(folder)
    # Text embeddings only: a vision-language target also has vision-tower embeddings.
    embeds = sorted(k for k in wmap if k.endswith(_EMBED_SUFFIX) and "visual" not in k and "vision" not in k)
    if not embeds:
        raise KeyError(f"{folder}: no '*{_EMBED_SUFFIX}' tensor in the checkpoint")
    embed_key = min(embeds, key=len)
    head_key = next((k for k in _HEAD_KEYS if k in wmap), None)
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    tied = head_key is None or bool(cfg.get("tie_word_embeddings", False))

    def read(key: str) -> torch.Tensor:
        with safe_open(str(folder / wmap[key]), framework="pt") as h:
            return h.get_tensor(key)

    embed = read(embed_key)
    head = embed if tied else read(head_key)
    return TargetHead(embed, head, tied).to(device, dtype)
