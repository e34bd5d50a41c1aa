"""Phase 1 of a precompute: arguments, inputs and the output folder, checked without the weights.

``prepare(args)`` validates, in this order and before anything expensive, the arguments, the
target's config.json and the layer ids (``_target_and_layers``), the prompt file, tokenized
(``inputs.tokenized_prompts``), the completion source (``_completion_source``: the SGLang or vLLM server's
health, model and speculative configuration, or the completions file), then the output folder and the compute dtype (a folder made with
other arguments is refused unless ``overwrite``). The result is a ``Plan``: everything
``run.execute`` needs, including the arguments' fingerprint that a resumed run must match.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...common.fileio import check_outputs_apart, output_path
from ..completion_client import CompletionClient
from ..identity import differing_fields, flatten
from ..integrity import sha256_file
from ..manifest import HEAD_NAME, MANIFEST_NAME, CacheError, Manifest
from ..needs import config_layer_ids
from ..prompts import PromptRecord
from ..served import served_counters
from ..served_speed import TIMING_NAME
from ..target import TargetConfig
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
from .errors import PrecomputeError
from .inputs import LaterTurns, Prompts, built_prompt_set, tokenized_prompts
from .journal import token_ids_ok
from .progress import read_progress_fingerprint

logger = logging.getLogger(__name__)

PROGRESS_NAME = "progress.jsonl"  # resume record: fingerprint line, then one line per finished shard
LOG_NAME = "precompute_log.json"
JOURNAL_NAME = "reference_completions.jsonl"  # same format as --completions, reusable with --reference file
COMPLETION_SOURCES = ("local", "sglang", "vllm", "file")  # the values of --reference
SERVED_SOURCES = ("sglang", "vllm")  # the completion sources that are servers (completion_client)
# Requests in flight by default: vLLM's counters are per request only one at a time (vllm_counters).
DEFAULT_IN_FLIGHT = {"sglang": 8, "vllm": 1}
DTYPE_NAMES = ("bfloat16", "float32")
# Files a cache folder may hold; anything else means --out points at the wrong folder.
_OWN_FILES = {MANIFEST_NAME, PROGRESS_NAME, LOG_NAME, JOURNAL_NAME, HEAD_NAME, TIMING_NAME}
# Manifest fields filled by the run itself, not by the arguments.
_RESULT_FIELDS = ("shards", "samples", "agreement", "target_head")


@dataclass
class PrecomputeArgs:
    """All options of tools/precompute_states.py (YAML keys use these names)."""

    target: str | None = None
    prompts: str | None = None
    out: str | None = None
    layers: list[int] | None = None  # default: from --drafter-config
    drafter_config: str | None = None
    reference: str = "local"  # the completion source, one of COMPLETION_SOURCES
    sglang_url: str | None = None
    vllm_url: str | None = None
    completions: str | None = None
    max_new_tokens: int = 256
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"  # storage dtype of the cached states
    compute_dtype: str = "auto"  # dtype the target runs in: auto | bfloat16 | float32
    device: str = "cpu"  # where the target runs: cpu, cuda or cuda:N (a spare GPU of the serving host)
    completions_only: bool = False  # journal the server's completions and stop (the prefill runs elsewhere)
    # The authors' prompt sets built on the fly (cache/prompt_sets.py), instead of --prompts: a preset name, where
    # its datasets were saved (else the hub) and its rows per set (else the preset's own counts).
    prompt_set: str | None = None
    prompt_data_dir: str | None = None
    prompt_max_samples: int | None = None
    topk_logprobs: int = 0
    num_shards: int = 1
    shard_index: int = 0
    samples_per_shard: int = 1
    stop_token_ids: list[int] | None = None  # default: the target's eos ids (generation_config.json)
    tokenizer: str | None = None  # default: --target (only needed for text/messages prompts)
    export_head: bool = True
    overwrite: bool = False
    max_in_flight: int | None = None  # None: DEFAULT_IN_FLIGHT of the --reference server
    baseline_server: str | None = None  # a plain (non-speculative) server of the same target: served speed
    sglang_timeout: float = 600.0  # per served request (SGLang or vLLM); --server-timeout too
    sglang_retries: int = 5  # --server-retries too
    progress: bool = True


@dataclass
class DtypeProbe:
    """How ``auto`` measures: GFLOP/s of a matmul per dtype, and the memory available (injectable)."""

    gflops: Gflops = matmul_gflops
    available: Available = available_memory_bytes


@dataclass
class CompletionSource:
    """Where the completions come from (``--reference``): the target's own greedy generation
    (``local``), an SGLang or vLLM server (``sglang``, ``vllm``: one ``CompletionClient`` interface) or a
    file of token ids (``file``)."""

    kind: str
    record: dict[str, Any]  # what the manifest keeps of it (``Manifest.reference``)
    client: CompletionClient | None = None  # a server: checked healthy, serving the target
    completions: dict[str, dict[str, Any]] = field(default_factory=dict)  # file: every completion, by id
    server_spec: dict[str, Any] | None = None  # a server: its speculative configuration
    max_in_flight: int = 1  # a server: requests in flight
    baseline: CompletionClient | None = None  # --baseline-server: the same prompts, plain, one at a time

    @property
    def served(self) -> bool:
        return self.kind in SERVED_SOURCES


@dataclass
class Plan:
    args: PrecomputeArgs
    out: Path
    target: TargetConfig
    layer_ids: list[int]
    stop_token_ids: list[int]
    prompt_ids: dict[str, list[int]]  # tokenized prompts of this part, by id
    groups: dict[int, list[PromptRecord]]  # shard group -> records of this part, in file order
    header: Manifest  # the manifest without results
    fingerprint: dict[str, Any]
    compute: ComputeDtypeChoice
    source: CompletionSource
    warnings: list[str] = field(default_factory=list)
    later_turns: LaterTurns | None = None  # mt-bench's second turns: prompt_ids filled in as turns complete

    @property
    def compute_dtype(self) -> str:
        return self.compute.dtype


# --------------------------------------------------------------------------------------------
# small helpers


def is_own_file(name: str) -> bool:
    return name in _OWN_FILES or (name.startswith("states-") and name.endswith(".safetensors")) or \
        (name.startswith(".") and name.endswith(".tmp"))


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = flatten(old), flatten(new)
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


def drafter_config_paths(value: str | list[str]) -> list[str]:
    """``--drafter-config``'s paths: one, several comma-separated, or a YAML list."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(p).strip() for p in items if str(p).strip()]


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
    ids = config_layer_ids(cfg)
    if ids is None:
        raise PrecomputeError(f"{p}: no dflash_config.target_layer_ids; pass --layers explicitly")
    if isinstance(ids, (str, bytes)) or not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PrecomputeError(f"{p}: dflash_config.target_layer_ids must be a non-empty list of layer ids, e.g. "
                              f"[1, 16, 31, 46, 61], not {ids!r}")
    n = cfg.get("num_target_layers")
    if n is not None and int(n) != num_layers:
        raise PrecomputeError(f"{p}: the drafter was made for a target with num_target_layers={n}, "
                              f"--target has {num_layers} decoder layers; wrong drafter or wrong target?")
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------
# validation


def check_args(a: PrecomputeArgs) -> None:
    if a.prompt_set and a.prompts:
        raise PrecomputeError(f"--prompt-set {a.prompt_set} and --prompts {a.prompts}: give one (the preset builds "
                              "the prompt file itself)")
    for name in ("target", "out") if a.prompt_set else ("target", "prompts", "out"):
        if not getattr(a, name):
            raise PrecomputeError(f"--{name} is required (on the command line or in --config)")
    if a.reference not in COMPLETION_SOURCES:
        raise PrecomputeError(f"--reference {a.reference!r}: use one of {', '.join(COMPLETION_SOURCES)}")
    if a.reference == "sglang" and not a.sglang_url:
        raise PrecomputeError("--reference sglang needs --sglang-url (e.g. http://127.0.0.1:30000)")
    if a.reference == "vllm" and not a.vllm_url:
        raise PrecomputeError("--reference vllm needs --vllm-url (e.g. http://127.0.0.1:8000)")
    if a.reference == "file" and not a.completions:
        raise PrecomputeError("--reference file needs --completions FILE (JSONL of {\"id\", \"output_ids\"})")
    if a.baseline_server and a.reference not in SERVED_SOURCES:
        raise PrecomputeError(f"--baseline-server times the same prompts on a plain server beside the speculative one "
                              f"of --reference sglang or vllm; --reference {a.reference} serves nothing to compare")
    if a.completions_only and a.reference not in SERVED_SOURCES:
        raise PrecomputeError(f"--completions-only journals a server's completions; --reference {a.reference} has none "
                              "to take (use --reference sglang or vllm)")
    if a.dtype not in DTYPE_NAMES:
        raise PrecomputeError(f"--dtype {a.dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    from ..target import TargetError, check_device

    try:
        check_device(a.device)  # before anything is read: a GPU asked for on a host without one
    except TargetError as e:
        raise PrecomputeError(str(e)) from None
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
    if a.max_in_flight is not None and a.max_in_flight < 1:
        raise PrecomputeError(f"--max-in-flight must be >= 1, got {a.max_in_flight}")
    if not a.sglang_timeout > 0:
        raise PrecomputeError(f"--server-timeout (--sglang-timeout) must be > 0 seconds, got {a.sglang_timeout}")
    if a.sglang_retries < 0:
        raise PrecomputeError(f"--server-retries (--sglang-retries) must be >= 0, got {a.sglang_retries}")
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


def _existing_fingerprint(out: Path) -> tuple[dict[str, Any] | None, str]:
    """The fingerprint of what ``out`` already holds (resume record, else manifest), and its source."""
    if (out / PROGRESS_NAME).is_file():
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


def _choose_compute(a: PrecomputeArgs, tcfg: TargetConfig, layer_ids: list[int], longest: int,
                    old: dict[str, Any] | None, probe: DtypeProbe) -> ComputeDtypeChoice:
    previous = ((old or {}).get("manifest") or {}).get("compute_dtype")
    if a.compute_dtype == "auto" and previous in DTYPE_NAMES:
        # a resumed run keeps the cache's compute dtype: mixing two in one cache would be silent
        return ComputeDtypeChoice(previous, f"kept from the existing cache in {a.out}")
    if a.compute_dtype == "auto" and not a.device.startswith("cpu"):
        # the CPU probe says nothing of a GPU: compute in the storage dtype (float32 when asked for it)
        return ComputeDtypeChoice(a.dtype, f"on {a.device}: the storage dtype")
    from ..target import DTYPES, LOGITS_CHUNK, count_text_parameters

    need = 4 * count_text_parameters(a.target, tcfg) + activation_bytes(
        tcfg, longest, len(layer_ids), 4, DTYPES[a.dtype].itemsize, LOGITS_CHUNK)
    choice = choose_compute_dtype(a.compute_dtype, a.dtype, tcfg.hidden_size, need, probe.gflops, probe.available)
    if choice.gflops:
        import torch

        logger.info(f"compute dtype: {choice.dtype} ({choice.reason}; {torch.get_num_threads()} threads, "
                    f"matmul of width {tcfg.hidden_size})")
    return choice


# --------------------------------------------------------------------------------------------
# the phases of prepare


def _target_and_layers(a: PrecomputeArgs) -> tuple[TargetConfig, list[int], list[int]]:
    """The target's config, the layer ids to capture and the stop token ids, each checked against it."""
    from ..target import TargetError, check_layer_ids, read_target_config

    try:
        tcfg = read_target_config(a.target)
    except TargetError as e:
        raise PrecomputeError(str(e)) from e
    try:
        if a.layers is not None:
            layer_ids = check_layer_ids(a.layers, tcfg.num_layers, "--layers")
            for path in drafter_config_paths(a.drafter_config or ""):  # both given: they must agree
                theirs = _layers_from_drafter(path, tcfg.num_layers)
                if set(theirs) != set(layer_ids):
                    raise PrecomputeError(f"--layers {','.join(map(str, layer_ids))} differ from the target_layer_ids "
                                          f"{theirs} of --drafter-config {path}: the cache would not hold the "
                                          "layers that drafter reads; give one of the two")
        elif a.drafter_config:
            # Several drafters' configs (comma-separated): one cache of the union of their layers, which each of
            # them reads its own columns of (StateCache.feature_columns).
            each = [_layers_from_drafter(path, tcfg.num_layers) for path in drafter_config_paths(a.drafter_config)]
            if not each:
                raise PrecomputeError(f"--drafter-config {a.drafter_config!r}: no path; give <drafter>/config.json")
            ids = each[0] if len(each) == 1 else sorted({i for layers in each for i in layers})  # one: its order
            layer_ids = check_layer_ids(ids, tcfg.num_layers, f"--drafter-config {a.drafter_config}")
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
    return tcfg, layer_ids, stop


def _completion_source(a: PrecomputeArgs, tcfg: TargetConfig, prompts: Prompts,
                       stop: list[int]) -> tuple[CompletionSource, list[str]]:
    """The completion source, checked (the server answers and serves the target, or the completions
    file covers this part's prompts), and its warnings (a server that may serve another model)."""
    record: dict[str, Any] = {"kind": a.reference, "url": None, "served_model": None,
                              "sampling_params": None, "max_new_tokens": a.max_new_tokens, "stop_token_ids": stop}
    if a.reference == "local":
        record["sampling_params"] = {"do_sample": False, "max_new_tokens": a.max_new_tokens, "eos_token_id": stop}
        return CompletionSource(a.reference, record), []
    if a.reference == "file":
        wanted = {r.id: [] for g in prompts.groups.values() for r in g}  # later turns' completions too
        completions = load_completions_file(a.completions, wanted, {r.id for r in prompts.records},
                                            tcfg.vocab_size, a.max_new_tokens, stop)
        record["completions"] = {"file": Path(a.completions).name, "sha256": sha256_file(a.completions)}
        return CompletionSource(a.reference, record, completions=completions), []
    from ..completion_client import ServerError, served_model_mismatch

    client = served_client(a)
    try:
        client.health()
        info = client.model_info()
        server_spec = client.speculative_config()  # served.py / vllm_counters.py: the --served-check side
    except ServerError as e:
        raise PrecomputeError(str(e)) from e
    warnings = [w for w in [served_model_mismatch(info, a.target, client.name, client.url_option),
                            _concurrency_warning(a, server_spec)] if w]
    for w in warnings:
        logger.warning(f"warning: {w}")
    in_flight = a.max_in_flight if a.max_in_flight is not None else DEFAULT_IN_FLIGHT[a.reference]
    record.update(url=client.url, served_model=info, sampling_params=client.sampling_params(a.max_new_tokens, stop))
    baseline = None
    if a.baseline_server:
        baseline, said = _baseline_client(a, in_flight)
        warnings += said
    return CompletionSource(a.reference, record, client=client, server_spec=server_spec,
                            max_in_flight=in_flight, baseline=baseline), warnings


def _baseline_client(a: PrecomputeArgs, in_flight: int) -> tuple[CompletionClient, list[str]]:
    """``--baseline-server``: a client of the same kind, checked healthy, serving the target, not speculating; and
    a warning when the speculative server's requests run several at a time (then their wall times are not one
    request's)."""
    from ..completion_client import ServerError, served_model_mismatch

    client = served_client(a, a.baseline_server)
    try:
        client.health()
        info = client.model_info()
        spec = client.speculative_config()
    except ServerError as e:
        raise PrecomputeError(f"--baseline-server {a.baseline_server}: {e}") from e
    from ..served_speed import speculating

    if speculating(spec):  # a plain server still describes itself (no algorithm, no draft length)
        raise PrecomputeError(f"--baseline-server {a.baseline_server}: it runs speculative decoding "
                              f"({speculating(spec)}); the "
                              "baseline is plain greedy decoding: start the same target without a drafter")
    warnings = [w for w in [served_model_mismatch(info, a.target, client.name, "--baseline-server")] if w]
    if in_flight > 1:
        warnings.append(f"--baseline-server with --max-in-flight {in_flight}: the speculative requests share the "
                        "server, so their wall times are not one request's; --max-in-flight 1 for a served speed")
    for w in warnings:
        logger.warning(f"warning: {w}")
    return client, warnings


def served_client(a: PrecomputeArgs, url: str | None = None) -> CompletionClient:
    """The client of ``--reference sglang`` or ``--reference vllm`` (at ``url``: another server of that kind)."""
    if a.reference == "vllm":
        from ..vllm_client import VLLMClient

        return VLLMClient(url or a.vllm_url, timeout=a.sglang_timeout, max_retries=a.sglang_retries)
    from ..sglang_client import SGLangClient

    return SGLangClient(url or a.sglang_url, timeout=a.sglang_timeout, max_retries=a.sglang_retries)


def _concurrency_warning(a: PrecomputeArgs, server_spec: dict[str, Any] | None) -> str | None:
    """vLLM's counters are server-wide: with several requests in flight none is any request's own."""
    speculating = (server_spec or {}).get("metrics_positions") is not None
    if a.reference != "vllm" or not speculating or (a.max_in_flight or 1) == 1:
        return None
    return (f"--max-in-flight {a.max_in_flight} with --reference vllm: the server's counters are server-wide, so no "
            "sample's counters will be its own (all marked unattributable); --max-in-flight 1 records them")


def _refuse_other_arguments(out: Path, old: dict[str, Any] | None, source: str, fingerprint: dict[str, Any]) -> None:
    """An existing cache or resume record in ``out`` made with other arguments is not mixed with this run."""
    if old is not None and old != fingerprint:
        diffs = diff(old, fingerprint)
        changed = differing_fields(old, fingerprint)
        if changed and all(".served_model." in f".{k}." or k.endswith(".served_model") for k in changed):
            # Same arguments, another model behind the URL: the server changed, not the command.
            raise PrecomputeError(
                f"--out {out}: the server now serves another model than the one that made its {source} "
                "(same arguments):\n  - " + "\n  - ".join(diffs[:10]) + "\nResume against a server of the "
                "original model, or pass --overwrite to start again with this one")
        raise PrecomputeError(
            f"--out {out}: its {source} was made with different arguments:\n  - " + "\n  - ".join(diffs[:20])
            + "\nUse another --out, rerun with the original arguments to resume, or pass --overwrite to "
            "replace that cache")


def prepare(args: PrecomputeArgs, probe: DtypeProbe | None = None) -> Plan:
    """Validate everything that can be validated without the target's weights."""
    a = args
    check_args(a)
    check_out_path(output_path(a.out))
    if a.prompt_set:
        a = args = dataclasses.replace(a, prompts=built_prompt_set(a))
    drafters = [("--drafter-config", p) for p in drafter_config_paths(a.drafter_config or "")]
    check_outputs_apart([("--target", a.target), ("--prompts", a.prompts), *drafters,
                         ("--completions", a.completions), ("--tokenizer", a.tokenizer)], folders=[("--out", a.out)])
    tcfg, layer_ids, stop = _target_and_layers(a)
    prompts = tokenized_prompts(a, tcfg)
    source, warnings = _completion_source(a, tcfg, prompts, stop)

    # the output folder, then the compute dtype (a resumed run keeps the cache's)
    out = output_path(a.out)  # a symbolic link is written through (fileio.output_path)
    old, old_source = _check_out_folder(out, a)
    # a later turn's prompt holds the turns before it and their answers: bound it by a completion per turn
    turns = max((len(r.turns or ()) for r in prompts.records), default=1)
    longest = max((len(v) for v in prompts.ids.values()), default=0) + a.max_new_tokens * max(turns, 1)
    compute = _choose_compute(a, tcfg, layer_ids, longest, old, probe or DtypeProbe())
    header = Manifest(target=tcfg.manifest_dict(), layer_ids=layer_ids, dtype=a.dtype, reference=source.record,
                      chat_template_kwargs=dict(a.chat_template_kwargs), topk_logprobs=a.topk_logprobs,
                      prompts=prompts.info, compute_dtype=compute.dtype, served_spec_config=source.server_spec,
                      prefill_device=None if a.device == "cpu" else str(a.device).split(":")[0])
    fingerprint = {"manifest": header_dict(header), "samples_per_shard": a.samples_per_shard,
                   "export_head": a.export_head}
    _refuse_other_arguments(out, old, old_source, fingerprint)
    return Plan(args=a, out=out, target=tcfg, layer_ids=layer_ids, stop_token_ids=stop, prompt_ids=prompts.ids,
                groups=prompts.groups, header=header, fingerprint=fingerprint, compute=compute, source=source,
                warnings=warnings, later_turns=prompts.later_turns)
