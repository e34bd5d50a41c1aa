"""The benchmarks' timing convention: runs interleaved over repetitions (every other repetition in reverse order,
so a drift of the machine's speed falls on every run alike), the fastest repetition kept."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from dflash_cb.common.timing import PhaseTimer


def fastest(reps: int, profiles: Mapping[str, Any], runs: Mapping[str, Any],
            run: Callable[[Any, Any, PhaseTimer], Any]) -> dict[tuple[str, str], tuple[Any, float, dict[str, float]]]:
    """``{(profile, run label): (result, wall seconds, phase seconds)}`` of the fastest of ``reps`` repetitions of
    ``run(runs[label], profiles[profile], timer)``, the runs interleaved within each profile."""
    best: dict[tuple[str, str], tuple[Any, float, dict[str, float]]] = {}
    for rep in range(reps):
        for name, options in profiles.items():
            order = list(runs.items())
            if rep % 2:
                order.reverse()
            for label, subject in order:
                timer = PhaseTimer()
                t = time.perf_counter()
                out = run(subject, options, timer)
                wall = time.perf_counter() - t
                if (name, label) not in best or wall < best[(name, label)][1]:
                    best[(name, label)] = (out, wall, timer.seconds)
    return best
