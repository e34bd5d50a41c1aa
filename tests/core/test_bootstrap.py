"""Bootstrap intervals, position / cycle-index buckets and the results.json schema."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from replay_reference import replay_walk

from dflash_cb.core.figures.bootstrap import Sums, intervals, metric_sums, paired_difference
from dflash_cb.core.figures.positions import (
    anchor_positions,
    cycle_table,
    position_labels,
    position_table,
)
from dflash_cb.core.loop.cycles import SampleBounds
from dflash_cb.core.results.results_file import SampleRecord


def synthetic_sums(rng: np.random.Generator, n_samples: int, block: int = 8) -> Sums:
    """Samples with their own difficulty p ~ Beta(2, 2); longer completions for easier prompts
    (cycles = 50 + Binomial(100, p)); every cycle produces 1 + Binomial(block - 1, p).

    True tau = E[n (1 + (block-1) p)] / E[n] with E[n] = 100, E[n p] = 50 E[p] + 100 E[p^2] = 25 + 30.
    """
    p = rng.beta(2.0, 2.0, n_samples)
    n = 50 + rng.binomial(100, p)
    produced = n + rng.binomial(n * (block - 1), p)  # a sum of Binomial(block-1, p) over n cycles
    return Sums.of(produced, n)


TRUE_TAU = (100 + 7 * 55) / 100


def test_interval_covers_the_true_tau_in_90_to_99_percent_of_replicates():
    rng = np.random.default_rng(2026)
    covered = 0
    for r in range(200):
        iv = intervals({"tau": synthetic_sums(rng, 66)}, n_resamples=1000, seed=r)["tau"]
        covered += iv.low <= TRUE_TAU <= iv.high
    assert 180 <= covered <= 198, covered  # 90-99% of 200


def test_cycle_level_resampling_would_be_too_narrow():
    """Why samples are the resampling unit: the interval reflects between-prompt variation."""
    rng = np.random.default_rng(5)
    s = synthetic_sums(rng, 66)
    iv = intervals({"tau": s})["tau"]
    # Binomial-only (independent cycles) standard error of the mean produced per cycle:
    per_cycle_se = math.sqrt(7 * 0.25 / s.cycles.sum())
    assert (iv.high - iv.low) > 5 * (2 * 1.96 * per_cycle_se)
    assert iv.low < iv.value < iv.high and iv.value == pytest.approx(s.produced.sum() / s.cycles.sum())


def test_paired_interval_of_a_drafter_against_itself_is_zero():
    s = synthetic_sums(np.random.default_rng(1), 40)
    d = paired_difference(s, s)
    assert (d.value, d.low, d.high) == (0.0, 0.0, 0.0)


def test_paired_interval_is_narrower_than_the_separate_ones_and_finds_a_small_gain():
    rng = np.random.default_rng(3)
    a = synthetic_sums(rng, 66)
    # B: every cycle of every sample commits 1 more token with probability 0.1 (tau + 0.1).
    b = Sums.of(a.produced + rng.binomial(a.cycles.astype(int), 0.1), a.cycles)
    d = paired_difference(a, b)
    ia, ib = intervals({"a": a})["a"], intervals({"b": b})["b"]
    assert d.low > 0 and d.excludes_zero()
    assert ia.high > ib.low  # separately the intervals overlap: only pairing sees the gain
    assert (d.high - d.low) < 0.25 * (ia.high - ia.low)


def test_same_resamples_for_every_metric_and_nan_for_empty_metrics():
    samples = [SampleRecord("a", "x", [1, 2, 3], {4: [2, 2]}), SampleRecord("b", "y", [1, 1], {4: [3]})]
    sums = metric_sums(samples, [4], ["x", "y", "z"])
    ivs = intervals(sums, n_resamples=200)
    assert ivs["tau"].value == pytest.approx(8 / 5)
    assert ivs["ddtree/tau_b4"].value == pytest.approx(7 / 3)
    assert ivs["category/x/tau"].value == pytest.approx(2.0) and ivs["category/y/tau"].value == 1.0
    assert math.isnan(ivs["category/z/tau"].value) and math.isnan(ivs["category/z/tau"].low)
    with pytest.raises(ValueError, match="one entry per sample"):
        intervals({"a": Sums.of([1], [1]), "b": Sums.of([1, 2], [1, 1])})


# -- positions ---------------------------------------------------------------------------------

def test_anchor_positions_follow_the_replay_walk():
    """Cycle i anchors at prompt_len + sum(produced of earlier cycles): checked against replay_walk,
    whose per-anchor ``produced`` here encodes the anchor it was read at."""
    prompt_len, end = 7, 80
    produced = [1 + (p % 5) for p in range(prompt_len, end)]  # produced at anchor p depends on p
    tokens = list(range(100))
    lengths = replay_walk(produced, tokens, SampleBounds(prompt_len, end, 100), [])
    anchors = prompt_len + anchor_positions(lengths)
    assert len(lengths) > 10
    assert lengths == [1 + (int(p) % 5) for p in anchors]


def _random_samples(rng: np.random.Generator, n: int) -> list[SampleRecord]:
    return [SampleRecord(f"s{i}", ["a", "b"][i % 2], rng.integers(1, 9, rng.integers(0, 400)).tolist())
            for i in range(n)]


def test_position_and_cycle_buckets_partition_the_cycles():
    rng = np.random.default_rng(0)
    samples = _random_samples(rng, 30)
    cycles = sum(len(s.acceptance_lengths) for s in samples)
    tau = sum(sum(s.acceptance_lengths) for s in samples) / cycles
    for table in (position_table(samples, (0, 64, 256, 512), ["a", "b"]), cycle_table(samples, 5, ["a", "b"])):
        assert sum(r["cycles"] for r in table.values()) == cycles
        assert sum(r["tau"] * r["cycles"] for r in table.values() if r["cycles"]) / cycles == pytest.approx(tau)
        for c in ("a", "b"):
            assert sum(r["categories"][c]["cycles"] for r in table.values()) == sum(
                len(s.acceptance_lengths) for s in samples if s.category == c)
    pos = position_table(samples, (0, 64, 256, 512))
    assert list(pos) == ["0_64", "64_256", "256_512", "512_end"]
    # The first cycle of every non-empty sample is cycle bucket 0 and sits at completion position 0.
    first = cycle_table(samples)["0"]
    nonempty = [s for s in samples if s.acceptance_lengths]
    assert first["cycles"] == len(nonempty)
    assert first["tau"] == pytest.approx(np.mean([s.acceptance_lengths[0] for s in nonempty]))
    assert position_labels((0, 256, 512, 1024, 2048))[-1] == "2048_end"
    with pytest.raises(ValueError, match="start at 0"):
        position_labels((10, 20))


# -- results.json ------------------------------------------------------------------------------

def test_results_schema_round_trip_partition_and_refusals(tmp_path, tiny_cache, tiny_drafter_config):
    import torch

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.results_file import (
        ResultsError,
        load_results,
        report_to_results,
        write_results,
    )

    torch.manual_seed(0)
    cache = StateCache(tiny_cache)
    report = evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(), budgets=[4], anchor_stride=3,
                      anchor_seed=5)
    res = report_to_results(report, cache, meta={"drafter": {"path": "x", "kind": "folder", "global_step": None}},
                            position_edges=(0, 4, 8, 16))
    path = tmp_path / "r.json"
    write_results(res, path)
    back = load_results(path, cache)
    assert back.to_dict() == json.loads(path.read_text())
    raw = json.loads(path.read_text())
    assert raw["version"] == 5 and "tau" not in raw  # every scalar once, under metrics
    assert raw["meta"]["drafter_family"] == "dflash" == back.family
    assert back.tau == pytest.approx(report.tau)
    for name in ("tau", "ddtree/tau_b4", "specforge/acc", "acceptance/depth_01", "all_anchor_tau"):
        assert back.metric(name + "_ci_low") <= back.metric(name) <= back.metric(name + "_ci_high"), name
    # Each sample's offset and integer counts at the stride, with the seed: enough to rebuild the figures.
    assert raw["meta"]["anchor_stride"] == 3 and raw["meta"]["anchor_seed"] == 5
    assert [s.anchor_offsets for s in back.samples] == [s.anchor_offsets for s in report.samples]
    assert [s.anchor_counts for s in back.samples] == [s.anchor_counts for s in report.samples]
    assert {s.anchor_offsets[3] for s in back.samples} != {0}  # not every sample starts at its first anchor
    # Version 4 files (no family: a DFlash drafter's) are read as they were.
    v4 = {**raw, "version": 4, "meta": {k: v for k, v in raw["meta"].items() if k != "drafter_family"}}
    (tmp_path / "v4.json").write_text(json.dumps(v4))
    old4 = load_results(tmp_path / "v4.json", cache)
    assert old4.family == "dflash" and old4.metrics == back.metrics and old4.samples == back.samples
    # Version 3 files (no anchor statistics) are still read; their anchor figures have no interval then.
    v3 = {**raw, "version": 3, "samples": [{k: v for k, v in x.items() if k != "anchor_statistics"}
                                           for x in raw["samples"]]}
    (tmp_path / "v3.json").write_text(json.dumps(v3))
    old3 = load_results(tmp_path / "v3.json", cache)
    assert old3.tau == back.tau and all(not s.anchor_counts for s in old3.samples)
    bad = json.loads(json.dumps(raw))
    bad["samples"][0]["anchor_statistics"]["3"]["offset"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ResultsError, match=r"offset 3 is not an integer in \[0, 3\)"):
        load_results(tmp_path / "bad.json")
    # The buckets partition the cycles of a real evaluation.
    cycles = back.metric("cycles")
    for kind, labels in (("position", ["0_4", "4_8", "8_16", "16_end"]), ("cycle", ["0", "1", "2", "3", "4plus"])):
        rows = [back.breakdown[kind][b] for b in labels]
        assert sum(r["cycles"] for r in rows) == cycles
        assert sum(back.metric(f"{kind}/{b}/cycles") for b in labels) == cycles
        assert sum((r["tau"] or 0) * r["cycles"] for r in rows) / cycles == pytest.approx(back.tau)

    # The development formats before version 3 are refused with the command that writes the file again.
    (tmp_path / "v1.json").write_text(json.dumps({**raw, "version": 1}))
    with pytest.raises(ResultsError, match="results version 1, a development format .* rerun tools/eval_drafter.py"):
        load_results(tmp_path / "v1.json", cache)
    (tmp_path / "v9.json").write_text(json.dumps({**raw, "version": 9}))
    with pytest.raises(ResultsError, match="version 9 is not known"):
        load_results(tmp_path / "v9.json")
    (tmp_path / "other.json").write_text(json.dumps({**raw, "meta": {**raw["meta"], "cache_manifest_sha256": "f" * 64,
                                                                       "cache_content_sha256": "f" * 64}}))
    with pytest.raises(ResultsError, match=r"ffffffffffff.*not comparable: rerun python tools/eval_drafter.py .* --drafter "):
        load_results(tmp_path / "other.json", cache)
    with pytest.raises(ResultsError, match="no such results file"):
        load_results(tmp_path / "missing.json")


def test_anchor_statistics_get_intervals_from_per_sample_counts():
    """specforge/acc, acceptance/depth_KK and all_anchor_tau of a stride are ratios of per-sample sums: the
    value is the pooled ratio and the interval comes from resampling samples (offsets included)."""
    from dflash_cb.core.figures.bootstrap import (
        DEFAULT_LEVEL,
        DEFAULT_RESAMPLES,
        DEFAULT_SEED,
        anchor_sums,
        interval_keys,
    )
    from dflash_cb.core.figures.derived import live_metrics
    from dflash_cb.core.figures.metrics import (
        ALL_ANCHOR_TAU,
        SPECFORGE_ACC,
        AnchorCounts,
        ci_high,
        ci_low,
        depth_acc,
    )

    rng = np.random.default_rng(3)
    samples = []
    for i in range(40):
        n = int(rng.integers(2, 9))
        total = [n, n - 1]
        match = [int(rng.integers(0, t + 1)) for t in total]
        c = AnchorCounts(n, int(rng.integers(n, 3 * n)), tuple(total), tuple(match), (0, 0), (0, 0), tuple(total),
                         tuple(match), 0.0, 0)
        samples.append(SampleRecord(f"s{i}", "c", [2, 1], {}, {4: i % 4}, {4: c}))
    sums = metric_sums(samples, anchor_stride=4)
    counts = [s.anchor_counts[4] for s in samples]
    assert sums[SPECFORGE_ACC].value == sum(sum(c.specforge_match) for c in counts) / sum(
        sum(c.specforge_total) for c in counts)
    assert sums[ALL_ANCHOR_TAU].value == sum(c.anchor_produced for c in counts) / sum(c.anchors for c in counts)
    assert sums[depth_acc(2)].value == sum(c.depth_match[1] for c in counts) / sum(c.depth_total[1] for c in counts)
    assert SPECFORGE_ACC not in metric_sums(samples) and SPECFORGE_ACC not in metric_sums(samples, anchor_stride=8)
    live = live_metrics(samples, (), ["c"], anchor_stride=4)
    for name in (SPECFORGE_ACC, ALL_ANCHOR_TAU, depth_acc(1), depth_acc(2)):
        assert live[ci_low(name)] < sums[name].value < live[ci_high(name)], name
    assert live_metrics(samples, (), ["c"]) == live  # the one stride the samples have: the callback's call today
    # The anchor statistics' intervals alone: the same resamples (they depend on the seed alone), the same ends.
    alone = interval_keys(anchor_sums(samples, 4), DEFAULT_RESAMPLES, DEFAULT_SEED, DEFAULT_LEVEL)
    assert alone and alone == {k: v for k, v in live.items() if k in alone}  # same resamples, same ends


def test_the_default_position_buckets_fit_short_completions(tiny_cache, tiny_drafter_config):
    """On completions far shorter than the default edges (0, 256, ... 2048) one bucket held every cycle: a single
    point. The default edges are halved until at least three buckets start within the longest completion, the
    same for every drafter on the samples; results.json records the edges used, the callback's default
    (``DEFAULT_POSITION_EDGES``) gets them, each bucket carries its cycle count, and edges a user gives are
    kept as given."""
    import torch

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.figures.derived import live_metrics
    from dflash_cb.core.figures.metrics import position_cycles
    from dflash_cb.core.figures.positions import DEFAULT_POSITION_EDGES, completion_extent, fitted_edges
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.results_file import report_to_results

    cache = StateCache(tiny_cache)
    torch.manual_seed(0)
    report = evaluate(cache, DFlashDrafter.from_config_dict(tiny_drafter_config).eval(), budgets=[])
    extent = completion_extent(report.samples)
    assert 8 < extent < 32  # the tiny cache: 24 new tokens
    res = report_to_results(report, cache)  # the tool's default edges
    table = res.breakdown["position"]
    assert list(table) == ["0_8", "8_16", "16_32"] and res.breakdown["position_edges"] == [0, 8, 16, 32, 64]
    assert sum(r["cycles"] for r in table.values()) == sum(len(s.acceptance_lengths) for s in report.samples)
    assert all(r["cycles"] > 0 for r in table.values())
    live = live_metrics(report.samples, [], [], position_edges=DEFAULT_POSITION_EDGES, n_resamples=20)
    assert {k for k in live if k.startswith("position/")} == {
        f"position/{b}/{x}" for b in table for x in ("tau", "cycles")}
    assert all(live[position_cycles(b)] == r["cycles"] for b, r in table.items())
    # Long completions keep the default; edges given are never changed.
    assert fitted_edges(DEFAULT_POSITION_EDGES, 2000) == DEFAULT_POSITION_EDGES
    assert fitted_edges(DEFAULT_POSITION_EDGES, 600) == DEFAULT_POSITION_EDGES  # 0, 256, 512: three buckets
    assert fitted_edges(DEFAULT_POSITION_EDGES, 3) == (0, 1, 2, 4, 8)
    assert fitted_edges((0, 256), 20) == (0, 256)
    assert list(report_to_results(report, cache, position_edges=(0, 256)).breakdown["position"]) == ["0_256"]


def test_intervals_are_the_gathered_resample_sums_to_the_last_bit():
    """Every resample's sums, taken as written in the module docstring (gather the drawn samples, add them): the
    intervals of counts (whole numbers, summed another way for speed) and of per-request means (fractions) are
    exactly theirs, and so is a paired difference."""
    from dflash_cb.core.figures.bootstrap import resample_indices

    rng = np.random.default_rng(7)
    counts = Sums.of(rng.integers(0, 900, 57).astype(float), rng.integers(0, 300, 57).astype(float))
    means = Sums.of(rng.random(57) * 5, (rng.random(57) > 0.2).astype(float))
    idx = resample_indices(57, 400, 3)

    def gathered(s: Sums) -> np.ndarray:
        num, den = s.produced[idx].sum(axis=1), s.cycles[idx].sum(axis=1)
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)

    a = (1.0 - 0.95) / 2.0  # the 95% interval's ends, as the module computes them
    got = intervals({"counts": counts, "means": means}, n_resamples=400, seed=3)
    for name, s in (("counts", counts), ("means", means)):
        lo, hi = np.quantile(gathered(s)[np.isfinite(gathered(s))], [a, 1.0 - a])
        assert (got[name].low, got[name].high) == (float(lo), float(hi)), name
    lo, hi = np.quantile(gathered(means) - gathered(counts), [a, 1.0 - a])
    diff = paired_difference(counts, means, n_resamples=400, seed=3)
    assert (diff.low, diff.high) == (float(lo), float(hi))
