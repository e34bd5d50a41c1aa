"""The fifth probe's findings, each class fixed once: non-finite weights get no tau (every tool, every kind of
file, a live module), non-finite logits from finite weights are said to be an overflow, and the silently wrong,
crashing and misleading cases it listed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from dflash_cb.common.cli import run
from dflash_cb.core.loop.finite import NonFiniteError


@pytest.fixture(scope="module")
def drafter(tiny_drafter_config: dict):
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    return DFlashDrafter.from_config_dict(tiny_drafter_config).eval()


def _poisoned(drafter, value: float = float("nan")):
    import copy

    bad = copy.deepcopy(drafter)
    with torch.no_grad():
        bad.layers[0].mlp.up_proj.weight[0, :3] = value
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_folder_with_non_finite_weights_gets_no_tau(drafter, tiny_cache, tmp_path, capsys, dtype, value) -> None:
    """The folder loader (every tool's) and eval_drafter refuse, naming the tensor and how many entries."""
    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    folder = tmp_path / "d"
    _poisoned(drafter, value).to(dtype).save_pretrained(folder)
    with pytest.raises(NonFiniteError, match=r"layers\.0\.mlp\.up_proj\.weight \(3 of \d+ entries\)"):
        load_drafter(folder)
    out = tmp_path / "r.json"
    assert run(eval_cli.main, ["--states", str(tiny_cache), "--drafter", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "NaN or infinite" in err and "up_proj" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_checkpoint_with_non_finite_weights_is_not_extracted(drafter, tiny_drafter_config, tmp_path, capsys) -> None:
    """extract_drafter (and the sweep, which reads checkpoints through the same function) refuse; nothing written."""
    from dflash_cb.integrations.cli import extract as extract_cli

    torch.save({"state_dict": {"drafter." + k: v for k, v in _poisoned(drafter).state_dict().items()},
                "hyper_parameters": {"drafter_config": tiny_drafter_config}, "global_step": 3}, tmp_path / "c.ckpt")
    assert run(extract_cli.main, ["--ckpt", str(tmp_path / "c.ckpt"), "--out", str(tmp_path / "out")]) == 2
    assert "up_proj.weight (3 of" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_live_evaluation_of_non_finite_weights_fails_and_the_next_goes_on(drafter, tiny_cache) -> None:
    """A live module that diverged: that evaluation is reported failed with the reason (a warning, no tau
    logged), and the next one, on finite weights, is as usual."""
    import copy

    from dflash_cb import LiveEvaluator

    logged: list[dict] = []
    live = copy.deepcopy(drafter)
    ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=1, ddtree_budgets=[4], console=False,
                       log=lambda m, s: logged.append(m) if "dflash_eval/tau" in m else None)
    assert ev.start(0, live) is not None
    w = live.layers[0].mlp.up_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"failed.*NaN or infinite.*up_proj"):
        assert ev.step(1, live) is None
    with torch.no_grad():
        w.copy_(saved)
    assert ev.step(2, live) is not None
    assert len(logged) == 2 and ev.state.failed_evaluations == 1


def test_non_finite_logits_from_finite_weights_are_an_overflow(drafter, tiny_cache) -> None:
    """A float16 drafter whose final norm pushes the hidden states past float16's range: said to be an overflow
    in that precision, with the fix, not scored."""
    import copy

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    big = copy.deepcopy(drafter)
    with torch.no_grad():
        big.norm.weight.fill_(6e4)
    cache = StateCache(tiny_cache)
    head = cache.load_head(dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NonFiniteError, match="overflow in torch.float16"):
            evaluate(cache, big.half(), head, budgets=())


@pytest.mark.parametrize("ids,said", [(3, "must be a list"), ("1,3", "must be a list"), ([], "is empty"),
                                      (["1", 3], "must hold non-negative integers")])
def test_target_layer_ids_that_are_not_a_list_of_ids(drafter, tmp_path, ids, said) -> None:
    """An int, a string, an empty list or strings in the list: one message naming the field, in the drafter
    loader (every tool) and in the precompute's --drafter-config."""
    from dflash_cb.cache.precompute import main as precompute
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    folder = tmp_path / "d"
    drafter.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"target_layer_ids {said}"):
        load_drafter(folder)
    assert run(precompute, ["--target", "x", "--prompts", "y", "--out", str(tmp_path / "o"), "--drafter-config",
                            str(folder / "config.json")]) == 2


def test_missing_layer_ids_are_not_a_shape_mismatch(drafter, tmp_path) -> None:
    """A config without target_layer_ids (the reference default then names another count) says so."""
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    folder = tmp_path / "d"
    drafter.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(cfg))
    n = len(drafter.spec.target_layer_ids)
    assert cfg["num_hidden_layers"] != n  # the reference default: one target layer per draft layer
    with pytest.raises(CheckpointError, match=rf"the weights read {n} target layer\(s\).*set dflash_config.target_layer_ids"):
        load_drafter(folder)


def test_layers_beside_a_drafter_config_must_agree(tiny_cache, drafter, tmp_path, capsys) -> None:
    """--layers given with --drafter-config: refused when they differ, naming both (it overrode silently)."""
    from dflash_cb.cache.precompute import main as precompute

    folder = tmp_path / "d"
    drafter.save_pretrained(folder)
    target = tiny_cache.parent / "target"
    prompts = tiny_cache.parent / "prompts.jsonl"
    assert run(precompute, ["--target", str(target), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                            "--layers", "0,1", "--drafter-config", str(folder / "config.json"), "--reference",
                            "local", "--dtype", "float32", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--layers 0,1 differ from the target_layer_ids" in err and not (tmp_path / "o").exists()


def test_sinks_get_their_own_copies_and_any_log_object_is_one(tiny_cache, drafter) -> None:
    """A sink that edits the dict or record it is handed changes nothing another sink or the history sees; an
    object with only log() is a sink (begin and evaluation are optional); a sink whose log and repr both raise
    is named by its class and the training goes on."""
    from dflash_cb import LiveEvaluator

    class Editor:
        def log(self, metrics, step):
            metrics.clear()

        def evaluation(self, record):
            record.scalars.clear()
            record.history.clear()
            record.per_depth.clear()

    class OnlyLog:
        def __init__(self):
            self.seen = []

        def log(self, metrics, step):
            self.seen.append(dict(metrics))

    class Broken:
        def log(self, metrics, step):
            raise RuntimeError("down")

        def __repr__(self):
            raise RuntimeError("no repr")

        __str__ = __repr__

    class Recorder:
        def __init__(self):
            self.records = []

        def log(self, metrics, step):
            pass

        def evaluation(self, record):
            self.records.append(record)

    only, rec = OnlyLog(), Recorder()
    ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=1, ddtree_budgets=[4], console=False,
                       log=[Editor(), only, Broken(), rec])
    with pytest.warns(RuntimeWarning, match="to a Broken sink failed: RuntimeError: down"):
        metrics = ev.start(0, drafter)
    assert metrics and "dflash_eval/tau" in only.seen[-1]
    assert ev.history and "tau" in ev.history[-1]
    r = rec.records[-1]
    assert "dflash_eval/tau" in r.scalars and r.history and r.per_depth


@pytest.mark.parametrize("where", ["log", "sinks"])
def test_bad_sinks_are_named_as_given(tiny_cache, where) -> None:
    """A class instead of an instance, and a bad entry of a list, named by the argument (and index) given."""
    from dflash_cb import DFlashEvalCallback, LiveEvaluator
    from dflash_cb.common.arguments import ArgumentError

    class MySink:
        def log(self, metrics, step):
            pass

    def make(value):
        if where == "log":
            return LiveEvaluator(str(tiny_cache), log=value)
        return DFlashEvalCallback(str(tiny_cache), sinks=value)

    with pytest.raises(ArgumentError, match=rf"^{where}=MySink: a class, not a sink; pass an instance"):
        make(MySink)
    with pytest.raises(ArgumentError, match=rf"^{where}\[1\]=42: expected a function"):
        make([MySink(), 42])


@pytest.mark.parametrize("prefix,suggested", [("/", "dflash_eval/"), ("//", "dflash_eval/"), ("my eval", "my_eval/"),
                                              ("/runs", "runs/")])
def test_a_bad_prefix_is_answered_with_a_usable_one(prefix, suggested) -> None:
    from dflash_cb.common.arguments import ArgumentError
    from dflash_cb.integrations.evaluator.config import check_prefix

    with pytest.raises(ArgumentError, match=f"e.g. prefix='{suggested}'"):
        check_prefix(prefix)
    assert check_prefix(suggested) == suggested


def test_a_resumed_offline_wandb_run_shows_its_whole_curve(tmp_path, monkeypatch, capsys) -> None:
    """An offline run resumed with its id writes a second folder holding only the new steps: --show on it draws
    every step of the run."""
    import wandb

    from dflash_cb.integrations.tracking import panels

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    dirs = []
    for steps in ((0, 1, 2), (3, 4)):
        run = wandb.init(project="p", id="resumed1", resume="allow", reinit="create_new")
        run.define_metric("trainer/global_step")
        run.define_metric("dflash_eval/*", step_metric="trainer/global_step")
        for s in steps:
            run.log({"dflash_eval/tau": 1.0 + s / 10, "trainer/global_step": s})
        dirs.append(Path(run.dir).parent)
        run.finish()
    assert dirs[0] != dirs[1]
    capsys.readouterr()
    assert panels.main(["--run", str(dirs[1]), "--show"]) == 0
    shown = [line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.split()[:1] and
             line.split()[0].isdigit()]
    assert [s for s, _ in shown] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("field,value", [("block_size", "16"), ("mask_token_id", None), ("mask_token_id", "x")])
def test_integer_fields_that_are_not_integers_are_named(drafter, tmp_path, field, value) -> None:
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    folder = tmp_path / "d"
    drafter.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"][field] = value
    cfg.pop(field, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"{field}"):
        load_drafter(folder)
