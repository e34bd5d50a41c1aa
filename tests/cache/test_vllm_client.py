"""VLLMClient and ``--reference vllm`` against a real HTTP server that speaks vLLM's API and exports its
counters (tests/support/vllm_server.py), backed by a tiny random Qwen3's greedy output and a stand-in drafter.

The fake server keeps its own ledger of what each request's rounds counted; the client must recover
exactly that from the server-wide ``/metrics`` deltas, attribute nothing it cannot, and survive faults
without losing or mixing counters.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from local_http import quick_retries
from tiny_target import random_prompts, save_tiny_qwen3, write_prompts
from vllm_server import FakeVLLM, serve, simulated_drafts

from dflash_cb.cache import vllm_counters as V
from dflash_cb.cache.prometheus import parse_exposition, total
from dflash_cb.cache.vllm_client import VLLMClient, VLLMError, served_model_mismatch

K = 3  # num_speculative_tokens


def _miss(t: int) -> bool:
    return t % 4 == 0  # the stand-in drafter misses every fourth position: rounds of 0..3 accepted drafts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def model(target_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture()
def fake(model, target_dir) -> FakeVLLM:
    return FakeVLLM(simulated_drafts(model, K, _miss), served_name="Qwen/Qwen3-Tiny-Test", root=str(target_dir),
                    num_spec_tokens=K, engines=2)


@pytest.fixture()
def server(fake) -> Iterator[tuple[str, FakeVLLM]]:
    with serve(fake) as url:
        yield url, fake


def client(url: str, **kw: Any) -> VLLMClient:
    return VLLMClient(url, **{"timeout": 10.0, "max_retries": 4, "backoff": 0.01, "max_backoff": 0.05, **kw})


PROMPTS = [[1, 17, 42, 99, 5, 64], [7, 8, 9], [100, 3, 55, 21, 90, 4, 33, 12], [60, 61]]


def hf_greedy(model, prompt: list[int], n: int, stops: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=stops or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _own(counters: dict[str, Any]) -> dict[str, Any]:
    """A recorded served_spec in the fake's ledger layout."""
    return {"drafts": counters[V.DRAFTS], "draft_tokens": counters[V.DRAFT_TOKENS], "accepted": counters[V.ACCEPTED],
            "per_pos": counters[V.PER_POSITION], "generation": counters[V.GENERATION_TOKENS]}


def _ledger(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "prompt"}


# -- the client ---------------------------------------------------------------------------------------


def test_completions_are_token_exact(server, model) -> None:
    url, fake = server
    c = client(url)
    assert c.model_info() == {"served_model_name": "Qwen/Qwen3-Tiny-Test", "model_path": fake.root,
                              "max_model_len": 512}  # no timestamps: the manifest must not change between runs
    assert served_model_mismatch(c.model_info(), "qwen3-tiny-test") is None
    assert "--vllm-url" in served_model_mismatch(c.model_info(), "Qwen/Qwen3.6-27B")
    for prompt in PROMPTS:
        for stops in ([2], [], [hf_greedy(model, prompt, 6, [])[3]]):  # no stop, the EOS, a token it reaches
            got = c.generate(prompt, 12, stops)
            assert got.output_ids == hf_greedy(model, prompt, 12, stops)
            assert got.finish_reason == ("stop" if got.output_ids[-1] in stops else "length")
    body = fake.bodies[-1]
    assert body["prompt"] == PROMPTS[-1] and body["return_token_ids"] is True and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["model"] == "Qwen/Qwen3-Tiny-Test" and body["max_tokens"] == 12
    assert body["repetition_penalty"] == 1.0 and body["n"] == 1 and body["stream"] is False


def test_counters_per_request_are_its_own(server) -> None:
    """One request at a time, two engines: each request's /metrics deltas are exactly what its own rounds
    counted (the fake's ledger), position by position, and attributable."""
    url, fake = server
    c = client(url)
    seen: list[str] = []
    got = c.generate_many([(f"s{i}", p) for i, p in enumerate(PROMPTS)], 16, [2], max_in_flight=1,
                          on_result=lambda k, _: seen.append(k))
    assert seen == ["s0", "s1", "s2", "s3"] and len(fake.ledger) == len(PROMPTS)
    for i, own in enumerate(fake.ledger):
        counters = got[f"s{i}"].meta_info
        assert counters[V.ATTRIBUTABLE] is True and V.UNATTRIBUTABLE_REASON not in counters, counters
        assert _own(counters) == _ledger(own) and counters[V.REQUEST_SUCCESS] == 1
        assert counters[V.RUNNING] == {"before": 0, "after": 0}
    assert any(own["accepted"] for own in fake.ledger) and any(own["accepted"] < own["draft_tokens"]
                                                              for own in fake.ledger)
    assert sum(own["drafts"] for own in fake.ledger) > len(PROMPTS)


def test_speculative_config(model, target_dir) -> None:
    loop = simulated_drafts(model, K, _miss)
    dev = FakeVLLM(loop, served_name="m", root=str(target_dir), num_spec_tokens=K, dev_mode=True, drafter="/d/dflash")
    with serve(dev) as url:
        assert client(url).speculative_config() == {
            "server": "vllm", "algorithm": "dflash", "draft_model_path": "/d/dflash", "draft_model_revision": None,
            "num_speculative_tokens": K, "metrics_exported": True, "metrics_positions": K}
    for fake, want in [(FakeVLLM(loop, served_name="m", root="r", num_spec_tokens=K),
                        {"server": "vllm", "metrics_exported": True, "metrics_positions": K}),
                       (FakeVLLM(loop, served_name="m", root="r", num_spec_tokens=None),  # not speculating
                        {"server": "vllm", "metrics_exported": True, "algorithm": None}),
                       (FakeVLLM(loop, served_name="m", root="r", stats=False),  # --disable-log-stats
                        {"server": "vllm", "metrics_exported": False})]:
        with serve(fake) as url:
            c = client(url)
            assert c.speculative_config() == want
            counters = c.generate(PROMPTS[0], 8, [2]).meta_info
            if "metrics_positions" in want:
                assert counters[V.ATTRIBUTABLE] is True and len(counters[V.PER_POSITION]) == K
            else:
                assert counters == {}  # nothing to record, nothing invented


def test_another_clients_request_finishing_meanwhile(server) -> None:
    """Another client's request that starts and finishes during one sample's request: that sample's counters
    are marked unattributable with the reason; the samples before and after it stay attributable."""
    url, fake = server
    c = client(url)
    other = client(url)
    fake.on_arrival[tuple(PROMPTS[1])] = lambda: other.generate([5, 6, 7, 8], 10, [2], concurrency=2)
    got = c.generate_many([(i, p) for i, p in enumerate(PROMPTS)], 16, [2], max_in_flight=1)
    assert [got[i].meta_info[V.ATTRIBUTABLE] for i in range(len(PROMPTS))] == [True, False, True, True]
    why = got[1].meta_info[V.UNATTRIBUTABLE_REASON]
    assert "2 requests finished during it" in why and V.REQUEST_SUCCESS in why
    assert got[1].meta_info[V.DRAFTS] == fake.ledger[1]["drafts"] + fake.ledger[2]["drafts"]  # both, mixed
    assert _own(got[2].meta_info) == _ledger(fake.ledger[3])


def test_a_request_already_running(server) -> None:
    """A request of another client still running when a sample's request is sent, and one still running
    after it: neither sample's counters are its own."""
    url, fake = server
    release = fake.hold[(5, 6, 7, 8)] = threading.Event()
    other = threading.Thread(target=client(url).generate, args=([5, 6, 7, 8], 10, [2]), kwargs={"concurrency": 2})
    other.start()
    try:
        deadline = time.monotonic() + 10
        while sum(fake.running) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = client(url).generate(PROMPTS[0], 12, [2])
    finally:
        release.set()
        other.join(10)
    assert got.meta_info[V.ATTRIBUTABLE] is False
    assert "1 request(s) were running when it was sent" in got.meta_info[V.UNATTRIBUTABLE_REASON]
    fake.hold[(9, 9, 9)] = release2 = threading.Event()

    def another_one_running() -> None:  # before the sample runs: another request arrives, and is held
        threading.Thread(target=client(url).generate, args=([9, 9, 9], 6, [2]), kwargs={"concurrency": 2},
                         daemon=True).start()
        deadline = time.monotonic() + 10
        while sum(fake.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

    fake.on_arrival[tuple(PROMPTS[2])] = another_one_running
    try:
        got = client(url).generate(PROMPTS[2], 12, [2])
    finally:
        release2.set()
    assert got.meta_info[V.ATTRIBUTABLE] is False
    assert "1 request(s) were running after it had finished" in got.meta_info[V.UNATTRIBUTABLE_REASON]


def test_a_preempted_request(server) -> None:
    """vLLM preempts a request under memory pressure and recomputes it: its rounds are not one loop."""
    url, fake = server
    fake.preempt.add(tuple(PROMPTS[0]))
    got = client(url).generate(PROMPTS[0], 12, [2])
    assert got.meta_info[V.ATTRIBUTABLE] is False and got.meta_info[V.PREEMPTIONS] == 1
    assert got.meta_info[V.UNATTRIBUTABLE_REASON].startswith("preempted 1 time(s) during it")


def test_faults_are_survived_and_the_counters_are_the_last_attempts(server, model) -> None:
    """503, a dropped connection after the server ran the request, garbage JSON after it ran, an HTML page
    for /metrics: retried; the completion is the greedy one and the counters are the last attempt's own."""
    url, fake = server
    fake.fail_first, fake.drop_first, fake.garbage_first, fake.metrics_garbage_first = 1, 1, 1, 1
    got = client(url).generate(PROMPTS[2], 16, [2])
    assert fake.calls == 4 and len(fake.ledger) == 3  # the drop and the garbage ran on the server too
    assert got.output_ids == hf_greedy(model, PROMPTS[2], 16, [2])
    assert got.meta_info[V.ATTRIBUTABLE] is True and _own(got.meta_info) == _ledger(fake.ledger[-1])


def test_faults_that_do_not_pass(server, model) -> None:
    url, fake = server
    fake.fail_first = 100
    with pytest.raises(VLLMError, match=r"failed after 3 attempt\(s\).*HTTP 503"):
        client(url, max_retries=2).generate(PROMPTS[0], 8, [2])
    fake.fail_first, fake.calls = 0, 0
    fake.ignores_return_token_ids = True  # an older vLLM
    with pytest.raises(VLLMError, match="return_token_ids"):
        client(url, max_retries=1).generate(PROMPTS[0], 8, [2])
    fake.ignores_return_token_ids, fake.bos_first = False, True
    with pytest.raises(VLLMError, match="other prompt tokens than sent"):
        client(url).generate(PROMPTS[0], 8, [2])
    fake.bos_first = False
    with pytest.raises(VLLMError, match="HTTP 400.*maximum context length"):  # not retried
        client(url).generate(PROMPTS[0], 600, [2])
    fake.metrics_garbage_first = 100  # /metrics never readable: the completion all the same, no counters, said once
    got = client(url, max_retries=1).generate(PROMPTS[0], 8, [2])
    assert got.output_ids == hf_greedy(model, PROMPTS[0], 8, [2]) and got.meta_info == {}


def test_late_statistics(server) -> None:
    """A server that counts a request a little after answering: the client waits for it; one that never
    does within the settle time gets its counters marked unattributable, never silently short."""
    url, fake = server
    fake.late_stats_s = 0.2
    got = client(url).generate(PROMPTS[0], 12, [2])
    assert got.meta_info[V.ATTRIBUTABLE] is True and _own(got.meta_info) == _ledger(fake.ledger[-1])
    got = client(url, settle_s=0.05).generate(PROMPTS[1], 12, [2])
    assert got.meta_info[V.ATTRIBUTABLE] is False and "had not counted the request" in \
        got.meta_info[V.UNATTRIBUTABLE_REASON]


def test_several_in_flight_are_never_attributed(server) -> None:
    url, fake = server
    got = client(url).generate_many([(i, p) for i, p in enumerate(PROMPTS)], 8, [2], max_in_flight=2)
    for c in got.values():
        assert c.meta_info == V.concurrent_counters(2) and "--max-in-flight 1" in c.meta_info[V.UNATTRIBUTABLE_REASON]


# -- the pure parts -------------------------------------------------------------------------------------


def test_prometheus_text() -> None:
    text = ('# HELP vllm:x_total X.\n# TYPE vllm:x_total counter\n'
            'vllm:x_total{engine="0",model_name="a \\"b\\" \\\\c\\nd"} 3.0\n'
            'vllm:x_total{engine="1",model_name="m"} 4 1712345678000\n'
            'vllm:h_bucket{le="+Inf"} +Inf\nvllm:g NaN\nplain 1e3\n\n')
    fam = parse_exposition(text)
    assert fam["vllm:x_total"][0][0] == {"engine": "0", "model_name": 'a "b" \\c\nd'}
    assert total(fam, "vllm:x_total") == 7.0 and total(fam, "plain") == 1000.0 and total(fam, "missing") is None
    assert fam["vllm:h_bucket"][0][1] == float("inf")
    for bad in ("<html>502</html>", 'vllm:x_total{engine="0" 3', "vllm:x_total three"):
        with pytest.raises(ValueError):
            parse_exposition(bad)


def _snap(**values: float) -> V.Snapshot:
    base = {V.DRAFTS: 10.0, V.DRAFT_TOKENS: 30.0, V.ACCEPTED: 12.0, V.REQUEST_SUCCESS: 4.0,
            V.GENERATION_TOKENS: 50.0, V.PREEMPTIONS: 0.0, V.RUNNING: 0.0, V.WAITING: 0.0}
    return V.Snapshot({**base, **values}, {0: 6.0, 1: 4.0, 2: 2.0})


def test_attribution_rules() -> None:
    before = _snap()
    assert V.attribution_problem(before, _snap(**{V.REQUEST_SUCCESS: 5.0, V.GENERATION_TOKENS: 58.0}), 8) is None
    assert "went backwards" in V.attribution_problem(before, _snap(**{V.DRAFTS: 2.0, V.REQUEST_SUCCESS: 5.0}), 0)
    assert "restarted" in V.attribution_problem(before, _snap(**{V.RUNNING: None, V.REQUEST_SUCCESS: 5.0}), 0)
    assert "generated 9 tokens during it, the request 8" in V.attribution_problem(
        before, _snap(**{V.REQUEST_SUCCESS: 5.0, V.GENERATION_TOKENS: 59.0}), 8)
    assert "preempted 2 time(s)" in V.attribution_problem(
        _snap(**{V.PREEMPTIONS: 1.0}), _snap(**{V.REQUEST_SUCCESS: 5.0, V.GENERATION_TOKENS: 58.0, V.PREEMPTIONS: 3.0}), 8)
    assert "were waiting when it was sent" in V.attribution_problem(
        _snap(**{V.WAITING: 1.0}), _snap(**{V.REQUEST_SUCCESS: 5.0, V.GENERATION_TOKENS: 58.0}), 8)


def test_counter_rules(tmp_path) -> None:
    from dflash_cb.cache.manifest import SampleEntry
    from dflash_cb.cache.served import FLAGGED, SKIPPED, comparability, served_block_size

    ok = {V.DRAFTS: 4, V.DRAFT_TOKENS: 12, V.ACCEPTED: 5, V.PER_POSITION: [3, 1, 1], V.REQUEST_SUCCESS: 1,
          V.GENERATION_TOKENS: 10, V.ATTRIBUTABLE: True}

    def verdict(block: int | None = 4, **fields: Any):
        spec = {k: v for k, v in {**ok, **fields}.items() if v != "<drop>"}
        return comparability(SampleEntry("s", "c", "x", 5, 10, 15, "length", served_spec=spec), block)

    assert verdict() is None and verdict(None) is None
    for field, bad in [(V.DRAFTS, -1), (V.ACCEPTED, 2.5), (V.PER_POSITION, [1, "2"]), (V.ATTRIBUTABLE, "yes")]:
        kind, why = verdict(**{field: bad})
        assert kind == FLAGGED and why.startswith(f"malformed {field}: "), why
    assert verdict(**{V.ATTRIBUTABLE: False, V.UNATTRIBUTABLE_REASON: "x y"}) == (SKIPPED, "unattributable: x y")
    assert verdict(**{V.DRAFTS: 0})[0] == SKIPPED
    for fields, word in [({V.DRAFTS: 10}, "every round commits at least one token"),
                         ({V.ACCEPTED: 13, V.PER_POSITION: [4, 4, 4, 1]}, "accepted of 12 verified"),
                         ({V.PER_POSITION: [1, 3, 1]}, "accepted position j"),
                         ({V.PER_POSITION: [3, 1, 0]}, "adds up to 4"),
                         ({V.ACCEPTED: 3, V.PER_POSITION: [2, 1, 0]}, "at most its accepted drafts + 1")]:
        kind, why = verdict(**fields)
        assert kind == FLAGGED and word in why, (fields, why)
    kind, why = verdict(block=3)  # 12 drafts in 4 rounds cannot be blocks of 3
    assert kind == FLAGGED and "at most 2 drafts a round" in why
    kind, why = verdict(block=5)  # blocks of 5 propose 16: some rounds were trimmed
    assert kind == SKIPPED and "the server trimmed them" in why
    assert verdict(None, **{V.DRAFT_TOKENS: 11})[0] == SKIPPED  # 11 in 4 rounds: not one length
    assert served_block_size({"server": "vllm", "metrics_positions": 15}) == 16
    assert served_block_size({"server": "vllm", "algorithm": "dflash", "num_speculative_tokens": 7}) == 8
    assert served_block_size({"server": "vllm", "algorithm": "eagle3", "num_speculative_tokens": 7}) is None
    assert served_block_size({"server": "vllm", "algorithm": None}) is None
    assert V.accepted_per_position([0, 3, 1, 2], 3) == [3, 2, 1]
    assert V.mean_acceptance_length(5, 4) == 2.25


# -- the precompute through vLLM --------------------------------------------------------------------------


def _precompute(target_dir: Path, prompts: Path, out: Path, *extra: str) -> int:
    from dflash_cb.cache.precompute import main

    return main(["--target", str(target_dir), "--prompts", str(prompts), "--out", str(out), "--layers", "0,2,3",
                 "--max-new-tokens", "14", "--dtype", "float32", "--no-progress", *extra])


def _shards(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("states-*.safetensors"))}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "p.jsonl", random_prompts(5, (4, 16), seed=11),
                         ["math", "code"])


def test_precompute_through_vllm(server, target_dir, prompts, tmp_path) -> None:
    """A cache made through vLLM equals, shard for shard, one made with local greedy generation; the
    manifest records the request, the served model and, per sample, the counters under vLLM's names."""
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.states import StateCache

    url, fake = server
    assert _precompute(target_dir, prompts, tmp_path / "local", "--reference", "local") == 0
    assert _precompute(target_dir, prompts, tmp_path / "vllm", "--reference", "vllm", "--vllm-url", url) == 0
    assert _shards(tmp_path / "vllm") == _shards(tmp_path / "local") and len(_shards(tmp_path / "local")) == 5
    m = StateCache(tmp_path / "vllm").manifest
    assert m.reference["kind"] == "vllm" and m.reference["url"] == url
    assert m.reference["served_model"] == {"served_model_name": "Qwen/Qwen3-Tiny-Test", "model_path": str(target_dir),
                                           "max_model_len": 512}
    assert m.reference["sampling_params"]["max_tokens"] == 14 and m.reference["sampling_params"]["ignore_eos"] is True
    assert m.served_spec_config == {"server": "vllm", "metrics_exported": True, "metrics_positions": K}
    assert m.agreement["samples_fully_agreeing"] == 5
    for e, own in zip(m.samples, fake.ledger, strict=True):
        assert e.served_spec[V.ATTRIBUTABLE] is True and _own(e.served_spec) == _ledger(own)
    journal = [json.loads(line) for line in (tmp_path / "vllm" / JOURNAL_NAME).read_text().splitlines()]
    assert [j["served_spec"] for j in journal] == [e.served_spec for e in m.samples]
    # a complete cache is not asked again
    calls = fake.calls
    assert _precompute(target_dir, prompts, tmp_path / "vllm", "--reference", "vllm", "--vllm-url", url) == 0
    assert fake.calls == calls


def test_precompute_faults_lose_nothing(model, target_dir, prompts, tmp_path, monkeypatch) -> None:
    """503s, dropped connections and garbage JSON (after the server ran the request), an HTML /metrics:
    the precompute gets through; the cache, its counters and its journal are those of a clean run."""
    from dflash_cb.cache import vllm_client
    from dflash_cb.cache.manifest import MANIFEST_NAME
    from dflash_cb.cache.precompute import JOURNAL_NAME

    quick_retries(monkeypatch, vllm_client, "VLLMClient")  # the tool's 1 s doubling would idle 7 s here

    loop = simulated_drafts(model, K, _miss)
    clean = FakeVLLM(loop, served_name="Qwen/Qwen3-Tiny-Test", root=str(target_dir), num_spec_tokens=K)
    faulty = FakeVLLM(loop, served_name="Qwen/Qwen3-Tiny-Test", root=str(target_dir), num_spec_tokens=K,
                      fail_first=1, drop_first=1, garbage_first=1, metrics_garbage_first=1)
    outs = []
    for fake in (clean, faulty):
        with serve(fake) as url:
            out = tmp_path / f"c{len(outs)}"
            assert _precompute(target_dir, prompts, out, "--reference", "vllm", "--vllm-url", url) == 0
            outs.append((out, url))
    (a, url_a), (b, url_b) = outs
    assert faulty.calls == clean.calls + 3 and _shards(a) == _shards(b)
    # the same bytes but for the server's address
    assert (b / MANIFEST_NAME).read_text().replace(url_b, url_a) == (a / MANIFEST_NAME).read_text()
    assert (b / JOURNAL_NAME).read_bytes() == (a / JOURNAL_NAME).read_bytes()


def test_precompute_resumes_with_the_counters(server, target_dir, prompts, tmp_path, capsys) -> None:
    """A run that fails on one prompt keeps every answer before it, counters included; the rerun asks only
    for the others and ends with the cache an uninterrupted run makes."""
    from dflash_cb.cache.manifest import MANIFEST_NAME
    from dflash_cb.cache.precompute import JOURNAL_NAME

    url, fake = server
    args = ("--reference", "vllm", "--vllm-url", url)
    assert _precompute(target_dir, prompts, tmp_path / "whole", *args) == 0
    third = tuple(json.loads(prompts.read_text().splitlines()[2])["input_ids"])
    fake.unavailable.add(third)
    out = tmp_path / "resumed"
    capsys.readouterr()
    assert _precompute(target_dir, prompts, out, *args, "--server-retries", "0") == 2
    assert "rerun to resume" in capsys.readouterr().err and not (out / MANIFEST_NAME).exists()
    saved = [json.loads(line) for line in (out / JOURNAL_NAME).read_text().splitlines()]
    assert [j["id"] for j in saved] == ["p000", "p001"] and all(j["served_spec"][V.ATTRIBUTABLE] for j in saved)
    fake.unavailable.clear()
    asked = len(fake.ledger)
    assert _precompute(target_dir, prompts, out, *args) == 0
    assert len(fake.ledger) - asked == 3
    for name in (MANIFEST_NAME, JOURNAL_NAME):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_precompute_in_parallel_marks_every_sample(server, target_dir, prompts, tmp_path, capsys) -> None:
    from dflash_cb.cache.states import StateCache

    url, fake = server
    assert _precompute(target_dir, prompts, tmp_path / "p", "--reference", "vllm", "--vllm-url", url,
                       "--max-in-flight", "3") == 0
    assert "no sample's counters will be its own" in capsys.readouterr().err
    for e in StateCache(tmp_path / "p").samples:
        assert e.served_spec == V.concurrent_counters(3)


def test_precompute_needs_the_url(target_dir, prompts, tmp_path, capsys) -> None:
    assert _precompute(target_dir, prompts, tmp_path / "x", "--reference", "vllm") == 2
    assert "--reference vllm needs --vllm-url" in capsys.readouterr().err
    assert _precompute(target_dir, prompts, tmp_path / "x", "--reference", "vllm", "--vllm-url", "http://127.0.0.1:9",
                       "--server-retries", "0") == 2
    err = capsys.readouterr().err
    assert "vLLM server at http://127.0.0.1:9 is not reachable" in err and "--vllm-url" in err


def test_per_position_status() -> None:
    """vLLM's per-position layout against the replay's correct drafts per cycle [2, 0, 1] (entry j: rounds
    whose first j + 1 drafts were accepted: [2, 1, 0, 0]); when the last cycle's matches reached the end of
    the known completion the server may have accepted more there, one more at each position from 1 on."""
    from dflash_cb.core.results.served_check import CENSORED, DIFFERS, EQUAL, per_position_status

    assert per_position_status([2, 0, 1], False, [2, 1, 0, 0]) == EQUAL
    assert per_position_status([2, 0, 1], True, [2, 2, 1, 0]) == CENSORED  # the server accepted 3 there
    assert per_position_status([2, 0, 1], True, [2, 2, 0, 0]) == CENSORED  # or 2
    assert per_position_status([2, 0, 1], False, [2, 2, 0, 0]) == DIFFERS  # not at the end: a difference
    assert per_position_status([2, 0, 1], True, [2, 1, 1, 0]) == DIFFERS  # the first round differs
    assert per_position_status([2, 0, 1], True, [1, 0, 0, 0]) == DIFFERS  # fewer is never censoring


def test_the_wrong_reference_kind_and_urls_as_typed(server, tiny_sglang) -> None:
    """--reference sglang pointed at vLLM, and the reverse, are named as such; a URL without http:// or ending in
    /v1 reaches the server."""
    from dflash_cb.cache.sglang_client import SGLangClient, SGLangError

    url, _ = server
    with pytest.raises(SGLangError, match=r"a vLLM server\? use --reference vllm --vllm-url"):
        SGLangClient(url, max_retries=0).model_info()
    with pytest.raises(VLLMError, match="is an SGLang server .* use --reference sglang --sglang-url"):
        client(tiny_sglang).model_info()
    bare = url.removeprefix("http://")
    for typed in (bare, url + "/v1", url + "/v1/", url + "/"):
        c = client(typed)
        assert c.url == url and c.model_info()["served_model_name"] == "Qwen/Qwen3-Tiny-Test"


@pytest.fixture()
def tiny_sglang(model):
    from local_http import serve as serve_http
    from test_sglang_client import FakeSGLang, make_handler

    with serve_http(make_handler(FakeSGLang(model))) as url:
        yield url


def test_a_server_restart_is_said_to_be_one(server) -> None:
    """Counters that went backwards across a request (a restart): the sample is skipped for that reason by the
    served check, not flagged as malformed counts."""
    from dflash_cb.cache.served import comparability

    before = V.snapshot("vllm:request_success_total 60\nvllm:spec_decode_num_drafts_total 60\n")
    after = V.snapshot("vllm:request_success_total 1\nvllm:spec_decode_num_drafts_total 9\n")
    counters = V.request_counters(before, after, 12)
    assert counters[V.DRAFTS] == -51 and counters[V.ATTRIBUTABLE] is False

    class E:
        id, served_spec = "p", counters

    kind, why = comparability(E())
    assert kind == "skipped" and "went backwards" in why and "restarted" in why
