"""What only the families with a head on the DFlash backbone do (DSpark's Markov head, Domino's GRU correction),
beside the conformance suite: the head changes the drafts (so the suite's oracle comparison tests it) and its
"head off" walk is the head-less drafter's tau, Domino's uncorrected first depths (with shift_label too), the
refusals (DDTree budgets, a Markov head type SpecForge does not build), specforge/acc left out and said why, and
early SpecForge checkpoints' ``logit_head.`` names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kits import KITS, _spec_generate, random_correction, random_markov_head
from safetensors.torch import load_file, save_file

from dflash_cb.common.cli import run
from dflash_cb.core.drafters.registry import family_named


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_cache) -> Path:
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.layouts import drafter_from_config

    m = StateCache(tiny_cache).manifest
    cfg = KITS["dspark"].config(m.vocab_size, m.hidden_size, 6)
    cfg["dflash_config"]["target_layer_ids"] = list(m.layer_ids)
    torch.manual_seed(0)
    drafter = drafter_from_config(cfg)
    random_markov_head(drafter)
    out = tmp_path_factory.mktemp("dspark") / "drafter"
    drafter.save_pretrained(out)
    return out


def test_the_tool_refuses_trees_and_leaves_specforge_accuracy_out_saying_why(tiny_cache, folder, tmp_path, capsys):
    from dflash_cb.integrations.cli import eval_drafter

    args = ["--states", str(tiny_cache), "--drafter", str(folder), "--dtype", "float32"]
    assert run(eval_drafter.main, [*args, "--out", str(tmp_path / "a.json"), "--ddtree-budgets", "4"]) == 2
    assert "a DSpark drafter drafts each depth from its parent token" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()
    assert run(eval_drafter.main, [*args, "--out", str(tmp_path / "b.json"), "--ddtree-budgets", ""]) == 0
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["meta"]["drafter_family"] == "dspark" and results["metrics"]["specforge/acc"] is None
    assert "specforge/acc is left out: SpecForge's DSpark accuracy" in results["meta"]["specforge_masks"]


def test_a_markov_head_of_another_type_names_its_keys_and_early_checkpoint_names_load(folder, tmp_path):
    """A gated head's weights under an rnn config: the layout's missing and extra keys; a head type SpecForge does
    not build: the types it does."""
    from dflash_cb.core.checkpoints.load import CheckpointError, load_drafter

    cfg = json.loads((folder / "config.json").read_text())
    for kind, said in (("rnn", r"DSpark layout: missing \['markov_head.joint_proj.bias', 'markov_head.joint_proj"
                               r".weight'\], unexpected \['markov_head.gate_proj.bias', 'markov_head.gate_proj.weight'\]"),
                       ("lstm", "markov_head_type 'lstm': SpecForge 0.2.0 builds vanilla, gated, rnn")):
        other = tmp_path / kind
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                                  "markov_head_type": kind}}))
        save_file(load_file(str(folder / "model.safetensors")), str(other / "model.safetensors"))
        with pytest.raises(CheckpointError, match=said):
            load_drafter(other)
    early = tmp_path / "early"  # SpecForge's first DSpark checkpoints kept the heads under logit_head.
    early.mkdir()
    (early / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    save_file({("logit_head." + k if k.startswith("markov_head.") else k): v for k, v in state.items()},
              str(early / "model.safetensors"))
    back, ours = load_drafter(early), load_drafter(folder)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items())


RANDOM_HEAD = {"dspark": random_markov_head, "domino": random_correction}  # weights that change the drafts


def _trained(family: str, cache, block: int = 6, train: bool = False, **fields):
    """A drafter of ``family`` with the kit's config and ``fields``: its head set to weights that change drafts, or
    with ``train`` trained briefly first, as the kits' drafters are (then the kit's own preparation)."""
    from tiny_target import train_briefly

    from dflash_cb.core.drafters.layouts import drafter_from_config

    m = cache.manifest
    cfg = KITS[family].config(m.vocab_size, m.hidden_size, block)
    cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": list(m.layer_ids), **fields}
    torch.manual_seed(0)
    drafter = drafter_from_config(cfg)
    prepare = RANDOM_HEAD[family]
    if train:
        drafter, prepare = train_briefly(drafter, cache), KITS[family].prepare
    if prepare is not None:
        prepare(drafter)
    return drafter, cfg


@pytest.mark.parametrize(("family", "fields"), [("dspark", {}), ("dspark", {"markov_head_type": "rnn"}),
                                                ("domino", {}), ("domino", {"shift_label": True})])
def test_the_head_changes_the_drafts(tiny_cache, family, fields):
    """With the head's own weights zeroed the drafts are the backbone's argmax: other cycles than with them."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    cache = StateCache(tiny_cache)
    drafter, _ = _trained(family, cache, **fields)
    with_head = evaluate(cache, drafter, budgets=(), keep_drafts=4)
    own = "markov_head" if family == "dspark" else "embed_proj"
    with torch.no_grad():
        for p in getattr(drafter, own).parameters():
            p.zero_()
    without = evaluate(cache, drafter, budgets=(), keep_drafts=4)
    assert [s.drafts for s in with_head.samples] != [s.drafts for s in without.samples]
    # The family's walk with the head off (its "where tau is lost" figure) is the head-less drafter's tau, exactly.
    (off,) = family_named(family).figures.walks
    assert with_head.summary[off.key] == without.summary["tau"] != with_head.summary["tau"]


@pytest.mark.parametrize(("family", "fields"), [("dspark", {"markov_head_type": "rnn"}),
                                                ("domino", {"shift_label": True})])
def test_blocks_drafted_only_as_deep_as_read_give_the_same_cycles(tiny_cache, family, fields):
    """Outside a strided statistics set a block is drafted a few depths at a time, only as deep as a walk reads
    (the engine's greedy head): the same cycles, and the same head-off walk, as with every block drafted whole, for
    a head whose state is scanned over the block and for one reading the position before each depth."""
    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    cache = StateCache(tiny_cache)
    drafter, _ = _trained(family, cache, train=True, **fields)
    whole = evaluate(cache, drafter, budgets=())
    strided = evaluate(cache, drafter, budgets=(), anchor_stride=4)
    assert [s.acceptance_lengths for s in strided.samples] == [s.acceptance_lengths for s in whole.samples]
    assert [s.walks for s in strided.samples] == [s.walks for s in whole.samples]
    assert any(n > 1 for s in whole.samples for n in s.acceptance_lengths)


@pytest.mark.parametrize("shift", [False, True])
def test_dominos_uncorrected_first_depths_equal_specforges_loop(tiny_cache, shift):
    """``pure_draft_prefix_len`` 2: depths 1 and 2 draft the head's argmax alone, the rest corrected; cycle for
    cycle SpecForge's own loop, with ``shift_label`` too (where SpecForge counts the uncorrected positions from the
    anchor's)."""
    from transformers import Qwen3ForCausalLM

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.replay import evaluate

    cache = StateCache(tiny_cache)
    drafter, cfg = _trained("domino", cache, pure_draft_prefix_len=2, shift_label=shift)
    ref = KITS["domino"].reference(drafter, cfg)
    target = Qwen3ForCausalLM.from_pretrained(tiny_cache.parent / "target", dtype=torch.float32).eval()
    m = cache.manifest
    want = {e.id: _spec_generate(ref, target, cache.load(e.id).input_ids[: e.prompt_len][None], m.max_new_tokens,
                                 m.stop_token_ids, 6) for e in cache.samples}
    got = evaluate(cache, drafter, budgets=(), tail_blocks="served")
    assert {s.id: s.acceptance_lengths for s in got.samples} == want


def test_the_confidence_heads_calibration_is_the_hand_computed_one(tiny_cache, tmp_path):
    """A DSpark drafter whose Markov head drafts ``s(t)`` after every token t (a bias of 1000 on it: ``s(t)`` the
    token that most often follows t in the cache) and whose confidence head reads only the previous token's Markov
    code (``confidence_head_with_markov``, zero weights on the state), set to predict ``p(t) = (37 t mod 100 +
    0.5) / 100``: its calibration figures in results.json (pooled, per depth, per bin), computed by hand from the
    cached tokens alone; the report prints the reliability table and the panels chart it."""
    import math
    from collections import Counter

    from plain_replay import anchors, loop_bounds

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.drafters.dspark import figures as f
    from dflash_cb.core.drafters.layouts import drafter_from_config
    from dflash_cb.core.figures.metrics import depth_acc
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.report import format_results
    from dflash_cb.core.results.results_file import load_results, report_to_results, write_results
    from dflash_cb.integrations.tracking.panels import PanelLayout, panel_plan

    cache = StateCache(tiny_cache)
    m, block = cache.manifest, 6
    v, h = m.vocab_size, m.hidden_size
    cfg = KITS["dspark"].config(v, h, block)
    cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": list(m.layer_ids), "markov_rank": v,
                            "markov_head_type": "vanilla", "confidence_head_with_markov": True}
    torch.manual_seed(0)
    drafter = drafter_from_config(cfg)
    seqs = [(e, cache.load(e.id).input_ids.tolist()) for e in cache.samples]
    follows: dict[int, Counter] = {}
    for _, toks in seqs:
        for a, b in zip(toks, toks[1:], strict=False):
            follows.setdefault(a, Counter())[b] += 1
    succ = {t: min(c, key=lambda x: (-c[x], x)) for t, c in follows.items()}
    p = [((37 * t) % 100 + 0.5) / 100 for t in range(v)]
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(v) * 1000)
        w2 = torch.zeros(v, v)
        for t, s in succ.items():
            w2[s, t] = 1.0
        drafter.markov_head.markov_w2.weight.copy_(w2)
        proj = drafter.confidence_head.proj
        proj.weight.zero_()
        proj.weight[0, h:] = torch.tensor([math.log(q / (1 - q)) / 1000 for q in p])
        proj.bias.zero_()

    # By hand: every statistics row (anchor, depth) whose target token is known.
    milli_by_depth, rows_by_depth, hits_by_depth = [0] * (block - 1), [0] * (block - 1), [0] * (block - 1)
    bins, bin_hits = [0] * f.BINS, [0] * f.BINS
    for e, toks in seqs:
        loop_end, known_end = loop_bounds(e.prompt_len, len(toks), e.valid_len, toks, m.max_new_tokens,
                                          set(m.stop_token_ids))
        for a in anchors(e.prompt_len, loop_end, known_end):
            for k in range(1, block):
                if a + k >= known_end:
                    break
                prev, tgt = toks[a + k - 1], toks[a + k]
                milli = round(p[prev] * 1000)
                b = min(milli // 100, f.BINS - 1)
                hit = succ.get(prev) == tgt
                milli_by_depth[k - 1] += milli
                rows_by_depth[k - 1] += 1
                hits_by_depth[k - 1] += hit
                bins[b] += 1
                bin_hits[b] += hit
    n = sum(rows_by_depth)
    assert 0 < sum(hits_by_depth) < n and sum(1 for c in bins if c) >= 3  # matches and misses, several bins

    write_results(report_to_results(evaluate(cache, drafter, budgets=()), cache), tmp_path / "r.json")
    res = load_results(tmp_path / "r.json", cache)
    for k in range(1, block):  # the drafts are s(previous token), as built
        assert res.metric(depth_acc(k)) == pytest.approx(hits_by_depth[k - 1] / rows_by_depth[k - 1])
        assert res.metric(f.confidence_predicted(k)) == pytest.approx(milli_by_depth[k - 1] / 1000 / rows_by_depth[k - 1])
    assert res.metric(f.CONFIDENCE_PREDICTED) == pytest.approx(sum(milli_by_depth) / 1000 / n)
    assert res.metric(f.CONFIDENCE_REALIZED) == pytest.approx(sum(hits_by_depth) / n)
    for b in range(f.BINS):
        assert res.metric(f.bin_share(b)) == pytest.approx(bins[b] / n)
        assert res.metric(f.bin_realized(b)) == (pytest.approx(bin_hits[b] / bins[b]) if bins[b] else None)
    assert res.per_depth["confidence_predicted"] == pytest.approx([m_ / 1000 / r for m_, r in
                                                                   zip(milli_by_depth, rows_by_depth, strict=True)])
    text = format_results(res)
    assert "DSpark confidence head reliability" in text
    b = max(range(f.BINS), key=lambda i: bins[i])
    assert f"{b / 10:.1f}-{(b + 1) / 10:.1f}      {bins[b] / n:.3f}" in text
    keys = {k for spec in panel_plan(PanelLayout(block_size=block, family="dspark"))["Drafter family"]
            for k in spec.keys}
    assert {"dflash_eval/" + k for k in (f.bin_realized(0), f.bin_share(9), f.confidence_predicted(5))} <= keys

    # Without a confidence head (confidence_head_alpha 0): none of these figures, and no table.
    cfg["dflash_config"] = {**cfg["dflash_config"], "confidence_head_alpha": 0.0, "confidence_head_with_markov": False}
    plain = drafter_from_config(cfg)
    assert getattr(plain, "confidence_head", None) is None
    write_results(report_to_results(evaluate(cache, plain, budgets=()), cache), tmp_path / "none.json")
    none = load_results(tmp_path / "none.json", cache)
    assert none.metric(f.CONFIDENCE_PREDICTED) is None and none.metric(f.bin_share(b)) is None
    assert none.metric(depth_acc(1)) is not None and "confidence head reliability" not in format_results(none)


def test_the_cost_model_counts_each_heads_weights_by_hand():
    """``DrafterShape`` of a Domino and a DSpark drafter: the head's weights counted by hand from the config (the
    DSpark code table apart), in ``memory_bound``'s ``family head`` part and in each read position's GFLOP."""
    from transformers import Qwen3Config

    from dflash_cb.core.costs.evaluation import DrafterShape, block_gflop, memory_bound

    v, h, g, e, r = 64, 32, 8, 16, 8
    domino = Qwen3Config(**KITS["domino"].config(v, h, 6))
    dspark = Qwen3Config(**KITS["dspark"].config(v, h, 6))  # gated, a confidence head without the Markov code
    dflash = Qwen3Config(**KITS["dflash"].config(v, h, 6))
    shapes = {name: DrafterShape.of(c, 6, 2 * h) for name, c in (("domino", domino), ("dspark", dspark),
                                                                   ("dflash", dflash))}
    gru, proj = 3 * g * (h + g), (h + g) * e + e * v
    gate, confidence = (h + r) * r + r, h + 1
    assert (shapes["domino"].head_params, shapes["domino"].head_tables) == (gru + proj, 0)
    assert (shapes["dspark"].head_params, shapes["dspark"].head_tables) == (r * v + gate + confidence, v * r)
    assert (shapes["dflash"].head_params, shapes["dflash"].head_tables) == (0, 0)
    for name in ("domino", "dspark"):
        s = shapes[name]
        parts = memory_bound(s, 100, weight_itemsize=2, head_itemsize=2, state_itemsize=2)
        assert parts["family head"] == 2 * (s.head_params + s.head_tables)
        assert block_gflop(s, 50, 3) - block_gflop(shapes["dflash"], 50, 3) == pytest.approx(2 * 3 * s.head_params / 1e9)
    assert "family head" not in memory_bound(shapes["dflash"], 100, weight_itemsize=2, head_itemsize=2, state_itemsize=2)
