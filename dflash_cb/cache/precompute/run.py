"""Phase 2 of a precompute: the resumable run (state, completions, per-sample prefill, shards).

``execute(plan)`` runs in phases, each a function below: keep the verified shards of an earlier
(killed) run (``_load_state``), get the missing completions (``_completions``: served ones journaled
as they arrive), load the target in the compute dtype, prefill one prompt+completion at a time with
layer hooks, writing every shard atomically and appending it to ``progress.jsonl`` (``_compute_shards``),
export the head (``_export_head``), write the manifest (``_write_manifest``) and the run's record
(``_summary``). The manifest is written last, so a folder with a manifest is a complete cache.

The layout is a pure function of the arguments (shard ``states-{g:05d}`` holds prompts with
``index // samples_per_shard == g``; no timestamps in the manifest), so an interrupted and resumed
run, or ``--num-shards`` parts merged, give the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...common.fileio import append_line_durably, atomic_path, atomic_write_json
from ...common.tensorfile import write_safetensors
from ..integrity import sha256_file
from ..manifest import (
    HEAD_NAME,
    MANIFEST_NAME,
    Manifest,
    SampleEntry,
    ShardEntry,
    first_disagreement,
    shard_name,
)
from ..prompts import PromptRecord
from ..served import served_counters
from ..served_speed import TIMING_KEY, TIMING_NAME, read_timings, timing_line, timing_record, with_baseline
from .errors import PrecomputeError
from .journal import append_entry, drop_torn_tail, journal_entry, read_journal, request_key, write_in_order
from .plan import (
    JOURNAL_NAME,
    LOG_NAME,
    PROGRESS_NAME,
    DtypeProbe,
    Plan,
    PrecomputeArgs,
    is_own_file,
    prepare,
    read_json,
)
from .progress import append_progress, read_progress, shard_record, start_progress

if TYPE_CHECKING:
    from ..target import Target

logger = logging.getLogger(__name__)

Completions = dict[str, dict[str, Any]]  # by sample id: output_ids, finish_reason, served_spec


def agreement_totals(samples: Sequence[SampleEntry]) -> dict[str, Any]:
    """Agreement of the target's own argmax with the completions (a function of the entries only)."""
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


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Atomic safetensors write (fileio.atomic_path); returns (sha256, bytes).

    Written from the tensors' memory (``tensorfile``: no second copy, 5 GB for a 248k x 5120
    embedding + head); a failed write (disk full) is an ``OSError`` naming ``path``.
    """
    with atomic_path(path) as tmp:
        size = write_safetensors(tmp, tensors, metadata={"format": "pt"})
        digest = sha256_file(tmp)
    return digest, size


def compute_sample(target: Target, record: PromptRecord, prompt: list[int], completion: list[int],
                   finish_reason: str, layer_ids: list[int], topk: int, shard: str,
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
    """What the cache folder holds so far: verified shards, their samples, the exported head."""

    shards: dict[str, ShardEntry] = field(default_factory=dict)
    samples: dict[str, SampleEntry] = field(default_factory=dict)
    head: dict[str, Any] | None = None

    def records(self) -> list[dict[str, Any]]:
        """progress.jsonl records of what is kept."""
        recs = [shard_record(s, [self.samples[i] for i in s.samples]) for _, s in sorted(self.shards.items())]
        return recs + ([{"target_head": self.head}] if self.head is not None else [])


@dataclass
class _Tally:
    """What the run measured: seconds per phase (the summary's ``timings``), bytes written, tokens prefilled."""

    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("load_s", "reference_s", "generate_s", "prefill_s", "write_s"), 0.0))
    bytes_written: int = 0
    tokens_done: int = 0


def _load_state(plan: Plan) -> _State:
    """Entries of an earlier run whose shard files are intact (size + sha256); everything else is redone."""
    out = plan.out
    for p in out.glob(".*.tmp"):  # leftovers of writes interrupted before their rename
        p.unlink()
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
            logger.warning(f"{p}: missing, incomplete or corrupted; it will be recomputed")
    state.samples = {s.id: s for s in samples if s.shard in state.shards}
    if head is not None and (out / head["file"]).is_file() and sha256_file(out / head["file"]) == head["sha256"]:
        state.head = head
    return state


def _request_keys(plan: Plan) -> dict[str, str]:
    record = plan.header.reference
    return {sid: request_key(ids, record["sampling_params"], record["served_model"])
            for sid, ids in plan.prompt_ids.items()}


def _served_completions(plan: Plan, todo: list[PromptRecord]) -> Completions:
    """Served completions for ``todo`` records, journaled one by one as they arrive.

    A rerun uses the journaled entries made by the same request (prompt tokens, sampling
    parameters, served model) and queries only the others.
    """
    journal = plan.out / JOURNAL_NAME
    keys = _request_keys(plan)
    drop_torn_tail(journal)
    have, ignored = read_journal(journal, keys, plan.target.vocab_size)
    if ignored:
        logger.warning(f"{journal}: {ignored} saved completion(s) were made with other arguments (or are damaged); "
                       "they are ignored and asked again")
    askable = [r for r in todo if r.id in plan.prompt_ids]  # a later turn waits for the turn before's answer
    need = [(r.id, plan.prompt_ids[r.id]) for r in askable if r.id not in have]
    if need:
        client = plan.source.client
        logger.info(f"querying {client.url} for {len(need)} reference completion(s) "
                    f"({len(askable) - len(need)} already saved in {JOURNAL_NAME})")

        def on_result(sid: str, c: Any) -> None:
            have[sid] = journal_entry(sid, keys[sid], c.output_ids, c.finish_reason, served_counters(c.meta_info))
            append_entry(journal, have[sid])
            timing = timing_record(c.wall_seconds, plan.source.max_in_flight, c.server_timing)
            if timing is not None:  # a measurement: beside the journal, whose bytes are the completions'
                append_line_durably(plan.out / TIMING_NAME, timing_line(sid, keys[sid], timing))

        client.generate_many(need, plan.args.max_new_tokens, plan.stop_token_ids,
                             max_in_flight=plan.source.max_in_flight, on_result=on_result,
                             vocab_size=plan.target.vocab_size)
    if plan.source.baseline is not None:
        _baseline_timings(plan, have, keys)
    return have


def _baseline_timings(plan: Plan, have: Completions, keys: dict[str, str]) -> None:
    """``--baseline-server``: each served prompt without a plain server's time is sent there, one at a time; the
    completion must be the speculative server's (the same target, greedy), and its wall time joins the prompt's
    timing (a later line of ``TIMING_NAME`` replaces the earlier one)."""
    client = plan.source.baseline
    assert client is not None
    timed = read_timings(plan.out / TIMING_NAME, keys)
    need = [sid for sid in plan.prompt_ids if sid in have
            and not isinstance((timed.get(sid, {}).get(TIMING_KEY) or {}).get("baseline"), dict)]
    if not need:
        return
    logger.info(f"timing {len(need)} prompt(s) on the plain server {client.url} (--baseline-server, one at a time)")
    for sid in need:
        c = client.generate(plan.prompt_ids[sid], plan.args.max_new_tokens, plan.stop_token_ids,
                            vocab_size=plan.target.vocab_size)
        want = list(have[sid]["output_ids"])
        if c.output_ids != want:
            at = next((i for i, (x, y) in enumerate(zip(c.output_ids, want, strict=False)) if x != y),
                      min(len(c.output_ids), len(want)))
            raise PrecomputeError(f"--baseline-server {client.url}: prompt {sid!r}: its greedy completion differs from "
                                  f"the speculative server's at token {at}; both must serve the same target, greedily")
        timing = with_baseline(timed.get(sid, {}).get(TIMING_KEY), c.wall_seconds, client.url, c.server_timing)
        append_line_durably(plan.out / TIMING_NAME, timing_line(sid, keys[sid], timing))


# --------------------------------------------------------------------------------------------
# the phases of the run


def _known_completion(plan: Plan, state: _State, completions: Completions, sid: str) -> list[int] | None:
    """The completion of sample ``sid`` if the run has it: given, generated or served so far, or in a kept shard."""
    if sid in completions:
        return list(completions[sid]["output_ids"])
    entry = state.samples.get(sid)
    if entry is None:
        return None
    from safetensors import safe_open

    with safe_open(str(plan.out / entry.shard), "pt") as f:  # verified by _load_state
        return f.get_tensor(f"{sid}/input_ids")[entry.prompt_len:].tolist()


def _later_turn_prompts(plan: Plan, state: _State, completions: Completions) -> bool:
    """The prompts of the later turns whose earlier turns all have completions now (the conversation so far,
    each answer decoded, through the chat template as the preset's benchmark builds it); True if any was added."""
    from ..prompt_sets import answer_text, earlier_turns, preset, turn_prompt

    lt = plan.later_turns
    if lt is None:
        return False
    added = False
    for r in lt.pending(plan.prompt_ids):
        before = earlier_turns(lt.records, r)
        answers = [_known_completion(plan, state, completions, sid) for sid in before]
        if any(a is None for a in answers):
            continue
        turn = len(answers) + 1
        _, ids = turn_prompt(preset(r.source["preset"]), lt.tokenizer, r.turns[:turn],
                             [answer_text(lt.tokenizer, a) for a in answers])
        if len(ids) + plan.args.max_new_tokens > plan.target.max_position_embeddings:
            raise PrecomputeError(f"{plan.args.prompts}:{r.line}: turn {turn} of {before[0]!r} has "
                                  f"{len(ids)} prompt tokens; with --max-new-tokens {plan.args.max_new_tokens} that "
                                  f"exceeds the target's {plan.target.max_position_embeddings} positions")
        plan.prompt_ids[r.id] = ids
        added = True
    return added


def _completions(plan: Plan, state: _State, todo: list[PromptRecord], tally: _Tally) -> Completions:
    """Every completion the run uses that is not generated locally: the file's, or the server's (the
    journal's for a complete cache), a later turn's asked once the turn before it is answered."""
    if not plan.source.served:
        return plan.source.completions
    from ..completion_client import ServerError

    def served() -> Completions:
        return _served_completions(plan, todo) if todo else \
            read_journal(plan.out / JOURNAL_NAME, _request_keys(plan))[0]

    t = time.time()
    try:
        completions = served()
        while _later_turn_prompts(plan, state, completions):
            completions = served()
    except ServerError as e:
        raise PrecomputeError(f"{e}\n(completions received so far are saved in {plan.out / JOURNAL_NAME}; "
                              "rerun to resume)") from e
    tally.timings["reference_s"] = time.time() - t
    return completions


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Progress:
    """The token progress bar, and after the first sample the projected time left."""

    def __init__(self, plan: Plan, todo: list[PromptRecord], completions: Completions, tally: _Tally):
        from tqdm import tqdm

        def expected_len(r: PromptRecord) -> int:  # exact for served/file completions, an upper bound for local
            comp = completions.get(r.id)
            prompt = len(plan.prompt_ids.get(r.id, ()))  # a later turn's prompt is not built yet: its answer
            return prompt + (len(comp["output_ids"]) if comp else plan.args.max_new_tokens)

        self.plan, self.tally = plan, tally
        self.expected = {r.id: expected_len(r) for r in todo}
        self.left = sum(self.expected.values())
        self.first = True
        self.bar = tqdm(total=self.left, unit="tok", unit_scale=True, disable=not plan.args.progress,
                        file=sys.stderr, dynamic_ncols=True)
        self.start = time.time()

    def done(self, entry: SampleEntry) -> None:
        self.tally.tokens_done += entry.total_len
        self.left -= self.expected[entry.id]
        self.bar.total = self.tally.tokens_done + self.left
        self.bar.update(entry.total_len)
        if self.first:
            self.first = False
            rate = self.tally.tokens_done / max(time.time() - self.start, 1e-9)
            bound = "at most " if self.plan.source.kind == "local" else ""
            logger.info(f"first sample: {entry.total_len} tokens, {rate:.0f} tok/s ({self.plan.compute_dtype} "
                        f"compute); {bound}{self.left} tokens left, projected {bound}"
                        f"{_duration(self.left / max(rate, 1e-9))}")

    def close(self) -> None:
        self.bar.close()


def _completion_of(plan: Plan, target: Target, r: PromptRecord, completions: Completions,
                   tally: _Tally) -> tuple[list[int], str]:
    """The completion of one prompt and why it ended: generated here (``local``) or given."""
    if plan.source.kind != "local":
        return completions[r.id]["output_ids"], completions[r.id]["finish_reason"]
    from ..target import greedy_generate

    t = time.time()
    comp, reason = greedy_generate(target, plan.prompt_ids[r.id], plan.args.max_new_tokens, plan.stop_token_ids)
    tally.timings["generate_s"] += time.time() - t
    return comp, reason


def _compute_shards(plan: Plan, state: _State, target: Target, groups: list[int], completions: Completions,
                    tally: _Tally) -> None:
    """Prefill every sample of ``groups`` and write each group as one shard, recorded as it lands."""
    progress = _Progress(plan, [r for g in groups for r in plan.groups[g]], completions, tally)
    try:
        _compute_groups(plan, state, target, groups, completions, tally, progress)
    except KeyboardInterrupt:
        # The bar counts samples computed; a shard's samples are kept only once the shard is written.
        progress.close()
        written = sum(len(sh.samples) for sh in state.shards.values())
        logger.warning(f"interrupted: {written} sample(s) written in {len(state.shards)} shard(s) of {plan.out} "
                       "(samples computed since the last written shard are not kept); run the same command to resume")
        raise
    progress.close()


def _compute_groups(plan: Plan, state: _State, target: Target, groups: list[int], completions: Completions,
                    tally: _Tally, progress: _Progress) -> None:
    from ..target import DTYPES

    store_dtype = DTYPES[plan.args.dtype]
    for g in groups:
        name = shard_name(g)
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        for r in plan.groups[g]:
            if r.id not in plan.prompt_ids:  # a later turn: the turns before it are done (lower indices)
                _later_turn_prompts(plan, state, completions)
            comp, reason = _completion_of(plan, target, r, completions, tally)
            if plan.source.kind == "local" and plan.later_turns is not None:
                completions[r.id] = {"output_ids": comp}  # the answer a later turn is asked after
            t = time.time()
            ts, entry = compute_sample(target, r, plan.prompt_ids[r.id], comp, reason, plan.layer_ids,
                                       plan.args.topk_logprobs, name, store_dtype)
            tally.timings["prefill_s"] += time.time() - t
            if plan.source.kind != "local":
                entry.served_spec = served_counters(completions[r.id].get("served_spec"))
            tensors.update(ts)
            entries.append(entry)
            progress.done(entry)
        t = time.time()
        sha, size = save_safetensors(plan.out / name, tensors)
        tally.timings["write_s"] += time.time() - t
        tally.bytes_written += size
        shard = ShardEntry(file=name, sha256=sha, bytes=size, samples=[e.id for e in entries])
        state.shards[name] = shard
        state.samples.update({e.id: e for e in entries})
        append_progress(plan.out / PROGRESS_NAME, shard_record(shard, entries))


def _export_head(plan: Plan, state: _State, target: Target, tally: _Tally) -> None:
    """The target's embedding and head in the storage dtype, beside the shards, recorded as it lands."""
    from ..target import DTYPES, head_tensors

    tensors, tied = head_tensors(target, DTYPES[plan.args.dtype])
    sha, size = save_safetensors(plan.out / HEAD_NAME, tensors)
    tally.bytes_written += size
    embed = tensors["embed_tokens.weight"]
    state.head = {"file": HEAD_NAME, "sha256": sha, "bytes": size, "tied": tied,
                  "vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]),
                  "dtype": str(embed.dtype).removeprefix("torch.")}
    append_progress(plan.out / PROGRESS_NAME, {"target_head": state.head})


def _write_manifest(plan: Plan, state: _State, completions: Completions) -> Manifest:
    """The manifest of what the folder now holds, written last: its presence means "complete"."""
    out = plan.out
    if not plan.args.export_head:
        state.head = None
        (out / HEAD_NAME).unlink(missing_ok=True)
    manifest = build_manifest(plan.header, list(state.shards.values()), list(state.samples.values()), state.head)
    ids = [s.id for s in manifest.samples]
    if plan.source.served and all(i in completions for i in ids):
        # sorted once complete, so the journal too is deterministic
        write_in_order(out / JOURNAL_NAME, completions, ids)
    manifest.write(out)
    (out / PROGRESS_NAME).unlink(missing_ok=True)
    return manifest


def _summary(plan: Plan, manifest: Manifest, state: _State, computed: int, kept: int, tally: _Tally,
             wall: float) -> dict[str, Any]:
    """The run's figures: what ``precompute_log.json`` keeps and the command line prints."""
    ag, timings = manifest.agreement, tally.timings
    return {
        "out": str(plan.out),
        "samples": len(manifest.samples),
        "samples_computed": computed,
        "samples_kept": kept,
        "tokens": sum(s.total_len for s in manifest.samples),
        "tokens_computed": tally.tokens_done,
        "completion_tokens": ag["completion_tokens"],
        "token_agreement": ag["token_agreement"],
        "samples_fully_agreeing": ag["samples_fully_agreeing"],
        "compute_dtype": plan.compute_dtype,
        "device": plan.args.device,
        "dtype": plan.args.dtype,
        "bytes_written": tally.bytes_written,
        "cache_bytes": sum(s.bytes for s in manifest.shards) + (state.head or {}).get("bytes", 0),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tally.tokens_done / max(timings["prefill_s"] + timings["generate_s"], 1e-9), 1),
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "warnings": plan.warnings,
    }


def execute(plan: Plan) -> dict[str, Any]:
    """Compute what is missing in ``plan.out``, write the manifest; return the run summary."""
    from ..target import load_target

    a, out = plan.args, plan.out
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tally = _Tally()
    with folder_lock(out):
        state = _load_state(plan)
        todo_groups = [g for g in sorted(plan.groups) if shard_name(g) not in state.shards]
        todo = [r for g in todo_groups for r in plan.groups[g]]
        kept = sum(len(recs) for recs in plan.groups.values()) - len(todo)
        if kept:
            logger.info(f"resuming: {kept} sample(s) in {len(state.shards)} verified shard(s) kept, "
                        f"{len(todo)} to compute")
        need_head = a.export_head and state.head is None
        # The fingerprint goes down first: whatever this run leaves behind is tied to its arguments.
        start_progress(out / PROGRESS_NAME, plan.fingerprint, state.records())
        completions = _completions(plan, state, todo, tally)
        if a.completions_only:  # the prefill runs on another host, from the journal (--reference file)
            journal = out / JOURNAL_NAME
            ids = [r.id for g in sorted(plan.groups) for r in plan.groups[g]]
            if all(i in completions for i in ids):
                write_in_order(journal, completions, ids)  # in prompt order, as a finished cache's journal
            logger.info(f"completions of {len(completions)} prompt(s) journaled in {journal}; run the prefill on a "
                        f"host with the RAM: --reference file --completions {journal}")
            return {"out": str(out), "completions": len(completions), "journal": str(journal)}
        if todo or need_head:
            t = time.time()
            logger.info(f"loading {a.target} (compute {plan.compute_dtype}, storage {a.dtype}, on {a.device}) ...")
            target = load_target(a.target, plan.compute_dtype, plan.target, device=a.device)
            tally.timings["load_s"] = time.time() - t
            _compute_shards(plan, state, target, todo_groups, completions, tally)
            if need_head:
                _export_head(plan, state, target, tally)
            del target
        manifest = _write_manifest(plan, state, completions)
        summary = _summary(plan, manifest, state, len(todo), kept, tally, time.time() - t0)
        # the thread count is in the compute record (it shapes the dtype probe's figures too)
        atomic_write_json(out / LOG_NAME, {"summary": summary, "args": dataclasses.asdict(a),
                                           "compute": plan.compute.record(), "finished_unix": time.time()})
    logger.info(format_summary(summary))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    return (f"precompute done: {s['out']}: {s['samples']} samples ({s['samples_computed']} computed, "
            f"{s['samples_kept']} kept), {s['tokens']} tokens; agreement {100 * s['token_agreement']:.2f}% of "
            f"{s['completion_tokens']} completion tokens ({s['compute_dtype']} compute, {s['dtype']} storage), "
            f"{s['samples_fully_agreeing']}/{s['samples']} samples fully agree; "
            f"{s['bytes_written'] / 1e6:.1f} MB written (cache {s['cache_bytes'] / 1e6:.1f} MB); "
            f"wall {s['wall_s']:.1f} s ({s['tokens_per_s']:.0f} tok/s)")


def run_precompute(args: PrecomputeArgs, probe: DtypeProbe | None = None) -> dict[str, Any]:
    return execute(prepare(args, probe))
