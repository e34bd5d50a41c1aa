"""The Prometheus text exposition format (what a server's ``GET /metrics`` answers), read into sums.

Only what the served counters need: ``name{label="value",...} value [timestamp]`` sample lines,
``#`` comments skipped, label values unescaped (``\\\\``, ``\\"``, ``\\n``). A line that is none of
these makes the whole answer unreadable (``ValueError`` naming the line): a proxy's HTML error page
must never read as "no counters".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

Labels = dict[str, str]
Families = dict[str, list[tuple[Labels, float]]]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _labels(text: str, line: str) -> Labels:
    out: Labels = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ValueError(f"unreadable labels in {line[:120]!r}")
        out[m.group(1)] = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)), m.group(2))
        pos = m.end()
    return out


def _value(text: str, line: str) -> float:
    special = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a sample value: {line[:120]!r}") from None


def parse_exposition(text: str) -> Families:
    """Sample name -> ``[(labels, value), ...]`` in the order given. Raises ValueError on a line that is
    neither a comment nor a sample."""
    families: Families = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line[:120]!r}")
        labels = _labels(m.group(2), line) if m.group(2) else {}
        families.setdefault(m.group(1), []).append((labels, _value(m.group(3), line)))
    return families


def total(families: Mapping[str, list[tuple[Labels, float]]], name: str) -> float | None:
    """The sum of ``name`` over all its label sets (engines, models), or None when it is not exported."""
    samples = families.get(name)
    return None if samples is None else sum(v for _, v in samples)


def by_label(families: Mapping[str, list[tuple[Labels, float]]], name: str, label: str) -> dict[str, float] | None:
    """``name`` summed per value of ``label`` (other labels summed over), or None when it is not exported."""
    samples = families.get(name)
    if samples is None:
        return None
    out: dict[str, float] = {}
    for labels, v in samples:
        key = labels.get(label)
        if key is not None:
            out[key] = out.get(key, 0.0) + v
    return out
