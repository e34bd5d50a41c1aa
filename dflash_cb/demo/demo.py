"""The end-to-end CPU demo behind ``python tools/demo.py``.

In a few minutes on a laptop, the whole system at toy scale:

1. train a tiny Qwen3 target on a synthetic language (``dflash_cb.demo.synthetic``) and save it;
2. precompute its hidden states for a training and a held-out evaluation prompt set with the real
   tool (``tools/precompute_states.py --reference local --dtype float32``);
3. train a DFlash drafter (``--drafter``: any block family, e.g. ``dflash2``, ``domino``, ``dspark``; or a chain
   drafter, ``eagle3`` or ``mtp``, trained on its first step) with Lightning (``DFlashDrafterModule``) while
   ``DFlashEvalCallback``
   replays the greedy speculative loop on the held-out cache every N steps (W&B offline by default,
   plus a CSVLogger), printing tau per evaluation;
4. extract the drafter from the final checkpoint (``tools/extract_drafter.py``'s code), score it
   once more as ``tools/eval_drafter.py`` does (``results.json``), do the same for the untrained
   first checkpoint and compare the two as ``tools/compare_results.py`` does (paired interval and
   verdict), draw plots and write ``summary.json`` with every path.

Deterministic given ``--seed``: every random choice comes from seeded generators and Lightning
runs with ``deterministic=True``.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common import cli
from ..common.fileio import atomic_write_json, atomic_write_text, naming_failures, output_path
from ..common.threads import THREADS_HELP, parse_threads
from ..core.drafters.registry import family_named
from ..core.drafters.spec import DEFAULT_FAMILY
from ..core.figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    CHAIN_TAU_ESTIMATE,
    SPECFORGE_ACC,
    TAU,
    TAU_REQUEST_MEAN,
    category_tau,
    ci_high,
    ci_low,
    ddtree_tau,
)
from .config import (
    CHAIN_DRAFTERS,
    DRAFTERS,
    MARKER,
    MEASURED_ON,
    MEASURED_TAU,
    MEASURED_THREADS,
    POSITION_EDGES,
    TAU_GOAL,
    DemoConfig,
    DemoError,
    Paths,
)
from .environment import check_wandb, quiet, setup_torch
from .plots import make_plots
from .reuse import check_target_from, reuse_target

if TYPE_CHECKING:
    from ..core.results.results_file import Results

def _say(msg: str = "") -> None:
    print(msg, flush=True)


def prepare_out(cfg: DemoConfig) -> Paths:
    """Create the output folder; refuse to touch an existing one unless it is a demo's and ``overwrite``."""
    out = output_path(cfg.out)  # a symbolic link is written through: the link keeps pointing at the output
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not cfg.overwrite:
            raise DemoError(f"{out} already exists and is not empty (a previous demo?); pass --overwrite to "
                            "replace it, or --out DIR for another folder")
        if not (out / MARKER).is_file():
            # Never rm -rf a folder the demo did not create, even when asked to overwrite.
            raise DemoError(f"{out} exists but was not written by the demo (no {MARKER} file); "
                            "refusing to delete it: choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MARKER, "written by python tools/demo.py; --overwrite may delete this folder\n")
    return Paths(out)


# -- steps 1 and 2: target, prompts, caches ---------------------------------------------------

def build_target(cfg: DemoConfig, paths: Paths) -> dict[str, Any]:
    from . import synthetic as S

    spec = S.TargetSpec(steps=cfg.target_steps)
    _say(f"[1/4] training the tiny target (Qwen3ForCausalLM, {spec.num_layers} layers, hidden {spec.hidden_size}, "
         f"vocab {S.VOCAB_SIZE}) on the synthetic language: {spec.steps} steps")
    rep = S.train_tiny_target(paths.target, seed=cfg.seed, spec=spec, log=_say)
    eval_set = S.make_prompts(cfg.eval_prompts_per_family, cfg.seed, prefix="eval-")
    train_set = S.make_prompts(cfg.train_prompts_per_family, cfg.seed, prefix="train-",
                               exclude=[r["input_ids"] for r in eval_set])
    S.write_prompts_jsonl(paths.prompts_eval, eval_set)
    S.write_prompts_jsonl(paths.prompts_train, train_set)
    # The target must write structured text, not one repeated token: check its greedy completions.
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(paths.target).eval()
    shown = [next(r for r in eval_set if r["category"] == fam) for fam in S.FAMILIES]
    completions = S.greedy_completions(model, [r["input_ids"] for r in eval_set], cfg.max_new_tokens)
    distinct = [len(set(c)) for c in completions]
    if min(distinct) < 3:
        raise DemoError(f"the tiny target's greedy completions are degenerate (distinct tokens per completion: "
                        f"{distinct}); try another --seed")
    _say(f"      trained in {rep.train_seconds:.1f}s, loss {rep.final_loss:.3f}; fresh prompts completed "
         "exactly as the language says: " + ", ".join(f"{k} {v:.0%}" for k, v in rep.exact_match.items()))
    by_id = {r["id"]: c for r, c in zip(eval_set, completions, strict=True)}
    examples = []
    for r in shown:
        c = by_id[r["id"]]
        _say(f"      {r['category']:>6}: {S.decode(r['input_ids'])}  =>  {S.decode(c)}")
        examples.append({"id": r["id"], "prompt": S.decode(r["input_ids"]), "completion": S.decode(c)})
    _say(f"      prompts: {len(train_set)} for training ({paths.prompts_train}), {len(eval_set)} held out "
         f"({paths.prompts_eval})")
    return {"train_seconds": rep.train_seconds, "final_loss": rep.final_loss, "exact_match": rep.exact_match,
            "examples": examples, "min_distinct_tokens": min(distinct),
            "train_prompts": len(train_set), "eval_prompts": len(eval_set)}


def precompute_argv(cfg: DemoConfig, target: Path, prompts: Path, out: Path) -> list[str]:
    return ["--target", str(target), "--prompts", str(prompts), "--out", str(out),
            "--layers", ",".join(str(i) for i in cfg.layer_ids), "--reference", "local", "--dtype", "float32",
            "--max-new-tokens", str(cfg.max_new_tokens), "--samples-per-shard", "64", "--no-progress",
            "--threads", str(max(1, cfg.threads))]


def build_caches(cfg: DemoConfig, paths: Paths) -> dict[str, Any]:
    from ..cache.precompute import main as precompute_main
    from ..cache.states import StateCache

    _say("[2/4] precomputing target states with the real tool (greedy completions by the target itself):")
    info: dict[str, Any] = {}
    for name, prompts, cache in (("train", paths.prompts_train, paths.cache_train),
                                 ("eval", paths.prompts_eval, paths.cache_eval)):
        argv = precompute_argv(cfg, paths.target, prompts, cache)
        _say("      " + shlex.join(["python", "tools/precompute_states.py", *argv]))
        start = time.perf_counter()
        rc = precompute_main(argv)  # the tool's own entry point, in this process (no second torch import)
        if rc != 0:
            raise DemoError(f"tools/precompute_states.py failed (exit {rc}) for the {name} cache; see above")
        m = StateCache(cache).manifest
        info[name] = {"samples": len(m.samples), "tokens": sum(s.total_len for s in m.samples),
                      "agreement": m.agreement.get("token_agreement"), "seconds": time.perf_counter() - start}
    return info


# -- step 3: the drafter, trained with Lightning and the callback ----------------------------

def drafter_config(cfg: DemoConfig) -> dict[str, Any]:
    from . import synthetic as S
    from .lightning_module import tiny_drafter_config

    if cfg.drafter in CHAIN_DRAFTERS:
        return chain_drafter_config(cfg)
    t = S.TargetSpec()
    return tiny_drafter_config(vocab_size=S.VOCAB_SIZE, target_hidden=t.hidden_size, target_layers=t.num_layers,
                               layer_ids=list(cfg.layer_ids), mask_token_id=S.MASK_TOKEN_ID,
                               block_size=cfg.block_size, num_layers=cfg.drafter_layers, heads=4, kv_heads=2,
                               head_dim=16, intermediate_size=3 * t.hidden_size, family=cfg.drafter)


def chain_drafter_config(cfg: DemoConfig) -> dict[str, Any]:
    """A small chain drafter of K = block size - 1 steps for the tiny target, as its family builds one
    (``ChainFamily.tiny_config``: the MTP head reads the target's last layer, EAGLE-3 three of the others)."""
    from . import synthetic as S

    config = family_named(cfg.drafter).tiny_config(S.target_config(S.TargetSpec()).to_dict(), cfg.layer_ids,
                                                   cfg.block_size - 1)
    if config is None:
        raise ValueError(f"--drafter {cfg.drafter}: the demo builds no {cfg.drafter} drafter")
    return config


def _fmt(x: Any, nd: int = 3) -> str:
    return "  n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def step_checkpoint(folder: Path, step: int) -> Path:
    """Where the demo keeps the drafter of the evaluation at ``step`` (what ``dflash-sweep`` reads)."""
    return folder / f"step_{step:06d}.ckpt"


def _tau_printer(eval_cb: Any, budgets: Sequence[int], first_checkpoint: Path) -> Any:
    from lightning.pytorch.callbacks import Callback

    class TauTable(Callback):
        """Prints each new evaluation of ``eval_cb`` as a table row (runs after it: callbacks run in order)."""

        def __init__(self) -> None:
            self.printed = 0
            self.start = time.perf_counter()

        def _flush(self, trainer: Any) -> None:
            for h in eval_cb.history[self.printed:]:
                # The weights of every evaluation, so a sweep over the checkpoints draws the run's curve.
                at = step_checkpoint(first_checkpoint.parent, int(h["step"]))
                at.parent.mkdir(parents=True, exist_ok=True)
                with naming_failures(at):
                    trainer.save_checkpoint(str(at))
                loss = trainer.callback_metrics.get("train/loss")
                dd = "  ".join(_fmt(h.get(ddtree_tau(b))) for b in budgets)
                cats = "  ".join(_fmt(h.get(category_tau(c)), 2) for c in ("count", "repeat", "pairs"))
                tau = f"{_fmt(h['tau'])} [{_fmt(h.get(ci_low(TAU)), 2)}, {_fmt(h.get(ci_high(TAU)), 2)}]"
                _say(f"      {int(h['step']):>5}  {tau}  {dd}  {_fmt(h.get('all_anchor_tau'))}  "
                     f"{cats}  {_fmt(float(loss) if loss is not None else None)}  "
                     f"{time.perf_counter() - self.start:>5.0f}s")
            self.printed = len(eval_cb.history)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # The untrained drafter, kept so the compare tool can show what training changed.
            first_checkpoint.parent.mkdir(parents=True, exist_ok=True)
            with naming_failures(first_checkpoint):  # Lightning's write error names no file
                trainer.save_checkpoint(str(first_checkpoint))
            dd = "  ".join(f"dd@{b:<3}" for b in budgets)
            _say(f"       step    tau [95% interval]  {dd}  all-anc  count repeat pairs   loss   wall")
            self._flush(trainer)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self._flush(trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._flush(trainer)

    return TauTable()


def train_drafter(cfg: DemoConfig, paths: Paths) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from ..integrations.loops.lightning import DFlashEvalCallback
    from . import synthetic as S
    from .lightning_module import CachedStatesDataModule, DFlashDrafterModule

    dcfg = drafter_config(cfg)
    atomic_write_json(paths.drafter_config, dcfg, indent=2)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module = DFlashDrafterModule(dcfg, states=str(paths.cache_train), lr=cfg.lr, anchors_per_sample=16,
                                 warmup_steps=30, init_seed=cfg.seed)
    chain = cfg.drafter in CHAIN_DRAFTERS
    # A chain drafter reads some of the cache's layers (its config's target_layer_ids).
    data = CachedStatesDataModule(str(paths.cache_train), batch_size=cfg.batch_size, shuffle=True,
                                  layer_ids=list(module.drafter.spec.target_layer_ids) if chain else None)
    n_params = sum(p.numel() for p in module.drafter.parameters())
    shape = (f"1 layer, K = {cfg.block_size - 1} steps, trained on its first step" if chain
             else f"{cfg.drafter_layers} layers, block {cfg.block_size}")
    label = DRAFTERS[cfg.drafter]
    _say(f"[3/4] training the {label} drafter ({shape}, "
         f"{n_params / 1e3:.0f}k parameters) with Lightning for {cfg.steps} steps; DFlashEvalCallback replays the "
         f"greedy loop on the {len(S.FAMILIES)}-category held-out cache every {cfg.eval_every} steps")

    # W&B: offline unless asked (then the user's own login and settings apply); runs land under --out.
    os.environ["WANDB_MODE"] = cfg.wandb_mode
    os.environ.setdefault("WANDB_SILENT", "true")
    wandb_logger = WandbLogger(project=cfg.wandb_project, name=f"demo-seed{cfg.seed}", save_dir=str(paths.out),
                               offline=cfg.wandb_mode == "offline",
                               config={"demo": {k: (str(v) if isinstance(v, Path) else v)
                                                for k, v in asdict(cfg).items()}})
    # Lightning passes anonymous=None explicitly, which only makes wandb print a deprecation warning.
    getattr(wandb_logger, "_wandb_init", {}).pop("anonymous", None)
    csv_logger = CSVLogger(save_dir=str(paths.out), name="csv_logs", version="")
    # At toy scale a full evaluation (every anchor, every budget) costs next to nothing, so the demo
    # runs the full profile each time; a real run keeps the light periodic defaults.
    eval_cb = DFlashEvalCallback(states=str(paths.cache_eval), every_n_train_steps=cfg.eval_every,
                                 ddtree_budgets=cfg.ddtree_budgets, light_ddtree_budgets=cfg.ddtree_budgets,
                                 light_anchor_stride=1, table_samples=3, table_cycles=4,
                                 tokenizer=S.decode, autocast_dtype="float32", console=False,
                                 position_edges=POSITION_EDGES)
    trainer = pl.Trainer(max_steps=cfg.steps, max_epochs=-1, accelerator="cpu", devices=1,
                         logger=[wandb_logger, csv_logger], callbacks=[eval_cb, _tau_printer(eval_cb, cfg.ddtree_budgets,
                                                                        paths.checkpoint_first)],
                         deterministic=True, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=10, num_sanity_val_steps=0)
    start = time.perf_counter()
    with naming_failures(paths.out):  # the loggers' writes (CSV, W&B) land under --out and name no file
        trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - start
    paths.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    with naming_failures(paths.checkpoint):
        trainer.save_checkpoint(str(paths.checkpoint))
    run = wandb_logger.experiment
    run_dir = Path(run.dir).parent  # .../wandb/offline-run-<time>-<id>; run.dir is its files/ folder
    run_url = getattr(run, "url", None) if cfg.wandb_mode == "online" else None
    import wandb

    wandb.finish()
    if not eval_cb.history:
        raise DemoError("DFlashEvalCallback logged no evaluation; see the warnings above")
    return {"history": eval_cb.history, "seconds": seconds, "params": n_params,
            "buffers": {name for name, _ in module.drafter.named_buffers()},
            "wandb_dir": run_dir, "wandb_url": run_url, "csv": Path(csv_logger.log_dir) / "metrics.csv"}


# -- step 4: extract, score, plot, summarize ---------------------------------------------------

def extract_and_score(cfg: DemoConfig, paths: Paths, checkpoint: Path | None = None, drafter_dir: Path | None = None,
                      results_path: Path | None = None) -> Results:
    """What a user does with a finished run: tools/extract_drafter.py, then tools/eval_drafter.py."""
    import torch

    from ..cache.states import StateCache
    from ..core.checkpoints.load import extract_drafter, load_drafter
    from ..core.replay import evaluate
    from ..core.results.results_file import drafter_provenance, report_to_results, write_results

    checkpoint, drafter_dir = checkpoint or paths.checkpoint, drafter_dir or paths.drafter
    info = extract_drafter(checkpoint, drafter_dir)
    cache = StateCache(paths.cache_eval)
    drafter = load_drafter(drafter_dir, device="cpu").eval()  # the class of its family
    report = evaluate(cache, drafter, budgets=cfg.ddtree_budgets, device=torch.device("cpu"))
    provenance = {**drafter_provenance(checkpoint, info["global_step"]), "extracted_to": str(drafter_dir.resolve())}
    results = report_to_results(report, cache, meta={"drafter": provenance, "dtype": "float32",
                                                     "device": "cpu", "threads": cfg.threads, "head_source": "cache"},
                                position_edges=POSITION_EDGES)
    write_results(results, results_path or paths.results)
    return results


def compare_first_last(paths: Paths, first: Results, last: Results) -> dict[str, Any]:
    """tools/compare_results.py on the first and the last checkpoint: Markdown, PNG, and the verdict."""
    from ..core.results.compare import compare, write_comparison

    def label(r: Results) -> str:
        return f"step {r.drafter_step}"

    labels = [label(first), label(last)]
    c = compare(labels, [first, last], position_edges=POSITION_EDGES)
    md, png = paths.comparison.with_suffix(".md"), paths.comparison.with_suffix(".png")
    write_comparison(c, md, png)
    d = c.differences[(0, 1)][TAU]
    # The same comparison from the shell, quoted so that it can be pasted whatever the folder's name.
    command = shlex.join(["python", "tools/compare_results.py", str(paths.results_first), str(paths.results),
                          "--labels", ",".join(labels), "--position-edges", ",".join(map(str, POSITION_EDGES)),
                          "--out", str(paths.comparison)])
    return {"text": d.text, "verdict": d.verdict, "delta": d.interval.value, "low": d.interval.low,
            "high": d.interval.high, "markdown": md, "png": png, "command": command}


def untrained_parts(first: Path, last: Path, buffers: Sequence[str] = ()) -> list[str]:
    """The drafter's submodules whose every weight is the same in the extracted first and last drafters (training
    left them at their init: an objective without a term for them), as ``name.*``. ``buffers``: saved tensors that
    are no weights (EAGLE-3's vocabulary mapping ``d2t``, ``t2d``): no training changes them, so they are left out."""
    import torch
    from safetensors.torch import load_file

    a = {k: v for f in sorted(first.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(last.glob("*.safetensors")) for k, v in load_file(f).items()}
    parts: dict[str, bool] = {}
    for key in sorted((a.keys() & b.keys()) - set(buffers)):
        part = key.split(".")[0]
        parts[part] = parts.get(part, True) and a[key].shape == b[key].shape and torch.equal(a[key], b[key])
    return [f"{part}.*" for part, same in parts.items() if same]


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The whole demo; returns the summary (also written to ``summary.json``)."""
    t0 = time.perf_counter()
    check_wandb(cfg.wandb_mode)
    # An earlier demo's states to reuse: checked before the output folder is touched.
    earlier = check_target_from(cfg) if cfg.target_from is not None else None
    paths = prepare_out(cfg)
    quiet()
    setup_torch(cfg)
    _say(f"dflash-cb demo: seed {cfg.seed}, output in {paths.out}/" + (" (quick)" if cfg.quick else ""))
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if earlier is not None:
        target_info, cache_info = reuse_target(cfg, paths, earlier)
        timings["target"], timings["precompute"] = time.perf_counter() - t, 0.0
    else:
        target_info = build_target(cfg, paths)
        timings["target"] = time.perf_counter() - t
        t = time.perf_counter()
        cache_info = build_caches(cfg, paths)
        timings["precompute"] = time.perf_counter() - t
    t = time.perf_counter()
    tr = train_drafter(cfg, paths)
    timings["drafter_training"] = time.perf_counter() - t
    t = time.perf_counter()
    _say("[4/4] extracting the drafter from the final checkpoint and scoring it (tools/extract_drafter.py, "
         "tools/eval_drafter.py)")
    results = extract_and_score(cfg, paths)
    results_first = extract_and_score(cfg, paths, paths.checkpoint_first, paths.drafter_first, paths.results_first)
    comparison = compare_first_last(paths, results_first, results)
    hist = tr["history"]
    first, last = hist[0], hist[-1]
    top_budget = max(cfg.ddtree_budgets, default=None)
    untrained = untrained_parts(paths.drafter_first, paths.drafter, sorted(tr["buffers"]))
    # The callback's last evaluation and the standalone scoring of the extracted weights must agree exactly.
    if results.tau is not None and abs(results.tau - last[TAU]) > 1e-9:
        raise DemoError(f"the extracted drafter scores tau {results.tau} but the callback logged {last['tau']} "
                        "for the same weights")
    plots = make_plots(hist, cfg.block_size, cfg.ddtree_budgets, paths.plots, family=cfg.drafter)
    timings["extract_score_plots"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    files = {
        "out": paths.out, "target": paths.target, "prompts_train": paths.prompts_train,
        "prompts_eval": paths.prompts_eval, "cache_train": paths.cache_train, "cache_eval": paths.cache_eval,
        "drafter_config": paths.drafter_config, "checkpoint": paths.checkpoint, "drafter": paths.drafter,
        "results": paths.results, "metrics_csv": tr["csv"], "wandb_run": tr["wandb_dir"],
        "checkpoint_first": paths.checkpoint_first, "results_first": paths.results_first,
        "comparison_md": comparison["markdown"], "comparison_png": comparison["png"],
        **{f"plot_{k}": v for k, v in plots.items()}, "summary": paths.summary,
    }
    summary = {
        "tau_first": first[TAU], "tau_last": last[TAU],
        "tau_last_interval": [last.get(ci_low(TAU)), last.get(ci_high(TAU))],
        "first_vs_last": {k: comparison[k] for k in ("text", "verdict", "delta", "low", "high", "command")},
        "ddtree_tau_last": last.get(ddtree_tau(top_budget)) if top_budget else None, "ddtree_budget": top_budget,
        "untrained_parts": untrained,
        "ddtree_tau_last_by_budget": {str(b): last.get(ddtree_tau(b)) for b in cfg.ddtree_budgets},
        "step_first": int(first["step"]), "step_last": int(last["step"]),
        "tau_goal": TAU_GOAL, "goal_reached": last[TAU] >= TAU_GOAL,
        "category_tau_last": {k.split("/")[1]: v for k, v in last.items()
                              if k.startswith("category/") and k == category_tau(k.split("/")[1])},
        "evaluations": [{"step": int(h["step"]), "tau": h[TAU], "tau_ci": [h.get(ci_low(TAU)), h.get(ci_high(TAU))],
                         **{f"ddtree_b{b}": h.get(ddtree_tau(b)) for b in cfg.ddtree_budgets}} for h in hist],
        "seed": cfg.seed, "quick": cfg.quick, "steps": cfg.steps, "eval_every": cfg.eval_every,
        "drafter": cfg.drafter, "block_size": cfg.block_size, "threads": cfg.threads, "wandb_mode": cfg.wandb_mode, "wandb_url": tr["wandb_url"],
        "target": target_info, "caches": cache_info, "drafter_params": tr["params"],
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "paths": {k: str(v) for k, v in files.items()},
    }
    atomic_write_json(paths.summary, _clean(summary), indent=1)
    _print_summary(summary, results, cfg)
    return summary


def expected_band(cfg: DemoConfig, tau: float | None = None) -> str | None:
    """The line saying what last tau to expect (``MEASURED_TAU``: the seeds' spread where it was measured, and
    this seed's figure there), for the default demo only (another drafter, --quick or other steps train another
    drafter); with ``tau``, whether this run's figure is inside the band."""
    if cfg.drafter != DEFAULT_FAMILY or cfg.quick or cfg.steps != DemoConfig.steps or cfg.block_size != DemoConfig.block_size:
        return None
    lo, hi = min(MEASURED_TAU.values()), max(MEASURED_TAU.values())
    seeds = sorted(MEASURED_TAU)
    there = f"; seed {cfg.seed} gave {MEASURED_TAU[cfg.seed]:.3f} there" if cfg.seed in MEASURED_TAU else ""
    inside = "" if tau is None else f": this run's {tau:.3f} is {'inside' if lo <= tau <= hi else 'outside'} it"
    return (f"to expect: {lo:.3f} to {hi:.3f}, the last tau of seeds {seeds[0]}-{seeds[-1]} on {MEASURED_ON} with "
            f"{MEASURED_THREADS} torch thread{there}{inside} (another CPU or thread count rounds differently and "
            "trains elsewhere: docs/getting-started.md)")


def _print_summary(s: dict[str, Any], results: Results, cfg: DemoConfig) -> None:
    p = s["paths"]
    _say("")
    _say("=" * 78)
    _say(f"tau (greedy speculative loop, exact offline replay on {s['caches']['eval']['samples']} held-out prompts)")
    _say(f"  first evaluation (step {s['step_first']:>4}): {s['tau_first']:.3f}")
    lo, hi = s["tau_last_interval"]
    _say(f"  last evaluation  (step {s['step_last']:>4}): {s['tau_last']:.3f} [{_fmt(lo, 2)}, {_fmt(hi, 2)}]"
         + ("" if cfg.quick else f"   (goal >= {TAU_GOAL}: {'reached' if s['goal_reached'] else 'NOT reached'})"))
    band = expected_band(cfg, s["tau_last"])
    if band:
        _say(f"  {band}")
    family = family_named(results.family)
    _say(f"  DDTree tau, budget {s['ddtree_budget']}: {_fmt(s['ddtree_tau_last'])}" if s["ddtree_budget"] else
         f"  DDTree: not scored ({family.tree_refusal()})")
    _say("  tau per category: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in sorted(s["category_tau_last"].items())))
    if s["untrained_parts"]:
        _say(f"  {family.label}: {', '.join(s['untrained_parts'])} left at their initial weights: the demo's "
             "training objective has no term for them, so every figure here scores them untrained")
    _say(f"  same replay, per-request means: tau {_fmt(results.metric(TAU_REQUEST_MEAN))}   served convention "
         f"(SGLang spec_accept_length) {_fmt(results.metric(ACCEPT_LENGTH_SERVED))}")
    _say(f"  all-anchor mean: {_fmt(results.metric(ALL_ANCHOR_TAU))}   SpecForge DFlash accuracy: "
         f"{_fmt(results.metric(SPECFORGE_ACC))}   independent-depth chain estimate: "
         f"{_fmt(results.metric(CHAIN_TAU_ESTIMATE))}")
    own = [f for f in (*family.figures.walks, *family.figures.pooled) if results.metric(f.key) is not None]
    if own:  # the family's own figures (DFlash 2: where its tau is lost)
        _say(f"  {family.label}: " + ", ".join(f"{f.label} {_fmt(results.metric(f.key))}" for f in own))
    for remark in family.figures.remarks(results.metric):
        _say(f"  {family.label}: {remark}")
    _say(f"  first vs last checkpoint (paired, same prompts): {s['first_vs_last']['text']}: "
         f"{s['first_vs_last']['verdict']}")
    _say("  [..] = 95% interval over the choice of prompts (cluster bootstrap over the held-out prompts)")
    for title, key in (("tau by cycle index after the prompt", "cycle"),
                       ("tau by anchor position in the completion", "position")):
        rows = results.breakdown.get(key) or {}
        _say(f"  {title}: " + ", ".join(f"{b} {_fmt(r['tau'], 2)}" for b, r in rows.items() if r["cycles"]))
    _say("")
    _say(f"  W&B run ({s['wandb_mode']}):  {p['wandb_run']}"
         + (f"\n                     {s['wandb_url']}" if s.get("wandb_url") else
            f"\n                     upload later with: {shlex.join(['wandb', 'sync', p['wandb_run']])}"))
    _say(f"  caches:             {p['cache_train']} (training), {p['cache_eval']} (evaluation)")
    _say(f"  results:            {p['results']}  (the extracted drafter {p['drafter']}, scored like "
         "tools/eval_drafter.py)")
    _say(f"  metrics (CSV):      {p['metrics_csv']}")
    _say(f"  comparison:         {p['comparison_md']}, {p['comparison_png']}")
    _say(f"                      again: {s['first_vs_last']['command']}")
    _say(f"  plots:              {p['plot_tau_over_steps']}, {p['plot_per_depth_acceptance']}, "
         f"{p['plot_accepted_lengths_hist']}")
    _say(f"  summary:            {p['summary']}")
    t = s["timings_s"]
    _say(f"  wall time:          {t['total']:.0f}s (target {t['target']:.0f}s, precompute {t['precompute']:.0f}s, "
         f"drafter training {t['drafter_training']:.0f}s; {cfg.threads} torch thread(s))")
    _say("=" * 78)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="demo.py",
        description="End-to-end CPU demo: tiny target -> precomputed states -> DFlash drafter trained with "
                    "Lightning and DFlashEvalCallback (tau per evaluation, W&B offline, plots, summary.json).")
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    p.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    p.add_argument("--steps", type=int, default=None, help="drafter training steps (default 1200; --quick: 150)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default 100; --quick: 50)")
    p.add_argument("--quick", action="store_true",
                   help="reduced form for CI (smaller target training, fewer prompts and steps; no tau goal)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous demo's output folder")
    p.add_argument("--wandb-mode", choices=["offline", "online"], default="offline",
                   help="offline (default; sync later with `wandb sync`) or online (needs `wandb login`)")
    p.add_argument("--wandb-project", default="dflash-cb-demo", help="W&B project (default dflash-cb-demo)")
    p.add_argument("--threads", default=None, help=THREADS_HELP)
    p.add_argument("--target-from", default=None, metavar="DIR",
                   help="reuse the target, prompts and caches of an earlier demo's --out (same --seed and --quick): "
                        "train only another drafter on the same states, e.g. to set families side by side")
    p.add_argument("--drafter", choices=list(DRAFTERS), default=DEFAULT_FAMILY,
                   help=f"the drafter family to train: {', '.join(DRAFTERS)} (default {DEFAULT_FAMILY}); a family "
                        "with figures of its own (DFlash 2's selector, a head's 'off' tau) adds them to the summary; "
                        f"one whose drafts make no DDTree is scored without budgets; {' and '.join(CHAIN_DRAFTERS)} are "
                        "chain drafters, trained on their first step only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = DemoConfig.resolve(a.out, a.seed, a.steps, a.eval_every, a.quick, overwrite=a.overwrite,
                                 wandb_mode=a.wandb_mode, wandb_project=a.wandb_project,
                                 threads=parse_threads(a.threads), drafter=a.drafter,
                                 target_from=Path(a.target_from) if a.target_from else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_demo(cfg)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.require_goal and not summary["goal_reached"]:
        print(f"error: the last tau {summary['tau_last']:.3f} is below {TAU_GOAL}", file=sys.stderr)
        return 1
    return 0


command = cli.command(main)  # the ``dflash-demo`` console command
