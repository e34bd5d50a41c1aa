"""One cache for several drafters: a cache of the union of their target layers, each drafter reading its own.

A drafter's figures on the union cache are bit-identical to those on a cache of exactly its layers (same
samples, same counts), whatever the order of its layers; the precompute takes several drafters' configs and
captures the union; a drafter that reads a layer the cache lacks is refused, naming the layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_target import TINY_MASK, random_prompts, save_tiny_qwen3, write_prompts

from dflash_cb.cache.states import CacheMismatchError, StateCache
from dflash_cb.common.cli import run
from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.replay import evaluate
from dflash_cb.demo.lightning_module import CachedStatesDataset, tiny_drafter_config


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    from dflash_cb.cache.precompute import main

    root = tmp_path_factory.mktemp("shared")
    target = save_tiny_qwen3(root / "target", seed=0)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(4, (5, 9), seed=3, vocab=120),
                            categories=["code", "chat"])
    tcfg = json.loads((target / "config.json").read_text())
    configs = {}
    for name, layers in (("a", [0, 2]), ("b", [3, 1])):
        cfg = tiny_drafter_config(tcfg["vocab_size"], tcfg["hidden_size"], tcfg["num_hidden_layers"], layers,
                                  TINY_MASK, block_size=5)
        (root / f"{name}.json").write_text(json.dumps(cfg))
        configs[name] = cfg
    common = ["--target", str(target), "--prompts", str(prompts), "--reference", "local", "--dtype", "float32",
              "--max-new-tokens", "16", "--no-progress", "--threads", "1"]
    caches = {"union": root / "union", "a": root / "only_a", "b": root / "only_b"}
    assert run(main, [*common, "--out", str(caches["union"]), "--drafter-config",
                      f"{root / 'a.json'},{root / 'b.json'}"]) == 0
    for name in ("a", "b"):
        assert run(main, [*common, "--out", str(caches[name]), "--drafter-config", str(root / f"{name}.json")]) == 0
    return {"configs": configs, "caches": caches}


def drafter(cfg: dict, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter.from_config_dict(cfg).eval()


def test_the_precompute_captures_the_union_of_several_drafters_layers(world):
    assert StateCache(world["caches"]["union"]).manifest.layer_ids == [0, 1, 2, 3]
    assert StateCache(world["caches"]["b"]).manifest.layer_ids == [3, 1]


@pytest.mark.parametrize("name", ["a", "b"])
def test_each_drafter_reads_its_own_columns_bit_identically(world, name):
    """The union cache gives each drafter exactly the figures of a cache of its own layers (the one in layer
    order 3, 1 included): same per-sample lengths, DDTree lengths and every summed count."""
    d = drafter(world["configs"][name], seed=1 if name == "a" else 2)
    union = evaluate(StateCache(world["caches"]["union"]), d, budgets=(4,), anchor_stride=2)
    alone = evaluate(StateCache(world["caches"][name]), d, budgets=(4,), anchor_stride=2)
    assert [(s.acceptance_lengths, s.ddtree, s.anchor_counts) for s in union.samples] == \
        [(s.acceptance_lengths, s.ddtree, s.anchor_counts) for s in alone.samples]
    for k, v in alone.counts.data.items():
        assert torch.equal(union.counts.data[k], v), k
    # The training data of that drafter on the union cache: its own features, as on its own cache.
    ids = [e.id for e in StateCache(world["caches"][name]).samples]
    mine = CachedStatesDataset(world["caches"]["union"], ids, layer_ids=world["configs"][name]["dflash_config"][
        "target_layer_ids"])
    own = CachedStatesDataset(world["caches"][name], ids)
    assert all(torch.equal(mine[i]["hidden"], own[i]["hidden"]) for i in range(len(own)))


def test_a_drafter_reading_a_layer_the_cache_lacks_is_refused_naming_it(world):
    cfg = world["configs"]["b"]
    with pytest.raises(CacheMismatchError, match=r"the drafter reads layers \[3, 1\]; the cache holds \[0, 2\], "
                                                 r"without \[3, 1\]"):
        evaluate(StateCache(world["caches"]["a"]), drafter(cfg, 0), budgets=())
    assert StateCache(world["caches"]["union"]).feature_columns([0, 1, 2, 3]) is None  # no copy when all of them
    with pytest.raises(CacheMismatchError, match=r"not \[3\]"):
        StateCache(world["caches"]["a"]).feature_columns([0, 3])


def test_eval_drafter_on_the_union_cache(world, tmp_path, capsys):
    """The tool reads the drafter's own columns too: its results equal the ones on the drafter's own cache."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    folder = tmp_path / "b"
    drafter(world["configs"]["b"], 2).save_pretrained(folder)
    outs = {}
    for cache in ("union", "b"):
        out = tmp_path / f"{cache}.json"
        assert run(eval_cli.main, ["--states", str(world["caches"][cache]), "--drafter", str(folder), "--out", str(out),
                                   "--ddtree-budgets", "4", "--device", "cpu", "--threads", "1"]) == 0
        outs[cache] = json.loads(Path(out).read_text())
    capsys.readouterr()
    assert outs["union"]["metrics"] == outs["b"]["metrics"]
    assert [s["acceptance_lengths"] for s in outs["union"]["samples"]] == \
        [s["acceptance_lengths"] for s in outs["b"]["samples"]]
