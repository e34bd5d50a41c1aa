#!/usr/bin/env python
"""SpecForge's own DFlash metric and the exact tau, side by side over one SpecForge training run.

    python tools/demo.py --out demo_out                     # the demo's caches and drafter config, once
    python benchmarks/specforge_curve.py --demo demo_out [--steps 1200 --every 50 --lr 2e-3]

Trains the demo's drafter configuration from scratch with SpecForge 0.2.0's own loop (``TrainerController.fit``
over ``TrainerCore``, ``DFlashTrainStrategy``, ``OnlineDFlashModel``, ``DFlashDraftModel``, its
``FSDPTrainingBackend`` unwrapped on one CPU process and its ``BF16Optimizer``) on the demo's training cache,
with ``dflash_cb.integrations.loops.specforge.attach``. Every ``--every`` optimizer steps SpecForge evaluates on
the demo's eval cache (``eval/simulated_acc_len``: for DFlash, its pooled per-position accuracy) and the
evaluator measures the exact greedy tau on the same eval cache, at the same weights. Prints both series and the
checkpoint each would keep (SpecForge's ``CheckpointManager`` keeps a checkpoint when its metric strictly beats
the best so far: the first of equal bests); the SpecForge run keeps its own default choice on disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.figures.metrics import DEFAULT_PREFIX, TAU  # noqa: E402
from dflash_cb.integrations.loops.specforge import attach  # noqa: E402
from dflash_cb.integrations.loops.specforge_data import sample_features  # noqa: E402

SPECFORGE_METRIC = "eval/simulated_acc_len"  # CheckpointManager's default best_metric


def batches(cache: StateCache, batch_size: int, seed: int) -> list:
    """Shuffled batches of ``batch_size`` samples, padded by SpecForge's own DFlash collator."""
    from specforge.algorithms.common.dflash_family_data import build_collator
    from specforge.runtime.contracts import TrainBatch

    collate = build_collator()
    ids = [e.id for e in cache.samples]
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for start in range(0, len(order) - batch_size + 1, batch_size):
        chosen = [ids[i] for i in order[start:start + batch_size]]
        features = [{k: v[None] for k, v in sample_features(cache, i).items()} for i in chosen]
        out.append(TrainBatch(chosen, "dflash", collate(features)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", required=True, help="a tools/demo.py output folder (cache/train, cache/eval, "
                                                 "drafter_config.json); only read")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=50, help="both evaluations every N optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-anchors", type=int, default=512,
                   help="SpecForge's anchors per sequence (its default, 512: every anchor of these sequences)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--update-docs", action="store_true",
                   help="also write the report into docs/training-loops.md (the specforge-curve-<steps> block)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(args.update_docs, "training-loops.md", f"specforge-curve-{args.steps}"):
        return report(args)


def report(args: argparse.Namespace) -> int:

    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.optimizer import BF16Optimizer
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerController, TrainerCore
    from specforge.training.strategies.base import DFlashTrainStrategy
    from transformers import Qwen3Config

    demo = Path(args.demo)
    train, evaluation = StateCache(demo / "cache" / "train"), StateCache(demo / "cache" / "eval")
    cfg = json.loads((demo / "drafter_config.json").read_text())
    torch.manual_seed(args.seed)
    sf_cfg = Qwen3Config(**cfg)
    sf_cfg._attn_implementation = "sdpa"
    draft = DFlashDraftModel(sf_cfg)
    head = train.load_head()
    lm_head = torch.nn.Linear(head.lm_head.shape[1], head.lm_head.shape[0], bias=False)
    lm_head.weight.data.copy_(head.lm_head)
    lm_head.requires_grad_(False)
    model = OnlineDFlashModel(draft, lm_head, torch.nn.Embedding.from_pretrained(head.embed_tokens.clone()),
                              cfg["dflash_config"]["mask_token_id"], block_size=cfg["block_size"],
                              attention_backend="sdpa", num_anchors=args.num_anchors)
    backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=lambda m: BF16Optimizer(
        m, lr=args.lr, total_steps=args.steps, warmup_ratio=0.0, lr_scheduler="constant"))
    backend.prepare_model(model, wrap=False, optimizer_target=draft)
    eval_data = batches(evaluation, 1, args.seed)
    series: dict[int, dict[str, float]] = {}

    def logger(metrics: dict, step: int) -> None:  # SpecForge's logger(metrics, step): both metrics arrive here
        if SPECFORGE_METRIC in metrics:
            series[step] = {SPECFORGE_METRIC: metrics[SPECFORGE_METRIC], TAU: metrics[DEFAULT_PREFIX + TAU]}

    with tempfile.TemporaryDirectory() as out:
        controller = TrainerController(
            TrainerCore(DFlashTrainStrategy(model), backend), run_id="demo", output_dir=out, max_steps=args.steps,
            num_epochs=10**6, eval_interval=args.every, eval_data_factory=lambda: eval_data, logger=logger,
            log_interval=args.steps)
        attach(controller, evaluation.path, every_n_train_steps=args.every, ddtree_budgets=[], console=False,
               eval_on_fit_start=False, eval_on_fit_end=False)
        started = time.perf_counter()
        controller.fit(batches(train, args.batch_size, args.seed))
        seconds = time.perf_counter() - started
        kept = json.loads((Path(out) / "demo.best_meta.json").read_text())["step"]

    def keeps(metric: str) -> int:
        return max(sorted(series), key=lambda s: series[s][metric])  # the first of equal bests

    print(f"SpecForge 0.2.0 DFlash training, demo drafter from scratch: {args.steps} optimizer steps, batch "
          f"{args.batch_size}, lr {args.lr}; both metrics on the demo's eval cache ({len(evaluation.samples)} "
          f"samples) every {args.every} steps ({seconds:.0f} s, OMP_NUM_THREADS={torch.get_num_threads()})")
    print(f"{'step':>6}  {SPECFORGE_METRIC:>24}  {'exact tau':>10}")
    for step in sorted(series):
        print(f"{step:>6}  {series[step][SPECFORGE_METRIC]:>24.4f}  {series[step][TAU]:>10.3f}")
    steps = sorted(series)
    opposite = [f"{a}->{b}" for a, b in zip(steps, steps[1:], strict=False)
                if (series[b][SPECFORGE_METRIC] - series[a][SPECFORGE_METRIC]) * (series[b][TAU] - series[a][TAU]) < 0]
    print(f"intervals where the two move in opposite directions: {', '.join(opposite) or 'none'}")
    by_acc, by_tau = keeps(SPECFORGE_METRIC), keeps(TAU)
    assert by_acc == kept, (by_acc, kept)  # what SpecForge's own CheckpointManager kept on disk
    print(f"best checkpoint by {SPECFORGE_METRIC} (SpecForge's default): step {by_acc}, whose tau is "
          f"{series[by_acc][TAU]:.3f}")
    print(f"best checkpoint by exact tau (keep_best_by_tau=True): step {by_tau}, tau {series[by_tau][TAU]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
