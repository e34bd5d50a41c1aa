"""One evaluation batched many ways: the figures of each (``figures``), in this process or, run as a script,
in a fresh one whose CPU kernels the environment chose (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``, the thread count): prints ``{"capability": ..., "threads": ..., "figures": ...}``.

The batchings take different matrix-kernel paths on purpose: every anchor at once (many rows), round by
round, one block a pass, three and seven blocks a pass (odd counts), one head row a call, one sample at a
time (each merged into the first), one sample a wave.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from dflash_cb.cache.states import StateCache
from dflash_cb.core.costs.evaluation import MemoryLimits
from dflash_cb.core.figures.metrics import summarize
from dflash_cb.core.replay import engine, scoring

BUDGETS = (3, 8)
STRIDE = 2


def figures(cache: StateCache, drafter: Any) -> dict[str, dict[str, float]]:
    """{batching: summary}; ``anchors_drafted`` is what batchings legitimately change (drafting ahead)."""
    run = dict(budgets=BUDGETS, anchor_stride=STRIDE)
    vocab_row = cache.manifest.vocab_size * 4
    ways = {
        "round_by_round": dict(draft_all=False),
        "all_at_once": dict(draft_all=True),
        "one_block_a_pass": dict(limits=MemoryLimits(max_blocks=1, attn_bytes=1)),
        "three_blocks_a_pass": dict(limits=MemoryLimits(max_blocks=3, context_bytes=1)),
        "seven_blocks_one_head_row": dict(limits=MemoryLimits(max_blocks=7, head_bytes=vocab_row)),
    }
    out = {name: engine.evaluate(cache, drafter, **run, **kw).summary for name, kw in ways.items()}
    rows = scoring._HEAD_ROWS
    try:
        scoring._HEAD_ROWS = 1  # the greedy head one row a call
        out["one_row_a_head_call"] = engine.evaluate(cache, drafter, **run).summary
    finally:
        scoring._HEAD_ROWS = rows
    alone = [engine.evaluate(cache, drafter, **run, sample_ids=[e.id]).counts for e in cache.samples]
    for c in alone[1:]:
        alone[0].merge_(c)
    out["one_sample_at_a_time"] = summarize(alone[0])
    for s in out.values():
        s.pop("anchors_drafted", None)
    return out


if __name__ == "__main__":
    from dflash_cb.core.checkpoints.load import load_drafter

    with torch.no_grad():
        found = figures(StateCache(sys.argv[1]), load_drafter(sys.argv[2]).eval())
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                      "figures": found}))
