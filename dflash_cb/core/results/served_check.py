"""The served check: the offline replay against the server's own speculative counters, per sample.

``tools/eval_drafter.py --served-check`` runs it. The counters' definitions (which fields SGLang sends,
what vLLM's ``/metrics`` deltas mean, their conventions, which samples are comparable) live with the
cache in ``dflash_cb.cache.served`` and ``dflash_cb.cache.vllm_counters``; this module compares them
with the replay's cycles and correct drafts (SGLang's histogram of correct drafts per round, vLLM's
accepted drafts per position) and summarises the difference with the comparison code's paired
bootstrap (docs/method.md, *Conventions*).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...cache import vllm_counters as V
from ...cache.served import (
    ACCEPT_LENGTH,
    CONVENTION,
    CORRECT_DRAFTS,
    FLAGGED,
    HISTOGRAM,
    SKIPPED,
    ServedCheckError,
    comparability,
    comparable_entries,
    convention_of,
    histogram_of,
    incomparable_settings,
    rounds_key,
    served_block_size,
    served_rounds_and_tau,
    trim_histogram,
    whole_count,
)
from ..drafters.base import DrafterFamily
from ..drafters.registry import default_family, family_named
from ..figures.bootstrap import Sums, paired_difference

EQUAL, CENSORED, DIFFERS = "equal", "equal_censored", "differs"


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
    offline_correct_drafts: int | None = None  # None: the replay's per-cycle counts were not given
    served_correct_drafts: int | None = None
    offline_histogram: list[int] | None = None
    served_histogram: list[int] | None = None
    # EQUAL; CENSORED (equal, the last round's count a lower bound that the server's meets); DIFFERS;
    # None when either side has no histogram
    histogram: str | None = None
    # vLLM: rounds whose first j + 1 drafts were accepted, per position j; their status as for the histogram
    offline_per_position: list[int] | None = None
    served_per_position: list[int] | None = None
    per_position: str | None = None
    # vLLM's mean acceptance length, 1 + correct drafts / rounds (vllm_counters.mean_acceptance_length)
    offline_vllm_accept_length: float | None = None
    served_vllm_accept_length: float | None = None
    # vLLM's per_step_accepted (--per-request-spec-decode-metrics detailed): drafts accepted at each verify step,
    # against the replay's per-cycle correct drafts; EQUAL, CENSORED (the last step's), DIFFERS, or None
    served_per_step: list[int] | None = None
    per_step: str | None = None
    first_step_difference: int | None = None

    @property
    def equal(self) -> bool:
        return self.offline_rounds == self.served_rounds


def histogram_status(correct: Sequence[int], censored: bool, served: Sequence[int]) -> str:
    """Offline per-cycle correct drafts against the server's histogram. ``censored``: the last cycle's
    matches reached the end of the known completion, so the server may have counted more there."""
    if trim_histogram(histogram_of(correct)) == trim_histogram(served):
        return EQUAL
    if censored and correct:
        rest = histogram_of(correct[:-1])
        left = [int(v) for v in served] + [0] * max(0, len(rest) - len(served))
        for k, v in enumerate(rest):
            left[k] -= v
        if min(left, default=0) >= 0 and sum(left) == 1 and left.index(1) >= correct[-1]:
            return CENSORED
    return DIFFERS


def per_position_status(correct: Sequence[int], censored: bool, served: Sequence[int]) -> str:
    """Offline per-cycle correct drafts against vLLM's per-position counts (entry j: rounds whose first
    j + 1 drafts were accepted). ``censored`` as for :func:`histogram_status`: then the server may have
    accepted more in the last round, which adds one at each position from the replay's count on."""
    offline = V.accepted_per_position(correct, len(served))
    if offline == [int(v) for v in served]:
        return EQUAL
    if censored and correct:
        extra = [j for j, (a, b) in enumerate(zip(served, offline, strict=True)) if a != b]
        steps = [int(served[j]) - offline[j] for j in extra]
        if extra and set(steps) == {1} and extra == list(range(correct[-1], correct[-1] + len(extra))):
            return CENSORED
    return DIFFERS


def per_step_status(correct: Sequence[int], censored: bool, served: Sequence[int]) -> tuple[str, int | None]:
    """The replay's per-cycle correct drafts against the server's drafts accepted at each verify step, in order:
    (status, the first step that differs or None). ``censored``: the last step may have accepted more."""
    served = [int(v) for v in served]
    if list(correct) == served:
        return EQUAL, None
    if censored and len(correct) == len(served) and list(correct[:-1]) == served[:-1] and served[-1] > correct[-1]:
        return CENSORED, None
    first = next((j for j, (a, b) in enumerate(zip(correct, served, strict=False)) if a != b),
                 min(len(correct), len(served)))
    return DIFFERS, first


def _pooled(vectors: Sequence[Sequence[int] | None]) -> list[int] | None:
    given = [list(v) for v in vectors if v is not None]
    if not given:
        return None
    return [sum(v[j] for v in given if j < len(v)) for j in range(max(len(v) for v in given))]


@dataclass
class ServedCheck:
    samples: list[SampleCheck]
    skipped: dict[str, str]  # sample id -> why it is not compared
    server: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    convention: str = CONVENTION
    flagged: dict[str, str] = field(default_factory=dict)  # sample id -> why its counters cannot be
    not_comparable: list[str] = field(default_factory=list)  # server settings that change the drafts
    # The block sizes: "replay" (what the replay drafted), "server" (recorded; None: unknown), "drafter".
    blocks: dict[str, int | str | None] = field(default_factory=dict)

    @property
    def comparable(self) -> bool:
        return not self.not_comparable

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
        hist = [x for x in s if x.histogram is not None or x.per_position is not None]
        pos = [x for x in s if x.per_position is not None]
        interval = self.paired_interval()
        known = [x for x in s if x.offline_correct_drafts is not None and x.served_correct_drafts is not None]
        k_rounds = (sum(x.offline_rounds for x in known), sum(x.served_rounds for x in known))
        return {
            "comparable": self.comparable,
            "samples_compared": len(s),
            "samples_equal_rounds": self.equal_rounds,
            "samples_with_histogram": sum(x.histogram is not None for x in s),
            "samples_equal_histogram": sum(x.histogram in (EQUAL, CENSORED) for x in s),
            "samples_histogram_censored": sum(x.histogram == CENSORED for x in s),
            "samples_with_per_position": len(pos),
            "samples_equal_per_position": sum(x.per_position in (EQUAL, CENSORED) for x in pos),
            "samples_per_position_censored": sum(x.per_position == CENSORED for x in pos),
            "samples_with_per_step": sum(x.per_step is not None for x in s),
            "samples_equal_per_step": sum(x.per_step in (EQUAL, CENSORED) for x in s),
            # vLLM's layout pooled over those samples: entry j = rounds whose first j + 1 drafts were accepted
            "offline_per_position": _pooled([x.offline_per_position for x in pos]),
            "served_per_position": _pooled([x.served_per_position for x in pos]),
            # vLLM's "Mean acceptance length" (1 + accepted / drafts, pooled over rounds) on both sides
            "vllm_mean_acceptance_length": None if not (known and all(k_rounds)) else {
                "offline": round(V.mean_acceptance_length(sum(x.offline_correct_drafts for x in known), k_rounds[0]), 6),
                "served": round(V.mean_acceptance_length(sum(x.served_correct_drafts for x in known), k_rounds[1]), 6)},
            "samples_skipped": len(self.skipped),
            "samples_flagged": len(self.flagged),
            "offline_rounds": off_rounds,
            "served_rounds": srv_rounds,
            "offline_correct_drafts": sum(x.offline_correct_drafts or 0 for x in hist),
            "served_correct_drafts": sum(x.served_correct_drafts or 0 for x in hist),
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
        off_p, off_c, srv_p, srv_c = self.paired_sums()
        iv = paired_difference(Sums.of(off_p, off_c), Sums.of(srv_p, srv_c))
        return iv.value, iv.low, iv.high

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "convention": self.convention, "server": self.server,
                "blocks": dict(self.blocks),
                "warnings": list(self.warnings), "not_comparable": list(self.not_comparable),
                "skipped": dict(self.skipped), "flagged": dict(self.flagged),
                "samples": [{**asdict(x), "equal": x.equal} for x in self.samples]}


def has_served_counters(entries: Sequence[Any]) -> bool:
    """Whether any sample holds the server's round count (SGLang's ``spec_verify_ct``, vLLM's ``num_drafts``),
    whatever its value, or vLLM counters marked unattributable: a malformed or unattributable one is
    skipped or flagged by the check with its reason (:func:`comparability`), not mistaken for a cache
    without counters."""
    return any(isinstance(e.served_spec, Mapping) and (rounds_key(e.served_spec) in e.served_spec
                                                       or V.ATTRIBUTABLE in e.served_spec) for e in entries)


def _family(name: str | None) -> DrafterFamily:
    """The drafter family ``name`` (the default family when None), whose ``served_methods`` a server names."""
    return family_named(name) if name else default_family()


def replay_block_size(server: Mapping[str, Any] | None, drafter_block_size: int, requested: int | None = None,
                      name: str = "--block-size", family: str | None = None) -> int:
    """The block ``--served-check`` replays at: ``requested`` when given, else the server's recorded block
    (:func:`served_block_size`) when the drafter can draft it, else the drafter's (a server block
    larger than the drafter's, or unknown: :func:`compare` says whether the check is comparable).
    A ``requested`` block other than the recorded server block is refused (``name`` names it)."""
    fam = _family(family)
    served = served_block_size(server, fam.served_methods, fam.kind == "chain")
    if requested is not None and served is not None and requested != served:
        raise ServedCheckError(f"{name} {requested} with --served-check: the server drafted blocks of {served} "
                               f"tokens (the cache's served_spec_config); drop {name}: the check replays at the "
                               "server's block")
    if requested is not None:
        return requested
    if served is not None and 2 <= served <= drafter_block_size:
        return served
    return drafter_block_size


def nothing_to_compare(cache_path: str | os.PathLike) -> ServedCheckError:
    return ServedCheckError(
        f"{cache_path}: no sample holds the server's speculative counters (spec_verify_ct, or vLLM's {V.DRAFTS}), "
        "so there is nothing to compare; precompute with --reference sglang against a server that runs the drafter "
        "(sglang.launch_server ... --speculative-algorithm DFLASH --speculative-draft-model-path <drafter>), or with "
        "--reference vllm --max-in-flight 1 against vllm serve <target> --speculative-config "
        "'{\"method\": \"dflash\", \"model\": <drafter>, ...}'")


def nothing_selected(cache_path: str | os.PathLike, selected: Sequence[Any]) -> ServedCheckError | None:
    """The error when none of the selected samples has comparable counters (:func:`comparability`), else None."""
    if not selected or comparable_entries(selected):
        return None
    verdicts = [(e.id, why) for e in selected if (why := comparability(e)) is not None]
    reasons = Counter(why[1].split(": ")[0] for _, why in verdicts)
    listed = "; ".join(f"{n} x {label}" for label, n in sorted(reasons.items())[:5])
    more = f"; {len(reasons) - 5} more kinds" if len(reasons) > 5 else ""
    flagged = next((f"; flagged {sid}: {why[1]}" for sid, why in verdicts if why[0] == FLAGGED), "") or \
        next((f"; e.g. {sid}: {why[1]}" for sid, why in verdicts), "")
    return ServedCheckError(
        f"{cache_path}: none of the {len(selected)} selected sample(s) has served counters to compare "
        f"({listed}{more}{flagged}); select samples that do (--sample-ids / --samples), or drop --served-check")


def _block_source(server: Mapping[str, Any] | None, server_block: int | None, counted_block: int | None) -> str | None:
    """Which record decided the server's block: its configuration, vLLM's counter positions, or the counters."""
    if server_block is not None:
        said, _ = V.drafts_per_round(server) if (server or {}).get("server") == "vllm" else (server_block, None)
        return "configuration" if said else "positions"
    return "counters" if counted_block is not None else None


def compare(entries: Sequence[Any], offline: Mapping[str, Sequence[int]], server: Mapping[str, Any] | None = None,
            drafter_block_size: int | None = None, drafter_path: str | None = None,
            correct_drafts: Mapping[str, Sequence[int]] | None = None,
            drafter_input_embedding_scale: float = 1.0, block_size: int | None = None,
            family: str | None = None) -> ServedCheck:
    """Compare the replay (``offline``: sample id -> acceptance_lengths; ``correct_drafts``: sample id ->
    correct drafts per cycle, from a ``tail_blocks="served"`` replay at ``block_size``, default
    ``drafter_block_size``) with each entry's ``served_spec``.

    Only samples that pass :func:`comparability` are compared; the others are listed as skipped or
    flagged with the reason. When a recorded server setting makes the server's drafts differ from
    the replay (:func:`incomparable_settings`: a draft window, the mask embedding, a block other than
    the replay's) the check says so once and is marked not comparable. When the server's block is not
    recorded, counters that prove rounds longer than the replay's block do the same. ``family``: the drafter's
    (None: the default), whose speculative methods the server must name (``DrafterFamily.served_methods``).
    """
    block = block_size if block_size is not None else drafter_block_size
    fam = _family(family)
    server_block = served_block_size(server, fam.served_methods, fam.kind == "chain")
    vllm = any(V.is_vllm(e.served_spec) for e in entries if e.id in offline)
    # vLLM: the block its counters show, when its configuration is not recorded
    counted_block = _counted_block(entries, offline) if vllm and server_block is None else None
    checks: list[SampleCheck] = []
    skipped: dict[str, str] = {}
    flagged: dict[str, str] = {}
    longest = 0
    longest_round = 0  # the most tokens one server round must have drafted (anchor included), from its counters
    for e in entries:
        if e.id not in offline:
            continue
        why = comparability(e, server_block or counted_block)
        if why is not None:
            (skipped if why[0] == SKIPPED else flagged)[e.id] = why[1]
            continue
        longest = max(longest, e.total_len - 1)  # the last anchor's context: every position before it
        correct = None if correct_drafts is None else correct_drafts.get(e.id)
        check, round_tokens = _sample_check(e, list(offline[e.id]), correct, block)
        longest_round = max(longest_round, round_tokens)
        checks.append(check)
    warnings = _warnings(checks, server, drafter_path, server_block)
    settings = incomparable_settings(server, longest, drafter_input_embedding_scale, drafter_path, block,
                                     drafter_block_size, fam.served_methods, fam.label, fam.kind == "chain")
    settings += _block_settings(server_block, counted_block, block, drafter_block_size, longest_round)
    warnings += [f"not comparable: {w}" for w in settings]
    return ServedCheck(checks, skipped, dict(server) if server else None, warnings, flagged=flagged,
                       not_comparable=settings,
                       convention=V.convention_of([e.served_spec for e in entries if e.id in offline]) if vllm
                       else CONVENTION,
                       blocks={"replay": block, "server": server_block or counted_block, "drafter": drafter_block_size,
                               # which source decided the server's block: its recorded configuration wins
                               "server_from": _block_source(server, server_block, counted_block)})


def _counted_block(entries: Sequence[Any], offline: Mapping[str, Sequence[int]]) -> int | None:
    """vLLM: the block most of its requests' counters show (drafts per round + 1), when its configuration is not
    recorded."""
    shown = Counter(b for e in entries if e.id in offline and V.is_vllm(e.served_spec)
                    and V.unattributed(e.served_spec) is None and (b := V.block_of(e.served_spec)) is not None)
    return shown.most_common(1)[0][0] if shown else None


def _sample_check(e: Any, lengths: list[int], correct: Sequence[int] | None,
                  block: int | None) -> tuple[SampleCheck, int]:
    """One comparable sample's check, and the most tokens one of its server rounds must have drafted."""
    counters = e.served_spec
    rounds, tau = served_rounds_and_tau(counters, e.completion_len)
    hist = counters.get(HISTOGRAM)
    top = max((k for k, v in enumerate(hist) if v), default=0) if isinstance(hist, list) else 0
    round_tokens = max(top + 1, -(-(e.completion_len - 1) // rounds))
    length = counters.get(ACCEPT_LENGTH)
    check = SampleCheck(
        id=e.id, category=e.category, offline_rounds=len(lengths), served_rounds=rounds,
        offline_tau=sum(lengths) / len(lengths) if lengths else None, served_tau=tau,
        served_accept_length=float(length) if isinstance(length, (int, float)) else None,
        convention=convention_of(counters, e.completion_len))
    if V.is_vllm(counters) and (accepted := whole_count(counters.get(V.ACCEPTED))) is not None:
        check.served_accept_length = V.mean_acceptance_length(accepted, rounds)  # vLLM's own convention
    if correct is not None:
        _correct_drafts(check, e, [int(k) for k in correct], lengths, rounds, block, hist)
    return check, round_tokens


def _correct_drafts(check: SampleCheck, e: Any, correct: list[int], lengths: list[int], rounds: int,
                    block: int | None, hist: Any) -> None:
    """The replay's correct drafts per cycle against the server's counters of them: their sum and histogram
    (both servers; ``hist``: the server's histogram as recorded), and vLLM's per verify step and per position
    (``_vllm_steps``)."""
    counters = e.served_spec
    check.offline_correct_drafts = sum(correct)
    check.offline_histogram = histogram_of(correct)
    check.served_correct_drafts = whole_count(counters.get(V.ACCEPTED if V.is_vllm(counters) else CORRECT_DRAFTS))
    # The last cycle matched up to the last known token: the server may have matched more.
    last_anchor = e.prompt_len + sum(lengths[:-1])
    censored = bool(correct) and (block is None or correct[-1] < block - 1) \
        and last_anchor + correct[-1] + 1 >= e.total_len
    if isinstance(hist, list):
        check.served_histogram = [int(v) for v in hist]
        check.histogram = histogram_status(correct, censored, check.served_histogram)
    if V.is_vllm(counters):
        _vllm_steps(check, counters, correct, censored)
    if lengths and check.served_correct_drafts is not None:
        check.offline_vllm_accept_length = V.mean_acceptance_length(sum(correct), len(lengths))
        check.served_vllm_accept_length = V.mean_acceptance_length(check.served_correct_drafts, rounds)


def _vllm_steps(check: SampleCheck, counters: Mapping[str, Any], correct: list[int], censored: bool) -> None:
    """vLLM's own finer counters, when it recorded them: accepted drafts per verify step (its per-request
    metrics) and per draft position."""
    steps = V.per_step_accepted(counters)
    if steps is not None:
        check.served_per_step = steps
        check.per_step, check.first_step_difference = per_step_status(correct, censored, steps)
    served_pp = V.per_position(counters)
    if served_pp is not None:
        check.served_per_position = served_pp
        check.offline_per_position = V.accepted_per_position(correct, len(served_pp))
        check.per_position = per_position_status(correct, censored, served_pp)


def _warnings(checks: Sequence[SampleCheck], server: Mapping[str, Any] | None, drafter_path: str | None,
              server_block: int | None) -> list[str]:
    """What may explain differences without making the check incomparable."""
    warnings = []
    served_path = (server or {}).get("draft_model_path")
    if drafter_path and isinstance(served_path, str) and served_path:
        a = os.path.basename(str(served_path).rstrip("/")).lower()
        b = os.path.basename(str(drafter_path).rstrip("/")).lower()
        if a != b:
            warnings.append(f"the server speculates with {served_path!r}, not obviously the evaluated drafter "
                            f"{drafter_path!r}: differences may just mean different drafters")
    missing = [c.id for c in checks if c.served_accept_length is None]
    if missing:
        warnings.append(f"{len(missing)} sample(s) have no {ACCEPT_LENGTH} (e.g. {missing[0]}): their rounds are "
                        "compared, the server's accept length is not shown")
    odd = sorted({c.convention for c in checks if c.served_accept_length is not None} - {"with_prefill_token", "vllm"})
    if odd:
        warnings.append(f"some samples' spec_accept_length does not fit completion_tokens / spec_verify_ct "
                        f"(conventions seen: {odd}); the round counts are still compared")
    if server_block is None and any(c.histogram == DIFFERS for c in checks):
        most_served = max(len(trim_histogram(c.served_histogram or [])) - 1 for c in checks)
        most_offline = max(len(c.offline_histogram or []) - 1 for c in checks)
        if 0 <= most_served < most_offline:  # a hint, not a proof: another drafter looks the same
            warnings.append(f"the server's block is not recorded; no server round had more than {most_served} "
                            f"correct drafts, the replay's up to {most_offline}: if the server drafted blocks of "
                            f"{most_served + 1}, rerun with --block-size {most_served + 1}")
    return warnings


def _block_settings(server_block: int | None, counted_block: int | None, block: int | None,
                    drafter_block_size: int | None, longest_round: int) -> list[str]:
    """Why the server's block differs from the replay's when its configuration is not recorded: vLLM's counters
    show another block, or some round drafted more tokens than the replay's block holds."""
    if counted_block is not None and block is not None and counted_block != block:
        drafter = (f", the drafter's trained block is {drafter_block_size}: the replay cannot draft that long"
                   if drafter_block_size is not None and counted_block > drafter_block_size
                   else f": replay at the server's block (--block-size {counted_block})")
        return [f"the server's configuration is not recorded, and its counters show blocks of {counted_block} "
                f"tokens ({V.DRAFT_TOKENS} / {V.DRAFTS} + 1), the replay drafted blocks of {block}{drafter}"]
    if server_block is None and counted_block is None and block is not None and longest_round > block:
        return [f"the server's block is not recorded, and its counters show a round of at least "
                f"{longest_round} tokens, longer than the replay's blocks of {block}"
                + (f" (the drafter's block is {drafter_block_size})" if drafter_block_size not in
                   (None, block) else "") + ": the server drafted with another block or drafter"]
    return []


def format_check(check: ServedCheck, max_rows: int = 40) -> str:
    """A readable report: the convention, the summary, then one line per sample (differences first)."""
    s = check.summary()

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    vllm = check.convention in (V.CONVENTION, V.REQUEST_CONVENTION)
    per_request = check.convention == V.REQUEST_CONVENTION or any(x.served_per_step is not None for x in check.samples)
    source = ("vLLM's per-request metrics" if per_request else f"vLLM {V.DRAFTS} across each request") if vllm \
        else "SGLang spec_verify_ct"
    lines = [f"served check: offline replay vs the server's own counters ({source})",
             f"  convention: {check.convention}"]
    if check.server:
        lines.append("  server: " + ", ".join(f"{k}={v}" for k, v in check.server.items()))
    if check.blocks:
        b = check.blocks
        source = {"configuration": " (its recorded configuration: /get_server_info or /server_info)",
                  "positions": " (the positions of its per-position counter on /metrics; no /server_info)",
                  "counters": " (its requests' counters: drafts per round + 1; no configuration recorded)"}
        lines.append(f"  blocks: replay {b.get('replay')}, server {b.get('server') or 'not recorded'}"
                     f"{source.get(b.get('server_from'), '')}, drafter {b.get('drafter')}")
    if not check.comparable:
        lines.append("  NOT COMPARABLE: a recorded server setting changes the server's drafts (below); "
                     "differences are expected, not mismatches")
    lines.append(f"  samples compared {s['samples_compared']}, equal round counts {s['samples_equal_rounds']}"
                 f"/{s['samples_compared']}, skipped {s['samples_skipped']}, flagged {s['samples_flagged']}")
    if s["samples_with_histogram"]:
        lines.append(f"  correct-draft histograms equal {s['samples_equal_histogram']}/{s['samples_with_histogram']}"
                     f" ({s['samples_histogram_censored']} with a censored last round); correct drafts offline "
                     f"{s['offline_correct_drafts']}, served {s['served_correct_drafts']}")
    if s["samples_with_per_position"]:
        lines.append(f"  per-position acceptance equal {s['samples_equal_per_position']}/{s['samples_with_per_position']}"
                     f" ({s['samples_per_position_censored']} with a censored last round); accepted drafts offline "
                     f"{s['offline_correct_drafts']}, served {s['served_correct_drafts']}; per position offline "
                     f"{s['offline_per_position']}, served {s['served_per_position']}")
    if s["samples_with_per_step"]:
        lines.append(f"  every verify step equal {s['samples_equal_per_step']}/{s['samples_with_per_step']} (the "
                     "server's per_step_accepted against the replay's cycles, in order)")
    if s["vllm_mean_acceptance_length"] is not None:
        m = s["vllm_mean_acceptance_length"]
        lines.append(f"  mean acceptance length, vLLM's convention (1 + accepted / drafts): offline {f(m['offline'])}, "
                     f"served {f(m['served'])} (tau below counts the tokens committed, after the last round's cut)")
    lines.append(f"  rounds offline {s['offline_rounds']}, served {s['served_rounds']}; pooled tau offline "
                 f"{f(s['offline_tau'])}, served {f(s['served_tau'])}; mean |tau diff| per sample "
                 f"{f(s['mean_abs_tau_diff'])}")
    if s["tau_diff_interval"] is not None and check.comparable:
        d, lo, hi = s["tau_diff_interval"]
        lines.append(f"  served - offline tau {d:+.3f}, paired 95% interval [{lo:+.3f}, {hi:+.3f}]")
    for w in check.warnings:
        lines.append(f"  warning: {w}")
    def same(x: SampleCheck) -> bool:
        return x.equal and DIFFERS not in (x.histogram, x.per_position, x.per_step)

    rows = sorted(check.samples, key=lambda x: (same(x), x.id))
    if rows:
        lines.append(f"  {'sample':<16} {'rounds off':>10} {'served':>7} {'tau off':>8} {'served':>7}  "
                     + ("server 1 + accepted/drafts" if vllm else "server accept_length"))
    for x in rows[:max_rows]:
        mark = "" if same(x) else ("  <- differs" if check.comparable else "  (differs)")
        if x.histogram == DIFFERS:
            mark += f" (histogram offline {x.offline_histogram}, served {x.served_histogram})"
        if x.per_position == DIFFERS:
            mark += f" (per position offline {x.offline_per_position}, served {x.served_per_position})"
        if x.per_step == DIFFERS:
            mark += f" (verify step {x.first_step_difference} first differs)"
        lines.append(f"  {x.id:<16} {x.offline_rounds:>10} {x.served_rounds:>7} {f(x.offline_tau):>8} "
                     f"{f(x.served_tau):>7}  {f(x.served_accept_length)}{mark}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more in the results file")
    for sid, why in list(check.flagged.items())[:10]:
        lines.append(f"  flagged {sid}: {why}")
    for sid, why in list(check.skipped.items())[:10]:
        lines.append(f"  skipped {sid}: {why}")
    if len(check.skipped) > 10:
        lines.append(f"  ... {len(check.skipped) - 10} more skipped")
    return "\n".join(lines)


# -- the served drafter as a baseline (callback) ------------------------------------------------------

