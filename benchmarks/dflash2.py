#!/usr/bin/env python
"""A DFlash 2 drafter's evaluation beside a DFlash drafter of the same backbone, and its memory at the real width.

    OMP_NUM_THREADS=1 python benchmarks/dflash2.py [--update-docs]

One CPU run, one torch thread. The DFlash drafter is ``_synthetic``'s preset (default ``cpu``: 2 layers, hidden
256, vocabulary 4,096, block 16); the DFlash 2 drafter has the same backbone weights plus its convolutions
(group 16, 2 taps) and selector (rank ``--rank``, ``--top-k`` candidates), freshly initialised. Both score the
same planted synthetic cache (completions that follow the DFlash drafter's drafts for a few tokens a cycle), with
the two profiles a live run makes at every evaluation: greedy only and greedy with DDTree (the largest default
budget, statistics every block-th anchor), and the full one (stride 1, budgets 16, 32, 64). Repetitions
interleave the two drafters; the table gives the fastest repetition's wall seconds, the ratio DFlash 2 /
DFlash, and the counted work: drafter passes, anchors drafted, where the seconds went (``engine.PHASES``).
A DFlash 2 drafter's replay needs no sequential walk over a block's positions: its accepted length is the
teacher-forced pick's, one step for every (anchor, depth) row (docs/method.md, "DFlash 2"); the walk itself
(what a server proposes; the sample table's drafts) is timed apart, batched across anchors and one anchor at a
time.

Then ``cost.memory_bound`` and ``cost.block_gflop`` at the real width (the Qwen3.6-27B drafter's shape,
vocabulary 248,320, bf16; DFlash 2 codebooks of rank 256, K 16) for a DFlash drafter and a DFlash 2 one.
``--update-docs`` writes the report into docs/performance.md (``<!-- table:dflash2 -->``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _docs import report_to_docs  # noqa: E402
from _synthetic import PRESETS, cache_arguments, drafter_config, make_drafter, make_head, write_cache  # noqa: E402
from _timing import fastest  # noqa: E402

from dflash_cb.core.costs.evaluation import DEFAULT_LIMITS, DrafterShape, block_gflop, memory_bound  # noqa: E402
from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402
from dflash_cb.core.drafters.dflash2 import selector  # noqa: E402
from dflash_cb.core.drafters.dflash2.figures import SELECTOR_ORACLE_TAU, SELECTOR_UNARY_TAU  # noqa: E402
from dflash_cb.core.drafters.dflash2.model import PICK_ROWS, DFlash2Drafter  # noqa: E402
from dflash_cb.core.drafters.proposers import predecessors  # noqa: E402
from dflash_cb.core.drafters.runners import block_embeddings  # noqa: E402
from dflash_cb.core.figures.metrics import TAU  # noqa: E402
from dflash_cb.core.replay import PHASES, evaluate  # noqa: E402

GB = 1e9


def dflash2_config(p: dict, rank: int, top_k: int, block: int | None = None):
    config = drafter_config({**p, "block": block or p["block"]})
    config.architectures = ["DFlash2DraftModel"]
    config.dflash_config = {**config.dflash_config, "conv_group_size": 16, "conv_kernel_size": 2,
                            "selector_rank": rank, "selector_top_k": top_k}
    return config


def same_backbone(one: torch.nn.Module, rank: int, top_k: int, p: dict) -> DFlash2Drafter:
    """A DFlash 2 drafter holding ``one``'s weights; its convolutions the identity (a zero kernel projection on
    the identity base kernel) and its selector freshly initialised (small codebooks: it seldom overrules the
    unary head). So its blocks are ``one``'s and its walks nearly so: the work compares like for like."""
    two = DFlash2Drafter(dflash2_config(p, rank, top_k)).eval()
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and all(any(m in k for m in ("_conv.", "candidate_selector")) for k in missing)
    with torch.no_grad():
        for layer in two.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.zero_()
    return two


def side_by_side(args, p: dict) -> None:
    head = make_head(p, seed=0, device="cpu", dtype=torch.float32)
    one = make_drafter(p, seed=0, device="cpu", dtype=torch.float32)
    two = same_backbone(one, args.rank, args.top_k, p)
    block = p["block"]
    with tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp) / "planted", p, args.samples, args.prompt, args.tokens, head,
                            dtype=torch.float32, planted=FastRunner(one))
        profiles = {"greedy only": dict(budgets=(), anchor_stride=block),
                    "greedy + DDTree 64": dict(budgets=(64,), anchor_stride=block),
                    "full (stride 1, 16,32,64)": dict(budgets=(16, 32, 64), anchor_stride=1)}
        drafters = {"DFlash": one, "DFlash 2": two}
        best = fastest(args.reps, profiles, drafters, lambda drafter, options, timer: evaluate(
            cache, drafter, head, timer=timer, **options))
        anchors = sum(e.completion_len - 1 for e in cache.samples)
        print(f"{args.preset}: {args.samples} samples x {args.prompt} + {args.tokens - args.prompt} tokens "
              f"({anchors} anchors), hidden {p['hidden']}, {p['layers']} layers, vocabulary {p['vocab']:,}, block "
              f"{block}; DFlash 2: rank {args.rank}, K {args.top_k}; fastest of {args.reps} interleaved repetitions")
        print()
        head_row = f"{'profile':<27}{'drafter':<10}{'wall s':>8}{'x DFlash':>10}{'passes':>8}{'drafted':>9}" \
                   f"{'tau':>7}{'unary':>7}{'oracle':>8}"
        print(head_row)
        for name in profiles:
            base = best[(name, "DFlash")][1]
            for label in drafters:
                report, wall, _ = best[(name, label)]
                s = report.summary
                extra = (f"{s[SELECTOR_UNARY_TAU]:>7.3f}{s[SELECTOR_ORACLE_TAU]:>8.3f}" if label == "DFlash 2"
                         else f"{'':>7}{'':>8}")
                print(f"{name:<27}{label:<10}{wall:>8.3f}{wall / base:>10.2f}{report.passes:>8}"
                      f"{int(s['anchors_drafted']):>9}{s[TAU]:>7.3f}" + extra)
        print()
        print("where the time goes (wall seconds of the fastest repetition; engine phases exclusive):")
        columns = [(name, label) for name in profiles for label in drafters]
        print(f"{'phase':<18}" + "".join(f"{(n.split(' (')[0][:14] + ', ' + ('D2' if lb == 'DFlash 2' else 'D1')):>20}"
                                           for n, lb in columns))
        for phase in PHASES:
            print(f"{phase:<18}" + "".join(f"{best[c][2].get(phase, 0.0):>20.4f}" for c in columns))
        walk_timing(two, head, cache, args)


def walk_timing(two: DFlash2Drafter, head, cache, args) -> None:
    """The selector's free walk (what a server proposes: D dependent steps) batched across every anchor of the
    cache, the same walk anchor by anchor, and the replay's teacher-forced pick (one step for every row, in the
    head's row chunks as the engine makes it): the candidates and ``H(h)`` given."""
    spec = two.spec
    d = spec.block_size - 1
    hidden, anchor, target = [], [], []
    with torch.no_grad():
        for e in cache.samples:
            s = cache.load(e.id)
            anchors = torch.arange(e.prompt_len, e.total_len - 1)
            emb = block_embeddings(s.input_ids, anchors, spec.block_size, spec, head.embed_tokens)
            hidden.append(two.forward_blocks(two.context_kv(s.hidden), emb, anchors)[:, 1:])
            anchor.append(s.input_ids[anchors])
            pos = (anchors[:, None] + torch.arange(1, d + 1)[None]).clamp(max=e.total_len - 1)
            target.append(s.input_ids[pos])
        hidden, anchor, target = torch.cat(hidden), torch.cat(anchor), torch.cat(target)
        ids, unary, query = two.selector_inputs(hidden, head.lm_head)
        a, b = two.codebooks
        n, rows = ids.shape[0], PICK_ROWS  # the engine's chunks of rows (dflash2.SelectorProposer.rows)
        previous = predecessors(anchor, target).reshape(-1)

        def forced() -> torch.Tensor:
            flat = [x.reshape(n * d, *x.shape[2:]) for x in (ids, unary, query)]
            return torch.cat([selector.choose(*(x[i:i + rows] for x in flat), previous[i:i + rows], a, b)[0]
                              for i in range(0, n * d, rows)]).view(n, d)

        runs = {"walk, batched over anchors": lambda: selector.walk_draft(ids, unary, query, anchor, a, b),
                "walk, one anchor at a time": lambda: torch.cat([
                    selector.walk_draft(ids[i:i + 1], unary[i:i + 1], query[i:i + 1], anchor[i:i + 1], a, b)
                    for i in range(n)]),
                "teacher-forced pick (the replay's)": forced}
        seconds, out = {}, {}
        for name, fn in runs.items():
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                out[name] = fn()
                times.append(time.perf_counter() - t)
            seconds[name] = min(times)
    from dflash_cb.core.loop.cycles import leading_matches

    walks = list(out.values())
    assert torch.equal(walks[0], walks[1])
    assert torch.equal(leading_matches(walks[0], target), leading_matches(walks[2], target))
    print()
    print(f"the selector over {n} anchors x {d} depths, candidates and H(h) given (fastest of {args.reps}; the "
          f"walks equal, the pick's leading matches the walk's):")
    for name, sec in seconds.items():
        print(f"  {name:<36}{sec * 1e3:>9.1f} ms")


def real_width(args) -> None:
    """``memory_bound`` and ``block_gflop`` of the Qwen3.6-27B-shaped drafter, DFlash and DFlash 2."""
    p = PRESETS["qwen36-27b"]
    features = len(p["target_layers"]) * p["hidden"]
    shapes = {"DFlash, block 16": DrafterShape.of(drafter_config(p), 16, features),
              "DFlash 2, block 16": DrafterShape.of(dflash2_config(p, 256, 16), 16, features),
              "DFlash 2, block 8": DrafterShape.of(dflash2_config(p, 256, 16, block=8), 8, features)}
    tokens = 64 * 2048
    bounds = {k: memory_bound(s, tokens, weight_itemsize=2, head_itemsize=2, state_itemsize=2, limits=DEFAULT_LIMITS)
              for k, s in shapes.items()}
    parts = list(dict.fromkeys(k for b in bounds.values() for k in b))
    print()
    print(f"memory at the real width (cost.memory_bound): hidden {p['hidden']}, {p['layers']} layers, vocabulary "
          f"{p['vocab']:,}, bf16 weights, untied bf16 head, {tokens:,} context positions (64 x 2,048) in bf16, "
          f"default MemoryLimits; DFlash 2: rank 256, K 16, conv group 16, 2 taps")
    print()
    print("| part (GB) | " + " | ".join(shapes) + " |")
    print("|---" * (len(shapes) + 1) + "|")
    for part in [*parts, "total"]:
        cells = [sum(b.values()) if part == "total" else b.get(part) for b in bounds.values()]
        print(f"| {part} | " + " | ".join("-" if c is None else f"{c / GB:.2f}" for c in cells) + " |")
    print()
    print("GFLOP of one drafted block at a 1,024-token context (cost.block_gflop):")
    print()
    print("| drafter | 4 depths read, no tree | every depth, DDTree |")
    print("|---|---|---|")
    for k, s in shapes.items():
        d = s.block_size - 1
        print(f"| {k} | {block_gflop(s, 1024, min(4, d)):.1f} | {block_gflop(s, 1024, d, lattice=True):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache_arguments(ap, samples=8)
    ap.add_argument("--rank", type=int, default=256, help="the DFlash 2 selector's rank")
    ap.add_argument("--top-k", type=int, default=16, help="the DFlash 2 selector's candidates per position")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--update-docs", action="store_true", help="write the report into docs/performance.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with report_to_docs(args.update_docs, "performance.md", "dflash2"):
        side_by_side(args, PRESETS[args.preset])
        real_width(args)


if __name__ == "__main__":
    main()
