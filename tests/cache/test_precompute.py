"""tools/precompute_states.py end to end on a tiny real Qwen3: references, manifest, resume, parts, errors."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from local_http import JSONHandler, quick_retries, serve
from safetensors import safe_open
from tiny_target import TINY_HIDDEN, TINY_VOCAB, random_prompts, save_tiny_qwen3, write_prompts

from dflash_cb.cache import precompute
from dflash_cb.cache.manifest import HEAD_NAME, MANIFEST_NAME, CacheError, shard_name
from dflash_cb.cache.precompute import JOURNAL_NAME, PROGRESS_NAME, main, merge_main
from dflash_cb.cache.states import StateCache

LAYERS = "0,2,3"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("prompts")
    return write_prompts(d / "prompts.jsonl", random_prompts(5, (4, 24), seed=3), ["math", "code", "chat"])


def run(target_dir: Path, prompts: Path, out: Path, *extra: str) -> int:
    return main(["--target", str(target_dir), "--prompts", str(prompts), "--out", str(out), "--layers", LAYERS,
                 "--max-new-tokens", "12", "--dtype", "float32", "--no-progress", *extra])


def folder_digest(folder: Path, skip: tuple[str, ...] = ("precompute_log.json",)) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module")
def local_cache(target_dir, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("caches") / "local"
    assert run(target_dir, prompts_file, out, "--topk-logprobs", "4") == 0
    return out


def test_local_reference_end_to_end(local_cache, target_dir, prompts_file):
    cache = StateCache(local_cache)
    m = cache.manifest
    assert m.target["architecture"] == "Qwen3ForCausalLM" and m.target["num_layers"] == 4
    assert m.target["hidden_size"] == TINY_HIDDEN and m.target["vocab_size"] == TINY_VOCAB
    assert m.target["max_position_embeddings"] == 512 and len(m.target["config_sha256"]) == 64
    assert m.layer_ids == [0, 2, 3] and m.dtype == "float32" and m.topk_logprobs == 4
    assert m.reference["kind"] == "local" and m.reference["max_new_tokens"] == 12
    assert m.reference["stop_token_ids"] == [2]
    assert m.prompts["file"] == "prompts.jsonl" and m.prompts["count"] == 5 and "part" not in m.prompts
    assert [s.id for s in m.samples] == [f"p{i:03d}" for i in range(5)]
    assert [s.shard for s in m.samples] == [shard_name(i) for i in range(5)]
    assert [s.category for s in m.samples] == ["math", "code", "chat", "math", "code"]
    # float32 prefill and greedy generation agree everywhere
    assert m.agreement["token_agreement"] == 1.0 and m.agreement["samples_fully_agreeing"] == 5
    assert m.agreement["first_disagreements"] == []
    assert not (local_cache / PROGRESS_NAME).exists()
    log = json.loads((local_cache / "precompute_log.json").read_text())
    assert log["summary"]["samples"] == 5 and log["summary"]["wall_s"] > 0
    assert "wall" not in json.dumps(m.to_dict())  # no timing in the manifest: runs are byte-comparable

    cache.verify()
    from dflash_cb.cache.target import load_target, prefill

    target = load_target(target_dir, "float32")
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    for entry, prompt in zip(m.samples, prompts, strict=True):
        s = cache.load(entry.id, verify=True)
        assert entry.valid_len == entry.total_len and entry.prompt_len == len(prompt)
        assert 1 <= entry.completion_len <= 12 and entry.finish_reason in ("stop", "length")
        assert s.input_ids.dtype == torch.int64 and s.input_ids[: len(prompt)].tolist() == prompt
        assert s.hidden.shape == (entry.total_len, 3 * TINY_HIDDEN) and s.hidden.dtype == torch.float32
        ref = prefill(target, s.input_ids, [0, 2, 3], topk=4)
        assert torch.equal(s.hidden, ref.hidden) and torch.equal(s.target_argmax, ref.target_argmax)
        assert s.topk_ids.shape == (entry.total_len, 4) and s.topk_logprobs.dtype == torch.float32
        # the completion is the target's greedy path: argmax at t predicts token t + 1
        assert s.target_argmax[entry.prompt_len - 1:-1].tolist() == s.input_ids[entry.prompt_len:].tolist()
    head = cache.load_head()
    assert not head.tied and m.target_head["tied"] is False
    assert torch.equal(head.embed_tokens, target.model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head, target.model.lm_head.weight)
    with safe_open(str(local_cache / HEAD_NAME), "pt") as f:
        assert set(f.keys()) == {"embed_tokens.weight", "lm_head.weight"}


def test_rerun_complete_cache_is_a_noop_and_repairs_corruption(local_cache, target_dir, prompts_file, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(local_cache, out)
    before = folder_digest(out)
    # flip bytes in one shard and truncate another: the rerun must verify, recompute both, and match
    victim = out / shard_name(1)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (out / shard_name(3)).write_bytes((out / shard_name(3)).read_bytes()[:100])
    with pytest.raises(CacheError, match=rf"{shard_name(1)}: sha256 .* \(corrupted\); rerun tools/precompute"):
        StateCache(out).verify()
    assert run(target_dir, prompts_file, out, "--topk-logprobs", "4") == 0
    assert folder_digest(out) == before


def test_corrupted_and_truncated_shards_are_reported(local_cache, tmp_path):
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(local_cache, out)
    f0 = out / shard_name(0)
    data = bytearray(f0.read_bytes())
    data[-20] ^= 0x55
    f0.write_bytes(bytes(data))
    cache = StateCache(out)
    with pytest.raises(CacheError) as err:
        cache.verify()
    assert str(f0) in str(err.value) and "corrupted" in str(err.value)
    assert "rerun tools/precompute_states.py" in str(err.value)
    with pytest.raises(CacheError, match="corrupted"):
        cache.load("p000", verify=True)
    f2 = out / shard_name(2)
    f2.write_bytes(f2.read_bytes()[:-7])
    with pytest.raises(CacheError) as err:
        StateCache(out).load("p002")
    assert str(f2) in str(err.value) and "truncated" in str(err.value) and "rerun" in str(err.value)


def test_reference_file(local_cache, target_dir, prompts_file, tmp_path):
    cache = StateCache(local_cache)
    comp = tmp_path / "completions.jsonl"
    lines = []
    for e in cache.samples:
        ids = cache.load(e.id).input_ids[e.prompt_len:].tolist()
        if e.id == "p001":
            ids[2] = (ids[2] + 1) % TINY_VOCAB  # not what the target would say: scoring must stop there
        lines.append(json.dumps({"id": e.id, "output_ids": ids}))
    comp.write_text("\n".join(reversed(lines)) + "\n")
    out = tmp_path / "file"
    assert run(target_dir, prompts_file, out, "--reference", "file", "--completions", str(comp)) == 0
    m = StateCache(out).manifest
    assert m.reference["kind"] == "file" and m.reference["completions"]["file"] == "completions.jsonl"
    by_id = {s.id: s for s in m.samples}
    p1 = by_id["p001"]
    assert p1.valid_len == p1.prompt_len + 2
    assert m.agreement["samples_fully_agreeing"] == 4
    assert m.agreement["first_disagreements"] == [{"id": "p001", "position": p1.valid_len, "completion_offset": 2}]
    for sid in ("p000", "p002"):
        assert torch.equal(StateCache(out).load(sid).hidden, cache.load(sid).hidden[:, :])

    # ids that are not in the prompt set are refused before anything is loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text(comp.read_text() + json.dumps({"id": "nope", "output_ids": [3]}) + "\n")
    assert run(target_dir, prompts_file, tmp_path / "x", "--reference", "file", "--completions", str(bad)) == 2
    missing = tmp_path / "missing.jsonl"
    missing.write_text("\n".join(lines[:3]) + "\n")
    assert run(target_dir, prompts_file, tmp_path / "y", "--reference", "file", "--completions",
               str(missing)) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# -- a real HTTP server speaking SGLang's native API, backed by the tiny model's greedy output -------------


class FakeSGLang:
    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.model_path = str(target_dir)
        self.reported_model = str(target_dir)
        self.lock = threading.Lock()
        self.calls = 0
        self.perturb: dict[tuple[int, ...], int] = {}  # prompt -> completion offset to change
        self.abort: set[tuple[int, ...]] = set()  # prompts answered with finish_reason "abort"
        self.short: set[tuple[int, ...]] = set()  # prompts answered with 3 tokens and finish_reason "length"
        self.oov: set[tuple[int, ...]] = set()  # prompts answered with a token id outside the vocabulary
        self.hold: set[tuple[int, ...]] = set()  # prompts whose answer waits for `release`
        self.release = threading.Event()

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        from dflash_cb.cache.target import Target, find_decoder_layers, greedy_generate, read_target_config

        sp = body["sampling_params"]
        assert sp["temperature"] == 0
        if tuple(body["input_ids"]) in self.hold:
            assert self.release.wait(30)
        with self.lock:
            self.calls += 1
            t = Target(self.model, read_target_config(self.model_path), find_decoder_layers(self.model),
                       torch.float32)
            out, reason = greedy_generate(t, body["input_ids"], sp["max_new_tokens"], sp["stop_token_ids"])
        if tuple(body["input_ids"]) in self.abort:
            return {"text": "", "output_ids": out[:2],
                    "meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}
        if tuple(body["input_ids"]) in self.short:
            out, reason = out[:3], "length"
        if tuple(body["input_ids"]) in self.oov:
            out[-1] = TINY_VOCAB + 5
        k = self.perturb.get(tuple(body["input_ids"]))
        if k is not None and k < len(out):
            out[k] = (out[k] + 1) % TINY_VOCAB
        return {"text": "", "output_ids": out,
                "meta_info": {"finish_reason": {"type": reason}, "prompt_tokens": len(body["input_ids"]),
                              "completion_tokens": len(out)}}


@pytest.fixture()
def sglang(target_dir) -> Iterator[tuple[str, FakeSGLang]]:
    state = FakeSGLang(target_dir)

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_json({})
            elif self.path == "/get_model_info":
                self.send_json({"model_path": state.reported_model, "is_generation": True})
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            self.send_json(state.generate(self.read_json()))

    with serve(Handler) as url:
        yield url, state


def test_reference_sglang(sglang, local_cache, target_dir, prompts_file, tmp_path):
    url, server = sglang
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    server.perturb[tuple(prompts[3])] = 5
    out = tmp_path / "sg"
    assert run(target_dir, prompts_file, out, "--reference", "sglang", "--sglang-url", url,
               "--max-in-flight", "3") == 0
    assert server.calls == 5
    cache = StateCache(out)
    m = cache.manifest
    assert m.reference["kind"] == "sglang" and m.reference["url"] == url
    assert m.reference["served_model"]["model_path"] == str(target_dir)
    assert m.reference["sampling_params"] == {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [2]}
    p3 = cache.entry("p003")
    assert p3.valid_len == p3.prompt_len + 5 and m.agreement["samples_fully_agreeing"] == 4
    local = StateCache(local_cache)
    for sid in ("p000", "p001"):  # the served greedy path is the local one: same states
        assert torch.equal(cache.load(sid).hidden, local.load(sid).hidden)
    journal = [json.loads(line) for line in (out / JOURNAL_NAME).read_text().splitlines()]
    assert [j["id"] for j in journal] == [f"p{i:03d}" for i in range(5)]

    # a lost shard is recomputed from the saved completions: the server is not asked again
    before = folder_digest(out)
    (out / shard_name(2)).unlink()
    (out / MANIFEST_NAME).unlink()
    assert run(target_dir, prompts_file, out, "--reference", "sglang", "--sglang-url", url) == 0
    assert server.calls == 5 and folder_digest(out) == before


def test_sglang_abort_fails_and_rerun_resumes(sglang, target_dir, prompts_file, tmp_path, capsys):
    url, server = sglang
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    server.abort.add(tuple(prompts[3]))
    out = tmp_path / "ab"
    args = ("--reference", "sglang", "--sglang-url", url, "--max-in-flight", "1")
    assert run(target_dir, prompts_file, out, *args) == 2
    err = capsys.readouterr().err
    assert "abort" in err and "rerun to resume" in err and not (out / MANIFEST_NAME).exists()
    saved = [json.loads(line)["id"] for line in (out / JOURNAL_NAME).read_text().splitlines()]
    # One request in flight: every answer that arrived before the abort is journaled (a later one
    # may have finished too before the failure was seen), the aborted one never.
    assert saved[:3] == ["p000", "p001", "p002"] and "p003" not in saved
    server.abort.clear()
    before = server.calls
    assert run(target_dir, prompts_file, out, *args) == 0
    assert server.calls - before == 5 - len(saved)  # saved completions are not asked again
    assert StateCache(out).manifest.agreement["samples_fully_agreeing"] == 5


def test_sglang_served_model_mismatch_warns(sglang, target_dir, prompts_file, tmp_path, capsys):
    url, server = sglang
    server.reported_model = "/models/Some-Other-Model"
    out = tmp_path / "warn"
    assert run(target_dir, prompts_file, out, "--reference", "sglang", "--sglang-url", url) == 0
    assert "does not look like the target" in capsys.readouterr().err
    log = json.loads((out / "precompute_log.json").read_text())
    assert any("Some-Other-Model" in w for w in log["summary"]["warnings"])
    assert StateCache(out).manifest.reference["served_model"]["model_path"] == "/models/Some-Other-Model"


def test_sglang_server_down_fails_before_loading(target_dir, prompts_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dflash_cb.cache.target.load_target", _must_not_load)
    rc = run(target_dir, prompts_file, tmp_path / "o", "--reference", "sglang", "--sglang-url",
             "http://127.0.0.1:9", "--sglang-retries", "0")
    assert rc == 2 and "not reachable" in capsys.readouterr().err


# -- validation happens before the model is loaded and leaves the output alone ----------------------------


def _must_not_load(*a: Any, **k: Any) -> None:
    raise AssertionError("the target was loaded before validation finished")


@pytest.mark.parametrize("case", ["bad_layer", "duplicate_id", "too_long", "bad_token", "other_args"])
def test_validation_before_loading(case, local_cache, target_dir, prompts_file, tmp_path, monkeypatch, capsys):
    import shutil

    out = tmp_path / "existing"
    shutil.copytree(local_cache, out)
    before = folder_digest(out, skip=())
    monkeypatch.setattr("dflash_cb.cache.target.load_target", _must_not_load)
    prompts, extra, expect = prompts_file, ["--topk-logprobs", "4"], ""
    if case == "bad_layer":
        extra += ["--layers", "0,4"]
        expect = r"layer ids [4] are outside [0, 4)"
    elif case == "duplicate_id":
        prompts = tmp_path / "dup.jsonl"
        prompts.write_text(prompts_file.read_text() + json.dumps({"id": "p001", "input_ids": [5, 6]}) + "\n")
        expect = "dup.jsonl:6: duplicate id 'p001' (first seen on line 2)"
    elif case == "too_long":
        prompts = write_prompts(tmp_path / "long.jsonl", [[5] * 505])
        expect = "long.jsonl:1: prompt 'p000' has 505 tokens"
    elif case == "bad_token":
        prompts = write_prompts(tmp_path / "tok.jsonl", [[5, 6, 500]])
        expect = "has token ids [500] >= the target's vocab size 128"
    else:
        extra = ["--topk-logprobs", "2"]
        expect = "topk_logprobs: existing 4, now 2"
    assert run(target_dir, prompts, out, *extra) == 2
    assert expect in capsys.readouterr().err
    assert folder_digest(out, skip=()) == before


def test_other_arguments_need_overwrite(local_cache, target_dir, prompts_file, tmp_path, capsys):
    import shutil

    out = tmp_path / "ow"
    shutil.copytree(local_cache, out)
    assert run(target_dir, prompts_file, out, "--max-new-tokens", "6") == 2
    err = capsys.readouterr().err
    assert "reference.max_new_tokens: existing 12, now 6" in err and "--overwrite" in err
    assert run(target_dir, prompts_file, out, "--max-new-tokens", "6", "--overwrite") == 0
    m = StateCache(out).manifest
    assert m.max_new_tokens == 6 and m.topk_logprobs == 0 and all(s.completion_len <= 6 for s in m.samples)
    # a folder that is not a cache is refused
    stranger = tmp_path / "home"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("x")
    assert run(target_dir, prompts_file, stranger) == 2
    assert "not part of a cache" in capsys.readouterr().err


# -- parts and merge --------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_shard", [1, 2])
def test_parts_merge_equals_single_run(per_shard, target_dir, prompts_file, tmp_path):
    extra = ["--samples-per-shard", str(per_shard), "--no-export-head"] if per_shard > 1 else []
    single = tmp_path / "single"
    assert run(target_dir, prompts_file, single, *extra) == 0
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for i, part in enumerate(parts):
        assert run(target_dir, prompts_file, part, "--num-shards", "2", "--shard-index", str(i), *extra) == 0
        assert StateCache(part).manifest.prompts["part"] == {"num_shards": 2, "shard_index": i}
    assert merge_main(["--out", str(tmp_path / "merged"), str(parts[0])]) == 2  # a part is missing
    assert not (tmp_path / "merged" / MANIFEST_NAME).exists()
    assert merge_main(["--out", str(tmp_path / "merged"), *map(str, parts)]) == 0
    merged = tmp_path / "merged"
    assert (merged / MANIFEST_NAME).read_bytes() == (single / MANIFEST_NAME).read_bytes()
    assert folder_digest(merged) == folder_digest(single)
    StateCache(merged).verify()
    if per_shard == 2:
        assert [s.shard for s in StateCache(merged).samples] == [shard_name(i // 2) for i in range(5)]
    # parts of different runs do not merge
    other = tmp_path / "other"
    assert run(target_dir, prompts_file, other, "--num-shards", "2", "--shard-index", "1", "--max-new-tokens",
               "5", *extra) == 0
    assert merge_main(["--out", str(tmp_path / "m2"), str(parts[0]), str(other)]) == 2


def test_yaml_config_and_cli_override(target_dir, prompts_file, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target: {target_dir}\nprompts: {prompts_file}\nout: {tmp_path / 'from_yaml'}\n"
                   "layers: [1, 3]\nmax_new_tokens: 4\ndtype: float32\nchat_template_kwargs: {enable_thinking: false}\n"
                   "topk_logprobs: 2\nno_export_head: true\n")
    args = precompute.args_from_cli(["--config", str(cfg), "--max-new-tokens", "3", "--layers", "0,1"])
    assert args.layers == [0, 1] and args.max_new_tokens == 3 and args.topk_logprobs == 2
    assert args.chat_template_kwargs == {"enable_thinking": False} and args.export_head is False
    assert main(["--config", str(cfg), "--max-new-tokens", "3", "--no-progress"]) == 0
    m = StateCache(tmp_path / "from_yaml").manifest
    assert m.layer_ids == [1, 3] and m.max_new_tokens == 3 and m.target_head is None
    assert m.chat_template_kwargs == {"enable_thinking": False}
    assert not (tmp_path / "from_yaml" / HEAD_NAME).exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_new_token: 3\n")
    with pytest.raises(precompute.PrecomputeError, match="unknown option 'max_new_token'"):
        precompute.args_from_cli(["--config", str(bad)])


def test_drafter_config_layers(target_dir, prompts_file, tmp_path, capsys):
    drafter = tmp_path / "drafter.json"
    drafter.write_text(json.dumps({"num_target_layers": 4, "dflash_config": {"target_layer_ids": [1, 2]}}))
    out = tmp_path / "d"
    rc = main(["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(out), "--drafter-config",
               str(drafter), "--max-new-tokens", "2", "--dtype", "float32", "--no-progress"])
    assert rc == 0 and StateCache(out).manifest.layer_ids == [1, 2]
    drafter.write_text(json.dumps({"num_target_layers": 64, "dflash_config": {"target_layer_ids": [1, 16]}}))
    rc = main(["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(tmp_path / "e"),
               "--drafter-config", str(drafter), "--no-progress"])
    assert rc == 2 and "num_target_layers=64" in capsys.readouterr().err
    drafter.write_text("{not json")  # the fix names the drafter's config, never "delete it"
    rc = main(["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(tmp_path / "f"),
               "--drafter-config", str(drafter), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--drafter-config {drafter}: unreadable" in err and "delete it" not in err


def test_qwen3_5_target_end_to_end(tmp_path):
    from tiny_target import save_tiny_qwen3_5

    target = save_tiny_qwen3_5(tmp_path / "q35")
    prompts = write_prompts(tmp_path / "p.jsonl", random_prompts(2, 9, seed=5))
    out = tmp_path / "c35"
    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--layers", "0,3",
                 "--max-new-tokens", "6", "--dtype", "float32", "--no-progress"]) == 0
    m = StateCache(out).manifest
    assert m.target["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert m.agreement["token_agreement"] == 1.0
    with safe_open(str(out / HEAD_NAME), "pt") as f:
        assert f.get_tensor("embed_tokens.weight").shape == (TINY_VOCAB, TINY_HIDDEN)


def test_text_and_messages_prompts_use_the_tokenizer(target_dir, tmp_path, capsys):
    from tiny_target import TINY_WORDS, save_tiny_tokenizer

    tok = save_tiny_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hello world"}]
    prompts.write_text(json.dumps({"id": "c", "category": "chat", "messages": msgs}) + "\n"
                       + json.dumps({"id": "t", "text": "what is 2 + 2 ?"}) + "\n")
    out = tmp_path / "chat"
    assert main(["--target", str(target_dir), "--prompts", str(prompts), "--out", str(out), "--layers", "1",
                 "--tokenizer", str(tok), "--chat-template-kwargs", '{"enable_thinking": false}',
                 "--max-new-tokens", "3", "--dtype", "float32", "--no-progress"]) == 0
    cache = StateCache(out)
    m = cache.manifest
    assert m.chat_template_kwargs == {"enable_thinking": False} and m.prompts["tokenizer"] == str(tok)
    words = "<|im_start|> user hello world <|im_end|> <|im_start|> assistant <think> </think>".split()
    c = cache.entry("c")
    assert cache.load("c").input_ids[: c.prompt_len].tolist() == [TINY_WORDS.index(w) for w in words]
    assert cache.entry("t").prompt_len == 6 and cache.entry("t").category == "uncategorized"
    # without a tokenizer (the tiny target folder has none) text prompts are refused up front, saying why
    # (transformers loads such a folder as an empty tokenizer, and "no tokens" would mislead)
    assert main(["--target", str(target_dir), "--prompts", str(prompts), "--out", str(tmp_path / "n"),
                 "--layers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--target {target_dir} has no tokenizer files" in err and "pass --tokenizer" in err
    assert "tokenizes to no tokens" not in err and not (tmp_path / "n").exists()


def test_broken_target_is_refused_by_the_tool(prompts_file, tmp_path, capsys):
    from tiny_target import delete_tensor

    broken = save_tiny_qwen3(tmp_path / "broken")
    delete_tensor(broken, "model.norm.weight")
    assert run(broken, prompts_file, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "model.norm.weight" in err and "missing from the checkpoint" in err
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()


# -- the reference journal and the served answers ---------------------------------------------------------


def _prompts(prompts_file: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]


def _journal_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()] if path.exists() else []


def test_completions_are_journaled_as_they_arrive(sglang, target_dir, prompts_file, tmp_path):
    """With two answers held back by the server, the three that arrived are already on disk."""
    url, server = sglang
    prompts = _prompts(prompts_file)
    server.hold = {tuple(prompts[1]), tuple(prompts[4])}
    out = tmp_path / "arrive"
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(
        run(target_dir, prompts_file, out, "--reference", "sglang", "--sglang-url", url, "--max-in-flight", "5")))
    worker.start()
    try:
        journal = out / JOURNAL_NAME
        deadline = time.monotonic() + 30
        while len(_journal_ids(journal)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # held requests are still open: what is on disk arrived one by one, not at the end
        assert sorted(_journal_ids(journal)) == ["p000", "p002", "p003"] and worker.is_alive()
    finally:
        server.release.set()
        worker.join(60)
    assert result == [0] and server.calls == 5
    assert _journal_ids(out / JOURNAL_NAME) == [f"p{i:03d}" for i in range(5)]


def test_short_answer_is_refused_naming_the_prompt(sglang, local_cache, target_dir, prompts_file, tmp_path,
                                                   capsys, monkeypatch):
    """A 'length' answer shorter than max_new_tokens is a server fault, never a cached sample."""
    from dflash_cb.cache import sglang_client

    quick_retries(monkeypatch, sglang_client, "SGLangClient")
    url, server = sglang
    local = StateCache(local_cache)
    victim = next(s for s in local.samples if s.completion_len > 3 and s.finish_reason == "length")
    server.short.add(tuple(_prompts(prompts_file)[victim.index]))
    out = tmp_path / "short"
    args = ("--reference", "sglang", "--sglang-url", url, "--sglang-retries", "1", "--max-in-flight", "1")
    assert run(target_dir, prompts_file, out, *args) == 2
    err = capsys.readouterr().err
    assert f"request {victim.id!r} failed" in err and "incomplete completion" in err and "2 attempt" in err
    assert not (out / MANIFEST_NAME).exists() and victim.id not in _journal_ids(out / JOURNAL_NAME)
    server.short.clear()
    assert run(target_dir, prompts_file, out, *args) == 0
    assert StateCache(out).entry(victim.id).completion_len == victim.completion_len


def test_out_of_vocabulary_answer_is_never_journaled(sglang, target_dir, prompts_file, tmp_path, capsys):
    """Token ids outside the vocabulary fail naming the prompt and never reach the journal."""
    url, server = sglang
    server.oov.add(tuple(_prompts(prompts_file)[2]))
    out = tmp_path / "oov"
    args = ("--reference", "sglang", "--sglang-url", url, "--sglang-retries", "0", "--max-in-flight", "1")
    assert run(target_dir, prompts_file, out, *args) == 2
    err = capsys.readouterr().err
    assert "request 'p002' failed" in err and f"outside the target's vocabulary [0, {TINY_VOCAB})" in err
    assert "Traceback" not in err and "p002" not in _journal_ids(out / JOURNAL_NAME)
    server.oov.clear()
    assert run(target_dir, prompts_file, out, *args) == 0  # the rerun does not crash on a stale entry


def test_journal_entries_are_keyed_by_their_request(sglang, target_dir, prompts_file, tmp_path, capsys):
    """A journal made with other arguments is not reused; one made with the same ones is."""
    url, server = sglang
    first = tmp_path / "first"
    args = ("--reference", "sglang", "--sglang-url", url)
    assert run(target_dir, prompts_file, first, *args) == 0 and server.calls == 5
    entry = json.loads((first / JOURNAL_NAME).read_text().splitlines()[0])
    assert len(entry["request_sha256"]) == 64 and entry["finish_reason"] in ("stop", "length")

    same = tmp_path / "same"  # the journal alone (as a run killed while querying leaves it)
    same.mkdir()
    (same / JOURNAL_NAME).write_bytes((first / JOURNAL_NAME).read_bytes())
    assert run(target_dir, prompts_file, same, *args) == 0 and server.calls == 5
    # The same cache; the requests' timing is the first run's alone (this one asked nothing).
    timing = "served_timing.jsonl"
    assert (first / timing).is_file() and not (same / timing).exists()
    assert folder_digest(same) == {k: v for k, v in folder_digest(first).items() if k != timing}

    other = tmp_path / "other"
    other.mkdir()
    (other / JOURNAL_NAME).write_bytes((first / JOURNAL_NAME).read_bytes())
    capsys.readouterr()
    assert run(target_dir, prompts_file, other, *args, "--max-new-tokens", "6") == 0
    assert server.calls == 10 and "5 saved completion(s) were made with other arguments" in capsys.readouterr().err
    assert all(s.completion_len <= 6 for s in StateCache(other).samples)


# -- the resume record grows by appends ----------------------------------------------------------------


def test_progress_record_is_appended_not_rewritten(target_dir, prompts_file, tmp_path, monkeypatch):
    from dflash_cb.cache.precompute import progress

    rewrites, appends = [], []
    real_start, real_append = progress.atomic_write_text, progress.append_line_durably
    monkeypatch.setattr(progress, "atomic_write_text", lambda p, t: (rewrites.append(p), real_start(p, t)))
    monkeypatch.setattr(progress, "append_line_durably", lambda p, t: (appends.append(t), real_append(p, t)))
    out = tmp_path / "prog"
    assert run(target_dir, prompts_file, out) == 0
    # one write of the fingerprint, then O(1) per shard: one line each (five shards, then the head)
    assert rewrites == [out / PROGRESS_NAME] and len(appends) == 6
    assert [next(iter(json.loads(a))) for a in appends] == ["shard"] * 5 + ["target_head"]


# -- compute dtype apart from storage dtype --------------------------------------------------------------


def test_float32_compute_with_bfloat16_storage(target_dir, prompts_file, tmp_path, capsys):
    from dflash_cb.cache.target import load_target, prefill

    out = tmp_path / "f32b16"
    assert main(["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(out), "--layers", LAYERS,
                 "--max-new-tokens", "12", "--dtype", "bfloat16", "--compute-dtype", "float32",
                 "--topk-logprobs", "3", "--no-progress"]) == 0
    err = capsys.readouterr().err
    # the ETA after the first sample, and the dtypes next to the agreement
    assert "first sample:" in err and "tok/s (float32 compute); at most" in err and "tokens left, projected" in err
    assert "(float32 compute, bfloat16 storage)" in err
    cache = StateCache(out)
    assert cache.manifest.dtype == "bfloat16" and cache.manifest.compute_dtype == "float32"
    target = load_target(target_dir, "float32")
    for entry in cache.samples:
        s = cache.load(entry.id)
        ref = prefill(target, s.input_ids, [0, 2, 3], topk=3)
        assert s.hidden.dtype == torch.bfloat16 and torch.equal(s.hidden, ref.hidden.to(torch.bfloat16))
        assert torch.equal(s.target_argmax, ref.target_argmax)  # agreement measured in float32
    head = cache.load_head()
    assert cache.manifest.target_head["dtype"] == "bfloat16" and head.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(head.lm_head, target.model.lm_head.weight.to(torch.bfloat16))
    log = json.loads((out / "precompute_log.json").read_text())
    assert log["summary"]["compute_dtype"] == "float32" and log["compute"]["reason"] == "given by --compute-dtype"


def test_auto_compute_dtype_follows_the_probe(target_dir, prompts_file, tmp_path, caplog):
    from dflash_cb.cache.precompute import DtypeProbe, PrecomputeArgs, prepare, run_precompute
    from dflash_cb.cache.target import load_target

    def args(out: str) -> PrecomputeArgs:
        return PrecomputeArgs(target=str(target_dir), prompts=str(prompts_file), out=str(tmp_path / out),
                              layers=[0, 2], max_new_tokens=4, dtype="bfloat16", progress=False)

    asked: list[tuple[torch.dtype, int]] = []

    def gflops(fast: torch.dtype):
        def measure(dtype: torch.dtype, hidden: int) -> float:
            asked.append((dtype, hidden))
            return 100.0 if dtype == fast else 20.0
        return measure

    plenty = lambda: 1 << 40  # noqa: E731
    plan = prepare(args("a"), probe=DtypeProbe(gflops(torch.float32), plenty))
    assert plan.compute_dtype == "float32" and plan.header.compute_dtype == "float32"
    assert sorted(asked, key=str) == sorted([(torch.float32, TINY_HIDDEN), (torch.bfloat16, TINY_HIDDEN)], key=str)
    assert prepare(args("b"), probe=DtypeProbe(gflops(torch.bfloat16), plenty)).compute_dtype == "bfloat16"
    # float32 faster but it would not fit: the float32 need (weights + activations) exceeds what is available
    tight = prepare(args("c"), probe=DtypeProbe(gflops(torch.float32), lambda: 1 << 20))
    assert tight.compute_dtype == "bfloat16" and "are available" in tight.compute.reason
    weights = sum(p.numel() for p in load_target(target_dir, "float32").model.parameters())
    assert tight.compute.float32_need_bytes > 4 * weights  # at least the float32 weights
    # a whole run records the choice and the measured figures
    with caplog.at_level(logging.INFO, logger="dflash_cb"):
        run_precompute(args("d"), probe=DtypeProbe(gflops(torch.float32), plenty))
    logged = [r.getMessage() for r in caplog.records]
    assert StateCache(tmp_path / "d").manifest.compute_dtype == "float32"
    assert any("compute dtype: float32" in m and "100.0 GFLOP/s" in m for m in logged)
    record = json.loads((tmp_path / "d" / "precompute_log.json").read_text())["compute"]
    assert record["gflops"] == {"float32": 100.0, "bfloat16": 20.0} and record["compute_dtype"] == "float32"


def test_resume_with_another_compute_dtype_is_refused(target_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "cd"
    common = ["--dtype", "bfloat16", "--max-new-tokens", "4"]
    assert run(target_dir, prompts_file, out, *common, "--compute-dtype", "float32") == 0
    before = folder_digest(out, skip=())
    capsys.readouterr()
    assert run(target_dir, prompts_file, out, *common, "--compute-dtype", "bfloat16") == 2
    err = capsys.readouterr().err
    assert "manifest.compute_dtype: existing 'float32', now 'bfloat16'" in err and "--overwrite" in err
    assert folder_digest(out, skip=()) == before
    # auto keeps the cache's compute dtype without probing the CPU (the probe would log its figures)
    assert run(target_dir, prompts_file, out, *common, "--compute-dtype", "auto") == 0
    assert "GFLOP/s" not in capsys.readouterr().err
    assert folder_digest(out) == {k: v for k, v in before.items() if k != "precompute_log.json"}


# -- OS errors on user paths are one line, exit 2 ----------------------------------------------------------


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_out_paths_that_cannot_be_written(local_cache, target_dir, prompts_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("dflash_cb.cache.target.load_target", _must_not_load)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    assert run(target_dir, prompts_file, a_file / "sub") == 2
    assert f"{a_file} is a file, not a folder" in _one_error_line(capsys.readouterr().err)
    assert run(target_dir, prompts_file, a_file) == 2
    assert "exists and is not a folder" in _one_error_line(capsys.readouterr().err)
    assert run(target_dir, prompts_file, Path("/proc/dflash-cb-test/x")) == 2
    assert "/proc/dflash-cb-test" in _one_error_line(capsys.readouterr().err)
    assert merge_main(["--out", str(a_file), str(local_cache)]) == 2
    assert "not a folder" in _one_error_line(capsys.readouterr().err)
    assert a_file.read_text() == "keep me"


def test_full_disk_during_a_shard_write_is_one_line(target_dir, prompts_file, tmp_path, capsys):
    """A write that runs out of room (here: RLIMIT_FSIZE, as a full disk would) fails cleanly, no shard kept."""
    import resource
    import signal

    out = tmp_path / "full"
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, old_limit[1]))
    try:
        rc = run(target_dir, prompts_file, out, "--samples-per-shard", "5", "--no-export-head")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert shard_name(0) in line and ("too large" in line or "disk full" in line)
    assert not (out / MANIFEST_NAME).exists() and not (out / shard_name(0)).exists()
    assert not list(out.glob(".*.tmp"))
    assert run(target_dir, prompts_file, out, "--samples-per-shard", "5", "--no-export-head") == 0


def test_a_resume_after_the_servers_model_changed_says_so(sglang, target_dir, prompts_file, tmp_path, capsys):
    """Same command, another model behind the URL: named as the server's change (not "other arguments")."""
    url, server = sglang
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    server.abort.add(tuple(prompts[3]))
    out = tmp_path / "changed"
    args = ("--reference", "sglang", "--sglang-url", url, "--max-in-flight", "1")
    assert run(target_dir, prompts_file, out, *args) == 2
    server.abort.clear()
    server.reported_model = "/models/Another-Model"
    capsys.readouterr()
    try:
        assert run(target_dir, prompts_file, out, *args) == 2
    finally:
        server.reported_model = str(target_dir)
    err = capsys.readouterr().err
    assert "the server now serves another model" in err and "Another-Model" in err and "different arguments" not in err


def test_ctrl_c_says_how_many_samples_were_written(target_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of a shard: the line counts the samples written (whole shards), not those computed;
    a rerun resumes from them."""
    from dflash_cb.cache.precompute import run as precompute_run
    from dflash_cb.common.cli import run as run_tool

    real, calls = precompute_run.compute_sample, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # the second sample of the second shard of two
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(precompute_run, "compute_sample", interrupted)
    out = tmp_path / "c"
    args = ["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(out), "--layers", LAYERS,
            "--max-new-tokens", "12", "--dtype", "float32", "--no-progress", "--samples-per-shard", "2"]
    assert run_tool(main, args) == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 sample(s) written in 1 shard(s)" in err and "run the same command to resume" in err
    monkeypatch.setattr(precompute_run, "compute_sample", real)
    assert run_tool(main, args) == 0


def test_the_prefill_device_is_checked_first_and_the_cpu_gives_the_same_cache(local_cache, target_dir, prompts_file,
                                                                              tmp_path, monkeypatch, capsys):
    """``--device cpu`` is the default's cache byte for byte. A device this machine lacks (``cuda`` here, a CPU-only
    torch) or a name that is no device is one line before the target is read, and nothing is written. Where a GPU
    is lent (the device machine) the prefill runs there and the states agree with the server's tokens."""
    import torch

    assert run(target_dir, prompts_file, tmp_path / "cpu", "--topk-logprobs", "4", "--device", "cpu") == 0
    assert folder_digest(tmp_path / "cpu") == folder_digest(local_cache)
    capsys.readouterr()
    if torch.cuda.is_available():
        assert run(target_dir, prompts_file, tmp_path / "gpu", "--device", "cuda") == 0
        manifest = json.loads((tmp_path / "gpu" / "manifest.json").read_text())
        assert manifest["prefill_device"] == "cuda" and manifest["agreement"]["token_agreement"] == 1.0
    else:
        monkeypatch.setattr("dflash_cb.cache.target.load_target", _must_not_load)
        assert run(target_dir, prompts_file, tmp_path / "gpu", "--device", "cuda") == 2
        assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "gpu").exists()
    monkeypatch.setattr("dflash_cb.cache.target.load_target", _must_not_load)
    assert run(target_dir, prompts_file, tmp_path / "bad", "--device", "tpu0") == 2
    assert "--device 'tpu0': expected cpu, cuda or cuda:N" in capsys.readouterr().err


def test_completions_only_journals_the_server_and_the_prefill_runs_elsewhere_from_the_file(
        sglang, target_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """The split of docs/precompute.md: on the GPU box the server's completions are journaled and nothing is
    loaded; on the big-RAM host ``--reference file`` over that journal gives the cache the server route gives,
    shard for shard; a completions-only run without a server is one line."""
    url, server = sglang
    whole = tmp_path / "whole"
    assert run(target_dir, prompts_file, whole, "--reference", "sglang", "--sglang-url", url) == 0
    with monkeypatch.context() as m:
        m.setattr("dflash_cb.cache.target.load_target", _must_not_load)
        box = tmp_path / "gpu_box"
        assert run(target_dir, prompts_file, box, "--reference", "sglang", "--sglang-url", url,
                   "--completions-only") == 0
    assert not (box / MANIFEST_NAME).exists() and not list(box.glob("*.safetensors"))
    journal = box / JOURNAL_NAME
    assert [json.loads(line)["id"] for line in journal.read_text().splitlines()] == [f"p{i:03d}" for i in range(5)]
    host = tmp_path / "ram_host"
    assert run(target_dir, prompts_file, host, "--reference", "file", "--completions", str(journal)) == 0
    shards = sorted(p.name for p in whole.glob("*.safetensors") if p.name != "target_head.safetensors")
    assert shards and all(folder_digest(host)[n] == folder_digest(whole)[n] for n in shards)
    capsys.readouterr()
    assert run(target_dir, prompts_file, tmp_path / "none", "--completions-only") == 2
    assert "--completions-only journals a server's completions; --reference local has none" in capsys.readouterr().err


def test_the_thinking_config_is_the_27b_config_with_thinking_on():
    """``configs/precompute/qwen36-27b-thinking.yaml``: the 27B's precompute with the chat template's thinking switch
    on, into its own folder; everything else (layers with the MTP head's 63, prompts, server, storage) the same."""
    from dataclasses import asdict

    from dflash_cb.cache.precompute.cli import args_from_cli

    root = Path(__file__).resolve().parents[2] / "configs" / "precompute"
    plain = asdict(args_from_cli(["--config", str(root / "qwen36-27b.yaml")]))
    thinking = asdict(args_from_cli(["--config", str(root / "qwen36-27b-thinking.yaml")]))
    assert plain["chat_template_kwargs"] == {"enable_thinking": False}
    assert thinking["chat_template_kwargs"] == {"enable_thinking": True}
    assert thinking["out"] != plain["out"] and 63 in thinking["layers"]
    differ = {k for k in plain if plain[k] != thinking[k]}
    assert differ == {"chat_template_kwargs", "out"}, differ
