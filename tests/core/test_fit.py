"""A drafter fitted once (``dflash_cb.core.replay.fit``): the family resolved and every shape check run in one
place, reused by every evaluation of the same drafter; the registry is asked nothing past the fit."""

from __future__ import annotations

import pytest
import torch

from dflash_cb import DFlashDrafter, LiveEvaluator
from dflash_cb.cache.states import StateCache
from dflash_cb.common.errors import DFlashCBError
from dflash_cb.core.drafters.registry import family_named
from dflash_cb.core.loop.ddtree import DDTreeBudgetError
from dflash_cb.core.replay import SpecForgePass, evaluate, fit, fit_drafter


def _drafter(cfg: dict, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter.from_config_dict(cfg)


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
    """Every family the fit module looks up by name, in order."""
    seen: list[str] = []

    def counting(name: str):
        seen.append(name)
        return family_named(name)

    monkeypatch.setattr(fit, "family_named", counting)
    return seen


def test_the_fit_holds_the_checked_facts(tiny_cache, tiny_drafter_config, lookups) -> None:
    cache = StateCache(tiny_cache)
    got = fit_drafter(cache, _drafter(tiny_drafter_config), block_size=4, budgets={"a": [8, 4], "b": [4, 16]})
    assert lookups == ["dflash"]  # one lookup, of the name the drafter's config gives
    assert got.family is family_named("dflash") and got.block_size == 4 and got.budgets == (4, 8, 16)
    assert got.drafting_spec.block_size == 4 and got.spec.block_size == tiny_drafter_config["block_size"]
    assert got.specforge in tuple(SpecForgePass)
    assert got.covers(got.spec, 4, [16]) and not got.covers(got.spec, 3, [16]) and not got.covers(got.spec, 4, [32])


def test_an_evaluation_given_the_fit_asks_the_registry_nothing(tiny_cache, tiny_drafter_config, lookups) -> None:
    cache = StateCache(tiny_cache)
    d = _drafter(tiny_drafter_config)
    fitted = fit_drafter(cache, d, budgets=[4])
    lookups.clear()
    with_fit = evaluate(cache, d, budgets=(4,), fit=fitted)
    assert lookups == []
    alone = evaluate(cache, d, budgets=(4,))
    assert lookups == ["dflash"]  # fitted here, once
    assert with_fit.summary == alone.summary and with_fit.family is fitted.family
    lookups.clear()
    evaluate(cache, d, budgets=(4,), block_size=3, fit=fitted)  # another block: the fit does not cover it
    assert lookups == ["dflash"]


def test_a_budget_above_the_tree_limit_is_refused_by_the_evaluation_too(tiny_cache, tiny_drafter_config) -> None:
    cache = StateCache(tiny_cache)
    with pytest.raises(DDTreeBudgetError, match="budgets"):
        evaluate(cache, _drafter(tiny_drafter_config), budgets=(10**9,))


def test_a_block_above_the_drafters_is_refused_naming_the_option(tiny_cache, tiny_drafter_config) -> None:
    with pytest.raises(DFlashCBError, match="--block-size"):
        fit_drafter(StateCache(tiny_cache), _drafter(tiny_drafter_config), block_size=99,
                    names={"block_size": "--block-size"})


def test_the_live_evaluator_fits_once_per_session(tiny_cache, tiny_drafter_config, monkeypatch) -> None:
    calls: list[int] = []
    real = fit.fit_drafter

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    from dflash_cb.integrations.evaluator import session

    monkeypatch.setattr(session, "fit_drafter", counting)
    ev = LiveEvaluator(str(tiny_cache), console=False, ddtree_budgets=[4], every_n_train_steps=1)
    ev.start(0, _drafter(tiny_drafter_config, 0))
    for step in (1, 2, 3):
        assert ev.step(step, _drafter(tiny_drafter_config, step)) is not None
    assert len(ev.history) >= 3 and calls == [1]
