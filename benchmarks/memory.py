#!/usr/bin/env python
"""Memory at the real width: peak RSS of setup, a greedy evaluation and a DDTree evaluation against
the engine's memory model (``dflash_cb.core.costs.evaluation.memory_bound``, stated in ``engine.evaluate``).

    python benchmarks/memory.py                     # CPU defaults: 1 sample of 8 + 8 tokens, bf16
    python benchmarks/memory.py --samples 16 --prompt 128 --completion 128 --device cuda   # a GPU box

Real hidden size (5,120), real vocabulary (248,320), one drafter layer of the Qwen3.6-27B shape, a
random drafter (tau ~ 1: every anchor is a walk anchor, the case that stresses the greedy head) and
a tied bf16 head (2.5 GB; an untied head is twice that, see the model). The cache is built once in
``--dir`` (default /tmp/dflash_cb_membench). Each case runs in a fresh process, which reports:

- ``VmHWM``: the kernel's peak resident set, checked against the bound. It includes the touched
  file pages of the memory-mapped shards and head: a head stored in the compute dtype is used in
  place, straight from the page cache, so it shows here and not as an allocation;
- peak anonymous RSS (``RssAnon`` sampled every 5 ms): the process's own allocations.

Both are given above the process's own figure after imports (torch itself).

On CPU the bf16 head matmul runs at about 1 GFLOP/s on a shared box (2.5 GFLOP a row at this
vocabulary), so the defaults keep the rows few; the bounded buffers (head logits, activations) are
then far from full, and the table shows which part of the model each case reached.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """Peak RssAnon, sampled in a thread (the kernel keeps no peak of the anonymous part alone)."""

    def __init__(self, every: float = 0.005):
        self.peak, self.every, self._stop = 0, every, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(self.every)

    def __enter__(self) -> AnonPeak:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _status("RssAnon"))


def preset(layers: int) -> dict:
    from _synthetic import PRESETS

    return {**PRESETS["qwen36-27b"], "layers": layers}


def build(folder: Path, p: dict, samples: int, prompt: int, completion: int) -> None:
    """Random bf16 features and tokens, then a tied bf16 head written row chunk by row chunk."""
    import torch
    from _synthetic import write_cache
    from safetensors.torch import save_file

    from dflash_cb.cache.integrity import sha256_file
    from dflash_cb.cache.manifest import HEAD_NAME, Manifest
    from dflash_cb.cache.states import TargetHead

    marker = folder / "built.json"
    want = {"samples": samples, "prompt": prompt, "completion": completion, "layers": p["layers"]}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return
    dummy = TargetHead(torch.zeros(1, 1), torch.zeros(1, 1))
    write_cache(folder, p, samples, prompt, prompt + completion, dummy, write_head=False)
    g = torch.Generator().manual_seed(0)
    embed = torch.empty(p["vocab"], p["hidden"], dtype=torch.bfloat16)
    for i in range(0, p["vocab"], 8192):  # no float32 copy of the whole matrix
        embed[i:i + 8192] = torch.randn(min(8192, p["vocab"] - i), p["hidden"], generator=g) * 0.02
    save_file({"embed_tokens.weight": embed}, str(folder / HEAD_NAME))
    del embed
    m = Manifest.from_dict(json.loads((folder / "manifest.json").read_text()))
    m.target_head = {"file": HEAD_NAME, "sha256": sha256_file(folder / HEAD_NAME), "tied": True,
                     "vocab_size": p["vocab"], "hidden_size": p["hidden"], "dtype": "bfloat16"}
    m.write(folder)
    marker.write_text(json.dumps(want))


def run_case(case: str, folder: Path, p: dict, device: str) -> dict:
    """One case in this process: the figures it measured and the model's bound for it."""
    import torch
    from _synthetic import drafter_config

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.costs.evaluation import DrafterShape, memory_bound
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    torch.set_num_threads(2)
    base, anon_base = _status("VmRSS"), _status("RssAnon")
    cache = StateCache(folder)
    spec_tokens = sum(e.total_len for e in cache.samples)
    with AnonPeak() as anon:
        t0 = time.perf_counter()
        if case == "setup":
            cache.check_files()
            cache.verify()
            cache.check_samples()
            head = cache.load_head(device=device, dtype=torch.bfloat16, verify=True)
            drafter = None
        else:
            head = cache.load_head(device=device, dtype=torch.bfloat16, verify=False)
            torch.manual_seed(0)
            torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of the weights first
            with torch.device(device):
                drafter = DFlashDrafter(drafter_config(p)).eval()
            torch.set_default_dtype(torch.float32)
            budgets = () if case == "greedy" else (16,)
            rep = evaluate(cache, drafter, head, budgets=budgets, anchor_stride=p["block"], device=device)
        seconds = time.perf_counter() - t0
    cfg = drafter_config(p)
    shape = DrafterShape.of(cfg, p["block"], len(p["target_layers"]) * p["hidden"])
    parts = memory_bound(shape, spec_tokens, weight_itemsize=2, head_itemsize=2, state_itemsize=2, tied=True)
    if case == "setup":
        # The head, one 16 MiB hashing buffer, one sample's small tensors.
        parts = {"head": parts["head"], "hash buffer": 16 << 20}
    out = {"case": case, "seconds": seconds, "hwm": _status("VmHWM") - base, "anon": anon.peak - anon_base,
           "bound": sum(parts.values()), "parts": parts}
    if drafter is not None:
        out["tau"] = rep.tau
        out["anchors_drafted"] = int(rep.counts.data["anchors_drafted"].sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/dflash_cb_membench")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--completion", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default="setup,greedy,ddtree")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child process: run this one case
    ap.add_argument("--update-docs", action="store_true", help="also write the report into docs/performance.md")
    args = ap.parse_args()
    folder = Path(args.dir)
    p = preset(args.layers)
    if args.case:
        print(json.dumps(run_case(args.case, folder, p, args.device)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _docs import report_to_docs

    with report_to_docs(args.update_docs, "performance.md", "memory"):
        report(args, folder, p)


def report(args: argparse.Namespace, folder: Path, p: dict) -> None:
    build(folder, p, args.samples, args.prompt, args.completion)
    rows = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--dir", str(folder), "--layers", str(args.layers), "--device",
               args.device, "--case", case]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        tau = f", tau {r['tau']:.2f}, {r['anchors_drafted']} anchors" if "tau" in r else ""
        print(f"{case:<7} peak anon {r['anon'] / GB:5.2f} GB  VmHWM {r['hwm'] / GB:5.2f} GB  bound "
              f"{r['bound'] / GB:5.2f} GB  ({r['seconds']:.0f} s{tau})", flush=True)
    print(f"\n{args.samples} sample(s) x {args.prompt} + {args.completion} tokens, hidden 5120, vocab 248,320, "
          f"{args.layers} drafter layer(s), tied bf16 head; peaks above the RSS after imports")
    print("| case | peak anon RSS (GB) | VmHWM (GB) | model bound (GB) | within | parts of the bound (GB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in r["parts"].items())
        print(f"| {r['case']} | {r['anon'] / GB:.2f} | {r['hwm'] / GB:.2f} | {r['bound'] / GB:.2f} | "
              f"{'yes' if r['hwm'] <= r['bound'] else 'NO'} | {parts} |")


if __name__ == "__main__":
    main()
