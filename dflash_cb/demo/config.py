"""The demo's knobs and where it writes (``DemoConfig``, ``Paths``), the families it trains, and what its default run
gave where it was measured."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.errors import DFlashCBError
from ..core.drafters.chain import ChainFamily
from ..core.drafters.registry import families, family_named
from ..core.drafters.spec import DEFAULT_FAMILY

MARKER = ".dflash_demo"  # written first into the output folder: --overwrite only ever deletes a demo's folder
TAU_GOAL = 2.0

# What the default demo (a DFlash drafter, 1200 steps) gave where it was measured: the last tau of each seed, with
# `OMP_NUM_THREADS=1 python tools/demo.py --threads 1 --seed N` (docs/getting-started.md, "The demo"). Another CPU's
# kernels or another thread count round differently, training takes another path and lands elsewhere: the spread
# over seeds is the band to expect, not a value to match.
MEASURED_ON = "a 2-core AMD EPYC (avx2)"
MEASURED_THREADS = 1
MEASURED_TAU = {0: 3.415, 1: 3.191, 2: 3.185, 3: 2.962, 4: 3.087}


@dataclass
class DemoConfig:
    """Every knob of the demo; ``resolve`` applies the command line and the ``--quick`` preset."""

    out: Path = Path("demo_out")
    seed: int = 0
    steps: int = 1200  # drafter optimizer steps
    eval_every: int = 100
    quick: bool = False
    overwrite: bool = False
    wandb_mode: str = "offline"
    wandb_project: str = "dflash-cb-demo"
    threads: int = 1
    target_from: Path | None = None  # an earlier demo's folder whose target, prompts and caches this run reuses
    drafter: str = DEFAULT_FAMILY  # the family trained: one of DRAFTERS (--drafter)
    block_size: int = 8
    # Sizes (set from --quick in ``resolve``).
    target_steps: int = 600
    train_prompts_per_family: int = 150
    eval_prompts_per_family: int = 10
    drafter_layers: int = 2
    batch_size: int = 4
    lr: float = 2e-3
    ddtree_budgets: tuple[int, ...] = (16, 32)
    max_new_tokens: int = 40
    layer_ids: tuple[int, ...] = (0, 1, 2)
    require_goal: bool = True  # exit non-zero when the last tau is below TAU_GOAL

    @classmethod
    def resolve(cls, out: str | os.PathLike = "demo_out", seed: int = 0, steps: int | None = None,
                eval_every: int | None = None, quick: bool = False, **kw: Any) -> DemoConfig:
        if quick:  # the CI form: same pipeline, smaller everything; tau must rise, not reach the goal
            base = dict(steps=150, eval_every=50, target_steps=200, train_prompts_per_family=30,
                        eval_prompts_per_family=4, ddtree_budgets=(16,), require_goal=False)
        else:
            base = {}
        if steps is not None:
            base["steps"] = steps
        if eval_every is not None:
            base["eval_every"] = eval_every
        cfg = cls(out=Path(out), seed=seed, quick=quick, **{**base, **kw})
        if cfg.steps < 1 or cfg.eval_every < 1:
            raise ValueError("--steps and --eval-every must be >= 1")
        if cfg.wandb_mode not in ("offline", "online"):
            raise ValueError(f"--wandb-mode must be offline or online, got {cfg.wandb_mode!r}")
        if cfg.drafter not in DRAFTERS:
            raise ValueError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {cfg.drafter!r}")
        if not family_named(cfg.drafter).supports_tree:
            cfg.ddtree_budgets = ()  # its trees are not what a server verifies: the summary says why
        return cfg


@dataclass
class Paths:
    """Where the demo writes each thing, under ``out``."""

    out: Path
    target: Path = field(init=False)
    prompts_train: Path = field(init=False)
    prompts_eval: Path = field(init=False)
    cache_train: Path = field(init=False)
    cache_eval: Path = field(init=False)
    drafter_config: Path = field(init=False)
    checkpoint: Path = field(init=False)
    drafter: Path = field(init=False)
    results: Path = field(init=False)
    plots: Path = field(init=False)
    summary: Path = field(init=False)

    def __post_init__(self) -> None:
        o = self.out
        self.target = o / "target"
        self.prompts_train = o / "prompts" / "train.jsonl"
        self.prompts_eval = o / "prompts" / "eval.jsonl"
        self.cache_train = o / "cache" / "train"
        self.cache_eval = o / "cache" / "eval"
        self.drafter_config = o / "drafter_config.json"
        self.checkpoint = o / "checkpoints" / "final.ckpt"
        self.checkpoint_first = o / "checkpoints" / "first.ckpt"  # the untrained drafter, for the comparison
        self.drafter = o / "drafter"
        self.drafter_first = o / "drafter_first"
        self.results = o / "results.json"
        self.results_first = o / "results_first.json"
        self.comparison = o / "comparison"  # .md and .png from the compare tool
        self.plots = o / "plots"
        self.summary = o / "summary.json"


# The chain families the demo builds a small drafter of (those whose family makes one: ``chain_drafter_config``).
CHAIN_DRAFTERS = tuple(f.name for f in families() if isinstance(f, ChainFamily)
                       and type(f).tiny_config is not ChainFamily.tiny_config)
# The drafter families the demo trains (--drafter: every block family and the chain families above; one without
# DDTree is scored without budgets), and how the summary names them. The demo's caches hold layers 0, 1 and 2
# (``layer_ids``): every family reads layers the cache holds.
DRAFTERS = {f.name: f.label for f in families() if f.kind == "block" or f.name in CHAIN_DRAFTERS}


class DemoError(DFlashCBError, RuntimeError):
    """A problem the user can fix (output folder, W&B credentials); printed without a traceback."""


# Completions here are tens of tokens long, so the position buckets are too (the default is 0..2048+).
POSITION_EDGES = (0, 8, 16, 32)
