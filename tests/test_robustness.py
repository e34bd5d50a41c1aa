"""The tools on a full disk and through symbolic links, as a user runs them.

A write that fails (a full disk, ``ulimit -f``) says ``error: <file>: <reason> (<fix>)``, exit code 2,
and keeps what was there (``dflash_cb.common.fileio``). The disk is filled for real: each tool runs
in a subprocess under a small ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored, so its writes fail with
``EFBIG`` as they would on a full disk with ``ENOSPC``. An ``--out`` that is a symbolic link is written
through: the link stays and its target gets the new file.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tool_runs import folder_digest

from dflash_cb.common.cli import run

ROOT = Path(__file__).resolve().parents[1]
TOO_LARGE = "File too large ("


def limited(tool: str, *args: str, limit: int) -> subprocess.CompletedProcess:
    """``python tools/<tool> args`` with files capped at ``limit`` bytes (``ulimit -f``)."""

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the tool
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], preexec_fn=cap, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def names_the_file(proc: subprocess.CompletedProcess, path: Path | str) -> str:
    """Exit code 2 and a last stderr line ``error: <path>: File too large (<fix>)`` (``path``: a regex
    when a str); no traceback."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    where = re.escape(str(path)) if isinstance(path, Path) else path
    assert re.match(rf"error: (.* -> )?{where}: {re.escape(TOO_LARGE)}", last) and "ulimit -f" in last, last
    return last


# -- a full disk ----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_eval_drafter_names_the_results_file_it_could_not_write_and_keeps_the_old_one(tiny_cache, drafter_dir,
                                                                                       tmp_path):
    out = tmp_path / "r.json"
    out.write_text("the previous results\n")
    proc = limited("eval_drafter.py", "--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(out),
                   "--ddtree-budgets", "4", "--device", "cpu", limit=1024)
    names_the_file(proc, out)
    assert "produced per cycle" in proc.stdout  # the numbers were shown before the write failed
    assert out.read_text() == "the previous results\n" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.e2e
def test_extract_on_a_full_disk_names_the_weights_and_keeps_the_previous_drafter(drafter_dir, tmp_path):
    from dflash_cb.integrations.cli import extract as extract_cli

    out = tmp_path / "drafter"
    assert run(extract_cli.main, ["--ckpt", str(drafter_dir / "model.safetensors"), "--config",
                                  str(drafter_dir / "config.json"), "--out", str(out)]) == 0
    before = folder_digest(out)
    proc = limited("extract_drafter.py", "--ckpt", str(drafter_dir / "model.safetensors"), "--config",
                   str(drafter_dir / "config.json"), "--out", str(out), limit=4096)
    last = names_the_file(proc, out / "model.safetensors")
    assert last.endswith(f"the drafter could not be written; --out {out} is as it was")
    assert folder_digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


@pytest.mark.e2e
def test_merge_and_precompute_name_the_shard_they_could_not_write(tiny_cache, tmp_path):
    merged = tmp_path / "merged"
    proc = limited("merge_states.py", "--copy", "--out", str(merged), str(tiny_cache), limit=4096)
    last = names_the_file(proc, merged / "states-00000.safetensors")
    assert f"{tiny_cache / 'states-00000.safetensors'} -> {merged}" in last  # copied from where to where
    assert not merged.exists() and sorted(p.name for p in tmp_path.iterdir()) == []

    root = tiny_cache.parent  # the target and prompts the fixture's cache was made from
    out = tmp_path / "cache"
    proc = limited("precompute_states.py", "--target", str(root / "target"), "--prompts", str(root / "prompts.jsonl"),
                   "--out", str(out), "--layers", "0,2", "--reference", "local", "--dtype", "float32",
                   "--max-new-tokens", "8", "--no-progress", limit=4096)
    names_the_file(proc, re.escape(str(out / "states-")) + r"\d{5}\.safetensors")
    assert not (out / "manifest.json").exists()


@pytest.mark.e2e
def test_the_demo_names_the_file_it_could_not_write(tmp_path):
    out = tmp_path / "demo"
    proc = limited("demo.py", "--quick", "--out", str(out), limit=16)
    names_the_file(proc, out / ".dflash_demo")


# -- symbolic links -------------------------------------------------------------------------------

def test_out_through_a_symbolic_link_writes_the_target_and_keeps_the_link(tiny_cache, drafter_dir, tmp_path, capsys):
    """``latest.json -> runs/a.json``: the link stays and points at the new results; a dangling link's
    target is created. The same for a drafter folder."""
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import extract as extract_cli

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "a.json").write_text("old results\n")
    live, dangling = tmp_path / "latest.json", tmp_path / "next.json"
    live.symlink_to(runs / "a.json")
    dangling.symlink_to(runs / "b.json")
    for link, target in ((live, runs / "a.json"), (dangling, runs / "b.json")):
        code = run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(link),
                                   "--ddtree-budgets", "4", "--device", "cpu"])
        assert code == 0, capsys.readouterr().err
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert load_results(target).tau is not None and json.loads(link.read_text())["metrics"]["tau"] is not None
    assert sorted(p.name for p in runs.iterdir()) == ["a.json", "b.json"]

    folders = tmp_path / "drafters"
    folders.mkdir()
    for name in ("current", "fresh"):
        link = tmp_path / name
        link.symlink_to(folders / name)
        if name == "current":  # a live link to an earlier drafter folder, which is replaced
            (folders / name).mkdir()
            (folders / name / "config.json").write_text("{}")
        code = run(extract_cli.main, ["--ckpt", str(drafter_dir / "model.safetensors"), "--config",
                                      str(drafter_dir / "config.json"), "--out", str(link)])
        assert code == 0, capsys.readouterr().err
        assert link.is_symlink() and os.readlink(link) == str(folders / name)
        assert folder_digest(folders / name) == folder_digest(drafter_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "drafters", "fresh", "latest.json", "next.json",
                                                         "runs"]

    from dflash_cb.cache.precompute import merge_main
    from dflash_cb.cache.states import StateCache

    caches = tmp_path / "caches"
    caches.mkdir()
    for name in ("new", "again"):  # a dangling link, then the same link, live, with --overwrite
        link = tmp_path / "cache"
        if not link.is_symlink():
            link.symlink_to(caches / "merged")
        code = merge_main(["--out", str(link), *(["--overwrite"] if name == "again" else []), str(tiny_cache)])
        assert code == 0, capsys.readouterr().err
        assert link.is_symlink() and os.readlink(link) == str(caches / "merged")
        assert StateCache(caches / "merged").manifest_sha256 == StateCache(tiny_cache).manifest_sha256
        assert sorted(p.name for p in caches.iterdir()) == ["merged"]


# -- baseline names --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [{"served": "runs/zlab.json"}, {"served!": "runs/zlab.json"},
                                   ["runs/served.json"], ["runs/a.json", "other/served.json"], "runs/served.json"])
def test_the_name_served_is_reserved_for_the_servers_own_tau(value):
    """``baseline/served/...`` is the server's online tau (from the cache's counters): a results file of that
    name would share its keys (tau from the server, delta_tau from the file). Refused, with the way out."""
    from dflash_cb import DFlashEvalCallback
    from dflash_cb.common.arguments import ArgumentError

    with pytest.raises(ArgumentError) as err:
        DFlashEvalCallback(states="no/such/cache", baselines=value)
    text = str(err.value)
    assert text.startswith(f"baselines={value!r}: expected a name other than ") and "server's online tau" in text
    assert "e.g. {'served" in text and "_file': " in text


def test_two_baseline_names_logged_under_one_key_are_refused():
    from dflash_cb import DFlashEvalCallback
    from dflash_cb.common.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=r"'a b' and 'a_b' are both logged as baseline/a_b/"):
        DFlashEvalCallback(states="c", baselines={"a b": "x.json", "a_b": "y.json"})
    with pytest.raises(ArgumentError, match=r"'zlab v1' and 'zlab_v1' are both logged as baseline/zlab_v1/"):
        DFlashEvalCallback(states="c", baselines=["runs/zlab v1.json", "old/zlab_v1.json"])
    cb = DFlashEvalCallback(states="c", baselines={"served_file": "runs/served.json", "zlab": "z.json"})
    assert cb.config.baselines == {"served_file": "runs/served.json", "zlab": "z.json"}
