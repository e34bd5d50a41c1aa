"""DDTree against a plain, obviously-correct heap implementation written here."""

from __future__ import annotations

import pytest
import torch
from ddtree_reference import reference_tree_accept

from dflash_cb.core.loop.ddtree import ddtree_accepted


@pytest.mark.parametrize("seed,quantize", [(0, False), (1, True), (2, True)])
def test_ddtree_matches_heap_reference(seed: int, quantize: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    a, d, k, vocab = 64, 7, 12, 20
    logits = torch.randn(a, d, vocab, generator=g) * 2
    if quantize:  # coarse values force exact score ties, the hard case for tie-breaking
        logits = torch.round(logits)
    lp = torch.log_softmax(logits, -1)
    top_lp, top_ids = torch.topk(lp, k, dim=-1)
    depths = torch.randint(1, d + 1, (a,), generator=g)
    # Targets mostly follow high-ranked tokens so paths go deep.
    pick = torch.randint(0, 4, (a, d), generator=g)
    target = top_ids.gather(-1, pick[..., None])[..., 0]
    target[torch.rand(a, d, generator=g) < 0.1] = -1
    out = ddtree_accepted(top_ids, top_lp, depths, target, max_budget=k)
    for i in range(a):
        ids_l = top_ids[i].tolist()
        lp_l = top_lp[i].double().tolist()
        for b in (1, 2, 5, 8, k):
            want = reference_tree_accept(ids_l, lp_l, int(depths[i]), target[i].tolist(), b)
            assert out[i, b - 1].item() == want, (i, b)


def test_ddtree_budget_one_is_greedy_depth_one() -> None:
    ids = torch.tensor([[[3, 4], [5, 6]]])
    lp = torch.log(torch.tensor([[[0.9, 0.1], [0.8, 0.2]]]))
    # Budget 1 holds only the rank-0 token at depth 1; budget 2 adds its child (score .72 > .1).
    out = ddtree_accepted(ids, lp, torch.tensor([2]), torch.tensor([[3, 5]]), max_budget=3)
    assert out[0].tolist() == [1, 2, 2]
    # The rank-1 depth-1 sibling (0.1) comes fourth, after the child (0.72) and its sibling (0.18).
    out = ddtree_accepted(ids, lp, torch.tensor([2]), torch.tensor([[4, 5]]), max_budget=4)
    assert out[0].tolist() == [0, 0, 0, 1]
