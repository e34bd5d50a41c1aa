"""Which samples of a cache an evaluation scores: one rule for the callback and ``tools/eval_drafter.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..common.errors import DFlashCBError
from .states import StateCache


def stratified_ids(ids: Sequence[str], category: Callable[[str], str], n: int, seed: int | None) -> list[str]:
    """``n`` of ``ids``, round-robin over categories (shuffled per category with ``seed``; in order if
    None), returned in the order of ``ids``. A private generator: the global RNG is untouched."""
    if n <= 0:
        return []
    by_cat: dict[str, list[str]] = {}
    for i in ids:
        by_cat.setdefault(category(i), []).append(i)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for c in sorted(by_cat):
            perm = torch.randperm(len(by_cat[c]), generator=g).tolist()
            by_cat[c] = [by_cat[c][j] for j in perm]
    chosen: list[str] = []
    queues = [list(by_cat[c]) for c in sorted(by_cat)]
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    order = {i: k for k, i in enumerate(ids)}
    return sorted(chosen, key=order.__getitem__)


class SampleSelectionError(DFlashCBError, ValueError):
    """A requested sample subset does not exist in the cache."""


def select_sample_ids(cache: StateCache, num_samples: int | None = None, sample_ids: Sequence[str] | None = None,
                      seed: int = 0) -> list[str]:
    """The samples an evaluation scores; the callback's ``num_samples``/``sample_ids`` and
    ``tools/eval_drafter.py --samples/--sample-ids`` both call this, so they pick the same subset.

    ``sample_ids`` wins (duplicates dropped, order kept); else ``num_samples`` draws a fixed subset
    stratified by category (round-robin, seeded); else every sample, in cache order.
    """
    all_ids = [s.id for s in cache.samples]
    if sample_ids is not None:
        known = set(all_ids)
        unknown = [i for i in sample_ids if i not in known]
        if unknown:
            raise SampleSelectionError(f"sample ids {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are not in "
                                       f"the cache {cache.path} (its ids: {', '.join(all_ids[:5])}"
                                       f"{' ...' if len(all_ids) > 5 else ''})")
        if not sample_ids:
            raise SampleSelectionError("the list of sample ids is empty: give at least one id")
        return list(dict.fromkeys(sample_ids))
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 1):
        raise SampleSelectionError(f"the number of samples must be a positive integer (or none for all), "
                                   f"got {num_samples!r}")
    if num_samples is None or num_samples >= len(all_ids):
        return all_ids
    return stratified_ids(all_ids, lambda i: cache.entry(i).category, num_samples, seed)
