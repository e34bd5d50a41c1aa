"""Crash and resume: a real tools/precompute_states.py process killed with SIGKILL mid-run, then rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import sigkill_when
from safetensors.torch import load_file
from tiny_target import random_prompts, save_tiny_qwen3, write_prompts

from dflash_cb.cache.manifest import MANIFEST_NAME
from dflash_cb.cache.precompute import PROGRESS_NAME, main
from dflash_cb.cache.states import StateCache

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "precompute_states.py"


@pytest.mark.e2e
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, capsys):
    target = save_tiny_qwen3(tmp_path / "target")
    # enough prompts that the kill lands mid-run
    prompts = write_prompts(tmp_path / "prompts.jsonl", random_prompts(30, (8, 40), seed=7))
    common = ["--target", str(target), "--prompts", str(prompts), "--layers", "0,1,3", "--max-new-tokens", "8",
              "--dtype", "float32", "--topk-logprobs", "3", "--no-progress", "--threads", "1"]
    # One thread everywhere: bitwise equality across processes needs the same reduction order.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = tmp_path / "uninterrupted"
        assert main([*common, "--out", str(reference)]) == 0
    finally:
        torch.set_num_threads(threads)

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(TOOL), *common, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=env)
    sigkill_when(proc, lambda: len(list(out.glob("states-*.safetensors"))) >= 3, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / MANIFEST_NAME).exists() and (out / PROGRESS_NAME).exists()
    partial = sorted(p.name for p in out.glob("states-*.safetensors"))
    assert 3 <= len(partial) < 30
    # a torn write from the crash, as a kill during the write would leave it
    (out / ".states-00039.safetensors.abc.tmp").write_bytes(b"half a shard")
    # and a torn append to the resume record (its last line without a newline): ignored
    with open(out / PROGRESS_NAME, "ab") as f:
        f.write(b'{"shard": {"file": "states-00029.safetensors", "sha')

    # the same command again (in this process, one thread like the killed one, to save a startup)
    capsys.readouterr()
    torch.set_num_threads(1)
    try:
        assert main([*common, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "resuming:" in err and "verified shard(s) kept" in err

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
