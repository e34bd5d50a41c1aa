"""What a DFlashEvalCallback series is measured on, with a real Lightning Trainer on CPU: a resumed run with another sample selection or a malformed saved state starts a
new series with a warning, and a cache folder replaced during training fails the evaluation naming
both manifest hashes."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_runs import fit, read_csv_metrics
from tiny_target import build_tiny_cache

from dflash_cb import DFlashEvalCallback
from dflash_cb.cache.states import StateCache
from dflash_cb.integrations.evaluator.eval_state import EvalState, MalformedStateError
from dflash_cb.integrations.evaluator.live import DFlashEvalError

RESUME_NOISE = ("ignore:.*ckpt_path.*:UserWarning", "ignore:.*resuming from a checkpoint.*:UserWarning")


def steps(cb: DFlashEvalCallback) -> list[int]:
    return [h["step"] for h in cb.history]


def ours(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in records if "DFlashEvalCallback" in str(w.message)]


def make_cb(cache: Path, **kw) -> DFlashEvalCallback:
    return DFlashEvalCallback(states=cache, every_n_train_steps=2, ddtree_budgets=[4], **kw)


@pytest.fixture(scope="module")
def three_sample_ckpt(tmp_path_factory, tiny_cache, tiny_drafter_config) -> tuple[Path, DFlashEvalCallback]:
    """A run on 3 of the 6 samples, checkpointed at step 2 (evaluations at 0 and 2)."""
    root = tmp_path_factory.mktemp("three")
    cb = make_cb(tiny_cache, num_samples=3, eval_on_fit_end=False)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit(root, tiny_drafter_config, tiny_cache, [cb, ckpt], max_steps=2, checkpointing=True)
    assert steps(cb) == [0, 2] and len(cb.evaluator.eval_ids) == 3
    return root / "ckpt" / "step=2.ckpt", cb


# -- another sample selection -------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.filterwarnings(*RESUME_NOISE)
@pytest.mark.parametrize("selection, message", [
    ({}, r"another sample selection, 3 samples \(num_samples=3, sample_seed=0\), than this run's 6 samples "
         r"\(every sample\)"),
    ({"num_samples": 3, "sample_seed": 1}, r"3 samples \(num_samples=3, sample_seed=0\), than this run's "
                                           r"3 samples \(num_samples=3, sample_seed=1\)"),
    ({"sample_ids": ["p000", "p001", "p002"]}, r"than this run's 3 samples \(sample_ids: 3 ids\)"),
])
def test_resume_with_another_sample_selection_starts_a_new_series(tmp_path, tiny_cache, tiny_drafter_config,
                                                                  three_sample_ckpt, selection, message):
    """The checkpoint records the selection (the evaluated ids' sha256 and the arguments);
    resumed with other ids, the old history is not continued (it would mix 3- and 6-sample numbers)."""
    ckpt, first = three_sample_ckpt
    state = torch.load(ckpt, weights_only=False)["callbacks"][first.state_key]
    assert state["sample_selection"]["count"] == 3 and state["sample_selection"]["num_samples"] == 3
    resumed = make_cb(tiny_cache, **selection)
    with pytest.warns(RuntimeWarning, match=message):
        fit(tmp_path, tiny_drafter_config, tiny_cache, [resumed], max_steps=4, ckpt_path=str(ckpt))
    assert set(resumed.evaluator.eval_ids) != set(first.evaluator.eval_ids)
    # A new series: the resumed weights scored on the new selection at step 2, then step 4.
    assert steps(resumed) == [2, 4] and resumed.evaluator.state.num_evals == 2
    assert resumed.state_dict()["sample_selection"]["count"] == len(resumed.evaluator.eval_ids)


@pytest.mark.e2e
@pytest.mark.filterwarnings(*RESUME_NOISE)
def test_resume_with_the_same_ids_goes_on(tmp_path, tiny_cache, tiny_drafter_config, three_sample_ckpt):
    """The evaluated ids decide, not how they were asked for: the same 3 ids by name continue the series."""
    ckpt, first = three_sample_ckpt
    same = make_cb(tiny_cache, sample_ids=list(first.evaluator.eval_ids))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fit(tmp_path, tiny_drafter_config, tiny_cache, [same], max_steps=4, ckpt_path=str(ckpt))
    assert ours(rec) == [] and steps(same) == [0, 2, 4] and same.evaluator.state.num_evals == 3


@pytest.mark.e2e
@pytest.mark.filterwarnings(*RESUME_NOISE)
@pytest.mark.parametrize("setting, message", [
    ({"tail_blocks": "reference"}, "tail_blocks 'served' -> 'reference'"),
    ({"autocast_dtype": "bfloat16"}, "dtype 'float32' -> 'bfloat16'"),
])
def test_resume_with_another_setting_that_changes_the_figures_starts_a_new_series(
        tmp_path, tiny_cache, tiny_drafter_config, three_sample_ckpt, setting, message):
    """The tail convention and the compute dtype change the figures: a resume with another one is a new series
    (one curve, one best tau, one delta_tau each), with a warning naming the setting and both values."""
    ckpt, first = three_sample_ckpt
    resumed = make_cb(tiny_cache, num_samples=3, **setting)
    with pytest.warns(RuntimeWarning, match=rf"measured with other settings than this run's \({message}\)"):
        fit(tmp_path, tiny_drafter_config, tiny_cache, [resumed], max_steps=4, ckpt_path=str(ckpt))
    assert steps(resumed) == [2, 4] and resumed.evaluator.state.num_evals == 2


# -- a malformed saved state ----------------------------------------------------------------------

GOOD = EvalState(last_eval_step=4, num_evals=2, start_done=True, history=[{"step": 0, "tau": 1.5}, {"step": 4, "tau": 2.0}],
                 cache_manifest_sha256="ab" * 32).to_dict()


@pytest.mark.parametrize("change, field", [
    ({"history": "garbage"}, "history"),  # was list("garbage"): seven one-letter "evaluations"
    ({"history": [{"step": 0, "tau": 1.5}, "x"]}, r"history\[1\]"),
    ({"history": [{"tau": 1.5}]}, r"history\[0\]"),  # no step
    ({"history": [{"step": 0, "tau": "1.5"}]}, r"history\[0\]"),
    ({"num_evals": "x"}, "num_evals"),  # was a ValueError deep in int()
    ({"num_evals": -1}, "num_evals"),
    ({"last_eval_step": 2.5}, "last_eval_step"),  # was silently 2
    ({"start_done": "no"}, "start_done"),  # was True
    ({"failed_evaluations": None}, "failed_evaluations"),  # was a TypeError
    ({"cache_manifest_sha256": 12}, "cache_manifest_sha256"),  # was a TypeError when compared
    ({"sample_selection": "3"}, "sample_selection"),
    ({"history": None}, "history"),
    ("drop:history", "history missing"),
    ("drop:num_evals", "num_evals missing"),
    ("not a dict", "not a dict"),
])
def test_malformed_state_warns_naming_the_field_and_starts_a_new_series(change, field):
    """``load_state_dict`` with a malformed state: one warning naming the field, the
    state of a fresh run (a new series; the resumed weights are evaluated at once), never a traceback."""
    if change == "not a dict":
        state = ["garbage"]
    elif isinstance(change, str):
        state = {k: v for k, v in GOOD.items() if k != change.split(":")[1]}
    else:
        state = {**GOOD, **change}
    cb = make_cb("x")
    with pytest.warns(RuntimeWarning, match=rf"evaluation state is malformed \({field}.*new series starts here"):
        cb.load_state_dict(state)
    assert (cb.history, cb.evaluator.state.num_evals, cb.evaluator.state.last_eval_step, cb.evaluator.state.start_done, cb.evaluator.state.failed_evaluations) == ([], 0, -1, False, 0)
    assert cb.state_dict() == EvalState().to_dict()


def test_well_formed_states_load_without_a_word():
    """A good state round-trips; an older checkpoint without the later fields (failures, cache hash,
    selection) still loads; unknown fields of a newer version are ignored."""
    for state in (GOOD, {k: GOOD[k] for k in ("last_eval_step", "num_evals", "start_done", "history")},
                  {**GOOD, "a_newer_field": 1}):
        cb = make_cb("x")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cb.load_state_dict(state)
        assert steps(cb) == [0, 4] and cb.evaluator.state.num_evals == 2 and cb.evaluator.state.start_done
    with pytest.raises(MalformedStateError, match="history"):
        EvalState.from_dict({**GOOD, "history": {}})


@pytest.mark.e2e
@pytest.mark.filterwarnings(*RESUME_NOISE)
def test_fit_resumed_from_a_damaged_state_trains_on_with_a_new_series(tmp_path, tiny_cache, tiny_drafter_config,
                                                                      three_sample_ckpt):
    """With a real resume: the checkpoint's callback state was damaged (history not a list of
    evaluations); the fit resumes at step 2 and starts a new series there, with one warning."""
    ckpt, first = three_sample_ckpt
    data = torch.load(ckpt, weights_only=False)
    data["callbacks"][first.state_key]["history"] = "garbage"
    damaged = tmp_path / "damaged.ckpt"
    torch.save(data, damaged)
    resumed = make_cb(tiny_cache, num_samples=3)
    with pytest.warns(RuntimeWarning, match=r"malformed \(history is 'garbage'"):
        trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [resumed], max_steps=4, ckpt_path=str(damaged))
    assert trainer.global_step == 4 and steps(resumed) == [2, 4]


# -- the cache folder replaced during training ------------------------------------------------------

class SwapCache(Callback):
    """Replaces the cache folder by another cache (other prompts) after the first optimizer step."""

    def __init__(self, folder: Path, other: Path):
        self.folder, self.other, self.done = folder, other, False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 1 and not self.done:
            shutil.rmtree(self.folder)
            shutil.copytree(self.other, self.folder)  # copy2 keeps the files' modification times
            self.done = True


@pytest.fixture(scope="module")
def other_cache(tmp_path_factory) -> Path:
    """The same tiny target, other prompts: another cache that fits the same drafter."""
    return build_tiny_cache(tmp_path_factory.mktemp("other_cache"), n_prompts=4, prompt_seed=7)


@pytest.mark.e2e
def test_cache_replaced_during_training_fails_the_evaluation_naming_both_hashes(tmp_path, tiny_cache, other_cache,
                                                                               tiny_drafter_config):
    """Not "truncated?" nor a sha256 mismatch of one shard: the evaluation fails with
    "the cache changed: manifest sha256 X..., was Y...", counts as a failed evaluation, training goes on
    until max_failed_evaluations in a row failed."""
    folder = tmp_path / "cache"
    shutil.copytree(tiny_cache, folder)
    old, new = StateCache(tiny_cache).manifest_sha256, StateCache(other_cache).manifest_sha256
    assert old != new
    cb = make_cb(folder)
    changed = rf"the cache changed: manifest sha256 {new[:12]}\.\.\., was {old[:12]}\.\.\."
    with pytest.warns(RuntimeWarning, match=r"evaluation at step 2 .*failed on rank 0: CacheError: .*" + changed) as rec:
        trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [SwapCache(folder, other_cache), cb], max_steps=4,
                         data_cache=tiny_cache, logger=CSVLogger(tmp_path / "logs"))
    assert trainer.global_step == 4 and steps(cb) == [0] and cb.evaluator.state.failed_evaluations == 2
    assert all("the cache changed" in m and "truncated" not in m for m in ours(rec))  # steps 2 and 4 (fit end)
    logged = read_csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv")
    assert {s: v["failed_evaluations"] for s, v in logged.items()} == {0: 0.0, 2: 1.0, 4: 2.0}

    shutil.rmtree(folder)
    shutil.copytree(tiny_cache, folder)
    strict = make_cb(folder, max_failed_evaluations=1)
    with pytest.raises(DFlashEvalError, match=changed):  # max_failed_evaluations=1: the first failure stops
        fit(tmp_path / "strict", tiny_drafter_config, tiny_cache, [SwapCache(folder, other_cache), strict],
            max_steps=4, data_cache=tiny_cache)


def test_an_untouched_or_rewritten_identical_manifest_is_not_a_change(tmp_path, tiny_cache):
    """The check is a stat; the manifest is hashed again only when its identity changed, and the same
    bytes written again (a restored backup) pass."""
    folder = tmp_path / "cache"
    shutil.copytree(tiny_cache, folder)
    cache = StateCache(folder)
    cache.check_unchanged()
    manifest = folder / "manifest.json"
    manifest.write_bytes(manifest.read_bytes())
    cache.check_unchanged()
    manifest.write_bytes(manifest.read_bytes().replace(b'"p000"', b'"q000"'))
    with pytest.raises(Exception, match="the cache changed: manifest sha256"):
        cache.check_unchanged()
    manifest.unlink()
    with pytest.raises(Exception, match="the cache changed: its manifest is gone"):
        cache.check_unchanged()
