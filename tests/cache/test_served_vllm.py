"""The served check against vLLM: a real HTTP server on 127.0.0.1 speaks vLLM's OpenAI API and exports its
Prometheus counters (tests/support/vllm_server.py), answering every ``/v1/completions`` by running the reference
full-block speculative loop (tests/support/full_block_loop.py, the reference ``dflash.model.DFlashDraftModel``)
with a briefly trained drafter, and counting each round as vLLM does (drafts, draft tokens, accepted
drafts before the cut, accepted per position). The precompute records each request's counter deltas;
the replay of the same drafter must count the same rounds and the same per-position acceptance on every
sample, another drafter must not, and a block or method that differs is NOT COMPARABLE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from served_world import BLOCK, N_PROMPTS, precompute, served_run
from served_world import edited_cache as _edited
from vllm_server import FakeVLLM, Loop, Run, serve

from dflash_cb.cache import vllm_counters as V
from dflash_cb.core.results.results_file import load_results

SMALL = 4  # a served block shorter than the drafter's BLOCK


@pytest.fixture(scope="module")
def world(served_world: dict[str, Any]) -> dict[str, Any]:
    return served_world


def _loop(world: dict[str, Any], block: int) -> Loop:
    def loop(prompt: list[int], max_tokens: int, stops: set[int]) -> Run:
        run = served_run(world, prompt, max_tokens, stops, block)
        return Run(run.output_ids, run.correct_drafts)

    return loop


def _fake(world: dict[str, Any], block: int = BLOCK, **kw: Any) -> FakeVLLM:
    return FakeVLLM(_loop(world, block), served_name="tiny-target", root=str(world["target_dir"]),
                    num_spec_tokens=block - 1, drafter=str(world["drafter"]), **kw)


def _vllm_args(world: dict[str, Any], url: str, out: Path, *extra: str) -> list[str]:
    return ["--target", str(world["target_dir"]), "--prompts", str(world["prompts"]), "--out", str(out),
            "--reference", "vllm", "--vllm-url", url, *extra]


def _eval(cache: Path, drafter: Path, out: Path, *extra: str) -> int:
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import eval_drafter as eval_drafter

    return run(eval_drafter.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                                   "--ddtree-budgets", "", "--served-check", *extra])


@pytest.fixture(scope="module")
def served(world, tmp_path_factory) -> dict[str, Any]:
    """A precompute against vLLM serving the drafter at its block, /server_info on (VLLM_SERVER_DEV_MODE=1)."""
    fake = _fake(world, dev_mode=True, engines=2)
    with serve(fake) as url:
        out = tmp_path_factory.mktemp("vllm") / "served"
        assert precompute(*_vllm_args(world, url, out)) == 0
    return dict(out=out, ledger=list(fake.ledger))


@pytest.fixture(scope="module")
def small(world, tmp_path_factory) -> dict[str, Any]:
    """vLLM serving the BLOCK drafter with num_speculative_tokens SMALL - 1, /server_info off."""
    fake = _fake(world, SMALL)
    with serve(fake) as url:
        out = tmp_path_factory.mktemp("vllm_small") / "served"
        assert precompute(*_vllm_args(world, url, out)) == 0
    return dict(out=out, ledger=list(fake.ledger))


def test_precompute_records_each_requests_counters(world, served) -> None:
    from dflash_cb.cache.states import StateCache

    m = StateCache(served["out"]).manifest
    assert m.served_spec_config == {"server": "vllm", "algorithm": "dflash", "draft_model_path": str(world["drafter"]),
                                    "draft_model_revision": None, "num_speculative_tokens": BLOCK - 1,
                                    "metrics_exported": True, "metrics_positions": BLOCK - 1}
    assert len(m.samples) == N_PROMPTS == len(served["ledger"])
    for e, own in zip(m.samples, served["ledger"], strict=True):
        spec = e.served_spec
        assert spec[V.ATTRIBUTABLE] is True and spec[V.DRAFTS] == own["drafts"] >= 1
        assert spec[V.ACCEPTED] == own["accepted"] and spec[V.PER_POSITION] == own["per_pos"]
        assert spec[V.DRAFT_TOKENS] == own["drafts"] * (BLOCK - 1) and spec[V.GENERATION_TOKENS] == e.completion_len
    assert m.agreement["samples_fully_agreeing"] == N_PROMPTS


def test_served_check_same_drafter(world, served, tmp_path, capsys) -> None:
    """Rounds per sample equal the replay's cycles, per-position acceptance equals the replay's counts (a
    last round that matched to the end of the completion as a lower bound), vLLM's mean acceptance length
    beside ours."""
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert _eval(served["out"], world["drafter"], out) == 0
    res = load_results(out)
    check = res.breakdown["served_check"]
    s = check["summary"]
    offline = {x.id: x.acceptance_lengths for x in res.samples}
    assert any(n > 1 for v in offline.values() for n in v) and any(n < BLOCK for v in offline.values() for n in v)
    assert s["comparable"] and not check["skipped"] and not check["flagged"]
    assert check["blocks"] == {"replay": BLOCK, "server": BLOCK, "drafter": BLOCK,
                               "server_from": "configuration"}
    assert s["samples_compared"] == s["samples_equal_rounds"] == N_PROMPTS
    assert s["samples_with_per_position"] == s["samples_equal_per_position"] == N_PROMPTS
    assert s["samples_with_histogram"] == 0  # vLLM has no histogram: its per-position counts stand for it
    for x in check["samples"]:
        assert x["offline_rounds"] == x["served_rounds"] == len(offline[x["id"]])
        assert x["per_position"] in ("equal", "equal_censored") and x["convention"] == "vllm"
        assert x["served_tau"] == pytest.approx(x["offline_tau"])
    ledger = served["ledger"]
    assert s["served_per_position"] == [sum(o["per_pos"][j] for o in ledger) for j in range(BLOCK - 1)]
    accepted, drafts = sum(o["accepted"] for o in ledger), sum(o["drafts"] for o in ledger)
    m = s["vllm_mean_acceptance_length"]
    assert m["served"] == pytest.approx(1 + accepted / drafts) and m["offline"] <= m["served"]
    # ours counts the tokens committed after the last round's cut: never more than vLLM's figure
    assert s["offline_tau"] == pytest.approx(res.tau) and res.tau <= m["offline"] + 1e-6
    assert s["tau_diff_interval"] == [0.0, 0.0, 0.0]
    text = capsys.readouterr().out
    assert "vLLM vllm:spec_decode_num_drafts_total across each request" in text
    assert f"per-position acceptance equal {N_PROMPTS}/{N_PROMPTS}" in text and "differs" not in text
    assert "mean acceptance length, vLLM's convention (1 + accepted / drafts)" in text


def test_served_check_other_drafter(world, served, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert _eval(served["out"], world["other"], out) == 0
    check = load_results(out).breakdown["served_check"]
    s = check["summary"]
    assert s["samples_equal_rounds"] < N_PROMPTS and s["samples_equal_per_position"] < N_PROMPTS
    assert s["offline_tau"] < s["served_tau"] and s["vllm_mean_acceptance_length"]["offline"] < \
        s["vllm_mean_acceptance_length"]["served"]
    assert any("not obviously the evaluated drafter" in w for w in check["warnings"])
    assert "<- differs" in capsys.readouterr().out


def test_served_block_smaller_than_the_drafters(world, small, tmp_path, capsys) -> None:
    """num_speculative_tokens SMALL - 1: the block comes from the counters' positions (no /server_info), the
    check replays at it and agrees; without any recorded configuration the counters themselves give it
    (draft tokens / drafts + 1): NOT COMPARABLE at the drafter's block, naming both, equal at --block-size."""
    from dflash_cb.cache.states import StateCache

    assert StateCache(small["out"]).manifest.served_spec_config == {"server": "vllm", "metrics_exported": True,
                                                                     "metrics_positions": SMALL - 1}
    assert _eval(small["out"], world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    s = check["summary"]
    assert check["blocks"] == {"replay": SMALL, "server": SMALL, "drafter": BLOCK,
                               "server_from": "positions"} and s["comparable"]
    assert s["samples_equal_rounds"] == s["samples_equal_per_position"] == N_PROMPTS

    def forget(m: dict) -> None:
        m["served_spec_config"] = None

    cache = _edited(small["out"], tmp_path / "unknown", forget)
    capsys.readouterr()
    assert _eval(cache, world["drafter"], tmp_path / "u.json") == 0
    check = load_results(tmp_path / "u.json").breakdown["served_check"]
    assert not check["summary"]["comparable"] and len(check["not_comparable"]) == 1
    why = check["not_comparable"][0]
    assert f"counters show blocks of {SMALL} tokens" in why and f"replay drafted blocks of {BLOCK}" in why
    assert f"--block-size {SMALL}" in why and "NOT COMPARABLE" in capsys.readouterr().out
    assert _eval(cache, world["drafter"], tmp_path / "b.json", "--block-size", str(SMALL)) == 0
    s = load_results(tmp_path / "b.json").breakdown["served_check"]["summary"]
    assert s["comparable"] and s["samples_equal_rounds"] == s["samples_equal_per_position"] == N_PROMPTS


def test_server_block_larger_than_the_drafters(world, served, tmp_path, capsys) -> None:
    drafter = tmp_path / "d4"
    shutil.copytree(world["drafter"], drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["block_size"] = SMALL
    (drafter / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert _eval(served["out"], drafter, tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert not check["summary"]["comparable"] and len(check["not_comparable"]) == 1
    why = check["not_comparable"][0]
    assert f"blocks of {BLOCK} tokens (num_speculative_tokens {BLOCK - 1})" in why and f"block of {SMALL}" in why
    text = capsys.readouterr().out
    assert "NOT COMPARABLE" in text and "<- differs" not in text


def test_another_method_is_not_comparable(world, served, tmp_path) -> None:
    def eagle(m: dict) -> None:
        m["served_spec_config"]["algorithm"] = "eagle3"

    cache = _edited(served["out"], tmp_path / "eagle", eagle)
    assert _eval(cache, world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert not check["summary"]["comparable"] and any("speculates with 'eagle3', not DFlash" in w
                                                     for w in check["not_comparable"])


def test_traffic_of_another_client(world, tmp_path, capsys) -> None:
    """Another client's request finishing during one sample's request: the precompute keeps the sample and
    marks its counters unattributable; the check skips it with the reason and compares the others."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.cache.vllm_client import VLLMClient

    fake = _fake(world)
    prompts = [json.loads(line)["input_ids"] for line in world["prompts"].read_text().splitlines()]
    with serve(fake) as url:
        other = VLLMClient(url)
        fake.on_arrival[tuple(prompts[2])] = lambda: other.generate([5, 6, 7], 8, [2], concurrency=2)
        assert precompute(*_vllm_args(world, url, tmp_path / "c")) == 0
    entries = StateCache(tmp_path / "c").samples
    assert [e.served_spec[V.ATTRIBUTABLE] for e in entries] == [i != 2 for i in range(N_PROMPTS)]
    assert _eval(tmp_path / "c", world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert list(check["skipped"]) == [entries[2].id]
    assert check["skipped"][entries[2].id].startswith("unattributable: 2 requests finished during it")
    s = check["summary"]
    assert s["samples_compared"] == s["samples_equal_rounds"] == s["samples_equal_per_position"] == N_PROMPTS - 1
    assert f"skipped {entries[2].id}: unattributable" in capsys.readouterr().out
    from dflash_cb.core.results.baselines import (
        load_served,  # the served tau beside a live tau says it is over fewer samples
    )

    b = load_served(StateCache(tmp_path / "c"))
    assert b.label.endswith(f"over {N_PROMPTS - 1} of {N_PROMPTS} samples)") and "served counters count" in b.details["subset"]


def test_requests_in_parallel_leave_nothing_to_compare(world, tmp_path, capsys) -> None:
    with serve(_fake(world)) as url:
        assert precompute(*_vllm_args(world, url, tmp_path / "c", "--max-in-flight", "2")) == 0
    capsys.readouterr()
    assert _eval(tmp_path / "c", world["drafter"], tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{N_PROMPTS} x unattributable" in err and "--max-in-flight 1" in err
    assert not (tmp_path / "r.json").exists()


def test_served_baseline_from_vllm(world, served) -> None:
    """baseline/served/tau for a cache made through vLLM: the replay's convention, (completion_tokens - 1)
    over the rounds, pooled over the samples whose counters count."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import baseline_scalars, load_served

    cache = StateCache(served["out"])
    b = load_served(cache)
    want = sum(e.completion_len - 1 for e in cache.samples) / sum(o["drafts"] for o in served["ledger"])
    assert b is not None and b.label == "drafter-served (served, measured online)" and "vLLM" in b.source
    assert baseline_scalars([b], "dflash_eval/") == {"dflash_eval/baseline/served/tau": pytest.approx(want)}
    assert b.details["samples"] == N_PROMPTS


def test_a_server_without_speculation(world, tmp_path, capsys) -> None:
    fake = FakeVLLM(_loop(world, BLOCK), served_name="tiny-target", root=str(world["target_dir"]), num_spec_tokens=None)
    with serve(fake) as url:
        assert precompute(*_vllm_args(world, url, tmp_path / "c")) == 0
    from dflash_cb.cache.states import StateCache

    m = StateCache(tmp_path / "c").manifest
    assert all(e.served_spec is None for e in m.samples) and m.served_spec_config["algorithm"] is None
    capsys.readouterr()
    assert _eval(tmp_path / "c", world["drafter"], tmp_path / "r.json") == 2
    err = capsys.readouterr().err
    assert "nothing to compare" in err and "--reference vllm --max-in-flight 1" in err


@pytest.mark.parametrize("mode", ["summary", "detailed"])
def test_per_request_metrics_at_any_concurrency_with_other_traffic(world, tmp_path, capsys, mode) -> None:
    """A vLLM started with --per-request-spec-decode-metrics: each answer's own counters are kept at
    --max-in-flight 3 with another client's requests in between, no /metrics read per request (no settle wait);
    the served check compares every sample, and with ``detailed`` every verify step."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.cache.vllm_client import VLLMClient

    fake = _fake(world, per_request=mode)
    prompts = [json.loads(line)["input_ids"] for line in world["prompts"].read_text().splitlines()]
    with serve(fake) as url:
        other = VLLMClient(url)
        fake.on_arrival[tuple(prompts[1])] = lambda: other.generate([5, 6, 7], 8, [2], concurrency=2)
        assert precompute(*_vllm_args(world, url, tmp_path / "c", "--max-in-flight", "3")) == 0
        reads = fake.metrics_calls
    assert reads <= 2  # the setup's look at the server's counters, none per request
    own = {tuple(o["prompt"]): o for o in fake.ledger}
    for e, prompt in zip(StateCache(tmp_path / "c").samples, prompts, strict=True):
        spec, mine = e.served_spec, own[tuple(prompt)]
        assert spec[V.ATTRIBUTABLE] is True and spec[V.PER_REQUEST] is True
        assert (spec[V.DRAFTS], spec[V.ACCEPTED], spec[V.PER_POSITION]) == (mine["drafts"], mine["accepted"],
                                                                             mine["per_pos"])
        assert (V.PER_STEP_ACCEPTED in spec) == (mode == "detailed")
    capsys.readouterr()
    assert _eval(tmp_path / "c", world["drafter"], tmp_path / "r.json") == 0
    s = load_results(tmp_path / "r.json").breakdown["served_check"]["summary"]
    assert s["samples_compared"] == s["samples_equal_rounds"] == s["samples_equal_per_position"] == N_PROMPTS
    assert s["samples_with_per_step"] == s["samples_equal_per_step"] == (N_PROMPTS if mode == "detailed" else 0)
    if mode == "detailed":
        assert f"every verify step equal {N_PROMPTS}/{N_PROMPTS}" in capsys.readouterr().out


def test_per_request_steps_that_differ_are_named(world, served) -> None:
    """A per_step_accepted that is not the replay's: the first differing step named, the sample not equal."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.served_check import DIFFERS, per_step_status

    assert per_step_status([2, 0, 3], False, [2, 1, 3]) == (DIFFERS, 1)
    assert per_step_status([2, 0, 3], True, [2, 0, 5])[0] == "equal_censored"
    assert per_step_status([2, 0], False, [2, 0, 1]) == (DIFFERS, 2)
    assert StateCache(served["out"]).samples  # the fixture's cache stays readable


def test_a_vllm_without_metrics_still_gives_completions(world, tmp_path, capsys) -> None:
    """No /metrics at all: the precompute goes on (one warning naming the server flag), the completions are
    the server's; with per-request metrics the counters are kept all the same."""
    from dflash_cb.cache.states import StateCache

    with serve(_fake(world, serves_metrics=False)) as url:
        assert precompute(*_vllm_args(world, url, tmp_path / "a")) == 0
    assert all(not e.served_spec for e in StateCache(tmp_path / "a").samples)
    assert "--per-request-spec-decode-metrics" in capsys.readouterr().err
    with serve(_fake(world, serves_metrics=False, per_request="summary")) as url:
        assert precompute(*_vllm_args(world, url, tmp_path / "b")) == 0
    assert all(e.served_spec[V.PER_REQUEST] for e in StateCache(tmp_path / "b").samples)


def test_served_speed_beside_the_projection(world, tmp_path, capsys) -> None:
    """The precompute keeps each request's wall time (one in flight) and what the server says of it; with
    --baseline-server every prompt goes to a plain server too, one at a time, its completion checked against the
    speculative one's, and both times are journaled; a rerun asks neither server again; the served check puts the
    served speedup per prompt and pooled beside the projection on the same prompts."""
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.precompute.journal import read_journal
    from dflash_cb.cache.served_speed import TIMING_NAME, read_timings
    from dflash_cb.integrations.cli import profile_costs

    spec = _fake(world, per_request="summary", reports_timing={"tokens_per_second": 123.0, "generation_time_ms": 45.0,
                                                               "first_token_ms": None})
    plain = FakeVLLM(_loop(world, BLOCK), served_name="tiny-target", root=str(world["target_dir"]),
                     num_spec_tokens=None)
    out = tmp_path / "cache"
    with serve(spec) as url, serve(plain) as base:
        assert precompute(*_vllm_args(world, url, out, "--baseline-server", base)) == 0
        assert (spec.calls, plain.calls) == (N_PROMPTS, N_PROMPTS)
        assert precompute(*_vllm_args(world, url, out, "--baseline-server", base)) == 0
        assert (spec.calls, plain.calls) == (N_PROMPTS, N_PROMPTS)  # resumed: nothing asked again
    completions, _ = read_journal(out / JOURNAL_NAME)
    assert all("served_timing" not in e for e in completions.values())  # the journal holds the completions alone
    journal = read_timings(out / TIMING_NAME)
    assert sorted(journal) == sorted(completions)
    for e in journal.values():
        t = e["served_timing"]
        assert t["in_flight"] == 1 and t["wall_seconds"] > 0
        assert t["server"] == {"tokens_per_second": 123.0, "generation_time_ms": 45.0}  # numbers only
        assert t["baseline"]["url"] == base and t["baseline"]["wall_seconds"] > 0
    csv = tmp_path / "v.csv"
    csv.write_text(f"verified_tokens,seconds\n1,0.01\n{BLOCK + 1},0.012\n")
    assert profile_costs.main(["--from-csv", str(csv), "--draft-seconds", "0.002", "--states", str(out), "--out",
                               str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert _eval(out, world["drafter"], tmp_path / "r.json", "--profile", str(tmp_path / "p.json")) == 0
    speed = load_results(tmp_path / "r.json").breakdown["served_speed"]
    ids = speed["ids"]
    assert sorted(ids) == sorted(journal) and speed["in_flight"] == 1
    want = [journal[i]["served_timing"]["baseline"]["wall_seconds"] / journal[i]["served_timing"]["wall_seconds"]
            for i in ids]
    assert speed["per_prompt"] == pytest.approx(want, rel=1e-12)
    total = sum(journal[i]["served_timing"]["baseline"]["wall_seconds"] for i in ids) / sum(
        journal[i]["served_timing"]["wall_seconds"] for i in ids)
    lo, hi = speed["served_speedup"][1:]
    assert speed["served_speedup"][0] == pytest.approx(total) and lo <= total <= hi
    assert speed["setting"] == f"block {BLOCK}" and len(speed["projected_per_prompt"]) == N_PROMPTS
    text = capsys.readouterr().out
    assert "SERVED speed" in text and f"projected (block {BLOCK}) on the same prompts" in text


def test_a_baseline_server_of_another_model_or_speculating_is_refused(world, tmp_path, capfd) -> None:
    """A plain server whose greedy completion differs names the prompt and token, before the prefill; a baseline
    server that speculates is refused at the start; --baseline-server needs a served reference."""

    def shifted(prompt: list[int], max_tokens: int, stops: set[int]) -> Run:
        run = _loop(world, BLOCK)(prompt, max_tokens, stops)
        return Run([(run.output_ids[0] + 1) % 100] + run.output_ids[1:], run.accepted)

    other = FakeVLLM(shifted, served_name="tiny-target", root=str(world["target_dir"]), num_spec_tokens=None)
    with serve(_fake(world, per_request="summary")) as url, serve(other) as base:
        assert precompute(*_vllm_args(world, url, tmp_path / "a", "--baseline-server", base)) == 2
        assert "its greedy completion differs from the speculative server's at token 0" in capfd.readouterr().err
        assert not (tmp_path / "a" / "manifest.json").exists()
    with serve(_fake(world, per_request="summary")) as url, serve(_fake(world)) as base:
        assert precompute(*_vllm_args(world, url, tmp_path / "b", "--baseline-server", base)) == 2
        assert f"runs speculative decoding (metrics_positions {BLOCK - 1})" in capfd.readouterr().err
    assert precompute("--target", str(world["target_dir"]), "--prompts", str(world["prompts"]), "--out",
                      str(tmp_path / "c"), "--baseline-server", "http://127.0.0.1:9") == 2
    assert "--baseline-server times the same prompts" in capfd.readouterr().err
