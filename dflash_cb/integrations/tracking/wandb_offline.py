"""Read what an offline W&B run logged, without W&B's servers (``tools/wandb_panels.py --run <folder>``).

An offline run (``WandbLogger(offline=True)``, ``WANDB_MODE=offline``) keeps its records in
``<run folder>/run-<id>.wandb``: a LevelDB-style log of 32 KiB blocks, each record behind a
7-byte header (crc32, length, kind: full, first, middle or last fragment; 0 is block padding),
whose payloads are ``wandb_internal_pb2.Record`` messages. The crc32 covers the kind byte and the
fragment (zlib's CRC-32, the one the W&B writer computes), so a flipped bit anywhere in a record is
caught and named, never read as other values. Only the history, summary and config keys (and values) are
decoded here, from protobuf's wire format by their field numbers, without importing wandb (whose import alone
takes a second or more): enough to show a run and check a panel layout against it. ``offline_records`` gives
every record as wandb's own messages.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

from ...common.errors import DFlashCBError

_BLOCK = 32768
_HEADER = 7
_MAGIC = b":W&B"


class OfflineRunError(DFlashCBError, ValueError):
    """A folder that is not a readable offline W&B run."""


def run_file(run_dir: str | os.PathLike) -> Path:
    """The ``run-*.wandb`` log of an offline run folder (or the file itself)."""
    p = Path(run_dir)
    found = [p] if p.is_file() else sorted(p.glob("run-*.wandb")) if p.is_dir() else []
    if not found:
        raise OfflineRunError(f"{p}: no run-*.wandb file; give an offline run folder such as "
                              "wandb/offline-run-<date>-<id> (written with WANDB_MODE=offline)")
    if len(found) > 1:  # one run writes one log: which one is meant is for the user to say
        raise OfflineRunError(f"{p}: {len(found)} run logs ({', '.join(f.name for f in found)}); give the one to "
                              f"read, e.g. --run {found[0]}")
    return found[0]


def _frames(run_dir: str | os.PathLike) -> tuple[Path, list[tuple[int, bytes]]]:
    """(the log's path, [(byte offset, payload)] of every complete record): the LevelDB layer, checksums checked."""
    path = run_file(run_dir)
    data = path.read_bytes()
    if data[:4] != _MAGIC:
        raise OfflineRunError(f"{path}: not a W&B run log (it does not start with {_MAGIC!r})")

    def damaged(at: int, what: str) -> OfflineRunError:
        return OfflineRunError(f"{path}: damaged at byte {at} ({what}): the file is not as W&B wrote it; copy the "
                               "run folder again from where the run wrote it")

    pos, out, buf, start = _HEADER, [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a header never straddles blocks: the rest of the block is padding
            pos += left
            continue
        at = pos
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0:
            pos += left - _HEADER
            continue
        if kind > 4 or n > left - _HEADER:
            raise damaged(at, f"a record header of kind {kind}, {n} bytes, in a block with {left - _HEADER} left")
        if pos + n > len(data):
            break  # the record the writer is busy with
        chunk, pos = data[pos:pos + n], pos + n
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise damaged(at, "a record's checksum does not match its bytes")
        if kind in (1, 2):
            start = at
        if kind == 1:
            out.append((start, chunk))
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append((start, buf + chunk))
            buf = b""
    return path, out


def _not_a_record(path: Path, at: int, why: str) -> OfflineRunError:
    return OfflineRunError(f"{path}: the record at byte {at} is not a W&B record ({why}); read the run with the "
                           "wandb version that wrote it")


def offline_records(run_dir: str | os.PathLike) -> list[Any]:
    """Every complete record of the run's log as wandb's ``Record`` messages (a record the writer is still busy with
    is left out). Imports wandb (a second or more); the history, summary and config readers below do not."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    path, frames = _frames(run_dir)
    records = []
    for at, raw in frames:
        try:
            records.append(pb.Record.FromString(raw))
        except DecodeError as e:
            raise _not_a_record(path, at, str(e)) from None
    return records


# -- the few fields the readers below need, read from protobuf's wire format -------------------------------
# Field numbers of wandb_internal.proto (tests/integrations/test_panels.py checks them against wandb's own descriptors):
# Record.history 2, .summary 3, .config 5, .run 17; HistoryRecord.item 1; SummaryRecord.update 1;
# ConfigRecord.update 1; RunRecord.config 4; each item's key 1, nested_key 2, value_json 16.
RECORD_HISTORY, RECORD_SUMMARY, RECORD_CONFIG, RECORD_RUN = 2, 3, 5, 17
ITEMS, RUN_CONFIG = 1, 4
ITEM_KEY, ITEM_NESTED_KEY, ITEM_VALUE_JSON = 1, 2, 16


class _WireError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _WireError(f"a varint runs past its message at byte {pos}")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, bytes | None]]:
    """(field number, bytes of a length-delimited field, else None) of every field of one message."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value = None
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            pos += 4
        else:
            raise _WireError(f"wire type {wire} of field {number}")
        if number == 0 or pos > len(buf):
            raise _WireError(f"field {number} runs past its message" if number else "field number 0")
        out.append((number, value))
    return out


def _items(message: bytes, field: int) -> dict[str, Any]:
    """``{key: value}`` of the repeated ``field`` of ``message`` (history, summary and config items)."""
    out = {}
    for number, item in _fields(message):
        if number != field or item is None:
            continue
        key, nested, value = "", [], ""
        for n, v in _fields(item):
            if v is None:
                continue
            if n == ITEM_KEY:
                key = v.decode()
            elif n == ITEM_NESTED_KEY:
                nested.append(v.decode())
            elif n == ITEM_VALUE_JSON:
                value = v.decode()
        out[key or "/".join(nested)] = json.loads(value)
    return out


def _read(run_dir: str | os.PathLike, read: Any) -> list[Any]:
    """``read(field number, bytes)`` of each length-delimited top-level field of every record of the run's log (the
    answers that are not None), without wandb; a record that is no protobuf message is named by its offset."""
    path, frames = _frames(run_dir)
    out = []
    for at, raw in frames:
        try:
            for number, value in _fields(raw):
                if value is not None and (got := read(number, value)) is not None:
                    out.append(got)
        except (_WireError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _not_a_record(path, at, str(e)) from None
    return out


def offline_history(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(history rows, summary) of an offline run: ``{key: value}`` per logged step, and the summary."""
    def read(number: int, value: bytes) -> tuple[int, dict[str, Any]] | None:
        return (number, _items(value, ITEMS)) if number in (RECORD_HISTORY, RECORD_SUMMARY) else None

    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for number, items in _read(run_dir, read):
        if number == RECORD_HISTORY:
            rows.append(items)
        else:
            summary.update(items)
    return rows, summary


def offline_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's configuration (``wandb.init(config=...)`` and later ``Run.config.update``), as logged."""
    def read(number: int, value: bytes) -> list[bytes] | None:
        if number == RECORD_RUN:
            return [v for n, v in _fields(value) if n == RUN_CONFIG and v is not None]
        return [value] if number == RECORD_CONFIG else None

    config: dict[str, Any] = {}
    for parts in _read(run_dir, read):
        for part in parts:
            config.update({k: v for k, v in _items(part, ITEMS).items() if k != "_wandb"})
    return config


def run_parts(run_dir: str | os.PathLike) -> list[Path]:
    """The folders of one offline run in the order they were written: a run resumed offline (the same id) writes
    a new ``offline-run-<date>_<time>-<id>`` folder beside the first (``...-<id>-1`` when in the same second),
    holding only its new steps."""
    run_dir = Path(run_dir)
    m = _PART.fullmatch(run_dir.name)
    if m is None:
        return [run_dir]
    base = m.group("id")

    def key(p: Path) -> tuple[str, int] | None:
        k = _PART.fullmatch(p.name)
        if k is None or not p.is_dir() or k.group("id") != base:
            return None
        return k.group("time"), int(k.group("n") or 0)

    parts = sorted((k, p) for p in run_dir.parent.glob("offline-run-*") if (k := key(p)) is not None)
    mine = key(run_dir)
    return [p for k, p in parts if mine is None or k <= mine] or [run_dir]


# ``offline-run-<date>_<time>-<id>``, and ``-<n>`` after it for a second folder created in the same second.
_PART = re.compile(r"offline-run-(?P<time>\d{8}_\d{6})-(?P<id>.+?)(?:-(?P<n>\d+))?")


def offline_run_history(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``offline_history`` of every part of a resumed offline run up to ``run_dir``: its whole curve."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for part in run_parts(run_dir):
        r, s = offline_history(part)
        rows += r
        summary.update(s)
    return rows, summary
