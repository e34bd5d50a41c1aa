"""The greedy loop's rules written plainly, for the per-anchor test oracles (docs/method.md, "The loop"): where a
cached sample's loop ends, what a cycle at an anchor commits, and the walk over those commits. Plain Python on
lists, independent of ``dflash_cb``."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def loop_bounds(prompt_len: int, total_len: int, valid_len: int, tokens: Sequence[int], max_new: int,
                stops: set[int]) -> tuple[int, int]:
    """(the loop's end, the end of the known target tokens): the reference's ``end`` when the cache holds the
    whole greedy completion (it reached ``max_new`` tokens or ended at a stop token), else ``valid_len``."""
    full_end = prompt_len + max_new
    whole = valid_len >= total_len and (total_len >= full_end or tokens[-1] in stops)
    return (full_end, total_len) if whole else (min(full_end, valid_len), valid_len)


def anchors(prompt_len: int, loop_end: int, known_end: int) -> range:
    return range(prompt_len, max(prompt_len, min(loop_end, known_end) - 1))


def committed(accepted: int, p: int, loop_end: int, tokens: Sequence[int], stops: set[int]) -> int:
    """Tokens a cycle at ``p`` commits after ``accepted`` matches: the bonus token, the loop's end, a stop token."""
    k = min(accepted + 1, loop_end - p - 1)
    return next((j for j in range(1, k + 1) if tokens[p + j] in stops), k)


def walk(produced: Callable[[int], int], p: int, loop_end: int, known_end: int, tokens: Sequence[int],
         stops: set[int]) -> list[int]:
    """The cycles of the loop from the prompt's end ``p``, ``produced(q)`` tokens committed at anchor ``q``."""
    out: list[int] = []
    if p >= known_end or tokens[p] in stops:
        return out
    while p + 1 < loop_end:
        k = produced(p)
        out.append(k)
        p += k
        if stops & set(tokens[p - k + 1: p + 1]):
            break
    return out
