"""The phases an evaluation's timer reports and the cost group each belongs to."""

from __future__ import annotations

from collections.abc import Mapping

from ..loop.limits import COST_GROUPS

# The phases an evaluation's timer reports (``evaluate(timer=...)``), exclusive of each other: reading
# the cache; the context K/V; the drafter's blocks up to the last layer's attention; the rest of that layer
# and the output head at the positions read; the DDTree heaps; the walks and their tables; the statistics.
LOAD, CONTEXT, FORWARD, HEAD, DDTREE, WALK, STATISTICS = (
    "load", "context K/V", "drafter forward", "head", "DDTree", "replay walk", "statistics")
PHASES = (LOAD, CONTEXT, FORWARD, HEAD, DDTREE, WALK, STATISTICS)
# The cost group of each phase (``limits.COST_GROUPS``): what ``costs.evaluation.Calibration`` measures apart.
PHASE_GROUPS = {LOAD: "other", CONTEXT: "drafter", FORWARD: "drafter", HEAD: "drafter", DDTREE: "ddtree",
                WALK: "other", STATISTICS: "other"}


def group_seconds(phases: Mapping[str, float], total: float) -> dict[str, float]:
    """An evaluation's seconds per cost group from its phase timer's seconds; what no phase timed (checks,
    setup) counts as "other", so the groups sum to ``total``."""
    out = dict.fromkeys(COST_GROUPS, 0.0)
    for name, seconds in phases.items():
        out[PHASE_GROUPS.get(name, "other")] += seconds
    out["other"] += max(0.0, total - sum(phases.values()))
    return out

