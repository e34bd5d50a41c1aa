"""Score every checkpoint of a training run on one cache (``tools/sweep_checkpoints.py``, ``dflash-sweep``).

The cache is opened, checked, hashed and its head loaded once (``scoring.CacheScorer``); each checkpoint's drafter
is read in memory as ``extract_drafter`` reads it (``checkpoints.drafter_in_checkpoint``) and scored as
``eval_drafter`` scores a folder. ``sweep.json`` (``core.sweep_record``) is rewritten atomically after every
checkpoint and every entry's ``results.json`` is written before it, so a sweep stopped anywhere (Ctrl-C, a kill)
resumes without scoring again what it scored; a checkpoint whose files changed (``file_identity``) is scored
again. With ``watch`` the sweep keeps looking for new checkpoints and scores each once it is completely
written. Under ``torchrun`` the ranks share the checkpoints: rank zero finds them and hands each rank its own
in waves (one checkpoint per rank), every rank scores its own on its device and writes its results file, and
rank zero gathers the entries, writes the sweep, the report and the W&B run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...cache.manifest import CacheError
from ...cache.states import CacheMismatchError, StateCache
from ...common import log
from ...common.arguments import ArgumentError
from ...common.errors import DFlashCBError
from ...core.checkpoints.files import CheckpointKind, FoundCheckpoint, find_checkpoints
from ...core.checkpoints.load import CheckpointError, NoDrafterConfigError, drafter_in_checkpoint
from ...core.results.report import evaluation_line
from ...core.results.results_file import Results, drafter_provenance, load_results
from ...core.results.sweep_record import (
    RESULTS_FOLDER,
    SweepEntry,
    SweepError,
    SweepFailure,
    SweepRecord,
    config_digest,
    results_name,
    settings_digest,
)
from ..evaluator.distributed import all_gather, world
from ..evaluator.scoring import CacheScorer, ScoringOptions
from ..tracking.wandb_logging import results_scalars
from .sweep_wandb import SweepWandb

logger = log.get_logger(__name__)


class SweepStop(DFlashCBError):
    """Another rank could not go on (its error is named): every rank stops."""


@dataclass(frozen=True)
class SweepOptions:
    """What the command line asked for, checked (``sweep_cli``)."""

    paths: tuple[str, ...]
    out: Path
    scoring: ScoringOptions
    config: dict[str, Any] | None = None  # --config: the drafter config of checkpoints that carry none
    prefix: str | None = None  # --prefix: the drafter's key prefix in the checkpoints
    watch: bool = False
    poll_seconds: float = 30.0
    max_checkpoints: int | None = None  # --watch: stop once the sweep holds this many entries
    until_step: int | None = None  # --watch: stop once a checkpoint of this step or later is scored
    wandb_project: str | None = None
    wandb_run_id: str | None = None
    wandb_name: str | None = None
    wandb_entity: str | None = None


def sweep_settings(options: SweepOptions, scorer: CacheScorer) -> dict[str, Any]:
    """What every entry of the sweep shares (``sweep_record.SETTING_OPTIONS``), and what describes it."""
    o = options.scoring
    return {
        "cache_path": str(scorer.cache.path.resolve()), "cache_manifest_sha256": scorer.cache.manifest_sha256,
        "ddtree_budgets": list(o.budgets), "anchor_stride": o.anchor_stride, "anchor_seed": o.anchor_seed,
        "block_size_option": o.block_size, "series": None, "tail_blocks": o.tail_blocks, "dtype": o.dtype_name,
        "device_type": o.device.type, "sample_selection": o.selection, "samples_evaluated": len(scorer.ids),
        "position_edges": list(o.position_edges), "head_source": str(Path(o.target).resolve()) if o.target else "cache",
        "drafter_config_sha256": config_digest(options.config), "prefix": options.prefix,
        # What is swept (not in the settings digest: a sweep of older files keeps its entries).
        "checkpoint_paths": sorted(str(Path(p).resolve()) for p in options.paths),
    }


# -- what moves between the ranks ------------------------------------------------------------------

@dataclass
class Planned:
    """A checkpoint to score, as rank zero found it."""

    path: str
    kind: str
    identity: list[list[Any]]

    @property
    def found(self) -> FoundCheckpoint:
        return FoundCheckpoint(Path(self.path), CheckpointKind(self.kind))


@dataclass
class Plan:
    """Rank zero's decision for one round, sent to every rank."""

    todo: list[Planned] = field(default_factory=list)
    steps: dict[int, str] = field(default_factory=dict)  # steps already scored: step -> checkpoint
    block_size: int | None = None  # the sweep's block, once an entry set it
    family: str | None = None  # the sweep's drafter family, likewise: one curve is one family's
    stop: bool = False
    error: str | None = None  # rank zero's reason to stop every rank


@dataclass
class Outcome:
    """What a rank did with its checkpoint of a wave."""

    entry: SweepEntry | None = None
    failure: SweepFailure | None = None
    fatal: str | None = None  # every rank stops (the cache changed, a bug, a drafter that does not fit the cache)


@dataclass
class Prepared:
    """A checkpoint read and its drafter checked, ready to score."""

    planned: Planned
    drafter: Any
    fit: Any
    step: int
    step_from: str


def _broadcast(obj: Any) -> Any:
    """Rank zero's ``obj`` on every rank (``distributed.all_gather``: tiny objects)."""
    return all_gather(obj)[0]


# -- one rank's work ---------------------------------------------------------------------------------

class CheckpointScorer:
    """Reads, checks and scores checkpoints on this rank (its device); writes each one's ``results.json``."""

    def __init__(self, options: SweepOptions, scorer: CacheScorer, digest: str) -> None:
        self.options, self.scorer, self.digest = options, scorer, digest
        self.rank = world()[0]

    def prepare(self, planned: Planned, plan: Plan) -> Prepared | Outcome:
        """The checkpoint's drafter, read in memory and checked against the cache and the sweep; a checkpoint
        that cannot be scored is an ``Outcome`` with its failure (a fatal one when the drafter does not fit the
        cache, or no config is known, before anything was scored or hashed: the same holds for every checkpoint of
        the run, so it is said once, before the cache is hashed)."""
        found = planned.found
        first = self.scorer.session is None and not plan.steps

        def failed(why: str) -> Outcome:
            return Outcome(failure=SweepFailure(planned.path, planned.identity, why.removeprefix(f"{planned.path}: ")))

        try:
            read = drafter_in_checkpoint(found.path, self.options.config, self.options.prefix)
        except NoDrafterConfigError as e:  # the same for every checkpoint of the run: said once, before any hashing
            return Outcome(fatal=log_text(e)) if first else failed(log_text(e))
        except (CheckpointError, OSError) as e:
            return failed(log_text(e))
        step, step_from = read.info["global_step"], "checkpoint"
        if step is None:
            step, step_from = found.name_step, "name"
        if step is None:
            recorded = read.info.get("step_problem")
            what = (f"{recorded}, and none in its name" if recorded else
                    "no training step, neither recorded in the checkpoint nor in its name")
            return failed(f"{what}; name it with its step (e.g. step-500, checkpoint-500)")
        other = plan.steps.get(step)
        if other is not None and other != planned.path:
            return failed(f"step {step} is scored already, from {other}: two checkpoints of one step would be two "
                          "points at one step of the curve; remove one of them (or sweep them apart)")
        drafter = read.model.to(self.options.scoring.device)
        try:
            fit = self.scorer.check(drafter, planned.path)
        except (CacheMismatchError, CacheError, ArgumentError) as e:
            return Outcome(fatal=log_text(e)) if first else failed(log_text(e))
        if plan.family is not None and fit.spec.family != plan.family:
            return failed(f"its drafter is a {fit.spec.family} drafter, the sweep's entries {plan.family} drafters: one "
                          "curve is one family's; sweep it into another --out")
        if plan.block_size is not None and fit.block_size != plan.block_size:
            return failed(f"its drafter drafts blocks of {fit.block_size}, the sweep's entries blocks of "
                          f"{plan.block_size}: one series is one block (pass --block-size {plan.block_size}, or "
                          "sweep it into another --out)")
        return Prepared(planned, drafter, fit, step, step_from)

    def score(self, p: Prepared) -> Outcome:
        """Score a prepared checkpoint and write its ``results.json`` (atomically) before reporting it."""
        planned = p.planned
        name = results_name(planned.path, p.step)
        results, _ = self.scorer.score(p.drafter, p.fit, drafter_provenance(planned.path, p.step), meta={"sweep": {
            "checkpoint": planned.path, "kind": planned.kind, "identity": planned.identity, "step": p.step,
            "step_from": p.step_from, "settings": self.digest, "rank": self.rank}})
        from ...core.results.results_file import write_results

        write_results(results, self.options.out / name)
        return Outcome(entry=entry_of(results, name))


def entry_of(results: Results, name: str) -> SweepEntry:
    """The sweep entry of a results file the sweep wrote (its ``meta.sweep``)."""
    s = results.meta["sweep"]
    # The family beside what identifies the figures: a DFlash and a DFlash 2 checkpoint are two curves.
    return SweepEntry(s["checkpoint"], s["kind"], int(s["step"]), s["step_from"], s["identity"], name,
                      results_scalars(results, prefix=""), {**results.series, "family": results.family},
                      int(s.get("rank", 0)))


def log_text(e: BaseException) -> str:
    """An error as one line (a CacheMismatchError lists its problems on lines of their own)."""
    return " ".join(str(e).split()) or type(e).__name__


def recover_entries(record: SweepRecord, folder: Path, digest: str) -> list[SweepEntry]:
    """Results files of this sweep's settings that ``sweep.json`` does not list (written just before a kill, or
    by another rank): their entries, so they are not scored again."""
    listed = {e.results for e in record.entries}
    found = []
    for path in sorted((folder / RESULTS_FOLDER).glob("*.json")):
        name = f"{RESULTS_FOLDER}/{path.name}"
        if name in listed:
            continue
        try:
            results = load_results(path)
        except DFlashCBError:
            continue  # not one of ours, or damaged: it is written again if its checkpoint is scored
        sweep = results.meta.get("sweep")
        if isinstance(sweep, dict) and sweep.get("settings") == digest:
            found.append(entry_of(results, name))
    return found


# -- the sweep -------------------------------------------------------------------------------------

class Sweep:
    """The rounds of a sweep: rank zero plans, every rank scores its share of each wave, rank zero records."""

    def __init__(self, options: SweepOptions, scorer: CacheScorer, record: SweepRecord | None) -> None:
        self.options, self.scorer = options, scorer
        self.rank, self.world = world()
        settings = sweep_settings(options, scorer)
        if record is not None:
            record.check_settings(settings, options.out)  # before any work: one series per sweep
            before = record.settings.get("checkpoint_paths")
            if before is not None and before != settings["checkpoint_paths"]:
                raise SweepError(f"--out {options.out}: its sweep is of {', '.join(before)}; this run sweeps "
                                 f"{', '.join(settings['checkpoint_paths'])}: two sweeps in one --out would mix "
                                 "their curves; give this run another --out (or the same paths to add to it)")
            record.settings["checkpoint_paths"] = settings["checkpoint_paths"]
        self.record = record if record is not None else SweepRecord(settings)
        self.digest = settings_digest(self.record.settings)
        self.worker = CheckpointScorer(options, scorer, self.digest)
        self.tracker: SweepWandb | None = None
        self._previous: dict[str, list[list[Any]]] = {}  # identities at the last look (watch: settled?)
        self._tried: set[str] = set()  # failures of this run, by checkpoint and identity: not retried unchanged
        self._waiting: dict[str, str] = {}  # checkpoints being written, and why (said once)
        self._read_while_written: set[str] = set()  # checkpoints whose files changed while being read (said once)
        self.scored_now = 0
        self._bar: Any = None

    # -- rank zero ---------------------------------------------------------------------------
    def begin(self) -> Plan:
        """Rank zero: the record with the entries a kill left only as results files, written; W&B opened."""
        o = self.options
        (o.out / RESULTS_FOLDER).mkdir(parents=True, exist_ok=True)
        for entry in recover_entries(self.record, o.out, self.digest):
            if self.record.conflict(entry) is None:
                self.record.add(entry)
        self.record.save(o.out)
        if o.wandb_project or o.wandb_run_id:
            self.tracker = SweepWandb(o, self.record, self.scorer)
            # Entries scored by an earlier run that this run has not received (another project or run id, a run
            # W&B failed): logged now, not only when something new is scored.
            self._to_wandb("logging to", lambda t: t.log(self.record, o.out))
            self.record.save(o.out)
        return Plan()

    def plan(self, first: bool) -> Plan:
        """Rank zero: the checkpoints to score now (found, not scored as they are, and, with ``watch``, completely
        written: complete by their kind and unchanged since the last look or older than a poll)."""
        o, record = self.options, self.record
        found = find_checkpoints(o.paths, skip=[o.out, o.scoring.states], require=first and not o.watch)
        check_found(found, o.out, first)
        record.failed = [f for f in record.failed if os.path.lexists(f.checkpoint)]  # rotated away since
        todo = []
        for c in found:
            path = str(c.path)
            identity = c.identity()
            if record.scored(path, identity) is not None:
                continue
            key = json.dumps([path, identity])
            if key in self._tried:
                continue
            if o.watch:
                why = c.incomplete()
                settled = self._previous.get(path) == identity or time.time() - c.newest_mtime() >= o.poll_seconds
                self._previous[path] = identity
                if why is not None or not settled:
                    if why is not None and self._waiting.get(path) != why:
                        log.say(f"waiting for {path}: {why}")
                    self._waiting[path] = why or "being written"
                    continue
                self._waiting.pop(path, None)
            todo.append(Planned(path, c.kind.value, identity))
        if o.max_checkpoints is not None:
            todo = todo[: max(0, o.max_checkpoints - len(record.entries))]
        return Plan(todo, {e.step: e.checkpoint for e in record.entries}, record.block_size, record.family,
                    self._done())

    @staticmethod
    def _changed_since_planned(p: Planned) -> bool:
        try:
            return p.found.identity() != p.identity
        except OSError:  # a file gone or renamed under it: a writer at work
            return True

    def _done(self) -> bool:
        o, entries = self.options, self.record.entries
        if o.max_checkpoints is not None and len(entries) >= o.max_checkpoints:
            return True
        return o.until_step is not None and any(e.step >= o.until_step for e in entries)

    def record_wave(self, planned: Sequence[Planned], outcomes: Sequence[Outcome | None]) -> None:
        """Rank zero: the wave's entries and failures recorded, ``sweep.json`` rewritten, one line each."""
        budgets = self.options.scoring.budgets
        for p, outcome in zip(planned, outcomes, strict=False):
            if outcome is None:
                continue
            if outcome.failure is not None:
                if self.options.watch and self._changed_since_planned(p):
                    # Its files changed while it was read: still being written, not damaged; looked at again.
                    if p.path not in self._read_while_written:  # said once, however many polls it takes
                        log.say(f"waiting for {p.path}: being written")
                    self._read_while_written.add(p.path)
                    continue
                self.record.fail(outcome.failure)
                self._tried.add(json.dumps([p.path, p.identity]))
                logger.warning(f"warning: {p.path}: not scored: {outcome.failure.error}")
            elif outcome.entry is not None:
                e = outcome.entry
                why = self.record.conflict(e)  # two ranks of one wave may have found one step, or two blocks
                if why is not None:
                    (self.options.out / e.results).unlink(missing_ok=True)
                    self.record.fail(SweepFailure(p.path, p.identity, why))
                    logger.warning(f"warning: {p.path}: not scored: {why}")
                    continue
                self.record.add(e)
                self.scored_now += 1
                best = self.record.best
                log.say(f"{Path(e.checkpoint).name}  " + evaluation_line(e.step, e.metrics, budgets)
                        + (f"  best: step {best.step}, tau {best.tau:.3f}" if best is not None else ""))
            if self._bar is not None:
                self._bar.update(1)
        self.record.save(self.options.out)
        self._to_wandb("logging to", lambda t: t.log(self.record, self.options.out))
        if self.tracker is not None:
            self.record.save(self.options.out)  # the steps the run received

    def _to_wandb(self, what: str, call: Any) -> None:
        """The live evaluation's policy for a sink: a failure is a warning and the sweep goes on (its entries are
        in sweep.json; the steps W&B did not receive are logged by the next run of the sweep)."""
        if self.tracker is None:
            return
        try:
            call(self.tracker)
        except Exception as e:  # wandb raises many types (network, quota, a finished run)
            logger.warning(f"warning: {what} W&B failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
                           "the entries are in sweep.json, and the next run of the same command logs what W&B missed")

    def report(self) -> None:
        """Rank zero: ``sweep.md`` and ``sweep.png``."""
        from ...core.results.sweep_report import write_report

        if self.record.entries or self.record.failed:
            write_report(self.record, self.options.out)

    # -- every rank --------------------------------------------------------------------------
    def run(self) -> None:
        """The rounds until done (one without ``watch``); every rank calls it."""
        first = True
        try:
            begun = self._agreed(self.begin)
            if begun.error is not None:
                raise SweepStop(begun.error)
            with self._progress() as bar:
                while True:
                    plan = self._agreed(lambda f=first: self.plan(f))
                    if plan.error is not None:
                        raise SweepStop(plan.error)
                    if bar is not None and plan.todo:
                        bar.total += len(plan.todo)
                        bar.refresh()
                    for at in range(0, len(plan.todo), self.world):
                        self._wave(plan.todo[at:at + self.world], plan)
                    if self.rank == 0 and plan.todo and self.options.watch:
                        self.report()  # a watcher's report is current after every round
                    first = False
                    if not self.options.watch or plan.stop or self._agreed(self._done):
                        break
                    if not plan.todo:
                        time.sleep(self.options.poll_seconds)
        finally:
            if self.rank == 0:
                self.report()
                self._to_wandb("finishing the run in", lambda t: t.finish())

    def _agreed(self, decide: Any) -> Any:
        """Rank zero's ``decide()`` on every rank; its ``DFlashCBError`` stops every rank with its message."""
        result: Any = None
        if self.rank == 0:
            try:
                result = decide()
            except DFlashCBError as e:
                if self.world == 1:
                    raise
                result = Plan(error=str(e))
        return _broadcast(result) if self.world > 1 else result

    def _wave(self, wave: list[Planned], plan: Plan) -> None:
        """One checkpoint per rank: read and checked, the session opened once (a collective), scored."""
        mine = wave[self.rank] if self.rank < len(wave) else None
        prepared: Prepared | Outcome | None = None
        error: BaseException | None = None
        try:
            prepared = self.worker.prepare(mine, plan) if mine is not None else None
        except Exception as e:  # a bug: every rank is told before it stops
            error, prepared = e, Outcome(fatal=f"{type(e).__name__}: {e}")
        if self.scorer.session is None:
            # Opening hashes the shards (each rank its share) and is a collective: all ranks agree first.
            states = all_gather(_state_of(prepared))
            self._stop_if_fatal([s for s in states if s and s[0] == "fatal"], error)
            dtypes = [s[1] for s in states if s and s[0] == "ready"]
            if dtypes:
                import torch

                self.scorer.open(getattr(torch, dtypes[0]))
                if self.world > 1 and self.options.scoring.verify:
                    adopt_verified(self.scorer.cache)
        outcome: Outcome | None = prepared if isinstance(prepared, Outcome) else None
        if isinstance(prepared, Prepared):
            try:
                outcome = self.worker.score(prepared)
            except Exception as e:  # the cache changed, a bug: every rank stops
                error, outcome = e, Outcome(fatal=log_text(e) if isinstance(e, DFlashCBError)
                                            else f"{type(e).__name__}: {e}")
            finally:
                prepared.drafter = None  # its memory back before the next checkpoint
        outcomes = all_gather(outcome)
        for o in outcomes:  # every rank knows the steps and the block scored so far (rank zero has the last word)
            if o is not None and o.entry is not None:
                plan.steps.setdefault(o.entry.step, o.entry.checkpoint)
                plan.block_size = plan.block_size or o.entry.block_size
                plan.family = plan.family or o.entry.series.get("family")
        if self.rank == 0:
            self.record_wave(wave, outcomes)
        self._stop_if_fatal([("fatal", o.fatal) for o in outcomes if o is not None and o.fatal], error)

    def _stop_if_fatal(self, fatal: list[tuple[str, str]], error: BaseException | None) -> None:
        if error is not None:
            raise error
        if fatal:
            if self.world == 1:
                raise DFlashCBError(fatal[0][1])
            raise SweepStop(f"a rank stopped the sweep: {fatal[0][1]}")

    @contextmanager
    def _progress(self) -> Iterator[Any]:
        """A progress bar over the checkpoints on rank zero (on a terminal); None elsewhere."""
        if self.rank != 0:
            yield None
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=0, unit="checkpoint", desc="sweep", disable=None, leave=False)
        try:
            yield self._bar
        finally:
            self._bar.close()
            self._bar = None


def adopt_verified(cache: StateCache) -> None:
    """Every rank scores every sample of its checkpoints, but opening the session hashed only this rank's share of
    the shards (``across_ranks.verify_across_ranks``): a shard another rank hashed counts as verified here when this
    rank sees the very same file (the same ``integrity.file_identity``: one copy on a shared filesystem), so each
    shard is hashed once over all ranks; a copy of its own (another node's disk) is hashed here when first read.
    A collective: every rank calls it."""
    from ...cache.integrity import VERIFIED, file_identity

    expected = {s.file: s.sha256 for s in cache.manifest.shards}
    mine = [(name, list(file_identity((cache.path / name).stat()))) for name, _ in cache.hashed if name in expected]
    for part in all_gather(mine):
        for name, identity in part:
            path = cache.path / name
            st = path.stat()
            if list(file_identity(st)) == identity:
                VERIFIED.add(path, expected[name], st)


def _state_of(prepared: Prepared | Outcome | None) -> tuple[str, str] | None:
    """What the other ranks need to know before the session opens: a fatal error, or a drafter's dtype."""
    if isinstance(prepared, Prepared):
        return "ready", str(next(prepared.drafter.parameters()).dtype).removeprefix("torch.")
    if isinstance(prepared, Outcome) and prepared.fatal:
        return "fatal", prepared.fatal
    return None


def check_found(found: Sequence[FoundCheckpoint], out: Path, first: bool) -> None:
    """Refused before any work: ``--out`` inside a checkpoint folder (writing there would change the checkpoint),
    and, at the first look, two checkpoints whose names carry one step (two points at one step), naming both."""
    from ...core.checkpoints.files import CheckpointPathError, output_inside_checkpoint, same_name_steps

    inside = output_inside_checkpoint(out, found)
    if inside is not None:
        raise CheckpointPathError(f"--out {out}: is inside the checkpoint {inside.path}, which writing there would "
                                  "change; choose a folder outside the checkpoints")
    pairs = same_name_steps(found) if first else []
    if pairs:
        a, b = pairs[0]
        raise CheckpointPathError(f"{a.path} and {b.path}: both are step {a.name_step} by their names (two points "
                                  "at one step of the curve); pass the paths apart, or remove the copy")


@contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler, torchrun stopping its workers) ends the sweep as Ctrl-C does: what is scored is kept."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
