"""The cache reader: manifest fields are bound-checked against the shards, hashes are re-checked
only for files that changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_cb.cache import integrity
from dflash_cb.cache.manifest import CacheError
from dflash_cb.cache.states import StateCache


def copy_cache(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        manifest = json.loads((dst / "manifest.json").read_text())
        edit(manifest)
        (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_manifest_fields_are_checked_against_the_shard(tiny_cache: Path, tmp_path: Path) -> None:
    """A hand-edited valid_len is refused against the stored target argmax (never trusted, never a crash)."""
    real = StateCache(tiny_cache).entry("p001")

    def smaller(m):
        m["samples"][1]["valid_len"] = real.prompt_len

    cache = StateCache(copy_cache(tiny_cache, tmp_path / "a", smaller))
    with pytest.raises(CacheError, match=rf"'p001'.*valid_len {real.prompt_len}, the stored target_argmax "
                                         rf"gives {real.valid_len}"):
        cache.load("p001")
    with pytest.raises(CacheError, match="valid_len"):
        cache.check_samples()  # the same check, reading only the small tensors
    cache.load("p000")  # the other samples are fine

    def too_large(m):
        m["samples"][1]["valid_len"] = real.total_len + 1

    with pytest.raises(CacheError, match=rf"sample 'p001': valid_len {real.total_len + 1} is outside"):
        StateCache(copy_cache(tiny_cache, tmp_path / "b", too_large))

    def longer(m):  # lengths must equal the tensors' lengths
        m["samples"][1]["completion_len"] += 2
        m["samples"][1]["valid_len"] += 2

    cache = StateCache(copy_cache(tiny_cache, tmp_path / "c", longer))
    with pytest.raises(CacheError, match=r"input_ids \(\d+,\) \(expected \(\d+,\)\)"):
        cache.check_samples(["p001"])

    def missing_field(m):
        del m["samples"][0]["prompt_len"]

    with pytest.raises(CacheError, match="malformed manifest"):
        StateCache(copy_cache(tiny_cache, tmp_path / "d", missing_field))


def test_changed_shard_is_hashed_again_unchanged_is_not(tiny_cache: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once verified, a shard is hashed again only when it changed (``integrity.file_identity``)."""
    cache = StateCache(copy_cache(tiny_cache, tmp_path / "cache"))
    hashed: list[str] = []
    real_sha = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real_sha(p, *a))
    cache.verify()
    n = len(hashed)
    assert n == len(cache.manifest.shards) + 1  # + the head
    cache.load("p002", verify=True)
    assert len(hashed) == n  # unchanged: not hashed again
    shard = cache.path / cache.entry("p002").shard
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="sha256 .* does not match"):
        cache.load("p002", verify=True)
    assert hashed[n:] == [shard.name]


def test_a_sample_is_checked_again_only_when_its_shard_changed(tiny_cache: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every evaluation of a run reads the same samples: each is checked against its manifest entry once per
    shard file (``integrity.file_identity``); a shard rewritten since is checked again, and a sample that no
    longer matches is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cache = StateCache(copy_cache(tiny_cache, tmp_path / "cache"))
    checked: list[str] = []
    real_check = StateCache._check_entry
    monkeypatch.setattr(StateCache, "_check_entry", lambda self, e, *a: checked.append(e.id) or real_check(self, e, *a))
    ids = [e.id for e in cache.samples]
    for _ in range(3):
        assert [s.entry.id for s in cache.load_many(ids)] == ids
    assert checked == ids  # once each
    entry = cache.entry("p001")
    assert entry.valid_len > entry.prompt_len
    shard = cache.path / entry.shard
    tensors = load_file(str(shard))
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
    argmax = tensors["p001/target_argmax"]
    argmax[entry.prompt_len - 1] = (argmax[entry.prompt_len - 1] + 1) % cache.manifest.vocab_size
    size = shard.stat().st_size
    save_file(tensors, str(shard), metadata=metadata)
    assert shard.stat().st_size == size  # the same tensors' shapes: only the new file identity tells
    checked.clear()
    cache.load("p000")
    assert checked == ["p000"] * (cache.entry("p000").shard == entry.shard)  # its shard changed: checked again
    with pytest.raises(CacheError, match=rf"'p001'.*the stored target_argmax gives {entry.prompt_len}"):
        cache.load("p001")


def test_an_evaluation_reads_no_argmax_of_a_checked_sample_but_checks_a_changed_one(tiny_cache: Path,
                                                                                      tmp_path: Path) -> None:
    """``load_many(argmax=False)`` (the engine's read) reads ``target_argmax`` only to check a sample not yet checked
    against it: the first read of a shard file has it, later reads of the same file leave it out; a shard rewritten
    since is read and checked again, and a changed argmax is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cache = StateCache(copy_cache(tiny_cache, tmp_path / "cache"))
    ids = [e.id for e in cache.samples]
    assert all(s.target_argmax is not None for s in cache.load_many(ids, argmax=False))
    assert all(s.target_argmax is None for s in cache.load_many(ids, argmax=False))
    assert all(s.target_argmax is not None for s in cache.load_many(ids))  # asked for: always read
    entry = cache.entry("p001")
    shard = cache.path / entry.shard
    tensors = load_file(str(shard))
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
    argmax = tensors["p001/target_argmax"]
    argmax[entry.prompt_len - 1] = (argmax[entry.prompt_len - 1] + 1) % cache.manifest.vocab_size
    save_file(tensors, str(shard), metadata=metadata)
    with pytest.raises(CacheError, match=r"'p001'.*the stored target_argmax gives"):
        list(cache.load_many(["p001"], argmax=False))


def test_token_ids_read_only_input_ids_and_check_the_shard(tiny_cache: Path, tmp_path: Path) -> None:
    """The W&B table's token ids: the same as a full load's, and a truncated shard is named."""
    cache = StateCache(copy_cache(tiny_cache, tmp_path / "cache"))
    assert cache.token_ids("p001") == cache.load("p001").input_ids.tolist()
    shard = cache.path / cache.entry("p001").shard
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CacheError, match=rf"{shard.name}: shard is .* bytes.*truncated"):
        cache.token_ids("p001")


def test_a_rewrite_that_restores_the_mtime_is_hashed_again(tiny_cache: Path, tmp_path: Path) -> None:
    """Same size, modification time put back (``cp -p``, rsync --times): the status-change time still
    moved, so the damaged shard is hashed again, here and in a new reader of the same process."""
    import os

    cache = StateCache(copy_cache(tiny_cache, tmp_path / "cache"))
    cache.verify()
    shard = cache.path / cache.entry("p002").shard
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(CacheError, match="sha256 .* does not match"):
        cache.load("p002", verify=True)
    with pytest.raises(CacheError, match="sha256 .* does not match"):
        StateCache(cache.path).load("p002", verify=True)
