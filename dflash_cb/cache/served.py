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

Per round SGLang also counts the correct drafts (``spec_num_correct_drafts``, and the histogram
``spec_correct_drafts_histogram``: entry k = rounds with k correct drafts) before the round's
output is cut at a stop token or ``max_new_tokens``. The replay (``tail_blocks="served"``, full
blocks as the server drafts) counts the same leading matches per cycle (``SampleResult.correct_drafts``)
as far as the cache knows the target's tokens; only a last round whose matches reach the end of
the completion can have matched more on the server (a "censored" round, checked as a lower bound).

Which samples count (one rule, :func:`comparability`, for the check and the callback's served
baseline): a sample has counters (``spec_verify_ct`` > 0), was never retracted
(``num_retractions`` = 0: a retracted request keeps counting rounds across the retraction), the
CPU prefill agrees with the served completion over its whole length, and the counters are
possible (no more rounds than committed tokens, a histogram that adds up).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..common.errors import DFlashCBError

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
    """Every ``spec_*`` field of a ``/generate`` answer's ``meta_info`` (sorted), with ``num_retractions``
    when the answer has spec fields, or None when there is none.

    Names are kept as the server sends them (they changed between SGLang versions), values that are
    not JSON-safe (NaN, objects) are dropped. A non-speculative server sends none, and so does a
    speculative one for a request that needed no verification round (SGLang writes the fields only
    when ``spec_verify_ct > 0``).
    """
    if not isinstance(meta_info, Mapping):
        return None
    kept = {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in meta_info.items()
            if isinstance(k, str) and k.startswith(SPEC_PREFIX) and _json_safe(v)}
    if kept and _json_safe(meta_info.get(RETRACTIONS)) and RETRACTIONS in meta_info:
        kept[RETRACTIONS] = meta_info[RETRACTIONS]
    return {k: kept[k] for k in sorted(kept)} or None


def server_spec_config(server_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The speculative part of ``/get_server_info``: algorithm, draft model, draft tokens, topk, steps,
    the draft window size and the page size, and what the served draft folder says when it is
    readable from here (:func:`draft_folder_settings`).

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


def whole_count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < 0:
        return None
    return int(v)


def impossible_counters(counters: Mapping[str, Any], completion_tokens: int) -> str | None:
    """Why these counters cannot describe a served request, or None. Every round commits at least one
    token (so rounds <= completion_tokens - 1, served tau >= 1); the histogram has one entry per round
    and its weighted total is the correct-draft count; a round commits at most its correct drafts + 1."""
    rounds = verify_rounds(counters)
    if rounds is None:
        return None
    committed = completion_tokens - 1
    if rounds > committed:
        return (f"{rounds} rounds for {committed} tokens committed by rounds (served tau "
                f"{committed / rounds:.3f} < 1): every round commits at least one token")
    correct = counters.get(CORRECT_DRAFTS)
    hist = counters.get(HISTOGRAM)
    if hist is not None:
        if not isinstance(hist, list) or any(whole_count(v) is None for v in hist):
            return f"{HISTOGRAM} = {hist!r}: expected a list of counts"
        if sum(hist) != rounds:
            return f"{HISTOGRAM} counts {sum(hist)} rounds, {VERIFY_CT} = {rounds}"
        if correct is not None and sum(k * v for k, v in enumerate(hist)) != correct:
            return (f"{HISTOGRAM} adds up to {sum(k * v for k, v in enumerate(hist))} correct drafts, "
                    f"{CORRECT_DRAFTS} = {correct!r}")
    if correct is not None:
        c = whole_count(correct)
        if c is None:
            return f"{CORRECT_DRAFTS} = {correct!r}: expected a whole number"
        if committed > c + rounds:
            return (f"{committed} tokens committed by {rounds} rounds with {c} correct drafts: a round commits at "
                    "most its correct drafts + 1")
    return None


def comparability(entry: Any) -> tuple[str, str] | None:
    """None when the sample's served counters are comparable with the replay, else ``(kind, reason)``
    (kind SKIPPED or FLAGGED). The one definition of "samples whose served counters count", used by
    ``--served-check`` (:func:`compare`) and the callback's served baseline (:func:`served_tau`)."""
    counters = getattr(entry, "served_spec", None) or {}
    if verify_rounds(counters) is None:
        return SKIPPED, ("no served counters (the server sends none for a request without a verification "
                         "round, e.g. a completion of one token, or it was not speculating)")
    retractions = counters.get(RETRACTIONS)
    if isinstance(retractions, (int, float)) and not isinstance(retractions, bool) and retractions > 0:
        return SKIPPED, (f"retracted {retractions:g} time(s) on the server (num_retractions): SGLang keeps "
                         "counting rounds across a retraction, so its counters do not describe one loop")
    if entry.valid_len < entry.total_len:
        return SKIPPED, (f"the CPU prefill disagrees with the served completion at completion offset "
                         f"{entry.valid_len - entry.prompt_len}: the replay stops there, the counters do not")
    why = impossible_counters(counters, entry.completion_len)
    if why is not None:
        return FLAGGED, f"counters that cannot be: {why}"
    return None


def comparable_entries(entries: Sequence[Any], sample_ids: Sequence[str] | None = None) -> list[Any]:
    wanted = set(sample_ids) if sample_ids is not None else None
    return [e for e in entries if (wanted is None or e.id in wanted) and comparability(e) is None]


# -- settings that make the server's drafts differ from the replay --------------------------------

def incomparable_settings(server: Mapping[str, Any] | None, longest_context: int,
                          drafter_input_embedding_scale: float = 1.0,
                          drafter_path: str | os.PathLike | None = None) -> list[str]:
    """One line per recorded server setting under which the server drafts differently from the replay
    (SGLang 0.5.23's DFlash worker; docs/method.md, "Tail blocks" and "Check against the server")."""
    server = server or {}
    out = []
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
    scales = {float(drafter_input_embedding_scale)}
    if isinstance(folder.get("input_embedding_scale"), (int, float)):
        scales.add(float(folder["input_embedding_scale"]))
    odd = sorted(x for x in scales if x != 1.0)
    if odd:
        out.append(f"input_embedding_scale {odd[0]:g}: the server ignores it (block embeddings unscaled), the replay "
                   "scales them: every draft can differ")
    return out


def served_tau(entries: Sequence[Any], sample_ids: Sequence[str] | None = None) -> tuple[float, int, int] | None:
    """Pooled served tau (replay's convention) over the comparable entries (:func:`comparability`, the
    samples ``--served-check`` compares): (tau, rounds, samples), or None."""
    rounds = tokens = n = 0
    for e in comparable_entries(entries, sample_ids):
        r, _ = served_rounds_and_tau(e.served_spec, e.completion_len)
        rounds += r
        tokens += e.completion_len - 1
        n += 1
    return (tokens / rounds, rounds, n) if rounds else None
