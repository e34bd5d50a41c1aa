"""The server's own speculative counters next to the offline replay (``--served-check``).

When SGLang serves the target with speculative decoding, every ``/generate`` answer carries the
request's counters in ``meta_info``. The precompute keeps every ``spec_*`` field per sample
(``SampleEntry.served_spec``) and the server's speculative configuration from
``/get_server_info`` (``Manifest.served_spec_config``). This module is the pure part: parse those
fields, convert them to this package's convention (one function, :func:`served_rounds_and_tau`),
and compare them, sample by sample, with the replay of the same drafter on the same cache.

SGLang's convention (cached_states/README.md, ``served_spec``; README, "Check against the
server"): every verification round (one target forward over a drafted block) adds 1 to
``spec_verify_ct``; the round appends the
accepted drafts and the bonus token to the output one at a time, stopping at a stop token or at
``max_new_tokens``; ``spec_accept_length = completion_tokens / spec_verify_ct``, where
``completion_tokens`` counts every output token, **including the first one, which comes from the
prefill and belongs to no round**. The replay's tau counts only the tokens committed by rounds,
so the served tau in our convention is ``(completion_tokens - 1) / spec_verify_ct``, and the
integers that must agree are the round counts: ``spec_verify_ct`` == the replay's cycles.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DFlashCBError

SPEC_PREFIX = "spec_"
VERIFY_CT = "spec_verify_ct"
ACCEPT_LENGTH = "spec_accept_length"
# /get_server_info (the server's arguments) -> the names kept in the manifest header.
_SERVER_SPEC_KEYS = {
    "speculative_algorithm": "algorithm",
    "speculative_draft_model_path": "draft_model_path",
    "speculative_draft_model_revision": "draft_model_revision",
    "speculative_num_draft_tokens": "num_draft_tokens",
    "speculative_eagle_topk": "topk",
    "speculative_num_steps": "num_steps",
}
CONVENTION = ("SGLang: spec_accept_length = completion_tokens / spec_verify_ct, counting the prefill's first "
              "token and every round's bonus token; served tau here = (completion_tokens - 1) / spec_verify_ct, "
              "the replay's convention (tokens committed by rounds / rounds)")


class ServedCheckError(DFlashCBError, ValueError):
    """Nothing to compare, or served counters that cannot be read."""


# -- parsing (what the precompute stores) ---------------------------------------------------------

def _json_safe(value: Any) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)  # the manifest must stay valid JSON
    if isinstance(value, (list, tuple)):
        return all(_json_safe(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_safe(v) for k, v in value.items())
    return False


def served_counters(meta_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Every ``spec_*`` field of a ``/generate`` answer's ``meta_info`` (sorted), or None when there is none.

    Names are kept as the server sends them (they changed between SGLang versions), values that are
    not JSON-safe (NaN, objects) are dropped. A non-speculative server sends none, and so does a
    speculative one for a request that needed no verification round (SGLang writes the fields only
    when ``spec_verify_ct > 0``).
    """
    if not isinstance(meta_info, Mapping):
        return None
    kept = {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in meta_info.items()
            if isinstance(k, str) and k.startswith(SPEC_PREFIX) and _json_safe(v)}
    return {k: kept[k] for k in sorted(kept)} or None


def server_spec_config(server_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The speculative part of ``/get_server_info``: algorithm, draft model, draft tokens, topk, steps.

    None when the server reports none of it (an old server, or one without that endpoint). The
    algorithm is None (or ``"NONE"`` on some versions) when the server does not speculate.
    """
    if not isinstance(server_info, Mapping):
        return None
    out = {name: server_info[key] for key, name in _SERVER_SPEC_KEYS.items()
           if key in server_info and _json_safe(server_info[key])}
    return out or None


# -- the convention -------------------------------------------------------------------------------

def verify_rounds(counters: Mapping[str, Any] | None) -> int | None:
    """``spec_verify_ct`` as a positive int, else None (absent, 0 on versions that send it for a request
    without a round, or not a whole number)."""
    v = (counters or {}).get(VERIFY_CT)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v <= 0:
        return None
    return int(v)


def spec_accept_length(completion_tokens: int, rounds: int) -> float:
    """SGLang's per-request ``spec_accept_length``: ``completion_tokens / spec_verify_ct``.

    SGLang 0.5.23 (``TokenizerManager``, per-request ``meta_info``) divides every output token, the prefill's first one
    included, by the verification rounds. ``metrics.sample_accept_length_served`` applies it to a replay.
    """
    return completion_tokens / rounds


def served_rounds_and_tau(counters: Mapping[str, Any], completion_tokens: int) -> tuple[int, float]:
    """``(rounds, tau)`` of one served request in the replay's convention.

    ``rounds`` is SGLang's ``spec_verify_ct``; ``tau`` = tokens committed by rounds / rounds, where
    the committed tokens are ``completion_tokens - 1``: the first completion token comes from the
    prefill, which SGLang counts in ``spec_accept_length`` (= ``completion_tokens / spec_verify_ct``)
    but the replay does not count in tau. Raises ServedCheckError when the counters are unusable.
    """
    rounds = verify_rounds(counters)
    if rounds is None:
        raise ServedCheckError(f"{VERIFY_CT} = {counters.get(VERIFY_CT)!r}: expected a positive integer")
    return rounds, (completion_tokens - 1) / rounds


def convention_of(counters: Mapping[str, Any], completion_tokens: int) -> str:
    """Which numerator the server's ``spec_accept_length`` uses: "with_prefill_token" (SGLang's),
    "rounds_only" (tokens committed by rounds), or "unknown" (absent, or neither fits)."""
    length, v = counters.get(ACCEPT_LENGTH), counters.get(VERIFY_CT)
    if not isinstance(length, (int, float)) or not isinstance(v, (int, float)) or v <= 0:
        return "unknown"
    total = length * v  # accept_length is a float mean: compare the implied token count
    if abs(total - completion_tokens) < 0.5:
        return "with_prefill_token"
    if abs(total - (completion_tokens - 1)) < 0.5:
        return "rounds_only"
    return "unknown"


# -- the comparison -------------------------------------------------------------------------------

@dataclass
class SampleCheck:
    id: str
    category: str
    offline_rounds: int
    served_rounds: int
    offline_tau: float | None  # None: no round
    served_tau: float
    served_accept_length: float | None  # as the server reported it (its convention)
    convention: str

    @property
    def equal(self) -> bool:
        return self.offline_rounds == self.served_rounds


@dataclass
class ServedCheck:
    samples: list[SampleCheck]
    skipped: dict[str, str]  # sample id -> why it is not compared
    server: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    convention: str = CONVENTION

    @property
    def equal_rounds(self) -> int:
        return sum(s.equal for s in self.samples)

    def summary(self) -> dict[str, Any]:
        """Counts, pooled taus (sums before the ratio, as everywhere in this package) and per-sample drift."""
        s = self.samples
        off_rounds = sum(x.offline_rounds for x in s)
        srv_rounds = sum(x.served_rounds for x in s)
        off_tokens = sum((x.offline_tau or 0.0) * x.offline_rounds for x in s)
        srv_tokens = sum(x.served_tau * x.served_rounds for x in s)
        both = [x for x in s if x.offline_tau is not None]
        diffs = [abs(x.offline_tau - x.served_tau) for x in both]
        interval = self.paired_interval()
        return {
            "samples_compared": len(s),
            "samples_equal_rounds": self.equal_rounds,
            "samples_skipped": len(self.skipped),
            "offline_rounds": off_rounds,
            "served_rounds": srv_rounds,
            "offline_tau": round(off_tokens / off_rounds, 6) if off_rounds else None,
            "served_tau": round(srv_tokens / srv_rounds, 6) if srv_rounds else None,
            "mean_abs_tau_diff": round(sum(diffs) / len(diffs), 6) if diffs else None,
            "max_abs_round_diff": max((abs(x.offline_rounds - x.served_rounds) for x in s), default=0),
            # served minus offline pooled tau, paired cluster-bootstrap 95% interval over the compared samples
            "tau_diff_interval": None if interval is None else [round(v, 6) for v in interval],
        }

    def paired_sums(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Per compared sample: offline (committed, rounds), served (committed, rounds), in one order."""
        s = self.samples
        return ([(x.offline_tau or 0.0) * x.offline_rounds for x in s], [float(x.offline_rounds) for x in s],
                [x.served_tau * x.served_rounds for x in s], [float(x.served_rounds) for x in s])

    def paired_interval(self) -> tuple[float, float, float] | None:
        """(served - offline pooled tau, low, high) from the comparison code's paired bootstrap."""
        if not self.samples:
            return None
        from .bootstrap import Sums, paired_difference
        off_p, off_c, srv_p, srv_c = self.paired_sums()
        iv = paired_difference(Sums.of(off_p, off_c), Sums.of(srv_p, srv_c))
        return iv.value, iv.low, iv.high

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "convention": self.convention, "server": self.server,
                "warnings": list(self.warnings), "skipped": dict(self.skipped),
                "samples": [{**asdict(x), "equal": x.equal} for x in self.samples]}


def has_served_counters(entries: Sequence[Any]) -> bool:
    return any(verify_rounds(getattr(e, "served_spec", None)) is not None for e in entries)


def nothing_to_compare(cache_path: str | os.PathLike) -> ServedCheckError:
    return ServedCheckError(
        f"{cache_path}: no sample holds the server's speculative counters (spec_verify_ct), so there is nothing "
        "to compare; precompute with --reference sglang against a server that runs the drafter "
        "(sglang.launch_server ... --speculative-algorithm DFLASH --speculative-draft-model-path <drafter>)")


def compare(entries: Sequence[Any], offline: Mapping[str, Sequence[int]], server: Mapping[str, Any] | None = None,
            drafter_block_size: int | None = None, drafter_path: str | None = None) -> ServedCheck:
    """Compare the replay (``offline``: sample id -> acceptance_lengths) with each entry's ``served_spec``.

    A sample is compared only when it has counters and the CPU prefill agrees with the served
    completion over its whole length (``valid_len == total_len``): the server's counters cover the
    whole completion, a cut replay does not. Skipped samples are listed with the reason.
    """
    checks: list[SampleCheck] = []
    skipped: dict[str, str] = {}
    for e in entries:
        if e.id not in offline:
            continue
        counters = e.served_spec or {}
        if verify_rounds(counters) is None:
            skipped[e.id] = ("no served counters (the server sends none for a request without a verification "
                             "round, e.g. a completion of one token, or it was not speculating)")
            continue
        if e.valid_len < e.total_len:
            skipped[e.id] = (f"the CPU prefill disagrees with the served completion at completion offset "
                             f"{e.valid_len - e.prompt_len}: the replay stops there, the counters do not")
            continue
        rounds, tau = served_rounds_and_tau(counters, e.completion_len)
        lengths = list(offline[e.id])
        length = counters.get(ACCEPT_LENGTH)
        checks.append(SampleCheck(
            id=e.id, category=e.category, offline_rounds=len(lengths), served_rounds=rounds,
            offline_tau=sum(lengths) / len(lengths) if lengths else None, served_tau=tau,
            served_accept_length=float(length) if isinstance(length, (int, float)) else None,
            convention=convention_of(counters, e.completion_len)))
    warnings = []
    n_draft = (server or {}).get("num_draft_tokens")
    if drafter_block_size is not None and isinstance(n_draft, int) and n_draft != drafter_block_size:
        warnings.append(f"the server drafts {n_draft} tokens per round, the evaluated drafter's block size is "
                        f"{drafter_block_size}: round counts are not comparable")
    served_path = (server or {}).get("draft_model_path")
    if drafter_path and isinstance(served_path, str) and served_path:
        a = os.path.basename(str(served_path).rstrip("/")).lower()
        b = os.path.basename(str(drafter_path).rstrip("/")).lower()
        if a != b:
            warnings.append(f"the server speculates with {served_path!r}, not obviously the evaluated drafter "
                            f"{drafter_path!r}: differences may just mean different drafters")
    odd = sorted({c.convention for c in checks} - {"with_prefill_token"})
    if odd:
        warnings.append(f"some samples' spec_accept_length does not fit completion_tokens / spec_verify_ct "
                        f"(conventions seen: {odd}); the round counts are still compared")
    return ServedCheck(checks, skipped, dict(server) if server else None, warnings)


def format_check(check: ServedCheck, max_rows: int = 40) -> str:
    """A readable report: the convention, the summary, then one line per sample (differences first)."""
    s = check.summary()

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = ["served check: offline replay vs the server's own counters (SGLang spec_verify_ct)",
             f"  convention: {check.convention}"]
    if check.server:
        lines.append("  server: " + ", ".join(f"{k}={v}" for k, v in check.server.items()))
    lines.append(f"  samples compared {s['samples_compared']}, equal round counts {s['samples_equal_rounds']}"
                 f"/{s['samples_compared']}, skipped {s['samples_skipped']}")
    lines.append(f"  rounds offline {s['offline_rounds']}, served {s['served_rounds']}; pooled tau offline "
                 f"{f(s['offline_tau'])}, served {f(s['served_tau'])}; mean |tau diff| per sample "
                 f"{f(s['mean_abs_tau_diff'])}")
    if s["tau_diff_interval"] is not None:
        d, lo, hi = s["tau_diff_interval"]
        lines.append(f"  served - offline tau {d:+.3f}, paired 95% interval [{lo:+.3f}, {hi:+.3f}]")
    for w in check.warnings:
        lines.append(f"  warning: {w}")
    rows = sorted(check.samples, key=lambda x: (x.equal, x.id))
    if rows:
        lines.append(f"  {'sample':<16} {'rounds off':>10} {'served':>7} {'tau off':>8} {'served':>7}  "
                     "server accept_length")
    for x in rows[:max_rows]:
        mark = "" if x.equal else "  <- differs"
        lines.append(f"  {x.id:<16} {x.offline_rounds:>10} {x.served_rounds:>7} {f(x.offline_tau):>8} "
                     f"{f(x.served_tau):>7}  {f(x.served_accept_length)}{mark}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more in the results file")
    for sid, why in list(check.skipped.items())[:10]:
        lines.append(f"  skipped {sid}: {why}")
    if len(check.skipped) > 10:
        lines.append(f"  ... {len(check.skipped) - 10} more skipped")
    return "\n".join(lines)


# -- the served drafter as a baseline (callback) ------------------------------------------------------

def served_tau(entries: Sequence[Any], sample_ids: Sequence[str] | None = None) -> tuple[float, int, int] | None:
    """Pooled served tau (replay's convention) over the entries with counters: (tau, rounds, samples), or None."""
    wanted = set(sample_ids) if sample_ids is not None else None
    rounds = tokens = n = 0
    for e in entries:
        if wanted is not None and e.id not in wanted:
            continue
        counters = e.served_spec or {}
        if verify_rounds(counters) is None:
            continue
        r, _ = served_rounds_and_tau(counters, e.completion_len)
        rounds += r
        tokens += e.completion_len - 1
        n += 1
    return (tokens / rounds, rounds, n) if rounds else None
