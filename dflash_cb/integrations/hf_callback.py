"""``DFlashEvalTrainerCallback``: the live evaluation in a Hugging Face ``transformers.Trainer``.

A thin adapter over ``dflash_cb.integrations.evaluator.LiveEvaluator``, like ``DFlashEvalCallback`` for Lightning::

    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.add_callback(DFlashEvalTrainerCallback(trainer, states="cached_states/qwen36-27b-v1",
                                                   every_n_train_steps=500, drafter="drafter"))

- Hooks: ``on_train_begin`` (setup, the fit-start evaluation), ``on_step_end`` (after each optimizer
  step, at ``state.global_step``), ``on_train_end`` (the full fit-end evaluation).
- The numbers go through ``trainer.log``: they land in ``trainer.state.log_history`` and reach every
  ``report_to`` integration (W&B, TensorBoard, ...). Tables and charts go to the W&B run when
  ``report_to`` includes ``wandb``. (The Trainer's W&B integration prefixes scalar names with
  ``train/``: ``train/dflash_eval/tau``.)
- State: an ``ExportableState``, so the schedule and history are saved in each checkpoint's
  ``trainer_state.json``; on ``train(resume_from_checkpoint=...)`` the callback restores them itself
  (``restore_callback_states_from_checkpoint`` is not needed; leave it False: when True, transformers
  rebuilds callbacks from their saved JSON arguments, without the trainer this one logs through).
- Distributed (DDP, FSDP through accelerate): every rank evaluates its share; sharded parameters of
  the model are gathered for the evaluation (``distributed.full_parameters_of``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .distributed import full_parameters_of
from .evaluator import DrafterSource, LiveEvaluator, find_drafter
from .sinks import MetricsSink


class DFlashEvalTrainerCallback(TrainerCallback, ExportableState):
    """Evaluate a DFlash drafter on cached target states while a ``transformers.Trainer`` trains it.

    Args:
        trainer: the ``Trainer`` whose ``log`` carries the metrics (add the callback with
            ``trainer.add_callback``).
        states: cache folder written by ``tools/precompute_states.py``.
        every_n_train_steps: evaluate after every N optimizer steps (``state.global_step``).
        drafter: attribute path of the drafter on the trainer's model (``"drafter"``), a function
            ``model -> drafter``, or None when the model is the drafter.
        **options: every other ``DFlashEvalCallback``/``LiveEvaluator`` argument (``ddtree_budgets``,
            ``num_samples``, ``baselines``, ``target_embed``/``target_lm_head`` as attribute paths on
            the model, ...).
    """

    def __init__(self, trainer: Any = None, states: str | os.PathLike = "", every_n_train_steps: int = 500,
                 drafter: DrafterSource = "drafter", **options: Any) -> None:
        if not states:
            raise ValueError("DFlashEvalTrainerCallback: states= (the cache folder) is required")
        self.trainer = trainer
        self.drafter = drafter
        # The JSON-able arguments, for ExportableState (transformers stores them in trainer_state.json).
        self.arguments = {k: v for k, v in {"states": str(states), "every_n_train_steps": every_n_train_steps,
                                            "drafter": drafter, **options}.items() if _jsonable(v)}
        self.evaluator = LiveEvaluator(states, every_n_train_steps, name=type(self).__name__,
                                       log=TrainerLog(self), **options)

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
        """The saved state of this callback in a resumed ``trainer_state.json`` (the same cache and prefix)."""
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        for entry in saved if isinstance(saved, list) else [saved]:
            args = (entry or {}).get("args", {})
            if (args.get("states"), args.get("prefix", "dflash_eval/")) == (self.evaluator.states, self.evaluator.prefix):
                self.evaluator.load_state_dict(entry["attributes"]["evaluator_state"])
                return

    # -- hooks ----------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        if self.trainer is None:
            raise ValueError("DFlashEvalTrainerCallback needs the trainer it logs through: "
                             "trainer.add_callback(DFlashEvalTrainerCallback(trainer, states=...)); with "
                             "restore_callback_states_from_checkpoint=True transformers rebuilds callbacks "
                             "without it: leave that option False (this callback restores its own state)")
        ev = self.evaluator
        self._restore(state)  # a resumed run: trainer_state.json is loaded by now
        ev.max_steps = int(state.max_steps or -1)
        ev.full_parameters = lambda: full_parameters_of(model)
        ev.setup(None, model)
        ev.start(state.global_step, self._drafter(model), model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self.evaluator.step(state.global_step, self._drafter(model), model)

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self.evaluator.finish(state.global_step, self._drafter(model), model)

    def _drafter(self, model: nn.Module | None) -> nn.Module:
        if model is None:
            raise ValueError("DFlashEvalTrainerCallback: the trainer passed no model to the callback")
        drafter = find_drafter(model, self.drafter, type(self).__name__)
        assert drafter is not None
        return drafter


class TrainerLog(MetricsSink):
    """The evaluator's scalars through ``trainer.log`` (log history and every ``report_to`` integration);
    the W&B run of the ``wandb`` integration for tables and charts."""

    def __init__(self, callback: DFlashEvalTrainerCallback) -> None:
        self.callback = callback

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.callback.trainer.log(dict(metrics))

    def wandb_run(self) -> Any | None:
        report_to = getattr(self.callback.trainer.args, "report_to", None) or []
        if "wandb" not in report_to and report_to != "all":
            return None
        import wandb

        return wandb.run


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["DFlashEvalTrainerCallback", "TrainerLog"]
