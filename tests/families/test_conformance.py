"""One conformance suite over every registered drafter family (``core/drafters/<family>/``): the replay equals the
family's own reference generate loop, a checkpoint round-trips, the cache fit is checked by the family's needs,
the family's figures reach results.json, the report and the tables, and a live evaluation in a plain loop logs
what the tool computes. A family is added here by registering its kit (``kits.KITS``), not by copying a test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kits import CASES, KITS, LAYERS
from tiny_target import ORACLE_LAYERS, ORACLE_MAX_NEW

from dflash_cb.core.drafters.registry import family_named, family_names

MAX_NEW = 40
BLOCK, SMALL = 8, 5
FAMILIES = sorted(KITS)


def test_every_registered_family_has_a_kit():
    assert sorted(family_names()) == FAMILIES


@pytest.fixture(scope="module")
def world(oracle_world: dict) -> dict:
    """One cache of a tiny target (a stop token two completions meet, top-K log-probs), its target
    (``tiny_target.build_oracle_world``)."""
    assert (LAYERS, MAX_NEW) == (ORACLE_LAYERS, ORACLE_MAX_NEW)
    return dict(cache=oracle_world["cache"], target=oracle_world["target"], stop=oracle_world["stop"], drafters={})


def _drafter(world: dict, family: str, variant: str = "") -> tuple:
    """(our module trained briefly, its config, the family's reference module with the same weights)."""
    if (family, variant) not in world["drafters"]:
        from tiny_target import train_briefly

        from dflash_cb.core.drafters.layouts import drafter_from_config

        kit, m = KITS[family], world["cache"].manifest
        cfg = kit.config_of(variant, m.vocab_size, m.hidden_size, BLOCK)
        torch.manual_seed(0)
        if kit.train is not None:
            ours = kit.train(drafter_from_config(cfg), world["cache"])
        else:
            ours = train_briefly(drafter_from_config(cfg), world["cache"], epochs=kit.train_epochs, loss=kit.loss)
        if kit.prepare is not None:
            kit.prepare(ours)
        world["drafters"][family, variant] = (ours, cfg, kit.reference(ours, cfg))
    return world["drafters"][family, variant]


@pytest.mark.parametrize("smaller", [False, True])
@pytest.mark.parametrize(("family", "variant"), CASES)
def test_the_replay_equals_the_familys_own_generate_loop(world, family: str, variant: str, smaller: bool) -> None:
    """Every sample's acceptance lengths are the family's reference loop's, cycle for cycle, at the drafter's
    block and a smaller one, for the kit's config and each of its variants; some cycles accept drafts and some
    do not; samples stop at the stop token or at max_new_tokens. The reference module itself (adopted,
    zero-copy) gives the same lengths. A family's head walks (the head off) are replayed too, and the head
    changes tau."""
    from dflash_cb.core.replay import evaluate

    cache, target = world["cache"], world["target"]
    ours, _, ref = _drafter(world, family, variant)
    block = SMALL if smaller else ours.spec.block_size
    stops = cache.manifest.stop_token_ids
    loop = KITS[family].loop_of(variant)
    want = {e.id: loop(ref, target, cache.load(e.id).input_ids[: e.prompt_len][None], MAX_NEW, stops, block)
            for e in cache.samples}
    tail = KITS[family].tail_blocks
    budgets = (4,) if family_named(family).supports_tree else ()
    rep = evaluate(cache, ours, budgets=budgets, tail_blocks=tail, block_size=block)
    got = {s.id: s.acceptance_lengths for s in rep.samples}
    assert got == want
    cycles = [n for v in want.values() for n in v]
    assert any(n > 1 for n in cycles) and any(n == 1 for n in cycles)
    ends = [cache.load(e.id).input_ids[-1].item() == world["stop"] for e in cache.samples]
    assert any(ends) and not all(ends)
    if KITS[family].adoptable:
        adopted = evaluate(cache, ref, budgets=(), tail_blocks=tail, block_size=block)
        assert {s.id: s.acceptance_lengths for s in adopted.samples} == want
    walks = family_named(family).figures.walks
    for walk in walks:  # the family's own walks are replayed too
        assert 1.0 <= rep.summary[walk.key] <= block
    if walks:  # the first: the family's own head switched off; the head, trained or set, changes tau
        assert rep.summary[walks[0].key] != rep.summary["tau"], walks[0].key


@pytest.mark.parametrize("family", FAMILIES)
def test_the_speed_checks_loops_decode_as_plain_greedy_decoding_and_the_replay(world, family: str) -> None:
    """The speed check's serving loops (``core.decode``: the target's and the drafter's caches kept across cycles)
    decode every prompt token for token as plain greedy decoding, and commit per cycle what the replay's cycles
    commit (full blocks, ``tail_blocks="served"``): the block or chain, and a DDTree where the family's tree is
    over the head's top-K. The loop drafts with its own state, not the cache's features: a drafter whose first
    layer is shifted by one proposes other drafts, and the comparison catches it."""
    from dflash_cb.core.decode.loops import (
        BlockDrafter,
        Clock,
        loop_drafter,
        plain_decode,
        speculative_decode,
    )
    from dflash_cb.core.decode.target_steps import DecodeError, TargetSteps
    from dflash_cb.core.drafters.proposers import ArgmaxProposer
    from dflash_cb.core.replay import evaluate

    cache, target = world["cache"], world["target"]
    ours, _, _ = _drafter(world, family)
    fam = family_named(family)
    head, embed = target.lm_head.weight, target.get_input_embeddings().weight
    proposer = fam.proposer(ours.spec, ours, head, 1 << 24, embed)
    tree = fam.supports_tree and type(proposer).tree is ArgmaxProposer.tree
    rep = evaluate(cache, ours, budgets=(4,) if tree else (), tail_blocks="served")
    layers, stops, clock = ours.spec.target_layer_ids, cache.manifest.stop_token_ids, Clock(torch.device("cpu"))
    loops = {"greedy": loop_drafter(ours, head, embed)}
    if tree:
        loops["ddtree"] = loop_drafter(ours, head, embed, tree_budget=4)
    elif fam.supports_tree:  # a tree of the family's own (DFlash 2's selector lattice): refused, not guessed
        with pytest.raises(DecodeError, match="builds DDTrees over the head's top-K"):
            BlockDrafter(loops["greedy"].runner, proposer, embed, ours.spec.block_size, 4)
    for s in rep.samples:
        prompt = cache.load(s.id).input_ids[: cache.entry(s.id).prompt_len].tolist()
        plain = plain_decode(TargetSteps(target, layers), prompt, MAX_NEW, stops, clock)
        assert plain.tokens == cache.load(s.id).input_ids[len(prompt):].tolist()  # the cache's greedy completion
        for name, drafter in loops.items():
            run = speculative_decode(TargetSteps(target, layers), drafter, prompt, MAX_NEW, stops, clock)
            assert run.tokens == plain.tokens, (name, s.id)
            assert run.accepted == (s.ddtree[4] if name == "ddtree" else s.acceptance_lengths), (name, s.id)
            assert run.seconds >= run.verify_seconds + run.draft_seconds - 1e-9 and run.verify_seconds > 0
    cycles = [n for s in rep.samples for n in s.acceptance_lengths]
    assert any(n > 1 for n in cycles)
    # Features of the wrong layers: the loop's drafts change, the tokens stay the target's own.
    wrong = [max(0, i - 1) for i in layers]
    s = rep.samples[0]
    prompt = cache.load(s.id).input_ids[: cache.entry(s.id).prompt_len].tolist()
    runs = [speculative_decode(TargetSteps(target, ids), loop_drafter(ours, head, embed), prompt, MAX_NEW, stops,
                               clock) for ids in (layers, wrong)]
    assert runs[0].tokens == runs[1].tokens
    assert any(speculative_decode(TargetSteps(target, wrong), loop_drafter(ours, head, embed),
                                  cache.load(x.id).input_ids[: cache.entry(x.id).prompt_len].tolist(), MAX_NEW,
                                  stops, clock).accepted != x.acceptance_lengths for x in rep.samples)


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_a_checkpoint_round_trips_in_every_form(world, family: str, variant: str, tmp_path: Path) -> None:
    """The published folder and a plain loop's checkpoint load into the family's class with the same weights; a
    folder missing one weight names the family's layout and the key."""
    from dflash_cb.core.checkpoints.load import CheckpointError, extract_drafter, load_drafter

    fam = family_named(family)
    ours, cfg, _ = _drafter(world, family, variant)
    ours.save_pretrained(tmp_path / "folder")
    torch.save({"drafter": ours.state_dict(), "config": cfg}, tmp_path / "loop.pt")
    extract_drafter(tmp_path / "loop.pt", tmp_path / "extracted")
    for folder in ("folder", "extracted"):
        back = load_drafter(tmp_path / folder)
        assert type(back) is fam.module_class() and back.spec == ours.spec, folder
        assert back.state_dict().keys() == ours.state_dict().keys()
        assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items()), folder
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "folder" / "model.safetensors"))
    dropped = sorted(state)[-1]
    del state[dropped]
    save_file(state, str(tmp_path / "folder" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"the {fam.label} layout: missing \['{dropped}'\]"):
        load_drafter(tmp_path / "folder")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_fit_is_the_familys_needs(world, family: str) -> None:
    """The family declares what it reads (layers, widths, filler token, target layers); one check compares it
    with the manifest and names the family and every field that differs."""
    from dflash_cb.cache.states import CacheMismatchError
    from dflash_cb.core.drafters.layouts import cache_needs, drafter_from_config

    fam = family_named(family)
    cache, m = world["cache"], world["cache"].manifest
    ours, cfg, _ = _drafter(world, family)
    needs = cache_needs(ours)
    assert needs.family == fam.label and list(needs.layer_ids) == list(KITS[family].layers)
    cache.check_fit(needs)
    other = {**cfg, "num_target_layers": 6}
    if "dflash_config" in cfg:
        other["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": [1, 2]}
    else:  # as many layers as the family reads
        other["target_layer_ids"] = [1, 2] + [2] * max(0, len(KITS[family].layers) - 2)
        if "eagle_config" in cfg:  # EAGLE-3 names its layers twice, and the two must agree
            other["eagle_config"] = {**cfg["eagle_config"],
                                     "eagle_aux_hidden_state_layer_ids": other["target_layer_ids"]}
    missing = 2
    if family == "mtp":  # an MTP head reads the target's last layer only: of 6 layers, layer 5
        other["target_layer_ids"], missing = [5], 5
    with pytest.raises(CacheMismatchError) as err:
        cache.check_fit(cache_needs(drafter_from_config(other)))
    said = str(err.value)
    assert f"does not fit the drafter ({fam.label})" in said and f"without [{missing}]" in said
    assert "num_target_layers: drafter was made for a 6-layer target" in said and str(m.layer_ids) in said


@pytest.mark.parametrize("family", FAMILIES)
def test_the_familys_figures_reach_every_output(world, family: str, tmp_path: Path) -> None:
    """results.json holds every figure the family declares (with intervals), its per-depth lists and its note;
    the printed report and the comparison table show them under the family's label."""
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.compare import compare, render_markdown
    from dflash_cb.core.results.report import format_results
    from dflash_cb.core.results.results_file import load_results, report_to_results, write_results

    fam = family_named(family)
    figures = fam.figures
    ours, _, _ = _drafter(world, family)
    cache = world["cache"]
    budgets = (4,) if fam.supports_tree else ()
    write_results(report_to_results(evaluate(cache, ours, budgets=budgets), cache), tmp_path / "r.json")
    res = load_results(tmp_path / "r.json", cache)
    assert res.family == family and json.loads((tmp_path / "r.json").read_text())["meta"]["drafter_family"] == family
    for f in (*figures.walks, *figures.pooled):
        assert res.metric(f.key) is not None, f.key
        assert res.metric(f.key + "_ci_low") <= res.metric(f.key) <= res.metric(f.key + "_ci_high"), f.key
    for d in figures.per_depth:
        assert len(res.per_depth[d.name]) == BLOCK - 1, d.name
    assert (figures.note_key in res.notes) == bool(figures.note)
    text = format_results(res)
    table = render_markdown(compare(["a", "b"], [res, res], 50, 0), None)
    for f in (*figures.walks, *figures.pooled):
        assert f.label in text and f"{fam.label}: {f.label}" in table, f.key


@pytest.mark.parametrize("family", FAMILIES)
def test_a_live_evaluation_in_a_plain_loop_logs_what_the_tool_computes(world, family: str, tmp_path: Path) -> None:
    """The live evaluator driven by a plain loop (start, finish) on the family's module: every logged figure,
    the family's own among them, is the tool's on the same weights."""
    from tool_runs import BUDGETS, PREFIX, assert_step_equals_tool

    from dflash_cb import LiveEvaluator
    from dflash_cb.core.figures.metrics import T1_TAU_ESTIMATE, TAU

    ours, _, _ = _drafter(world, family)
    logged: dict[int, dict[str, float]] = {}

    def collect(metrics: dict[str, float], step: int) -> None:
        if PREFIX + TAU in metrics:
            logged[step] = metrics

    budgets = BUDGETS if family_named(family).supports_tree else ()
    evaluator = LiveEvaluator(str(world["cache"].path), every_n_train_steps=1, max_steps=1, ddtree_budgets=budgets,
                              log=collect, console=False)
    assert evaluator.start(0, ours) is not None
    assert evaluator.finish(1, ours) is not None
    ours.save_pretrained(tmp_path / "drafter")
    assert sorted(logged) == [0, 1]
    for w in family_named(family).figures.walks:
        assert PREFIX + w.key in logged[1]
    assert_step_equals_tool(world["cache"].path, tmp_path / "drafter", tmp_path / "r.json", logged[1], True, BLOCK, 1,
                            approx=(T1_TAU_ESTIMATE,), budgets=budgets)
