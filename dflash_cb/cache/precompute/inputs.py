"""The prompts a precompute reads (``--prompts`` or a ``--prompt-set`` preset built beside the cache), tokenized and
checked against the target; later turns built once the turns before them have completions. ``a`` is the run's
``plan.PrecomputeArgs``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...common.fileio import output_path
from ..integrity import sha256_file
from ..prompt_sets import PromptSetError, check_tokenizer, later_turns
from ..prompts import PromptRecord
from ..target import TargetConfig
from .errors import PrecomputeError

logger = logging.getLogger(__name__)


def _load_tokenizer(a: Any) -> Any:
    from transformers import AutoTokenizer

    from ..prompts import missing_tokenizer_files

    tok_path = a.tokenizer or a.target
    missing = missing_tokenizer_files(tok_path)
    if missing:
        flag = "--tokenizer" if a.tokenizer else "--target"
        raise PrecomputeError(f"{a.prompts}: prompts given as text/messages need a tokenizer, and {flag} "
                              f"{tok_path} has no tokenizer files ({missing}); pass --tokenizer <folder "
                              "with tokenizer.json> or give the prompts as input_ids")
    try:
        return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=False)
    except Exception as e:
        raise PrecomputeError(f"{a.prompts}: prompts given as text/messages need a tokenizer, and "
                              f"{tok_path} has none loadable ({e}); pass --tokenizer") from e

@dataclass
class LaterTurns:
    """What builds a later turn's prompt once the turns before it have completions (prompt_sets.turn_prompt)."""

    records: dict[str, PromptRecord]  # this part's samples by id, later turns included
    tokenizer: Any

    def pending(self, known: dict[str, list[int]]) -> list[PromptRecord]:
        return [r for r in self.records.values() if r.follows is not None and r.id not in known]


@dataclass
class Prompts:
    records: list[PromptRecord]  # the whole file
    ids: dict[str, list[int]]  # tokenized prompts of this part (--num-shards/--shard-index), by id
    groups: dict[int, list[PromptRecord]]  # shard group -> records of this part, in file order
    info: dict[str, Any]  # the manifest's ``prompts`` header
    later_turns: LaterTurns | None = None


def tokenized_prompts(a: Any, tcfg: TargetConfig) -> Prompts:
    """This part's prompts, tokenized and checked against the target (vocabulary, context length)."""
    from .. import prompts as P

    records = P.load_prompts(a.prompts)  # PromptFileError: file:line and the fix
    try:
        later = later_turns(records)  # mt-bench's second turns: samples of their own, prompts built as they run
    except PromptSetError as e:
        raise PrecomputeError(f"{a.prompts}: {e}") from None
    if later and a.num_shards > 1:
        raise PrecomputeError(f"{a.prompts}: {len(later)} later turn(s) need the completion of the turn before "
                              "on the same host; run this prompt file without --num-shards")
    records = records + later
    S, N, part = a.samples_per_shard, a.num_shards, a.shard_index
    mine = [r for r in records if (r.index // S) % N == part]
    built_with = {r.tokenizer for r in mine if r.tokenizer}  # a benchmark prompt set: its ids are one tokenizer's
    tokenizer = _load_tokenizer(a) if P.needs_tokenizer(mine) or built_with else None
    if built_with:
        check_tokenizer(built_with, tokenizer, f"{a.prompts} (tokenizer {a.tokenizer or a.target})")
    first = [r for r in mine if r.follows is None]
    prompt_ids = {r.id: P.tokenize_prompt(r, tokenizer, a.chat_template_kwargs) for r in first}
    for r in first:
        if not prompt_ids[r.id]:
            raise PrecomputeError(f"{a.prompts}:{r.line}: prompt {r.id!r} tokenizes to no tokens")
        bad = [t for t in prompt_ids[r.id] if t >= tcfg.vocab_size]
        if bad:
            raise PrecomputeError(f"{a.prompts}:{r.line}: prompt {r.id!r} has token ids {bad[:5]} >= the "
                                  f"target's vocab size {tcfg.vocab_size}; wrong tokenizer or target?")
    P.check_lengths([(r, prompt_ids[r.id]) for r in first], a.max_new_tokens, tcfg.max_position_embeddings,
                    a.prompts)
    groups: dict[int, list[PromptRecord]] = {}
    for r in mine:
        groups.setdefault(r.index // S, []).append(r)
    info: dict[str, Any] = {"file": Path(a.prompts).name, "sha256": sha256_file(a.prompts), "count": len(records),
                            "tokenizer": (a.tokenizer or a.target) if tokenizer is not None else None}
    sets = {r.category: {k: r.source.get(k) for k in ("preset", "dataset", "config", "split", "revision")}
            for r in records if r.source and r.follows is None}
    if sets:  # a benchmark prompt set (tools/build_prompts.py): which dataset, at which revision, per category
        info["sources"] = dict(sorted(sets.items()))
    if N > 1:
        info["part"] = {"num_shards": N, "shard_index": part}
    turns = LaterTurns({r.id: r for r in mine}, tokenizer) if later else None
    return Prompts(records, prompt_ids, groups, info, turns)


def built_prompt_set(a: Any) -> str:
    """``--prompt-set``: the preset's prompts built with the target's tokenizer into ``<out>.prompts.jsonl``
    beside the cache (the same file ``tools/build_prompts.py`` writes; built again identically on a resume)."""
    from ...common.fileio import atomic_write_text
    from ..prompt_sets import PromptSetError, build_records, preset

    try:
        p = preset(a.prompt_set)
    except PromptSetError as e:
        raise PrecomputeError(f"--prompt-set: {e}") from None
    if a.prompt_max_samples is not None and a.prompt_max_samples < 1:
        raise PrecomputeError(f"--prompt-max-samples {a.prompt_max_samples}: give a positive number of rows per set")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.target, trust_remote_code=False)
    try:
        records = build_records(p, tokenizer, data_dir=a.prompt_data_dir, max_samples=a.prompt_max_samples,
                                data_flag="--prompt-data-dir")
    except PromptSetError as e:
        raise PrecomputeError(f"--prompt-set {a.prompt_set}: {e}") from None
    out = output_path(a.out)
    path = out.parent / f"{out.name}.prompts.jsonl"
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    logger.info(f"--prompt-set {p.name}: {len(records)} prompts written to {path}")
    return str(path)


