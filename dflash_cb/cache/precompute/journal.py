"""The completions journal (``reference_completions.jsonl``): one JSON object per line, appended as each arrives.

A line is ``{"id", "request_sha256", "output_ids", "finish_reason", ...}``; more keys may be added
(readers keep unknown keys). ``request_sha256`` hashes what determines the completion: the prompt's
token ids, the sampling parameters (max_new_tokens and stop ids among them) and the served model. A
rerun uses only the entries whose hash matches its own request, so a journal left by a run with other
arguments is never silently reused. The file is also a valid ``--completions`` file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...common.fileio import append_line_durably, atomic_write_text
from ..target import canonical_sha256

_SERVED_MODEL_KEYS = ("model_path", "served_model_name", "tokenizer_path")


def request_key(prompt_ids: Sequence[int], sampling_params: dict[str, Any] | None,
                served_model: dict[str, Any] | None) -> str:
    """sha256 of what determines a served greedy completion (``target.canonical_sha256``)."""
    served = {k: served_model[k] for k in _SERVED_MODEL_KEYS if k in (served_model or {})}
    data = {"input_ids": [int(t) for t in prompt_ids], "sampling_params": sampling_params, "served_model": served}
    return canonical_sha256(data)


def journal_entry(sid: str, key: str, output_ids: Sequence[int], finish_reason: str,
                  served_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    entry = {"id": sid, "request_sha256": key, "output_ids": [int(t) for t in output_ids],
             "finish_reason": str(finish_reason)}
    if served_spec:  # the server's speculative counters (dflash_cb/cache/served.py), kept across a resume
        entry["served_spec"] = served_spec
    return entry


def journal_line(entry: dict[str, Any]) -> str:
    """One compact JSON line: the format of this journal and of progress.jsonl."""
    return json.dumps(entry, separators=(",", ":")) + "\n"


def token_ids_ok(ids: Any, vocab: int | None) -> bool:
    """``ids`` is a list of token ids in ``[0, vocab)`` (any non-negative int without ``vocab``)."""
    return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                         and (vocab is None or t < vocab) for t in ids)


def _valid(obj: Any, vocab: int | None) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(obj.get("finish_reason"), str):
        return False
    return token_ids_ok(obj.get("output_ids"), vocab)


def parse_complete_lines(data: bytes) -> tuple[list[Any], int]:
    """The JSON values of the newline-terminated lines of an append-only record, and how many lines
    were not JSON. A last piece without its newline was cut by a crash: it is skipped, not counted."""
    objs, bad = [], 0
    for line in data.split(b"\n")[:-1]:
        try:
            objs.append(json.loads(line))
        except ValueError:
            bad += 1
    return objs, bad


def read_journal(path: Path, keys: dict[str, str] | None = None,
                 vocab: int | None = None) -> tuple[dict[str, dict[str, Any]], int]:
    """Entries by id, and how many lines were ignored.

    Ignored: a last line cut by a crash (no newline), lines that are not valid entries (token ids
    outside ``[0, vocab)`` among them) and, when ``keys`` is given, entries whose ``request_sha256``
    is not ``keys[id]`` (made with other arguments). A later line for an id replaces an earlier one.
    """
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done, 0
    objs, ignored = parse_complete_lines(path.read_bytes())
    for obj in objs:
        if not _valid(obj, vocab) or (keys is not None and obj.get("request_sha256") != keys.get(obj["id"])):
            ignored += 1
            continue
        done[obj["id"]] = obj
    return done, ignored


def drop_torn_tail(path: Path) -> None:
    """Cut a last line left without its newline by a crash, so the next append starts a fresh line."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos = size
        while pos > 0:  # scan back in blocks for the last newline
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            block = f.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                f.truncate(pos - step + nl + 1)
                return
            pos -= step
        f.truncate(0)


def append_entry(path: Path, entry: dict[str, Any]) -> None:
    append_line_durably(path, journal_line(entry))


def write_in_order(path: Path, entries: dict[str, dict[str, Any]], ids: Sequence[str]) -> None:
    """Rewrite the journal atomically, one line per id in ``ids`` order: a complete cache's journal
    is then a function of the arguments, like its manifest (a single run and merged parts agree)."""
    atomic_write_text(path, "".join(journal_line(entries[i]) for i in ids))
