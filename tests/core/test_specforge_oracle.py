"""A second oracle: SpecForge 0.2.0's own DFlash objective and evaluator give our ``specforge/acc``.

SpecForge's DFlash training (``OnlineDFlashModel`` behind ``DFlashTrainStrategy``) reports one
accuracy, argmax matches over weights across every (anchor, depth >= 1) block position whose label
is a supervised token; its ``Evaluator`` sums those numerators and denominators over the eval set
into ``eval/avg_acc`` (= ``eval/simulated_acc_len`` for DFlash). Here it runs with our drafter's
weights on our cached target states (loss mask = the completion up to ``valid_len``) and must give
our ``specforge/acc`` and our per-depth ``acceptance/depth_KK``, integer counts equal.

Anchors: SpecForge samples ``min(num_anchors, candidates)`` anchors at random among the positions
whose token and next token are supervised. With ``num_anchors`` at least the sequence length every
candidate is taken (the random draw only orders them, and they are sorted), so its anchor set is
every completion position but the last: our statistics set at stride 1.

Blocks: SpecForge always drafts a full ``block_size`` block; our replay (like ``dflash_generate``)
shortens the block of an anchor within ``block_size`` of the loop's end. A causal (sliding-window)
layer does not see later block positions, so the two coincide at every anchor for a drafter whose
layers are all ``sliding_attention``: that one runs on the shared tiny cache, samples reaching
``max_new_tokens`` included. A drafter with a full-attention (bidirectional) layer runs on a cache
whose samples end at a stop token at least ``block_size`` tokens before ``max_new_tokens``, where
every statistics anchor has a full block in both.

Per-depth counts come from SpecForge's own objective: its per-chunk term function is wrapped to
also count, per block position, the same matches over the same weights it sums.

Masks: SpecForge's training mask windows a sliding layer over the context keys only (inside the
block it is causal, not windowed) and ignores ``is_causal``; the served drafter (and our replay)
windows the block too and honours ``is_causal``. Where the two differ (a window shorter than the
block, ``is_causal`` set) our ``specforge/acc`` comes from a pass of its own under SpecForge's masks,
and must still equal SpecForge's figure, while the per-depth ``acceptance/*`` keep the served masks.
The same holds for ``tail_blocks="reference"``, whose shortened tail blocks SpecForge never drafts.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from oracles import require

sf_model = require("specforge.algorithms.common.dflash_family_model")  # a missing oracle fails, never skips
from specforge.eval.evaluator import Evaluator  # noqa: E402
from specforge.training.strategies.base import DFlashTrainStrategy  # noqa: E402
from specforge_objective import dflash_objective  # noqa: E402

from dflash_cb.core.figures.metrics import SPECFORGE_ACC, depth_acc  # noqa: E402
from dflash_cb.integrations.loops.specforge_data import train_batches  # noqa: E402

BLOCK = 6
LAYERS = [0, 2]


class _CountingObjective(sf_model.OnlineDFlashModel):
    """SpecForge's DFlash objective, also keeping its per-position matches and weights (test only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.match = torch.zeros(self.block_size, dtype=torch.float64)
        self.weight = torch.zeros(self.block_size, dtype=torch.float64)

    def _dflash_objective_chunk_terms(self, hidden, target_ids, weight_mask):
        terms = super()._dflash_objective_chunk_terms(hidden, target_ids, weight_mask)
        with torch.no_grad():
            b, n, bs, h = hidden.shape
            pred = self.lm_head(hidden.reshape(b, n * bs, h)).reshape(b, n, bs, -1).argmax(-1)
            self.match += ((pred == target_ids) & (weight_mask > 0.5)).sum((0, 1)).double()
            self.weight += weight_mask.sum((0, 1)).double()
        return terms


def _drafter_config(vocab: int, hidden: int, target_layers: int, mask: int, layer_types: list[str],
                    block: int = BLOCK, window: int = 7, **extra) -> dict:
    from dflash_cb.demo.lightning_module import tiny_drafter_config

    cfg = tiny_drafter_config(vocab, hidden, target_layers, LAYERS, mask, block_size=block, num_layers=len(layer_types))
    # A window shorter than the contexts, so the sliding rule matters.
    cfg.update(layer_types=layer_types, sliding_window=window, use_sliding_window=True, **extra)
    return cfg


def _specforge(cache, drafter, cfg: dict, ids: list[str]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """SpecForge's evaluator over one batch per cached sample; returns its metrics and per-position counts."""
    longest = max(cache.entry(i).total_len for i in ids)
    model = dflash_objective(cfg, drafter.state_dict(), cache.load_head(), longest, _CountingObjective)
    # The loss mask: the completion on the target's greedy path (specforge_data.sample_features).
    metrics = Evaluator().run(DFlashTrainStrategy(model).forward_loss, train_batches(cache, ids))
    return metrics, model.match, model.weight


def _check_parity(cache, drafter, cfg: dict, ids: list[str], tail_blocks: str = "served") -> dict:
    """Our ``specforge/acc`` and its per-position counts equal SpecForge's; the per-depth acceptance equals
    them too exactly when the served masks and blocks are SpecForge's."""
    from dflash_cb.core.replay import evaluate

    block = cfg["block_size"]
    report = evaluate(cache, drafter, sample_ids=ids, budgets=[], anchor_stride=1, tail_blocks=tail_blocks)
    ours = report.summary
    theirs, match, weight = _specforge(cache, drafter, cfg, ids)
    d = report.counts.data
    # Position 0 of a block is the anchor, never scored; positions 1..B-1 are our depths 1..B-1.
    assert weight[0] == 0
    assert d["specforge_total"].tolist() == weight[1:].tolist() == d["depth_total"].tolist()
    assert d["specforge_match"].tolist() == match[1:].tolist()
    assert ours[SPECFORGE_ACC] == pytest.approx(theirs["eval/avg_acc"], abs=1e-12)
    assert ours[SPECFORGE_ACC] == pytest.approx(theirs["eval/simulated_acc_len"], abs=1e-12)
    assert 0.05 < ours[SPECFORGE_ACC] < 0.95  # partial acceptance: the comparison carries information
    same = drafter.specforge_difference() is None
    assert (report.specforge_note == "") == same
    if same and tail_blocks == "served":
        for k in range(1, block):
            assert ours[depth_acc(k)] == pytest.approx((match[k] / weight[k]).item(), abs=1e-15)
    return {"ours": ours[SPECFORGE_ACC], "specforge": theirs["eval/avg_acc"],
            "served_pooled": d["depth_match"].sum().item() / d["depth_total"].sum().item(),
            "matches": int(d["specforge_match"].sum()), "weights": int(d["specforge_total"].sum()),
            "per_depth": [ours[depth_acc(k)] for k in range(1, block)], "note": report.specforge_note}


def _trained(cfg: dict, cache):
    from tiny_target import train_briefly

    from dflash_cb.core.drafters.dflash.model import DFlashDrafter

    torch.manual_seed(0)
    return train_briefly(DFlashDrafter.from_config_dict(cfg), cache)


@pytest.mark.parametrize(("block", "window"), [(BLOCK, 7), (8, 3)])
def test_sliding_window_drafter_matches_specforge_on_every_anchor(tiny_cache, block: int, window: int):
    """A window of 7 with block 6 (the masks agree) and of 3 with block 8 (served, the window also covers the
    block; SpecForge's does not): our specforge/acc is SpecForge's in both. With window 3 the served drafts
    score differently from SpecForge's: the per-depth figures keep the served ones."""
    from tiny_target import TINY_MASK

    from dflash_cb.cache.states import StateCache

    cache = StateCache(tiny_cache)
    m = cache.manifest
    assert all(e.total_len == e.prompt_len + m.max_new_tokens for e in cache.samples)  # tail anchors are in the set
    cfg = _drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_MASK,
                          ["sliding_attention", "sliding_attention"], block=block, window=window)
    got = _check_parity(cache, _trained(cfg, cache), cfg, [e.id for e in cache.samples])
    print(got)
    assert ("sliding_window" in got["note"]) == (window < block)
    if window < block:
        assert abs(got["served_pooled"] - got["specforge"]) > 0.005


def test_bidirectional_drafter_with_reference_tail_blocks_matches_specforge(tmp_path_factory):
    """Shortened tail blocks (``tail_blocks="reference"``) change a bidirectional layer's drafts; SpecForge
    drafts those anchors in full, and so does our specforge/acc. Short completions: most anchors are tail ones."""
    from tiny_target import TINY_MASK, build_tiny_cache

    from dflash_cb.cache.states import StateCache

    cache = StateCache(build_tiny_cache(tmp_path_factory.mktemp("short"), n_prompts=12, max_new_tokens=10))
    m = cache.manifest
    cfg = _drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_MASK,
                          ["full_attention", "sliding_attention"])
    got = _check_parity(cache, _trained(cfg, cache), cfg, [e.id for e in cache.samples], tail_blocks="reference")
    print(got)
    assert got["served_pooled"] != got["specforge"]  # the shortened blocks did change matches


@pytest.fixture(scope="module")
def stopping_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache whose completions mostly end at a stop token well before ``max_new_tokens``: the token found
    early in the most greedy completions of the tiny target is made the stop token."""
    from tiny_target import build_tiny_cache

    from dflash_cb.cache.precompute import PrecomputeArgs, run_precompute
    from dflash_cb.cache.states import StateCache

    root = tmp_path_factory.mktemp("stopping")
    first = StateCache(build_tiny_cache(root, n_prompts=12, max_new_tokens=48))
    early = Counter()
    for e in first.samples:
        early.update(set(first.load(e.id).input_ids[e.prompt_len + 2:e.prompt_len + 20].tolist()))
    stop = early.most_common(1)[0][0]
    out = root / "cache_stop"
    run_precompute(PrecomputeArgs(target=str(root / "target"), prompts=str(root / "prompts.jsonl"), out=str(out),
                                  layers=LAYERS, reference="local", dtype="float32", max_new_tokens=48,
                                  stop_token_ids=[stop], progress=False))
    return out


def test_bidirectional_drafter_matches_specforge_where_blocks_are_full(stopping_cache):
    from tiny_target import TINY_MASK

    from dflash_cb.cache.states import StateCache

    cache = StateCache(stopping_cache)
    m = cache.manifest
    # The samples that stopped early enough that each statistics anchor has a full block in the replay too.
    ids = [e.id for e in cache.samples if e.total_len + BLOCK - 2 <= e.prompt_len + m.max_new_tokens]
    assert len(ids) >= 3, [(e.prompt_len, e.total_len) for e in cache.samples]
    cfg = _drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_MASK,
                          ["full_attention", "sliding_attention"])
    print(_check_parity(cache, _trained(cfg, cache), cfg, ids))


def test_is_causal_drafter_matches_specforge(stopping_cache):
    """``is_causal`` true makes the served full-attention layer causal; SpecForge ignores it (bidirectional)."""
    from tiny_target import TINY_MASK

    from dflash_cb.cache.states import StateCache

    cache = StateCache(stopping_cache)
    m = cache.manifest
    ids = [e.id for e in cache.samples if e.total_len + BLOCK - 2 <= e.prompt_len + m.max_new_tokens]
    cfg = _drafter_config(m.vocab_size, m.hidden_size, int(m.target["num_layers"]), TINY_MASK,
                          ["full_attention", "sliding_attention"], is_causal=True)
    got = _check_parity(cache, _trained(cfg, cache), cfg, ids)
    print(got)
    assert "is_causal True" in got["note"] and got["served_pooled"] != got["specforge"]
