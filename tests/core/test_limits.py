"""Limits checked before any work: DDTree budgets bounded by what a tree can hold, one id rule for
prompt files and id lists, ``--samples`` above the cache's size said out loud."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything

from dflash_cb.cache.prompts import PromptFileError, load_prompts, parse_id_list
from dflash_cb.common.cli import run
from dflash_cb.core.loop.ddtree import (
    DDTREE_MAX_BUDGET,
    DDTreeBudgetError,
    ddtree_accepted,
    max_ddtree_budget,
)


def save_drafter(cfg: dict, folder: Path) -> Path:
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    DFlashDrafter.from_config_dict(cfg).save_pretrained(folder)
    return folder


def eval_tool(capsys, cache: Path, drafter: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    code = run(eval_cli.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                               "--device", "cpu", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- DDTree budgets -----------------------------------------------------------------------------------------------

def test_budget_bound_is_what_a_tree_can_hold_or_the_documented_maximum():
    assert max_ddtree_budget(2, 64) == 64  # one depth: at most one node per token
    assert max_ddtree_budget(3, 5) == 5 + 25
    assert max_ddtree_budget(16, 248_320) == DDTREE_MAX_BUDGET == max_ddtree_budget()
    # the bound is real: past it every pop is empty (a full tree over vocabulary 3, block 3: 3 + 9 nodes)
    a, d, k = 1, 2, 3
    ids = torch.tensor([[[0, 1, 2], [0, 1, 2]]])
    lp = torch.log_softmax(torch.tensor([[[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]]]), -1)
    out = ddtree_accepted(ids, lp, torch.tensor([d]), torch.tensor([[2, 2]]), max_ddtree_budget(3, k) + 5)
    assert out.shape == (a, 17) and out[0, max_ddtree_budget(3, k) - 1] == 2
    assert torch.equal(out[0, max_ddtree_budget(3, k) - 1:], torch.full((6,), 2))


def test_eval_drafter_refuses_a_huge_budget_before_any_work(tiny_cache, tiny_drafter_config, tmp_path, capsys,
                                                           monkeypatch):
    from dflash_cb.cache.states import StateCache

    drafter = save_drafter(tiny_drafter_config, tmp_path / "drafter")  # block 6, vocabulary 128
    read: list[str] = []  # the cache's samples and head, as the tool reads them
    for name in ("load", "load_many", "load_head"):
        real = getattr(StateCache, name)
        monkeypatch.setattr(StateCache, name, lambda *a, _real=real, _name=name, **k: read.append(_name) or _real(*a, **k))
    code, out, err = eval_tool(capsys, tiny_cache, drafter, tmp_path / "r.json", "--ddtree-budgets", "16,100000")
    assert code == 2 and err.count("\n") == 1 and "--ddtree-budgets [100000]: above 1024" in err, err
    assert "tau (greedy replay)" not in out and read == []
    small = save_drafter({**tiny_drafter_config, "block_size": 2}, tmp_path / "block2")
    code, out, err = eval_tool(capsys, tiny_cache, small, tmp_path / "r.json", "--ddtree-budgets", "128,129")
    assert code == 2 and "[129]: above 128, the most distinct nodes a tree can have with block size 2 and " \
                         "vocabulary 128" in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.e2e
def test_callback_refuses_a_budget_above_the_bound_at_setup(tmp_path, tiny_cache, tiny_drafter_config):
    from lightning.pytorch import Trainer

    from dflash_cb import DFlashEvalCallback
    from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule

    seed_everything(0, verbose=False)
    module = DFlashDrafterModule({**tiny_drafter_config, "block_size": 2}, str(tiny_cache), lr=1e-2)
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=1, ddtree_budgets=[4, 200])
    trainer = Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    with pytest.raises(DDTreeBudgetError, match=r"ddtree_budgets \[200\]: above 128"):
        trainer.fit(module, CachedStatesDataModule(str(tiny_cache)))
    assert trainer.global_step == 0


# -- sample ids --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["a,b", " sp ", "a b", "-x", "é1"])
def test_prompt_file_ids_follow_the_one_rule(tmp_path, bad):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "ok-1", "text": "x"}) + "\n" + json.dumps({"id": bad, "text": "y"}) + "\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: 'id' .* does not follow the id rule"):
        load_prompts(path)


def test_every_shipped_and_demo_id_follows_the_rule_and_round_trips_through_an_id_list():
    from dflash_cb.demo.synthetic import make_prompts

    shipped = [r.id for r in load_prompts(Path(__file__).resolve().parents[2] / "configs/prompts/eval_v1.jsonl")]
    assert len(shipped) == 66
    demo = [r["id"] for prefix in ("eval-", "train-") for r in make_prompts(3, 0, prefix=prefix)]
    assert "eval-count-000" in demo
    for ids in (shipped, demo, ["p000", "run:7/a.b_c"]):
        assert parse_id_list(",".join(ids), "--sample-ids") == ids
        assert parse_id_list(" , ".join(ids), "--sample-ids") == ids


def test_eval_drafter_sample_ids_follow_the_rule(tiny_cache, tiny_drafter_config, tmp_path, capsys):
    drafter = save_drafter(tiny_drafter_config, tmp_path / "drafter")
    code, _, err = eval_tool(capsys, tiny_cache, drafter, tmp_path / "r.json", "--sample-ids", "p000,p 001")
    assert code == 2 and "--sample-ids 'p000,p 001': 'p 001' does not follow the id rule" in err, err


# -- --samples --------------------------------------------------------------------------------------------------

def test_more_samples_than_the_cache_has_is_said(tiny_cache, tiny_drafter_config, tmp_path, capsys):
    drafter = save_drafter(tiny_drafter_config, tmp_path / "drafter")
    code, _, err = eval_tool(capsys, tiny_cache, drafter, tmp_path / "r.json", "--samples", "500",
                             "--ddtree-budgets", "4")
    assert code == 0, err
    assert f"warning: --samples 500: the cache {tiny_cache} has only 6 samples; scoring all 6" in err
    assert len(json.loads((tmp_path / "r.json").read_text())["samples"]) == 6
    code, _, err = eval_tool(capsys, tiny_cache, drafter, tmp_path / "r.json", "--samples", "6", "--ddtree-budgets", "4")
    assert code == 0 and "warning" not in err
