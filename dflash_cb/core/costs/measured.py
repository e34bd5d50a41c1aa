"""Measured speed beside the projection (the speed check, docs/serving.md "Checking a projection"): per setting,
the seconds of real decodes of the same prompts, repeated, turned into a speedup over plain decoding with an
interval over prompts, the spread over repeats, the per-cycle split (verify, drafter, overhead) and the
projection's ratio to it. Pure: no I/O, no models; the loops are ``core.decode``, the edge
``integrations/cli/speed_check.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..figures.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, Sums, intervals, paired_difference

SPEED_CHECK_FORMAT = "dflash-cb-speed-check"
SPEED_CHECK_VERSION = 1


@dataclass(frozen=True)
class Timed:
    """One decode of one prompt: its seconds after the prefill, the part inside target passes and inside the
    drafter, its cycles (0: plain decoding) and the tokens it committed after the prefill's."""

    seconds: float
    verify: float
    draft: float
    cycles: int
    tokens: int

    @property
    def overhead(self) -> float:
        return max(0.0, self.seconds - self.verify - self.draft)


@dataclass
class SettingRuns:
    """Every timed decode of one setting: ``runs[prompt][repeat]``."""

    name: str
    label: str
    kind: str  # ``serving.CYCLE_KINDS``, or "plain"
    runs: list[list[Timed]] = field(default_factory=list)

    def medians(self) -> list[float]:
        """Per prompt, the median seconds over its repeats (a preemption moves one repeat, not the median)."""
        return [statistics.median(t.seconds for t in reps) for reps in self.runs]

    def per_cycle(self) -> dict[str, float]:
        """Seconds per cycle inside target passes, inside the drafter and outside both, pooled over every run."""
        cycles = sum(t.cycles for reps in self.runs for t in reps)
        if not cycles:
            return {}
        return {what: sum(getattr(t, what) for reps in self.runs for t in reps) / cycles
                for what in ("verify", "draft", "overhead")}

    def tau(self) -> float:
        first = [reps[0] for reps in self.runs if reps]
        cycles = sum(t.cycles for t in first)
        return sum(t.tokens for t in first) / cycles if cycles else float("nan")


@dataclass(frozen=True)
class MeasuredSetting:
    name: str
    label: str
    kind: str
    tau: float
    speedup: Interval  # over prompts (medians over repeats)
    repeat_range: tuple[float, float]  # the pooled speedup of each repeat: its smallest and largest
    tokens_per_second: float
    per_cycle: dict[str, float]
    projected: Interval | None = None
    plain_step: float = 0.0  # plain decoding's seconds per token, pooled

    @property
    def ratio(self) -> float | None:
        """Projected over measured speedup (1: the projection holds)."""
        if self.projected is None or not self.speedup.value:
            return None
        return self.projected.value / self.speedup.value

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "kind": self.kind, "tau": self.tau,
                "speedup": [self.speedup.value, self.speedup.low, self.speedup.high],
                "repeat_range": list(self.repeat_range), "tokens_per_second": self.tokens_per_second,
                "per_cycle_seconds": dict(self.per_cycle),
                "projected": None if self.projected is None else [self.projected.value, self.projected.low,
                                                                   self.projected.high],
                "ratio": self.ratio}


def measure(plain: SettingRuns, settings: Sequence[SettingRuns],
            projected: Mapping[str, Interval] | None = None, n_resamples: int = DEFAULT_RESAMPLES,
            seed: int = DEFAULT_SEED) -> list[MeasuredSetting]:
    """Each setting's measured speedup over ``plain`` on the same prompts: the ratio of summed per-prompt median
    seconds, a cluster-bootstrap interval over prompts, and the range of the pooled speedup across repeats."""
    base = plain.medians()
    tokens = [reps[0].tokens for reps in plain.runs]
    out = []
    for s in settings:
        med = s.medians()
        found = intervals({"speedup": Sums.of(base, med), "tps": Sums.of(tokens, med)}, n_resamples, seed)
        repeats = min(len(r) for r in s.runs + plain.runs)
        per_repeat = [sum(p[r].seconds for p in plain.runs) / sum(x[r].seconds for x in s.runs) for r in range(repeats)]
        out.append(MeasuredSetting(s.name, s.label, s.kind, s.tau(), found["speedup"],
                                   (min(per_repeat), max(per_repeat)), found["tps"].value, s.per_cycle(),
                                   (projected or {}).get(s.name), sum(base) / max(1, sum(tokens))))
    return out


def overhead_terms(settings: Sequence[MeasuredSetting]) -> dict[str, float]:
    """Per kind of cycle, the seconds a cycle spends outside the two models' calls: the median over the settings
    of that kind (what ``CostProfile.overhead`` holds)."""
    kinds: dict[str, list[float]] = {}
    for s in settings:
        if "overhead" in s.per_cycle:
            kinds.setdefault(s.kind, []).append(s.per_cycle["overhead"])
    return {k: statistics.median(v) for k, v in sorted(kinds.items())}


def verdict(settings: Sequence[MeasuredSetting], runs: Mapping[str, SettingRuns], plain: SettingRuns,
            n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> str:
    """Which setting to serve by the measured speed: the fastest, named only when it beats the second beyond the
    paired interval over prompts; otherwise that they are within noise."""
    if not settings:
        return "nothing measured"
    ranked = sorted(settings, key=lambda s: -s.speedup.value)
    best = ranked[0]
    if len(ranked) == 1:
        return f"{best.label}: {best.speedup.value:.2f}x measured"
    second = ranked[1]
    base = plain.medians()
    diff = paired_difference(Sums.of(base, runs[second.name].medians()), Sums.of(base, runs[best.name].medians()),
                             n_resamples, seed)
    if diff.low > 0:
        return (f"measured fastest: {best.label} ({best.speedup.value:.2f}x), ahead of {second.label} by "
                f"{diff.value:+.2f}x [{diff.low:+.2f}, {diff.high:+.2f}]")
    return (f"{best.label} ({best.speedup.value:.2f}x) and {second.label} ({second.speedup.value:.2f}x) are within "
            f"noise: {diff.value:+.2f}x [{diff.low:+.2f}, {diff.high:+.2f}] over the same prompts")


@dataclass(frozen=True)
class ServedComparison:
    """The served speedup over prompts timed on both servers, beside the projection on the same prompts."""

    ids: tuple[str, ...]
    served: Interval  # plain server's seconds over the speculative server's, pooled over prompts
    per_prompt: tuple[float, ...]
    in_flight: int  # the speculative requests' concurrency (1: one request's own time)
    projected: Interval | None = None
    projected_per_prompt: tuple[float, ...] = ()
    setting: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ids": list(self.ids), "served_speedup": [self.served.value, self.served.low,
                                                                        self.served.high],
                               "per_prompt": list(self.per_prompt), "in_flight": self.in_flight}
        if self.projected is not None:
            out.update(projected_speedup=[self.projected.value, self.projected.low, self.projected.high],
                       projected_per_prompt=list(self.projected_per_prompt), setting=self.setting)
        return out


def served_comparison(ids: Sequence[str], seconds: Sequence[float], baseline: Sequence[float], in_flight: int,
                      projection: Mapping[str, Any] | None = None, setting: str = "greedy",
                      n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> ServedComparison:
    """Served speedup per prompt and pooled (summed plain seconds over summed speculative seconds, the cluster
    bootstrap over prompts); with a projection (``serving.Projection.to_dict``), its ``setting`` on the same
    prompts (their per-sample seconds), from the same resamples."""
    sums = {"served": Sums.of(list(baseline), list(seconds))}
    proj_rows: list[list[float]] = []
    label = ""
    if projection is not None:
        chosen = next((s for s in projection["settings"] if s["name"] == setting), None)
        if chosen is not None:
            rows = dict(zip(chosen["ids"], chosen["per_sample"], strict=True))
            if all(i in rows for i in ids):
                proj_rows = [rows[i] for i in ids]
                label = chosen["label"]
                sums["projected"] = Sums.of([r[2] for r in proj_rows], [r[1] for r in proj_rows])
    found = intervals(sums, n_resamples, seed)
    return ServedComparison(tuple(ids), found["served"], tuple(b / s for b, s in zip(baseline, seconds, strict=True)),
                            in_flight, found.get("projected"),
                            tuple(r[2] / r[1] for r in proj_rows if r[1] > 0), label)


def format_served(c: ServedComparison, url: str = "") -> str:
    """The served speed in a few lines (``eval_drafter --served-check``)."""
    lines = [f"  SERVED speed (the client's wall time per request, {len(c.ids)} prompt(s) timed on both servers"
             + (f"; plain server {url}" if url else "") + "):"]
    s = c.served
    line = f"    served speedup {s.value:.2f}x [{s.low:.2f}, {s.high:.2f}]"
    if c.projected is not None:
        p = c.projected
        line += (f"; projected ({c.setting}) on the same prompts {p.value:.2f}x [{p.low:.2f}, {p.high:.2f}], "
                 f"projected / served {p.value / s.value:.2f}")
    lines.append(line)
    if c.in_flight > 1:
        lines.append(f"    the speculative requests ran {c.in_flight} at a time: their wall times are not one "
                     "request's (precompute with --max-in-flight 1 for a served speed)")
    shown = [f"{i} {x:.2f}x" + (f" (proj {c.projected_per_prompt[k]:.2f}x)" if c.projected_per_prompt else "")
             for k, (i, x) in enumerate(zip(c.ids, c.per_prompt, strict=True))]
    lines.append("    per prompt: " + ", ".join(shown[:12]) + (" ..." if len(shown) > 12 else ""))
    return "\n".join(lines)
