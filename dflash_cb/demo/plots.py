"""The demo's plots: tau over the training steps with its band, per-depth acceptance, accepted lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..common.fileio import atomic_path
from ..core.drafters.registry import family_named
from ..core.drafters.spec import DEFAULT_FAMILY
from ..core.figures.metrics import (
    ALL_ANCHOR_TAU,
    TAU,
    ci_high,
    ci_low,
    ddtree_tau,
    depth_acc,
    depth_acc_cond,
    hist_frac,
)
from .config import TAU_GOAL


def make_plots(history: list[dict[str, float]], block_size: int, budgets: Sequence[int], plots: Path,
               goal: float = TAU_GOAL, family: str = DEFAULT_FAMILY) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    out: dict[str, Path] = {}

    def save(fig: Any, ax: Any, name: str, outside: bool = False) -> None:
        if outside:  # many lines: the legend beside the axes, never over the band or the lines
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.legend(fontsize=8)
        out[name] = plots / f"{name}.png"
        fig.tight_layout()
        with atomic_path(out[name]) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.plot(steps, [h[TAU] for h in history], "o-", lw=2, label="tau (greedy replay)")
    ax.fill_between(steps, [h.get(ci_low(TAU), math.nan) for h in history],
                    [h.get(ci_high(TAU), math.nan) for h in history], color="C0", alpha=0.2,
                    label="tau: 95% interval over prompts")
    for b in budgets:
        ax.plot(steps, [h.get(ddtree_tau(b), math.nan) for h in history], "s--", label=f"DDTree tau, budget {b}")
    ax.plot(steps, [h.get(ALL_ANCHOR_TAU, math.nan) for h in history], ":", color="gray",
            label="all-anchor mean accepted + 1")
    fam = family_named(family)
    for k, walk in enumerate(fam.figures.walks):  # the family's own walks (DFlash 2: selector off, perfect selector)
        ax.plot(steps, [h.get(walk.key, math.nan) for h in history], "^-.", color=f"C{len(budgets) + 2 + k}",
                label=walk.label)
    ax.axhline(goal, color="red", lw=0.8, alpha=0.6, label=f"the demo's goal: tau {goal:g}")
    ax.set(xlabel="training step", ylabel="tokens per drafter call", title=f"{fam.label} drafter: tau while it trains")
    ax.grid(alpha=0.3)
    save(fig, ax, "tau_over_steps", outside=True)

    depths = list(range(1, block_size))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for h, style, colors in ((history[0], ":", ("0.55", "0.75")), (history[-1], "-", ("C0", "C1"))):
        ax.plot(depths, [h.get(depth_acc(k), math.nan) for k in depths], "o" + style, color=colors[0],
                label=f"step {int(h['step'])}: P(draft at depth k = target)")
        # NaN where no anchor got that deep (e.g. the untrained drafter): not drawn.
        ax.plot(depths, [h.get(depth_acc_cond(k), math.nan) for k in depths], "^" + style, color=colors[1],
                label=f"step {int(h['step'])}: same, given depths < k all matched")
    ax.set(xlabel="block depth k", ylabel="acceptance", ylim=(-0.02, 1.02), title="per-depth acceptance (all anchors)")
    ax.grid(alpha=0.3)
    save(fig, ax, "per_depth_acceptance")

    ns = list(range(1, block_size + 1))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    w = 0.4
    for off, h, color in ((-w / 2, history[0], "0.6"), (w / 2, history[-1], "C0")):
        ax.bar([n + off for n in ns], [h.get(hist_frac(n), 0.0) or 0.0 for n in ns], width=w, color=color,
               label=f"step {int(h['step'])} (tau {h[TAU]:.2f})")
    ax.set(xlabel="tokens committed per cycle (accepted + 1)", ylabel="fraction of cycles", xticks=ns,
           title="tokens committed per speculative cycle (accepted + 1)")
    ax.grid(alpha=0.3, axis="y")
    save(fig, ax, "accepted_lengths_hist", outside=True)
    return out
