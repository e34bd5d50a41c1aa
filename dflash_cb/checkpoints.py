"""Turn a training checkpoint into a drafter folder (``config.json`` + ``model.safetensors``).

Checkpoints are read with ``torch.load(weights_only=True)``: tensors and plain containers only,
never arbitrary pickled objects. Optimizer, scheduler and loop state are dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .model import DFlashDrafter


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return {"state_dict": load_file(str(path))}
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # an unsafe global in the pickle: refuse rather than execute it
        raise ValueError(
            f"{path}: cannot be read with torch.load(weights_only=True) ({str(e).splitlines()[0]}). "
            "The checkpoint holds pickled Python objects besides tensors; save the drafter's state_dict "
            "(or the LightningModule checkpoint with plain hyper-parameters) and try again"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict (a Lightning checkpoint or a state dict), got {type(obj).__name__}")
    return obj


def state_dict_of(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model weights: Lightning's ``state_dict``, a ``model``/``module`` entry, or the dict itself."""
    for key in ("state_dict", "model", "module", "model_state_dict"):
        if isinstance(ckpt.get(key), dict):
            return {k: v for k, v in ckpt[key].items() if isinstance(v, torch.Tensor)}
    return {k: v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}


def expected_keys(config: dict[str, Any]) -> set[str]:
    with torch.device("meta"):
        return set(DFlashDrafter.from_config_dict(config).state_dict())


def find_prefix(keys: set[str], expected: set[str]) -> str:
    """The prefix under which every expected drafter key appears (e.g. ``drafter.`` or ``model.draft.``)."""
    anchor = "fc.weight"
    candidates = sorted({k[: -len(anchor)] for k in keys if k.endswith(anchor)})
    found = [p for p in candidates if all(p + e in keys for e in expected)]
    if len(found) == 1:
        return found[0]
    if not found:
        near = ", ".join(repr(p) for p in candidates) or "none"
        raise ValueError(f"no key prefix holds a complete DFlash drafter for this config (prefixes ending in "
                         f"fc.weight: {near}); check --config or pass --prefix")
    raise ValueError(f"several key prefixes hold a complete drafter: {found}; choose one with --prefix")


def extract_drafter(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike,
                    config: dict[str, Any] | None = None, prefix: str | None = None) -> dict[str, Any]:
    """Write ``out_dir`` with the drafter's weights; refuses missing or unexpected keys. Returns a report."""
    ckpt = load_checkpoint(ckpt_path)
    if config is None:
        hp = ckpt.get("hyper_parameters") or {}
        config = hp.get("drafter_config") if isinstance(hp, dict) else None
        if not isinstance(config, dict):
            raise ValueError(f"{ckpt_path}: no drafter config stored in the checkpoint "
                             "(hyper_parameters.drafter_config); pass --config drafter_config.json")
    state = state_dict_of(ckpt)
    expected = expected_keys(config)
    if prefix is None:
        prefix = find_prefix(set(state), expected)
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    missing = sorted(expected - set(sub))
    unexpected = sorted(set(sub) - expected)
    if missing or unexpected:
        raise ValueError(f"{ckpt_path}: under prefix {prefix!r} the drafter has missing keys {missing[:8]} and "
                         f"unexpected keys {unexpected[:8]}; check --config / --prefix")
    weights = {k: v.detach().contiguous().clone() for k, v in sub.items()}
    # Validate shapes by loading into a real drafter before anything is written.
    model = DFlashDrafter.from_config_dict(config)
    from .model import load_state_dict_strict

    load_state_dict_strict(model, weights, source=f"{ckpt_path} [{prefix}]")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a drafter folder is meant to be shared
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dropped = sorted(k for k in ckpt if k not in ("state_dict",))
    return {"prefix": prefix, "tensors": len(weights), "dropped_entries": dropped,
            "params": sum(v.numel() for v in weights.values())}
