"""The serving projection: tokens per second and speedup over plain decoding, from the exact replay's cycles
and a cost profile (docs/serving.md).

A speculative cycle commits ``produced`` tokens and costs ``draft_passes * C_draft + C_verify(n; context)``,
``n`` the tokens the target verifies (the block; a DDTree's nodes and its root; a chain's K drafts and its
anchor). Plain decoding pays ``C_verify(1; position)`` per token. Every cycle of every sample is priced at its
own context (the anchor's position), so a long-tailed acceptance distribution and long completions are
projected as they are, not through the mean tau. Per sample: tokens, speculative seconds, plain seconds;
tokens per second and speedup are ratios of their sums, with intervals from the same cluster bootstrap as
tau (``bootstrap``).

Pure: no I/O, no torch. The profile file's reading and the measuring live in ``integrations.profile_cli``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ...common.errors import DFlashCBError
from ..figures.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, Sums, intervals, paired_difference

PROFILE_FORMAT = "dflash-cb-cost-profile"
# 2: the per-cycle overhead, the rows' spread and flags. A version-1 file reads as one without them.
PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)
ProfileKind = Literal["measured", "roofline", "user"]
PROFILE_KINDS: tuple[ProfileKind, ...] = ("measured", "roofline", "user")
# What a projection is, said beside every projected figure.
PROJECTION_NOTE = ("projection: the exact replay's cycles priced with the cost profile named here (measured step "
                   "times, a roofline estimate or the user's own numbers), not a measured serving speed")
# The identity fields a profile records; a target field that differs from the cache's refuses the profile.
TARGET_FIELDS = ("hidden_size", "num_layers", "vocab_size")
DRAFTER_FIELDS = ("family", "hidden_size", "num_layers", "block_size")
# What a cycle of each kind of setting pays besides the two models' calls (``CostProfile.overhead``).
CYCLE_KINDS = ("block", "ddtree", "chain")
# No step of a served model takes an hour: a larger figure is a unit or a typing mistake.
MAX_STEP_SECONDS = 3600.0


class ProfileError(DFlashCBError, ValueError):
    """A cost profile that cannot be used: unreadable, or measured for something else."""


@dataclass(frozen=True)
class CostProfile:
    """Measured (or stated) step costs for one target, drafter and device, at batch ``batch_size``.

    ``verify``: per context length (0: the same at every context), the target's verify step as sorted
    (verified tokens, seconds) rows; between rows interpolated, beyond them refused. ``draft``: per context
    length (0: every context), the seconds of one drafter pass (a block drafter) or one step (a chain drafter).
    ``target`` / ``drafter``: what it was measured for (``TARGET_FIELDS`` / ``DRAFTER_FIELDS``, any subset).
    ``source``: the command that measured it, the roofline's stated numbers, or the user's file. ``others``:
    more drafters timed against the same target steps, as (identity, draft seconds per context): one profile
    serves drafters of several families side by side (``for_drafter`` picks a drafter's own).

    ``overhead``: per kind of setting (``CYCLE_KINDS``), the seconds a cycle pays outside the target's verify
    and the drafter's passes (acceptance, cache cuts, a tree's heap and mask), measured from real cycles by the
    speed check (``tools/speed_check.py --profile-out``) or stated; absent: none. ``spread``: per context, each
    verify row's (tokens, relative spread of its repeats: (max - min) / median); ``flags``: rows that stayed
    unstable or broke monotonicity after being measured again, in words."""

    kind: ProfileKind
    verify: dict[int, tuple[tuple[int, float], ...]]
    draft: dict[int, float]
    target: dict[str, Any] = field(default_factory=dict)
    drafter: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    dtype: str = ""
    batch_size: int = 1
    date: str = ""
    source: str = ""
    others: tuple[tuple[dict[str, Any], dict[int, float]], ...] = ()
    overhead: dict[str, float] = field(default_factory=dict)
    spread: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    # Per context, each verify row's repeats (verified tokens, seconds of every timed run): a measured profile's
    # own noise, resampled into the projection's interval (``project``).
    repeats: dict[int, tuple[tuple[int, tuple[float, ...]], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in PROFILE_KINDS:
            raise ProfileError(f"profile kind {self.kind!r} is not one of {', '.join(PROFILE_KINDS)}")
        if not self.verify:
            raise ProfileError("the profile has no verify rows: measure some (tools/profile_costs.py) or give "
                               "--from-csv rows 'verified_tokens,seconds'")
        for ctx, rows in self.verify.items():
            ns = [n for n, _ in rows]
            if ctx < 0 or not rows or ns != sorted(set(ns)) or ns[0] < 1:
                raise ProfileError(f"verify rows at context {ctx}: verified token counts must be distinct integers "
                                   f">= 1 in increasing order, got {ns}")
            if any(not (math.isfinite(s) and 0 < s <= MAX_STEP_SECONDS) for _, s in rows):
                raise ProfileError(f"verify rows at context {ctx}: every time must be a positive number of seconds "
                                   f"up to {MAX_STEP_SECONDS:g}")
        for draft in (self.draft, *(d for _, d in self.others)):
            if not draft or any(c < 0 or not (math.isfinite(s) and 0 <= s <= MAX_STEP_SECONDS) for c, s in draft.items()):
                raise ProfileError("the profile's draft seconds must be non-negative numbers per context (0: any)")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ProfileError(f"batch_size {self.batch_size!r}: the batch the times are for, an integer >= 1")
        for what, fields, have in (("target", TARGET_FIELDS, self.target), ("drafter", DRAFTER_FIELDS, self.drafter)):
            for f in fields:  # compared with a cache's and a drafter's integers: "64" would never match 64
                v = have.get(f)
                if v is not None and f != "family" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise ProfileError(f"{what} {f} {v!r}: an integer >= 1 (as the model's config.json says)")
        for kind, sec in self.overhead.items():
            if kind not in CYCLE_KINDS or not (isinstance(sec, (int, float)) and math.isfinite(sec) and sec >= 0):
                raise ProfileError(f"overhead {kind!r}: {sec!r}; a non-negative number of seconds per cycle for each "
                                   f"of {', '.join(CYCLE_KINDS)}")

    def overhead_seconds(self, kind: str) -> float:
        """The seconds a cycle of a setting of ``kind`` pays outside the two models' calls (0: not measured)."""
        return float(self.overhead.get(kind, 0.0))

    def for_drafter(self, identity: Mapping[str, Any]) -> CostProfile:
        """This profile with the draft seconds of the drafter it timed that is ``identity`` (its family, widths
        and layers; a chain's step does not depend on its length, nor a pass on the block asked for), else as it
        is (``identity_mismatches`` then says whose they are)."""
        def same(have: Mapping[str, Any]) -> bool:
            return all(have.get(f) == identity.get(f) for f in DRAFTER_FIELDS if f != "block_size"
                       and have.get(f) is not None and identity.get(f) is not None)

        pairs = ((self.drafter, self.draft), *self.others)
        for i, (who, draft) in enumerate(pairs):
            if who and same(who):  # the others keep every other drafter's pass: the profile stays the same one
                rest = tuple((dict(w), dict(d)) for j, (w, d) in enumerate(pairs) if j != i)
                return replace(self, drafter=dict(who), draft=dict(draft), others=rest)
        return self

    def identity(self) -> dict[str, Any]:
        """What makes two profiles one: where and how it was measured and every number in it (each drafter's
        pass whichever drafter it was picked for), as ``{"fields": ..., "digest": sha256}``; two files projected
        with profiles of different identities price differently even when their labels read the same."""
        import hashlib
        import json

        data = self.to_dict()
        pairs = sorted(json.dumps([who, {str(c): s for c, s in sorted(d.items())}], sort_keys=True)
                       for who, d in ((self.drafter, self.draft), *self.others))
        for k in ("drafter", "draft", "others"):
            data.pop(k)
        digest = hashlib.sha256(json.dumps([data, pairs], sort_keys=True).encode()).hexdigest()
        fields = {k: data[k] for k in ("kind", "target", "device", "dtype", "batch_size", "date", "source")}
        return {"fields": fields, "digest": digest}

    @property
    def max_verified(self) -> int:
        """The most verified tokens every context's rows reach (beyond it a projection is refused)."""
        return min(rows[-1][0] for rows in self.verify.values())

    def label(self) -> str:
        """What the projected figures rest on, in one line."""
        what = {"measured": "measured", "roofline": "roofline estimate", "user": "user's own measurement"}[self.kind]
        parts = [p for p in (self.device, self.dtype, f"batch {self.batch_size}", self.date) if p]
        if self.overhead:
            parts.append("per-cycle overhead " + ", ".join(f"{k} {1e3 * v:.3g} ms" for k, v in sorted(self.overhead.items())))
        if self.flags:
            parts.append(f"{len(self.flags)} unstable row(s) flagged")
        # A measured profile's command stays in the file; a roofline's numbers and the user's file are the figure.
        said = f": {self.source}" if self.source and self.kind != "measured" else ""
        return f"{what} ({', '.join(parts)}){said}"

    def reach(self, n: int) -> str:
        """How to give this profile verify rows up to ``n`` tokens: a CSV is the user's to extend, a measured or
        roofline profile is measured again."""
        if self.kind == "user":
            return (f"add rows up to {n} verified tokens to your CSV ({self.source.removeprefix('--from-csv ')}) "
                    "and write the profile again (tools/profile_costs.py --from-csv)")
        again = "--roofline " if self.kind == "roofline" else ""
        return f"measure up to {n} tokens (tools/profile_costs.py {again}--tokens 1-{n})"

    def verify_seconds(self, n: int, context: int) -> float:
        """The target's verify step at ``n`` tokens after ``context`` committed ones."""
        return _across_contexts(self.verify, context, lambda rows: _between_rows(rows, n))

    def draft_seconds(self, context: int) -> float:
        return _across_contexts(self.draft, context, lambda s: s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify"] = {str(c): [list(r) for r in rows] for c, rows in sorted(self.verify.items())}
        d["draft"] = {str(c): s for c, s in sorted(self.draft.items())}
        d["others"] = [{"drafter": who, "draft": {str(c): s for c, s in sorted(draft.items())}}
                       for who, draft in self.others]
        d["spread"] = {str(c): [list(r) for r in rows] for c, rows in sorted(self.spread.items())}
        d["flags"] = list(self.flags)
        d["repeats"] = {str(c): [[n, list(t)] for n, t in rows] for c, rows in sorted(self.repeats.items())}
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **d}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> CostProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: not a dflash-cb cost profile (format "
                               f"{data.get('format') if isinstance(data, dict) else None!r}); write one with "
                               "tools/profile_costs.py")
        if data.get("version") not in READABLE_VERSIONS:
            raise ProfileError(f"{where}: profile version {data.get('version')!r}; this dflash-cb reads version "
                               f"{PROFILE_VERSION}: measure it again with tools/profile_costs.py")
        try:
            verify = {int(c): tuple((_count(n), _seconds(s)) for n, s in rows) for c, rows in data["verify"].items()}
            draft = {int(c): _seconds(s) for c, s in data["draft"].items()}
            others = tuple((dict(o["drafter"]), {int(c): _seconds(s) for c, s in o["draft"].items()})
                           for o in data.get("others") or ())
            batch = data.get("batch_size", 1)
            if isinstance(batch, bool) or not isinstance(batch, int):
                raise ProfileError(f"batch_size {batch!r}: an integer >= 1")
            return cls(str(data["kind"]), verify, draft, dict(data.get("target") or {}),  # type: ignore[arg-type]
                       dict(data.get("drafter") or {}), str(data.get("device", "")), str(data.get("dtype", "")),
                       batch, str(data.get("date", "")), str(data.get("source", "")),
                       others, {str(k): v for k, v in (data.get("overhead") or {}).items()},
                       {int(c): tuple((int(n), float(x)) for n, x in rows)
                        for c, rows in (data.get("spread") or {}).items()},
                       tuple(str(f) for f in data.get("flags") or ()),
                       {int(c): tuple((int(n), tuple(float(x) for x in t)) for n, t in rows)
                        for c, rows in (data.get("repeats") or {}).items()})
        except ProfileError as e:
            raise ProfileError(f"{where}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ProfileError(f"{where}: damaged cost profile ({what}); write it again with "
                               "tools/profile_costs.py") from e


def _seconds(value: Any) -> float:
    """A profile file's time: a JSON number (``true`` or ``"0.02"`` is a damaged file, not 1 s or 0.02 s)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"a time of {value!r}, not a number of seconds")
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"a verified token count of {value!r}, not an integer")
    return value


def _between_rows(rows: Sequence[tuple[int, float]], n: int) -> float:
    if n < rows[0][0] or n > rows[-1][0]:
        raise ProfileError(f"{n} verified tokens is outside the profile's rows ({rows[0][0]} to {rows[-1][0]}): "
                           "give the profile rows that reach it or score a smaller setting")
    i = bisect.bisect_left([r[0] for r in rows], n)
    if rows[i][0] == n:
        return rows[i][1]
    (n0, s0), (n1, s1) = rows[i - 1], rows[i]
    return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


def _across_contexts(table: Mapping[int, Any], context: int, at: Any) -> float:
    """Linear in the context between measured context lengths; the nearest one outside them (a step's cost
    grows slowly with the context: the profile's range is stated with every projection)."""
    ctxs = sorted(table)
    if len(ctxs) == 1 or context <= ctxs[0]:
        return float(at(table[ctxs[0]]))
    if context >= ctxs[-1]:
        return float(at(table[ctxs[-1]]))
    i = bisect.bisect_left(ctxs, context)
    c0, c1 = ctxs[i - 1], ctxs[i]
    v0, v1 = at(table[c0]), at(table[c1])
    return float(v0 + (v1 - v0) * (context - c0) / (c1 - c0))


def identity_mismatches(profile: CostProfile, target: Mapping[str, Any],
                        drafter: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(target fields that differ: the profile is for another target, refused; drafter fields that differ:
    its draft cost is another drafter's, warned), each as 'field profile X, here Y'."""
    def differ(fields: Sequence[str], have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
        return [f"{f}: profile {have[f]!r}, here {want[f]!r}" for f in fields
                if f in have and f in want and have[f] is not None and want[f] is not None and have[f] != want[f]]
    return differ(TARGET_FIELDS, profile.target, target), differ(DRAFTER_FIELDS, profile.drafter, drafter)


# -- a measured profile's rows -------------------------------------------------------------------------------

# A verify row cheaper than a row of fewer tokens by more than this share breaks monotonicity (more tokens never
# cost less, beyond noise); a row whose repeats spread (max - min) by more than MAX_SPREAD of its median is
# unstable. Either is measured again, then flagged in the profile.
MONOTONE_TOLERANCE = 0.10
MAX_SPREAD = 0.5


def row_spread(times: Sequence[float]) -> float:
    """(max - min) / median of one row's repeats."""
    ordered = sorted(times)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                  + ordered[len(ordered) // 2]) / 2
    return (ordered[-1] - ordered[0]) / median if median > 0 else math.inf


def suspicious_rows(samples: Mapping[int, Sequence[float]], tolerance: float = MONOTONE_TOLERANCE,
                    max_spread: float = MAX_SPREAD) -> dict[int, str]:
    """Verify rows (verified tokens -> the seconds of each repeat) that break monotonicity or spread too wide,
    each with the reason in words."""
    med = {n: sorted(v)[len(v) // 2] for n, v in samples.items() if v}
    out: dict[int, str] = {}
    for n in sorted(med):
        cheaper = [m for m in med if m < n and med[n] < med[m] * (1 - tolerance)]
        if cheaper:
            m = max(cheaper, key=lambda x: med[x])
            why = (f"{n} tokens ({1e3 * med[n]:.3g} ms) cheaper than {m} tokens ({1e3 * med[m]:.3g} ms) by more "
                   f"than {tolerance:.0%}")
            out[n] = why
            out.setdefault(m, why)
        spread = row_spread(samples[n])
        if spread > max_spread and n not in out:
            out[n] = f"{n} tokens: repeats spread {spread:.0%} of the median (more than {max_spread:.0%})"
    return out


# -- settings and the projection ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One way to serve a drafter: ``name`` (the replay's key: ``greedy``, ``ddtree_b64``), the tokens the
    target verifies per cycle, and drafter passes (block drafters) or steps (chain drafters) per cycle."""

    name: str
    verified: int
    draft_passes: int
    label: str
    kind: str = "block"  # ``CYCLE_KINDS``: which per-cycle overhead of the profile a cycle pays


def block_settings(block_size: int, budgets: Sequence[int] = (), passes: int = 1, label: str | None = None,
                   kind: str = "block") -> list[Setting]:
    """A drafter's settings from one evaluation: the greedy block (its ``block_size`` tokens verified: the anchor
    and the drafts) and a DDTree per budget (its nodes and the root). ``passes``: drafter passes per cycle (a
    block drafter's one; a chain drafter's one step per draft, ``DrafterFamily.draft_passes``); ``label``: the
    greedy setting's name in tables (``DrafterFamily.setting_label``); ``kind``: the greedy setting's kind of cycle
    (``DrafterFamily.kind``: a block or a chain)."""
    out = [Setting("greedy", block_size, passes, label or f"block {block_size}", kind)]
    out += [Setting(f"ddtree_b{b}", b + 1, 1, f"DDTree {b}", "ddtree") for b in budgets]
    return out


@dataclass(frozen=True)
class SampleCycles:
    """One sample as the projection needs it: where its first cycle starts (the prompt's length: the anchor of
    the first cycle is the prefill's token) and each setting's cycles' ``produced``."""

    prompt_len: int
    produced: Mapping[str, Sequence[int]]
    id: str = ""
    category: str = ""


def sample_seconds(sample: SampleCycles, setting: Setting, profile: CostProfile) -> tuple[int, float, float]:
    """(tokens committed, seconds speculating, seconds plain decoding would take for those tokens)."""
    tokens, spec, plain = 0, 0.0, 0.0
    p = sample.prompt_len
    overhead = profile.overhead_seconds(setting.kind)
    for produced in sample.produced.get(setting.name, ()):
        spec += (setting.draft_passes * profile.draft_seconds(p) + profile.verify_seconds(setting.verified, p)
                 + overhead)
        for j in range(produced):
            plain += profile.verify_seconds(1, p + j)
        tokens += produced
        p += produced
    return tokens, spec, plain


def priced_per_cycle(samples: Sequence[SampleCycles], setting: Setting, profile: CostProfile) -> dict[str, float]:
    """What the profile prices a cycle of ``setting`` at, on average over the samples' cycles: its verify pass,
    its drafter passes (or steps) and its overhead (the speed check shows them beside the measured split)."""
    verify = draft = 0.0
    cycles = 0
    for x in samples:
        p = x.prompt_len
        for produced in x.produced.get(setting.name, ()):
            verify += profile.verify_seconds(setting.verified, p)
            draft += setting.draft_passes * profile.draft_seconds(p)
            cycles, p = cycles + 1, p + produced
    if not cycles:
        return {}
    return {"verify": verify / cycles, "draft": draft / cycles, "overhead": profile.overhead_seconds(setting.kind)}


@dataclass(frozen=True)
class SettingProjection:
    setting: Setting
    tau: float
    tokens_per_second: Interval
    speedup: Interval
    breakeven_tau: float  # the tau at which this setting is as fast as plain decoding (at its mean context)
    per_sample: tuple[tuple[int, float, float], ...]  # (tokens, speculative seconds, plain seconds)
    ids: tuple[str, ...] = ()  # the samples of ``per_sample``, in its order
    categories: tuple[str, ...] = ()

    def sums(self, category: str | None = None) -> Sums:
        """The speedup's per-sample sums (plain seconds over speculative seconds), zero outside ``category``."""
        keep = [category is None or c == category for c in (self.categories or [""] * len(self.per_sample))]
        return Sums.of([s[2] if k else 0.0 for s, k in zip(self.per_sample, keep, strict=True)],
                       [s[1] if k else 0.0 for s, k in zip(self.per_sample, keep, strict=True)])


@dataclass(frozen=True)
class Projection:
    profile: str  # CostProfile.label()
    settings: tuple[SettingProjection, ...]
    profile_identity: dict[str, Any] = field(default_factory=dict)  # CostProfile.identity(); {} in older files

    @property
    def best(self) -> SettingProjection:
        """The setting with the largest projected speedup (the first of equal ones)."""
        return max(self.settings, key=lambda s: (s.speedup.value, -self.settings.index(s)))

    def runner_up_difference(self, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
                             ) -> tuple[SettingProjection, Interval] | None:
        """The second-best setting and best - second speedup, paired over the same resampled prompts."""
        if len(self.settings) < 2:
            return None
        ranked = sorted(self.settings, key=lambda s: -s.speedup.value)
        return ranked[1], paired_difference(ranked[1].sums(), ranked[0].sums(), n_resamples, seed)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "profile_identity": self.profile_identity, "note": PROJECTION_NOTE,
                "best": self.best.setting.name, "settings": [
            {"name": s.setting.name, "label": s.setting.label, "verified_tokens": s.setting.verified,
             "draft_passes": s.setting.draft_passes, "kind": s.setting.kind, "tau": s.tau,
             "tokens_per_second": _interval(s.tokens_per_second), "speedup": _interval(s.speedup),
             "breakeven_tau": s.breakeven_tau, "per_sample": [list(x) for x in s.per_sample],
             "ids": list(s.ids), "categories": list(s.categories)}
            for s in self.settings]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Projection:
        out = []
        for s in data["settings"]:
            setting = Setting(str(s["name"]), int(s["verified_tokens"]), int(s["draft_passes"]), str(s["label"]),
                              str(s.get("kind", "ddtree" if str(s["name"]).startswith("ddtree_") else "block")))
            out.append(SettingProjection(setting, float(s["tau"]), Interval(*s["tokens_per_second"]),
                                         Interval(*s["speedup"]), float(s["breakeven_tau"]),
                                         tuple((int(a), float(b), float(c)) for a, b, c in s["per_sample"]),
                                         tuple(map(str, s.get("ids", ()))), tuple(map(str, s.get("categories", ())))))
        return cls(str(data["profile"]), tuple(out), dict(data.get("profile_identity") or {}))


def _interval(i: Interval) -> list[float]:
    return [i.value, i.low, i.high]


def project(samples: Sequence[SampleCycles], settings: Sequence[Setting], profile: CostProfile,
            n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> Projection:
    """Every setting's projected tokens per second and speedup over plain decoding, per-cycle priced, with
    intervals over the samples (and, for a profile that keeps its rows' repeats, over draws of the profile from
    them: ``profile_draws``); refuses a setting the profile's verify rows do not reach, before pricing."""
    if not samples:
        raise ProfileError("nothing to project: no scored sample")
    for s in settings:
        if s.verified > profile.max_verified:
            raise ProfileError(f"{s.label} verifies {s.verified} tokens a cycle, beyond the profile's rows (up to "
                               f"{profile.max_verified}): {profile.reach(s.verified)}, or leave that setting out")
    out = []
    draws = profile_draws(profile, seed=seed)
    for s in settings:
        rows = tuple(sample_seconds(x, s, profile) for x in samples)
        cycles = sum(len(x.produced.get(s.name, ())) for x in samples)
        tokens = sum(r[0] for r in rows)
        found = intervals({"tps": Sums.of([r[0] for r in rows], [r[1] for r in rows]),
                           "speedup": Sums.of([r[2] for r in rows], [r[1] for r in rows])}, n_resamples, seed)
        if draws:  # a measured profile's repeats: its noise enters the interval beside the prompts'
            found = {"tps": _with_profile_noise(found["tps"], samples, s, draws, n_resamples, seed, tps=True),
                     "speedup": _with_profile_noise(found["speedup"], samples, s, draws, n_resamples, seed)}
        context = _mean_context(samples, s.name)
        cost = (s.draft_passes * profile.draft_seconds(context) + profile.verify_seconds(s.verified, context)
                + profile.overhead_seconds(s.kind))
        out.append(SettingProjection(s, tokens / cycles if cycles else math.nan, found["tps"], found["speedup"],
                                     cost / profile.verify_seconds(1, context), rows,
                                     tuple(x.id for x in samples), tuple(x.category for x in samples)))
    return Projection(profile.label(), tuple(out), profile.identity())


# How many profiles a projection draws from a measured profile's repeats (each row the median of a resample of
# its own repeats); the interval's resamples take them in turn, each with its own resample of the prompts.
PROFILE_DRAWS = 40


def profile_draws(profile: CostProfile, draws: int = PROFILE_DRAWS, seed: int = DEFAULT_SEED) -> list[CostProfile]:
    """Profiles as the measurement could have come out: every verify row with repeats replaced by the median of a
    resample (with replacement) of them; none when the profile keeps no repeats (a CSV, a roofline)."""
    if not profile.repeats:
        return []
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        verify = {}
        for ctx, rows in profile.verify.items():
            times = dict(profile.repeats.get(ctx, ()))
            verify[ctx] = tuple((n, float(np.median(rng.choice(times[n], size=len(times[n]))))
                                 if len(times.get(n, ())) > 1 else sec) for n, sec in rows)
        out.append(replace(profile, verify=verify, repeats={}))
    return out


def _with_profile_noise(found: Interval, samples: Sequence[SampleCycles], setting: Setting,
                        draws: Sequence[CostProfile], n_resamples: int, seed: int, tps: bool = False) -> Interval:
    """``found`` (an interval over prompts) widened by the profile's own noise: resample i prices the prompts of
    the i-th prompt resample with draw ``i mod len(draws)``."""
    import numpy as np

    from ..figures.bootstrap import DEFAULT_LEVEL, resample_indices

    anchors = [_anchors(x, setting) for x in samples]
    priced = np.stack([_priced(samples, anchors, setting, d) for d in draws])  # [D, S, 3]
    idx = resample_indices(len(samples), n_resamples, seed)
    d = np.arange(n_resamples) % len(draws)
    picked = priced[d[:, None], idx]  # [R, S, 3]
    num = picked[..., 0] if tps else picked[..., 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = num.sum(axis=1) / picked[..., 1].sum(axis=1)
    ratios = ratios[np.isfinite(ratios)]
    if not ratios.size:
        return found
    a = (1 - DEFAULT_LEVEL) / 2
    lo, hi = np.quantile(ratios, [a, 1 - a])
    return Interval(found.value, float(min(found.low, lo)), float(max(found.high, hi)))


def _anchors(sample: SampleCycles, setting: Setting) -> Any:
    """A sample's cycle anchors (the position each cycle is priced at) and its committed tokens' positions' end."""
    import numpy as np

    produced = np.asarray(sample.produced.get(setting.name, ()), dtype=np.int64)
    starts = sample.prompt_len + np.concatenate([[0], np.cumsum(produced)[:-1]]) if produced.size else produced
    return starts, int(produced.sum())


def _priced(samples: Sequence[SampleCycles], anchors: Sequence[Any], setting: Setting, profile: CostProfile) -> Any:
    """``sample_seconds`` of every sample at once [S, 3] (tokens, speculative, plain): the same prices, linear
    in the context between the profile's contexts and the nearest outside them, summed in array order (a draw's
    figures, not the reported ones, so the last bits of rounding do not matter)."""
    import numpy as np

    def curve(table: Mapping[int, Any], at: Callable[[Any], float]) -> tuple[Any, Any]:
        ctxs = sorted(table)
        return np.asarray(ctxs, dtype=np.float64), np.asarray([at(table[c]) for c in ctxs], dtype=np.float64)

    vx, vy = curve(profile.verify, lambda rows: _between_rows(rows, setting.verified))
    px, py = curve(profile.verify, lambda rows: _between_rows(rows, 1))
    dx, dy = curve(profile.draft, lambda sec: sec)
    overhead = profile.overhead_seconds(setting.kind)
    out = np.zeros((len(samples), 3))
    for i, (x, (starts, tokens)) in enumerate(zip(samples, anchors, strict=True)):
        p = starts.astype(np.float64)
        spec = (setting.draft_passes * np.interp(p, dx, dy) + np.interp(p, vx, vy) + overhead).sum()
        plain = np.interp(np.arange(x.prompt_len, x.prompt_len + tokens, dtype=np.float64), px, py).sum()
        out[i] = (tokens, spec, plain)
    return out


def _mean_context(samples: Sequence[SampleCycles], name: str) -> int:
    total, n = 0, 0
    for x in samples:
        p = x.prompt_len
        for produced in x.produced.get(name, ()):
            total, n, p = total + p, n + 1, p + produced
    return round(total / n) if n else 0


def serving_metrics(projection: Projection) -> dict[str, float]:
    """The projected figures under their metric names (``metrics.serving_key``), with interval bounds."""
    from ..figures.metrics import CI_HIGH_SUFFIX, CI_LOW_SUFFIX, serving_key

    out: dict[str, float] = {}
    for s in projection.settings:
        for what, i in (("speedup", s.speedup), ("tokens_per_s", s.tokens_per_second)):
            key = serving_key(what, s.setting.name)
            out[key], out[key + CI_LOW_SUFFIX], out[key + CI_HIGH_SUFFIX] = i.value, i.low, i.high
        out[serving_key("breakeven_tau", s.setting.name)] = s.breakeven_tau
    out[serving_key("best_speedup")] = projection.best.speedup.value
    return out
