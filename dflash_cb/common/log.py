"""The package's one output channel: ``logging``, with rank-zero helpers.

Every library message goes through ``logging.getLogger(__name__)`` of its module. Two kinds:

- what a user reads as the output of the live evaluation or of a tool (the per-evaluation console line, a
  tool's summary): the ``CONSOLE`` logger, shown on stdout;
- everything else (progress notes, warnings of a tool): the module's own logger, shown on stderr.

``ConsoleLines`` is the one handler that shows both, each record as its message alone, on the
``sys.stdout`` / ``sys.stderr`` of the moment (a test or a tool may swap them). Tools install it for their
run (``common.cli.run``); a library user gets it the first time the live evaluator speaks, unless the
program configured logging itself (a handler on the root logger), as Lightning does for its own logger.

Warnings a user should act on inside a training loop (a new series, a failed evaluation) stay Python
warnings (``warnings.warn``: filterable, and what Lightning's ``rank_zero_warn`` does), issued on rank zero
unless each rank has its own to say (``warn(..., every_rank=True)``).
"""

from __future__ import annotations

import logging
import sys
import warnings

PACKAGE = __name__.split(".")[0]
CONSOLE = f"{PACKAGE}.console"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def rank() -> int:
    """This process's rank under ``torch.distributed`` (0 without a process group)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _root_prints() -> bool:
    """Whether the program's root logger shows records on a console itself (``logging.basicConfig``)."""
    consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    return any(isinstance(h, logging.StreamHandler) and id(getattr(h, "stream", None)) in consoles
               for h in logging.getLogger().handlers)


class ConsoleLines(logging.Handler):
    """Records as their message alone: the console logger's below WARNING on stdout, the rest on stderr.

    Records still propagate (a program's own handlers, ``caplog``, log collectors see them); when the root
    logger already prints to a console, this handler stays quiet, so a line is shown once. A closed pipe on
    stdout (``tool | head``) is raised to the caller, not printed as a logging error: the tool then says
    what it had already written."""

    def emit(self, record: logging.LogRecord) -> None:
        if _root_prints():
            return
        if record.name.startswith(CONSOLE) and self not in logging.getLogger(CONSOLE).handlers and _ensured():
            return  # the console logger's own handler shows it
        to_stdout = record.name.startswith(CONSOLE) and record.levelno < logging.WARNING
        stream = sys.stdout if to_stdout else sys.stderr
        try:
            print(self.format(record), file=stream, flush=True)
        except BrokenPipeError:
            raise
        except Exception:  # as logging's own handlers do: a failed message never stops the program
            self.handleError(record)


def console_installed() -> bool:
    return any(isinstance(h, ConsoleLines) for h in logging.getLogger(PACKAGE).handlers)


def install_console(level: int = logging.INFO) -> ConsoleLines | None:
    """Show the package's messages with ``ConsoleLines``; returns the handler it added (None when one is
    there already). The package logger's level is set to ``level`` unless the program chose one."""
    package = logging.getLogger(PACKAGE)
    if console_installed():
        return None
    handler = ConsoleLines()
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(level)
    return handler


def _ensured() -> bool:
    return any(isinstance(h, ConsoleLines) for h in logging.getLogger(CONSOLE).handlers)


def ensure_console() -> None:
    """For a library user (the live evaluator calls it before it speaks): the console lines are shown as
    ``print`` would show them, the package's other messages stay quiet (INFO), unless the program configured
    the console logger itself."""
    console = logging.getLogger(CONSOLE)
    if not console.handlers:
        console.addHandler(ConsoleLines())
        if console.level == logging.NOTSET:
            console.setLevel(logging.INFO)


def say(text: str) -> None:
    """A line of the program's output (the console logger, INFO), on rank zero."""
    if rank() == 0:
        logging.getLogger(CONSOLE).info(text)


def warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2,
         every_rank: bool = False) -> None:
    """A Python warning on rank zero (every rank with ``every_rank``: each has its own to say)."""
    if every_rank or rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
