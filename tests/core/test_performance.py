"""What an evaluation costs, where its time goes, and how many threads it runs on.

The light evaluation (statistics every block-th anchor, the largest budget) must never cost more than the
full one (stride 1, every budget): at the sizes the demo reaches, a round of drafting costs more than the
blocks it spares, and the live evaluator then drafts every anchor at once (``cost.draft_all_is_cheaper``).
The tests count that work (blocks drafted, passes, DDTree heap pops, and the cost model's price of them), which
no other job on the machine changes; ``benchmarks/eval_cost.py`` prints the CPU seconds beside them.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from dflash_cb.cache.states import StateCache
from dflash_cb.common.timing import PhaseTimer
from dflash_cb.core.costs.evaluation import (
    DrafterShape,
    draft_all_is_cheaper,
    evaluation_cost,
    predicted_seconds,
)
from dflash_cb.core.drafters import proposers
from dflash_cb.core.drafters.dflash.model import DFlashDrafter
from dflash_cb.core.figures.metrics import ddtree_tau
from dflash_cb.core.replay import PHASES, evaluate

BUDGETS = (4, 8)


@pytest.fixture(scope="module")
def caches(tiny_cache, tmp_path_factory) -> dict[str, Path]:
    """The toy at two of the demo's sizes: 6 samples of 24 tokens and 30 of 40 (its eval cache)."""
    from conftest import build_tiny_cache

    return {"6 samples": tiny_cache,
            "30 samples": build_tiny_cache(tmp_path_factory.mktemp("thirty"), n_prompts=30, max_new_tokens=40)}


@pytest.fixture(scope="module")
def drafter_at(caches, tiny_drafter_config, trained_tiny_drafter):
    """A maker of the tiny drafter (seed 0) for a cache of ``caches``, trained briefly on it or not: each made once
    in the module (the tests only evaluate it); on the tiny cache the training is the session's
    ``trained_tiny_drafter``."""
    from tiny_target import train_briefly

    made: dict[tuple[str, bool], DFlashDrafter] = {}

    def make(size: str, trained: bool) -> DFlashDrafter:
        if (size, trained) not in made:
            if trained and size == "6 samples":
                made[size, trained] = trained_tiny_drafter()
            else:
                torch.manual_seed(0)
                drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
                made[size, trained] = (train_briefly(drafter, StateCache(caches[size])) if trained
                                       else drafter.eval())
        return made[size, trained]

    return make


def counting_heap_pops(monkeypatch) -> list[int]:
    """The DDTree heap pops the engine makes (anchors x the budget each heap runs to), summed in ``[0]``."""
    pops = [0]
    real = proposers.ddtree_accepted  # DFlash's trees (proposers.ArgmaxProposer.tree)

    def counted(topk_ids, topk_logprobs, depths, target, max_budget):
        pops[0] += topk_ids.shape[0] * max_budget
        return real(topk_ids, topk_logprobs, depths, target, max_budget)

    monkeypatch.setattr(proposers, "ddtree_accepted", counted)
    return pops


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("size", ["6 samples", "30 samples"])
def test_the_light_evaluation_costs_no_more_than_the_full_one(caches, drafter_at, size, trained, monkeypatch):
    """As the live evaluator runs them: the light evaluation decides from a warm-up sample's taus whether to
    draft every anchor at once; the full one has the light stride's statistics too. An untrained drafter
    (tau 1: the walks visit every anchor, both draft everything) and a briefly trained one. Counted work: the
    blocks drafted, the drafter passes and the heap pops of the light evaluation are at most the full one's,
    and so is the cost model's price of that counted work (``cost.evaluation_cost(counted=...)``) at its
    reference rates; the pops counted are the ones the model prices."""
    cache = StateCache(caches[size])
    drafter = drafter_at(size, trained)
    spec = drafter.spec
    block = spec.block_size
    shape = DrafterShape.of(drafter.config, block, len(spec.target_layer_ids) * spec.target_hidden_size)
    everything = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
    longest = max(cache.samples, key=lambda e: e.valid_len - e.prompt_len).id
    warm = evaluate(cache, drafter, sample_ids=[longest], budgets=BUDGETS[-1:], anchor_stride=1)
    draft_all = draft_all_is_cheaper(shape, everything, warm.tau, BUDGETS[-1:], block,
                                     {BUDGETS[-1]: warm.summary[ddtree_tau(BUDGETS[-1])]})
    pops = counting_heap_pops(monkeypatch)
    one = evaluate(cache, drafter, budgets=BUDGETS[-1:], anchor_stride=block, draft_all=draft_all)
    one_pops, pops[0] = pops[0], 0
    every = evaluate(cache, drafter, budgets=BUDGETS, anchor_stride=1, extra_anchor_strides=[block])
    every_pops = pops[0]

    def priced(report, budgets, stride, at_once):
        drafted = int(report.counts.data["anchors_drafted"].item())
        return evaluation_cost(shape, everything, report.tau, budgets, stride, draft_all=at_once,
                               tree_taus={b: report.summary[ddtree_tau(b)] for b in budgets},
                               counted=(drafted, report.passes))

    light, full = priced(one, BUDGETS[-1:], block, draft_all), priced(every, BUDGETS, 1, False)
    assert draft_all  # at these sizes a round costs more than the blocks it spares
    assert one.passes <= every.passes and light.anchors <= full.anchors and one_pops <= every_pops
    assert (one_pops, every_pops) == (light.tree_pops, full.tree_pops)
    assert predicted_seconds(light) <= predicted_seconds(full), (size, trained, light, full)
    # The same replays whatever was drafted at once.
    assert [s.acceptance_lengths for s in one.samples] == [s.acceptance_lengths for s in every.samples]


def test_drafting_every_anchor_at_once_changes_only_what_is_drafted(tiny_cache, trained_tiny_drafter):
    """draft_all: one round instead of one per cycle, every figure of the evaluation equal."""
    cache = StateCache(tiny_cache)
    drafter = trained_tiny_drafter()
    rounds = evaluate(cache, drafter, budgets=BUDGETS, anchor_stride=3)
    at_once = evaluate(cache, drafter, budgets=BUDGETS, anchor_stride=3, draft_all=True)
    assert rounds.passes > 2 and at_once.passes == 1
    assert at_once.counts.data["anchors_drafted"].item() > rounds.counts.data["anchors_drafted"].item()
    for k, v in rounds.counts.data.items():
        if k not in ("anchors_drafted", "t1_sum"):
            assert torch.equal(at_once.counts.data[k], v), k
    assert [(s.acceptance_lengths, s.ddtree) for s in at_once.samples] == [
        (s.acceptance_lengths, s.ddtree) for s in rounds.samples]


def test_phase_timers_account_for_the_evaluation(tiny_cache, trained_tiny_drafter):
    """Every engine phase is timed, each tick of the clock at most once (nested phases exclusive): on a clock
    that counts its own reads, the phases' total is within the ticks between the first and the last read."""
    cache = StateCache(tiny_cache)
    drafter = trained_tiny_drafter()
    reads = itertools.count()
    timer = PhaseTimer(clock=lambda: float(next(reads)))
    evaluate(cache, drafter, budgets=BUDGETS, anchor_stride=3, timer=timer)
    last = next(reads) - 1
    assert set(timer.seconds) == set(PHASES)
    assert all(v > 0 for v in timer.seconds.values()) and timer.total <= last


def test_threads_default_to_the_usable_cores_and_are_recorded(tiny_cache, tiny_drafter_config, tmp_path, capsys,
                                                              monkeypatch):
    """--threads: the cores this process may use, at most one per physical core and OMP_NUM_THREADS; given, it
    is checked (one line, exit 2) before any work, printed in the summary and recorded in results.json."""
    from dflash_cb.common.cli import run
    from dflash_cb.common.threads import default_threads, physical_cores, usable_cpus
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    cpus = usable_cpus()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == min(len(cpus), physical_cores(cpus) or len(cpus))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    drafter = DFlashDrafter.from_config_dict(tiny_drafter_config)
    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "results.json"
    argv = ["--states", str(tiny_cache), "--drafter", str(tmp_path / "drafter"), "--out", str(out),
            "--ddtree-budgets", "", "--device", "cpu"]
    n = torch.get_num_threads()
    try:
        assert run(eval_cli.main, [*argv, "--threads", "0"]) == 2
        err = capsys.readouterr().err
        assert "--threads '0': expected a positive integer" in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
        assert run(eval_cli.main, [*argv, "--threads", "1"]) == 0
        assert "threads=1" in capsys.readouterr().out
        assert json.loads(out.read_text())["meta"]["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("size", ["6 samples", "30 samples"])
def test_rounds_build_a_tree_only_where_a_tree_walk_may_still_go(caches, drafter_at, size, monkeypatch):
    """Drafting round by round, a block gets the head's top-K and a DDTree only where a tree walk may still visit
    it (or it is a statistics anchor): fewer heaps than blocks drafted, the cost model's count of them
    (``cost.tree_share``) close to the count, and every replay, tree included, the one drafting every anchor at
    once gives (a tree for every block)."""
    cache = StateCache(caches[size])
    drafter = drafter_at(size, True)
    spec = drafter.spec
    shape = DrafterShape.of(drafter.config, spec.block_size, len(spec.target_layer_ids) * spec.target_hidden_size)
    pops = counting_heap_pops(monkeypatch)
    budget, stride = BUDGETS[-1], spec.block_size
    rounds = evaluate(cache, drafter, budgets=(budget,), anchor_stride=stride)
    heaps, pops[0] = pops[0] // budget, 0
    at_once = evaluate(cache, drafter, budgets=(budget,), anchor_stride=stride, draft_all=True)
    drafted = int(rounds.counts.data["anchors_drafted"].item())
    assert rounds.passes > 2 and heaps < drafted and pops[0] // budget == at_once.counts.data["anchors_drafted"].item()
    assert [(s.acceptance_lengths, s.ddtree) for s in rounds.samples] == [
        (s.acceptance_lengths, s.ddtree) for s in at_once.samples]
    samples = [(e.prompt_len, e.valid_len - e.prompt_len) for e in cache.samples]
    model = evaluation_cost(shape, samples, rounds.tau, (budget,), stride,
                            tree_taus={budget: rounds.summary[ddtree_tau(budget)]})
    print(f"{size}: {drafted} blocks drafted, {heaps} trees built, {model.tree_pops // budget:.0f} predicted")
    assert abs(model.tree_pops / budget - heaps) <= 0.25 * heaps
