#!/usr/bin/env python
"""The demo's figures for the docs, read from a finished demo's ``summary.json`` (nothing is recomputed).

    python tools/demo.py --out demo_out
    python benchmarks/demo_figures.py --demo demo_out [--update-docs]

Prints the live evaluations (step, tau with its 95% interval, DDTree tau per budget, per-category tau),
the comparison of the last checkpoint with the first, and the demo's wall time, as a markdown block; with
``--update-docs`` writes it into ``docs/getting-started.md`` (the ``demo`` table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def block(summary: dict) -> str:
    evals = summary["evaluations"]
    budgets = sorted(int(k.removeprefix("ddtree_b")) for k in evals[-1] if k.startswith("ddtree_b"))
    cats = sorted(summary["category_tau_last"])
    head = ["step", "tau [95% interval]", *(f"DDTree b{b}" for b in budgets)]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in evals:
        lo, hi = e["tau_ci"]
        rows.append(f"| {e['step']} | {e['tau']:.3f} [{lo:.2f}, {hi:.2f}] | "
                    + " | ".join(f"{e[f'ddtree_b{b}']:.3f}" for b in budgets) + " |")
    lo, hi = summary["tau_last_interval"]
    cmp = summary["first_vs_last"]
    diff = f"{cmp['text']}: {cmp['verdict']}"
    lines = [
        "\n".join(rows), "",
        f"Last evaluation (step {summary['step_last']}): tau {summary['tau_last']:.3f} [{lo:.2f}, {hi:.2f}], "
        f"DDTree tau {summary['ddtree_tau_last']:.3f} at budget {summary['ddtree_budget']}; per category: "
        + ", ".join(f"{c} {summary['category_tau_last'][c]:.3f}" for c in cats) + ".",
        f"Last checkpoint against the first (paired, `comparison.md`): {diff}.",
        f"Wall time of the whole demo: {summary['timings_s'].get('total', float('nan')):.0f} s.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="demo_out", help="a finished tools/demo.py output folder")
    ap.add_argument("--update-docs", action="store_true", help="write the block into docs/getting-started.md")
    args = ap.parse_args()
    summary = json.loads((Path(args.demo) / "summary.json").read_text())
    text = block(summary)
    print(text)
    if args.update_docs:
        from _docs import update_docs_table

        note = (f" (the demo itself: `python tools/demo.py --out {args.demo}`, seed {summary['seed']}, "
                f"{summary['threads']} thread(s))")
        update_docs_table("getting-started.md", "demo", text, note)
        # The README's picture: the demo's own plot of the live tau, as it drew it.
        img = Path(__file__).resolve().parents[1] / "docs" / "img" / "demo_tau_over_steps.png"
        img.parent.mkdir(exist_ok=True)
        shutil.copyfile(Path(args.demo) / "plots" / "tau_over_steps.png", img)
        print(f"updated {img}")


if __name__ == "__main__":
    main()
