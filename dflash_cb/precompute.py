"""Precompute a cache of target hidden states (the core of tools/precompute_states.py and merge_states.py).

Two phases, so every cheap check happens before the expensive load of the target:

1. ``prepare(args)``: arguments, target config.json, layer ids, the prompt file (tokenized),
   the reference source (SGLang health/model info, completions file) and the output folder
   (a folder made with other arguments is refused unless ``overwrite``). No weights loaded.
2. ``execute(plan)``: keeps verified shards from an earlier (killed) run, gets the missing
   reference completions, loads the target, prefills one prompt+completion at a time with
   layer hooks, and writes every shard atomically, recording it in ``progress.json``. The
   manifest is written last, so a folder with a manifest is a complete cache.

The layout is a pure function of the arguments (shard ``states-{g:05d}`` holds prompts with
``index // samples_per_shard == g``; no timestamps in the manifest), so an interrupted and
resumed run, or ``--num-shards`` parts merged, give the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_cb.states import (
    HEAD_NAME,
    MANIFEST_NAME,
    CacheError,
    Manifest,
    SampleEntry,
    ShardEntry,
    StateCache,
    atomic_write_bytes,
    sha256_file,
    shard_name,
)

from .errors import DFlashCBError
from .served import served_counters, server_spec_config

PROGRESS_NAME = "progress.json"
LOG_NAME = "precompute_log.json"
JOURNAL_NAME = "reference_completions.jsonl"  # same format as --completions, reusable with --reference file
REFERENCE_KINDS = ("local", "sglang", "file")
DTYPE_NAMES = ("bfloat16", "float32")
# Files a cache folder may hold; anything else means --out points at the wrong folder.
_OWN_FILES = {MANIFEST_NAME, PROGRESS_NAME, LOG_NAME, JOURNAL_NAME, HEAD_NAME}
# Manifest fields filled by the run itself, not by the arguments.
_RESULT_FIELDS = ("shards", "samples", "agreement", "target_head")

Log = Callable[[str], None]


class PrecomputeError(DFlashCBError, ValueError):
    """Invalid arguments, inputs or output folder; raised before any expensive work."""


def _stderr(msg: str) -> None:
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
    dtype: str = "bfloat16"
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


# --------------------------------------------------------------------------------------------
# small helpers


def _is_own_file(name: str) -> bool:
    return name in _OWN_FILES or (name.startswith("states-") and name.endswith(".safetensors")) or \
        (name.startswith(".") and name.endswith(".tmp"))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): d}


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: existing {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


def first_disagreement(target_argmax: torch.Tensor, input_ids: torch.Tensor, prompt_len: int) -> int:
    """``valid_len``: the first completion position t with argmax[t-1] != input_ids[t], else len(input_ids)."""
    t = input_ids.shape[0]
    if t <= prompt_len:
        return t
    differ = (target_argmax[prompt_len - 1:t - 1] != input_ids[prompt_len:]).nonzero()
    return prompt_len + int(differ[0]) if len(differ) else t


def agreement_totals(samples: Sequence[SampleEntry]) -> dict[str, Any]:
    """Agreement of the target's own argmax with the reference completions (a function of the entries only)."""
    completion = sum(s.completion_len for s in samples)
    valid = sum(s.valid_len - s.prompt_len for s in samples)
    firsts = [{"id": s.id, "position": s.valid_len, "completion_offset": s.valid_len - s.prompt_len}
              for s in sorted(samples, key=lambda s: s.index) if s.valid_len < s.total_len]
    return {
        "samples": len(samples),
        "samples_fully_agreeing": len(samples) - len(firsts),
        "completion_tokens": completion,
        "valid_completion_tokens": valid,
        "token_agreement": round(valid / completion, 6) if completion else 1.0,
        "first_disagreements": firsts,
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PrecomputeError(f"{path}: unreadable ({e}); delete it or pass --overwrite") from e


def _layers_from_drafter(path: str, num_layers: int) -> list[int]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PrecomputeError(f"--drafter-config {path}: no such file (give the drafter's config.json)")
    cfg = _read_json(p)
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        raise PrecomputeError(f"{p}: no dflash_config.target_layer_ids; pass --layers explicitly")
    n = cfg.get("num_target_layers")
    if n is not None and int(n) != num_layers:
        raise PrecomputeError(f"{p}: the drafter was made for a target with num_target_layers={n}, "
                              f"--target has {num_layers} decoder layers; wrong drafter or wrong target?")
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------
# phase 1: prepare (no weights loaded)


@dataclass
class Plan:
    args: PrecomputeArgs
    out: Path
    target: Any  # dflash_cb.target.TargetConfig
    layer_ids: list[int]
    stop_token_ids: list[int]
    records: list[Any]  # all PromptRecords of the file
    prompt_ids: dict[str, list[int]]  # tokenized prompts of this part, by id
    groups: dict[int, list[Any]]  # shard group -> records of this part, in file order
    header: Manifest  # the manifest without results
    fingerprint: dict[str, Any]
    completions: dict[str, dict[str, Any]] = field(default_factory=dict)  # --reference file
    client: Any = None  # SGLangClient
    warnings: list[str] = field(default_factory=list)


def _check_args(a: PrecomputeArgs) -> None:
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
    if not isinstance(a.chat_template_kwargs, dict):
        raise PrecomputeError(f"--chat-template-kwargs must be a JSON object, got {a.chat_template_kwargs!r}")


def _load_completions_file(path: str, wanted: dict[str, list[int]], all_ids: set[str], vocab: int,
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
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < vocab for t in ids):
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


def prepare(args: PrecomputeArgs, log: Log = _stderr) -> Plan:
    """Validate everything that can be validated without the target's weights."""
    from dflash_cb import prompts as P
    from dflash_cb.target import TargetError, check_layer_ids, read_target_config

    a = args
    _check_args(a)
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
    records = P.load_prompts(a.prompts)  # PromptFileError is a ValueError with file:line
    S, N, part = a.samples_per_shard, a.num_shards, a.shard_index
    mine = [r for r in records if (r.index // S) % N == part]
    tokenizer = None
    if P.needs_tokenizer(mine):
        from transformers import AutoTokenizer

        tok_path = a.tokenizer or a.target
        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=False)
        except Exception as e:
            raise PrecomputeError(f"{a.prompts}: prompts given as text/messages need a tokenizer, and "
                                  f"{tok_path} has none loadable ({e}); pass --tokenizer") from e
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
        from dflash_cb.sglang_client import SGLangClient, SGLangError, served_model_mismatch

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
        completions = _load_completions_file(a.completions, prompt_ids, {r.id for r in records},
                                             tcfg.vocab_size, a.max_new_tokens, stop)
        reference["completions"] = {"file": Path(a.completions).name, "sha256": sha256_file(a.completions)}

    prompts_info: dict[str, Any] = {"file": Path(a.prompts).name, "sha256": sha256_file(a.prompts),
                                    "count": len(records),
                                    "tokenizer": (a.tokenizer or a.target) if tokenizer is not None else None}
    if N > 1:
        prompts_info["part"] = {"num_shards": N, "shard_index": part}
    header = Manifest(target=tcfg.manifest_dict(), layer_ids=layer_ids, dtype=a.dtype, reference=reference,
                      chat_template_kwargs=dict(a.chat_template_kwargs), topk_logprobs=a.topk_logprobs,
                      prompts=prompts_info, served_spec_config=spec_config)
    fingerprint = {"manifest": _header_dict(header), "samples_per_shard": S, "export_head": a.export_head}
    plan = Plan(args=a, out=Path(a.out), target=tcfg, layer_ids=layer_ids, stop_token_ids=stop,
                records=records, prompt_ids=prompt_ids, groups=groups, header=header,
                fingerprint=fingerprint, completions=completions, client=client, warnings=warnings)
    _check_out_folder(plan)
    return plan


def _header_dict(m: Manifest) -> dict[str, Any]:
    d = m.to_dict()
    for k in _RESULT_FIELDS:
        d.pop(k, None)
    return d


def _manifest_fingerprint(m: Manifest) -> dict[str, Any]:
    sizes = {}
    for s in m.samples:
        sizes[s.shard] = sizes.get(s.shard, 0) + 1
    return {"manifest": _header_dict(m), "samples_per_shard": max(sizes.values(), default=1),
            "export_head": m.target_head is not None}


def _check_out_folder(plan: Plan) -> None:
    out, a = plan.out, plan.args
    if out.exists() and not out.is_dir():
        raise PrecomputeError(f"--out {out}: exists and is not a folder")
    if not out.is_dir() or a.overwrite:
        return
    strangers = sorted(p.name for p in out.iterdir() if not _is_own_file(p.name))
    if strangers:
        raise PrecomputeError(f"--out {out}: holds files that are not part of a cache ({strangers[:5]}); "
                              "choose a new or empty folder")
    old = None
    if (out / PROGRESS_NAME).is_file():
        old = _read_json(out / PROGRESS_NAME).get("fingerprint")
        source = PROGRESS_NAME
    elif (out / MANIFEST_NAME).is_file():
        try:
            old = _manifest_fingerprint(Manifest.from_dict(_read_json(out / MANIFEST_NAME)))
        except (CacheError, TypeError) as e:
            raise PrecomputeError(f"{out / MANIFEST_NAME}: not a manifest this version can resume ({e}); "
                                  "use another --out or pass --overwrite") from e
        source = MANIFEST_NAME
    if old is not None and old != plan.fingerprint:
        diffs = _diff(old, plan.fingerprint)
        raise PrecomputeError(
            f"--out {out}: its {source} was made with different arguments:\n  - " + "\n  - ".join(diffs[:20])
            + "\nUse another --out, rerun with the original arguments to resume, or pass --overwrite to "
            "replace that cache")


# --------------------------------------------------------------------------------------------
# phase 2: execute


@contextlib.contextmanager
def _folder_lock(out: Path) -> Iterator[None]:
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrecomputeError(f"--out {out}: another precompute is writing to this folder") from None
        except OSError:  # a filesystem without flock: run unguarded rather than not at all
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class _State:
    shards: dict[str, ShardEntry] = field(default_factory=dict)
    samples: dict[str, SampleEntry] = field(default_factory=dict)
    head: dict[str, Any] | None = None

    def to_json(self, fingerprint: dict[str, Any]) -> bytes:
        return (json.dumps({"fingerprint": fingerprint,
                            "shards": [dataclasses.asdict(s) for _, s in sorted(self.shards.items())],
                            "samples": [dataclasses.asdict(s) for s in self.samples.values()],
                            "target_head": self.head}, indent=1) + "\n").encode()


def _load_state(plan: Plan, log: Log) -> _State:
    """Entries of an earlier run whose shard files are intact (size + sha256); everything else is redone."""
    out = plan.out
    for p in out.glob(".*.tmp"):  # leftovers of writes interrupted before their rename
        p.unlink()
    if plan.args.overwrite:
        for p in out.iterdir():
            if _is_own_file(p.name) and p.is_file():
                p.unlink()
        return _State()
    if (out / PROGRESS_NAME).is_file():
        data = _read_json(out / PROGRESS_NAME)
        shards = [ShardEntry(**s) for s in data.get("shards", [])]
        samples = [SampleEntry(**s) for s in data.get("samples", [])]
        head = data.get("target_head")
    elif (out / MANIFEST_NAME).is_file():
        m = Manifest.from_dict(_read_json(out / MANIFEST_NAME))
        shards, samples, head = m.shards, m.samples, m.target_head
    else:
        return _State()
    state = _State()
    expected = {shard_name(g): [r.id for r in recs] for g, recs in plan.groups.items()}
    for s in shards:
        p = out / s.file
        ok = expected.get(s.file) == s.samples and p.is_file() and p.stat().st_size == s.bytes \
            and sha256_file(p) == s.sha256
        if ok:
            state.shards[s.file] = s
        else:
            log(f"{p}: missing, incomplete or corrupted; it will be recomputed")
    state.samples = {s.id: s for s in samples if s.shard in state.shards}
    if head is not None and (out / head["file"]).is_file() and sha256_file(out / head["file"]) == head["sha256"]:
        state.head = head
    return state


def _read_journal(path: Path) -> dict[str, dict[str, Any]]:
    """Completions saved by earlier runs; a line cut by a crash (no newline / bad JSON) is ignored."""
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done
    for line in path.read_bytes().split(b"\n")[:-1]:  # the last piece lacks its newline unless complete
        try:
            obj = json.loads(line)
            done[obj["id"]] = {"output_ids": [int(t) for t in obj["output_ids"]],
                               "finish_reason": str(obj["finish_reason"]),
                               "served_spec": served_counters(obj.get("served_spec"))}
        except (ValueError, KeyError, TypeError):
            continue
    return done


def _sglang_completions(plan: Plan, todo: list[Any], log: Log) -> dict[str, dict[str, Any]]:
    """Served completions for ``todo`` records, journaled as they arrive so a rerun never re-queries."""
    journal = plan.out / JOURNAL_NAME
    have = _read_journal(journal)
    # Rewrite the journal clean (drops a torn last line) before appending to it.
    atomic_write_bytes(journal, b"".join(_journal_line(k, v) for k, v in have.items()))
    need = [(r.id, plan.prompt_ids[r.id]) for r in todo if r.id not in have]
    if need:
        log(f"querying {plan.client.url} for {len(need)} reference completion(s) "
            f"({len(have)} already saved in {JOURNAL_NAME})")
        with open(journal, "ab") as f:
            def on_result(key: str, c: Any) -> None:
                have[key] = {"output_ids": list(c.output_ids), "finish_reason": c.finish_reason,
                             "served_spec": served_counters(c.meta_info)}
                f.write(_journal_line(key, have[key]))
                f.flush()
                os.fsync(f.fileno())

            plan.client.generate_many(need, plan.args.max_new_tokens, plan.stop_token_ids,
                                      max_in_flight=plan.args.max_in_flight, on_result=on_result)
    return have


def _journal_line(sid: str, c: dict[str, Any]) -> bytes:
    line = {"id": sid, "output_ids": c["output_ids"], "finish_reason": c["finish_reason"]}
    if c.get("served_spec"):  # the server's speculative counters (absent: the line is as before)
        line["served_spec"] = c["served_spec"]
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


def compute_sample(target: Any, record: Any, prompt: list[int], completion: list[int], finish_reason: str,
                   layer_ids: list[int], topk: int, shard: str) -> tuple[dict[str, torch.Tensor], SampleEntry]:
    """One prefill over prompt + completion: the sample's tensors and its manifest entry."""
    from dflash_cb.target import prefill

    ids = torch.tensor(list(prompt) + list(completion), dtype=torch.int64)
    res = prefill(target, ids, layer_ids, topk=topk)
    valid = first_disagreement(res.target_argmax, ids, len(prompt))
    tensors = {f"{record.id}/input_ids": ids, f"{record.id}/hidden": res.hidden,
               f"{record.id}/target_argmax": res.target_argmax}
    if topk:
        tensors[f"{record.id}/topk_ids"] = res.topk_ids
        tensors[f"{record.id}/topk_logprobs"] = res.topk_logprobs
    entry = SampleEntry(id=record.id, category=record.category, shard=shard, prompt_len=len(prompt),
                        completion_len=len(completion), valid_len=valid, finish_reason=finish_reason,
                        index=record.index)
    return tensors, entry


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Atomic safetensors write (temp + fsync + rename); returns (sha256, bytes).

    ``save_file`` streams from the tensors' memory: ``save()`` to bytes would hold a second copy,
    which for a 248k x 5120 embedding + head is 5 GB.
    """
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest, size = sha256_file(tmp), os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return digest, size


def build_manifest(header: Manifest, shards: Sequence[ShardEntry], samples: Sequence[SampleEntry],
                   head: dict[str, Any] | None) -> Manifest:
    m = Manifest.from_dict(header.to_dict())
    m.shards = sorted(shards, key=lambda s: s.file)
    m.samples = sorted(samples, key=lambda s: s.index)
    m.agreement = agreement_totals(m.samples)
    m.target_head = head
    return m


def execute(plan: Plan, log: Log = _stderr) -> dict[str, Any]:
    """Compute what is missing in ``plan.out``, write the manifest; return the run summary."""
    from tqdm import tqdm

    from dflash_cb.target import greedy_generate, head_tensors, load_target

    a, out = plan.args, plan.out
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    timings = {"load_s": 0.0, "reference_s": 0.0, "generate_s": 0.0, "prefill_s": 0.0, "write_s": 0.0}
    with _folder_lock(out):
        state = _load_state(plan, log)
        todo_groups = [g for g in sorted(plan.groups) if shard_name(g) not in state.shards]
        todo = [r for g in todo_groups for r in plan.groups[g]]
        kept = sum(len(plan.groups[g]) for g in plan.groups) - len(todo)
        if kept:
            log(f"resuming: {kept} sample(s) in {len(state.shards)} verified shard(s) kept, {len(todo)} to compute")
        need_head = a.export_head and state.head is None

        completions = plan.completions
        if a.reference == "sglang":
            t = time.time()
            completions = _sglang_completions(plan, todo, log) if todo else _read_journal(out / JOURNAL_NAME)
            timings["reference_s"] = time.time() - t

        bytes_written = 0
        tokens_done = 0
        if todo or need_head:
            t = time.time()
            log(f"loading {a.target} ({a.dtype}) ...")
            target = load_target(a.target, a.dtype, plan.target)
            timings["load_s"] = time.time() - t
            bar = tqdm(total=len(todo), unit="sample", disable=not a.progress, file=sys.stderr,
                       dynamic_ncols=True)
            t_loop = time.time()
            for g in todo_groups:
                name = shard_name(g)
                tensors: dict[str, torch.Tensor] = {}
                entries = []
                for r in plan.groups[g]:
                    prompt = plan.prompt_ids[r.id]
                    if a.reference == "local":
                        t = time.time()
                        comp, reason = greedy_generate(target, prompt, a.max_new_tokens, plan.stop_token_ids)
                        timings["generate_s"] += time.time() - t
                    else:
                        comp, reason = completions[r.id]["output_ids"], completions[r.id]["finish_reason"]
                    t = time.time()
                    ts, entry = compute_sample(target, r, prompt, comp, reason, plan.layer_ids,
                                               a.topk_logprobs, name)
                    if a.reference != "local":
                        entry.served_spec = completions[r.id].get("served_spec")
                    timings["prefill_s"] += time.time() - t
                    tensors.update(ts)
                    entries.append(entry)
                    tokens_done += entry.total_len
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{tokens_done / max(time.time() - t_loop, 1e-9):.0f}")
                t = time.time()
                sha, size = _save_safetensors(out / name, tensors)
                timings["write_s"] += time.time() - t
                bytes_written += size
                state.shards[name] = ShardEntry(file=name, sha256=sha, bytes=size, samples=[e.id for e in entries])
                state.samples.update({e.id: e for e in entries})
                atomic_write_bytes(out / PROGRESS_NAME, state.to_json(plan.fingerprint))
            bar.close()
            if need_head:
                tensors, tied = head_tensors(target)
                sha, size = _save_safetensors(out / HEAD_NAME, tensors)
                bytes_written += size
                embed = tensors["embed_tokens.weight"]
                state.head = {"file": HEAD_NAME, "sha256": sha, "bytes": size, "tied": tied,
                              "vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]),
                              "dtype": str(embed.dtype).removeprefix("torch.")}
                atomic_write_bytes(out / PROGRESS_NAME, state.to_json(plan.fingerprint))
            del target

        if not a.export_head:
            state.head = None
            (out / HEAD_NAME).unlink(missing_ok=True)
        manifest = build_manifest(plan.header, list(state.shards.values()), list(state.samples.values()),
                                  state.head)
        ids = [s.id for s in manifest.samples]
        if a.reference == "sglang" and all(i in completions for i in ids):
            # sorted once complete, so the journal too is deterministic
            atomic_write_bytes(out / JOURNAL_NAME, b"".join(_journal_line(i, completions[i]) for i in ids))
        manifest.write(out)  # last: its presence means "complete"
        (out / PROGRESS_NAME).unlink(missing_ok=True)

        wall = time.time() - t0
        ag = manifest.agreement
        total_tokens = sum(s.total_len for s in manifest.samples)
        summary = {
            "out": str(out),
            "samples": len(manifest.samples),
            "samples_computed": len(todo),
            "samples_kept": kept,
            "tokens": total_tokens,
            "tokens_computed": tokens_done,
            "completion_tokens": ag["completion_tokens"],
            "token_agreement": ag["token_agreement"],
            "samples_fully_agreeing": ag["samples_fully_agreeing"],
            "bytes_written": bytes_written,
            "cache_bytes": sum(s.bytes for s in manifest.shards) + (state.head or {}).get("bytes", 0),
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens_done / max(timings["prefill_s"] + timings["generate_s"], 1e-9), 1),
            "timings": {k: round(v, 3) for k, v in timings.items()},
            "warnings": plan.warnings,
        }
        log_record = {"summary": summary, "args": dataclasses.asdict(a), "finished_unix": time.time(),
                      "torch_threads": torch.get_num_threads()}
        atomic_write_bytes(out / LOG_NAME, (json.dumps(log_record, indent=1) + "\n").encode())
    log(format_summary(summary))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    return (f"precompute done: {s['out']}: {s['samples']} samples ({s['samples_computed']} computed, "
            f"{s['samples_kept']} kept), {s['tokens']} tokens; agreement {100 * s['token_agreement']:.2f}% of "
            f"{s['completion_tokens']} completion tokens, {s['samples_fully_agreeing']}/{s['samples']} samples "
            f"fully agree; {s['bytes_written'] / 1e6:.1f} MB written (cache {s['cache_bytes'] / 1e6:.1f} MB); "
            f"wall {s['wall_s']:.1f} s ({s['tokens_per_s']:.0f} tok/s)")


def run_precompute(args: PrecomputeArgs, log: Log = _stderr) -> dict[str, Any]:
    return execute(prepare(args, log), log)


# --------------------------------------------------------------------------------------------
# merge


def merge_parts(out: str | os.PathLike, parts: Sequence[str | os.PathLike], overwrite: bool = False,
                link: bool = True, verify: bool = True, log: Log = _stderr) -> Manifest:
    """Combine ``--num-shards`` parts into one cache, equal to what a single run would have written."""
    out = Path(out)
    if not parts:
        raise PrecomputeError("merge: give at least one part folder")
    caches = []
    for p in parts:
        try:
            caches.append(StateCache(p))
        except CacheError as e:
            raise PrecomputeError(f"merge: {e}") from e
    base = caches[0].manifest

    # Paths may differ between hosts (same checkpoint elsewhere); everything that shapes the data may not.
    local_paths = ("target.name_or_path", "prompts.tokenizer")

    def common(m: Manifest) -> dict[str, Any]:
        d = _header_dict(m)
        d["prompts"] = {k: v for k, v in d["prompts"].items() if k != "part"}
        d["target_head"] = None if m.target_head is None else m.target_head["sha256"]
        return d

    for c in caches[1:]:
        diffs = _diff(common(base), common(c.manifest))
        for d in [d for d in diffs if d.split(":")[0] in local_paths]:
            log(f"warning: merge: {c.path} differs in {d} (kept {caches[0].path}'s)")
        diffs = [d for d in diffs if d.split(":")[0] not in local_paths]
        if diffs:
            raise PrecomputeError(f"merge: {c.path} was made with other arguments than {caches[0].path}:\n  - "
                                  + "\n  - ".join(diffs[:20]))
    count = int(base.prompts.get("count", -1))
    seen: dict[int, str] = {}
    for c in caches:
        for s in c.manifest.samples:
            if s.index in seen:
                raise PrecomputeError(f"merge: prompt #{s.index} ({s.id!r}) is in both {seen[s.index]} and "
                                      f"{c.path}; give each part once")
            seen[s.index] = str(c.path)
    missing = sorted(set(range(count)) - set(seen))
    if missing:
        raise PrecomputeError(f"merge: the parts cover {len(seen)} of {count} prompts; missing prompt indices "
                              f"{missing[:20]} (a part not given or not finished?)")
    if out.resolve() in {c.path.resolve() for c in caches}:
        raise PrecomputeError("merge: --out must not be one of the parts")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise PrecomputeError(f"merge: --out {out} is not empty; pass --overwrite to replace it")
        for p in out.iterdir():
            if _is_own_file(p.name) and p.is_file():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)

    def place(src: Path, dst: Path) -> None:
        tmp = dst.with_name(f".{dst.name}.merge.tmp")
        tmp.unlink(missing_ok=True)
        try:
            if not link:
                raise OSError
            os.link(src, tmp)  # hard link: no copy of multi-GB shards on the same filesystem
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)

    shards, samples = [], []
    for c in caches:
        if verify:
            try:
                c.verify()
            except CacheError as e:
                raise PrecomputeError(f"merge: {e}") from e
        for s in c.manifest.shards:
            place(c.path / s.file, out / s.file)
            shards.append(s)
        samples.extend(c.manifest.samples)
    head = base.target_head
    if head is not None:
        place(caches[0].path / head["file"], out / head["file"])
    journals = {}
    for c in caches:
        journals.update(_read_journal(c.path / JOURNAL_NAME))
    header = Manifest.from_dict(base.to_dict())
    header.prompts = {k: v for k, v in header.prompts.items() if k != "part"}
    m = build_manifest(header, shards, samples, head)
    if journals and all(s.id in journals for s in m.samples):
        atomic_write_bytes(out / JOURNAL_NAME, b"".join(_journal_line(s.id, journals[s.id]) for s in m.samples))
    m.write(out)
    log(f"merged {len(caches)} part(s) into {out}: {len(m.samples)} samples, {len(m.shards)} shards")
    return m


# --------------------------------------------------------------------------------------------
# command line


def _int_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if isinstance(value, int):
        value = [value]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise PrecomputeError(f"expected a comma-separated list of integers, got {value!r}") from None


def _json_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise PrecomputeError(f"--chat-template-kwargs: not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise PrecomputeError(f"--chat-template-kwargs must be a JSON object, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precompute_states.py",
        description="Precompute a DFlash cache of target hidden states (see cached_states/README.md). "
                    "Every option can also come from --config FILE (YAML, same names); the command line wins.")
    S = argparse.SUPPRESS  # unset options stay absent, so YAML values are not overridden by defaults
    p.add_argument("--config", help="YAML file with any of the options below")
    p.add_argument("--target", default=S, help="Hugging Face model folder (or hub id)")
    p.add_argument("--prompts", default=S, help="prompt JSONL (id, category, messages|text|input_ids)")
    p.add_argument("--out", default=S, help="cache folder, e.g. cached_states/qwen36-27b-v1")
    p.add_argument("--layers", default=S, help="target layer ids, e.g. 1,16,31,46,61 (id i = hidden_states[i+1])")
    p.add_argument("--drafter-config", default=S, help="drafter config.json giving the layer ids")
    p.add_argument("--reference", default=S, choices=REFERENCE_KINDS, help="completion source (default local)")
    p.add_argument("--sglang-url", default=S, help="SGLang server for --reference sglang")
    p.add_argument("--completions", default=S, help='JSONL of {"id", "output_ids"} for --reference file')
    p.add_argument("--max-new-tokens", type=int, default=S, help="generation length (default 256)")
    p.add_argument("--chat-template-kwargs", default=S, help='JSON, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--dtype", default=S, choices=DTYPE_NAMES, help="compute and storage dtype (default bfloat16)")
    p.add_argument("--topk-logprobs", type=int, default=S, help="store top-K log-probs per position (0 = off)")
    p.add_argument("--num-shards", type=int, default=S, help="split the work into N parts (default 1)")
    p.add_argument("--shard-index", type=int, default=S, help="which part this run computes (0-based)")
    p.add_argument("--samples-per-shard", type=int, default=S, help="samples per shard file (default 1)")
    p.add_argument("--stop-token-ids", default=S, help="comma-separated; default: the target's eos ids")
    p.add_argument("--tokenizer", default=S, help="tokenizer for text/messages prompts (default: --target)")
    p.add_argument("--no-export-head", dest="export_head", action="store_false", default=S,
                   help="do not export the target's embedding and head")
    p.add_argument("--overwrite", action="store_true", default=S,
                   help="replace a cache in --out made with other arguments")
    p.add_argument("--max-in-flight", type=int, default=S, help="concurrent SGLang requests (default 8)")
    p.add_argument("--sglang-timeout", type=float, default=S, help="seconds per SGLang request (default 600)")
    p.add_argument("--sglang-retries", type=int, default=S, help="retries per SGLang request (default 5)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bar")
    return p


def args_from_cli(argv: Sequence[str] | None = None) -> PrecomputeArgs:
    """Parse the command line over the optional --config YAML over the defaults."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    config = ns.pop("config", None)
    if config:
        import yaml

        try:
            loaded = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise PrecomputeError(f"--config {config}: {e}") from e
        if not isinstance(loaded, dict):
            raise PrecomputeError(f"--config {config}: expected a mapping of option names to values")
        known = {f.name for f in dataclasses.fields(PrecomputeArgs)}
        for k, v in loaded.items():
            key = str(k).replace("-", "_")
            if key == "no_export_head":
                key, v = "export_head", not v
            if key not in known:
                raise PrecomputeError(f"--config {config}: unknown option {k!r}; known: {sorted(known)}")
            values[key] = v
    values.update(ns)
    if "layers" in values:
        values["layers"] = _int_list(values["layers"])
    if "stop_token_ids" in values:
        values["stop_token_ids"] = _int_list(values["stop_token_ids"])
    if "chat_template_kwargs" in values:
        values["chat_template_kwargs"] = _json_dict(values["chat_template_kwargs"] or {})
    for k in ("target", "prompts", "out", "drafter_config", "sglang_url", "completions", "tokenizer"):
        if values.get(k) is not None:
            values[k] = str(values[k])
    return PrecomputeArgs(**values)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = args_from_cli(argv)
        plan = prepare(args)
    except ValueError as e:  # PrecomputeError, PromptFileError: bad input, nothing was loaded or written
        _stderr(f"error: {e}")
        return 2
    from dflash_cb.sglang_client import SGLangError
    from dflash_cb.target import TargetError

    try:
        execute(plan)
    except (PrecomputeError, CacheError, TargetError, SGLangError) as e:
        hint = ""
        if isinstance(e, SGLangError):
            hint = f"\n(completions received so far are saved in {plan.out / JOURNAL_NAME}; rerun to resume)"
        _stderr(f"error: {e}{hint}")
        return 1
    return 0


def merge_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="merge_states.py",
                                description="Merge --num-shards parts of a precompute into one cache.")
    p.add_argument("--out", required=True, help="the merged cache folder")
    p.add_argument("parts", nargs="+", help="part folders (each a finished precompute_states.py --out)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache in --out")
    p.add_argument("--copy", action="store_true", help="copy shards instead of hard-linking them")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the parts' shards")
    ns = p.parse_args(argv)
    try:
        merge_parts(ns.out, ns.parts, overwrite=ns.overwrite, link=not ns.copy, verify=not ns.no_verify)
    except (PrecomputeError, CacheError) as e:
        _stderr(f"error: {e}")
        return 1
    return 0
