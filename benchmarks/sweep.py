#!/usr/bin/env python
"""A run's checkpoints scored one sweep against one extract + eval_drafter pair per checkpoint, side by side.

    OMP_NUM_THREADS=1 python benchmarks/sweep.py --checkpoints 8 --sizes 4x256,8x512 --repeats 2 [--update-docs]

Per size (samples x tokens per sample), a synthetic cache (preset ``cpu``: hidden 256, vocabulary 4,096,
completions planted to follow a drafter) and ``--checkpoints`` plain-loop checkpoints (``torch.save({"step",
"drafter"})``) whose weights move towards that drafter, step by step. Then, each as a user runs it in its own
process, with ``--threads 1``: for every checkpoint ``tools/extract_drafter.py`` and ``tools/eval_drafter.py`` on
the folder it writes; and one ``tools/sweep_checkpoints.py`` over the folder. Prints the wall time of both ways,
their ratio and what the sweep saves per checkpoint (a process start, reading the cache's head, hashing the
shards), and checks that both give every checkpoint the same tau.
"""

from __future__ import annotations

import argparse
import json
import os
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

from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def tool(name: str, *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "tools" / name), *args], env=ENV, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def make_run(root: Path, checkpoints: int, samples: int, tokens: int) -> tuple[Path, Path, Path]:
    """(cache, checkpoint folder, drafter config.json)."""
    p = PRESETS["cpu"]
    head = make_head(p, 1, "cpu", torch.float32)
    target = make_drafter(p, 2, "cpu", torch.float32)
    cache = write_cache(root / "cache", p, samples, 64, tokens, head, dtype=torch.float32,
                        planted=FastRunner(target)).path
    target.save_pretrained(root / "config_source")
    start = make_drafter(p, 3, "cpu", torch.float32).state_dict()
    folder = root / "ckpts"
    folder.mkdir()
    final = target.state_dict()
    for k in range(1, checkpoints + 1):
        w = 1 - 0.5 ** k  # the weights move from a random drafter towards the planted one
        state = {name: (1 - w) * start[name] + w * final[name] for name in final}
        torch.save({"step": 100 * k, "drafter": state}, folder / f"step_{100 * k}.pt")
    return cache, folder, root / "config_source" / "config.json"


def measure(root: Path, checkpoints: int, samples: int, tokens: int, budgets: str, repeats: int) -> dict:
    """Both ways on one run's checkpoints, ``repeats`` times in turn: the fastest wall seconds of each, and every
    checkpoint's tau (the same both ways)."""
    cache, folder, config = make_run(root, checkpoints, samples, tokens)
    times: dict[str, list[float]] = {"separate_s": [], "sweep_s": []}
    for k in range(repeats):
        f = both_ways(root / f"repeat{k}", cache, folder, config, budgets)
        for name in times:
            times[name].append(f[name])
    return {**{name: min(t) for name, t in times.items()}, "taus": f["taus"]}


def both_ways(root: Path, cache: Path, folder: Path, config: Path, budgets: str) -> dict:
    options = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--ddtree-budgets", budgets]
    started = time.perf_counter()
    separate = {}
    for ckpt in sorted(folder.glob("*.pt"), key=lambda c: int(c.stem.split("_")[1])):
        tool("extract_drafter.py", "--ckpt", str(ckpt), "--out", str(root / "drafters" / ckpt.stem),
             "--config", str(config))
        out = root / "separate" / f"{ckpt.stem}.json"
        tool("eval_drafter.py", "--states", str(cache), "--drafter", str(root / "drafters" / ckpt.stem),
             "--out", str(out), *options)
        separate[ckpt.stem] = json.loads(out.read_text())["metrics"]["tau"]
    separate_s = time.perf_counter() - started
    started = time.perf_counter()
    tool("sweep_checkpoints.py", str(folder), "--states", str(cache), "--out", str(root / "sweep"),
         "--config", str(config), *options)
    sweep_s = time.perf_counter() - started
    swept = {Path(e["checkpoint"]).stem: e["metrics"]["tau"]
             for e in json.loads((root / "sweep" / "sweep.json").read_text())["entries"]}
    if swept != separate:
        raise SystemExit(f"the sweep's taus differ from the tools': {swept} vs {separate}")
    return {"separate_s": separate_s, "sweep_s": sweep_s, "taus": separate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=8)
    ap.add_argument("--sizes", default="4x256,8x512", help="comma-separated SAMPLESxTOKENS (a 64-token prompt each)")
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--repeats", type=int, default=1, help="measure both ways this many times in turn; the fastest")
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/evaluating.md")
    args = ap.parse_args()
    n = args.checkpoints
    rows = ["| checkpoints | cache | extract + eval_drafter per checkpoint | one sweep | ratio | saved per checkpoint |",
            "|---|---|---|---|---|---|"]
    for size in args.sizes.split(","):
        samples, tokens = (int(x) for x in size.split("x"))
        f = measure(Path(tempfile.mkdtemp(prefix="dflash_sweep_bench_")), n, samples, tokens, args.budgets,
                    args.repeats)
        a, b = f["separate_s"], f["sweep_s"]
        rows.append(f"| {n} | {samples} samples x {tokens} tokens | {a:.1f} s ({a / n:.2f} s each) | {b:.1f} s "
                    f"({b / n:.2f} s each) | {a / b:.1f}x | {(a - b) / n:.2f} s |")
        print(rows[-1])
        print(f"  taus (the same both ways): {', '.join(f'{k} {v:.3f}' for k, v in f['taus'].items())}")
    table = "\n".join(rows)
    print(table)
    if args.update_docs:
        from _docs import update_docs_table

        update_docs_table("evaluating.md", "sweep-vs-tools", table)


if __name__ == "__main__":
    main()
