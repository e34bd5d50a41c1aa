"""``DFlashEvalTrainerCallback``: the live evaluation in a Hugging Face ``transformers.Trainer``.

A thin adapter over ``dflash_cb.integrations.evaluator.live.LiveEvaluator``, like ``DFlashEvalCallback`` for Lightning::

    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.add_callback(DFlashEvalTrainerCallback(trainer, states="cached_states/qwen36-27b-v1",
                                                   every_n_train_steps=500, drafter="drafter"))

- Hooks: ``on_train_begin`` (setup, the fit-start evaluation), ``on_step_end`` (after each optimizer
  step, at ``state.global_step``), ``on_evaluate`` (this step's figures for ``metric_for_best_model``),
  ``on_train_end`` (the full fit-end evaluation).
- The numbers go into ``trainer.state.log_history`` and every ``report_to`` integration (``TrainerLog``);
  W&B gets them straight from the evaluator, with the tables and charts, under the same names and step
  axis (``trainer/global_step``) as a Lightning or plain-loop run, so ``tools/wandb_panels.py`` builds the
  same panels. The console gets one line per evaluation, not the Trainer's dict of every key.
- Keep the checkpoint with the best tau: ``TrainingArguments(eval_strategy="steps", eval_steps=N,
  save_strategy="best", metric_for_best_model="dflash_eval/tau", greater_is_better=True)``; at each of the
  Trainer's evaluations the callback supplies the tau of that step (evaluating then if its own schedule did
  not), so the kept checkpoint carries its own step's tau.
- State: an ``ExportableState``, so the schedule and history are saved in each checkpoint's
  ``trainer_state.json``; on ``train(resume_from_checkpoint=...)`` the callback restores its latest entry
  (matched by prefix; the cache by its manifest sha256, whatever the path's spelling)
  (``restore_callback_states_from_checkpoint`` is not needed; leave it False: when True, transformers
  rebuilds callbacks from their saved JSON arguments, without the trainer this one logs through).
  A second ``train()`` on the same Trainer starts from step 0: a new series.
- Distributed (DDP, FSDP through accelerate): every rank evaluates its share; sharded parameters of
  the model are gathered for the evaluation (``distributed.full_parameters_of``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ...common import arguments as check
from ...core.figures.positions import DEFAULT_POSITION_EDGES
from ...core.replay import DEFAULT_BUDGETS
from ..evaluator.config import (
    DEFAULT_PREFIX,
    AutocastName,
    EvalConfig,
    TailBlocks,
    WeightSource,
    config_fields,
    config_from,
    one_per_prefix,
)
from ..evaluator.distributed import full_parameters_of
from ..evaluator.drafter_source import DrafterSource, find_drafter
from ..evaluator.live import LiveEvaluator
from ..tracking.sinks import MetricsSink
from ..tracking.trackers import as_sinks, hf_sinks


class DFlashEvalTrainerCallback(TrainerCallback, ExportableState):
    """Evaluate a DFlash drafter on cached target states while a ``transformers.Trainer`` trains it.

    Args:
        trainer: the ``Trainer`` whose ``log`` carries the metrics (add the callback with
            ``trainer.add_callback``).
        states: cache folder written by ``tools/precompute_states.py``.
        every_n_train_steps: evaluate after every N optimizer steps (``state.global_step``).
        drafter: attribute path of the drafter on the trainer's model (``"drafter"``), a function
            ``model -> drafter``, or None when the model is the drafter.

    Every other argument is ``EvalConfig``'s (``dflash_cb.integrations.evaluator.config``), documented there;
    ``target_embed``/``target_lm_head`` are attribute paths on the trainer's model.
    """

    def __init__(
        self,
        trainer: Any = None,
        states: str | os.PathLike = "",
        every_n_train_steps: int = 500,
        drafter: DrafterSource = "drafter",
        *,
        eval_on_fit_start: bool = True,
        eval_on_fit_end: bool = True,
        target_embed: WeightSource | None = None,
        target_lm_head: WeightSource | None = None,
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
        sinks: Sequence[MetricsSink] | None = None,
    ) -> None:
        if not states:
            raise check.ArgumentError("DFlashEvalTrainerCallback: states= (the cache folder) is required")
        config = config_from(locals())
        self.trainer = trainer
        self.drafter_source = drafter  # where the drafter is in the training model (a path or a function)
        self.sinks = as_sinks(sinks, "sinks")  # beside the Trainer's log and the trackers its report_to names
        self.evaluator = LiveEvaluator(config, name=type(self).__name__)
        if trainer is not None:
            _check_one_per_prefix(self, trainer)
        # The JSON-able arguments, for ExportableState (transformers stores them in trainer_state.json).
        given = {"drafter": drafter, **{name: getattr(config, name) for name in config_fields()}}
        self.arguments = {k: _jsonable(v) for k, v in given.items() if _jsonable(v) is not _NOT_JSON}

    @property
    def config(self) -> EvalConfig:
        return self.evaluator.config

    # -- ExportableState -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"args": self.arguments, "attributes": {"evaluator_state": self.evaluator.state_dict()}}

    @property
    def evaluator_state(self) -> dict[str, Any]:
        return self.evaluator.state_dict()

    @evaluator_state.setter
    def evaluator_state(self, state: dict[str, Any]) -> None:
        self.evaluator.load_state_dict(state)

    def _restore(self, state: Any) -> None:
        """This callback's saved state in a resumed ``trainer_state.json``: the latest entry with this prefix.

        transformers keeps one entry per callback instance when a callback class is there once, and appends
        every instance's state at each save when it is there more than once: the last entry of a prefix is
        its state at that checkpoint. The cache is matched by the evaluator (its manifest sha256), so any
        spelling of the same folder restores, and another cache starts a new series with a warning."""
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        entries = saved if isinstance(saved, list) else [saved]
        mine = [e for e in entries if isinstance(e, dict)
                and (e.get("args") or {}).get("prefix", DEFAULT_PREFIX) == self.config.prefix]
        if mine:
            self.evaluator.load_state_dict((mine[-1].get("attributes") or {}).get("evaluator_state"))

    # -- hooks ----------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        if self.trainer is None:
            raise check.ArgumentError(
                "DFlashEvalTrainerCallback needs the trainer it logs through: "
                "trainer.add_callback(DFlashEvalTrainerCallback(trainer, states=...)); with "
                "restore_callback_states_from_checkpoint=True transformers rebuilds callbacks "
                "without it: leave that option False (this callback restores its own state)")
        _check_one_per_prefix(self, self.trainer)
        # The scalars into the Trainer's own record; the trackers its report_to names (W&B gets the scalars
        # straight, under the evaluator's names and step axis; TensorBoard the rich record); the user's sinks.
        sinks: list[MetricsSink] = [TrainerLog(self.trainer), *hf_sinks(self.trainer), *self.sinks]
        self.evaluator.setup(None, model, sinks=sinks, max_steps=int(state.max_steps or -1),
                             full_parameters=lambda: full_parameters_of(model))
        if state.global_step > 0:
            self._restore(state)  # a resumed run: trainer_state.json is loaded by now
        self.evaluator.start(state.global_step, self._drafter(model), model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self.evaluator.step(state.global_step, self._drafter(model), model)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None,
                    model: nn.Module | None = None, **kw: Any) -> None:
        """With ``metric_for_best_model`` naming one of this callback's metrics (``"dflash_eval/tau"``), the
        evaluation's metrics get this step's figures (``eval_``-prefixed, as the Trainer looks them up), so
        the Trainer keeps the checkpoint with the best tau of its own step."""
        best = getattr(args, "metric_for_best_model", None) or ""
        if metrics is None or not best.removeprefix("eval_").startswith(self.config.prefix):
            return
        ours = self.evaluator.metrics_at(state.global_step, self._drafter(model), model)
        for k, v in (ours or {}).items():
            metrics[f"eval_{k}"] = v

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self.evaluator.finish(state.global_step, self._drafter(model), model)

    def _drafter(self, model: nn.Module | None) -> nn.Module:
        if model is None:
            raise check.ArgumentError("DFlashEvalTrainerCallback: the trainer passed no model to the callback")
        drafter = find_drafter(model, self.drafter_source, type(self).__name__)
        assert drafter is not None
        return drafter


def _check_one_per_prefix(callback: DFlashEvalTrainerCallback, trainer: Any) -> None:
    handler = getattr(trainer, "callback_handler", None)
    others = [c.config.prefix for c in getattr(handler, "callbacks", [])
              if isinstance(c, DFlashEvalTrainerCallback) and c is not callback]
    one_per_prefix(type(callback).__name__, callback.config.prefix, others, "Trainer", "callbacks")


class TrainerLog(MetricsSink):
    """The evaluator's scalars into the Trainer's own record: ``state.log_history`` (so they are in every
    checkpoint's ``trainer_state.json``) and every ``report_to`` integration but the trackers this package has a
    sink for (W&B, TensorBoard: ``trackers``), which get them straight, under the evaluator's names and step
    axis, where the Trainer's integrations would rename them (``train/dflash_eval/tau``). The console printers
    are skipped: the evaluator prints one line per evaluation instead of the Trainer's whole dict."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def log(self, metrics: dict[str, float], step: int) -> None:
        from transformers.integrations import TensorBoardCallback, WandbCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        t = self.trainer
        t.state.log_history.append({**metrics, "step": int(step)})
        skip = (PrinterCallback, ProgressCallback, WandbCallback, TensorBoardCallback, DFlashEvalTrainerCallback)
        for cb in t.callback_handler.callbacks:
            if isinstance(cb, skip) or type(cb).on_log is TrainerCallback.on_log:
                continue
            cb.on_log(t.args, t.state, t.control, logs=dict(metrics), model=t.model)

    def __str__(self) -> str:
        return "the Trainer's log"


_NOT_JSON = object()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON (tuples as lists), or ``_NOT_JSON``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return _NOT_JSON
