"""Cheap optional phase timers: where an evaluation's time goes, without a profiler.

``PhaseTimer.phase(name)`` charges the time spent inside it to ``name``, less what nested phases take
(each second is counted once). Code that is timed takes a timer argument and uses ``NO_TIMER`` when none
is given: entering a phase then costs one attribute lookup. On an asynchronous device pass ``sync``
(``torch.cuda.synchronize``) so that each phase waits for its own kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class PhaseTimer:
    """Seconds per named phase, exclusive of nested phases, in the order first entered."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], object] | None = None):
        self.clock = clock
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._stack: list[str] = []
        self._mark = 0.0

    def _charge(self) -> None:
        if self.sync is not None:
            self.sync()
        now = self.clock()
        if self._stack:
            name = self._stack[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._charge()
        self._stack.append(name)
        self.seconds.setdefault(name, 0.0)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class _NoTimer:
    """A timer that times nothing (the default of timed code)."""

    _null = contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._null


NO_TIMER = _NoTimer()
