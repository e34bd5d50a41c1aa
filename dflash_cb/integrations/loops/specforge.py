"""SpecForge 0.2.0: the drafter's exact tau inside SpecForge's own training loop, with no edit of its files.

A thin adapter over ``dflash_cb.integrations.evaluator.live.LiveEvaluator``, like the Lightning and Hugging Face
callbacks. SpecForge's ``TrainerController`` has no callback hooks, so ``attach`` wraps four of its methods
on the one controller instance it is given (``detach`` restores them)::

    from dflash_cb.integrations.loops.specforge import attach

    controller = TrainerController(core, run_id="run", output_dir="out", logger=logger, eval_interval=500,
                                   eval_data_factory=eval_data, save_interval=500)
    attach(controller, "cached_states/qwen36-27b-v1", every_n_train_steps=500, keep_best_by_tau=True)
    controller.fit(data)

- ``controller.fit``: opens the evaluator's session with SpecForge's ``logger`` as its sink, evaluates the
  untrained (or resumed) drafter before the first optimizer step, and after the last one runs the full
  fit-end evaluation.
- ``controller.core.train_step``: after a step that stepped the optimizer, the step just completed is
  ``controller.global_step + 1`` (the controller counts it right after): evaluated when due, and logged
  through SpecForge's ``logger`` at that step, so its trackers get the numbers.
- ``controller.evaluate_configured``: SpecForge's own evaluations get this step's figures
  (``LiveEvaluator.metrics_at``) added to its ``eval/*`` metrics, so its checkpoint manager can keep the
  best checkpoint by ``{prefix}tau`` and ``{run_id}.best_meta.json`` records it.
- ``controller.save_checkpoint``: rank zero writes the evaluator's state (schedule and history) as
  ``dflash_cb_eval.json`` into the checkpoint folder SpecForge wrote; a controller that starts at
  ``global_step > 0`` (a resume) reads it back, so no evaluation is repeated or skipped.

The drafter is SpecForge's ``DFlashDraftModel`` at the trainable module's ``draft_model`` (the engine scores
it in place: same parameter names as dflash's). The target's embedding and head are, by default, the
``OnlineDFlashModel``'s own frozen ``embed_tokens`` and ``lm_head`` (no second copy); pass
``target_embed=None`` to use the cache's exported head instead. Under ``torch.distributed`` every rank runs
the same wrapped calls, scores its share of the samples, and sharded (FSDP) parameters are gathered for the
evaluation (``distributed.full_parameters_of`` the trainable module).

SpecForge is imported only inside functions: ``import dflash_cb`` never needs it.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ...common import arguments as check
from ...common.fileio import atomic_write_json
from ...core.figures.metrics import TAU
from ..evaluator.config import EvalConfig, config_fields, one_per_prefix
from ..evaluator.distributed import world
from ..evaluator.drafter_source import DrafterSource, find_drafter
from ..evaluator.live import LiveEvaluator
from ..tracking.sinks import CallableSink, MetricsSink
from ..tracking.trackers import as_sinks

STATE_FILE = "dflash_cb_eval.json"  # in each SpecForge checkpoint folder: {prefix: LiveEvaluator.state_dict()}
# The OnlineDFlashModel's frozen target matrices, the default head of the evaluation.
MODEL_HEAD = {"target_embed": "embed_tokens", "target_lm_head": "lm_head"}
_WRAPPED = (("fit",), ("evaluate_configured",), ("save_checkpoint",), ("core", "train_step"))
_MISSING = object()
# controller -> {prefix: attachment}: one evaluation per prefix and controller.
_ATTACHED: weakref.WeakKeyDictionary[Any, dict[str, SpecForgeEvaluation]] = weakref.WeakKeyDictionary()


class SpecForgeEvaluation:
    """One ``LiveEvaluator`` attached to one SpecForge ``TrainerController`` (made by ``attach``).

    Attributes:
        evaluator: the ``LiveEvaluator`` (``history``, ``last``, ``state_dict()``).
        controller: the controller it is attached to.
    """

    def __init__(self, controller: Any, evaluator: LiveEvaluator, drafter: DrafterSource,
                 keep_best_by_tau: bool, resume_from: str | os.PathLike | None,
                 sinks: Sequence[MetricsSink] = ()) -> None:
        self.controller = controller
        self.sinks = list(sinks)
        self.evaluator = evaluator
        self.drafter_source = drafter  # where the drafter is in the training model (a path or a function)
        self.resume_from = resume_from
        self._fitting = False
        self._resumed = False  # the checkpoint's state is read once, at the first fit
        self._replaced: list[tuple[Any, str, Any, Callable[..., Any]]] = []  # (owner, name, previous, ours)
        self._best_before: tuple[str, Any, Any] | None = None
        if keep_best_by_tau:
            self._keep_best_by(evaluator.prefix + TAU)

    @property
    def prefix(self) -> str:
        return self.evaluator.prefix

    # -- the wrapped methods ----------------------------------------------------------------------
    def _install(self) -> None:
        c = self.controller
        ours = {"fit": self._fit, "evaluate_configured": self._evaluate_configured,
                "save_checkpoint": self._save_checkpoint, "train_step": self._train_step}
        for path in _WRAPPED:
            owner = c if len(path) == 1 else getattr(c, path[0])
            name = path[-1]
            original = getattr(owner, name)
            wrapper = _wrapping(original, ours[name])
            self._replaced.append((owner, name, owner.__dict__.get(name, _MISSING), wrapper))
            setattr(owner, name, wrapper)

    def detach(self) -> None:
        """Restore the controller's methods (and its checkpoint manager's best metric); the evaluator keeps its
        history. An attachment made later on the same controller must be detached first."""
        later = [(owner, name) for owner, name, _, ours in self._replaced if owner.__dict__.get(name) is not ours]
        if later:
            raise check.ArgumentError(
                f"SpecForgeEvaluation(prefix={self.prefix!r}).detach(): {type(later[0][0]).__name__}."
                f"{later[0][1]} was wrapped again after this attachment; detach the later attachment first")
        for owner, name, previous, _ in reversed(self._replaced):
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._replaced = []
        if self._best_before is not None:
            manager = self.controller._checkpoint_manager()
            manager.best_metric, manager.best_score, manager.best_step = self._best_before
            self._best_before = None
        _ATTACHED.get(self.controller, {}).pop(self.prefix, None)

    def _fit(self, original: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        c = self.controller
        module = c.core.strategy.trainable_module()
        sinks = ([CallableSink(c.logger)] if c.logger is not None else []) + self.sinks
        self.evaluator.setup(None, module, sinks=sinks, max_steps=c.max_steps if c.max_steps is not None else -1)
        if c.global_step > 0 and not self._resumed:
            self._restore(c.global_step)
        self._resumed = True
        self.evaluator.start(c.global_step, self._drafter(module), module)
        self._fitting = True
        try:
            step = original(data, *args, **kwargs)
        finally:
            self._fitting = False
        self.evaluator.finish(c.global_step, self._drafter(module), module)
        return step

    def _train_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self._fitting and result.optimizer_stepped:
            # The controller counts the optimizer step right after this call returns.
            module = self.controller.core.strategy.trainable_module()
            self.evaluator.step(self.controller.global_step + 1, self._drafter(module), module)
        return result

    def _evaluate_configured(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        metrics = original(*args, **kwargs)
        if not self._fitting:
            return metrics
        module = self.controller.core.strategy.trainable_module()
        ours = self.evaluator.metrics_at(self.controller.global_step, self._drafter(module), module)
        return {**(metrics or {}), **(ours or {})}

    def _save_checkpoint(self, original: Callable[..., Any], step: int, *args: Any, **kwargs: Any) -> Any:
        saved = original(step, *args, **kwargs)
        if world()[0] == 0:
            folder = _checkpoint_folder(saved)
            path = folder / STATE_FILE
            states = _read_states(path) if path.exists() else {}  # another prefix's attachment wrote first
            states[self.prefix] = self.evaluator.state_dict()
            atomic_write_json(path, states)
        return saved

    # -- helpers ----------------------------------------------------------------------------------
    def _drafter(self, module: nn.Module) -> nn.Module:
        drafter = find_drafter(module, self.drafter_source, type(self).__name__)
        assert drafter is not None
        return drafter

    def _restore(self, step: int) -> None:
        """The evaluator's state saved in the checkpoint this run resumes from (``resume_from``, or the
        controller's own checkpoint folder of ``step``)."""
        folder = Path(self.resume_from) if self.resume_from is not None else Path(
            self.controller._checkpoint_manager().checkpoint_dir(step))
        path = folder / STATE_FILE
        try:
            states = _read_states(path)
        except FileNotFoundError:
            states = {}
        except ValueError as e:
            warnings.warn(f"{type(self).__name__}: {path} is not the evaluator's state ({e}); it is ignored and a "
                          f"new series starts at step {step}", RuntimeWarning, stacklevel=4)
            return
        state = states.get(self.prefix)
        if state is None:
            warnings.warn(f"{type(self).__name__}: no evaluator state for prefix={self.prefix!r} in {path} (a "
                          f"checkpoint written without it, or resume_from= names another folder); a new series "
                          f"starts at step {step}", RuntimeWarning, stacklevel=4)
            return
        self.evaluator.load_state_dict(state)

    def _keep_best_by(self, metric: str) -> None:
        """SpecForge's checkpoint manager keeps the best checkpoint by ``metric``: its best record is read
        again for that metric (a resumed run keeps its best; a record of another metric is ignored)."""
        c = self.controller
        if not (c.eval_interval and c.eval_interval > 0 and c.eval_data_factory is not None):
            raise check.ArgumentError(
                "keep_best_by_tau=True: SpecForge picks its best checkpoint at its own evaluations, and this "
                f"controller has none (eval_interval={c.eval_interval!r}, eval_data_factory="
                f"{'set' if c.eval_data_factory is not None else 'None'}); give the controller an eval_interval > 0 "
                "and an eval_data_factory (command line: training.eval_interval and data.eval_hidden_states_path)")
        manager = c._checkpoint_manager()
        self._best_before = (manager.best_metric, manager.best_score, manager.best_step)
        if manager.best_metric != metric:
            manager.best_metric, manager.best_score, manager.best_step = metric, None, None
            manager._load_best_meta()


def attach(controller: Any, states: str | os.PathLike | EvalConfig, every_n_train_steps: int = 500,
           drafter: DrafterSource = "draft_model", *, keep_best_by_tau: bool = False,
           resume_from: str | os.PathLike | None = None, sinks: Sequence[Any] | None = None,
           **options: Any) -> SpecForgeEvaluation:
    """Evaluate the drafter a SpecForge ``TrainerController`` trains, in its own loop (see the module doc).

    Args:
        controller: SpecForge 0.2.0's ``TrainerController`` (command line: ``tools/specforge_train.py``).
        states: cache folder written by ``tools/precompute_states.py`` (or an ``EvalConfig``).
        every_n_train_steps: evaluate after every N optimizer steps (``controller.global_step``).
        drafter: attribute path of the drafter on the trainable module (SpecForge's ``OnlineDFlashModel``),
            or a function ``module -> drafter``.
        keep_best_by_tau: SpecForge's checkpoint manager keeps the checkpoint with the best ``{prefix}tau``
            instead of its ``eval/simulated_acc_len`` (an accuracy). Needs the controller's own evaluations
            (``eval_interval > 0`` and an ``eval_data_factory``): the best is picked at those steps. Without
            it, pass ``checkpoint_manager=CheckpointManager(output_dir, run_id,
            best_metric="dflash_eval/tau")`` to the controller for the same effect.
        resume_from: the checkpoint folder a resumed run started from, when it is not the controller's own
            ``{output_dir}/{run_id}-step{N}`` (SpecForge's ``training.resume_from``); one that does not exist,
            or the state file in it, is refused (``check_resume_from``).
        sinks: more destinations beside SpecForge's ``logger`` (a W&B run, a TensorBoard ``SummaryWriter``, a
            ``MetricsSink``, a function ``log(metrics, step)``): SpecForge's logger gets the scalars only.
        options: ``EvalConfig``'s other fields (``dflash_cb.integrations.evaluator.config``). ``target_embed`` and
            ``target_lm_head`` default to the ``OnlineDFlashModel``'s ``embed_tokens``/``lm_head``; give
            ``target_embed=None`` for the cache's exported head.

    Returns the attachment (``.evaluator``, ``.detach()``). A second attachment with the same ``prefix`` on
    one controller is refused (their metrics and saved states would collide).
    """
    missing = [name for name in ("core", "fit", "evaluate_configured", "save_checkpoint", "global_step",
                                 "_checkpoint_manager") if not hasattr(controller, name)]
    if missing or not hasattr(getattr(controller, "core", None), "train_step"):
        raise check.ArgumentError(f"attach(controller={type(controller).__name__}): expected SpecForge 0.2.0's "
                                  "TrainerController (specforge.training.controller); the domain Trainer holds it "
                                  "as trainer._controller")
    if not isinstance(drafter, str) and not callable(drafter):
        raise check.ArgumentError(f"drafter={drafter!r}: expected an attribute path on the trainable module (str) or "
                                  "a function module -> drafter")
    check.flag("keep_best_by_tau", keep_best_by_tau)
    check_resume_from(resume_from)
    if isinstance(states, EvalConfig):
        evaluator = LiveEvaluator(states, name=SpecForgeEvaluation.__name__, **options)
    else:
        config = evaluation_config(states, every_n_train_steps, options)
        evaluator = LiveEvaluator(config, name=SpecForgeEvaluation.__name__)
    attached = _ATTACHED.setdefault(controller, {})
    one_per_prefix("attach()", evaluator.prefix, attached, "controller")
    attachment = SpecForgeEvaluation(controller, evaluator, drafter, keep_best_by_tau, resume_from, as_sinks(sinks, "sinks"))
    attachment._install()
    attached[evaluator.prefix] = attachment
    return attachment


def check_resume_from(resume_from: str | os.PathLike | None) -> None:
    """A ``resume_from`` is the checkpoint folder the run resumes from: one that does not exist would start a
    new series (the run's history lost to a typo), and the state file in it is not the folder."""
    if resume_from is None:
        return
    path = Path(resume_from)
    if path.is_dir():
        return
    if path.is_file():
        if path.name == STATE_FILE:
            raise check.ArgumentError(f"resume_from={path}: the evaluator's state file; give its folder, "
                                      f"resume_from={path.parent}")
        raise check.ArgumentError(f"resume_from={path}: a file; give the checkpoint folder the run resumes from "
                                  "(SpecForge's training.resume_from)")
    raise check.ArgumentError(f"resume_from={path}: no such folder; give the checkpoint folder the run resumes from "
                              "(SpecForge's training.resume_from), or leave resume_from out for the controller's own "
                              "{output_dir}/{run_id}-step{N}")


def evaluation_config(states: str | os.PathLike, every_n_train_steps: int, options: dict[str, Any]) -> EvalConfig:
    """The ``EvalConfig`` of an attachment: ``options`` are its fields; the head defaults to the
    ``OnlineDFlashModel``'s own matrices (``MODEL_HEAD``) unless ``target_embed``/``target_lm_head`` are given."""
    unknown = sorted(set(options) - set(config_fields()))
    if unknown:
        raise check.ArgumentError(f"unknown evaluator option(s) {', '.join(unknown)}; the options are EvalConfig's "
                                  f"fields: {', '.join(config_fields())}")
    if not {"target_embed", "target_lm_head"} & set(options):
        options = {**options, **MODEL_HEAD}
    return EvalConfig(states, every_n_train_steps, **options)


def _wrapping(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _checkpoint_folder(saved: Any) -> Path:
    """The folder of SpecForge's returned ``Checkpoint`` (``checkpoint_uri = file://<folder>``)."""
    uri = str(getattr(saved, "checkpoint_uri", ""))
    return Path(uri.removeprefix("file://"))


def _read_states(path: Path) -> dict[str, Any]:
    """``{prefix: state}`` from a checkpoint's state file (ValueError: not such a file)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object of {{prefix: state}}, found a {type(data).__name__}")
    return data
