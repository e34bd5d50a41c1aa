"""``profile_costs --from-csv``: a profile stated by the user as a CSV of verify times (verified tokens -> seconds)
and one drafter pass, checked as a whole before any work."""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

from ...common.arguments import ArgumentError
from ...core.costs.serving import MAX_STEP_SECONDS

# A one-token verify step above this is likelier milliseconds written as seconds than a real step: warned.
SUSPICIOUS_ONE_TOKEN_SECONDS = 1.0


def read_csv_rows(path: str) -> dict[int, float]:
    """``--from-csv``: the user's rows (verified tokens -> seconds), checked as a whole before any work: the
    encoding (UTF-8, an Excel BOM accepted), the header, each row's types, finiteness and range, a 1-token row,
    at least one more, and monotonicity within ``MONOTONE_TOLERANCE``; a 1-token step above a second is warned
    about (milliseconds by mistake?)."""
    from ...core.costs.serving import MONOTONE_TOLERANCE, suspicious_rows

    where = f"--from-csv {path}"
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ArgumentError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ArgumentError(f"{where}: is a folder; give the CSV file") from None
    try:
        text = raw.decode("utf-8-sig")  # a BOM (Excel's "CSV UTF-8") is not part of the header
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ArgumentError(f"{where}, line {line}: byte 0x{raw[e.start]:02x} is not UTF-8 (a Latin-1 or Windows "
                            "export?); save the file as UTF-8 (plain ASCII digits suffice)") from None
    reader = csv.DictReader(text.splitlines())
    names = [n.strip() for n in reader.fieldnames or []]
    if not {"verified_tokens", "seconds"} <= set(names):
        raise ArgumentError(f"{where}: the header must name verified_tokens,seconds (got {reader.fieldnames})")
    reader.fieldnames = names
    rows: dict[int, float] = {}
    problems: list[str] = []
    for i, row in enumerate(reader, start=2):
        tokens, seconds = (str(row.get(k) or "").strip() for k in ("verified_tokens", "seconds"))
        try:
            n = int(tokens)
        except ValueError:
            problems.append(f"line {i}: verified_tokens {tokens!r} is not an integer")
            continue
        try:
            sec = float(seconds)
        except ValueError:
            problems.append(f"line {i}: seconds {seconds!r} is not a number")
            continue
        if n < 1:
            problems.append(f"line {i}: verified_tokens {n}; a verify step checks 1 token or more")
        elif not (math.isfinite(sec) and 0 < sec <= MAX_STEP_SECONDS):
            problems.append(f"line {i}: seconds {seconds}; a step's time is a positive number of seconds up to "
                            f"{MAX_STEP_SECONDS:g}")
        elif n in rows:
            problems.append(f"line {i}: verified_tokens {n} given twice")
        else:
            rows[n] = sec
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ArgumentError(f"{where}: {'; '.join(problems[:3])}{more}; fix these rows and run again")
    if 1 not in rows:
        raise ArgumentError(f"{where}: needs a row for verified_tokens 1 (plain decoding's step, the "
                            "speedup's baseline)")
    if len(rows) < 2:
        raise ArgumentError(f"{where}: only the 1-token row; a speculative cycle verifies more (a block drafter its "
                            "block, a chain K + 1, a DDTree its budget + 1): add rows up to the most tokens a cycle "
                            "verifies")
    broken = suspicious_rows({n: [s] for n, s in rows.items()}, max_spread=math.inf)
    if broken:
        raise ArgumentError(f"{where}: not monotone: {next(iter(broken.values()))} (the tolerance is "
                            f"{MONOTONE_TOLERANCE:.0%}: verifying more tokens never costs less beyond noise); check "
                            "the rows' units and order")
    if rows[1] > SUSPICIOUS_ONE_TOKEN_SECONDS:
        warnings.warn(f"{where}: a 1-token verify step of {rows[1]:g} s is slow for a served model: are the times "
                      "in milliseconds? The CSV's seconds column is in seconds (0.02 for 20 ms)", stacklevel=2)
    return rows


def from_csv(path: str, draft_seconds: float | None) -> tuple[dict[int, tuple[tuple[int, float], ...]], dict[int, float]]:
    if draft_seconds is None or not (math.isfinite(draft_seconds) and draft_seconds >= 0):
        raise ArgumentError("--from-csv needs --draft-seconds S: one drafter pass (block drafters) or one step "
                            "(chain drafters) on your serving stack, in seconds (>= 0)")
    rows = read_csv_rows(path)
    return {0: tuple(sorted(rows.items()))}, {0: float(draft_seconds)}
