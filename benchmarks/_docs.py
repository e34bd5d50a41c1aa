"""Tables in the docs are written by the script that measures them (``--update-docs``), never by hand.

A page marks a table's place with ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; the script replaces
what is between with the command that produced it, the machine it ran on and the table.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def machine() -> str:
    """The machine a figure was measured on, as the docs describe it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        model = found.group(1).strip() if found else model
        found = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        flags = set(found.group(1).split()) if found else set()
    except OSError:
        pass
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "no AVX2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cores} CPU cores of an {model} ({isa}){gpu}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"


def command() -> str:
    """How the running script was started, for a reader to run it again."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    argv = [a for a in sys.argv[1:] if a != "--update-docs"]
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, argv)])


def update_docs_table(page: str, name: str, table: str, note: str = "") -> None:
    """Replace the marked table ``name`` of ``docs/<page>`` with ``table``, the command and the machine."""
    path = DOCS / page
    text = path.read_text()
    start, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path}: no {start} ... {end} markers; add them where the table goes")
    block = f"{start}\nMeasured with `{command()}` on {machine()}{note}:\n\n{table.strip()}\n{end}"
    new = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(new)
    os.replace(f.name, path)
    print(f"updated {path} ({name})")


@contextlib.contextmanager
def report_to_docs(enabled: bool, page: str, name: str) -> Iterator[None]:
    """Print as usual; with ``enabled``, also put everything printed inside as the marked block of the page
    (a script's plain-text report, verbatim)."""
    if not enabled:
        yield
        return
    buffer = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            sys.__stdout__.write(text)
            return buffer.write(text)

    with contextlib.redirect_stdout(Tee()):
        yield
    update_docs_table(page, name, "```text\n" + buffer.getvalue().strip("\n") + "\n```")


__all__ = ["command", "machine", "report_to_docs", "update_docs_table"]
