#!/usr/bin/env python
"""What DFlashEvalCallback costs a training run, measured in one run.

    python benchmarks/callback.py                 # CPU, synthetic cache (benchmarks/_synthetic.py, "cpu-tiny")
    python benchmarks/callback.py --preset cpu --steps 30 --every 10 --device cuda

1. Step time between evaluations, with vs without the callback: the same seeded training is run
   without and then with the callback, ``--rounds`` times (A B, A B, ...); a step's time is the
   interval between two consecutive ``on_train_batch_start`` calls, and intervals that contain an
   evaluation are left out. Between evaluations the callback does one modulo, so the ratio should
   be 1.0; the per-round ratios show how much of any deviation is noise.
2. One evaluation inside training vs a bare ``evaluate()`` on the same weights, the target head
   already loaded (what ``benchmarks/eval.py`` measures), run right after each of the callback's
   evaluations inside the same fit, so that both see the same machine load. The callback keeps the
   cache index and the head loaded across evaluations, so the ratio should be 1.0. A cold
   ``evaluate()`` that reads and hashes the head file on every call is shown for contrast (the
   difference grows with the head: 248,320 x 5,120 for Qwen3.6-27B).

Medians throughout: the figures are meant to survive a shared, busy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import PRESETS, drafter_config, make_drafter, make_head, write_cache  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from dflash_cb import DFlashEvalCallback  # noqa: E402
from dflash_cb.cache.states import StateCache, TargetHead  # noqa: E402
from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402
from dflash_cb.core.figures.metrics import EVAL_TIME  # noqa: E402
from dflash_cb.core.replay import evaluate  # noqa: E402
from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule  # noqa: E402


def _sync(module: torch.nn.Module) -> None:
    if next(module.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


class StepTimer(Callback):
    """Wall time between consecutive batch starts; marks intervals that contained an evaluation."""

    def __init__(self, eval_cb: DFlashEvalCallback | None):
        self.eval_cb = eval_cb
        self.times: list[float] = []
        self.evals: list[int] = []
        self._last: float | None = None
        self._evals_at_last = 0

    def _n_evals(self) -> int:
        return self.eval_cb.evaluator.state.num_evals if self.eval_cb is not None else 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(pl_module)
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
            self.evals.append(self._n_evals() - self._evals_at_last)
        self._last = now
        self._evals_at_last = self._n_evals()


class BareEvaluate(Callback):
    """Right after each of the callback's evaluations: a bare ``evaluate()`` on the same weights."""

    def __init__(self, eval_cb: DFlashEvalCallback, cache: StateCache, head: TargetHead, budgets: tuple[int, ...]):
        self.eval_cb, self.cache, self.head, self.budgets = eval_cb, cache, head, budgets
        self.pairs: list[tuple[float, float]] = []  # (in the callback, bare)
        self._seen = 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        n = self.eval_cb.evaluator.state.num_evals
        if n == self._seen:
            return
        self._seen = n
        if n == 1:  # the first evaluation also loads (and hashes) the head: not a steady-state figure
            return
        drafter = pl_module.drafter
        drafter.eval()
        _sync(drafter)
        t = time.perf_counter()
        evaluate(self.cache, drafter, self.head, budgets=self.budgets)
        _sync(drafter)
        self.pairs.append((self.eval_cb.history[-1][EVAL_TIME], time.perf_counter() - t))
        drafter.train()


def run_fit(cfg: dict, cache: StateCache, steps: int, device: str, callbacks: list,
            timer: StepTimer) -> DFlashDrafterModule:
    seed_everything(0, verbose=False)
    module = DFlashDrafterModule(cfg, str(cache.path), lr=1e-3, anchors_per_sample=16)
    trainer = Trainer(max_steps=steps, accelerator=device, devices=1, logger=False, callbacks=[timer, *callbacks],
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, CachedStatesDataModule(str(cache.path), batch_size=2))
    return module


def steady(timer: StepTimer) -> list[float]:
    """Step intervals without an evaluation in them, after a short warm-up."""
    return [t for i, (t, e) in enumerate(zip(timer.times, timer.evals, strict=True)) if i >= 3 and e == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(p for p in PRESETS if p.startswith("cpu")), default="cpu-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="training steps per fit")
    ap.add_argument("--every", type=int, default=10, help="every_n_train_steps of the callback")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of fits (without, then with the callback)")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--update-docs", action="store_true", help="also write the report into docs/performance.md")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(args.update_docs, "performance.md", "callback"):
        report(args)


def report(args: argparse.Namespace) -> None:
    p = PRESETS[args.preset]
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    dev = args.device
    with tempfile.TemporaryDirectory() as tmp:
        head = make_head(p, 1, dev, torch.float32)
        planted = FastRunner(make_drafter(p, 2, dev, torch.float32))
        cache = write_cache(Path(tmp) / "cache", p, args.samples, args.prompt, args.tokens, head,
                            dtype=torch.float32, planted=planted)
        cfg = drafter_config(p).to_dict()
        loaded = cache.load_head(device=dev, dtype=torch.float32)
        without, with_cb, round_ratios, pairs, cold = [], [], [], [], []
        for _ in range(args.rounds):
            t_a = StepTimer(None)
            run_fit(cfg, cache, args.steps, dev, [], t_a)
            cb = DFlashEvalCallback(states=cache.path, every_n_train_steps=args.every, ddtree_budgets=budgets,
                                    eval_on_fit_start=True, eval_on_fit_end=False, autocast_dtype="float32",
                                    table_samples=0)
            bare = BareEvaluate(cb, cache, loaded, budgets)
            t_b = StepTimer(cb)
            module = run_fit(cfg, cache, args.steps, dev, [cb, bare], t_b)
            a, b = steady(t_a), steady(t_b)
            without += a
            with_cb += b
            round_ratios.append(statistics.median(b) / statistics.median(a))
            pairs += bare.pairs
            drafter = module.drafter.eval()
            t = time.perf_counter()
            evaluate(cache, drafter, None, budgets=budgets)  # reads and hashes the head file
            cold.append(time.perf_counter() - t)
    in_cb = statistics.median(x for x, _ in pairs)
    bare_s = statistics.median(y for _, y in pairs)
    fig = {
        "preset": args.preset, "device": dev, "samples": args.samples, "tokens_per_sample": args.tokens,
        "steps_per_fit": args.steps, "every_n_train_steps": args.every, "rounds": args.rounds,
        "step_s_without": statistics.median(without), "step_s_with": statistics.median(with_cb),
        "step_ratio_with_over_without": statistics.median(with_cb) / statistics.median(without),
        "step_ratio_per_round": round_ratios, "steps_measured": [len(without), len(with_cb)],
        "eval_s_in_callback": in_cb, "eval_s_bare_evaluate": bare_s,
        "eval_ratio_callback_over_bare": statistics.median(x / y for x, y in pairs), "eval_pairs": len(pairs),
        "eval_s_cold_evaluate": statistics.median(cold),
    }
    print(f"preset {args.preset} on {dev}: {args.samples} samples x {args.tokens} tokens, budgets {list(budgets)}, "
          f"{args.rounds} rounds of {args.steps} steps, evaluation every {args.every}")
    print(f"step time between evaluations: without {fig['step_s_without'] * 1e3:.2f} ms, with "
          f"{fig['step_s_with'] * 1e3:.2f} ms -> ratio {fig['step_ratio_with_over_without']:.3f} "
          f"(per round: {', '.join(f'{r:.3f}' for r in round_ratios)}; {len(without)} / {len(with_cb)} steps)")
    print(f"one evaluation: in the callback {in_cb:.3f} s, bare evaluate() right after it {bare_s:.3f} s -> "
          f"ratio {fig['eval_ratio_callback_over_bare']:.3f} over {len(pairs)} pairs; cold evaluate() "
          f"(head read from disk each call) {fig['eval_s_cold_evaluate']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")


if __name__ == "__main__":
    main()
