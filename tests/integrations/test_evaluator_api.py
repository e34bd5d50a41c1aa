"""``LiveEvaluator`` used directly, as a plain loop would: its calls, its steps, its sinks, its drafter.

The rules: every argument and step is checked (nothing coerced, a ``DFlashCBError`` naming it), a logging
failure never ends the training and never starves another sink, and a drafter that changed since setup
fails that evaluation under the failure policy instead of logging impossible numbers.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_cb import DFlashDrafter, LiveEvaluator
from dflash_cb.common.arguments import ArgumentError
from dflash_cb.common.errors import DFlashCBError
from dflash_cb.integrations.evaluator.live import DFlashEvalError

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "dflash_eval/"


def drafter(cfg: dict, block_size: int | None = None, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter.from_config_dict({**cfg, "block_size": block_size or cfg["block_size"]})


def evaluator(cache: Path, **options) -> LiveEvaluator:
    options.setdefault("ddtree_budgets", [4])
    options.setdefault("every_n_train_steps", 1)
    return LiveEvaluator(str(cache), console=False, **options)


# -- the drafter, checked at every evaluation -----------------------------------------------------

@pytest.mark.parametrize(("first", "then"), [(4, 8), (8, 4)])
def test_a_drafter_of_another_block_size_fails_that_evaluation_naming_both(tiny_cache, tiny_drafter_config,
                                                                             first, then):
    logged = []
    ev = evaluator(tiny_cache, log=lambda m, s: logged.append((s, m)), eval_on_fit_start=True)
    ev.start(0, drafter(tiny_drafter_config, first))
    with pytest.warns(RuntimeWarning, match=rf"DrafterChangedError: .*block_size {first} -> {then}"):
        assert ev.step(1, drafter(tiny_drafter_config, then)) is None
    taus = [m[PREFIX + "tau"] for _, m in logged if PREFIX + "tau" in m]
    assert len(taus) == 1 and 1.0 <= taus[0] <= first  # only the first drafter's evaluation was logged
    assert ev.state.failed_evaluations == 1 and [h["step"] for h in ev.history] == [0]
    strict = evaluator(tiny_cache, fail_on_error=True)
    strict.start(0, drafter(tiny_drafter_config, first))
    with pytest.raises(DFlashEvalError, match=rf"block_size {first} -> {then}"):
        strict.step(1, drafter(tiny_drafter_config, then))


def test_the_same_drafter_with_new_weights_is_evaluated(tiny_cache, tiny_drafter_config):
    ev = evaluator(tiny_cache)
    ev.start(0, drafter(tiny_drafter_config, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert ev.step(1, drafter(tiny_drafter_config, seed=1)) is not None


def test_a_data_parallel_wrapper_is_looked_through(tiny_cache, tiny_drafter_config):
    plain, wrapped = evaluator(tiny_cache), evaluator(tiny_cache)
    d = drafter(tiny_drafter_config)
    a = plain.start(0, d)
    b = wrapped.start(0, nn.DataParallel(d))
    assert a[PREFIX + "tau"] == b[PREFIX + "tau"]


def test_a_module_that_is_no_drafter_says_where_to_point(tiny_cache):
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

    with pytest.raises(DFlashCBError, match=r"point drafter= at the drafter module") as err:
        evaluator(tiny_cache).start(0, Wrapper())
    assert "spec=DrafterSpec" not in str(err.value)


# -- steps and arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["5", 2.5, 5.0, True, torch.tensor(5), -1, None])
def test_a_step_that_is_not_an_optimizer_step_is_refused_naming_it(tiny_cache, tiny_drafter_config, bad):
    ev = evaluator(tiny_cache)
    d = drafter(tiny_drafter_config)
    ev.start(0, d)
    with pytest.raises(ArgumentError, match=r"step\(global_step="):
        ev.step(bad, d)
    with pytest.raises(ArgumentError, match=r"finish\(global_step="):
        ev.finish(bad, d)


def test_steps_that_go_back_and_a_step_before_start_are_refused(tiny_cache, tiny_drafter_config):
    d = drafter(tiny_drafter_config)
    ev = evaluator(tiny_cache, every_n_train_steps=5)
    with pytest.raises(ArgumentError, match=r"step\(global_step=5\) before start\(\)"):
        ev.step(5, d)
    assert ev.history == []
    ev.start(0, d)
    ev.step(10, d)
    with pytest.raises(ArgumentError, match=r"global_step=5\) after step 10: steps must not go back"):
        ev.step(5, d)
    ev.step(10, d)  # the same step again (another micro-batch) is fine and not evaluated twice
    assert [h["step"] for h in ev.history] == [0, 10]


@pytest.mark.parametrize(("value", "ok"), [(None, True), (-1, True), (7, True), ("3", False), (2.5, False),
                                          (True, False), (-2, False)])
def test_max_steps_is_an_integer_or_unknown(tiny_cache, value, ok):
    if ok:
        LiveEvaluator(str(tiny_cache), max_steps=value)
    else:
        with pytest.raises(ArgumentError, match="max_steps="):
            LiveEvaluator(str(tiny_cache), max_steps=value)


def test_log_must_be_a_sink_a_function_or_a_run(tiny_cache):
    with pytest.raises(ArgumentError, match="log=3: expected"):
        LiveEvaluator(str(tiny_cache), log=3)


# -- sinks: a logging failure never ends the training ------------------------------------------------

def test_a_raising_sink_is_named_and_the_others_still_get_everything(tiny_cache, tiny_drafter_config):
    got = []

    def broken(metrics, step):
        raise OSError("disk full")

    ev = evaluator(tiny_cache, log=[broken, lambda m, s: got.append((s, PREFIX + "tau" in m))], max_steps=1)
    d = drafter(tiny_drafter_config)
    with pytest.warns(RuntimeWarning, match=r"logging .* to log function .*broken failed: OSError: disk full") as rec:
        ev.start(0, d)  # the setup's predicted cost, then the start evaluation
        ev.step(1, d)
        ev.finish(1, d)
    # the predicted cost, then each evaluation, reached the good sink
    assert got == [(0, False), (0, True), (1, True)]
    assert [h["step"] for h in ev.history] == [0, 1]
    assert all("training goes on" in str(w.message) for w in rec if "broken" in str(w.message))


def test_a_sink_failing_with_fail_on_error_still_does_not_end_the_training(tiny_cache, tiny_drafter_config):
    def broken(metrics, step):
        raise RuntimeError("tracker down")

    ev = evaluator(tiny_cache, log=broken, fail_on_error=True)
    with pytest.warns(RuntimeWarning, match="tracker down"):
        metrics = ev.start(0, drafter(tiny_drafter_config))
    assert math.isfinite(metrics[PREFIX + "tau"])


# -- LightningCLI: a wrong value is one clean message ------------------------------------------------

@pytest.mark.e2e
def test_lightning_cli_refuses_an_unknown_tail_mode_in_a_few_lines(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: dflash_cb.DFlashEvalCallback\n"
                   "      init_args: {states: c, tail_blocks: servd}\n")
    script = ("import sys\nfrom lightning.pytorch.cli import LightningCLI\n"
              "from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule\n"
              "LightningCLI(DFlashDrafterModule, CachedStatesDataModule, run=False)\n")
    r = subprocess.run([sys.executable, "-c", script, "--config", str(cfg), "--model.drafter_config={}",
                        "--model.states=c", "--data.states=c"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    # jsonargparse's own message (the usage, then the key and the allowed values), not a double traceback
    assert 'Parser key "tail_blocks"' in r.stderr and "Literal['served', 'reference']" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_a_baseline_replayed_with_other_tail_blocks_is_warned_about_at_setup(tiny_cache, tiny_drafter_config,
                                                                             tmp_path):
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.results_file import report_to_results, write_results

    cache = StateCache(tiny_cache)
    write_results(report_to_results(evaluate(cache, drafter(tiny_drafter_config).eval(), budgets=[4],
                                             tail_blocks="reference"), cache), tmp_path / "ref.json")
    # Checked once the drafter is known (its block is part of what must agree).
    with pytest.warns(RuntimeWarning, match="tail_blocks differ"):
        evaluator(tiny_cache, baselines={"ref": str(tmp_path / "ref.json")}).setup(drafter(tiny_drafter_config))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        evaluator(tiny_cache, baselines={"ref": str(tmp_path / "ref.json")},
                  tail_blocks="reference").setup(drafter(tiny_drafter_config))
    with pytest.warns(RuntimeWarning, match=r"block_size differ \(this run 4, baseline .*ref.json 6\)"):
        evaluator(tiny_cache, baselines={"ref": str(tmp_path / "ref.json")}, tail_blocks="reference",
                  block_size=4).setup(drafter(tiny_drafter_config))


def test_the_block_the_server_drafts_with_equals_the_tool_at_that_block(tiny_cache, tiny_drafter_config, tmp_path):
    """``block_size=4`` on a block-6 drafter: the live figures are the tool's ``--block-size 4`` figures;
    a block above the drafter's is refused at setup, naming the argument."""
    import json

    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    d = drafter(tiny_drafter_config)
    d.save_pretrained(tmp_path / "d")
    ev = evaluator(tiny_cache, block_size=4, ddtree_budgets=[4], eval_on_fit_end=True)
    live = ev.finish(0, d)
    assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(tmp_path / "d"), "--out",
                          str(tmp_path / "r.json"), "--block-size", "4", "--ddtree-budgets", "4", "--device", "cpu",
                          "--dtype", "float32"]) == 0
    tool = json.loads((tmp_path / "r.json").read_text())
    assert live[PREFIX + "tau"] == tool["metrics"]["tau"] <= 4
    assert live[PREFIX + "ddtree/tau_b4"] == tool["metrics"]["ddtree/tau_b4"]
    assert ev.describe()["block_size"] == 4 and ev.describe()["drafter_block_size"] == tiny_drafter_config["block_size"]
    with pytest.raises(ArgumentError, match=r"block_size=9: expected an integer from 2 to 6"):
        evaluator(tiny_cache, block_size=9).start(0, d)
    with pytest.raises(ArgumentError, match="block_size=1"):
        evaluator(tiny_cache, block_size=1)


def test_the_anchor_set_is_part_of_the_series(tiny_cache, tiny_drafter_config):
    """The strided statistics of a resumed run score the same anchors: the saved state records the block and
    the anchor set, and a resume with another seed or stride starts a new series instead of mixing them."""
    d = drafter(tiny_drafter_config)
    first = evaluator(tiny_cache, every_n_train_steps=2, anchor_seed=3)
    first.start(0, d)
    first.step(2, d)
    saved = first.state_dict()
    assert saved["series"] == {"block_size": 6, "anchor_stride": 6, "anchor_seed": 3, "tail_blocks": "served",
                               "dtype": "float32"}
    same = evaluator(tiny_cache, every_n_train_steps=2, anchor_seed=3)
    same.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        same.start(2, d)
    assert [h["step"] for h in same.history] == [0, 2]
    for other, changed in (({"anchor_seed": 4}, "anchor_seed 3 -> 4"), ({"light_anchor_stride": 3}, "anchor_stride 6 -> 3"),
                           ({"block_size": 5}, "block_size 6 -> 5"),
                           ({"tail_blocks": "reference"}, "tail_blocks 'served' -> 'reference'"),
                           ({"autocast_dtype": "bfloat16"}, "dtype 'float32' -> 'bfloat16'")):
        resumed = evaluator(tiny_cache, every_n_train_steps=2, **{"anchor_seed": 3, **other})
        resumed.load_state_dict(saved)
        with pytest.warns(RuntimeWarning, match=rf"measured with other settings than this run's \(.*{changed}.*\)"):
            resumed.start(2, d)
        assert [h["step"] for h in resumed.history] == [2]  # a new series, from the resumed weights
    # A state saved before the record had its present name and fields goes on where those agree.
    old = {**{k: v for k, v in saved.items() if k != "series"},
           "estimator": {"block_size": 6, "anchor_stride": 6, "anchor_seed": 3}}
    kept = evaluator(tiny_cache, every_n_train_steps=2, anchor_seed=3)
    kept.load_state_dict(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        kept.start(2, d)
    assert [h["step"] for h in kept.history] == [0, 2]


# Every option of the evaluator, with another value (the options that need files or a model aside).
_OTHER_VALUES = {
    "every_n_train_steps": 3, "eval_on_fit_start": False, "eval_on_fit_end": False, "ddtree_budgets": [2, 4],
    "light_ddtree_budgets": [2], "light_anchor_stride": 2, "anchor_seed": 7, "full_every_n_evals": 2, "num_samples": 3,
    "sample_ids": None, "sample_seed": 5, "prefix": "other_eval/", "fail_on_error": True, "max_failed_evaluations": 1,
    "autocast_dtype": "bfloat16", "table_samples": 1, "table_cycles": 2, "tokenizer": str, "verify_cache": False,
    "position_edges": [0, 4, 8], "console": True, "tail_blocks": "reference", "block_size": 4,
}


@pytest.fixture(scope="module")
def trained(trained_tiny_drafter):
    """The tiny drafter after a few epochs: partial acceptance, so the settings have figures to change."""
    return trained_tiny_drafter()


def test_every_option_that_changes_a_logged_figure_identifies_the_series(tiny_cache, trained):
    """The series identity is complete: an option whose change alters a main-key figure of the same weights
    (compared on the keys both evaluations log, prefix stripped, times aside) changes what a resume compares (the
    saved series, the sample selection or the cache); an option that leaves every figure alone may stay out."""
    from dflash_cb.integrations.evaluator.config import OLD_NAMES, config_fields

    timed = ("eval_time_s", "eval_overhead", "predicted/", "setup_time_s", "step", "failed_evaluations",
             "anchors_drafted", "anchors_needed")  # the cost of the pass that ran, not figures of the drafter
    # cost_profile adds the serving/* projections and changes no figure of the drafter (like published).
    untested = {"states", "target_embed", "target_lm_head", "baselines", "published", "published_entries",
                "cost_profile", *OLD_NAMES}
    assert set(_OTHER_VALUES) == set(config_fields()) - untested  # a new option must be added here

    def run(**options):
        ev = LiveEvaluator(str(tiny_cache), **{"ddtree_budgets": [4], "every_n_train_steps": 1, "console": False,
                                               **options})
        metrics = ev.start(0, trained) or ev.step(1, trained)
        prefix = ev.prefix
        figures = {k[len(prefix):]: v for k, v in metrics.items() if not k[len(prefix):].startswith(timed)}
        state = ev.state_dict()
        return figures, (state["series"], state["sample_selection"]["ids_sha256"], state["cache_manifest_sha256"])

    base, identity = run()
    assert 1.05 < base["tau"] < 4 and 0 < base["acceptance/depth_01"] < 1  # figures that settings can move
    moved = []
    for name, value in _OTHER_VALUES.items():
        figures, other = run(**{name: value})
        common = set(base) & set(figures)
        changed = [k for k in common if not math.isclose(base[k], figures[k], rel_tol=0, abs_tol=0)]
        if changed:
            moved.append(name)
            assert other != identity, f"{name}={value!r} changes {sorted(changed)[:4]} but not the series identity"
    # (tail_blocks moves no figure of this drafter: the resume test above covers it)
    assert {"autocast_dtype", "block_size", "anchor_seed", "light_anchor_stride", "num_samples"} <= set(moved), moved


def test_a_stride_past_most_completions_is_warned_about_at_setup(tiny_cache, tiny_drafter_config):
    with pytest.warns(RuntimeWarning, match="light_anchor_stride 4096"):
        evaluator(tiny_cache, light_anchor_stride=4096).setup(drafter(tiny_drafter_config))


def test_every_evaluation_logs_the_light_estimator_under_the_main_keys(tiny_cache, tiny_drafter_config):
    """A full evaluation's main keys equal a light evaluation's of the same weights (same anchors, same
    budgets); its exact figures are under full/ only."""
    d = drafter(tiny_drafter_config, seed=2)
    light = evaluator(tiny_cache, ddtree_budgets=[2, 4], eval_on_fit_end=False).start(0, d)
    full = evaluator(tiny_cache, ddtree_budgets=[2, 4]).finish(0, d)
    main = {k: v for k, v in full.items() if not k.startswith(PREFIX + "full/")}
    skip = ("eval_time_s", "eval_overhead", "anchors_drafted", "anchors_needed", "step")
    assert {k for k in main if not k.endswith(skip)} == {k for k in light if not k.endswith(skip)}
    for k, v in light.items():
        if not k.endswith(skip):
            assert main[k] == v, k
    assert full[PREFIX + "full/anchor_stride"] == 1 and full[PREFIX + "anchor_stride"] == 6
    assert PREFIX + "ddtree/tau_b2" not in full and PREFIX + "full/ddtree/tau_b2" in full
    assert full[PREFIX + "full/specforge/acc"] != full[PREFIX + "specforge/acc"]  # two estimators, two keys


def test_more_samples_than_the_cache_holds_is_said_by_the_live_evaluator_too(tiny_cache, tiny_drafter_config):
    """``num_samples`` above the cache's size scores every sample, as eval_drafter's ``--samples`` does, and says
    so (one warning naming the cache and both counts) instead of accepting it silently."""
    with pytest.warns(RuntimeWarning, match=rf"num_samples 500: the cache {tiny_cache} has only 6 samples; scoring "
                                            r"all 6"):
        ev = evaluator(tiny_cache, num_samples=500)
        ev.setup()
    assert len(ev.eval_ids) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        evaluator(tiny_cache, num_samples=6).setup()
