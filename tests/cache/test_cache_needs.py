"""The one fit check (``cache/needs.py``) for what no family declares yet: another state of a layer than its
output, target weights beyond the embedding and head (a chain drafter's ``mtp.*``), a drafter config file."""

from __future__ import annotations

from dflash_cb.cache.needs import CacheNeeds, config_layer_ids, fit_problems, is_drafter_config
from dflash_cb.cache.states import StateCache


def test_a_state_or_weights_the_cache_lacks_are_named(tiny_cache):
    m = StateCache(tiny_cache).manifest
    fits = CacheNeeds("X", tuple(m.layer_ids), m.hidden_size, m.vocab_size)
    assert fit_problems(m, fits) == []
    wanting = CacheNeeds("X", tuple(m.layer_ids), state="final_norm", target_weights=("mtp.",))
    assert fit_problems(m, wanting) == [
        "state: the drafter reads each layer's final_norm; the cache holds layer outputs",
        "target weights: the drafter reads the target's mtp.* weights; the cache exports the embedding and head only"]


def test_a_drafter_config_is_told_from_a_model_config():
    assert is_drafter_config({"dflash_config": {"target_layer_ids": [1]}})
    assert is_drafter_config({"drafter_family": "x"}) and not is_drafter_config({"hidden_size": 8})
    assert config_layer_ids({"dflash_config": {"target_layer_ids": [1, 2]}, "target_layer_ids": [3]}) == [1, 2]
    assert config_layer_ids({"target_layer_ids": [3]}) == [3] and config_layer_ids({}) is None
