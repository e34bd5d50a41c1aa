"""Crash and resume: a real tools/precompute_states.py process killed with SIGKILL mid-run, then rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tiny_target import random_prompts, save_tiny_qwen3, write_prompts

from dflash_cb.precompute import PROGRESS_NAME, main
from dflash_cb.states import MANIFEST_NAME, StateCache

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "precompute_states.py"


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    target = save_tiny_qwen3(tmp_path / "target")
    # enough prompts that the kill lands mid-run
    prompts = write_prompts(tmp_path / "prompts.jsonl", random_prompts(40, (8, 40), seed=7))
    common = ["--target", str(target), "--prompts", str(prompts), "--layers", "0,1,3", "--max-new-tokens", "24",
              "--dtype", "float32", "--topk-logprobs", "3", "--no-progress"]

    reference = tmp_path / "uninterrupted"
    assert main([*common, "--out", str(reference)]) == 0

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(TOOL), *common, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if len(list(out.glob("states-*.safetensors"))) >= 3:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / MANIFEST_NAME).exists() and (out / PROGRESS_NAME).exists()
    partial = sorted(p.name for p in out.glob("states-*.safetensors"))
    assert 3 <= len(partial) < 40
    # a torn write from the crash, as a kill during the write would leave it
    (out / ".states-00039.safetensors.abc.tmp").write_bytes(b"half a shard")

    rerun = subprocess.run([sys.executable, str(TOOL), *common, "--out", str(out)], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming:" in rerun.stderr and "kept" in rerun.stderr

    assert (out / MANIFEST_NAME).read_bytes() == (reference / MANIFEST_NAME).read_bytes()
    assert not list(out.glob(".*.tmp")) and not (out / PROGRESS_NAME).exists()
    names = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    assert names == sorted(p.name for p in reference.iterdir() if p.suffix == ".safetensors")
    for name in names:
        a, b = load_file(str(out / name)), load_file(str(reference / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{name}: {k} differs"
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    StateCache(out).verify()
