#!/usr/bin/env python
"""A chain drafter's evaluation (the target's MTP head) beside a DFlash drafter's on one cache, and its memory at
the real width.

    OMP_NUM_THREADS=1 python benchmarks/chain.py [--preset cpu] [--reps 3] [--update-docs]

One CPU run, one torch thread. The DFlash drafter is ``_synthetic``'s preset (default ``cpu``: 2 layers, hidden
256, vocabulary 4,096, block 16) reading every layer of a planted synthetic cache (completions that follow its
drafts for a few tokens a cycle); the MTP head (one Qwen3.5 decoder layer of the preset's width, freshly
initialised) reads the cache's last layer. Both drafters score the same cache with the profile a full evaluation
runs (anchor statistics at every anchor: every anchor drafted once, whatever the drafter's tau, so the work is
like for like) and a live run's light one (statistics every 16th anchor; what is drafted then follows each
drafter's own walk, so a weaker drafter drafts more anchors). The table gives the fastest repetition's wall
seconds, the ratio to DFlash's, and the counted work: drafter passes and anchors drafted.

Then ``costs.evaluation.memory_bound`` at the real width: the Qwen3.6-27B DFlash drafter and the target's own MTP
head (hidden 5,120, 24 query and 4 K/V heads of 256, intermediate 17,408, vocabulary 248,320, bf16), for 64
samples of 2,048 context tokens. ``--update-docs`` writes the report into docs/performance.md
(``<!-- table:chain -->``).
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
from dflash_cb.core.drafters.layouts import drafter_from_config  # noqa: E402
from dflash_cb.core.figures.metrics import TAU  # noqa: E402
from dflash_cb.core.replay import evaluate  # noqa: E402

GB = 1e9


def mtp_config(hidden: int, heads: int, kv: int, head_dim: int, inter: int, vocab: int, last: int, k: int,
               n_target: int) -> dict:
    return dict(architectures=["Qwen3_5MTPDrafter"], drafter_family="mtp", model_type="qwen3_5_text",
                vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6, max_position_embeddings=32768,
                num_hidden_layers=1, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                target_layer_ids=[last], num_target_layers=n_target, num_speculative_tokens=k)


def side_by_side(args, p: dict) -> str:
    last = max(p["target_layers"]) + 2
    p = {**p, "target_layers": [*p["target_layers"], last]}  # the DFlash drafter reads them all, the MTP the last
    head = make_head(p, seed=0, device="cpu", dtype=torch.float32)
    dflash = make_drafter(p, seed=0, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    # The synthetic cache's target is max(layers) + 3 deep (``_synthetic``): its features are random either way.
    mtp = drafter_from_config(mtp_config(p["hidden"], p["heads"], p["kv"], p["head_dim"], p["inter"], p["vocab"], last,
                                         3, last + 3)).eval()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp) / "planted", p, args.samples, args.prompt, args.tokens, head,
                            dtype=torch.float32, planted=FastRunner(dflash))
        runs = {f"DFlash, block {p['block']}": (dflash, {}), "MTP, K = 3": (mtp, dict(block_size=4)),
                "MTP, K = 7": (mtp, dict(block_size=8))}
        profiles = {"full (stride 1)": dict(anchor_stride=1), "light (stride 16)": dict(anchor_stride=16)}
        best = fastest(args.reps, profiles, runs, lambda run, options, timer: evaluate(
            cache, run[0], head, budgets=(), timer=timer, **options, **run[1]))
        anchors = sum(e.completion_len - 1 for e in cache.samples)
        lines.append(f"{args.preset}: {args.samples} samples x {args.prompt} + {args.tokens - args.prompt} tokens "
                     f"({anchors} anchors), hidden {p['hidden']}, vocabulary {p['vocab']:,}; DFlash {p['layers']} "
                     f"layers over {len(p['target_layers'])} target layers; MTP one layer over the last; fastest of "
                     f"{args.reps} interleaved repetitions")
        lines.append("")
        lines.append(f"{'profile':<20}{'drafter':<18}{'wall s':>8}{'x DFlash':>10}{'passes':>8}{'drafted':>9}"
                     f"{'tau':>7}")
        for name in profiles:
            base = best[(name, next(iter(runs)))][1]
            for label in runs:
                report, wall, _ = best[(name, label)]
                s = report.summary
                lines.append(f"{name:<20}{label:<18}{wall:>8.3f}{wall / base:>10.2f}{report.passes:>8}"
                             f"{int(s['anchors_drafted']):>9}{s[TAU]:>7.3f}")
    return "\n".join(lines)


def real_width() -> str:
    p = PRESETS["qwen36-27b"]
    dflash = DrafterShape.of(drafter_config(p), p["block"], len(p["target_layers"]) * p["hidden"])
    mtp_cfg = drafter_from_config(mtp_config(5120, 24, 4, 256, 17408, 248320, 63, 3, 64)).config
    mtp = DrafterShape.of(mtp_cfg, 4, 5120)
    lines = ["", "memory at the real width (GB; bf16 weights, head and state; 64 x 2,048 context tokens):",
             f"{'part':<14}{'DFlash b16':>12}{'MTP K=3':>10}"]
    parts = [memory_bound(s, 64 * 2048, weight_itemsize=2, head_itemsize=2, state_itemsize=2) for s in (dflash, mtp)]
    for key in parts[0]:
        lines.append(f"{key:<14}{parts[0][key] / GB:>12.2f}{parts[1].get(key, 0) / GB:>10.2f}")
    lines.append(f"{'total':<14}{sum(parts[0].values()) / GB:>12.2f}{sum(parts[1].values()) / GB:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache_arguments(ap)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    with report_to_docs(args.update_docs, "performance.md", "chain"):
        print(side_by_side(args, PRESETS[args.preset]))
        print(real_width())


if __name__ == "__main__":
    main()
