"""Everything W&B-specific: metric definitions, the samples table, histogram, per-depth chart, baselines.

Scalars reach every Lightning logger through ``trainer.loggers`` (callback.py); this module adds
what only W&B can show. Nothing here runs unless a ``WandbLogger`` is attached (or, for
``log_standalone_results``, a project is given), and ``wandb`` is imported lazily.

Metric layout (``prefix`` defaults to ``dflash_eval/``):

- ``{prefix}tau``, ``{prefix}ddtree/tau_b<B>``, ... : the live drafter, one point per evaluation
  (names from ``dflash_cb.core.figures.metrics``), plotted against ``trainer/global_step``.
- ``{prefix}baseline/<name>/<metric>``: a reference drafter measured on the same cache (constant
  series, logged at every evaluation so it spans the same steps, and in the run summary).
- ``{prefix}published/<name>/<metric>``: a figure reported by a paper, not measured here.
- ``{prefix}sample_table`` (table), ``{prefix}produced_hist`` (histogram of ``produced`` per cycle),
  ``{prefix}charts/acceptance_per_depth`` (live vs reference vs published on one plot).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ...core.figures.metrics import BEST_STEP, BEST_TAU, DEFAULT_PREFIX, EVAL_TIME, STEP_KEY, TAU
from ...core.results.baselines import Baseline, baseline_scalars
from ...core.results.results_file import Results
from .sample_table import TABLE_COLUMNS, clip


def define_eval_metrics(run: Any, prefix: str = DEFAULT_PREFIX) -> None:
    """Every ``{prefix}*`` series (live, baselines, published) plots against the trainer step."""
    run.define_metric(STEP_KEY)
    run.define_metric(f"{prefix}*", step_metric=STEP_KEY)
    # The summary keeps the best tau besides the last one (log_best adds the step it was measured at).
    run.define_metric(f"{prefix}{TAU}", step_metric=STEP_KEY, summary="max,last")


def start_live_run(run: Any, prefix: str, baselines: Sequence[Baseline], skipped: Sequence[str],
                   config: dict[str, Any]) -> None:
    """Once per fit, before the callback's first evaluation is logged: the metric definitions, the
    baselines in the summary (and the published entries not logged) and the callback's configuration."""
    define_eval_metrics(run, prefix)
    if baselines or skipped:
        log_baselines_summary(run, baselines, prefix, skipped)
    run.config.update({f"{prefix.rstrip('/')}_config": config}, allow_val_change=True)


def log_best(run: Any, history: Sequence[dict[str, float]], prefix: str = DEFAULT_PREFIX) -> None:
    """``{prefix}best/tau`` and ``{prefix}best/step`` in the run summary, from the callback's history."""
    scored = [h for h in history if isinstance(h.get(TAU), float) and math.isfinite(h[TAU])]
    if scored:
        best = max(scored, key=lambda h: h[TAU])
        run.summary[prefix + BEST_TAU] = best[TAU]
        run.summary[prefix + BEST_STEP] = int(best["step"])


# -- per-evaluation logging ---------------------------------------------------------------------

def _series(values: Sequence[float] | None) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for k, v in enumerate(values or [], start=1):
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            xs.append(k)
            ys.append(float(v))
    return xs, ys


def per_depth_chart(live: Sequence[float], baselines: Sequence[Baseline], step: int) -> Any | None:
    """Live, reference and published per-depth acceptance on one line plot (x = depth)."""
    import wandb

    xs, ys, keys = [], [], []
    for name, values in [(f"live @ step {step}", live)] + [(b.label, b.per_depth) for b in baselines]:
        x, y = _series(values)
        if x:
            xs.append(x)
            ys.append(y)
            keys.append(name)
    if not xs:
        return None
    return wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title="acceptance per depth (unconditional)",
                                  xname="depth")


def produced_histogram(hist: Sequence[float]) -> Any:
    """``hist[n]`` = cycles that produced n tokens (n = 0..block_size)."""
    import wandb

    counts = [float(c) for c in hist[1:]]
    edges = [n + 0.5 for n in range(len(counts) + 1)]
    return wandb.Histogram(np_histogram=(counts, edges))


def log_evaluation(run: Any, *, step: int, prefix: str, live_per_depth: Sequence[float], hist: Sequence[float],
                   baselines: Sequence[Baseline], rows: Sequence[list[Any]] | None) -> None:
    """The W&B-only objects of one evaluation (the scalars went through ``trainer.loggers``)."""
    import wandb

    data: dict[str, Any] = {STEP_KEY: int(step), f"{prefix}produced_hist": produced_histogram(hist)}
    chart = per_depth_chart(live_per_depth, baselines, step)
    if chart is not None:
        data[f"{prefix}charts/acceptance_per_depth"] = chart
    if rows:
        data[f"{prefix}sample_table"] = wandb.Table(columns=TABLE_COLUMNS, data=[list(r) for r in rows])
    run.log(data)


def log_baselines_summary(run: Any, baselines: Sequence[Baseline], prefix: str = DEFAULT_PREFIX,
                          skipped: Sequence[str] = ()) -> None:
    """Baselines in the run summary (every metric, per-depth included) and their provenance in the config."""
    for b in baselines:
        for k, v in b.metrics.items():
            run.summary[f"{prefix}{b.key}/{k}"] = v
    info = {b.key: {"kind": b.kind, "label": b.label, "source": b.source, **{k: v for k, v in b.details.items()
                                                                              if v is not None}}
            for b in baselines}
    if skipped:
        info["not_logged"] = list(skipped)
    run.config.update({f"{prefix.rstrip('/')}_baselines": info}, allow_val_change=True)


# -- standalone evaluation (tools/eval_drafter.py --wandb-project) ------------------------------

def results_scalars(results: Results, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The scalar metrics of a ``results.json`` under the callback's names (NaN/None dropped)."""
    out: dict[str, float] = {}
    for k in results.metrics:
        v = results.metric(k)
        if v is not None:
            out[prefix + k] = v
    wall = results.meta.get("wall_time_s")
    if isinstance(wall, (int, float)):
        out[prefix + EVAL_TIME] = float(wall)
    return out


def log_standalone_results(results: Results, project: str, name: str | None = None, *,
                           prefix: str = DEFAULT_PREFIX, published: str | os.PathLike | None = None,
                           entity: str | None = None, tags: Sequence[str] | None = None,
                           mode: str | None = None, dir: str | os.PathLike | None = None) -> str:
    """Log one evaluation (a ``results.json`` dict) as its own W&B run, under the callback's metric names.

    Logged at ``trainer/global_step`` 0 so that panels built for training runs show it too. Returns
    the run's local folder. ``mode`` defaults to W&B's own setting (``WANDB_MODE``, e.g. offline).
    """
    import wandb

    meta = results.meta
    run = wandb.init(project=project, name=name, entity=entity, tags=list(tags) if tags else None, mode=mode,
                     dir=str(dir) if dir else None, job_type="dflash-eval",
                     config={"dflash_eval": {k: v for k, v in meta.items() if v is not None}}, reinit="create_new")
    try:
        define_eval_metrics(run, prefix)
        scalars = results_scalars(results, prefix)
        baselines: list[Baseline] = []
        skipped: list[str] = []
        if published:
            from ...core.results.baselines import load_published

            pf = load_published(published)
            baselines, skipped = pf.baselines, pf.skipped
            scalars.update(baseline_scalars(baselines, prefix))
        hist_map = results.histogram
        block = int(meta.get("block_size") or (max((int(n) for n in hist_map), default=0)))
        hist = [0.0] * (block + 1)
        for n, c in hist_map.items():
            if int(n) <= block:
                hist[int(n)] = float(c)
        per_depth = results.per_depth.get("unconditional") or []
        per_depth = [math.nan if v is None else v for v in per_depth]
        rows = []
        for s in results.samples:
            ls = s.acceptance_lengths
            rows.append([0, s.id, s.category, "", "", "(standalone evaluation: no drafts kept)",
                         clip(" ".join(str(k) for k in ls), 1000), sum(ls) / len(ls) if ls else math.nan])
        run.log({**scalars, STEP_KEY: 0})
        log_evaluation(run, step=0, prefix=prefix, live_per_depth=per_depth, hist=hist, baselines=baselines,
                       rows=rows)
        for k, v in scalars.items():
            run.summary[k] = v
        if baselines or skipped:
            log_baselines_summary(run, baselines, prefix, skipped)
        return str(run.dir)
    finally:
        run.finish()


