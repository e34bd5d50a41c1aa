"""When the live evaluator evaluates, and with which profile: pure decisions on integers.

``LiveEvaluator`` acts on them at the loop's calls (``start``/``step``/``finish``); they are apart so
that the rules can be read and tested on their own, as Lightning's callbacks keep their predicates.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Trigger(enum.Enum):
    """What called for an evaluation."""

    FIT_START = "fit start"  # before the first training step (the untrained or resumed drafter)
    PERIODIC = "step"  # every_n_train_steps, or a loop asking for this step's figures (metrics_at)
    FIT_END = "fit end"  # after the last step: always a full evaluation


@dataclass(frozen=True)
class Reason:
    """Why an evaluation runs: its trigger and the step; ``str`` is how messages name it."""

    trigger: Trigger
    step: int

    def __str__(self) -> str:
        return f"step {self.step}" if self.trigger is Trigger.PERIODIC else self.trigger.value

    @property
    def full(self) -> bool:
        """The fit-end evaluation is always a full one."""
        return self.trigger is Trigger.FIT_END


@dataclass(frozen=True)
class Profile:
    """What one evaluation computes: its DDTree budgets and its anchor-statistics stride.

    Every evaluation reports the light profile's figures under the main keys (one estimator per key); a
    full one also reports its own exact figures under ``full/``, from the same drafter pass."""

    full: bool  # the full profile: stride 1, every budget
    budgets: tuple[int, ...]
    stride: int
    light_budgets: tuple[int, ...]  # the main keys' budgets and stride (== budgets, stride when light)
    light_stride: int

    @property
    def kind(self) -> str:
        """The profile's name: "full" or "light" (the cost model calibrates each apart)."""
        return "full" if self.full else "light"


def fit_start_eval_due(step: int, last_eval_step: int, start_done: bool, eval_on_fit_start: bool) -> bool:
    """Evaluate before the first training step? Once per run: a resumed run does not repeat it, nor
    evaluate again a step already evaluated."""
    return eval_on_fit_start and not start_done and step != last_eval_step


def periodic_eval_reason(step: int, every_n_train_steps: int, last_eval_step: int, eval_on_fit_end: bool,
                         max_steps: int) -> Reason | None:
    """The reason of the evaluation due as optimizer step ``step``'s batch ends (None: no evaluation)."""
    n = every_n_train_steps
    # step > 0: with gradient accumulation the first micro-batches end at step 0, before any update.
    if not (n > 0 and step > 0 and step % n == 0 and step != last_eval_step):
        return None
    # The last step's evaluation is the fit-end one: full, and not repeated by finish().
    last = eval_on_fit_end and 0 < max_steps <= step
    return Reason(Trigger.FIT_END if last else Trigger.PERIODIC, step)


def fit_end_eval_due(step: int, last_eval_step: int, last_eval_full: bool, eval_on_fit_end: bool) -> bool:
    """Evaluate after the last step? Unless that step was just evaluated with the full profile."""
    return eval_on_fit_end and (step != last_eval_step or not last_eval_full)


def is_full_evaluation(reason: Reason, evals_done: int, full_every_n_evals: int) -> bool:
    """Full profile (anchor stride 1, every DDTree budget) at fit end and for every N-th evaluation
    (``full_every_n_evals``; 0 = only at fit end); otherwise the light periodic profile."""
    n = full_every_n_evals
    return reason.full or (n > 0 and (evals_done + 1) % n == 0)


def choose_profile(reason: Reason, evals_done: int, full_every_n_evals: int, budgets: tuple[int, ...],
                   light_budgets: tuple[int, ...], light_stride: int) -> Profile:
    """The profile of the evaluation about to run (``is_full_evaluation``)."""
    if is_full_evaluation(reason, evals_done, full_every_n_evals):
        return Profile(True, budgets, 1, light_budgets, light_stride)
    return Profile(False, light_budgets, light_stride, light_budgets, light_stride)


