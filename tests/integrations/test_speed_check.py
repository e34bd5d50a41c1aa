"""The speed check (tools/speed_check.py): real decodes on the tiny CPU models beside the projection, checked token
for token against plain greedy decoding and cycle for cycle against the replay; a wrong target is caught and the
first prompt and cycle named; bad input refused before anything loads. Counted work, never a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cb.common.arguments import ArgumentError
from dflash_cb.integrations.cli import speed_check


@pytest.fixture(scope="module")
def world(tiny_cache: Path, trained_tiny_drafter, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("speed")
    trained_tiny_drafter().save_pretrained(root / "drafter")
    csv = root / "verify.csv"
    csv.write_text("verified_tokens,seconds\n1,0.004\n9,0.005\n")
    from dflash_cb.integrations.cli import profile_costs

    assert profile_costs.main(["--from-csv", str(csv), "--draft-seconds", "0.002", "--states", str(tiny_cache),
                               "--drafter", str(root / "drafter"), "--out", str(root / "profile.json")]) == 0
    return dict(root=root, cache=tiny_cache, target=tiny_cache.parent / "target", drafter=root / "drafter",
                profile=root / "profile.json")


def _args(world: dict, out: Path, *extra: str) -> list[str]:
    return ["--target", str(world["target"]), "--drafter", str(world["drafter"]), "--states", str(world["cache"]),
            "--out", str(out), "--no-progress", *extra]


def test_measured_speed_beside_the_projection(world: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    """Every setting and plain decoding decode every prompt once to warm up (plain: each prompt, the reference
    tokens) and then ``repeats`` times, interleaved; every decode is exact; the report gives each setting's tau
    (the replay's), measured speedup with its interval and repeat range, the projection on the same prompts and
    their ratio, and the per-cycle split; --profile-out writes the profile again with the measured overhead
    and leaves --profile as it was."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.core.decode import loops
    from dflash_cb.core.replay import evaluate

    counted = {"plain": 0, "spec": 0}
    plain, spec = loops.plain_decode, loops.speculative_decode

    def count(kind, fn):
        def wrapped(*a, **k):
            counted[kind] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(loops, "plain_decode", count("plain", plain))
    monkeypatch.setattr(loops, "speculative_decode", count("spec", spec))
    before = world["profile"].read_bytes()
    out, checked = tmp_path / "check.json", tmp_path / "checked.json"
    assert speed_check.main(_args(world, out, "--ddtree-budgets", "4", "--prompts", "3", "--repeats", "2",
                                  "--profile", str(world["profile"]), "--profile-out", str(checked))) == 0
    assert counted == {"plain": 3 + 2 * 3, "spec": 2 + 2 * 3 * 2}
    report = json.loads(out.read_text())
    assert report["exact"] and report["first_difference"] is None and report["repeats"] == 2
    cache = StateCache(world["cache"])
    ids = [e.id for e in cache.samples][:3]
    assert report["prompts"] == ids
    rep = evaluate(cache, load_drafter(world["drafter"]), sample_ids=ids, budgets=(4,), tail_blocks="served")
    by = {s["name"]: s for s in report["settings"]}
    assert list(by) == ["greedy", "ddtree_b4"] and by["greedy"]["label"] == "block 6"
    for name, runs in (("greedy", [s.acceptance_lengths for s in rep.samples]),
                       ("ddtree_b4", [s.ddtree[4] for s in rep.samples])):
        s = by[name]
        assert s["tau"] == pytest.approx(sum(map(sum, runs)) / sum(map(len, runs)))
        v, lo, hi = s["speedup"]
        assert lo <= v <= hi and v > 0 and s["repeat_range"][0] <= s["repeat_range"][1]
        assert s["ratio"] == pytest.approx(s["projected"][0] / v)
        assert set(s["per_cycle_seconds"]) == {"verify", "draft", "overhead"}
        # The CSV profile's prices of a cycle: flat verify rows 1 -> 9 tokens, 2 ms a pass, no overhead.
        priced = s["priced_per_cycle_seconds"]
        n = 6 if name == "greedy" else 5
        assert priced["verify"] == pytest.approx(0.004 + 0.001 * (n - 1) / 8) and priced["draft"] == pytest.approx(0.002)
        assert priced["overhead"] == 0.0
    assert set(report["overhead_seconds_per_cycle"]) == {"block", "ddtree"}
    assert world["profile"].read_bytes() == before
    from dflash_cb.integrations.evaluator.projection import read_profile

    assert read_profile(checked).overhead == report["overhead_seconds_per_cycle"]
    shown = capsys.readouterr().out
    assert "MEASURED speed" in shown and "exact: every decode equals plain greedy decoding" in shown
    with pytest.raises(ArgumentError, match="exists"):  # a profile is never overwritten
        speed_check.main(_args(world, tmp_path / "c2.json", "--profile", str(world["profile"]), "--profile-out",
                               str(checked)))


def test_a_cache_of_another_target_is_caught_naming_prompt_and_cycle(world: dict, tmp_path: Path) -> None:
    """Another target of the same shape (the identity check passes): its decodes still agree with its own plain
    decoding, but not with the cache's replay; the report names the first prompt and cycle, exit code 1."""
    from tiny_target import save_tiny_qwen3

    other = save_tiny_qwen3(tmp_path / "other", seed=11)
    out = tmp_path / "check.json"
    args = _args(world, out, "--prompts", "2", "--repeats", "1")
    args[args.index("--target") + 1] = str(other)
    assert speed_check.main(args) == 1
    report = json.loads(out.read_text())
    assert not report["exact"]
    assert report["first_difference"].startswith("greedy on prompt ") and " cycle " in report["first_difference"]


@pytest.mark.parametrize(("extra", "said"), [
    (("--speculative-tokens", "2"), "a chain drafter's"),
    (("--profile-out", "x.json"), "give --profile"),
    (("--block-size", "9"), "above the drafter's block"),
    (("--prompts", "0"), "--prompts"),
])
def test_bad_input_is_refused_before_anything_loads(world: dict, tmp_path: Path, monkeypatch, extra, said) -> None:
    import dflash_cb.cache.target as target_module

    def never(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(target_module, "load_target", never)
    with pytest.raises(ArgumentError, match=said):
        speed_check.main(_args(world, tmp_path / "c.json", *extra))


def test_an_output_onto_an_input_is_refused(world: dict) -> None:
    from dflash_cb.common.fileio import OverwritesInputError

    with pytest.raises(OverwritesInputError):
        speed_check.main(_args(world, world["drafter"] / "config.json"))
