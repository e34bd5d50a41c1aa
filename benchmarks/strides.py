#!/usr/bin/env python
"""Strided anchor statistics against every anchor, on the demo's training cache: the docs table.

    python tools/demo.py --out demo_out                       # once: the demo's caches and trained drafter
    OMP_NUM_THREADS=1 python benchmarks/strides.py --demo demo_out

For each stride (default 1, 2, 4, 8, 16; per-sample offsets from ``--anchor-seed``), one row:
``specforge/acc``, the acceptance at depths 1-3 and ``all_anchor_tau``, each with its 95% cluster-bootstrap
interval (``bootstrap.interval_metrics``), the anchors the statistics scored and the wall time of the
evaluation (greedy replay plus statistics, DDTree off unless ``--ddtree-budgets``; the minimum over
``--reps`` runs, strides interleaved). Then which strided figures fall outside the stride-1 interval and
whether the stride-1 figure falls inside each strided interval.

A second table shows what the offsets do: per stride, each figure's mean and standard deviation over
``--seeds`` draws of the offsets (computed from the per-sample counts of one evaluation per offset), and
the figure with every sample started at its first anchor (offset 0: the statistics set before per-sample
offsets). Prints Markdown.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.checkpoints.load import load_drafter  # noqa: E402
from dflash_cb.core.figures.bootstrap import interval_metrics  # noqa: E402
from dflash_cb.core.figures.metrics import (  # noqa: E402
    ALL_ANCHOR_TAU,
    SPECFORGE_ACC,
    EvalCounts,
    ci_high,
    ci_low,
    depth_acc,
    summarize,
)
from dflash_cb.core.loop.anchor_sets import offsets_for  # noqa: E402
from dflash_cb.core.replay import EvalReport, evaluate  # noqa: E402

FIGURES = [SPECFORGE_ACC, depth_acc(1), depth_acc(2), depth_acc(3), ALL_ANCHOR_TAU]
HEADER = ["specforge/acc", "depth 1", "depth 2", "depth 3", "all_anchor_tau"]


def figures(report: EvalReport, stride: int) -> dict[str, tuple[float, float, float]]:
    """{figure: (value, low, high)} at ``stride`` (intervals over the samples, their offsets included)."""
    summary = report.summary
    ivs = interval_metrics(report.samples, anchor_stride=stride)
    return {f: (summary[f], ivs.get(ci_low(f), math.nan), ivs.get(ci_high(f), math.nan)) for f in FIGURES}


def cell(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", default="demo_out", help="the demo's output folder (python tools/demo.py --out ...)")
    p.add_argument("--cache", default="train", choices=["train", "eval"], help="which of the demo's caches")
    p.add_argument("--strides", default="1,2,4,8,16")
    p.add_argument("--anchor-seed", type=int, default=0)
    p.add_argument("--ddtree-budgets", default="", help="comma-separated DDTree budgets timed with it ('' = off)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per stride (the minimum is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seeds", type=int, default=200, help="offset draws for the mean / sd table (default 200)")
    p.add_argument("--update-docs", action="store_true", help="also write the report into docs/method.md")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(args.update_docs, "method.md", "strides"):
        report(args)


def report(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    demo = Path(args.demo)
    cache = StateCache(demo / "cache" / args.cache)
    drafter = load_drafter(demo / "drafter", device="cpu").eval()
    head = cache.load_head()
    strides = [int(x) for x in args.strides.split(",")]
    budgets = tuple(int(x) for x in args.ddtree_budgets.split(",") if x.strip())
    ids = [e.id for e in cache.samples]

    def run(stride: int, offsets: dict[str, int] | None = None) -> EvalReport:
        return evaluate(cache, drafter, head, budgets=budgets, anchor_stride=stride, anchor_seed=args.anchor_seed,
                        anchor_offsets=offsets)

    run(strides[0])  # warm up (allocator, kernels)
    walls: dict[int, list[float]] = {s: [] for s in strides}
    reports: dict[int, EvalReport] = {}
    for _ in range(args.reps):  # interleaved, so a busy moment on a shared machine spreads over every stride
        for s in strides:
            t = time.perf_counter()
            reports[s] = run(s)
            walls[s].append(time.perf_counter() - t)
    rows = {s: figures(reports[s], s) for s in strides}

    print(f"Demo training cache `{cache.path}`: {len(ids)} samples, block {drafter.spec.block_size}, anchor seed "
          f"{args.anchor_seed}; DDTree {'off' if not budgets else budgets}; {args.threads} torch thread(s); wall = "
          f"min of {args.reps}. [..] = 95% cluster-bootstrap interval over samples.")
    print()
    print("| stride | " + " | ".join(HEADER) + " | anchors scored | wall (s) |")
    print("|---" * (len(HEADER) + 3) + "|")
    for s in strides:
        anchors = int(reports[s].counts.data["anchors"].item())
        print(f"| {s} | " + " | ".join(cell(rows[s][f]) for f in FIGURES) + f" | {anchors} | {min(walls[s]):.2f} |")

    one = strides[0]
    outside = [f"{h} at stride {s}" for s in strides[1:] for f, h in zip(FIGURES, HEADER, strict=True)
               if not rows[one][f][1] <= rows[s][f][0] <= rows[one][f][2]]
    missed = [f"{h} at stride {s}" for s in strides[1:] for f, h in zip(FIGURES, HEADER, strict=True)
              if not rows[s][f][1] <= rows[one][f][0] <= rows[s][f][2]]
    print()
    print(f"Strided figures outside the stride-{one} interval: {', '.join(outside) or 'none'}.")
    print(f"Strided intervals that miss the stride-{one} figure: {', '.join(missed) or 'none'}.")
    print()
    print(f"Over {args.seeds} draws of the offsets (seeds 0..{args.seeds - 1}): mean (sd) of each figure; and every "
          "sample at offset 0 (its first anchor always in: the statistics set before per-sample offsets):")
    print()
    print("| stride | " + " | ".join(HEADER) + " | " + " | ".join(f"{h}, offset 0" for h in HEADER) + " |")
    print("|---" * (2 * len(HEADER) + 1) + "|")
    for s in strides:
        per_offset = [{r.id: r.anchor_counts[s] for r in run(s, dict.fromkeys(ids, o)).samples} for o in range(s)]
        draws = {f: [] for f in FIGURES}
        for seed in range(args.seeds):
            offsets = offsets_for(ids, s, seed)
            summary = pooled([per_offset[offsets[i]][i] for i in ids], drafter.spec.block_size)
            for f in FIGURES:
                draws[f].append(summary[f])
        first = pooled([per_offset[0][i] for i in ids], drafter.spec.block_size)
        stats = [f"{statistics.mean(draws[f]):.4f} ({statistics.pstdev(draws[f]):.4f})" for f in FIGURES]
        print(f"| {s} | " + " | ".join(stats) + " | " + " | ".join(f"{first[f]:.3f}" for f in FIGURES) + " |")


def pooled(counts: list, block_size: int) -> dict[str, float]:
    """The figures of per-sample anchor counts summed (``metrics.summarize``)."""
    total = EvalCounts(block_size, (), ())
    for c in counts:
        total.add_anchor_counts(c)
    return summarize(total)


if __name__ == "__main__":
    main()
