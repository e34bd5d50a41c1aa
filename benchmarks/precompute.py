#!/usr/bin/env python
"""Benchmark of the precompute path on CPU: a dense Qwen3 and a Qwen3.5 hybrid (3 Gated DeltaNet
layers to 1 full attention, the real layout) of the same width, each in float32 and bfloat16 compute.

Figures, measured side by side in one run (interleaved repetitions, medians; the min is shown too):

0. the CPU probe behind ``--compute-dtype auto``: matmul GFLOP/s per dtype (what the tool prints);
1. wall time of the tool's prefill (hooks + chunked head, states stored in bfloat16) and with
   ``--topk-logprobs 8``, each over a bare Hugging Face forward of the same tokens (target <= 1.10),
   for both models and both compute dtypes; hybrid / dense at equal width; the prefill's effective
   GFLOP/s over the probe's (the efficiency the README's time formula uses);
2. a whole ``--compute-dtype auto`` run vs the same run with the faster fixed dtype (target: within
   5%, and auto picks that dtype);
3. peak RSS of a process that loads the target and precomputes one prompt, minus the RSS of the
   imports alone, over the weights in the compute dtype + one prompt's activations (target <= 1.2),
   each in a fresh subprocess reading VmHWM from /proc/self/status;
4. bytes on disk per token with bfloat16 storage of float32 compute over len(layers) * hidden * 2
   (target <= 1.02).

Usage: python benchmarks/precompute.py [--hidden 512 --num-layers 8 --vocab 32000 --tokens 384 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYER_IDS = [1, 2, 4, 5, 6]  # five layers, like the Qwen3.6-27B drafter's [1, 16, 31, 46, 61]
MODELS = ("dense", "hybrid")
DTYPES = ("float32", "bfloat16")


def vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def build_model(kind: str, folder: Path, a: argparse.Namespace) -> None:
    """A random model saved in bfloat16, like the real checkpoint."""
    torch.manual_seed(0)
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                  num_hidden_layers=a.num_layers, num_attention_heads=a.hidden // 64,
                  num_key_value_heads=max(a.hidden // 128, 1), head_dim=64, max_position_embeddings=4096,
                  tie_word_embeddings=False, eos_token_id=2)
    if kind == "dense":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        # Qwen3.6-27B's proportions: value heads = 2 x key heads, head dim 128 scaled to 64
        layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=a.hidden // 128,
            linear_num_value_heads=a.hidden // 64, layer_types=layer_types * (a.num_layers // 4)))
    model.to(torch.bfloat16).save_pretrained(folder)


def token_ids(a: argparse.Namespace, i: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, a.vocab, (a.tokens + a.completion,), generator=g).tolist()


class Record:  # a prompt record, as compute_sample needs it
    id, category, index = "s0", "bench", 0


def measure(kind: str, folder: str, a: argparse.Namespace) -> None:
    """Subprocess body: do one thing, print peak and current RSS as JSON."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cb.cache.precompute import compute_sample, save_safetensors
    from dflash_cb.cache.target import head_tensors, load_target

    # The baseline includes the code: importing the model class costs ~100 MiB whatever the model size,
    # so every process first builds the model on the meta device (no memory for weights).
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    ids = token_ids(a, 0)
    out: dict = {"kind": kind}
    if kind != "baseline":
        target = load_target(folder, kind)  # kind = the compute dtype
        out["weights"] = sum(p.numel() * p.element_size() for p in target.model.parameters())
        with tempfile.TemporaryDirectory() as d:
            ts, _ = compute_sample(target, Record, ids[: a.tokens], ids[a.tokens:], "length", LAYER_IDS, 0,
                                   "states-00000.safetensors", torch.bfloat16)
            save_safetensors(Path(d) / "s.safetensors", ts)
            del ts
            save_safetensors(Path(d) / "h.safetensors", head_tensors(target, torch.bfloat16)[0])
    out["peak"] = vm("VmHWM")
    print(json.dumps(out))


def run_sub(kind: str, folder: Path, argv: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *argv, "--measure", kind, "--model", str(folder)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def paired(xs: list[float], ys: list[float]) -> float:
    """Median of the per-round ratios: paired rounds cancel the drift of a shared machine."""
    return statistics.median(x / y for x, y in zip(xs, ys, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8, help="a multiple of 4 (the hybrid's 3:1 pattern)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=384, help="prompt tokens")
    p.add_argument("--completion", type=int, default=128, help="completion tokens (from a file reference)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the wall-time figures")
    p.add_argument("--run-prompts", type=int, default=24, help="prompts of the whole runs in figure 2")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: least disturbed by other load; the ratios are what matters)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (models, caches)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--update-docs", action="store_true", help="also write the report into docs/performance.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.measure:
        return measure(a.measure, a.model, a)
    argv = [x for x in sys.argv[1:] if x not in ("--keep", "--update-docs")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(a.update_docs, "performance.md", "precompute"):
        report(a, argv)


def report(a: argparse.Namespace, argv: list[str]) -> None:

    from dflash_cb.cache.precompute import PrecomputeArgs, matmul_gflops, run_precompute
    from dflash_cb.cache.precompute.compute_dtype import activation_bytes
    from dflash_cb.cache.target import DTYPES as TARGET_DTYPES
    from dflash_cb.cache.target import LOGITS_CHUNK, load_target, prefill, read_target_config

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    folders = {m: work / m for m in MODELS}
    for m, folder in folders.items():
        build_model(m, folder, a)
    T = a.tokens + a.completion
    print(f"models: dense Qwen3 and hybrid Qwen3.5 (3 linear : 1 full attention), hidden {a.hidden}, "
          f"{a.num_layers} layers, vocab {a.vocab}, saved in bfloat16; one prompt of {T} tokens; layers "
          f"{LAYER_IDS}; states stored in bfloat16; torch threads {torch.get_num_threads()}; "
          f"{a.repeats} interleaved rounds, median (min)")

    # -- 0. the probe -----------------------------------------------------------------------------------
    t = time.perf_counter()
    probe = {d: matmul_gflops(getattr(torch, d), a.hidden) for d in DTYPES}
    probe_s = time.perf_counter() - t
    print(f"\n(0) CPU probe (--compute-dtype auto), matmul [256, {a.hidden}] x [{a.hidden}, {a.hidden}]: "
          + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in probe.items()) + f"  ({probe_s:.2f} s)")

    # -- 1. wall time -----------------------------------------------------------------------------------
    targets = {(m, d): load_target(folders[m], d) for m in MODELS for d in DTYPES}
    ids = token_ids(a, 0)

    def bare(tg) -> None:
        with torch.inference_mode():
            tg.model(torch.tensor([ids]), use_cache=False)

    def tool(tg) -> None:
        prefill(tg, ids, LAYER_IDS, store_dtype=torch.bfloat16)

    def tool_topk(tg) -> None:
        prefill(tg, ids, LAYER_IDS, topk=8, store_dtype=torch.bfloat16)

    paths = {"bare": bare, "tool": tool, "top8": tool_topk}
    for tg in targets.values():
        tool(tg)  # warm-up
    times = {(k, name): [] for k in targets for name in paths}
    for _ in range(a.repeats):
        for k, tg in targets.items():  # interleaved: drift of a busy machine hits every figure alike
            for name, fn in paths.items():
                t = time.perf_counter()
                fn(tg)
                times[(k, name)].append(time.perf_counter() - t)
    print(f"\n(1) wall time over {T} tokens (target: tool / bare and top-8 / bare <= 1.10); ratios: median of "
          "the per-round ratios (ratio of the minima); GFLOP/s from the fastest round")
    print(f"    {'model':7s} {'compute':9s} {'bare HF s':>16s} {'tool / bare':>14s} {'top-8 / bare':>14s} "
          f"{'top-8 / tool':>13s} {'tool tok/s':>10s} {'GFLOP/s':>8s} {'/ probe':>8s}")
    for (m, d), tg in targets.items():
        b, tl, tk = (times[((m, d), n)] for n in paths)
        flop = 2 * sum(p.numel() for n, p in tg.model.named_parameters() if "embed_tokens" not in n) * T
        eff = flop / min(tl) / 1e9
        print(f"    {m:7s} {d:9s} {med(b):7.3f} ({min(b):6.3f}) {paired(tl, b):6.3f} ({min(tl) / min(b):5.3f}) "
              f"{paired(tk, b):6.3f} ({min(tk) / min(b):5.3f}) {paired(tk, tl):13.3f} {T / med(tl):10.0f} "
              f"{eff:8.1f} {eff / probe[d]:8.2f}")
    for d in DTYPES:
        h, dn = med(times[(("hybrid", d), "tool")]), med(times[(("dense", d), "tool")])
        print(f"    hybrid / dense tool time at equal width, {d}: {h / dn:.2f}")
    for m in MODELS:
        f, b = med(times[((m, "float32"), "tool")]), med(times[((m, "bfloat16"), "tool")])
        print(f"    {m}: bfloat16 / float32 tool time {b / f:.2f} (faster: {'float32' if f < b else 'bfloat16'})")
    del targets

    # -- 2. auto vs the faster fixed dtype, whole runs -----------------------------------------------
    pfile, cfile = work / "prompts.jsonl", work / "completions.jsonl"
    prompts = [token_ids(a, i) for i in range(a.run_prompts)]
    pfile.write_text("".join(json.dumps({"id": f"b{i}", "input_ids": x[: a.tokens]}) + "\n"
                             for i, x in enumerate(prompts)))
    cfile.write_text("".join(json.dumps({"id": f"b{i}", "output_ids": x[a.tokens:]}) + "\n"
                             for i, x in enumerate(prompts)))

    def whole_run(model: str, compute: str, out: Path, topk: int = 0) -> tuple[float, dict]:
        t = time.perf_counter()
        s = run_precompute(PrecomputeArgs(target=str(folders[model]), prompts=str(pfile), out=str(out),
                                          layers=LAYER_IDS, reference="file", completions=str(cfile),
                                          max_new_tokens=a.completion, dtype="bfloat16", compute_dtype=compute,
                                          topk_logprobs=topk, export_head=False, progress=False, overwrite=True))
        return time.perf_counter() - t, s

    faster = min(DTYPES, key=lambda d: med(times[(("hybrid", d), "tool")]))
    runs: dict[str, list[float]] = {"auto": [], faster: []}
    picked = set()
    for _ in range(a.repeats):
        for c in runs:
            sec, s = whole_run("hybrid", c, work / f"run-{c}")
            runs[c].append(sec)
            if c == "auto":
                picked.add(s["compute_dtype"])
    print(f"\n(2) whole run, hybrid, {a.run_prompts} prompts x {T} tokens, --dtype bfloat16 (target: auto within "
          f"5% of the faster fixed dtype, and picks it)")
    print(f"    auto picked {sorted(picked)}; faster fixed dtype in (1): {faster}")
    print(f"    auto {med(runs['auto']):.2f} s ({min(runs['auto']):.2f}), {faster} {med(runs[faster]):.2f} s "
          f"({min(runs[faster]):.2f}): ratio {paired(runs['auto'], runs[faster]):.3f} "
          f"({min(runs['auto']) / min(runs[faster]):.3f}); auto's only extra work, the probe, {probe_s:.2f} s = "
          f"{100 * probe_s / med(runs[faster]):.1f}% of the run")

    # -- 3. peak memory ---------------------------------------------------------------------------------
    print(f"\n(3) peak RSS over the baseline of imports + model code, one prompt of {T} tokens (target <= 1.2)")
    mb = 1 / 2**20
    for m in MODELS:
        baseline = run_sub("baseline", folders[m], argv)
        cfg = read_target_config(folders[m])
        for d in DTYPES:
            r = run_sub(d, folders[m], argv)
            act = activation_bytes(cfg, T, len(LAYER_IDS), TARGET_DTYPES[d].itemsize,
                                   TARGET_DTYPES["bfloat16"].itemsize, LOGITS_CHUNK)
            delta = r["peak"] - baseline["peak"]
            print(f"    {m:7s} {d:9s} weights {r['weights'] * mb:7.1f} MiB + activations {act * mb:6.1f} MiB; "
                  f"tool {delta * mb:7.1f} MiB  ratio {delta / (r['weights'] + act):5.3f}")

    # -- 4. bytes per token -----------------------------------------------------------------------------
    print("\n(4) bytes on disk per token, bfloat16 storage of float32 compute, one sample per shard "
          "(target <= 1.02)")
    ideal = len(LAYER_IDS) * a.hidden * 2
    for k in (0, 8):
        out = work / f"cache-k{k}"
        whole_run("dense", "float32", out, topk=k)
        per_tok = sum(f.stat().st_size for f in out.glob("states-*.safetensors")) / (a.run_prompts * T)
        real = 5 * 5120 * 2  # Qwen3.6-27B: 5 layers x 5120 x bf16
        print(f"    top-k {k}: {per_tok:8.1f} B/token vs {ideal} ideal, ratio {per_tok / ideal:6.4f}  "
              f"(same overhead at Qwen3.6-27B width: ratio {(real + 16 + 12 * k) / real:6.4f})")
    if a.keep:
        print(f"\nwork folder kept: {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
