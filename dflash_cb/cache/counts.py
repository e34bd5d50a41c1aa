"""Small value checks shared by the servers' counters (``served``, ``vllm_counters``)."""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> bool:
    """Whether ``value`` can go into the manifest as it is (finite numbers, strings, lists, objects)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)  # the manifest must stay valid JSON
    if isinstance(value, (list, tuple)):
        return all(json_safe(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_safe(v) for k, v in value.items())
    return False


def whole_count(v: Any) -> int | None:
    """``v`` as a count (a whole number >= 0; a float like 3.0 is one), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < 0:
        return None
    return int(v)


def clip(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# The rules every server's round counts obey (SGLang's and vLLM's, in their own field names).

def too_many_rounds(rounds: int, completion_tokens: int, field: str) -> str | None:
    """Every round commits at least one token, and the prefill's first token belongs to none."""
    committed = completion_tokens - 1
    if rounds <= committed:
        return None
    return (f"impossible {field}: {rounds} rounds for {committed} tokens committed by rounds (served tau "
            f"{committed / rounds:.3f} < 1): every round commits at least one token")


def too_few_drafts(completion_tokens: int, drafts: int, rounds: int, field: str, kind: str) -> str | None:
    """A round commits at most its ``kind`` drafts (correct, accepted) + 1 (the bonus token)."""
    committed = completion_tokens - 1
    if committed <= drafts + rounds:
        return None
    return (f"impossible {field}: {committed} tokens committed by {rounds} rounds with {drafts} {kind} drafts: a "
            f"round commits at most its {kind} drafts + 1")
