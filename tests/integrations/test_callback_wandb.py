"""W&B side of the callback, offline: metric keys, the samples table, the chart, baselines, standalone runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from wandb_runs import history_and_summary, write_published

from dflash_cb import DFlashEvalCallback
from dflash_cb.cache.states import StateCache
from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.replay import evaluate
from dflash_cb.core.results.baselines import load_measured, load_published
from dflash_cb.core.results.results_file import load_results, report_to_results, write_results
from dflash_cb.demo.lightning_module import CachedStatesDataModule

BUDGETS = [4, 8]


@pytest.fixture(scope="module")
def reference_results(tiny_cache, tiny_drafter_config, tmp_path_factory) -> Path:
    """results.json of a 'reference' drafter (other random weights) on the same cache."""
    torch.manual_seed(123)
    ref = DFlashDrafter.from_config_dict(tiny_drafter_config).eval()
    cache = StateCache(tiny_cache)
    report = evaluate(cache, ref, budgets=BUDGETS)
    path = tmp_path_factory.mktemp("ref") / "zlab.json"
    write_results(report_to_results(report, cache, meta={"drafter": "reference (test)"}), path)
    return path


@pytest.mark.e2e
def test_wandb_offline_run_holds_metrics_table_chart_and_baselines(tmp_path, tiny_cache, tiny_drafter_config,
                                                                   reference_results):
    from lightning.pytorch.loggers import WandbLogger
    from lightning_runs import make_module, make_trainer

    published = write_published(tmp_path / "published.yaml")
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=BUDGETS, num_samples=4,
                            baselines={"zlab": str(reference_results)}, published=published, table_samples=2,
                            table_cycles=3)
    logger = WandbLogger(project="dflash-cb-test", name="callback", save_dir=str(tmp_path), offline=True)
    seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [cb], 4, logger=logger)
    trainer.fit(make_module(tiny_drafter_config, tiny_cache), CachedStatesDataModule(str(tiny_cache), batch_size=2))
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()  # flush everything to the .wandb file

    history, summary, defined = history_and_summary(run_dir)
    assert ("dflash_eval/*", "trainer/global_step") in defined
    evals = [h for h in history if "dflash_eval/tau" in h]
    assert [h["trainer/global_step"] for h in evals] == [0, 2, 4]
    assert [h["dflash_eval/tau"] for h in evals] == pytest.approx([h["tau"] for h in cb.history], rel=1e-12)
    keys = set().union(*history)
    for k in ("dflash_eval/full/ddtree/tau_b4", "dflash_eval/ddtree/tau_b8", "dflash_eval/acceptance/depth_01",
              "dflash_eval/all_anchor_tau", "dflash_eval/category/code/tau", "dflash_eval/eval_time_s",
              "dflash_eval/baseline/zlab/tau", "dflash_eval/published/paper-x/tau", "dflash_eval/specforge/acc",
              "dflash_eval/tau_request_mean", "dflash_eval/accept_length_served",
              "dflash_eval/published/paper-y/tau_request_mean"):
        assert k in keys, k
    # Each published figure sits only under the live metric of its declared convention.
    assert "dflash_eval/published/paper-y/tau" not in keys
    assert all(h["dflash_eval/published/paper-y/tau_request_mean"] == 3.25 for h in evals)
    assert not any("unknown-drafter" in k for k in keys | set(summary))  # placeholders are never logged

    # The reference is restricted to the same 4-sample subset the live evaluation scores.
    ref = load_measured(reference_results, StateCache(tiny_cache), sample_ids=cb.evaluator.eval_ids)
    assert all(h["dflash_eval/baseline/zlab/tau"] == pytest.approx(ref.metrics["tau"]) for h in evals)
    full_tau = json.loads(reference_results.read_text())["metrics"]["tau"]
    assert len(cb.evaluator.eval_ids) == 4 and ref.details["subset"].startswith("4 of 6")
    assert ref.metrics["tau"] == pytest.approx(
        sum(sum(s["acceptance_lengths"]) for s in json.loads(reference_results.read_text())["samples"]
            if s["id"] in cb.evaluator.eval_ids)
        / sum(len(s["acceptance_lengths"]) for s in json.loads(reference_results.read_text())["samples"]
              if s["id"] in cb.evaluator.eval_ids)) and isinstance(full_tau, float)
    assert summary["dflash_eval/baseline/zlab/acceptance/depth_01"] == pytest.approx(ref.metrics["acceptance/depth_01"])
    assert summary["dflash_eval/published/paper-x/ddtree/tau_b8"] == 4.0

    # Objects: table, histogram, per-depth chart at every evaluation.
    table_entries = [h for h in history if "dflash_eval/sample_table/path" in h]
    assert len(table_entries) == 3
    assert all(h["dflash_eval/produced_hist/_type"] == "histogram" for h in table_entries)
    assert all("dflash_eval/charts/acceptance_per_depth_table/path" in h for h in table_entries)
    table = json.loads((run_dir / "files" / table_entries[-1]["dflash_eval/sample_table/path"]).read_text())
    assert table["columns"][:3] == ["step", "sample", "category"] and len(table["data"]) == 2
    assert all(row[0] == 4 and "✓«" in row[5] and "#1 @" in row[5] for row in table["data"])
    chart = json.loads((run_dir / "files" / table_entries[-1]["dflash_eval/charts/acceptance_per_depth_table/path"])
                       .read_text())
    series = {row[1] for row in chart["data"]}
    assert series == {"live @ step 4", "zlab (reference)", "paper-x (published, not measured here; pooled)"}


@pytest.mark.e2e
def test_baseline_from_another_cache_is_refused_before_training(tmp_path, tiny_cache, tiny_drafter_config,
                                                                reference_results):
    from lightning_runs import make_module, make_trainer

    other = json.loads(reference_results.read_text())
    other["meta"]["cache_manifest_sha256"] = other["meta"]["cache_content_sha256"] = "0" * 64
    bad = tmp_path / "other_cache.json"
    bad.write_text(json.dumps(other))
    cb = DFlashEvalCallback(states=tiny_cache, baselines=[str(bad)])
    trainer = make_trainer(tmp_path, [cb], 2)
    with pytest.raises(ValueError, match="Numbers from different caches are not comparable"):
        trainer.fit(make_module(tiny_drafter_config, tiny_cache), CachedStatesDataModule(str(tiny_cache)))
    assert trainer.global_step == 0


def test_shipped_published_yaml_logs_nothing_unverified():
    root = Path(__file__).resolve().parents[2]
    pf = load_published(root / "configs" / "baselines" / "published.yaml")
    # Only the figures checked against their source (the DFlash authors' table, tests/core/test_conventions.py); the
    # others stay placeholders until they are.
    assert [b.name for b in pf.baselines] == ["dflash-qwen3-8b-b16", "dflash-qwen3-4b-b16"]
    assert {s.split(":")[0] for s in pf.skipped} == {"ddtree-paper-qwen3-8b", "zlab-qwen36-27b"}


@pytest.mark.e2e
def test_log_standalone_results_uses_the_callback_names(tmp_path, reference_results):
    from dflash_cb.integrations.tracking.wandb_logging import log_standalone_results

    results = load_results(reference_results)
    files_dir = log_standalone_results(results, project="dflash-cb-test", name="standalone", mode="offline",
                                       dir=tmp_path, published=write_published(tmp_path / "published.yaml"))
    history, summary, _ = history_and_summary(Path(files_dir).parent)
    assert summary["dflash_eval/tau"] == pytest.approx(results.tau)
    assert summary["trainer/global_step"] == 0
    assert summary["dflash_eval/published/paper-x/tau"] == 3.5
    for b in BUDGETS:
        assert summary[f"dflash_eval/ddtree/tau_b{b}"] == pytest.approx(results.metric(f"ddtree/tau_b{b}"))
    assert any("dflash_eval/sample_table/path" in h for h in history)
    assert not any(isinstance(v, float) and math.isnan(v) for v in summary.values())
