"""The cached-states format: one manifest dataclass (the single source of truth) and a lazy reader.

A cache folder holds ``manifest.json``, shards ``states-NNNNN.safetensors`` and, optionally,
``target_head.safetensors`` (the target's input embedding and output head). Shards are
memory-mapped and read one tensor at a time, so a multi-GB cache never has to fit in RAM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import DFlashCBError
from .fileio import atomic_write_bytes  # noqa: F401  (re-exported: older imports)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEAD_NAME = "target_head.safetensors"
LAYER_INDEX_CONVENTION = "dflash: layer id i = output of decoder layer i = hf hidden_states[i + 1]"


def shard_name(index: int) -> str:
    return f"states-{index:05d}.safetensors"


class CacheError(DFlashCBError, RuntimeError):
    """A cache folder is missing, corrupted or from an incompatible version."""


class CacheMismatchError(DFlashCBError, ValueError):
    """A cache does not fit a drafter (layer ids, hidden size, vocab, block size ...)."""


@dataclass
class SampleEntry:
    id: str
    category: str
    shard: str
    prompt_len: int
    completion_len: int
    # Tokens [0, valid_len) are the target's own greedy path; scoring stops there.
    valid_len: int
    finish_reason: str
    index: int = 0  # position in the prompt file

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.completion_len


@dataclass
class ShardEntry:
    file: str
    sha256: str
    bytes: int
    samples: list[str] = field(default_factory=list)


@dataclass
class Manifest:
    target: dict[str, Any]  # name_or_path, architecture, num_layers, hidden_size, vocab_size, config_sha256
    layer_ids: list[int]
    dtype: str
    reference: dict[str, Any]  # kind, url, served_model, sampling_params, max_new_tokens, stop_token_ids
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    topk_logprobs: int = 0
    shards: list[ShardEntry] = field(default_factory=list)
    samples: list[SampleEntry] = field(default_factory=list)
    agreement: dict[str, Any] = field(default_factory=dict)
    target_head: dict[str, Any] | None = None  # file, sha256, tied, vocab_size, hidden_size, dtype
    prompts: dict[str, Any] = field(default_factory=dict)  # file name and sha256 of the prompt set
    compute_dtype: str | None = None  # dtype the target computed in; None (older caches): the same as dtype
    layer_index_convention: str = LAYER_INDEX_CONVENTION
    format_version: int = FORMAT_VERSION

    # -- derived -------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target["vocab_size"])

    @property
    def feature_dim(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def max_new_tokens(self) -> int:
        return int(self.reference["max_new_tokens"])

    @property
    def stop_token_ids(self) -> list[int]:
        return [int(t) for t in self.reference.get("stop_token_ids") or []]

    # -- (de)serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "manifest") -> Manifest:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheError(
                f"{source}: cache format_version {version!r}, this dflash-cb reads version {FORMAT_VERSION}; "
                "recompute the cache with tools/precompute_states.py of this version"
            )
        data = dict(data)
        data["shards"] = [ShardEntry(**s) for s in data.get("shards", [])]
        data["samples"] = [SampleEntry(**s) for s in data.get("samples", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CacheError(f"{source}: unknown manifest fields {unknown}; was it written by a newer dflash-cb?")
        return cls(**data)

    def write(self, folder: str | os.PathLike) -> None:
        atomic_write_bytes(Path(folder) / MANIFEST_NAME, self.to_json().encode())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class CachedSample:
    entry: SampleEntry
    input_ids: torch.Tensor  # int64 [T]: prompt + reference completion
    hidden: torch.Tensor  # [T, len(layer_ids) * hidden]: concatenated target layer outputs
    target_argmax: torch.Tensor  # int64 [T]: the target's argmax at every position (predicts t + 1)
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


class StateCache:
    """Read-only, lazy view of a cache folder. Shards are opened memory-mapped on first use."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            hint = ""
            if self.path.is_dir() and any(self.path.glob("states-*.safetensors")):
                hint = " (shards exist: the precompute did not finish; rerun the same command to resume)"
            raise CacheError(
                f"{manifest_path}: no manifest{hint}. Create the cache with tools/precompute_states.py --out {self.path}"
            )
        raw = manifest_path.read_bytes()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CacheError(f"{manifest_path}: not valid JSON ({e}); recompute or restore the cache") from e
        self.manifest = Manifest.from_dict(data, source=str(manifest_path))
        # Identifies exactly what was measured: results from different caches must not be compared.
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        self._by_id = {s.id: s for s in self.manifest.samples}
        self._shards = {s.file: s for s in self.manifest.shards}
        self._verified: set[str] = set()
        for s in self.manifest.samples:
            if s.shard not in self._shards:
                raise CacheError(f"{manifest_path}: sample {s.id!r} names shard {s.shard!r} that is not listed")

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
    def _check_shard_file(self, shard: ShardEntry, hash_check: bool) -> Path:
        p = self.path / shard.file
        fix = f"rerun tools/precompute_states.py with the same arguments and --out {self.path} to rebuild it"
        if not p.is_file():
            raise CacheError(f"{p}: shard missing; {fix}")
        size = p.stat().st_size
        if size != shard.bytes:
            raise CacheError(f"{p}: shard is {size} bytes, manifest says {shard.bytes} (truncated?); {fix}")
        if hash_check and shard.file not in self._verified:
            digest = sha256_file(p)
            if digest != shard.sha256:
                raise CacheError(f"{p}: sha256 {digest[:12]}... does not match the manifest's "
                                 f"{shard.sha256[:12]}... (corrupted); {fix}")
            self._verified.add(shard.file)
        return p

    def verify(self, shard_files: list[str] | None = None) -> None:
        """Check sizes and sha256 of the given shards (all by default) and of the head file."""
        for name in shard_files if shard_files is not None else list(self._shards):
            self._check_shard_file(self._shards[name], hash_check=True)
        if shard_files is None and self.manifest.target_head is not None:
            self._check_head(hash_check=True)

    # -- data ----------------------------------------------------------------
    def load(self, sample_id: str, device: torch.device | str = "cpu", verify: bool = False) -> CachedSample:
        entry = self.entry(sample_id)
        path = self._check_shard_file(self._shards[entry.shard], hash_check=verify)
        prefix = f"{sample_id}/"
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                keys = set(f.keys())

                def get(name: str, required: bool = True) -> torch.Tensor | None:
                    if prefix + name not in keys:
                        if required:
                            raise CacheError(f"{path}: tensor {prefix + name!r} missing; rebuild the cache")
                        return None
                    return f.get_tensor(prefix + name)

                sample = CachedSample(entry, get("input_ids"), get("hidden"), get("target_argmax"),
                                      get("topk_ids", False), get("topk_logprobs", False))
        except CacheError:
            raise
        except Exception as e:  # safetensors raises its own error types on a corrupted header
            raise CacheError(f"{path}: cannot read shard ({e}); rerun tools/precompute_states.py with "
                             f"the same arguments and --out {self.path} to rebuild it") from e
        t = entry.total_len
        fd = self.manifest.feature_dim
        if tuple(sample.input_ids.shape) != (t,) or tuple(sample.hidden.shape) != (t, fd):
            raise CacheError(f"{path}: sample {sample_id!r} has input_ids {tuple(sample.input_ids.shape)} and "
                             f"hidden {tuple(sample.hidden.shape)}, manifest expects ({t},) and ({t}, {fd})")
        return sample

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
        if hash_check and info["file"] not in self._verified:
            if sha256_file(p) != info["sha256"]:
                raise CacheError(f"{p}: sha256 does not match the manifest (corrupted); {fix}")
            self._verified.add(info["file"])
        return p

    @property
    def has_head(self) -> bool:
        return self.manifest.target_head is not None

    def load_head(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  verify: bool = True) -> TargetHead:
        p = self._check_head(hash_check=verify)
        with safe_open(str(p), framework="pt", device="cpu") as f:
            embed = f.get_tensor("embed_tokens.weight")
            tied = bool(self.manifest.target_head.get("tied", False))
            head = embed if tied else f.get_tensor("lm_head.weight")
        return TargetHead(embed, head, tied).to(device, dtype)

    # -- compatibility -------------------------------------------------------
    def check_drafter(self, spec: dict[str, Any]) -> None:
        """Raise CacheMismatchError listing every field where the drafter and the cache disagree.

        ``spec`` keys: target_layer_ids, target_hidden_size (hidden of the target = context width / len(ids)),
        vocab_size, block_size, mask_token_id (each optional).
        """
        m = self.manifest
        problems = []
        ids = spec.get("target_layer_ids")
        if ids is not None and list(ids) != list(m.layer_ids):
            problems.append(f"target_layer_ids: drafter {list(ids)}, cache {m.layer_ids}")
        hs = spec.get("target_hidden_size")
        if hs is not None and int(hs) != m.hidden_size:
            problems.append(f"target hidden size: drafter expects {hs}, cache has {m.hidden_size}")
        vocab = spec.get("vocab_size")
        if vocab is not None and int(vocab) != m.vocab_size:
            problems.append(f"vocab_size: drafter {vocab}, cache target {m.vocab_size}")
        bs = spec.get("block_size")
        if bs is not None and int(bs) < 2:
            problems.append(f"block_size: drafter {bs}, must be at least 2")
        mask = spec.get("mask_token_id")
        if mask is not None and not 0 <= int(mask) < m.vocab_size:
            problems.append(f"mask_token_id: drafter {mask} is outside the cache target's vocab [0, {m.vocab_size})")
        if problems:
            raise CacheMismatchError(
                f"cache {self.path} does not fit the drafter:\n  - " + "\n  - ".join(problems)
                + "\nUse a cache precomputed with the drafter's target and layer ids "
                "(tools/precompute_states.py --drafter-config <drafter>/config.json)."
            )
