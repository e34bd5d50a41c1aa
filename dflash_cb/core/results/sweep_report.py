"""The report of a checkpoint sweep: ``sweep.md`` and the ``sweep.png`` it embeds, written together atomically.

The curve (tau with its 95% interval over the steps, DDTree tau per budget, the best checkpoint marked), the
table of entries, the checkpoints that could not be scored, and a paired comparison of the best checkpoint
against the last one (``compare.compare``: both scored the same prompts, so the difference is paired; its rows
and verdicts are ``tools/compare_results.py``'s, by one rule: ``verdicts``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...common.fileio import atomic_paths, naming_failures
from ..drafters.registry import family_named
from ..figures.metrics import TAU, ci_high, ci_low, ddtree_tau
from .compare import Comparison, compare
from .report import with_interval
from .results_file import load_results
from .sweep_record import SweepEntry, SweepRecord
from .verdicts import difference_rows, family_note

REPORT_MD = "sweep.md"
REPORT_PNG = "sweep.png"


def _get(entry: SweepEntry, name: str) -> float | None:
    v = entry.metrics.get(name)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _cell(entry: SweepEntry, name: str) -> str:
    return with_interval(_get(entry, name), _get(entry, ci_low(name)), _get(entry, ci_high(name)))


def best_vs_last(record: SweepRecord, folder: Path) -> Comparison | None:
    """The paired comparison ``best - last`` (None with fewer than two entries, or when the best is the last)."""
    best = record.best
    if best is None or len(record.entries) < 2 or best is record.entries[-1]:
        return None
    last = record.entries[-1]
    labels = [f"last (step {last.step})", f"best (step {best.step})"]
    return compare(labels, [load_results(folder / last.results), load_results(folder / best.results)])


def best_vs_first(record: SweepRecord, folder: Path) -> Comparison | None:
    """The paired comparison ``best - first`` when the best is the last checkpoint (what the run gained; the
    plot's second panel then), else None."""
    best = record.best
    if best is None or len(record.entries) < 2 or best is not record.entries[-1]:
        return None
    first = record.entries[0]
    labels = [f"first (step {first.step})", f"best (step {best.step})"]
    return compare(labels, [load_results(folder / first.results), load_results(folder / best.results)])


def render_markdown(record: SweepRecord, comparison: Comparison | None, plot: str | None = REPORT_PNG,
                    gained: Comparison | None = None) -> str:
    """``gained``: best minus first, when the best is the last (``best_vs_first``)."""
    s = record.settings
    budgets = list(s.get("ddtree_budgets") or [])
    # The drafter family's own walks (DFlash 2: the selector off, a perfect selector) get columns of their own.
    walks = family_named(record.family).figures.walks if record.family else ()
    best = record.best
    lines = ["## Checkpoint sweep", ""]
    lines.append(f"Cache `{s.get('cache_path')}` (manifest `{str(s.get('cache_manifest_sha256'))[:12]}`), "
                 f"{s.get('samples_evaluated')} samples, block {record.block_size}, tail blocks {s.get('tail_blocks')}, "
                 f"anchor stride {s.get('anchor_stride')}, dtype {s.get('dtype')} on {s.get('device_type')}. "
                 "tau is the exact greedy replay; intervals: 95%, cluster bootstrap over the prompts.")
    lines.append("")
    if best is not None:
        lines.append(f"- **best: step {best.step}** (`{best.checkpoint}`): tau {_cell(best, TAU)}"
                     + "".join(f", DDTree b{b} {_cell(best, ddtree_tau(b))}" for b in budgets[-1:]))
    if comparison is not None:
        d = comparison.differences[(0, 1)]
        lines.append(f"- **{d[TAU].text}**: {d[TAU].verdict} (paired on {comparison.n} prompts)")
    elif best is not None and len(record.entries) > 1:
        lines.append("- the best checkpoint is the last one")
        if gained is not None:
            d = gained.differences[(0, 1)]
            lines.append(f"- **{d[TAU].text}**: {d[TAU].verdict} (what the run gained, paired on {gained.n} prompts)")
    heads = [*(f"DDTree b{b}" for b in budgets), *(w.key for w in walks)]
    lines += ["", "| step | checkpoint | tau [95%] | " + "".join(f"{h} | " for h in heads) + " |",
              "|---|---|---|" + "---|" * len(heads) + "---|"]
    for e in record.entries:
        mark = "**best**" if e is best else ""
        cells = [*(_cell(e, ddtree_tau(b)) for b in budgets), *(_cell(e, w.key) for w in walks)]
        lines.append(f"| {e.step} | `{Path(e.checkpoint).name}` | {_cell(e, TAU)} | " + "".join(f"{c} | " for c in cells)
                     + f"{mark} |")
    if comparison is not None:
        lines += ["", f"### Best minus last, paired on {comparison.n} prompts", "",
                  "| metric | difference [95% interval] | verdict |", "|---|---|---|"]
        d = comparison.differences[(0, 1)]
        # The rows and verdicts of tools/compare_results.py on the same two files: one rule (``verdicts``).
        for metric in difference_rows(d, comparison.budgets, comparison.categories):
            lines.append(f"| {metric} | {d[metric].cell} | {d[metric].verdict} |")
        note = family_note(len(comparison.categories))
        if note:
            lines += ["", note]
    if record.failed:
        lines += ["", "### Not scored", ""]
        lines += [f"- `{f.checkpoint}`: {f.error}" for f in record.failed]
    if plot and record.entries:
        lines += ["", f"![tau over the checkpoints]({plot})"]
    return "\n".join(lines) + "\n"


def plot_sweep(record: SweepRecord, comparison: Comparison | None, path: str | Path) -> None:
    """Left: tau with its interval and DDTree tau per budget over the steps, the best marked. Right: ``comparison``,
    best minus last (or, when the best is the last, best minus first: ``best_vs_first``), paired, per metric with
    its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = record.entries
    steps = [e.step for e in entries]

    def series(name: str) -> list[float]:
        return [math.nan if _get(e, name) is None else _get(e, name) for e in entries]

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    ax.plot(steps, series(TAU), "o-", color="C0", label="tau")
    ax.fill_between(steps, series(ci_low(TAU)), series(ci_high(TAU)), color="C0", alpha=0.2, label="95% interval")
    for k, b in enumerate(record.settings.get("ddtree_budgets") or []):
        ax.plot(steps, series(ddtree_tau(b)), "s--", color=f"C{k + 1}", label=f"DDTree tau, budget {b}")
    best = record.best
    if best is not None:
        ax.plot([best.step], [best.tau], marker="*", markersize=18, color="gold", markeredgecolor="black",
                linestyle="none", label=f"best: step {best.step}")
    ax.set(xlabel="training step", ylabel="tokens per cycle", title="tau over the checkpoints")
    ax.legend(fontsize=8)
    ax = axes[1]
    if comparison is not None:
        diffs = comparison.differences[(0, 1)]
        names = list(diffs)
        values = [diffs[m].interval.value for m in names]
        low = [max(0.0, v - diffs[m].interval.low) if math.isfinite(diffs[m].interval.low) else 0.0
               for v, m in zip(values, names, strict=True)]
        high = [max(0.0, diffs[m].interval.high - v) if math.isfinite(diffs[m].interval.high) else 0.0
                for v, m in zip(values, names, strict=True)]
        ax.barh(range(len(names)), values, xerr=[low, high], capsize=3, color="C0")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set(xlabel=f"best - {comparison.labels[0].split(' ')[0]} (paired, 95% interval)",
               title=comparison.labels[1] + " vs " + comparison.labels[0])
    else:
        ax.axis("off")
        why = "the best checkpoint is the last one" if len(entries) > 1 else "fewer than two checkpoints"
        ax.text(0.5, 0.5, f"best vs last: {why}", ha="center", va="center")
    fig.tight_layout()
    try:
        with naming_failures(path):
            fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def write_report(record: SweepRecord, folder: str | Path) -> dict[str, Any]:
    """``folder/sweep.md`` and ``folder/sweep.png``: both, or (on a failure) neither is replaced."""
    folder = Path(folder)
    comparison = best_vs_last(record, folder)
    gained = best_vs_first(record, folder)
    md = render_markdown(record, comparison, gained=gained)
    with atomic_paths(folder / REPORT_MD, folder / REPORT_PNG) as (md_tmp, png_tmp):
        with naming_failures(folder / REPORT_MD), open(md_tmp, "w") as f:
            f.write(md)
        plot_sweep(record, comparison or gained, png_tmp)
    return {"markdown": folder / REPORT_MD, "plot": folder / REPORT_PNG, "comparison": comparison}
