"""``results.json``: what an evaluation measured, and enough metadata to know later what it was.

Written by ``tools/eval_drafter.py`` and read back as a baseline by the callback, which refuses a
baseline measured on another cache (the manifest hash differs).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from . import __version__
from .cli import describe_os_error
from .engine import EvalReport
from .errors import DFlashCBError
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
            **(meta or {}),
        },
    }
    if T1_TAU_ESTIMATE in summary:
        out["t1_tau_estimate"] = {"value": _clean(summary[T1_TAU_ESTIMATE]), "note": T1_NOTE}
    return out


class ResultsError(DFlashCBError, ValueError):
    """A results.json cannot be written there, or read back as a baseline."""


def check_results_path(path: str | os.PathLike) -> Path:
    """Fail now, not after the evaluation, when ``path`` cannot receive a results file.

    Creates the missing parent folders and writes (then removes) a probe file next to ``path``.
    """
    path = Path(path)
    if path.is_dir():
        raise ResultsError(f"--out {path}: is a folder; give a file path, e.g. {path / 'results.json'}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ResultsError(f"--out {path}: {parent} is a file, not a folder; choose another path")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ResultsError(f"--out {path}: cannot write there ({describe_os_error(e)})") from None
    return path


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
        raise ResultsError(f"{path}: not valid JSON ({e}); recreate it with tools/eval_drafter.py") from e
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT or data.get("version") != RESULTS_VERSION:
        data = data if isinstance(data, dict) else {}
        raise ResultsError(f"{path}: not a dflash-cb results file (format {data.get('format')!r}, "
                         f"version {data.get('version')!r}); produce it with tools/eval_drafter.py")
    if cache is not None:
        meta = data.get("meta") or {}
        theirs = meta.get("cache_manifest_sha256")
        if theirs != cache.manifest_sha256:
            drafter = meta.get("drafter") or "<the reference drafter folder>"
            raise ResultsError(
                f"{path}: measured on cache {meta.get('cache_path')!r} "
                f"(manifest sha256 {str(theirs)[:12]}...), but this run evaluates {cache.path} "
                f"(manifest sha256 {cache.manifest_sha256[:12]}...). Numbers from different caches are not "
                f"comparable: rerun python tools/eval_drafter.py --states {shlex.quote(str(cache.path))} "
                f"--drafter {shlex.quote(str(drafter))} --out {shlex.quote(str(path))}"
            )
    return data
