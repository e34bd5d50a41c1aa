"""vLLM's speculative-decoding counters, per request: what ``/metrics`` says and what one request did.

vLLM says nothing about speculation per request. Its Prometheus counters on ``GET /metrics`` are
server-wide (summed here over their ``engine`` and ``model_name`` labels): ``num_drafts`` (one per
verification round of one request), ``num_draft_tokens`` (the drafts verified in those rounds),
``num_accepted_tokens`` (the drafts accepted) and ``num_accepted_tokens_per_pos{position="j"}`` (rounds
whose first ``j + 1`` drafts were accepted; ``j`` from 0 to ``num_speculative_tokens - 1``). vLLM counts
a round's accepted drafts before the stop tokens and ``max_tokens`` cut its output, as SGLang counts
its correct drafts (docs/served-check.md, "vLLM"). A request's own figures are the counters' change
across it (:func:`request_counters`), and they are its own only when no other request ran meanwhile
(:func:`attribution_problem`); the precompute then keeps the sample and marks its counters
unattributable, with the reason. Names are kept as vLLM exports them.

The rules a recorded sample must satisfy to be compared with the replay are here too
(:func:`malformed`, :func:`impossible`, :func:`unlike_the_replay`); ``served.comparability`` applies
them, beside SGLang's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .counts import clip, json_safe, too_few_drafts, too_many_rounds, whole_count
from .prometheus import by_label, parse_exposition, total

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUEST_SUCCESS = "vllm:request_success_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
POSITION_LABEL = "position"
PREFIX = "vllm:"
# Ours, beside vLLM's names in a sample's served_spec.
ATTRIBUTABLE = "attributable"
UNATTRIBUTABLE_REASON = "unattributable_reason"
# Counters from the answer's own ``body["metrics"]["speculative_decoding"]`` (a vLLM started with
# ``--per-request-spec-decode-metrics summary|detailed``), not from /metrics deltas; with ``detailed``, the
# drafts accepted at each verify step, in order.
PER_REQUEST = "per_request"
PER_STEP_ACCEPTED = "per_step_accepted"
# The chain length the answer says it drafted with, checked against the server's recorded configuration.
SPEC_TOKENS = "num_spec_tokens"

_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED, REQUEST_SUCCESS, GENERATION_TOKENS, PREEMPTIONS)
_GAUGES = (RUNNING, WAITING)
CONVENTION = ("vLLM: server-wide counters, a request's figures are their change across it; mean acceptance "
              "length = 1 + num_accepted_tokens / num_drafts (a round's accepted drafts plus its bonus token, "
              "before the final cut); served tau here = (completion_tokens - 1) / num_drafts, the replay's "
              "convention (tokens committed by rounds / rounds)")

# The same figures from each answer's own ``body["metrics"]["speculative_decoding"]`` (``--per-request-spec-decode-metrics``).
REQUEST_CONVENTION = ("vLLM: each answer's own counters (metrics.speculative_decoding: num_spec_steps as num_drafts, "
                      "num_accepted_draft_tokens as num_accepted_tokens), not /metrics deltas; mean acceptance "
                      "length = 1 + num_accepted_tokens / num_drafts (a round's accepted drafts plus its bonus token, "
                      "before the final cut); served tau here = (completion_tokens - 1) / num_drafts, the replay's "
                      "convention (tokens committed by rounds / rounds)")


def convention_of(counters: Sequence[Mapping[str, Any] | None]) -> str:
    """The convention of vLLM samples' counters: each answer's own when every one says so (``per_request``), else
    the /metrics deltas'."""
    own = [c for c in counters if is_vllm(c)]
    return REQUEST_CONVENTION if own and all(c.get(PER_REQUEST) is True for c in own) else CONVENTION


def is_vllm(counters: Mapping[str, Any] | None) -> bool:
    """Whether a sample's served_spec holds vLLM's counters (their names say so) rather than SGLang's."""
    if not isinstance(counters, Mapping):
        return False
    return ATTRIBUTABLE in counters or any(isinstance(k, str) and k.startswith(PREFIX) for k in counters)


def mean_acceptance_length(accepted: float, drafts: float) -> float:
    """vLLM's logged "Mean acceptance length": ``1 + num_accepted_tokens / num_drafts`` (its
    ``SpecDecodingLogging`` and the PromQL its metrics document): accepted drafts plus one bonus token per
    round, pooled over rounds, counted before a round's output is cut at a stop token or ``max_tokens``."""
    return 1.0 + accepted / drafts


# -- one read of /metrics ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """One read of ``/metrics``: each counter and gauge summed over engines and models (None: not
    exported) and the per-position acceptance counter by position."""

    values: dict[str, float | None]
    per_position: dict[int, float] | None

    @property
    def exports_counters(self) -> bool:
        """The server exports its request counters at all (not with ``--disable-log-stats``)."""
        return self.values.get(REQUEST_SUCCESS) is not None

    @property
    def speculating(self) -> bool:
        return self.values.get(DRAFTS) is not None

    @property
    def positions(self) -> int | None:
        """How many draft positions the per-position counter has: the server's ``num_speculative_tokens``."""
        return len(self.per_position) if self.per_position else None


def snapshot(text: str) -> Snapshot:
    """Read a ``/metrics`` answer; ValueError when it is not the Prometheus text format."""
    families = parse_exposition(text)
    values = {name: total(families, name) for name in (*_COUNTERS, *_GAUGES)}
    raw = by_label(families, PER_POSITION, POSITION_LABEL)
    per_position = None
    if raw is not None:
        try:
            per_position = {int(k): v for k, v in raw.items()}
        except ValueError:
            raise ValueError(f"{PER_POSITION} has a position label that is not a number: {sorted(raw)}") from None
    return Snapshot(values, per_position)


def _count(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v  # a counter is whole; anything else stays visible (malformed)


# -- one request ------------------------------------------------------------------------------------

def attribution_problem(before: Snapshot, after: Snapshot, completion_tokens: int) -> str | None:
    """Why the counters' change across a request is not the request's own, or None. It is when exactly
    one request finished meanwhile (``request_success``), no request was running or waiting before it
    was sent or after it finished (the gauges, where exported), the server generated exactly its
    tokens in between (``generation_tokens``, where exported) and preempted nothing (``num_preemptions``:
    a preempted request is recomputed and drafts again, so its rounds are not one loop)."""
    names = [n for n in (*_COUNTERS, *_GAUGES) if (before.values.get(n) is None) != (after.values.get(n) is None)]
    if names:
        return f"the server's exported counters changed across the request ({names[0]}; the server restarted?)"
    for name in _COUNTERS:
        b, a = before.values.get(name), after.values.get(name)
        if b is not None and a is not None and not (math.isfinite(a) and math.isfinite(b)):
            return f"{name} is not a number on the server ({b:g} -> {a:g}): the counters cannot be read as counts"
        if b is not None and a is not None and a < b:
            return f"{name} went backwards across the request ({b:g} -> {a:g}; the server restarted?)"
    if set(before.per_position or {}) != set(after.per_position or {}):
        return f"the positions of {PER_POSITION} changed across the request (the server restarted?)"
    finished = after.values[REQUEST_SUCCESS] - before.values[REQUEST_SUCCESS]
    if finished == 0:
        return (f"{REQUEST_SUCCESS} had not counted the request when its counters were read (the server records "
                "its statistics late or not at all)")
    if finished != 1:
        return (f"{finished:g} requests finished during it ({REQUEST_SUCCESS} moved by {finished:g}): another "
                "client's requests ran meanwhile")
    for name, when, snap in ((RUNNING, "when it was sent", before), (WAITING, "when it was sent", before),
                             (RUNNING, "after it had finished", after), (WAITING, "after it had finished", after)):
        n = snap.values.get(name)
        if n:
            return f"{n:g} request(s) were {'running' if name == RUNNING else 'waiting'} {when} ({name})"
    preempted = (after.values.get(PREEMPTIONS) or 0) - (before.values.get(PREEMPTIONS) or 0)
    if preempted:
        return (f"preempted {preempted:g} time(s) during it ({PREEMPTIONS}): a preempted request is recomputed and "
                "drafts again, so its rounds are not one loop")
    generated = after.values.get(GENERATION_TOKENS)
    if generated is not None:
        generated -= before.values[GENERATION_TOKENS]
        if generated != completion_tokens:
            return (f"the server generated {generated:g} tokens during it, the request {completion_tokens} "
                    f"({GENERATION_TOKENS}): another request's tokens")
    return None


def request_counters(before: Snapshot, after: Snapshot, completion_tokens: int) -> dict[str, Any] | None:
    """A sample's served_spec: the counters' change across its request under vLLM's names, the gauges
    before and after, and whether it is the request's own (``attributable``, else
    ``unattributable_reason``). None when the server exports no speculative counters (it does not
    speculate, or keeps no statistics)."""
    if not (before.speculating and after.speculating):
        return None
    out: dict[str, Any] = {}
    for name in _COUNTERS:
        if before.values.get(name) is not None and after.values.get(name) is not None:
            out[name] = _count(after.values[name] - before.values[name])
    positions = sorted(after.per_position or {})
    out[PER_POSITION] = [_count(after.per_position[j] - (before.per_position or {}).get(j, 0.0)) for j in positions]
    for name in _GAUGES:
        if before.values.get(name) is not None and after.values.get(name) is not None:
            out[name] = {"before": _count(before.values[name]), "after": _count(after.values[name])}
    why = attribution_problem(before, after, completion_tokens)
    out[ATTRIBUTABLE] = why is None
    if why is not None:
        out[UNATTRIBUTABLE_REASON] = why
    return {k: out[k] for k in sorted(out)}


def answer_counters(body: Any) -> dict[str, Any] | None:
    """A request's own served counters from vLLM's per-request metrics (``body["metrics"]["speculative_decoding"]`` of the
    answer), under the names of the /metrics counters: verify steps as ``num_drafts``, drafted and accepted
    tokens, the accepted count per position from ``acceptance_histogram`` (index j: steps that accepted exactly
    j drafts), and ``per_step_accepted`` when the server reports it (``detailed``). None when the answer carries
    none; a ValueError naming the field when it is malformed."""
    spec = (body.get("metrics") or {}).get("speculative_decoding") if isinstance(body, dict) and isinstance(
        body.get("metrics"), dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"metrics.speculative_decoding is {clip(spec)}, expected an object")
    out: dict[str, Any] = {}
    for field_name, key in (("num_spec_steps", DRAFTS), ("num_draft_tokens", DRAFT_TOKENS),
                            ("num_accepted_draft_tokens", ACCEPTED)):
        v = whole_count(spec.get(field_name))
        if v is None:
            raise ValueError(f"metrics.speculative_decoding.{field_name} is {clip(spec.get(field_name))}, expected a "
                             "whole number >= 0")
        out[key] = v
    hist = spec.get("acceptance_histogram")
    if hist is not None:
        counts = [whole_count(v) for v in hist] if isinstance(hist, list) else [None]
        if any(c is None for c in counts):
            raise ValueError(f"metrics.speculative_decoding.acceptance_histogram is {clip(hist)}, expected counts")
        out[PER_POSITION] = [sum(counts[j + 1:]) for j in range(len(counts) - 1)]
    steps = spec.get("per_step_accepted")
    if steps is not None:
        counts = [whole_count(v) for v in steps] if isinstance(steps, list) else [None]
        if any(c is None for c in counts) or len(counts) != out[DRAFTS]:
            raise ValueError(f"metrics.speculative_decoding.per_step_accepted is {clip(steps)}, expected one count "
                             f"per verify step ({out[DRAFTS]})")
        out[PER_STEP_ACCEPTED] = counts
    k = whole_count(spec.get(SPEC_TOKENS)) if spec.get(SPEC_TOKENS) is not None else None
    if k is not None:
        out[SPEC_TOKENS] = k
    why = _inconsistent(spec, out, hist)
    if why is not None:
        raise ValueError(f"metrics.speculative_decoding: {why}: the counters do not describe one request's "
                         "verify steps; check the server's version (vLLM's per-request metrics)")
    out[ATTRIBUTABLE] = True
    out[PER_REQUEST] = True
    return {k: out[k] for k in sorted(out)}


def _inconsistent(spec: Mapping[str, Any], out: Mapping[str, Any], hist: Any) -> str | None:
    """Where a request's counters contradict one another (each is well formed): the accepted tokens against the
    drafted ones, the per-step counts and the histogram; the chain length ``num_spec_tokens`` bounds a step."""
    steps, accepted, drafted = out[DRAFTS], out[ACCEPTED], out[DRAFT_TOKENS]
    k = whole_count(spec.get("num_spec_tokens")) if spec.get("num_spec_tokens") is not None else None
    if accepted > drafted:
        return f"num_accepted_draft_tokens {accepted} above num_draft_tokens {drafted}"
    if k is not None and drafted > steps * k:
        return f"num_draft_tokens {drafted} above num_spec_steps {steps} x num_spec_tokens {k}"
    per_step = out.get(PER_STEP_ACCEPTED)
    if per_step is not None:
        if sum(per_step) != accepted:
            return f"per_step_accepted sums to {sum(per_step)}, num_accepted_draft_tokens is {accepted}"
        if k is not None and per_step and max(per_step) > k:
            return f"a step of per_step_accepted accepts {max(per_step)}, above num_spec_tokens {k}"
    if isinstance(hist, list):
        if k is not None and len(hist) != k + 1:
            return f"acceptance_histogram has {len(hist)} entries, num_spec_tokens {k} needs {k + 1} (0 to {k})"
        if sum(hist) != steps:
            return f"acceptance_histogram counts {sum(hist)} steps, num_spec_steps is {steps}"
        if sum(j * c for j, c in enumerate(hist)) != accepted:
            return (f"acceptance_histogram accepts {sum(j * c for j, c in enumerate(hist))} tokens, "
                    f"num_accepted_draft_tokens is {accepted}")
    return None


def per_step_accepted(counters: Mapping[str, Any]) -> list[int] | None:
    steps = counters.get(PER_STEP_ACCEPTED)
    return [int(v) for v in steps] if isinstance(steps, list) and all(whole_count(v) is not None for v in steps) else None


def concurrent_counters(concurrency: int) -> dict[str, Any]:
    """The served_spec of a request sent while others were in flight: nothing of the counters is its own."""
    return {ATTRIBUTABLE: False,
            UNATTRIBUTABLE_REASON: f"sent {concurrency} at a time (--max-in-flight {concurrency}): the server-wide "
                                   "counters cannot be split between requests; precompute with --max-in-flight 1"}


def kept_fields(counters: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM fields of a served_spec that the manifest keeps (JSON-safe values)."""
    return {k: v for k, v in counters.items() if isinstance(k, str) and json_safe(v)
            and (k.startswith(PREFIX) or k in (ATTRIBUTABLE, UNATTRIBUTABLE_REASON, PER_REQUEST, PER_STEP_ACCEPTED,
                                                  SPEC_TOKENS))}


# -- the server's configuration ----------------------------------------------------------------------

def speculative_config(server_info: Mapping[str, Any] | None, metrics: Snapshot | None) -> dict[str, Any]:
    """What the manifest keeps of a vLLM server's speculative configuration: ``server: "vllm"``; from
    ``GET /server_info?config_format=json`` (served only with ``VLLM_SERVER_DEV_MODE=1``) its
    ``speculative_config`` as ``algorithm`` (the method), ``draft_model_path``, ``draft_model_revision``,
    ``num_speculative_tokens``; from ``/metrics`` whether it exports counters (``metrics_exported``) and
    how many draft positions its per-position counter has (``metrics_positions``). ``algorithm`` is None
    when the counters show that it does not speculate."""
    out: dict[str, Any] = {"server": "vllm"}
    config = (server_info or {}).get("vllm_config")
    spec = config.get("speculative_config") if isinstance(config, Mapping) else None
    if isinstance(spec, Mapping):
        for key, name in (("method", "algorithm"), ("model", "draft_model_path"), ("revision", "draft_model_revision"),
                          ("num_speculative_tokens", "num_speculative_tokens")):
            if key in spec and json_safe(spec[key]):
                out[name] = spec[key]
    if metrics is not None:
        out["metrics_exported"] = metrics.exports_counters
        if metrics.speculating:
            out["metrics_positions"] = metrics.positions
        elif metrics.exports_counters and "algorithm" not in out:
            out["algorithm"] = None  # it counts requests but no drafts: not speculating
    return out


def drafts_per_round(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(num_speculative_tokens, metrics_positions)`` of a recorded vLLM configuration (None: not said)."""
    def positive(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return positive(config.get("num_speculative_tokens")), positive(config.get("metrics_positions"))


# -- which samples count ------------------------------------------------------------------------------

def rounds(counters: Mapping[str, Any]) -> int | None:
    """The request's verification rounds (``num_drafts``) as a positive int, else None."""
    v = whole_count(counters.get(DRAFTS))
    return v if v else None


def per_position(counters: Mapping[str, Any]) -> list[int] | None:
    pp = counters.get(PER_POSITION)
    return [int(v) for v in pp] if isinstance(pp, list) and all(whole_count(v) is not None for v in pp) else None


def malformed(counters: Mapping[str, Any]) -> str | None:
    """``"malformed <field>: ..."`` for the first recorded field no precompute writes, else None."""
    for key in _COUNTERS:
        if key in counters and whole_count(counters[key]) is None:
            return f"malformed {key}: {counters[key]!r} (expected a whole number >= 0)"
    if PER_POSITION in counters and per_position(counters) is None:
        return f"malformed {PER_POSITION}: {clip(counters[PER_POSITION])} (expected a list of counts, one per position)"
    if ATTRIBUTABLE in counters and not isinstance(counters[ATTRIBUTABLE], bool):
        return f"malformed {ATTRIBUTABLE}: {counters[ATTRIBUTABLE]!r} (expected true or false)"
    return None


def unattributed(counters: Mapping[str, Any]) -> str | None:
    """Why the counters are not the request's own (as recorded), or None."""
    if counters.get(ATTRIBUTABLE) is True:
        return None
    why = counters.get(UNATTRIBUTABLE_REASON)
    if not isinstance(why, str) or not why:
        why = "not recorded as the request's own"
    return f"unattributable: {why}"


def impossible(counters: Mapping[str, Any], completion_tokens: int, block_size: int | None = None) -> str | None:
    """Why these counters cannot describe one request, or None: every round commits at least one token and
    at most its accepted drafts + 1; no more drafts accepted than verified; the per-position counts do not
    grow with the position, start at no more than the rounds and add up to the accepted drafts; with the
    server's ``block_size`` known, a round verifies at most ``block_size - 1`` drafts."""
    r = rounds(counters)
    if r is None:
        return None
    if (why := too_many_rounds(r, completion_tokens, DRAFTS)) is not None:
        return why
    accepted, drafted = whole_count(counters.get(ACCEPTED)), whole_count(counters.get(DRAFT_TOKENS))
    if accepted is not None and drafted is not None and accepted > drafted:
        return f"impossible {ACCEPTED}: {accepted} drafts accepted of {drafted} verified ({DRAFT_TOKENS})"
    if accepted is not None and (why := too_few_drafts(completion_tokens, accepted, r, ACCEPTED, "accepted")):
        return why
    pp = per_position(counters)
    if pp:
        if any(b > a for a, b in zip(pp, pp[1:], strict=False)) or pp[0] > r:
            return (f"impossible {PER_POSITION}: {clip(pp)} for {r} rounds (a round that accepted position j + 1 "
                    "accepted position j)")
        if accepted is not None and sum(pp) != accepted:
            return f"impossible {PER_POSITION}: it adds up to {sum(pp)} accepted drafts, {ACCEPTED} = {accepted}"
    if block_size is not None and drafted is not None and drafted > r * (block_size - 1):
        return (f"impossible {DRAFT_TOKENS}: {drafted} drafts in {r} rounds, the server drafts blocks of {block_size} "
                f"(at most {block_size - 1} drafts a round)")
    return None


def other_chain_length(counters: Mapping[str, Any], block_size: int | None) -> str | None:
    """Why an answer's own ``num_spec_tokens`` is not the server's recorded configuration (blocks of
    ``block_size``: ``num_speculative_tokens + 1``), or None."""
    k = whole_count(counters.get(SPEC_TOKENS))
    if k is None or block_size is None or k == block_size - 1:
        return None
    return (f"another chain length: the answer's num_spec_tokens is {k}, the server's recorded configuration says "
            f"{block_size - 1} (blocks of {block_size}): the request was not drafted as recorded (a server restarted "
            "with another --speculative-config?); precompute it again against one server")


def unlike_the_replay(counters: Mapping[str, Any], block_size: int | None = None) -> str | None:
    """Why possible counters still do not describe the replay's full blocks, or None: some rounds verified
    fewer drafts than the others (vLLM's scheduler trims a round's drafts to stay within ``max_model_len``
    or the step's token budget)."""
    r, drafted = rounds(counters), whole_count(counters.get(DRAFT_TOKENS))
    if r is None or drafted is None:
        return None
    if (block_size is not None and drafted < r * (block_size - 1)) or (block_size is None and drafted % r):
        return (f"some rounds verified fewer drafts ({drafted} draft tokens in {r} rounds"
                + (f", blocks of {block_size} propose {r * (block_size - 1)}" if block_size is not None else "")
                + "): the server trimmed them (max_model_len or the step's token budget), the replay drafts full blocks")
    return None


def block_of(counters: Mapping[str, Any]) -> int | None:
    """The block the counters show (drafts verified per round + 1), when every round verified as many."""
    r, drafted = rounds(counters), whole_count(counters.get(DRAFT_TOKENS))
    if r is None or drafted is None or drafted % r:
        return None
    return drafted // r + 1


def accepted_per_position(correct_drafts: Sequence[int], positions: int) -> list[int]:
    """The replay's cycles in vLLM's per-position layout: entry j = cycles whose first j + 1 drafts matched."""
    return [sum(1 for c in correct_drafts if c > j) for j in range(positions)]
