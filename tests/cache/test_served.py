"""The server's own speculative counters next to the offline replay (``--served-check``).

A real HTTP server on 127.0.0.1 speaks SGLang's native API and answers every ``/generate`` by
running a speculative loop that drafts full blocks and cuts after verification, as SGLang's DFlash
worker does (tests/support/full_block_loop.py, with the reference ``dflash.model.DFlashDraftModel``), with a
tiny target and a briefly trained drafter; its ``spec_verify_ct`` / ``spec_accept_length`` /
``spec_num_correct_drafts`` / ``spec_correct_drafts_histogram`` / ``num_retractions`` follow SGLang's
definitions (rounds; ``completion_tokens / spec_verify_ct``; correct drafts per round before the
cut). The precompute records them, the replay of the same drafter must count the same rounds and
the same histogram on every sample, another drafter must not.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import local_http
import pytest
import torch
from local_http import JSONHandler
from processes import sigkill_when
from served_world import BLOCK, LAYERS, MAX_NEW, N_PROMPTS, drafter_config, precompute, served_run
from served_world import edited_cache as _edited

from dflash_cb.core.results.results_file import load_results

ROOT = Path(__file__).resolve().parents[2]
_drafter_config, _precompute = drafter_config, precompute


@pytest.fixture(scope="module")
def world(served_world: dict[str, Any]) -> dict[str, Any]:
    """Tiny target, a local cache to train on, the served drafter (trained) and another one (untrained)."""
    return served_world


class SpecServer:
    """SGLang's native API backed by the reference speculative loop (one request at a time)."""

    def __init__(self, world: dict[str, Any]) -> None:
        self.w = world
        self.speculative = True
        self.delay = 0.0
        self.info: str = "ok"  # "ok" | "missing" (404, an older server) | "garbage" (not JSON)
        self.lock = threading.Lock()
        self.calls: Counter[tuple[int, ...]] = Counter()
        self.rounds: dict[tuple[int, ...], int] = {}  # what the loop counted, per prompt
        self.window: int | None = None  # --speculative-draft-window-size (reported only)
        self.retracted: set[tuple[int, ...]] = set()  # prompts retracted once (SGLang counts the round again)
        self.impossible: set[tuple[int, ...]] = set()  # prompts answered with more rounds than tokens
        self.bare: set[tuple[int, ...]] = set()  # prompts answered without counters
        self.block = BLOCK  # the block it drafts with (anchor included): SGLang's speculative_num_draft_tokens
        self.dflash_block: int | None = None  # --speculative-dflash-block-size (None: not given, as in SGLang)

    def server_info(self) -> dict[str, Any]:
        spec = self.speculative
        return {"model_path": str(self.w["target_dir"]), "tp_size": 1,
                "speculative_algorithm": "DFLASH" if spec else None,
                "speculative_draft_model_path": str(self.w["drafter"]) if spec else None,
                "speculative_num_draft_tokens": self.block if spec else None,
                "speculative_dflash_block_size": self.dflash_block if spec else None,
                "speculative_eagle_topk": 1 if spec else None, "speculative_num_steps": None,
                "speculative_draft_window_size": self.window, "page_size": 1}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        sp = body["sampling_params"]
        assert sp["temperature"] == 0
        ids = body["input_ids"]
        with self.lock:
            self.calls[tuple(ids)] += 1
            time.sleep(self.delay)
            run = served_run(self.w, ids, sp["max_new_tokens"], sp["stop_token_ids"], self.block)
        out = run.output_ids
        rounds = len(run.acceptance_lengths)
        self.rounds[tuple(ids)] = rounds
        meta: dict[str, Any] = {"finish_reason": {"type": "stop" if out[-1] in sp["stop_token_ids"] else "length"},
                                "prompt_tokens": len(ids), "completion_tokens": len(out), "num_retractions": 0}
        hist = [0] * (max(run.correct_drafts, default=0) + 1)
        for k in run.correct_drafts:
            hist[k] += 1
        if tuple(ids) in self.retracted:  # the retracted request ran one round again: SGLang counts both
            meta["num_retractions"] = 1
            rounds += 1
            hist[0] += 1
        if tuple(ids) in self.impossible:
            rounds = len(out) + 3
            hist[0] += rounds - sum(hist)
        if self.speculative and rounds > 0 and tuple(ids) not in self.bare:  # only after a verification round
            correct = sum(k * v for k, v in enumerate(hist))
            meta.update(spec_verify_ct=rounds, spec_accept_length=len(out) / rounds,
                        spec_num_correct_drafts=correct, spec_num_proposed_drafts=rounds * (self.block - 1),
                        spec_accept_rate=correct / (rounds * (self.block - 1)), spec_correct_drafts_histogram=hist)
        return {"text": "", "output_ids": out, "meta_info": meta}


@contextlib.contextmanager
def serve(world: dict[str, Any]) -> Iterator[tuple[str, SpecServer]]:
    state = SpecServer(world)

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_json({})
            elif self.path == "/get_model_info":
                self.send_json({"model_path": str(world["target_dir"]), "is_generation": True})
            elif self.path == "/get_server_info" and state.info == "ok":
                self.send_json(state.server_info())
            elif self.path == "/get_server_info" and state.info == "garbage":
                self.send_bytes(200, b"<html>oops", ctype="text/html")
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            self.send_json(state.generate(self.read_json()))

    with local_http.serve(Handler) as url:
        yield url, state


@pytest.fixture()
def server(world) -> Iterator[tuple[str, SpecServer]]:
    with serve(world) as got:
        yield got


def _sglang_args(world: dict[str, Any], url: str, out: Path) -> list[str]:
    return ["--target", str(world["target_dir"]), "--prompts", str(world["prompts"]), "--out", str(out),
            "--reference", "sglang", "--sglang-url", url, "--max-in-flight", "1"]


def _eval(world: dict[str, Any], cache: Path, drafter: Path, out: Path, *extra: str) -> int:
    from dflash_cb.common.cli import run
    from dflash_cb.integrations.cli import eval_drafter as eval_drafter

    return run(eval_drafter.main, ["--states", str(cache), "--drafter", str(drafter), "--out", str(out),
                                   "--ddtree-budgets", "", "--served-check", *extra])


def _prompt_keys(world: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(json.loads(line)["input_ids"]) for line in world["prompts"].read_text().splitlines()]


@pytest.fixture(scope="module")
def served_cache(world, tmp_path_factory) -> dict[str, Any]:
    """One precompute against the speculative server (module scope: several tests read it)."""
    with serve(world) as (url, state):
        out = tmp_path_factory.mktemp("sg") / "served"
        assert _precompute(*_sglang_args(world, url, out)) == 0
        return dict(out=out, rounds=dict(state.rounds), url=url)


def test_precompute_records_the_served_counters(world, served_cache) -> None:
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.states import StateCache

    cache = StateCache(served_cache["out"])
    m = cache.manifest
    assert m.served_spec_config == {"algorithm": "DFLASH", "draft_model_path": str(world["drafter"]),
                                    "num_draft_tokens": BLOCK, "dflash_block_size": None, "topk": 1, "num_steps": None,
                                    "draft_window_size": None, "page_size": 1,
                                    # the served draft folder is readable here: what it holds is recorded
                                    "draft_folder": {"mask_embedding": False, "input_embedding_scale": None}}
    prompts = [json.loads(line)["input_ids"] for line in world["prompts"].read_text().splitlines()]
    assert len(m.samples) == N_PROMPTS
    for e, p in zip(m.samples, prompts, strict=True):
        assert e.served_spec is not None and e.served_spec["spec_verify_ct"] == served_cache["rounds"][tuple(p)]
        # every spec_* field is kept, whatever its name
        assert set(e.served_spec) == {"spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts",
                                      "spec_num_proposed_drafts", "spec_accept_rate",
                                      "spec_correct_drafts_histogram", "num_retractions"}
        assert e.served_spec["spec_accept_length"] == pytest.approx(e.completion_len / e.served_spec["spec_verify_ct"])
    journal = [json.loads(line) for line in (served_cache["out"] / JOURNAL_NAME).read_text().splitlines()]
    assert [j["served_spec"] for j in journal] == [e.served_spec for e in m.samples]


def test_served_check_same_drafter_equal_rounds(world, served_cache, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert _eval(world, served_cache["out"], world["drafter"], out) == 0
    res = load_results(out)
    check = res.breakdown["served_check"]
    s = check["summary"]
    assert s["samples_compared"] == N_PROMPTS and s["samples_equal_rounds"] == N_PROMPTS and not check["skipped"]
    offline = {x.id: x.acceptance_lengths for x in res.samples}
    assert any(n > 1 for v in offline.values() for n in v)  # not a drafter that never gets a token right
    # the correct-draft histograms agree sample by sample (a last round that matched to the end of the
    # completion may have matched more on the server: equal as a lower bound)
    assert s["samples_with_histogram"] == s["samples_equal_histogram"] == N_PROMPTS and s["comparable"]
    assert s["offline_correct_drafts"] <= s["served_correct_drafts"]
    for x in check["samples"]:
        assert x["offline_rounds"] == x["served_rounds"] == len(offline[x["id"]])
        assert x["histogram"] in ("equal", "equal_censored")
        assert x["convention"] == "with_prefill_token"
        assert x["served_tau"] == pytest.approx(x["offline_tau"])
    assert s["offline_tau"] == pytest.approx(res.tau) and s["served_tau"] == pytest.approx(res.tau)
    assert s["mean_abs_tau_diff"] == pytest.approx(0.0)
    assert s["tau_diff_interval"] == [0.0, 0.0, 0.0]
    text = capsys.readouterr().out
    assert f"equal round counts {N_PROMPTS}/{N_PROMPTS}" in text and "differs" not in text
    assert f"correct-draft histograms equal {N_PROMPTS}/{N_PROMPTS}" in text


def test_served_check_other_drafter_reports_the_difference(world, served_cache, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert _eval(world, served_cache["out"], world["other"], out) == 0
    check = load_results(out).breakdown["served_check"]
    s = check["summary"]
    assert s["samples_compared"] == N_PROMPTS and s["samples_equal_rounds"] < N_PROMPTS
    assert s["offline_tau"] < s["served_tau"] and s["mean_abs_tau_diff"] > 0
    assert s["samples_equal_histogram"] < N_PROMPTS and s["offline_correct_drafts"] < s["served_correct_drafts"]
    assert any("not obviously the evaluated drafter" in w for w in check["warnings"])
    text = capsys.readouterr().out
    assert "<- differs" in text


def test_served_check_refuses_reference_tail_blocks(world, served_cache, tmp_path, capsys) -> None:
    capsys.readouterr()
    assert _eval(world, served_cache["out"], world["drafter"], tmp_path / "r.json", "--tail-blocks", "reference") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tail-blocks served" in err and not (tmp_path / "r.json").exists()


def test_server_without_counters(world, server, tmp_path, capsys) -> None:
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.states import StateCache

    url, state = server
    state.speculative = False
    out = tmp_path / "plain"
    assert _precompute(*_sglang_args(world, url, out)) == 0
    m = StateCache(out).manifest
    assert all(e.served_spec is None for e in m.samples)
    assert m.served_spec_config["algorithm"] is None
    journal = [json.loads(line) for line in (out / JOURNAL_NAME).read_text().splitlines()]
    assert all(set(j) == {"id", "request_sha256", "output_ids", "finish_reason"} for j in journal)  # no served_spec key
    capsys.readouterr()
    assert _eval(world, out, world["drafter"], tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "nothing to compare" in err
    assert "--speculative-algorithm" in err and not (tmp_path / "r.json").exists()


@pytest.mark.e2e
def test_sigkill_during_queries_keeps_the_counters(world, server, tmp_path) -> None:
    from dflash_cb.cache.manifest import MANIFEST_NAME
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.states import StateCache

    url, state = server
    reference = tmp_path / "uninterrupted"  # same server (its URL is in the manifest)
    assert _precompute(*_sglang_args(world, url, reference)) == 0
    state.calls.clear()
    state.delay = 0.15  # slow answers, so the kill lands between two of them
    out = tmp_path / "killed"
    args = _sglang_args(world, url, out) + ["--layers", ",".join(map(str, LAYERS)), "--dtype", "float32",
                                            "--max-new-tokens", str(MAX_NEW), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "precompute_states.py"), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    journal = out / JOURNAL_NAME
    # The first journaled answer: with answers journaled as they arrive the kill lands between two
    # queries; a client that hands them over all at once puts it just after the last query.
    sigkill_when(proc, lambda: journal.is_file() and journal.read_bytes().count(b"\n") >= 1, timeout=120)
    assert not (out / MANIFEST_NAME).exists()
    saved = [json.loads(line) for line in journal.read_text().splitlines()]
    assert 1 <= len(saved) <= N_PROMPTS and all("spec_verify_ct" in j["served_spec"] for j in saved)
    asked = dict(state.calls)
    state.delay = 0.0
    assert _precompute(*_sglang_args(world, url, out)) == 0
    # the journaled completions were not asked again, and their counters made it into the manifest
    prompts = [json.loads(line)["input_ids"] for line in world["prompts"].read_text().splitlines()]
    by_id = {f"p{i:03d}": tuple(p) for i, p in enumerate(prompts)}
    for j in saved:
        assert state.calls[by_id[j["id"]]] == asked[by_id[j["id"]]]
    assert (out / MANIFEST_NAME).read_bytes() == (reference / MANIFEST_NAME).read_bytes()
    assert (out / JOURNAL_NAME).read_bytes() == (reference / JOURNAL_NAME).read_bytes()
    assert all(e.served_spec["spec_verify_ct"] >= 1 for e in StateCache(out).samples)


# -- the pure part ----------------------------------------------------------------------------------


def test_counters_parsing_and_convention() -> None:
    from dflash_cb.cache.served import (
        ServedCheckError,
        convention_of,
        served_counters,
        served_rounds_and_tau,
        server_spec_config,
        verify_rounds,
    )

    assert served_counters({"finish_reason": {"type": "stop"}, "completion_tokens": 3}) is None
    assert served_counters(None) is None
    got = served_counters({"spec_verify_ct": 4, "spec_accept_length": 2.5, "spec_new_name": [1, 2],
                           "spec_bad": math.nan, "completion_tokens": 10})
    assert got == {"spec_accept_length": 2.5, "spec_new_name": [1, 2], "spec_verify_ct": 4}
    # 10 tokens in 4 rounds: SGLang says 2.5 (it counts the prefill's token), the replay's tau is 9 / 4
    assert served_rounds_and_tau(got, 10) == (4, 2.25)
    assert convention_of(got, 10) == "with_prefill_token"
    assert convention_of({"spec_verify_ct": 4, "spec_accept_length": 2.25}, 10) == "rounds_only"
    assert convention_of({"spec_verify_ct": 4}, 10) == "unknown"
    assert verify_rounds({"spec_verify_ct": 0}) is None and verify_rounds({"spec_verify_ct": "3"}) is None
    assert verify_rounds({"spec_verify_ct": 3.0}) == 3 and verify_rounds(None) is None
    with pytest.raises(ServedCheckError, match="spec_verify_ct = 0"):
        served_rounds_and_tau({"spec_verify_ct": 0}, 5)
    assert server_spec_config({"tp_size": 2}) is None
    assert server_spec_config({"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 16,
                               "speculative_eagle_topk": 1}) == {"algorithm": "DFLASH", "num_draft_tokens": 16,
                                                                 "topk": 1}


def test_old_manifest_loads_and_served_baseline(served_cache) -> None:
    from dflash_cb.cache.manifest import MANIFEST_NAME, Manifest
    from dflash_cb.cache.served import served_tau
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import baseline_scalars, load_served

    data = json.loads((served_cache["out"] / MANIFEST_NAME).read_text())
    data.pop("served_spec_config")
    for s in data["samples"]:
        s.pop("served_spec")
    old = Manifest.from_dict(data)  # a manifest written before these fields existed
    assert old.served_spec_config is None and all(s.served_spec is None for s in old.samples)

    cache = StateCache(served_cache["out"])
    b = load_served(cache)
    assert b is not None and b.label == "drafter-served (served, measured online)"
    want = sum(e.completion_len - 1 for e in cache.samples) / sum(e.served_spec["spec_verify_ct"]
                                                                    for e in cache.samples)
    assert baseline_scalars([b], "dflash_eval/") == {"dflash_eval/baseline/served/tau": pytest.approx(want)}
    sub = [cache.samples[0].id]
    assert served_tau(cache.samples, sub)[0] == pytest.approx(
        (cache.samples[0].completion_len - 1) / cache.samples[0].served_spec["spec_verify_ct"])


def test_only_fully_agreeing_samples_with_counters_are_compared(served_cache) -> None:
    import dataclasses

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.served_check import compare

    entries = StateCache(served_cache["out"]).samples
    cut = dataclasses.replace(entries[0], valid_len=entries[0].prompt_len + 3)  # CPU and server part ways
    bare = dataclasses.replace(entries[1], served_spec=None)
    offline = {e.id: [1] * e.served_spec["spec_verify_ct"] for e in entries}
    check = compare([cut, bare, *entries[2:]], offline, {"num_draft_tokens": BLOCK + 2}, drafter_block_size=BLOCK)
    assert [s.id for s in check.samples] == [e.id for e in entries[2:]]
    assert "completion offset 3" in check.skipped[cut.id] and "no served counters" in check.skipped[bare.id]
    assert check.summary()["samples_equal_rounds"] == len(entries) - 2 and check.summary()["samples_skipped"] == 2
    assert any("not comparable" in w for w in check.warnings)  # the server drafts another block size


@pytest.mark.e2e
def test_callback_logs_the_served_tau(world, served_cache, tmp_path) -> None:
    import csv

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger

    from dflash_cb import DFlashEvalCallback
    from dflash_cb.cache.served import served_tau
    from dflash_cb.cache.states import StateCache
    from dflash_cb.demo.lightning_module import CachedStatesDataModule, DFlashDrafterModule

    cache = StateCache(served_cache["out"])
    want = served_tau(cache.samples)[0]
    seed_everything(0, verbose=False)
    module = DFlashDrafterModule(_drafter_config(cache.manifest.vocab_size, cache.manifest.hidden_size),
                                 str(cache.path), lr=1e-2, anchors_per_sample=8)
    cb = DFlashEvalCallback(states=cache.path, every_n_train_steps=1, ddtree_budgets=[])
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = Trainer(max_steps=1, accelerator="cpu", devices=1, logger=logger, callbacks=[cb],
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      log_every_n_steps=1, default_root_dir=str(tmp_path))
    trainer.fit(module, CachedStatesDataModule(str(cache.path), batch_size=2))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = [float(r["dflash_eval/baseline/served/tau"]) for r in csv.DictReader(f)
                  if r.get("dflash_eval/baseline/served/tau")]
    assert logged and all(v == pytest.approx(want) for v in logged)
    assert any(b.label.endswith("(served, measured online)") for b in cb.evaluator.session.baselines)
    assert cb.evaluator.describe()["tail_blocks"] == "served"  # the run's logged config says which tail convention


def test_server_info_is_optional(server) -> None:
    from dflash_cb.cache.served import server_spec_config
    from dflash_cb.cache.sglang_client import SGLangClient

    url, state = server
    client = SGLangClient(url, max_retries=0)
    assert server_spec_config(client.server_info())["algorithm"] == "DFLASH"
    for kind in ("missing", "garbage"):  # an older server, a proxy's error page: no config, no failure
        state.info = kind
        assert client.server_info() == {} and server_spec_config(client.server_info()) is None


def test_reused_journal_keeps_the_counters(world, served_cache, tmp_path) -> None:
    from dflash_cb.cache.precompute import JOURNAL_NAME
    from dflash_cb.cache.states import StateCache

    out = tmp_path / "from_file"
    assert _precompute("--target", str(world["target_dir"]), "--prompts", str(world["prompts"]), "--out", str(out),
                       "--reference", "file", "--completions", str(served_cache["out"] / JOURNAL_NAME)) == 0
    got = StateCache(out).manifest
    assert got.served_spec_config is None  # the file does not say which server it came from
    assert [e.served_spec for e in got.samples] == [e.served_spec for e in StateCache(served_cache["out"]).samples]


def test_retracted_impossible_and_bare_samples(world, server, tmp_path, capsys) -> None:
    """A retracted request is skipped with the reason, counters that cannot be are flagged (never a
    difference), and a --sample-ids selection with no counters stops before the evaluation; the
    callback's served baseline counts exactly the samples the check compares."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_served

    url, state = server
    keys = _prompt_keys(world)
    state.retracted, state.impossible, state.bare = {keys[0]}, {keys[1]}, {keys[2]}
    out = tmp_path / "odd"
    assert _precompute(*_sglang_args(world, url, out)) == 0
    cache = StateCache(out)
    ids = [f"p{i:03d}" for i in range(N_PROMPTS)]  # the prompt file's ids, in its order
    spec = {e.id: e.served_spec for e in cache.samples}
    assert spec[ids[0]]["num_retractions"] == 1 and spec[ids[3]]["num_retractions"] == 0 and spec[ids[2]] is None
    capsys.readouterr()
    assert _eval(world, out, world["drafter"], tmp_path / "bare.json", "--sample-ids", ids[2]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none of the 1 selected" in err and "no served counters" in err
    assert not (tmp_path / "bare.json").exists()
    assert _eval(world, out, world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    s = check["summary"]
    assert "num_retractions" in check["skipped"][ids[0]] and "no served counters" in check["skipped"][ids[2]]
    assert list(check["flagged"]) == [ids[1]] and "every round commits at least one token" in check["flagged"][ids[1]]
    assert s["samples_compared"] == s["samples_equal_rounds"] == s["samples_equal_histogram"] == N_PROMPTS - 3
    assert s["samples_flagged"] == 1 and s["samples_skipped"] == 2
    text = capsys.readouterr().out
    assert f"flagged {ids[1]}: impossible spec_verify_ct" in text and "differs" not in text
    served = load_served(cache)
    assert served is not None and served.details["samples"] == s["samples_compared"]
    assert served.metrics["tau"] == pytest.approx(s["served_tau"])


def test_draft_window_makes_the_check_not_comparable(world, server, tmp_path, capsys) -> None:
    """A draft window shorter than the samples changes the server's drafts: one warning naming the
    setting, the check marked not comparable, no mismatch reported."""
    url, state = server
    state.window = 4
    out = tmp_path / "windowed"
    assert _precompute(*_sglang_args(world, url, out)) == 0
    capsys.readouterr()
    assert _eval(world, out, world["other"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert check["server"]["draft_window_size"] == 4 and not check["summary"]["comparable"]
    assert len(check["not_comparable"]) == 1 and "--speculative-draft-window-size 4" in check["not_comparable"][0]
    assert sum("not comparable" in w for w in check["warnings"]) == 1
    assert check["summary"]["samples_equal_rounds"] < N_PROMPTS  # the drafts differ, and that is not a mismatch
    text = capsys.readouterr().out
    assert "NOT COMPARABLE" in text and "<- differs" not in text and "paired 95% interval" not in text


def test_served_definitions_pure(tmp_path) -> None:
    from dflash_cb.cache.served import (
        draft_folder_settings,
        histogram_of,
        impossible_counters,
        incomparable_settings,
    )
    from dflash_cb.core.results.served_check import CENSORED, DIFFERS, EQUAL, histogram_status

    assert histogram_of([0, 2, 2, 1]) == [1, 1, 2] and histogram_of([]) == []
    assert histogram_status([0, 2, 2, 1], False, [1, 1, 2, 0]) == EQUAL  # trailing zeros do not matter
    # the last round matched up to the end of the completion: the server may have counted more there
    assert histogram_status([0, 2, 2, 1], True, [1, 0, 2, 0, 1]) == CENSORED
    assert histogram_status([0, 2, 2, 1], False, [1, 0, 2, 0, 1]) == DIFFERS
    assert histogram_status([0, 2, 2, 3], True, [1, 0, 3]) == DIFFERS  # fewer than the replay saw: no
    ok = {"spec_verify_ct": 3, "spec_num_correct_drafts": 4, "spec_correct_drafts_histogram": [1, 0, 2]}
    assert impossible_counters(ok, 8) is None
    assert "every round commits" in impossible_counters(ok, 3)
    assert "counts 4 rounds" in impossible_counters({**ok, "spec_correct_drafts_histogram": [2, 0, 2]}, 8)
    assert "adds up to 4" in impossible_counters({**ok, "spec_num_correct_drafts": 5}, 9)
    assert "at most its correct drafts + 1" in impossible_counters(ok, 9)  # 8 tokens from 3 rounds, 4 correct
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dflash_config": {"input_embedding_scale": 2.0}}))
    assert draft_folder_settings(str(drafter)) == {"mask_embedding": False, "input_embedding_scale": 2.0}
    assert draft_folder_settings("org/a-hub-id") is None
    (drafter / "mask_embedding.pt").write_bytes(b"")
    got = incomparable_settings({"draft_folder": draft_folder_settings(str(drafter))}, 100)
    assert len(got) == 2 and "mask_embedding.pt" in got[0] and "input_embedding_scale 2" in got[1]
    assert incomparable_settings({"draft_window_size": 128, "page_size": 16}, 100) == []  # the window covers all
    assert "page size 16" in incomparable_settings({"draft_window_size": 64, "page_size": 16}, 100)[0]
    assert "input_embedding_scale 0.5" in incomparable_settings(None, 10, drafter_input_embedding_scale=0.5)[0]


def test_one_definition_of_comparable_samples(served_cache) -> None:
    """The callback's served baseline and --served-check count the same samples: a sample whose CPU
    prefill left the served path (or that was retracted) is in neither."""
    import dataclasses

    from dflash_cb.cache.served import served_tau
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.served_check import compare

    entries = StateCache(served_cache["out"]).samples
    cut = dataclasses.replace(entries[0], valid_len=entries[0].prompt_len + 3)
    retracted = dataclasses.replace(entries[1], served_spec={**entries[1].served_spec, "num_retractions": 2})
    mixed = [cut, retracted, *entries[2:]]
    check = compare(mixed, {e.id: [1] * e.served_spec["spec_verify_ct"] for e in entries})
    tau, rounds, n = served_tau(mixed)
    assert n == len(check.samples) == len(entries) - 2 and rounds == check.summary()["served_rounds"]
    assert tau == pytest.approx(check.summary()["served_tau"])


# -- the server's block size --------------------------------------------------------------------------

SMALL = 4  # a served block shorter than the drafter's BLOCK


def _drafter_at_block(world: dict[str, Any], block: int, out: Path) -> Path:
    """The served drafter's weights in a folder whose config declares another trained block."""
    import shutil

    shutil.copytree(world["drafter"], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["block_size"] = block
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def small_served(world, tmp_path_factory) -> dict[str, Any]:
    """A precompute against a server started with --speculative-dflash-block-size SMALL (it drafts blocks
    of SMALL with the BLOCK drafter and reports both settings, as SGLang resolves them)."""
    with serve(world) as (url, state):
        state.block = state.dflash_block = SMALL
        out = tmp_path_factory.mktemp("sg_small") / "served"
        assert _precompute(*_sglang_args(world, url, out)) == 0
        return dict(out=out, rounds=dict(state.rounds))


def test_served_check_replays_at_the_servers_smaller_block(world, small_served, tmp_path, capsys) -> None:
    """The server drafted blocks of SMALL with a BLOCK drafter: the manifest records the block, and the
    check replays at it: every sample's rounds and histogram equal, comparable; results and the
    printed summary name both blocks. A --block-size other than the server's is refused."""
    from dflash_cb.cache.states import StateCache

    config = StateCache(small_served["out"]).manifest.served_spec_config
    assert config["num_draft_tokens"] == config["dflash_block_size"] == SMALL
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert _eval(world, small_served["out"], world["drafter"], out) == 0
    res = load_results(out)
    check = res.breakdown["served_check"]
    s = check["summary"]
    assert s["comparable"] and not check["not_comparable"]
    assert s["samples_compared"] == s["samples_equal_rounds"] == s["samples_equal_histogram"] == N_PROMPTS
    assert check["blocks"] == {"replay": SMALL, "server": SMALL, "drafter": BLOCK, "server_from": "configuration"}
    assert res.meta["block_size"] == SMALL and res.meta["drafter_block_size"] == BLOCK
    assert max(n for x in res.samples for n in x.acceptance_lengths) <= SMALL
    text = capsys.readouterr().out
    assert f"blocks: replay {SMALL}, server {SMALL} (its recorded configuration: /get_server_info or /server_info), drafter {BLOCK}" in text and "differs" not in text
    assert f"block    {SMALL} (the drafter's is {BLOCK})" in text
    assert _eval(world, small_served["out"], world["drafter"], tmp_path / "b.json", "--block-size", "5") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--block-size 5" in err and f"blocks of {SMALL}" in err
    assert not (tmp_path / "b.json").exists()


def test_served_block_not_recorded(world, small_served, tmp_path, capsys) -> None:
    """Without the server's settings (an older server) the check replays at the drafter's block and the
    rounds differ; the counters hint at the server's block, and --block-size SMALL makes them equal."""
    def forget(m: dict) -> None:
        m["served_spec_config"] = None

    cache = _edited(small_served["out"], tmp_path / "unknown", forget)
    capsys.readouterr()
    assert _eval(world, cache, world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert check["blocks"] == {"replay": BLOCK, "server": None, "drafter": BLOCK, "server_from": None}
    assert check["summary"]["samples_equal_histogram"] < N_PROMPTS
    assert any(f"rerun with --block-size {SMALL}" in w for w in check["warnings"])
    assert _eval(world, cache, world["drafter"], tmp_path / "s.json", "--block-size", str(SMALL)) == 0
    s = load_results(tmp_path / "s.json").breakdown["served_check"]["summary"]
    assert s["samples_equal_rounds"] == s["samples_equal_histogram"] == N_PROMPTS and s["comparable"]


def test_server_block_larger_than_the_drafters(world, served_cache, tmp_path, capsys) -> None:
    """The server drafted blocks of BLOCK, the evaluated drafter declares SMALL: the replay cannot draft
    that long, so the check is NOT COMPARABLE, naming both sizes; with the server's settings not
    recorded, counters that prove rounds longer than SMALL tokens do the same."""
    drafter = _drafter_at_block(world, SMALL, tmp_path / "d4")
    capsys.readouterr()
    assert _eval(world, served_cache["out"], drafter, tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert not check["summary"]["comparable"] and len(check["not_comparable"]) == 1
    assert f"blocks of {BLOCK} tokens" in check["not_comparable"][0] and f"block of {SMALL}" in check["not_comparable"][0]
    text = capsys.readouterr().out
    assert "NOT COMPARABLE" in text and "<- differs" not in text

    def forget(m: dict) -> None:
        m["served_spec_config"] = None

    cache = _edited(served_cache["out"], tmp_path / "unknown", forget)
    assert _eval(world, cache, drafter, tmp_path / "u.json") == 0
    check = load_results(tmp_path / "u.json").breakdown["served_check"]
    assert not check["summary"]["comparable"] and len(check["not_comparable"]) == 1
    assert "not recorded" in check["not_comparable"][0] and f"replay's blocks of {SMALL}" in check["not_comparable"][0]


# -- malformed and impossible counters ------------------------------------------------------------------


@pytest.mark.parametrize("value", [[1, 2], "spec_verify_ct=3", 7])
def test_served_spec_of_the_wrong_shape(world, served_cache, tmp_path, capsys, value) -> None:
    """A manifest whose ``served_spec`` is not an object: the cache reader (and so --served-check and the
    evaluator's setup) refuses it in one line naming the manifest and the sample."""
    from dflash_cb.cache.manifest import MANIFEST_NAME, CacheError
    from dflash_cb.cache.states import StateCache
    from dflash_cb.integrations.evaluator.live import LiveEvaluator

    def damage(m: dict) -> None:
        m["samples"][1]["served_spec"] = value

    cache = _edited(served_cache["out"], tmp_path / "bad", damage)
    sid = json.loads((cache / MANIFEST_NAME).read_text())["samples"][1]["id"]
    with pytest.raises(CacheError, match=rf"{MANIFEST_NAME}: sample '{sid}': malformed served_spec: a "
                                         rf"{type(value).__name__}"):
        StateCache(cache)
    capsys.readouterr()
    assert _eval(world, cache, world["drafter"], tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(cache / MANIFEST_NAME) in err and repr(sid) in err
    assert "malformed served_spec" in err and not (tmp_path / "r.json").exists()
    with pytest.raises(CacheError, match=rf"sample '{sid}': malformed served_spec"):
        LiveEvaluator(states=str(cache)).setup(drafter=torch.nn.Linear(1, 1))


@pytest.mark.parametrize("value", [-3, "9", None, True])
def test_malformed_round_count_on_every_sample(world, served_cache, tmp_path, capsys, value) -> None:
    """spec_verify_ct that no server sends, on every sample: flagged as malformed with the field named,
    not 'no sample holds the server's counters'; one line, exit 2, before any weights are read."""
    def damage(m: dict) -> None:
        for x in m["samples"]:
            x["served_spec"]["spec_verify_ct"] = value

    cache = _edited(served_cache["out"], tmp_path / "bad", damage)
    capsys.readouterr()
    assert _eval(world, cache, world["drafter"], tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing to compare" not in err and "no served counters" not in err
    assert f"{N_PROMPTS} x malformed spec_verify_ct" in err and f"malformed spec_verify_ct: {value!r}" in err


def test_malformed_and_missing_counters_per_sample(world, served_cache, tmp_path, capsys) -> None:
    """Per sample: -3, "9", 2.5 rounds and a string num_retractions are flagged as malformed, naming the
    field (never 'no served counters', never compared); a missing spec_accept_length is said to be
    missing (not 'does not fit') and its rounds are still compared. The callback's served baseline
    counts exactly the compared samples."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.results.baselines import load_served

    def damage(m: dict) -> None:
        s = m["samples"]
        s[0]["served_spec"]["spec_verify_ct"] = -3
        s[1]["served_spec"]["spec_verify_ct"] = "9"
        s[2]["served_spec"]["spec_verify_ct"] = 2.5
        s[3]["served_spec"]["num_retractions"] = "0"
        del s[4]["served_spec"]["spec_accept_length"]

    cache = _edited(served_cache["out"], tmp_path / "bad", damage)
    ids = [e.id for e in StateCache(cache).samples]
    capsys.readouterr()
    assert _eval(world, cache, world["drafter"], tmp_path / "r.json") == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    assert sorted(check["flagged"]) == ids[:4] and not check["skipped"]
    for sid, field in zip(ids[:4], ["spec_verify_ct"] * 3 + ["num_retractions"], strict=True):
        assert check["flagged"][sid].startswith(f"malformed {field}: "), check["flagged"][sid]
    s = check["summary"]
    assert s["samples_compared"] == s["samples_equal_rounds"] == 2 and s["samples_flagged"] == 4
    assert not any("does not fit" in w for w in check["warnings"])
    assert any(f"1 sample(s) have no spec_accept_length (e.g. {ids[4]})" in w for w in check["warnings"])
    text = capsys.readouterr().out
    assert f"flagged {ids[2]}: malformed spec_verify_ct: 2.5" in text and "no served counters" not in text
    served = load_served(StateCache(cache))
    assert served is not None and served.details["samples"] == 2


def test_counter_rules_pure(served_cache) -> None:
    """The neighbours, on the one rule (``comparability``): each malformed field is named; 0 rounds is a
    request without a round (skipped); a histogram or round longer than the server's block is impossible."""
    import dataclasses

    from dflash_cb.cache.served import FLAGGED, SKIPPED, comparability, served_block_size, served_spec_problem
    from dflash_cb.cache.states import StateCache

    e = StateCache(served_cache["out"]).samples[0]
    assert comparability(e) is None and comparability(e, BLOCK) is None

    def verdict(block: int | None = None, **fields: Any) -> tuple[str, str] | None:
        spec = {k: v for k, v in {**e.served_spec, **fields}.items() if v != "<drop>"}
        return comparability(dataclasses.replace(e, served_spec=spec), block)

    for field, bad in [("spec_verify_ct", 3.5), ("spec_verify_ct", float("nan")), ("num_retractions", -1),
                       ("num_retractions", 1.5), ("spec_num_correct_drafts", -1), ("spec_num_correct_drafts", "4"),
                       ("spec_correct_drafts_histogram", "x"), ("spec_correct_drafts_histogram", [1, -1]),
                       ("spec_correct_drafts_histogram", None), ("spec_accept_length", "2.5"),
                       ("spec_accept_length", -1.0), ("spec_accept_length", True)]:
        kind, why = verdict(**{field: bad})
        assert kind == FLAGGED and why.startswith(f"malformed {field}: "), (field, bad, why)
    assert verdict(spec_verify_ct=0)[0] == SKIPPED and verdict(spec_verify_ct="<drop>")[0] == SKIPPED
    assert verdict(spec_accept_length="<drop>") is None  # only the shown accept length is missing
    assert verdict(num_retractions=2)[0] == SKIPPED
    rounds = e.served_spec["spec_verify_ct"]
    top = len(e.served_spec["spec_correct_drafts_histogram"]) - 1
    kind, why = verdict(block=top)  # a server block too short for the recorded histogram
    assert kind == FLAGGED and why.startswith("impossible spec_correct_drafts_histogram: ") and f"blocks of {top}" in why
    assert verdict(block=top + 1) is None
    kind, why = comparability(dataclasses.replace(e, served_spec=[1]))
    assert kind == FLAGGED and why.startswith("malformed served_spec: a list")
    assert served_spec_problem(None) is None and served_spec_problem({}) is None
    assert "a str" in served_spec_problem("x") and "a dict" in served_spec_problem({1: 2})
    assert rounds > 0
    # The server's block: --speculative-dflash-block-size or the draft tokens, for DFlash only.
    assert served_block_size({"algorithm": "DFLASH", "num_draft_tokens": 8, "dflash_block_size": None}) == 8
    assert served_block_size({"algorithm": "DFLASH", "num_draft_tokens": 8, "dflash_block_size": 8}) == 8
    assert served_block_size({"num_draft_tokens": 8}) == 8  # the algorithm not recorded: the draft tokens
    assert served_block_size({"algorithm": "EAGLE", "num_draft_tokens": 8}) is None
    assert served_block_size({"algorithm": None, "num_draft_tokens": None}) is None
    assert served_block_size({"algorithm": "DFLASH", "num_draft_tokens": True}) is None
    assert served_block_size(None) is None and served_block_size([8]) is None


def test_each_family_names_the_methods_a_server_serves_it_with():
    """A server's speculative method must be one the drafter's family names (DSpark: vLLM's dspark; the MTP head:
    mtp, or SGLang's NEXTN whose block is its steps + 1; EAGLE-3: EAGLE3); another method is not the drafter's
    rounds."""
    from dflash_cb.cache.served import incomparable_settings, served_block_size
    from dflash_cb.core.drafters.registry import family_named

    dspark, mtp = family_named("dspark").served_methods, family_named("mtp").served_methods
    assert served_block_size({"server": "vllm", "algorithm": "dspark", "num_speculative_tokens": 7}, dspark) == 8
    assert served_block_size({"server": "vllm", "algorithm": "dflash", "num_speculative_tokens": 7}, dspark) is None
    said = incomparable_settings({"server": "vllm", "algorithm": "dflash"}, 10, methods=dspark, label="DSpark")
    assert any("speculates with 'dflash', not DSpark" in w for w in said)
    assert served_block_size({"algorithm": "NEXTN", "num_steps": 3, "num_draft_tokens": 5}, mtp, chain=True) == 4
    assert served_block_size({"algorithm": "DFLASH", "num_draft_tokens": 16}) == 16  # the block families' default
    # A block family with methods of its own is still a block family: its draft tokens are its block.
    assert served_block_size({"num_steps": 3, "num_draft_tokens": 8}, dspark) == 8
    eagle3 = family_named("eagle3")
    assert eagle3.kind == "chain"
    record = {"algorithm": "EAGLE3", "num_steps": 3, "num_draft_tokens": 4}
    assert served_block_size(record, eagle3.served_methods, chain=True) == 4
    assert incomparable_settings(record, 10, block_size=4, methods=eagle3.served_methods, label=eagle3.label,
                                 chain=True) == []
