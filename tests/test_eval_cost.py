"""Setup hashes each file once per process, and an evaluation's cost is
predicted at setup and measured as it runs (real Lightning Trainer, tiny drafter, CSV logger)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_runs import fit, read_csv_metrics
from torch.utils.flop_counter import FlopCounterMode

from dflash_cb import DFlashEvalCallback
from dflash_cb.cache import integrity
from dflash_cb.cache.selection import select_sample_ids
from dflash_cb.cache.states import StateCache
from dflash_cb.core.cost import DrafterShape, evaluation_cost
from dflash_cb.core.engine import evaluate
from dflash_cb.core.model import DFlashDrafter


def count_hashes(monkeypatch) -> list[str]:
    """The files sha256 actually reads, by name, in order."""
    seen: list[str] = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: seen.append(Path(p).name) or real(p, *a, **k))
    return seen


@pytest.mark.e2e
def test_setup_hashes_each_file_once_per_process(tmp_path, tiny_cache, tiny_drafter_config, monkeypatch):
    """Two fits (two callbacks, two StateCaches) on one cache: the first hashes every evaluated shard
    and the head once, although setup, every evaluation and the head load all verify; the second
    hashes nothing; a shard rewritten since (``integrity.file_identity``) is hashed again, alone."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)  # a path no other test has verified in this process
    hashed = count_hashes(monkeypatch)
    cb = DFlashEvalCallback(states=cache, every_n_train_steps=2, ddtree_budgets=[4], num_samples=4)
    fit(tmp_path / "a", tiny_drafter_config, cache, [cb], max_steps=4)
    sc = StateCache(cache)
    want = sorted([*sc.shards_of(cb.evaluator.eval_ids), sc.manifest.target_head["file"]])
    assert len(cb.evaluator.eval_ids) == 4 < len(sc.shards_of()) and sorted(hashed) == want
    hashed.clear()
    fit(tmp_path / "b", tiny_drafter_config, cache, [DFlashEvalCallback(states=cache, every_n_train_steps=2,
                                                                         num_samples=4)], max_steps=2)
    assert hashed == []
    shard = cache / sc.shards_of(cb.evaluator.eval_ids)[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fit(tmp_path / "c", tiny_drafter_config, cache, [DFlashEvalCallback(states=cache, every_n_train_steps=2,
                                                                         num_samples=4)], max_steps=2)
    assert hashed == [shard.name]


@pytest.mark.e2e
def test_predicted_cost_and_overhead_are_printed_and_logged(tmp_path, tiny_cache, tiny_drafter_config, caplog):
    """Setup prints one line (setup time, hashing, predicted periodic and full cost) and logs the
    prediction; every evaluation after training logs eval_overhead in (0, 1) and prints it."""
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4, 8])
    with caplog.at_level(logging.INFO):
        trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [cb], max_steps=4,
                         logger=CSVLogger(tmp_path / "logs"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DFlashEvalCallback")]
    assert lines[0].startswith("DFlashEvalCallback setup ") and "predicted at tau 1.00: periodic: ~" in lines[0]
    assert "full: ~" in lines[0] and "sha256 of" in lines[0]
    logged = read_csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv")
    # tau 1: every anchor is drafted with every depth read, whatever the profile
    assert logged[0]["predicted/full_gflop"] >= logged[0]["predicted/periodic_gflop"] > 0
    assert logged[0]["predicted/full_anchors"] >= logged[0]["predicted/periodic_anchors"] > 0
    assert logged[0]["setup_time_s"] > 0
    assert "eval_overhead" not in logged[0]  # the fit-start evaluation has no training before it
    for step in (2, 4):
        assert 0 < logged[step]["eval_overhead"] < 1
    assert "% of wall time)" in lines[-1]


def test_predicted_gflop_against_counted_flops(tiny_cache, tiny_drafter_config):
    """The prediction from the drafter's shape against torch's own FLOP counter over a real
    evaluation (tau ~ 1, untrained drafter): within 5%, for greedy only, a periodic and a full profile."""
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config).eval()
    cache = StateCache(tiny_cache)
    ids = select_sample_ids(cache)
    spec = drafter.spec
    shape = DrafterShape.of(drafter.config, spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size)
    samples = [(e.prompt_len, e.valid_len - e.prompt_len) for e in map(cache.entry, ids)]
    for budgets, stride in (((8,), spec.block_size), ((4, 8), 1), ((), spec.block_size)):
        with FlopCounterMode(display=False) as counter:
            report = evaluate(cache, drafter, budgets=budgets, anchor_stride=stride)
        predicted = evaluation_cost(shape, samples, report.tau, budgets, stride)
        # torch counts the matmuls (its CPU attention kernel is not counted): compare those.
        counted = counter.get_total_flops() / 1e9
        matmuls = predicted.gflop - predicted.attention_gflop
        assert abs(matmuls / counted - 1) < 0.05, (budgets, stride, predicted, counted)
        drafted = int(report.counts.data["anchors_drafted"].sum())
        assert abs(predicted.anchors / drafted - 1) < 0.05, (budgets, stride, predicted.anchors, drafted)
