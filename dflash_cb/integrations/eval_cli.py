"""The command line of ``tools/eval_drafter.py``: the edge only (arguments, the checks that must pass
before any work, the files it writes); the evaluation itself is ``dflash_cb.core.engine.evaluate``."""


from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from ..common import cli
from ..common.log import get_logger, say
from ..common.threads import THREADS_HELP
from ..core.positions import DEFAULT_POSITION_EDGES

logger = get_logger(__name__)

USAGE = """Score a saved DFlash drafter on a cache of target states: exact tau, DDTree, per-depth acceptance.

    python tools/eval_drafter.py --states cached_states/qwen36-27b-v1 --drafter path/to/drafter \\
        --out results.json [--ddtree-budgets 16,32,64] [--device cuda] [--dtype bfloat16]
        [--samples N | --sample-ids a,b,c] [--anchor-stride N [--anchor-seed S]] [--block-size N]
        [--served-check] [--no-verify] [--threads N]

Every argument, the cache, the drafter and the head are checked (and the shards to score hashed)
before the evaluation starts; a problem is one line naming the file and the fix, exit code 2.
"""


def parse_budgets(text: str) -> tuple[int, ...]:
    """``--ddtree-budgets``: comma-separated positive integers, or '' for no DDTree."""
    from ..common.arguments import parse_int_list

    return parse_int_list("--ddtree-budgets", text, 1, note="e.g. 16,32,64, or '' to turn DDTree off")


def resolve_device(name: str | None):  # -> torch.device
    import torch

    from ..common.errors import DFlashCBError

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DFlashCBError(f"--device {name!r}: not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise DFlashCBError(f"--device {name}: {why}; use --device cpu (exact float32), or run where a GPU is")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DFlashCBError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible; use cuda:0 .. "
                            f"cuda:{torch.cuda.device_count() - 1}")
    if device.type not in ("cpu", "cuda"):
        raise DFlashCBError(f"--device {name}: only cpu and cuda are supported")
    return device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", required=True, help="cache folder written by tools/precompute_states.py")
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="results.json to write (checked before any work)")
    p.add_argument("--ddtree-budgets", default="16,32,64", help="comma-separated node budgets ('' = off)")
    p.add_argument("--anchor-stride", default="1",
                   help="per-depth / all-anchor / SpecForge statistics on every N-th anchor from a per-sample offset "
                        "(default 1: every anchor; the callback's periodic evaluations use the block size); tau is "
                        "exact either way")
    p.add_argument("--anchor-seed", default="0",
                   help="seed of the per-sample offsets of the --anchor-stride set (default 0, as the callback); "
                        "recorded in results.json with each sample's offset")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu; exactness needs float32)")
    p.add_argument("--target", default=None,
                   help="target model folder to take the embedding and output head from (default: the cache's export)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--samples", default=None,
                     help="score a fixed subset of N samples, stratified by category exactly as the callback's "
                          "num_samples (same --sample-seed, same subset)")
    sel.add_argument("--sample-ids", default=None, help="score exactly these comma-separated sample ids")
    p.add_argument("--sample-seed", default="0", help="seed of the --samples subset (default 0, as the callback)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check the sha256 of every shard to score and of the exported head before scoring "
                        "(default; --no-verify checks sizes only)")
    p.add_argument("--tail-blocks", choices=["served", "reference"], default="served",
                   help="near the end: full blocks cut after verification, as SGLang serves (served, default), "
                        "or shortened blocks, as dflash's dflash_generate (reference); docs/method.md, 'Tail blocks'")
    p.add_argument("--block-size", default=None,
                   help="draft blocks of N tokens (anchor included), 2 .. the drafter's block (default: the "
                        "drafter's), as a server started with --speculative-num-draft-tokens N drafts; with "
                        "--served-check the default is the server's recorded block")
    p.add_argument("--served-check", action="store_true",
                   help="compare with the server's own speculative counters stored in the cache (the drafter "
                        "must be the one the server ran during the precompute)")
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)),
                   help="completion-position buckets for tau by position (results.json breakdown)")
    p.add_argument("--threads", default=None, help=THREADS_HELP)
    p.add_argument("--wandb-project", default=None, help="also log the evaluation to this W&B project")
    p.add_argument("--wandb-name", default=None, help="W&B run name")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from ..cache.prompts import parse_id_list
    from ..cache.states import StateCache
    from ..common.arguments import parse_int, parse_position_edges
    from ..common.errors import DFlashCBError
    from ..common.fileio import check_outputs_apart
    from ..common.threads import parse_threads, set_threads
    from ..core.anchor_sets import sparse_stride_warning
    from ..core.checkpoints import load_drafter
    from ..core.ddtree import check_ddtree_budgets
    from ..core.engine import anchors_per_sample, evaluate, resolve_autocast
    from ..core.report import format_results
    from ..core.request import EvalRequest
    from ..core.results import check_results_path, drafter_provenance, report_to_results, write_results
    from ..core.served_check import (
        compare,
        format_check,
        has_served_counters,
        nothing_selected,
        nothing_to_compare,
        replay_block_size,
    )
    from .config import EvalConfig
    from .session import LoopContext, chosen_samples, drafter_fit, open_session

    # Cheap checks first, then the files, so nothing is computed for a run that cannot finish.
    check_outputs_apart([("--states", args.states), ("--drafter", args.drafter), ("--target", args.target)],
                        files=[("--out", args.out)])
    out = check_results_path(args.out)
    # One rule with the callback's arguments (dflash_cb.common.arguments): a bad value is one line naming the option.
    budgets = parse_budgets(args.ddtree_budgets)
    check_ddtree_budgets(budgets, None, None, "--ddtree-budgets")  # the block and vocabulary bound: below
    anchor_stride = parse_int("--anchor-stride", args.anchor_stride, 1, note="1 = every anchor")
    block_size = parse_int("--block-size", args.block_size, 2, note="the anchor and at least one draft") \
        if args.block_size is not None else None  # the drafter's bound: below
    anchor_seed = parse_int("--anchor-seed", args.anchor_seed, 0)
    num_samples = parse_int("--samples", args.samples, 1, note="omit it to score every sample") \
        if args.samples is not None else None
    sample_ids = parse_id_list(args.sample_ids, "--sample-ids") if args.sample_ids is not None else None
    sample_seed = parse_int("--sample-seed", args.sample_seed, 0)
    edges = parse_position_edges("--position-edges", args.position_edges)
    threads = set_threads(parse_threads(args.threads))
    if args.served_check and args.tail_blocks != "served":
        raise DFlashCBError("--served-check with --tail-blocks reference: the server drafts full blocks, so the "
                            "check always replays with --tail-blocks served; drop --tail-blocks reference")
    device = resolve_device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    # The live evaluator's configuration and checks (session.py), with this tool's options.
    config = EvalConfig(args.states, every_n_train_steps=0, ddtree_budgets=budgets, light_ddtree_budgets=budgets,
                        light_anchor_stride=anchor_stride, anchor_seed=anchor_seed, num_samples=num_samples,
                        sample_ids=sample_ids, sample_seed=sample_seed, verify_cache=bool(args.verify),
                        position_edges=edges, tail_blocks=args.tail_blocks, block_size=block_size, table_samples=0,
                        console=False)
    cache = StateCache(args.states)
    if args.served_check and not has_served_counters(cache.samples):
        raise nothing_to_compare(cache.path)  # before any weights are read
    ids = chosen_samples(cache, config, option="--samples", warn=lambda m: logger.warning(f"warning: {m}"))
    sparse = sparse_stride_warning(anchors_per_sample(cache, ids), anchor_stride, anchor_seed, option="--anchor-stride")
    if sparse is not None:
        logger.warning(f"warning: {sparse}")
    if args.served_check:
        chosen = set(ids)
        why = nothing_selected(cache.path, [e for e in cache.samples if e.id in chosen])
        if why is not None:
            raise why  # the selection holds no sample with comparable counters: before any weights are read
    drafter = load_drafter(args.drafter, device=device)
    if args.served_check:  # the server's block when it is recorded (docs/method.md, "Check against the server")
        cache.check_drafter(drafter.spec.as_cache_check())  # before its block is compared with the server's
        config = config.replace(block_size=replay_block_size(cache.manifest.served_spec_config,
                                                             drafter.spec.block_size, block_size))
    if not args.target and not cache.has_head:
        from ..cache.manifest import CacheError

        raise CacheError(f"{cache.path} has no exported target head (built with --no-export-head); "
                         "pass --target <the target model folder>")
    fit = drafter_fit(cache, config, drafter, None, "--drafter", head_given=bool(args.target),
                      names={"block_size": "--block-size", "ddtree_budgets": "--ddtree-budgets",
                             "light_ddtree_budgets": "--ddtree-budgets"})
    drafter.eval()
    autocast = resolve_autocast(dtype_name, device, next(drafter.parameters()).dtype)
    # The head is held in the dtype it computes in: bf16 for a bf16 evaluation, float32 only when asked.
    head_dtype = autocast or next(drafter.parameters()).dtype
    head = None
    if args.target:
        from ..cache.target_head import load_target_head

        head = load_target_head(args.target, device=device, dtype=head_dtype)
        cache.check_head(head, f"--target {args.target}")  # tie flag, vocabulary and hidden size
        config = config.replace(target_embed=head.embed_tokens, target_lm_head=head.lm_head)
    open_session(config, LoopContext(), cache, ids)  # file sizes, the shards' sha256 (--verify), sample fields
    if head is None:
        head = cache.load_head(device=device, dtype=head_dtype, verify=args.verify)
    request = EvalRequest(sample_ids=tuple(ids), budgets=budgets, anchor_stride=anchor_stride, anchor_seed=anchor_seed,
                          block_size=fit.block_size, tail_blocks=args.tail_blocks, device=device,
                          autocast_dtype=autocast, verify=bool(args.verify))
    report = evaluate(cache, drafter, head, request, progress=True)
    results = report_to_results(report, cache, position_edges=edges, meta={
        "drafter": drafter_provenance(args.drafter), "dtype": dtype_name, "head_dtype": report.head_dtype,
        "device": str(device), "threads": threads,
        "head_source": args.target or "cache", "verified": bool(args.verify),
        "sample_selection": {"samples": num_samples, "sample_ids": sample_ids, "sample_seed": sample_seed},
    })
    check = None
    if args.served_check:
        check = compare(cache.samples, {s.id: s.acceptance_lengths for s in report.samples},
                        cache.manifest.served_spec_config, drafter.spec.block_size, args.drafter,
                        correct_drafts={s.id: s.correct_drafts for s in report.samples},
                        drafter_input_embedding_scale=drafter.spec.input_embedding_scale, block_size=fit.block_size)
        results.breakdown["served_check"] = check.to_dict()
    lines = [format_results(results)] + (["\n" + format_check(check)] if check is not None else [])
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
        from .wandb_logging import log_standalone_results

        run_dir = Path(log_standalone_results(results, project=args.wandb_project, name=args.wandb_name)).parent
        how = (f"; see it with python tools/wandb_panels.py --run {shlex.quote(str(run_dir))} --show"
               if run_dir.name.startswith("offline-run") else "")
        say(f"logged to W&B project {args.wandb_project}: {run_dir}{how}")
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
