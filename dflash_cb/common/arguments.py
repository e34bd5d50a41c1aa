"""One rule for argument values, shared by ``DFlashEvalCallback`` and the command-line tools.

Each checker takes the argument's name (``"periodic_anchor_stride"``, ``"--samples"``) and its value,
returns the value normalised (an ``int``, a tuple of ints, a list of strings) or raises one
``ArgumentError``: ``name=value: expected ...`` (``--option 'text': expected ...``), a line naming the
argument, the value given and what it must be. Nothing is coerced:
``2.5``, ``2.0``, ``"8"`` and ``True`` are not integers (``int(2.7)`` would silently be 2, and a YAML
string would fail later in a comparison), and a bare string is not a list of strings (``list("abc")``
is three one-letter ids). The ``parse_*`` functions read the tools' comma-separated text with the
same rules. Pure: no I/O.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import DFlashCBError


class ArgumentError(DFlashCBError, ValueError):
    """An argument value of the wrong type or out of range; the message names the argument."""


def is_int(value: Any) -> bool:
    """An integer (a Python or numpy one), not a bool."""
    # numbers.Integral covers numpy integers; bool is an int subclass but never a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ints(minimum: int, plural: bool = False) -> str:
    if minimum == 1:
        return "positive integers" if plural else "a positive integer"
    return f"integers >= {minimum}" if plural else f"an integer >= {minimum}"


def _refuse(name: str, value: Any, expected: str, note: str | None = None) -> ArgumentError:
    """``name=value: expected ...`` (``--option 'text': expected ...`` for a command-line option)."""
    given = f"{name} {value!r}" if name.startswith("-") else f"{name}={value!r}"
    return ArgumentError(f"{given}: expected {expected}" + (f"; {note}" if note else ""))


def _are_not(bad: Sequence[Any]) -> str:
    return f"{' and '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not"


def _or_none(none: str | None) -> str:
    return f" or None ({none})" if none is not None else ""


def int_at_least(name: str, value: Any, minimum: int, *, none: str | None = None, note: str | None = None) -> Any:
    """``value`` as an int >= ``minimum``. With ``none`` (what None means), None is accepted too."""
    if value is None and none is not None:
        return None
    if not is_int(value) or value < minimum:
        raise _refuse(name, value, _ints(minimum) + _or_none(none), note)
    return int(value)


def int_between(name: str, value: Any, minimum: int, maximum: int, *, none: str | None = None,
                note: str | None = None) -> Any:
    """``value`` as an int in ``[minimum, maximum]``. With ``none`` (what None means), None is accepted too."""
    if value is None and none is not None:
        return None
    if not is_int(value) or not minimum <= value <= maximum:
        raise _refuse(name, value, f"an integer from {minimum} to {maximum}" + _or_none(none), note)
    return int(value)


def int_list(name: str, values: Any, minimum: int, *, none: str | None = None, note: str | None = None,
             empty: bool = True) -> Any:
    """``values`` (a list or tuple of ints >= ``minimum``) as a tuple in the given order. With ``none``
    (what None means) None is accepted; ``empty=False`` refuses an empty list."""
    if values is None and none is not None:
        return None
    expected = f"a list of {_ints(minimum, plural=True)}{_or_none(none)}"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _refuse(name, values, expected, note)
    bad = [v for v in values if not is_int(v) or v < minimum]
    if bad:
        raise _refuse(name, values, f"{expected} ({_are_not(bad)})", note)
    if not values and not empty:
        raise _refuse(name, values, f"{expected}, at least one", note)
    return tuple(int(v) for v in values)


def str_list(name: str, values: Any, *, none: str | None = None, empty: bool = False) -> Any:
    """``values`` (a list or tuple of non-blank strings) as a list. A bare string is refused: it would
    be split into its characters. With ``none`` (what None means) None is accepted."""
    if values is None and none is not None:
        return None
    expected = f"a list of strings{_or_none(none)}"
    if isinstance(values, (str, bytes)):
        raise _refuse(name, values, f"{expected}, not a single string", f"write [{values!r}]")
    if not isinstance(values, Sequence):
        raise _refuse(name, values, expected)
    bad = [v for v in values if not isinstance(v, str) or not v.strip()]
    if bad:
        raise _refuse(name, values, f"a list of non-blank strings{_or_none(none)} ({_are_not(bad)})")
    if not values and not empty:
        raise _refuse(name, values, f"{expected}, at least one")
    return list(values)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool: only True or False (``"false"`` is a true value in Python)."""
    if not isinstance(value, bool):
        raise _refuse(name, value, "True or False")
    return value


_EDGES, _EDGES_EXAMPLE = "integers from 0, strictly increasing", "e.g. 0,256,512,1024,2048"


def check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    """Position-bucket edges as a tuple: from 0, strictly increasing (``ValueError`` otherwise)."""
    e = tuple(int(x) for x in edges)
    if not e or e[0] != 0 or any(b <= a for a, b in zip(e, e[1:], strict=False)):
        raise ValueError(f"position edges must start at 0 and increase strictly, got {list(edges)} "
                         "(e.g. 0,256,512,1024,2048)")
    return e


def position_edges(name: str, values: Any) -> tuple[int, ...]:
    """Completion-position bucket edges: integers from 0, strictly increasing (``positions.check_edges``)."""
    edges = int_list(name, values, 0, empty=False)
    try:
        return check_edges(edges)
    except ValueError:
        raise _refuse(name, values, _EDGES, _EDGES_EXAMPLE) from None


def path_or_none(name: str, value: Any) -> str | None:
    """A file or folder path (str or ``os.PathLike``) as a str, or None."""
    return None if value is None else file_path(name, value)


# ``baseline/served/...`` holds the server's own online tau (``core.metrics.SERVED_BASELINE``): a
# measured baseline of that name would mix its figures with the server's under one key.
SERVED_BASELINE_NAME = "served"


def metric_segment(name: str) -> str:
    """A reference's name as one segment of a metric name (``baseline/<segment>/tau``): characters other
    than letters, digits and ``-_.`` become ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_") or "unnamed"


def baseline_paths(name: str, value: Any) -> dict[str, str]:
    """Reference results files as ``{name: path}``: from a dict, a list of paths (name = the file's
    stem; two files with one stem are refused rather than one silently dropped), or None (none).

    Two names that give one metric segment (``a b``, ``a_b``) are refused, and so is the name
    ``served`` (from a dict or a file stem), reserved for the server's online tau."""
    if value is None:
        return {}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or not k.strip()]
        if bad:
            raise _refuse(name, value, f"non-blank strings as names ({_are_not(bad)})")
        named = {k: file_path(f"{name}[{k!r}]", v) for k, v in value.items()}
    else:
        paths = [value] if isinstance(value, (str, os.PathLike)) else value
        if not isinstance(paths, Sequence) or isinstance(paths, bytes):
            raise _refuse(name, value, "{name: results.json} or a list of results.json paths")
        named = {}
        for i, v in enumerate(paths):
            p = file_path(f"{name}[{i}]", v)
            stem = Path(p).stem
            if stem in named:
                raise _refuse(name, value, f"files with distinct names ({named[stem]!r} and {p!r} are both "
                                           f"{stem!r})", "name them: {name: path, ...}")
            named[stem] = p
    segments: dict[str, str] = {}
    for key, p in named.items():
        seg = metric_segment(key)
        if seg == SERVED_BASELINE_NAME:
            raise _refuse(name, value, f"a name other than {key!r} for {p!r}",
                          f"baseline/{SERVED_BASELINE_NAME}/ is the server's online tau (from the cache's served "
                          f"counters); name the file another way, e.g. {{{(key + '_file')!r}: {p!r}}}")
        if seg in segments:
            raise _refuse(name, value, f"names that give distinct metric names ({segments[seg]!r} and {key!r} are "
                                       f"both logged as baseline/{seg}/...)", "rename one of them")
        segments[seg] = key
    return named


def file_path(name: str, value: Any) -> str:
    """A file or folder path (str or ``os.PathLike``, not blank) as a str."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise _refuse(name, value, "a path (a non-blank string)")
    return str(value)


# -- the tools' comma-separated text ------------------------------------------------------------

def _items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse_ints(name: str, text: str, expected: str, note: str | None) -> list[int]:
    try:
        return [int(t) for t in _items(text)]
    except ValueError:
        raise _refuse(name, text, expected, note) from None


def parse_int(name: str, text: str, minimum: int, *, note: str | None = None) -> int:
    """An option's text as an int >= ``minimum`` (``"2.5"`` and ``"x"`` refused, naming the option)."""
    values = _parse_ints(name, text, _ints(minimum), note)
    if len(values) != 1 or values[0] < minimum:
        raise _refuse(name, text, _ints(minimum), note)
    return values[0]


def parse_int_list(name: str, text: str, minimum: int, *, note: str | None = None,
                   empty: bool = True) -> tuple[int, ...]:
    """Comma-separated integers >= ``minimum`` (blank items skipped; ``''`` is the empty list)."""
    expected = f"comma-separated {_ints(minimum, plural=True)}"
    values = _parse_ints(name, text, expected, note)
    if any(v < minimum for v in values) or (not values and not empty):
        raise _refuse(name, text, expected, note)
    return tuple(values)


def parse_position_edges(name: str, text: str) -> tuple[int, ...]:
    """Comma-separated position bucket edges (``position_edges``)."""
    expected = f"comma-separated {_EDGES}"
    try:
        return position_edges(name, _parse_ints(name, text, expected, _EDGES_EXAMPLE))
    except ArgumentError:
        raise _refuse(name, text, expected, _EDGES_EXAMPLE) from None


def parse_str_list(name: str, text: str) -> list[str]:
    """Comma-separated non-blank strings, stripped; at least one."""
    items = _items(text)
    if not items:
        raise _refuse(name, text, "one or more comma-separated values")
    return items
