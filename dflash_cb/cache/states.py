"""The cache reader: a lazy, read-only view of a cache folder (the format is ``manifest``).

Shards are memory-mapped and read one tensor at a time, so a multi-GB cache never has to fit in
RAM. Every read checks what it touches against the manifest: sizes on open, sha256 on request
(``integrity``: each file hashed once per process while unchanged), and every sample's fields
against its tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..common.errors import DFlashCBError
from .identity import CONTENT_KEY, IDENTITY_KEY, content_sha256, identity
from .integrity import VERIFIED, file_identity, sha256_unless_verified
from .manifest import (
    MANIFEST_NAME,
    CacheError,
    Manifest,
    SampleEntry,
    ShardEntry,
    first_disagreement,
    interrupted_merge,
)
from .needs import CacheNeeds, fit_problems, is_drafter_config


class CacheMismatchError(DFlashCBError, ValueError):
    """A cache does not fit a drafter (layer ids, hidden size, vocab, block size ...)."""


def read_tensor(handle: Any, key: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Tensor ``key`` of an open safetensors file in ``dtype`` on ``device``, with no transient second
    copy of it: a tensor stored in another dtype is converted in row chunks of ``chunk_bytes`` into
    its destination (a float32 [248,320 x 5,120] head read as bfloat16 holds 2.5 GB, not 7.6 GB)."""
    sl = handle.get_slice(key)
    shape = tuple(sl.get_shape())
    stored = sl[0:1].dtype if shape and shape[0] else None
    if dtype is None or stored is None or stored == dtype or len(shape) < 2:
        return handle.get_tensor(key).to(device=device, dtype=dtype)
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = max(1, chunk_bytes // max(1, math.prod(shape[1:]) * stored.itemsize))
    for i in range(0, shape[0], rows):
        out[i:i + rows].copy_(sl[i:i + rows])
    return out


_SAMPLE_TENSORS = ("input_ids", "hidden", "target_argmax", "topk_ids", "topk_logprobs")


@dataclass
class CachedSample:
    entry: SampleEntry
    input_ids: torch.Tensor  # int64 [T]: prompt + reference completion
    hidden: torch.Tensor  # [T, len(layer_ids) * hidden]: concatenated target layer outputs
    # int64 [T]: the target's argmax at every position (predicts t + 1); None when not asked for (``load_many``)
    target_argmax: torch.Tensor | None
    topk_ids: torch.Tensor | None = None  # int64 [T, K]
    topk_logprobs: torch.Tensor | None = None  # float [T, K]


@dataclass
class TargetHead:
    """The target's input embedding and output head, the only target weights a drafter needs."""

    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the same tensor when tied)
    tied: bool = False

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TargetHead:
        embed = self.embed_tokens.to(device=device, dtype=dtype)
        head = embed if self.tied else self.lm_head.to(device=device, dtype=dtype)
        return TargetHead(embed, head, self.tied)


def _what_else(path: Path) -> str | None:
    """What ``path`` is when it is no cache but something a user confuses with one (None: nothing known)."""
    if path.is_file():
        return "a file"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if is_drafter_config(config):
        return "a drafter folder (its config.json is a drafter's; pass it as --drafter)"
    return "a Hugging Face model folder (config.json)" if isinstance(config, dict) else None


class StateCache:
    """Read-only, lazy view of a cache folder. Shards are opened memory-mapped on first use."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            not_a_cache = _what_else(self.path)
            if not_a_cache:
                raise CacheError(f"{self.path}: {not_a_cache}, not a cache of target states: give the folder "
                                 "tools/precompute_states.py --out wrote (it holds manifest.json)")
            hint = ""
            if interrupted_merge(self.path):
                hint = (" (a tools/merge_states.py run into this folder was interrupted: rerun the same merge "
                        "command to finish it)")
            elif self.path.is_dir() and any(self.path.glob("states-*.safetensors")):
                hint = " (shards exist: the precompute did not finish; rerun the same command to resume)"
            raise CacheError(
                f"{manifest_path}: no manifest{hint}. Create the cache with tools/precompute_states.py --out {self.path}"
            )
        self._manifest_seen = file_identity(manifest_path.stat())  # before the read: a later change is seen
        raw = manifest_path.read_bytes()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CacheError(f"{manifest_path}: not valid JSON ({e}); recompute or restore the cache") from e
        self.manifest = Manifest.from_dict(data, source=str(manifest_path))
        # Identifies exactly what was measured: results from different caches must not be compared.
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        # What the figures rest on, wherever the cache was built (``identity``: the manifest less local paths).
        self.identity = identity(self.manifest.to_dict())
        self.content_sha256 = content_sha256(self.identity)
        self._by_id = {s.id: s for s in self.manifest.samples}
        self._shards = {s.file: s for s in self.manifest.shards}
        # Samples found to match their manifest entry, with their shard's file identity then: a repeated read of
        # an unchanged shard (every evaluation of a training run) does not check them again.
        self._matched: dict[str, tuple[int, ...]] = {}
        self.hashed: list[tuple[str, int]] = []  # (file, bytes) this instance actually hashed, in order
        for s in self.manifest.samples:
            if s.shard not in self._shards:
                raise CacheError(f"{manifest_path}: sample {s.id!r} names shard {s.shard!r} that is not listed")

    @property
    def identity_meta(self) -> dict[str, Any]:
        """What a results file records of this cache (``meta``): the manifest's hash and the content identity."""
        return {"cache_manifest_sha256": self.manifest_sha256, CONTENT_KEY: self.content_sha256,
                IDENTITY_KEY: self.identity}

    # -- index ---------------------------------------------------------------
    @property
    def samples(self) -> list[SampleEntry]:
        return self.manifest.samples

    def __len__(self) -> int:
        return len(self.manifest.samples)

    def entry(self, sample_id: str) -> SampleEntry:
        try:
            return self._by_id[sample_id]
        except KeyError:
            raise KeyError(f"{self.path}: no sample {sample_id!r}") from None

    # -- integrity -----------------------------------------------------------
    @property
    def _rebuild_fix(self) -> str:
        """The fix for a missing or damaged shard, in every message that reports one."""
        return f"rerun tools/precompute_states.py with the same arguments and --out {self.path} to rebuild it"

    def _check_shard_file(self, shard: ShardEntry, hash_check: bool) -> Path:
        p = self.path / shard.file
        fix = self._rebuild_fix
        if not p.is_file():
            raise CacheError(f"{p}: shard missing; {fix}")
        st = p.stat()
        if st.st_size != shard.bytes:
            raise CacheError(f"{p}: shard is {st.st_size} bytes, manifest says {shard.bytes} (truncated?); {fix}")
        if hash_check and (digest := self._wrong_digest(shard.file, p, st, shard.sha256)) is not None:
            raise CacheError(f"{p}: sha256 {digest[:12]}... does not match the manifest's "
                             f"{shard.sha256[:12]}... (corrupted); {fix}")
        return p

    def _wrong_digest(self, name: str, p: Path, st: os.stat_result, expected: str) -> str | None:
        """None if ``p`` hashes to ``expected``, else the digest it has (``integrity.sha256_unless_verified``)."""
        digest = sha256_unless_verified(p, st, expected)
        if digest is None:
            return None
        self.hashed.append((name, st.st_size))
        return digest if digest != expected else None

    def check_unchanged(self) -> None:
        """Raise ``CacheError`` if the folder's manifest is no longer the one this reader opened (the cache
        was replaced or rebuilt while in use): a ``stat``, and a re-hash of the manifest only when its
        ``integrity.file_identity`` changed, so a long run notices a swapped folder, naming both hashes,
        instead of failing later on a shard that no longer fits."""
        p = self.path / MANIFEST_NAME
        try:
            seen = file_identity(p.stat())
        except OSError as e:
            raise CacheError(f"{p}: the cache changed: its manifest is gone ({e.strerror}); restore the cache "
                             f"this run started with, or restart the run on the new one") from None
        if seen == self._manifest_seen:
            return
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest != self.manifest_sha256:
            raise CacheError(f"{self.path}: the cache changed: manifest sha256 {digest[:12]}..., was "
                             f"{self.manifest_sha256[:12]}... when this run opened it (the folder was replaced or "
                             "rebuilt); restore that cache, or restart the run on the new one (numbers from "
                             "different caches are not comparable)")
        self._manifest_seen = seen  # touched or copied back, same bytes: fine

    def verify(self, shard_files: list[str] | None = None, head: bool | None = None) -> None:
        """Check sizes and sha256 of the given shards (all by default) and of the head file (by
        default only when checking all shards).

        A file checked before is hashed again only if it changed (``integrity.file_identity``).
        """
        for name in shard_files if shard_files is not None else list(self._shards):
            self._check_shard_file(self._shards[name], hash_check=True)
        if (shard_files is None if head is None else head) and self.manifest.target_head is not None:
            self._check_head(hash_check=True)

    def check_files(self, sample_ids: Sequence[str] | None = None, head: bool = True) -> None:
        """Cheap presence and size checks (one ``stat`` per file, no hashing) of the shards holding
        ``sample_ids`` (all by default) and, with ``head``, of the exported head file."""
        for name in self.shards_of(sample_ids):
            self._check_shard_file(self._shards[name], hash_check=False)
        if head and self.manifest.target_head is not None:
            self._check_head(hash_check=False)

    def shards_of(self, sample_ids: Sequence[str] | None = None) -> list[str]:
        """The shard files holding ``sample_ids`` (all shards by default), in manifest order."""
        if sample_ids is None:
            return list(self._shards)
        wanted = {self.entry(i).shard for i in sample_ids}
        return [f for f in self._shards if f in wanted]

    # -- data ----------------------------------------------------------------
    def load(self, sample_id: str, device: torch.device | str = "cpu", verify: bool = False) -> CachedSample:
        return next(self.load_many([sample_id], device, verify))

    def load_many(self, sample_ids: Iterable[str], device: torch.device | str = "cpu",
                  verify: bool = False, argmax: bool = True) -> Iterator[CachedSample]:
        """The samples in the order given, one at a time; each shard is checked (sha256 with ``verify``) and
        opened once for all its samples (an open reads the shard's whole header). ``argmax`` False leaves
        ``target_argmax`` out once a sample's fields were checked against it (an evaluation never reads it)."""
        with contextlib.ExitStack() as stack:
            opened: dict[str, tuple[Path, Any, set[str], tuple[int, ...]]] = {}  # path, file, keys, identity
            for sample_id in sample_ids:
                entry = self.entry(sample_id)
                if entry.shard not in opened:
                    path = self._check_shard_file(self._shards[entry.shard], hash_check=verify)
                    seen = file_identity(path.stat())  # before the open: a file replaced later is checked again
                    try:
                        f = stack.enter_context(safe_open(str(path), framework="pt", device=str(device)))
                        opened[entry.shard] = (path, f, set(f.keys()), seen)
                    except Exception as e:  # safetensors raises its own error types on a corrupted header
                        raise CacheError(f"{path}: cannot read shard ({e}); {self._rebuild_fix}") from e
                yield self._read_sample(entry, *opened[entry.shard], argmax=argmax)

    def _read_sample(self, entry: SampleEntry, path: Path, f: Any, keys: set[str],
                     seen: tuple[int, ...] | None = None, argmax: bool = True) -> CachedSample:
        prefix = f"{entry.id}/"
        checked = seen is not None and self._matched.get(entry.id) == seen

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            if prefix + name not in keys:
                if required:
                    raise CacheError(f"{path}: tensor {prefix + name!r} missing; rebuild the cache")
                return None
            return f.get_tensor(prefix + name)

        try:
            sample = CachedSample(entry, get("input_ids"), get("hidden"),
                                  get("target_argmax") if argmax or not checked else None,
                                  get("topk_ids", False), get("topk_logprobs", False))
        except CacheError:
            raise
        except Exception as e:  # safetensors raises its own error types on a damaged tensor
            raise CacheError(f"{path}: cannot read shard ({e}); {self._rebuild_fix}") from e
        if not checked:
            shapes = {name: tuple(t.shape) for name in _SAMPLE_TENSORS
                      if (t := getattr(sample, name)) is not None}
            self._check_entry(entry, shapes, sample.input_ids, sample.target_argmax, path)
            if seen is not None:
                self._matched[entry.id] = seen
        return sample

    def token_ids(self, sample_id: str, verify: bool = False) -> list[int]:
        """A sample's token ids (prompt and completion), reading only ``input_ids`` (the features of
        one sample can be 100+ MB). The shard's size is checked (and its sha256 with ``verify``)."""
        entry = self.entry(sample_id)
        path = self._check_shard_file(self._shards[entry.shard], hash_check=verify)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return f.get_tensor(f"{sample_id}/input_ids").tolist()
        except Exception as e:  # safetensors' own error types on a damaged header or a missing tensor
            raise CacheError(f"{path}: cannot read the input_ids of sample {sample_id!r} ({e}); "
                             f"{self._rebuild_fix}") from e

    def check_samples(self, sample_ids: Sequence[str] | None = None) -> None:
        """Every manifest field of these samples (all by default) against their shards, reading only
        the small tensors (``input_ids``, ``target_argmax``; ``hidden``'s shape from the header):
        a hand-edited or damaged manifest is found before an evaluation starts."""
        ids = list(sample_ids) if sample_ids is not None else [s.id for s in self.samples]
        by_shard: dict[str, list[SampleEntry]] = {}
        for i in ids:
            by_shard.setdefault(self.entry(i).shard, []).append(self.entry(i))
        for shard, entries in by_shard.items():
            path = self._check_shard_file(self._shards[shard], hash_check=False)
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    keys = set(f.keys())
                    for e in entries:
                        shapes = {n: tuple(f.get_slice(f"{e.id}/{n}").get_shape()) for n in _SAMPLE_TENSORS
                                  if f"{e.id}/{n}" in keys}
                        if "input_ids" not in shapes or "target_argmax" not in shapes or "hidden" not in shapes:
                            raise CacheError(f"{path}: tensors of sample {e.id!r} missing; rebuild the cache")
                        self._check_entry(e, shapes, f.get_tensor(f"{e.id}/input_ids"),
                                          f.get_tensor(f"{e.id}/target_argmax"), path)
            except CacheError:
                raise
            except Exception as err:  # safetensors' own errors on a damaged header
                raise CacheError(f"{path}: cannot read shard ({err}); {self._rebuild_fix}") from err

    def _check_entry(self, e: SampleEntry, shapes: dict[str, tuple[int, ...]], input_ids: torch.Tensor,
                     target_argmax: torch.Tensor, path: Path) -> None:
        """A sample's manifest fields against its tensors; ``valid_len`` is recomputed from
        ``target_argmax`` (the manifest is plain JSON: a hand edit must not change a score silently)."""
        m = self.manifest
        t, fd, k = e.total_len, m.feature_dim, m.topk_logprobs
        expected = {"input_ids": (t,), "hidden": (t, fd), "target_argmax": (t,)}
        if k:
            expected.update(topk_ids=(t, k), topk_logprobs=(t, k))
        problems = [f"{name} {shapes[name]} (expected {shape})"
                    for name, shape in expected.items() if name in shapes and shapes[name] != shape]
        if not problems:
            for name, x in (("input_ids", input_ids), ("target_argmax", target_argmax)):
                if x.numel() and (int(x.min()) < 0 or int(x.max()) >= m.vocab_size):
                    problems.append(f"{name} holds ids outside the vocabulary [0, {m.vocab_size})")
        if not problems:
            valid = first_disagreement(target_argmax, input_ids, e.prompt_len)
            if valid != e.valid_len:
                problems.append(f"the manifest says valid_len {e.valid_len}, the stored target_argmax "
                                f"gives {valid}")
        if problems:
            raise CacheError(f"{path}: sample {e.id!r} does not match its manifest entry (prompt_len "
                             f"{e.prompt_len}, completion_len {e.completion_len}): " + "; ".join(problems)
                             + f". The manifest or the shard was changed: restore {self.path} or recompute it "
                             "with tools/precompute_states.py")

    def iter_samples(self, ids: list[str] | None = None, device: torch.device | str = "cpu",
                     verify: bool = False) -> Iterator[CachedSample]:
        for sid in ids if ids is not None else [s.id for s in self.samples]:
            yield self.load(sid, device=device, verify=verify)

    def _check_head(self, hash_check: bool) -> Path:
        info = self.manifest.target_head
        if info is None:
            raise CacheError(f"{self.path}: the cache has no exported target head (it was built with "
                             "--no-export-head); pass the target's embedding and head explicitly (--target)")
        p = self.path / info["file"]
        fix = f"rerun tools/precompute_states.py with --out {self.path} to re-export it"
        if not p.is_file():
            raise CacheError(f"{p}: target head file missing; {fix}")
        st = p.stat()
        if hash_check and self._wrong_digest(info["file"], p, st, info["sha256"]) is not None:
            raise CacheError(f"{p}: sha256 does not match the manifest (corrupted); {fix}")
        return p

    def head_verified_elsewhere(self) -> None:
        """Take the exported head as verified, as it is now: another process (rank zero) hashed it."""
        info = self.manifest.target_head
        if info is not None:
            VERIFIED.add(self.path / info["file"], info["sha256"])

    @property
    def categories(self) -> tuple[str, ...]:
        """The prompt categories of the cache, sorted: the axis of every per-category count."""
        return tuple(sorted({s.category for s in self.samples}))

    @property
    def has_head(self) -> bool:
        return self.manifest.target_head is not None

    def load_head(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  verify: bool = True) -> TargetHead:
        """The exported head in ``dtype`` (as stored if None) on ``device``, each tensor read straight
        into its destination (``read_tensor``): a bf16 evaluation never holds a float32 copy."""
        p = self._check_head(hash_check=verify)
        try:
            with safe_open(str(p), framework="pt", device="cpu") as f:
                embed = read_tensor(f, "embed_tokens.weight", dtype, device)
                tied = bool(self.manifest.target_head.get("tied", False))
                head = embed if tied else read_tensor(f, "lm_head.weight", dtype, device)
        except Exception as e:  # safetensors' own error types on a damaged file
            raise CacheError(f"{p}: cannot read the target head ({e}); rerun tools/precompute_states.py "
                             f"with --out {self.path} to re-export it") from e
        out = TargetHead(embed, head, tied)
        self.check_head(out, str(p))
        return out

    def check_head(self, head: TargetHead, source: str) -> None:
        """Raise CacheMismatchError unless ``head`` is [vocab, hidden] of the cache's target (and tied
        as the exported head is, when the cache has one)."""
        m = self.manifest
        want = (m.vocab_size, m.hidden_size)
        problems = [f"{name} has shape {tuple(t.shape)}, the cache's target is [vocab {want[0]}, hidden {want[1]}]"
                    for name, t in (("embed_tokens", head.embed_tokens), ("lm_head", head.lm_head))
                    if tuple(t.shape) != want]
        exported = m.target_head
        if exported is not None and "tied" in exported and bool(exported["tied"]) != head.tied:
            problems.append(f"{'tied' if head.tied else 'untied'} embedding and head, but the cache's target "
                            f"is {'tied' if exported['tied'] else 'untied'}")
        if problems:
            raise CacheMismatchError(f"{source}: does not fit cache {self.path}:\n  - " + "\n  - ".join(problems)
                                     + "\nUse the target the cache was made with "
                                     f"({m.target.get('name_or_path')!r}).")

    # -- compatibility -------------------------------------------------------
    def check_fit(self, needs: CacheNeeds) -> None:
        """Raise CacheMismatchError listing every field where a drafter's ``needs`` and the cache disagree
        (``needs.fit_problems``: the one check, whatever the drafter's family)."""
        problems = fit_problems(self.manifest, needs)
        if problems:
            raise CacheMismatchError(
                f"cache {self.path} does not fit the drafter ({needs.family}):\n  - " + "\n  - ".join(problems)
                + "\nUse a cache precomputed with the drafter's target and layer ids "
                "(tools/precompute_states.py --drafter-config <drafter>/config.json; several drafters' configs, "
                "comma-separated, give a cache of the union of their layers)."
            )

    def feature_columns(self, layer_ids: Sequence[int]) -> torch.Tensor | None:
        """The columns of a sample's features (``CachedSample.hidden``, the cache's layers side by side) that a
        drafter reading ``layer_ids`` takes, in its order; None when they are all of them in the cache's order
        (the features as they are, no copy). The values are the cache's own, so a drafter's figures on a cache
        of more layers are bit-identical to those on a cache of exactly its layers."""
        cached = list(self.manifest.layer_ids)
        ids = [int(i) for i in layer_ids]
        if ids == cached:
            return None
        missing = [i for i in ids if i not in cached]
        if missing:
            raise CacheMismatchError(f"cache {self.path} holds target layers {cached}, not {missing} (the drafter "
                                     f"reads {ids}); precompute a cache with them (--layers or --drafter-config)")
        h = self.manifest.hidden_size
        return torch.cat([torch.arange(cached.index(i) * h, (cached.index(i) + 1) * h) for i in ids])
