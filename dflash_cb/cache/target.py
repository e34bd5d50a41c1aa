"""The target model on CPU: config without weights, a strict text-only load, layer capture, chunked head.

Layer ids follow the DFlash convention: id ``i`` is the output of decoder layer ``i``,
i.e. Hugging Face ``hidden_states[i + 1]``. HF replaces the last entry of
``hidden_states`` by the final-normed state, so for ``i = num_layers - 1`` the captured
feature is the base model's (normed) ``last_hidden_state``; every other id is read with a
forward hook on its decoder layer. Only the selected layers are kept, written straight
into one ``[T, len(ids) * hidden]`` buffer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..common.errors import DFlashCBError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
LOGITS_CHUNK = 256

# Where decoder classes keep their layer list, most common first.
_LAYER_PATHS = (
    "model.layers",  # Llama/Qwen3/Qwen3_5ForCausalLM
    "model.language_model.layers",  # *ForConditionalGeneration (transformers 5)
    "language_model.model.layers",  # older VLM wrappers
    "model.decoder.layers",
    "transformer.h",
    "layers",
)


class TargetError(DFlashCBError, RuntimeError):
    """The target checkpoint cannot be used (missing/mismatched weights, unknown layout ...)."""


def _file_json(path: str | os.PathLike, name: str) -> tuple[Path | None, dict[str, Any] | None]:
    """Find ``name`` in a local folder, or in a hub repo's cache (downloaded if a hub is reachable)."""
    local = Path(path) / name
    if local.is_file():
        return local, json.loads(local.read_text())
    if Path(path).is_dir():
        return None, None
    try:
        from huggingface_hub import hf_hub_download

        p = Path(hf_hub_download(str(path), name))
    except Exception:  # no hub, no such repo or no such file
        return None, None
    return p, json.loads(p.read_text())


def canonical_sha256(data: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace): stable across re-saves of the same config."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class TargetConfig:
    """What the precompute needs to know about a target before loading its weights."""

    name_or_path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    config_sha256: str
    eos_token_ids: list[int] = field(default_factory=list)  # generation_config.json, else config.json
    final_logit_softcapping: float | None = None
    intermediate_size: int = 0  # for memory estimates only (not in the manifest)
    num_attention_heads: int = 0

    def manifest_dict(self) -> dict[str, Any]:
        return {
            "name_or_path": self.name_or_path,
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "config_sha256": self.config_sha256,
            "max_position_embeddings": self.max_position_embeddings,
        }


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def read_target_config(path: str | os.PathLike) -> TargetConfig:
    """Read ``config.json`` (and ``generation_config.json``) of a target without touching its weights."""
    cfg_path, raw = _file_json(path, "config.json")
    if raw is None:
        raise TargetError(f"{path}: no config.json; --target must be a Hugging Face model folder or hub id")
    from .needs import is_drafter_config

    if is_drafter_config(raw):  # its weights lack the target's embedding and head: say so, not "re-download"
        raise TargetError(f"--target {path}: a drafter's folder ({cfg_path} describes a drafter), not a target's; "
                          "--target is the target model's folder (the one the cache was made with), the drafter "
                          "goes to --drafter")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise TargetError(f"{cfg_path}: transformers cannot read this config ({e}); "
                          "is transformers recent enough for this model type?") from e
    text = config.get_text_config()  # qwen3_5 keeps the language model's fields under text_config
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(text, k, None) is None]
    if missing:
        raise TargetError(f"{cfg_path}: text config has no {missing}; not a decoder-only language model?")
    _, gen = _file_json(path, "generation_config.json")
    eos = _ids((gen or {}).get("eos_token_id")) or _ids(getattr(text, "eos_token_id", None)) \
        or _ids(getattr(config, "eos_token_id", None))
    tie = getattr(text, "tie_word_embeddings", None)
    if tie is None:
        tie = getattr(config, "tie_word_embeddings", False)
    return TargetConfig(
        name_or_path=str(path),
        architecture=(raw.get("architectures") or [type(config).__name__])[0],
        model_type=str(raw.get("model_type", "")),
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 1 << 30),
        tie_word_embeddings=bool(tie),
        config_sha256=canonical_sha256(raw),
        eos_token_ids=eos,
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        num_attention_heads=int(getattr(text, "num_attention_heads", 0) or 0),
    )


def is_vision_key(name: str) -> bool:
    """A vision-language checkpoint's vision-tower tensor (not part of the text model)."""
    return "visual" in name or "vision" in name


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header: its length in bytes and its JSON (names, dtypes, shapes, data
    offsets counted from the end of the header); no tensor data is read."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n, json.loads(f.read(n))


def count_text_parameters(path: str | os.PathLike, config: TargetConfig) -> int:
    """Parameters the text model loads, from the safetensors headers (no weights read).

    Falls back to an estimate from the config when ``path`` is not a local folder of safetensors.
    """
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    total = 0
    for f in files:
        try:
            _, header = safetensors_header(f)
        except (OSError, ValueError):
            files = []
            break
        for name, info in header.items():
            if name != "__metadata__" and not is_vision_key(name):
                count = 1
                for d in info["shape"]:
                    count *= int(d)
                total += count
    if files:
        return total
    h, inter = config.hidden_size, config.intermediate_size or 4 * config.hidden_size
    heads = 1 if config.tie_word_embeddings else 2
    return heads * config.vocab_size * h + config.num_layers * (4 * h * h + 3 * h * inter)


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, source: str = "--layers") -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError(f"{source}: no layer ids given")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{source}: layer ids {bad} are outside [0, {num_layers}) for this target "
                         f"({num_layers} decoder layers; id i = output of decoder layer i)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{source}: duplicate layer ids in {ids}")
    return ids


def find_decoder_layers(model: nn.Module, num_layers: int | None = None) -> nn.ModuleList:
    """The decoder layer list, wherever the class keeps it."""
    for dotted in _LAYER_PATHS:
        obj: Any = model
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and (num_layers is None or len(obj) == num_layers):
            return obj
    candidates = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, nn.ModuleList) and n.endswith("layers") and "visual" not in n
                  and (num_layers is None or len(m) == num_layers)]
    if len(candidates) == 1:
        return candidates[0][1]
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__} "
                      f"(tried {', '.join(_LAYER_PATHS)}; candidates {[n for n, _ in candidates]})")


@dataclass
class Target:
    model: nn.Module  # the *ForCausalLM text model, eval mode
    config: TargetConfig
    layers: nn.ModuleList
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def base(self) -> nn.Module:
        """The decoder stack without the head (its output is already final-normed)."""
        return self.model.base_model

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def tied(self) -> bool:
        head, embed = self.lm_head.weight, self.embed_tokens.weight
        return head is embed or head.data_ptr() == embed.data_ptr() or self.config.tie_word_embeddings


def check_device(device: str) -> torch.device:
    """``device`` as torch reads it, refused in one line when this machine has no such device (before the
    target is loaded): ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TargetError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise TargetError(f"--device {device!r}: the prefill runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise TargetError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); run "
                          "on the CPU (--device cpu) or on a host with a GPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TargetError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def load_target(path: str | os.PathLike, dtype: str | torch.dtype = "bfloat16",
                config: TargetConfig | None = None, device: str | torch.device = "cpu") -> Target:
    """Load the target's text model alone (a VLM's vision tower is skipped); any missing weight is fatal. On
    ``device`` (a spare GPU of the serving host): the states still land in CPU memory."""
    from transformers import AutoModelForCausalLM

    config = config or read_target_config(path)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    # ignore_mismatched_sizes only turns transformers' anonymous error into a report we check below.
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype, trust_remote_code=False, output_loading_info=True,
        ignore_mismatched_sizes=True)
    files = ", ".join(p.name for p in sorted(Path(path).glob("*.safetensors"))) if Path(path).is_dir() else path
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        # A missing key would be silently random-initialised: hidden states would look fine and be wrong.
        raise TargetError(f"{path}: {len(missing)} weight(s) missing from the checkpoint ({files}): "
                          f"{missing[:10]}{' ...' if len(missing) > 10 else ''}; re-download the model "
                          "(an incomplete copy?) — missing weights would be randomly initialised")
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        raise TargetError(f"{path}: weights in {files} whose shape does not fit config.json "
                          f"(name, checkpoint shape, model shape): {mismatched[:10]}; the weights and the "
                          "config do not belong together")
    if info.get("error_msgs"):
        raise TargetError(f"{path}: errors while loading {files}: {info['error_msgs'][:5]}")
    model.eval()
    model.requires_grad_(False)
    model.to(device)
    layers = find_decoder_layers(model, config.num_layers)
    return Target(model=model, config=config, layers=layers, dtype=torch_dtype)


@dataclass
class PrefillResult:
    hidden: torch.Tensor  # [T, len(ids) * hidden] in the storage dtype
    target_argmax: torch.Tensor  # int64 [T]: argmax at position t predicts token t + 1
    topk_ids: torch.Tensor | None = None  # int64 [T, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [T, K]


@contextlib.contextmanager
def capture_layers(layers: nn.ModuleList, layer_ids: Sequence[int], out: torch.Tensor) -> Iterator[torch.Tensor]:
    """Forward hooks writing the outputs of ``layers[i]`` (batch 1) into column blocks of ``out``.

    ``out`` is ``[T, len(layer_ids) * H]``; block ``k`` receives ``layers[layer_ids[k]]``'s output.
    Ids that are not hooked (see ``prefill``) are simply skipped.
    """
    width = out.shape[1] // len(layer_ids)
    handles = []

    def make_hook(k: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            h = output[0] if isinstance(output, tuple | list) else output
            out[:, k * width:(k + 1) * width].copy_(h[0])
        return hook

    try:
        for k, i in enumerate(layer_ids):
            if i < len(layers):
                handles.append(layers[i].register_forward_hook(make_hook(k)))
        yield out
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def head_stats(final_hidden: torch.Tensor, lm_head: nn.Module, topk: int = 0, chunk: int = LOGITS_CHUNK,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Argmax (and top-K log-probs) of ``lm_head(final_hidden)`` computed ``chunk`` positions at a time.

    Full logits of a 248k vocabulary over 2k tokens are 2 GB in float32; chunks keep it to
    ``chunk * V`` floats. Logits are computed in the model dtype (as HF does). With top-K, one pass
    over each chunk gives all three: the argmax is read off the top-K (the first maximal index, like
    ``argmax``), and the log-sum-exp reuses the top-1 value as its shift, exponentiating in place in
    the logits' dtype and summing in float32 (bfloat16 logits are not copied to float32: the copy cost
    more than the rest of the top-K; the sum's relative error stays below 2^-8).
    """
    t = final_hidden.shape[0]
    argmax = torch.empty(t, dtype=torch.int64)
    ids = torch.empty(t, topk, dtype=torch.int64) if topk else None
    lps = torch.empty(t, topk, dtype=torch.float32) if topk else None
    for s in range(0, t, chunk):
        logits = lm_head(final_hidden[s:s + chunk])
        if softcap:
            logits = torch.tanh(logits.float() / softcap) * softcap
        if not topk:
            # max().indices: the first maximal index like argmax(), and ~4x faster on CPU for bf16
            argmax[s:s + chunk] = logits.max(-1).indices
            continue
        # Row slices of about 1 MiB: the top-K, exp and sum passes then run in the core's cache
        # instead of streaming the whole chunk from memory three times.
        rows = max(1, (1 << 20) // (logits.shape[-1] * logits.element_size()))
        for r in range(0, logits.shape[0], rows):
            _top_k_rows(logits[r:r + rows], topk, s + r, argmax, ids, lps)
    return argmax, ids, lps


def _top_k_rows(logits: torch.Tensor, topk: int, at: int, argmax: torch.Tensor, ids: torch.Tensor,
                lps: torch.Tensor) -> None:
    """Argmax, top-K ids and log-probs of a few rows of logits (overwritten) into rows ``at..``."""
    n = logits.shape[0]
    vals, idx = logits.topk(topk, dim=-1)
    top = vals[:, :1]
    tied = vals == top  # ties at the maximum: argmax() takes the smallest index among them
    argmax[at:at + n] = torch.where(tied, idx, logits.shape[-1]).min(-1).values
    all_tied = tied[:, -1].nonzero().flatten().cpu()
    if len(all_tied):  # more ties than K: the smallest maximal index may lie outside the top-K
        argmax[at + all_tied] = logits[all_tied.to(logits.device)].max(-1).indices.cpu()
    ids[at:at + n] = idx
    # exp in place, summed in float32. Shifting by the max costs a pass; it is needed only where exp
    # could overflow or underflow (|logit| >= 80).
    if -80 < float(top.min()) and float(top.max()) < 80:
        lps[at:at + n] = vals.float() - logits.exp_().sum(-1, keepdim=True, dtype=torch.float32).log()
    else:
        total = logits.sub_(top).exp_().sum(-1, keepdim=True, dtype=torch.float32)
        lps[at:at + n] = vals.float() - top.float() - total.log()


@torch.inference_mode()
def prefill(target: Target, input_ids: Sequence[int] | torch.Tensor, layer_ids: Sequence[int], topk: int = 0,
            chunk: int = LOGITS_CHUNK, store_dtype: torch.dtype | None = None) -> PrefillResult:
    """One forward over ``input_ids``: the selected layers' outputs and the target's argmax at every position.

    The forward and the argmax run in the target's (compute) dtype; the captured states are written
    straight into a ``store_dtype`` buffer (default: the compute dtype), rounded once by ``copy_``.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1).to(target.device)
    t, h = ids.shape[1], target.config.hidden_size
    out = torch.empty(t, len(layer_ids) * h, dtype=store_dtype or target.dtype)  # CPU memory, whatever the device
    last = target.config.num_layers - 1
    with capture_layers(target.layers, [i if i != last else 1 << 30 for i in layer_ids], out):
        final = target.base(input_ids=ids, use_cache=False).last_hidden_state[0]
    for k, i in enumerate(layer_ids):
        if i == last:  # hidden_states[num_layers] is the final-normed state in HF
            out[:, k * h:(k + 1) * h].copy_(final)
    argmax, top_ids, top_lps = head_stats(final, target.lm_head, topk, chunk, target.config.final_logit_softcapping)
    return PrefillResult(out, argmax, top_ids, top_lps)


@torch.inference_mode()
def greedy_generate(target: Target, input_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int]) -> tuple[list[int], str]:
    """Greedy completion with the loaded target; returns (completion ids, "stop" | "length")."""
    from transformers import GenerationConfig

    ids = torch.as_tensor(list(input_ids), dtype=torch.int64).reshape(1, -1).to(target.device)
    stop = [int(s) for s in stop_token_ids]
    gen = GenerationConfig(do_sample=False, max_new_tokens=int(max_new_tokens), eos_token_id=stop or [],
                           pad_token_id=stop[0] if stop else 0)
    model = target.model
    saved = model.generation_config
    # generate() fills unset fields from the model's generation_config (which may carry sampling or a
    # repetition penalty from the checkpoint): a blank one makes this plain greedy decoding.
    model.generation_config = GenerationConfig()
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    finally:
        model.generation_config = saved
    completion = out[0, ids.shape[1]:].tolist()  # a batch of one is never padded
    reason = "stop" if completion and completion[-1] in stop else "length"
    return completion, reason


def head_tensors(target: Target, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], bool]:
    """The input embedding and output head as safetensors-ready tensors, and whether they are tied."""
    tied = target.tied
    embed = target.embed_tokens.weight.detach()
    tensors = {"embed_tokens.weight": embed.to(dtype or embed.dtype).cpu().contiguous()}
    if not tied:
        head = target.lm_head.weight.detach()
        tensors["lm_head.weight"] = head.to(dtype or head.dtype).cpu().contiguous()
    return tensors, tied
