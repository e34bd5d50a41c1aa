#!/usr/bin/env python
"""What the two tail-block conventions change, on the demo's trained drafter and held-out prompts.

    python tools/demo.py --out /tmp/demo_full
    OMP_NUM_THREADS=1 python benchmarks/tail_blocks.py --demo /tmp/demo_full [--update-docs]

The held-out cache as the demo writes it (``max_new_tokens`` 40), and the same prompts precomputed at
``--max-new-tokens 16`` (made here with ``tools/precompute_states.py`` if missing), are scored with
``tail_blocks="served"`` and ``"reference"`` (what ``tools/eval_drafter.py --tail-blocks`` runs). Per cache:
the cycles, the cycles whose block ``reference`` shortened, the cycles that differ, tau under each, and
the statistics and DDTree walks that differ (``docs/evaluating.md``, "Tail blocks").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.checkpoints.load import load_drafter  # noqa: E402
from dflash_cb.core.figures.metrics import ALL_ANCHOR_TAU, SPECFORGE_ACC, depth_acc  # noqa: E402
from dflash_cb.core.replay import evaluate  # noqa: E402

BUDGETS = (16, 32, 64)


def short_cache(demo: Path, tokens: int) -> Path:
    out = demo / "cache" / f"eval{tokens}"
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "precompute_states.py"), "--target", str(demo / "target"),
                        "--prompts", str(demo / "prompts" / "eval.jsonl"), "--out", str(out), "--layers", "0,1,2",
                        "--reference", "local", "--dtype", "float32", "--max-new-tokens", str(tokens)], check=True)
    return out


def compare(cache: StateCache, drafter: torch.nn.Module) -> dict[str, object]:
    served = evaluate(cache, drafter, budgets=BUDGETS, tail_blocks="served")
    ref = evaluate(cache, drafter, budgets=BUDGETS, tail_blocks="reference")
    block, end = drafter.spec.block_size, {e.id: e.prompt_len + cache.manifest.max_new_tokens for e in cache.samples}
    shortened = differ = 0
    for a, b in zip(served.samples, ref.samples, strict=True):
        p = cache.entry(a.id).prompt_len
        for k in b.acceptance_lengths:  # the reference walk: a block is shortened within block_size of the end
            shortened += end[a.id] - p < block
            p += k
        differ += sum(x != y for x, y in zip(a.acceptance_lengths, b.acceptance_lengths, strict=False))
        differ += abs(len(a.acceptance_lengths) - len(b.acceptance_lengths))
    ddtree = sum(any(a.ddtree[x] != b.ddtree[x] for x in BUDGETS) for a, b in zip(served.samples, ref.samples,
                                                                                  strict=True))
    capped = sum(e.total_len - e.prompt_len >= cache.manifest.max_new_tokens for e in cache.samples)
    s, r = served.summary, ref.summary
    return {"cache": f"{cache.manifest.max_new_tokens} tokens", "samples": len(cache), "capped": capped,
            "cycles": f"{int(s['cycles'])} / {int(r['cycles'])}", "shortened": shortened, "differ": differ,
            "tau": f"{served.tau:.3f} / {ref.tau:.3f}",
            "specforge/acc": f"{s[SPECFORGE_ACC]:.5f} / {r[SPECFORGE_ACC]:.5f}",
            "depth 2": f"{s[depth_acc(2)]:.5f} / {r[depth_acc(2)]:.5f}",
            "all_anchor_tau": f"{s[ALL_ANCHOR_TAU]:.4f} / {r[ALL_ANCHOR_TAU]:.4f}", "ddtree samples": ddtree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="demo_out", help="a finished tools/demo.py output folder")
    ap.add_argument("--tokens", type=int, default=16, help="max_new_tokens of the short cache (default 16)")
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/evaluating.md")
    ap.add_argument("--docs-table", default="tail-blocks", help="which marked table of docs/evaluating.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    demo = Path(args.demo)
    drafter = load_drafter(demo / "drafter").eval()
    rows = [compare(StateCache(c), drafter) for c in (demo / "cache" / "eval", short_cache(demo, args.tokens))]
    keys = ["cache", "samples", "capped", "cycles", "shortened", "differ", "tau", "specforge/acc", "depth 2",
            "all_anchor_tau", "ddtree samples"]
    names = ["max_new_tokens", "samples", "reaching the limit", "cycles (served / reference)",
             "shortened blocks (reference)", "cycles that differ", "tau (served / reference)",
             "specforge/acc (served / reference)", "depth-2 acceptance", "all_anchor_tau",
             "samples whose DDTree walks differ"]
    table = "\n".join(["| " + " | ".join(names) + " |", "|---" * len(names) + "|",
                       *("| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows)])
    print(table)
    if args.update_docs:
        from _docs import update_docs_table

        kernels = os.environ.get("ATEN_CPU_CAPABILITY")
        update_docs_table("evaluating.md", args.docs_table, table,
                          f" with `ATEN_CPU_CAPABILITY={kernels}`" if kernels else "")


if __name__ == "__main__":
    main()
