"""Phase 1 of a precompute: arguments, inputs and the output folder, checked without the weights.

``prepare(args)`` validates the arguments, the target's config.json, the layer ids, the prompt file
(tokenized), the reference source (SGLang health/model info, completions file), chooses the compute
dtype and checks the output folder (a folder made with other arguments is refused unless
``overwrite``). The result is a ``Plan``: everything ``run.execute`` needs, including the arguments'
fingerprint that a resumed run must match.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...common.errors import DFlashCBError
from ...common.fileio import check_outputs_apart, output_path
from ..served import served_counters, server_spec_config
from ..states import HEAD_NAME, MANIFEST_NAME, CacheError, Manifest, sha256_file
from .compute_dtype import (
    COMPUTE_DTYPE_NAMES,
    Available,
    ComputeDtypeChoice,
    Gflops,
    activation_bytes,
    available_memory_bytes,
    choose_compute_dtype,
    matmul_gflops,
)
from .journal import token_ids_ok

PROGRESS_NAME = "progress.jsonl"  # resume record: fingerprint line, then one line per finished shard
LEGACY_PROGRESS_NAME = "progress.json"  # written by earlier versions (rewritten per shard)
LOG_NAME = "precompute_log.json"
JOURNAL_NAME = "reference_completions.jsonl"  # same format as --completions, reusable with --reference file
REFERENCE_KINDS = ("local", "sglang", "file")
DTYPE_NAMES = ("bfloat16", "float32")
# Files a cache folder may hold; anything else means --out points at the wrong folder.
_OWN_FILES = {MANIFEST_NAME, PROGRESS_NAME, LEGACY_PROGRESS_NAME, LOG_NAME, JOURNAL_NAME, HEAD_NAME}
# Manifest fields filled by the run itself, not by the arguments.
_RESULT_FIELDS = ("shards", "samples", "agreement", "target_head")

Log = Callable[[str], None]


class PrecomputeError(DFlashCBError, ValueError):
    """Invalid arguments, inputs or output folder; raised before any expensive work."""


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class PrecomputeArgs:
    """All options of tools/precompute_states.py (YAML keys use these names)."""

    target: str | None = None
    prompts: str | None = None
    out: str | None = None
    layers: list[int] | None = None  # default: from --drafter-config
    drafter_config: str | None = None
    reference: str = "local"
    sglang_url: str | None = None
    completions: str | None = None
    max_new_tokens: int = 256
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"  # storage dtype of the cached states
    compute_dtype: str = "auto"  # dtype the target runs in: auto | bfloat16 | float32
    topk_logprobs: int = 0
    num_shards: int = 1
    shard_index: int = 0
    samples_per_shard: int = 1
    stop_token_ids: list[int] | None = None  # default: the target's eos ids (generation_config.json)
    tokenizer: str | None = None  # default: --target (only needed for text/messages prompts)
    export_head: bool = True
    overwrite: bool = False
    max_in_flight: int = 8
    sglang_timeout: float = 600.0
    sglang_retries: int = 5
    progress: bool = True


@dataclass
class DtypeProbe:
    """How ``auto`` measures: GFLOP/s of a matmul per dtype, and the memory available (injectable)."""

    gflops: Gflops = matmul_gflops
    available: Available = available_memory_bytes


@dataclass
class Plan:
    args: PrecomputeArgs
    out: Path
    target: Any  # dflash_cb.cache.target.TargetConfig
    layer_ids: list[int]
    stop_token_ids: list[int]
    prompt_ids: dict[str, list[int]]  # tokenized prompts of this part, by id
    groups: dict[int, list[Any]]  # shard group -> records of this part, in file order
    header: Manifest  # the manifest without results
    fingerprint: dict[str, Any]
    compute: ComputeDtypeChoice
    completions: dict[str, dict[str, Any]] = field(default_factory=dict)  # --reference file
    client: Any = None  # SGLangClient
    warnings: list[str] = field(default_factory=list)

    @property
    def compute_dtype(self) -> str:
        return self.compute.dtype


# --------------------------------------------------------------------------------------------
# small helpers


def is_own_file(name: str) -> bool:
    return name in _OWN_FILES or (name.startswith("states-") and name.endswith(".safetensors")) or \
        (name.startswith(".") and name.endswith(".tmp"))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): d}


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: existing {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PrecomputeError(f"{path}: unreadable ({e}); delete it or pass --overwrite") from e


def header_dict(m: Manifest) -> dict[str, Any]:
    """The manifest without the run's results: what the arguments determine."""
    d = m.to_dict()
    for k in _RESULT_FIELDS:
        d.pop(k, None)
    return d


def manifest_fingerprint(m: Manifest) -> dict[str, Any]:
    sizes: dict[str, int] = {}
    for s in m.samples:
        sizes[s.shard] = sizes.get(s.shard, 0) + 1
    return {"manifest": header_dict(m), "samples_per_shard": max(sizes.values(), default=1),
            "export_head": m.target_head is not None}


def _layers_from_drafter(path: str, num_layers: int) -> list[int]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PrecomputeError(f"--drafter-config {path}: no such file (give the drafter's config.json)")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:  # read_json's fix (delete it) is for our own files only
        raise PrecomputeError(f"--drafter-config {p}: unreadable ({e}); give the drafter's config.json") from e
    if not isinstance(cfg, dict):
        raise PrecomputeError(f"--drafter-config {p}: not a JSON object; give the drafter's config.json")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        raise PrecomputeError(f"{p}: no dflash_config.target_layer_ids; pass --layers explicitly")
    n = cfg.get("num_target_layers")
    if n is not None and int(n) != num_layers:
        raise PrecomputeError(f"{p}: the drafter was made for a target with num_target_layers={n}, "
                              f"--target has {num_layers} decoder layers; wrong drafter or wrong target?")
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------
# validation


def check_args(a: PrecomputeArgs) -> None:
    for name in ("target", "prompts", "out"):
        if not getattr(a, name):
            raise PrecomputeError(f"--{name} is required (on the command line or in --config)")
    if a.reference not in REFERENCE_KINDS:
        raise PrecomputeError(f"--reference {a.reference!r}: use one of {', '.join(REFERENCE_KINDS)}")
    if a.reference == "sglang" and not a.sglang_url:
        raise PrecomputeError("--reference sglang needs --sglang-url (e.g. http://127.0.0.1:30000)")
    if a.reference == "file" and not a.completions:
        raise PrecomputeError("--reference file needs --completions FILE (JSONL of {\"id\", \"output_ids\"})")
    if a.dtype not in DTYPE_NAMES:
        raise PrecomputeError(f"--dtype {a.dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    if a.compute_dtype not in COMPUTE_DTYPE_NAMES:
        raise PrecomputeError(f"--compute-dtype {a.compute_dtype!r}: use one of {', '.join(COMPUTE_DTYPE_NAMES)}")
    if a.max_new_tokens < 1:
        raise PrecomputeError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.topk_logprobs < 0:
        raise PrecomputeError(f"--topk-logprobs must be >= 0, got {a.topk_logprobs}")
    if a.num_shards < 1 or not 0 <= a.shard_index < a.num_shards:
        raise PrecomputeError(f"--num-shards {a.num_shards} --shard-index {a.shard_index}: "
                              "need num_shards >= 1 and 0 <= shard_index < num_shards")
    if a.samples_per_shard < 1:
        raise PrecomputeError(f"--samples-per-shard must be >= 1, got {a.samples_per_shard}")
    if a.max_in_flight < 1:
        raise PrecomputeError(f"--max-in-flight must be >= 1, got {a.max_in_flight}")
    if not a.sglang_timeout > 0:
        raise PrecomputeError(f"--sglang-timeout must be > 0 seconds, got {a.sglang_timeout}")
    if a.sglang_retries < 0:
        raise PrecomputeError(f"--sglang-retries must be >= 0, got {a.sglang_retries}")
    if not isinstance(a.chat_template_kwargs, dict):
        raise PrecomputeError(f"--chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}")


def check_out_path(out: Path) -> None:
    """--out must be a folder we can create or write, before anything expensive happens."""
    if out.exists() and not out.is_dir():
        raise PrecomputeError(f"--out {out}: exists and is not a folder; choose a folder path")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise PrecomputeError(f"--out {out}: {probe} is a file, not a folder; choose another --out")
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise PrecomputeError(f"--out {out}: {probe} is not writable; choose a path you can write to")


def load_completions_file(path: str, wanted: dict[str, list[int]], all_ids: set[str], vocab: int,
                          max_new_tokens: int, stop: list[int]) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise PrecomputeError(f"--completions {path}: no such file")
    out: dict[str, dict[str, Any]] = {}
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrecomputeError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            raise PrecomputeError(f"{where}: each line must be an object {{\"id\": str, \"output_ids\": [int]}}")
        sid, ids = obj["id"], obj.get("output_ids")
        if sid not in all_ids:
            raise PrecomputeError(f"{where}: id {sid!r} is not in the prompt file; wrong completions file?")
        if sid in out:
            raise PrecomputeError(f"{where}: duplicate id {sid!r}")
        if not token_ids_ok(ids, vocab):
            raise PrecomputeError(f"{where}: 'output_ids' of {sid!r} must be a list of token ids in [0, {vocab})")
        if len(ids) > max_new_tokens:
            raise PrecomputeError(f"{where}: {sid!r} has {len(ids)} completion tokens > --max-new-tokens "
                                  f"{max_new_tokens}; raise --max-new-tokens to the generation length used")
        reason = obj.get("finish_reason") or ("stop" if ids and ids[-1] in stop else "length")
        if reason == "abort":
            raise PrecomputeError(f"{where}: {sid!r} was aborted by the server; regenerate it")
        out[sid] = {"output_ids": ids, "finish_reason": str(reason),
                    "served_spec": served_counters(obj.get("served_spec"))}  # a reused journal keeps them
    missing = [sid for sid in wanted if sid not in out]
    if missing:
        raise PrecomputeError(f"{path}: no completion for {len(missing)} prompt(s): {missing[:10]}")
    return out


def _load_tokenizer(a: PrecomputeArgs) -> Any:
    from transformers import AutoTokenizer

    from ..prompts import missing_tokenizer_files

    tok_path = a.tokenizer or a.target
    missing = missing_tokenizer_files(tok_path)
    if missing:
        flag = "--tokenizer" if a.tokenizer else "--target"
        raise PrecomputeError(f"{a.prompts}: prompts given as text/messages need a tokenizer, and {flag} "
                              f"{tok_path} has no tokenizer files ({missing}); pass --tokenizer <folder "
                              "with tokenizer.json> or give the prompts as input_ids")
    try:
        return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=False)
    except Exception as e:
        raise PrecomputeError(f"{a.prompts}: prompts given as text/messages need a tokenizer, and "
                              f"{tok_path} has none loadable ({e}); pass --tokenizer") from e


def _existing_fingerprint(out: Path) -> tuple[dict[str, Any] | None, str]:
    """The fingerprint of what ``out`` already holds (resume record, else manifest), and its source."""
    if (out / PROGRESS_NAME).is_file():
        from .progress import read_progress_fingerprint

        return read_progress_fingerprint(out / PROGRESS_NAME), PROGRESS_NAME
    if (out / MANIFEST_NAME).is_file():
        try:
            return manifest_fingerprint(Manifest.from_dict(read_json(out / MANIFEST_NAME))), MANIFEST_NAME
        except (CacheError, TypeError) as e:
            raise PrecomputeError(f"{out / MANIFEST_NAME}: not a manifest this version can resume ({e}); "
                                  "use another --out or pass --overwrite") from e
    return None, ""


def check_only_cache_files(out: Path, context: str = "") -> None:
    """Refuse an existing --out holding files a cache does not write: it is the wrong folder."""
    strangers = sorted(p.name for p in out.iterdir() if not is_own_file(p.name))
    if strangers:
        raise PrecomputeError(f"{context}--out {out}: holds files that are not part of a cache ({strangers[:5]}); "
                              "choose a new or empty folder")


def _check_out_folder(out: Path, a: PrecomputeArgs) -> tuple[dict[str, Any] | None, str]:
    """The fingerprint of what an existing --out holds (``check_out_path`` already ran in ``prepare``)."""
    if not out.is_dir() or a.overwrite:
        return None, ""
    check_only_cache_files(out)
    return _existing_fingerprint(out)


def _choose_compute(a: PrecomputeArgs, tcfg: Any, layer_ids: list[int], longest: int,
                    old: dict[str, Any] | None, probe: DtypeProbe, log: Log) -> ComputeDtypeChoice:
    previous = ((old or {}).get("manifest") or {}).get("compute_dtype")
    if a.compute_dtype == "auto" and previous in DTYPE_NAMES:
        # a resumed run keeps the cache's compute dtype: mixing two in one cache would be silent
        return ComputeDtypeChoice(previous, f"kept from the existing cache in {a.out}")
    from ..target import DTYPES, LOGITS_CHUNK, count_text_parameters

    need = 4 * count_text_parameters(a.target, tcfg) + activation_bytes(
        tcfg, longest, len(layer_ids), 4, DTYPES[a.dtype].itemsize, LOGITS_CHUNK)
    choice = choose_compute_dtype(a.compute_dtype, a.dtype, tcfg.hidden_size, need, probe.gflops, probe.available)
    if choice.gflops:
        import torch

        log(f"compute dtype: {choice.dtype} ({choice.reason}; {torch.get_num_threads()} threads, "
            f"matmul of width {tcfg.hidden_size})")
    return choice


def prepare(args: PrecomputeArgs, log: Log = stderr_log, probe: DtypeProbe | None = None) -> Plan:
    """Validate everything that can be validated without the target's weights."""
    from .. import prompts as P
    from ..target import TargetError, check_layer_ids, read_target_config

    a = args
    check_args(a)
    check_out_path(output_path(a.out))
    check_outputs_apart([("--target", a.target), ("--prompts", a.prompts), ("--drafter-config", a.drafter_config),
                         ("--completions", a.completions), ("--tokenizer", a.tokenizer)], folders=[("--out", a.out)])
    try:
        tcfg = read_target_config(a.target)
    except TargetError as e:
        raise PrecomputeError(str(e)) from e
    try:
        if a.layers is not None:
            layer_ids = check_layer_ids(a.layers, tcfg.num_layers, "--layers")
        elif a.drafter_config:
            layer_ids = check_layer_ids(_layers_from_drafter(a.drafter_config, tcfg.num_layers),
                                        tcfg.num_layers, f"--drafter-config {a.drafter_config}")
        else:
            raise PrecomputeError("give --layers (e.g. 1,16,31,46,61) or --drafter-config <drafter>/config.json")
    except ValueError as e:
        raise PrecomputeError(str(e)) from e
    if a.topk_logprobs > tcfg.vocab_size:
        raise PrecomputeError(f"--topk-logprobs {a.topk_logprobs} exceeds the vocabulary ({tcfg.vocab_size})")
    stop = [int(t) for t in (a.stop_token_ids if a.stop_token_ids is not None else tcfg.eos_token_ids)]
    bad_stop = [t for t in stop if not 0 <= t < tcfg.vocab_size]
    if bad_stop:
        raise PrecomputeError(f"stop token ids {bad_stop} are outside the vocabulary [0, {tcfg.vocab_size})")

    # -- prompts
    records = P.load_prompts(a.prompts)  # PromptFileError: file:line and the fix
    S, N, part = a.samples_per_shard, a.num_shards, a.shard_index
    mine = [r for r in records if (r.index // S) % N == part]
    tokenizer = _load_tokenizer(a) if P.needs_tokenizer(mine) else None
    prompt_ids = {r.id: P.tokenize_prompt(r, tokenizer, a.chat_template_kwargs) for r in mine}
    for r in mine:
        if not prompt_ids[r.id]:
            raise PrecomputeError(f"{a.prompts}:{r.line}: prompt {r.id!r} tokenizes to no tokens")
        bad = [t for t in prompt_ids[r.id] if t >= tcfg.vocab_size]
        if bad:
            raise PrecomputeError(f"{a.prompts}:{r.line}: prompt {r.id!r} has token ids {bad[:5]} >= the "
                                  f"target's vocab size {tcfg.vocab_size}; wrong tokenizer or target?")
    P.check_lengths([(r, prompt_ids[r.id]) for r in mine], a.max_new_tokens, tcfg.max_position_embeddings,
                    a.prompts)
    groups: dict[int, list[Any]] = {}
    for r in mine:
        groups.setdefault(r.index // S, []).append(r)

    # -- reference
    warnings: list[str] = []
    client = None
    spec_config = None
    completions: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] = {"kind": a.reference, "url": None, "served_model": None,
                                 "sampling_params": None, "max_new_tokens": a.max_new_tokens,
                                 "stop_token_ids": stop}
    if a.reference == "sglang":
        from ..sglang_client import SGLangClient, SGLangError, served_model_mismatch

        client = SGLangClient(a.sglang_url, timeout=a.sglang_timeout, max_retries=a.sglang_retries)
        try:
            client.health()
            info = client.model_info()
        except SGLangError as e:
            raise PrecomputeError(str(e)) from e
        spec_config = server_spec_config(client.server_info())  # served.py: the --served-check side
        msg = served_model_mismatch(info, a.target)
        if msg:
            warnings.append(msg)
            log(f"warning: {msg}")
        reference.update(url=client.url, served_model=info,
                         sampling_params={"temperature": 0, "max_new_tokens": a.max_new_tokens,
                                          "stop_token_ids": stop})
    elif a.reference == "local":
        reference["sampling_params"] = {"do_sample": False, "max_new_tokens": a.max_new_tokens,
                                        "eos_token_id": stop}
    else:
        completions = load_completions_file(a.completions, prompt_ids, {r.id for r in records},
                                            tcfg.vocab_size, a.max_new_tokens, stop)
        reference["completions"] = {"file": Path(a.completions).name, "sha256": sha256_file(a.completions)}

    prompts_info: dict[str, Any] = {"file": Path(a.prompts).name, "sha256": sha256_file(a.prompts),
                                    "count": len(records),
                                    "tokenizer": (a.tokenizer or a.target) if tokenizer is not None else None}
    if N > 1:
        prompts_info["part"] = {"num_shards": N, "shard_index": part}

    # -- output folder, then the compute dtype (a resumed run keeps the cache's)
    out = output_path(a.out)  # a symbolic link is written through (fileio.output_path)
    old, source = _check_out_folder(out, a)
    longest = max((len(v) for v in prompt_ids.values()), default=0) + a.max_new_tokens
    compute = _choose_compute(a, tcfg, layer_ids, longest, old, probe or DtypeProbe(), log)
    header = Manifest(target=tcfg.manifest_dict(), layer_ids=layer_ids, dtype=a.dtype, reference=reference,
                      chat_template_kwargs=dict(a.chat_template_kwargs), topk_logprobs=a.topk_logprobs,
                      prompts=prompts_info, compute_dtype=compute.dtype,
                      served_spec_config=spec_config)
    fingerprint = {"manifest": header_dict(header), "samples_per_shard": S, "export_head": a.export_head}
    if old is not None and old != fingerprint:
        diffs = diff(old, fingerprint)
        raise PrecomputeError(
            f"--out {out}: its {source} was made with different arguments:\n  - " + "\n  - ".join(diffs[:20])
            + "\nUse another --out, rerun with the original arguments to resume, or pass --overwrite to "
            "replace that cache")
    return Plan(args=a, out=out, target=tcfg, layer_ids=layer_ids, stop_token_ids=stop,
                prompt_ids=prompt_ids, groups=groups, header=header, fingerprint=fingerprint, compute=compute,
                completions=completions, client=client, warnings=warnings)
