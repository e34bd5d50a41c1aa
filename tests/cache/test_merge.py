"""tools/merge_states.py replacing a cache: built beside it, swapped in only once checked, so a refused
or killed merge leaves the old cache as it was and the same command finishes the job."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from processes import sigkill_when
from tiny_target import random_prompts, save_tiny_qwen3, write_prompts
from tool_runs import folder_digest

from dflash_cb.cache.manifest import CacheError, merge_staging_path, replaced_cache_path
from dflash_cb.cache.precompute import main, merge_main
from dflash_cb.cache.states import StateCache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merge")
    target = save_tiny_qwen3(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(5, (4, 24), seed=3), ["math", "code", "chat"])

    def part(name: str, i: int, per_shard: int, new_tokens: int) -> Path:
        out = root / name
        assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--layers", "0,2",
                     "--max-new-tokens", str(new_tokens), "--dtype", "float32", "--no-progress", "--num-shards", "2",
                     "--shard-index", str(i), "--samples-per-shard", str(per_shard)]) == 0
        return out

    made = {f"a{i}": part(f"a{i}", i, 1, 6) for i in range(2)}  # the old cache's parts
    made.update({f"b{i}": part(f"b{i}", i, 1, 4) for i in range(2)})  # the new cache's parts
    made["s2"] = part("s2", 1, 2, 6)
    made["old"] = root / "old"
    assert merge_main(["--out", str(made["old"]), str(made["a0"]), str(made["a1"])]) == 0
    return made


def old_cache_copy(made: dict[str, Path], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    out = tmp_path / "cache"
    shutil.copytree(made["old"], out)
    return out, folder_digest(out)


@pytest.mark.e2e
def test_overwrite_with_a_damaged_part_leaves_the_old_cache_as_it_was(made, tmp_path, capsys):
    """A merge over an existing cache with a damaged part is refused, and the old cache (manifest, head,
    shards) is left as it was."""
    out, before = old_cache_copy(made, tmp_path)
    damaged = tmp_path / "b1"
    shutil.copytree(made["b1"], damaged)
    shard = sorted(damaged.glob("states-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert merge_main(["--out", str(out), "--overwrite", str(made["b0"]), str(damaged)]) == 2
    assert "sha256" in capsys.readouterr().err
    assert folder_digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["b1", "cache"]
    StateCache(out).verify()
    # the good parts replace it
    assert merge_main(["--out", str(out), "--overwrite", str(made["b0"]), str(made["b1"])]) == 0
    assert StateCache(out).manifest.max_new_tokens == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["b1", "cache"]


def start_merge(out: Path, *parts: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "merge_states.py"), "--copy", "--overwrite",
                             "--out", str(out), *map(str, parts)], stderr=subprocess.PIPE, cwd=ROOT)


def copying(folder: Path):
    return lambda: folder.is_dir() and any(folder.iterdir())


@pytest.mark.e2e
def test_killed_merge_leaves_the_old_cache_and_the_same_command_finishes(made, tmp_path):
    """A real merge process SIGKILLed while it copies shards."""
    out, before = old_cache_copy(made, tmp_path)
    sigkill_when(start_merge(out, made["b0"], made["b1"]), copying(merge_staging_path(out)), timeout=120, poll_s=0)
    assert folder_digest(out) == before  # the old cache, untouched and readable
    StateCache(out).verify()
    assert main_rc(out, made) == 0 and StateCache(out).manifest.max_new_tokens == 4
    assert not merge_staging_path(out).exists() and not replaced_cache_path(out).exists()


def main_rc(out: Path, made: dict[str, Path]) -> int:
    return merge_main(["--out", str(out), "--overwrite", "--copy", str(made["b0"]), str(made["b1"])])


@pytest.mark.e2e
def test_killed_first_merge_reader_advice_works(made, tmp_path):
    """The reader of an interrupted merge says to rerun the merge, and that works."""
    out = tmp_path / "merged"
    sigkill_when(start_merge(out, made["b0"], made["b1"]), copying(merge_staging_path(out)), timeout=120, poll_s=0)
    with pytest.raises(CacheError, match="merge_states.py run into this folder was interrupted: rerun the same "
                                         "merge command"):
        StateCache(out)
    assert main_rc(out, made) == 0  # the advice, followed
    StateCache(out).verify()
    reference = tmp_path / "reference"
    assert merge_main(["--out", str(reference), str(made["b0"]), str(made["b1"])]) == 0
    assert folder_digest(out) == folder_digest(reference) and not merge_staging_path(out).exists()


@pytest.mark.e2e
def test_killed_between_the_renames_the_old_cache_comes_back(made, tmp_path, capsys):
    """The state a kill between the two renames leaves: the old cache aside, the new one staged."""
    out, before = old_cache_copy(made, tmp_path)
    shutil.copytree(made["b0"], merge_staging_path(out))
    out.rename(replaced_cache_path(out))
    with pytest.raises(CacheError, match="rerun the same merge command"):
        StateCache(out)
    # a rerun without --overwrite restores the old cache, then refuses to replace it
    assert merge_main(["--out", str(out), str(made["b0"]), str(made["b1"])]) == 2
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    assert folder_digest(out) == before and not merge_staging_path(out).exists()


@pytest.mark.e2e
def test_parts_with_different_samples_per_shard_name_the_option(made, tmp_path, capsys):
    """Parts made with different --samples-per-shard are refused naming the option (not as a prompt found
    in both parts)."""
    assert merge_main(["--out", str(tmp_path / "m"), str(made["a0"]), str(made["s2"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different --samples-per-shard" in err and f"{made['s2']}: 2" in err, err
    assert not (tmp_path / "m").exists()
