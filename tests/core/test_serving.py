"""The serving projection (dflash_cb/core/costs/serving.py): a hand computation on known cycles, the identities any
correct projection satisfies, the best setting on planted profiles, refusals; the profile tool measuring the
tiny CPU models for real (counted work, never a time) and resuming; eval_drafter --profile end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_cb.common.arguments import ArgumentError
from dflash_cb.core.costs.serving import (
    CostProfile,
    ProfileError,
    SampleCycles,
    Setting,
    block_settings,
    identity_mismatches,
    project,
    sample_seconds,
)
from dflash_cb.integrations.evaluator.projection import read_profile


def flat(seconds: float, draft: float, top: int = 64) -> CostProfile:
    return CostProfile("user", {0: ((1, seconds), (top, seconds))}, {0: draft})


SAMPLES = [SampleCycles(10, {"greedy": [3, 1, 2], "ddtree_b4": [4, 2]}),
           SampleCycles(5, {"greedy": [1, 1, 1, 1, 1, 1, 1], "ddtree_b4": [2, 3, 2]}),  # a hard prompt: a long tail
           SampleCycles(7, {"greedy": [4, 4, 4, 1], "ddtree_b4": [5, 5, 3]})]


def test_a_hand_computed_projection() -> None:
    """Verify cost linear between rows and in the context; each cycle priced at its own anchor's position."""
    profile = CostProfile("user", {0: ((1, 1.0), (4, 2.0)), 100: ((1, 2.0), (4, 4.0))}, {0: 0.5, 100: 1.5})
    greedy = Setting("greedy", 4, 1, "block 4")
    tokens, spec, plain = sample_seconds(SampleCycles(10, {"greedy": [3, 1, 2]}), greedy, profile)
    # Cycles anchored at 10, 13, 14: draft 0.5 + c/100, verify(4) 2 + 2c/100; plain: tokens at 10..15, 1 + c/100.
    want_spec = sum(0.5 + c / 100 + 2 + 2 * c / 100 for c in (10, 13, 14))
    want_plain = sum(1 + c / 100 for c in range(10, 16))
    assert tokens == 6 and spec == pytest.approx(want_spec, rel=1e-12) and plain == pytest.approx(want_plain, rel=1e-12)
    assert profile.verify_seconds(3, 0) == pytest.approx(1 + 2 / 3)  # between rows
    p = project([SampleCycles(10, {"greedy": [3, 1, 2]})], [greedy], profile)
    s = p.settings[0]
    assert s.speedup.value == pytest.approx(want_plain / want_spec) and s.tau == 2.0
    assert s.tokens_per_second.value == pytest.approx(6 / want_spec)
    # Break-even at the cycles' mean context (12): (draft + verify(4)) / verify(1).
    assert s.breakeven_tau == pytest.approx((0.5 + 0.12 + 2 + 0.24) / 1.12)


def test_flat_verify_and_free_drafting_project_the_pooled_tau() -> None:
    """A verify step that costs the same at any token count and free drafting: the speedup is each setting's pooled
    tau (tokens / cycles); drafting as costly as a verify step halves it."""
    settings = block_settings(6, (4,))
    for draft, factor in ((0.0, 1.0), (0.02, 0.5)):
        p = project(SAMPLES, settings, flat(0.02, draft))
        for s in p.settings:
            tokens = sum(sum(x.produced[s.setting.name]) for x in SAMPLES)
            cycles = sum(len(x.produced[s.setting.name]) for x in SAMPLES)
            assert s.speedup.value == pytest.approx(factor * tokens / cycles, rel=1e-12)
            assert s.speedup.low <= s.speedup.value <= s.speedup.high
            assert s.breakeven_tau == pytest.approx(1 / factor)


def test_the_per_cycle_overhead_enters_as_the_identities_say() -> None:
    """Flat verify, free drafting: no overhead projects each setting's pooled tau; an overhead of one verify step per
    cycle of its kind is priced as one more verify step (the speedup halves), and a kind's overhead touches only the
    settings of that kind; the break-even tau counts it; a profile written with it reads back with it."""
    settings = block_settings(6, (4,))
    none = project(SAMPLES, settings, flat(0.02, 0.0))
    with_block = replace(flat(0.02, 0.0), overhead={"block": 0.02})
    both = replace(flat(0.02, 0.0), overhead={"block": 0.02, "ddtree": 0.02})
    for p_none, p_block, p_both in zip(none.settings, project(SAMPLES, settings, with_block).settings,
                                       project(SAMPLES, settings, both).settings, strict=True):
        pooled = sum(sum(x.produced[p_none.setting.name]) for x in SAMPLES) / sum(
            len(x.produced[p_none.setting.name]) for x in SAMPLES)
        assert p_none.speedup.value == pytest.approx(pooled, rel=1e-12)
        assert p_both.speedup.value == pytest.approx(pooled / 2, rel=1e-12)
        assert p_both.breakeven_tau == pytest.approx(2 * p_none.breakeven_tau, rel=1e-12)
        want = pooled / 2 if p_none.setting.kind == "block" else pooled
        assert p_block.speedup.value == pytest.approx(want, rel=1e-12), p_none.setting.name
    assert [s.kind for s in settings] == ["block", "ddtree"]
    back = CostProfile.from_dict(json.loads(json.dumps(both.to_dict())))
    assert back.overhead == {"block": 0.02, "ddtree": 0.02} and "per-cycle overhead" in back.label()
    with pytest.raises(ProfileError, match="overhead 'tree'"):
        replace(flat(0.02, 0.0), overhead={"tree": 0.01})
    with pytest.raises(ProfileError, match="overhead 'block'"):
        replace(flat(0.02, 0.0), overhead={"block": -1.0})


def test_a_measured_profiles_own_noise_widens_the_interval() -> None:
    """A profile that keeps its rows' repeats: repeats that agree leave the interval over prompts as it is; repeats
    that spread widen it, the point estimate (the rows' medians) unchanged; the repeats survive the file."""
    settings = block_settings(6, (4,))
    base = CostProfile("measured", {0: ((1, 0.02), (5, 0.03), (64, 0.04))}, {0: 0.005})
    steady = replace(base, repeats={0: ((1, (0.02,) * 5), (5, (0.03,) * 5), (64, (0.04,) * 5))})
    noisy = replace(base, repeats={0: ((1, (0.012, 0.02, 0.02, 0.03, 0.035)), (5, (0.02, 0.03, 0.03, 0.03, 0.05)),
                                       (64, (0.04,) * 5))})
    plain, same, wide = (project(SAMPLES, settings, x) for x in (base, steady, noisy))
    for a, b, c in zip(plain.settings, same.settings, wide.settings, strict=True):
        assert (a.speedup.low, a.speedup.high) == pytest.approx((b.speedup.low, b.speedup.high), rel=1e-12)
        assert c.speedup.value == pytest.approx(a.speedup.value, rel=1e-12)
        assert c.speedup.high - c.speedup.low > a.speedup.high - a.speedup.low
        assert c.speedup.low <= a.speedup.low and c.speedup.high >= a.speedup.high
    assert CostProfile.from_dict(json.loads(json.dumps(noisy.to_dict()))).repeats == noisy.repeats


def test_a_version_1_profile_still_reads() -> None:
    """Profiles written before the overhead, the spread and the flags read as profiles without them."""
    old = {k: v for k, v in flat(0.02, 0.001).to_dict().items() if k not in ("overhead", "spread", "flags")}
    old["version"] = 1
    back = CostProfile.from_dict(old)
    assert back.overhead == {} and back.flags == () and back.verify == flat(0.02, 0.001).verify


def test_a_planted_unstable_row_is_flagged() -> None:
    """Rows that break monotonicity beyond the stated tolerance, or whose repeats spread too wide, are named with
    the reason; steady monotone rows and noise within the tolerance are not."""
    from dflash_cb.core.costs.serving import MONOTONE_TOLERANCE, suspicious_rows

    steady = {1: [1.0, 1.01, 0.99], 2: [1.05, 1.06, 1.04], 4: [1.1, 1.12, 1.11], 8: [1.3, 1.31, 1.29]}
    assert suspicious_rows(steady) == {}
    noisy = {**steady, 4: [1.0, 1.01, 1.0]}  # 4 tokens a hair below 2 tokens: within the tolerance
    assert suspicious_rows(noisy) == {}
    planted = {**steady, 2: [5.0, 5.1, 4.9]}  # a preemption moved a whole row
    flagged = suspicious_rows(planted)
    assert set(flagged) == {2, 4, 8} and f"by more than {MONOTONE_TOLERANCE:.0%}" in flagged[4]
    spread = {**steady, 8: [1.3, 3.0, 1.31]}
    assert list(suspicious_rows(spread)) == [8] and "spread" in suspicious_rows(spread)[8]


def test_a_profile_measured_beside_a_planted_preemption_flags_it(tiny_cache, drafter_dir, tmp_path) -> None:
    """On the real tiny target: a clock that turns every timing of the 3-token verify row into a long pause (a
    process sharing the core) makes that row non-monotone; the row is measured again (more calls than the other
    rows), then flagged in the written profile, and its spread recorded per row. Counted work, no real time."""
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    calls: dict[object, int] = {}

    class Planted(profile_cli.StepClock):
        def once(self, fn, prepare=lambda: None):
            n = (getattr(fn, "__defaults__", None) or (None,))[0]
            calls[n] = calls.get(n, 0) + 1
            real = super().once(fn, prepare)
            return real + 1.0 if n == 3 else real

    real_clock = profile_cli.StepClock
    profile_cli.StepClock = Planted
    try:
        out = tmp_path / "p.json"
        assert profile_cli.main(["--target", str(tiny_cache.parent / "target"), "--drafter", str(drafter_dir),
                                 "--out", str(out), "--dtype", "float32", "--contexts", "12", "--tokens", "1-6",
                                 "--repeats", "3"]) == 0
    finally:
        profile_cli.StepClock = real_clock
    prof = read_profile(out)
    assert any("context 12: 3 tokens" in f or "than 3 tokens" in f for f in prof.flags), prof.flags
    assert "unstable row(s) flagged" in prof.label()
    assert calls[3] == 1 + 3 + 3 and calls[1] >= 1 + 3  # warm-up, repeats, measured again
    assert [n for n, _ in prof.spread[12]] == list(range(1, 7)) and all(x >= 0 for _, x in prof.spread[12])


def test_the_best_setting_follows_the_profile() -> None:
    """The same cycles: a verify step that costs little more for 5 tokens than for 6 makes the DDTree best (it
    commits more a cycle); one that grows steeply with the tokens makes the greedy block best."""
    settings = block_settings(4, (4,))  # greedy verifies 4 tokens, the DDTree 5
    gentle = CostProfile("user", {0: ((1, 1.0), (4, 1.1), (5, 1.12))}, {0: 0.1})
    steep = CostProfile("user", {0: ((1, 1.0), (4, 1.1), (5, 3.0))}, {0: 0.1})
    assert project(SAMPLES, settings, gentle).best.setting.name == "ddtree_b4"
    assert project(SAMPLES, settings, steep).best.setting.name == "greedy"
    second, diff = project(SAMPLES, settings, gentle).runner_up_difference()
    assert second.setting.name == "greedy" and diff.value > 0


def test_per_cycle_accounting_is_not_the_mean_tau() -> None:
    """Where the verify cost grows with the context, a sample's long cycles late in a completion are priced at
    that context: the projection differs from pricing the mean tau at the mean context."""
    profile = CostProfile("user", {0: ((1, 1.0), (8, 1.0)), 1000: ((1, 11.0), (8, 11.0))}, {0: 0.0})
    early = SampleCycles(0, {"greedy": [8] * 5 + [1] * 200})
    p = project([early], [Setting("greedy", 8, 1, "block 8")], profile).settings[0]

    def cost(c: int) -> float:
        return 1 + 10 * min(c, 1000) / 1000

    starts = [8 * i for i in range(5)] + [40 + i for i in range(200)]
    hand = sum(cost(c) for c in range(240)) / sum(cost(c) for c in starts)
    assert p.speedup.value == pytest.approx(hand, rel=1e-12)
    assert p.speedup.value < p.tau - 0.05  # the mean tau at one context would say tau (1.17): the long cycles are cheap ones


def test_refusals() -> None:
    with pytest.raises(ProfileError, match="beyond the profile's rows"):
        project(SAMPLES, block_settings(16), flat(1.0, 0.0, top=8))
    with pytest.raises(ProfileError, match="increasing order"):
        CostProfile("user", {0: ((4, 1.0), (2, 1.0))}, {0: 0.0})
    with pytest.raises(ProfileError, match="kind"):
        CostProfile("guess", {0: ((1, 1.0),)}, {0: 0.0})  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="not a dflash-cb cost profile"):
        CostProfile.from_dict({"format": "x"})
    p = CostProfile("measured", {0: ((1, 1.0),)}, {0: 0.0}, target={"hidden_size": 64, "vocab_size": 10},
                    drafter={"block_size": 16})
    wrong, other = identity_mismatches(p, {"hidden_size": 32, "vocab_size": 10}, {"block_size": 8})
    assert wrong == ["hidden_size: profile 64, here 32"] and other == ["block_size: profile 16, here 8"]
    back = CostProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p


# -- the tool, for real ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafter_dir(tiny_cache: Path, tiny_drafter_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("serving") / "drafter"
    DFlashDrafter.from_config_dict(tiny_drafter_config).save_pretrained(out)
    return out


def test_a_profile_measured_on_the_tiny_models_and_resumed(tiny_cache, drafter_dir, tmp_path, monkeypatch) -> None:
    """Every (context, tokens) point measured once, with the drafter's pass per context; a run stopped after its
    first context resumes with the second alone; the finished file is never overwritten."""
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    target = tiny_cache.parent / "target"
    measured: list[int] = []
    real = profile_cli.measure_context

    def counted(*a, **k):
        measured.append(a[3])
        return real(*a, **k)

    monkeypatch.setattr(profile_cli, "measure_context", counted)
    out = tmp_path / "p.json"
    args = ["--target", str(target), "--drafter", str(drafter_dir), "--out", str(out), "--dtype", "float32",
            "--contexts", "8,20", "--tokens", "1-6", "--repeats", "1"]

    def stop_after_first(*a, **k):  # Ctrl-C as the second context starts
        if measured:
            raise KeyboardInterrupt
        return counted(*a, **k)

    monkeypatch.setattr(profile_cli, "measure_context", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        profile_cli.main(args)
    partial = json.loads(out.read_text())
    assert partial["partial"] and list(partial["verify"]) == ["8"]
    monkeypatch.setattr(profile_cli, "measure_context", counted)
    assert profile_cli.main(args) == 0
    assert measured == [8, 20]  # the second run measured only what was missing
    prof = read_profile(out)
    assert prof.kind == "measured" and sorted(prof.verify) == [8, 20] and prof.max_verified == 6
    assert all([n for n, _ in rows] == list(range(1, 7)) and all(s > 0 for _, s in rows) for rows in prof.verify.values())
    assert all(s > 0 for s in prof.draft.values()) and prof.drafter["block_size"] == 6
    assert prof.target["hidden_size"] == json.loads((target / "config.json").read_text())["hidden_size"]
    with pytest.raises(ArgumentError, match="exists"):
        profile_cli.main(args)


def test_eval_drafter_projects_with_a_profile(tiny_cache, drafter_dir, tmp_path) -> None:
    """--profile: the projection in results.json beside tau, labelled; a flat profile with free drafting
    projects each setting's pooled tau through the whole tool; a profile of another target or too few rows is
    refused before any scoring."""
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    csv = tmp_path / "verify.csv"
    csv.write_text("verified_tokens,seconds\n1,0.02\n16,0.02\n")
    prof = tmp_path / "flat.json"
    assert profile_cli.main(["--from-csv", str(csv), "--draft-seconds", "0", "--states", str(tiny_cache),
                             "--out", str(prof)]) == 0
    out = tmp_path / "r.json"
    assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(out),
                          "--ddtree-budgets", "4,8", "--profile", str(prof), "--device", "cpu"]) == 0
    res = load_results(out)
    assert res.metrics["serving/speedup_greedy"] == pytest.approx(res.metrics["tau"], rel=1e-12)
    assert res.metrics["serving/speedup_ddtree_b8"] == pytest.approx(res.metrics["ddtree/tau_b8"], rel=1e-12)
    label = res.breakdown["serving"]["profile"]  # what the projection rests on, each part said once
    assert label.startswith("user's own measurement (") and label.endswith(f"): --from-csv {csv}"), label
    assert label.count("measurement") == 1
    assert "projection" in res.notes["serving"]
    few = tmp_path / "few.csv"
    few.write_text("verified_tokens,seconds\n1,0.02\n6,0.03\n")
    short = tmp_path / "short.json"
    assert profile_cli.main(["--from-csv", str(few), "--draft-seconds", "0", "--out", str(short)]) == 0
    # A CSV too short for a budget: the fix is the user's own file, rows up to the tokens that budget verifies.
    with pytest.raises(ArgumentError, match=f"DDTree 8 verifies 9 tokens.*add rows up to 9 verified tokens to your "
                                            f"CSV \\({few}\\)"):
        eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(tmp_path / "x.json"),
                       "--ddtree-budgets", "4,8", "--profile", str(short)])
    other = json.loads(prof.read_text())
    other["target"]["hidden_size"] = 4096
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ArgumentError, match="another target"):
        eval_cli.main(["--states", str(tiny_cache), "--drafter", str(drafter_dir), "--out", str(tmp_path / "y.json"),
                       "--profile", str(tmp_path / "other.json")])
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "y.json").exists()
    assert math.isfinite(res.metrics["serving/breakeven_tau_greedy"])


def test_a_roofline_profile_is_labelled_with_the_stated_numbers(tiny_cache, drafter_dir, tmp_path) -> None:
    """No target run: bytes over the stated bandwidth, FLOPs over the stated peak; memory-bound steps at few
    tokens cost the same, compute-bound ones grow with them; the label says what was stated."""
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    out = tmp_path / "roof.json"
    assert profile_cli.main(["--roofline", "--bandwidth-gbs", "100", "--peak-tflops", "0.8", "--target",
                             str(tiny_cache.parent / "target"), "--drafter", str(drafter_dir), "--contexts", "16,64",
                             "--tokens", "1-32", "--out", str(out)]) == 0
    p = read_profile(out)
    assert p.kind == "roofline" and "100 GB/s" in p.label() and "0.8 TFLOP/s" in p.label()
    rows = dict(p.verify[16])
    assert rows[1] == rows[2] < rows[32]  # bytes bound at one and two tokens, FLOPs bound at 32
    assert p.verify_seconds(1, 64) >= p.verify_seconds(1, 16) and p.draft[16] > 0
    with pytest.raises(ArgumentError, match="--bandwidth-gbs"):
        profile_cli.main(["--roofline", "--target", str(tiny_cache.parent / "target"), "--out", str(tmp_path / "x")])


def test_serve_plan_across_drafters(tiny_cache, trained_tiny_drafter, drafter_dir, tmp_path, monkeypatch) -> None:
    """Two drafters scored with one profile on one cache: each one's settings, the best drafter at its best setting
    against the other paired, per category, a PNG whose every point is named by its setting; a file without a
    projection, or with another profile, refused."""
    from drawn import overlapping, saved_figures

    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.cli import profile_costs as profile_cli
    from dflash_cb.integrations.cli import serve_plan as serve_plan_cli

    trained = tmp_path / "trained"
    trained_tiny_drafter().save_pretrained(trained)
    (tmp_path / "v.csv").write_text("verified_tokens,seconds\n1,0.02\n9,0.022\n")
    prof = tmp_path / "p.json"
    assert profile_cli.main(["--from-csv", str(tmp_path / "v.csv"), "--draft-seconds", "0.004", "--out", str(prof)]) == 0
    files = {}
    for name, d in (("untrained", drafter_dir), ("trained", trained)):
        files[name] = tmp_path / f"{name}.json"
        assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(d), "--out", str(files[name]),
                              "--ddtree-budgets", "8", "--profile", str(prof)]) == 0
    out = tmp_path / "plan"
    figures = saved_figures(monkeypatch)
    assert serve_plan_cli.main([str(files["untrained"]), str(files["trained"]), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    (ax,) = figures[0].axes
    names = list(ax.texts)
    assert sorted(t.get_text() for t in names) == ["DDTree 8", "DDTree 8", "block 6", "block 6"]
    assert not overlapping(names, figures[0])
    assert "| untrained | block 6" in md and "| trained | DDTree 8" in md and "per category" in md
    assert "**Serve trained at" in md and "trained is faster" in md  # the trained drafter is the faster one
    assert "not a measured serving speed" in md
    # The same drafter twice: the paired difference is zero, its interval holds zero, so no setting is named.
    same = tmp_path / "same"
    assert serve_plan_cli.main([str(files["trained"]), str(files["trained"]), "--labels", "a,b", "--out",
                                str(same)]) == 0
    md = same.with_suffix(".md").read_text()
    assert "**Serve" not in md and "are within noise" in md and "tools/speed_check.py" in md
    plain = tmp_path / "plain.json"
    assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(trained), "--out", str(plain)]) == 0
    with pytest.raises(Exception, match="no serving projection"):
        serve_plan_cli.main([str(files["trained"]), str(plain), "--out", str(tmp_path / "x")])
    (tmp_path / "w.csv").write_text("verified_tokens,seconds\n1,0.03\n9,0.03\n")
    other = tmp_path / "q.json"
    assert profile_cli.main(["--from-csv", str(tmp_path / "w.csv"), "--draft-seconds", "0", "--out", str(other)]) == 0
    again = tmp_path / "again.json"
    assert eval_cli.main(["--states", str(tiny_cache), "--drafter", str(trained), "--out", str(again),
                          "--ddtree-budgets", "8", "--profile", str(other)]) == 0
    with pytest.raises(Exception, match="different profiles"):
        serve_plan_cli.main([str(files["trained"]), str(again), "--out", str(tmp_path / "y")])


def test_the_live_evaluation_logs_the_projection(tiny_cache, tiny_drafter_config, tmp_path) -> None:
    """cost_profile=: every evaluation of a plain loop logs serving/* beside tau (a flat profile with free drafting:
    the greedy speedup is the logged tau, the DDTree's its tau); too few rows are refused at setup."""
    from test_loops import BUDGETS, PREFIX, plain_loop

    from dflash_cb.integrations.cli import profile_costs as profile_cli

    (tmp_path / "v.csv").write_text("verified_tokens,seconds\n1,0.02\n64,0.02\n")
    prof = tmp_path / "p.json"
    assert profile_cli.main(["--from-csv", str(tmp_path / "v.csv"), "--draft-seconds", "0", "--out", str(prof)]) == 0
    _, logged, _ = plain_loop(str(tiny_cache), tiny_drafter_config, steps=2, every=2, cost_profile=str(prof))
    assert sorted(logged) == [0, 2]
    b = max(BUDGETS)
    for metrics in logged.values():
        assert metrics[PREFIX + "serving/speedup_greedy"] == pytest.approx(metrics[PREFIX + "tau"], rel=1e-12)
        assert metrics[PREFIX + f"serving/speedup_ddtree_b{b}"] == pytest.approx(
            metrics[PREFIX + f"ddtree/tau_b{b}"], rel=1e-12)
        assert metrics[PREFIX + "serving/speedup_greedy_ci_low"] <= metrics[PREFIX + "serving/speedup_greedy"]
    from dflash_cb.integrations.tracking.panels import layout_from_keys, panel_plan

    keys = set(logged[2])  # the W&B view built from a run's keys has the projection's section, every key logged
    section = panel_plan(layout_from_keys(keys))["Serving (projected)"]
    assert len(section) == 4 and all(k in keys for spec in section for k in spec.keys)
    (tmp_path / "few.csv").write_text("verified_tokens,seconds\n1,0.02\n4,0.02\n")
    few = tmp_path / "few.json"
    assert profile_cli.main(["--from-csv", str(tmp_path / "few.csv"), "--draft-seconds", "0", "--out", str(few)]) == 0
    with pytest.raises(ArgumentError, match="verifies 6 tokens"):
        plain_loop(str(tiny_cache), tiny_drafter_config, steps=2, every=2, cost_profile=str(few))


def test_a_user_states_the_per_cycle_overhead(tmp_path) -> None:
    """--overhead KIND=SECONDS writes the per-cycle overhead into any profile (here a CSV one), and a projection
    prices it; a kind that is not one, a number that is not finite, or a kind given twice is refused before any
    work, naming the option."""
    from dflash_cb.integrations.cli import profile_costs as profile_cli

    csv = tmp_path / "v.csv"
    csv.write_text("verified_tokens,seconds\n1,0.02\n9,0.02\n")
    out = tmp_path / "p.json"
    assert profile_cli.main(["--from-csv", str(csv), "--draft-seconds", "0", "--out", str(out), "--overhead",
                             "block=0.02,ddtree=0.01"]) == 0
    prof = read_profile(out)
    assert prof.overhead == {"block": 0.02, "ddtree": 0.01}
    p = project(SAMPLES, block_settings(6, (4,)), prof)
    pooled = {s.setting.name: s.tau for s in p.settings}
    assert p.settings[0].speedup.value == pytest.approx(pooled["greedy"] / 2, rel=1e-12)
    assert p.settings[1].speedup.value == pytest.approx(pooled["ddtree_b4"] / 1.5, rel=1e-12)
    for bad in ("tree=0.01", "block=nan", "block=1,block=2", "block"):
        with pytest.raises(ArgumentError, match="--overhead"):
            profile_cli.main(["--from-csv", str(csv), "--draft-seconds", "0", "--out", str(tmp_path / "q.json"),
                              "--overhead", bad])
    assert not (tmp_path / "q.json").exists()
