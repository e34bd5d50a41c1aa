#!/usr/bin/env python
"""How much the drafter's float32 forward rounds an anchor differently with the shape of the batch it is in.

    OMP_NUM_THREADS=1 python benchmarks/batch_rounding.py [--threads 1]

The toy (a tiny Qwen3 target cached through the real precompute with its top-K log-probs, a drafter trained
briefly) evaluated at stride 1 with every anchor at once, round by round, one block a pass and three blocks a
pass. Prints, per batching against every anchor at once: the anchors whose temperature-1 value differs, the
largest difference, ``t1_tau_estimate``'s relative difference, and whether every integer figure is equal
(docs/metrics.md, "Floats"). The figures are this machine's: another CPU's kernels round otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from figures import is_float_figure  # noqa: E402
from tiny_target import (  # noqa: E402
    TINY_LAYER_IDS,
    TINY_MASK,
    random_prompts,
    save_tiny_qwen3,
    train_briefly,
    write_prompts,
)

from dflash_cb.cache.precompute import PrecomputeArgs, run_precompute  # noqa: E402
from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.costs.evaluation import MemoryLimits  # noqa: E402
from dflash_cb.core.drafters.dflash.model import DFlashDrafter  # noqa: E402
from dflash_cb.core.figures.metrics import T1_TAU_ESTIMATE  # noqa: E402
from dflash_cb.core.replay import engine  # noqa: E402
from dflash_cb.demo.lightning_module import tiny_drafter_config  # noqa: E402

WAYS = {"round by round": dict(draft_all=False), "one block a pass": dict(limits=MemoryLimits(max_blocks=1)),
        "three blocks a pass": dict(limits=MemoryLimits(max_blocks=3, context_bytes=1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = save_tiny_qwen3(root / "target", seed=0)
        prompts = write_prompts(root / "prompts.jsonl", random_prompts(8, (5, 10), seed=1, vocab=120),
                                categories=["code", "chat"])
        run_precompute(PrecomputeArgs(target=str(target), prompts=str(prompts), out=str(root / "cache"),
                                      layers=TINY_LAYER_IDS, reference="local", dtype="float32", max_new_tokens=32,
                                      topk_logprobs=8, progress=False))
        cache = StateCache(root / "cache")
        m = cache.manifest
        torch.manual_seed(0)
        drafter = train_briefly(DFlashDrafter.from_config_dict(tiny_drafter_config(
            m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS, TINY_MASK, block_size=6)), cache)
        seen: list[torch.Tensor] = []
        real = engine.anchor_counts_per_sample

        def keep(*a, **k):  # the per-anchor temperature-1 values the counts are summed from
            seen.append(a[8].clone())
            return real(*a, **k)

        engine.anchor_counts_per_sample = keep

        def run(**kw) -> tuple[torch.Tensor, dict]:
            seen.clear()
            rep = engine.evaluate(cache, drafter, budgets=(4,), anchor_stride=1, **kw)
            return torch.cat(seen), rep.summary

        base, first = run(draft_all=True)
        print(f"{base.numel()} anchors, t1_tau_estimate {first[T1_TAU_ESTIMATE]:.12f}, {args.threads} thread(s), "
              f"CPU kernels {torch.backends.cpu.get_cpu_capability()}")
        for name, kw in WAYS.items():
            values, summary = run(**kw)
            diff = (values - base).abs()
            same = all(summary[k] == first[k] for k in first if not is_float_figure(k) and k != "anchors_drafted")
            rel = abs(summary[T1_TAU_ESTIMATE] - first[T1_TAU_ESTIMATE]) / first[T1_TAU_ESTIMATE]
            print(f"{name:>20}: {int((diff > 0).sum())} anchors differ, at most {diff.max().item():.2e}; "
                  f"t1_tau_estimate relative {rel:.1e}; integer figures equal: {same}")


if __name__ == "__main__":
    main()
