"""The W&B panels (tools/wandb_panels.py) against a real offline run written by the callback.

Every key a panel references must exist in that run's history or summary, so renaming a metric
fails here instead of leaving an empty panel. The view is built and serialised offline; the one
network call (``save()``) is not tested.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything

from dflash_cb import DFlashEvalCallback
from dflash_cb.lightning_module import CachedStatesDataModule
from dflash_cb.panels import (
    PanelLayout,
    build_report,
    build_workspace,
    layout_from_keys,
    panel_plan,
    referenced_keys,
)
from dflash_cb.positions import cycle_labels, position_labels
from dflash_cb.states import StateCache

BUDGETS = [4, 8]
EDGES = (0, 8, 16)


@pytest.fixture(scope="module")
def offline_run(tiny_cache, tiny_drafter_config, tmp_path_factory) -> dict:
    """A real training run with the callback, a measured baseline and a published figure, logged offline."""
    from lightning.pytorch.loggers import WandbLogger
    from test_callback import make_module, make_trainer
    from test_callback_wandb import history_and_summary, write_published

    from dflash_cb.engine import evaluate
    from dflash_cb.model import DFlashDrafter
    from dflash_cb.results import report_to_results, write_results

    tmp = tmp_path_factory.mktemp("panels")
    torch.manual_seed(7)
    cache = StateCache(tiny_cache)
    write_results(report_to_results(evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(),
                                             budgets=BUDGETS), cache), tmp / "zlab.json")
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS,
                            baselines={"zlab": str(tmp / "zlab.json")}, published=write_published(tmp / "pub.yaml"),
                            table_samples=2, position_edges=EDGES, prog_bar=True)
    logger = WandbLogger(project="dflash-cb-test", name="panels", save_dir=str(tmp), offline=True)
    seed_everything(0, verbose=False)
    trainer = make_trainer(tmp, [cb], 4, logger=logger)
    trainer.fit(make_module(tiny_drafter_config, tiny_cache), CachedStatesDataModule(str(tiny_cache), batch_size=2))
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    history, summary, _ = history_and_summary(run_dir)
    return {"history": history, "summary": summary, "cb": cb, "trainer": trainer, "run_dir": run_dir}


def _layout(cb: DFlashEvalCallback, block_size: int) -> PanelLayout:
    """What a user passes to tools/wandb_panels.py for this run: from its configuration, not its keys."""
    return PanelLayout(budgets=BUDGETS, categories=sorted({s.category for s in cb.cache.samples}),
                       block_size=block_size, position_buckets=position_labels(EDGES), cycle_buckets=cycle_labels(),
                       baselines=["baseline/zlab"], published=["published/paper-x"])


def test_every_panel_key_exists_in_the_logged_run(offline_run, tiny_drafter_config):
    history, summary, cb = offline_run["history"], offline_run["summary"], offline_run["cb"]
    logged = set().union(*history) | set(summary)
    plan = panel_plan(_layout(cb, tiny_drafter_config["block_size"]))
    refs = referenced_keys(plan)
    assert refs["line"] and refs["scalar"] and refs["table"]
    # A metric without a value at any evaluation (NaN: e.g. a depth no anchor reached) is not logged,
    # but the callback computed it under that name.
    nan_everywhere = {"dflash_eval/" + k for k, v in cb.history[-1].items() if v != v}
    assert refs["line"] <= logged | nan_everywhere, sorted(refs["line"] - logged - nan_everywhere)
    assert len(refs["line"] & nan_everywhere) <= 4  # the check is not vacuous
    assert refs["scalar"] <= set(summary), sorted(refs["scalar"] - set(summary))
    for table in refs["table"]:  # a logged table appears as <key>/_type, <key>/path, ...
        assert any(k.startswith(table + "/") for k in logged), table
    assert [s for s, panels in plan.items() if panels] == ["Headline", "Uncertainty", "Per category", "Per depth",
                                                            "By position", "Cost", "Samples"]
    # The same layout is recovered from the logged keys alone (tools/wandb_panels.py --run).
    back = layout_from_keys(logged)
    want = _layout(cb, tiny_drafter_config["block_size"])
    assert back.block_size == want.block_size
    for f in ("budgets", "categories", "position_buckets", "cycle_buckets", "baselines", "published"):
        assert list(getattr(back, f)) == list(getattr(want, f)), f


def test_view_and_report_build_and_the_view_serialises(offline_run, tiny_drafter_config):
    layout = _layout(offline_run["cb"], tiny_drafter_config["block_size"])
    view = build_workspace("my-team", "dflash-cb-test", layout)
    wire = json.loads(view._to_model().model_dump_json())  # what save() would send
    text = json.dumps(wire)
    for key in ("dflash_eval/tau_ci_low", "dflash_eval/baseline/zlab/delta_tau", "dflash_eval/position/8_16/tau",
                "dflash_eval/cycle/4plus/tau", "dflash_eval/sample_table", "trainer/global_step"):
        assert key in text, key
    assert [s.name for s in view.sections][:2] == ["Headline", "Uncertainty"]
    report = build_report("my-team", "dflash-cb-test", layout)  # serialising a report needs a W&B login
    assert sum(len(b.panels) for b in report.blocks if hasattr(b, "panels")) == sum(
        len(p) for p in panel_plan(layout).values())


def test_the_run_holds_intervals_deltas_best_tau_and_positions(offline_run):
    history, summary = offline_run["history"], offline_run["summary"]
    evals = [h for h in history if "dflash_eval/tau" in h]
    assert [h["trainer/global_step"] for h in evals] == [0, 2, 4]
    for h in evals:
        assert h["dflash_eval/tau_ci_low"] <= h["dflash_eval/tau"] <= h["dflash_eval/tau_ci_high"]
        d = h["dflash_eval/baseline/zlab/delta_tau"]
        assert d == pytest.approx(h["dflash_eval/tau"] - h["dflash_eval/baseline/zlab/tau"])
        assert h["dflash_eval/baseline/zlab/delta_tau_ci_low"] <= d <= h["dflash_eval/baseline/zlab/delta_tau_ci_high"]
        cycles = sum(h[f"dflash_eval/position/{b}/cycles"] for b in position_labels(EDGES))
        assert cycles == h["dflash_eval/cycles"] == sum(h[f"dflash_eval/cycle/{b}/cycles"] for b in cycle_labels())
    best = max(evals, key=lambda h: h["dflash_eval/tau"])
    assert summary["dflash_eval/best/tau"] == best["dflash_eval/tau"]
    assert summary["dflash_eval/best/step"] == best["trainer/global_step"]
    assert summary["dflash_eval/tau"]["max"] == best["dflash_eval/tau"]  # define_metric(summary="max,last")
    assert summary["dflash_eval/tau"]["last"] == evals[-1]["dflash_eval/tau"]
    assert offline_run["trainer"].progress_bar_metrics["dflash_eval/tau"] == pytest.approx(evals[-1]["dflash_eval/tau"])


def test_console_line_per_evaluation(offline_run):
    from dflash_cb.report import evaluation_line

    cb = offline_run["cb"]
    h = cb.history[-1]
    line = evaluation_line(int(h["step"]), h, BUDGETS, ["baseline/zlab"])
    assert line.startswith(f"step 4: tau {h['tau']:.3f} [{h['tau_ci_low']:.2f}, {h['tau_ci_high']:.2f}]")
    assert f"DDTree b8 {h['ddtree/tau_b8']:.3f}" in line and "vs zlab " in line
    assert line.endswith(f" s ({h['eval_overhead']:.1%} of wall time)")


def test_panels_tool_dry_run_builds_the_view_without_network(capsys):
    from dflash_cb.cli import run
    from dflash_cb.panels import main

    assert run(main, ["--entity", "e", "--project", "p", "--budgets", "4,8", "--categories", "chat,code",
                      "--baselines", "z-lab drafter", "--block-size", "6", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    keys = {k for panels in plan.values() for p in panels for k in p["keys"]}
    assert "dflash_eval/baseline/z-lab_drafter/delta_tau_ci_high" in keys and "dflash_eval/acceptance/depth_05" in keys
    assert run(main, ["--entity", "e", "--project", "p", "--position-edges", "3,1", "--dry-run"]) == 2
    assert "position edges must start at 0" in capsys.readouterr().err
