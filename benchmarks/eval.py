#!/usr/bin/env python
"""Evaluation speed: the batched engine side by side with a straightforward per-cycle loop.

    python benchmarks/eval.py                         # CPU: small drafter, ratio engine / per-cycle loop
    python benchmarks/eval.py --preset qwen36-27b --device cuda --samples 64 --tokens 2048

The CPU preset plants completions that follow the drafter for a random number of tokens per cycle
(tau > 1, as with a trained drafter), checks that both paths give identical acceptance_lengths, and
prints the time ratio. The engine also computes the all-anchor and DDTree statistics in its time;
the loop computes only the greedy acceptance lengths. The qwen36-27b preset times a full
evaluation of a random drafter of the Qwen3.6-27B drafter's shape and its extra GPU memory.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import PRESETS, make_drafter, make_head, write_cache  # noqa: E402

from dflash_cb.engine import (  # noqa: E402
    FastRunner,
    apply_head,
    as_runner,
    block_embeddings,
    bounds_for,
    evaluate,
)
from dflash_cb.states import StateCache, TargetHead  # noqa: E402


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
    state = runner.prepare(sample.hidden.to(device=tokens.device, dtype=runner.dtype))
    p = bounds.prompt_len
    out: list[int] = []
    if p >= bounds.known_end or tok_list[p] in stops:
        return out
    with torch.no_grad():
        while p + 1 < bounds.loop_end:
            length = min(spec.block_size, bounds.loop_end - p)
            anc = torch.tensor([p], device=tokens.device)
            emb = block_embeddings(tokens, anc, length, spec, head.embed_tokens).to(runner.dtype)
            hid = runner.hidden(state, emb, anc)[0, 1:].to(head.lm_head.dtype)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="prompt + completion tokens per sample")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--attn-mem-mb", type=int, default=None)
    ap.add_argument("--head-mem-mb", type=int, default=None)
    ap.add_argument("--loop-samples", type=int, default=None,
                    help="run the per-cycle loop on the first N samples only (default: all; 0 = skip)")
    ap.add_argument("--random-completions", action="store_true",
                    help="CPU presets: do not plant completions (tau ~ 1, every anchor is a cycle)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    p = PRESETS[args.preset]
    big = not args.preset.startswith("cpu")
    samples = args.samples or (64 if big else 8)
    tokens = args.tokens or (2048 if big else 384)
    prompt = args.prompt or (256 if big else 64)
    dev = args.device
    dtype = torch.bfloat16 if big else torch.float32
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    attn = (args.attn_mem_mb or (2048 if big else 256)) << 20
    headm = (args.head_mem_mb or (1024 if big else 256)) << 20
    torch.set_grad_enabled(False)
    figures: dict = {"preset": args.preset, "device": dev, "planted": not (big or args.random_completions), "samples": samples, "tokens_per_sample": tokens,
                     "prompt_len": prompt, "budgets": budgets}
    if dev.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name()
    head = make_head(p, 1, dev, dtype)
    drafter = make_drafter(p, 2, dev, dtype)
    tmp = Path(args.cache_dir or tempfile.mkdtemp(prefix="dflash_bench_"))
    t0 = time.perf_counter()
    cache = write_cache(tmp / "cache", p, samples, prompt, tokens, head, dtype=dtype,
                        planted=None if big or args.random_completions else FastRunner(drafter),
                        write_head=not big)
    figures["cache_build_s"] = round(time.perf_counter() - t0, 2)
    autocast = torch.bfloat16 if big and dev.startswith("cuda") else None

    def run_engine():
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        rep = evaluate(cache, drafter, head, budgets=budgets, device=dev, autocast_dtype=autocast,
                       attn_mem_bytes=attn, head_mem_bytes=headm)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        return rep, time.perf_counter() - t

    if dev.startswith("cuda"):
        # Warm-up on two samples (kernels, allocator), then measure the full run.
        evaluate(cache, drafter, head, sample_ids=[s.id for s in cache.samples[:2]], budgets=budgets,
                 device=dev, autocast_dtype=autocast, attn_mem_bytes=attn, head_mem_bytes=headm)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rep, t_engine = run_engine()
    figures["engine_s"] = round(t_engine, 3)
    figures["tau"] = rep.tau
    figures["cycles"] = rep.counts.data["cycles"].item()
    figures["anchors"] = rep.counts.data["anchors"].item()
    if dev.startswith("cuda"):
        figures["extra_gpu_mem_gb"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        figures["resident_gpu_mem_gb (drafter + head)"] = round(base / 2**30, 2)
    n_loop = samples if args.loop_samples is None else args.loop_samples
    if n_loop:
        ids = [s.id for s in cache.samples[:n_loop]]
        if n_loop < samples:  # time the engine on the same subset, side by side
            sub, t_sub = None, time.perf_counter()
            sub = evaluate(cache, drafter, head, sample_ids=ids, budgets=budgets, device=dev,
                           autocast_dtype=autocast, attn_mem_bytes=attn, head_mem_bytes=headm)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            t_sub = time.perf_counter() - t_sub
            engine_lengths = [s.acceptance_lengths for s in sub.samples]
        else:
            t_sub, engine_lengths = t_engine, [s.acceptance_lengths for s in rep.samples]
        t = time.perf_counter()
        loop = [replay_per_cycle(cache, drafter, head, sid) for sid in ids]
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t_loop = time.perf_counter() - t
        figures.update(loop_samples=n_loop, loop_s=round(t_loop, 3), engine_same_samples_s=round(t_sub, 3),
                       speedup=round(t_loop / t_sub, 2), identical_acceptance=loop == engine_lengths)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
