"""Prompt-set parsing, validation and tokenization (with a real, offline-built tokenizer)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tiny_target import TINY_WORDS, tiny_tokenizer
from transformers import PreTrainedTokenizerFast

from dflash_cb.cache.prompts import (
    PromptFileError,
    PromptRecord,
    check_lengths,
    load_prompts,
    needs_tokenizer,
    tokenize_prompt,
)

REPO = Path(__file__).resolve().parents[2]
EVAL_V1 = REPO / "configs" / "prompts" / "eval_v1.jsonl"
CATEGORIES = ("math", "code", "reasoning", "writing", "chat", "multiturn")

USER = [{"role": "user", "content": "hello"}]


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def obj(**kw: Any) -> str:
    return json.dumps(kw)


# -- parsing ------------------------------------------------------------------------------


def test_load_all_kinds_and_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        obj(id="a", category="math", messages=USER),
        "",
        "   ",
        obj(id="b", text="hello world"),
        obj(id="c", input_ids=[0, 5, 9]),
    )
    recs = load_prompts(path)
    assert [r.id for r in recs] == ["a", "b", "c"]
    assert [r.index for r in recs] == [0, 1, 2]
    assert [r.line for r in recs] == [1, 4, 5]  # blank lines skipped but counted
    assert recs[0].category == "math" and recs[0].messages == USER
    assert recs[1].category == "uncategorized" and recs[1].text == "hello world"
    assert recs[2].input_ids == [0, 5, 9] and recs[2].messages is None and recs[2].text is None
    assert needs_tokenizer(recs)
    assert not needs_tokenizer(recs[2:])
    with pytest.raises(AttributeError):  # frozen
        recs[0].id = "x"  # type: ignore[misc]


BAD_CASES = [
    # (line 2 content, expected fragment of the message)
    ("{not json", "invalid JSON"),
    ("[1, 2, 3]", "must be a JSON object"),
    ('"just a string"', "must be a JSON object"),
    (obj(messages=USER), "missing 'id'"),
    (obj(id="", messages=USER), "'id' is empty"),
    (obj(id="   ", messages=USER), "'id' is empty"),
    (obj(id=7, messages=USER), "'id' must be a string"),
    (obj(id="first", messages=USER), "duplicate id 'first' (first seen on line 1); ids must be unique"),
    (obj(id="x"), "exactly one of 'messages', 'text' or 'input_ids' (found: none)"),
    (
        obj(id="x", text="a", input_ids=[1]),
        "exactly one of 'messages', 'text' or 'input_ids' (found: text, input_ids)",
    ),
    (obj(id="x", text="a", prompt="b"), "unknown field(s) ['prompt']"),
    (obj(id="x", category=3, text="a"), "'category' must be a non-empty string"),
    (obj(id="x", text=["a"]), "'text' must be a string"),
    (obj(id="x", text=""), "'text' is empty"),
    (obj(id="x", input_ids=[]), "'input_ids' is empty"),
    (obj(id="x", input_ids="1 2 3"), "'input_ids' must be a list"),
    (obj(id="x", input_ids=[1, -2]), "input_ids[1] = -2 is negative"),
    (obj(id="x", input_ids=[1, 2.5]), "input_ids[1] = 2.5 is not an integer"),
    (obj(id="x", input_ids=[1, True]), "input_ids[1] = True is not an integer"),
    (obj(id="x", messages="hello"), "'messages' must be a list"),
    (obj(id="x", messages=[]), "'messages' is empty"),
    (obj(id="x", messages=["hello"]), "messages[0] must be an object"),
    (obj(id="x", messages=[{"content": "hi"}]), "messages[0] needs a non-empty string 'role'"),
    (obj(id="x", messages=[{"role": "robot", "content": "hi"}]), "unknown role 'robot'"),
    (obj(id="x", messages=[{"role": "user"}]), "messages[0] (user) has no 'content'"),
    (obj(id="x", messages=[{"role": "user", "content": 5}]), "'content' must be a string"),
    (
        obj(id="x", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
        "the last message is from the assistant",
    ),
]


@pytest.mark.parametrize(("line", "fragment"), BAD_CASES)
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = write(tmp_path, obj(id="first", messages=USER), line)
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    msg = str(info.value)
    assert f"{path}:2:" in msg
    assert "prompts.jsonl" in msg
    assert fragment in msg


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "", "  ")
    with pytest.raises(PromptFileError, match="no prompts found") as info:
        load_prompts(path)
    assert "prompts.jsonl" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_error_is_a_value_error() -> None:
    assert issubclass(PromptFileError, ValueError)


# -- tokenization ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


def rec(**kw: Any) -> PromptRecord:
    return PromptRecord(**{"id": "p", "category": "chat", "index": 0, "line": 3, **kw})


def ids(*words: str) -> list[int]:
    return [TINY_WORDS.index(w) for w in words]


def test_tokenize_input_ids_needs_no_tokenizer() -> None:
    assert tokenize_prompt(rec(input_ids=[4, 5, 6]), None, {}) == [4, 5, 6]


def test_tokenize_text(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenize_prompt(rec(text="what is 2 + 2 ?"), tokenizer, {}) == ids(
        "what", "is", "2", "+", "2", "?"
    )


def test_tokenize_messages_honours_enable_thinking(tokenizer: PreTrainedTokenizerFast) -> None:
    msgs = [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hello world"}]
    r = rec(messages=msgs)
    base = ids(
        "<|im_start|>", "system", "you", "are", "helpful", "<|im_end|>",
        "<|im_start|>", "user", "hello", "world", "<|im_end|>",
        "<|im_start|>", "assistant",
    )  # fmt: skip
    thinking = tokenize_prompt(r, tokenizer, {})
    no_thinking = tokenize_prompt(r, tokenizer, {"enable_thinking": False})
    assert thinking == base
    assert tokenize_prompt(r, tokenizer, {"enable_thinking": True}) == base
    assert no_thinking == base + ids("<think>", "</think>")
    assert all(type(t) is int for t in no_thinking)


def test_tokenize_without_tokenizer_or_template(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(PromptFileError, match="needs a tokenizer") as info:
        tokenize_prompt(rec(text="hello"), None, {})
    assert "'p'" in str(info.value) and "line 3" in str(info.value)
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>")
    bare.chat_template = None
    with pytest.raises(PromptFileError, match="no chat_template"):
        tokenize_prompt(rec(messages=USER), bare, {})


def test_check_lengths(tmp_path: Path) -> None:
    a, b = rec(id="short", line=1, input_ids=[1] * 10), rec(id="long-1", line=7, input_ids=[1] * 200)
    check_lengths([(a, a.input_ids), (b, b.input_ids)], 56, 256, "prompts.jsonl")  # exactly fits
    with pytest.raises(PromptFileError) as info:
        check_lengths([(a, a.input_ids), (b, b.input_ids)], 57, 256, "prompts.jsonl")
    msg = str(info.value)
    assert msg.startswith("prompts.jsonl:7:") and "'long-1'" in msg and "257 > " in msg and "256" in msg


# -- the shipped evaluation set -------------------------------------------------------------


def test_shipped_eval_v1(tokenizer: PreTrainedTokenizerFast) -> None:
    recs = load_prompts(EVAL_V1)
    assert len(recs) >= 60
    assert len({r.id for r in recs}) == len(recs)
    counts = Counter(r.category for r in recs)
    for cat in CATEGORIES:
        assert counts[cat] >= 8, f"category {cat!r} has only {counts[cat]} prompts"
    assert set(counts) == set(CATEGORIES)
    for r in recs:
        assert r.messages is not None, r.id
        assert r.id.startswith(r.category + "-"), r.id
        assert all(m["content"].strip() for m in r.messages), r.id
        if r.category == "multiturn":
            assert any(m["role"] == "assistant" for m in r.messages), r.id
        # Every prompt goes through a chat template without error.
        assert tokenize_prompt(r, tokenizer, {"enable_thinking": False})


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    """A model folder without tokenizer files (transformers would load it as an empty tokenizer)."""
    from dflash_cb.cache.prompts import missing_tokenizer_files

    (tmp_path / "config.json").write_text("{}")
    assert "tokenizer.json" in missing_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert missing_tokenizer_files(tmp_path) == []
    assert missing_tokenizer_files("Qwen/Qwen3.6-27B") == []  # a hub id is not checked locally
