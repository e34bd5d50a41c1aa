"""A readable text summary of an evaluation (results.json content)."""

from __future__ import annotations

from typing import Any


def _f(x: Any, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def format_results(res: dict[str, Any]) -> str:
    lines = []
    meta = res.get("meta", {})
    lines.append(f"cache    {meta.get('cache_path')}  (manifest {str(meta.get('cache_manifest_sha256'))[:12]})")
    if meta.get("drafter"):
        lines.append(f"drafter  {meta['drafter']}  dtype={meta.get('dtype')} device={meta.get('device')}")
    cycles = sum(len(s["acceptance_lengths"]) for s in res["samples"])
    lines.append(f"samples  {len(res['samples'])}   cycles {cycles}   wall {meta.get('wall_time_s')} s")
    if meta.get("anchors_drafted") is not None:
        lines.append(f"anchors  drafted {meta['anchors_drafted']}   needed {meta.get('anchors_needed')}   "
                     f"statistics stride {meta.get('anchor_stride')}")
    lines.append("")
    lines.append(f"  tau (greedy replay)          {_f(res['tau'])}")
    for b, d in res.get("ddtree", {}).items():
        lines.append(f"  DDTree tau, budget {b:>4}     {_f(d['tau'])}")
    lines.append(f"  all-anchor mean accepted     {_f(res.get('all_anchor_tau'))}")
    lines.append(f"  SpecForge-style product est. {_f(res.get('specforge_sim_tau'))}")
    t1 = res.get("t1_tau_estimate")
    if t1:
        lines.append(f"  tau at temperature 1         {_f(t1['value'])}  (ESTIMATE from top-K target log-probs)")
    pd = res.get("per_depth", {})
    if pd.get("unconditional"):
        lines.append("")
        lines.append("  depth        " + " ".join(f"{k:>5d}" for k in range(1, len(pd["unconditional"]) + 1)))
        lines.append("  accept       " + " ".join(f"{_f(v, 2):>5}" for v in pd["unconditional"]))
        lines.append("  accept|prev  " + " ".join(f"{_f(v, 2):>5}" for v in pd["conditional"]))
    if res.get("per_category"):
        lines.append("")
        for c, d in sorted(res["per_category"].items()):
            lines.append(f"  {c:<20} tau {_f(d['tau'])}  ({d['cycles']} cycles)")
    hist = res.get("histogram", {})
    total = sum(hist.values())
    if total:
        lines.append("")
        lines.append("  produced per cycle:")
        for n, c in hist.items():
            if c:
                lines.append(f"    {int(n):>3} {c:>7}  {'#' * max(1, round(40 * c / total))}")
    return "\n".join(lines)
