#!/usr/bin/env python
"""What the live evaluator's evaluations cost in CPU seconds on the toy, and how well the cost model predicts it.

    OMP_NUM_THREADS=1 python benchmarks/eval_cost.py [--rounds 7] [--budgets off,16,64,256,1024] [--update-docs]

The test suite asserts the counted work of these evaluations (``tests/core/test_performance.py``,
``tests/core/test_eval_cost.py``: anchors drafted, passes, heap pops, the cost model's price of them); this script
prints the seconds they take, which a busy machine changes and a test therefore cannot assert:

1. The light evaluation (statistics every block-th anchor, the largest budget, ``draft_all`` as the cost
   model decides) against the full one (stride 1, every budget), at two of the demo's sizes (6 samples of 24
   tokens, 30 of 40), untrained and briefly trained: light / full, which should stay at or below 1.
2. The live evaluator's sequence (a warm-up sample, then light, light, full, full, light), each evaluation's
   seconds predicted from those before it (``cost.SecondsPredictor``) against the measured ones, per DDTree
   budget: predicted / measured, which should stay within 1.5x.

Seconds are this process's CPU seconds (another job takes none of them), the fastest of ``--rounds`` runs taken
round-robin, after one untimed run of each; one torch thread unless ``--threads`` says otherwise.
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
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the toy: a tiny Qwen3 target cached through the real precompute

from tiny_target import TINY_LAYER_IDS, TINY_MASK, build_tiny_cache, train_briefly  # noqa: E402

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.common.timing import PhaseTimer  # noqa: E402
from dflash_cb.core.costs.evaluation import DrafterShape, SecondsPredictor, draft_all_is_cheaper  # noqa: E402
from dflash_cb.core.drafters.dflash.model import DFlashDrafter  # noqa: E402
from dflash_cb.core.figures.metrics import ddtree_tau  # noqa: E402
from dflash_cb.core.replay import evaluate, group_seconds  # noqa: E402
from dflash_cb.demo.lightning_module import tiny_drafter_config  # noqa: E402


def toy_drafter(cache: StateCache, trained: bool) -> DFlashDrafter:
    m = cache.manifest
    cfg = tiny_drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_LAYER_IDS, TINY_MASK,
                              block_size=6)
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(cfg)
    return train_briefly(drafter, cache) if trained else drafter.eval()


def shape_of(drafter: DFlashDrafter) -> DrafterShape:
    spec = drafter.spec
    return DrafterShape.of(drafter.config, spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size)


def cpu_measured(cache: StateCache, drafter: DFlashDrafter, runs: list[dict], rounds: int) -> list[tuple]:
    """Per run (``evaluate`` keyword arguments): its fastest CPU seconds, its seconds per cost group, its report."""
    for kwargs in runs:
        evaluate(cache, drafter, **kwargs)  # a profile's first run pays one-time costs (allocations, new shapes)
    best: list = [None] * len(runs)
    for _ in range(rounds):
        for i, kwargs in enumerate(runs):
            timer = PhaseTimer(clock=time.process_time)
            start = time.process_time()
            report = evaluate(cache, drafter, timer=timer, **kwargs)
            total = time.process_time() - start
            if best[i] is None or total < best[i][0]:
                best[i] = (total, group_seconds(timer.seconds, total), report)
    return best


def light_against_full(caches: dict[str, Path], rounds: int) -> None:
    print("light / full evaluation, CPU seconds (fastest of", rounds, "interleaved runs):")
    budgets = (4, 8)
    for size, root in caches.items():
        cache = StateCache(root)
        for trained in (False, True):
            drafter = toy_drafter(cache, trained)
            block, shape = drafter.spec.block_size, shape_of(drafter)
            everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
            longest = max(cache.samples, key=lambda e: e.valid_len - e.prompt_len).id
            warm = evaluate(cache, drafter, sample_ids=[longest], budgets=budgets[-1:], anchor_stride=1)
            draft_all = draft_all_is_cheaper(shape, everything, warm.tau, budgets[-1:], block,
                                             {budgets[-1]: warm.summary[ddtree_tau(budgets[-1])]})
            (light, _, _), (full, _, _) = cpu_measured(cache, drafter, [
                dict(budgets=budgets[-1:], anchor_stride=block, draft_all=draft_all),
                dict(budgets=budgets, anchor_stride=1, extra_anchor_strides=[block])], rounds)
            print(f"  {size:<11} {'trained' if trained else 'untrained':<9} draft_all={draft_all!s:<5} "
                  f"light {light * 1e3:7.1f} ms  full {full * 1e3:7.1f} ms  light/full {light / full:.2f}")


def predicted_against_measured(root: Path, budget_list: list[int | None], rounds: int) -> None:
    print("predicted / measured seconds along the live evaluator's sequence (1.5x is the promise):")
    cache = StateCache(root)
    drafter = toy_drafter(cache, True)
    block, shape = drafter.spec.block_size, shape_of(drafter)
    everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
    longest = max(cache.samples, key=lambda e: e.valid_len - e.prompt_len).id
    sequence = (("light", block), ("light", block), ("full", 1), ("full", 1), ("light", block))
    for budget in budget_list:
        budgets = () if budget is None else (budget,)
        warm = evaluate(cache, drafter, sample_ids=[longest], budgets=budgets, anchor_stride=1)
        tau, taus, runs = warm.tau, {b: warm.summary[ddtree_tau(b)] for b in budgets}, []
        for _, stride in sequence:  # each evaluation's tau decides the next one's draft_all
            runs.append(dict(budgets=budgets, anchor_stride=stride, tau=tau, taus=taus,
                             draft_all=draft_all_is_cheaper(shape, everything, tau, budgets, stride, taus)))
            report = evaluate(cache, drafter, budgets=budgets, anchor_stride=stride, draft_all=runs[-1]["draft_all"])
            tau, taus = report.tau, {b: report.summary[ddtree_tau(b)] for b in budgets}
        timed = cpu_measured(cache, drafter, [{k: r[k] for k in ("budgets", "anchor_stride", "draft_all")}
                                              for r in runs], rounds)
        predictor, ratios = SecondsPredictor(shape, everything), []
        for (kind, stride), run, (seconds, groups, report) in zip(sequence, runs, timed, strict=True):
            predicted = predictor.predict(kind, budgets, stride, run["tau"], run["taus"], run["draft_all"])
            if predicted is not None:
                ratios.append(f"{kind} {predicted / seconds:.2f}")
            predictor.measured(kind, groups, budgets, stride, report.tau,
                               {b: report.summary[ddtree_tau(b)] for b in budgets}, run["draft_all"],
                               (int(report.counts.data["anchors_drafted"].item()), report.passes))
        print(f"  budget {budget or 'off':<5} " + "  ".join(ratios))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--rounds", type=int, default=7, help="timed runs of each evaluation, round-robin (default 7)")
    p.add_argument("--budgets", default="off,16,64,256,1024", help="DDTree budgets of part 2 ('off': greedy only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--update-docs", action="store_true", help="also write the report into docs/performance.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [None if b == "off" else int(b) for b in args.budgets.split(",") if b]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with tempfile.TemporaryDirectory() as tmp, report_to_docs(args.update_docs, "performance.md", "eval-cost"):
        caches = {"6 samples": build_tiny_cache(Path(tmp) / "six"),
                  "30 samples": build_tiny_cache(Path(tmp) / "thirty", n_prompts=30, max_new_tokens=40)}
        light_against_full(caches, args.rounds)
        predicted_against_measured(caches["6 samples"], budgets, args.rounds)


if __name__ == "__main__":
    main()
