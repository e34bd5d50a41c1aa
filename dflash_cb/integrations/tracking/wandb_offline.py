"""Read what an offline W&B run logged, without W&B's servers (``tools/wandb_panels.py --run <folder>``).

An offline run (``WandbLogger(offline=True)``, ``WANDB_MODE=offline``) keeps its records in
``<run folder>/run-<id>.wandb``: a LevelDB-style log of 32 KiB blocks, each record behind a
7-byte header (crc32, length, kind: full, first, middle or last fragment; 0 is block padding),
whose payloads are ``wandb_internal_pb2.Record`` messages. The crc32 covers the kind byte and the
fragment (zlib's CRC-32, the one the W&B writer computes), so a flipped bit anywhere in a record is
caught and named, never read as other values. Only the history and summary keys (and values) are
decoded here: enough to check a panel layout against the run.
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


def offline_records(run_dir: str | os.PathLike) -> list[Any]:
    """Every complete record of the run's log (a record the writer is still busy with is left out)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

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
    records = []
    for at, raw in out:
        try:
            records.append(pb.Record.FromString(raw))
        except DecodeError as e:
            import wandb

            raise OfflineRunError(f"{path}: the record at byte {at} is not a W&B record wandb {wandb.__version__} "
                                  f"reads ({e}); read the run with the wandb version that wrote it") from None
    return records


def offline_history(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(history rows, summary) of an offline run: ``{key: value}`` per logged step, and the summary."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for r in offline_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.summary.update})
    return rows, summary


def offline_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's configuration (``wandb.init(config=...)`` and later ``Run.config.update``), as logged."""
    config: dict[str, Any] = {}
    for r in offline_records(run_dir):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for i in items:
            key = i.key or "/".join(i.nested_key)
            if key != "_wandb":
                config[key] = json.loads(i.value_json)
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
