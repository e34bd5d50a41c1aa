"""Crash tests: SIGKILL a real tool process at a chosen moment."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def sigkill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, poll_s: float = 0.005) -> None:
    """Poll ``ready()`` until it holds, then SIGKILL ``proc``; fail if the process ended first.

    ``poll_s=0`` spins: for a moment that lasts only milliseconds (a file being copied)."""
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if ready():
                break
            time.sleep(poll_s)
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
