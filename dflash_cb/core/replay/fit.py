"""A drafter fitted to a cache once: its family resolved and every check on its shape run, before any work.

``fit_drafter`` is the one place the replay turns a drafter's family name into the family: past it, code holds
the ``FittedDrafter`` (its family object, spec, block, budgets and SpecForge pass) and asks the registry nothing.
What it checks depends on the drafter's config and the cache's manifest only (cheap: no shard, no weight is
read), so a caller fits before hashing or loading anything large; the live evaluator fits once per session and
``evaluate`` reuses the fit at every evaluation. The weights' finiteness is not part of a fit: training moves
them, so ``evaluate`` checks them each time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...cache.states import StateCache
from ...common.errors import DFlashCBError
from ..drafters.base import DrafterFamily
from ..drafters.registry import family_named
from ..drafters.runners import DraftRunner, as_runner
from ..drafters.spec import DrafterSpec
from ..loop.cycles import check_block_size
from ..loop.ddtree import check_ddtree_budgets
from ..loop.limits import DEFAULT_LIMITS, MemoryLimits
from .report import SPECFORGE_LEFT_OUT, SPECFORGE_OWN_PASS
from .request import SpecForgePass


@dataclass(frozen=True)
class FittedDrafter:
    """A drafter as checked against a cache (``fit_drafter``)."""

    family: DrafterFamily
    spec: DrafterSpec  # the drafter's own
    block_size: int  # the block every cycle drafts: the one asked for, else the drafter's
    budgets: tuple[int, ...]  # every DDTree budget checked (sorted): an evaluation may use any of them
    specforge: SpecForgePass  # how ``specforge/acc`` is computed at ``block_size``
    specforge_note: str  # the report's note on it ("" when SpecForge's masks are the served ones)

    @property
    def drafting_spec(self) -> DrafterSpec:
        """``spec`` at the block the cycles draft (the report keeps ``spec``)."""
        return dataclasses.replace(self.spec, block_size=self.block_size)

    def covers(self, spec: DrafterSpec, block_size: int | None, budgets: Sequence[int]) -> bool:
        """This fit holds for a drafter of ``spec`` evaluated at ``block_size`` (None: the drafter's) with
        ``budgets``: the same drafter shape, the same block, budgets among those checked."""
        return (spec == self.spec and (block_size or spec.block_size) == self.block_size
                and set(budgets) <= set(self.budgets))


def check_tree_support(family: DrafterFamily, budgets: Sequence[int], option: str = "budgets") -> None:
    """Refuse DDTree budgets for a family whose drafts make no DDTree (``DrafterFamily.supports_tree``)."""
    if budgets and not family.supports_tree:
        raise DFlashCBError(f"{option} {list(budgets)}: {family.tree_refusal()}; pass no budgets "
                            "(--ddtree-budgets '' / ddtree_budgets=())")


def specforge_pass(family: DrafterFamily, runner: DraftRunner, block_size: int) -> tuple[SpecForgePass, str]:
    """How ``specforge/acc`` is computed for ``runner``'s drafter at ``block_size`` and the report's note on
    it ("" when SpecForge's masks are the served ones)."""
    if not family.specforge_accuracy:
        return SpecForgePass.LEFT_OUT, (f"specforge/acc is left out: SpecForge's {family.label} accuracy scores its "
                                        "own objective, which is not replayed")
    difference = runner.specforge_difference(block_size)
    if difference is None:
        return SpecForgePass.SAME_DRAFTS, ""
    if runner.has_specforge_masks:
        return SpecForgePass.OWN_PASS, f"{difference}: {SPECFORGE_OWN_PASS}"
    return SpecForgePass.LEFT_OUT, f"{difference}: {SPECFORGE_LEFT_OUT}"


def fit_drafter(cache: StateCache, drafter: Any, *, block_size: int | None = None,
                budgets: Mapping[str, Sequence[int]] | Sequence[int] = (), spec: DrafterSpec | None = None,
                limits: MemoryLimits = DEFAULT_LIMITS, names: Mapping[str, str] | None = None,
                runner: DraftRunner | None = None) -> FittedDrafter:
    """Check ``drafter`` against ``cache`` once: the family's cache needs (layers, widths, target layers, filler
    token), the block (2 .. the drafter's, or the family's cap), each set of DDTree budgets (the family makes trees;
    at most ``ddtree.max_ddtree_budget`` nodes), and how ``specforge/acc`` is computed.

    ``budgets``: one sequence, or several by the option that gave them (``{"ddtree_budgets": ..., ...}``);
    ``names`` spells options as the caller takes them (``{"block_size": "--block-size"}``). ``spec``: the
    drafter's spec when its class carries none. Raises ``CacheMismatchError`` / ``DFlashCBError`` naming what
    does not fit."""
    runner = runner if runner is not None else as_runner(drafter, spec, limits)
    spec = runner.spec
    family = family_named(spec.family)  # the one lookup: the name comes from the drafter's config
    cache.check_fit(family.cache_needs(spec, getattr(drafter, "config", None)))
    spelled = dict(names or {})
    block = check_block_size(block_size, spec.block_size, spelled.get("block_size", "block_size"),
                             cap=family.block_cap(spec))
    sets = dict(budgets) if isinstance(budgets, Mapping) else {"budgets": tuple(budgets)}
    for option, chosen in sets.items():
        name = spelled.get(option, option)
        check_tree_support(family, chosen, name)
        check_ddtree_budgets(chosen, block, cache.manifest.vocab_size, name, family.tree_candidates(spec),
                             family.tree_candidates_why(spec, block))
    specforge, note = specforge_pass(family, runner, block)
    every = tuple(sorted({b for chosen in sets.values() for b in chosen}))
    return FittedDrafter(family, spec, block, every, specforge, note)
