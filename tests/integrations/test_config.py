"""One configuration for every loop: the adapters' arguments are ``EvalConfig``'s fields plus their own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dflash_cb.common.arguments import ArgumentError
from dflash_cb.integrations.evaluator.config import OLD_NAMES, EvalConfig, config_fields
from dflash_cb.integrations.evaluator.live import LiveEvaluator
from dflash_cb.integrations.loops.hf import DFlashEvalTrainerCallback
from dflash_cb.integrations.loops.lightning import DFlashEvalCallback

OWN = {DFlashEvalCallback: ("drafter", "prog_bar", "sinks"), DFlashEvalTrainerCallback: ("trainer", "drafter", "sinks")}


@pytest.mark.parametrize("adapter", list(OWN), ids=lambda a: a.__name__)
def test_adapter_parameters_are_the_config_fields_plus_their_own(adapter):
    params = inspect.signature(adapter.__init__).parameters
    names = [n for n in params if n != "self"]
    own = OWN[adapter]
    assert sorted(names) == sorted((*config_fields(), *own))
    defaults = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
    for name in config_fields():
        if name == "states":
            continue
        assert params[name].default == defaults[name], name


@pytest.mark.parametrize("adapter", list(OWN), ids=lambda a: a.__name__)
def test_adapter_builds_the_config_from_every_argument(adapter):
    """Every argument reaches the config (none forgotten in the explicit call)."""
    given = {"every_n_train_steps": 7, "eval_on_fit_start": False, "eval_on_fit_end": False,
             "target_embed": "embed", "target_lm_head": "head", "ddtree_budgets": [8, 4],
             "light_ddtree_budgets": [4], "light_anchor_stride": 3, "anchor_seed": 5, "full_every_n_evals": 2,
             "num_samples": 5, "sample_ids": ["a"], "sample_seed": 9, "prefix": "x/", "baselines": {"b": "b.json"},
             "published": "p.yaml", "published_entries": ["e"], "cost_profile": "c.json", "fail_on_error": True, "max_failed_evaluations": 1,
             "autocast_dtype": "bfloat16", "table_samples": 2, "table_cycles": 3, "tokenizer": "tok",
             "verify_cache": False, "position_edges": [0, 4], "console": False, "tail_blocks": "reference",
             "block_size": 4}
    assert set(given) == set(config_fields()) - {"states", *OLD_NAMES}
    cb = adapter(states="c", **given)
    expected = EvalConfig(states="c", **given)
    assert cb.evaluator.config == expected and cb.evaluator.config.tokenizer == "tok"


@pytest.mark.parametrize("adapter", list(OWN), ids=lambda a: a.__name__)
def test_the_light_options_old_names_are_accepted(adapter):
    """``periodic_ddtree_budgets`` / ``periodic_anchor_stride`` (YAML written for them) give the config the light
    options' values; both names of one option are refused, naming both."""
    old = adapter(states="c", periodic_ddtree_budgets=[8, 4], periodic_anchor_stride=3).config
    assert old == adapter(states="c", light_ddtree_budgets=[4, 8], light_anchor_stride=3).config
    assert (old.light_budgets, old.light_stride(16), old.periodic_anchor_stride) == ((4, 8), 3, None)
    with pytest.raises(ArgumentError, match="periodic_anchor_stride and light_anchor_stride both given"):
        adapter(states="c", periodic_anchor_stride=3, light_anchor_stride=4)


@pytest.mark.parametrize("prefix", ["dflash", "", "/", "dflash eval/", "dflash_eval/full/", "x/ddtree/", 3])
def test_a_prefix_that_cannot_name_keys_is_refused(prefix):
    """A prefix is a name ending in '/' (``dflash`` would log ``dflashtau``) whose last part is no metric
    namespace (``dflash_eval/full/`` would log over the default evaluator's full keys)."""
    with pytest.raises(ArgumentError, match="prefix="):
        EvalConfig("c", prefix=prefix)
    assert EvalConfig("c", prefix="dflash_eval_b/").prefix == "dflash_eval_b/"
    assert EvalConfig("c", prefix="runs/a/dflash_eval/").prefix == "runs/a/dflash_eval/"


def test_config_is_frozen_and_replace_checks_again():
    cfg = EvalConfig("c", every_n_train_steps=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.every_n_train_steps = 5  # type: ignore[misc]
    assert cfg.replace(every_n_train_steps=5).every_n_train_steps == 5
    with pytest.raises(ArgumentError, match="every_n_train_steps=2.5"):
        cfg.replace(every_n_train_steps=2.5)


def test_evaluator_takes_a_config_or_the_same_options():
    cfg = EvalConfig("c", every_n_train_steps=4, num_samples=3)
    assert LiveEvaluator(cfg).config == LiveEvaluator("c", every_n_train_steps=4, num_samples=3).config
    with pytest.raises(ArgumentError, match="num_samples given beside an EvalConfig"):
        LiveEvaluator(cfg, num_samples=2)


def test_adapters_do_not_forward_attributes():
    """The callback is no proxy: a write to it cannot bypass the config's checks."""
    cb = DFlashEvalCallback(states="c")
    with pytest.raises(AttributeError):
        _ = cb.ddtree_budgets
    assert cb.evaluator.config is cb.config
