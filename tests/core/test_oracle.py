"""Exactness against the ground truth: the reference ``dflash.model.dflash_generate`` loop
(``tail_blocks="reference"``) and an independent full-block loop (``tail_blocks="served"``,
tests/support/full_block_loop.py).

A tiny Qwen3 target and a briefly trained drafter (so acceptance is neither trivially 1 nor
trivially full) run the real speculative loop; the same prompts go through our precompute tool
(``--reference local --dtype float32``) and our engine / ``tools/eval_drafter.py``. The per-sample
``acceptance_lengths`` lists must be identical, cycle for cycle. With the layer offset wrong they
must not be.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import oracles
import pytest
import torch

from dflash_cb.core.drafters.registry import spec_from_config

dm = oracles.require("dflash.model")

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [1, 3]  # the drafter's target layers: outputs of decoder layers 1 and 3 of the 4-layer target
MAX_NEW = 40
BLOCK = 6


def _drafter_config(vocab: int, hidden: int) -> dict:
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=4, block_size=BLOCK,
        # The second drafter layer is causal with a sliding window shorter than the contexts (docs/method.md).
        layer_types=["full_attention", "sliding_attention"], sliding_window=9, use_sliding_window=True,
        dflash_config={"target_layer_ids": LAYERS, "mask_token_id": vocab - 1},
    )


def _precompute(target: Path, prompts: Path, out: Path, layers: list[int]) -> Path:
    from dflash_cb.cache.precompute import main

    rc = main(["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--layers",
               ",".join(map(str, layers)), "--reference", "local", "--dtype", "float32",
               "--max-new-tokens", str(MAX_NEW), "--no-progress"])
    assert rc == 0
    return out


def _run_loops(cache, ref, target, cfg: dict, block: int) -> tuple[dict, dict]:
    """Per sample: dflash_generate's acceptance lengths and the full-block loop's run, both at ``block``."""
    from full_block_loop import full_block_generate

    stops = cache.manifest.stop_token_ids
    # dflash_generate times itself with CUDA events; on CPU a wall clock does the same job.
    orig = dm._cuda_time
    dm._cuda_time = time.perf_counter
    try:
        oracle, full = {}, {}
        for e in cache.samples:
            prompt = cache.load(e.id).input_ids[: e.prompt_len][None]
            st = dm.dflash_generate(ref, target, prompt, MAX_NEW, stops, block_size=block, return_stats=True)
            oracle[e.id] = list(st.acceptance_lengths)
            full[e.id] = full_block_generate(ref, target, prompt[0].tolist(), MAX_NEW, stops, LAYERS, block,
                                             cfg["dflash_config"]["mask_token_id"])
    finally:
        dm._cuda_time = orig
    return oracle, full


@pytest.fixture(scope="module")
def setup(oracle_world: dict, tmp_path_factory: pytest.TempPathFactory):
    from tiny_target import ORACLE_LAYERS, ORACLE_MAX_NEW, train_briefly
    from transformers import Qwen3Config

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    assert (LAYERS, MAX_NEW) == (ORACLE_LAYERS, ORACLE_MAX_NEW)
    root = tmp_path_factory.mktemp("oracle")
    # the tiny target's plain cache (tiny_target.build_oracle_world)
    target_dir, prompts, cache = oracle_world["target_dir"], oracle_world["prompts"], oracle_world["plain"]
    m = cache.manifest
    cfg = _drafter_config(m.vocab_size, m.hidden_size)
    torch.manual_seed(0)
    ours = train_briefly(DFlashDrafter.from_config_dict(cfg), cache)  # partial acceptance: the interesting regime
    ref = dm.DFlashDraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict(ours.state_dict())
    target = oracle_world["target"]
    oracle, full = _run_loops(cache, ref, target, cfg, BLOCK)
    return dict(root=root, target_dir=target_dir, prompts=prompts, cache=cache, ours=ours, ref=ref, oracle=oracle,
                cfg=cfg, full=full, target=target)


def test_eval_tool_matches_oracle(setup, tmp_path: Path) -> None:
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter as eval_drafter

    setup["ours"].save_pretrained(tmp_path / "drafter")
    out = tmp_path / "results.json"
    assert eval_drafter.main(["--states", str(setup["cache"].path), "--drafter", str(tmp_path / "drafter"),
                              "--out", str(out), "--ddtree-budgets", "4,16", "--dtype", "float32",
                              "--tail-blocks", "reference"]) == 0
    res = load_results(out)
    assert {s.id: s.acceptance_lengths for s in res.samples} == setup["oracle"]
    cycles = [n for v in setup["oracle"].values() for n in v]
    assert res.tau == pytest.approx(sum(cycles) / len(cycles))
    assert res.manifest_sha256 == setup["cache"].manifest_sha256
    assert res.budgets == [4, 16]
    # Cost accounting: a full evaluation drafts every anchor once, no more.
    meta = res.meta
    assert meta["anchor_stride"] == 1 and meta["tail_blocks"] == "reference"
    assert meta["anchors_drafted"] == meta["anchors_needed"] > sum(map(len, setup["oracle"].values()))
    # A bigger tree never accepts less on the same cycle structure start.
    assert res.metric("ddtree/tau_b16") >= res.metric("ddtree/tau_b4") - 1e-9


def test_generic_runner_matches(setup) -> None:
    from dflash_cb.core.drafters.dflash.runner import PerAnchorRunner
    from dflash_cb.core.replay import evaluate

    runner = PerAnchorRunner(setup["ref"], spec_from_config(setup["ref"].config))
    sub = [e.id for e in setup["cache"].samples[:3]]
    rep = evaluate(setup["cache"], runner, budgets=(), sample_ids=sub, device="cpu", tail_blocks="reference")
    assert {s.id: s.acceptance_lengths for s in rep.samples} == {k: setup["oracle"][k] for k in sub}


def test_wrong_layer_offset_is_caught(setup) -> None:
    """A cache that read hidden_states[i] instead of hidden_states[i + 1] must not reproduce the loop."""
    from dflash_cb.cache.manifest import MANIFEST_NAME
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    out = _precompute(setup["target_dir"], setup["prompts"], setup["root"] / "cache_offset",
                      [i - 1 for i in LAYERS])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["layer_ids"] = LAYERS  # the off-by-one bug: features of layer i - 1 labelled as layer i
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    rep = evaluate(StateCache(out), setup["ours"], budgets=())
    assert {s.id: s.acceptance_lengths for s in rep.samples} != setup["oracle"]


def test_temperature_one_estimate_with_stored_topk(setup) -> None:
    """--topk-logprobs adds the (labelled) temperature-1 estimate; the greedy replay is unchanged."""
    from dflash_cb.cache.precompute import main
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.figures.metrics import T1_TAU_ESTIMATE
    from dflash_cb.core.replay import evaluate

    out = setup["root"] / "cache_topk"
    assert main(["--target", str(setup["target_dir"]), "--prompts", str(setup["prompts"]), "--out", str(out),
                 "--layers", ",".join(map(str, LAYERS)), "--reference", "local", "--dtype", "float32",
                 "--max-new-tokens", str(MAX_NEW), "--topk-logprobs", "8", "--no-progress"]) == 0
    rep = evaluate(StateCache(out), setup["ours"], budgets=(), tail_blocks="reference")
    assert {s.id: s.acceptance_lengths for s in rep.samples} == setup["oracle"]
    est = rep.summary[T1_TAU_ESTIMATE]
    assert 1.0 <= est <= BLOCK


def test_overlap_is_sum_of_min_p_q() -> None:
    from dflash_cb.core.drafters.proposers import apply_head
    from dflash_cb.core.drafters.spec import DrafterSpec

    torch.manual_seed(0)
    hidden, head = torch.randn(5, 8), torch.randn(11, 8)
    spec = DrafterSpec(block_size=4, mask_token_id=10, target_layer_ids=(0,), target_hidden_size=8, vocab_size=11)
    q = torch.softmax(hidden @ head.T, -1)
    p = torch.softmax(torch.randn(5, 11), -1)
    lp, ids = torch.topk(torch.log(p), 4, dim=-1)
    out = apply_head(hidden, head, spec, k=3, target_topk=(ids, lp))
    want = torch.minimum(p.gather(-1, ids), q.gather(-1, ids)).sum(-1)
    assert out.overlap.dtype == torch.float64 and torch.allclose(out.overlap, want.double(), atol=1e-6)
    assert torch.equal(out.argmax, q.argmax(-1))
    assert torch.allclose(out.topk_logprobs, torch.topk(torch.log(q), 3, -1).values, atol=1e-5)


@pytest.mark.parametrize("tail_blocks", ["reference", "served"])
def test_disagreement_truncates_scoring(setup, tmp_path: Path, tail_blocks: str) -> None:
    """valid_len cuts scoring: a sample off the greedy path at its first token scores no cycle,
    one cut mid-way scores only the cycles before the cut; the others are unchanged (under either
    tail convention, against its own oracle)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_cb.cache.integrity import sha256_file
    from dflash_cb.cache.manifest import MANIFEST_NAME
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    src = setup["cache"].path
    dst = tmp_path / "cut"
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    first, second = manifest["samples"][0], manifest["samples"][1]

    def disagree_at(entry: dict, position: int) -> None:
        """Make the stored target argmax differ from the served token at ``position`` (the reader
        recomputes valid_len from it: editing the manifest alone is refused)."""
        shard = dst / entry["shard"]
        tensors = load_file(str(shard))
        argmax = tensors[f"{entry['id']}/target_argmax"].clone()
        argmax[position - 1] = (int(tensors[f"{entry['id']}/input_ids"][position]) + 1) % manifest["target"]["vocab_size"]
        tensors[f"{entry['id']}/target_argmax"] = argmax
        save_file(tensors, str(shard))
        info = next(s for s in manifest["shards"] if s["file"] == entry["shard"])
        info["sha256"], info["bytes"] = sha256_file(shard), shard.stat().st_size
        entry["valid_len"] = position

    disagree_at(first, first["prompt_len"])
    disagree_at(second, second["prompt_len"] + 7)
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    rep = evaluate(StateCache(dst), setup["ours"], budgets=(4,), tail_blocks=tail_blocks)
    oracle = setup["oracle"] if tail_blocks == "reference" else {k: v.acceptance_lengths
                                                                 for k, v in setup["full"].items()}
    got = {s.id: s for s in rep.samples}
    assert got[first["id"]].acceptance_lengths == [] and got[first["id"]].ddtree[4] == []
    cut = got[second["id"]].acceptance_lengths
    assert sum(cut) <= 7 - 1 and cut == oracle[second["id"]][: len(cut)][:-1] + cut[-1:]
    for sid, lengths in oracle.items():
        if sid not in (first["id"], second["id"]):
            assert got[sid].acceptance_lengths == lengths


def test_served_tail_blocks_match_a_full_block_loop(setup) -> None:
    """``tail_blocks="served"`` (the default) reproduces a loop that drafts a full block every cycle
    and cuts after verification, cycle for cycle, with the sliding-window layer in the drafter; the
    correct-draft counts agree wherever the cache knows the target's tokens (the loop's last cycle
    may match past the end of the completion, which the cache cannot see)."""
    from dflash_cb.core.replay import evaluate

    rep = evaluate(setup["cache"], setup["ours"], budgets=(4,), keep_drafts=MAX_NEW)
    assert rep.tail_blocks == "served"
    for s in rep.samples:
        want = setup["full"][s.id]
        assert s.acceptance_lengths == want.acceptance_lengths
        assert s.correct_drafts[:-1] == want.correct_drafts[:-1] and s.correct_drafts[-1] <= want.correct_drafts[-1]
        assert s.drafts == want.drafts  # every cycle's block, the tail ones included
    reached = [e.id for e in setup["cache"].samples if e.completion_len == MAX_NEW]
    assert reached  # samples that reach max_new_tokens: where the conventions part
    # The shortened tail blocks of the reference convention draft other tokens (the first drafter
    # layer is bidirectional), so the two conventions are different loops on this drafter.
    ref = evaluate(setup["cache"], setup["ours"], budgets=(), keep_drafts=MAX_NEW, tail_blocks="reference")
    changed = [s.id for s, r in zip(rep.samples, ref.samples, strict=True)
               if any(a[: len(b)] != b for a, b in zip(s.drafts, r.drafts, strict=False))]
    assert changed and set(changed) <= set(reached)


def test_tail_blocks_do_not_matter_for_causal_layers(setup) -> None:
    """With every drafter layer causal (sliding window), a shorter block cannot change earlier drafts."""
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate

    cfg = dict(setup["cfg"], layer_types=["sliding_attention", "sliding_attention"], sliding_window=64)
    causal = DFlashDrafter.from_config_dict(cfg).eval()
    causal.load_state_dict(setup["ours"].state_dict())
    served = evaluate(setup["cache"], causal, budgets=(), tail_blocks="served")
    reference = evaluate(setup["cache"], causal, budgets=(), tail_blocks="reference")
    assert [s.acceptance_lengths for s in served.samples] == [s.acceptance_lengths for s in reference.samples]
    with pytest.raises(ValueError, match="tail_blocks='short'"):
        evaluate(setup["cache"], causal, budgets=(), tail_blocks="short")


SMALL = 4  # a served block shorter than the drafter's BLOCK (SGLang's --speculative-num-draft-tokens 4)


@pytest.fixture(scope="module")
def small_block(setup):
    """The reference loop (``dflash_generate(block_size=SMALL)``) and the full-block loop run with the
    same drafter at a block of SMALL: both take the block as an argument."""
    reference, full = _run_loops(setup["cache"], setup["ref"], setup["target"], setup["cfg"], SMALL)
    return dict(reference=reference, full=full)


def test_smaller_block_matches_both_loops_at_that_block(setup, small_block) -> None:
    """``block_size=SMALL`` on the block-BLOCK drafter is the loop at that block, cycle for cycle: the
    reference loop under ``tail_blocks="reference"``, the full-block loop (every draft, and the
    correct-draft counts) under ``"served"``. Under it, our drafter as the engine calls it (many blocks
    of a sample in one packed pass) gives the reference ``DFlashDraftModel``'s drafts at that length at
    every anchor; at some anchors those are not the first depths of its BLOCK-long drafts (the
    bidirectional layer sees fewer mask positions), so the comparisons are not blind to the length."""
    from dflash_cb.core.drafters.proposers import apply_head
    from dflash_cb.core.drafters.runners import block_embeddings
    from dflash_cb.core.replay import evaluate

    cache, ours, ref = setup["cache"], setup["ours"], setup["ref"]
    reference = evaluate(cache, ours, budgets=(4,), tail_blocks="reference", block_size=SMALL)
    assert {s.id: s.acceptance_lengths for s in reference.samples} == small_block["reference"]
    assert {s.id: s.acceptance_lengths for s in reference.samples} != setup["oracle"]  # the block matters here
    served = evaluate(cache, ours, budgets=(4,), keep_drafts=MAX_NEW, block_size=SMALL)
    for s in served.samples:
        want = small_block["full"][s.id]
        assert s.acceptance_lengths == want.acceptance_lengths, s.id
        assert s.drafts == want.drafts, s.id
        assert s.correct_drafts[:-1] == want.correct_drafts[:-1] and s.correct_drafts[-1] <= want.correct_drafts[-1]
    lengths = [n for s in served.samples for n in s.acceptance_lengths]
    assert max(lengths) == SMALL and served.block_size == SMALL and served.spec.block_size == BLOCK

    head = cache.load_head()
    spec = ours.spec
    same = moved = 0
    with torch.no_grad():
        for e in cache.samples:
            smp = cache.load(e.id)
            anchors = torch.arange(e.prompt_len, e.total_len - 1)
            emb = block_embeddings(smp.input_ids, anchors, SMALL, spec, head.embed_tokens)
            hid = ours.forward_blocks(ours.context_kv(smp.hidden), emb, anchors)[:, 1:]
            got = apply_head(hid.reshape(-1, hid.shape[-1]), head.lm_head, spec, 0).argmax.view(len(anchors), -1)
            for i, p in enumerate(anchors.tolist()):
                drafts = {}
                for n in (SMALL, BLOCK):
                    block = block_embeddings(smp.input_ids, torch.tensor([p]), n, spec, head.embed_tokens)
                    h = ref(target_hidden=smp.hidden[None, :p], noise_embedding=block,
                            position_ids=torch.arange(p + n)[None])[0, 1:SMALL]
                    drafts[n] = (h @ head.lm_head.T).argmax(-1).tolist()
                same += got[i].tolist() == drafts[SMALL]
                moved += drafts[SMALL] != drafts[BLOCK]
    assert same == sum(e.total_len - 1 - e.prompt_len for e in cache.samples) and moved > 0


def test_eval_tool_block_size(setup, small_block, tmp_path: Path, capsys) -> None:
    """``--block-size N`` evaluates at that block (recorded in results.json and printed); a block the
    drafter cannot draft is one line, exit 2, before anything is written."""
    from dflash_cb.common.cli import run
    from dflash_cb.core.results.results_file import load_results
    from dflash_cb.integrations.cli import eval_drafter as eval_drafter

    setup["ours"].save_pretrained(tmp_path / "drafter")
    base = ["--states", str(setup["cache"].path), "--drafter", str(tmp_path / "drafter"), "--ddtree-budgets", "4",
            "--dtype", "float32", "--tail-blocks", "reference"]
    out = tmp_path / "r.json"
    assert run(eval_drafter.main, [*base, "--out", str(out), "--block-size", str(SMALL)]) == 0
    res = load_results(out)
    assert {s.id: s.acceptance_lengths for s in res.samples} == small_block["reference"]
    assert res.meta["block_size"] == SMALL and res.meta["drafter_block_size"] == BLOCK
    assert len(res.per_depth["unconditional"]) == SMALL - 1 and set(res.histogram) == {"1", "2", "3", "4"}
    assert f"block    {SMALL} (the drafter's is {BLOCK})" in capsys.readouterr().out
    for bad in ("1", str(BLOCK + 1), "2.5", "x"):
        assert run(eval_drafter.main, [*base, "--out", str(tmp_path / "bad.json"), "--block-size", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: --block-size") and bad in err, err
        assert not (tmp_path / "bad.json").exists()
