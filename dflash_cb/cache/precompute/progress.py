"""The resume record ``progress.jsonl``: appended once per finished shard, so its cost stays O(1).

Line 1 is ``{"fingerprint": ...}`` (the arguments the run was made with), then one
``{"shard": ShardEntry, "samples": [SampleEntry, ...]}`` per finished shard and
``{"target_head": {...}}`` once the head is exported. A crash can leave a last line without its
newline: it is ignored (that shard is then recomputed). The manifest replaces this file at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...common.fileio import append_line_durably, atomic_write_text
from ..manifest import SampleEntry, ShardEntry
from .errors import PrecomputeError
from .journal import journal_line as _line
from .journal import parse_complete_lines


def shard_record(shard: ShardEntry, samples: Iterable[SampleEntry]) -> dict[str, Any]:
    return {"shard": dataclasses.asdict(shard), "samples": [dataclasses.asdict(s) for s in samples]}


def start_progress(path: Path, fingerprint: dict[str, Any], kept: Iterable[dict[str, Any]]) -> None:
    """Write the record afresh (atomically): the fingerprint, then what an earlier run left intact."""
    atomic_write_text(path, "".join(_line(r) for r in [{"fingerprint": fingerprint}, *kept]))


def append_progress(path: Path, record: dict[str, Any]) -> None:
    append_line_durably(path, _line(record))


def _lines(path: Path) -> list[Any]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PrecomputeError(f"{path}: unreadable ({e}); delete it or pass --overwrite") from e
    return parse_complete_lines(data)[0]


def read_progress_fingerprint(path: Path) -> dict[str, Any]:
    lines = _lines(path)
    if not lines or not isinstance(lines[0], dict) or "fingerprint" not in lines[0]:
        raise PrecomputeError(f"{path}: no arguments fingerprint on its first line; delete it or pass --overwrite")
    return lines[0]["fingerprint"]


def read_progress(path: Path) -> tuple[list[ShardEntry], list[SampleEntry], dict[str, Any] | None]:
    """Shards, samples and head recorded by an earlier run (unverified: the caller checks the files)."""
    shards: list[ShardEntry] = []
    samples: list[SampleEntry] = []
    head = None
    for rec in _lines(path)[1:]:
        try:
            if "shard" in rec:
                shard, entries = ShardEntry(**rec["shard"]), [SampleEntry(**s) for s in rec["samples"]]
                shards.append(shard)
                samples.extend(entries)
            elif "target_head" in rec:
                head = rec["target_head"]
        except (TypeError, KeyError):
            continue  # a damaged record: its shard is recomputed
    return shards, samples, head
