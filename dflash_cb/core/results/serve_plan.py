"""Which drafter to serve, at which setting: the projections of several results files on one cache, side by side
(``tools/serve_plan.py``; docs/serving.md).

Every file must carry a projection (``eval_drafter --profile``) with the same profile, and be measured on the same
cache: the same prompts priced the same way. Per drafter and setting: tau, projected speedup and tokens per
second with intervals, the break-even tau; the best setting of each drafter; the best two drafters at their best
settings compared paired over the same resampled prompts; the best setting's speedup per category.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...common.errors import DFlashCBError
from ...common.fileio import atomic_write_text, naming_failures
from ..costs.serving import PROJECTION_NOTE, Projection, SettingProjection
from ..figures.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, intervals, paired_difference
from .compare import check_same_cache
from .results_file import Results, series_mismatch

PLAN_HEADER = "# Which drafter to serve (projected)"  # a plan's first line: how an earlier one is known


class ServePlanError(DFlashCBError, ValueError):
    """Results files that cannot be planned from together."""


@dataclass(frozen=True)
class Plan:
    labels: tuple[str, ...]
    projections: tuple[Projection, ...]
    categories: tuple[str, ...]
    best_pair: tuple[int, int] | None  # (best drafter, runner-up) by their best settings' speedup
    difference: Interval | None  # the best's best speedup minus the runner-up's, paired over resampled prompts
    by_category: dict[str, list[Interval]]  # category -> each drafter's best setting's speedup there
    warnings: tuple[str, ...] = ()  # why the files' figures may not be like for like (compare_results' rule)

    @property
    def profile(self) -> str:
        return self.projections[0].profile


def plan(labels: Sequence[str], results: Sequence[Results], n_resamples: int = DEFAULT_RESAMPLES,
         seed: int = DEFAULT_SEED) -> Plan:
    check_same_cache(labels, results)
    projections = []
    for label, r in zip(labels, results, strict=True):
        if not r.breakdown.get("serving"):
            raise ServePlanError(f"{label}: no serving projection; score it with tools/eval_drafter.py --profile "
                                 "PROFILE (the same profile for every drafter)")
        try:
            projections.append(Projection.from_dict(r.breakdown["serving"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ServePlanError(f"{label}: its serving projection is damaged ({what}); score it again with "
                                 "tools/eval_drafter.py --profile PROFILE") from None
    check_same_profile(labels, projections)
    ids = [p.settings[0].ids for p in projections]
    if any(set(i) != set(ids[0]) for i in ids[1:]):
        raise ServePlanError("the files scored different samples (--samples / --sample-ids): score every drafter "
                             "on the same ones")
    order = [{sid: k for k, sid in enumerate(i)} for i in ids]
    aligned = [_aligned(p.best, [o[sid] for sid in ids[0]]) for p, o in zip(projections, order, strict=True)]
    ranked = sorted(range(len(projections)), key=lambda k: -projections[k].best.speedup.value)
    pair, diff = None, None
    if len(ranked) > 1:
        pair = (ranked[0], ranked[1])
        diff = paired_difference(aligned[ranked[1]].sums(), aligned[ranked[0]].sums(), n_resamples, seed)
    categories = tuple(sorted(set(aligned[0].categories) - {""}))
    by_category = {c: [intervals({"s": a.sums(c)}, n_resamples, seed)["s"] for a in aligned] for c in categories}
    # The block differs between drafters by design (each is served at its own); a tail convention or a dtype
    # does not, and compare_results warns about it: so does the plan.
    series = [{k: v for k, v in r.series.items() if k != "block_size"} for r in results]
    mismatch = series_mismatch(list(zip(labels, series, strict=True)))
    return Plan(tuple(labels), tuple(projections), categories, pair, diff, by_category,
                (mismatch,) if mismatch else ())


def check_same_profile(labels: Sequence[str], projections: Sequence[Projection]) -> None:
    """Two files are planned together only when projected with one profile: by identity (where and how it was
    measured and every number in it, ``CostProfile.identity``), not by its label, which two CSVs of one name
    with other draft seconds, or two measurements of one day and machine, share."""
    ids = [p.profile_identity for p in projections]
    known = all(i.get("digest") for i in ids)
    if (known and len({i["digest"] for i in ids}) == 1) or (not known and len({p.profile for p in projections}) == 1
                                                            and not any(ids)):
        return
    fields = [i.get("fields") or {} for i in ids]
    differ = sorted(k for k in set().union(*fields) if len({repr(f.get(k)) for f in fields}) > 1)
    why = (f"their profiles differ in {', '.join(differ)}" if differ
           else "their profiles read the same but hold other numbers" if known
           else "some were projected before profiles recorded their identity")
    raise ServePlanError(f"the files were projected with different profiles ({why}: " + "; ".join(
        f"{label}: {p.profile}" for label, p in zip(labels, projections, strict=True)) + "): score every drafter "
        "with one --profile")


def _aligned(s: SettingProjection, index: list[int]) -> SettingProjection:
    """``s`` with its samples in another order (the first file's)."""
    from dataclasses import replace

    return replace(s, per_sample=tuple(s.per_sample[i] for i in index), ids=tuple(s.ids[i] for i in index),
                   categories=tuple(s.categories[i] for i in index))


def _iv(i: Interval, digits: int = 2, unit: str = "x") -> str:
    if not math.isfinite(i.value):
        return "n/a"
    return f"{i.value:.{digits}f}{unit} [{i.low:.{digits}f}, {i.high:.{digits}f}]"


def format_plan(p: Plan) -> str:
    lines = [PLAN_HEADER, "",
             f"Profile: {p.profile}. {PROJECTION_NOTE[0].upper() + PROJECTION_NOTE[1:]}.", "",
             "| drafter | setting | tau | speedup | tokens/s | break-even tau |", "|---|---|---|---|---|---|"]
    for label, proj in zip(p.labels, p.projections, strict=True):
        best = proj.best
        for s in proj.settings:
            mark = " **best**" if s is best else ""
            lines.append(f"| {label} | {s.setting.label}{mark} | {s.tau:.3f} | {_iv(s.speedup)} | "
                         f"{_iv(s.tokens_per_second, 1, '')} | {s.breakeven_tau:.2f} |")
    if p.best_pair is not None and p.difference is not None:
        a, b = p.best_pair
        d = p.difference
        first = f"{p.labels[a]} at {p.projections[a].best.setting.label}"
        second = f"{p.labels[b]} at {p.projections[b].best.setting.label}"
        paired = f"(paired over the same resampled prompts): {d.value:+.3f}x [{d.low:+.3f}, {d.high:+.3f}]"
        # A verdict only where the difference is beyond the interval: otherwise the two are within noise.
        if d.low > 0:
            lines += ["", f"**Serve {first}.** Against {second} {paired}, {p.labels[a]} is faster."]
        else:
            lines += ["", f"**{first} and {second} are within noise.** Projected difference "
                      f"{paired}: the interval holds zero, so no setting is named; check both with "
                      "tools/speed_check.py."]
    elif p.projections:
        lines += ["", f"**Best setting: {p.projections[0].best.setting.label}.**"]
    lines += [f"\n**Warning:** {w}" for w in p.warnings]
    if p.categories:
        lines += ["", "Best setting's speedup per category:", "",
                  "| category | " + " | ".join(p.labels) + " |", "|---|" + "---|" * len(p.labels)]
        for c in p.categories:
            lines.append(f"| {c} | " + " | ".join(_iv(i) for i in p.by_category[c]) + " |")
    return "\n".join(lines) + "\n"


def plot_plan(p: Plan, path: str | Path) -> None:
    """Projected speedup against the tokens verified a cycle, one line per drafter, best settings starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    for k, (label, proj) in enumerate(zip(p.labels, p.projections, strict=True)):
        xs = [s.setting.verified for s in proj.settings]
        ys = [s.speedup.value for s in proj.settings]
        err = [[max(0.0, s.speedup.value - s.speedup.low) for s in proj.settings],
               [max(0.0, s.speedup.high - s.speedup.value) for s in proj.settings]]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", color=f"C{k}", capsize=3, label=label)
        for i, (x, y, setting) in enumerate(zip(xs, ys, proj.settings, strict=True)):  # which setting each is
            ax.annotate(setting.setting.label, (x, y), textcoords="offset points", fontsize=7, color=f"C{k}",
                        xytext=(5, 6 if (i + k) % 2 == 0 else -11))
        best = proj.best
        ax.plot([best.setting.verified], [best.speedup.value], marker="*", markersize=16, color="gold",
                markeredgecolor="black", linestyle="none")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="plain decoding")
    ax.set(xlabel="tokens verified per cycle (block; DDTree budget + 1)", ylabel="projected speedup",
           title="Which setting to serve (a projection)")
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"profile: {p.profile}", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        with naming_failures(path):
            fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def write_plan(p: Plan, md_path: Path, png_path: Path) -> str:
    md = format_plan(p) + f"\n![projected speedup per setting]({png_path.name})\n"
    plot_plan(p, png_path)
    atomic_write_text(md_path, md)
    return md
