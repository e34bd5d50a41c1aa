"""``EvalRequest``: what one evaluation computes, checked once, frozen.

Every caller of the engine (``engine.evaluate``; the live evaluator's measuring side, ``eval_drafter.py``, the
sweep) states its options in one of these instead of a loose dict of keywords, so an option added here
reaches every caller or fails where it is built. Pure: no file access, no drafter (what depends on the
drafter, its block and spec, is checked by the engine against the drafter it is given).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common import arguments as check
from ..drafters.spec import DrafterSpec
from ..loop.anchor_sets import DEFAULT_ANCHOR_SEED, check_anchor_offsets
from ..loop.cycles import TailBlocks, check_tail_blocks
from ..loop.limits import DEFAULT_LIMITS, MemoryLimits

DEFAULT_BUDGETS = (16, 32, 64)


class SpecForgePass(enum.Enum):
    """How ``specforge/acc`` is computed for a drafter (``engine.specforge_pass``).

    ``SAME_DRAFTS``: SpecForge trains under the served masks, so its accuracy comes from the same drafts
    (shortened tail blocks excepted, drafted again in full); ``OWN_PASS``: its masks differ, so the
    statistics anchors are drafted once more under them; ``LEFT_OUT``: they differ and the drafter's runner
    cannot run them, so the figure is not reported."""

    SAME_DRAFTS = "served"
    OWN_PASS = "own pass"
    LEFT_OUT = "none"


# What identifies a series of figures: every option that changes a logged figure is marked on its field
# (``field(metadata=...)``) with the name results.json records it under (``EvalReport.series``, ``meta``), and
# what it changes: "quantity", the number measured (the block drafted, the tail convention, the compute
# dtype), or "estimator", only how the anchor statistics estimate it (their anchor set). The live evaluator
# starts a new series when any of them changes; baselines and comparisons warn when a quantity differs.
QUANTITY, ESTIMATOR = "quantity", "estimator"


def _series(name: str, kind: str) -> dict[str, str]:
    return {"series": name, "changes": kind}


@dataclass(frozen=True)
class EvalRequest:
    """The options of one ``engine.evaluate`` (documented there); normalised and checked at construction.

    ``budgets`` sorted and unique, ``sample_ids`` and the strides as tuples, ``device`` a ``torch.device``
    (None: the drafter's). ``block_size`` None = the drafter's (checked against it by the engine).
    """

    sample_ids: tuple[str, ...] | None = None
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    anchor_stride: int = field(default=1, metadata=_series("anchor_stride", ESTIMATOR))
    extra_anchor_strides: tuple[int, ...] = ()
    anchor_seed: int = field(default=DEFAULT_ANCHOR_SEED, metadata=_series("anchor_seed", ESTIMATOR))
    anchor_offsets: Mapping[str, int] | None = field(default=None, compare=False)
    block_size: int | None = field(default=None, metadata=_series("block_size", QUANTITY))
    tail_blocks: TailBlocks = field(default="served", metadata=_series("tail_blocks", QUANTITY))
    device: torch.device | None = None
    autocast_dtype: torch.dtype | None = field(default=None, metadata=_series("dtype", QUANTITY))
    spec: DrafterSpec | None = None  # the drafter's spec when its class carries none
    verify: bool = False  # hash a shard again when its file identity changed since it was hashed
    keep_drafts: int = 0  # per sample, the draft blocks of this many first cycles (SampleResult.drafts)
    draft_all: bool = False
    limits: MemoryLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_tail_blocks(self.tail_blocks)
        if not check.is_int(self.anchor_stride) or self.anchor_stride < 1:
            raise check.ArgumentError(f"anchor_stride must be >= 1 (1 = every anchor), got {self.anchor_stride!r}")
        put("anchor_seed", check.int_at_least("anchor_seed", self.anchor_seed, 0))
        extra = check.int_list("extra_anchor_strides", list(self.extra_anchor_strides), 1)
        put("extra_anchor_strides", tuple(sorted(set(extra) - {self.anchor_stride})))
        put("anchor_offsets", check_anchor_offsets("anchor_offsets", self.anchor_offsets, self.anchor_stride))
        if not isinstance(self.limits, MemoryLimits):
            raise check.ArgumentError(f"limits={self.limits!r}: expected a dflash_cb.core.loop.limits.MemoryLimits")
        budgets = tuple(sorted({int(b) for b in self.budgets}))
        if any(b < 1 for b in budgets):
            raise ValueError(f"DDTree budgets must be positive, got {budgets}")
        put("budgets", budgets)
        if self.sample_ids is not None:
            put("sample_ids", tuple(self.sample_ids))
        put("keep_drafts", check.int_at_least("keep_drafts", self.keep_drafts, 0))
        if self.device is not None and not isinstance(self.device, torch.device):
            put("device", torch.device(self.device))
        put("verify", bool(self.verify))
        put("draft_all", bool(self.draft_all))

    @property
    def strides(self) -> tuple[int, ...]:
        """Every statistics stride: ``anchor_stride`` first, then the extra ones."""
        return (self.anchor_stride, *self.extra_anchor_strides)

    def series(self, block_size: int | None = None) -> dict[str, Any]:
        """What identifies the figures of this request (``series_fields``), under results.json's names:
        ``block_size`` (None: this request's; pass the resolved block when it defers to the drafter's), the
        tail convention, the compute dtype (``"float32"`` without autocast) and the anchor set."""
        out: dict[str, Any] = {}
        for f, (name, _) in series_fields().items():
            value = getattr(self, f)
            if f == "autocast_dtype":
                value = str(value or torch.float32).removeprefix("torch.")
            elif f == "block_size" and block_size is not None:
                value = block_size
            out[name] = value
        return out

    def replace(self, **changes: Any) -> EvalRequest:
        """A copy with ``changes``, checked like a new one."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, request: EvalRequest | None, options: Mapping[str, Any]) -> EvalRequest:
        """``request`` (default: a fresh one) with the keyword ``options`` of a call replacing its fields; an
        unknown option is a ``TypeError`` naming it, as for any misspelt keyword."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"evaluate() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        base = request if request is not None else cls()
        return base.replace(**options) if options else base


def series_fields() -> dict[str, tuple[str, str]]:
    """``{EvalRequest field: (its name in results.json, QUANTITY or ESTIMATOR)}``, from the fields' metadata:
    the one list of what identifies a series."""
    return {f.name: (f.metadata["series"], f.metadata["changes"]) for f in dataclasses.fields(EvalRequest)
            if "series" in f.metadata}


def series_names(kind: str | None = None) -> tuple[str, ...]:
    """The results.json names of the series fields (of one ``kind`` only, when given)."""
    return tuple(name for name, k in series_fields().values() if kind is None or k == kind)


def series_differences(a: Mapping[str, Any], b: Mapping[str, Any], kind: str | None = None) -> list[tuple[str, Any, Any]]:
    """``(name, a's value, b's value)`` for every series field (of ``kind``) the two records do not agree on; a
    record that lacks a name (an older file) says None there."""
    return [(n, a.get(n), b.get(n)) for n in series_names(kind) if a.get(n) != b.get(n)]
