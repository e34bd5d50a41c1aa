"""Scoring saved drafters on one cache: what ``tools/eval_drafter.py`` and the checkpoint sweep share.

``add_scoring_options`` puts the evaluation's options on a parser (DDTree budgets, anchor stride and seed, block,
tail blocks, dtype, device, target, sample selection, verification, position edges, threads);
``ScoringOptions.from_args`` checks them (one line naming the option, before any work); ``CacheScorer`` opens the
cache once (the samples chosen as the live evaluator chooses them, the files checked and hashed once, the head
loaded once) and scores any number of drafters on it through the live evaluator's own functions
(``session.drafter_fit``, ``session.open_session``, ``engine.evaluate``, ``results.report_to_results``). So the
sweep takes eval_drafter's options, checks and numbers by construction.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...cache.states import StateCache, TargetHead
from ...common.log import get_logger
from ...common.threads import THREADS_HELP
from ...core.figures.positions import DEFAULT_POSITION_EDGES
from ...core.replay import EvalReport
from ...core.results.results_file import Results
from .config import EvalConfig
from .session import DrafterFit

logger = get_logger(__name__)


def add_scoring_options(p: argparse.ArgumentParser) -> None:
    """The evaluation's options (``ScoringOptions``), as both tools spell them."""
    p.add_argument("--states", required=True, help="cache folder written by tools/precompute_states.py")
    p.add_argument("--ddtree-budgets", default="16,32,64", help="comma-separated node budgets ('' = off)")
    p.add_argument("--anchor-stride", default="1",
                   help="per-depth / all-anchor / SpecForge statistics on every N-th anchor from a per-sample offset "
                        "(default 1: every anchor; the callback's periodic evaluations use the block size); tau is "
                        "exact either way")
    p.add_argument("--anchor-seed", default="0",
                   help="seed of the per-sample offsets of the --anchor-stride set (default 0, as the callback); "
                        "recorded in results.json with each sample's offset")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu; exactness needs float32)")
    p.add_argument("--target", default=None,
                   help="target model folder to take the embedding and output head from (default: the cache's export)")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--samples", default=None,
                     help="score a fixed subset of N samples, stratified by category exactly as the callback's "
                          "num_samples (same --sample-seed, same subset)")
    sel.add_argument("--sample-ids", default=None, help="score exactly these comma-separated sample ids")
    p.add_argument("--sample-seed", default="0", help="seed of the --samples subset (default 0, as the callback)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check the sha256 of every shard to score and of the exported head before scoring "
                        "(default; --no-verify checks sizes only)")
    p.add_argument("--tail-blocks", choices=["served", "reference"], default="served",
                   help="near the end: full blocks cut after verification, as SGLang serves (served, default), "
                        "or shortened blocks, as dflash's dflash_generate (reference); docs/method.md, 'Tail blocks'")
    p.add_argument("--block-size", default=None,
                   help="draft blocks of N tokens (anchor included), 2 .. the drafter's block (default: the "
                        "drafter's), as a server started with --speculative-num-draft-tokens N drafts")
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)),
                   help="completion-position buckets for tau by position (results.json breakdown)")
    p.add_argument("--threads", default=None, help=THREADS_HELP)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``--ddtree-budgets``: comma-separated positive integers, or '' for no DDTree."""
    from ...common.arguments import parse_int_list

    return parse_int_list("--ddtree-budgets", text, 1, note="e.g. 16,32,64, or '' to turn DDTree off")


def resolve_device(name: str | None) -> torch.device:
    from ...common.errors import DFlashCBError

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DFlashCBError(f"--device {name!r}: not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise DFlashCBError(f"--device {name}: {why}; use --device cpu (exact float32), or run where a GPU is")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DFlashCBError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible; use cuda:0 .. "
                            f"cuda:{torch.cuda.device_count() - 1}")
    if device.type not in ("cpu", "cuda"):
        raise DFlashCBError(f"--device {name}: only cpu and cuda are supported")
    return device


@dataclass(frozen=True)
class ScoringOptions:
    """The evaluation's options, checked (``from_args``); the same for every drafter a tool scores."""

    states: str
    budgets: tuple[int, ...]
    anchor_stride: int
    anchor_seed: int
    block_size: int | None  # None: the drafter's
    num_samples: int | None
    sample_ids: list[str] | None
    sample_seed: int
    position_edges: tuple[int, ...]
    tail_blocks: str
    device: torch.device
    dtype_name: str
    verify: bool
    target: str | None
    threads: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScoringOptions:
        """Every value checked with the callback's rules (``dflash_cb.common.arguments``), naming the option;
        torch's threads set. Nothing is read from disk."""
        from ...cache.prompts import parse_id_list
        from ...common.arguments import parse_int, parse_position_edges
        from ...common.threads import parse_threads, set_threads
        from ...core.loop.ddtree import check_ddtree_budgets

        budgets = parse_budgets(args.ddtree_budgets)
        check_ddtree_budgets(budgets, None, None, "--ddtree-budgets")  # the block and vocabulary bound: later
        anchor_stride = parse_int("--anchor-stride", args.anchor_stride, 1, note="1 = every anchor")
        block_size = parse_int("--block-size", args.block_size, 2, note="the anchor and at least one draft") \
            if args.block_size is not None else None  # the drafter's bound: later
        anchor_seed = parse_int("--anchor-seed", args.anchor_seed, 0)
        num_samples = parse_int("--samples", args.samples, 1, note="omit it to score every sample") \
            if args.samples is not None else None
        sample_ids = parse_id_list(args.sample_ids, "--sample-ids") if args.sample_ids is not None else None
        sample_seed = parse_int("--sample-seed", args.sample_seed, 0)
        edges = parse_position_edges("--position-edges", args.position_edges)
        threads = set_threads(parse_threads(args.threads))
        device = resolve_device(args.device)
        dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        return cls(args.states, budgets, anchor_stride, anchor_seed, block_size, num_samples, sample_ids, sample_seed,
                   edges, args.tail_blocks, device, dtype_name, bool(args.verify), args.target, threads)

    def eval_config(self, table_samples: int = 0) -> EvalConfig:
        """The live evaluator's configuration of these options (its checks take it)."""
        return EvalConfig(self.states, every_n_train_steps=0, ddtree_budgets=self.budgets,
                          light_ddtree_budgets=self.budgets, light_anchor_stride=self.anchor_stride,
                          anchor_seed=self.anchor_seed, num_samples=self.num_samples, sample_ids=self.sample_ids,
                          sample_seed=self.sample_seed, verify_cache=self.verify, position_edges=self.position_edges,
                          tail_blocks=self.tail_blocks, block_size=self.block_size, table_samples=table_samples,
                          console=False)

    @property
    def selection(self) -> dict[str, Any]:
        """How the samples were chosen, as ``results.json`` records it (``meta.sample_selection``)."""
        return {"samples": self.num_samples, "sample_ids": self.sample_ids, "sample_seed": self.sample_seed}


# How eval_drafter spells the config fields a drafter is checked against.
OPTION_NAMES = {"block_size": "--block-size", "ddtree_budgets": "--ddtree-budgets",
                "light_ddtree_budgets": "--ddtree-budgets"}


class CacheScorer:
    """One cache, opened for scoring drafters: its samples chosen (``session.chosen_samples``) at construction,
    its files checked and hashed and its head loaded once (``open``), then ``score`` per drafter.

    ``config`` may be replaced before ``open`` (``eval_drafter.py --served-check`` takes the server's block).
    """

    def __init__(self, options: ScoringOptions, table_samples: int = 0) -> None:
        from ...core.loop.anchor_sets import sparse_stride_warning
        from ...core.replay import anchors_per_sample
        from .session import chosen_samples

        self.options = options
        self.config = options.eval_config(table_samples)
        self.cache = StateCache(options.states)  # CacheError: no or broken manifest
        self.ids = chosen_samples(self.cache, self.config, option="--samples",
                                  warn=lambda m: logger.warning(f"warning: {m}"))
        sparse = sparse_stride_warning(anchors_per_sample(self.cache, self.ids), options.anchor_stride,
                                       options.anchor_seed, option="--anchor-stride")
        if sparse is not None:
            logger.warning(f"warning: {sparse}")
        self.session: Any = None  # session.EvalSession, once open
        self._heads: dict[torch.dtype, TargetHead] = {}

    def check(self, drafter: nn.Module, owner: str) -> DrafterFit:
        """The drafter against the cache and the options (``session.drafter_fit``: configs only, cheap)."""
        import dataclasses

        from ...cache.manifest import CacheError
        from .session import drafter_fit, without_default_trees

        config, note = without_default_trees(self.config, drafter)
        if note is not None:  # a family without trees: the default --ddtree-budgets go, said once
            self.config, self.options = config, dataclasses.replace(self.options, budgets=())
            logger.info(f"{owner}: {note}")
        if not self.options.target and not self.cache.has_head:
            raise CacheError(f"{self.cache.path} has no exported target head (built with --no-export-head); "
                             "pass --target <the target model folder>")
        return drafter_fit(self.cache, self.config, drafter, None, owner, head_given=bool(self.options.target),
                           names=OPTION_NAMES)

    def _dtypes(self, weights: torch.dtype) -> tuple[torch.dtype | None, torch.dtype]:
        """(autocast dtype, the head's dtype) for drafter parameters of dtype ``weights``: the head is held in the
        dtype it computes in (bf16 for a bf16 evaluation, float32 only when asked)."""
        from ...core.replay import resolve_autocast

        autocast = resolve_autocast(self.options.dtype_name, self.options.device, weights)
        return autocast, autocast or weights

    def _load_head(self, dtype: torch.dtype) -> TargetHead:
        if dtype not in self._heads:
            if self.options.target:
                from ...cache.target_head import load_target_head

                head = load_target_head(self.options.target, device=self.options.device, dtype=dtype)
                self.cache.check_head(head, f"--target {self.options.target}")  # tie flag, vocabulary, hidden size
            else:
                head = self.cache.load_head(device=self.options.device, dtype=dtype, verify=self.options.verify)
            self._heads[dtype] = head
        return self._heads[dtype]

    def open(self, weights: torch.dtype) -> None:
        """The shards' sizes and sha256 (``--verify``), the samples' fields (``session.open_session``) and the head,
        once; ``weights``: the drafters' parameter dtype (the head's follows it). A collective under
        ``torch.distributed`` (every rank calls it)."""
        from .session import LoopContext, open_session

        if self.session is not None:
            return
        _, head_dtype = self._dtypes(weights)
        if self.options.target:  # the model's head: the cache's export is neither hashed nor loaded
            head = self._load_head(head_dtype)
            self.config = self.config.replace(target_embed=head.embed_tokens, target_lm_head=head.lm_head)
        self.session = open_session(self.config, LoopContext(), self.cache, self.ids)
        self._load_head(head_dtype)

    def score(self, drafter: nn.Module, fit: DrafterFit, provenance: dict[str, Any],
              meta: dict[str, Any] | None = None, progress: bool = False) -> tuple[Results, EvalReport]:
        """``drafter`` (checked: ``check``) scored on the chosen samples: a ``results.json``'s content whose meta
        names the drafter (``provenance``, ``results.drafter_provenance``), the settings, and ``meta``; and the
        engine's report it was made from."""
        from ...core.replay import EvalRequest, evaluate
        from ...core.results.results_file import report_to_results

        weights = next(drafter.parameters()).dtype
        self.open(weights)
        o = self.options
        drafter.eval()
        autocast, head_dtype = self._dtypes(weights)
        request = EvalRequest(sample_ids=tuple(self.ids), budgets=o.budgets, anchor_stride=o.anchor_stride,
                              anchor_seed=o.anchor_seed, block_size=fit.block_size, tail_blocks=o.tail_blocks,
                              device=o.device, autocast_dtype=autocast, verify=o.verify)
        report = evaluate(self.cache, drafter, self._load_head(head_dtype), request, progress=progress, fit=fit)
        results = report_to_results(report, self.cache, position_edges=o.position_edges, meta={
            "drafter": provenance, "dtype": o.dtype_name, "head_dtype": report.head_dtype,
            "device": str(o.device), "threads": o.threads, "head_source": o.target or "cache",
            "verified": o.verify, "sample_selection": o.selection, **(meta or {}),
        })
        family = fit.family
        with torch.no_grad():  # the family's own pass (EAGLE-3: SpecForge's accuracy figures)
            results.metrics.update(family.own_figures(self.cache, drafter, fit.block_size, self.ids,
                                                      self._load_head(head_dtype)))
        return results, report

