"""Setup hashes each file once per process, and an evaluation's cost is predicted at setup and measured as it
runs (real Lightning Trainer, tiny drafter, CSV logger); after the first evaluation the next one's seconds are
predicted, and the prediction follows the work the evaluation counted (``benchmarks/eval_cost.py`` prints it
against CPU seconds: a test asserts no measured time)."""

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
from dflash_cb.core.costs.evaluation import (
    COST_GROUPS,
    DrafterShape,
    SecondsPredictor,
    draft_all_is_cheaper,
    evaluation_cost,
)
from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.figures.metrics import ddtree_tau
from dflash_cb.core.replay import evaluate


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
    """Setup prints one line (setup time, hashing, predicted light and full cost) and logs the
    prediction; every evaluation after training logs eval_overhead in (0, 1) and prints it."""
    cb = DFlashEvalCallback(states=tiny_cache, every_n_train_steps=2, ddtree_budgets=[4, 8])
    with caplog.at_level(logging.INFO):
        trainer, _ = fit(tmp_path, tiny_drafter_config, tiny_cache, [cb], max_steps=4,
                         logger=CSVLogger(tmp_path / "logs"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DFlashEvalCallback")]
    assert lines[0].startswith("DFlashEvalCallback setup ") and "predicted at tau 1.00: light: ~" in lines[0]
    assert "full: ~" in lines[0] and "sha256 of" in lines[0]
    logged = read_csv_metrics(Path(trainer.logger.log_dir) / "metrics.csv")
    # tau 1: every anchor is drafted with every depth read, whatever the profile
    assert logged[0]["predicted/full_gflop"] >= logged[0]["predicted/light_gflop"] > 0
    assert logged[0]["predicted/full_anchors"] >= logged[0]["predicted/light_anchors"] > 0
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


# -- the cost in seconds -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_toy(trained_tiny_drafter):
    """The tiny drafter after a few epochs: partial acceptance, so a light evaluation walks over many rounds."""
    return trained_tiny_drafter()


@pytest.fixture(scope="module")
def toy_evaluation(tiny_cache, trained_toy):
    """``evaluate(cache, trained_toy, **options)``, each set of options run once in this module: the sequences
    below repeat evaluations with the same options (as the live evaluator does), and an evaluation is a function
    of its inputs (the tests only read its report)."""
    cache, reports = StateCache(tiny_cache), {}

    def run(**options):
        key = tuple(sorted(options.items()))
        if key not in reports:
            reports[key] = evaluate(cache, trained_toy, **options)
        return reports[key]

    return run


# A machine unlike the reference one (``cost.REFERENCE_SECONDS``): its drafter 3x slower, its heaps twice as fast.
MACHINE_RATES = {"drafter": 3.0, "ddtree": 0.5, "other": 2.0}


def seconds_of_counted_work(shape, samples, report, budgets, stride, draft_all) -> dict[str, float]:
    """An evaluation's seconds per cost group on ``MACHINE_RATES``: the work it counted (anchors drafted, passes),
    priced by the cost model; what a clock would say on a machine whose seconds follow the work."""
    cost = evaluation_cost(shape, samples, report.tau, budgets, stride, draft_all=draft_all,
                           tree_taus={b: report.summary[ddtree_tau(b)] for b in budgets},
                           counted=(int(report.counts.data["anchors_drafted"].item()), report.passes))
    return {g: cost.reference(g) * MACHINE_RATES[g] for g in COST_GROUPS}


@pytest.mark.parametrize("rounds", [False, True], ids=["as decided", "in rounds"])
@pytest.mark.parametrize("budget", [None, 16, 64, 256, 1024])
def test_predicted_seconds_follow_the_counted_work(tiny_cache, trained_toy, toy_evaluation, budget, rounds):
    """The live evaluator's sequence on the toy: a warm-up sample gives the taus, then light evaluations
    (statistics every block-th anchor, the budget's tree) and full ones (stride 1). Each evaluation is
    predicted from those before it (``SecondsPredictor``): a profile measured before by its own calibration, the
    first full one from the last light one's rates against its counted work. The measured seconds are the
    evaluation's counted work priced on a machine unlike the reference one, so the prediction is held to the
    work counted, within 1.5x, for DDTree off and budgets 16 to 1024; the light evaluations as the cost model
    decides (drafting every anchor at once) and drafted in rounds. The anchors predicted from the cache's tau are
    the counted ones within 5%. ``benchmarks/eval_cost.py`` prints the same against CPU seconds."""
    cache = StateCache(tiny_cache)
    spec = trained_toy.spec
    budgets = () if budget is None else (budget,)
    shape = DrafterShape.of(trained_toy.config, spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size)
    everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
    longest = max(cache.samples, key=lambda e: e.valid_len - e.prompt_len).id
    warm = toy_evaluation(sample_ids=(longest,), budgets=budgets, anchor_stride=1)
    sequence = (("light", spec.block_size), ("light", spec.block_size), ("full", 1), ("full", 1),
                ("light", spec.block_size))
    tau, taus = warm.tau, {b: warm.summary[ddtree_tau(b)] for b in budgets}
    predictor, ratios, drafted = SecondsPredictor(shape, everything), {}, {}
    for i, (kind, stride) in enumerate(sequence):
        # The sequence as the evaluator runs it: each evaluation's tau decides the next one's draft_all.
        draft_all = not rounds and draft_all_is_cheaper(shape, everything, tau, budgets, stride, taus)
        predicted = predictor.predict(kind, budgets, stride, tau, taus, draft_all)
        expected = evaluation_cost(shape, everything, tau, budgets, stride, tree_taus=taus, draft_all=draft_all)
        report = toy_evaluation(budgets=budgets, anchor_stride=stride, draft_all=draft_all)
        groups = seconds_of_counted_work(shape, everything, report, budgets, stride, draft_all)
        if i:  # the first is predicted at the warm-up sample's tau, the others at the whole cache's
            ratios[f"{i} {kind}"] = predicted / sum(groups.values())
            drafted[f"{i} {kind}"] = (expected.anchors, int(report.counts.data["anchors_drafted"].item()))
        tau, taus = report.tau, {b: report.summary[ddtree_tau(b)] for b in budgets}
        predictor.measured(kind, groups, budgets, stride, tau, taus, draft_all,
                           (int(report.counts.data["anchors_drafted"].item()), report.passes))
    assert rounds or all(n == m for n, m in drafted.values())  # the model decided to draft every anchor
    assert all(abs(n / m - 1) < 0.05 for n, m in drafted.values()), drafted
    assert all(1 / 1.5 < r < 1.5 for r in ratios.values()), ratios


def test_predicted_seconds_are_logged_beside_the_measured_ones(tiny_cache, trained_toy):
    """From the second evaluation on, predicted/seconds (what the evaluations before it predicted) is logged
    and printed beside eval_time_s; the first evaluation's line says what its warm-up and the setup cost."""
    from dflash_cb import LiveEvaluator
    from dflash_cb.core.figures.metrics import EVAL_TIME, PREDICTED_SECONDS

    logged, lines = [], []
    ev = LiveEvaluator(str(tiny_cache), every_n_train_steps=1, ddtree_budgets=[4, 8], full_every_n_evals=3,
                       log=lambda m, s: logged.append((s, m)), say=lines.append)
    ev.start(0, trained_toy)
    for step in range(1, 5):
        ev.step(step, trained_toy)
    evals = [m for _, m in logged if "dflash_eval/" + EVAL_TIME in m]
    assert len(evals) == 5 and "dflash_eval/" + PREDICTED_SECONDS not in evals[0]
    for m in evals[1:]:
        assert m["dflash_eval/" + PREDICTED_SECONDS] > 0 and m["dflash_eval/" + EVAL_TIME] > 0
    shown = [line for line in lines if "step " in line]
    assert "first evaluation: " in shown[0] and "s of it warm-up; setup " in shown[0] and "predicted" not in shown[0]
    assert all(", predicted " in line and "first evaluation" not in line for line in shown[1:])
