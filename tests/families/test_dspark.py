"""What only DSpark drafters do, beside the conformance suite: the refusals (DDTree budgets, the rnn Markov head),
specforge/acc left out and said why, and early SpecForge checkpoints' ``logit_head.`` names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kits import KITS
from safetensors.torch import load_file, save_file

from dflash_cb.common.cli import run


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_cache) -> Path:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.layouts import drafter_from_config

    m = StateCache(tiny_cache).manifest
    cfg = KITS["dspark"].config(m.vocab_size, m.hidden_size, 6)
    cfg["dflash_config"]["target_layer_ids"] = list(m.layer_ids)
    torch.manual_seed(0)
    drafter = drafter_from_config(cfg)
    KITS["dspark"].prepare(drafter)
    out = tmp_path_factory.mktemp("dspark") / "drafter"
    drafter.save_pretrained(out)
    return out


def test_the_tool_refuses_trees_and_leaves_specforge_accuracy_out_saying_why(tiny_cache, folder, tmp_path, capsys):
    from dflash_cb.integrations.cli import eval_drafter

    args = ["--states", str(tiny_cache), "--drafter", str(folder), "--dtype", "float32"]
    assert run(eval_drafter.main, [*args, "--out", str(tmp_path / "a.json"), "--ddtree-budgets", "4"]) == 2
    assert "a DSpark drafter drafts each depth from its parent token" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()
    assert run(eval_drafter.main, [*args, "--out", str(tmp_path / "b.json"), "--ddtree-budgets", ""]) == 0
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["meta"]["drafter_family"] == "dspark" and results["metrics"]["specforge/acc"] is None
    assert "specforge/acc is left out: SpecForge's DSpark accuracy" in results["meta"]["specforge_masks"]


def test_an_rnn_markov_head_is_refused_and_early_checkpoint_names_load(folder, tmp_path):
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    cfg = json.loads((folder / "config.json").read_text())
    rnn = tmp_path / "rnn"
    rnn.mkdir()
    (rnn / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                          "markov_head_type": "rnn"}}))
    save_file(load_file(str(folder / "model.safetensors")), str(rnn / "model.safetensors"))
    with pytest.raises(CheckpointError, match="markov_head_type 'rnn': the replay takes vanilla, gated"):
        load_drafter(rnn)
    early = tmp_path / "early"  # SpecForge's first DSpark checkpoints kept the heads under logit_head.
    early.mkdir()
    (early / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    save_file({("logit_head." + k if k.startswith("markov_head.") else k): v for k, v in state.items()},
              str(early / "model.safetensors"))
    back, ours = load_drafter(early), load_drafter(folder)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items())
