"""The server's own speculative counters next to the offline replay (``--served-check``).

Two servers, one set of rules: SGLang reports its counters per request (below); vLLM reports
server-wide Prometheus counters, whose change across a request the precompute records when the
request ran alone (``vllm_counters``: its names, its attribution rule, its checks). A sample's
``served_spec`` says which by its field names (``spec_*`` or ``vllm:*``), and every function here that
reads one dispatches on that.

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

Per round SGLang also counts the correct drafts (``spec_num_correct_drafts``, and the histogram
``spec_correct_drafts_histogram``: entry k = rounds with k correct drafts) before the round's
output is cut at a stop token or ``max_new_tokens``. The replay (``tail_blocks="served"``, full
blocks as the server drafts) counts the same leading matches per cycle (``SampleResult.correct_drafts``)
as far as the cache knows the target's tokens; only a last round whose matches reach the end of
the completion can have matched more on the server (a "censored" round, checked as a lower bound).

The server drafts blocks of ``speculative_num_draft_tokens`` (:func:`served_block_size`), which can
be smaller than the drafter's trained block; the check replays at that block.

Which samples count (one rule, :func:`comparability`, for the check and the callback's served
baseline): a sample has well-formed counters (whole non-negative counts: anything else is flagged
as malformed, naming the field), has rounds (``spec_verify_ct`` > 0), was never retracted
(``num_retractions`` = 0: a retracted request keeps counting rounds across the retraction), the
CPU prefill agrees with the served completion over its whole length, and the counters are
possible (no more rounds than committed tokens, a histogram that adds up, no round longer than
the server's block).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..common.errors import DFlashCBError
from . import vllm_counters as V
from .counts import clip as _clip
from .counts import json_safe as _json_safe
from .counts import too_few_drafts, too_many_rounds, whole_count

SPEC_PREFIX = "spec_"
VERIFY_CT = "spec_verify_ct"
ACCEPT_LENGTH = "spec_accept_length"
CORRECT_DRAFTS = "spec_num_correct_drafts"
HISTOGRAM = "spec_correct_drafts_histogram"
RETRACTIONS = "num_retractions"  # meta_info, beside the spec_* fields: kept with them
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # in the draft folder: SGLang overrides the mask token's embedding
# /get_server_info (the server's arguments) -> the names kept in the manifest header.
_SERVER_SPEC_KEYS = {
    "speculative_algorithm": "algorithm",
    "speculative_draft_model_path": "draft_model_path",
    "speculative_draft_model_revision": "draft_model_revision",
    "speculative_num_draft_tokens": "num_draft_tokens",
    "speculative_dflash_block_size": "dflash_block_size",
    "speculative_eagle_topk": "topk",
    "speculative_num_steps": "num_steps",
    "speculative_draft_window_size": "draft_window_size",
    "page_size": "page_size",
}
CONVENTION = ("SGLang: spec_accept_length = completion_tokens / spec_verify_ct, counting the prefill's first "
              "token and every round's bonus token; served tau here = (completion_tokens - 1) / spec_verify_ct, "
              "the replay's convention (tokens committed by rounds / rounds)")


class ServedCheckError(DFlashCBError, ValueError):
    """Nothing to compare, or served counters that cannot be read."""


# -- parsing (what the precompute stores) ---------------------------------------------------------

def served_counters(meta_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Every ``spec_*`` field of a ``/generate`` answer's ``meta_info`` (sorted), with ``num_retractions``
    when the answer has spec fields, or None when there is none.

    Names are kept as the server sends them (they changed between SGLang versions), values that are
    not JSON-safe (NaN, objects) are dropped. A non-speculative server sends none, and so does a
    speculative one for a request that needed no verification round (SGLang writes the fields only
    when ``spec_verify_ct > 0``). vLLM's per-request counters (``vllm_counters.request_counters``) are
    kept under their own names, with whether they are the request's own.
    """
    if not isinstance(meta_info, Mapping):
        return None
    if V.is_vllm(meta_info):
        kept_v = V.kept_fields(meta_info)
        return {k: kept_v[k] for k in sorted(kept_v)} or None
    kept = {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in meta_info.items()
            if isinstance(k, str) and k.startswith(SPEC_PREFIX) and _json_safe(v)}
    if kept and _json_safe(meta_info.get(RETRACTIONS)) and RETRACTIONS in meta_info:
        kept[RETRACTIONS] = meta_info[RETRACTIONS]
    return {k: kept[k] for k in sorted(kept)} or None


def server_spec_config(server_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The speculative part of ``/get_server_info``: algorithm, draft model, draft tokens, the DFlash
    block size, topk, steps, the draft window size and the page size, and what the served draft
    folder says when it is readable from here (:func:`draft_folder_settings`).

    None when the server reports none of it (an old server, or one without that endpoint). The
    algorithm is None (or ``"NONE"`` on some versions) when the server does not speculate.
    """
    if not isinstance(server_info, Mapping):
        return None
    out = {name: server_info[key] for key, name in _SERVER_SPEC_KEYS.items()
           if key in server_info and _json_safe(server_info[key])}
    folder = draft_folder_settings(out.get("draft_model_path"))
    if folder is not None:
        out["draft_folder"] = folder
    return out or None


def draft_folder_settings(path: Any) -> dict[str, Any] | None:
    """``{"mask_embedding": bool, "input_embedding_scale": float | None}`` of a draft folder readable
    here (the precompute often runs beside the server), else None (a hub id, another machine)."""
    if not isinstance(path, str) or not path or not os.path.isdir(path):
        return None
    import json

    scale = None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        raw = cfg.get("input_embedding_scale", (cfg.get("dflash_config") or {}).get("input_embedding_scale"))
        scale = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
    except (OSError, ValueError, AttributeError):
        pass
    return {"mask_embedding": os.path.isfile(os.path.join(path, MASK_EMBEDDING_FILE)), "input_embedding_scale": scale}


# -- the convention -------------------------------------------------------------------------------

# The speculative methods a server names for a drafter of the block format; a drafter family declares its own
# (``DrafterFamily.served_methods``).
BLOCK_METHODS = ("DFLASH",)


def served_block_size(server: Mapping[str, Any] | None, methods: Sequence[str] = BLOCK_METHODS,
                      chain: bool = False) -> int | None:
    """The block the server drafted with (anchor included), from the recorded ``/get_server_info``, or None.

    SGLang's DFlash worker drafts blocks of ``speculative_num_draft_tokens``; ``--speculative-dflash-block-size``
    sets it too (SGLang refuses the two set apart, and resolves an unset one from the draft model's
    config, so a DFlash server reports the block it drafts with). For another algorithm than ``methods`` (the
    evaluated drafter family's) the draft tokens are not its block: None, as for an old manifest that recorded
    neither. A ``chain`` drafter's (``num_speculative_tokens`` K, SGLang's ``num_steps``) block is K + 1.

    vLLM drafts ``num_speculative_tokens`` tokens a round after the anchor: its block is that + 1, from
    ``/server_info`` where the server serves it, else from the positions of its per-position counter
    (``vllm_counters.speculative_config``).
    """
    if not isinstance(server, Mapping):
        return None
    if "algorithm" in server and str(server["algorithm"]).upper() not in methods:  # None: not speculating
        return None
    if server.get("server") == "vllm":
        said, counted = V.drafts_per_round(server)
        k = said or counted
        return k + 1 if k else None
    if chain:  # SGLang's --speculative-num-steps drafts a token each
        steps = server.get("num_steps")
        return steps + 1 if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
    for key in ("dflash_block_size", "num_draft_tokens"):
        v = server.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def rounds_key(counters: Mapping[str, Any] | None) -> str:
    """The field that counts a request's verification rounds: SGLang's ``spec_verify_ct`` or vLLM's ``num_drafts``."""
    return V.DRAFTS if V.is_vllm(counters) else VERIFY_CT


def verify_rounds(counters: Mapping[str, Any] | None) -> int | None:
    """The rounds (``spec_verify_ct``, vLLM's ``num_drafts``) as a positive int, else None (absent, 0 on
    versions that send it for a request without a round, or not a whole number)."""
    v = counters.get(rounds_key(counters)) if isinstance(counters, Mapping) else None
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

    ``rounds`` is SGLang's ``spec_verify_ct`` (vLLM's ``num_drafts`` across the request); ``tau`` = tokens
    committed by rounds / rounds, where the committed tokens are ``completion_tokens - 1``: the first
    completion token comes from the prefill, which SGLang counts in ``spec_accept_length`` (=
    ``completion_tokens / spec_verify_ct``) but the replay does not count in tau. Raises
    ServedCheckError when the counters are unusable.
    """
    rounds = verify_rounds(counters)
    if rounds is None:
        key = rounds_key(counters)
        raise ServedCheckError(f"{key} = {counters.get(key)!r}: expected a positive integer")
    return rounds, (completion_tokens - 1) / rounds


def convention_of(counters: Mapping[str, Any], completion_tokens: int) -> str:
    """Which numerator the server's ``spec_accept_length`` uses: "with_prefill_token" (SGLang's),
    "rounds_only" (tokens committed by rounds), or "unknown" (absent, or neither fits); "vllm" for vLLM's
    counters (no per-request accept length: :func:`vllm_counters.mean_acceptance_length` stands for it)."""
    if V.is_vllm(counters):
        return "vllm"
    length, v = counters.get(ACCEPT_LENGTH), counters.get(VERIFY_CT)
    if not isinstance(length, (int, float)) or not isinstance(v, (int, float)) or v <= 0:
        return "unknown"
    total = length * v  # accept_length is a float mean: compare the implied token count
    if abs(total - completion_tokens) < 0.5:
        return "with_prefill_token"
    if abs(total - (completion_tokens - 1)) < 0.5:
        return "rounds_only"
    return "unknown"


# -- which samples count (the check and the callback's served baseline) ---------------------------

SKIPPED = "skipped"  # nothing to compare, or counters that do not describe the replayed path
FLAGGED = "flagged"  # counters that cannot be: reported as such, never as a difference


def histogram_of(counts: Sequence[int]) -> list[int]:
    """Per-round counts -> SGLang's histogram layout: entry k = rounds with k (empty when no round)."""
    out = [0] * (max(counts) + 1) if counts else []
    for k in counts:
        out[k] += 1
    return out


def trim_histogram(hist: Sequence[int]) -> list[int]:
    out = [int(v) for v in hist]
    while out and out[-1] == 0:
        out.pop()
    return out


def served_spec_problem(value: Any) -> str | None:
    """What is wrong with a sample entry's ``served_spec`` as a whole, or None: the precompute writes an
    object of the server's counters (:func:`served_counters`) or nothing. The manifest reader refuses
    another shape, naming the manifest and the sample; the per-field values are judged by
    :func:`impossible_counters`."""
    if value is None or (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        return None
    return (f"malformed served_spec: a {type(value).__name__}, {_clip(value)} (expected an object of the "
            "server's spec_* counters, or null)")


# Each field: what it must be (a whole count; for spec_verify_ct 0 is a request without a round).
_COUNT_FIELDS = (VERIFY_CT, CORRECT_DRAFTS, RETRACTIONS)


def malformed_counters(counters: Mapping[str, Any]) -> str | None:
    """``"malformed <field>: ..."`` for the first recorded field whose value no server sends (a negative,
    fractional, string or boolean count, a histogram that is not a list of counts, an accept length that
    is not a non-negative number), else None. An absent field is not malformed (versions differ).
    vLLM's counters: :func:`vllm_counters.malformed`."""
    if V.is_vllm(counters):
        return V.malformed(counters)
    for key in _COUNT_FIELDS:
        if key in counters and whole_count(counters[key]) is None:
            return f"malformed {key}: {counters[key]!r} (expected a whole number >= 0)"
    hist = counters.get(HISTOGRAM)
    if HISTOGRAM in counters and (not isinstance(hist, list) or any(whole_count(v) is None for v in hist)):
        return f"malformed {HISTOGRAM}: {_clip(hist)} (expected a list of counts)"
    length = counters.get(ACCEPT_LENGTH)
    if ACCEPT_LENGTH in counters and (isinstance(length, bool) or not isinstance(length, (int, float))
                                      or not math.isfinite(length) or length < 0):
        return f"malformed {ACCEPT_LENGTH}: {length!r} (expected a number >= 0)"
    return None


def impossible_counters(counters: Mapping[str, Any], completion_tokens: int,
                        block_size: int | None = None) -> str | None:
    """Why these counters cannot describe a served request, or None: ``"malformed <field>: ..."``
    (:func:`malformed_counters`) or ``"impossible <field>: ..."``. Every round commits at least one
    token (so rounds <= completion_tokens - 1, served tau >= 1); the histogram has one entry per round
    and its weighted total is the correct-draft count; a round commits at most its correct drafts + 1;
    with the server's ``block_size`` known, a round has at most ``block_size - 1`` correct drafts.
    vLLM's counters: :func:`vllm_counters.impossible`, the same rules in its layout."""
    bad = malformed_counters(counters)
    if bad is not None:
        return bad
    if V.is_vllm(counters):
        return V.impossible(counters, completion_tokens, block_size)
    rounds = verify_rounds(counters)
    if rounds is None:
        return None
    committed = completion_tokens - 1
    if (why := too_many_rounds(rounds, completion_tokens, VERIFY_CT)) is not None:
        return why
    correct = counters.get(CORRECT_DRAFTS)
    hist = counters.get(HISTOGRAM)
    if hist is not None:
        if sum(hist) != rounds:
            return f"impossible {HISTOGRAM}: it counts {sum(hist)} rounds, {VERIFY_CT} = {rounds}"
        if correct is not None and sum(k * v for k, v in enumerate(hist)) != correct:
            return (f"impossible {HISTOGRAM}: it adds up to {sum(k * v for k, v in enumerate(hist))} correct drafts, "
                    f"{CORRECT_DRAFTS} = {correct!r}")
        top = max((k for k, v in enumerate(hist) if v), default=0)
        if block_size is not None and top > block_size - 1:
            return (f"impossible {HISTOGRAM}: a round with {top} correct drafts, the server drafts blocks of "
                    f"{block_size} (at most {block_size - 1} drafts)")
    if correct is not None and (why := too_few_drafts(completion_tokens, correct, rounds, CORRECT_DRAFTS,
                                                      "correct")) is not None:
        return why
    if block_size is not None and committed > rounds * block_size:
        return (f"impossible {VERIFY_CT}: {committed} tokens committed by {rounds} rounds of blocks of {block_size} "
                f"(at most {block_size} tokens a round)")
    return None


def comparability(entry: Any, block_size: int | None = None) -> tuple[str, str] | None:
    """None when the sample's served counters are comparable with the replay, else ``(kind, reason)``
    (kind SKIPPED or FLAGGED; the reason's text before its first ": " is a short label). The one
    definition of "samples whose served counters count", used by ``--served-check`` (:func:`compare`)
    and the callback's served baseline (:func:`served_tau`). ``block_size``: the server's, when known
    (:func:`served_block_size`).

    Counters no server sends are FLAGGED with the field named, before anything else: they are
    damage, never "no counters" or a difference. A sample without ``spec_verify_ct`` (or with 0) has no
    round to compare. vLLM's counters count only when they are the request's own (recorded
    ``attributable``), and only when every round verified a full block's drafts."""
    spec = getattr(entry, "served_spec", None)
    problem = served_spec_problem(spec)
    if problem is not None:
        return FLAGGED, problem
    counters = spec or {}
    vllm = V.is_vllm(counters)
    # Marked not the request's own at the precompute (a server restart's negative deltas, NaN from a server that
    # lost a series): that reason, not "malformed", is what happened.
    if vllm and counters.get(V.ATTRIBUTABLE) is False and (why := V.unattributed(counters)) is not None:
        return SKIPPED, why
    bad = malformed_counters(counters)
    if bad is not None:
        return FLAGGED, bad
    if vllm and (why := V.unattributed(counters)) is not None:
        return SKIPPED, why
    if vllm and (why := V.other_chain_length(counters, block_size)) is not None:
        return SKIPPED, why
    if verify_rounds(counters) is None:
        key = rounds_key(counters)
        if whole_count(counters.get(key)) == 0 and entry.completion_len > 1:
            # Every token after the prefill's first is committed by a round when the server speculates.
            said = "num_spec_steps" if counters.get(V.PER_REQUEST) else key
            return SKIPPED, (f"not speculated: {said} 0 for a {entry.completion_len}-token completion (every token "
                             "after the first is committed by a verify round when the server speculates): the server "
                             "did not speculate on this request; check its speculative config")
        return SKIPPED, ("no served counters: the server sends none for a request without a verification "
                         "round (e.g. a completion of one token), or it was not speculating")
    retractions = counters.get(RETRACTIONS)
    if retractions:
        return SKIPPED, (f"retracted {retractions:g} time(s) on the server (num_retractions): SGLang keeps "
                         "counting rounds across a retraction, so its counters do not describe one loop")
    if entry.valid_len < entry.total_len:
        return SKIPPED, (f"the CPU prefill disagrees with the served completion at completion offset "
                         f"{entry.valid_len - entry.prompt_len}: the replay stops there, the counters do not")
    why = impossible_counters(counters, entry.completion_len, block_size)
    if why is not None:
        return FLAGGED, why
    if vllm and (why := V.unlike_the_replay(counters, block_size)) is not None:
        return SKIPPED, why
    return None


def comparable_entries(entries: Sequence[Any], sample_ids: Sequence[str] | None = None,
                       block_size: int | None = None) -> list[Any]:
    wanted = set(sample_ids) if sample_ids is not None else None
    return [e for e in entries if (wanted is None or e.id in wanted) and comparability(e, block_size) is None]


# -- settings that make the server's drafts differ from the replay --------------------------------

def block_size_settings(server: Mapping[str, Any] | None, block_size: int | None,
                        drafter_block_size: int | None, methods: Sequence[str] = BLOCK_METHODS,
                        chain: bool = False) -> list[str]:
    """One line when the recorded server block (:func:`served_block_size`) is not the block the replay
    drafted (``block_size``; the drafter's trained block is ``drafter_block_size``), naming both."""
    server = server or {}
    out = []
    if server.get("server") == "vllm":
        said, counted = V.drafts_per_round(server)
        if said and counted and said != counted:
            out.append(f"the server's settings disagree: /server_info says num_speculative_tokens {said}, its "
                       f"per-position counter has {counted} positions: which block it drafted is unknown")
        setting = f"num_speculative_tokens {said or counted}"
    elif chain:
        setting = "speculative_num_steps + 1"
    else:
        both = [server.get(k) for k in ("dflash_block_size", "num_draft_tokens")]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in both) and both[0] != both[1]:
            out.append(f"the recorded server arguments disagree: speculative_dflash_block_size {both[0]}, "
                       f"speculative_num_draft_tokens {both[1]} (SGLang refuses that): which block it drafted is "
                       "unknown")
        setting = "speculative_num_draft_tokens"
    served = served_block_size(server, methods, chain)
    if served is None or block_size is None or served == block_size:
        return out
    drafter = f" (the drafter's block is {drafter_block_size})" if drafter_block_size not in (None, block_size) else ""
    if drafter_block_size is not None and served > drafter_block_size:
        out.append(f"the server drafts blocks of {served} tokens ({setting}), more than the "
                   f"drafter's trained block of {drafter_block_size}: the replay drafts at most that, so its cycles "
                   "cannot be the server's rounds")
    else:
        out.append(f"the server drafts blocks of {served} tokens ({setting}), the replay drafted "
                   f"blocks of {block_size}{drafter}: replay at the server's block (--block-size {served})")
    return out


def incomparable_settings(server: Mapping[str, Any] | None, longest_context: int,
                          drafter_input_embedding_scale: float = 1.0,
                          drafter_path: str | os.PathLike | None = None, block_size: int | None = None,
                          drafter_block_size: int | None = None, methods: Sequence[str] = BLOCK_METHODS,
                          label: str = "the evaluated drafter's method", chain: bool = False) -> list[str]:
    """One line per recorded server setting under which the server drafts differently from the replay
    (SGLang 0.5.23's DFlash worker; docs/method.md, "Tail blocks" and "Check against the server"),
    the block size included (:func:`block_size_settings`). A server speculating with another method than
    DFlash (``methods``: the evaluated drafter family's, named ``label``; ``chain``: a chain drafter's) is named
    too. For vLLM only those two
    are known (docs/served-check.md, "vLLM")."""
    server = server or {}
    out = []
    method = server.get("algorithm")
    if isinstance(method, str) and method.upper() not in (*methods, "NONE"):
        out.append(f"the server speculates with {method!r}, not {label}: its rounds are not the replay's cycles")
    if server.get("server") == "vllm" or tuple(methods) != BLOCK_METHODS:  # the settings below are DFlash's
        return out + block_size_settings(server, block_size, drafter_block_size, methods, chain)
    window = server.get("draft_window_size")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0 and longest_context > window:
        page = server.get("page_size")
        extra = (f"; with page size {page} up to {page - 1} more tokens stay visible"
                 if isinstance(page, int) and page > 1 else "")
        out.append(f"--speculative-draft-window-size {window}: the server drafts from the last {window} context "
                   f"tokens only{extra}; the replay sees all of them, and samples reach {longest_context} "
                   "tokens: drafts there can differ")
    folder = server.get("draft_folder") or {}
    local = draft_folder_settings(str(drafter_path)) if drafter_path is not None else None
    if folder.get("mask_embedding") or (local or {}).get("mask_embedding"):
        out.append(f"{MASK_EMBEDDING_FILE} in the draft folder: the server replaces the mask token's embedding row "
                   "with it, the replay uses the target's row: every draft can differ")
    out += block_size_settings(server, block_size, drafter_block_size, methods, chain)
    scales = {float(drafter_input_embedding_scale)}
    if isinstance(folder.get("input_embedding_scale"), (int, float)):
        scales.add(float(folder["input_embedding_scale"]))
    odd = sorted(x for x in scales if x != 1.0)
    if odd:
        out.append(f"input_embedding_scale {odd[0]:g}: the server ignores it (block embeddings unscaled), the replay "
                   "scales them: every draft can differ")
    return out


def served_tau(entries: Sequence[Any], sample_ids: Sequence[str] | None = None,
               block_size: int | None = None) -> tuple[float, int, int] | None:
    """Pooled served tau (replay's convention) over the comparable entries (:func:`comparability`, the
    samples ``--served-check`` compares; ``block_size``: the server's, :func:`served_block_size`):
    (tau, rounds, samples), or None."""
    rounds = tokens = n = 0
    for e in comparable_entries(entries, sample_ids, block_size):
        r, _ = served_rounds_and_tau(e.served_spec, e.completion_len)
        rounds += r
        tokens += e.completion_len - 1
        n += 1
    return (tokens / rounds, rounds, n) if rounds else None
