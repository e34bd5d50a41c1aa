"""The anchor-statistics set: per-sample offsets drawn from (seed, sample id, stride), so a strided
figure is an unbiased estimate of the stride-1 one (docs/method.md, "Anchor statistics")."""

from __future__ import annotations

import pytest
import torch

from dflash_cb.core.loop.anchor_sets import anchor_offset, offsets_for, sparse_stride_warning, strided

IDS = [f"prompt-{i:05d}" for i in range(4000)]
# Chi-square critical values at p = 0.001 for stride - 1 degrees of freedom.
CHI2_999 = {2: 10.83, 3: 13.82, 8: 24.32, 16: 37.70}


@pytest.mark.parametrize("stride", sorted(CHI2_999))
def test_offsets_are_uniform_over_samples(stride: int) -> None:
    counts = torch.bincount(torch.tensor([anchor_offset(0, i, stride) for i in IDS]), minlength=stride).double()
    expected = len(IDS) / stride
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert counts.numel() == stride and chi2 < CHI2_999[stride], (counts.tolist(), chi2)


def test_offsets_depend_only_on_seed_sample_and_stride() -> None:
    full = offsets_for(IDS, 8, 3)
    subset = IDS[::-7]  # another selection, in another order (a DDP rank's share, say)
    assert offsets_for(subset, 8, 3) == {i: full[i] for i in subset}
    assert all(anchor_offset(s, i, 1) == 0 for s in (0, 9) for i in IDS[:50])  # stride 1: every anchor
    other = offsets_for(IDS, 8, 4)
    moved = sum(full[i] != other[i] for i in IDS) / len(IDS)
    assert 0.8 < moved < 0.95  # a new seed draws anew: 7 / 8 of the offsets change
    assert offsets_for(IDS[:3], 8, 3, {IDS[0]: 5}) == {IDS[0]: 5, IDS[1]: full[IDS[1]], IDS[2]: full[IDS[2]]}


def test_every_anchor_is_scored_with_the_same_chance() -> None:
    """Over samples (here: the same 10-anchor completion under 4,000 ids) every anchor, the first one
    included, is in the stride-4 set a quarter of the time; starting at the first anchor put it in always."""
    stride, n = 4, 10
    hits = torch.zeros(n)
    for i in IDS:
        hits[list(strided(range(n), stride, anchor_offset(0, i, stride)))] += 1
    share = hits / len(IDS)
    assert torch.allclose(share, torch.full((n,), 1 / stride), atol=0.03), share.tolist()
    assert list(strided(range(n), stride, 0))[0] == 0  # the old set (offset 0) always held the first anchor


def test_a_stride_past_most_completions_warns_naming_it() -> None:
    counts = {"a": 3, "b": 2, "c": 40, "d": 0}
    msg = sparse_stride_warning(counts, 4096, 0, option="--anchor-stride")
    assert msg is not None and msg.startswith("--anchor-stride 4096: 3 of 3 samples have at most 4096 anchors")
    kept = sum(len(strided(range(n), 4096, anchor_offset(0, i, 4096))) for i, n in counts.items())
    assert f"rest on {kept} anchors in all" in msg
    assert sparse_stride_warning(counts, 5, 0) is not None  # a and b of a, b, c: most samples
    assert sparse_stride_warning(counts, 2, 0) is None  # only b
    assert sparse_stride_warning(counts, 1, 0) is None


def test_strided_figure_estimates_the_stride_1_figure_where_the_first_anchor_biased_it(tiny_cache, trained_tiny_drafter):
    """A trained drafter on the tiny cache, stride 4. Per sample and per offset the engine's counts give the
    strided figure for any draw of offsets. Averaged over 400 seeds, the numerator and denominator of
    ``all_anchor_tau`` are the stride-1 ones over 4, and the figure is the stride-1 figure within a few
    thousandths; the old set (every sample at offset 0, its first anchor in) is far off."""

    from dflash_cb.cache.states import StateCache
    from dflash_cb.core.figures.metrics import ALL_ANCHOR_TAU
    from dflash_cb.core.replay import evaluate

    stride = 4
    cache = StateCache(tiny_cache)
    drafter = trained_tiny_drafter()
    ids = [e.id for e in cache.samples]
    every = evaluate(cache, drafter, budgets=(), anchor_stride=1)
    per_offset = [{s.id: s.anchor_counts[stride] for s in evaluate(cache, drafter, budgets=(), anchor_stride=stride,
                                                                  anchor_offsets=dict.fromkeys(ids, o)).samples}
                  for o in range(stride)]
    num, den = every.counts.data["anchor_produced"].item(), every.counts.data["anchors"].item()
    exact = every.summary[ALL_ANCHOR_TAU]

    def figure(offsets: dict[str, int]) -> tuple[int, int]:
        picked = [per_offset[offsets[i]][i] for i in ids]
        return sum(c.anchor_produced for c in picked), sum(c.anchors for c in picked)

    draws = [figure(offsets_for(ids, stride, seed)) for seed in range(400)]
    mean_num = sum(n for n, _ in draws) / len(draws)
    mean_den = sum(d for _, d in draws) / len(draws)
    assert mean_num == pytest.approx(num / stride, rel=0.02) and mean_den == pytest.approx(den / stride, rel=0.02)
    new = sum(n / d for n, d in draws) / len(draws)
    old_num, old_den = figure(dict.fromkeys(ids, 0))
    old = old_num / old_den
    print(f"stride 1 {exact:.4f}  new (mean over seeds) {new:.4f}  old (offset 0) {old:.4f}")
    assert abs(new - exact) < 0.25 * abs(old - exact)
