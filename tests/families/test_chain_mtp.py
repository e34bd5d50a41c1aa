"""The target's own MTP head as a chain drafter: extracted from a tiny Qwen3.5 checkpoint that carries ``mtp.*``
weights (which transformers drops on load), cached beside the layers a block drafter reads, and replayed
cycle for cycle as an independent loop over transformers' ``Qwen3_5DecoderLayer`` wired as vLLM wires it
(``chain_reference.mtp_generate``) runs it, at K = 1, 3 and 5, under both tail conventions, with a stop token."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

MAX_NEW = 30
LAYERS = [1, 2]  # a block drafter's layers; the MTP reads layer 3 (the last: the target's final-normed state)


def _precompute(target: Path, prompts: Path, out: Path, *extra: str) -> Path:
    from dflash_cb.cache.precompute import main

    assert main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--reference", "local",
                 "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--no-progress", *extra]) == 0
    return out


def _dflash_config(m) -> dict:
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    return tiny_drafter_config(m.vocab_size, m.hidden_size, 4, LAYERS, 127, block_size=6)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from chain_reference import train_chain
    from safetensors.torch import load_file, save_file
    from tiny_target import random_prompts, save_tiny_qwen3_5, write_prompts

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.drafters.mtp.model import mtp_config_from_target

    root = tmp_path_factory.mktemp("mtp")
    target_dir = save_tiny_qwen3_5(root / "target", seed=3, mtp_num_hidden_layers=1)
    prompts = write_prompts(root / "prompts.jsonl", random_prompts(5, (4, 10), seed=5, vocab=120),
                            categories=["math", "chat"])
    first = StateCache(_precompute(target_dir, prompts, root / "plain", "--layers", "3"))
    seen = [set(first.load(e.id).input_ids[e.prompt_len + 6:].tolist()) for e in first.samples]
    stop = next(t for t, n in Counter(t for s in seen for t in s).most_common() if n == 2)
    cfg = mtp_config_from_target(json.loads((target_dir / "config.json").read_text()), 5)
    # One cache for a block drafter and the MTP head: the union of the layers their configs read.
    (root / "mtp.json").write_text(json.dumps(cfg))
    (root / "dflash.json").write_text(json.dumps(_dflash_config(first.manifest)))
    cache = StateCache(_precompute(target_dir, prompts, root / "cache", "--stop-token-ids", str(stop),
                                   "--drafter-config", f"{root / 'dflash.json'},{root / 'mtp.json'}"))
    assert cache.manifest.layer_ids == [1, 2, 3]
    torch.manual_seed(0)
    drafter = train_chain(drafter_from_config(cfg), cache)
    # The trained head goes into the target's checkpoint under mtp.*, as the released Qwen3.5 / 3.6 ship it.
    shard = target_dir / "model.safetensors"
    state = load_file(str(shard))
    save_file({**state, **{k: v.detach().clone() for k, v in drafter.state_dict().items()}}, str(shard),
              metadata={"format": "pt"})
    return dict(root=root, target_dir=target_dir, cache=cache, drafter=drafter, stop=stop)


@pytest.fixture(scope="module")
def target(world):
    """The target with its MTP head, loaded once: the reference loops over it share its passes
    (``chain_reference.LastPass``). Read it, never change it."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(world["target_dir"], dtype=torch.float32).eval()


def test_the_mtp_head_is_extracted_from_the_target_checkpoint(world, tmp_path: Path) -> None:
    """``--mtp-from`` writes the mtp.* weights as a drafter folder that loads wherever a drafter loads; a target
    without them is refused naming why."""
    from dflash_cb.core.checkpoints.load import CheckpointError, extract_from_target, load_drafter
    from dflash_cb.integrations.cli.extract import main

    assert main(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp"),
                 "--speculative-tokens", "3"]) == 0
    back = load_drafter(tmp_path / "mtp")
    ours = world["drafter"]
    assert type(back) is type(ours) and back.spec.block_size == 4 and back.spec.family == "mtp"
    assert back.spec.target_layer_ids == (3,)
    assert back.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items())
    from tiny_target import save_tiny_qwen3_5

    bare = save_tiny_qwen3_5(tmp_path / "bare", seed=1, mtp_num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"no safetensors file holds mtp\.\* weights"):
        extract_from_target(bare, tmp_path / "none")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("tail", ["served", "reference"])
def test_the_replay_equals_a_vllm_wired_mtp_loop(world, target, tail: str) -> None:
    """Cycle for cycle at K = 1, 3 and 5 (blocks of 2, 4, 6), against transformers' own decoder layer in a
    per-cycle loop; some cycles accept drafts and some do not; samples end at the stop token or at
    max_new_tokens; tau > 1.5."""
    from chain_reference import ReferenceMtp, mtp_generate

    from dflash_cb.core.replay import evaluate

    cache = world["cache"]
    ref = ReferenceMtp(target.config.text_config, world["drafter"].state_dict()).eval()
    stops = cache.manifest.stop_token_ids
    for k in (1, 3, 5):
        want = {e.id: mtp_generate(ref, target, cache.load(e.id).input_ids[: e.prompt_len].tolist(), MAX_NEW, stops,
                                   k, tail) for e in cache.samples}
        rep = evaluate(cache, world["drafter"], block_size=k + 1, tail_blocks=tail, budgets=())
        assert {s.id: s.acceptance_lengths for s in rep.samples} == want, k
        cycles = [n for v in want.values() for n in v]
        assert any(n > 1 for n in cycles) and any(n == 1 for n in cycles)
        print(f"MTP K={k} ({tail}): tau {rep.summary['tau']:.4f}, {len(cycles)} cycles")
        if k == 3:
            assert rep.summary["tau"] > 1.5
    ends = [cache.load(e.id).input_ids[-1].item() == world["stop"] for e in cache.samples]
    assert any(ends) and not all(ends)


def test_a_chain_refuses_a_ddtree(world) -> None:
    from dflash_cb.common.errors import DFlashCBError
    from dflash_cb.core.replay import evaluate

    with pytest.raises(DFlashCBError, match="MTP drafter drafts each depth from its parent token"):
        evaluate(world["cache"], world["drafter"], budgets=(4,))


def test_the_targets_mtp_is_the_line_to_beat_in_the_callback(world, tmp_path: Path) -> None:
    """``eval_drafter`` scores the extracted MTP folder at K = 3 on the same cache as a block drafter; the live
    evaluation of a DFlash drafter takes it as a baseline (``baselines={"mtp": ...}``) and logs its tau beside
    its own, without a warning that the reference drafted another block (another family's chain length is not
    a mismatch)."""
    from dflash_cb import LiveEvaluator
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.integrations.cli import eval_drafter
    from dflash_cb.integrations.cli.extract import main as extract

    cache = world["cache"]
    m = cache.manifest
    assert extract(["--from-target", str(world["target_dir"]), "--out", str(tmp_path / "mtp")]) == 0
    assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "mtp"), "--out",
                              str(tmp_path / "mtp.json"), "--ddtree-budgets", "", "--device", "cpu"]) == 0
    mtp = json.loads((tmp_path / "mtp.json").read_text())
    assert mtp["meta"]["drafter_family"] == "mtp" and mtp["metrics"]["tau"] > 1.5
    torch.manual_seed(0)
    dflash = drafter_from_config(_dflash_config(m))
    logged: dict[str, float] = {}
    warnings: list[str] = []
    ev = LiveEvaluator(str(cache.path), every_n_train_steps=1, max_steps=1, ddtree_budgets=(), console=False,
                       baselines={"mtp": str(tmp_path / "mtp.json")}, log=lambda metrics, step: logged.update(metrics))
    from dflash_cb.common import log as tool_log

    saved = tool_log.warn
    tool_log.warn = warnings.append
    try:
        assert ev.start(0, dflash) is not None
    finally:
        tool_log.warn = saved
    assert logged["dflash_eval/baseline/mtp/tau"] == mtp["metrics"]["tau"]
    assert not [w for w in warnings if "block" in w], warnings


def test_the_serving_projection_counts_a_chains_steps(world, tmp_path: Path) -> None:
    """A chain of K drafts costs K drafter steps a cycle: with a verify cost flat in the tokens verified and
    a step costing a K-th of it, a cycle costs two verify steps and the projected speedup is half the pooled
    tau. One profile times both drafters (each evaluation takes its own drafter's cost); the serving plan sets
    the MTP head beside a block drafter, its setting named by its chain length."""
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.integrations.cli import eval_drafter, profile_costs, serve_plan
    from dflash_cb.integrations.cli.extract import main as extract

    cache, m = world["cache"], world["cache"].manifest
    assert extract(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp")]) == 0
    torch.manual_seed(0)
    drafter_from_config(_dflash_config(m)).save_pretrained(tmp_path / "dflash")
    (tmp_path / "v.csv").write_text("verified_tokens,seconds\n1,0.03\n9,0.03\n")
    prof = tmp_path / "p.json"
    # One profile for both: a DFlash pass costs a verify step, an MTP step a third of one.
    assert profile_costs.main(["--from-csv", str(tmp_path / "v.csv"), "--drafter",
                               f"{tmp_path / 'dflash'},{tmp_path / 'mtp'}", "--draft-seconds", "0.03,0.01",
                               "--out", str(prof)]) == 0
    files = []
    for name in ("mtp", "dflash"):
        files.append(tmp_path / f"{name}.json")
        assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / name), "--out",
                                  str(files[-1]), "--ddtree-budgets", "", "--profile", str(prof)]) == 0
    for f in files:  # each drafter's cycle costs two verify steps: K = 3 steps of 0.01, or one pass of 0.03
        m = json.loads(f.read_text())["metrics"]
        assert m["serving/speedup_greedy"] == pytest.approx(m["tau"] / 2, rel=1e-12), f
    assert serve_plan.main([str(files[0]), str(files[1]), "--out", str(tmp_path / "plan")]) == 0
    md = (tmp_path / "plan.md").read_text()
    assert "| mtp | chain K=3" in md and "| dflash | block 6" in md
    # Families side by side is a normal comparison: each drafts its own block, no "not like for like" warning.
    from dflash_cb.integrations.cli.compare import main as compare

    assert compare([str(files[0]), str(files[1]), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp.md").read_text()
    assert "| tau (pooled over cycles) |" in table and "block_size differ" not in table


def test_a_profile_times_one_chain_step(world, tmp_path: Path, monkeypatch) -> None:
    """``profile_costs --drafter`` on the MTP folder measures, through the replay's runner, one chain step a
    context (one decoder-layer pass of one token, counted), and its roofline charges a step one token."""
    from dflash_cb.core.drafters.chain import ChainRunner
    from dflash_cb.integrations.cli import profile_costs
    from dflash_cb.integrations.cli.extract import main as extract

    assert extract(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp")]) == 0
    steps: list[int] = []
    real = ChainRunner.block_rows

    def counted(self, context, noise_embedding, *a, **k):
        steps.append(noise_embedding.shape[1] - 2)  # the unroll's steps beyond the context row
        return real(self, context, noise_embedding, *a, **k)

    monkeypatch.setattr(ChainRunner, "block_rows", counted)
    out = tmp_path / "p.json"
    torch.manual_seed(0)
    from dflash_cb.core.drafters.layouts import drafter_from_config

    drafter_from_config(_dflash_config(world["cache"].manifest)).save_pretrained(tmp_path / "dflash")
    assert profile_costs.main(["--target", str(world["target_dir"]), "--drafter",
                               f"{tmp_path / 'mtp'},{tmp_path / 'dflash'}", "--out", str(out), "--dtype", "float32",
                               "--contexts", "8,16", "--tokens", "1-6", "--repeats", "1"]) == 0
    assert steps and set(steps) == {1}  # every timed MTP pass is one step
    data = json.loads(out.read_text())
    assert data["drafter"]["family"] == "mtp" and all(v > 0 for v in data["draft"].values())
    assert [o["drafter"]["family"] for o in data["others"]] == ["dflash"]
    assert all(v > 0 for v in data["others"][0]["draft"].values())
    roof = tmp_path / "r.json"
    assert profile_costs.main(["--roofline", "--target", str(world["target_dir"]), "--drafter", str(tmp_path / "mtp"),
                               "--bandwidth-gbs", "1", "--peak-tflops", "1", "--contexts", "8", "--out",
                               str(roof)]) == 0
    assert json.loads(roof.read_text())["draft"]["8"] > 0
    # A chain of one step is still a chain: a pass is a step, not its whole block of two.
    from dflash_cb.core.checkpoints.load import load_drafter

    assert extract(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp1"),
                    "--speculative-tokens", "1"]) == 0
    assert profile_costs._pass_tokens(load_drafter(tmp_path / "mtp1")) == 1


def test_eval_drafter_scores_several_chain_lengths(world, tmp_path: Path, caplog) -> None:
    """``--speculative-tokens 1,3`` writes one results file per K, each the evaluation at block K + 1; a block
    drafter is refused before any scoring, naming --block-size. One K writes --out itself, as named, and says so."""
    from dflash_cb.common.arguments import ArgumentError
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.replay import evaluate
    from dflash_cb.integrations.cli import eval_drafter

    cache = world["cache"]
    world["drafter"].save_pretrained(tmp_path / "mtp")
    caplog.set_level("INFO")
    assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "mtp"), "--out",
                              str(tmp_path / "r.json"), "--speculative-tokens", "3,1", "--ddtree-budgets", ""]) == 0
    said = caplog.text
    for k in (1, 3):
        got = json.loads((tmp_path / f"r.k{k}.json").read_text())
        assert got["metrics"]["tau"] == evaluate(cache, world["drafter"], block_size=k + 1, budgets=()).summary["tau"]
        assert f"-> {tmp_path / f'r.k{k}.json'}" in said
    assert not (tmp_path / "r.json").exists()
    caplog.clear()
    assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "mtp"), "--out",
                              str(tmp_path / "one.json"), "--speculative-tokens", "3", "--ddtree-budgets", ""]) == 0
    assert json.loads((tmp_path / "one.json").read_text())["metrics"]["tau"] == json.loads(
        (tmp_path / "r.k3.json").read_text())["metrics"]["tau"]
    assert f"-> {tmp_path / 'one.json'}" in caplog.text and not (tmp_path / "one.k3.json").exists()
    torch.manual_seed(0)
    drafter_from_config(_dflash_config(cache.manifest)).save_pretrained(tmp_path / "dflash")
    with pytest.raises(ArgumentError, match="drafts a block in one pass; score another block with --block-size"):
        eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "dflash"), "--out",
                           str(tmp_path / "d.json"), "--speculative-tokens", "3"])


def test_the_served_check_of_an_mtp_server(world, target, tmp_path: Path) -> None:
    """A real HTTP server on 127.0.0.1 speaking vLLM's API, serving the target with ``method: mtp`` and
    ``num_speculative_tokens`` 3, its rounds those of the vLLM-wired MTP loop: the precompute records each
    request's counters; the replay of the extracted head at the server's block (K + 1 = 4, read from the server's
    configuration) counts the same rounds and per-position acceptance on every sample; a DFlash drafter's check of
    the same cache says the server speculates with another method."""
    from chain_reference import ReferenceMtp, mtp_run
    from vllm_server import FakeVLLM, Run, serve

    from dflash_cb.common.cli import run
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter
    from dflash_cb.integrations.cli.extract import main as extract

    ref = ReferenceMtp(target.config.text_config, world["drafter"].state_dict()).eval()

    def loop(prompt: list[int], max_tokens: int, stops: set[int]) -> Run:
        got = mtp_run(ref, target, prompt, max_tokens, sorted(stops), 3)
        return Run(got.output, got.correct)

    fake = FakeVLLM(loop, served_name="tiny-target", root=str(world["target_dir"]), num_spec_tokens=3, method="mtp",
                    dev_mode=True)
    with serve(fake) as url:
        _precompute(world["target_dir"], world["root"] / "prompts.jsonl", tmp_path / "served", "--drafter-config",
                    f"{world['root'] / 'dflash.json'},{world['root'] / 'mtp.json'}", "--stop-token-ids",
                    str(world["stop"]), "--reference", "vllm", "--vllm-url", url)
    assert extract(["--mtp-from", str(world["target_dir"]), "--out", str(tmp_path / "mtp"),
                    "--speculative-tokens", "5"]) == 0  # its config says K = 5: the check replays the server's 3
    assert run(eval_drafter.main, ["--states", str(tmp_path / "served"), "--drafter", str(tmp_path / "mtp"), "--out",
                                   str(tmp_path / "r.json"), "--ddtree-budgets", "", "--served-check"]) == 0
    check = load_results(tmp_path / "r.json").breakdown["served_check"]
    s = check["summary"]
    assert s["comparable"] and not check["not_comparable"], check["not_comparable"]
    assert check["blocks"]["replay"] == check["blocks"]["server"] == 4
    assert s["samples_compared"] == s["samples_equal_rounds"] == s["samples_equal_per_position"] == 5
    torch.manual_seed(0)
    drafter_from_config(_dflash_config(world["cache"].manifest)).save_pretrained(tmp_path / "dflash")
    assert run(eval_drafter.main, ["--states", str(tmp_path / "served"), "--drafter", str(tmp_path / "dflash"), "--out",
                                   str(tmp_path / "d.json"), "--ddtree-budgets", "", "--served-check"]) == 0
    other = load_results(tmp_path / "d.json").breakdown["served_check"]
    assert not other["summary"]["comparable"]
    assert any("speculates with 'mtp', not DFlash" in w for w in other["not_comparable"]), other["not_comparable"]


def test_the_default_ddtree_budgets_are_dropped_for_a_chain(world, tmp_path: Path) -> None:
    """A chain drafts no DDTree: the tools' and the live evaluator's default budgets go without a word from the
    user; budgets the user names are refused, naming why."""
    from dflash_cb import LiveEvaluator
    from dflash_cb.common.errors import DFlashCBError
    from dflash_cb.integrations.cli import eval_drafter

    cache = world["cache"]
    world["drafter"].save_pretrained(tmp_path / "mtp")
    assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "mtp"), "--out",
                              str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["ddtree_budgets"] == []
    with pytest.raises(DFlashCBError, match="--ddtree-budgets \\[4\\]: a MTP drafter drafts each depth"):
        eval_drafter.main(["--states", str(cache.path), "--drafter", str(tmp_path / "mtp"), "--out",
                           str(tmp_path / "s.json"), "--ddtree-budgets", "4"])
    logged: dict[str, float] = {}
    ev = LiveEvaluator(str(cache.path), every_n_train_steps=1, max_steps=1, console=False,
                       log=lambda metrics, step: logged.update(metrics))
    assert ev.start(0, world["drafter"]) is not None
    assert logged["dflash_eval/tau"] == json.loads((tmp_path / "r.json").read_text())["metrics"]["tau"]
    assert not any("ddtree" in k for k in logged)
