"""Read what an offline W&B run logged, without W&B's servers (``tools/wandb_panels.py --run <folder>``).

An offline run (``WandbLogger(offline=True)``, ``WANDB_MODE=offline``) keeps its records in
``<run folder>/run-<id>.wandb``: a LevelDB-style log of 32 KiB blocks, each record behind a
7-byte header (crc32, length, kind: full, first, middle or last fragment; 0 is block padding),
whose payloads are ``wandb_internal_pb2.Record`` messages. Only the history and summary keys
(and values) are decoded here: enough to check a panel layout against the run.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from ..common.errors import DFlashCBError

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
    return found[0]


def offline_records(run_dir: str | os.PathLike) -> list[Any]:
    """Every complete record of the run's log (a record the writer is still busy with is left out)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = run_file(run_dir)
    data = path.read_bytes()
    if data[:4] != _MAGIC:
        raise OfflineRunError(f"{path}: not a W&B run log (it does not start with {_MAGIC!r})")
    pos, out, buf = _HEADER, [], b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a header never straddles blocks: the rest of the block is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0:
            pos += left - _HEADER
            continue
        if pos + n > len(data):
            break
        chunk, pos = data[pos:pos + n], pos + n
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
            buf = b""
    return [pb.Record.FromString(r) for r in out]


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
    """The run's configuration (``wandb.init(config=...)`` and later ``run.config.update``), as logged."""
    config: dict[str, Any] = {}
    for r in offline_records(run_dir):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for i in items:
            key = i.key or "/".join(i.nested_key)
            if key != "_wandb":
                config[key] = json.loads(i.value_json)
    return config
