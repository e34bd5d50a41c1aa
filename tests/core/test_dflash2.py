"""Our DFlash 2 drafter and selector against the reference ``dflash.model.DFlash2DraftModel`` (same weights)
and its ``dflash_generate`` loop; the selector's tree against plain-Python heaps (tests/support/selector_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import oracles
import pytest
import torch
from safetensors.torch import load_file, save_file
from selector_reference import enumerated_tree_accept, heap_tree_accept
from transformers import Qwen3Config

from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.drafters.dflash2 import selector
from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter
from dflash_cb.core.drafters.registry import spec_of
from dflash_cb.core.drafters.spec import draft_logits

dm = oracles.require("dflash.model")

SELECTOR = {"conv_group_size": 8, "conv_kernel_size": 2, "selector_rank": 6, "selector_top_k": 5}


def _config(sliding: bool = False, taps: int = 2, family: str = "dflash2", **dflash) -> Qwen3Config:
    """A tiny DFlash 2 drafter config (``family="dflash"``: the DFlash drafter of the same shape)."""
    selector_fields = {**SELECTOR, "conv_kernel_size": taps} if family == "dflash2" else {}
    d = dict(architectures=["DFlash2DraftModel" if family == "dflash2" else "DFlashDraftModel"], vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=512, num_target_layers=4, block_size=6,
             dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 63, **selector_fields, **dflash})
    if sliding:  # a causal window shorter than the block: it limits the block's own keys too
        d.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3, use_sliding_window=True)
    return Qwen3Config(**d)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights where every DFlash 2 part matters: the reference leaves ``base_kernel`` uninitialised (``torch.empty``),
    its default init makes the kernel offsets and the pairwise scores negligible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                p[:, 0] += 1.0
            elif "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "hidden_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _pair(cfg: Qwen3Config, seed: int = 0) -> tuple[torch.nn.Module, DFlash2Drafter]:
    torch.manual_seed(seed)
    ref = _randomize(dm.DFlash2DraftModel(cfg), seed).eval()
    ours = DFlash2Drafter(cfg).eval()
    ours.load_state_dict(ref.state_dict())  # the reference's codebooks are embeddings: ``.weight`` keys
    return ref, ours


def _reference_block(ref, features: torch.Tensor, emb: torch.Tensor, p: int) -> torch.Tensor:
    pos = torch.arange(p + emb.shape[0])[None]
    return ref(target_hidden=features[None, :p], noise_embedding=emb[None], position_ids=pos)[0]


# -- the drafter's blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("sliding,taps", [(False, 2), (True, 2), (True, 3)])
@pytest.mark.parametrize("attn_mem_bytes", [None, 1])
def test_batched_blocks_equal_reference_forward(sliding: bool, taps: int, attn_mem_bytes: int | None) -> None:
    """block_rows over many anchors of several samples (shortened tail blocks among them, attention calls shared
    or one block each) and the reference forward signature equal one reference call per anchor."""
    ref, ours = _pair(_config(sliding, taps), seed=1)
    feats = [torch.randn(t, 64) for t in (4, 90, 40)]  # blocks of 2 positions at least, as the loop drafts
    plan = [[2], [5, 30, 31, 60, 85, 88], [20, 37]]
    anchors = torch.tensor([p for ps in plan for p in ps])
    who = [s for s, ps in enumerate(plan) for _ in ps]
    lengths = torch.tensor([min(6, f.shape[0] - p) for f, ps in zip(feats, plan, strict=True) for p in ps])
    assert lengths.min() < 6  # some tail blocks are shorter
    emb = torch.randn(len(anchors), 6, 32)
    with torch.no_grad():
        context = ours.context_kv(feats)
        blocks = ours.block_rows(context, emb, anchors, torch.tensor(who), lengths, attn_mem_bytes)
        every = blocks.rows(torch.arange(len(anchors))[:, None], torch.arange(6)[None, :])
        full = ours.forward_samples(context, emb, anchors, torch.tensor(who), lengths, attn_mem_bytes)
        assert torch.equal(every, full)
        for i, p in enumerate(anchors.tolist()):
            n = int(lengths[i])
            want = _reference_block(ref, feats[who[i]], emb[i, :n], p)
            assert torch.allclose(every[i, :n], want, atol=1e-5), (who[i], p)
            mine = ours(target_hidden=feats[who[i]][None, :p], noise_embedding=emb[i:i + 1, :n],
                        position_ids=torch.arange(p + n)[None])[0]
            assert torch.allclose(mine, want, atol=1e-5), (who[i], p)
    # The convolutions matter: the same weights without them (a DFlash drafter) give other blocks.
    plain = DFlashDrafter(_config(sliding, family="dflash")).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items()
                           if not any(m in k for m in ("_conv.", "candidate_selector"))})
    with torch.no_grad():
        other = plain.forward_samples(plain.context_kv(feats), emb, anchors, torch.tensor(who), lengths)
    assert not torch.allclose(other, full, atol=1e-2)


def test_forward_compiles_as_one_graph() -> None:
    ref, ours = _pair(_config(True), seed=2)
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    features, emb = torch.randn(2, 10, 64), torch.randn(2, 6, 32)
    pos = torch.arange(16)[None].expand(2, 16)
    with torch.no_grad():
        assert torch.allclose(compiled(position_ids=pos, noise_embedding=emb, target_hidden=features),
                              ref(position_ids=pos, noise_embedding=emb, target_hidden=features), atol=1e-5)


# -- the selector against the reference's propose ----------------------------------------------------

@pytest.mark.parametrize("multiplier,softcap", [(None, None), (0.5, 3.0)])
def test_walk_equals_reference_propose_and_forced_matches_equal_its_accepted_length(multiplier, softcap) -> None:
    extra = {k: v for k, v in (("output_multiplier", multiplier), ("final_logit_softcapping", softcap)) if v}
    ref, ours = _pair(_config(**extra), seed=3)
    head = torch.nn.Linear(32, 64, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    n, d = 300, 5
    hidden = torch.randn(n, d, 32)
    anchor = torch.randint(0, 64, (n,))
    with torch.no_grad():
        assert torch.allclose(draft_logits(hidden, head.weight, ours.spec), ref.compute_logits(hidden, head),
                              atol=1e-5)
        want, _, _ = ref.propose(hidden, anchor, head, 0.0)
        walk = ours.propose(hidden, anchor, head.weight)
        assert torch.equal(walk, want)
        ids, unary, query = ours.selector_inputs(hidden, head.weight)
        # The selector matters: the walk is not the unary argmax everywhere.
        assert (walk != ids[..., 0]).any()
        # Targets that follow the walk for a drawn number of depths, then leave it.
        g = torch.Generator().manual_seed(0)
        follow = torch.randint(0, d + 1, (n,), generator=g)
        target = torch.where(torch.arange(d)[None] < follow[:, None], walk, (walk + 1) % 64)
        target[torch.rand(n, d, generator=g) < 0.05] = -1  # unknown tokens never match
        forced = selector.forced_draft(ids, unary, query, anchor, target, *ours.codebooks)
    from dflash_cb.core.loop.cycles import leading_matches

    assert torch.equal(leading_matches(forced, target), leading_matches(want, target))
    assert len(set(leading_matches(want, target).tolist())) == d + 1  # every accepted length occurs


def test_transition_logprobs_are_the_reference_scores_given_each_parent() -> None:
    """The lattice's rows: log-softmax over the K candidates of the reference's own edge score
    (``CandidateSelector.select``'s unary + codebook term) given the anchor, or each candidate one depth up."""
    ref, ours = _pair(_config(), seed=4)
    head = torch.nn.Linear(32, 64, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    hidden, anchor = torch.randn(7, 4, 32), torch.randint(0, 64, (7,))
    sel = ref.candidate_selector
    with torch.no_grad():
        ids, unary, query = ours.selector_inputs(hidden, head.weight)
        first, steps = selector.transition_logprobs(ids, unary, query, anchor, *ours.codebooks)
        proj = sel.hidden_projection(hidden)

        def ref_scores(t: int, predecessor: torch.Tensor) -> torch.Tensor:
            return unary[:, t] + torch.einsum("br,bkr->bk", sel.predecessor_codebook(predecessor) * proj[:, t],
                                              sel.successor_codebook(ids[:, t]))

        assert torch.allclose(first, torch.log_softmax(ref_scores(0, anchor).double(), -1), atol=1e-6)
        for t in range(1, 4):
            for a in range(5):
                want = torch.log_softmax(ref_scores(t, ids[:, t - 1, a]).double(), -1)
                assert torch.allclose(steps[:, t - 1, a], want, atol=1e-6), (t, a)


def test_top_candidates_are_canonical_and_batch_independent() -> None:
    """Ties at the K-th value go to the lower ids; the order is unary descending, then id ascending; a row's
    candidates do not depend on the rows batched with it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (40, 3, 50), generator=g).float()  # many exact ties
    ids, unary = selector.top_candidates(logits, 7)
    for row, got_ids, got_u in zip(logits.view(-1, 50), ids.view(-1, 7), unary.view(-1, 7), strict=True):
        want = sorted(range(50), key=lambda i: (-row[i].item(), i))[:7]
        assert got_ids.tolist() == want
        assert got_u.tolist() == [row[i].item() for i in want]
    alone = selector.top_candidates(logits[5:6, 1:2], 7)[0]
    assert torch.equal(alone[0, 0], ids[5, 1])


# -- the tree over the selector's lattice ----------------------------------------------------------------

def _lattice(n: int, d: int, k: int, seed: int, quantize: bool):
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(n, k, generator=g) * 2
    steps = torch.randn(n, d - 1, k, k, generator=g) * 2
    if quantize:  # coarse scores: equal log-probabilities and equal path sums, the hard case for ties
        first, steps = first.round(), steps.round()
    ids = torch.stack([torch.randperm(40, generator=g)[:k] for _ in range(n * d)]).view(n, d, k)
    pick = torch.randint(0, 3, (n, d), generator=g)  # targets mostly among the best-ranked candidates
    target = ids.gather(-1, pick[..., None])[..., 0]
    target[torch.rand(n, d, generator=g) < 0.1] = -1
    depths = torch.randint(0, d + 1, (n,), generator=g)
    return ids, torch.log_softmax(first.double(), -1), torch.log_softmax(steps.double(), -1), depths, target


@pytest.mark.parametrize("seed,quantize", [(0, False), (1, True), (2, True)])
def test_lattice_tree_equals_heap_over_paths(seed: int, quantize: bool) -> None:
    n, d, k = 48, 4, 3
    ids, first, steps, depths, target = _lattice(n, d, k, seed, quantize)
    nodes = k + k**2 + k**3 + k**4
    budgets = (1, 2, 5, 13, 40, nodes, nodes + 10)  # past the lattice: nothing more to pop
    out = selector.lattice_tree_accepted(ids, first, steps, depths, target, max(budgets))
    assert out.shape == (n, max(budgets))
    for i in range(n):
        args = (ids[i].tolist(), first[i].tolist(), steps[i].tolist(), int(depths[i]), target[i].tolist())
        for b in budgets:
            want = heap_tree_accept(*args, b)
            assert out[i, b - 1].item() == want, (i, b)
            if not quantize:
                assert enumerated_tree_accept(*args, b) == want, (i, b)
    assert out[:, -1].max() > 1  # some trees reach deep


def test_lattice_tree_of_one_node_per_depth_is_the_walk() -> None:
    """Budget 1 holds the best depth-1 candidate; with K = 1 the tree is the chain and accepts the forced matches."""
    ids = torch.tensor([[[7], [8], [9]]])
    first = torch.zeros(1, 1, dtype=torch.float64)
    steps = torch.zeros(1, 2, 1, 1, dtype=torch.float64)
    out = selector.lattice_tree_accepted(ids, first, steps, torch.tensor([3]), torch.tensor([[7, 8, 5]]), 5)
    assert out[0].tolist() == [1, 2, 2, 2, 2]


# -- the loop: dflash_generate with the reference DFlash 2 drafter -------------------------------------

@pytest.mark.e2e
def test_teacher_forced_replay_equals_dflash_generate(tiny_cache: Path, tiny_drafter_config: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference loop with a DFlash 2 drafter (its selector's walk proposes every block) accepts, cycle for
    cycle, what our blocks (all anchors of all samples in one pass) and teacher-forced selector drafts give."""
    import time

    from replay_reference import replay_walk
    from tiny_target import train_briefly
    from transformers import Qwen3ForCausalLM

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.runners import block_embeddings
    from dflash_cb.core.loop.cycles import (
        cut_produced,
        leading_matches,
        next_stop_positions,
        sample_bounds,
    )

    cfg = {**tiny_drafter_config, "architectures": ["DFlash2DraftModel"], "num_hidden_layers": 2,
           "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4, "use_sliding_window": True,
           "dflash_config": {**tiny_drafter_config["dflash_config"], **SELECTOR}}
    cache = StateCache(tiny_cache)
    torch.manual_seed(0)
    ours = train_briefly(DFlash2Drafter.from_config_dict(cfg), cache)
    with torch.no_grad():  # a selector strong enough to overrule the unary argmax sometimes
        for p in ours.codebooks:
            p.normal_(std=0.7)
        ours.candidate_selector.hidden_projection.weight.normal_(std=0.15)
    ref = dm.DFlash2DraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict({k + ".weight" if k.endswith("codebook") else k: v for k, v in ours.state_dict().items()})
    target = Qwen3ForCausalLM.from_pretrained(tiny_cache.parent / "target", dtype=torch.float32).eval()
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # it synchronises CUDA; a wall clock on a CPU
    m = cache.manifest
    stops, max_new = m.stop_token_ids, m.max_new_tokens
    head = cache.load_head()
    spec, block = ours.spec, ours.spec.block_size
    samples = [cache.load(e.id) for e in cache.samples]
    bounds = [sample_bounds(e.prompt_len, s.input_ids.shape[0], e.valid_len, max_new, int(s.input_ids[-1]), stops)
              for e, s in zip(cache.samples, samples, strict=True)]
    anchors = torch.tensor([p for b in bounds for p in b.anchors])
    who = torch.tensor([i for i, b in enumerate(bounds) for _ in b.anchors])
    tokens = [s.input_ids for s in samples]
    with torch.no_grad():
        emb = torch.cat([block_embeddings(tokens[i], torch.tensor(list(b.anchors)), block, spec, head.embed_tokens)
                         for i, b in enumerate(bounds)])
        ends = torch.tensor([bounds[i].loop_end for i in who.tolist()])
        lengths = torch.clamp(ends - anchors, max=block)  # dflash_generate's shortened tail blocks
        blocks = ours.block_rows(ours.context_kv([s.hidden for s in samples]), emb, anchors, who, lengths)
        hidden = blocks.rows(torch.arange(len(anchors))[:, None], torch.arange(1, block)[None, :])
        ids, unary, query = ours.selector_inputs(hidden, head.lm_head)
        depth = torch.arange(1, block)[None, :]
        known = torch.tensor([bounds[i].known_end for i in who.tolist()])
        pos = anchors[:, None] + depth
        truth = torch.stack([tokens[i][pos[j].clamp(max=len(tokens[i]) - 1)] for j, i in enumerate(who.tolist())])
        truth[(pos >= known[:, None]) | (depth >= lengths[:, None])] = -1
        first = anchors.new_tensor([tokens[i][b] for i, b in zip(who.tolist(), anchors.tolist(), strict=True)])
        forced = selector.forced_draft(ids, unary, query, first, truth, *ours.codebooks)
        walk = selector.walk_draft(ids, unary, query, first, *ours.codebooks)
    accepted = leading_matches(forced, truth)
    assert torch.equal(accepted, leading_matches(walk, truth))
    assert (walk != ids[..., 0]).any()  # the selector overrules the unary argmax somewhere
    stop_at = torch.stack([next_stop_positions(tokens[i], stops)[p + 1] for i, p in zip(who.tolist(), anchors.tolist(),
                                                                                           strict=True)])
    produced = cut_produced(accepted, anchors, ends, stop_at).tolist()
    unary_only = cut_produced(leading_matches(ids[..., 0], truth), anchors, ends, stop_at).tolist()
    cycles, differ = [], False
    for i, (e, b) in enumerate(zip(cache.samples, bounds, strict=True)):
        mine = [produced[j] for j in range(len(anchors)) if who[j] == i]
        got = replay_walk(mine, tokens[i].tolist(), b, stops)
        run = dm.dflash_generate(ref, target, tokens[i][: e.prompt_len][None], max_new, stops, return_stats=True)
        assert got == list(run.acceptance_lengths), e.id
        cycles += got
        without = replay_walk([unary_only[j] for j in range(len(anchors)) if who[j] == i], tokens[i].tolist(), b,
                              stops)
        differ |= without != got
    assert any(c > 1 for c in cycles) and any(c == 1 for c in cycles)  # partial acceptance: informative
    assert differ  # the selector's drafts, not the unary argmax's, are what the loop accepted


# -- loading and saving ----------------------------------------------------------------------------

def test_published_folder_loads_in_both_and_round_trips(tmp_path: Path) -> None:
    from dflash_cb.core.checkpoints.load import load_drafter

    ref, ours = _pair(_config(True), seed=5)
    ours.save_pretrained(tmp_path / "ours")
    stored = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in stored and not any(k.endswith("codebook.weight")
                                                                          for k in stored)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    back = load_drafter(tmp_path / "ours")
    assert type(back) is DFlash2Drafter and back.spec == ours.spec and back.spec.family == "dflash2"
    with pytest.raises(ValueError, match="the config is a DFlash 2 drafter's, not a DFlash one"):
        DFlashDrafter.from_pretrained(tmp_path / "ours")
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    loaded = dm.DFlash2DraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # The reference's own save_pretrained (codebooks as embeddings: with .weight) loads here too.
    ref.save_pretrained(str(tmp_path / "ref"))
    assert any(k.endswith("codebook.weight") for k in load_file(str(tmp_path / "ref" / "model.safetensors")))
    for folder in (tmp_path / "ref",):
        got = load_drafter(folder)
        assert type(got) is DFlash2Drafter
        for k, v in ours.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k
        assert torch.equal(DFlash2Drafter.from_pretrained(folder).fc.weight, ours.fc.weight)
    # A config without architectures: the DFlash 2 fields say it.
    data = json.loads((tmp_path / "ours" / "config.json").read_text())
    del data["architectures"]
    (tmp_path / "ours" / "config.json").write_text(json.dumps(data))
    assert type(load_drafter(tmp_path / "ours")) is DFlash2Drafter
    assert spec_of(ref).family == "dflash2" and spec_of(ref).option("selector_top_k") == 5


def _folder(tmp_path: Path, name: str, config: dict, state: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_a_layout_of_neither_family_names_the_closest_ones_keys(tmp_path: Path) -> None:
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    _, ours = _pair(_config(), seed=6)
    config = ours.config.to_dict()
    state = {k: v.contiguous() for k, v in ours.state_dict().items()}
    broken = {k: v for k, v in state.items() if k != "layers.1.mlp_conv.base_kernel"}
    broken["layers.1.mlp_conv.extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"do not match the DFlash 2 layout: missing "
                                              r"\['layers.1.mlp_conv.base_kernel'\], unexpected "
                                              r"\['layers.1.mlp_conv.extra'\]"):
        load_drafter(_folder(tmp_path, "broken", config, broken))
    # DFlash 2 weights under a config that says DFlash: what to set.
    dflash = {**config, "architectures": ["DFlashDraftModel"]}
    with pytest.raises(CheckpointError, match=r"the weights are a DFlash 2 drafter's, but the config says DFlash: "
                                              r"set architectures \['DFlash2DraftModel'\]"):
        load_drafter(_folder(tmp_path, "said_dflash", dflash, state))
    # ... and closest to DFlash 2 when a DFlash 2 key is missing too.
    with pytest.raises(CheckpointError, match=r"fit no family's layout; the closest is DFlash 2 \(the config says "
                                              r"DFlash\): missing \['layers.1.mlp_conv.base_kernel'\]"):
        load_drafter(_folder(tmp_path, "said_dflash_broken", dflash, {k: v for k, v in broken.items()
                                                                       if not k.endswith("extra")}))
    # A config that does not say, with DFlash 2 keys: the fields to add.
    plain = {k: v for k, v in config.items() if k != "architectures"}
    plain["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k not in SELECTOR}
    with pytest.raises(CheckpointError, match=r"the weights are a DFlash 2 drafter's \(.*\), but the config does not "
                                              r"say so: set architectures \['DFlash2DraftModel'\] and dflash_config's "
                                              r"conv_group_size, conv_kernel_size, selector_rank, selector_top_k"):
        load_drafter(_folder(tmp_path, "unsaid", plain, state))
    # A DFlash drafter's weights under a DFlash 2 config, and a bad DFlash 2 field.
    one = {k: v for k, v in state.items() if not any(m in k for m in ("_conv.", "candidate_selector"))}
    with pytest.raises(CheckpointError, match=r"the weights are a DFlash drafter's, but the config says DFlash 2"):
        load_drafter(_folder(tmp_path, "one", config, one))
    bad = {**config, "dflash_config": {**config["dflash_config"], "conv_group_size": 5}}
    with pytest.raises(CheckpointError, match="conv_group_size 5 does not divide hidden_size 32"):
        load_drafter(_folder(tmp_path, "bad", bad, state))


def test_adopting_live_modules_shares_their_weights() -> None:
    from dflash_cb.core.drafters.layouts import adopt_module

    ref, _ = _pair(_config(True), seed=7)
    adopted = adopt_module(ref)
    assert type(adopted) is DFlash2Drafter
    assert adopted.codebooks[0].data_ptr() == ref.candidate_selector.predecessor_codebook.weight.data_ptr()
    assert adopted.layers[1].mlp_conv.base_kernel.data_ptr() == ref.layers[1].mlp_conv.base_kernel.data_ptr()
    feats, emb = torch.randn(30, 64), torch.randn(1, 6, 32)
    with torch.no_grad():
        ref.layers[0].attention_conv.base_kernel.mul_(0.5)  # a training step, in place: seen by the adopted one
        got = adopted.block_rows(adopted.context_kv(feats), emb, torch.tensor([20]), torch.tensor([0]))
        assert torch.allclose(got.hidden[0], _reference_block(ref, feats, emb[0], 20), atol=1e-5)
    # A user's own module with the same parameter names and a config, and the DFlash reference class.
    user = torch.nn.Module()
    for name in ("layers", "norm", "fc", "hidden_norm", "candidate_selector", "rotary_emb"):
        setattr(user, name, getattr(ref, name))
    user.config = ref.config
    assert type(adopt_module(user)) is DFlash2Drafter
    one = dm.DFlashDraftModel(_config(True, family="dflash")).eval()
    assert type(adopt_module(one)) is DFlashDrafter
    assert adopt_module(torch.nn.Linear(2, 2)) is None


# -- extracting from training checkpoints ------------------------------------------------------------

class _Training(torch.nn.Module):
    """A loop's module: the reference DFlash 2 drafter under ``drafter.`` and a loss that reaches every part."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        torch.manual_seed(0)
        self.drafter = _randomize(dm.DFlash2DraftModel(cfg), 0)

    def loss(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        feats, emb = torch.randn(2, 8, 64, generator=g), torch.randn(2, 6, 32, generator=g)
        h = self.drafter(target_hidden=feats, noise_embedding=emb, position_ids=torch.arange(14)[None].expand(2, 14))
        sel = self.drafter.candidate_selector
        pair = sel.predecessor_codebook.weight[:8] @ sel.successor_codebook.weight[:8].T
        return h.square().mean() + sel.hidden_projection(h).mean() + pair.mean()


def _assert_extracted(folder: Path, module: torch.nn.Module) -> None:
    from dflash_cb.core.checkpoints.load import load_drafter

    got = load_drafter(folder)
    assert type(got) is DFlash2Drafter
    want = {k.removesuffix(".weight") if k.endswith("codebook.weight") else k: v
            for k, v in module.state_dict().items()}
    assert set(got.state_dict()) == set(want)
    for k, v in want.items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.e2e
def test_extract_from_lightning_hf_plain_and_specforge_checkpoints(tmp_path: Path) -> None:
    """A DFlash 2 drafter trained a few steps comes out of every checkpoint kind with the module's weights."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    from dflash_cb.core.checkpoints.load import extract_drafter

    cfg = _config(True)
    config = cfg.to_dict()

    class Module(LightningModule):
        def __init__(self, drafter_config: dict):
            super().__init__()
            self.save_hyperparameters()  # the drafter config travels in the checkpoint
            self.net = _Training(Qwen3Config(**drafter_config))

        def training_step(self, batch, batch_idx):
            return self.net.loss()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)

    module = Module(config)
    before = module.net.drafter.layers[0].mlp_conv.base_kernel.clone()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "pl", save_last=True)
    Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ckpt], default_root_dir=tmp_path).fit(module)
    assert not torch.equal(module.net.drafter.layers[0].mlp_conv.base_kernel, before)  # it trained
    info = extract_drafter(ckpt.last_model_path, tmp_path / "from_lightning")
    assert info["prefix"] == "net.drafter." and info["global_step"] == 2
    _assert_extracted(tmp_path / "from_lightning", module.net.drafter)

    class HFModule(_Training):
        def forward(self, x):
            return {"loss": self.loss()}

    hf = HFModule(cfg)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=1,
                             learning_rate=0.1, report_to="none", use_cpu=True, save_strategy="steps", save_steps=2,
                             logging_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    HFTrainer(model=hf, args=args, train_dataset=[{"x": 0.0}] * 4,
              data_collator=lambda b: {"x": torch.zeros(len(b))}).train()
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    info = extract_drafter(tmp_path / "hf" / "checkpoint-2", tmp_path / "from_hf", config=config)
    assert info["prefix"] == "drafter." and info["global_step"] == 2
    _assert_extracted(tmp_path / "from_hf", hf.drafter)

    torch.save({"drafter": hf.drafter.state_dict(), "step": 2}, tmp_path / "plain.pt")
    extract_drafter(tmp_path / "plain.pt", tmp_path / "from_plain", config=config)
    _assert_extracted(tmp_path / "from_plain", hf.drafter)

    # SpecForge's checkpoint layout (``{run}-step{N}/training_state.pt``: the draft weights under
    # ``draft_state_dict``); SpecForge 0.2.0 has no DFlash 2 strategy, so the drafter here is the reference's.
    (tmp_path / "run-step2").mkdir()
    torch.save({"draft_state_dict": hf.drafter.state_dict(), "global_step": 2, "epoch": 0, "strategy": "dflash",
                "run_id": "run", "world_size": 1}, tmp_path / "run-step2" / "training_state.pt")
    info = extract_drafter(tmp_path / "run-step2" / "training_state.pt", tmp_path / "from_specforge", config=config)
    assert info["entry"] == "draft_state_dict" and info["global_step"] == 2
    _assert_extracted(tmp_path / "from_specforge", hf.drafter)


# -- memory ----------------------------------------------------------------------------------------

def test_memory_bound_adds_the_parts_of_a_real_dflash2_drafter() -> None:
    """Against the DFlash drafter of the same shape: the weights grow by the real module's convolution and
    projection parameters, a codebooks part holds exactly its codebooks' bytes, a selector part covers every
    tensor the lattice of a full pass allocates; nothing else changes."""
    from allocations import Allocations

    from dflash_cb.core.costs.evaluation import DrafterShape, MemoryLimits, memory_bound
    from dflash_cb.core.drafters.dflash2.model import is_dflash2_key

    _, ours = _pair(_config(), seed=8)
    one = DFlashDrafter(_config(family="dflash"))
    limits = MemoryLimits(max_blocks=3)

    def bound(model):
        shape = DrafterShape.of(model.config, 6, 64)
        return memory_bound(shape, 100, weight_itemsize=2, head_itemsize=2, state_itemsize=4, limits=limits)

    a, b = bound(one), bound(ours)
    codebooks = sum(p.numel() for p in ours.codebooks)
    extra = sum(p.numel() for k, p in ours.named_parameters() if is_dflash2_key(k))
    assert b["codebooks"] == 2 * codebooks == 2 * 2 * 64 * 6
    assert b["weights"] - a["weights"] == 2 * (extra - codebooks)
    assert {k: v for k, v in b.items() if k not in ("weights", "codebooks", "selector")} == \
        {k: v for k, v in a.items() if k != "weights"}
    inputs = (torch.randint(0, 64, (3, 5, 5)), torch.randn(3, 5, 5), torch.randn(3, 5, 6), torch.randint(0, 64, (3,)))
    storages: dict[int, int] = {}  # every tensor allocated, once per storage (a view shares its base's)

    def record(t: torch.Tensor) -> bool:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return False

    with torch.no_grad(), Allocations(keep=record):
        selector.transition_logprobs(*inputs, *ours.codebooks)
    assert 0.5 * b["selector"] < sum(storages.values()) <= b["selector"]  # all of them alive at once: the worst case
