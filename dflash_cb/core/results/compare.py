"""Compare evaluations of drafters on the same cache: paired differences with intervals, and a verdict.

Two evaluations on the same cache scored the same prompts, so they are compared *paired*: the
bootstrap resamples the prompts once and takes the difference on each resample
(``bootstrap.paired_difference``). The verdict says "B is better" only when the whole 95%
interval of ``B - A`` lies above zero; otherwise the prompts cannot tell the two apart.

The per-category rows are many small comparisons at once, so a category gets a verdict only where
the overall tau has one, from an interval corrected for the number of categories: the one rule
of every tool that judges a difference (``verdicts``, the sweep's best-vs-last table too). The
position and cycle tables are descriptive: tau with its cycle count, no verdict.

Used by ``tools/compare_results.py`` (files) and by the callback (``delta_metrics``: live drafter
minus each measured baseline, on the evaluated samples).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from ...cache.identity import cache_difference
from ...common.errors import DFlashCBError
from ...common.fileio import atomic_paths, naming_failures
from ..drafters.registry import families, family_named
from ..figures.bootstrap import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    Interval,
    intervals,
    metric_sums,
    paired_difference,
)
from ..figures.derived import delta_metrics, live_metrics, shared  # noqa: F401  (their names here before figures/)
from ..figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    TAU,
    TAU_REQUEST_MEAN,
    category_tau,
    ddtree_tau,
)
from ..figures.positions import DEFAULT_POSITION_EDGES, check_edges, cycle_table, position_table
from .report import metric_with_interval, with_interval
from .results_file import Results, series_mismatch
from .verdicts import Difference, difference_rows, family_note, judge


class CompareError(DFlashCBError, ValueError):
    """Evaluations that cannot be compared (other caches, no shared samples)."""


# -- paired differences ------------------------------------------------------------------------

def paired(a_samples: Sequence[Any], b_samples: Sequence[Any], la: str, lb: str, budgets: Sequence[int] = (),
           categories: Sequence[str] = (), n_resamples: int = DEFAULT_RESAMPLES,
           seed: int = DEFAULT_SEED) -> dict[str, Difference]:
    """``b - a`` for tau, each DDTree tau, each category tau and the drafter family walks' taus both have, on the
    samples both scored.

    Judged by the one rule (``verdicts``): with several categories, each category's interval is
    Bonferroni-corrected for their number, and it has no verdict unless the overall tau has one."""
    sa, sb = shared(a_samples, b_samples)
    if not sa:
        raise CompareError(f"{la} and {lb} share no scored sample: nothing to compare")
    ma, mb = metric_sums(sa, budgets, categories), metric_sums(sb, budgets, categories)
    # A figure only one side has (a DFlash 2 drafter's selector walks beside a DFlash one) has no difference.
    return judge([k for k in ma if k in mb], la, lb, len(sa), categories,
                 lambda k, level: paired_difference(ma[k], mb[k], n_resamples, seed, level))


# -- a comparison of files ------------------------------------------------------------------

@dataclass
class Comparison:
    labels: list[str]
    results: list[Results]
    samples: list[list[Any]]  # per evaluation, the samples every evaluation scored, aligned
    budgets: list[int]  # DDTree budgets some evaluation has ("n/a" for the others: a chain drafter has no tree)
    categories: list[str]
    intervals: list[dict[str, Interval]]  # per evaluation, on the shared samples
    differences: dict[tuple[int, int], dict[str, Difference]]  # (i, j) -> j - i
    position_edges: tuple[int, ...]
    warnings: list[str] = field(default_factory=list)  # why the figures may not be like for like

    @property
    def n(self) -> int:
        return len(self.samples[0])


def check_same_cache(labels: Sequence[str], results: Sequence[Results]) -> None:
    unknown = [label for label, r in zip(labels, results, strict=True) if not r.manifest_sha256]
    if unknown:  # nothing shows that the files scored the same prompts
        raise CompareError(
            f"{', '.join(unknown)}: no cache manifest hash (meta.cache_manifest_sha256), so nothing shows these "
            "evaluations scored the same prompts. Score the drafters again with tools/eval_drafter.py "
            "--states <cache>, which records the hash")
    for label, r in zip(labels[1:], results[1:], strict=True):
        # By content (``cache.identity``): the same cache built in another folder or on another host compares.
        why = cache_difference(results[0].meta, r.meta)
        if why is not None:
            raise CompareError(
                f"{labels[0]} was measured on cache {results[0].meta.get('cache_path')!r}, {label} on "
                f"{r.meta.get('cache_path')!r}: {why}; figures from different caches are not comparable. Score "
                "both drafters on one cache with tools/eval_drafter.py --states <cache>")


def check_same_categories(labels: Sequence[str], aligned: Sequence[Sequence[Any]]) -> None:
    """The same sample id must be the same prompt: a different category means the files disagree on it."""
    for label, samples in zip(labels[1:], aligned[1:], strict=True):
        bad = [(a.id, a.category, b.category) for a, b in zip(aligned[0], samples, strict=True)
               if a.category != b.category]
        if bad:
            i, ca, cb = bad[0]
            raise CompareError(
                f"{label} and {labels[0]} give {len(bad)} shared sample id(s) different categories (e.g. {i!r}: "
                f"{cb!r} in {label}, {ca!r} in {labels[0]}): they do not describe the same prompts. Score both "
                "drafters on one cache with tools/eval_drafter.py --states <cache>")


def shared_budgets(results: Sequence[Results]) -> list[int]:
    """The DDTree budgets every evaluation has."""
    return sorted(set.intersection(*(set(r.budgets) for r in results)))


def any_budgets(results: Sequence[Results]) -> list[int]:
    """The DDTree budgets some evaluation has: each is a row, "n/a" where a file lacks it (a chain drafter's)."""
    return sorted(set().union(*(r.budgets for r in results)))


def like_for_like(results: Sequence[Results]) -> list[dict[str, Any]]:
    """Each evaluation's series as compared side by side: drafters of several families draft their own blocks
    (a DFlash block of 16 beside the MTP head's chain of 3), so the block is compared only within one family."""
    several = len({r.family for r in results}) > 1
    return [{k: v for k, v in r.series.items() if not (several and k == "block_size")} for r in results]


def compare(labels: Sequence[str], results: Sequence[Results], n_resamples: int = DEFAULT_RESAMPLES,
            seed: int = DEFAULT_SEED, position_edges: Sequence[int] = DEFAULT_POSITION_EDGES) -> Comparison:
    if len(results) < 2:
        raise CompareError("compare needs at least two evaluations")
    check_same_cache(labels, results)
    ids = [s.id for s in results[0].samples]
    for r in results[1:]:
        have = {s.id for s in r.samples}
        ids = [i for i in ids if i in have]
    if not ids:
        raise CompareError(f"{', '.join(labels)} share no scored sample: nothing to compare")
    aligned = []
    for r in results:
        by_id = {s.id: s for s in r.samples}
        aligned.append([by_id[i] for i in ids])
    check_same_categories(labels, aligned)
    categories = sorted({s.category for s in aligned[0]})
    ivs = [intervals(metric_sums(s, r.budgets, categories), n_resamples, seed) for s, r in zip(aligned, results, strict=True)]
    diffs = {}
    for i, j in combinations(range(len(results)), 2):  # a pair differs on the budgets both have
        diffs[(i, j)] = paired(aligned[i], aligned[j], labels[i], labels[j], shared_budgets([results[i], results[j]]),
                               categories, n_resamples, seed)
    chain = all(family_named(r.family).kind == "chain" for r in results)  # block_size is K + 1
    notes = [m for m in [series_mismatch(list(zip(labels, like_for_like(results), strict=True)),
                                         blocks_compared=True, chain=chain)] if m]
    return Comparison(list(labels), list(results), aligned, any_budgets(results), categories, ivs, diffs,
                      check_edges(position_edges), notes)


def family_walks() -> tuple[str, ...]:
    """Every family walk's tau key, in a fixed order (``FamilyFigures.walks`` of each registered family)."""
    return tuple(dict.fromkeys(w.key for f in families() for w in f.figures.walks))


def family_pooled() -> tuple[str, ...]:
    """Every family's pooled anchor figures, shown per evaluation from its own file (each file's own statistics
    set)."""
    return tuple(dict.fromkeys(p.key for f in families() for p in f.figures.pooled))


_LABELS = {
    TAU: "tau (pooled over cycles)",
    TAU_REQUEST_MEAN: "tau, mean over requests (dflash.benchmark)",
    ACCEPT_LENGTH_SERVED: "served accept length, mean over requests (SGLang)",
}


def _family_labels() -> dict[str, str]:
    return {k: v for f in families() for k, v in f.figures.labels(f.label).items()}


def _metric_label(metric: str) -> str:
    labels = {**_LABELS, **_family_labels()}
    if metric in labels:
        return labels[metric]
    if metric.startswith("ddtree/tau_b"):
        return f"DDTree tau, budget {metric.rsplit('_b', 1)[1]}"
    if metric.startswith("category/"):
        _, category, name = metric.split("/", 2)
        return f"tau, {category}" + (", mean over requests (dflash.benchmark)" if name == TAU_REQUEST_MEAN else "")
    return metric


def _fmt_iv(iv: Interval) -> str:
    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return with_interval(finite(iv.value), finite(iv.low), finite(iv.high))


def _metrics_order(c: Comparison) -> list[str]:
    """The rows of the tables: every evaluation's figures, then the walks of a drafter family some evaluations
    have (DFlash 2's selector walks: "n/a" for the others)."""
    walks = [w for w in family_walks() if any(w in iv for iv in c.intervals)]
    return [TAU, TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED, *(ddtree_tau(b) for b in c.budgets),
            *(category_tau(x) for x in c.categories), *walks]


def published_rows(c: Comparison, published: Sequence[Any]) -> list[str]:
    """Markdown rows: each published figure beside every evaluation's figure of the same convention (a figure of
    a category the evaluations do not have: beside their figure over all prompts, marked ``(all prompts)``).

    ``published``: ``baselines.Baseline`` entries of kind published (their metric names already carry the
    convention, ``baselines.published_metric``). A figure no evaluation has is listed as such.
    """
    rows = []
    for b in published:
        for m, v in sorted(b.metrics.items()):
            cells = []
            for iv in c.intervals:
                # A benchmark these prompts do not have: beside the same convention over all prompts, said so.
                overall = m.rsplit("/", 1)[1] if m.startswith("category/") and m not in iv else None
                if m in iv:
                    cells.append(_fmt_iv(iv[m]))
                elif overall in iv:
                    cells.append(f"{_fmt_iv(iv[overall])} (all prompts)")
                else:
                    cells.append("n/a")
            rows.append(f"| {b.name} | {_metric_label(m)} | {v:.3f} | {' | '.join(cells)} |")
    return rows


COMPARISON_HEADER = "## Drafter comparison"  # a comparison's first line: how an earlier one is known


def render_markdown(c: Comparison, plot_path: str | None = None, published: Sequence[Any] = ()) -> str:
    r0 = c.results[0]
    lines = [COMPARISON_HEADER, ""]
    lines.append(f"Cache `{r0.meta.get('cache_path')}` (manifest `{str(r0.manifest_sha256)[:12]}`), "
                 f"{c.n} prompts scored by every evaluation. Intervals: 95%, cluster bootstrap over prompts "
                 "(uncertainty from the choice of prompts); differences are paired on the same prompts.")
    lines.append("")
    for w in c.warnings:
        lines += [f"**Warning:** {w}", ""]
    for label, r in zip(c.labels, c.results, strict=True):  # a family's walk above tau (DFlash 2's selector)
        fam = family_named(r.family)
        lines += [f"- {label} ({fam.label}): {remark}" for remark in fam.figures.remarks(r.metric)]
    for d in c.differences.values():
        lines.append(f"- **{d[TAU].text}**: {d[TAU].verdict}")
    lines += ["", "| metric | " + " | ".join(c.labels) + " |", "|---" * (len(c.labels) + 1) + "|"]
    for m in _metrics_order(c):
        lines.append(f"| {_metric_label(m)} | " + " | ".join(_fmt_iv(iv[m]) if m in iv else "n/a"
                                                               for iv in c.intervals) + " |")
    for m in family_pooled():
        if any(r.metric(m) is not None for r in c.results):  # the whole file's figure, with its own interval
            lines.append(f"| {_metric_label(m)} | " + " | ".join(metric_with_interval(r, m) for r in c.results)
                         + " |")
    if published:
        lines += ["", "### Published figures (other prompts and hardware: context, not measured here)", "",
                  "Each figure stands beside the figure of its own convention on these prompts.", "",
                  "| published | convention / metric | published value | " + " | ".join(c.labels) + " |",
                  "|---" * (len(c.labels) + 3) + "|", *published_rows(c, published)]
    lines += ["", "### Paired differences", "", "| pair | metric | difference [95% interval] | verdict |",
              "|---|---|---|---|"]
    for (i, j), d in c.differences.items():
        for m in difference_rows(d, c.budgets, c.categories):
            lines.append(f"| {c.labels[j]} - {c.labels[i]} | {_metric_label(m)} | {d[m].cell} | {d[m].verdict} |")
    note = family_note(len(c.categories))
    if note:
        lines += ["", note + " The tables by position and cycle below are descriptive: tau and its cycle count per "
                  "bucket, no verdict."]
    for title, tables in (("By position in the completion (tau, cycles)",
                           [position_table(s, c.position_edges) for s in c.samples]),
                          ("By cycle index after the prompt (tau, cycles)", [cycle_table(s) for s in c.samples])):
        lines += ["", f"### {title}", "", "| bucket | " + " | ".join(c.labels) + " |", "|---" * (len(c.labels) + 1) + "|"]
        for bucket in tables[0]:
            cells = [("n/a" if t[bucket]["tau"] is None else f"{t[bucket]['tau']:.3f}") + f" ({t[bucket]['cycles']})"
                     for t in tables]
            lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
    lines += ["", "### Evaluations", ""]
    for label, r in zip(c.labels, c.results, strict=True):
        step = r.drafter_step
        lines.append(f"- {label}: drafter `{r.drafter_path}`" + (f" (global step {step})" if step is not None else "")
                     + f", {len(r.samples)} samples, {drafted(r)}, dtype "
                     + f"{r.meta.get('dtype')}, tail blocks " + (r.tail_blocks or "not recorded"))
    if plot_path:
        lines += ["", f"![comparison]({plot_path})"]
    return "\n".join(lines) + "\n"


def drafted(r: Results) -> str:
    """What an evaluation drafted: a chain drafter by its family and chain length K, a block drafter by its block."""
    family = family_named(r.family)
    if family.kind == "chain" and r.block_size:
        return f"{family.label}, K = {r.block_size - 1} (block {r.block_size})"
    return f"{family.label}, block {r.block_size or 'not recorded'}"


def plot_comparison(c: Comparison, path: str | Path) -> Path:
    """One PNG: per-depth acceptance overlaid, per-category tau bars with intervals, tau by position.

    Written to ``path`` as it is (``write_comparison`` gives it a temporary path and renames it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for label, r in zip(c.labels, c.results, strict=True):
        ys = [math.nan if v is None else v for v in r.per_depth.get("unconditional") or []]
        ax.plot(range(1, len(ys) + 1), ys, "o-", label=label)
    ax.set(xlabel="depth in the block", ylabel="acceptance (unconditional)", title="acceptance per depth",
           ylim=(0, 1.02))
    ax.xaxis.get_major_locator().set_params(integer=True)  # depths are whole numbers
    ax.legend(fontsize=8)
    ax = axes[1]
    names = [TAU] + [category_tau(x) for x in c.categories]
    width = 0.8 / len(c.labels)
    x = np.arange(len(names))
    for k, (label, iv) in enumerate(zip(c.labels, c.intervals, strict=True)):
        vals = np.array([iv[m].value for m in names])
        err = np.array([[iv[m].value - iv[m].low for m in names], [iv[m].high - iv[m].value for m in names]])
        # A few resamples can leave the value outside its percentile interval: no negative error bars.
        err = np.clip(np.nan_to_num(err), 0.0, None)
        ax.bar(x + k * width - 0.4 + width / 2, np.nan_to_num(vals), width, yerr=err, capsize=3, label=label)
    ax.set_xticks(x, ["all"] + list(c.categories), rotation=20)
    ax.set(ylabel="tau (95% interval)", title="tau per category")
    ax.legend(fontsize=8)
    ax = axes[2]
    for i, (label, s) in enumerate(zip(c.labels, c.samples, strict=True)):
        t = position_table(s, c.position_edges)
        ys = [math.nan if v["tau"] is None else v["tau"] for v in t.values()]
        ax.plot(list(t), ys, "o-", color=f"C{i}", label=label)
        for k, (v, y) in enumerate(zip(t.values(), ys, strict=True)):  # what each point rests on
            if math.isfinite(y):  # each evaluation's counts on their own row below its points: none overlap
                ax.annotate(f"{v['cycles']}", (k, y), textcoords="offset points", xytext=(0, -11 - 9 * i),
                            fontsize=7, ha="center", color=f"C{i}")
    ax.set(xlabel="anchor position in the completion (numbers: cycles at each point)", ylabel="tau",
           title="tau by position")
    ax.margins(y=0.25)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path = Path(path)
    try:
        with naming_failures(path):
            fig.savefig(path, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path


def write_comparison(c: Comparison, md_path: str | Path, png_path: str | Path,
                     published: Sequence[Any] = ()) -> str:
    """Write ``comparison.md`` and the ``.png`` it embeds: both, or (on a failure) neither is replaced,
    so a report never shows another comparison's plot. Returns the Markdown."""
    md_path, png_path = Path(md_path), Path(png_path)
    md = render_markdown(c, png_path.name, published)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_paths(md_path, png_path) as (md_tmp, png_tmp):
        with naming_failures(md_path), open(md_tmp, "w") as f:
            f.write(md)
        with naming_failures(png_path):
            plot_comparison(c, png_tmp)
    return md


# -- command line (tools/compare_results.py) ------------------------------------------------
