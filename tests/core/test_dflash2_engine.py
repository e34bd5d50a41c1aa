"""The engine on DFlash 2 drafters against the ground truth: the reference ``dflash.model.dflash_generate`` loop with
the reference ``DFlash2DraftModel`` (``tail_blocks="reference"``), an independent full-block loop whose drafts are
the reference's selector walk (``tail_blocks="served"``, tests/support/full_block_loop.py), and a plain per-anchor replay
written here with the reference's own modules (the selector diagnostics and the tree over its lattice, against the
heap of tests/support/selector_reference.py).

A tiny Qwen3 target (precomputed by our tool, a stop token among its completions, the target's top-K stored), and a
DFlash 2 drafter of block 16 trained briefly with its selector (tests/support/tiny_target.py, ``selector_loss``), so that acceptance is partial
and the selector's walk, the unary argmax and a perfect selector give three different taus. One drafter layer is
causal with a sliding window shorter than the contexts (and than the block). Blocks of 16 and, served smaller, 8.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import oracles
import plain_replay
import pytest
import torch
from figures import T1_RTOL, assert_same_figures, is_float_figure
from selector_reference import heap_tree_accept
from transformers import Qwen3Config

from dflash_cb.core.drafters.dflash2.figures import (
    SELECTOR_ACC,
    SELECTOR_ORACLE_TAU,
    SELECTOR_RECALL,
    SELECTOR_RECALL_COUNT,
    SELECTOR_UNARY_TAU,
    selector_acc,
    selector_recall,
)
from dflash_cb.core.drafters.registry import spec_from_config
from dflash_cb.core.figures.metrics import T1_TAU_ESTIMATE, TAU, ddtree_tau

dm = oracles.require("dflash.model")

LAYERS = [1, 3]  # outputs of decoder layers 1 and 3 of the 4-layer target
MAX_NEW = 40
BLOCK, SMALL = 16, 8
K = 4  # selector_top_k: few candidates, so the target often is not among them
TREE_BUDGETS = (3, 12)
SELECTOR = {"conv_group_size": 8, "conv_kernel_size": 2, "selector_rank": 8, "selector_top_k": K}
WALKS = (SELECTOR_UNARY_TAU, SELECTOR_ORACLE_TAU)


def _drafter_config(vocab: int, hidden: int, **dflash) -> dict:
    return dict(
        architectures=["DFlash2DraftModel"], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=4, block_size=BLOCK,
        layer_types=["full_attention", "sliding_attention"], sliding_window=9, use_sliding_window=True,
        dflash_config={"target_layer_ids": LAYERS, "mask_token_id": vocab - 1, **SELECTOR, **dflash},
    )


def _reference(ours, cfg: dict):
    ref = dm.DFlash2DraftModel(Qwen3Config(**cfg)).eval()
    ref.load_state_dict({k + ".weight" if k.endswith("codebook") else k: v for k, v in ours.state_dict().items()})
    return ref


def _run_loops(cache, ref, target, block: int, full: bool = True) -> tuple[dict, dict]:
    """Per sample: dflash_generate's acceptance lengths and (``full``) the full-block loop's run, at ``block``."""
    from full_block_loop import full_block_generate

    stops = cache.manifest.stop_token_ids
    mask = ref.config.dflash_config["mask_token_id"]

    def walk(hidden: torch.Tensor, anchor: int) -> list[int]:  # what a server proposes: the selector's walk
        return ref.propose(hidden, torch.tensor([anchor]), target.lm_head, 0.0)[0][0].tolist()

    orig = dm._cuda_time
    dm._cuda_time = time.perf_counter  # it synchronises CUDA; a wall clock does the same job on a CPU
    try:
        oracle, loop = {}, {}
        for e in cache.samples:
            prompt = cache.load(e.id).input_ids[: e.prompt_len][None]
            run = dm.dflash_generate(ref, target, prompt, MAX_NEW, stops, block_size=block, return_stats=True)
            oracle[e.id] = list(run.acceptance_lengths)
            if full:
                loop[e.id] = full_block_generate(ref, target, prompt[0].tolist(), MAX_NEW, stops, LAYERS, block, mask,
                                                 propose=walk)
    finally:
        dm._cuda_time = orig
    return oracle, loop


@pytest.fixture(scope="module")
def world(oracle_world: dict) -> dict:
    from tiny_target import ORACLE_LAYERS, ORACLE_MAX_NEW, selector_loss, train_briefly

    from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter

    # The tiny target's cache with a stop token found a few tokens into two completions, so that two samples stop and
    # the others reach max_new_tokens (where the tail-block conventions part); the target's top-K stored.
    assert (LAYERS, MAX_NEW) == (ORACLE_LAYERS, ORACLE_MAX_NEW)
    cache, target, stop = oracle_world["cache"], oracle_world["target"], oracle_world["stop"]
    m = cache.manifest
    cfg = _drafter_config(m.vocab_size, m.hidden_size)
    torch.manual_seed(0)
    ours = train_briefly(DFlash2Drafter.from_config_dict(cfg), cache, epochs=20, loss=selector_loss)
    ref = _reference(ours, cfg)
    runs = {block: _run_loops(cache, ref, target, block) for block in (BLOCK, SMALL)}
    # The same weights under a config that scales and caps the logits (unary scores and candidates change).
    scaled_cfg = _drafter_config(m.vocab_size, m.hidden_size, output_multiplier=0.4, final_logit_softcapping=2.5)
    scaled = DFlash2Drafter.from_config_dict(scaled_cfg).eval()
    scaled.load_state_dict(ours.state_dict())
    scaled_oracle, _ = _run_loops(cache, _reference(scaled, scaled_cfg), target, BLOCK, full=False)
    return dict(cache=cache, cfg=cfg, ours=ours, ref=ref, target=target, runs=runs, stop=stop,
                scaled=scaled, scaled_oracle=scaled_oracle)


def _lists(report) -> dict[str, list[int]]:
    return {s.id: s.acceptance_lengths for s in report.samples}


# -- the loop ----------------------------------------------------------------------------------------

def test_generic_runner_reads_the_selector_from_the_module(world) -> None:
    from dflash_cb.core.drafters.dflash.runner import PerAnchorRunner
    from dflash_cb.core.replay import evaluate

    cache, ref = world["cache"], world["ref"]
    runner = PerAnchorRunner(ref, spec_from_config(ref.config))
    sub = [e.id for e in cache.samples[:2]]
    rep = evaluate(cache, runner, budgets=(), sample_ids=sub, tail_blocks="reference", device="cpu")
    assert _lists(rep) == {k: world["runs"][BLOCK][0][k] for k in sub}
    with pytest.raises(ValueError, match="has no candidate_selector"):
        evaluate(cache, PerAnchorRunner(lambda **kw: ref(**kw), runner.spec), budgets=(), sample_ids=sub)


@pytest.mark.parametrize("block", [BLOCK, SMALL])
def test_served_tail_blocks_equal_a_full_block_loop_of_selector_walks(world, block: int) -> None:
    """``tail_blocks="served"`` reproduces a loop that drafts a full block every cycle, the block being the
    reference's selector walk: the cycles, every cycle's block (the walk, not the teacher-forced draft), and the
    correct-draft counts wherever the cache knows the target's tokens."""
    from dflash_cb.core.replay import evaluate

    rep = evaluate(world["cache"], world["ours"], budgets=(4,), keep_drafts=MAX_NEW, block_size=block)
    _, loop = world["runs"][block]
    for s in rep.samples:
        want = loop[s.id]
        assert s.acceptance_lengths == want.acceptance_lengths, s.id
        assert s.drafts == want.drafts, s.id
        assert s.correct_drafts[:-1] == want.correct_drafts[:-1] and s.correct_drafts[-1] <= want.correct_drafts[-1]
    # At block 16 the reference convention's shortened tail blocks draft otherwise (the first layer is
    # bidirectional): there the comparison sees the tail convention.
    ref = evaluate(world["cache"], world["ours"], budgets=(), keep_drafts=MAX_NEW, block_size=block,
                   tail_blocks="reference")
    changed = any(a[: len(b)] != b for s, r in zip(rep.samples, ref.samples, strict=True)
                  for a, b in zip(s.drafts, r.drafts, strict=False))
    assert changed or block != BLOCK


def test_scaled_and_capped_logits(world) -> None:
    """``output_multiplier`` and ``final_logit_softcapping`` set: the unary scores the selector adds to its pair
    scores are the scaled, capped logits, as in the reference; the same weights without them draft otherwise."""
    from dflash_cb.core.replay import evaluate

    cache = world["cache"]
    scaled = evaluate(cache, world["scaled"], budgets=(), tail_blocks="reference", keep_drafts=MAX_NEW)
    assert _lists(scaled) == world["scaled_oracle"]
    plain = evaluate(cache, world["ours"], budgets=(), tail_blocks="reference", keep_drafts=MAX_NEW)
    assert [s.drafts for s in scaled.samples] != [s.drafts for s in plain.samples]


# -- where tau is lost, and the tree: a plain per-anchor replay with the reference's modules -----------

@torch.no_grad()
def _plain_replay(world, budgets: tuple[int, ...]) -> dict:
    """Per sample, from one reference forward per anchor (its block shortened at the tail, as dflash_generate
    does) and the reference's candidate selector: the cycles of the selector's, the unary argmax's and a perfect
    selector's loops, of DDTree over the lattice (tests/support/selector_reference.py), and the per-depth counts."""
    cache, ref = world["cache"], world["ref"]
    sel = ref.candidate_selector
    head = cache.load_head()
    out_head = torch.nn.Linear(head.lm_head.shape[1], head.lm_head.shape[0], bias=False)
    out_head.weight = torch.nn.Parameter(head.lm_head)
    stops = set(cache.manifest.stop_token_ids)
    d = BLOCK - 1
    counts = {"total": [0] * d, "recall": [0] * d, "match": [0] * d}
    t1 = []
    per_sample = {}
    for e in cache.samples:
        s = cache.load(e.id)
        tok = s.input_ids.tolist()
        loop_end, known_end = plain_replay.loop_bounds(e.prompt_len, e.total_len, e.valid_len, tok, MAX_NEW, stops)
        produced = {}
        for p in plain_replay.anchors(e.prompt_len, loop_end, known_end):
            n = min(BLOCK, loop_end - p)
            ids = torch.tensor([tok[p]] + [ref.mask_token_id] * (n - 1))
            h = ref(target_hidden=s.hidden[None, :p], noise_embedding=head.embed_tokens[ids][None],
                    position_ids=torch.arange(p + n)[None])[0, 1:]
            logits = ref.compute_logits(h, out_head)
            unary, cand = torch.topk(logits, K, dim=-1)
            proj = sel.hidden_projection(h)

            def scores(k: int, before: int, unary=unary, proj=proj, cand=cand) -> torch.Tensor:
                """The reference's edge scores of depth k + 1's candidates after the token ``before``."""
                return unary[k] + (sel.predecessor_codebook.weight[before] * proj[k]) @ \
                    sel.successor_codebook.weight[cand[k]].T

            target = [tok[p + k] if p + k < known_end else -1 for k in range(1, n)]
            picked, unary_hit, recall, alpha = [], [], [], []
            for k in range(n - 1):
                before = tok[p + k] if p + k < known_end else 0  # teacher forced: the anchor, the target's tokens
                sc = scores(k, before)
                picked.append(cand[k][sc.argmax()].item() == target[k])
                unary_hit.append(logits[k].argmax().item() == target[k])
                recall.append(target[k] in cand[k].tolist())
                if target[k] >= 0:
                    counts["total"][k] += 1
                    counts["recall"][k] += recall[-1]
                    counts["match"][k] += picked[-1]
                if target[k] < 0:
                    alpha.append(0.0)
                    continue
                # Temperature 1: the selector samples from a softmax of its scores over the candidates.
                q = dict(zip(cand[k].tolist(), torch.softmax(sc, -1).tolist(), strict=True))
                stored = zip(s.topk_ids[p + k].tolist(), s.topk_logprobs[p + k].tolist(), strict=True)
                alpha.append(sum(min(math.exp(lp), q.get(x, 0.0)) for x, lp in stored))
            prod, total = 1.0, 1.0
            for a in alpha:
                prod *= a
                total += prod
            t1.append(total)
            first = torch.log_softmax(scores(0, tok[p]).double(), -1).tolist()
            steps = [[torch.log_softmax(scores(k, c).double(), -1).tolist() for c in cand[k - 1].tolist()]
                     for k in range(1, n - 1)]
            trees = [heap_tree_accept(cand.tolist(), first, steps, n - 1, target, b) for b in budgets]

            accepted = [_lead(picked), *trees, _lead(unary_hit), _lead(recall)]
            produced[p] = [plain_replay.committed(a, p, loop_end, tok, stops) for a in accepted]
        per_sample[e.id] = [plain_replay.walk(lambda q, w=w, at=produced: at[q][w], e.prompt_len, loop_end, known_end,
                                              tok, stops) for w in range(3 + len(budgets))]
    return dict(samples=per_sample, counts=counts, t1=sum(t1) / len(t1))


def _lead(hits: list[bool]) -> int:
    return next((i for i, x in enumerate(hits) if not x), len(hits))


def test_selector_diagnostics_and_lattice_tree_equal_a_plain_replay(world) -> None:
    """At every anchor: the unary top-K recall, the selector's pick given the target's predecessors, the
    temperature-1 estimate of its candidate softmax, and the cycles of the selector's loop, of the unary argmax's
    (the selector off), of a perfect selector's and of DDTree over the lattice at two budgets."""
    from dflash_cb.core.replay import evaluate

    want = _plain_replay(world, TREE_BUDGETS)
    rep = evaluate(world["cache"], world["ours"], budgets=TREE_BUDGETS, tail_blocks="reference")
    for s in rep.samples:
        lists = want["samples"][s.id]
        assert s.acceptance_lengths == lists[0], s.id
        assert s.ddtree == {b: lists[1 + i] for i, b in enumerate(TREE_BUDGETS)}, s.id
        assert s.walks == dict(zip(WALKS, lists[-2:], strict=True)), s.id
    data, c = rep.counts.data, want["counts"]
    assert data["depth_total"].tolist() == c["total"]
    assert data[SELECTOR_RECALL_COUNT].tolist() == c["recall"] and data["depth_match"].tolist() == c["match"]
    summary = rep.summary
    assert summary[SELECTOR_RECALL] == sum(c["recall"]) / sum(c["total"])
    assert summary[SELECTOR_ACC] == sum(c["match"]) / sum(c["recall"])
    assert summary[selector_recall(2)] == c["recall"][1] / c["total"][1]
    assert summary[selector_acc(2)] == c["match"][1] / c["recall"][1]
    assert 0 < summary[SELECTOR_RECALL] < 1 and 0 < summary[SELECTOR_ACC] < 1
    assert summary[T1_TAU_ESTIMATE] == pytest.approx(want["t1"], rel=1e-5)
    cycles = [n for v in want["samples"].values() for lists in v[1:] for n in lists]
    assert len({summary[ddtree_tau(b)] for b in TREE_BUDGETS}) == 2 and max(cycles) > 2  # trees that reach deep


def test_drafting_choices_change_no_figure(world) -> None:
    """What is drafted (every anchor at once or round by round, the statistics stride, passes cut small, one
    sample at a time) changes no replay, and at one stride no statistic: every walk, the selector's included."""
    from dflash_cb.core.costs.evaluation import MemoryLimits
    from dflash_cb.core.replay import evaluate

    cache, ours = world["cache"], world["ours"]
    runs = {(stride, draft_all): evaluate(cache, ours, budgets=(4,), anchor_stride=stride, draft_all=draft_all)
            for stride in (1, 8) for draft_all in (False, True)}

    def walks(rep) -> list:
        return [(s.acceptance_lengths, s.ddtree, s.walks) for s in rep.samples]

    first = walks(runs[(1, False)])
    assert all(walks(r) == first for r in runs.values())
    for stride in (1, 8):  # every integer figure to the last bit, the t1 estimate to figures.T1_RTOL (its docstring)
        assert_same_figures(runs[(stride, False)].summary, runs[(stride, True)].summary, ignore={"anchors_drafted"})
    assert runs[(8, True)].summary["anchors_drafted"] > runs[(8, False)].summary["anchors_drafted"]
    squeezed = evaluate(cache, ours, budgets=(4,), anchor_stride=8,
                        limits=MemoryLimits(max_blocks=3, head_bytes=3 * 128 * 12, context_bytes=1))
    alone = [evaluate(cache, ours, budgets=(4,), anchor_stride=8, sample_ids=[e.id]) for e in cache.samples]
    assert walks(squeezed) == first == [w for r in alone for w in walks(r)]
    summed = alone[0].counts
    for r in alone[1:]:
        summed.merge_(r.counts)
    for k, v in runs[(8, False)].counts.data.items():
        if is_float_figure(k):
            assert torch.allclose(summed.data[k], v, rtol=T1_RTOL, atol=0), k
            assert torch.allclose(squeezed.counts.data[k], v, rtol=T1_RTOL, atol=0), k
        else:
            assert torch.equal(summed.data[k], v), k
            assert torch.equal(squeezed.counts.data[k], v), k


def test_counts_are_one_flat_vector_of_a_fixed_shape(world) -> None:
    """A DFlash 2 evaluation's counts travel as one float64 vector (the single all_reduce): its shape follows from
    (block, budgets, categories, family) alone, and loading it back gives the same figures."""
    from dflash_cb.core.figures.metrics import EvalCounts, summarize
    from dflash_cb.core.replay import evaluate

    cache = world["cache"]
    rep = evaluate(cache, world["ours"], budgets=(4, 8), anchor_stride=8)
    c = rep.counts
    template = EvalCounts(c.block_size, (4, 8), c.categories, "dflash2")
    assert template.flat().shape == c.flat().shape
    assert EvalCounts(c.block_size, (4, 8), c.categories).flat().numel() == c.flat().numel() - 2 * 2 - (BLOCK - 1)
    template.load_flat(c.flat())
    back = summarize(template)
    assert back.keys() == rep.summary.keys() and SELECTOR_ACC in back
    assert all(back[k] == v or (math.isnan(back[k]) and math.isnan(v)) for k, v in rep.summary.items())


# -- DDTree budgets -----------------------------------------------------------------------------------

def test_a_budget_past_the_lattice_is_refused_naming_it(world, tmp_path: Path, capsys) -> None:
    """The tree of a DFlash 2 drafter is over its selector's candidates: at block 3 and K 4 it has 4 + 16 nodes,
    so budget 21 is refused (the tool, the live evaluator's check) where a DFlash drafter's tree could use it."""
    from dflash_cb.common.cli import run
    from dflash_cb.core.loop.ddtree import DDTreeBudgetError, check_ddtree_budgets, max_ddtree_budget
    from dflash_cb.integrations.cli import eval_drafter as eval_cli
    from dflash_cb.integrations.evaluator.config import EvalConfig
    from dflash_cb.integrations.evaluator.session import drafter_fit

    assert max_ddtree_budget(3, 128, K) == 20 and max_ddtree_budget(3, 128) == 1024
    check_ddtree_budgets([21], 3, 128, "budgets")  # a DFlash drafter's tree could hold it
    world["ours"].save_pretrained(tmp_path / "drafter")
    args = ["--states", str(world["cache"].path), "--drafter", str(tmp_path / "drafter"), "--block-size", "3",
            "--dtype", "float32", "--out", str(tmp_path / "r.json")]
    assert run(eval_cli.main, [*args, "--ddtree-budgets", "8,21"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--ddtree-budgets [21]: above 20, the nodes of a DFlash 2 drafter's " \
                                           "selector lattice with block size 3 and selector_top_k 4" in err, err
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(DDTreeBudgetError, match="ddtree_budgets \\[21\\]: above 20"):
        drafter_fit(world["cache"], EvalConfig(str(world["cache"].path), every_n_train_steps=0, ddtree_budgets=[21],
                                               block_size=3),
                    world["ours"], None, "test")


# -- the tool, compare and the live evaluator ---------------------------------------------------------

@pytest.mark.e2e
def test_eval_tool_writes_the_selector_figures_and_compares_with_dflash(world, tmp_path: Path, capsys) -> None:
    """eval_drafter on a saved DFlash 2 folder: the loop's cycles, the selector figures (with intervals) and each
    sample's walks in results.json, read back; a comparison with a DFlash drafter's file is a normal one."""
    from tiny_target import train_briefly

    from dflash_cb.common.cli import run
    from dflash_cb.core.drafters.dflash.model import DFlashDrafter
    from dflash_cb.core.replay import evaluate
    from dflash_cb.core.results.compare import compare, render_markdown
    from dflash_cb.core.results.results_file import load_results, report_to_results, write_results
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    cache = world["cache"]
    world["ours"].save_pretrained(tmp_path / "drafter")
    out = tmp_path / "dflash2.json"
    assert run(eval_cli.main, ["--states", str(cache.path), "--drafter", str(tmp_path / "drafter"), "--out", str(out),
                               "--ddtree-budgets", "4", "--dtype", "float32", "--tail-blocks", "reference"]) == 0
    printed = capsys.readouterr().out
    assert "tau with a perfect selector over the candidates" in printed and "the unary argmax, selector off" in printed
    res = load_results(out, cache)
    assert {s.id: s.acceptance_lengths for s in res.samples} == world["runs"][BLOCK][0]
    assert res.family == "dflash2" and json.loads(out.read_text())["version"] == 5
    want = evaluate(cache, world["ours"], budgets=(4,), tail_blocks="reference")
    for key in (*WALKS, SELECTOR_RECALL, SELECTOR_ACC, selector_recall(3), selector_acc(3)):
        assert res.metric(key) == pytest.approx(want.summary[key], rel=1e-12), key
        assert res.metric(key + "_ci_low") <= res.metric(key) <= res.metric(key + "_ci_high"), key
    assert [s.walks for s in res.samples] == [s.walks for s in want.samples]
    assert len(res.per_depth["selector_recall"]) == BLOCK - 1 and "selector" in res.notes
    # Beside a DFlash drafter of the same shape on the same cache: tau compared, the selector rows one-sided.
    cfg = {**world["cfg"], "architectures": ["DFlashDraftModel"],
           "dflash_config": {k: v for k, v in world["cfg"]["dflash_config"].items() if k not in SELECTOR}}
    torch.manual_seed(0)
    one = train_briefly(DFlashDrafter.from_config_dict(cfg), cache, epochs=2)
    write_results(report_to_results(evaluate(cache, one, budgets=(4,), tail_blocks="reference"), cache),
                  tmp_path / "dflash.json")
    c = compare(["dflash", "dflash2"], [load_results(tmp_path / "dflash.json"), res])
    assert TAU in c.differences[(0, 1)] and SELECTOR_UNARY_TAU not in c.differences[(0, 1)]
    md = render_markdown(c)
    row = next(line for line in md.splitlines() if line.startswith("| DFlash 2: tau with the selector off"))
    assert row.split("|")[2].strip() == "n/a" and row.split("|")[3].strip() != "n/a"


@pytest.mark.e2e
def test_plain_loop_logs_the_tools_selector_figures(world, tmp_path: Path) -> None:
    """A plain training loop with a DFlash 2 drafter and the live evaluator (start, step, finish): at every
    evaluated step every logged figure, the selector's among them, is the tool's on that step's weights at the
    same stride; the W&B panels' Selector section is built from keys the run logged."""
    from tool_runs import BUDGETS, PREFIX, assert_step_equals_tool
    from torch.utils.data import DataLoader

    from dflash_cb import LiveEvaluator
    from dflash_cb.core.drafters.dflash2.model import DFlash2Drafter
    from dflash_cb.core.drafters.training import batch_loss
    from dflash_cb.demo.lightning_module import CachedStatesDataset, collate_samples
    from dflash_cb.integrations.tracking.panels import layout_from_keys, panel_plan

    cache = str(world["cache"].path)
    torch.manual_seed(0)
    drafter = DFlash2Drafter.from_config_dict(world["cfg"])
    drafter.load_state_dict(world["ours"].state_dict())
    head = world["cache"].load_head(dtype=torch.float32)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    logged: dict[int, dict[str, float]] = {}

    def collect(metrics: dict[str, float], step: int) -> None:
        if PREFIX + TAU in metrics:
            logged[step] = metrics

    evaluator = LiveEvaluator(cache, every_n_train_steps=2, max_steps=4, ddtree_budgets=BUDGETS, log=collect,
                              console=False)
    step = 0

    def saved() -> None:
        drafter.save_pretrained(tmp_path / f"drafter_{step}")

    if evaluator.start(step, drafter) is not None:
        saved()
    data = DataLoader(CachedStatesDataset(cache), batch_size=2, shuffle=True, collate_fn=collate_samples)
    while step < 4:
        for batch in data:
            loss, _ = batch_loss(drafter, head, batch, anchors_per_sample=8)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if evaluator.step(step, drafter) is not None:
                saved()
            if step == 4:
                break
    if evaluator.finish(step, drafter) is not None:
        saved()
    assert sorted(logged) == [0, 2, 4]
    for s in (0, 2, 4):
        assert PREFIX + SELECTOR_UNARY_TAU in logged[s] and PREFIX + selector_acc(1) in logged[s]
        assert_step_equals_tool(world["cache"].path, tmp_path / f"drafter_{s}", tmp_path / f"r{s}.json", logged[s],
                                s == 4, BLOCK, s, approx=(T1_TAU_ESTIMATE,))
    assert PREFIX + "full/" + SELECTOR_ORACLE_TAU in logged[4]
    keys = set().union(*logged.values())
    layout = layout_from_keys(keys)
    section = panel_plan(layout)["Drafter family"]
    assert layout.family == "dflash2" and section
    # A figure without a value (NaN: a depth no candidate reached) is not logged, but was computed under its name.
    nan = {PREFIX + k for row in evaluator.history for k, v in row.items() if v != v}
    assert {k for spec in section for k in spec.keys} <= keys | nan
