#!/usr/bin/env python
"""The exact evaluation beside SpecForge 0.2.0's accuracy pass, in one run, on the same cache and drafter.

    python benchmarks/vs_specforge.py                         # the demo's training cache and trained drafter
    python benchmarks/vs_specforge.py --cache eval --reps 7   # its 30-sample eval cache
    python benchmarks/vs_specforge.py --states DIR --drafter DIR --budgets 16,32,64 --device cuda

Four passes over the same samples, repeated ``--reps`` times with the four interleaved (min and median):

- **SpecForge**: SpecForge 0.2.0's own evaluation pass, its ``Evaluator`` over prebuilt batches (one per
  sample: ``integrations.specforge_data.train_batches``, on the device) with our drafter's weights in its
  ``DFlashDraftModel`` and every anchor drafted (``num_anchors`` at least the longest sample, as
  ``tests/core/test_specforge_oracle.py``). It computes its accuracy only. Model and batches are built before
  the clock starts.
- **greedy, stride 1**: what ``tools/eval_drafter.py --ddtree-budgets '' --anchor-stride 1`` does once the
  drafter is loaded: ``engine.evaluate`` (reading the samples and the head from the cache), the exact greedy
  tau and every anchor statistic at every anchor, the intervals and breakdowns (``results.report_to_results``)
  and results.json written. By anchors drafted it does SpecForge's drafter work (one block per anchor).
- **light**: the live evaluator's periodic evaluation: statistics every ``--light-stride`` anchors (default:
  the block size), the largest ``--budgets``, and its intervals (``figures.derived.live_metrics``); whether it drafts
  every anchor at once is decided as the evaluator decides it (``cost.draft_all_is_cheaper``, from the taus of
  the evaluation before it: here one full evaluation before the clock starts).
- **full**: its full evaluation: stride 1 and every budget, with the light stride's statistics from the same
  pass (``extra_anchor_strides``) and the intervals of both.

Printed: seconds (wall; process CPU beside it, the steadier figure on a shared machine), the ratio of each
pass to SpecForge's, and where each pass's time goes (``engine.PHASES``, then the intervals and the write),
from cheap timers in the engine (``common.timing.PhaseTimer``), not a profiler. On CUDA the same passes run
on the GPU (every phase waits for its kernels), and absolute times matter as much as the ratios.

``--package DIR`` benchmarks the ``dflash_cb`` found in DIR instead of this checkout's (e.g. an older
revision: ``git archive REV dflash_cb | tar -x -C DIR``); a revision without phase timers shows totals only.
One torch thread by default (``--threads``): on a shared machine more threads wait on each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("SpecForge", "greedy, stride 1", "light", "full")
AFTER_ENGINE = ("bootstrap", "writing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", default="demo_out", help="a finished tools/demo.py output folder (default demo_out)")
    p.add_argument("--cache", choices=("train", "eval"), default="train", help="which of the demo's caches")
    p.add_argument("--states", default=None, help="another cache folder (overrides --demo/--cache)")
    p.add_argument("--drafter", default=None, help="another drafter folder (default: the demo's trained drafter)")
    p.add_argument("--budgets", default="16,32", help="DDTree budgets of the full profile (default: the demo's)")
    p.add_argument("--light-stride", type=int, default=None, help="light profile's stride (default: block size)")
    p.add_argument("--reps", type=int, default=5, help="repetitions, the four passes interleaved (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--package", default=None, help="benchmark the dflash_cb package found in this folder")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--update-docs", action="store_true",
                   help="also write the report into docs/performance.md (the vs-specforge-<cache> block)")
    return p.parse_args(argv)


def _sync(device: Any) -> Callable[[], None] | None:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else None


def specforge_pass(cache: Any, drafter: Any, device: Any) -> Callable[[], dict[str, float]]:
    """SpecForge's evaluation pass, ready to run: its model and batches are built here, outside the clock."""
    from specforge.eval.evaluator import Evaluator
    from specforge.training.strategies.base import DFlashTrainStrategy
    from specforge_objective import dflash_objective

    from dflash_cb.integrations.loops.specforge_data import train_batches

    longest = max(e.total_len for e in cache.samples)
    model = dflash_objective(drafter.config.to_dict(), drafter.state_dict(), cache.load_head(), longest).to(device)
    batches = train_batches(cache)
    for b in batches:
        b.tensors = {k: v.to(device) for k, v in b.tensors.items()}
    strategy = DFlashTrainStrategy(model)
    return lambda: Evaluator().run(strategy.forward_loss, batches)


class Ours:
    """The three dflash-cb passes, on whichever ``dflash_cb`` was imported."""

    def __init__(self, cache: Any, drafter: Any, device: Any, budgets: tuple[int, ...], light_stride: int,
                 out: Path):
        from dflash_cb.core.replay import engine

        self.cache, self.drafter, self.device, self.out = cache, drafter, device, out
        self.budgets, self.light_stride = budgets, light_stride
        self.engine = engine
        params = set(inspect.signature(engine.evaluate).parameters)
        request = getattr(engine, "EvalRequest", None)  # evaluate's options are its fields (``**options``)
        if request is not None:
            params |= {f.name for f in dataclasses.fields(request)}
        self.timed, self.extra = "timer" in params, "extra_anchor_strides" in params
        self.light_kw: dict[str, Any] = {}
        if "draft_all" in params:  # decided as the live evaluator does, from the taus it last measured
            from dflash_cb.core.costs.evaluation import DrafterShape, draft_all_is_cheaper
            from dflash_cb.core.figures.metrics import ddtree_tau

            spec = drafter.spec
            shape = DrafterShape.of(drafter.config, spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size)
            last = engine.evaluate(cache, drafter, None, device=device, budgets=budgets, anchor_stride=1)
            samples = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
            self.light_kw["draft_all"] = draft_all_is_cheaper(
                shape, samples, last.tau, budgets[-1:], light_stride, {b: last.summary[ddtree_tau(b)] for b in budgets},
                state_itemsize=drafter.fc.weight.element_size())

    def _timer(self) -> Any:
        if not self.timed:
            return None
        from dflash_cb.common.timing import PhaseTimer

        return PhaseTimer(sync=_sync(self.device))

    def _evaluate(self, timer: Any, **kw: Any) -> Any:
        if timer is not None:
            kw["timer"] = timer
        return self.engine.evaluate(self.cache, self.drafter, None, device=self.device, **kw)

    @staticmethod
    def _phase(timer: Any, name: str) -> Any:
        import contextlib

        return timer.phase(name) if timer is not None else contextlib.nullcontext()

    def greedy(self) -> tuple[Any, Any]:
        from dflash_cb.core.results.results_file import report_to_results, write_results

        timer = self._timer()
        report = self._evaluate(timer, budgets=(), anchor_stride=1)
        with self._phase(timer, "bootstrap"):
            results = report_to_results(report, self.cache, meta={"benchmark": "vs_specforge"})
        with self._phase(timer, "writing"):
            write_results(results, self.out / "results.json")
        return report, timer

    def light(self) -> tuple[Any, Any]:
        from dflash_cb.core.figures.derived import live_metrics

        timer = self._timer()
        budgets = self.budgets[-1:]
        report = self._evaluate(timer, budgets=budgets, anchor_stride=self.light_stride, **self.light_kw)
        with self._phase(timer, "bootstrap"):
            live_metrics(report.samples, budgets, self.cache.categories, anchor_stride=self.light_stride)
        return report, timer

    def full(self) -> tuple[Any, Any]:
        from dflash_cb.core.figures.derived import live_metrics
        from dflash_cb.core.figures.metrics import summarize

        timer = self._timer()
        kw = {"extra_anchor_strides": [self.light_stride]} if self.extra else {}
        report = self._evaluate(timer, budgets=self.budgets, anchor_stride=1, **kw)
        with self._phase(timer, "bootstrap"):
            if self.extra:
                summarize(report.counts_at(self.light_stride))
            live_metrics(report.samples, self.budgets[-1:], self.cache.categories,
                         anchor_stride=self.light_stride if self.extra else None)
            live_metrics(report.samples, self.budgets, self.cache.categories, anchor_stride=1 if self.extra else None)
        return report, timer


def clocked(fn: Callable[[], Any], sync: Callable[[], None] | None) -> tuple[Any, float, float]:
    """(result, wall seconds, this process's CPU seconds)."""
    if sync is not None:
        sync()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    if sync is not None:
        sync()
    return out, time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    name = "vs-specforge-" + ("other" if args.states else args.cache)
    with report_to_docs(args.update_docs and not args.package, "performance.md", name):
        return report(args)


def report(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(args.package).resolve() if args.package else ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "support"))  # SpecForge's own objective: tests/support/specforge_objective.py
    import torch

    import dflash_cb
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.checkpoints.load import load_drafter

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    demo = Path(args.demo)
    states = Path(args.states) if args.states else demo / "cache" / args.cache
    drafter_path = Path(args.drafter) if args.drafter else demo / "drafter"
    for what, path in (("cache", states / "manifest.json"), ("drafter", drafter_path / "config.json")):
        if not path.is_file():
            sys.exit(f"error: no {what} at {path.parent}; run tools/demo.py --out {demo} first, or pass "
                     f"--{'states' if what == 'cache' else 'drafter'}")
    budgets = tuple(sorted({int(b) for b in args.budgets.split(",") if b.strip()}))
    cache = StateCache(states)
    drafter = load_drafter(str(drafter_path), device=device).eval()
    light_stride = args.light_stride or drafter.spec.block_size
    sync = _sync(device)
    out = Path(tempfile.mkdtemp(prefix="vs_specforge_"))
    ours = Ours(cache, drafter, device, budgets, light_stride, out)
    runs: dict[str, Callable[[], Any]] = {"SpecForge": specforge_pass(cache, drafter, device),
                                          "greedy, stride 1": ours.greedy, "light": ours.light, "full": ours.full}
    wall: dict[str, list[float]] = {k: [] for k in SIDES}
    cpu: dict[str, list[float]] = {k: [] for k in SIDES}
    phases: dict[str, dict[str, float]] = {}
    checks: dict[str, Any] = {}
    print(f"dflash_cb {Path(dflash_cb.__file__).parent}  device {device}  threads {torch.get_num_threads()}  "
          f"cache {states} ({len(cache.samples)} samples)  block {drafter.spec.block_size}  light: stride "
          f"{light_stride}, budget {budgets[-1:]}"
          + (f", every anchor at once: {ours.light_kw['draft_all']}" if ours.light_kw else "")
          + f"  full: stride 1, budgets {list(budgets)}", flush=True)
    with torch.no_grad():
        runs["SpecForge"]()  # warm-up: first calls allocate and pick kernels
        ours.greedy()
        for _ in range(args.reps):
            for side in SIDES:
                result, w, c = clocked(runs[side], sync)
                if side != "SpecForge":
                    report, timer = result
                    if timer is not None and (not wall[side] or w < min(wall[side])):
                        phases[side] = dict(timer.seconds)
                    if side == "greedy, stride 1":
                        checks["ours"] = report.summary["specforge/acc"]
                else:
                    checks["SpecForge"] = result["eval/avg_acc"]
                wall[side].append(w)
                cpu[side].append(c)
    base_w, base_c = min(wall["SpecForge"]), min(cpu["SpecForge"])
    print(f"\nspecforge/acc: ours {checks['ours']:.6f}, SpecForge's eval/avg_acc {checks['SpecForge']:.6f}"
          + ("" if abs(checks["ours"] - checks["SpecForge"]) < 1e-9 else "  (DIFFERENT)"))
    print(f"\n{'pass':<18} {'wall min':>9} {'median':>8} {'CPU min':>8} {'x SpecForge (wall)':>19} "
          f"{'(CPU)':>6}")
    for side in SIDES:
        print(f"{side:<18} {min(wall[side]):>9.3f} {statistics.median(wall[side]):>8.3f} {min(cpu[side]):>8.3f} "
              f"{min(wall[side]) / base_w:>19.2f} {min(cpu[side]) / base_c:>6.2f}")
    if phases:
        names = list(dict.fromkeys(n for side in SIDES[1:] for n in phases.get(side, {})))
        ordered = [n for n in names if n not in AFTER_ENGINE] + [n for n in AFTER_ENGINE if n in names]
        print("\nwhere the time goes (wall seconds, fastest repetition; engine phases exclusive):")
        print(f"{'phase':<18}" + "".join(f"{s:>18}" for s in SIDES[1:]))
        for n in ordered:
            print(f"{n:<18}" + "".join(f"{phases.get(s, {}).get(n, 0.0):>18.4f}" for s in SIDES[1:]))
        print(f"{'(untimed rest)':<18}" + "".join(
            f"{min(wall[s]) - sum(phases.get(s, {}).values()):>18.4f}" for s in SIDES[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": str(device), "threads": torch.get_num_threads(), "cache": str(states), "reps": args.reps,
            "wall": wall, "cpu": cpu, "phases": phases, "specforge_acc": checks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
