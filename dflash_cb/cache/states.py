"""The cached-states format: one manifest dataclass (the single source of truth) and a lazy reader.

A cache folder holds ``manifest.json``, shards ``states-NNNNN.safetensors`` and, optionally,
``target_head.safetensors`` (the target's input embedding and output head). Shards are
memory-mapped and read one tensor at a time, so a multi-GB cache never has to fit in RAM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..common.errors import DFlashCBError
from ..common.fileio import atomic_write_bytes
from .served import served_spec_problem

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEAD_NAME = "target_head.safetensors"
LAYER_INDEX_CONVENTION = "dflash: layer id i = output of decoder layer i = hf hidden_states[i + 1]"


def shard_name(index: int) -> str:
    return f"states-{index:05d}.safetensors"


def merge_staging_path(out: str | os.PathLike) -> Path:
    """Where tools/merge_states.py builds the merged cache before it replaces ``out``."""
    out = Path(out)
    return out.parent / f".{out.name}.merging"


def replaced_cache_path(out: str | os.PathLike) -> Path:
    """Where the previous cache waits, for an instant, while a merged cache takes its place."""
    out = Path(out)
    return out.parent / f".{out.name}.replaced"


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
    # The server's own speculative counters for this request (every spec_* field of SGLang's
    # meta_info, e.g. spec_verify_ct, spec_accept_length); None when the server sent none.
    served_spec: dict[str, Any] | None = None

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
    # The server's speculative configuration (/get_server_info: algorithm, draft_model_path,
    # num_draft_tokens, topk, num_steps); None for local/file references or servers that do not say.
    served_spec_config: dict[str, Any] | None = None
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
        if not isinstance(data, dict):
            raise CacheError(f"{source}: expected a JSON object, got {type(data).__name__}; recompute or restore the cache")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheError(
                f"{source}: cache format_version {version!r}, this dflash-cb reads version {FORMAT_VERSION}; "
                "recompute the cache with tools/precompute_states.py of this version"
            )
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CacheError(f"{source}: unknown manifest fields {unknown}; was it written by a newer dflash-cb?")
        try:
            data["shards"] = [ShardEntry(**s) for s in data.get("shards", [])]
            data["samples"] = [SampleEntry(**s) for s in data.get("samples", [])]
            manifest = cls(**data)
        except TypeError as e:  # a missing or misspelled field in an entry
            raise CacheError(f"{source}: malformed manifest ({e}); recompute or restore the cache") from None
        for s in manifest.samples:
            problem = _entry_problem(s)
            if problem:
                raise CacheError(f"{source}: sample {s.id!r}: {problem}; the manifest was edited or damaged: "
                                 "restore it or recompute the cache")
        return manifest

    def write(self, folder: str | os.PathLike) -> None:
        atomic_write_bytes(Path(folder) / MANIFEST_NAME, self.to_json().encode())


def _entry_problem(e: SampleEntry) -> str | None:
    """What is impossible about a sample entry on its own (before its shard is read), or None."""
    ints = {k: getattr(e, k) for k in ("prompt_len", "completion_len", "valid_len")}
    bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        return f"{', '.join(bad)} must be integers, got {[ints[k] for k in bad]}"
    if e.prompt_len < 1 or e.completion_len < 0:
        return f"prompt_len {e.prompt_len} must be >= 1 and completion_len {e.completion_len} >= 0"
    if not e.prompt_len <= e.valid_len <= e.total_len:
        return (f"valid_len {e.valid_len} is outside [prompt_len {e.prompt_len}, "
                f"prompt_len + completion_len {e.total_len}]")
    return served_spec_problem(e.served_spec)  # its values are judged where they are compared (served.py)


def first_disagreement(target_argmax: torch.Tensor, input_ids: torch.Tensor, prompt_len: int) -> int:
    """``valid_len``: the first completion position t with argmax[t-1] != input_ids[t], else len(input_ids)."""
    t = input_ids.shape[0]
    if t <= prompt_len:
        return t
    differ = (target_argmax[prompt_len - 1:t - 1] != input_ids[prompt_len:]).nonzero()
    return prompt_len + int(differ[0]) if len(differ) else t


def stratified_ids(ids: Sequence[str], category: Callable[[str], str], n: int, seed: int | None) -> list[str]:
    """``n`` of ``ids``, round-robin over categories (shuffled per category with ``seed``; in order if
    None), returned in the order of ``ids``. A private generator: the global RNG is untouched."""
    if n <= 0:
        return []
    by_cat: dict[str, list[str]] = {}
    for i in ids:
        by_cat.setdefault(category(i), []).append(i)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for c in sorted(by_cat):
            perm = torch.randperm(len(by_cat[c]), generator=g).tolist()
            by_cat[c] = [by_cat[c][j] for j in perm]
    chosen: list[str] = []
    queues = [list(by_cat[c]) for c in sorted(by_cat)]
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    order = {i: k for k, i in enumerate(ids)}
    return sorted(chosen, key=order.__getitem__)


class SampleSelectionError(DFlashCBError, ValueError):
    """A requested sample subset does not exist in the cache."""


def select_sample_ids(cache: StateCache, num_samples: int | None = None, sample_ids: Sequence[str] | None = None,
                      seed: int = 0) -> list[str]:
    """The samples an evaluation scores; the callback's ``num_samples``/``sample_ids`` and
    ``tools/eval_drafter.py --samples/--sample-ids`` both call this, so they pick the same subset.

    ``sample_ids`` wins (duplicates dropped, order kept); else ``num_samples`` draws a fixed subset
    stratified by category (round-robin, seeded); else every sample, in cache order.
    """
    all_ids = [s.id for s in cache.samples]
    if sample_ids is not None:
        known = set(all_ids)
        unknown = [i for i in sample_ids if i not in known]
        if unknown:
            raise SampleSelectionError(f"sample ids {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are not in "
                                       f"the cache {cache.path} (its ids: {', '.join(all_ids[:5])}"
                                       f"{' ...' if len(all_ids) > 5 else ''})")
        if not sample_ids:
            raise SampleSelectionError("the list of sample ids is empty: give at least one id")
        return list(dict.fromkeys(sample_ids))
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 1):
        raise SampleSelectionError(f"the number of samples must be a positive integer (or none for all), "
                                   f"got {num_samples!r}")
    if num_samples is None or num_samples >= len(all_ids):
        return all_ids
    return stratified_ids(all_ids, lambda i: cache.entry(i).category, num_samples, seed)


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, replaced by a rename or copied over: a copy or a rewrite
    that keeps (or restores) the modification time still changes the inode or the status-change time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Files whose sha256 matched, by (real path, file_identity, expected sha256), for this process: a new
# StateCache of the same folder (every Lightning setup makes one) does not hash them again.
_VERIFIED: set[tuple[str, tuple[int, ...], str]] = set()


def verified_key(path: str | os.PathLike, st: os.stat_result, expected: str) -> tuple[str, tuple[int, ...], str]:
    return (os.path.realpath(path), file_identity(st), expected)


def mark_verified(path: str | os.PathLike, expected: str) -> None:
    """Record that ``path`` (as it is now) matches ``expected``: e.g. another rank hashed it."""
    _VERIFIED.add(verified_key(path, os.stat(path), expected))


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
            if merge_staging_path(self.path).exists() or replaced_cache_path(self.path).exists():
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
        self._by_id = {s.id: s for s in self.manifest.samples}
        self._shards = {s.file: s for s in self.manifest.shards}
        self.hashed: list[tuple[str, int]] = []  # (file, bytes) this instance actually hashed, in order
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
        """None if ``p`` hashes to ``expected``, else the digest it has. A file that passed before is
        hashed again only if it changed (``file_identity``: size, times, inode)."""
        key = verified_key(p, st, expected)
        if key in _VERIFIED:
            return None
        digest = sha256_file(p)
        self.hashed.append((name, st.st_size))
        if digest != expected:
            return digest
        _VERIFIED.add(key)
        return None

    def check_unchanged(self) -> None:
        """Raise ``CacheError`` if the folder's manifest is no longer the one this reader opened (the cache
        was replaced or rebuilt while in use): a ``stat``, and a re-hash of the manifest only when its
        identity (inode, size, times) changed, so a long run notices a swapped folder, naming both hashes,
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

        A file checked before is hashed again only if it changed (``file_identity``: size, times, inode).
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
                  verify: bool = False) -> Iterator[CachedSample]:
        """The samples in the order given, one at a time; each shard is checked (sha256 with ``verify``) and
        opened once for all its samples (an open reads the shard's whole header)."""
        with contextlib.ExitStack() as stack:
            opened: dict[str, tuple[Path, Any, set[str]]] = {}
            for sample_id in sample_ids:
                entry = self.entry(sample_id)
                if entry.shard not in opened:
                    path = self._check_shard_file(self._shards[entry.shard], hash_check=verify)
                    try:
                        f = stack.enter_context(safe_open(str(path), framework="pt", device=str(device)))
                        opened[entry.shard] = (path, f, set(f.keys()))
                    except Exception as e:  # safetensors raises its own error types on a corrupted header
                        raise CacheError(f"{path}: cannot read shard ({e}); {self._rebuild_fix}") from e
                yield self._read_sample(entry, *opened[entry.shard])

    def _read_sample(self, entry: SampleEntry, path: Path, f: Any, keys: set[str]) -> CachedSample:
        prefix = f"{entry.id}/"

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            if prefix + name not in keys:
                if required:
                    raise CacheError(f"{path}: tensor {prefix + name!r} missing; rebuild the cache")
                return None
            return f.get_tensor(prefix + name)

        try:
            sample = CachedSample(entry, get("input_ids"), get("hidden"), get("target_argmax"),
                                  get("topk_ids", False), get("topk_logprobs", False))
        except CacheError:
            raise
        except Exception as e:  # safetensors raises its own error types on a damaged tensor
            raise CacheError(f"{path}: cannot read shard ({e}); {self._rebuild_fix}") from e
        shapes = {name: tuple(t.shape) for name in _SAMPLE_TENSORS
                  if (t := getattr(sample, name)) is not None}
        self._check_entry(entry, shapes, sample.input_ids, sample.target_argmax, path)
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
            mark_verified(self.path / info["file"], info["sha256"])

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
