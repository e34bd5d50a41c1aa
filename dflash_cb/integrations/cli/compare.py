"""``tools/compare_results.py`` and ``dflash-compare``: compare results.json files of drafters scored on one cache
(the comparison itself: ``core.results.compare``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ...common import cli
from ...common.threads import THREADS_HELP
from ...core.figures.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED
from ...core.figures.positions import DEFAULT_POSITION_EDGES
from ...core.results.compare import COMPARISON_HEADER, CompareError, any_budgets, compare, write_comparison
from ...core.results.results_file import load_results, report_paths


def file_labels(paths: Sequence[str], given: str | None) -> list[str]:
    if given is not None:
        labels = [x.strip() for x in given.split(",")]
        if len(labels) != len(paths):
            raise CompareError(f"--labels has {len(labels)} names for {len(paths)} files; give one per file")
        if not all(labels):
            raise CompareError(f"--labels {given!r}: name {labels.index('') + 1} is blank; give a name per file")
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise CompareError(f"--labels {given!r}: {dup} given more than once; the labels name the columns and "
                               "the differences, so give each file its own name")
        return labels
    resolved = [Path(p).resolve() for p in paths]
    for k, r in enumerate(resolved):
        if r in resolved[:k]:
            raise CompareError(f"{paths[k]} is given twice (as {paths[resolved.index(r)]} too): a file compared "
                               "with itself differs by nothing; give two different results files")
    # The shortest tail of each path as given (folders and stem) that tells the files apart.
    tails = [tuple(x for x in Path(p).with_suffix("").parts if x != Path(p).anchor) for p in paths]
    for n in range(1, max(map(len, tails)) + 1):
        labels = ["/".join(t[-n:]) for t in tails]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compare_results.py",
        description="Compare results.json files of drafters scored on one cache: tau, DDTree and per-category tau "
                    "with 95% intervals, paired differences with a verdict, Markdown and a PNG.")
    p.add_argument("results", nargs="+", help="two or more results.json (tools/eval_drafter.py --out)")
    p.add_argument("--labels", default=None, help="comma-separated names, one per file (default: file stems)")
    p.add_argument("--out", default="comparison", help="writes OUT.md and OUT.png (default: ./comparison)")
    p.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="bootstrap seed (default 0)")
    p.add_argument("--published", default=None,
                   help="published-figures YAML (configs/baselines/published.yaml format): each figure is listed "
                        "beside the evaluations' figure of its declared convention")
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)),
                   help="completion-position bucket edges (default 0,256,512,1024,2048)")
    p.add_argument("--threads", default=None, help=THREADS_HELP)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ...common.arguments import parse_position_edges
    from ...common.threads import parse_threads, set_threads

    args = build_parser().parse_args(argv)
    if len(args.results) < 2:
        raise CompareError("give at least two results.json files to compare")
    edges = parse_position_edges("--position-edges", args.position_edges)  # the callback's rule
    if args.resamples < 1:
        raise CompareError(f"--resamples must be >= 1, got {args.resamples}")
    if args.seed < 0:
        raise CompareError(f"--seed {args.seed}: expected an integer >= 0 (the bootstrap's seed, default "
                           f"{DEFAULT_SEED})")
    threads = set_threads(parse_threads(args.threads))
    md_path, png_path = report_paths(args.out, COMPARISON_HEADER, "comparison", [("results file", r) for r in args.results])
    labels = file_labels(args.results, args.labels)
    results = [load_results(p) for p in args.results]  # ResultsError names the file and the fix
    published = []
    if args.published:
        from ...core.results.baselines import load_published

        try:  # a DDTree figure must stand beside a budget every evaluation has
            published = load_published(args.published, budgets=any_budgets(results)).baselines
        except (OSError, ValueError) as e:
            raise CompareError(f"--published: {e}") from None
    c = compare(labels, results, args.resamples, args.seed, edges)
    for w in c.warnings:
        print(f"warning: {w}", file=sys.stderr)
    md = write_comparison(c, md_path, png_path, published)
    print(md)
    print(f"wrote {md_path} and {png_path} ({threads} threads)")
    return 0


command = cli.command(main)  # the ``dflash-compare`` console command
