#!/usr/bin/env python
"""Score a saved DFlash drafter on a cache of target states: exact tau, DDTree, per-depth acceptance.

    python tools/eval_drafter.py --states cached_states/qwen36-27b-v1 --drafter path/to/drafter \
        --out results.json [--ddtree-budgets 16,32,64] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", required=True, help="cache folder written by tools/precompute_states.py")
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="results.json to write")
    p.add_argument("--ddtree-budgets", default="16,32,64", help="comma-separated node budgets ('' = off)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu; exactness needs float32)")
    p.add_argument("--target", default=None,
                   help="target model folder to take the embedding and output head from (default: the cache's export)")
    p.add_argument("--samples", type=int, default=None, help="evaluate only the first N samples")
    p.add_argument("--verify", action="store_true", help="check every shard's sha256 before reading it")
    p.add_argument("--served-check", action="store_true",
                   help="compare with the server's own speculative counters stored in the cache (the drafter "
                        "must be the one the server ran during the precompute)")
    p.add_argument("--position-edges", default="0,256,512,1024,2048",
                   help="completion-position buckets for tau by position (results.json breakdown)")
    p.add_argument("--wandb-project", default=None, help="also log the evaluation to this W&B project")
    p.add_argument("--wandb-name", default=None, help="W&B run name")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from dflash_cb.engine import evaluate
    from dflash_cb.model import DFlashDrafter
    from dflash_cb.positions import check_edges
    from dflash_cb.report import format_results
    from dflash_cb.results import drafter_provenance, report_to_results, write_results
    from dflash_cb.served import compare, format_check, has_served_counters, nothing_to_compare
    from dflash_cb.states import CacheError, CacheMismatchError, StateCache

    try:
        budgets = tuple(int(b) for b in args.ddtree_budgets.split(",") if b.strip())
    except ValueError:
        print(f"error: --ddtree-budgets {args.ddtree_budgets!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    try:
        edges = check_edges([int(x) for x in args.position_edges.split(",") if x.strip()])
    except ValueError as e:
        print(f"error: --position-edges {args.position_edges!r}: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    # Cheap checks first: the cache and the drafter config, before any weights are read.
    try:
        cache = StateCache(args.states)
        if args.served_check and not has_served_counters(cache.samples):
            raise nothing_to_compare(cache.path)  # before any weights are read
        drafter = DFlashDrafter.from_pretrained(args.drafter, device=device)
        cache.check_drafter(drafter.spec.as_cache_check())
    except (CacheError, CacheMismatchError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    drafter.eval()
    head = None
    if args.target:
        from dflash_cb.target_head import load_target_head

        head = load_target_head(args.target, device=device, dtype=torch.float32)
    elif not cache.has_head:
        print(f"error: {cache.path} has no exported target head; pass --target PATH", file=sys.stderr)
        return 2
    ids = [s.id for s in cache.samples][: args.samples] if args.samples else None
    autocast = torch.bfloat16 if dtype_name == "bfloat16" else None
    report = evaluate(cache, drafter, head, sample_ids=ids, budgets=budgets, device=device,
                      autocast_dtype=autocast, verify=args.verify, progress=True)
    results = report_to_results(report, cache, position_edges=edges, meta={
        "drafter": drafter_provenance(args.drafter), "dtype": dtype_name, "device": str(device),
        "head_source": args.target or "cache",
    })
    check = None
    if args.served_check:
        check = compare(cache.samples, {s.id: s.acceptance_lengths for s in report.samples},
                        cache.manifest.served_spec_config, drafter.spec.block_size, args.drafter)
        results.breakdown["served_check"] = check.to_dict()
    write_results(results, args.out)
    print(format_results(results))
    if check is not None:
        print("\n" + format_check(check))
    print(f"\nwrote {args.out}")
    if args.wandb_project:
        from dflash_cb.wandb_logging import log_standalone_results

        log_standalone_results(results, project=args.wandb_project, name=args.wandb_name)
    return 0


if __name__ == "__main__":
    from dflash_cb.cli import run

    sys.exit(run(main))
