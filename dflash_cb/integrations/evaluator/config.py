"""``EvalConfig``: every option of the live evaluation, checked once, in one frozen object.

The evaluator (``evaluator.LiveEvaluator``) takes one; each adapter (Lightning, Hugging Face, SpecForge)
builds it from its own arguments and adds only what its loop needs (where the drafter is, the progress
bar). ``tests/integrations/test_config.py`` checks that the adapters' signatures are the config's fields plus their own,
so an option added here reaches every loop or fails a test. Pure: no file access (a config parses
anywhere, e.g. on a login node before the cache is copied), one rule for every value
(``dflash_cb.common.arguments``): nothing is coerced, each error names the argument.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ...common import arguments as check
from ...core.figures.metrics import DEFAULT_PREFIX, key_namespaces
from ...core.figures.positions import DEFAULT_POSITION_EDGES
from ...core.loop.cycles import TAIL_BLOCKS
from ...core.replay import AUTOCAST_NAMES, DEFAULT_BUDGETS

# The target's embedding or head: an attribute path on the training model, a module, or the matrix itself.
WeightSource = str | nn.Module | torch.Tensor
TailBlocks = Literal["served", "reference"]
AutocastName = Literal["auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"]


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate, when, and how to report it; the same in every training loop.

    Args:
        states: cache folder written by ``tools/precompute_states.py``.
        every_n_train_steps: evaluate after every N optimizer steps (``global_step % N == 0``);
            0 disables the periodic evaluations (start/end ones still run).
        eval_on_fit_start: evaluate before the first training step (the untrained baseline). Done
            once per run: a resumed run does not repeat it.
        eval_on_fit_end: evaluate after the last step (unless that step was just evaluated).
        target_embed, target_lm_head: the target's input embedding and output head, when the training
            model holds them (no copy): an ``nn.Embedding``/``nn.Linear``, a ``[vocab, hidden]`` tensor, or
            an attribute path on the training model. Without them the cache's exported head is loaded
            once, onto the drafter's device, and kept there (Qwen3.6-27B: embedding + head = 5.1 GB in
            bf16). ``target_lm_head`` may be omitted only when the target ties embedding and head.
        ddtree_budgets: DDTree node budgets (empty: no DDTree) of the full evaluations.
        light_ddtree_budgets: DDTree budgets of the light evaluations (the periodic ones, but every
            ``full_every_n_evals``-th); None = the largest of ``ddtree_budgets`` only (each budget's walk
            visits its own anchors: extra budgets cost nearly a full replay each).
        light_anchor_stride: anchor-statistics stride of the light evaluations (per-depth acceptance,
            ``specforge/acc``, all-anchor and estimated taus on every N-th anchor from a per-sample offset; the
            tau replays are exact whatever the stride); None = the evaluated block size. These strided figures
            are the main keys at every evaluation; full evaluations add the exact (stride 1) ones under
            ``{prefix}full/``.
        anchor_seed: seed of the per-sample offsets of the strided anchor set (``anchor_sets.anchor_offset``):
            fixed for a run, so every evaluation scores the same anchors; the same as ``eval_drafter.py
            --anchor-seed``.
        full_every_n_evals: every N-th evaluation is a full one (``anchor_stride=1``, every budget); 0 = only
            the one at fit end.
        num_samples: evaluate a fixed subset of this many samples (stratified by category, chosen
            with ``sample_seed``, the same at every evaluation); None = every sample.
        sample_ids: evaluate exactly these sample ids (overrides ``num_samples``).
        sample_seed: seed of the subset choice (a private generator: training RNG is not touched).
        prefix: metric name prefix.
        baselines: reference ``results.json`` files from ``tools/eval_drafter.py`` on the same cache:
            ``{name: path}`` or a list of paths (name = file stem). Logged as constant series
            ``{prefix}baseline/<name>/...`` and in the W&B summary. A file measured on another cache is
            refused at setup. When the cache holds the server's speculative counters (``served_spec``), the
            served drafter's online tau is logged too, as ``{prefix}baseline/served/tau``.
        published: YAML of published figures (format: ``configs/baselines/published.yaml``), logged as
            ``{prefix}published/<name>/...``, marked as published, not measured here. Placeholder entries
            are not logged. Default: none.
        published_entries: names of the published entries to log (default: every non-placeholder entry).
        cost_profile: a cost profile (``tools/profile_costs.py``): every evaluation also logs the projected
            speedup over plain decoding and tokens per second of each scored setting (``{prefix}serving/...``,
            docs/serving.md), labelled projections. A profile of another target, or too few verified tokens for
            a setting, is refused at setup. Default: none.
        fail_on_error: raise when an evaluation fails instead of warning and going on.
        max_failed_evaluations: raise ``DFlashEvalError`` when this many evaluations in a row failed
            (0: never; each failure is still a warning and counts in ``{prefix}failed_evaluations``).
        autocast_dtype: ``"auto"`` (bfloat16 autocast on CUDA for a float32 drafter, none on CPU),
            ``"bfloat16"``, ``"float16"``, or ``"float32"``/None (no autocast: exact float32).
        table_samples: samples shown in the W&B table at each evaluation (0 = no table).
        table_cycles: cycles (draft blocks) shown per table sample.
        tokenizer: decodes tokens in the W&B table: a Hugging Face tokenizer path or object, or a function
            ``ids -> str``; None shows token ids.
        verify_cache: check the sha256 of every shard to evaluate (and of the exported head) at setup,
            and before each evaluation hash again any of them that changed (``integrity.file_identity``).
            False skips the hashing (a large cache on a slow disk); sizes are always checked at setup.
        position_edges: completion-position bucket edges for ``{prefix}position/<lo>_<hi>/tau``
            (the last bucket is open-ended).
        console: print one line per evaluation on rank zero (step, tau with its 95% interval, DDTree tau
            at the largest budget, difference to each measured baseline, wall time).
        tail_blocks: ``"served"`` (full blocks near the end, cut after verification, as SGLang serves) or
            ``"reference"`` (shortened blocks, as dflash's ``dflash_generate``); docs/method.md, "Tail blocks".
        block_size: the block the loop drafts with, from 2 up to the drafter's trained block: a server can
            draft with a shorter one (SGLang's ``--speculative-dflash-block-size``), which caps its tau.
            None = the drafter's (checked against the drafter at setup, ``replay.check_block_size``).
        periodic_ddtree_budgets, periodic_anchor_stride: the first names of ``light_ddtree_budgets`` and
            ``light_anchor_stride``, still accepted (not both names of one option).

    Intervals: ``{prefix}<metric>_ci_low``/``_ci_high`` are 95% cluster-bootstrap intervals over the
    evaluated samples (``dflash_cb.core.figures.bootstrap``): the uncertainty from the choice of prompts.
    """

    states: str | os.PathLike
    every_n_train_steps: int = 500
    eval_on_fit_start: bool = True
    eval_on_fit_end: bool = True
    target_embed: WeightSource | None = None
    target_lm_head: WeightSource | None = None
    ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS
    light_ddtree_budgets: Sequence[int] | None = None
    light_anchor_stride: int | None = None
    anchor_seed: int = 0
    full_every_n_evals: int = 0
    num_samples: int | None = None
    sample_ids: Sequence[str] | None = None
    sample_seed: int = 0
    prefix: str = DEFAULT_PREFIX
    baselines: dict[str, str] | Sequence[str] | None = None
    published: str | os.PathLike | None = None
    published_entries: Sequence[str] | None = None
    cost_profile: str | os.PathLike | None = None
    fail_on_error: bool = False
    max_failed_evaluations: int = 3
    autocast_dtype: AutocastName | None = "auto"
    table_samples: int = 4
    table_cycles: int = 4
    tokenizer: Any = field(default=None, compare=False)
    verify_cache: bool = True
    position_edges: Sequence[int] = DEFAULT_POSITION_EDGES
    console: bool = True
    tail_blocks: TailBlocks = "served"
    block_size: int | None = None
    # The light options' first names, still accepted (YAML and code written for them keep working).
    periodic_ddtree_budgets: Sequence[int] | None = None
    periodic_anchor_stride: int | None = None

    def __post_init__(self) -> None:
        # Normalised in place (frozen: object.__setattr__), so every reader sees one spelling: paths as str,
        # budgets sorted and unique, lists as tuples.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        named = {new: new for new in OLD_NAMES.values()}  # errors name the option as it was given
        for old, new in OLD_NAMES.items():
            if getattr(self, old) is not None:
                named[new] = old
                if getattr(self, new) is not None:
                    raise check.ArgumentError(f"{old} and {new} both given: {old} is the old name of {new}; "
                                              f"give {new} only")
                put(new, getattr(self, old))
                put(old, None)
        budgets = tuple(sorted(set(check.int_list("ddtree_budgets", self.ddtree_budgets, 1, note="[] = no DDTree"))))
        put("ddtree_budgets", budgets)
        light = check.int_list(named["light_ddtree_budgets"], self.light_ddtree_budgets, 1,
                               none="the largest of ddtree_budgets")
        put("light_ddtree_budgets", tuple(sorted(set(light))) if light is not None else None)
        embed = None if isinstance(self.target_embed, str) and not self.target_embed else self.target_embed
        head = None if isinstance(self.target_lm_head, str) and not self.target_lm_head else self.target_lm_head
        for name, source in (("target_embed", embed), ("target_lm_head", head)):
            if source is not None and not isinstance(source, (str, nn.Embedding, nn.Linear, torch.Tensor)):
                raise check.ArgumentError(f"{name}={type(source).__name__}: expected an attribute path on the "
                                          "training model, an nn.Embedding/nn.Linear or a [vocab, hidden] tensor")
        if head is not None and embed is None:
            raise check.ArgumentError("target_lm_head needs target_embed too (the block embeddings come from the "
                                      "target)")
        put("target_embed", embed)
        put("target_lm_head", head)
        if self.autocast_dtype not in (None, "auto", *AUTOCAST_NAMES):
            raise check.ArgumentError(f"autocast_dtype={self.autocast_dtype!r}: expected 'auto', None or one of "
                                      f"{sorted(AUTOCAST_NAMES)}")
        if self.tail_blocks not in TAIL_BLOCKS:
            raise check.ArgumentError(f"tail_blocks={self.tail_blocks!r}: expected one of {', '.join(TAIL_BLOCKS)} "
                                      "(docs/method.md, 'Tail blocks')")
        put("states", check.file_path("states", self.states))
        put("every_n_train_steps", check.int_at_least("every_n_train_steps", self.every_n_train_steps, 0,
                                                      note="0 = no periodic evaluations"))
        for name in ("eval_on_fit_start", "eval_on_fit_end", "fail_on_error", "verify_cache", "console"):
            check.flag(name, getattr(self, name))
        put("light_anchor_stride", check.int_at_least(named["light_anchor_stride"], self.light_anchor_stride, 1,
                                                      none="the drafter's block size"))
        put("anchor_seed", check.int_at_least("anchor_seed", self.anchor_seed, 0))
        put("full_every_n_evals", check.int_at_least("full_every_n_evals", self.full_every_n_evals, 0,
                                                     note="0 = only the fit-end evaluation is full"))
        put("num_samples", check.int_at_least("num_samples", self.num_samples, 1, none="every sample"))
        ids = check.str_list("sample_ids", self.sample_ids, none="num_samples decides")
        put("sample_ids", tuple(ids) if ids is not None else None)
        put("sample_seed", check.int_at_least("sample_seed", self.sample_seed, 0))
        check_prefix(self.prefix)
        put("baselines", check.baseline_paths("baselines", self.baselines))
        put("published", check.path_or_none("published", self.published))
        entries = check.str_list("published_entries", self.published_entries, none="every non-placeholder entry")
        put("published_entries", tuple(entries) if entries is not None else None)
        put("cost_profile", check.path_or_none("cost_profile", self.cost_profile))
        put("max_failed_evaluations", check.int_at_least("max_failed_evaluations", self.max_failed_evaluations, 0,
                                                         note="0 = never stop"))
        put("table_samples", check.int_at_least("table_samples", self.table_samples, 0, note="0 = no table"))
        put("table_cycles", check.int_at_least("table_cycles", self.table_cycles, 1))
        put("position_edges", check.position_edges("position_edges", self.position_edges))
        put("block_size", check.int_at_least("block_size", self.block_size, 2, none="the drafter's block",
                                             note="the block the server drafts with, at most the drafter's"))

    # -- derived -----------------------------------------------------------------------------
    @property
    def light_budgets(self) -> tuple[int, ...]:
        """The DDTree budgets of a light evaluation."""
        if self.light_ddtree_budgets is not None:
            return tuple(self.light_ddtree_budgets)
        return tuple(self.ddtree_budgets)[-1:]

    def light_stride(self, block_size: int) -> int:
        """The anchor-statistics stride of a light evaluation at the evaluated ``block_size``."""
        return self.light_anchor_stride or block_size

    @property
    def needs_cache_head(self) -> bool:
        """Whether the cache's exported embedding and head are used (the model holds no target weights)."""
        return self.target_embed is None

    def replace(self, **changes: Any) -> EvalConfig:
        """A copy with ``changes``, checked like a new one."""
        return dataclasses.replace(self, **changes)

    def describe(self, block_size: int | None = None) -> dict[str, Any]:
        """The settings recorded in a run's configuration (W&B ``{prefix}config``); ``block_size``: the block
        evaluated (once the drafter is known)."""
        return {
            "states": self.states, "every_n_train_steps": self.every_n_train_steps,
            "ddtree_budgets": list(self.ddtree_budgets), "light_ddtree_budgets": list(self.light_budgets),
            "light_anchor_stride": self.light_stride(block_size) if block_size else self.light_anchor_stride,
            "anchor_seed": self.anchor_seed,
            "full_every_n_evals": self.full_every_n_evals, "tail_blocks": self.tail_blocks,
            "block_size": block_size if block_size is not None else self.block_size,
            "autocast_dtype": self.autocast_dtype, "position_edges": list(self.position_edges),
        }


# Old option name -> the name it has now.
OLD_NAMES = {"periodic_ddtree_budgets": "light_ddtree_budgets", "periodic_anchor_stride": "light_anchor_stride"}


def config_fields() -> tuple[str, ...]:
    """The option names, in order (the adapters' signatures repeat them: ``tests/integrations/test_config.py``)."""
    return tuple(f.name for f in dataclasses.fields(EvalConfig))


def config_from(arguments: Mapping[str, Any]) -> EvalConfig:
    """The ``EvalConfig`` of an adapter's arguments (its ``locals()`` at the top of ``__init__``): every config
    field taken by name, the adapter's own arguments left out. One call for every adapter, so an option
    added to ``EvalConfig`` reaches every loop (``tests/integrations/test_config.py``)."""
    return EvalConfig(**{name: arguments[name] for name in config_fields()})


def one_per_prefix(adapter: str, prefix: str, peers: Iterable[str], where: str, what: str = "evaluations") -> None:
    """Refuse a second evaluation under ``prefix`` in one loop (``peers``: the other evaluations' prefixes
    there): their metrics and saved states would collide. The one guard of every adapter."""
    if prefix in set(peers):
        raise check.ArgumentError(f"{adapter}: two {what} with prefix={prefix!r} on one {where}; give each "
                                  f"its own prefix= (e.g. {DEFAULT_PREFIX!r} and 'dflash_eval_b/'): their metrics "
                                  "and saved states would collide")


def check_prefix(prefix: Any) -> str:
    """A metric prefix: a non-empty string ending in ``/`` whose last segment is no metric namespace (then
    ``{prefix}tau`` reads as one key and no key of another evaluator's ``full/``, ``baseline/``, ... is
    taken)."""
    if not isinstance(prefix, str):
        raise check.ArgumentError(f"prefix={prefix!r}: expected a string, e.g. {DEFAULT_PREFIX!r}")
    last = prefix.rstrip("/").rsplit("/", 1)[-1]
    if not prefix.endswith("/") or not prefix.strip("/") or any(c.isspace() for c in prefix):
        fixed = (prefix.strip().strip("/").replace(" ", "_") or DEFAULT_PREFIX.rstrip("/")) + "/"
        raise check.ArgumentError(f"prefix={prefix!r}: a metric prefix is a name ending in '/' (keys are "
                                  f"prefix + 'tau'), without spaces; e.g. prefix={fixed!r}")
    if last in key_namespaces():
        raise check.ArgumentError(f"prefix={prefix!r}: its last part {last!r} is a namespace of the metric names "
                                  f"(keys such as {DEFAULT_PREFIX}{last}/...), so its keys would collide with "
                                  f"another evaluation's; choose another name, e.g. prefix={prefix.rstrip('/')}_eval/")
    return prefix
