"""Which anchors the anchor statistics score: one offset per sample, then every ``stride``-th anchor.

With ``anchor_stride = s`` a sample's statistics set is ``anchors[o::s]`` for an offset ``o`` in
``[0, s)``. Starting every sample at its first anchor (``o = 0``) would put the hardest anchor
(the drafter has seen none of the completion yet) in every set and weigh it ``s`` times its share.
So ``o`` is drawn uniformly per sample, from a hash of (seed, stride, sample id): every anchor then
has the same chance ``1 / s`` to be scored, and summing a statistic's counts over the ``s`` offsets
gives the stride-1 counts (docs/method.md, "Anchor statistics").

The offset is a pure function of those three values: it does not depend on which samples are
evaluated together, on how they are split over DDP ranks, or on the evaluation, so successive
evaluations of a run score the same anchors and their series stay comparable. Pure; no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from ...common import arguments as check

DEFAULT_ANCHOR_SEED = 0


def anchor_offset(seed: int, sample_id: str, stride: int) -> int:
    """The sample's statistics offset in ``[0, stride)`` (0 at stride 1), uniform over seeds and samples."""
    if stride == 1:
        return 0
    digest = hashlib.sha256(f"dflash-cb anchor offset\0{seed}\0{stride}\0{sample_id}".encode()).digest()
    # 64 bits modulo a small stride: the bias is below 2**-50.
    return int.from_bytes(digest[:8], "big") % stride


def strided(anchors: range, stride: int, offset: int) -> range:
    """The statistics set of one sample: ``anchors[offset::stride]``."""
    return anchors[offset::stride]


def offsets_for(ids: list[str], stride: int, seed: int, overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """Each sample's offset: ``overrides[id]`` where given, else ``anchor_offset(seed, id, stride)``."""
    given = overrides or {}
    return {i: given[i] if i in given else anchor_offset(seed, i, stride) for i in ids}


def check_anchor_offsets(name: str, offsets: Mapping[str, int] | None, stride: int) -> dict[str, int] | None:
    """``offsets`` ({sample id: offset}) with every offset an int in ``[0, stride)``."""
    if offsets is None:
        return None
    if not isinstance(offsets, Mapping):
        raise check.ArgumentError(f"{name}={offsets!r}: expected a mapping of sample id to offset in [0, {stride})")
    bad = {k: v for k, v in offsets.items() if not check.is_int(v) or not 0 <= v < stride}
    if bad:
        k, v = next(iter(bad.items()))
        raise check.ArgumentError(f"{name}[{k!r}]={v!r}: expected an integer in [0, {stride}) (the anchor stride); "
                                  f"{len(bad)} offset(s) out of range")
    return {str(k): int(v) for k, v in offsets.items()}


def sparse_stride_warning(anchor_counts: Mapping[str, int], stride: int, seed: int,
                          overrides: Mapping[str, int] | None = None, option: str = "anchor stride") -> str | None:
    """A one-line warning when ``stride`` reaches past most completions, else None.

    ``anchor_counts``: each evaluated sample's number of anchors (``engine.anchors_per_sample``). A
    sample with at most ``stride`` anchors keeps at most one statistics anchor (none when its offset
    falls past its last anchor). The figures stay unbiased (every anchor has the same chance
    ``1 / stride`` to be scored) but rest on few anchors, and their intervals say how few. So this is a
    warning, not a refusal, and only when more than half of the samples that have an anchor are such
    samples: a few short completions under the usual stride are normal and cost little precision.
    """
    if stride <= 1:
        return None
    with_anchors = {i: n for i, n in anchor_counts.items() if n > 0}  # a sample without anchors has none to lose
    short = [i for i, n in with_anchors.items() if n <= stride]
    if 2 * len(short) <= len(with_anchors):
        return None
    offsets = offsets_for(list(with_anchors), stride, seed, overrides)
    kept = {i: len(strided(range(n), stride, offsets[i])) for i, n in with_anchors.items()}
    none = sum(1 for i in short if kept[i] == 0)
    return (f"{option} {stride}: {len(short)} of {len(with_anchors)} samples have at most {stride} anchors, so each "
            f"keeps at most one statistics anchor ({none} keep none); the anchor statistics (acceptance/*, "
            f"specforge/acc, all_anchor_tau) rest on {sum(kept.values())} anchors in all: unbiased, but see their "
            "intervals, or use a smaller stride")
