"""Acceptance metrics: summable counts and the one place metric names are defined.

Every ratio is computed from counts summed over samples (and over ranks under DDP) *before*
dividing, so the numbers do not depend on how samples were split into batches or processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ...cache.served import spec_accept_length
from ...common.arguments import SERVED_BASELINE_NAME
from ..drafters.base import FamilyFigures
from ..drafters.registry import families, family_named
from ..drafters.spec import DEFAULT_FAMILY

# The live evaluation's default name prefix (``{prefix}tau``); every default in the package is this one.
DEFAULT_PREFIX = "dflash_eval/"
# Metric names (logged as ``prefix + name``; the glossary in README.md defines each one).
TAU = "tau"
CYCLES = "cycles"
TOKENS = "committed_tokens"
SAMPLES = "samples"
ALL_ANCHOR_TAU = "all_anchor_tau"
# 1 + sum_k prod_{j<=k} acceptance/depth_j: a chain of independent depths; no peer logs this for DFlash.
CHAIN_TAU_ESTIMATE = "chain_tau_estimate"
# SpecForge 0.2.0's DFlash accuracy (train/acc, eval/avg_acc, eval/simulated_acc_len) on the statistics set.
SPECFORGE_ACC = "specforge/acc"
# Per-request conventions of published tables (docs/method.md, "Conventions"): means over samples of
# ``sample_tau`` / ``sample_accept_length_served``, computed from the per-sample lengths in sample order
# (``bootstrap.request_means``) rather than from summed counts: a float sum over ranks would depend on
# the split in its last bits.
TAU_REQUEST_MEAN = "tau_request_mean"
ACCEPT_LENGTH_SERVED = "accept_length_served"
T1_TAU_ESTIMATE = "t1_tau_estimate"
# The temperature-1 estimate is the one float figure summed over anchors. Each anchor's value is rounded to a
# multiple of T1_QUANTUM, so every partial sum below 2**53 * T1_QUANTUM (5e8; 3e7 anchors of a 16-block) is
# exact in float64: the sum is the same in any order and grouping (samples, waves, ranks, merges).
T1_QUANTUM = 2.0 ** -24
EVAL_TIME = "eval_time_s"
# Evaluation cost: distinct anchors the drafter ran at / the replays and the statistics set needed.
ANCHORS_DRAFTED = "anchors_drafted"
ANCHORS_NEEDED = "anchors_needed"
ANCHOR_STRIDE = "anchor_stride"  # the statistics set's stride (run config and results.json meta)
ANCHOR_SEED = "anchor_seed"  # the seed of the statistics set's per-sample offsets (anchor_sets.anchor_offset)
FAILED_EVALS = "failed_evaluations"  # evaluations that raised so far in this run (callback)
# The evaluation's share of wall time since the previous one ended (callback; dflash_cb.core.costs.evaluation).
EVAL_OVERHEAD = "eval_overhead"
SETUP_TIME = "setup_time_s"  # the callback's setup: cache checks and hashing
# The optimizer step an evaluation measured, logged beside its figures: a checkpoint kept by tau can show
# the step its tau belongs to (``{dflash_eval/step}`` in a ModelCheckpoint filename).
EVAL_STEP = "step"
# The x-axis of every live series in W&B: the optimizer step, whatever the loop (Lightning's own key).
STEP_KEY = "trainer/global_step"


def metric_key(name: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The logged key of a metric: ``metric_key(TAU)`` is ``"dflash_eval/tau"`` (for ``ModelCheckpoint(monitor=...)``,
    ``metric_for_best_model``, a dashboard)."""
    return prefix + name


TAU_KEY = DEFAULT_PREFIX + TAU  # "dflash_eval/tau": the default evaluator's tau


# The first segments of every drafter's metric names below a prefix: a prefix must not end in one
# (``{prefix}full/tau`` of one evaluation would be another's full key). The families add theirs (``key_namespaces``).
KEY_NAMESPACES = ("acceptance", "acceptance_cond", "baseline", "best", "category", "cycle", "ddtree", "full",
                  "position", "predicted", "produced_frac", "published", "serving", "specforge", "charts")


def key_namespaces() -> tuple[str, ...]:
    """``KEY_NAMESPACES`` and the first segments of every registered family's figures (``FamilyFigures.namespaces``)."""
    return tuple(dict.fromkeys((*KEY_NAMESPACES, *(n for f in families() for n in f.figures.namespaces()))))

# The seconds the evaluation was predicted to take before it ran (``costs.evaluation.SecondsPredictor``: calibrated by the
# evaluations measured before it), logged beside its measured ``eval_time_s``.
PREDICTED_SECONDS = "predicted/seconds"


def serving_key(what: str, setting: str | None = None) -> str:
    """A projected serving figure (``core.serving``): ``serving/speedup_greedy``, ``serving/tokens_per_s_ddtree_b64``,
    ``serving/breakeven_tau_greedy``, ``serving/best_speedup``. Projections, never measured speeds."""
    return f"serving/{what}" + (f"_{setting}" if setting else "")


def predicted_anchors(kind: str) -> str:
    """Anchors one ``kind`` ("light" / "full") evaluation is expected to draft (``costs.evaluation.evaluation_cost``)."""
    return f"predicted/{kind}_anchors"


def predicted_gflop(kind: str) -> str:
    return f"predicted/{kind}_gflop"


def ddtree_tau(budget: int) -> str:
    return f"ddtree/tau_b{budget}"


def depth_acc(k: int) -> str:
    return f"acceptance/depth_{k:02d}"


def depth_acc_cond(k: int) -> str:
    return f"acceptance_cond/depth_{k:02d}"


def category_tau(category: str) -> str:
    return f"category/{category}/tau"


def category_tau_request_mean(category: str) -> str:
    """``tau_request_mean`` over one category's requests: a published per-benchmark figure stands beside it."""
    return f"category/{category}/{TAU_REQUEST_MEAN}"


def hist_frac(n: int) -> str:
    return f"produced_frac/{n:02d}"


# -- what a drafter family adds (its folder's ``FamilyFigures``: core/drafters/<family>/) ---------------------

def family_figures(family: str) -> FamilyFigures:
    """The figures ``family`` adds to every drafter's (``DrafterFamily.figures``)."""
    return family_named(family).figures


def extra_anchor_counts() -> tuple[str, ...]:
    """Every per-depth count any family adds (the names a results.json may hold beside ``ANCHOR_COUNT_KEYS``)."""
    return tuple(dict.fromkeys(n for f in families() for n in f.figures.depth_counts))


def family_ratios(counts: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """(numerator, denominator) of each figure a family's per-depth counts give, from ``depth_total``,
    ``depth_match`` and the family's columns (one sample's or a sum's), for the family whose columns ``counts``
    holds: the one definition the summary and the bootstrap (``bootstrap.anchor_sums``) share; {} for none."""
    for f in families():
        if f.figures.depth_counts and all(n in counts for n in f.figures.depth_counts):
            return f.figures.ratios_of(counts)
    return {}


class HasFamilyFigures:
    """What its drafter ``family`` adds, for anything that has one (the counts)."""

    family: str

    @property
    def walks(self) -> tuple[str, ...]:
        """The family's replay walks besides the greedy one and the DDTree budgets (their tau keys)."""
        return family_figures(self.family).walk_keys

    @property
    def depth_counts(self) -> tuple[str, ...]:
        """The family's per-depth anchor counts besides the served match and SpecForge's."""
        return family_figures(self.family).depth_counts


# -- uncertainty, comparisons and breakdowns (dflash_cb.core.figures.bootstrap, dflash_cb.core.figures.positions, dflash_cb.core.results.compare) --
DELTA_TAU = "delta_tau"  # live minus a baseline, paired on the evaluated samples
BEST_TAU = "best/tau"  # W&B summary: the best tau of the run so far, and the step it was measured at
BEST_STEP = "best/step"
CI_LOW_SUFFIX = "_ci_low"
CI_HIGH_SUFFIX = "_ci_high"
FULL_PREFIX = "full/"  # a full evaluation's keys, logged again under {prefix}full/ (callback)
SERVED_BASELINE = f"baseline/{SERVED_BASELINE_NAME}"  # the served drafter's online tau (baselines.Baseline.key)


def ci_low(metric: str) -> str:
    """Lower end of the metric's bootstrap interval (``tau_ci_low``, ``ddtree/tau_b32_ci_low``)."""
    return metric + CI_LOW_SUFFIX


def ci_high(metric: str) -> str:
    return metric + CI_HIGH_SUFFIX


def position_bucket(lo: int, hi: int | None) -> str:
    """Completion-position bucket ``[lo, hi)``; ``hi`` None = everything from ``lo`` on."""
    return f"{lo}_{'end' if hi is None else hi}"


def position_tau(bucket: str) -> str:
    return f"position/{bucket}/tau"


def position_cycles(bucket: str) -> str:
    return f"position/{bucket}/cycles"


def cycle_bucket(index: int, last: bool = False) -> str:
    """Cycle-index bucket: ``0``, ``1``, ... and ``<n>plus`` for the last, open one."""
    return f"{index}plus" if last else str(index)


def cycle_tau(bucket: str) -> str:
    return f"cycle/{bucket}/tau"


def cycle_cycles(bucket: str) -> str:
    return f"cycle/{bucket}/cycles"


def sample_tau(lengths: Sequence[int]) -> float:
    """One request's mean acceptance length: its committed tokens over its cycles (NaN without a cycle).

    The per-request number that ``dflash.benchmark`` averages into "Average Acceptance length"
    (dflash 0.1.0: mean of each request's ``acceptance_lengths``); ``tau_request_mean`` is its mean.
    """
    return sum(lengths) / len(lengths) if lengths else math.nan


def sample_accept_length_served(lengths: Sequence[int]) -> float:
    """One request's acceptance length as SGLang serves it (``spec_accept_length``), from its replay.

    SGLang 0.5.23 divides ``completion_tokens`` by ``spec_verify_ct``; its completion includes the
    prefill's token, which belongs to no cycle: ``(1 + sum(lengths)) / len(lengths)``. SpecForge's
    SGLang benchmark averages this per-request figure. NaN without a cycle (SGLang then sends no
    ``spec_*`` fields).
    """
    return spec_accept_length(1 + sum(lengths), len(lengths)) if lengths else math.nan


# The anchor-statistics part of ``EvalCounts``: one sample's counts over one statistics set.
ANCHOR_COUNT_KEYS = ("anchors", "anchor_produced", "depth_total", "depth_match", "cond_num", "cond_den",
                     "specforge_total", "specforge_match", "t1_sum", "t1_anchors")


@dataclass(frozen=True)
class AnchorCounts:
    """One sample's anchor statistics over one statistics set, as integers (``t1_sum`` excepted).

    Per depth k = 1 .. block_size - 1 (index k - 1): ``depth_total`` anchors whose depth exists and
    whose target token is known, ``depth_match`` of those where the draft matches, ``cond_den`` of
    those where depths 1 .. k-1 matched, ``cond_num`` anchors whose first k depths matched.
    ``specforge_total`` / ``specforge_match``: the same weights and matches as SpecForge 0.2.0 counts
    them (full blocks under its training masks; zero weights when they could not be computed).
    ``t1_sum``: expected accepted + 1 at temperature 1, summed over the ``t1_anchors`` scored ones.
    ``depth_counts``: the drafter family's own per-depth counts (``FamilyFigures.depth_counts``; DFlash 2:
    ``selector_recall``), empty for DFlash.
    """

    anchors: int = 0
    anchor_produced: int = 0
    depth_total: tuple[int, ...] = ()
    depth_match: tuple[int, ...] = ()
    cond_num: tuple[int, ...] = ()
    cond_den: tuple[int, ...] = ()
    specforge_total: tuple[int, ...] = ()
    specforge_match: tuple[int, ...] = ()
    t1_sum: float = 0.0
    t1_anchors: int = 0
    depth_counts: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """One flat object: the fields, then each family count under its own name."""
        # Field by field, not ``asdict``: its deep copies were most of writing a results.json of a few hundred samples.
        out = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)
               if f.name != "depth_counts"}
        return {**out, **{k: list(v) for k, v in self.depth_counts.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], depths: int | None = None) -> AnchorCounts:
        """From ``to_dict``'s form; every field must be there, integers where integers are due and, with
        ``depths``, per-depth lists of that length; a family's counts (``extra_anchor_counts()``) may be."""
        if not isinstance(data, dict) or not set(ANCHOR_COUNT_KEYS) <= set(data) <= {*ANCHOR_COUNT_KEYS,
                                                                                      *extra_anchor_counts()}:
            raise ValueError(f"anchor counts must hold exactly {', '.join(ANCHOR_COUNT_KEYS)} (and any of "
                             f"{', '.join(extra_anchor_counts())}); got {str(data)[:80]}")
        out: dict[str, Any] = {"depth_counts": {}}
        for k in (*ANCHOR_COUNT_KEYS, *(n for n in extra_anchor_counts() if n in data)):
            v = data[k]
            if k == "t1_sum":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"anchor counts: t1_sum must be a number, got {v!r}")
                out[k] = float(v)
            elif isinstance(v, list):
                if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) or (
                        depths is not None and len(v) != depths):
                    raise ValueError(f"anchor counts: {k} must be {depths or 'a list of'} non-negative integers, "
                                     f"got {str(v)[:60]}")
                if k in extra_anchor_counts():
                    out["depth_counts"][k] = tuple(v)
                else:
                    out[k] = tuple(v)
            elif isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out[k] = v
            else:
                raise ValueError(f"anchor counts: {k} must be a non-negative integer, got {v!r}")
        return cls(**out)


def quantize_t1(values: torch.Tensor) -> torch.Tensor:
    """Per-anchor temperature-1 values (float64) rounded to multiples of ``T1_QUANTUM``: sums of them are exact,
    so their order does not matter (docs/metrics.md, "Floats")."""
    return torch.round(values.double() / T1_QUANTUM) * T1_QUANTUM


def count_anchors(accepted: torch.Tensor, produced: torch.Tensor, valid_depth: torch.Tensor, match: torch.Tensor,
                  specforge_match: torch.Tensor | None = None, specforge: bool = True,
                  t1: torch.Tensor | None = None) -> AnchorCounts:
    """The counts of a set of anchors of one sample (teacher forced): ``anchor_counts_per_sample`` of one
    sample, the one implementation.

    accepted [A]: leading matches; produced [A]; valid_depth [A, D]: the depth exists and its target
    token is known; match [A, D]: draft == target at that depth; specforge_match [A, D]: the same
    under SpecForge's masks and full blocks (None: ``match``); ``specforge`` False: SpecForge's
    figure could not be computed (zero weights). t1 [A]: expected accepted length at temperature 1
    (None: no top-K log-probs stored).
    """
    sample = torch.zeros(accepted.shape[0], dtype=torch.long)
    sf = match if specforge_match is None else specforge_match
    t1_values = torch.zeros(accepted.shape[0], dtype=torch.float64) if t1 is None else t1
    return anchor_counts_per_sample(sample, 1, accepted.cpu(), produced.cpu(), valid_depth.cpu(), match.cpu(),
                                    sf.cpu(), specforge, t1_values.cpu(), [t1 is not None])[0]


def anchor_counts_per_sample(sample: torch.Tensor, n_samples: int, accepted: torch.Tensor, produced: torch.Tensor,
                             valid: torch.Tensor, match: torch.Tensor, specforge_match: torch.Tensor, specforge: bool,
                             t1: torch.Tensor, t1_scored: Sequence[bool],
                             extra: Mapping[str, torch.Tensor] | None = None) -> list[AnchorCounts]:
    """Each sample's ``AnchorCounts`` over anchors given as flat rows (CPU tensors), in (sample, anchor) order.

    sample [A]: each row's sample index in ``[0, n_samples)``; accepted, produced [A]; valid, match,
    specforge_match [A, D] booleans (a match counts only where the depth is valid); ``specforge`` False:
    SpecForge's figure could not be computed (zero weights); t1 [A] float64: expected accepted length at
    temperature 1, counted for the samples whose ``t1_scored`` is True. Integer sums per sample (the same
    whatever else the rows hold), and ``t1_sum`` a sum of ``quantize_t1`` values: exact in any order. ``extra``: the
    drafter family's per-depth counts [A, D] by name (``FamilyFigures.depth_counts``: booleans or small
    non-negative integers), summed where valid.
    """
    d = valid.shape[1]
    depth = torch.arange(1, d + 1)[None, :]
    valid = valid.bool()
    accepted = accepted.long()

    def per_sample(x: torch.Tensor) -> list[Any]:
        return torch.zeros((n_samples, *x.shape[1:]), dtype=torch.long).index_add_(0, sample, x.long()).tolist()

    anchors = per_sample(torch.ones_like(sample))
    anchor_produced = per_sample(produced)
    total = per_sample(valid)
    hit = per_sample(match.bool() & valid)
    cond_num = per_sample(accepted[:, None] >= depth)
    cond_den = per_sample((accepted[:, None] >= depth - 1) & valid)  # depths 1..k-1 all matched
    sf_hit = per_sample(specforge_match.bool() & valid)
    family = {name: per_sample(x.long() * valid) for name, x in (extra or {}).items()}
    t1_sums = torch.zeros(n_samples, dtype=torch.float64).index_add_(0, sample, quantize_t1(t1 + 1)).tolist()
    zeros = (0,) * d
    return [AnchorCounts(
        anchors=anchors[s], anchor_produced=anchor_produced[s], depth_total=tuple(total[s]),
        depth_match=tuple(hit[s]), cond_num=tuple(cond_num[s]), cond_den=tuple(cond_den[s]),
        specforge_total=tuple(total[s]) if specforge else zeros,
        specforge_match=tuple(sf_hit[s]) if specforge else zeros,
        t1_sum=t1_sums[s] if t1_scored[s] else 0.0, t1_anchors=anchors[s] if t1_scored[s] else 0,
        depth_counts={name: tuple(x[s]) for name, x in family.items()})
        for s in range(n_samples)]


@dataclass
class EvalCounts(HasFamilyFigures):
    """Integer-valued sums (kept in float64: exact up to 2**53) over scored samples.

    The parts and their sizes follow from (block size, budgets, categories, family): the drafter family adds
    its walks' cycles and produced tokens (``walk_cycles``, ``walk_produced``) and its per-depth counts
    (``FamilyFigures``); a DFlash evaluation has none of them."""

    block_size: int
    budgets: tuple[int, ...]
    categories: tuple[str, ...]
    family: str = DEFAULT_FAMILY
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = self.block_size - 1
        shapes = {
            "samples": 1, "cycles": 1, "produced": 1,
            "hist": self.block_size + 1,  # produced values 0..block_size
            "anchors": 1, "anchor_produced": 1,
            "depth_total": d, "depth_match": d, "cond_num": d, "cond_den": d,
            "specforge_total": d, "specforge_match": d,
            "cat_cycles": len(self.categories), "cat_produced": len(self.categories),
            "dd_cycles": len(self.budgets), "dd_produced": len(self.budgets),
            "t1_sum": 1, "t1_anchors": 1,
            "anchors_drafted": 1, "anchors_needed": 1,
        }
        if self.walks:
            shapes.update(walk_cycles=len(self.walks), walk_produced=len(self.walks))
        shapes.update(dict.fromkeys(self.depth_counts, d))
        for k, n in shapes.items():
            self.data.setdefault(k, torch.zeros(n, dtype=torch.float64))

    # -- DDP: one flat vector so a single all_reduce sums everything -----------
    def flat(self) -> torch.Tensor:
        return torch.cat([self.data[k] for k in sorted(self.data)])

    def load_flat(self, flat: torch.Tensor) -> None:
        i = 0
        for k in sorted(self.data):
            n = self.data[k].numel()
            self.data[k] = flat[i:i + n].to(torch.float64).cpu().clone()
            i += n

    def merge_(self, other: EvalCounts) -> EvalCounts:
        for k, v in other.data.items():
            self.data[k] += v
        return self

    def add_samples(self, cycles: Sequence[Sequence[int]] = (), categories: Sequence[str] = (),
                    ddtree: Sequence[Sequence[Sequence[int]]] = (), cost: Sequence[tuple[int, int]] = (),
                    anchors: Sequence[AnchorCounts] = (), walks: Sequence[Sequence[Sequence[int]]] = ()) -> None:
        """Add samples: per sample its greedy cycles' ``produced`` (``cycles``, with its category), its DDTree
        cycles per budget in ``budgets`` order, its (anchors drafted, anchors needed), its anchor statistics
        (``count_anchors``) and its family walks' cycles in ``walks`` order. Each sequence is one entry per
        sample (empty: that part is not added).

        Summed in plain Python in sample order and added once: every count is an integer sum, exact in any
        order, and so is ``t1_sum``, the one float: a sum of multiples of ``T1_QUANTUM`` (``quantize_t1``).
        """
        d = self.data
        if cycles:
            hist = [0] * (self.block_size + 1)
            cat_cycles, cat_produced = [0] * len(self.categories), [0] * len(self.categories)
            for lengths, category in zip(cycles, categories, strict=True):
                c = self.categories.index(category)
                cat_cycles[c] += len(lengths)
                cat_produced[c] += sum(lengths)
                for n in lengths:
                    hist[n] += 1
            d["samples"] += len(cycles)
            d["cycles"] += sum(cat_cycles)
            d["produced"] += sum(cat_produced)
            d["hist"] += torch.tensor(hist, dtype=torch.float64)
            d["cat_cycles"] += torch.tensor(cat_cycles, dtype=torch.float64)
            d["cat_produced"] += torch.tensor(cat_produced, dtype=torch.float64)
        if ddtree:
            per_budget = list(zip(*ddtree, strict=True))
            d["dd_cycles"] += torch.tensor([sum(map(len, b)) for b in per_budget], dtype=torch.float64)
            d["dd_produced"] += torch.tensor([sum(map(sum, b)) for b in per_budget], dtype=torch.float64)
        if walks:
            per_walk = list(zip(*walks, strict=True))
            d["walk_cycles"] += torch.tensor([sum(map(len, w)) for w in per_walk], dtype=torch.float64)
            d["walk_produced"] += torch.tensor([sum(map(sum, w)) for w in per_walk], dtype=torch.float64)
        if cost:
            d["anchors_drafted"] += sum(c[0] for c in cost)
            d["anchors_needed"] += sum(c[1] for c in cost)
        if anchors:
            t1 = float(d["t1_sum"][0])
            for a in anchors:
                t1 += a.t1_sum
            d["t1_sum"][0] = t1
            for k in ANCHOR_COUNT_KEYS:
                if k == "t1_sum":
                    continue
                values = [getattr(a, k) for a in anchors]
                if isinstance(values[0], tuple):
                    rows = [v for v in values if v]  # an empty tuple: a sample scored no anchor
                    if rows:
                        d[k] += torch.tensor([sum(col) for col in zip(*rows, strict=True)], dtype=torch.float64)
                else:
                    d[k] += sum(values)
            for k in self.depth_counts:
                rows = [a.depth_counts[k] for a in anchors if a.depth_counts.get(k)]
                if rows:
                    d[k] += torch.tensor([sum(col) for col in zip(*rows, strict=True)], dtype=torch.float64)

    def add_anchor_counts(self, counts: AnchorCounts) -> None:
        """One sample's anchor statistics (``count_anchors``)."""
        self.add_samples(anchors=[counts])

    def add_anchors(self, accepted: torch.Tensor, produced: torch.Tensor, valid_depth: torch.Tensor,
                    match: torch.Tensor) -> None:
        """Teacher-forced counts over anchors of a sample (``count_anchors``; SpecForge's masks taken to be
        the drafter's own)."""
        self.add_anchor_counts(count_anchors(accepted, produced, valid_depth, match))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def summarize(counts: EvalCounts) -> dict[str, float]:
    """Scalar metrics (unprefixed names) from summed counts."""
    d = counts.data
    out: dict[str, float] = {
        TAU: _ratio(d["produced"].item(), d["cycles"].item()),
        CYCLES: d["cycles"].item(),
        TOKENS: d["produced"].item(),
        SAMPLES: d["samples"].item(),
        ALL_ANCHOR_TAU: _ratio(d["anchor_produced"].item(), d["anchors"].item()),
        ANCHORS_DRAFTED: d["anchors_drafted"].item(),
        ANCHORS_NEEDED: d["anchors_needed"].item(),
    }
    for i, b in enumerate(counts.budgets):
        out[ddtree_tau(b)] = _ratio(d["dd_produced"][i].item(), d["dd_cycles"][i].item())
    for i, name in enumerate(counts.walks):
        out[name] = _ratio(d["walk_produced"][i].item(), d["walk_cycles"][i].item())
    for name, (num, den) in family_figures(counts.family).ratios_of({k: d[k].tolist() for k in ("depth_total", "depth_match",
                                                                          *counts.depth_counts)}).items():
        out[name] = _ratio(num, den)
    uncond = [_ratio(m, t) for m, t in zip(d["depth_match"].tolist(), d["depth_total"].tolist(), strict=True)]
    cond = [_ratio(n, m) for n, m in zip(d["cond_num"].tolist(), d["cond_den"].tolist(), strict=True)]
    for k, (u, c) in enumerate(zip(uncond, cond, strict=True), start=1):
        out[depth_acc(k)] = u
        out[depth_acc_cond(k)] = c
    # SpecForge's pooled DFlash accuracy: integer matches over integer weights, every (anchor, depth), counted
    # under SpecForge's own masks (docs/method.md, "SpecForge's accuracy"); NaN when it could not be computed.
    out[SPECFORGE_ACC] = _ratio(d["specforge_match"].sum().item(), d["specforge_total"].sum().item())
    # Independent-depth chain: 1 + sum_k prod_{j<=k} acc_j from per-position (unconditional) accuracy.
    sim, prod = 1.0, 1.0
    for u in uncond:
        if math.isnan(u):
            break
        prod *= u
        sim += prod
    out[CHAIN_TAU_ESTIMATE] = sim if d["anchors"].item() > 0 else math.nan
    for i, c in enumerate(counts.categories):
        out[category_tau(c)] = _ratio(d["cat_produced"][i].item(), d["cat_cycles"][i].item())
    total = d["hist"].sum().item()
    for n in range(1, counts.block_size + 1):
        out[hist_frac(n)] = _ratio(d["hist"][n].item(), total)
    if d["t1_anchors"].item() > 0:
        out[T1_TAU_ESTIMATE] = _ratio(d["t1_sum"].item(), d["t1_anchors"].item())
    return out


def per_depth(summary: dict[str, float], block_size: int, family: str = DEFAULT_FAMILY) -> dict[str, list[float]]:
    """The per-depth figures as lists over depths 1 .. block_size - 1, with the drafter ``family``'s own
    (``FamilyFigures.per_depth``) where the summary has them."""
    out = {
        "unconditional": [summary[depth_acc(k)] for k in range(1, block_size)],
        "conditional": [summary[depth_acc_cond(k)] for k in range(1, block_size)],
    }
    for figure in family_figures(family).per_depth:
        if figure.key(1) in summary:
            out[figure.name] = [summary[figure.key(k)] for k in range(1, block_size)]
    return out
