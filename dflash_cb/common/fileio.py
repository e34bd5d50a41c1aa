"""Atomic file writes, the one implementation for the whole package.

Every writer goes through a temporary file in the destination's folder, fsync, then ``os.replace``:
a reader (or a crash) sees the old file or the new one, never half of one. Files get the mode the
umask allows (``mkstemp`` alone would leave them 0600, but caches and drafters are meant to be
shared and copied).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import DFlashCBError


def _umask_mode(base: int = 0o666) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsynced and renamed onto ``path``.

    For writers that want a file name (``safetensors.torch.save_file``) rather than bytes. On any
    exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _umask_mode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int | None = 1) -> None:
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n")


def append_line_durably(path: str | os.PathLike, line: str) -> None:
    """Append one ``\\n``-terminated line and fsync: a crash keeps every line appended before it.

    A crash mid-append can leave a partial last line without its newline; readers of such
    journals must ignore a last line that does not end in ``\\n``.
    """
    if not line.endswith("\n"):
        line += "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


class OverwritesInputError(DFlashCBError):
    """An output of a run would be written over (or would replace) a file the same run reads."""


PathArg = tuple[str, "str | os.PathLike | None"]


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_outputs_apart(inputs: Iterable[PathArg], files: Iterable[PathArg] = (),
                        folders: Iterable[PathArg] = ()) -> None:
    """Refuse, before any work, an output that would write over something the same run reads.

    Each argument is ``(option name, path)``; ``None`` paths are ignored. Paths are compared
    resolved (``realpath``: symbolic links, ``..`` and relative paths all followed). An output
    *file* is refused when it is an input, or an existing file inside an input folder (a cache's
    manifest or shard, a drafter's weights). An output *folder* (created, filled or replaced by the
    run) is refused when it is an input or contains one.
    """
    ins = [(name, _real(p)) for name, p in inputs if p is not None]
    for name, p in files:
        if p is None:
            continue
        out = _real(p)
        for in_name, src in ins:
            if out == src or (_inside(out, src) and os.path.isdir(src) and os.path.lexists(out)):
                where = in_name if out == src else f"a file of {in_name} {src}"
                raise OverwritesInputError(f"{name} {p}: is {where}, an input of this run, and would be "
                                           f"overwritten; write {name} somewhere else")
    for name, p in folders:
        if p is None:
            continue
        out = _real(p)
        for in_name, src in ins:
            if _inside(src, out):
                what = "is" if out == src else "contains"
                raise OverwritesInputError(f"{name} {p}: {what} {in_name} {src}, an input of this run; choose an "
                                           f"{name} folder apart from the inputs")
