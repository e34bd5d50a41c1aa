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

from ..common import arguments as check
from .anchor_sets import DEFAULT_ANCHOR_SEED, check_anchor_offsets
from .cost import DEFAULT_LIMITS, MemoryLimits
from .model import DrafterSpec
from .replay import TailBlocks, check_tail_blocks

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


@dataclass(frozen=True)
class EvalRequest:
    """The options of one ``engine.evaluate`` (documented there); normalised and checked at construction.

    ``budgets`` sorted and unique, ``sample_ids`` and the strides as tuples, ``device`` a ``torch.device``
    (None: the drafter's). ``block_size`` None = the drafter's (checked against it by the engine).
    """

    sample_ids: tuple[str, ...] | None = None
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    anchor_stride: int = 1
    extra_anchor_strides: tuple[int, ...] = ()
    anchor_seed: int = DEFAULT_ANCHOR_SEED
    anchor_offsets: Mapping[str, int] | None = field(default=None, compare=False)
    block_size: int | None = None
    tail_blocks: TailBlocks = "served"
    device: torch.device | None = None
    autocast_dtype: torch.dtype | None = None
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
            raise check.ArgumentError(f"limits={self.limits!r}: expected a dflash_cb.core.cost.MemoryLimits")
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
