"""``demo.py --target-from DIR``: the target, prompts and caches of an earlier demo, reused, so several drafter
families train and are scored on the same states without training the target again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..common.fileio import output_path
from .config import MARKER, DemoConfig, DemoError, Paths

# What a demo's target, prompts and caches depend on: a run reusing them must agree on each.
TARGET_SETTINGS = ("seed", "quick")


def check_target_from(cfg: DemoConfig) -> dict[str, Any]:
    """``--target-from DIR``: a finished demo of the same seed and ``--quick`` (its summary), checked before any
    work; the target, prompts and caches depend on nothing else (the drafter family, steps and evaluations do
    not enter them)."""
    src = Path(cfg.target_from)
    summary = src / "summary.json"
    if not (src / MARKER).is_file() or not summary.is_file():
        raise DemoError(f"--target-from {src}: not a finished demo's folder (no {MARKER} or summary.json); give the "
                        "--out of a demo that ran to the end")
    if output_path(src) == output_path(cfg.out):
        raise DemoError(f"--target-from {src} is --out itself; give another --out")
    try:
        earlier = json.loads(summary.read_text())
    except (OSError, ValueError) as e:
        raise DemoError(f"--target-from {summary}: not readable ({e}); run that demo again") from None
    now = {"seed": cfg.seed, "quick": cfg.quick}
    other = [f"{k} {earlier.get(k)!r} there, {now[k]!r} here" for k in TARGET_SETTINGS if earlier.get(k) != now[k]]
    if other:
        raise DemoError(f"--target-from {src}: its target was trained with other settings ({'; '.join(other)}); "
                        "run with the same --seed and --quick, or without --target-from")
    missing = [p for p in ("target", "prompts", "cache") if not (src / p).is_dir()]
    if missing:
        raise DemoError(f"--target-from {src}: {', '.join(missing)} missing; run that demo again")
    return earlier


def reuse_target(cfg: DemoConfig, paths: Paths, earlier: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Steps 1 and 2 from an earlier demo whose summary ``check_target_from`` read (``earlier``): its target,
    prompts and caches copied into this run's folder, so every family trains on the same states and this folder
    stands alone."""
    src = Path(cfg.target_from)
    print(f"[1-2/4] target, prompts and caches reused from {src} (same seed and --quick): copied, not trained "
          "again", flush=True)
    for name in ("target", "prompts", "cache"):
        shutil.copytree(src / name, paths.out / name)
    return earlier["target"], earlier["caches"]
