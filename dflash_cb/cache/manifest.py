"""The cache format: one manifest dataclass, the single source of truth for ``manifest.json``.

A cache folder holds ``manifest.json``, shards ``states-NNNNN.safetensors`` and, optionally,
``target_head.safetensors`` (the target's input embedding and output head). The manifest lists
every shard (file, sha256, bytes) and every sample (``SampleEntry``); ``format_version`` says which
version of this layout it is, and a reader of another version refuses it. The reader is
``states.StateCache``; the writer is ``precompute``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..common.errors import DFlashCBError
from ..common.fileio import atomic_write_bytes
from .served import served_spec_problem

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEAD_NAME = "target_head.safetensors"
LAYER_INDEX_CONVENTION = "dflash: layer id i = output of decoder layer i = hf hidden_states[i + 1]"


def shard_name(index: int) -> str:
    return f"states-{index:05d}.safetensors"


# Beside a cache folder while a merge replaces it (``precompute.merge``); the reader names them too.
def merge_staging_path(out: str | os.PathLike) -> Path:
    """Where ``tools/merge_states.py`` builds the merged cache before it replaces ``out``."""
    out = Path(out)
    return out.parent / f".{out.name}.merging"


def replaced_cache_path(out: str | os.PathLike) -> Path:
    """Where the previous cache waits, for an instant, while a merged cache takes its place."""
    out = Path(out)
    return out.parent / f".{out.name}.replaced"


def interrupted_merge(out: str | os.PathLike) -> bool:
    """A merge into ``out`` was killed before it finished (rerunning it finishes the job)."""
    return merge_staging_path(out).exists() or replaced_cache_path(out).exists()


class CacheError(DFlashCBError, RuntimeError):
    """A cache folder is missing, corrupted or from an incompatible version."""


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
    # The server's own speculative counters for this request: every spec_* field of SGLang's
    # meta_info (e.g. spec_verify_ct, spec_accept_length), or the change of vLLM's vllm:* counters
    # across it with whether it is the request's own (vllm_counters); None when the server sent none.
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
    # The completion source (the precompute's --reference): kind (local | sglang | vllm | file), url, served_model,
    # sampling_params, max_new_tokens, stop_token_ids; the key keeps the option's name.
    reference: dict[str, Any]
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    topk_logprobs: int = 0
    shards: list[ShardEntry] = field(default_factory=list)
    samples: list[SampleEntry] = field(default_factory=list)
    agreement: dict[str, Any] = field(default_factory=dict)
    target_head: dict[str, Any] | None = None  # file, sha256, tied, vocab_size, hidden_size, dtype
    prompts: dict[str, Any] = field(default_factory=dict)  # file name and sha256 of the prompt set
    # The server's speculative configuration (SGLang's /get_server_info: algorithm, draft_model_path,
    # num_draft_tokens, topk, num_steps; vLLM's: server "vllm", what /metrics and /server_info say);
    # None for local/file completions or servers that do not say.
    served_spec_config: dict[str, Any] | None = None
    compute_dtype: str | None = None  # dtype the target computed in; None (older caches): the same as dtype
    # Where the prefill ran ("cpu", "cuda"): a GPU's kernels round otherwise; None (older caches): the CPU.
    prefill_device: str | None = None
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


