"""A sweep's entries in a W&B run (``sweep.Sweep`` logs through it): the live evaluation's keys, step axis and
panels, for checkpoints scored after training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...common.errors import DFlashCBError
from ...core.figures.metrics import ANCHOR_STRIDE, DEFAULT_PREFIX, EVAL_STEP, TAU
from ...core.results.results_file import Results, load_results
from ...core.results.sweep_record import SweepRecord
from ..evaluator.scoring import CacheScorer
from ..tracking.wandb_logging import results_scalars


class SweepWandb:
    """The sweep's entries in a W&B run, under the live evaluation's keys and step axis (``trackers.wandb_run``),
    so the run gets the live evaluation's panels. A new run (``--wandb-project``; a resumed sweep resumes the run
    it logged to), or an existing one (``--wandb-run-id``: a training run made without the evaluation).
    ``options``: the sweep's ``sweep.SweepOptions``."""

    def __init__(self, options: Any, record: SweepRecord, scorer: CacheScorer,
                 prefix: str = DEFAULT_PREFIX) -> None:
        import wandb

        from ..tracking.sinks import RunInfo
        from ..tracking.trackers.wandb_run import WandbSink

        known = record.wandb
        run_id = options.wandb_run_id
        if run_id is None and known.get("project") == options.wandb_project:
            run_id = known.get("run_id")  # a resumed sweep goes on in the run it logged to
        try:
            self.run = wandb.init(project=options.wandb_project, entity=options.wandb_entity, id=run_id,
                                  resume="allow" if run_id else None, name=options.wandb_name,
                                  job_type="dflash-sweep", reinit="create_new")
        except Exception as e:  # wandb raises many types (UsageError, CommError, network errors)
            raise DFlashCBError(f"--wandb-project/--wandb-run-id: W&B could not start the run ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:300]}); log in with `wandb login`, or set "
                                "WANDB_MODE=offline") from None
        logged = known.get("logged_steps", []) if known.get("run_id") == self.run.id else []
        record.wandb = {"project": options.wandb_project, "run_id": self.run.id, "dir": str(self.run.dir),
                        "logged_steps": list(logged)}
        self.prefix, self.scorer = prefix, scorer
        self.sink = WandbSink(self.run)
        self.sink.begin(RunInfo(prefix, dict(record.settings), [], []))
        from ...cache.selection import stratified_ids

        cache = scorer.cache
        self.table_ids = stratified_ids(scorer.ids, lambda i: cache.entry(i).category, 4, None)

    def log(self, record: SweepRecord, folder: Path) -> None:
        """Every entry this run has not received yet, in step order: its scalars at its step, then its
        histogram, per-depth chart, samples table and the best tau so far in the summary."""
        from ..tracking.sinks import EvaluationRecord

        logged = record.wandb["logged_steps"]
        history = [{"step": e.step, TAU: e.tau if e.tau is not None else math.nan}
                   for e in record.entries if e.step in logged]
        for e in record.entries:
            if e.step in logged:
                continue
            results = load_results(folder / e.results)
            scalars = results_scalars(results, self.prefix)
            scalars[self.prefix + EVAL_STEP] = float(e.step)
            scalars[self.prefix + ANCHOR_STRIDE] = float(results.meta.get(ANCHOR_STRIDE) or 1)
            self.sink.log(scalars, e.step)
            history.append({"step": e.step, TAU: e.tau if e.tau is not None else math.nan})
            block = results.block_size or 0
            hist = [float(results.histogram.get(str(n), 0)) for n in range(block + 1)]
            per_depth = [math.nan if v is None else v for v in results.per_depth.get("unconditional") or []]
            self.sink.evaluation(EvaluationRecord(e.step, self.prefix, scalars, per_depth, hist, [], list(history),
                                                  lambda r=results: self._table(r)))
            logged.append(e.step)

    def _table(self, results: Results) -> list[Any]:
        from ..tracking.sinks import TableSample

        cache, by_id = self.scorer.cache, {s.id: s for s in results.samples}
        return [TableSample(i, cache.entry(i).category, cache.token_ids(i), cache.entry(i).prompt_len,
                            by_id[i].acceptance_lengths, None) for i in self.table_ids if i in by_id]

    def finish(self) -> None:
        self.run.finish()
