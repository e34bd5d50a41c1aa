"""The replay: a drafter scored on a cache of target states, exactly, without the target.

One door: callers import from here. Inside, one module per phase of an evaluation: ``request`` (what to
compute), ``fit`` (the drafter checked against the cache once), ``plan`` (what every wave shares, which samples go
together), ``wave`` (a wave's flat tables), ``walks`` (the replay walks, advanced together), ``scoring`` (drafting
and scoring a chunk of slots: the only room a family's runner and proposer enter), ``report`` (what an evaluation
returns), ``engine`` (the loop over them), ``phases`` and ``precision`` (the timer's phases, the autocast rule).

This package was once the module ``dflash_cb/core/replay.py``, whose names are in ``dflash_cb.core.loop.cycles``
now: until the next release they import from here too, with a ``DeprecationWarning``."""

from ...common.moved import names_from
from .engine import evaluate
from .fit import FittedDrafter, check_tree_support, fit_drafter
from .phases import PHASE_GROUPS, PHASES, group_seconds
from .plan import anchors_per_sample, bounds_for
from .precision import AUTOCAST_NAMES, autocast_context, resolve_autocast
from .report import EvalReport, SampleResult, summed_counts
from .request import DEFAULT_BUDGETS, QUANTITY, EvalRequest, SpecForgePass, series_differences, series_names

__all__ = ["AUTOCAST_NAMES", "DEFAULT_BUDGETS", "PHASES", "PHASE_GROUPS", "QUANTITY", "EvalReport", "EvalRequest", "FittedDrafter",
           "SampleResult", "SpecForgePass", "anchors_per_sample", "autocast_context", "bounds_for",
           "check_tree_support", "evaluate", "fit_drafter", "group_seconds", "resolve_autocast", "series_differences", "series_names",
           "summed_counts"]

__getattr__ = names_from(__name__, "dflash_cb.core.loop.cycles")
