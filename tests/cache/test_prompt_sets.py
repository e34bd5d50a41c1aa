"""The authors' benchmark prompt sets (dflash_cb/cache/prompt_sets.py, tools/build_prompts.py).

Oracles: ``dflash`` 0.1.0's own ``load_and_process_dataset`` / ``_select_dataset`` / ``apply_chat_template``
for the ``dflash-0.1`` preset, and the paper-era code transcribed in tests/support/paper_protocol.py for
``dflash-paper``. The Hugging Face hub cannot be reached here, so ``datasets.load_dataset`` (and the hub's
revision look-up) is pointed at small local copies of every set, saved with ``datasets``' own format: the
only stand-in, and it is the network's. Everything above it (``datasets``' ``map``/``shuffle``/``select``,
the tokenizers, the chat templates, the precompute) is the real thing.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets  # the dev extra installs it (the prompts extra for users); the package imports it lazily
import paper_protocol
import pytest
from tiny_target import TINY_WORDS, save_tiny_qwen3, save_tiny_tokenizer

from dflash_cb.cache import prompt_sets as PS
from dflash_cb.cache.build_prompts import main as build_main
from dflash_cb.cache.prompts import load_prompts

REVISION = "0123456789abcdef0123456789abcdef01234567"  # what the stand-in hub says each set is at
ROOT = Path(__file__).resolve().parents[2]


def test_the_paper_preset_s_categories_are_the_published_table_s():
    import yaml

    entries = yaml.safe_load((ROOT / "configs" / "baselines" / "published.yaml").read_text())["entries"]
    published = {m.split("/")[1] for e in entries if e["name"].startswith("dflash-")
                 for m in e["metrics"] if m.startswith("category/")}
    assert published == {s.category for s in PS.PAPER.sets}
    assert {s.category for s in PS.PACKAGE_0_1.sets} < published


def _rows(category: str) -> dict[str, list]:
    """A few rows with the fields the authors read (and one they do not), larger than --max-samples 4 except
    the aime sets, so both sides of the paper's 'only where larger' rule are taken."""
    n = 3 if category.startswith("aime") else 9
    text = [f"{category} question {i}: what is {i} + {i * 7}? {'(a {b})' if i % 3 == 0 else ''}" for i in range(n)]
    extra = {"id": list(range(n))}
    if category == "mt-bench":
        return {"prompt": [[t, f"Now rewrite your answer {i} as a poem."] for i, t in enumerate(text)],
                "category": ["writing"] * n}
    if category == "alpaca":
        return {"instruction": text, "input": ["" if i % 2 else f"input {i}" for i in range(n)], "output": text}
    if category == "livecodebench":
        return {"question_content": text, "starter_code": ["" if i % 2 else f"def f{i}():\n    pass" for i in range(n)]}
    field = {"gsm8k": "question", "humaneval": "prompt", "mbpp": "prompt", "swe-bench": "problem_statement"}
    return {field.get(category, "problem"): text, **extra}


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """Every set of both presets saved locally, as the hub would serve it (livecodebench: six json-lines files)."""
    root = tmp_path_factory.mktemp("hub")
    datasets.disable_progress_bars()
    for s in PS.PAPER.sets:
        rows = _rows(s.category)
        if s.files:
            folder = root / s.category
            folder.mkdir()
            names = list(rows)
            n = len(rows[names[0]])
            for j, name in enumerate(s.files):  # rows spread over the files, one file left empty
                with open(folder / name, "w") as f:
                    for i in range(n):
                        if j < 5 and i % 5 == j:
                            f.write(json.dumps({k: rows[k][i] for k in names}) + "\n")
        else:
            datasets.Dataset.from_dict(rows).save_to_disk(str(root / s.dataset / (s.config or "default") / s.split))
    return root


@pytest.fixture
def offline_hub(hub, monkeypatch, tmp_path):
    """``datasets.load_dataset`` (as the authors' code and ours call it) reads the local copies; the revisions
    asked for are recorded."""
    real = datasets.load_dataset
    asked: list[tuple[str, str | None]] = []

    def load_dataset(path, name=None, *, split=None, revision=None, data_files=None, **kwargs):
        if path == "json":
            urls = data_files
            local = {k: [str(hub / "livecodebench" / u.rsplit("/", 1)[1]) for u in v] for k, v in urls.items()}
            asked.append(("livecodebench/code_generation_lite", next(iter(urls.values()))[0].split("/")[-2]))
            return real("json", data_files=local, split=split, cache_dir=str(tmp_path / "cache"))
        asked.append((path, revision))
        return datasets.load_from_disk(str(hub / path / (name or "default") / split))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(PS, "hub_revision", lambda dataset: REVISION)
    return asked


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer that adds a BOS token when asked for special tokens (so the two protocols'
    encodings differ), with a Qwen-like chat template that has the enable_thinking switch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", len(vocab))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    return hf


def _by_category(records: list[dict], category: str) -> list[dict]:
    return [r for r in records if r["category"] == category]


@pytest.mark.parametrize("max_samples", [4, None])
def test_the_0_1_preset_is_the_dflash_package_s_own_prompts(offline_hub, byte_tokenizer, max_samples):
    from dflash import benchmark as B

    records = PS.build_records(PS.PACKAGE_0_1, byte_tokenizer, max_samples=max_samples)
    assert [(path, rev) for path, rev in offline_hub] == [(s.dataset, REVISION) for s in PS.PACKAGE_0_1.sets]
    assert [s.category for s in PS.PACKAGE_0_1.sets] == list(B.DATASETS)
    for name in B.DATASETS:
        theirs = B._select_dataset(B.load_and_process_dataset(name), max_samples)
        ours = _by_category(records, name)
        assert len(ours) == len(theirs) == (max_samples or 9)
        for r, item in zip(ours, theirs, strict=True):
            text = B.apply_chat_template(byte_tokenizer, [{"role": "user", "content": item["turns"][0]}], "off")
            assert r["turns"] == item["turns"]
            assert PS.turn_prompt(PS.PACKAGE_0_1, byte_tokenizer, r["turns"])[0] == text
            assert r["input_ids"] == byte_tokenizer.encode(text, add_special_tokens=False)  # token for token
            assert r["source"] == {"preset": "dflash-0.1", "dataset": PS.PACKAGE_0_1.set(name).dataset,
                                   "config": PS.PACKAGE_0_1.set(name).config, "split": PS.PACKAGE_0_1.set(name).split,
                                   "revision": REVISION, "row": r["source"]["row"]}
    assert {len(r["turns"]) for r in records} == {1, 2} and all(r["input_ids"][0] != 256 for r in records)


@pytest.mark.parametrize("max_samples", [4, None])
def test_the_paper_preset_is_the_transcribed_paper_protocol(offline_hub, byte_tokenizer, max_samples):
    records = PS.build_records(PS.PAPER, byte_tokenizer, max_samples=max_samples)
    assert {r["category"] for r in records} == {s.category for s in PS.PAPER.sets}
    for s in PS.PAPER.sets:
        theirs = paper_protocol.prompts(s.category, max_samples, byte_tokenizer)
        ours = _by_category(records, s.category)
        assert [(r["turns"], r["input_ids"]) for r in ours] == [(t, ids) for t, _, ids in theirs], s.category
        assert [PS.turn_prompt(PS.PAPER, byte_tokenizer, r["turns"])[0] for r in ours] == [t for _, t, _ in theirs]
    # the paper encodes with special tokens (the BOS here); sets not larger than n keep their order
    assert all(r["input_ids"][0] == byte_tokenizer.bos_token_id for r in records)
    aime = [r["source"]["row"] for r in _by_category(records, "aime24")]
    assert aime == [0, 1, 2]
    if max_samples:
        assert [r["source"]["row"] for r in _by_category(records, "gsm8k")] != [0, 1, 2, 3]
    lcb = _by_category(records, "livecodebench")[0]["source"]
    assert lcb["files"] == [f"test{i}.jsonl" for i in ("", 2, 3, 4, 5, 6)] and lcb["revision"] == REVISION
    assert ("livecodebench/code_generation_lite", REVISION) in offline_hub  # the files read at the revision


def test_mt_bench_second_turn_is_built_on_the_first_turn_s_decoded_answer(offline_hub, byte_tokenizer):
    from dflash import benchmark as B

    (record,) = PS.build_records(PS.PACKAGE_0_1, byte_tokenizer, max_samples=1, categories=["mt-bench"])
    first, second = record["turns"]
    # turn 1's greedy completion ends at the stop token; the next turn sees it decoded without special tokens
    completion = byte_tokenizer.encode("Roses are red {x}.", add_special_tokens=False) + [byte_tokenizer.eos_token_id]
    answer = PS.answer_text(byte_tokenizer, completion)
    assert answer == "Roses are red {x}."
    for p in (PS.PACKAGE_0_1, PS.PAPER):
        messages = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": second}]
        if p is PS.PAPER:
            text, ids = paper_protocol.encode_turn(byte_tokenizer, messages)
        else:
            text = B.apply_chat_template(byte_tokenizer, messages, "off")
            ids = byte_tokenizer.encode(text, add_special_tokens=False)
        assert PS.turn_prompt(p, byte_tokenizer, record["turns"], [answer]) == (text, ids)
        assert text.count("<|im_start|>user") == 2 and text.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(PS.PromptSetError, match="nothing left to ask"):
        PS.turn_prompt(PS.PAPER, byte_tokenizer, record["turns"], [answer, answer])


def test_saved_sets_build_the_same_prompts_without_the_hub_and_a_revision_mismatch_is_refused(
        offline_hub, byte_tokenizer, tmp_path, monkeypatch):
    from_hub = PS.build_records(PS.PAPER, byte_tokenizer, max_samples=4)
    data = tmp_path / "data"
    assert build_main(["--preset", "dflash-paper", "--save-data", str(data)]) == 0
    monkeypatch.setattr(datasets, "load_dataset", None)  # from here on, no hub at all
    monkeypatch.setattr(PS, "hub_revision", None)
    assert PS.build_records(PS.PAPER, byte_tokenizer, max_samples=4, data_dir=data) == from_hub
    assert json.loads((data / "gsm8k" / PS.SOURCE_FILE).read_text())["revision"] == REVISION

    pinned = PS.PromptSet(**{**PS.PAPER.set("gsm8k").__dict__, "revision": "f" * 40})
    with pytest.raises(PS.PromptSetError, match=f"at revision '{REVISION}', the preset pins '{'f' * 40}'"):
        PS.load_set(pinned, data)
    with pytest.raises(PS.PromptSetError, match="no saved set here"):
        PS.load_set(PS.PAPER.set("gsm8k"), tmp_path / "elsewhere")


def test_the_0_1_protocol_refuses_a_template_without_the_thinking_switch(offline_hub, byte_tokenizer):
    import copy

    plain = copy.deepcopy(byte_tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(PS.PromptSetError, match="no enable_thinking switch"):
        PS.turn_prompt(PS.PACKAGE_0_1, plain, ["hi"])
    assert PS.turn_prompt(PS.PAPER, plain, ["hi"])[0] == "hi"  # the paper passes the flag regardless


def test_the_tool_writes_a_prompt_file_the_precompute_runs_only_with_the_same_tokenizer(
        offline_hub, byte_tokenizer, tmp_path, capsys):
    """Built for the tiny target's tokenizer: the precompute with that tokenizer caches exactly the built token
    ids; with another tokenizer it refuses before loading the weights."""
    from dflash_cb.cache.precompute import main as precompute_main
    from dflash_cb.cache.states import StateCache

    tok = save_tiny_tokenizer(tmp_path / "tok")
    other = tmp_path / "other"
    byte_tokenizer.save_pretrained(other)
    target = save_tiny_qwen3(tmp_path / "target")
    out = tmp_path / "mbpp.jsonl"
    assert build_main(["--preset", "dflash-0.1", "--sets", "mbpp,humaneval", "--max-samples", "2",
                       "--tokenizer", str(tok), "--out", str(out)]) == 0
    assert "mbpp.jsonl: 4 prompts of dflash-0.1 (mbpp 2, humaneval 2)" in capsys.readouterr().err
    records = load_prompts(out)
    assert [r.category for r in records] == ["mbpp", "mbpp", "humaneval", "humaneval"]
    assert all(r.source["revision"] == REVISION and r.tokenizer.startswith("sha256:") for r in records)
    assert records[0].input_ids[:3] == [TINY_WORDS.index(w) for w in ("<|im_start|>", "user", "<unk>")]

    common = ["--target", str(target), "--prompts", str(out), "--layers", "1", "--max-new-tokens", "3",
              "--dtype", "float32", "--no-progress"]
    assert precompute_main([*common, "--tokenizer", str(other), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "the prompts were built with tokenizer sha256:" in err and "build them again for this target" in err
    assert not (tmp_path / "refused").exists()

    assert precompute_main([*common, "--tokenizer", str(tok), "--out", str(tmp_path / "cache")]) == 0
    cache = StateCache(tmp_path / "cache")
    assert cache.manifest.prompts["sources"]["mbpp"] == {  # the manifest names each category's dataset revision
        "preset": "dflash-0.1", "dataset": "google-research-datasets/mbpp", "config": "sanitized", "split": "test",
        "revision": REVISION}
    for r in records:
        e = cache.entry(r.id)
        assert cache.load(r.id).input_ids[: e.prompt_len].tolist() == r.input_ids and e.category == r.category


def test_tool_errors_are_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    def unreachable(self, *args, **kwargs):  # what this machine's hub answers (it has no network)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    assert build_main(["--preset", "dflash-paper", "--sets", "gsm8k", "--save-data", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "openai/gsm8k (gsm8k): cannot read it from the Hugging Face hub" in err
    assert "build with --data-dir DIR" in err and not (tmp_path / "d" / "gsm8k" / PS.SOURCE_FILE).exists()
    assert build_main(["--preset", "dflash-paper", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--out and --tokenizer are needed" in capsys.readouterr().err
    assert build_main(["--preset", "dflash-0.1", "--sets", "alpaca", "--save-data", str(tmp_path)]) == 2
    assert "preset 'dflash-0.1' has no set 'alpaca'" in capsys.readouterr().err
    assert build_main(["--preset", "dflash-0.1", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no tokenizer files" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def _cache_samples(folder: Path) -> dict[str, tuple[list[int], list[int]]]:
    from dflash_cb.cache.states import StateCache

    cache = StateCache(folder)
    out = {}
    for e in cache.manifest.samples:
        ids = cache.load(e.id).input_ids.tolist()
        out[e.id] = (ids[: e.prompt_len], ids[e.prompt_len:])
    return out


@pytest.mark.parametrize("preset", ["dflash-0.1", "dflash-paper"])
def test_the_precompute_asks_mt_bench_s_second_turn_after_the_first_turn_s_greedy_answer(
        offline_hub, byte_tokenizer, tmp_path, preset):
    """Each turn a sample of its own (the request mean then averages over turns, as the authors' benchmark);
    turn 2's prompt is turn 1's conversation with the target's greedy answer decoded as their code decodes
    it, checked against dflash.benchmark's own steps (0.1) or the paper's transcription. A lost turn-2 shard
    is rebuilt from the kept turn 1; a completions file and a server give the same prompts."""
    from dflash import benchmark as B

    from dflash_cb.cache.precompute import main as precompute_main

    tok = tmp_path / "tok"
    byte_tokenizer.save_pretrained(tok)
    target = save_tiny_qwen3(tmp_path / "target", vocab_size=300)  # every byte token in its vocabulary
    prompts = tmp_path / "mt.jsonl"
    assert build_main(["--preset", preset, "--sets", "mt-bench", "--max-samples", "2", "--tokenizer", str(tok),
                       "--out", str(prompts)]) == 0
    firsts = load_prompts(prompts)
    common = ["--target", str(target), "--prompts", str(prompts), "--tokenizer", str(tok), "--layers", "1",
              "--max-new-tokens", "6", "--dtype", "float32", "--no-progress"]
    out = tmp_path / "local"
    assert precompute_main([*common, "--out", str(out)]) == 0
    samples = _cache_samples(out)
    assert sorted(samples) == sorted([r.id for r in firsts] + [f"{r.id}.t2" for r in firsts])
    for r in firsts:
        prompt, answer_ids = samples[r.id]
        assert prompt == r.input_ids and answer_ids
        answer = byte_tokenizer.decode(answer_ids, skip_special_tokens=True)
        assert answer and answer in byte_tokenizer.decode(samples[f"{r.id}.t2"][0])  # the answer is in turn 2
        messages = [{"role": "user", "content": r.turns[0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": r.turns[1]}]
        if preset == "dflash-0.1":
            expected = byte_tokenizer.encode(B.apply_chat_template(byte_tokenizer, messages, "off"),
                                             add_special_tokens=False)
        else:
            expected = paper_protocol.encode_turn(byte_tokenizer, messages)[1]
        assert samples[f"{r.id}.t2"][0] == expected
    from dflash_cb.cache.states import StateCache

    assert {e.category for e in StateCache(out).manifest.samples} == {"mt-bench"}

    # a damaged turn-2 shard: recomputed, its prompt rebuilt from turn 1's kept shard; the same bytes again
    from test_precompute import folder_digest

    before = folder_digest(out)
    last = StateCache(out).entry(f"{firsts[1].id}.t2").shard
    (out / last).write_bytes(b"damaged")
    assert precompute_main([*common, "--out", str(out)]) == 0
    assert folder_digest(out) == before

    # the same completions from a file: the same prompts, turn 2's built from the file's turn 1
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps({"id": sid, "output_ids": comp}) + "\n"
                                   for sid, (_, comp) in samples.items()))
    assert precompute_main([*common, "--out", str(tmp_path / "file"), "--reference", "file",
                            "--completions", str(completions)]) == 0
    assert _cache_samples(tmp_path / "file") == samples


def test_a_server_answers_turn_two_after_turn_one(offline_hub, byte_tokenizer, tmp_path):
    from local_http import JSONHandler, serve
    from test_precompute import FakeSGLang

    from dflash_cb.cache.precompute import main as precompute_main

    tok = tmp_path / "tok"
    byte_tokenizer.save_pretrained(tok)
    target = save_tiny_qwen3(tmp_path / "target", vocab_size=300)
    prompts = tmp_path / "mt.jsonl"
    assert build_main(["--preset", "dflash-paper", "--sets", "mt-bench", "--max-samples", "2",
                       "--tokenizer", str(tok), "--out", str(prompts)]) == 0
    common = ["--target", str(target), "--prompts", str(prompts), "--tokenizer", str(tok), "--layers", "1",
              "--max-new-tokens", "6", "--dtype", "float32", "--no-progress"]
    assert precompute_main([*common, "--out", str(tmp_path / "local")]) == 0
    server = FakeSGLang(target)

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            self.send_json({} if self.path == "/health" else {"model_path": str(target), "is_generation": True})

        def do_POST(self) -> None:
            self.send_json(server.generate(self.read_json()))

    with serve(Handler) as url:
        out = tmp_path / "served"
        assert precompute_main([*common, "--out", str(out), "--reference", "sglang", "--sglang-url", url]) == 0
        assert server.calls == 4  # two first turns, then two second turns
        assert _cache_samples(out) == _cache_samples(tmp_path / "local")  # the served greedy path is the local one
        journal = [json.loads(line)["id"] for line in (out / "reference_completions.jsonl").read_text().splitlines()]
        assert sorted(journal) == sorted(_cache_samples(out))


def _command(name: str, *argv: str) -> int:
    """The console command ``name`` in this process, found as pyproject.toml names it."""
    import importlib

    from test_commands import console_scripts, launched

    from dflash_cb.common.cli import run

    module, attr = launched(console_scripts()[name]).split(":")
    return run(getattr(importlib.import_module(module), attr).main, list(argv))


def test_a_cache_of_the_paper_preset_puts_each_published_figure_beside_its_own_benchmark(
        offline_hub, drafter_dir, tmp_path, capsys):
    """The authors' table (configs/baselines/published.yaml) beside a cache of their prompts: each benchmark's
    figure stands beside the same benchmark's request mean (mt-bench: both turns), not the overall one."""
    from dflash_cb.cache.precompute import main as precompute_main
    from dflash_cb.cache.states import StateCache

    tok = save_tiny_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "paper.jsonl"
    assert build_main(["--preset", "dflash-paper", "--sets", "gsm8k,mt-bench", "--max-samples", "2",
                       "--tokenizer", str(tok), "--out", str(prompts)]) == 0
    cache = tmp_path / "cache"
    assert precompute_main(["--target", str(save_tiny_qwen3(tmp_path / "target")), "--prompts", str(prompts),
                            "--tokenizer", str(tok), "--layers", "0,2", "--max-new-tokens", "10", "--dtype",
                            "float32", "--no-progress", "--out", str(cache)]) == 0
    assert sorted(s.category for s in StateCache(cache).manifest.samples) == ["gsm8k"] * 2 + ["mt-bench"] * 4
    results = []
    for name in ("a", "b"):  # a comparison takes two evaluations: the same drafter twice is enough here
        results.append(tmp_path / f"{name}.json")
        assert _command("dflash-eval", "--states", str(cache), "--drafter", str(drafter_dir), "--ddtree-budgets", "",
                        "--out", str(results[-1])) == 0
    capsys.readouterr()
    assert _command("dflash-compare", *map(str, results), "--out", str(tmp_path / "cmp"), "--published",
                    str(ROOT / "configs" / "baselines" / "published.yaml")) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dflash-qwen3-8b-b16 |")]
    for benchmark in ("gsm8k", "mt-bench"):
        row = next(r for r in rows if f"tau, {benchmark}," in r)
        assert "(all prompts)" not in row and "n/a" not in row, row
    assert "(all prompts)" in next(r for r in rows if "tau, math500," in r)  # a benchmark this cache lacks


def test_the_precompute_builds_a_preset_itself_as_the_tool_builds_it(offline_hub, tmp_path, capsys):
    """``--prompt-set`` (with the target's tokenizer) caches what ``--prompts`` over the tool's file caches, shard
    for shard, mt-bench's second turn included; giving both is one line before any work."""
    from test_precompute import folder_digest

    from dflash_cb.cache.precompute import main as precompute_main

    tok = save_tiny_tokenizer(tmp_path / "tok")
    target = save_tiny_qwen3(tmp_path / "target")
    built = tmp_path / "built.jsonl"
    assert build_main(["--preset", "dflash-0.1", "--max-samples", "1", "--tokenizer", str(tok),
                       "--out", str(built)]) == 0
    common = ["--target", str(target), "--tokenizer", str(tok), "--layers", "1", "--max-new-tokens", "3",
              "--dtype", "float32", "--no-progress"]
    assert precompute_main([*common, "--prompts", str(built), "--out", str(tmp_path / "a")]) == 0
    assert precompute_main([*common, "--prompt-set", "dflash-0.1", "--prompt-max-samples", "1",
                            "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b.prompts.jsonl").read_text() == built.read_text()
    shards = sorted(p.name for p in (tmp_path / "a").glob("states-*.safetensors"))
    a, b = folder_digest(tmp_path / "a"), folder_digest(tmp_path / "b")
    assert shards and any(".t2" in line for line in (tmp_path / "a" / "manifest.json").read_text().split('"'))
    assert all(a[n] == b[n] for n in shards)
    capsys.readouterr()
    import datasets

    def unreachable(*args, **kwargs):  # what this machine's hub answers (it has no network)
        raise ConnectionError("Name or service not known")

    with pytest.MonkeyPatch.context() as mp:  # without the hub, the precompute names its own option for saved sets
        mp.setattr(PS, "hub_revision", unreachable)
        mp.setattr(datasets, "load_dataset", unreachable)
        assert precompute_main([*common, "--prompt-set", "dflash-0.1", "--prompt-max-samples", "1",
                                "--out", str(tmp_path / "c")]) != 0
    err = capsys.readouterr().err
    assert "build with --prompt-data-dir DIR" in err and " --data-dir" not in err, err
    assert precompute_main([*common, "--prompt-set", "dflash-0.1", "--prompts", str(built),
                            "--out", str(tmp_path / "c")]) == 2
    assert "--prompt-set dflash-0.1 and --prompts" in capsys.readouterr().err and not (tmp_path / "c").exists()
