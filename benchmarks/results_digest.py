"""Digests of every figure the replay computes, to show a refactor changes none of them.

For each demo output folder given (``python tools/demo.py --quick --drafter F --out DIR``), scores the demo's
extracted drafter on its evaluation cache under several settings (the defaults; a shorter block with the reference
tail; DDTree budgets with another statistics stride and seed; the Python API with kept drafts, an extra stride and
every anchor drafted) and prints one sha256 per (family, setting) of the results with the clock's fields left out.
Run it on two checkouts and compare, e.g.:

    PYTHONPATH=/path/to/before python benchmarks/results_digest.py demo_dflash demo_dflash2 --out before.json
    PYTHONPATH=/path/to/after python benchmarks/results_digest.py demo_dflash demo_dflash2 --out after.json
    diff before.json after.json   # nothing: every figure byte-equal
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# What measures the clock or the machine, not the drafter: left out of the digests.
CLOCK_WORDS = ("seconds", "wall", "_time", "time_", "timing", "throughput", "per_s", "elapsed", "created", "date",
               "host", "python", "torch_version", "version", "threads", "command", "path", "cpu")


def _clockless(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clockless(v) for k, v in value.items()
                if not any(w in str(k).lower() for w in CLOCK_WORDS)}
    if isinstance(value, list):
        return [_clockless(v) for v in value]
    return value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(_clockless(value), sort_keys=True).encode()).hexdigest()[:16]


SETTINGS = {
    "defaults": [],
    "block4-reference-stride3": ["--block-size", "4", "--tail-blocks", "reference", "--anchor-stride", "3"],
    "budgets-stride2-seed5": ["--ddtree-budgets", "4,8", "--anchor-stride", "2", "--anchor-seed", "5"],
}


def _tool(demo: Path, setting: list[str], out: Path, tree: bool) -> dict:
    if not tree:
        setting = [a for a in setting if a != "4,8" and a != "--ddtree-budgets"] + ["--ddtree-budgets", ""]
    cmd = [sys.executable, str(ROOT / "tools" / "eval_drafter.py"), "--states", str(demo / "cache" / "eval"),
           "--drafter", str(demo / "drafter"), "--out", str(out), "--device", "cpu", "--threads", "1", *setting]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _api(demo: Path) -> dict:
    from dflash_cb import load_drafter
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay.engine import evaluate  # the path every revision has (the one door came later)

    cache = StateCache(demo / "cache" / "eval")
    drafter = load_drafter(demo / "drafter")
    report = evaluate(cache, drafter, budgets=(), keep_drafts=2, extra_anchor_strides=(2,), draft_all=True,
                      anchor_stride=3)
    return {"summary": report.summary, "samples": [dataclasses.asdict(s) for s in report.samples],
            "stride2": dataclasses.asdict(report.counts_at(2)), "passes": report.passes, "note": report.specforge_note}


def _read_back(demo: Path) -> str:
    """The demo's own results files, written by the checkout that ran the demo, read by this one: the digest of
    what it reads (equal to the file's when nothing is lost)."""
    from dflash_cb.core.results.results_file import load_results

    got = {}
    for name in ("results.json", "results_first.json"):
        written = json.loads((demo / name).read_text())
        read = load_results(demo / name).to_dict()
        got[name] = [_digest(written), _digest(json.loads(json.dumps(read, default=str)))]
    return ", ".join(f"{k} written {a} read {b}" for k, (a, b) in got.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("demos", nargs="+", type=Path, help="demo output folders (tools/demo.py --out)")
    ap.add_argument("--out", type=Path, help="write the digests as JSON")
    ap.add_argument("--keep", type=Path, help="also keep the clockless results here, one file per digest")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    digests: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for demo in a.demos:
            family = json.loads((demo / "drafter" / "config.json").read_text()).get("architectures", ["?"])[0]
            tree = True
            for name, setting in SETTINGS.items():
                try:
                    got = _tool(demo, setting, Path(tmp) / f"{demo.name}-{name}.json", tree)
                except SystemExit as e:
                    if "DDTree" in str(e) or "budgets" in str(e):
                        tree = False
                        got = _tool(demo, setting, Path(tmp) / f"{demo.name}-{name}.json", tree)
                    else:
                        raise
                digests[f"{demo.name}/{name}"] = _digest(got)
                if a.keep:
                    a.keep.mkdir(parents=True, exist_ok=True)
                    (a.keep / f"{demo.name}-{name}.json").write_text(json.dumps(_clockless(got), indent=1,
                                                                                sort_keys=True, default=str))
            digests[f"{demo.name}/read-back"] = _read_back(demo)
            got = _api(demo)
            digests[f"{demo.name}/api-drafts-stride3-extra2-draft-all"] = _digest(json.loads(json.dumps(got, default=str)))
            print(f"{demo.name} ({family}): " + ", ".join(f"{k.split('/')[1]} {v}" for k, v in digests.items()
                                                         if k.startswith(demo.name + "/")), flush=True)
    if a.out:
        a.out.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
