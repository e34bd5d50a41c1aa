"""Real processes for tests: SIGKILL a tool at a chosen moment; launch a script as torch.distributed ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


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


def run_ranks(script: str, args: Sequence[str], log_dir: Path, world: int = 2, timeout: float = 600,
              env: dict[str, str] | None = None) -> None:
    """Run ``python script *args`` as ``world`` torch.distributed ranks on 127.0.0.1 (RANK/WORLD_SIZE set);
    fail with the rank's log tail if one exits non-zero.

    The rendezvous store lives in this process, as torchrun's agent holds it, for as long as any rank runs:
    its port is the one the OS bound for it (never a free port looked up and then raced for), and rank zero
    ending first cannot take the store from a rank still tearing its process group down (a rank then
    aborted: "terminate called without an active exception")."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    procs, logs = [], []
    try:
        for rank in range(world):
            # The rank script (a test file run as __main__) imports the tests' helpers, which live here.
            path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), (env or {}).get("PYTHONPATH"),
                                               os.environ.get("PYTHONPATH")) if p)
            rank_env = {**os.environ, **(env or {}), "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(world), "RANK": str(rank),
                        "LOCAL_RANK": str(rank), "NODE_RANK": "0", "PYTHONWARNINGS": "ignore"}
            # Output to files, not pipes: a rank blocked on a full pipe would stall the other in a collective.
            logs.append(log_dir / f"rank{rank}.log")
            with open(logs[-1], "w") as f:
                procs.append(subprocess.Popen([sys.executable, script, *args], env=rank_env, stdout=f,
                                              stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log.read_text()[-6000:]}"
