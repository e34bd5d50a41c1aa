#!/usr/bin/env python
"""What the intervals and breakdowns cost per evaluation: 100 samples x 500 cycles, 1,000 resamples.

    PYTHONPATH=$PWD python benchmarks/bootstrap.py [--samples 100] [--cycles 500] [--repeats 5]

Times ``figures.derived.derived_metrics`` (intervals for tau, 3 DDTree budgets and 4 categories; position and
cycle-index tables) and the paired difference alone; prints min and median over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dflash_cb.core.figures.bootstrap import metric_sums, paired_difference
from dflash_cb.core.figures.derived import derived_metrics
from dflash_cb.core.results.results_file import SampleRecord


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--cycles", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--update-docs", action="store_true", help="also write the report into docs/performance.md")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(args.update_docs, "performance.md", "intervals"):
        report(args)


def report(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    budgets, cats = (16, 32, 64), ("a", "b", "c", "d")
    samples = [SampleRecord(f"s{i}", cats[i % 4], rng.integers(1, 17, args.cycles).tolist(),
                            {b: rng.integers(1, 17, args.cycles).tolist() for b in budgets})
               for i in range(args.samples)]
    other = [SampleRecord(s.id, s.category, [min(16, k + 1) for k in s.acceptance_lengths]) for s in samples]
    t_all, t_pair = [], []
    for _ in range(args.repeats):  # interleaved
        t = time.perf_counter()
        derived_metrics(samples, budgets, cats)
        t_all.append(time.perf_counter() - t)
        t = time.perf_counter()
        paired_difference(metric_sums(samples)["tau"], metric_sums(other)["tau"])
        t_pair.append(time.perf_counter() - t)
    for name, ts in (("derived_metrics (intervals + breakdowns)", t_all), ("paired difference", t_pair)):
        print(f"{name:<42} {args.samples} samples x {args.cycles} cycles, 1000 resamples: "
              f"min {min(ts) * 1e3:.1f} ms, median {statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
