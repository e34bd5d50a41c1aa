"""The sample table's text, whatever the tracker shows it in (a W&B table, TensorBoard text): each row one
evaluated sample, its prompt's end, the reference completion and the drafter's blocks per cycle."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

TABLE_COLUMNS = ["step", "sample", "category", "prompt", "reference", "drafter_blocks", "acceptance_lengths", "tau"]

Decoder = Callable[[Sequence[int]], str]


def make_decoder(tokenizer: Any) -> Decoder:
    """``tokenizer``: None (token ids), a Hugging Face tokenizer path or object, or a function ids -> str."""
    if tokenizer is None:
        return lambda ids: " ".join(str(int(t)) for t in ids)
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if hasattr(tokenizer, "decode"):
        tok = tokenizer
        return lambda ids: tok.decode([int(t) for t in ids], skip_special_tokens=False)
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"tokenizer must be a path, an object with decode(), or a function; got {type(tokenizer).__name__}")


def clip(text: str, n: int, left: bool = False) -> str:
    if len(text) <= n:
        return text
    return "…" + text[-n:] if left else text[:n] + "…"


def format_blocks(input_ids: Sequence[int], prompt_len: int, lengths: Sequence[int], drafts: Sequence[Sequence[int]],
                  decode: Decoder, max_chars: int = 2000) -> str:
    """One line per cycle: ``✓«accepted» ✗[rejected drafts] +bonus``.

    Accepted = the leading drafted tokens equal to the reference; the cycle then commits the
    target's token at the first mismatch (the bonus). ``produced`` = accepted + 1, except at the tail.
    """
    lines = []
    p = prompt_len
    for i, (k, block) in enumerate(zip(lengths, drafts, strict=False)):
        ref = list(input_ids[p + 1: p + 1 + len(block)])
        a = 0
        while a < len(block) and a < len(ref) and int(block[a]) == int(ref[a]):
            a += 1
        acc = decode(block[:a]) if a else ""
        rej = decode(block[a:]) if a < len(block) else ""
        bonus = decode(input_ids[p + a + 1: p + a + 2]) if a < k and p + a + 1 < len(input_ids) else ""
        lines.append(f"#{i + 1} @{p} produced {k}: ✓«{acc}» ✗[{rej}]" + (f" +«{bonus}»" if bonus else ""))
        p += k
    return clip("\n".join(lines), max_chars)


def table_row(step: int, sample_id: str, category: str, input_ids: Sequence[int], prompt_len: int,
              lengths: Sequence[int], drafts: Sequence[Sequence[int]] | None, decode: Decoder,
              prompt_tokens: int = 256) -> list[Any]:
    shown = sum(lengths[: len(drafts)]) if drafts else sum(lengths[:4])
    ref_end = min(len(input_ids), prompt_len + max(shown, 1) + 16)
    prompt = decode(input_ids[max(0, prompt_len - prompt_tokens): prompt_len])
    if prompt_len > prompt_tokens:
        prompt = "…" + prompt
    blocks = format_blocks(input_ids, prompt_len, lengths, drafts, decode) if drafts else "(no drafts kept)"
    tau = sum(lengths) / len(lengths) if lengths else math.nan
    return [int(step), sample_id, category, clip(prompt, 2000, left=True),
            clip(decode(input_ids[prompt_len:ref_end]), 2000), blocks,
            clip(" ".join(str(k) for k in lengths), 1000), tau]


def record_rows(step: int, samples: Sequence[Any], decode: Decoder) -> list[list[Any]]:
    """The table rows (``TABLE_COLUMNS``) of an evaluation's samples (``sinks.TableSample``)."""
    return [table_row(step, s.id, s.category, s.input_ids, s.prompt_len, s.acceptance_lengths, s.drafts, decode)
            for s in samples]
