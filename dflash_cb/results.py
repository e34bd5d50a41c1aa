"""``results.json``: what an evaluation measured, and enough metadata to know later what it was.

Written by ``tools/eval_drafter.py`` and read back as a baseline by the callback, which refuses a
baseline measured on another cache (the manifest hash differs).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from . import __version__, metrics
from .engine import EvalReport
from .metrics import ALL_ANCHOR_TAU, SPECFORGE_TAU, T1_TAU_ESTIMATE, TAU, category_tau, ddtree_tau, per_depth
from .states import StateCache, atomic_write_bytes

RESULTS_FORMAT = "dflash-cb-results"
RESULTS_VERSION = 1
T1_NOTE = ("estimate: expected accepted length at temperature 1 from per-depth overlap sum_x min(p, q) "
           "with the target's stored top-K log-probs, along the greedy path; not an exact replay")


def _clean(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def report_to_results(report: EvalReport, cache: StateCache, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    summary = report.summary
    counts = report.counts
    hist = counts.data["hist"].tolist()
    out: dict[str, Any] = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "tau": _clean(summary[TAU]),
        "samples": [{"id": s.id, "category": s.category, "acceptance_lengths": s.acceptance_lengths}
                    for s in report.samples],
        "ddtree": {
            str(b): {"tau": _clean(summary[ddtree_tau(b)]),
                     "samples": [{"id": s.id, "acceptance_lengths": s.ddtree.get(b, [])} for s in report.samples]}
            for b in report.budgets
        },
        "per_depth": {k: [_clean(v) for v in vals] for k, vals in per_depth(summary, report.spec.block_size).items()},
        "histogram": {str(n): int(hist[n]) for n in range(1, report.spec.block_size + 1)},
        "per_category": {
            c: {"tau": _clean(summary[category_tau(c)]), "cycles": int(counts.data["cat_cycles"][i].item())}
            for i, c in enumerate(counts.categories)
        },
        "all_anchor_tau": _clean(summary[ALL_ANCHOR_TAU]),
        "specforge_sim_tau": _clean(summary[SPECFORGE_TAU]),
        "metrics": {k: _clean(v) for k, v in summary.items()},
        "meta": {
            "cache_path": str(cache.path),
            "cache_manifest_sha256": cache.manifest_sha256,
            "block_size": report.spec.block_size,
            "ddtree_budgets": list(report.budgets),
            "dflash_cb_version": __version__,
            "wall_time_s": round(report.wall_time_s, 3),
            "samples_evaluated": len(report.samples),
            metrics.ANCHOR_STRIDE: report.anchor_stride,
            metrics.ANCHORS_DRAFTED: int(counts.data["anchors_drafted"].item()),
            metrics.ANCHORS_NEEDED: int(counts.data["anchors_needed"].item()),
            **(meta or {}),
        },
    }
    if T1_TAU_ESTIMATE in summary:
        out["t1_tau_estimate"] = {"value": _clean(summary[T1_TAU_ESTIMATE]), "note": T1_NOTE}
    return out


def write_results(results: dict[str, Any], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(results, indent=1) + "\n").encode())


def load_results(path: str | os.PathLike, cache: StateCache | None = None) -> dict[str, Any]:
    """Read a results.json; with ``cache``, refuse one measured on a different cache."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such results file; create it with tools/eval_drafter.py --out {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if data.get("format") != RESULTS_FORMAT or data.get("version") != RESULTS_VERSION:
        raise ValueError(f"{path}: not a dflash-cb results file (format {data.get('format')!r}, "
                         f"version {data.get('version')!r}); produce it with tools/eval_drafter.py")
    if cache is not None:
        theirs = data.get("meta", {}).get("cache_manifest_sha256")
        if theirs != cache.manifest_sha256:
            raise ValueError(
                f"{path}: measured on cache {data.get('meta', {}).get('cache_path')!r} "
                f"(manifest sha256 {str(theirs)[:12]}...), but this run evaluates {cache.path} "
                f"(manifest sha256 {cache.manifest_sha256[:12]}...). Numbers from different caches are not "
                f"comparable: rerun tools/eval_drafter.py --states {cache.path} --out {path}"
            )
    return data
