#!/usr/bin/env python
"""Which drafter to serve, worked through on the CPU demo: two DFlash drafters and an MTP head on one cache,
projected to tokens per second from one cost profile measured on the demo's target.

    python tools/demo.py --out demo_out
    OMP_NUM_THREADS=1 python benchmarks/which_to_serve.py --demo demo_out [--out demo_out/serve] [--update-docs]

The demo's target is a tiny Qwen3 that ships no MTP head, so this script trains one for it (a Qwen3.5 MTP layer,
its first step on the demo's training cache, ``chain.first_step_loss``): a stand-in for Qwen3.6's own ``mtp.*``
head, which ``tools/extract_drafter.py --mtp-from`` reads. It reads the demo's last layer, which the demo's caches
already hold (layer id ``num_layers - 1``: docs/method.md, "Chain drafters"). Then, each with the repository's
own command line:

1. ``tools/profile_costs.py --target demo_out/target --drafter demo_out/drafter,MTP``: the target's verify step
   at 1 .. 33 tokens and each drafter's pass (the MTP's one step) on this machine, one profile;
2. ``tools/eval_drafter.py --profile``: the demo's first and last DFlash drafters (block 8, DDTree 32) and the
   MTP head at K = 1, 3 and 5 (``--speculative-tokens``), on the demo's held-out cache;
3. ``tools/serve_plan.py``: the table and the plot.

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
from dflash_cb.core.drafters.chain import ChainRunner, first_step_loss  # noqa: E402
from dflash_cb.core.drafters.layouts import drafter_from_config  # noqa: E402
from dflash_cb.integrations.cli import eval_drafter, profile_costs, serve_plan  # noqa: E402


def train_mtp(demo: Path, out: Path, epochs: int, seed: int) -> Path:
    """A Qwen3.5 MTP layer for the demo's target, trained on its training cache; saved as a drafter folder."""
    target = json.loads((demo / "target" / "config.json").read_text())
    config = {"architectures": ["Qwen3_5MTPDrafter"], "drafter_family": "mtp", "model_type": "qwen3_5_text",
              "mtp_num_hidden_layers": 1, "num_hidden_layers": 1,
              **{k: target[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")},
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              "target_layer_ids": [target["num_hidden_layers"] - 1], "num_target_layers": target["num_hidden_layers"],
              "num_speculative_tokens": 3}
    torch.manual_seed(seed)
    mtp = drafter_from_config(config)
    cache = StateCache(demo / "cache" / "train")
    head = cache.load_head()
    runner = ChainRunner(mtp, mtp.spec)
    columns = cache.feature_columns(mtp.spec.target_layer_ids)
    opt = torch.optim.AdamW(mtp.parameters(), lr=3e-3)
    for epoch in range(epochs):
        total = 0.0
        for e in cache.samples:
            s = cache.load(e.id)
            feats = (s.hidden if columns is None else s.hidden.index_select(1, columns)).float()
            loss = first_step_loss(runner, feats, s.input_ids.long(), head.embed_tokens, head.lm_head)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        print(f"MTP epoch {epoch + 1}/{epochs}: first-step loss {total / len(cache.samples):.3f}")
    folder = out / "mtp"
    mtp.eval().save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", required=True, help="a finished demo's output folder (python tools/demo.py --out DIR)")
    ap.add_argument("--out", default=None, help="where to write (default: DEMO/serve; must not exist)")
    ap.add_argument("--epochs", type=int, default=20, help="the MTP head's training epochs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    demo = Path(args.demo)
    out = Path(args.out) if args.out else demo / "serve"
    out.mkdir(parents=True, exist_ok=False)
    mtp = train_mtp(demo, out, args.epochs, args.seed)
    profile = out / "profile.json"
    cmd = ["--target", str(demo / "target"), "--drafter", f"{demo / 'drafter'},{mtp}", "--out", str(profile),
           "--dtype", "float32", "--contexts", "32", "--tokens", "1-33", "--repeats", "5"]
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
    with report_to_docs(args.update_docs, "serving.md", "which-to-serve"):
        # The plan without its image line: the page shows the plot itself, below the table.
        print("\n".join(line for line in plan.with_suffix(".md").read_text().splitlines()
                        if not line.startswith("![")).rstrip())
    if args.update_docs:
        shutil.copyfile(plan.with_suffix(".png"), ROOT / "docs" / "img" / "which_to_serve.png")


if __name__ == "__main__":
    main()
