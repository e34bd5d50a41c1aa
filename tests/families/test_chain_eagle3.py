"""EAGLE-3 as a chain drafter, against SpecForge 0.2.0's own ``LlamaForCausalLMEagle3``.

A tiny 8-layer Qwen3 target, a cache of the three layers SpecForge's default reads ([1, L // 2 - 1, L - 4] =
[1, 3, 4]: layer outputs) built by the real precompute, an EAGLE-3 drafter with a draft vocabulary smaller than
the target's (one frequent completion token left out, so ``d2t`` maps ids that are not the identity), wider
than the target (``target_hidden_size``), trained briefly (first step, teacher-forced) so that some cycles
accept drafts and some do not.

The oracle (``specforge_generate``) is SpecForge's module with our weights, driven in a per-cycle greedy loop
(``chain_reference.greedy_loop``): each cycle the target runs over the whole sequence (the verify pass, whose
states of the committed tokens are the next cycle's context), its three
states are captured as SGLang's ``set_eagle3_layers_to_capture`` captures them (the residual stream entering
layer ``i + 1``, by forward pre-hooks), the drafter's context is rebuilt from them (row t: the state at t and
the token at t + 1), and K steps run through SpecForge's own ``backbone`` / ``compute_logits`` with its
test-time-training cache (the way its training unrolls; the last row carries the drafts), the draft mapped by
``d2t``. SpecForge's rotary helpers and norms are ``torch.compile``d; the oracle runs them eagerly.

SpecForge's own per-position accuracy and ``simulated_acc_len`` come from its ``OnlineEagle3Model`` and
``Evaluator`` over the target's states and logits (``test_simulated_acc_len_is_specforges``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from eagle3_reference import (
    DRAFT_VOCAB,
    EAGLE_IDS,
    MAX_NEW,
    eagle_config,
    sglang_capture,
    specforge_generate,
    specforge_module,
    trained_drafter,
)
from oracles import require

llama3_eagle = require("specforge.modeling.draft.llama3_eagle")  # a missing oracle fails, never skips

TARGET_LAYERS = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from chain_reference import chain_cache
    from tiny_target import save_tiny_qwen3

    from dflash_cb.core.checkpoints.load import load_drafter

    root = tmp_path_factory.mktemp("eagle3")
    target_dir = save_tiny_qwen3(root / "target", seed=3, num_hidden_layers=TARGET_LAYERS)
    cache, stop = chain_cache(root, target_dir, EAGLE_IDS, MAX_NEW)
    config = eagle_config()
    drafter = trained_drafter(config, cache)
    # The trained weights in SpecForge's module, saved as SpecForge saves a draft; the replay scores that folder.
    sf = specforge_module(config, drafter.state_dict())
    sf.save_pretrained(root / "specforge")
    return dict(root=root, target_dir=target_dir, cache=cache, drafter=drafter, sf=sf, stop=stop,
                loaded=load_drafter(root / "specforge"), config=config)


@pytest.fixture(scope="module")
def target(world):
    """The target, loaded once: the reference loops over it share its passes (``chain_reference.LastPass``). Read
    it, never change it."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(world["target_dir"], dtype=torch.float32).eval()


def test_a_specforge_folder_loads_and_round_trips(world, tmp_path: Path) -> None:
    """The folder SpecForge saves (``config.json`` + safetensors under its names) loads with ``load_drafter`` as
    an EAGLE-3 chain of SpecForge's layers (unchanged) and K = 3; ours saves a folder SpecForge's module loads
    back, strictly, to the same tensors."""
    from safetensors.torch import load_file

    from dflash_cb.core.checkpoints.load import load_drafter
    from dflash_cb.core.drafters.eagle3.model import Eagle3Drafter

    loaded, ours = world["loaded"], world["drafter"]
    assert type(loaded) is Eagle3Drafter and loaded.spec.family == "eagle3" and loaded.spec.block_size == 4
    assert loaded.spec.target_layer_ids == tuple(EAGLE_IDS) and loaded.spec.target_hidden_size == 32
    sf_state = world["sf"].state_dict()
    assert loaded.state_dict().keys() == sf_state.keys()
    assert all(torch.equal(v, sf_state[k]) for k, v in loaded.state_dict().items())
    assert not torch.equal(loaded.d2t, torch.zeros_like(loaded.d2t))  # a mapping that is not the identity
    loaded.save_pretrained(tmp_path / "ours")
    back = load_drafter(tmp_path / "ours")
    assert back.spec == loaded.spec
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == EAGLE_IDS
    again = specforge_module(saved, load_file(str(tmp_path / "ours" / "model.safetensors")))
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in again.state_dict().items())


@pytest.fixture(scope="module")
def narrow(world) -> dict:
    """A drafter as wide as the target whose embedding is the target's (SpecForge's frozen copy), trained, in
    SpecForge's module too."""
    config = eagle_config(hidden_size=32)
    drafter = trained_drafter(config, world["cache"], embed=world["cache"].load_head().embed_tokens, seed=1)
    return dict(config=config, drafter=drafter, sf=specforge_module(config, drafter.state_dict()))


def without_embedding(module) -> dict[str, torch.Tensor]:
    """The weights SpecForge's ``export_to_sglang`` and its EAGLE-3 checkpoints keep: all but the embedding."""
    return {k: v for k, v in module.state_dict().items() if "embed" not in k.lower()}


def test_a_folder_without_the_embedding_embeds_with_the_targets(world, narrow, target, tmp_path: Path) -> None:
    """SpecForge's SGLang export (and published EAGLE-3 folders) leave out ``embed_tokens``: such a folder loads
    and embeds with the target's table, as the servers do, and its replay equals SpecForge's module holding that
    table; a drafter wider than the target, which cannot, is refused naming the fix."""
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter
    from dflash_cb.core.replay import evaluate

    cache, sf = world["cache"], narrow["sf"]
    sf.save_pretrained(tmp_path / "sglang", state_dict=without_embedding(sf))  # what export_to_sglang writes
    loaded = load_drafter(tmp_path / "sglang")
    assert loaded.embed_tokens is None and "embed_tokens.weight" not in loaded.state_dict()
    want = {e.id: specforge_generate(sf, target, cache.load(e.id).input_ids[: e.prompt_len].tolist(),
                                     cache.manifest.stop_token_ids, 3, "served") for e in cache.samples}
    rep = evaluate(cache, loaded, block_size=4, budgets=())
    assert {s.id: s.acceptance_lengths for s in rep.samples} == want
    assert any(n > 1 for v in want.values() for n in v)
    world["sf"].save_pretrained(tmp_path / "wide", state_dict=without_embedding(world["sf"]))
    with pytest.raises(CheckpointError, match="hidden_size is 48: add the drafter's own embed_tokens.weight"):
        load_drafter(tmp_path / "wide")


def test_a_specforge_training_checkpoint_is_read(world, narrow, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SpecForge's checkpoint folder (``{run}-step{N}/training_state.pt`` written by its ``CheckpointManager``, the
    draft under ``draft_state_dict`` as its EAGLE-3 strategy filters it: the frozen embedding left out) is read
    with the drafter's config, at its step, as the drafter the servers run, and extracted to a folder that loads."""
    from specforge.training.checkpoint import CheckpointManager
    from specforge.training.strategies.base import Eagle3TrainStrategy

    from dflash_cb.core.checkpoints.load import drafter_in_checkpoint, extract_drafter, load_drafter
    from dflash_cb.core.replay import evaluate

    sf = narrow["sf"]
    sf.freeze_embedding()
    strategy = Eagle3TrainStrategy(specforge_training_module(monkeypatch).OnlineEagle3Model(sf, length=3))
    weights = strategy.checkpoint_state_filter(strategy.trainable_module().state_dict())
    assert "embed_tokens.weight" not in weights and "midlayer.self_attn.q_proj.weight" in weights
    folder = CheckpointManager(str(tmp_path), "run").save({"draft_state_dict": weights, "global_step": 6,
                                                          "strategy": strategy.name}, 6)
    found = drafter_in_checkpoint(folder, config=narrow["config"])
    assert found.info["global_step"] == 6 and found.model.embed_tokens is None
    extract_drafter(folder, tmp_path / "out", config=narrow["config"])
    back = load_drafter(tmp_path / "out")
    lengths = [[s.acceptance_lengths for s in evaluate(world["cache"], m, block_size=4, budgets=()).samples]
               for m in (found.model, back, narrow["drafter"])]
    assert lengths[0] == lengths[1] == lengths[2]


@pytest.mark.parametrize("tail", ["served", "reference"])
def test_the_replay_equals_specforge_driven_per_cycle(world, target, tail: str) -> None:
    """Cycle for cycle at K = 1, 3 and 5 (blocks of 2, 4, 6), against SpecForge's module in a per-cycle loop;
    some cycles accept drafts and some do not; samples end at the stop token or at max_new_tokens; tau > 1.5."""
    from dflash_cb.core.replay import evaluate

    cache = world["cache"]
    stops = cache.manifest.stop_token_ids
    taus = {}
    for k in (1, 3, 5):
        want = {e.id: specforge_generate(world["sf"], target, cache.load(e.id).input_ids[: e.prompt_len].tolist(),
                                         stops, k, tail) for e in cache.samples}
        rep = evaluate(cache, world["loaded"], block_size=k + 1, tail_blocks=tail, budgets=())
        assert {s.id: s.acceptance_lengths for s in rep.samples} == want, k
        cycles = [n for v in want.values() for n in v]
        assert any(n > 1 for n in cycles) and any(n == 1 for n in cycles)
        taus[k] = rep.summary["tau"]
    print(f"EAGLE-3 tau ({tail}):", {k: round(v, 4) for k, v in taus.items()})
    assert taus[3] > 1.5
    ends = [cache.load(e.id).input_ids[-1].item() == world["stop"] for e in cache.samples]
    assert any(ends) and not all(ends)


def test_a_live_specforge_module_is_adopted(world) -> None:
    """SpecForge's module in a training loop is scored through ours sharing its weights (no copy), equal to the
    loaded folder's figures."""
    from dflash_cb.core.drafters.layouts import adopt_module
    from dflash_cb.core.replay import evaluate

    sf = world["sf"]
    ours = adopt_module(sf)
    assert ours is not None and ours.spec == world["loaded"].spec
    assert ours.midlayer.self_attn.q_proj.weight.data_ptr() == sf.midlayer.self_attn.q_proj.weight.data_ptr()
    a = evaluate(world["cache"], ours, block_size=4, budgets=())
    b = evaluate(world["cache"], world["loaded"], block_size=4, budgets=())
    assert [s.acceptance_lengths for s in a.samples] == [s.acceptance_lengths for s in b.samples]


def test_layer_ids_map_from_each_servers_field() -> None:
    """SpecForge's / SGLang's ``eagle_config`` ids are layer outputs (a cache's ids, unchanged); vLLM's top-level
    ids are layer inputs (one less); with neither, ``num_target_layers`` gives SpecForge's default; with none
    of them, a message naming the field to add. Variants SpecForge 0.2.0's model has not (vLLM's) are refused
    naming the field."""
    from dflash_cb.core.drafters.registry import spec_from_config

    base = {k: v for k, v in eagle_config().items() if k != "eagle_config"}
    assert spec_from_config(eagle_config()).target_layer_ids == (1, 3, 4)
    assert spec_from_config({**base, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}).target_layer_ids == (1, 3, 4)
    assert spec_from_config({**base, "num_target_layers": 32}).target_layer_ids == (1, 15, 28)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        spec_from_config(base)
    with pytest.raises(ValueError, match="fc reads three"):
        spec_from_config({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}})
    from dflash_cb.core.drafters.layouts import drafter_from_config

    for bad, field in (({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": False}},
                        "use_aux_hidden_state is false"), ({"norm_before_residual": True}, "norm_before_residual"),
                       ({"num_hidden_layers": 2}, "num_hidden_layers is 2")):
        with pytest.raises(ValueError, match=field):
            drafter_from_config({**eagle_config(), **bad})


def test_a_chain_refuses_a_ddtree(world) -> None:
    """DDTree budgets are refused in one line naming EAGLE's own tree (what a server verifies at topk > 1)."""
    from dflash_cb.common.errors import DFlashCBError
    from dflash_cb.core.replay import evaluate

    with pytest.raises(DFlashCBError, match=r"EAGLE's own top-k tree, reranked to num_draft_tokens, which is not "
                                            r"replayed.*pass no budgets"):
        evaluate(world["cache"], world["loaded"], budgets=(4,))


def specforge_training_module(monkeypatch: pytest.MonkeyPatch):
    """SpecForge's ``specforge.algorithms.eagle3.model`` (``OnlineEagle3Model``), loaded unregistered: its
    ``specforge.core.loss`` imports Triton (a GPU kernel) at import time, so a plain torch cross-entropy stands in
    for that one module's ``LogSoftmaxLoss``; no figure compared here reads the loss."""
    import importlib.util
    import sys
    import types

    class TorchLogSoftmaxLoss:  # the same cross-entropy in plain torch ops (autograd differentiates it)
        @staticmethod
        def apply(logits, target, position_mask):
            terms = -(target * torch.log_softmax(logits.float(), -1)).sum(-1, keepdim=True) * position_mask
            return terms.mean()

    monkeypatch.setitem(sys.modules, "specforge.core.loss", types.SimpleNamespace(LogSoftmaxLoss=TorchLogSoftmaxLoss))
    found = importlib.util.find_spec("specforge.algorithms.eagle3.model")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def eagle3_batches(cache, target) -> list:
    """SpecForge's EAGLE-3 ``TrainBatch`` per sample, as its offline reader makes them: the tokens, the target's
    logits and its three states (captured as SGLang captures them), the loss mask on the completion but its last
    token."""
    from specforge.runtime.contracts import TrainBatch
    from specforge.utils import padding

    batches = []
    with torch.no_grad(), sglang_capture(target) as captured:
        for e in cache.samples:
            ids = cache.load(e.id).input_ids.long()[None]
            loss_mask = torch.zeros_like(ids)
            loss_mask[:, e.prompt_len:-1] = 1
            batches.append(TrainBatch([e.id], "eagle3", {
                "input_ids": padding(ids, left=False), "target": padding(target(input_ids=ids).logits, left=False),
                "loss_mask": loss_mask[..., None], "attention_mask": torch.ones_like(ids),
                "hidden_state": torch.cat([captured[i] for i in EAGLE_IDS], dim=-1)}))
    return batches


def specforge_eval(online, batches) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    """SpecForge's ``Evaluator`` over its ``OnlineEagle3Model`` ``online`` (as its EAGLE-3 strategy calls it),
    and each batch's per-position (correct, counted)."""
    from specforge.eval.evaluator import Evaluator
    from specforge.training.strategies.base import StepOutput

    seen: list[tuple[list[int], list[int]]] = []

    def forward(batch) -> StepOutput:
        t = batch.tensors
        out = online(input_ids=t["input_ids"], attention_mask=t["attention_mask"], target=t["target"],
                     loss_mask=t["loss_mask"], hidden_states=t["hidden_state"])
        seen.append(([int(c) for c in out[3]], [int(d) for d in out[4]]))
        return StepOutput(loss=sum(out[0]), metrics={"acc_corrects": out[3], "acc_denoms": out[4]})

    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        return Evaluator().run(forward, batches), seen


def test_simulated_acc_len_is_specforges(world, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SpecForge's per-position accuracy and ``eval/simulated_acc_len`` (its ``OnlineEagle3Model`` over the
    target's own states and logits, as its offline strategy feeds it, summed by its ``Evaluator``) equal ours
    from the cache, integer counts equal, at K = 3 and 5. Its KL loss is a Triton kernel (a GPU): here a plain
    torch cross-entropy stands in for it; the counts compared do not read the loss."""
    from transformers import Qwen3ForCausalLM

    from dflash_cb.core.drafters.eagle3.accuracy import cache_position_counts

    sf_eagle3 = specforge_training_module(monkeypatch)
    cache = world["cache"]
    target = Qwen3ForCausalLM.from_pretrained(world["target_dir"], dtype=torch.float32).eval()
    batches = eagle3_batches(cache, target)
    for k in (3, 5):
        want, seen = specforge_eval(sf_eagle3.OnlineEagle3Model(world["sf"], length=k), batches)
        ours = cache_position_counts(cache, world["loaded"], steps=k)
        assert ours.correct.tolist() == [sum(c[j] for c, _ in seen) for j in range(k)]
        assert ours.counted.tolist() == [sum(d[j] for _, d in seen) for j in range(k)]
        assert ours.per_position_acc == pytest.approx(want["eval/per_position_acc"], abs=1e-12)
        assert ours.simulated_acc_len == pytest.approx(want["eval/simulated_acc_len"], abs=1e-12)
        assert 0 < want["eval/per_position_acc"][-1] < want["eval/per_position_acc"][0] < 1
        print(f"EAGLE-3 K={k}: simulated_acc_len {ours.simulated_acc_len:.4f}, per position "
              f"{[round(a, 4) for a in ours.per_position_acc]}")
        # eval_drafter records SpecForge's figures beside tau, at the K it scores, with a note saying what they are.
        from dflash_cb.core.drafters.eagle3.figures import SIMULATED_ACC_LEN, position_acc_key
        from dflash_cb.core.results.report import format_results
        from dflash_cb.core.results.results_file import load_results
        from dflash_cb.integrations.cli import eval_drafter

        out = tmp_path / f"k{k}.json"
        assert eval_drafter.main(["--states", str(cache.path), "--drafter", str(world["root"] / "specforge"),
                                  "--out", str(out), "--block-size", str(k + 1)]) == 0
        res = load_results(out)
        assert res.metric(SIMULATED_ACC_LEN) == pytest.approx(want["eval/simulated_acc_len"], abs=1e-12)
        assert [res.metric(position_acc_key(j + 1)) for j in range(k)] == pytest.approx(
            want["eval/per_position_acc"], abs=1e-12)
        assert "specforge_eagle3" in res.notes and "simulated_acc_len" in format_results(res)


def test_each_step_equals_specforges_unroll_under_its_options() -> None:
    """SpecForge's options ``fc_norm`` (each target layer normed before ``fc``) and ``norm_output`` false (the
    head reads the un-normed output): every step of every row equals SpecForge's own test-time-training unroll
    (``backbone`` / ``compute_logits``, fed the data's tokens) to float rounding, and drafts the same tokens."""
    from specforge.utils import padding
    from transformers import LlamaConfig

    from dflash_cb.core.drafters.chain import ChainRunner
    from dflash_cb.core.drafters.layouts import adopt_module

    config = eagle_config(fc_norm=True, norm_output=False)
    torch.manual_seed(2)
    sf = llama3_eagle.LlamaForCausalLMEagle3(LlamaConfig.from_dict(config)).eval()
    with torch.no_grad():
        for p in sf.parameters():  # norms too: none left at one
            p.normal_(0.0, 0.2)
    ours = adopt_module(sf)
    assert ours is not None and ours.fc_norm is not None and not ours.norm_output
    t, steps = 14, 4
    aux, ids = torch.randn(1, t, 96), torch.randint(0, 128, (1, t))
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        hidden = sf.project_hidden_states(aux)
        mask = sf.prepare_decoder_attention_mask(torch.ones(1, t), hidden, 1, t, 0)
        tokens, cache_hidden, want = padding(ids, left=False), [[], []], []
        for _ in range(steps):
            hidden = sf.backbone(input_embeds=sf.embed_input_ids(tokens), hidden_states=hidden,
                                 cache_hidden=cache_hidden, attention_mask=mask, position_ids=torch.arange(t)[None])
            want.append(sf.compute_logits(hidden)[0])
            tokens = padding(tokens, left=False)
        runner = ChainRunner(ours, ours.spec)
        rows = t - 1
        context = runner.context(iter([(aux[0, :rows], ours.embed(ids[0, 1:], None))]), [rows])
        anchors = torch.arange(1, rows + 1)
        blocks = runner.block_rows(context, runner.block_inputs(ids[0], anchors, steps + 1, None), anchors,
                                   torch.zeros_like(anchors))
    for j in range(steps):
        fed = rows - j  # rows whose step j is fed a data token (SpecForge pads the rest)
        got = ours.lm_head(blocks.hidden[:fed, j + 1])
        assert torch.allclose(got, want[j][:fed], atol=1e-4, rtol=1e-4), j
        assert torch.equal(got.argmax(-1), want[j][:fed].argmax(-1)), j


def test_drafts_and_overlap_read_the_draft_vocabulary(world) -> None:
    """The proposer drafts the target id ``d2t`` maps the draft head's argmax to, and with the target's stored
    top-K its overlap ``sum_x min(p(x), q(x))`` takes q of a target token from its draft id, 0 outside the draft
    vocabulary (-1: no stored token)."""
    from dflash_cb.core.drafters.layouts import proposer_for

    drafter = world["loaded"]
    prop = proposer_for(drafter.spec, drafter, world["cache"].load_head().lm_head, 1 << 20)
    hidden = torch.randn(5, 48)
    with torch.no_grad():
        q = torch.softmax(drafter.lm_head(hidden).double(), -1)
    mapped = (torch.arange(DRAFT_VOCAB) + drafter.d2t).tolist()
    outside = next(t for t in range(128) if t not in mapped)
    ids = torch.tensor([[mapped[3], outside, mapped[7], -1]]).expand(5, 4)
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05]])).expand(5, 4)
    none = torch.full((5,), -1)
    out = prop.rows(hidden, none, none, target_topk=(ids, logprobs))
    assert out.tokens.tolist() == [mapped[i] for i in q.argmax(-1).tolist()]
    want = torch.minimum(q[:, 3], torch.tensor(0.5).double()) + torch.minimum(q[:, 7], torch.tensor(0.1).double())
    assert torch.allclose(out.overlap, want, atol=1e-6)
    broken = copy.deepcopy(drafter)
    broken.d2t[1] = broken.d2t[0] - 1  # draft ids 0 and 1 on one target id
    with pytest.raises(ValueError, match="d2t maps draft ids 0 and 1 onto one target id"):
        proposer_for(broken.spec, broken, world["cache"].load_head().lm_head, 1 << 20)


def test_the_precompute_plans_a_specforge_folders_layers(world, tmp_path: Path) -> None:
    """``--drafter-config`` of the folder SpecForge saved (its layers in ``eagle_config``) gives a cache of those
    layers, which the drafter fits; with a DFlash drafter's config beside it, the union of both."""
    from tiny_target import random_prompts, write_prompts

    from dflash_cb.cache.precompute import main
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.layouts import cache_needs

    prompts = write_prompts(tmp_path / "p.jsonl", random_prompts(2, (4, 6), seed=1, vocab=120))
    base = ["--target", str(world["target_dir"]), "--prompts", str(prompts), "--reference", "local", "--dtype",
            "float32", "--max-new-tokens", "4", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "c"), "--drafter-config",
                 str(world["root"] / "specforge" / "config.json")]) == 0
    cache = StateCache(tmp_path / "c")
    assert cache.manifest.layer_ids == EAGLE_IDS
    cache.check_fit(cache_needs(world["loaded"]))
    (tmp_path / "dflash.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"],
                                                      "dflash_config": {"target_layer_ids": [2, 5]}}))
    assert main([*base, "--out", str(tmp_path / "u"), "--drafter-config",
                 f"{world['root'] / 'specforge' / 'config.json'},{tmp_path / 'dflash.json'}"]) == 0
    assert StateCache(tmp_path / "u").manifest.layer_ids == sorted({*EAGLE_IDS, 2, 5})


def test_the_sweep_reads_specforge_eagle3_checkpoints(world, narrow, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``dflash-sweep`` over a SpecForge run's EAGLE-3 checkpoints (its ``CheckpointManager`` folders, the
    strategy's filter) scores each at its step, each tau the tool's on the same weights."""
    from specforge.training.checkpoint import CheckpointManager
    from specforge.training.strategies.base import Eagle3TrainStrategy

    from dflash_cb.core.replay import evaluate
    from dflash_cb.integrations.cli.sweep_cli import main as sweep

    sf = copy.deepcopy(narrow["sf"])
    sf.freeze_embedding()
    strategy = Eagle3TrainStrategy(specforge_training_module(monkeypatch).OnlineEagle3Model(sf, length=3))
    manager = CheckpointManager(str(tmp_path / "run"), "run")
    taus = {}
    for step in (3, 6):
        with torch.no_grad():
            sf.midlayer.mlp.down_proj.weight.mul_(0.5)  # another checkpoint, other weights
        weights = strategy.checkpoint_state_filter(strategy.trainable_module().state_dict())
        manager.save({"draft_state_dict": {k: v.clone() for k, v in weights.items()}, "global_step": step,
                      "strategy": strategy.name}, step)
        taus[step] = evaluate(world["cache"], sf, block_size=4, budgets=()).summary["tau"]
    (tmp_path / "config.json").write_text(json.dumps(narrow["config"]))
    assert sweep([str(tmp_path / "run"), "--states", str(world["cache"].path), "--config", str(tmp_path / "config.json"),
                  "--out", str(tmp_path / "sweep"), "--block-size", "4"]) == 0
    entries = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["entries"]
    assert {e["step"]: e["metrics"]["tau"] for e in entries} == taus


@pytest.mark.e2e
def test_an_eagle3_drafter_training_in_specforges_loop_is_scored_live(world, narrow, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SpecForge's own ``TrainerController`` training its ``LlamaForCausalLMEagle3`` with its EAGLE-3 strategy
    (``OnlineEagle3Model`` over the target's states and logits, the batches its offline reader makes; its Triton
    loss stood in for by torch, a GPU kernel), the live evaluation attached: the tau logged at step 0 and at fit
    end equals the tool's on the weights of that step, and training moved it."""
    import torch.distributed as dist
    from specforge.optimizer import BF16Optimizer
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerController, TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import Qwen3ForCausalLM

    from dflash_cb.core.replay import evaluate
    from dflash_cb.integrations.loops.specforge import attach

    cache = world["cache"]
    target = Qwen3ForCausalLM.from_pretrained(world["target_dir"], dtype=torch.float32).eval()
    batches = eagle3_batches(cache, target)
    sf = copy.deepcopy(narrow["sf"])
    sf.freeze_embedding()
    model = specforge_training_module(monkeypatch).OnlineEagle3Model(sf, length=3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backend = FSDPTrainingBackend(ParallelConfig(), optimizer_factory=lambda m: BF16Optimizer(
            m, lr=3e-2, total_steps=100, warmup_ratio=0.0, lr_scheduler="constant"))
        backend.prepare_model(model, wrap=False, optimizer_target=sf)
        logged: dict[int, float] = {}
        weights: dict[int, dict[str, torch.Tensor]] = {}

        def log(metrics: dict, step: int) -> None:
            if "dflash_eval/tau" in metrics:
                logged[step] = metrics["dflash_eval/tau"]
                weights[step] = {k: v.detach().clone() for k, v in sf.state_dict().items()}

        controller = TrainerController(TrainerCore(Eagle3TrainStrategy(model), backend), run_id="run",
                                       output_dir=str(tmp_path / "out"), max_steps=4, num_epochs=50, log_interval=1,
                                       logger=log)
        attach(controller, cache.path, every_n_train_steps=4, target_embed=None, target_lm_head=None, console=False,
               block_size=4)
        assert controller.fit(batches) == 4
    finally:
        dist.destroy_process_group()
    assert sorted(logged) == [0, 4] and logged[0] != logged[4]
    for step, state in weights.items():
        sf.load_state_dict(state)
        assert logged[step] == evaluate(cache, sf, block_size=4, budgets=()).summary["tau"], step


def test_the_targets_last_layer_is_refused() -> None:
    """A cache's last layer is the final-normed state; an EAGLE-3 server captures the stream before that norm."""
    from dflash_cb.core.drafters.eagle3.model import eagle_layer_ids

    with pytest.raises(ValueError, match=r"names the target's last layer \(7\): a cache holds its state after"):
        eagle_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, "num_target_layers": 8})
    assert eagle_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}, "num_target_layers": 8}) \
        == [1, 3, 6]
