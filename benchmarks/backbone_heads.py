#!/usr/bin/env python
"""Domino and DSpark drafters' evaluation beside a DFlash drafter of the same backbone, and their memory at the
real width.

    OMP_NUM_THREADS=1 python benchmarks/backbone_heads.py [--preset cpu] [--reps 3] [--update-docs]

One CPU run, one torch thread. The DFlash drafter is ``_synthetic``'s preset (default ``cpu``: 2 layers, hidden
256, vocabulary 4,096, block 16); the Domino drafter (GRU correction, ``--emb-dim``, ``--gru-dim``) and two DSpark
drafters (a ``gated`` and an ``rnn`` Markov head of rank ``--rank``, each with a confidence head that reads the
Markov code) hold the same backbone weights, their heads freshly initialised (their output projections times
``--head-scale``, 0.01: a fresh head at full scale overrules the backbone nearly everywhere and its walks draft
every anchor). The head sizes default to a
sixteenth of the hidden size, about the real width's ratio (rank 256 at hidden 5,120). All score the same planted
synthetic cache (completions that follow the DFlash drafter's drafts for a few tokens a cycle) with the profile a
full evaluation runs (statistics at every anchor: every anchor drafted once, whatever the drafter's tau, so the
work is like for like) and a live run's light one (statistics every 16th anchor; what is drafted then follows each
drafter's own walk: the fresh heads change drafts, so their walks draft more anchors). Repetitions interleave the
drafters; the table gives the fastest repetition's wall seconds, the ratio to DFlash's, the counted work (drafter
passes, anchors drafted) and where the seconds went (``engine.PHASES``; the family's prefix scan, the GRU or the
rnn head's state, is part of the head phase).

Then ``costs.evaluation.memory_bound`` at the real width (the Qwen3.6-27B drafter's shape, vocabulary 248,320,
bf16) for the four drafters: the heads' weights (``DrafterFamily.cost_fields``) are part of ``weights``.
``--update-docs`` writes the report into docs/performance.md (``<!-- table:backbone-heads -->``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _docs import report_to_docs  # noqa: E402
from _synthetic import PRESETS, cache_arguments, drafter_config, make_drafter, make_head, write_cache  # noqa: E402
from _timing import fastest  # noqa: E402

from dflash_cb.core.costs.evaluation import DrafterShape, memory_bound  # noqa: E402
from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402
from dflash_cb.core.drafters.registry import family_of  # noqa: E402
from dflash_cb.core.figures.metrics import TAU  # noqa: E402
from dflash_cb.core.replay import PHASES, evaluate  # noqa: E402

GB = 1e9


def head_configs(p: dict, rank: int, emb_dim: int, gru_dim: int) -> dict[str, object]:
    """The drafters' configs beside DFlash's: Domino, DSpark gated and rnn (each with a confidence head)."""
    def on_backbone(architecture: str, **fields) -> object:
        config = drafter_config(p)
        config.architectures = [architecture]
        config.dflash_config = {**config.dflash_config, **fields}
        return config

    dspark = dict(projector_type="dspark", markov_rank=rank, enable_confidence_head=True,
                  confidence_head_with_markov=True)
    return {"DFlash": drafter_config(p),
            "Domino": on_backbone("DominoDraftModel", projector_type="domino", emb_dim=emb_dim, gru_hidden_dim=gru_dim),
            "DSpark gated": on_backbone("DSparkDraftModel", markov_head_type="gated", **dspark),
            "DSpark rnn": on_backbone("DSparkDraftModel", markov_head_type="rnn", **dspark)}


# The weights that project a head's output onto the vocabulary: scaled by ``--head-scale`` after the fresh init.
OUTPUTS = ("embed_proj.2.weight", "markov_head.markov_w2.weight")


def same_backbone(one: torch.nn.Module, config: object, seed: int, scale: float) -> torch.nn.Module:
    """A drafter of ``config``'s family holding ``one``'s weights, its own head freshly initialised and its output
    projection times ``scale`` (a fresh head at full scale overrules the backbone's head nearly everywhere, tau
    about 1, and a walk then drafts every anchor; a small one changes a few drafts: the work compares like for
    like)."""
    torch.manual_seed(seed)
    drafter = family_of(config).module_class()(config).eval()
    missing, unexpected = drafter.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and all(k.split(".")[0] in family_of(config).head_parts for k in missing), missing
    with torch.no_grad():
        for name, weight in drafter.named_parameters():
            if name in OUTPUTS:
                weight.mul_(scale)
    return drafter


def side_by_side(args, p: dict) -> None:
    head = make_head(p, seed=0, device="cpu", dtype=torch.float32)
    one = make_drafter(p, seed=0, device="cpu", dtype=torch.float32)
    configs = head_configs(p, args.rank, args.emb_dim, args.gru_dim)
    drafters = {label: one if label == "DFlash" else same_backbone(one, config, 1 + i, args.head_scale)
                for i, (label, config) in enumerate(configs.items())}
    with tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp) / "planted", p, args.samples, args.prompt, args.tokens, head,
                            dtype=torch.float32, planted=FastRunner(one))
        profiles = {"full (stride 1)": dict(anchor_stride=1), "light (stride 16)": dict(anchor_stride=16)}
        best = fastest(args.reps, profiles, drafters, lambda drafter, options, timer: evaluate(
            cache, drafter, head, budgets=(), timer=timer, **options))
        anchors = sum(e.completion_len - 1 for e in cache.samples)
        print(f"{args.preset}: {args.samples} samples x {args.prompt} + {args.tokens - args.prompt} tokens "
              f"({anchors} anchors), hidden {p['hidden']}, {p['layers']} layers, vocabulary {p['vocab']:,}, block "
              f"{p['block']}; Domino: emb_dim {args.emb_dim}, GRU {args.gru_dim}; DSpark: rank {args.rank}, "
              f"confidence head with the Markov code; heads' output "
              f"projections x {args.head_scale:g}; fastest of {args.reps} interleaved repetitions")
        print()
        print(f"{'profile':<20}{'drafter':<14}{'wall s':>8}{'x DFlash':>10}{'passes':>8}{'drafted':>9}{'tau':>7}")
        for name in profiles:
            base = best[(name, "DFlash")][1]
            for label in drafters:
                report, wall, _ = best[(name, label)]
                s = report.summary
                print(f"{name:<20}{label:<14}{wall:>8.3f}{wall / base:>10.2f}{report.passes:>8}"
                      f"{int(s['anchors_drafted']):>9}{s[TAU]:>7.3f}")
        print()
        print("where the time goes (wall seconds of the fastest repetition; engine phases exclusive):")
        columns = [(name, label) for name in profiles for label in drafters]
        short = {"DFlash": "DF", "Domino": "Dom", "DSpark gated": "gated", "DSpark rnn": "rnn"}
        print(f"{'phase':<18}" + "".join(f"{name.split(' (')[0] + ' ' + short[label]:>12}" for name, label in columns))
        for phase in PHASES:
            print(f"{phase:<18}" + "".join(f"{best[c][2].get(phase, 0.0):>12.4f}" for c in columns))
        print(f"{'outside phases':<18}" + "".join(f"{best[c][1] - sum(best[c][2].values()):>12.4f}" for c in columns))


def real_width(args) -> None:
    """``memory_bound`` of the Qwen3.6-27B-shaped drafter with each family's head."""
    p = PRESETS["qwen36-27b"]
    features = len(p["target_layers"]) * p["hidden"]
    shapes = {label: DrafterShape.of(config, p["block"], features)
              for label, config in head_configs(p, 256, 256, 256).items()}
    tokens = 64 * 2048
    bounds = {k: memory_bound(s, tokens, weight_itemsize=2, head_itemsize=2, state_itemsize=2) for k, s in shapes.items()}
    print()
    print(f"memory at the real width (GB; cost.memory_bound): hidden {p['hidden']}, {p['layers']} layers, vocabulary "
          f"{p['vocab']:,}, block {p['block']}, bf16 weights, head and state, {tokens:,} context positions "
          f"(64 x 2,048), default MemoryLimits; Domino emb_dim 256, GRU 256; DSpark rank 256, confidence head")
    print()
    print(f"{'part':<14}" + "".join(f"{k:>14}" for k in shapes))
    for part in [*dict.fromkeys(k for b in bounds.values() for k in b), "total"]:
        cells = [sum(b.values()) if part == "total" else b.get(part) for b in bounds.values()]
        print(f"{part:<14}" + "".join(f"{'-' if c is None else f'{c / GB:.2f}':>14}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache_arguments(ap)
    ap.add_argument("--rank", type=int, default=None, help="DSpark's Markov rank (default hidden / 16)")
    ap.add_argument("--emb-dim", type=int, default=None, help="Domino's embed_proj width (default hidden / 16)")
    ap.add_argument("--gru-dim", type=int, default=None, help="Domino's GRU width (default hidden / 16)")
    ap.add_argument("--head-scale", type=float, default=0.01,
                    help="the fresh heads' output projections times this (1: as initialised)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--update-docs", action="store_true", help="write the report into docs/performance.md")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    for name in ("rank", "emb_dim", "gru_dim"):
        if getattr(args, name) is None:
            setattr(args, name, max(1, p["hidden"] // 16))
    torch.set_num_threads(1)
    with report_to_docs(args.update_docs, "performance.md", "backbone-heads"):
        side_by_side(args, p)
        real_width(args)


if __name__ == "__main__":
    main()
