"""DFlashEvalCallback with a real Lightning Trainer on CPU (tiny target, tiny drafter, few steps)."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_runs import fit, make_module, make_trainer, read_csv_metrics
from tool_runs import same

from dflash_cb import DFlashEvalCallback
from dflash_cb.cache.selection import stratified_ids
from dflash_cb.cache.states import CacheMismatchError, StateCache
from dflash_cb.core.figures.metrics import EVAL_TIME
from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule
from dflash_cb.integrations.evaluator.live import DFlashEvalError
from dflash_cb.integrations.evaluator.schedule import (
    Profile,
    Reason,
    Trigger,
    choose_profile,
    fit_end_eval_due,
    fit_start_eval_due,
    is_full_evaluation,
    periodic_eval_reason,
)
from dflash_cb.integrations.tracking.sample_table import format_blocks, make_decoder

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = [4, 8]


# ---------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_logged_tau_equals_eval_drafter_on_saved_weights(tmp_path, tiny_cache, tiny_drafter_config,
                                                         tiny_dflash2_config, family):
    """CSV-logged metrics at a step == tools/eval_drafter.py on the drafter checkpointed at that step, for a
    DFlash and a DFlash 2 drafter (its selector figures included).

    The callback takes the head from the module's attributes; the tool from the cache's export.
    """
    from dflash_cb.core.checkpoints.load import extract_drafter

    tiny_drafter_config = tiny_dflash2_config if family == "dflash2" else tiny_drafter_config
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=3, ddtree_budgets=BUDGETS,
                            target_embed="target_embed", target_lm_head="target_lm_head")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    # The metrics reach trainer.callback_metrics too: ModelCheckpoint can keep the best drafter by tau.
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="dflash_eval/tau", mode="max", every_n_train_steps=3)
    trainer, module = fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, ckpt, best], max_steps=6,
                          logger=CSVLogger(tmp_path / "logs"), checkpointing=True)
    logged = read_csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv")
    assert sorted(logged) == [0, 3, 6] == [h["step"] for h in cb.history]
    assert best.best_model_score.item() == pytest.approx(max(logged[3]["tau"], logged[6]["tau"]), rel=1e-6)
    assert logged[6]["tau"] != logged[0]["tau"]  # the drafter learned something between evaluations
    # One estimator per key: every evaluation logs the light profile's figures (strided statistics, the
    # largest budget) under the main keys; the last one, full, adds its exact figures under full/.
    block = tiny_drafter_config["block_size"]
    assert [logged[s]["anchor_stride"] for s in (0, 3, 6)] == [block] * 3 and logged[6]["full/anchor_stride"] == 1
    assert "full/tau" not in logged[3] and logged[6]["full/tau"] == logged[6]["tau"]
    assert f"ddtree/tau_b{min(BUDGETS)}" not in logged[6] and f"full/ddtree/tau_b{min(BUDGETS)}" in logged[6]
    # The cost keys describe the pass that ran: the full pass at step 6. (At this size the light pass drafts every
    # anchor at once, cost.draft_all_is_cheaper: what it needed still tells the two apart.)
    assert logged[3]["anchors_needed"] < logged[6]["anchors_needed"] == logged[6]["full/anchors_needed"]
    assert logged[3]["anchors_drafted"] <= logged[6]["anchors_drafted"] == logged[6]["full/anchors_drafted"]
    from dflash_cb.integrations.cli import eval_drafter as tool

    light = ["--anchor-stride", str(block), "--ddtree-budgets", str(max(BUDGETS))]
    full = ["--ddtree-budgets", ",".join(map(str, BUDGETS))]
    for step, prefix, profile in ((3, "", light), (6, "", light), (6, "full/", full)):
        folder = tmp_path / f"drafter_{step}"
        if not folder.exists():
            extract_drafter(tmp_path / "ckpt" / f"step={step}.ckpt", folder)
        out = tmp_path / f"results_{step}{prefix.strip('/')}.json"
        # The main keys of every evaluation: the tool at the light profile (stride = block size, same seed);
        # full/ keys of the last one: the tool's default, stride 1 and every budget.
        assert tool.main(["--states", str(tiny_cache), "--drafter", str(folder), "--out", str(out),
                          *profile, "--device", "cpu", "--dtype", "float32"]) == 0
        expected = json.loads(out.read_text())["metrics"]
        got = {k[len(prefix):]: v for k, v in logged[step].items() if k.startswith(prefix)}
        assert got["tau"] == expected["tau"]
        for k, v in expected.items():
            if k == EVAL_TIME or (step == 6 and not prefix and k in ("anchors_drafted", "anchors_needed")):
                continue  # the pass's own cost: under full/ at a full evaluation
            if k == "anchors_drafted" and not prefix:
                continue  # how the pass drafted: the callback may draft every anchor at once where that is cheaper
            if v is None:  # NaN in results.json, not logged by the callback
                assert k not in got
            else:
                assert same(got[k], v), (step, prefix, k, got[k], v)
        # The callback's per-sample results agree too (rank zero keeps the last evaluation's).
    res = json.loads((tmp_path / "results_6full.json").read_text())
    assert [s.acceptance_lengths for s in cb.evaluator.last.samples] == [s["acceptance_lengths"] for s in res["samples"]]
    assert ("selector/unary_tau" in logged[6]) == (family == "dflash2") == (res["meta"]["drafter_family"] == "dflash2")


class Probe(Callback):
    """Placed around the eval callback: snapshots before, compares after (same batch-end hook)."""

    def __init__(self, role: str, shared: dict):
        self.role, self.shared = role, shared

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        d = pl_module.drafter
        snap = {"rng": torch.get_rng_state(), "modes": [m.training for m in d.modules()],
                "grads": [None if p.grad is None else p.grad.clone() for p in d.parameters()],
                "params": [p.detach().clone() for p in d.parameters()],
                "opt": {k: v.clone() for st in trainer.optimizers[0].state.values() for k, v in st.items()
                        if torch.is_tensor(v)}}
        if self.role == "before":
            self.shared["before"] = snap
            return
        b = self.shared["before"]
        assert torch.equal(b["rng"], snap["rng"])
        assert b["modes"] == snap["modes"] and all(snap["modes"])
        for x, y in zip(b["grads"], snap["grads"], strict=True):
            assert (x is None and y is None) or torch.equal(x, y)
        assert all(torch.equal(x, y) for x, y in zip(b["params"], snap["params"], strict=True))
        assert b["opt"].keys() == snap["opt"].keys() and all(torch.equal(b["opt"][k], snap["opt"][k]) for k in b["opt"])
        self.shared["checked"] = self.shared.get("checked", 0) + 1


@pytest.mark.e2e
def test_evaluation_leaves_training_untouched(tmp_path, tiny_cache, tiny_drafter_config):
    """RNG, modes, grads, params and optimizer state are the same around an evaluation, and a run
    with the callback ends with bit-identical weights to a run without it."""
    shared: dict = {}
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS)
    _, with_cb = fit(tmp_path / "a", tiny_drafter_config, tiny_cache,
                     [Probe("before", shared), cb, Probe("after", shared)], max_steps=4)
    _, without = fit(tmp_path / "b", tiny_drafter_config, tiny_cache, [], max_steps=4)
    assert [h["step"] for h in cb.history] == [0, 2, 4]
    assert shared["checked"] == 4
    for (k, a), (_, b) in zip(with_cb.drafter.state_dict().items(), without.drafter.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.e2e
@pytest.mark.parametrize("change, message", [
    ({"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 127}},
     r"target_layer_ids: the drafter reads layers \[1, 3\]; the cache holds \[0, 2\], without \[1, 3\]"),
    ({"num_target_layers": 64}, r"num_target_layers: drafter was made for a 64-layer target, the cache's target has 4"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 999}}, r"mask_token_id: drafter 999"),
])
def test_mismatched_cache_stops_fit_before_first_step(tmp_path, tiny_cache, tiny_drafter_config, change, message):
    cfg = {**tiny_drafter_config, **change}
    steps: list[int] = []

    class Counter(Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.append(trainer.global_step)

    seed_everything(0, verbose=False)
    module = make_module(cfg, tiny_cache)
    trainer = make_trainer(tmp_path, [DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2), Counter()], 4)
    with pytest.raises(CacheMismatchError, match=message):
        trainer.fit(module, CachedStatesDataModule(str(tiny_cache)))
    assert steps == [] and trainer.global_step == 0


@pytest.mark.e2e
def test_module_head_with_wrong_shape_is_refused(tmp_path, tiny_cache, tiny_drafter_config):
    seed_everything(0, verbose=False)
    module = make_module(tiny_drafter_config, tiny_cache)
    module.register_buffer("small_head", torch.zeros(10, 32), persistent=False)
    cb = DFlashEvalCallback(states=tiny_cache, target_embed="target_embed", target_lm_head="small_head")
    with pytest.raises(CacheMismatchError, match=r"target_lm_head \(small_head\): shape \(10, 32\)"):
        make_trainer(tmp_path, [cb], 2).fit(module, CachedStatesDataModule(str(tiny_cache)))


class Corrupt(Callback):
    """Flips one byte of a shard (same size) after the first optimizer step: damage after setup."""

    def __init__(self, shard: Path):
        self.shard, self.done = shard, False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 1 and not self.done:
            data = bytearray(self.shard.read_bytes())
            data[-3] ^= 0x01
            self.shard.write_bytes(bytes(data))
            self.done = True


@pytest.mark.e2e
def test_shard_changed_during_training_is_rehashed_counted_and_stops_after_k(tmp_path, tiny_cache,
                                                                             tiny_drafter_config):
    """A shard whose bytes change after setup is hashed again (its file identity changed), the
    evaluation fails with the sha256 named, dflash_eval/failed_evaluations counts it, training goes on
    until max_failed_evaluations failures in a row."""
    broken = tmp_path / "cache"
    shutil.copytree(tiny_cache, broken)
    shard = sorted(broken.glob("states-*.safetensors"))[1]
    cb = DFlashEvalCallback(states=broken, every_n_train_steps=2, ddtree_budgets=BUDGETS)
    with pytest.warns(RuntimeWarning, match=r"evaluation at .*failed on rank 0: CacheError: .*sha256") as rec:
        trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [Corrupt(shard), cb], max_steps=4,
                         data_cache=tiny_cache, logger=CSVLogger(tmp_path / "logs"))
    assert trainer.global_step == 4 and [h["step"] for h in cb.history] == [0]
    assert len([w for w in rec if "DFlashEvalCallback" in str(w.message)]) == 2  # steps 2 and 4
    logged = read_csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv")
    assert {s: v["failed_evaluations"] for s, v in logged.items()} == {0: 0.0, 2: 1.0, 4: 2.0}

    shutil.rmtree(broken)
    shutil.copytree(tiny_cache, broken)
    strict = DFlashEvalCallback(states=broken, every_n_train_steps=1, ddtree_budgets=BUDGETS, max_failed_evaluations=2)
    with pytest.warns(RuntimeWarning), pytest.raises(DFlashEvalError, match="2 evaluations in a row failed"):
        fit(tmp_path / "k", tiny_drafter_config, tiny_cache, [Corrupt(shard), strict], max_steps=6,
            data_cache=tiny_cache)
    assert strict.evaluator.state.last_eval_step == 2 and strict.evaluator.state.failed_evaluations == 2  # steps 1 and 2 failed, then stop

    shutil.rmtree(broken)
    shutil.copytree(tiny_cache, broken)
    at_once = DFlashEvalCallback(states=broken, every_n_train_steps=2, fail_on_error=True)
    with pytest.raises(DFlashEvalError, match="sha256"):
        fit(tmp_path / "strict", tiny_drafter_config, tiny_cache, [Corrupt(shard), at_once], max_steps=4,
            data_cache=tiny_cache)


@pytest.mark.e2e
@pytest.mark.parametrize("damage, message", [
    ("truncate", r"shard is \d+ bytes, manifest says \d+ \(truncated\?\)"),
    ("flip", r"sha256 .* does not match"),
    ("no_head", r"target head file missing"),
])
def test_damaged_cache_stops_fit_at_setup(tmp_path, tiny_cache, tiny_drafter_config, damage, message):
    """Found at setup (a stat per file, sha256 by default), not inside every evaluation."""
    from dflash_cb.cache.manifest import CacheError

    broken = tmp_path / "cache"
    shutil.copytree(tiny_cache, broken)
    shard = sorted(broken.glob("states-*.safetensors"))[-1]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        (broken / "target_head.safetensors").unlink()
    steps: list[int] = []

    class Counter(Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.append(trainer.global_step)

    cb = DFlashEvalCallback(states=broken, every_n_train_steps=2, ddtree_budgets=BUDGETS)
    with pytest.raises(CacheError, match=message):
        fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, Counter()], max_steps=4, data_cache=tiny_cache)
    assert steps == []


def test_non_integer_arguments_are_refused():
    """``every_n_train_steps=0.5`` is refused, not truncated to 0 (which would silently mean no periodic
    evaluation)."""
    for bad in (0.5, 2.0, "3", True):
        with pytest.raises(ValueError, match=r"every_n_train_steps=.*: expected an integer >= 0"):
            DFlashEvalCallback(states="x", every_n_train_steps=bad)
    with pytest.raises(ValueError, match="num_samples=2.5: expected a positive integer"):
        DFlashEvalCallback(states="x", num_samples=2.5)


@pytest.mark.parametrize("argument, value, expected", [
    # each of these would otherwise be accepted, or fail later, far from the argument
    ("periodic_anchor_stride", 2.5, "a positive integer or None"),  # every periodic evaluation then failed
    ("periodic_anchor_stride", "8", "a positive integer or None"),  # a str < int comparison error
    ("full_every_n_evals", 1.5, "an integer >= 0"),
    ("ddtree_budgets", [2.7, 16.9], "a list of positive integers (2.7 and 16.9 are not)"),  # became (2, 16)
    ("ddtree_budgets", 16, "a list of positive integers"),  # 'int' object is not iterable
    ("periodic_ddtree_budgets", [8.5], "a list of positive integers or None"),
    ("sample_ids", "eval-count-000", "a list of strings or None (num_samples decides), not a single string"),
    ("sample_ids", [], "at least one"),
    ("sample_ids", ["p001", 3], "a list of non-blank strings"),
    ("table_samples", 2.5, "an integer >= 0"),
    ("table_cycles", 0, "a positive integer"),
    ("sample_seed", 1.5, "an integer >= 0"),  # became 1
    ("num_samples", True, "a positive integer or None"),
    ("position_edges", [0, 2.5, 8], "a list of integers >= 0 (2.5 is not)"),  # became (0, 2, 8)
    ("position_edges", [0, 8, 4], "integers from 0, strictly increasing"),
    ("max_failed_evaluations", "3", "an integer >= 0"),
    ("every_n_train_steps", None, "an integer >= 0"),
    ("published_entries", "zlab", "a list of strings or None (every non-placeholder entry), not a single string"),
    ("baselines", 5, "{name: results.json} or a list of results.json paths"),
    ("baselines", ["a/results.json", "b/results.json"], "distinct names"),  # one was dropped silently
    ("eval_on_fit_end", "false", "True or False"),  # a non-empty string is true
])
def test_every_argument_is_checked_at_construction_naming_it(argument, value, expected):
    """One rule (``dflash_cb.common.arguments``), one ``ArgumentError`` (a ValueError) per bad
    value, ``argument=value: expected ...``, at construction: no file is touched, no fit started."""
    from dflash_cb.common.arguments import ArgumentError

    with pytest.raises(ArgumentError) as err:
        DFlashEvalCallback(states="no/such/cache", **{argument: value})
    assert str(err.value).startswith(f"{argument}={value!r}: expected ") and expected in str(err.value)
    assert isinstance(err.value, ValueError)


def test_valid_arguments_are_normalised():
    """The checks accept what the YAML config and numpy hand over, and keep the documented meanings."""
    import numpy as np

    cb = DFlashEvalCallback(states=Path("c"), every_n_train_steps=np.int64(4), ddtree_budgets=[64, 16, 16],
                            periodic_ddtree_budgets=[], sample_ids=("a", "b"), baselines="r/zlab.json",
                            position_edges=(0, 8))
    assert cb.config.every_n_train_steps == 4 and type(cb.config.every_n_train_steps) is int and cb.config.states == "c"
    assert cb.config.ddtree_budgets == (16, 64) and cb.config.light_budgets == () and cb.config.sample_ids == ("a", "b")
    assert cb.config.baselines == {"zlab": "r/zlab.json"} and cb.config.position_edges == (0, 8)
    assert DFlashEvalCallback(states="c", ddtree_budgets=[]).config.light_budgets == ()


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning", "ignore:.*resuming from a checkpoint.*:UserWarning")
def test_resume_on_a_replaced_cache_warns_and_starts_a_new_series(tmp_path, tiny_cache, tiny_drafter_config):
    """The checkpoint carries the cache's manifest sha256; resumed on another cache at the same
    path, the old history is not continued (it would mix two caches in one series)."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    cb = DFlashEvalCallback(states=cache, every_n_train_steps=2, ddtree_budgets=[4], eval_on_fit_end=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, ckpt], max_steps=2, checkpointing=True)
    assert [h["step"] for h in cb.history] == [0, 2]
    old_sha = StateCache(cache).manifest_sha256
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["samples"] = manifest["samples"][:4]  # "the same path, another cache"
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=1))

    resumed = DFlashEvalCallback(states=cache, every_n_train_steps=2, ddtree_budgets=[4])
    with pytest.warns(RuntimeWarning, match="measured on another cache"):
        fit(tmp_path / "b", tiny_drafter_config, tiny_cache, [resumed], max_steps=4,
            ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    # A new series: the resumed weights scored on the new cache at step 2, then step 4.
    assert [h["step"] for h in resumed.history] == [2, 4] and resumed.evaluator.state.num_evals == 2
    assert resumed.state_dict()["cache_manifest_sha256"] == StateCache(cache).manifest_sha256 != old_sha


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:.*ckpt_path.*:UserWarning", "ignore:.*resuming from a checkpoint.*:UserWarning")
@pytest.mark.parametrize("spelling", ["as saved", "trailing slash", "relative"])
def test_resume_neither_repeats_nor_skips(tmp_path, tiny_cache, tiny_drafter_config, monkeypatch, spelling):
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4], eval_on_fit_end=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, ckpt], max_steps=5, checkpointing=True)
    assert [h["step"] for h in cb.history] == [0, 2, 4]
    # The checkpoint at step 4 was written after the evaluation at step 4 (ModelCheckpoint runs last).
    state = torch.load(tmp_path / "ckpt" / "step=4.ckpt", weights_only=False)["callbacks"][cb.state_key]
    assert state["last_eval_step"] == 4 and state["start_done"]

    # The same cache, whatever the spelling of its path: the state is found by the prefix, the cache by its hash.
    states = {"as saved": str(tiny_cache), "trailing slash": str(tiny_cache) + "/", "relative": tiny_cache.name}[spelling]
    if spelling == "relative":
        monkeypatch.chdir(tiny_cache.parent)
    resumed = DFlashEvalCallback(states=states, every_n_train_steps=2, ddtree_budgets=[4])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*DFlashEval.*")  # restored (no "add the callbacks"), no new series
        trainer, _ = fit(tmp_path / "b", tiny_drafter_config, tiny_cache, [resumed], max_steps=8,
                         ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    # Restored history [0, 2, 4], then 6 and 8: no second evaluation at 4, none missing.
    assert [h["step"] for h in resumed.history] == [0, 2, 4, 6, 8]
    assert resumed.evaluator.state.num_evals == 5 and trainer.global_step == 8


def test_subset_is_fixed_and_stratified(tiny_cache):
    cache = StateCache(tiny_cache)
    ids = [s.id for s in cache.samples]
    def category(i):
        return cache.entry(i).category

    a = stratified_ids(ids, category, 4, seed=3)
    assert a == stratified_ids(ids, category, 4, seed=3) and len(a) == 4
    cats = [cache.entry(i).category for i in a]
    assert sorted(cats) == ["chat", "chat", "code", "code"]
    assert a == sorted(a, key=ids.index)
    rng = torch.get_rng_state()
    stratified_ids(ids, category, 4, seed=5)
    assert torch.equal(rng, torch.get_rng_state())


def test_decoders():
    assert make_decoder(None)([5, 7]) == "5 7"
    assert make_decoder(lambda ids: "".join(chr(97 + i) for i in ids))([0, 1]) == "ab"

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return f"<{len(ids)}>"

    assert make_decoder(Tok())([1, 2, 3]) == "<3>"


def test_format_blocks_marks_accepted_spans():
    ids = [9, 9, 1, 2, 3, 4, 5, 6, 7]  # prompt [9, 9]; the anchor is position 2 (token 1)
    text = format_blocks(ids, 2, [3, 1], [[2, 3, 8, 8], [9, 9, 9, 9]], lambda t: " ".join(map(str, t)))
    assert text.splitlines() == ["#1 @2 produced 3: ✓«2 3» ✗[8 8] +«4»", "#2 @5 produced 1: ✓«» ✗[9 9 9 9] +«5»"]


@pytest.mark.e2e
def test_cli_yaml_config_parses_into_callback(tmp_path, tiny_cache, tiny_drafter_config):
    """The shipped YAML appends (a user's ModelCheckpoint stays), needs no file of this
    repository (no published figures by default), and takes command-line overrides."""
    from lightning.pytorch.cli import LightningCLI

    user = tmp_path / "my_training.yaml"
    user.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                    "      init_args: {monitor: dflash_eval/tau, mode: max}\n")
    argv = ["--config", str(user), "--config", str(ROOT / "configs" / "callback" / "dflash_eval.yaml"),
            f"--model.drafter_config={json.dumps(tiny_drafter_config)}", f"--model.states={tiny_cache}",
            f"--data.states={tiny_cache}", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks.init_args.every_n_train_steps=1000", "--trainer.max_steps=2",
            # (states: overridden below to the test cache, budgets to one small one)
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"]
    def parse(argv: list[str]) -> LightningCLI:
        old = sys.argv
        try:
            sys.argv = ["prog"]
            return LightningCLI(DFlashDrafterModule, CachedStatesDataModule, run=False, args=argv,
                                save_config_kwargs={"overwrite": True})
        finally:
            sys.argv = old

    cli = parse(argv)
    cbs = [c for c in cli.trainer.callbacks if isinstance(c, DFlashEvalCallback)]
    assert len(cbs) == 1
    cb = cbs[0]
    assert cb.config.states == "cached_states/qwen36-27b-v1" and cb.config.every_n_train_steps == 1000
    assert cb.drafter_source == "drafter" and cb.config.ddtree_budgets == (16, 32, 64) and cb.config.prefix == "dflash_eval/"
    assert cb.config.published is None and cb.config.fail_on_error is False and cb.config.verify_cache is True
    assert cb.config.max_failed_evaluations == 3
    mine = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor == "dflash_eval/tau"]
    assert len(mine) == 1
    # And it runs: fit from the YAML with command-line overrides (on the test cache), evaluating at the
    # start and the end.
    cli = parse([*argv, f"--trainer.callbacks.init_args.states={tiny_cache}",
                 "--trainer.callbacks.init_args.ddtree_budgets=[4]"])
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, DFlashEvalCallback))
    mine = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor == "dflash_eval/tau"]
    assert cb.config.states == str(tiny_cache) and cb.config.ddtree_budgets == (4,)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert [h["step"] for h in cb.history] == [0, 2] and mine[0].best_model_score is not None


def test_the_shipped_yaml_lists_every_argument_with_its_default():
    """configs/callback/dflash_eval.yaml is the callback's reference: every argument (the old names of the light
    options excepted, named in a comment), each with the default the signature has (the cache path aside)."""
    import inspect

    import yaml

    from dflash_cb.integrations.evaluator.config import OLD_NAMES

    text = (ROOT / "configs" / "callback" / "dflash_eval.yaml").read_text()
    listed = yaml.safe_load(text)["trainer"]["callbacks+"][0]["init_args"]
    params = inspect.signature(DFlashEvalCallback.__init__).parameters
    assert set(listed) == set(params) - {"self", *OLD_NAMES}
    for name, value in listed.items():
        default = params[name].default
        if name == "states":
            continue
        want = list(default) if isinstance(default, tuple) else ({} if name == "baselines" else default)
        assert value == want, name
    assert all(old in text for old in OLD_NAMES) and "jsonargparse[signatures] >= 4.39.0" in text


def test_state_dict_round_trip():
    cb = DFlashEvalCallback(states="x", every_n_train_steps=5)
    saved = {**cb.state_dict(), "last_eval_step": 10, "num_evals": 3, "start_done": True,
             "history": [{"step": 10, "tau": 2.0}]}
    other = DFlashEvalCallback(states="x", every_n_train_steps=5)
    other.load_state_dict(saved)
    s = other.evaluator.state
    assert (s.last_eval_step, s.num_evals, s.start_done, other.history) == (10, 3, True, saved["history"])
    # The state key is the prefix: the same state whatever the spelling of the cache's path.
    assert other.state_key == cb.state_key == DFlashEvalCallback(states="x/").state_key
    assert cb.state_key != DFlashEvalCallback(states="x", prefix="b/").state_key


def test_schedule_decisions():
    """The hooks' decisions as pure functions: when to evaluate, and with which profile."""
    # every 2 steps, max_steps 6: steps 2 and 4 are periodic, step 6 is the fit-end one
    assert [periodic_eval_reason(s, 2, -1, True, 6) for s in range(7)] == [
        None, None, Reason(Trigger.PERIODIC, 2), None, Reason(Trigger.PERIODIC, 4), None, Reason(Trigger.FIT_END, 6)]
    assert [str(periodic_eval_reason(s, 2, -1, True, 6)) for s in (2, 6)] == ["step 2", "fit end"]  # in messages
    assert periodic_eval_reason(6, 2, -1, False, 6) == Reason(Trigger.PERIODIC, 6)  # no fit-end evaluation asked for
    assert periodic_eval_reason(6, 2, -1, True, -1) == Reason(Trigger.PERIODIC, 6)  # no max_steps: last step unknown
    assert periodic_eval_reason(4, 2, 4, True, 6) is None  # the next micro-batch of an evaluated step
    assert periodic_eval_reason(4, 0, -1, True, 6) is None  # periodic evaluations off
    assert fit_start_eval_due(0, -1, False, True)
    assert not fit_start_eval_due(0, -1, True, True)  # resumed: done once per run
    assert not fit_start_eval_due(10, 10, False, True)  # this step was evaluated already
    assert not fit_start_eval_due(0, -1, False, False)
    assert fit_end_eval_due(6, 4, True, True)
    assert fit_end_eval_due(6, 6, False, True)  # the last step's evaluation was a light one
    assert not fit_end_eval_due(6, 6, True, True)
    assert not fit_end_eval_due(6, 4, False, False)
    step, end = Reason(Trigger.PERIODIC, 2), Reason(Trigger.FIT_END, 6)
    assert [is_full_evaluation(step, k, 3) for k in range(6)] == [False, False, True, False, False, True]
    assert is_full_evaluation(end, 0, 0) and not any(is_full_evaluation(step, k, 0) for k in range(6))


def test_evaluation_profiles():
    """Light periodic evaluations, a full one every N-th and at fit end; bad profile values refused early."""
    cfg = DFlashEvalCallback(states="x", ddtree_budgets=[16, 32, 64], full_every_n_evals=3).config
    step, end = Reason(Trigger.PERIODIC, 2), Reason(Trigger.FIT_END, 6)
    plan = [choose_profile(step, k, cfg.full_every_n_evals, cfg.ddtree_budgets, cfg.light_budgets,
                           cfg.light_stride(16)) for k in range(6)]
    light, full = Profile(False, (64,), 16, (64,), 16), Profile(True, (16, 32, 64), 1, (64,), 16)
    assert plan == [light, light, full, light, light, full]
    assert choose_profile(end, 0, 3, cfg.ddtree_budgets, cfg.light_budgets, cfg.light_stride(16)) == full
    custom = DFlashEvalCallback(states="x", periodic_ddtree_budgets=[8, 4], periodic_anchor_stride=4).config
    assert choose_profile(step, 0, 0, custom.ddtree_budgets, custom.light_budgets,
                          custom.light_stride(16)) == Profile(False, (4, 8), 4, (4, 8), 4)
    for bad in ({"periodic_anchor_stride": 0}, {"full_every_n_evals": -1}, {"periodic_ddtree_budgets": [0]},
                {"tail_blocks": "short"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DFlashEvalCallback(states="x", **bad)


@pytest.mark.e2e
def test_a_checkpoint_cadence_off_the_evaluations_is_warned_about_at_setup(tmp_path, tiny_cache, tiny_drafter_config):
    """A ModelCheckpoint monitoring a dflash_eval key on a cadence that is not a multiple of the evaluation's
    (3 steps against 2, or epoch ends) would write stale taus into file names and the best-checkpoint choice:
    fit warns before the first step, naming both cadences and the fix; an aligned one (4 against 2) is quiet."""
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS)
    off = ModelCheckpoint(dirpath=tmp_path / "a", monitor="dflash_eval/tau", mode="max", every_n_train_steps=3)
    epochs = ModelCheckpoint(dirpath=tmp_path / "b", monitor="dflash_eval/ddtree/tau_b8", mode="max")
    aligned = ModelCheckpoint(dirpath=tmp_path / "c", monitor="dflash_eval/tau", mode="max", every_n_train_steps=4)
    other = ModelCheckpoint(dirpath=tmp_path / "d", monitor="train_loss", every_n_train_steps=3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, off, epochs, aligned, other], max_steps=2,
            checkpointing=True)
    said = [str(w.message) for w in rec if "ModelCheckpoint(monitor=" in str(w.message)]
    assert len(said) == 2, said
    assert "'dflash_eval/tau') saves every 3 training step(s), the evaluation runs every 2 step(s)" in said[0]
    assert "every_n_train_steps=2) or a multiple of it" in said[0]
    assert "'dflash_eval/ddtree/tau_b8') saves at the end of every 1 epoch(s)" in said[1]


@pytest.mark.e2e
def test_model_checkpoint_recipe_keeps_the_best_tau_of_its_own_step(tmp_path, tiny_cache, tiny_drafter_config):
    """The documented recipe: cadences aligned, the tau in a filename without a nested folder; the kept
    checkpoint carries the tau measured at its own step (``dflash_eval/step`` says which)."""
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS)
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="dflash_eval/tau", mode="max", every_n_train_steps=2,
                           filename="step{step}-tau{dflash_eval/tau:.4f}", auto_insert_metric_name=False)
    trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [cb, best], max_steps=6, checkpointing=True)
    path = Path(best.best_model_path)
    assert path.parent == tmp_path / "best"  # no folder made of the metric's name
    step = int(path.name.split("-")[0].removeprefix("step"))
    by_step = {h["step"]: h["tau"] for h in cb.history}
    assert best.best_model_score.item() == pytest.approx(by_step[step], rel=1e-6)
    assert by_step[step] == max(by_step[s] for s in (2, 4, 6))
    assert path.name == f"step{step}-tau{by_step[step]:.4f}.ckpt"
    assert trainer.callback_metrics["dflash_eval/step"].item() == 6
