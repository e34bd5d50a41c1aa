#!/usr/bin/env python
"""What DFlashEvalCallback costs a training run, measured in one run.

    python benchmarks/callback.py                 # CPU, synthetic cache (benchmarks/_synthetic.py, "cpu-tiny")
    python benchmarks/callback.py --preset cpu --steps 40 --every 10 --device cuda

1. Step time between evaluations, with vs without the callback: the same seeded training is run
   alternately without and with the callback (A, B, A, B ...); a step's time is the interval between
   two consecutive ``on_train_batch_start`` calls, and intervals that contain an evaluation are left
   out. The ratio of the medians should be 1.0: between evaluations the callback does one modulo.
2. One evaluation inside training vs a bare ``evaluate()`` call on the same drafter weights right
   after the fit, with the head already loaded (what ``benchmarks/eval.py`` measures): the callback keeps the cache index and the
   target head loaded across evaluations, so the two should match. A cold ``evaluate()`` that reads
   the head from disk each time is shown for contrast.
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
from dflash_cb.engine import FastRunner, evaluate  # noqa: E402
from dflash_cb.lightning_module import CachedStatesDataModule, DFlashDrafterModule  # noqa: E402
from dflash_cb.metrics import EVAL_TIME  # noqa: E402


class StepTimer(Callback):
    """Wall time between consecutive batch starts; marks intervals that contained an evaluation."""

    def __init__(self, eval_cb: DFlashEvalCallback | None):
        self.eval_cb = eval_cb
        self.times: list[float] = []
        self.evals: list[int] = []
        self._last: float | None = None
        self._evals_at_last = 0

    def _n_evals(self) -> int:
        return self.eval_cb.num_evals if self.eval_cb is not None else 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
            self.evals.append(self._n_evals() - self._evals_at_last)
        self._last = now
        self._evals_at_last = self._n_evals()


def run_fit(cfg: dict, cache: str, steps: int, device: str,
            callback: DFlashEvalCallback | None) -> tuple[list[float], DFlashDrafterModule]:
    seed_everything(0, verbose=False)
    module = DFlashDrafterModule(cfg, cache, lr=1e-3, anchors_per_sample=16)
    timer = StepTimer(callback)
    trainer = Trainer(max_steps=steps, accelerator=device, devices=1, logger=False,
                      callbacks=[timer] + ([callback] if callback else []), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, CachedStatesDataModule(cache, batch_size=2))
    # Drop the first intervals (warm-up) and every interval with an evaluation in it.
    times = [t for i, (t, e) in enumerate(zip(timer.times, timer.evals, strict=True)) if i >= 3 and e == 0]
    return times, module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(p for p in PRESETS if p.startswith("cpu")), default="cpu-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="training steps per fit")
    ap.add_argument("--every", type=int, default=20, help="every_n_train_steps of the callback")
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs of fits (without/with the callback)")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    dev = args.device
    with tempfile.TemporaryDirectory() as tmp:
        head = make_head(p, 1, dev, torch.float32)
        planted = FastRunner(make_drafter(p, 2, dev, torch.float32))
        cache = write_cache(Path(tmp) / "cache", p, args.samples, args.prompt, args.tokens, head,
                            dtype=torch.float32, planted=planted)
        cfg = drafter_config(p).to_dict()

        # -- 1. step time with and without the callback; 2. evaluation cost, interleaved -----------
        loaded = cache.load_head(device=dev, dtype=torch.float32)
        without, with_cb, eval_times, bare, cold = [], [], [], [], []
        for _ in range(args.rounds):
            without += run_fit(cfg, str(cache.path), args.steps, dev, None)[0]
            cb = DFlashEvalCallback(states=cache.path, every_n_train_steps=args.every, ddtree_budgets=budgets,
                                    eval_on_fit_start=True, eval_on_fit_end=True, autocast_dtype="float32")
            times, module = run_fit(cfg, str(cache.path), args.steps, dev, cb)
            with_cb += times
            eval_times += [h[EVAL_TIME] for h in cb.history[1:]]  # the first one includes loading the head
            # The same weights the callback scored last, with a bare evaluate() (head already loaded) ...
            drafter = module.drafter.eval()
            t = time.perf_counter()
            evaluate(cache, drafter, loaded, budgets=budgets)
            bare.append(time.perf_counter() - t)
            # ... and a cold one that reads and hashes the head file, as a naive per-eval reload would.
            t = time.perf_counter()
            evaluate(cache, drafter, None, budgets=budgets)
            cold.append(time.perf_counter() - t)
        step_ratio = statistics.median(with_cb) / statistics.median(without)
    fig = {
        "preset": args.preset, "device": dev, "samples": args.samples, "tokens_per_sample": args.tokens,
        "steps_per_fit": args.steps, "every_n_train_steps": args.every, "rounds": args.rounds,
        "step_s_without": statistics.median(without), "step_s_with": statistics.median(with_cb),
        "step_ratio_with_over_without": step_ratio, "steps_measured": [len(without), len(with_cb)],
        "eval_s_in_callback": statistics.median(eval_times), "eval_s_bare_evaluate": statistics.median(bare),
        "eval_s_cold_evaluate": statistics.median(cold),
        "eval_ratio_callback_over_bare": statistics.median(eval_times) / statistics.median(bare),
    }
    print(f"preset {args.preset} on {dev}: {args.samples} samples x {args.tokens} tokens, budgets {list(budgets)}")
    print(f"step time between evaluations: without {fig['step_s_without'] * 1e3:.2f} ms, with "
          f"{fig['step_s_with'] * 1e3:.2f} ms  -> ratio {step_ratio:.3f} "
          f"(medians of {len(without)} / {len(with_cb)} steps)")
    print(f"one evaluation: in the callback {fig['eval_s_in_callback']:.3f} s, bare evaluate() "
          f"{fig['eval_s_bare_evaluate']:.3f} s -> ratio {fig['eval_ratio_callback_over_bare']:.3f}; "
          f"cold evaluate() (head read each time) {fig['eval_s_cold_evaluate']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")


if __name__ == "__main__":
    main()
