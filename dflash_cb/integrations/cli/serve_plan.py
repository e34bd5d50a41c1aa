"""The command line of ``tools/serve_plan.py``: the files, the checks, the outputs; the plan itself is
``core.serve_plan``."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path

from ...common import cli
from ...common.log import say

USAGE = """Which drafter to serve, at which setting: projected speedups of several drafters on one cache.

    python tools/serve_plan.py dflash.json dflash2.json --labels dflash,dflash2 --out plan
        (writes plan.md and plan.png)

Each results file comes from tools/eval_drafter.py --profile PROFILE, every one with the same profile and cache.
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.json files written with --profile")
    p.add_argument("--labels", default=None, help="comma-separated names (default: the files' stems)")
    p.add_argument("--out", default="serve_plan", help="output path without suffix: .md and .png are written")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = p.parse_args(argv)

    from ...common.arguments import ArgumentError
    from ...core.results.results_file import load_results, report_paths
    from ...core.results.serve_plan import PLAN_HEADER, plan, write_plan
    from .compare import file_labels

    # compare_results' rule: a blank or repeated --label, the same file twice, stems told apart by their folders.
    if args.labels is not None or len(args.results) > 1:
        labels = file_labels(args.results, args.labels)
    else:
        labels = [Path(args.results[0]).stem]
    if args.resamples < 1 or args.seed < 0:
        raise ArgumentError("--resamples must be >= 1 and --seed >= 0")
    md_path, png_path = report_paths(args.out, PLAN_HEADER, "plan", [("results file", r) for r in args.results])
    results = [load_results(r) for r in args.results]
    the_plan = plan(labels, results, args.resamples, args.seed)
    for w in the_plan.warnings:
        warnings.warn(w, stacklevel=1)
    md = write_plan(the_plan, md_path, png_path)
    say(md)
    say(f"wrote {md_path} and {png_path}")
    return 0


command = cli.command(main)  # the ``dflash-serve-plan`` console command
