"""A readable text summary of an evaluation (a ``results.Results``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..drafters.registry import family_named
from ..figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    CHAIN_TAU_ESTIMATE,
    DELTA_TAU,
    EVAL_OVERHEAD,
    EVAL_TIME,
    PREDICTED_SECONDS,
    SPECFORGE_ACC,
    T1_TAU_ESTIMATE,
    TAU,
    TAU_REQUEST_MEAN,
    category_tau,
    ci_high,
    ci_low,
    ddtree_tau,
)
from .results_file import Results


def _f(x: Any, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def with_interval(value: float | None, low: float | None, high: float | None, nd: int = 3) -> str:
    """``3.094 [2.77, 3.44]`` (just the value when there is no interval)."""
    if value is None:
        return "n/a"
    if low is None or high is None:
        return f"{value:.{nd}f}"
    return f"{value:.{nd}f} [{low:.2f}, {high:.2f}]"


def metric_with_interval(res: Results, name: str) -> str:
    return with_interval(res.metric(name), res.metric(ci_low(name)), res.metric(ci_high(name)))


def format_results(res: Results) -> str:
    family = family_named(res.family)
    figures = family.figures
    lines = []
    meta = res.meta
    lines.append(f"cache    {meta.get('cache_path')}  (manifest {str(meta.get('cache_manifest_sha256'))[:12]})")
    if meta.get("drafter"):
        step = res.drafter_step
        lines.append(f"drafter  {res.drafter_path}" + (f" (global step {step})" if step is not None else "")
                     + f"  dtype={meta.get('dtype')} head={meta.get('head_dtype')} device={meta.get('device')}"
                     + (f" threads={meta['threads']}" if meta.get("threads") is not None else ""))
    cycles = sum(len(s.acceptance_lengths) for s in res.samples)
    lines.append(f"samples  {len(res.samples)}   cycles {cycles}   wall {meta.get('wall_time_s')} s")
    if meta.get("block_size") is not None:
        drafter_block = meta.get("drafter_block_size")
        lines.append(f"block    {meta['block_size']}" + (f" (the drafter's is {drafter_block})" if drafter_block
                                                          not in (None, meta["block_size"]) else ""))
    if meta.get("anchors_drafted") is not None:
        seed = meta.get("anchor_seed")
        lines.append(f"anchors  drafted {meta['anchors_drafted']}   needed {meta.get('anchors_needed')}   "
                     f"statistics stride {meta.get('anchor_stride')}"
                     + (f" (per-sample offsets, seed {seed})" if seed is not None and meta.get("anchor_stride") != 1
                        else ""))
    lines.append("")
    lines.append(f"  tau (greedy replay, pooled)  {metric_with_interval(res, TAU)}")
    lines.append(f"  tau, mean over requests      {metric_with_interval(res, TAU_REQUEST_MEAN)}  (dflash.benchmark)")
    lines.append(f"  served accept length         {metric_with_interval(res, ACCEPT_LENGTH_SERVED)}  "
                 "(SGLang spec_accept_length, request mean)")
    for b in res.budgets:
        lines.append(f"  DDTree tau, budget {b:>4}     {metric_with_interval(res, ddtree_tau(b))}")
    lines.append(f"  all-anchor mean accepted     {metric_with_interval(res, ALL_ANCHOR_TAU)}")
    lines.append(f"  SpecForge DFlash accuracy    {metric_with_interval(res, SPECFORGE_ACC)}  "
                 "(its train/acc, eval/avg_acc" + (f"; {figures.specforge_scores})" if figures.specforge_scores
                                                   else ")"))
    masks = meta.get("specforge_masks")
    if masks and masks != "served":
        lines.append(f"    note: {masks}")
    lines.append(f"  chain estimate (indep.)      {_f(res.metric(CHAIN_TAU_ESTIMATE))}")
    if res.metric(T1_TAU_ESTIMATE) is not None:
        lines.append(f"  tau at temperature 1         {_f(res.metric(T1_TAU_ESTIMATE))}  "
                     "(ESTIMATE from top-K target log-probs)")
    shown = [f for f in (*figures.walks, *figures.pooled, *figures.own_pass) if res.metric(f.key) is not None]
    if shown:  # the drafter family's own figures (DFlash 2: where tau is lost)
        lines.append(f"  {family.label} {figures.section}")
        lines += [f"    {f.label:<48} {metric_with_interval(res, f.key)}" for f in shown]
    for table in figures.tables:  # the family's own tables of pooled figures
        cells = [[res.metric(table.key(i, j)) for j in range(len(table.columns))] for i in range(len(table.rows))]
        if any(v is not None for row in cells for v in row):
            lines.append(f"  {family.label} {table.title}")
            lines.append(f"    {table.row_header:<12} " + "".join(f"{c:<30}" for c in table.columns).rstrip())
            lines += [f"    {r:<12} " + "".join(f"{metric_with_interval(res, table.key(i, j)):<30}"
                                           for j in range(len(table.columns))).rstrip()
                      for i, r in enumerate(table.rows) if any(v is not None for v in cells[i])]
    lines.append("  [..] = 95% interval over the choice of prompts (cluster bootstrap)")
    pd = res.per_depth
    if pd.get("unconditional"):
        lines.append("")
        lines.append("  depth        " + " ".join(f"{k:>5d}" for k in range(1, len(pd["unconditional"]) + 1)))
        lines.append("  accept       " + " ".join(f"{_f(v, 2):>5}" for v in pd["unconditional"]))
        lines.append("  accept|prev  " + " ".join(f"{_f(v, 2):>5}" for v in pd["conditional"]))
        for d in figures.per_depth:  # the drafter family's own
            if pd.get(d.name):
                lines.append(f"  {d.short or d.name:<12.12} " + " ".join(f"{_f(v, 2):>5}" for v in pd[d.name]))
    if res.categories:
        lines.append("")
        for c in res.categories:
            n = sum(len(s.acceptance_lengths) for s in res.samples if s.category == c)
            lines.append(f"  {c:<20} tau {metric_with_interval(res, category_tau(c))}  ({n} cycles)")
    for title, key in (("tau by anchor position in the completion", "position"),
                       ("tau by cycle index after the prompt", "cycle")):
        table = res.breakdown.get(key) or {}
        if table:
            lines.append("")
            lines.append(f"  {title}:")
            for bucket, row in table.items():
                lines.append(f"    {bucket:<10} {_f(row.get('tau'))}  ({row.get('cycles')} cycles)")
    serving = res.breakdown.get("serving")
    if serving:
        lines += [""] + format_projection(serving)
    hist = res.histogram
    total = sum(hist.values())
    if total:
        lines.append("")
        lines.append("  produced per cycle:")
        for n, c in hist.items():
            if c:
                lines.append(f"    {int(n):>3} {c:>7}  {'#' * max(1, round(40 * c / total))}")
    return "\n".join(lines)


def format_projection(serving: dict) -> list[str]:
    """The serving projection of a results file (``core.serving``), said to be one, with its profile."""
    from ..costs.serving import Projection

    p = Projection.from_dict(serving)
    best = p.best
    lines = [f"  PROJECTED serving speed (profile: {p.profile}):",
             f"    {'setting':<14} {'tau':>6} {'speedup':>26} {'tokens/s':>28} {'break-even tau':>15}"]
    for s in p.settings:
        lines.append(f"    {s.setting.label:<14} {_f(s.tau, 3):>6} {_interval(s.speedup, 2, 'x'):>26} "
                     f"{_interval(s.tokens_per_second, 1, ''):>28} {_f(s.breakeven_tau, 2):>15}"
                     + ("   <- best" if s is best else ""))
    second = p.runner_up_difference()
    if second is not None:
        diff = second[1]
        lines.append(f"    best vs {second[0].setting.label}: {diff.value:+.3f}x [{diff.low:+.3f}, {diff.high:+.3f}]"
                     + ("" if diff.excludes_zero() else "  (no difference detectable)"))
    lines.append("    a projection from the replay's cycles and the profile's step costs, not a measured speed")
    return lines


def _interval(i: Any, digits: int, unit: str) -> str:
    return f"{i.value:.{digits}f}{unit} [{i.low:.{digits}f}, {i.high:.{digits}f}]"


def evaluation_line(step: int, metrics: dict[str, float], budgets: Sequence[int] = (),
                    baselines: Sequence[str] = (), note: str = "") -> str:
    """One console line per evaluation: tau with its interval, DDTree tau at the largest budget, deltas, time
    (and the predicted time beside it), then ``note`` (e.g. what the first evaluation spent besides scoring)."""
    def get(name: str) -> float | None:
        v = metrics.get(name)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None

    parts = [f"step {step}: tau {with_interval(get(TAU), get(ci_low(TAU)), get(ci_high(TAU)))}"]
    if budgets:
        b = max(budgets)
        parts.append(f"DDTree b{b} {_f(get(ddtree_tau(b)))}")
    for key in baselines:
        name = f"{key}/{DELTA_TAU}"
        if get(name) is not None:
            lo, hi = get(ci_low(name)), get(ci_high(name))
            iv = f" [{lo:+.2f}, {hi:+.2f}]" if lo is not None and hi is not None else ""
            parts.append(f"vs {key.split('/', 1)[1]} {get(name):+.3f}{iv}")
    if get(EVAL_TIME) is not None:
        share, predicted = get(EVAL_OVERHEAD), get(PREDICTED_SECONDS)
        parts.append(f"{get(EVAL_TIME):.2f} s" + (f", predicted {predicted:.2f} s" if predicted is not None else "")
                     + (f" ({share:.1%} of wall time)" if share is not None else ""))
    if note:
        parts.append(f"({note})")
    return "  ".join(parts)
