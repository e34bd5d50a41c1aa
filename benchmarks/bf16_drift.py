#!/usr/bin/env python
"""How much bfloat16 autocast moves the measured tau, against exact float32, on CPU.

    python tools/demo.py --out /tmp/demo                    # a trained drafter and its held-out cache
    python benchmarks/bf16_drift.py --demo /tmp/demo --planted

For each case the same drafter is evaluated twice on the same cache (float32, then under
``torch.autocast("cpu", bfloat16)``, as the callback evaluates on GPU) and the script prints the
tau of both, their difference, the DDTree tau differences, and the share of float32 cycles that
bfloat16 changes: a cycle (anchor, produced) of the float32 walk that the bfloat16 walk does not
make identically (a changed length, or an anchor the bfloat16 walk never visits).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synthetic import PRESETS, make_drafter, make_head, write_cache  # noqa: E402

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.drafters.dflash.model import DFlashDrafter  # noqa: E402
from dflash_cb.core.drafters.dflash.runner import FastRunner  # noqa: E402
from dflash_cb.core.figures.metrics import ddtree_tau  # noqa: E402
from dflash_cb.core.replay import evaluate  # noqa: E402


def _cycles(lengths: list[int], start: int) -> set[tuple[int, int]]:
    out, p = set(), start
    for k in lengths:
        out.add((p, k))
        p += k
    return out


def drift(cache: StateCache, drafter: torch.nn.Module, head, budgets: tuple[int, ...]) -> dict:
    f32 = evaluate(cache, drafter, head, budgets=budgets, device="cpu")
    bf16 = evaluate(cache, drafter, head, budgets=budgets, device="cpu", autocast_dtype=torch.bfloat16)
    changed = total = samples_changed = 0
    for a, b in zip(f32.samples, bf16.samples, strict=True):
        start = cache.entry(a.id).prompt_len
        ca, cb = _cycles(a.acceptance_lengths, start), _cycles(b.acceptance_lengths, start)
        changed += len(ca - cb)
        total += len(ca)
        samples_changed += ca != cb
    s32, s16 = f32.summary, bf16.summary
    out = {"samples": len(f32.samples), "cycles_float32": total, "tau_float32": round(f32.tau, 4),
           "tau_bf16": round(bf16.tau, 4), "tau_diff": round(bf16.tau - f32.tau, 4),
           "cycles_changed_share": round(changed / max(total, 1), 4), "samples_with_a_change": samples_changed}
    for b in budgets:
        out[f"ddtree_b{b}_diff"] = round(s16[ddtree_tau(b)] - s32[ddtree_tau(b)], 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default=None, help="a finished tools/demo.py output folder (drafter/, cache/eval)")
    ap.add_argument("--planted", action="store_true", help="also the planted preset cpu (8 x 512 tokens)")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/evaluating.md")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    budgets = tuple(int(b) for b in args.budgets.split(",") if b)
    figures: dict = {}
    if args.demo:
        demo = Path(args.demo)
        drafter = DFlashDrafter.from_pretrained(demo / "drafter").eval()
        figures["demo drafter, held-out cache"] = drift(StateCache(demo / "cache" / "eval"), drafter, None, budgets)
    if args.planted:
        p = PRESETS["cpu"]
        head = make_head(p, 1, "cpu", torch.float32)
        drafter = make_drafter(p, 2, "cpu", torch.float32)
        tmp = Path(tempfile.mkdtemp(prefix="dflash_drift_"))
        cache = write_cache(tmp / "cache", p, 8, 64, 512, head, dtype=torch.float32, planted=FastRunner(drafter))
        figures["planted preset cpu, 8 x 512"] = drift(cache, drafter, head, budgets)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    table = markdown(figures, budgets)
    print(table)
    if args.update_docs:
        from _docs import update_docs_table

        update_docs_table("evaluating.md", "bf16-drift", table)


def markdown(figures: dict, budgets: tuple[int, ...]) -> str:
    head = "| drafter, cache | tau float32 | tau bf16 | cycles changed | DDTree tau change (" + \
        " / ".join(map(str, budgets)) + ") |"
    rows = [head, "|---|---|---|---|---|"]
    for name, f in figures.items():
        moved = " / ".join(f"{f[f'ddtree_b{b}_diff']:+.3f}" for b in budgets)
        rows.append(f"| {name}: {f['samples']} samples, {f['cycles_float32']} cycles | {f['tau_float32']:.3f} | "
                    f"{f['tau_bf16']:.3f} | {f['cycles_changed_share']:.1%} ({f['samples_with_a_change']} samples) "
                    f"| {moved} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
