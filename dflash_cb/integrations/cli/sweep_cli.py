"""The command line of ``tools/sweep_checkpoints.py`` (``dflash-sweep``): the edge only (arguments, the checks that
must pass before any work, the process group under ``torchrun``); the sweep itself is ``sweep.Sweep``."""

from __future__ import annotations

import argparse
import glob
import os
from collections.abc import Sequence
from pathlib import Path

from ...common import cli
from ...common.log import say
from ..evaluator.scoring import add_scoring_options

USAGE = """Score every checkpoint of a training run on a cache: tau over the steps, the best checkpoint, W&B panels.

    python tools/sweep_checkpoints.py runs/exp1/checkpoints --states cached_states/qwen36-27b-v1 \\
        --out sweeps/exp1 [--config drafter_config.json] [--prefix drafter.] [eval_drafter's options]
        [--watch [--poll-seconds S] [--max-checkpoints N | --until-step S]]
        [--wandb-project P | --wandb-run-id ID]

Checkpoints: Lightning .ckpt files, Hugging Face checkpoint-N/ folders, SpecForge <run>-stepN/ folders, a plain
loop's .pt files, saved drafter folders; a folder is searched, a glob pattern expanded. Each is scored as
tools/eval_drafter.py scores the folder tools/extract_drafter.py makes of it, with the cache opened, hashed and
its head loaded once. Writes OUT/sweep.json (the entries in step order and the best), one results.json per
checkpoint (OUT/results/), and OUT/sweep.md with OUT/sweep.png. A second run scores only what it has not
scored (a checkpoint written again is scored again); --watch keeps scoring new checkpoints as a run writes
them. Under torchrun the ranks share the checkpoints. Every argument is checked before any work; a problem is
one line naming the file or option and the fix, exit code 2.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep_checkpoints.py", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="checkpoint files or folders, folders to search, or glob patterns (quoted: 'runs/*/ckpt-*')")
    p.add_argument("--out", required=True,
                   help="the sweep's folder: sweep.json, results/, sweep.md, sweep.png (a sweep there is resumed)")
    p.add_argument("--config", default=None,
                   help="drafter config.json, for checkpoints that carry none (as tools/extract_drafter.py --config)")
    p.add_argument("--prefix", default=None,
                   help="key prefix of the drafter in the checkpoints (default: found; as tools/extract_drafter.py)")
    add_scoring_options(p)  # --states and tools/eval_drafter.py's evaluation options
    p.add_argument("--watch", action="store_true",
                   help="keep running: score new checkpoints once they are completely written (Ctrl-C ends it, the "
                        "sweep written)")
    p.add_argument("--poll-seconds", default="30",
                   help="--watch: look for new checkpoints this often; a checkpoint is scored once it is complete "
                        "and unchanged for this long (default 30)")
    p.add_argument("--max-checkpoints", default=None, help="--watch: stop once the sweep holds N scored checkpoints")
    p.add_argument("--until-step", default=None, help="--watch: stop once a checkpoint of step S or later is scored")
    p.add_argument("--wandb-project", default=None,
                   help="log the curve to a W&B run of this project under the live evaluation's keys and step axis "
                        "(a new run; a resumed sweep goes on in the run it logged to)")
    p.add_argument("--wandb-run-id", default=None,
                   help="log into this existing W&B run (e.g. the training run), resumed; with --wandb-project when "
                        "the run is not in W&B's default project")
    p.add_argument("--wandb-name", default=None, help="W&B run name (a new run)")
    p.add_argument("--wandb-entity", default=None, help="W&B entity (default: W&B's own setting)")
    return p


def _out_folder(out: Path, states: str) -> None:
    """``--out``: a folder that is new, empty, or a sweep's; never inside the cache."""
    from ...common.errors import DFlashCBError
    from ...core.results.results_file import check_results_path
    from ...core.results.sweep_record import RESULTS_FOLDER, SWEEP_FILE
    from ...core.results.sweep_report import REPORT_MD, REPORT_PNG

    if out.exists() and not out.is_dir():
        raise DFlashCBError(f"--out {out}: is a file; give a folder for the sweep (sweep.json, results/, sweep.md)")
    real, cache = os.path.realpath(out), os.path.realpath(states)
    if real == cache or real.startswith(cache.rstrip(os.sep) + os.sep):
        raise DFlashCBError(f"--out {out}: is inside the cache --states {states}; choose a folder apart from it")
    if out.is_dir() and not (out / SWEEP_FILE).is_file():
        # A checkpoint's (or a model's) own folder: a sweep's files beside its weights would ship with them.
        own = sorted(p.name for p in out.iterdir() if p.name in ("config.json", "trainer_state.json",
                                                                  "training_state.pt") or p.suffix in (".ckpt", ".safetensors"))
        if own:
            raise DFlashCBError(f"--out {out}: is a checkpoint folder (it holds {', '.join(own[:3])}), not a sweep's; "
                                "the sweep writes sweep.json, results/ and sweep.md: give --out a new folder, e.g. "
                                f"--out {out.parent / 'sweep'}")
        other = sorted(p.name for p in out.iterdir() if p.name not in (RESULTS_FOLDER, REPORT_MD, REPORT_PNG)
                       and not p.name.startswith("."))
        if other:
            raise DFlashCBError(f"--out {out}: the folder holds {', '.join(other[:4])}{' ...' if len(other) > 4 else ''} "
                                "and no sweep.json; choose a new folder (or an earlier sweep's)")
    check_results_path(out / SWEEP_FILE, "--out", SWEEP_FILE)  # writable: parents made, a probe written


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, object]:
    """The arguments, every one checked (no scoring, no hashing): ``(args, SweepOptions)``."""
    from ...common.arguments import parse_int
    from ...common.errors import DFlashCBError
    from ...common.fileio import check_outputs_apart
    from ...core.checkpoints.files import find_checkpoints
    from ...core.checkpoints.load import read_drafter_config
    from ..evaluator.scoring import ScoringOptions
    from .sweep import SweepOptions, check_found

    args = build_parser().parse_args(argv)
    out = Path(args.out)
    given = [p for p in args.paths if not glob.has_magic(p)]
    check_outputs_apart([("--states", args.states), ("--target", args.target), ("--config", args.config),
                         *(("PATH", p) for p in given)], folders=[("--out", out)])
    # What the paths name, before anything is written (a watcher may start before the run wrote anything).
    check_found(find_checkpoints(args.paths, skip=[out, args.states], require=not args.watch), out, first=True)
    try:
        poll = float(args.poll_seconds)
    except ValueError:
        poll = -1.0
    if not poll > 0 or poll != poll:
        raise DFlashCBError(f"--poll-seconds {args.poll_seconds!r}: expected a positive number of seconds")
    max_checkpoints = parse_int("--max-checkpoints", args.max_checkpoints, 1) if args.max_checkpoints else None
    until_step = parse_int("--until-step", args.until_step, 0) if args.until_step is not None else None
    if not args.watch and (max_checkpoints is not None or until_step is not None):
        raise DFlashCBError("--max-checkpoints and --until-step stop a --watch; without --watch the sweep stops when "
                            "every checkpoint found is scored: add --watch or drop them")
    if args.wandb_name and args.wandb_run_id:
        raise DFlashCBError("--wandb-name names a new run; --wandb-run-id logs into an existing one: drop one")
    config = read_drafter_config(args.config) if args.config else None
    scoring = ScoringOptions.from_args(args)
    options = SweepOptions(tuple(args.paths), out, scoring, config, args.prefix, args.watch, poll, max_checkpoints,
                           until_step, args.wandb_project, args.wandb_run_id, args.wandb_name, args.wandb_entity)
    _out_folder(out, args.states)  # last: it makes the folder
    return args, options


def _process_group(device_type: str) -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), the ranks' process group: gloo carries the sweep's small messages
    whatever the device (each rank scores on its own GPU; no tensor crosses ranks), with a timeout a long
    checkpoint fits in. True when this call made it."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(hours=12))
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return True


def main(argv: Sequence[str] | None = None) -> int:
    from dataclasses import replace

    import torch

    from ...core.results.sweep_record import load_sweep
    from ..evaluator.scoring import CacheScorer
    from .sweep import Sweep, terminated_as_interrupt

    args, options = parse(argv)
    made = _process_group(options.scoring.device.type)
    try:
        scoring = options.scoring
        if made and scoring.device.type == "cuda" and scoring.device.index is None:
            scoring = replace(scoring, device=torch.device("cuda", torch.cuda.current_device()))
            options = replace(options, scoring=scoring)
        scorer = CacheScorer(scoring)
        sweep = Sweep(options, scorer, load_sweep(options.out))  # a resume with other settings is refused here
        try:
            with terminated_as_interrupt():
                sweep.run()
        except KeyboardInterrupt:
            saved = load_sweep(options.out)  # what the file holds: an entry scored as Ctrl-C came may not be in it
            say(f"stopped: {len(saved.entries) if saved is not None else 0} checkpoint(s) in "
                f"{options.out / 'sweep.json'}")
            return 0 if options.watch else 130
        record = sweep.record
        best = record.best
        say(f"scored {sweep.scored_now} checkpoint(s) now, {len(record.entries)} in all; "
            + (f"best: step {best.step} ({best.checkpoint}), tau {best.tau:.3f}; " if best is not None else "")
            + (f"{len(record.failed)} not scored (listed in sweep.json); " if record.failed else "")
            + f"wrote {options.out / 'sweep.json'}, {options.out / 'sweep.md'}"
            + (f", {options.out / 'sweep.png'}" if (options.out / "sweep.png").is_file() else ""))
        if (options.wandb_project or options.wandb_run_id) and record.wandb.get("dir"):
            run_dir = Path(record.wandb["dir"]).parent
            if run_dir.name.startswith("offline-run"):
                say(f"W&B (offline): python tools/wandb_panels.py --run {run_dir} --show")
        if not record.entries and record.failed:
            from ...common.errors import DFlashCBError

            raise DFlashCBError(f"no checkpoint could be scored: {record.failed[0].checkpoint}: "
                                f"{record.failed[0].error}")
        return 0
    finally:
        if made:
            from ..evaluator.distributed import end_process_group

            end_process_group()


command = cli.command(main)  # the ``dflash-sweep`` console command
