"""The command line of ``tools/eval_drafter.py``: the edge only (arguments, the checks that must pass
before any work, the files it writes); the evaluation itself is ``dflash_cb.core.replay.engine.evaluate``."""


from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from ...common import cli
from ...common.log import say
from ..evaluator.projection import (
    add_projection,
    cache_contexts,
    checked_settings,
    drafter_identity,
    read_profile,
    refuse_other_target,
)
from ..evaluator.scoring import CacheScorer, ScoringOptions, add_scoring_options

USAGE = """Score a saved DFlash drafter on a cache of target states: exact tau, DDTree, per-depth acceptance.

    python tools/eval_drafter.py --states cached_states/qwen36-27b-v1 --drafter path/to/drafter \\
        --out results.json [--ddtree-budgets 16,32,64] [--device cuda] [--dtype bfloat16]
        [--samples N | --sample-ids a,b,c] [--anchor-stride N [--anchor-seed S]] [--block-size N]
        [--served-check] [--profile profile.json] [--no-verify] [--threads N]

Every argument, the cache, the drafter and the head are checked (and the shards to score hashed)
before the evaluation starts; a problem is one line naming the file and the fix, exit code 2.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scoring_options(p)  # --states, budgets, stride, block, tail blocks, dtype, device, samples, threads, ...
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="results.json to write (checked before any work)")
    p.add_argument("--served-check", action="store_true",
                   help="compare with the server's own speculative counters stored in the cache (the drafter "
                        "must be the one the server ran during the precompute); the default --block-size is then "
                        "the server's recorded block")
    p.add_argument("--profile", default=None,
                   help="a cost profile (tools/profile_costs.py): also project tokens per second and the speedup "
                        "over plain decoding of every scored setting (block, DDTree budgets)")
    p.add_argument("--speculative-tokens", default=None, metavar="K,K,...",
                   help="a chain drafter (the target's MTP head, EAGLE-3): score each chain length K (e.g. 1,3,5; "
                        "the servers' num_speculative_tokens), one results file each: one K writes --out itself, "
                        "several write --out with .kK before its suffix (results.k1.json, results.k3.json); a "
                        "block drafter takes --block-size instead")
    p.add_argument("--wandb-project", default=None, help="also log the evaluation to this W&B project")
    p.add_argument("--wandb-name", default=None, help="W&B run name")
    return p.parse_args(argv)


def _served_speed(cache: Any, ids: list[str], projection: dict[str, Any] | None) -> tuple[Any, str] | None:
    """The served speedup of the prompts the precompute timed on a plain server too (``--baseline-server``), beside
    the projection on the same prompts; None when none was timed there."""
    from ...cache.served_speed import TIMING_KEY, TIMING_NAME, read_timings, served_speeds
    from ...core.costs.measured import format_served, served_comparison

    journal = read_timings(Path(cache.path) / TIMING_NAME)
    rows = served_speeds(journal, ids)
    if not rows:
        return None
    first = (journal[rows[0].id].get(TIMING_KEY) or {}).get("baseline") or {}
    c = served_comparison([r.id for r in rows], [r.seconds for r in rows], [r.baseline_seconds for r in rows],
                          max(r.in_flight for r in rows), projection)
    return c, format_served(c, str(first.get("url") or ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from ...common.errors import DFlashCBError
    from ...common.fileio import check_outputs_apart
    from ...core.checkpoints.load import load_drafter
    from ...core.drafters.layouts import cache_needs
    from ...core.drafters.registry import family_named
    from ...core.results.report import format_results
    from ...core.results.results_file import check_results_path, drafter_provenance, write_results
    from ...core.results.served_check import (
        compare,
        format_check,
        has_served_counters,
        nothing_selected,
        nothing_to_compare,
        replay_block_size,
    )

    # Cheap checks first, then the files, so nothing is computed for a run that cannot finish.
    chain = _chain_lengths(args)
    # Every file this run writes (each K's own with several), apart from every file it reads: the profile too,
    # often the only copy of a measurement.
    outs = [("--out", args.out)] + [("--out", chain_output(Path(args.out), k, chain)) for k in chain]
    check_outputs_apart([("--states", args.states), ("--drafter", args.drafter), ("--target", args.target),
                         ("--profile", args.profile)], files=outs)
    out = check_results_path(args.out)
    # One rule with the callback's arguments (dflash_cb.common.arguments): a bad value is one line naming the option.
    options = ScoringOptions.from_args(args)
    if args.served_check and args.tail_blocks != "served":
        raise DFlashCBError("--served-check with --tail-blocks reference: the server drafts full blocks, so the "
                            "check always replays with --tail-blocks served; drop --tail-blocks reference")
    profile = read_profile(args.profile) if args.profile else None
    # The live evaluator's configuration and checks (session.py), with this tool's options.
    scorer = CacheScorer(options)
    cache = scorer.cache
    if profile is not None:
        refuse_other_target(profile, cache.manifest.target, f"--profile {args.profile}")
    if args.served_check and not has_served_counters(cache.samples):
        raise nothing_to_compare(cache.path)  # before any weights are read
    if args.served_check:
        chosen = set(scorer.ids)
        why = nothing_selected(cache.path, [e for e in cache.samples if e.id in chosen])
        if why is not None:
            raise why  # the selection holds no sample with comparable counters: before any weights are read
    drafter = load_drafter(args.drafter, device=options.device)
    if profile is not None:  # a profile timing several drafters: this one's passes
        profile = profile.for_drafter(drafter_identity(drafter))
    if chain:
        return _score_chain_lengths(args, scorer, drafter, chain, out, profile)
    # The longest block the drafter can draft: its trained one, or a chain's unroll (``DrafterFamily.block_cap``).
    reach = family_named(drafter.spec.family).block_cap(drafter.spec)
    if args.served_check:  # the server's block when it is recorded (docs/method.md, "Check against the server")
        cache.check_fit(cache_needs(drafter))  # before its block is compared with the server's
        scorer.config = scorer.config.replace(block_size=replay_block_size(
            cache.manifest.served_spec_config, reach, options.block_size, family=drafter.spec.family))
    fit = scorer.check(drafter, "--drafter")
    settings = None
    if profile is not None:  # every setting within the profile's rows, before any scoring
        settings = checked_settings(profile, drafter, fit.block_size, scorer.options.budgets,
                                    f"--profile {args.profile}", contexts=cache_contexts(cache, scorer.ids))
    results, report = scorer.score(drafter, fit, drafter_provenance(args.drafter), progress=True)
    if profile is not None:
        add_projection(results, report, cache, profile, settings)
    check = None
    if args.served_check:
        check = compare(cache.samples, {s.id: s.acceptance_lengths for s in report.samples},
                        cache.manifest.served_spec_config, reach, args.drafter,
                        correct_drafts={s.id: s.correct_drafts for s in report.samples},
                        drafter_input_embedding_scale=drafter.spec.input_embedding_scale, block_size=fit.block_size,
                        family=drafter.spec.family)
        results.breakdown["served_check"] = check.to_dict()
    lines = [format_results(results)] + (["\n" + format_check(check)] if check is not None else [])
    if args.served_check:
        served = _served_speed(cache, [s.id for s in report.samples], results.breakdown.get("serving"))
        if served is not None:
            results.breakdown["served_speed"] = served[0].to_dict()
            lines.append("\n" + served[1])
    # Written before the summary is printed, so a closed pipe (``eval_drafter ... | head``) cannot lose the
    # results; a write that fails (a full disk) still shows the numbers, then names the file.
    try:
        write_results(results, out)
    except OSError:
        for line in lines:
            say(line)
        raise
    try:
        for line in [*lines, f"\nwrote {out}"]:
            say(line)
    except BrokenPipeError:
        _stdout_closed(out)
        return 0
    if args.wandb_project:
        from ..tracking.wandb_logging import log_standalone_results

        run_dir = Path(log_standalone_results(results, project=args.wandb_project, name=args.wandb_name)).parent
        how = (f"; see it with python tools/wandb_panels.py --run {shlex.quote(str(run_dir))} --show"
               if run_dir.name.startswith("offline-run") else "")
        say(f"logged to W&B project {args.wandb_project}: {run_dir}{how}")
    return 0


def _chain_lengths(args: argparse.Namespace) -> list[int]:
    """``--speculative-tokens`` as a list of K (empty when not given), checked before any weights are read."""
    from ...common.arguments import ArgumentError, parse_int_list

    if args.speculative_tokens is None:
        return []
    if args.block_size is not None or args.served_check:
        raise ArgumentError("--speculative-tokens sets the block of each evaluation (K + 1): drop --block-size "
                            "and --served-check")
    ks = sorted(set(parse_int_list("--speculative-tokens", args.speculative_tokens, 1)))
    if not ks:
        raise ArgumentError("--speculative-tokens: give chain lengths, e.g. 1,3,5")
    return ks


def chain_output(out: Path, k: int, ks: list[int]) -> Path:
    """Where ``--speculative-tokens`` writes the results of chain length ``k`` of ``ks``: ``--out`` itself for one K,
    ``.kK`` before the suffix for several (one file each)."""
    return out if len(ks) == 1 else out.with_name(f"{out.stem}.k{k}{out.suffix or '.json'}")


def _score_chain_lengths(args: argparse.Namespace, scorer: object, drafter: object, ks: list[int], out: Path,
                         profile: object) -> int:
    """One evaluation per chain length, each written to its own results file, then a table of them."""
    from ...common.arguments import ArgumentError
    from ...core.drafters.registry import family_named
    from ...core.results.results_file import check_results_path, drafter_provenance, write_results

    family = family_named(drafter.spec.family)
    if family.kind != "chain":
        raise ArgumentError(f"--speculative-tokens: a {family.label} drafter drafts a block in one pass; score "
                            "another block with --block-size")
    cap = family.block_cap(drafter.spec) - 1
    if ks[-1] > cap:
        raise ArgumentError(f"--speculative-tokens {args.speculative_tokens}: a {family.label} chain drafts 1 to "
                            f"{cap} tokens a cycle (K); give chain lengths up to {cap}")
    if profile is not None:  # every K within the profile's rows, before the first is scored
        for k in ks:
            checked_settings(profile, drafter, k + 1, (), f"--profile {args.profile}",
                             "smaller --speculative-tokens", contexts=cache_contexts(scorer.cache, scorer.ids))
    outs = [check_results_path(chain_output(out, k, ks)) for k in ks]
    rows = []
    base = scorer.config
    for k, path in zip(ks, outs, strict=True):
        scorer.config = base.replace(block_size=k + 1)
        fit = scorer.check(drafter, "--drafter")
        settings = None
        if profile is not None:
            with warnings.catch_warnings():  # said once, before the first K was scored
                warnings.simplefilter("ignore")
                settings = checked_settings(profile, drafter, fit.block_size, (), f"--profile {args.profile}",
                                            "smaller --speculative-tokens")
        results, report = scorer.score(drafter, fit, drafter_provenance(args.drafter), progress=True)
        if profile is not None:
            add_projection(results, report, scorer.cache, profile, settings)
        write_results(results, path)
        rows.append((k, results.metrics, path))
    say(f"{family.label} drafter {args.drafter}, chain length K (num_speculative_tokens):")
    say(f"{'K':>3}  {'tau':>7}  {'95% interval':>17}" + ("  projected speedup" if profile is not None else ""))
    for k, m, path in rows:
        speed = f"  {m['serving/speedup_greedy']:>17.3f}" if "serving/speedup_greedy" in m else ""
        say(f"{k:>3}  {m['tau']:>7.3f}  [{m['tau_ci_low']:.3f}, {m['tau_ci_high']:.3f}]{speed}   -> {path}")
    return 0


def _stdout_closed(out: Path) -> None:
    """The reader of stdout went away (``| head``): the results are written; say so where it can be read."""
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's final flush must not fail again
        print(f"eval_drafter: stdout was closed before the summary was printed; the results are in {out}",
              file=sys.stderr)
    except OSError:
        pass


command = cli.command(main)  # the ``dflash-eval`` console command
