"""The command line of ``tools/specforge_train.py``: SpecForge's own ``specforge train``, with the live
evaluation attached to the controller it builds (``specforge.attach``), and no edit of SpecForge's files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...common import cli
from ...common.arguments import ArgumentError

USAGE = """Train with SpecForge 0.2.0's command line, with the drafter's exact tau measured while it trains.

    python tools/specforge_train.py --states cached_states/qwen36-27b-v1 --every-n-train-steps 500 \\
        [--keep-best-by-tau] [--eval-config eval.yaml] -- --config run.yaml [section.field=value ...]

Everything after -- is `specforge train`'s own arguments. Several ranks: start each rank with torchrun
(`torchrun --nproc_per_node 8 tools/specforge_train.py ...`); SpecForge's self-launch would start workers
without the evaluation, so it is refused. The numbers go to SpecForge's logger (console and tracker; its
trackers add `train/` to keys that are not `train/` or `eval/`), and its evaluations get this step's figures.
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specforge_train.py", description=USAGE, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", required=True, help="cache folder written by tools/precompute_states.py")
    p.add_argument("--every-n-train-steps", default="500",
                   help="evaluate after every N optimizer steps (0: only before the first and after the last)")
    p.add_argument("--keep-best-by-tau", action="store_true",
                   help="SpecForge keeps the checkpoint with the best dflash_eval/tau instead of its "
                        "eval/simulated_acc_len (needs training.eval_interval and an eval set)")
    p.add_argument("--eval-config", default=None,
                   help="YAML mapping of the evaluator's other options (EvalConfig's fields: ddtree_budgets, "
                        "num_samples, prefix, ...)")
    return p.parse_args(argv)


def read_eval_config(path: str) -> dict[str, Any]:
    """``--eval-config``: a YAML mapping of ``EvalConfig`` fields (checked by the config itself)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ArgumentError(f"--eval-config {path}: not YAML ({e}); write a mapping of EvalConfig's fields, "
                            "e.g. 'ddtree_budgets: [16, 32]'") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ArgumentError(f"--eval-config {path}: expected a mapping of EvalConfig's fields, found a "
                            f"{type(data).__name__}")
    reserved = sorted({"states", "every_n_train_steps"} & set(data))
    if reserved:
        raise ArgumentError(f"--eval-config {path}: {', '.join(reserved)} belong on the command line "
                            "(--states, --every-n-train-steps)")
    return data


def _needs_own_evaluations(cfg: Any) -> str | None:
    """Why ``--keep-best-by-tau`` cannot work with this SpecForge config (None: it can)."""
    if cfg.training.eval_interval > 0 and (cfg.data.eval_hidden_states_path or cfg.data.eval_data_path):
        return None
    return (f"--keep-best-by-tau: SpecForge picks its best checkpoint at its own evaluations, and this config has "
            f"none (training.eval_interval={cfg.training.eval_interval}, data.eval_hidden_states_path="
            f"{cfg.data.eval_hidden_states_path!r}); set both, or drop --keep-best-by-tau")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            parse_args(argv)
        raise ArgumentError("put SpecForge's train arguments after --, e.g. python tools/specforge_train.py "
                            "--states CACHE -- --config run.yaml")
    cut = argv.index("--")
    args, theirs = parse_args(argv[:cut]), argv[cut + 1:]

    from ...cache.states import StateCache
    from ...common.arguments import parse_int
    from ..loops.specforge import attach, evaluation_config

    every = parse_int("--every-n-train-steps", args.every_n_train_steps, 0, note="0 = no periodic evaluations")
    config = evaluation_config(args.states, every, read_eval_config(args.eval_config) if args.eval_config else {})
    StateCache(config.states)  # the cache's manifest, before SpecForge loads a model

    import specforge.application as application
    import specforge.launch_plan as launch_plan
    from specforge import cli as specforge_cli
    from specforge.training.checkpoint import CheckpointManager

    build = application.build_application_run
    run_commands = launch_plan.run_commands

    def build_and_attach(run: Any, *a: Any, **kw: Any) -> Any:
        cfg = getattr(run, "config", run)
        if args.keep_best_by_tau and cfg.training.role != "producer" and _needs_own_evaluations(cfg):
            raise ArgumentError(_needs_own_evaluations(cfg))  # before any model is loaded
        built = build(run, *a, **kw)
        trainer = getattr(built, "trainer", None)
        if trainer is not None:  # a producer (capture only) trains nothing
            resume = cfg.training.resume_from
            attach(trainer._controller, config, keep_best_by_tau=args.keep_best_by_tau,
                   resume_from=CheckpointManager.resolve_resume_dir(resume) if resume else None)
        return built

    def refuse(*a: Any, **kw: Any) -> int:
        raise ArgumentError("this SpecForge config starts worker processes itself, which would train without the "
                            "evaluation; start the ranks with torchrun instead: torchrun --nproc_per_node N "
                            "tools/specforge_train.py ... -- --config ...")

    import specforge.distributed as specforge_distributed

    from ..evaluator.distributed import end_process_group

    teardown = specforge_distributed.destroy_distributed

    def teardown_together() -> None:  # every rank done before any tears the groups down
        end_process_group(destroy=teardown)

    application.build_application_run, launch_plan.run_commands = build_and_attach, refuse
    specforge_distributed.destroy_distributed = teardown_together
    try:
        return int(specforge_cli.main(["train", *theirs]) or 0)
    finally:
        application.build_application_run, launch_plan.run_commands = build, run_commands
        specforge_distributed.destroy_distributed = teardown


command = cli.command(main)  # the ``dflash-specforge-train`` console command
