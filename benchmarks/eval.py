#!/usr/bin/env python
"""Evaluation speed: the demand-driven engine side by side with an earlier engine and a per-cycle loop.

    python benchmarks/eval.py                          # CPU: the engine against a per-cycle loop and an earlier engine (preset cpu, 8 x 512, planted)
    python benchmarks/eval.py --preset qwen36-27b --device cuda --samples 64 --tokens 2048   # GPU profiles

CPU presets print one row per setting, each a ratio measured side by side in one run, repeated
``--reps`` times with the two sides interleaved (min and median reported), asserting identical
``acceptance_lengths`` (and DDTree lists) in every repetition:

- greedy only (``budgets=()``, stride 16) vs the per-cycle loop (one drafter call per cycle),
- greedy + DDTree budget 32, stride 16 vs an earlier engine with budget 32,
- full (stride 1, budgets 16,32,64) vs an earlier engine with the same budgets,
- random completions (tau ~ 1), greedy only, stride 16 vs an earlier engine,

each with ``anchors_drafted / anchors_needed``. Both wall and process CPU seconds are recorded (on a
machine shared with other jobs the CPU seconds are the steadier measure); one torch thread by default.
"Today's engine" is the ``dflash_cb`` package of the git revision ``--baseline-ref`` (default
``c7f1746``, an earlier all-anchor engine), extracted with ``git archive`` into a temp folder
as the package ``dflash_cb_baseline`` and imported next to this checkout's package.

The GPU preset (Qwen3.6-27B drafter shape, random weights, bf16) times the callback's three
profiles, greedy only / callback default (stride = block size, the largest budget) / full, with
their extra GPU memory and the TFLOP/s achieved from the anchors drafted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import PRESETS, make_drafter, make_head, write_cache  # noqa: E402

from dflash_cb.cache.states import StateCache, TargetHead  # noqa: E402
from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402
from dflash_cb.core.drafters.proposers import apply_head  # noqa: E402
from dflash_cb.core.drafters.runners import as_runner, block_embeddings  # noqa: E402
from dflash_cb.core.replay import bounds_for, evaluate  # noqa: E402


def replay_per_cycle(cache: StateCache, drafter: torch.nn.Module, head: TargetHead, sample_id: str) -> list[int]:
    """The straightforward loop: one drafter call per cycle, as the reference makes (the baseline)."""
    runner = as_runner(drafter)
    spec = runner.spec
    sample = cache.load(sample_id)
    bounds = bounds_for(sample, cache.manifest)
    tokens = sample.input_ids.to(head.embed_tokens.device)
    tok_list = tokens.tolist()
    stops = set(cache.manifest.stop_token_ids)
    # Context K/V once per sample, as the reference's KV cache holds it; then one call per cycle.
    context = runner.context([sample.hidden.to(device=tokens.device, dtype=runner.dtype)], [sample.hidden.shape[0]])
    p = bounds.prompt_len
    out: list[int] = []
    if p >= bounds.known_end or tok_list[p] in stops:
        return out
    with torch.no_grad():
        while p + 1 < bounds.loop_end:
            length = min(spec.block_size, bounds.loop_end - p)
            anc = torch.tensor([p], device=tokens.device)
            emb = block_embeddings(tokens, anc, length, spec, head.embed_tokens).to(runner.dtype)
            blocks = runner.block_rows(context, emb, anc, torch.zeros_like(anc))
            hid = blocks.rows(torch.zeros(1, dtype=torch.long, device=anc.device),
                              torch.arange(1, length, device=anc.device)).to(head.lm_head.dtype)
            draft = apply_head(hid, head.lm_head, spec, 0).argmax
            a = 0
            while a < length - 1 and p + a + 1 < bounds.known_end and int(draft[a]) == tok_list[p + a + 1]:
                a += 1
            produced = min(a + 1, bounds.loop_end - p - 1)
            stop = next((j for j in range(1, produced + 1) if tok_list[p + j] in stops), None)
            out.append(stop or produced)
            p += stop or produced
            if stop:
                break
    return out


def load_baseline(ref: str):
    """This repository's ``dflash_cb`` at git revision ``ref``, importable as ``dflash_cb_baseline``."""
    tmp = Path(tempfile.mkdtemp(prefix="dflash_baseline_"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "dflash_cb"], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"error: git archive {ref} failed ({archive.stderr.decode().strip()}); pass --baseline-ref REV")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    (tmp / "dflash_cb").rename(tmp / "dflash_cb_baseline")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("dflash_cb_baseline.engine")


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, dev: str):
    """(result, wall seconds, this process's CPU seconds)."""
    _sync(dev)
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    _sync(dev)
    return out, time.perf_counter() - t, time.process_time() - c


def _lists(rep) -> tuple[list, dict]:
    return [s.acceptance_lengths for s in rep.samples], {b: [s.ddtree[b] for s in rep.samples] for b in rep.budgets}


def compare(args, p: dict, drafter, head, tmp: Path) -> dict:
    """The CPU table: each row new vs old, interleaved repetitions, identical lists asserted."""
    base_engine = load_baseline(args.baseline_ref)
    # The old engine must drive the drafter its fast way (our class, weights shared), or its rows flatter us.
    if not isinstance(base_engine.as_runner(drafter), base_engine.FastRunner):
        sys.exit(f"error: the engine at {args.baseline_ref} does not adopt this drafter; pass --baseline-ref REV")
    block = p["block"]
    stride = args.stride or block
    figures: dict = {"rows": {}}
    planted = write_cache(tmp / "planted", p, args.samples, args.prompt, args.tokens, head, dtype=torch.float32,
                          planted=FastRunner(drafter))
    rand = write_cache(tmp / "random", p, args.samples, args.prompt, args.tokens, head, dtype=torch.float32, seed=1)
    # Both engines read this checkout's cache format (the old engine only uses load / manifest / samples).
    caches = {"planted": planted, "random": rand}

    def new(cache_kind, budgets, anchor_stride):
        return lambda: evaluate(caches[cache_kind], drafter, head, budgets=budgets, anchor_stride=anchor_stride)

    def old(cache_kind, budgets):
        return lambda: base_engine.evaluate(caches[cache_kind], drafter, head, budgets=budgets)

    def loop(cache_kind):
        c = caches[cache_kind]
        return lambda: [replay_per_cycle(c, drafter, head, s.id) for s in c.samples]

    rows = {
        f"greedy only (budgets=(), stride {stride}) vs per-cycle loop": (new("planted", (), stride), loop("planted"), False),
        f"greedy + DDTree 32, stride {stride} vs an earlier engine (budget 32)":
            (new("planted", (32,), stride), old("planted", (32,)), True),
        "full (stride 1, budgets 16,32,64) vs an earlier engine":
            (new("planted", (16, 32, 64), 1), old("planted", (16, 32, 64)), True),
        f"random completions (tau ~1), greedy only, stride {stride} vs an earlier engine":
            (new("random", (), stride), old("random", ()), True),
    }
    # name -> {"wall" | "cpu": ([new seconds], [other seconds])}
    times: dict[str, dict[str, tuple[list[float], list[float]]]] = {k: {"wall": ([], []), "cpu": ([], [])}
                                                                     for k in rows}
    every = {kind: sum(len(bounds_for(c.load(s.id), c.manifest).anchors) for s in c.samples)
             for kind, c in caches.items()}
    total = {name: every["random" if "random" in name else "planted"] for name in rows}
    for rep in range(args.reps):
        for name, (fn_new, fn_other, is_engine) in rows.items():
            # Alternate which side goes first, so a neighbour's load hits both alike.
            order = [("new", fn_new), ("other", fn_other)]
            if rep % 2:
                order.reverse()
            got = {}
            for side, fn in order:
                got[side], wall, cpu = timed(fn, args.device)
                times[name]["wall"][0 if side == "new" else 1].append(wall)
                times[name]["cpu"][0 if side == "new" else 1].append(cpu)
            new_rep = got["new"]
            if is_engine:
                assert _lists(new_rep)[0] == _lists(got["other"])[0], f"{name}: acceptance_lengths differ"
                assert _lists(new_rep)[1] == _lists(got["other"])[1], f"{name}: DDTree lists differ"
            else:
                assert _lists(new_rep)[0] == got["other"], f"{name}: acceptance_lengths differ from the loop"
            d = new_rep.counts.data
            figures["rows"][name] = {"tau": round(new_rep.tau, 3), "anchors_drafted": int(d["anchors_drafted"].item()),
                                     "anchors_needed": int(d["anchors_needed"].item()),
                                     "anchors_total": total[name]}
    for name, kinds in times.items():
        r = figures["rows"][name]
        r.update(drafted_over_needed=round(r["anchors_drafted"] / max(r["anchors_needed"], 1), 3),
                 identical_acceptance=True)
        for kind, (tn, to) in kinds.items():
            speed = [o / n for n, o in zip(tn, to, strict=True)]
            r[kind] = {"new_s": [round(x, 3) for x in tn], "other_s": [round(x, 3) for x in to],
                       "speedup_min": round(min(speed), 2), "speedup_median": round(statistics.median(speed), 2)}
    return figures


def flops_per_anchor(p: dict, context: float) -> float:
    """Forward FLOPs of one block (linear layers, attention at mean context ``context``, the head)."""
    h, n, inter = p["hidden"], p["block"], p["inter"]
    q, kv = p["heads"] * p["head_dim"], p["kv"] * p["head_dim"]
    linear = p["layers"] * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    attn = p["layers"] * 2 * p["heads"] * p["head_dim"] * (context + n)
    return 2 * n * (linear + attn) + 2 * (n - 1) * p["vocab"] * h


def profiles(args, p: dict, drafter, head, tmp: Path) -> dict:
    """The callback's three profiles on one cache: wall time, extra GPU memory, achieved TFLOP/s."""
    dev = args.device
    big = not args.preset.startswith("cpu")
    dtype = args.torch_dtype
    cache = write_cache(tmp / "cache", p, args.samples, args.prompt, args.tokens, head, dtype=dtype,
                        planted=FastRunner(drafter), write_head=not big)
    autocast = torch.bfloat16 if dtype == torch.bfloat16 and dev.startswith("cuda") else None
    block = p["block"]
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    settings = {"greedy only": ((), block), "callback default": ((max(budgets),), block), "full": (budgets, 1)}
    out: dict = {}
    # Warm-up (kernels, allocator) on two samples.
    evaluate(cache, drafter, head, sample_ids=[s.id for s in cache.samples[:2]], budgets=budgets, device=dev,
             autocast_dtype=autocast)
    for name, (b, stride) in settings.items():
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rep, t, _ = timed(lambda b=b, stride=stride: evaluate(cache, drafter, head, budgets=b, anchor_stride=stride,
                                                           device=dev, autocast_dtype=autocast), dev)
        d = rep.counts.data
        drafted = d["anchors_drafted"].item()
        row = {"wall_s": round(t, 3), "tau": round(rep.tau, 3), "anchors_drafted": int(drafted),
               "anchors_needed": int(d["anchors_needed"].item()),
               "tflops": round(drafted * flops_per_anchor(p, (args.tokens + args.prompt) / 2) / t / 1e12, 2)}
        if dev.startswith("cuda"):
            row["extra_gpu_mem_gb"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="prompt + completion tokens per sample")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample")
    ap.add_argument("--budgets", default="16,32,64", help="the full profile's DDTree budgets")
    ap.add_argument("--stride", type=int, default=None, help="light anchor stride (default: block size)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per row")
    ap.add_argument("--profiles", action="store_true", help="time the three callback profiles (default on GPU presets)")
    ap.add_argument("--baseline-ref", default="c7f1746",
                    help="git revision whose engine is 'an earlier engine' (default: an earlier all-anchor engine)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="drafter, head and cache dtype (default: bfloat16 for qwen36-27b, float32 for cpu presets)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared machine one thread gives steadier ratios)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    p = PRESETS[args.preset]
    big = not args.preset.startswith("cpu")
    args.samples = args.samples or (64 if big else 8)
    args.tokens = args.tokens or (2048 if big else 512)
    args.prompt = args.prompt or (256 if big else 64)
    dtype = torch.bfloat16 if (args.dtype or ("bfloat16" if big else "float32")) == "bfloat16" else torch.float32
    args.torch_dtype = dtype
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    figures: dict = {"preset": args.preset, "device": args.device, "samples": args.samples,
                     "tokens_per_sample": args.tokens, "prompt_len": args.prompt, "threads": torch.get_num_threads(),
                     "dtype": str(dtype)}
    if args.device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name()
    head = make_head(p, 1, args.device, dtype)
    drafter = make_drafter(p, 2, args.device, dtype)
    tmp = Path(args.cache_dir or tempfile.mkdtemp(prefix="dflash_bench_"))
    if big or args.profiles:
        figures["profiles"] = profiles(args, p, drafter, head, tmp)
    else:
        figures.update(compare(args, p, drafter, head, tmp))
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
