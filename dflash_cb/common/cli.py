"""The command-line tools' shared edge: user errors become one line and exit code 2.

Every ``tools/*.py`` and every console command (``[project.scripts]``, made by ``command``) calls
``run(main)``. The package's own errors (``DFlashCBError``) and OS errors on user paths (an
unwritable ``--out``, a file where a folder is expected, a full disk) print ``error: <what, where>
(<fix>)`` on stderr, no traceback. Anything else is a bug in this package and keeps its traceback.
While a tool runs, the package's messages are shown (``common.log``: its output on stdout, library
notes and warnings, INFO and above, on stderr), one line each, as the message alone.

Ctrl-C is ``interrupted`` and exit code 130 from the first moment: a console command is a ``launcher``
that imports its tool (and torch, seconds of it) only once a start-up handler is on, which leaves at
once (nothing is written yet); Python's own handler would print a traceback from the middle of the
imports, and inside torch's C++ start-up a ``KeyboardInterrupt`` aborts the process (``what():
KeyboardInterrupt``, exit 134). From the tool's start on, Ctrl-C is the tool's ``KeyboardInterrupt``
(its writes are atomic, its resumable work resumes).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import log
from .errors import DFlashCBError

EXIT_USER_ERROR = 2

_OS_FIXES = {
    errno.ENOSPC: "free disk space or choose another folder, then rerun the same command",
    errno.EDQUOT: "free disk space or choose another folder, then rerun the same command",
    errno.EFBIG: "the file outgrew the size limit (ulimit -f) or the filesystem's largest file: raise the limit or "
                 "choose another folder, then rerun the same command",
    errno.EACCES: "choose a path you can write to, or fix its permissions",
    errno.EPERM: "choose a path you can write to, or fix its permissions",
    errno.EROFS: "the filesystem is read-only: choose another path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a file stands where a folder is expected: choose another path",
    errno.EISDIR: "a folder stands where a file is expected: choose another path",
    errno.EEXIST: "remove it or choose another path",
}


def describe_os_error(err: OSError) -> str:
    """``<path>: <reason> (<fix>)`` for an OS error, naming both paths of a failed rename."""
    where = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    reason = err.strerror or str(err)
    fix = _OS_FIXES.get(err.errno or -1)
    text = f"{where}: {reason}" if where else reason
    return f"{text} ({fix})" if fix else text


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
              line: str | None = None) -> None:
    """A Python warning in a tool: ``<Category>: <message>`` on stderr, without the package's source line that
    ``warnings`` prints beneath it (the message names the file and the fix; our code line says nothing)."""
    print(f"{category.__name__}: {message}", file=file if file is not None else sys.stderr)


@contextlib.contextmanager
def _messages_shown() -> Iterator[None]:
    """Show the package's messages for the duration (``log.ConsoleLines``: the tool's output on stdout, its
    notes and warnings on stderr, Python warnings one line each); once, however nested."""
    package = logging.getLogger(log.PACKAGE)
    level = package.level
    handler = log.install_console()
    shown = warnings.showwarning
    if handler is not None:
        warnings.showwarning = _one_line
    try:
        yield
    finally:
        if handler is not None:
            package.removeHandler(handler)
            package.setLevel(level)
            warnings.showwarning = shown


Main = Callable[[Sequence[str] | None], int | None]


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """A tool sets torch's thread count (``--threads``); run in another program's process (the demo runs the
    precompute, a test runs a tool), it leaves that program's count as it found it."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if before is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)


EXIT_INTERRUPTED = 130  # a shell's code for a command ended by SIGINT


def run(main: Main, argv: Sequence[str] | None = None, *, on_start: Callable[[], None] | None = None) -> int:
    """Call ``main(argv)``; turn user errors into one stderr line and exit code 2.

    Set ``DFLASH_CB_TRACEBACK=1`` to get the full traceback instead (for bug reports). ``on_start`` runs
    first, inside the same guard (``launch``: hands Ctrl-C back to Python's handler).
    """
    try:
        if on_start is not None:
            on_start()
        with _messages_shown(), _threads_kept():
            return int(main(argv) or 0)
    except (DFlashCBError, OSError) as e:
        if os.environ.get("DFLASH_CB_TRACEBACK"):
            raise
        text = describe_os_error(e) if isinstance(e, OSError) else str(e)
        print(f"error: {text}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def command(main: Main) -> Callable[[], int]:
    """A tool's command: ``run(main)`` on the command line's arguments (``entry.main`` is ``main``). Its
    console command (``[project.scripts]``) and ``tools/*.py`` script reach it through ``launch``."""

    def entry() -> int:
        return run(main)

    entry.__doc__ = main.__doc__
    entry.main = main  # type: ignore[attr-defined]
    return entry


# Imported under the start-up handler whether the tool imports it at once or later: a KeyboardInterrupt
# inside torch's C++ start-up aborts the process instead of raising.
_START_UP_MODULES = ("torch",)


def _leave(signum: int, frame: Any) -> None:
    """Ctrl-C while a tool starts: nothing is written yet, so leave at once, as an interrupted tool does."""
    try:
        print("interrupted", file=sys.stderr, flush=True)
    finally:
        os._exit(EXIT_INTERRUPTED)


def launch(module: str, name: str = "command") -> int:
    """Run the ``command`` object ``name`` of ``module``, imported (with ``_START_UP_MODULES``) while Ctrl-C
    leaves at once with ``interrupted`` and exit code 130; from the tool's start on, Ctrl-C is its
    ``KeyboardInterrupt`` (``run``)."""
    guarded = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _leave) if guarded else None

    def hand_back() -> None:
        if guarded:
            signal.signal(signal.SIGINT, previous if callable(previous) and previous is not _leave
                          else signal.default_int_handler)

    try:
        entry = getattr(importlib.import_module(module), name)
        for extra in _START_UP_MODULES:
            with contextlib.suppress(ImportError):
                importlib.import_module(extra)
    except BaseException:
        hand_back()
        raise
    return run(entry.main, on_start=hand_back)


def launcher(module: str, name: str = "command") -> Callable[[], int]:
    """A console command (``[project.scripts]``) that imports nothing heavy until called: ``launch(module,
    name)``. ``entry.target`` names the command it runs (``module:name``)."""

    def entry() -> int:
        return launch(module, name)

    entry.target = f"{module}:{name}"  # type: ignore[attr-defined]
    return entry
