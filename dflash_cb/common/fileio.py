"""Atomic file writes, the one implementation for the whole package.

Every writer goes through a temporary file in the destination's folder, fsync, then ``os.replace``:
a reader (or a crash) sees the old file or the new one, never half of one. Files get the mode the
umask allows (``mkstemp`` alone would leave them 0600, but caches and drafters are meant to be
shared and copied).

A failed write (a full disk, ``ulimit -f``, safetensors' own error type) is an ``OSError`` naming
the destination, so every tool can say ``error: <file>: <reason>``. An output named through a
symbolic link is written *through* it (``output_path``): the link stays and its target receives the
file, as a shell's ``>`` does; a dangling link's target is created.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import DFlashCBError


def _umask_mode(base: int = 0o666) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def output_path(path: str | os.PathLike) -> Path:
    """Where an output named ``path`` is written: through symbolic links (the whole chain, a dangling
    one included), so that a link such as ``latest.json -> runs/a.json`` keeps pointing at the new file."""
    path = Path(path)
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def _os_code(err: BaseException) -> int | None:
    """The errno inside safetensors' error type (``... (os error 28)``), which is not an ``OSError``: for
    writes by other libraries (transformers' ``save_pretrained``); this package's own safetensors files
    are written by ``tensorfile``, whose failures are real ``OSError``s."""
    if type(err).__name__ != "SafetensorError":
        return None
    m = re.search(r"os error (\d+)", str(err))
    return int(m[1]) if m else None


@contextlib.contextmanager
def naming_failures(path: str | os.PathLike, temp: str | None = None, only_temp: bool = False) -> Iterator[None]:
    """Re-raise a failed write inside the block as an ``OSError`` naming ``path``.

    ``f.write`` and ``fsync`` on a full disk (or past ``ulimit -f``) raise an ``OSError`` without a
    file name, and safetensors wraps the OS error in its own type: either way the user would read
    ``No space left on device`` without learning which file. ``temp``: the path prefix of this write's
    temporary files (``<folder>/.<name>.``, a staging folder), internal names the user is never shown;
    with ``only_temp``, only errors naming such a file are renamed.
    """
    try:
        yield
    except OSError as e:
        def ours(name: Any) -> bool:
            return name is not None and temp is not None and os.fspath(name).startswith(temp)

        if ours(e.filename2):  # a copy or rename into a temporary file: name its source and ``path``
            raise OSError(e.errno, e.strerror or str(e), e.filename, None, os.fspath(path)) from e
        if not ours(e.filename) and (e.filename is not None or only_temp):
            raise
        raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e
    except Exception as e:
        code = None if only_temp else _os_code(e)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), os.fspath(path)) from e


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsynced and renamed onto ``path``.

    For writers that want a file name (``safetensors.torch.save_file``) rather than bytes. On any
    exception the temporary file is removed and ``path`` is left as it was; a failed write is an
    ``OSError`` naming ``path`` (``naming_failures``). A symbolic link is written through (``output_path``).
    """
    with atomic_paths(path) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """``atomic_path`` for outputs that belong together (a report and the plot it embeds): after the
    block every one is renamed into place, or none is.

    A rename that fails after others succeeded gives the files already replaced their previous
    content back (kept as hard links, or copies, until the last rename). A failed write in the block
    names its file when the error carries the temporary name; wrap each write in
    ``naming_failures(path)`` where it cannot (a bare ``write``'s error has no name).
    """
    shown = [os.fspath(p) for p in paths]
    real = [output_path(p) for p in paths]
    tmps: list[Path] = []
    try:
        for name, dest in zip(shown, real, strict=True):
            with naming_failures(name, _temp_prefix(dest)):
                fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_temp_prefix(dest).rsplit(os.sep, 1)[-1],
                                           suffix=".tmp")
                os.close(fd)
            tmps.append(Path(tmp))
        with contextlib.ExitStack() as names:
            if len(paths) == 1:  # a bare write's error can only be about this one file
                names.enter_context(naming_failures(shown[0], _temp_prefix(real[0])))
            else:
                for name, dest in zip(shown, real, strict=True):
                    names.enter_context(naming_failures(name, _temp_prefix(dest), only_temp=True))
            yield tmps
            for tmp in tmps:
                os.chmod(tmp, _umask_mode())
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            _replace_together(list(zip(tmps, real, strict=True)))
    finally:
        for tmp in tmps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _temp_prefix(dest: Path) -> str:
    return str(dest.parent / f".{dest.name}.")


def _replace_together(pairs: list[tuple[Path, Path]]) -> None:
    """``os.replace`` each ``(tmp, dest)``; if one fails, undo those done (see ``atomic_paths``)."""
    if len(pairs) == 1:
        os.replace(*pairs[0])
        return
    backups: list[Path | None] = []
    try:
        for _, dest in pairs:
            backups.append(_keep_copy(dest) if dest.is_file() else None)
        done = 0
        try:
            for tmp, dest in pairs:
                os.replace(tmp, dest)
                done += 1
        except BaseException:
            for (_, dest), backup in list(zip(pairs, backups, strict=False))[:done]:
                if backup is None:
                    dest.unlink()
                else:
                    os.replace(backup, dest)
            raise
    finally:
        for backup in backups:
            if backup is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(backup)


def _keep_copy(dest: Path) -> Path:
    """A second name for ``dest``'s current content, next to it: a hard link, or a copy where links fail."""
    with naming_failures(dest, _temp_prefix(dest)):
        fd, keep = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".old")
        os.close(fd)
        os.unlink(keep)
        try:
            os.link(dest, keep)
        except OSError:  # a filesystem without hard links
            shutil.copy2(dest, keep)
    return Path(keep)


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
    with naming_failures(path), open(path, "a", encoding="utf-8") as f:
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
                        folders: Iterable[PathArg] = (), models: Iterable[PathArg] = ()) -> None:
    """Refuse, before any work, an output that would write over something the same run reads.

    Each argument is ``(option name, path)``; ``None`` paths are ignored. Paths are compared
    resolved (``realpath``: symbolic links, ``..`` and relative paths all followed). An output
    *file* is refused when it is an input, or an existing file inside an input folder (a cache's
    manifest or shard, a drafter's weights). An output *folder* (created, filled or replaced by the
    run) is refused when it is an input or contains one. ``models``: input folders (a target's, a drafter's)
    that no output file may land in at all, not even a new one: a stray file in a model folder is read by the
    next loader (an index, a config) or shipped with the weights.
    """
    models = [(name, p) for name, p in models if p is not None]
    ins = [(name, _real(p)) for name, p in [*inputs, *models] if p is not None]
    for name, p in files:
        if p is None:
            continue
        out = _real(p)
        for in_name, src in ((n, _real(m)) for n, m in models):
            if _inside(out, src) and out != src and os.path.isdir(src):
                raise OverwritesInputError(f"{name} {p}: is inside {in_name} {src}, a model folder this run "
                                           f"reads; write {name} outside it")
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
