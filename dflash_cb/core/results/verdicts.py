"""The one rule that judges a paired difference, for every tool that shows one: ``tools/compare_results.py``
(``compare.paired``, ``compare.render_markdown``) and the sweep's best-vs-last table (``sweep_report``).

- ``B - A`` has a verdict ("B is better") only when its whole interval lies on one side of zero; otherwise the
  prompts cannot tell the two apart.
- The per-category rows (each category's tau, and its mean over requests) are many small comparisons at once:
  at 95% each, one of ten categories misses zero by chance about every other time (more on few prompts). So a
  category row has a verdict only where the headline, the overall tau, has one (the categories partition its
  prompts), and then from an interval Bonferroni-corrected for the number of categories ``m``: the bootstrap's
  level is ``1 - 0.05 / m`` (``category_level``).
- The rows a table of differences shows: ``difference_rows``, the same in every tool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..figures.bootstrap import DEFAULT_LEVEL, Interval
from ..figures.metrics import ACCEPT_LENGTH_SERVED, TAU, TAU_REQUEST_MEAN, category_tau, ddtree_tau

CATEGORY_PREFIX = "category/"  # the per-category metrics' names (``metrics.category_tau``)


@dataclass(frozen=True)
class Difference:
    """``b - a`` for one metric over ``n`` shared samples."""

    a: str
    b: str
    metric: str
    interval: Interval
    n: int
    level: float = DEFAULT_LEVEL  # of ``interval``
    family: int = 1  # comparisons made together with this one (the categories)
    gated: bool = False  # one of a family whose headline (the overall tau) has no verdict: none here either

    @property
    def text(self) -> str:
        iv = self.interval
        return f"{self.b} - {self.a} = {iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]"

    @property
    def cell(self) -> str:
        """The difference and its interval as a table's cell, the interval's level named when not 95%."""
        iv = self.interval
        level = f" [{self.level:.1%}]" if self.level != DEFAULT_LEVEL else ""
        return f"{iv.value:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}]{level}"

    @property
    def decided(self) -> bool:
        """Whether the interval lies on one side of zero (and the row may say so)."""
        iv = self.interval
        return not self.gated and (iv.low > 0 or iv.high < 0)

    @property
    def verdict(self) -> str:
        iv = self.interval
        if self.gated:
            return f"no verdict: the overall tau has none ({self.family} categories are {self.family} comparisons)"
        if not (math.isfinite(iv.low) and math.isfinite(iv.high)):
            return "no interval (too few cycles)"
        if iv.low > 0:
            said = f"{self.b} is better"
        elif iv.high < 0:
            said = f"{self.a} is better"
        else:
            said = f"no difference detectable with {self.n} prompts"
        if self.family > 1:
            said += f" (Bonferroni over {self.family} categories: {self.level:.1%} interval)"
        return said


def category_level(m: int, level: float = DEFAULT_LEVEL) -> float:
    """The interval level of each of ``m`` category rows (Bonferroni: the error ``1 - level`` split ``m`` ways)."""
    return 1 - (1 - level) / m if m > 1 else level


def judge(metrics: Iterable[str], a: str, b: str, n: int, categories: Sequence[str],
          interval: Callable[[str, float], Interval]) -> dict[str, Difference]:
    """``b - a`` for each metric (``TAU`` among them), each judged by the rule: ``interval(metric, level)`` is the
    paired bootstrap interval at ``level``, 95% for the overall figures and ``category_level`` for a category's."""
    names = list(metrics)
    out = {k: Difference(a, b, k, interval(k, DEFAULT_LEVEL), n) for k in names if not k.startswith(CATEGORY_PREFIX)}
    m = len(categories)
    level, headline = category_level(m), out[TAU].decided
    for k in names:
        if k.startswith(CATEGORY_PREFIX):
            out[k] = Difference(a, b, k, interval(k, level), n, level, m, gated=m > 1 and not headline)
    return out


def difference_rows(differences: Mapping[str, Difference], budgets: Sequence[int],
                    categories: Sequence[str]) -> list[str]:
    """The metrics a table of differences shows, in order: tau and its conventions, DDTree per budget, each
    category's tau, then a drafter family's walks both sides have (DFlash 2's selector walks)."""
    head = [TAU, TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED, *(ddtree_tau(b) for b in budgets),
            *(category_tau(c) for c in categories)]
    walks = [k for k in differences if k not in head and not k.startswith(CATEGORY_PREFIX)]
    return [k for k in head if k in differences] + walks


def family_note(m: int) -> str | None:
    """What a table with ``m`` category rows says about them (None with one category or none)."""
    if m < 2:
        return None
    return (f"The {m} category rows are {m} comparisons at once: a category has a verdict only where the overall tau "
            f"has one, from an interval Bonferroni-corrected for {m} comparisons ({category_level(m):.1%} each).")
