"""Prompt-set JSONL files: parsing, validation and tokenization.

One JSON object per line::

    {"id": "math-001", "category": "math", "messages": [{"role": "user", "content": "..."}]}

Exactly one of ``messages``, ``text`` or ``input_ids`` gives the prompt. A prompt set built from the authors'
benchmarks (``prompt_sets.py``, tools/build_prompts.py) adds ``turns`` (every user turn, the first being the
prompt), ``source`` (dataset, revision, row) and ``tokenizer`` (the identity of the tokenizer that built the
token ids: another target's is refused). Every error
names the file and the line and says how to fix it, because these files are written
by hand and a vague error costs a precompute run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.errors import DFlashCBError

DEFAULT_CATEGORY = "uncategorized"
PROMPT_FIELDS = ("messages", "text", "input_ids")
PROVENANCE_FIELDS = ("turns", "source", "tokenizer")  # written by tools/build_prompts.py
KNOWN_FIELDS = frozenset({"id", "category", *PROMPT_FIELDS, *PROVENANCE_FIELDS})
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class PromptFileError(DFlashCBError, ValueError):
    """A prompt file (or one of its records) is invalid; the message says where and how to fix it."""


# One rule for sample ids, in the prompt file and in every id list a tool takes (``--sample-ids a,b``):
# an id the precompute accepts can always be selected again, so no commas and no spaces.
ID_RULE = "a letter or digit, then letters, digits and . _ : / - (no spaces, no commas)"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def id_problem(value: str) -> str | None:
    """Why ``value`` is not a valid sample id, or None when it is."""
    return None if _ID_RE.fullmatch(value) else f"{value!r} does not follow the id rule: {ID_RULE}"


def parse_id_list(text: str, name: str) -> list[str]:
    """A comma-separated id list from the command line (spaces around commas allowed), each id under the
    prompt file's rule; the list rule itself (non-blank, at least one) is ``arguments.parse_str_list``."""
    from ..common.arguments import parse_str_list

    ids = parse_str_list(name, text)
    bad = [problem for problem in map(id_problem, ids) if problem]
    if bad:
        raise PromptFileError(f"{name} {text!r}: {bad[0]}")
    return ids


@dataclass(frozen=True)
class PromptRecord:
    id: str
    category: str
    index: int  # 0-based position among the records of the file
    line: int  # 1-based line number in the file
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    turns: list[str] | None = None  # a benchmark's user turns (mt-bench: two); the prompt is the first one's
    source: dict[str, Any] | None = None  # where a benchmark prompt came from (dataset, revision, row)
    tokenizer: str | None = None  # prompt_sets.tokenizer_identity of the tokenizer that built input_ids
    follows: str | None = None  # a later turn (prompt_sets.later_turns): the sample answering the turn before

    @property
    def kind(self) -> str:
        """Which prompt field this record uses: 'messages', 'text' or 'input_ids'."""
        if self.messages is not None:
            return "messages"
        if self.text is not None:
            return "text"
        return "input_ids"


def _where(path: str | os.PathLike[str], line: int | None = None) -> str:
    name = os.fspath(path)
    return f"{name}:{line}" if line is not None else name


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a token id is almost certainly a typo.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise PromptFileError(
            f'{where}: \'messages\' must be a list of {{"role", "content"}} objects, '
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise PromptFileError(f"{where}: 'messages' is empty; give at least one user message")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise PromptFileError(
                f"{where}: messages[{i}] must be an object with 'role' and 'content', "
                f"got {type(msg).__name__}"
            )
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise PromptFileError(f"{where}: messages[{i}] needs a non-empty string 'role' (e.g. \"user\")")
        if role not in MESSAGE_ROLES:
            raise PromptFileError(
                f"{where}: messages[{i}] has unknown role {role!r}; use one of {sorted(MESSAGE_ROLES)}"
            )
        if "content" not in msg:
            raise PromptFileError(f"{where}: messages[{i}] ({role}) has no 'content'; add the message text")
        content = msg["content"]
        # Multimodal-style content lists are allowed by chat templates; plain text is the common case.
        if not isinstance(content, str | list):
            raise PromptFileError(
                f"{where}: messages[{i}] ({role}) 'content' must be a string, got {type(content).__name__}"
            )
        out.append(dict(msg))
    if out[-1]["role"] == "assistant":
        raise PromptFileError(
            f"{where}: the last message is from the assistant; end with a user turn so the "
            "model has something to answer (the generation prompt is added for you)"
        )
    return out


def parse_record(obj: Any, *, index: int, line: int, path: str | os.PathLike[str]) -> PromptRecord:
    """Validate one decoded JSON value and build its PromptRecord."""
    where = _where(path, line)
    if not isinstance(obj, dict):
        raise PromptFileError(
            f'{where}: each line must be a JSON object like {{"id": ..., "messages": [...]}}, '
            f"got {type(obj).__name__}"
        )
    if "id" not in obj:
        raise PromptFileError(f"{where}: missing 'id'; give every prompt a unique non-empty string id")
    pid = obj["id"]
    if not isinstance(pid, str):
        raise PromptFileError(f"{where}: 'id' must be a string, got {type(pid).__name__} {pid!r}; quote it")
    if not pid.strip():
        raise PromptFileError(f"{where}: 'id' is empty; give every prompt a unique non-empty string id")
    problem = id_problem(pid)
    if problem:
        raise PromptFileError(f"{where}: 'id' {problem}; tools select samples by comma-separated ids")

    category = obj.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise PromptFileError(
            f"{where}: prompt {pid!r}: 'category' must be a non-empty string (or omit it for "
            f"{DEFAULT_CATEGORY!r})"
        )

    present = [f for f in PROMPT_FIELDS if f in obj]
    if len(present) != 1:
        found = ", ".join(present) if present else "none"
        raise PromptFileError(
            f"{where}: prompt {pid!r} must have exactly one of 'messages', 'text' or 'input_ids' "
            f"(found: {found})"
        )
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        raise PromptFileError(
            f"{where}: prompt {pid!r} has unknown field(s) {unknown}; allowed: {sorted(KNOWN_FIELDS)}"
        )

    messages = text = input_ids = None
    field = present[0]
    value = obj[field]
    if field == "messages":
        messages = _check_messages(value, f"{where}: prompt {pid!r}")
    elif field == "text":
        if not isinstance(value, str):
            raise PromptFileError(
                f"{where}: prompt {pid!r}: 'text' must be a string, got {type(value).__name__}"
            )
        if not value:
            raise PromptFileError(f"{where}: prompt {pid!r}: 'text' is empty; give the prompt text")
        text = value
    else:
        if not isinstance(value, list):
            raise PromptFileError(
                f"{where}: prompt {pid!r}: 'input_ids' must be a list of token ids, got {type(value).__name__}"
            )
        if not value:
            raise PromptFileError(
                f"{where}: prompt {pid!r}: 'input_ids' is empty; give at least one token id"
            )
        for i, tok in enumerate(value):
            if not _is_int(tok):
                raise PromptFileError(
                    f"{where}: prompt {pid!r}: input_ids[{i}] = {tok!r} is not an integer; "
                    "token ids must be non-negative integers"
                )
            if tok < 0:
                raise PromptFileError(
                    f"{where}: prompt {pid!r}: input_ids[{i}] = {tok} is negative; "
                    "token ids must be non-negative integers"
                )
        input_ids = list(value)
    turns = obj.get("turns")
    if turns is not None and (not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns)):
        raise PromptFileError(f"{where}: prompt {pid!r}: 'turns' must be a non-empty list of strings (the user "
                              "turns); build the file again with tools/build_prompts.py")
    source = obj.get("source")
    if source is not None and not isinstance(source, dict):
        raise PromptFileError(f"{where}: prompt {pid!r}: 'source' must be an object (dataset, revision, row)")
    tok = obj.get("tokenizer")
    if tok is not None and not isinstance(tok, str):
        raise PromptFileError(f"{where}: prompt {pid!r}: 'tokenizer' must be a string (the tokenizer's identity)")
    return PromptRecord(
        id=pid, category=category, index=index, line=line, messages=messages, text=text, input_ids=input_ids,
        turns=turns, source=source, tokenizer=tok,
    )


def load_prompts(path: str | os.PathLike[str]) -> list[PromptRecord]:
    """Read and validate a prompt-set JSONL file. Blank lines are skipped."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"{_where(path)}: prompt file not found; check the path") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{_where(path)}: not valid UTF-8 ({exc}); save the file as UTF-8") from None

    records: list[PromptRecord] = []
    first_seen: dict[str, int] = {}
    for lineno, text in enumerate(raw.splitlines(), start=1):
        if not text.strip():
            continue
        where = _where(path, lineno)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptFileError(
                f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one complete "
                "JSON object"
            ) from None
        rec = parse_record(obj, index=len(records), line=lineno, path=path)
        if rec.id in first_seen:
            raise PromptFileError(
                f"{where}: duplicate id {rec.id!r} (first seen on line {first_seen[rec.id]}); ids must be unique"
            )
        first_seen[rec.id] = lineno
        records.append(rec)
    if not records:
        raise PromptFileError(
            f"{_where(path)}: no prompts found; the file is empty (one JSON object per line)"
        )
    return records


def needs_tokenizer(records: Iterable[PromptRecord]) -> bool:
    """True when any record is given as text or chat messages rather than token ids."""
    return any(r.input_ids is None for r in records)


# Files one of which a Hugging Face tokenizer folder holds (fast tokenizer, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def missing_tokenizer_files(path: str | os.PathLike[str]) -> list[str]:
    """The tokenizer files a local folder lacks (all of ``TOKENIZER_FILES``), or [] if it has one.

    Needed because ``AutoTokenizer`` loads a folder holding only ``config.json`` without complaint,
    as a tokenizer with an empty vocabulary: every text then "tokenizes to no tokens". A hub id
    (not a local folder) is not checked here.
    """
    folder = Path(path)
    if not folder.is_dir():
        return []
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return []
    return list(TOKENIZER_FILES)


def _to_id_list(value: Any) -> list[int]:
    """Normalise what apply_chat_template returns (list, nested list, tensor, dict/BatchEncoding)."""
    if isinstance(value, Mapping) or (hasattr(value, "keys") and "input_ids" in value):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    value = list(value)
    if len(value) == 1 and isinstance(value[0], list | tuple):
        value = list(value[0])  # batch of one
    if not all(_is_int(t) for t in value):
        raise TypeError(f"expected a flat list of token ids, got {value[:5]!r}...")
    return [int(t) for t in value]


def tokenize_prompt(
    record: PromptRecord, tokenizer: Any, chat_template_kwargs: Mapping[str, Any]
) -> list[int]:
    """Token ids of one prompt.

    ``input_ids`` are used as given. ``text`` is encoded without special tokens so the file
    controls exactly what the model sees. ``messages`` go through the chat template with
    the generation prompt added; ``chat_template_kwargs`` (e.g. ``enable_thinking``) are
    passed explicitly because the template defaults change what the target generates.
    """
    if record.input_ids is not None:
        return list(record.input_ids)
    where = f"prompt {record.id!r} (line {record.line})"
    if tokenizer is None:
        raise PromptFileError(
            f"{where} is given as {record.kind}, which needs a tokenizer; load the target's tokenizer "
            "or give the prompt as 'input_ids'"
        )
    if record.text is not None:
        return [int(t) for t in tokenizer.encode(record.text, add_special_tokens=False)]
    if not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(
            f"{where} is given as chat messages but the tokenizer has no chat_template; use the "
            "target's chat tokenizer or give the prompt as 'text'/'input_ids'"
        )
    out = tokenizer.apply_chat_template(
        record.messages, tokenize=True, add_generation_prompt=True, **dict(chat_template_kwargs)
    )
    ids = _to_id_list(out)
    if not ids:
        raise PromptFileError(f"{where}: the chat template produced no tokens; check the messages")
    return ids


def check_lengths(
    records_with_ids: Sequence[tuple[PromptRecord, Sequence[int]]],
    max_new_tokens: int,
    max_positions: int,
    path: str | os.PathLike[str],
) -> None:
    """Fail when a prompt plus its completion would not fit in the model's positions."""
    for rec, ids in records_with_ids:
        total = len(ids) + max_new_tokens
        if total > max_positions:
            raise PromptFileError(
                f"{_where(path, rec.line)}: prompt {rec.id!r} has {len(ids)} tokens; with max_new_tokens="
                f"{max_new_tokens} that is {total} > the model's max positions {max_positions}; shorten the "
                f"prompt or lower max_new_tokens to {max(max_positions - len(ids), 0)}"
            )
