#!/usr/bin/env python
"""Benchmark of the precompute path on a mid-size random Qwen3 (CPU), three figures side by side:

1. wall time of the tool's per-sample path (hooked prefill + chunked argmax, and + shard write)
   vs a bare Hugging Face forward over the same tokens (target ratio <= 1.15);
2. peak RSS of a process that loads the target and precomputes one prompt, minus the RSS of
   the imports alone, vs loaded weights + one prompt's activations (target <= 1.2x); each
   measurement runs in a fresh subprocess reading VmHWM from /proc/self/status;
3. bytes on disk per token vs len(layer_ids) * hidden * dtype bytes (target <= 1.02x).

Usage: python benchmarks/precompute.py [--hidden 512 --num-layers 8 --vocab 32000 --tokens 512 ...]
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


def vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def build_model(folder: Path, a: argparse.Namespace) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_hidden_layers=a.num_layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=max(a.hidden // 128, 1), head_dim=64,
                      max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=2)
    Qwen3ForCausalLM(cfg).to(getattr(torch, a.dtype)).save_pretrained(folder)


def token_ids(a: argparse.Namespace, i: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, a.vocab, (a.tokens + a.completion,), generator=g).tolist()


def measure(kind: str, folder: str, a: argparse.Namespace) -> None:
    """Subprocess body: do one thing, print peak and current RSS as JSON."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cb.precompute import _save_safetensors, compute_sample
    from dflash_cb.target import head_tensors, load_target

    # The baseline includes the code: importing the model class costs ~100 MiB whatever the model size,
    # so every process first builds the model on the meta device (no memory for weights).
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))

    ids = token_ids(a, 0)
    out: dict = {"kind": kind}
    if kind == "tool":
        target = load_target(folder, a.dtype)
        out["after_load"] = vm("VmRSS")
        out["weights"] = sum(p.numel() * p.element_size() for p in target.model.parameters())

        class R:  # a prompt record
            id, category, index = "s0", "bench", 0

        with tempfile.TemporaryDirectory() as d:
            ts, _ = compute_sample(target, R, ids[: a.tokens], ids[a.tokens:], "length", LAYER_IDS,
                                   a.topk, "states-00000.safetensors")
            _save_safetensors(Path(d) / "s.safetensors", ts)
            del ts
            _save_safetensors(Path(d) / "h.safetensors", head_tensors(target)[0])
    elif kind == "bare":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, a.dtype)).eval()
        out["after_load"] = vm("VmRSS")
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=False)
    out["peak"] = vm("VmHWM")
    print(json.dumps(out))


def run_sub(kind: str, folder: Path, argv: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *argv, "--measure", kind, "--model", str(folder)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens")
    p.add_argument("--completion", type=int, default=128, help="completion tokens (from a file reference)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--topk", type=int, default=0, help="top-K log-probs in the memory/bytes measurements")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: least disturbed by other load; the ratios are what matters)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (model, caches)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.measure:
        return measure(a.measure, a.model, a)
    argv = [x for x in sys.argv[1:] if x != "--keep"]

    from dflash_cb.precompute import PrecomputeArgs, _save_safetensors, compute_sample, run_precompute
    from dflash_cb.target import load_target, prefill

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    folder = work / "model"
    build_model(folder, a)
    T = a.tokens + a.completion
    esize = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    print(f"model: Qwen3 hidden {a.hidden}, {a.num_layers} layers, vocab {a.vocab}, {a.dtype}; "
          f"{a.prompts} prompts x {T} tokens; layers {LAYER_IDS}; torch threads {torch.get_num_threads()}")

    # -- 1. wall time ---------------------------------------------------------------------------------
    target = load_target(folder, a.dtype)
    model = target.model
    prompts = [token_ids(a, i) for i in range(a.prompts)]

    class R:
        id, category, index = "s", "bench", 0

    def bare(ids: list[int]) -> None:
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=False)

    def tool(ids: list[int]) -> None:
        prefill(target, ids, LAYER_IDS)

    def tool_topk(ids: list[int]) -> None:
        prefill(target, ids, LAYER_IDS, topk=8)

    def tool_write(ids: list[int]) -> None:
        ts, _ = compute_sample(target, R, ids[: a.tokens], ids[a.tokens:], "length", LAYER_IDS, 0, "x")
        _save_safetensors(work / "tmp.safetensors", ts)

    paths = {"bare HF forward (full logits)": bare, "tool prefill (hooks + chunked argmax)": tool,
             "tool prefill + shard write (sha256, fsync)": tool_write, "tool prefill, top-8 logprobs": tool_topk}
    for fn in paths.values():
        fn(prompts[0])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(a.repeats):
        for name, fn in paths.items():  # interleaved, so drift of a busy machine hits all paths alike
            t = time.perf_counter()
            for ids in prompts:
                fn(ids)
            times[name].append(time.perf_counter() - t)
    # min over rounds is the least disturbed by other load on the machine; the median is shown too
    base = min(times["bare HF forward (full logits)"])
    base_med = statistics.median(times["bare HF forward (full logits)"])
    print(f"\n(1) wall time over {a.prompts * T} tokens, best (median) of {a.repeats} interleaved rounds")
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        print(f"    {name:45s} {best:7.3f} s ({med:7.3f})  {a.prompts * T / best:7.0f} tok/s  "
              f"ratio {best / base:5.3f} ({med / base_med:5.3f})")

    # -- 2. peak memory -------------------------------------------------------------------------------
    baseline = run_sub("baseline", folder, argv)
    tool_m = run_sub("tool", folder, argv)
    bare_m = run_sub("bare", folder, argv)
    cfg = json.loads((folder / "config.json").read_text())
    H, inter, heads, V = a.hidden, cfg["intermediate_size"], cfg["num_attention_heads"], a.vocab
    # one prompt's activations in the tool's path: a few [T, H] residual/norm tensors, the MLP's three
    # [T, I] tensors, attention probabilities (float32 in SDPA's CPU math path), the captured
    # [T, L*H] buffer and one 256-position logits chunk (model dtype; + a float32 copy with top-k).
    act = (T * (4 * H + 3 * inter) * esize + heads * T * T * 4 + T * len(LAYER_IDS) * H * esize
           + 256 * V * (esize + (4 if a.topk else 0)))
    weights = tool_m["weights"]
    tool_delta = tool_m["peak"] - baseline["peak"]
    bare_delta = bare_m["peak"] - baseline["peak"]
    mb = 1 / 2**20
    print(f"\n(2) peak RSS over the baseline of imports + model code ({baseline['peak'] * mb:.0f} MiB), "
          f"one prompt of {T} tokens")
    print(f"    loaded weights {weights * mb:.1f} MiB + one prompt's activations {act * mb:.1f} MiB "
          f"= {(weights + act) * mb:.1f} MiB")
    print(f"    tool (load_target + prefill + shard + head export) {tool_delta * mb:8.1f} MiB  "
          f"ratio {tool_delta / (weights + act):5.3f}")
    print(f"    bare HF (from_pretrained + forward, full logits)    {bare_delta * mb:8.1f} MiB  "
          f"ratio {bare_delta / (weights + act):5.3f}")

    # -- 3. bytes per token -----------------------------------------------------------------------------
    pfile, cfile = work / "prompts.jsonl", work / "completions.jsonl"
    pfile.write_text("".join(json.dumps({"id": f"b{i}", "input_ids": ids[: a.tokens]}) + "\n"
                             for i, ids in enumerate(prompts)))
    cfile.write_text("".join(json.dumps({"id": f"b{i}", "output_ids": ids[a.tokens:]}) + "\n"
                             for i, ids in enumerate(prompts)))
    print("\n(3) bytes on disk per token (tools/precompute_states.py --reference file, one sample per shard)")
    ideal = len(LAYER_IDS) * H * esize
    for k in sorted({0, a.topk, 8}):
        out = work / f"cache-k{k}"
        run_precompute(PrecomputeArgs(target=str(folder), prompts=str(pfile), out=str(out), layers=LAYER_IDS,
                                      reference="file", completions=str(cfile), max_new_tokens=a.completion,
                                      dtype=a.dtype, topk_logprobs=k, export_head=False, progress=False),
                       log=lambda m: None)
        shard_bytes = sum(f.stat().st_size for f in out.glob("states-*.safetensors"))
        per_tok = shard_bytes / (a.prompts * T)
        real = 5 * 5120 * 2  # Qwen3.6-27B: 5 layers x 5120 x bf16
        real_ratio = (real + 16 + 12 * k) / real
        print(f"    top-k {k}: {per_tok:8.1f} B/token vs {ideal} ideal, ratio {per_tok / ideal:6.4f}  "
              f"(same overhead at Qwen3.6-27B width: ratio {real_ratio:6.4f})")
    if a.keep:
        print(f"\nwork folder kept: {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
