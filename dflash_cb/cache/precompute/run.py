"""Phase 2 of a precompute: the resumable run (state, reference completions, per-sample prefill, shards).

``execute(plan)`` keeps verified shards from an earlier (killed) run, gets the missing reference
completions (journaled as they arrive), loads the target in the compute dtype, prefills one
prompt+completion at a time with layer hooks, and writes every shard atomically, appending it to
``progress.jsonl``. The manifest is written last, so a folder with a manifest is a complete cache.

The layout is a pure function of the arguments (shard ``states-{g:05d}`` holds prompts with
``index // samples_per_shard == g``; no timestamps in the manifest), so an interrupted and resumed
run, or ``--num-shards`` parts merged, give the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...common.fileio import atomic_path, atomic_write_json
from ..served import served_counters
from ..states import (
    HEAD_NAME,
    MANIFEST_NAME,
    Manifest,
    SampleEntry,
    ShardEntry,
    first_disagreement,
    sha256_file,
    shard_name,
)
from .journal import append_entry, drop_torn_tail, journal_entry, read_journal, request_key, write_in_order
from .plan import (
    JOURNAL_NAME,
    LEGACY_PROGRESS_NAME,
    LOG_NAME,
    PROGRESS_NAME,
    DtypeProbe,
    Log,
    Plan,
    PrecomputeArgs,
    PrecomputeError,
    is_own_file,
    prepare,
    read_json,
    stderr_log,
)
from .progress import append_progress, read_progress, shard_record, start_progress


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


def build_manifest(header: Manifest, shards: Sequence[ShardEntry], samples: Sequence[SampleEntry],
                   head: dict[str, Any] | None) -> Manifest:
    m = Manifest.from_dict(header.to_dict())
    m.shards = sorted(shards, key=lambda s: s.file)
    m.samples = sorted(samples, key=lambda s: s.index)
    m.agreement = agreement_totals(m.samples)
    m.target_head = head
    return m


# --------------------------------------------------------------------------------------------
# shard files


def _safetensors_size(path: Path) -> int:
    """The size a complete safetensors file must have, from its own header."""
    from ..target import safetensors_header

    n, header = safetensors_header(path)
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Atomic safetensors write (fileio.atomic_path); returns (sha256, bytes).

    ``save_file`` streams from the tensors' memory (``save()`` to bytes would hold a second copy, 5 GB
    for a 248k x 5120 embedding + head). Its writer does not always report a failed write (disk
    full), so the size is checked against the file's own header before the file is renamed into place.
    """
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:  # a failed write is an OSError naming ``path``
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        size, expected = os.path.getsize(tmp), _safetensors_size(tmp)
        if size != expected:
            raise OSError(errno.ENOSPC, f"short write, {size} of {expected} bytes (disk full?)", str(path))
        digest = sha256_file(tmp)
    return digest, size


def compute_sample(target: Any, record: Any, prompt: list[int], completion: list[int], finish_reason: str,
                   layer_ids: list[int], topk: int, shard: str,
                   store_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], SampleEntry]:
    """One prefill over prompt + completion: the sample's tensors and its manifest entry."""
    from ..target import prefill

    ids = torch.tensor(list(prompt) + list(completion), dtype=torch.int64)
    res = prefill(target, ids, layer_ids, topk=topk, store_dtype=store_dtype)
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


# --------------------------------------------------------------------------------------------
# resumable state


@contextlib.contextmanager
def folder_lock(out: Path) -> Iterator[None]:
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

    def records(self) -> list[dict[str, Any]]:
        """progress.jsonl records of what is kept."""
        recs = [shard_record(s, [self.samples[i] for i in s.samples]) for _, s in sorted(self.shards.items())]
        return recs + ([{"target_head": self.head}] if self.head is not None else [])


def _load_state(plan: Plan, log: Log) -> _State:
    """Entries of an earlier run whose shard files are intact (size + sha256); everything else is redone."""
    out = plan.out
    for p in out.glob(".*.tmp"):  # leftovers of writes interrupted before their rename
        p.unlink()
    (out / LEGACY_PROGRESS_NAME).unlink(missing_ok=True)
    if plan.args.overwrite:
        for p in out.iterdir():
            if is_own_file(p.name) and p.is_file():
                p.unlink()
        return _State()
    if (out / PROGRESS_NAME).is_file():
        shards, samples, head = read_progress(out / PROGRESS_NAME)
    elif (out / MANIFEST_NAME).is_file():
        m = Manifest.from_dict(read_json(out / MANIFEST_NAME))
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


def _request_keys(plan: Plan) -> dict[str, str]:
    ref = plan.header.reference
    return {sid: request_key(ids, ref["sampling_params"], ref["served_model"]) for sid, ids in plan.prompt_ids.items()}


def _sglang_completions(plan: Plan, todo: list[Any], log: Log) -> dict[str, dict[str, Any]]:
    """Served completions for ``todo`` records, journaled one by one as they arrive.

    A rerun uses the journaled entries made by the same request (prompt tokens, sampling
    parameters, served model) and queries only the others.
    """
    journal = plan.out / JOURNAL_NAME
    keys = _request_keys(plan)
    drop_torn_tail(journal)
    have, ignored = read_journal(journal, keys, plan.target.vocab_size)
    if ignored:
        log(f"{journal}: {ignored} saved completion(s) were made with other arguments (or are damaged); "
            "they are ignored and asked again")
    need = [(r.id, plan.prompt_ids[r.id]) for r in todo if r.id not in have]
    if need:
        log(f"querying {plan.client.url} for {len(need)} reference completion(s) "
            f"({len(todo) - len(need)} already saved in {JOURNAL_NAME})")

        def on_result(sid: str, c: Any) -> None:
            have[sid] = journal_entry(sid, keys[sid], c.output_ids, c.finish_reason, served_counters(c.meta_info))
            append_entry(journal, have[sid])

        plan.client.generate_many(need, plan.args.max_new_tokens, plan.stop_token_ids,
                                  max_in_flight=plan.args.max_in_flight, on_result=on_result,
                                  vocab_size=plan.target.vocab_size)
    return have


# --------------------------------------------------------------------------------------------
# the run


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def execute(plan: Plan, log: Log = stderr_log) -> dict[str, Any]:
    """Compute what is missing in ``plan.out``, write the manifest; return the run summary."""
    from tqdm import tqdm

    from ..sglang_client import SGLangError
    from ..target import DTYPES, greedy_generate, head_tensors, load_target

    a, out = plan.args, plan.out
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    store_dtype = DTYPES[a.dtype]
    timings = {"load_s": 0.0, "reference_s": 0.0, "generate_s": 0.0, "prefill_s": 0.0, "write_s": 0.0}
    with folder_lock(out):
        state = _load_state(plan, log)
        todo_groups = [g for g in sorted(plan.groups) if shard_name(g) not in state.shards]
        todo = [r for g in todo_groups for r in plan.groups[g]]
        kept = sum(len(plan.groups[g]) for g in plan.groups) - len(todo)
        if kept:
            log(f"resuming: {kept} sample(s) in {len(state.shards)} verified shard(s) kept, {len(todo)} to compute")
        need_head = a.export_head and state.head is None
        # The fingerprint goes down first: whatever this run leaves behind is tied to its arguments.
        start_progress(out / PROGRESS_NAME, plan.fingerprint, state.records())

        completions = plan.completions
        if a.reference == "sglang":
            t = time.time()
            try:
                completions = _sglang_completions(plan, todo, log) if todo else \
                    read_journal(out / JOURNAL_NAME, _request_keys(plan))[0]
            except SGLangError as e:
                raise PrecomputeError(f"{e}\n(completions received so far are saved in {out / JOURNAL_NAME}; "
                                      "rerun to resume)") from e
            timings["reference_s"] = time.time() - t

        bytes_written = 0
        tokens_done = 0
        if todo or need_head:
            t = time.time()
            log(f"loading {a.target} (compute {plan.compute_dtype}, storage {a.dtype}) ...")
            target = load_target(a.target, plan.compute_dtype, plan.target)
            timings["load_s"] = time.time() - t

            def expected_len(r: Any) -> int:  # exact for served/file completions, an upper bound for local
                comp = completions.get(r.id)
                return len(plan.prompt_ids[r.id]) + (len(comp["output_ids"]) if comp else a.max_new_tokens)

            tokens_left = sum(expected_len(r) for r in todo)
            bar = tqdm(total=tokens_left, unit="tok", unit_scale=True, disable=not a.progress, file=sys.stderr,
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
                                               a.topk_logprobs, name, store_dtype)
                    timings["prefill_s"] += time.time() - t
                    if a.reference != "local":
                        entry.served_spec = served_counters(completions[r.id].get("served_spec"))
                    tensors.update(ts)
                    entries.append(entry)
                    tokens_done += entry.total_len
                    tokens_left -= expected_len(r)
                    bar.total = tokens_done + tokens_left
                    bar.update(entry.total_len)
                    if len(entries) == 1 and g == todo_groups[0]:
                        rate = tokens_done / max(time.time() - t_loop, 1e-9)
                        bound = "at most " if a.reference == "local" else ""
                        log(f"first sample: {entry.total_len} tokens, {rate:.0f} tok/s ({plan.compute_dtype} "
                            f"compute); {bound}{tokens_left} tokens left, projected {bound}"
                            f"{_duration(tokens_left / max(rate, 1e-9))}")
                t = time.time()
                sha, size = save_safetensors(out / name, tensors)
                timings["write_s"] += time.time() - t
                bytes_written += size
                shard = ShardEntry(file=name, sha256=sha, bytes=size, samples=[e.id for e in entries])
                state.shards[name] = shard
                state.samples.update({e.id: e for e in entries})
                append_progress(out / PROGRESS_NAME, shard_record(shard, entries))
            bar.close()
            if need_head:
                tensors, tied = head_tensors(target, store_dtype)
                sha, size = save_safetensors(out / HEAD_NAME, tensors)
                bytes_written += size
                embed = tensors["embed_tokens.weight"]
                state.head = {"file": HEAD_NAME, "sha256": sha, "bytes": size, "tied": tied,
                              "vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]),
                              "dtype": str(embed.dtype).removeprefix("torch.")}
                append_progress(out / PROGRESS_NAME, {"target_head": state.head})
            del target

        if not a.export_head:
            state.head = None
            (out / HEAD_NAME).unlink(missing_ok=True)
        manifest = build_manifest(plan.header, list(state.shards.values()), list(state.samples.values()),
                                  state.head)
        ids = [s.id for s in manifest.samples]
        if a.reference == "sglang" and all(i in completions for i in ids):
            # sorted once complete, so the journal too is deterministic
            write_in_order(out / JOURNAL_NAME, completions, ids)
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
            "compute_dtype": plan.compute_dtype,
            "dtype": a.dtype,
            "bytes_written": bytes_written,
            "cache_bytes": sum(s.bytes for s in manifest.shards) + (state.head or {}).get("bytes", 0),
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens_done / max(timings["prefill_s"] + timings["generate_s"], 1e-9), 1),
            "timings": {k: round(v, 3) for k, v in timings.items()},
            "warnings": plan.warnings,
        }
        # the thread count is in the compute record (it shapes the dtype probe's figures too)
        log_record = {"summary": summary, "args": dataclasses.asdict(a), "compute": plan.compute.record(),
                      "finished_unix": time.time()}
        atomic_write_json(out / LOG_NAME, log_record)
    log(format_summary(summary))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    return (f"precompute done: {s['out']}: {s['samples']} samples ({s['samples_computed']} computed, "
            f"{s['samples_kept']} kept), {s['tokens']} tokens; agreement {100 * s['token_agreement']:.2f}% of "
            f"{s['completion_tokens']} completion tokens ({s['compute_dtype']} compute, {s['dtype']} storage), "
            f"{s['samples_fully_agreeing']}/{s['samples']} samples fully agree; "
            f"{s['bytes_written'] / 1e6:.1f} MB written (cache {s['cache_bytes'] / 1e6:.1f} MB); "
            f"wall {s['wall_s']:.1f} s ({s['tokens_per_s']:.0f} tok/s)")


def run_precompute(args: PrecomputeArgs, log: Log = stderr_log, probe: DtypeProbe | None = None) -> dict[str, Any]:
    return execute(prepare(args, log, probe), log)
