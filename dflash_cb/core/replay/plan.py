"""What every wave of one evaluation shares, and which samples are evaluated together."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ...cache.manifest import Manifest, SampleEntry
from ...cache.states import CachedSample, StateCache
from ..drafters.runners import DraftRunner
from ..loop.anchor_sets import strided
from ..loop.cycles import (
    SampleBounds,
    sample_bounds,
)


@dataclass(frozen=True)
class Plan:
    """What every wave of one evaluation shares."""

    strides: tuple[int, ...]  # the statistics strides: ``anchor_stride`` first, then the extra ones
    offsets: dict[int, dict[str, int]]  # per stride: each sample's offset (``anchor_sets``)
    budgets: tuple[int, ...]  # the DDTree budgets: one walk each
    family_walks: tuple[str, ...]  # the drafter family's own walks (``Proposer.walks``)
    depth_counts: tuple[str, ...]  # the drafter family's per-depth statistics (``Proposer.depth_counts``)
    depths: int  # drafted depths of a full block (block size - 1)
    keep_drafts: bool
    draft_all: bool  # the first round drafts every anchor (``evaluate(draft_all=True)``)
    stop_token_ids: tuple[int, ...]
    device: torch.device
    verify: bool

    @property
    def walks(self) -> int:
        """Walks per sample: the greedy one, one per DDTree budget, then the family's own, in that order."""
        return 1 + len(self.budgets) + len(self.family_walks)



def stats_anchors(bounds: SampleBounds, stride: int, offset: int = 0) -> range:
    """One sample's anchor-statistics set: every ``stride``-th anchor from its ``offset``-th
    (``anchor_sets``: the offset is drawn per sample, so the first anchor is not always in)."""
    return strided(bounds.anchors, stride, offset)



def bounds_for(sample: CachedSample, manifest: Manifest) -> SampleBounds:
    e = sample.entry
    last = int(sample.input_ids[-1]) if e.total_len > 0 else None
    return sample_bounds(e.prompt_len, e.total_len, e.valid_len, manifest.max_new_tokens, last,
                         manifest.stop_token_ids)


def anchor_count(entry: SampleEntry, manifest: Manifest) -> int:
    """How many anchors a sample has (``len(bounds_for(...).anchors)``) from its manifest entry alone: the
    last token, which ``bounds_for`` reads from the shard, moves the loop's end but never the anchors."""
    return len(sample_bounds(entry.prompt_len, entry.total_len, entry.valid_len, manifest.max_new_tokens, None,
                             ()).anchors)


def anchors_per_sample(cache: StateCache, ids: Iterable[str]) -> dict[str, int]:
    """``{sample id: anchors}`` without reading a shard (for ``anchor_sets.sparse_stride_warning``)."""
    return {i: anchor_count(cache.entry(i), cache.manifest) for i in ids}


def split_waves(cache: StateCache, ids: list[str], runner: DraftRunner, dtype: torch.dtype, budget: int) -> list[list[str]]:
    """Split ``ids`` (in order) into groups whose prepared states fit ``budget`` bytes together."""
    waves: list[list[str]] = [[]]
    used = 0
    for sid in ids:
        need = runner.state_bytes(cache.entry(sid).total_len, dtype)
        if waves[-1] and used + need > budget:
            waves.append([])
            used = 0
        waves[-1].append(sid)
        used += need
    return [w for w in waves if w]
