"""The command line of ``tools/eval_drafter.py``: the edge only (arguments, the checks that must pass
before any work, the files it writes); the evaluation itself is ``dflash_cb.engine.evaluate``."""


from __future__ import annotations

import argparse

from .positions import DEFAULT_POSITION_EDGES

USAGE = """Score a saved DFlash drafter on a cache of target states: exact tau, DDTree, per-depth acceptance.

    python tools/eval_drafter.py --states cached_states/qwen36-27b-v1 --drafter path/to/drafter \\
        --out results.json [--ddtree-budgets 16,32,64] [--device cuda] [--dtype bfloat16]
        [--samples N | --sample-ids a,b,c] [--no-verify]

Every argument, the cache, the drafter and the head are checked (and the shards to score hashed)
before the evaluation starts; a problem is one line naming the file and the fix, exit code 2.
"""


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (omit the option to score every "
                                         f"sample), got {n}")
    return n


def parse_budgets(text: str) -> tuple[int, ...]:
    from .errors import DFlashCBError

    try:
        budgets = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        budgets = ()
        bad = True
    else:
        bad = any(b < 1 for b in budgets)
    if bad:
        raise DFlashCBError(f"--ddtree-budgets {text!r}: expected comma-separated positive integers "
                            "(e.g. 16,32,64), or '' to turn DDTree off")
    return budgets


def resolve_device(name: str | None):  # -> torch.device
    import torch

    from .errors import DFlashCBError

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
    p.add_argument("--anchor-stride", type=int, default=1,
                   help="per-depth / all-anchor statistics on every N-th anchor (default 1: every anchor; "
                        "the callback's periodic evaluations use the block size); tau is exact either way")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu; exactness needs float32)")
    p.add_argument("--target", default=None,
                   help="target model folder to take the embedding and output head from (default: the cache's export)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--samples", type=_positive_int, default=None,
                     help="score a fixed subset of N samples, stratified by category exactly as the callback's "
                          "num_samples (same --sample-seed, same subset)")
    sel.add_argument("--sample-ids", default=None, help="score exactly these comma-separated sample ids")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the --samples subset (default 0, as the callback)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check the sha256 of every shard to score and of the exported head before scoring "
                        "(default; --no-verify checks sizes only)")
    p.add_argument("--served-check", action="store_true",
                   help="compare with the server's own speculative counters stored in the cache (the drafter "
                        "must be the one the server ran during the precompute)")
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)),
                   help="completion-position buckets for tau by position (results.json breakdown)")
    p.add_argument("--wandb-project", default=None, help="also log the evaluation to this W&B project")
    p.add_argument("--wandb-name", default=None, help="W&B run name")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from .checkpoints import load_drafter
    from .engine import evaluate, resolve_autocast
    from .errors import DFlashCBError
    from .positions import check_edges
    from .report import format_results
    from .results import check_results_path, drafter_provenance, report_to_results, write_results
    from .served import compare, format_check, has_served_counters, nothing_to_compare
    from .states import StateCache, select_sample_ids

    # Cheap checks first, then the files, so nothing is computed for a run that cannot finish.
    out = check_results_path(args.out)
    budgets = parse_budgets(args.ddtree_budgets)
    if args.anchor_stride < 1:
        raise DFlashCBError(f"--anchor-stride {args.anchor_stride}: expected a positive integer (1 = every anchor)")
    try:
        edges = check_edges([int(x) for x in args.position_edges.split(",") if x.strip()])
    except ValueError as e:
        raise DFlashCBError(f"--position-edges {args.position_edges!r}: {e}") from None
    device = resolve_device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cache = StateCache(args.states)
    if args.served_check and not has_served_counters(cache.samples):
        raise nothing_to_compare(cache.path)  # before any weights are read
    sample_ids = [i.strip() for i in args.sample_ids.split(",") if i.strip()] if args.sample_ids is not None else None
    ids = select_sample_ids(cache, args.samples, sample_ids, args.sample_seed)
    drafter = load_drafter(args.drafter, device=device)
    cache.check_drafter(drafter.spec.as_cache_check())
    drafter.eval()
    autocast = resolve_autocast(dtype_name, device, next(drafter.parameters()).dtype)
    # The head is held in the dtype it computes in: bf16 for a bf16 evaluation, float32 only when asked.
    head_dtype = autocast or next(drafter.parameters()).dtype
    head = None
    if args.target:
        from .target_head import load_target_head

        head = load_target_head(args.target, device=device, dtype=head_dtype)
        cache.check_head(head, f"--target {args.target}")  # tie flag, vocabulary and hidden size
    elif not cache.has_head:
        from .states import CacheError

        raise CacheError(f"{cache.path} has no exported target head (built with --no-export-head); "
                         "pass --target <the target model folder>")
    cache.check_files(ids, head=head is None)
    if args.verify:
        cache.verify(cache.shards_of(ids))
    cache.check_samples(ids)  # manifest fields against the shards (small tensors only)
    if head is None:
        head = cache.load_head(device=device, dtype=head_dtype, verify=args.verify)
    report = evaluate(cache, drafter, head, sample_ids=ids, budgets=budgets, device=device,
                      autocast_dtype=autocast, verify=args.verify, progress=True, anchor_stride=args.anchor_stride)
    results = report_to_results(report, cache, position_edges=edges, meta={
        "drafter": drafter_provenance(args.drafter), "dtype": dtype_name, "head_dtype": report.head_dtype,
        "device": str(device),
        "head_source": args.target or "cache", "verified": bool(args.verify),
        "sample_selection": {"samples": args.samples, "sample_ids": sample_ids, "sample_seed": args.sample_seed},
    })
    check = None
    if args.served_check:
        check = compare(cache.samples, {s.id: s.acceptance_lengths for s in report.samples},
                        cache.manifest.served_spec_config, drafter.spec.block_size, args.drafter)
        results.breakdown["served_check"] = check.to_dict()
    print(format_results(results))  # shown before writing: a failing write does not lose the numbers
    if check is not None:
        print("\n" + format_check(check))
    write_results(results, out)
    print(f"\nwrote {out}")
    if args.wandb_project:
        from .wandb_logging import log_standalone_results

        log_standalone_results(results, project=args.wandb_project, name=args.wandb_name)
    return 0
