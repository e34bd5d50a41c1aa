#!/usr/bin/env python
"""Which drafter to serve, worked through on the CPU demo: two DFlash drafters and an MTP head on one cache,
projected to tokens per second from one cost profile measured on the demo's target.

    python tools/demo.py --out demo_out
    OMP_NUM_THREADS=1 python benchmarks/which_to_serve.py --demo demo_out [--out demo_out/serve] [--update-docs]

The demo's target is a tiny Qwen3 that ships no MTP head, so this script trains one for it (a Qwen3.5 MTP layer,
its first step on the demo's training cache, ``chain.train_first_step``): a stand-in for Qwen3.6's own ``mtp.*``
head, which ``tools/extract_drafter.py --from-target`` reads. It reads the demo's last layer, which the demo's caches
already hold (layer id ``num_layers - 1``: docs/method.md, "Chain drafters"). Then, each with the repository's
own command line:

1. ``tools/profile_costs.py --target demo_out/target --drafter demo_out/drafter,MTP``: the target's verify step
   at 1 .. 33 tokens and each drafter's pass (the MTP's one step) on this machine, one profile;
2. ``tools/eval_drafter.py --profile``: the demo's first and last DFlash drafters (block 8, DDTree 32) and the
   MTP head at K = 1, 3 and 5 (``--speculative-tokens``), on the demo's held-out cache;
3. ``tools/serve_plan.py``: the table and the plot;
4. ``tools/speed_check.py``: real greedy speculative decoding of every setting beside plain greedy decoding on this
   machine (K/V caches as a server keeps them, settings interleaved, ``--repeats`` each after a warm-up), its
   per-cycle overhead measured first on the demo's *training* prompts (``--profile-out``) and the projection on
   the held-out prompts priced with it, so the projected column is not fitted to the prompts it is compared on;
5. ``--reruns N``: the profile measured N more times, each priced with the same overhead, and the best setting of
   each rerun (a profile that flips the best setting between reruns is too noisy to act on).

``--update-docs`` writes the plan into docs/serving.md (``<!-- table:which-to-serve -->``) and the plot into
docs/img/which_to_serve.png. The figures are a CPU projection for a model of a few thousand parameters: what they
show is the method, not a serving speed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _docs import report_to_docs  # noqa: E402

from dflash_cb.cache.states import StateCache  # noqa: E402
from dflash_cb.core.drafters.chain import train_first_step  # noqa: E402
from dflash_cb.core.drafters.layouts import drafter_from_config  # noqa: E402
from dflash_cb.core.drafters.mtp.model import mtp_config_from_target  # noqa: E402
from dflash_cb.integrations.cli import eval_drafter, profile_costs, serve_plan, speed_check  # noqa: E402


def train_mtp(demo: Path, out: Path, epochs: int, seed: int) -> Path:
    """A Qwen3.5 MTP layer for the demo's target, trained on its training cache; saved as a drafter folder."""
    target = json.loads((demo / "target" / "config.json").read_text())
    # The demo's Qwen3 target as a Qwen3.5 one with a single MTP layer (partial rotary, as Qwen3.5's).
    config = mtp_config_from_target({**target, "mtp_num_hidden_layers": 1, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, 3)
    torch.manual_seed(seed)
    mtp = train_first_step(drafter_from_config(config), StateCache(demo / "cache" / "train"), epochs, 3e-3)
    folder = out / "mtp"
    mtp.save_pretrained(folder)
    return folder


def print_profile(path: Path) -> None:
    """The measured step times the projection prices cycles with: the target's verify step at the token counts the
    settings verify, and each drafter's pass (a chain's one step)."""
    data = json.loads(path.read_text())
    for ctx, rows in data["verify"].items():
        verify = dict(rows)
        shown = ", ".join(f"{n} token{'s' if n > 1 else ''} {1e3 * verify[n]:.2f} ms" for n in (1, 2, 4, 6, 8, 9, 33) if n in verify)
        print(f"Target verify step at context {ctx}: {shown}")
        for d in (data, *data.get("others", [])):
            print(f"Drafter pass at context {ctx}: {d['drafter']['family']} {1e3 * d['draft'][ctx]:.2f} ms")
    print()


def measured_checks(demo: Path, out: Path, profile: Path, drafters: dict[str, tuple[Path, list[str]]], prompts: int,
                    repeats: int) -> dict[str, dict]:
    """Per drafter: the per-cycle overhead measured on the training prompts, then the speed check on the held-out
    prompts with the projection priced with that overhead (the speed check's report, read back)."""
    out_checks = {}
    for name, (folder, extra) in drafters.items():
        common = ["--target", str(demo / "target"), "--drafter", str(folder), "--no-progress", *extra]
        calibrated = out / f"profile.{name}.json"
        cmd = [*common, "--states", str(demo / "cache" / "train"), "--prompts", "4", "--repeats", "3", "--profile",
               str(profile), "--profile-out", str(calibrated), "--out", str(out / f"overhead.{name}.json")]
        print("python tools/speed_check.py " + " ".join(cmd))
        assert speed_check.main(cmd) == 0
        report = out / f"check.{name}.json"
        cmd = [*common, "--states", str(demo / "cache" / "eval"), "--prompts", str(prompts), "--repeats",
               str(repeats), "--profile", str(calibrated), "--out", str(report)]
        print("python tools/speed_check.py " + " ".join(cmd))
        assert speed_check.main(cmd) == 0
        out_checks[name] = json.loads(report.read_text())
    return out_checks


def profile_reruns(demo: Path, out: Path, cmd_profile: list[str], checks: dict[str, dict],
                   drafters: dict[str, tuple[Path, list[str]]], reruns: int) -> list[tuple[str, float]]:
    """The profile measured ``reruns`` more times; each priced with the checks' overhead, the projection of every
    setting on the held-out prompts; per rerun the best setting and its projected speedup."""
    import dataclasses

    from dflash_cb.core.costs.serving import CostProfile
    from dflash_cb.integrations.evaluator.projection import read_profile

    overhead: dict[str, float] = {}
    for report in checks.values():
        overhead.update(report["overhead_seconds_per_cycle"])
    best = []
    for r in range(reruns):
        raw = out / f"rerun{r}.json"
        assert profile_costs.main([*cmd_profile, "--out", str(raw)]) == 0
        priced = out / f"rerun{r}.priced.json"
        priced.write_text(json.dumps(CostProfile.to_dict(dataclasses.replace(read_profile(raw), overhead=overhead))))
        found = []
        for name, (folder, extra) in drafters.items():
            res = out / f"rerun{r}.{name}.json"
            opts = ["--ddtree-budgets", "32"] if "--ddtree-budgets" in extra else ["--speculative-tokens", "1,3,5",
                                                                                   "--ddtree-budgets", ""]
            assert eval_drafter.main(["--states", str(demo / "cache" / "eval"), "--drafter", str(folder), "--out",
                                      str(res), "--profile", str(priced), "--sample-ids", ",".join(checks[name]["prompts"]),
                                      *opts]) == 0
            for f in sorted(out.glob(f"rerun{r}.{name}*.json")):
                serving = json.loads(f.read_text())["breakdown"]["serving"]
                for s in serving["settings"]:
                    found.append((f"{name} {s['label']}", s["speedup"][0]))
        best.append(max(found, key=lambda x: x[1]))
    return best


def print_measured(checks: dict[str, dict], reruns: list[tuple[str, float]]) -> None:
    """Projected beside measured per setting, the measured verdict, and the profile reruns' best settings."""
    print("Measured with tools/speed_check.py on the held-out prompts (projection priced with the per-cycle overhead "
          "measured on the training prompts):\n")
    print("| drafter | setting | tau | projected | measured | repeats range | projected / measured |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, report in checks.items():
        for s in report["settings"]:
            p, m = s["projected"], s["speedup"]
            rows.append((name, s, m))
            print(f"| {name} | {s['label']} | {s['tau']:.3f} | {p[0]:.2f}x [{p[1]:.2f}, {p[2]:.2f}] | "
                  f"{m[0]:.2f}x [{m[1]:.2f}, {m[2]:.2f}] | [{s['repeat_range'][0]:.2f}, {s['repeat_range'][1]:.2f}] "
                  f"| {s['ratio']:.2f} |")
    rows.sort(key=lambda r: -r[2][0])
    if len(rows) > 1:
        (a, s1, m1), (b, s2, m2) = rows[:2]
        if m1[1] > m2[2]:
            print(f"\n**Measured fastest: {a} at {s1['label']}** ({m1[0]:.2f}x), beyond {b} at {s2['label']} "
                  f"({m2[0]:.2f}x): their intervals do not overlap.")
        else:
            print(f"\n**{a} at {s1['label']} ({m1[0]:.2f}x) and {b} at {s2['label']} ({m2[0]:.2f}x) are within "
                  "noise** of each other (their intervals overlap).")
    if reruns:
        print(f"\nBest projected setting in {len(reruns)} reruns of the profile command: "
              + ", ".join(f"{label} ({v:.2f}x)" for label, v in reruns) + ".")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", required=True, help="a finished demo's output folder (python tools/demo.py --out DIR)")
    ap.add_argument("--out", default=None, help="where to write (default: DEMO/serve; must not exist)")
    ap.add_argument("--epochs", type=int, default=20, help="the MTP head's training epochs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8, help="the speed check's held-out prompts")
    ap.add_argument("--repeats", type=int, default=5, help="the speed check's timed decodes per prompt and setting")
    ap.add_argument("--reruns", type=int, default=5, help="profile reruns for the best setting's stability")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    demo = Path(args.demo)
    out = Path(args.out) if args.out else demo / "serve"
    out.mkdir(parents=True, exist_ok=False)
    mtp = train_mtp(demo, out, args.epochs, args.seed)
    profile = out / "profile.json"
    cmd_profile = ["--target", str(demo / "target"), "--drafter", f"{demo / 'drafter'},{mtp}", "--dtype", "float32",
                   "--contexts", "8,24,40", "--tokens", "1-33", "--repeats", "5"]
    cmd = [*cmd_profile, "--out", str(profile)]
    print("python tools/profile_costs.py " + " ".join(cmd))
    assert profile_costs.main(cmd) == 0
    states = str(demo / "cache" / "eval")
    files, labels = [], []
    for name, folder in (("dflash-first", demo / "drafter_first"), ("dflash-last", demo / "drafter")):
        files.append(out / f"{name}.json")
        labels.append(name)
        cmd = ["--states", states, "--drafter", str(folder), "--out", str(files[-1]), "--ddtree-budgets", "32",
               "--profile", str(profile)]
        print("python tools/eval_drafter.py " + " ".join(cmd))
        assert eval_drafter.main(cmd) == 0
    cmd = ["--states", states, "--drafter", str(mtp), "--out", str(out / "mtp.json"), "--speculative-tokens",
           "1,3,5", "--ddtree-budgets", "", "--profile", str(profile)]
    print("python tools/eval_drafter.py " + " ".join(cmd))
    assert eval_drafter.main(cmd) == 0
    for k in (1, 3, 5):
        files.append(out / f"mtp.k{k}.json")
        labels.append(f"mtp-k{k}")
    plan = out / "plan"
    cmd = [*map(str, files), "--labels", ",".join(labels), "--out", str(plan)]
    print("python tools/serve_plan.py " + " ".join(cmd))
    assert serve_plan.main(cmd) == 0
    drafters = {"dflash-first": (demo / "drafter_first", ["--ddtree-budgets", "32"]),
                "dflash-last": (demo / "drafter", ["--ddtree-budgets", "32"]),
                "mtp": (mtp, ["--speculative-tokens", "1,3,5"])}
    checks = measured_checks(demo, out, profile, drafters, args.prompts, args.repeats)
    reruns = profile_reruns(demo, out, cmd_profile, checks, drafters, args.reruns)
    with report_to_docs(args.update_docs, "serving.md", "which-to-serve"):
        print_profile(profile)
        print_measured(checks, reruns)
        # The plan without its image line: the page shows the plot itself, below the table.
        print("\n".join(line for line in plan.with_suffix(".md").read_text().splitlines()
                        if not line.startswith("![")).rstrip())
    if args.update_docs:
        shutil.copyfile(plan.with_suffix(".png"), ROOT / "docs" / "img" / "which_to_serve.png")


if __name__ == "__main__":
    main()
