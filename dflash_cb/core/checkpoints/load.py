"""Turn a training checkpoint into a drafter folder (``config.json`` + ``model.safetensors``).

Checkpoints are read with ``torch.load(weights_only=True)``: tensors and plain containers only,
never arbitrary pickled objects. Optimizer, scheduler and loop state are dropped.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ...cache.needs import is_drafter_config
from ...cache.target_head import weight_map
from ...common.arguments import is_int
from ...common.cli import describe_os_error
from ...common.errors import DFlashCBError
from ...common.fileio import (
    _umask_mode,
    atomic_path,
    atomic_write_text,
    check_outputs_apart,
    naming_failures,
    output_path,
)
from ...common.tensorfile import write_safetensors
from ..drafters.chain import DEFAULT_SPECULATIVE_TOKENS
from ..drafters.layouts import drafter_from_config, layout_keys, load_weights, published_spelling
from ..drafters.registry import families, family_of, family_said, spec_from_config
from ..loop.finite import check_finite_weights

DRAFTER_FILES = ("config.json", "model.safetensors")


class CheckpointError(DFlashCBError, ValueError):
    """A checkpoint or drafter folder cannot be read, or an output folder must not be written."""


class NoDrafterConfigError(CheckpointError):
    """A checkpoint that carries no drafter config, read without one (``--config``)."""


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` (or safetensors), telling apart a file
    that is no checkpoint, a truncated one, and one that really holds non-tensor Python objects."""
    path = Path(path)
    if path.is_dir():
        return load_checkpoint_folder(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file or folder; pass --ckpt a .ckpt/.pt/.safetensors file "
                              "or a Hugging Face checkpoint-N folder")
    if path.suffix == ".safetensors":
        return {"state_dict": read_safetensors(path)}
    with open(path, "rb") as f:
        head = f.read(4)
    is_zip = head.startswith(b"PK\x03\x04")  # torch.save's default format
    # torch's legacy format is a pickle: PROTO opcode, then a protocol torch writes (2) or Python reads (up to 5)
    is_pickle = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if not is_zip and not is_pickle:
        raise CheckpointError(f"{path}: not a PyTorch checkpoint (neither the zip format of torch.save nor a "
                              f"pickle; it starts with {head!r}); pass the .ckpt written by Lightning's "
                              "ModelCheckpoint, a torch.save'd state dict or a .safetensors file")
    if is_zip and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: truncated or damaged ({path.stat().st_size} bytes, the zip archive "
                              "has no central directory): copy it again or use another checkpoint")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found:  # a real, intact checkpoint holding some Python object: refuse rather than execute it
            raise CheckpointError(
                f"{path}: holds a pickled Python object that is not a tensor or a plain container "
                f"({found.group(1)}), and this tool never unpickles code. Save the drafter's state_dict "
                "(or a LightningModule checkpoint whose hyper-parameters are plain values) and try again"
            ) from None
        raise CheckpointError(f"{path}: not a checkpoint this tool can read safely ({_unpickler_reason(e)}); "
                              "pass a Lightning .ckpt, a torch.save'd state dict or a .safetensors file") from None
    except Exception as e:  # torch's reader on a damaged archive (RuntimeError, EOFError, KeyError ...)
        raise CheckpointError(f"{path}: truncated or damaged checkpoint ({type(e).__name__}: {_first_line(e)}); "
                              "copy it again or use another checkpoint") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict (a Lightning checkpoint or a state dict), "
                              f"got {type(obj).__name__}")
    return obj


def _unpickler_reason(e: BaseException) -> str:
    """What torch's weights-only reader stopped at, without its advice to retry unsafely."""
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(e))
    return f"the weights-only reader stopped at: {found.group(1).strip()}" if found else type(e).__name__


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``load_file`` with the file named when it is truncated or not a safetensors file."""
    try:
        return load_file(str(path))
    except OSError:
        raise
    except Exception as e:  # safetensors' own error type
        raise CheckpointError(f"{path}: not a readable safetensors file, truncated or damaged ({_first_line(e)}); "
                              "copy it again or re-create it") from None


def load_drafter(path: str | os.PathLike, device: torch.device | str = "cpu") -> nn.Module:
    """A drafter folder loaded into the class of its family (``layouts.drafter_family``,
    from ``architectures``, else from the weights' keys), every problem of the folder reported as a
    ``CheckpointError`` naming the file: a missing or invalid ``config.json``, truncated weights, missing or
    unexpected keys (of the closest family's layout)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such drafter folder (a drafter folder holds config.json and "
                              "model.safetensors; tools/extract_drafter.py makes one from a checkpoint)")
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: no drafter config; a drafter folder holds config.json and "
                              "model.safetensors (tools/extract_drafter.py makes one from a checkpoint)")
    config = read_drafter_config(cfg_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights next to config.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f))
    model = _drafter_for(config, state, str(cfg_path))
    try:
        load_weights(model, state, source=str(folder))
        check = getattr(model, "check_loaded", None)  # a family's own check of what the weights say (EAGLE-3's d2t)
        if check is not None:
            check()
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}" if str(folder) not in str(e) else str(e)) from None
    check_finite_weights(state.items(), str(folder))
    return model.to(device=device)


def _drafter_for(config: dict[str, Any], state: dict[str, torch.Tensor], where: str) -> nn.Module:
    """A fresh drafter of the family of ``config`` (and of ``state``'s keys when the config does not say)."""
    try:
        model = drafter_from_config(config, state)
        spec_from_config(model.config)  # block size, mask token, layer ids
    except Exception as e:  # transformers' config class or the drafter constructor
        raise CheckpointError(f"{where}: not a valid drafter config ({type(e).__name__}: "
                              f"{_first_line(e)}); compare it with the reference drafter's config.json") from None
    return model


def read_drafter_config(path: str | os.PathLike) -> dict[str, Any]:
    """A drafter ``config.json`` as a dict, checked for the fields the evaluation needs."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); fix the file or take the reference "
                              "drafter's config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k not in config]
    if not is_drafter_config(config) and family_said(config) is None:  # a format naming its family by architecture only
        missing.append("dflash_config")
    if missing:
        raise CheckpointError(f"{path}: not a drafter config (missing {', '.join(missing)}); "
                              "a drafter config is the config.json of a drafter folder")
    return config


# Where a loop keeps its weights: Lightning's ``state_dict``, common ``torch.save`` layouts, the whole dict.
_WEIGHT_KEYS = ("state_dict", "model", "module", "model_state_dict")
# Where a checkpoint may carry the drafter's config: a LightningModule's hyper-parameters, a plain loop's entry.
_CONFIG_KEYS = ("drafter_config", "config")


# SpecForge's checkpoint folder (``{run_id}-step{N}/``): the shared payload, the draft's weights under
# ``draft_state_dict`` with ``global_step``, beside per-rank optimizer and RNG files.
SPECFORGE_STATE = "training_state.pt"


def load_checkpoint_folder(folder: Path) -> dict[str, Any]:
    """A Hugging Face ``Trainer`` checkpoint folder (``checkpoint-N``): its model weights (``model.safetensors``,
    sharded ``model-*-of-*.safetensors``, or ``pytorch_model.bin``), and its ``config.json`` when that is a
    DFlash drafter config (a ``PreTrainedModel`` drafter); or a SpecForge checkpoint folder (its
    ``training_state.pt``, read with ``weights_only=True`` as SpecForge's own warm start reads it)."""
    shards = sorted(folder.glob("model*.safetensors"))
    if not shards and (folder / SPECFORGE_STATE).is_file():
        return load_checkpoint(folder / SPECFORGE_STATE)
    index = folder / "model.safetensors.index.json"
    # A sharded save lists its shards in the index, and names each "model-<i>-of-<n>": a shard gone would leave a
    # drafter with keys missing, so name it (and its index) rather than read what is there.
    try:
        listed = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a readable shard index ({_first_line(e)}); restore it from where the "
                              "checkpoint was written, or remove it") from None
    numbered = [re.fullmatch(r"model-(\d+)-of-(\d+)\.safetensors", f.name) for f in shards]
    counts = {int(m[2]) for m in numbered if m}
    implied = {f"model-{i:0{len(m[2])}d}-of-{m[2]}.safetensors" for m in numbered if m for i in range(1, int(m[2]) + 1)}
    if len(counts) > 1 and not listed:
        raise CheckpointError(f"{folder}: shards of {len(counts)} different saves (model-*-of-{sorted(counts)}) and "
                              "no model.safetensors.index.json to say which is the model; keep one save's shards")
    missing = sorted(name for name in (listed or implied) if not (folder / name).is_file())
    if missing:
        where = f"listed in {index}" if listed else "the other shards' names count them"
        raise CheckpointError(f"{folder}: shard(s) {', '.join(missing)} missing ({where}); copy the whole "
                              "checkpoint folder again")
    if listed:
        shards = [folder / name for name in sorted(listed)]
    if shards:
        state: dict[str, torch.Tensor] = {}
        for f in shards:
            state.update(read_safetensors(f))
        ckpt: dict[str, Any] = {"state_dict": state}
    elif (folder / "pytorch_model.bin").is_file():
        ckpt = {"state_dict": state_dict_of(load_checkpoint(folder / "pytorch_model.bin"))}
    else:
        raise CheckpointError(f"{folder}: a folder without model weights (no model.safetensors, model-*.safetensors, "
                              f"pytorch_model.bin or SpecForge's {SPECFORGE_STATE}); pass a Hugging Face "
                              "checkpoint-N folder, a SpecForge <run>-stepN folder, a .ckpt/.pt file or a "
                              ".safetensors file")
    step = _trainer_state_step(folder / "trainer_state.json")
    if step is not None:
        ckpt["global_step"] = step
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            ckpt["drafter_config"] = read_drafter_config(cfg)
        except CheckpointError:
            pass  # the training model's own config, not a drafter's: --config gives it
    return ckpt


def _trainer_state_step(path: Path) -> int | None:
    try:
        step = json.loads(path.read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def stored_config(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter config a checkpoint carries: ``hyper_parameters.drafter_config`` (a LightningModule's
    ``save_hyperparameters``), or a top-level ``drafter_config``/``config`` entry (a plain loop's checkpoint,
    a Hugging Face folder's ``config.json``)."""
    hp = ckpt.get("hyper_parameters")
    found = [hp.get("drafter_config")] if isinstance(hp, dict) else []
    found += [ckpt.get(k) for k in _CONFIG_KEYS]
    return next((c for c in found if is_drafter_config(c)), None)


def weight_sources(ckpt: dict[str, Any]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``(entry, tensors)`` where weights may be: the usual entries, any other top-level dict of tensors (a plain
    loop's ``{"drafter": drafter.state_dict(), ...}``), and the checkpoint itself (a bare state dict)."""
    out = []
    for key, value in ckpt.items():
        if isinstance(value, dict):
            tensors = {k: v for k, v in value.items() if isinstance(v, torch.Tensor)}
            if tensors and (key in _WEIGHT_KEYS or len(tensors) == len(value)):
                out.append((key, tensors))
    top = {k: v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}
    if top:
        out.append(("", top))
    # Every family's keys in their published spelling (a live DFlash 2 module's codebooks are embeddings), as
    # every layout is compared in it.
    try:
        return [(key, published_spelling(tensors)) for key, tensors in out]
    except ValueError as e:
        raise CheckpointError(f"checkpoint entry holds {e}") from None


def state_dict_of(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model weights: Lightning's ``state_dict``, a ``model``/``module`` entry, or the dict itself."""
    for key in _WEIGHT_KEYS:
        if isinstance(ckpt.get(key), dict):
            return {k: v for k, v in ckpt[key].items() if isinstance(v, torch.Tensor)}
    return {k: v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}


def locate_drafter(ckpt: dict[str, Any], expected: set[str], prefix: str | None,
                   where: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """``(entry, prefix, tensors)`` of the one place in ``ckpt`` holding a complete drafter."""
    sources = weight_sources(ckpt)
    if not sources:
        raise CheckpointError(f"{where}: holds no tensors; pass the checkpoint that has the drafter's weights")
    found, errors = [], []
    for entry, tensors in sources:
        try:
            p = prefix if prefix is not None else find_prefix(set(tensors), expected)
        except CheckpointError as e:
            errors.append(e)
            continue
        if any(k.startswith(p) for k in tensors):
            found.append((entry, p, tensors))
    if not found:
        raise errors[0] if errors else CheckpointError(f"{where}: no key starts with --prefix {prefix!r}")
    if len(found) > 1:
        names = ", ".join(repr(e or "(top level)") for e, _, _ in found)
        raise CheckpointError(f"{where}: several entries hold a complete drafter ({names}); keep one in the "
                              "checkpoint or extract from a file holding only the drafter's state dict")
    return found[0]


def expected_keys(config: dict[str, Any]) -> set[str]:
    """The weight names a checkpoint of the drafter ``config`` describes holds (its family's layout,
    ``registry.family_of``, less what its checkpoints may leave out: ``DrafterFamily.optional_keys``)."""
    return layout_keys(config) - set(family_of(config).optional_keys)


def find_prefix(keys: set[str], expected: set[str]) -> str:
    """The prefix under which every expected drafter key appears (e.g. ``drafter.`` or ``model.draft.``)."""
    anchor = min(expected)  # any one of the drafter's own weight names marks where it sits
    candidates = sorted({k[: -len(anchor)] for k in keys if k.endswith(anchor)})
    found = [p for p in candidates if all(p + e in keys for e in expected)]
    if len(found) == 1:
        return found[0]
    if not found:
        near = ", ".join(repr(p) for p in candidates) or "none"
        raise CheckpointError(f"no key prefix holds a complete drafter for this config (prefixes ending in "
                         f"{anchor}: {near}); check --config or pass --prefix")
    raise CheckpointError(f"several key prefixes hold a complete drafter: {found}; choose one with --prefix")


@dataclass
class CheckpointDrafter:
    """The drafter a checkpoint holds (``drafter_in_checkpoint``): loaded, checked, and where it was found."""

    model: nn.Module  # the drafter of its family with the checkpoint's weights, on the CPU
    config: dict[str, Any]  # its config.json, as ``extract_drafter`` writes it
    weights: dict[str, torch.Tensor]  # the checkpoint's tensors under the prefix, without it (not copied)
    info: dict[str, Any]  # entry, prefix, tensors, dropped entries, other tensors, global_step, params


def drafter_in_checkpoint(ckpt_path: str | os.PathLike, config: dict[str, Any] | None = None,
                          prefix: str | None = None) -> CheckpointDrafter:
    """Read a checkpoint and load the drafter it holds, in memory; refuses missing or unexpected keys.

    The one reading of a checkpoint: ``extract_drafter`` writes what this returns, and the sweep scores it
    without a folder (the model is the one ``load_drafter`` makes from the folder ``extract_drafter`` writes:
    the same config, round-tripped through JSON, and the same weights). ``config`` defaults to the one the
    checkpoint carries (``stored_config``).
    """
    ckpt = load_checkpoint(ckpt_path)
    if config is None:
        config = stored_config(ckpt)
        if config is None:
            raise NoDrafterConfigError(f"{ckpt_path}: no drafter config stored in the checkpoint "
                                  "(hyper_parameters.drafter_config, or a drafter_config entry); pass --config "
                                  "drafter_config.json")
    try:
        config = json.loads(json.dumps(config))  # what a written config.json reads back as
        expected = expected_keys(config)
    except Exception as e:
        raise CheckpointError(f"the drafter config is not a valid drafter config ({type(e).__name__}: "
                              f"{_first_line(e)}); check --config") from None
    entry, prefix, state = locate_drafter(ckpt, expected, prefix, str(ckpt_path))
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    # Keys and shapes checked by loading into a real drafter (of the closest family) before anything is written.
    model = _drafter_for(config, sub, "the drafter config")
    try:
        load_weights(model, sub, source=f"{ckpt_path} [prefix {prefix!r}]")
    except ValueError as e:
        raise CheckpointError(f"{e}; check --config / --prefix") from None
    check_finite_weights(sub.items(), f"{ckpt_path} [prefix {prefix!r}]")  # before anything is written or scored
    # What was left behind: the checkpoint's other entries, and tensors beside the drafter's.
    dropped = [k for k in ckpt if k != entry] if entry else [k for k, v in ckpt.items() if not isinstance(v, torch.Tensor)]
    info = {"entry": entry, "prefix": prefix, "tensors": len(sub), "dropped_entries": sorted(dropped),
            "other_tensors": sorted(k for k in state if not k.startswith(prefix)),
            "global_step": checkpoint_step(ckpt), "step_problem": step_problem(ckpt),
            "params": sum(v.numel() for v in sub.values())}
    return CheckpointDrafter(model, config, sub, info)


# The largest step a series can hold (its plots and tables are int64).
MAX_STEP = 2**63 - 1


def checkpoint_step(ckpt: dict[str, Any]) -> int | None:
    """The training step a checkpoint records: ``global_step`` (Lightning, SpecForge, a Hugging Face folder's
    ``trainer_state.json``), else a plain loop's ``step`` entry; None when it records none (or no valid one:
    ``step_problem`` says what it records)."""
    for key in ("global_step", "step"):
        step = ckpt.get(key)
        if is_int(step) and 0 <= step <= MAX_STEP:
            return int(step)
    return None


def step_problem(ckpt: dict[str, Any]) -> str | None:
    """What is wrong with a recorded step that ``checkpoint_step`` does not take (None: none recorded or fine)."""
    for key in ("global_step", "step"):
        step = ckpt.get(key)
        if step is None or (is_int(step) and 0 <= step <= MAX_STEP):
            continue
        return (f"its recorded {key} {step!r} is not a training step (an integer from 0 to 2**63 - 1)")
    return None


def extract_drafter(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike,
                    config: dict[str, Any] | None = None, prefix: str | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Write ``out_dir`` with the drafter's weights; refuses missing or unexpected keys. Returns a report.

    Nothing the tool did not write is ever deleted: a new or empty ``out_dir`` gets the drafter
    atomically (temporary folder + rename); an existing drafter folder (``config.json`` and
    ``model.safetensors`` only) has those two files replaced; any other non-empty folder is
    refused unless ``overwrite``, and then only those two files are written into it, the rest kept.
    The folder holding the checkpoint is always refused.
    """
    out = output_path(out_dir)  # a symbolic link is written through: the link keeps pointing at the drafter
    overwrite_into = check_drafter_out(out, ckpt_path, overwrite)  # before any reading
    found = drafter_in_checkpoint(ckpt_path, config, prefix)
    weights = {k: v.detach().contiguous().clone() for k, v in found.weights.items()}
    _write_out(out, overwrite_into, weights, found.config)
    return found.info


def _write_out(out: Path, overwrite_into: bool, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The drafter's two files into ``out`` as ``check_drafter_out`` allowed: a fresh folder renamed into place, or
    the two files written into a foreign folder (``overwrite_into``)."""
    config_text = json.dumps(config, indent=2) + "\n"
    try:
        if overwrite_into:
            _write_drafter_files(out, weights, config_text)
        else:
            _write_drafter_folder(out, weights, config_text)
    except OSError as e:  # names the file (fileio.naming_failures), e.g. a full disk
        kept = "" if overwrite_into else f"; --out {out} is as it was"
        raise CheckpointError(f"{describe_os_error(e)}: the drafter could not be written{kept}") from None


def extract_from_target(target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
                        overwrite: bool = False) -> dict[str, Any]:
    """Write the drafter a target ships inside its own checkpoint (a family's ``target_prefix``: Qwen3.5 /
    Qwen3.6's MTP head under ``mtp.*``, which transformers drops when it loads the model) as a drafter folder
    ``out_dir``, reading only those tensors from the target's safetensors shards (the 27B's 52 GB are never
    loaded). Same folder rules as ``extract_drafter``."""
    from safetensors import safe_open

    folder = Path(target_dir)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"target folder {folder}: no config.json; point it at the target's model folder (the one "
                              "holding config.json and *.safetensors)")
    from ..drafters.chain import ChainFamily

    cap = ChainFamily.max_speculative_tokens
    if isinstance(speculative_tokens, bool) or not 1 <= int(speculative_tokens) <= cap:
        raise CheckpointError(f"speculative_tokens {speculative_tokens}: a chain drafts 1 to {cap} tokens a cycle "
                              "(the servers' num_speculative_tokens, commonly 3)")
    out = output_path(out_dir)
    overwrite_into = check_drafter_out(out, folder, overwrite)
    try:
        target_config = json.loads(cfg_path.read_text())
        if not isinstance(target_config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: not a readable config.json ({e}); copy the target's "
                              "config.json again") from None
    shipped = [f for f in families() if f.target_prefix is not None]
    config, family = None, None
    for family in shipped:
        try:
            config = family.config_from_target(target_config, speculative_tokens)
            break
        except ValueError as e:
            reason = str(e)
    if config is None or family is None:
        raise CheckpointError(f"{cfg_path}: {reason if shipped else 'no drafter family reads a target checkpoint'}")
    prefix = family.target_prefix
    wanted = {k: name for k, name in weight_map(folder).items() if k.startswith(prefix)}
    files = sorted(set(wanted.values()))
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        try:  # a truncated shard, or an index naming a tensor its shard lacks: the file named, not a traceback
            with safe_open(str(folder / name), framework="pt") as f:
                held = set(f.keys())
                lacking = sorted(k for k, file in wanted.items() if file == name and k not in held)
                if lacking:
                    raise CheckpointError(f"{folder / name}: the index names {lacking[0]} (and "
                                          f"{len(lacking) - 1} more) in this file but it lacks them; copy the "
                                          "target's files again")
                weights.update({k: f.get_tensor(k).contiguous() for k, file in wanted.items() if file == name})
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' own error type, OSError
            raise CheckpointError(f"{folder / name}: not a readable safetensors file ({e}); copy it "
                                  "again") from None
    if not weights:
        raise CheckpointError(f"target folder {folder}: its config says it ships a {family.label} drafter but no "
                              f"safetensors file holds {prefix}* weights (a checkpoint re-saved by transformers "
                              "loses them: use the original files)")
    model = drafter_from_config(config)
    try:
        load_weights(model, weights, source=str(folder))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    check_finite_weights(weights.items(), str(folder))
    _write_out(out, overwrite_into, weights, config)
    return {"tensors": len(weights), "params": sum(v.numel() for v in weights.values()), "files": files,
            "family": family.label}


def check_drafter_out(out: Path, ckpt_path: str | os.PathLike, overwrite: bool) -> bool:
    """Refuse an ``--out`` that would lose a user's files; True when writing into a foreign folder
    (``overwrite``), False when the tool writes a fresh folder or replaces a drafter folder."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: is a file, not a folder; choose a folder path for the drafter")
    check_outputs_apart([("--ckpt", ckpt_path)], folders=[("--out", out)])
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"--out {out}: {parent} is a file, not a folder; choose another path")
            break
    if not out.is_dir():
        return False
    entries = sorted(p.name for p in out.iterdir())
    if not entries or set(entries) <= set(DRAFTER_FILES):
        return False
    if not overwrite:
        raise CheckpointError(f"--out {out}: the folder is not empty and is not a drafter folder (it holds "
                              f"{', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}); choose a new "
                              "folder, or pass --overwrite to write config.json and model.safetensors into it "
                              "(other files are kept)")
    stray = [e for e in entries if e.endswith(".safetensors") and e not in DRAFTER_FILES]
    if stray:
        raise CheckpointError(f"--out {out}: holds other weights ({', '.join(stray[:5])}) that a loader would "
                              "read together with the drafter's; choose a new folder")
    return True


def _write_drafter_files(out: Path, weights: dict[str, torch.Tensor], config_text: str,
                         shown: Path | None = None) -> None:
    """Each file atomically (weights first: a config never points at missing weights). ``shown``: the
    folder a failure names when ``out`` is a temporary one."""
    shown = shown or out
    with naming_failures(shown / "model.safetensors", temp=f"{out}{os.sep}"), atomic_path(out / "model.safetensors") as tmp:
        write_safetensors(tmp, weights, metadata={"format": "pt"})
    with naming_failures(shown / "config.json", temp=f"{out}{os.sep}"):
        atomic_write_text(out / "config.json", config_text)


def _write_drafter_folder(out: Path, weights: dict[str, torch.Tensor], config_text: str) -> None:
    """A complete folder next to ``out``, renamed into place; an existing drafter folder is swapped out
    and only its own two files are removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    old: Path | None = None
    try:
        _write_drafter_files(tmp, weights, config_text, shown=out)
        os.chmod(tmp, _umask_mode(0o777))  # mkdtemp makes it private; a drafter folder is meant to be shared
        if out.is_dir():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
            os.replace(out, old / "folder")
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old / "folder", out)  # put the previous drafter back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None and (old / "folder").is_dir():
            for name in DRAFTER_FILES:  # checked by check_drafter_out: nothing else is in there
                (old / "folder" / name).unlink(missing_ok=True)
            (old / "folder").rmdir()
        if old is not None:
            old.rmdir()


def describe_source(entry: str, prefix: str) -> str:
    """``entry 'drafter'``, ``'state_dict', prefix 'drafter.'``: where the drafter's weights were found."""
    where = f"entry {entry!r}" if entry else "the top level"
    return f"{where}, prefix {prefix!r}" if prefix else where


def describe_dropped(info: dict[str, Any], shown: int = 6) -> str:
    """What extraction left behind, for the summary line."""
    parts = []
    entries, tensors = info["dropped_entries"], info["other_tensors"]
    if entries:
        parts.append("dropped " + ", ".join(entries))
    if tensors:
        more = f", ... ({len(tensors) - shown} more)" if len(tensors) > shown else ""
        parts.append(f"{len(tensors)} other tensor(s) not copied: {', '.join(tensors[:shown])}{more}")
    return "; ".join(parts) or "nothing else in it"
