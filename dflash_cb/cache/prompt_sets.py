"""The DFlash authors' benchmark prompt sets, as data: which rows of which dataset, formatted how.

Two protocols (docs/precompute.md, "Build the authors' prompt sets"):

- ``dflash-paper``: z-lab/dflash at 98bde5f (``model/utils.py``, ``benchmark.py``, ``run_benchmark.sh``),
  the protocol of the published table (``configs/baselines/published.yaml``): ten sets; a set larger than
  its sample count is subsampled by ``datasets``' ``Dataset.shuffle(seed=0)`` then its first n rows; the
  prompt text is encoded with the tokenizer's special tokens (``tokenizer.encode(text)``).
- ``dflash-0.1``: the ``dflash`` 0.1.0 package (``dflash.benchmark``): five sets; every set is put in the
  order of ``random.Random(42).shuffle`` and its first n rows kept (all by default); the prompt text is
  encoded without special tokens.

Both apply the target tokenizer's chat template with the generation prompt and ``enable_thinking=False``,
each turn a user message, no system prompt. mt-bench has two turns: the second is asked after the
assistant's answer to the first (the target's greedy completion, decoded without special tokens), and each
turn is a request of its own in the request mean (docs/method.md, "Conventions").

``datasets`` (the ``prompts`` extra) is imported only by the functions that read datasets.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..common.errors import DFlashCBError
from .prompts import PromptRecord
from .target import canonical_sha256

CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}  # both protocols: thinking off
SOURCE_FILE = "source.json"  # in each set's folder under --data-dir: where and at which revision it came from
HUB = "https://huggingface.co/datasets"


class PromptSetError(DFlashCBError, ValueError):
    """A preset, a dataset or a built prompt set cannot be used as asked; the message says how to fix it."""


# How a preset picks and orders a set's rows: the paper's datasets shuffle(seed=0) where a set is larger than
# its count, or dflash 0.1.0's random.Random(42) order of every set.
Selection = Literal["shuffle-seed-0-if-larger", "random-42"]
Row = Mapping[str, Any]
Formatter = Callable[[Row], list[str]]  # a dataset row -> the user turns


@dataclass(frozen=True)
class PromptSet:
    """One benchmark of a preset: where its rows come from and how a row becomes user turns."""

    category: str  # as configs/baselines/published.yaml names the benchmark
    dataset: str  # Hugging Face dataset id (for ``files`` sets: the repository holding them)
    config: str | None
    split: str
    fields: tuple[str, ...]  # the row fields ``format`` reads (checked before any prompt is built)
    format: Formatter
    samples: int | None  # the authors' sample count for this set (None: every row)
    revision: str | None = None  # the dataset revision pinned; None: recorded from the data, not checked
    files: tuple[str, ...] = ()  # json-lines files of the repository, read in this order, instead of a split


@dataclass(frozen=True)
class Preset:
    name: str
    citation: str
    sets: tuple[PromptSet, ...]
    selection: Selection
    add_special_tokens: bool  # how the templated text is encoded
    needs_thinking_switch: bool  # a chat template without enable_thinking is refused (0.1's --reasoning off)

    def set(self, category: str) -> PromptSet:
        for s in self.sets:
            if s.category == category:
                return s
        raise PromptSetError(f"preset {self.name!r} has no set {category!r}; it has "
                             f"{[s.category for s in self.sets]}")


# ---------------------------------------------------------------------------------------------------------
# Row formats: the authors' wording (the prompt text is the protocol); the structure is ours.

_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
_SWE = "Problem Statement:\n{}\nPlease fix the issue described above."
_LCB_INSTRUCTION = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests. You will NOT "
    "return anything except for the program"
)


def _field(name: str, wrap: str = "{}") -> Formatter:
    return lambda row: [wrap.format(row[name])]


def _boxed(name: str) -> Formatter:
    return lambda row: [str(row[name]) + _BOXED]


def _turns(row: Row) -> list[str]:
    """mt-bench's ``prompt``: a list of user turns; a string (a copy saved with one turn) is one turn, not a turn
    per character."""
    turns = row["prompt"]
    return [turns] if isinstance(turns, str) else [str(t) for t in turns]


def _alpaca(row: Row) -> list[str]:
    extra = row["input"]
    return [f"{row['instruction']}\n\nInput:\n{extra}" if extra else str(row["instruction"])]


def _livecodebench(row: Row) -> list[str]:
    starter = row.get("starter_code")
    if starter:
        how, code = "### Format: Use the following code structure:", f"```python\n{starter}\n```"
    else:
        how, code = "### Format: Write your code in the following format:", "```python\n# YOUR CODE HERE\n```"
    parts = [_LCB_INSTRUCTION, f"### Question:\n{row['question_content']}", f"{how}\n{code}",
             "### Answer: (use the provided format with backticks)"]
    return ["\n\n".join(parts)]


_GSM8K = dict(category="gsm8k", dataset="openai/gsm8k", config="main", split="test", fields=("question",),
              format=_boxed("question"))
_MATH500 = dict(category="math500", dataset="HuggingFaceH4/MATH-500", config=None, split="test",
                fields=("problem",), format=_boxed("problem"))
_HUMANEVAL_SET = dict(category="humaneval", dataset="openai/openai_humaneval", config=None, split="test",
                      fields=("prompt",), format=_field("prompt", _HUMANEVAL))
_MBPP = dict(category="mbpp", dataset="google-research-datasets/mbpp", config="sanitized", split="test",
             fields=("prompt",), format=_field("prompt"))
_MT_BENCH = dict(category="mt-bench", dataset="HuggingFaceH4/mt_bench_prompts", config=None, split="train",
                 fields=("prompt",), format=_turns)

# Sample counts: run_benchmark.sh at 98bde5f (the published table's runs).
PAPER = Preset(
    name="dflash-paper",
    citation="z-lab/dflash 98bde5f1a6e23bce24a195815d6213a0e2b52fed: model/utils.py load_and_process_dataset, "
             "benchmark.py, run_benchmark.sh",
    sets=(
        PromptSet(**_GSM8K, samples=128),
        PromptSet(**_MATH500, samples=128),
        PromptSet("aime24", "HuggingFaceH4/aime_2024", None, "train", ("problem",), _boxed("problem"), 30),
        PromptSet("aime25", "MathArena/aime_2025", None, "train", ("problem",), _boxed("problem"), 30),
        PromptSet(**_HUMANEVAL_SET, samples=164),
        PromptSet(**_MBPP, samples=128),
        PromptSet("livecodebench", "livecodebench/code_generation_lite", None, "test",
                  ("question_content", "starter_code"), _livecodebench, 128,
                  files=tuple(f"test{i}.jsonl" for i in ("", 2, 3, 4, 5, 6))),
        PromptSet("swe-bench", "princeton-nlp/SWE-bench_Lite", None, "test", ("problem_statement",),
                  _field("problem_statement", _SWE), 128),
        PromptSet(**_MT_BENCH, samples=80),
        PromptSet("alpaca", "tatsu-lab/alpaca", None, "train", ("instruction", "input"), _alpaca, 128),
    ),
    selection="shuffle-seed-0-if-larger",
    add_special_tokens=True,  # benchmark.py: tokenizer.encode(input_text) with its defaults
    needs_thinking_switch=False,  # it passes enable_thinking=False whatever the template
)

# dflash 0.1.0's CLI takes every row unless --max-samples is given.
PACKAGE_0_1 = Preset(
    name="dflash-0.1",
    citation="dflash 0.1.0 (PyPI): dflash/benchmark.py DATASETS, load_and_process_dataset, _select_dataset, "
             "apply_chat_template with --reasoning off",
    sets=tuple(PromptSet(**s, samples=None) for s in (_GSM8K, _MATH500, _HUMANEVAL_SET, _MBPP, _MT_BENCH)),
    selection="random-42",
    add_special_tokens=False,  # _run_transformers: tokenizer.encode(text, add_special_tokens=False)
    needs_thinking_switch=True,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (PAPER, PACKAGE_0_1)}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PromptSetError(f"unknown preset {name!r}; use one of {sorted(PRESETS)}")
    return PRESETS[name]


# ---------------------------------------------------------------------------------------------------------
# Selection


def selected_rows(p: Preset, n_rows: int, count: int | None) -> list[int]:
    """The rows of a set of ``n_rows`` rows that ``p`` benchmarks, in the order it runs them."""
    if p.selection == "random-42":
        order = list(range(n_rows))
        random.Random(42).shuffle(order)
        return order if count is None else order[:count]
    if count is None or n_rows <= count:
        return list(range(n_rows))
    from datasets import Dataset

    # The permutation of Dataset.shuffle depends on the length and the seed only: shuffle the row numbers.
    rows = Dataset.from_dict({"row": list(range(n_rows))}).shuffle(seed=0).select(range(count))
    return [int(r) for r in rows["row"]]


# ---------------------------------------------------------------------------------------------------------
# Reading the datasets: from the hub, or from a folder saved on a machine that has it


def _check_revision(s: PromptSet, found: str | None, where: str) -> None:
    if s.revision is not None and found != s.revision:
        raise PromptSetError(
            f"{where}: {s.dataset} is at revision {found!r}, the preset pins {s.revision!r}; save the set again "
            f"at the pinned revision (tools/build_prompts.py --save-data on a machine with the hub)")


def _hub_rows(s: PromptSet, revision: str | None) -> Any:
    import datasets

    if s.files:
        ref = revision or "main"
        urls = [f"{HUB}/{s.dataset}/resolve/{ref}/{name}" for name in s.files]
        return datasets.load_dataset("json", data_files={s.split: urls}, split=s.split)
    return datasets.load_dataset(s.dataset, s.config, split=s.split, revision=revision)


def hub_revision(dataset: str) -> str:
    """The dataset repository's current commit on the hub (recorded when the preset pins none)."""
    from huggingface_hub import HfApi

    return str(HfApi().dataset_info(dataset).sha)


def _from_hub(s: PromptSet, data_flag: str = "--data-dir") -> tuple[Any, str]:
    """The rows of ``s`` from the hub and the revision read: the pinned one, else the current one. ``data_flag``:
    the caller's option that reads saved sets instead, named in the error."""
    try:
        revision = s.revision or hub_revision(s.dataset)
        return _hub_rows(s, revision), revision
    except Exception as e:  # network, authentication, a missing revision: each library raises its own
        raise PromptSetError(
            f"{s.dataset} ({s.category}): cannot read it from the Hugging Face hub ({type(e).__name__}: {e}); "
            "where the hub cannot be reached, save the sets on a machine that reaches it "
            f"(tools/build_prompts.py --save-data DIR) and build with {data_flag} DIR") from e


def load_set(s: PromptSet, data_dir: str | Path | None = None,
             data_flag: str = "--data-dir") -> tuple[Any, str | None]:
    """The rows of ``s`` (a ``datasets.Dataset``) and the revision they are at.

    From ``data_dir/<category>`` when given (saved by ``save_set``, its revision in ``source.json``),
    else from the hub at the pinned revision (or the current one, recorded)."""
    import datasets

    if data_dir is None:
        rows, revision = _from_hub(s, data_flag)
    else:
        folder = Path(data_dir) / s.category
        if not (folder / SOURCE_FILE).is_file():
            raise PromptSetError(
                f"{folder}: no saved set here ({SOURCE_FILE} missing); prepare it on a machine with the hub: "
                f"tools/build_prompts.py --preset <name> --save-data {data_dir}")
        try:
            source = json.loads((folder / SOURCE_FILE).read_text())
            if not isinstance(source, dict):
                raise ValueError(f"a JSON {type(source).__name__}, not an object")
        except (OSError, ValueError) as e:
            raise PromptSetError(f"{folder}/{SOURCE_FILE}: not a readable saved set's record ({e}); save the set "
                                 f"again: tools/build_prompts.py --preset <name> --save-data {data_dir}") from None
        if source.get("dataset") != s.dataset or source.get("split") != s.split or source.get("config") != s.config:
            raise PromptSetError(
                f"{folder}/{SOURCE_FILE}: holds {source.get('dataset')} {source.get('config')} "
                f"{source.get('split')}, the preset reads {s.dataset} {s.config} {s.split}; save the set again")
        revision = source.get("revision")
        _check_revision(s, revision, f"{folder}/{SOURCE_FILE}")
        rows = datasets.load_from_disk(str(folder))
    missing = [f for f in s.fields if f not in rows.column_names]
    if missing:
        raise PromptSetError(f"{s.dataset} ({s.category}): the rows have no field(s) {missing} (fields: "
                             f"{rows.column_names}); wrong dataset or revision?")
    return rows, revision


def save_set(s: PromptSet, data_dir: str | Path) -> Path:
    """Save ``s`` from the hub into ``data_dir/<category>`` (``Dataset.save_to_disk``) with its source."""
    from ..common.fileio import atomic_write_json

    rows, revision = _from_hub(s)
    folder = Path(data_dir) / s.category
    (folder / SOURCE_FILE).unlink(missing_ok=True)  # written last: a save cut short is no saved set
    rows.save_to_disk(str(folder))
    atomic_write_json(folder / SOURCE_FILE, {"dataset": s.dataset, "config": s.config, "split": s.split,
                                             "revision": revision, "files": list(s.files)})
    return folder


# ---------------------------------------------------------------------------------------------------------
# Templates and the tokenizer they were applied with


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of what makes a tokenizer encode and template the same: vocabulary, added and special tokens,
    chat template. Equal for the same tokenizer saved anywhere."""
    data = {"vocab": tokenizer.get_vocab(), "special": tokenizer.special_tokens_map,
            "chat_template": tokenizer.chat_template,
            "bos": tokenizer.bos_token, "eos": tokenizer.eos_token}
    return "sha256:" + canonical_sha256(json.loads(json.dumps(data, default=str)))


def conversation(turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of turn ``len(answers) + 1``: every earlier turn with its answer, then the next user turn."""
    if len(answers) >= len(turns):
        raise PromptSetError(f"{len(answers)} answers for {len(turns)} turns: nothing left to ask")
    messages: list[dict[str, str]] = []
    for user, answer in zip(turns, [*answers, None], strict=False):  # answers stop one turn short
        messages.append({"role": "user", "content": user})
        if answer is None:
            break
        messages.append({"role": "assistant", "content": answer})
    return messages


def turn_prompt(p: Preset, tokenizer: Any, turns: Sequence[str], answers: Sequence[str] = ()) -> tuple[str, list[int]]:
    """The text and token ids of the next turn's prompt, as ``p``'s benchmark builds them."""
    template = str(tokenizer.chat_template or "")
    if not template:
        raise PromptSetError("the tokenizer has no chat template; give the target's own tokenizer (--tokenizer)")
    if p.needs_thinking_switch and "enable_thinking" not in template:
        raise PromptSetError(f"{p.name}: the tokenizer's chat template has no enable_thinking switch, which "
                             "--reasoning off requires; use the dflash-paper preset or a thinking-aware target")
    text = tokenizer.apply_chat_template(conversation(turns, answers), tokenize=False, add_generation_prompt=True,
                                         **CHAT_TEMPLATE_KWARGS)
    return text, [int(t) for t in tokenizer.encode(text, add_special_tokens=p.add_special_tokens)]


def answer_text(tokenizer: Any, completion_ids: Sequence[int]) -> str:
    """A turn's answer as the next turn sees it: the greedy completion decoded without special tokens."""
    return tokenizer.decode(list(completion_ids), skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------
# Building the records of a prompt file (dflash_cb/cache/prompts.py format)


def build_records(p: Preset, tokenizer: Any, *, data_dir: str | Path | None = None, max_samples: int | None = None,
                  categories: Sequence[str] | None = None, data_flag: str = "--data-dir") -> list[dict[str, Any]]:
    """One prompt record per selected row of every set (turn 1's token ids; all turns kept in ``turns``);
    ``data_flag``: the caller's option for ``data_dir``, named where the hub cannot be reached."""
    identity = tokenizer_identity(tokenizer)
    chosen = [p.set(c) for c in categories] if categories else list(p.sets)
    records: list[dict[str, Any]] = []
    for s in chosen:
        rows, revision = load_set(s, data_dir, data_flag)
        count = max_samples if max_samples is not None else s.samples
        for row in selected_rows(p, len(rows), count):
            turns = s.format(rows[row])
            _, ids = turn_prompt(p, tokenizer, turns)
            source = {"preset": p.name, "dataset": s.dataset, "config": s.config, "split": s.split,
                      "revision": revision, "row": row}
            if s.files:
                source["files"] = list(s.files)
            records.append({"id": f"{s.category}-{row:05d}", "category": s.category, "input_ids": ids,
                            "turns": turns, "source": source, "tokenizer": identity})
    return records


def later_turns(records: Sequence[PromptRecord]) -> list[PromptRecord]:
    """Every later turn of the multi-turn records as a sample of its own (``<id>.t2``, ...), placed after the
    file's records; its prompt is built when the turn before has its completion (``turn_prompt``)."""
    taken = {r.id for r in records}
    out: list[PromptRecord] = []
    for r in records:
        if not r.turns or len(r.turns) < 2:
            continue
        name = (r.source or {}).get("preset")
        if name not in PRESETS:
            raise PromptSetError(f"line {r.line}: prompt {r.id!r} has {len(r.turns)} turns but no 'source.preset' "
                                 f"naming how to build them (one of {sorted(PRESETS)}); build the file with "
                                 "tools/build_prompts.py")
        before = r.id
        for turn in range(2, len(r.turns) + 1):
            sid = f"{r.id}.t{turn}"
            if sid in taken:
                raise PromptSetError(f"line {r.line}: prompt {r.id!r}'s turn {turn} would be sample {sid!r}, "
                                     "which the file already uses; rename that prompt")
            taken.add(sid)
            out.append(dataclasses.replace(r, id=sid, index=len(records) + len(out), input_ids=None, messages=None,
                                           text=None, source={**(r.source or {}), "turn": turn}, follows=before))
            before = sid
    return out


def earlier_turns(records: Mapping[str, PromptRecord], r: PromptRecord) -> list[str]:
    """The samples of the turns before ``r``, first turn first."""
    chain: list[str] = []
    sid = r.follows
    while sid is not None:
        chain.append(sid)
        sid = records[sid].follows
    return chain[::-1]


def check_tokenizer(recorded: set[str], tokenizer: Any, where: str) -> None:
    """Refuse a prompt set built with another tokenizer than the one the target will be run with."""
    found = tokenizer_identity(tokenizer)
    other = sorted(recorded - {found})
    if other:
        raise PromptSetError(
            f"{where}: the prompts were built with tokenizer {other[0]}, the target's is {found}; build them "
            "again for this target: tools/build_prompts.py --tokenizer <the target's folder>")
