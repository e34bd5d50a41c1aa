"""The evaluation loop: a drafter fitted once (``fit``), its samples in waves (``plan``), every walk advanced
round by round (``walks``), what the walks need drafted and scored (``scoring``), then summed (``report``).
The method, and why the replay is exact: docs/method.md.

What a drafter's hidden states draft is its family's ``proposers.Proposer`` (``DrafterFamily.proposer``):
DFlash's head argmax, DFlash 2's selector given the target's own predecessor (docs/method.md, "DFlash 2"); the
engine reads hidden rows, hands them to it, and walks what it answers. A family may add walks of its own and
per-depth statistics (``Proposer.walks``, ``Proposer.depth_counts``).

The replays (the greedy walk, one walk per DDTree budget and the family's own walks, for every sample)
advance in rounds. Each round collects the anchors that the live walks need next, plus, in the first round,
the fixed anchor-statistics set (per sample every ``anchor_stride``-th anchor from a drawn offset,
``anchor_sets``; the union over the extra strides); each distinct (sample, anchor) is drafted once and its
per-walk ``produced`` values are kept, so a walk that lands on an anchor drafted earlier (by another walk or
for the statistics) reuses it. The statistics are kept per anchor and summed per sample and stride when the
sample is done, so the counts are per-sample integers summed in sample order. ``specforge/acc`` drafts its
anchors again only where SpecForge's drafts differ from the served ones (its masks, or a shortened tail
block). When the drafts so far say a walk almost always advances by one token (tau ~ 1), the round also
drafts the next few anchors that walk will need with high probability (``walks.lookahead_cap``), so a weak
drafter does not cost one round per cycle.

The samples evaluated together (a *wave*, ``wave.Wave``) are flat tables: their tokens end to end, one slot
per anchor, every walk as a row of tensors (``walks.Walks``), so a round costs a few tensor operations
whatever the number of samples. The context K/V of a wave is projected in a few batched matmuls. Within a
round the token-wise work (projections, MLP, norms, the output head and its argmax / top-K reduction) runs on
the blocks of all samples together, and attention on parts of several samples per kernel call, each block
over its own sample's context prefix. The head is applied in row chunks and reduced on the fly, so
``[blocks x depth x vocab]`` logits never exist. The last drafter layer stops after its attention
(``dflash.model.DeferredBlocks``): its ``o_proj``, MLP and the final norm are token-wise, so they run, with
the head, only on the block positions that are read. No Lightning, W&B or HTTP here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...cache.states import StateCache, TargetHead
from ...common.timing import NO_TIMER, PhaseTimer
from ..drafters.proposers import apply_head
from ..drafters.runners import as_runner
from ..loop.anchor_sets import offsets_for
from ..loop.finite import check_finite_weights
from .fit import FittedDrafter, check_tree_support, fit_drafter, specforge_pass
from .phases import LOAD, PHASE_GROUPS, PHASES, STATISTICS, WALK, group_seconds
from .plan import Plan, anchor_count, anchors_per_sample, bounds_for, split_waves, stats_anchors
from .precision import AUTOCAST_NAMES, autocast_context, resolve_autocast
from .report import SPECFORGE_LEFT_OUT, SPECFORGE_OWN_PASS, EvalReport, SampleResult, summed_counts
from .request import EvalRequest, SpecForgePass
from .scoring import Scorer, expected_accepted
from .walks import lookahead_cap
from .wave import load_wave

# What this module gave before the replay was cut into its phases' modules: importable from here for a release.
__all__ = ["AUTOCAST_NAMES", "PHASES", "PHASE_GROUPS", "SPECFORGE_LEFT_OUT", "SPECFORGE_OWN_PASS", "EvalReport",
           "FittedDrafter", "SampleResult", "anchor_count", "anchors_per_sample", "apply_head", "autocast_context",
           "bounds_for", "check_tree_support", "evaluate", "expected_accepted", "fit_drafter", "group_seconds",
           "resolve_autocast", "specforge_pass", "stats_anchors", "summed_counts"]


def evaluate(cache: StateCache, drafter: Any, head: TargetHead | None = None, request: EvalRequest | None = None, *,
             fit: FittedDrafter | None = None, progress: bool = False, timer: PhaseTimer | None = None,
             **options: Any) -> EvalReport:
    """Score ``drafter`` on ``cache``: exact greedy replay, DDTree per budget, anchor statistics.

    What to compute is an ``EvalRequest`` (``request``; keyword ``options`` replace its fields, so
    ``evaluate(cache, drafter, budgets=(16,), anchor_stride=8)`` reads as before). Its fields:

    ``anchor_stride`` picks the anchor-statistics set (per-depth acceptance, ``specforge/acc``,
    ``all_anchor_tau``, the chain and temperature-1 estimates): per sample ``anchors[o::anchor_stride]``
    with an offset ``o = anchor_sets.anchor_offset(anchor_seed, sample id, anchor_stride)`` in
    ``[0, anchor_stride)``, the same at every evaluation whatever else is evaluated with it; 1 = every
    anchor. ``anchor_offsets`` ({sample id: offset}) replaces the drawn offsets of the samples it names
    (others keep theirs). ``extra_anchor_strides``: more statistics sets from the same pass (each with its
    own drawn offsets; what is drafted is the union); ``EvalReport.counts_at(stride)`` gives their counts.
    The replays are exact whatever the strides. ``specforge/acc`` is SpecForge 0.2.0's accuracy: when
    its training masks differ from the served ones (``DrafterFamily.specforge_difference``), the statistics
    anchors are drafted once more under its masks (``EvalReport.specforge_note``). ``head`` defaults to
    the cache's exported target head. ``autocast_dtype`` (e.g. bfloat16 on GPU) trades exactness for
    speed; exactness tests use float32. ``keep_drafts`` > 0 keeps, per sample, the draft blocks of that
    many first cycles (``SampleResult.drafts``).
    ``tail_blocks`` (``replay.TAIL_BLOCKS``): "served" drafts full blocks up to the end, as SGLang;
    "reference" shortens the last blocks, as ``dflash_generate`` (docs/method.md, "Tail blocks").
    ``block_size`` (``replay.check_block_size``: 2 .. the drafter's, a chain drafter's up to its family's
    ``block_cap``; None = the drafter's) is the block
    every cycle drafts, as a server started with a smaller block does; the tail rules and the
    per-depth statistics follow it (``EvalReport.block_size``). ``draft_all``: the first round drafts every
    anchor, as stride 1 does, whatever the statistics stride: one round instead of one per cycle, cheaper when
    the walks would draft most anchors anyway (a weak drafter) or a pass costs more than the blocks it
    spares (few samples; ``costs.evaluation.draft_all_is_cheaper`` decides for the live evaluator). Only what is drafted
    changes, never a figure. ``timer`` (``common.timing.PhaseTimer``) collects the seconds of each phase
    (``PHASES``); ``progress`` shows a progress bar over the samples.

    ``fit`` (``fit.fit_drafter``): the drafter as checked against the cache already, for a caller that
    evaluates one drafter many times (the live evaluator); without it, or when it does not cover this request
    (another block, budgets it did not check), the drafter is fitted here.

    The head runs in its own dtype: a head loaded here (``head`` None) is read in the compute dtype
    (``autocast_dtype``, else the drafter's), so a bf16 evaluation never holds a float32 head; a
    given head is used as it is (``EvalReport.head_dtype`` says which).

    Memory model (``limits``, a ``limits.MemoryLimits``; ``costs.evaluation.memory_bound`` computes it; the README's
    memory section gives the figures), for the Qwen3.6-27B drafter in bf16 (5 layers, hidden 5120,
    vocabulary 248,320, block 16):

    - drafter weights: 1.73 B parameters, 3.5 GB;
    - target embedding + output head, in the compute dtype: 2 x 248,320 x 5,120 x 2 bytes = 5.1 GB
      (2.5 GB when tied);
    - context K/V, 5 layers x 2 x 8 KV heads x 128 x 2 bytes = 20 KiB per position: 42 MB per
      2,048-token sample, 2.7 GB for 64; samples are evaluated in waves whose K/V fit
      ``limits.context_bytes`` together (4 GiB default: 64 such samples are one wave); their features are
      projected in batches under ``limits.attn_bytes``;
    - bounded buffers: a round drafts at most ``limits.max_blocks`` blocks per pass (token-wise activations
      ~ ``max_blocks`` x block_size x (3 x intermediate + 4 x hidden): 2.4 GB at 1,024 blocks in bf16); attention
      temporaries stay under ``limits.attn_bytes`` per call, and every vocabulary-sized tensor (the
      head's logits, greedy and statistics rows alike) under ``limits.head_bytes``;
    - a DFlash 2 drafter adds its selector's codebooks (2 x vocabulary x rank in the weights' dtype: 254 MB
      at 248,320 x 256 in bf16) and, with DDTree budgets, the lattice of a pass (``costs.evaluation.memory_bound``).

    A DFlash 2 drafter (``DrafterSpec.family``) is scored by its selector (docs/method.md, "DFlash 2"): the
    replays, the DDTree taus (over the selector's lattice) and the per-depth acceptance score the selector's
    drafts; ``specforge/acc`` the unary argmax; ``selector/...`` says where tau is lost (docs/metrics.md).
    """
    start = time.perf_counter()
    timer = timer if timer is not None else NO_TIMER
    req = EvalRequest.of(request, options)
    limits, budgets = req.limits, req.budgets
    runner = as_runner(drafter, req.spec, limits)
    spec = runner.spec
    if fit is None or not fit.covers(spec, req.block_size, budgets):
        fit = fit_drafter(cache, drafter, block_size=req.block_size, budgets=budgets, limits=limits, runner=runner)
    if isinstance(drafter, torch.nn.Module):  # NaN weights would still get a tau (the argmax of NaN is a token)
        check_finite_weights(drafter.named_parameters(), f"the drafter ({type(drafter).__name__})")
    block, specforge, note = fit.block_size, fit.specforge, fit.specforge_note
    drafting_spec = fit.drafting_spec  # what the cycles draft; the report keeps spec
    device = req.device
    if device is None:
        device = runner.device
    with timer.phase(LOAD):
        if head is None:
            head = cache.load_head(device=device, dtype=req.autocast_dtype or runner.dtype)
        elif head.embed_tokens.device != device:
            head = head.to(device)
    ids = list(req.sample_ids) if req.sample_ids is not None else [s.id for s in cache.samples]
    categories = cache.categories
    manifest = cache.manifest
    strides = req.strides
    offsets = {s: offsets_for(ids, s, req.anchor_seed, req.anchor_offsets if s == req.anchor_stride else None)
               for s in strides}
    # The family's proposer: what the drafter's hidden states draft, and the family's own walks and statistics.
    proposer = fit.family.proposer(drafting_spec, runner.module, head.lm_head, limits.head_bytes, head.embed_tokens)
    plan = Plan(strides, offsets, budgets, proposer.walks, proposer.depth_counts, block - 1, req.keep_drafts > 0,
                req.draft_all, tuple(manifest.stop_token_ids), device, req.verify)
    scorer = Scorer(runner, head, drafting_spec, proposer, budgets, limits.head_bytes, req.tail_blocks, specforge,
                    req.keep_drafts > 0, timer)
    state_dtype = req.autocast_dtype or runner.dtype
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="evaluating", unit="sample")
    results: dict[str, SampleResult] = {}
    passes = 0
    with torch.no_grad(), autocast_context(device, req.autocast_dtype):
        for wave_ids in split_waves(cache, ids, runner, state_dtype, limits.context_bytes):
            wave = load_wave(cache, wave_ids, runner, plan, timer, head.embed_tokens)
            first = True
            while True:
                with timer.phase(WALK):
                    wave.walks.advance(lookahead_cap(block))
                    slots = wave.requests(first)
                first = False
                if not slots.numel():
                    break
                for i in range(0, slots.numel(), limits.max_blocks):
                    chunk = slots[i:i + limits.max_blocks]
                    scored = scorer.score(wave, chunk)
                    passes += 1
                    with timer.phase(WALK):
                        wave.record(chunk, scored)
            with timer.phase(STATISTICS):
                for r in wave.results(budgets, req.keep_drafts, block, specforge is not SpecForgePass.LEFT_OUT):
                    results[r.id] = r
            del wave  # the context K/V of this wave can go
            if bar is not None:
                bar.update(len(wave_ids))
    if bar is not None:
        bar.close()
    samples = [results[sid] for sid in ids]
    with timer.phase(STATISTICS):
        # In sample order, from per-sample integers: the counts do not depend on waves, rounds or ranks.
        counts = summed_counts(samples, block, budgets, categories, req.anchor_stride, spec.family)
    return EvalReport(counts, samples, time.perf_counter() - start, spec, budgets, req.anchor_stride, req.tail_blocks,
                      str(head.lm_head.dtype).removeprefix("torch."), req.anchor_seed, strides[1:], note, passes,
                      req.series(block_size=block), fit.family)
