"""``DFlashEvalCallback``: the drafter's exact offline tau, measured while it trains.

Add it to a ``Trainer`` (or three lines of LightningCLI YAML, ``configs/callback/dflash_eval.yaml``)::

    trainer = Trainer(callbacks=[DFlashEvalCallback(states="cached_states/qwen36-27b-v1",
                                                    every_n_train_steps=500)], logger=WandbLogger(...))

Every ``every_n_train_steps`` optimizer steps (and, by default, before the first and after the
last step) it replays the greedy speculative loop on the cached target states with the drafter's
current weights (``dflash_cb.core.replay.engine.evaluate``) and logs ``dflash_eval/tau``, DDTree tau per
budget, per-depth acceptance, per-category tau, ... to every logger at ``trainer.global_step``.

Guarantees, modelled on ``ModelCheckpoint``/``EarlyStopping``:

- Configuration errors (no cache, a missing or truncated shard or head file, a shard whose sha256
  differs, cache vs drafter mismatch, a baseline from another cache) stop ``fit`` before the first
  training step, naming the file or field.
- An evaluation changes nothing training depends on: it runs under ``torch.no_grad`` with the
  drafter in eval mode (each submodule's mode restored afterwards), restores the CPU and CUDA
  RNG states, never touches the optimizer or gradients, and keeps no tensors afterwards.
- Failures inside an evaluation (e.g. a shard damaged after setup: one whose size or modification
  time changed is hashed again) warn, count in ``{prefix}failed_evaluations``, and training goes on,
  unless ``fail_on_error=True`` or ``max_failed_evaluations`` evaluations in a row failed.
- Distributed: rank r scores ``samples[r::world]``; integer counts are summed with one
  ``all_reduce`` before any ratio, so the numbers equal a single-process run's exactly; only rank
  zero logs. Under FSDP (1 or 2) every rank gathers the full parameters once per evaluation and
  scores its own share (see ``dflash_cb.integrations.evaluator.across_ranks`` and ``dflash_cb.integrations.evaluator.distributed``). DeepSpeed ZeRO-3
  is refused.
- ``state_dict``/``load_state_dict`` carry the schedule, so a resumed run neither repeats nor skips
  an evaluation. They also carry the cache's manifest sha256 and the sample selection: resumed on
  another cache or with another ``num_samples``/``sample_ids``/``sample_seed`` (other evaluated ids),
  the callback warns and starts a new series instead of mixing two caches' or selections' numbers.
  A malformed saved state warns, naming the field, and starts a new series too
  (``dflash_cb.integrations.evaluator.eval_state``).

Metric values go to ``trainer.callback_metrics`` too, so ``ModelCheckpoint(monitor="dflash_eval/tau",
mode="max")`` and ``EarlyStopping`` can use them.

The callback is a thin adapter: the evaluation, its schedule, failure policy, state and logging are
``dflash_cb.integrations.evaluator.live.LiveEvaluator`` (the same object serves the Hugging Face ``Trainer`` and plain
loops); this file maps Lightning's hooks, loggers, FSDP strategies and ``callback_metrics`` onto it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ...common import arguments as check
from ...common import log
from ...core.figures.metrics import TAU
from ...core.figures.positions import DEFAULT_POSITION_EDGES
from ...core.replay import DEFAULT_BUDGETS
from ..evaluator.config import DEFAULT_PREFIX, AutocastName, EvalConfig, TailBlocks, config_from
from ..evaluator.distributed import full_parameters, sharding_kind
from ..evaluator.drafter_source import find_drafter
from ..evaluator.live import LiveEvaluator
from ..tracking.sinks import MetricsSink
from ..tracking.trackers import as_sinks, lightning_sinks

DrafterSource = str | Callable[[LightningModule], nn.Module]


class DFlashEvalCallback(Callback):
    """Evaluate a DFlash drafter on cached target states during training and log the exact tau.

    Args:
        states: cache folder written by ``tools/precompute_states.py``.
        every_n_train_steps: evaluate after every N optimizer steps (``trainer.global_step % N == 0``);
            0 disables the periodic evaluations (start/end ones still run). An integer.
        drafter: attribute path of the drafter on the LightningModule (``"drafter"``,
            ``"model.draft"``), or a function ``module -> drafter``. Any module with a DFlash config
            (``.spec`` or ``.config``) works; ``torch.compile`` wrappers are unwrapped.
        target_embed: attribute path of the target's input embedding on the module (an
            ``nn.Embedding`` or a ``[vocab, hidden]`` tensor). With ``target_lm_head``, the head is taken
            from the module (no copy); without both, the cache's exported head is loaded once, onto the
            drafter's device, and kept there (Qwen3.6-27B: embedding + head = 5.1 GB in bf16; a module
            that already holds the target's matrices for training should name them here instead).
        target_lm_head: attribute path of the target's output head (``nn.Linear`` or tensor). Omit it
            with ``target_embed`` set only when the target ties embedding and head.
        prog_bar: show ``{prefix}tau`` in the progress bar.
        console: print one line per evaluation on rank zero (step, tau with its 95% interval, DDTree tau
            at the largest budget, difference to each measured baseline, wall time).

    Every other argument (schedule, profiles, samples, baselines, failure policy, W&B table, ...) is
    ``dflash_cb.integrations.evaluator.config.EvalConfig``'s, documented there. Scalars go to every logger at
    ``trainer.global_step``; tables and charts to the first ``WandbLogger``'s run.

    Checkpointing: the callback's state (schedule, history) is saved in Lightning checkpoints under its
    ``state_key``, which is its ``prefix``: several callbacks in one Trainer (another cache, another sample
    selection) each need their own ``prefix=`` (Lightning refuses two with one state key), and a resumed run
    finds the state whatever the spelling of ``states``. To keep the checkpoint with the best tau, align the
    cadences so each checkpoint carries the tau of its own step::

        DFlashEvalCallback(states=..., every_n_train_steps=500)
        ModelCheckpoint(monitor="dflash_eval/tau", mode="max", every_n_train_steps=500,
                        filename="step{step}-tau{dflash_eval/tau:.4f}", auto_insert_metric_name=False)

    (``auto_insert_metric_name=False``: the inserted name ``dflash_eval/tau=`` would make a folder.) The
    metrics also carry ``dflash_eval/step``, the step each figure measured.
    """

    # The arguments are spelled out, not **kwargs, so LightningCLI (jsonargparse) can configure the callback
    # from YAML; they are EvalConfig's fields plus drafter and prog_bar (tests/integrations/test_config.py checks it).
    def __init__(
        self,
        states: str | os.PathLike,
        every_n_train_steps: int = 500,
        drafter: DrafterSource = "drafter",
        *,
        eval_on_fit_start: bool = True,
        eval_on_fit_end: bool = True,
        target_embed: str | None = None,
        target_lm_head: str | None = None,
        ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS,
        light_ddtree_budgets: Sequence[int] | None = None,
        light_anchor_stride: int | None = None,
        anchor_seed: int = 0,
        full_every_n_evals: int = 0,
        num_samples: int | None = None,
        sample_ids: Sequence[str] | None = None,
        sample_seed: int = 0,
        prefix: str = DEFAULT_PREFIX,
        baselines: dict[str, str] | Sequence[str] | None = None,
        published: str | os.PathLike | None = None,
        published_entries: Sequence[str] | None = None,
        cost_profile: str | os.PathLike | None = None,
        fail_on_error: bool = False,
        max_failed_evaluations: int = 3,
        autocast_dtype: AutocastName | None = "auto",
        table_samples: int = 4,
        table_cycles: int = 4,
        tokenizer: Any = None,
        verify_cache: bool = True,
        position_edges: Sequence[int] = DEFAULT_POSITION_EDGES,
        console: bool = True,
        tail_blocks: TailBlocks = "served",
        block_size: int | None = None,
        periodic_ddtree_budgets: Sequence[int] | None = None,
        periodic_anchor_stride: int | None = None,
        prog_bar: bool = False,
        sinks: Sequence[MetricsSink] | None = None,
    ) -> None:
        config = config_from(locals())  # first: the arguments as given
        super().__init__()
        if not isinstance(drafter, str) and not callable(drafter):
            raise check.ArgumentError(f"drafter={drafter!r}: expected an attribute path (str) or a function taking "
                                      "the LightningModule")
        self.evaluator = LiveEvaluator(config, name=type(self).__name__)
        self.drafter_source = drafter  # where the drafter is in the training model (a path or a function)
        self.prog_bar = check.flag("prog_bar", prog_bar)
        self.sinks = as_sinks(sinks, "sinks")  # beside the trainer's loggers and the trackers found among them
        self._fast_dev_run_noted = False

    @property
    def config(self) -> EvalConfig:
        return self.evaluator.config

    @property
    def history(self) -> list[dict[str, float]]:
        """Rank zero: ``{"step": s, metric: value, ...}`` per evaluation (``LiveEvaluator.history``)."""
        return self.evaluator.history

    # -- Lightning plumbing ---------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # The prefix alone: a resumed run finds its state whatever the spelling of the cache's path (the
        # evaluator then checks the cache itself, by its manifest sha256). Two callbacks on one Trainer
        # therefore need two prefixes, which their metrics need anyway.
        return self._generate_state_key(prefix=self.config.prefix)

    def state_dict(self) -> dict[str, Any]:
        return self.evaluator.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evaluator.load_state_dict(state_dict)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if sharding_kind(trainer) == "deepspeed3":
            raise RuntimeError("DFlashEvalCallback: DeepSpeed ZeRO stage 3 shards parameters in a way this callback "
                               "cannot gather; use ZeRO stage 1/2, DDP or FSDP")
        for problem in stale_checkpoint_cadences(trainer.callbacks, self.config):
            log.warn(f"{type(self).__name__}: {problem}")
        # The scalars to every logger; the rich record to the trackers among them (W&B, TensorBoard); then the
        # user's own sinks.
        sinks: list[MetricsSink] = [LightningLoggers(trainer), *lightning_sinks(trainer), *self.sinks]
        # The drafter may only exist after configure_model (FSDP); then on_fit_start validates it.
        self.evaluator.setup(self._drafter(pl_module, required=False), pl_module, sinks=sinks,
                             max_steps=trainer.max_steps, full_parameters=lambda: full_parameters(trainer))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.evaluator.validated:
            # The model is wrapped by now: under FSDP, shapes are only right with whole parameters.
            with full_parameters(trainer):
                self.evaluator.validate(self._drafter(pl_module), pl_module)
        self.evaluator.report_setup(trainer.global_step, self._drafter(pl_module))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here (not in on_fit_start) because a resumed run's global step and weights are restored by now.
        if not self._skipped(trainer):
            self._publish(trainer, self.evaluator.start(trainer.global_step, self._drafter(pl_module), pl_module))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._skipped(trainer):
            self._publish(trainer, self.evaluator.step(trainer.global_step, self._drafter(pl_module), pl_module))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on_train_end, not on_fit_end: loggers and the process group are still up.
        if not self._skipped(trainer):
            self._publish(trainer, self.evaluator.finish(trainer.global_step, self._drafter(pl_module), pl_module))

    def _drafter(self, pl_module: LightningModule, required: bool = True) -> nn.Module | None:
        return find_drafter(pl_module, self.drafter_source, type(self).__name__, required)

    def _skipped(self, trainer: Trainer) -> bool:
        if trainer.fast_dev_run and not self._fast_dev_run_noted:
            rank_zero_info("DFlashEvalCallback: evaluations are skipped under fast_dev_run")
            self._fast_dev_run_noted = True
        return bool(trainer.fast_dev_run)

    def _publish(self, trainer: Trainer, metrics: dict[str, float] | None) -> None:
        """Every rank's numbers into ``callback_metrics`` (ModelCheckpoint, EarlyStopping); the progress bar."""
        if metrics is None:
            return
        assert self.evaluator.last is not None
        for k, v in self.evaluator.last.shared.items():
            trainer.callback_metrics[k] = torch.tensor(v)
        tau = self.config.prefix + TAU
        if self.prog_bar and trainer.global_rank == 0 and tau in metrics:
            trainer.progress_bar_metrics[tau] = metrics[tau]


def stale_checkpoint_cadences(callbacks: Sequence[Any], config: EvalConfig) -> list[str]:
    """What is wrong with each ``ModelCheckpoint`` that monitors one of the evaluation's keys on a cadence that
    is not a multiple of the evaluation's: at a step without an evaluation, ``callback_metrics`` still holds the
    tau of an earlier step, so the file name and the best-checkpoint choice get a stale figure."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = config.every_n_train_steps
    problems = []
    for cb in callbacks:
        monitor = getattr(cb, "monitor", None)
        if not isinstance(cb, ModelCheckpoint) or not isinstance(monitor, str) or not monitor.startswith(config.prefix):
            continue
        steps = int(getattr(cb, "_every_n_train_steps", 0) or 0)
        if steps and every and steps % every == 0:
            continue
        if steps:
            saves = f"saves every {steps} training step(s)"
        elif getattr(cb, "_train_time_interval", None) is not None:
            saves = f"saves every {cb._train_time_interval}"
        else:
            saves = f"saves at the end of every {getattr(cb, '_every_n_epochs', 1) or 1} epoch(s)"
        runs = f"the evaluation runs every {every} step(s)" if every else "the evaluation runs at fit start and end only"
        fix = (f"ModelCheckpoint(monitor={monitor!r}, every_n_train_steps={every or 'N'}) or a multiple of it"
               + ("" if every else ", with DFlashEvalCallback(every_n_train_steps=N)"))
        problems.append(f"ModelCheckpoint(monitor={monitor!r}) {saves}, {runs}: a checkpoint saved at a step "
                        f"without an evaluation carries the tau of an earlier step in its file name and in the best-"
                        f"checkpoint choice; align them: {fix}")
    return problems


class LightningLoggers(MetricsSink):
    """The evaluator's scalars to every logger of the trainer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.trainer.loggers:
            lg.log_metrics(metrics, step=step)
            lg.save()

    def __str__(self) -> str:
        return "Lightning loggers"
