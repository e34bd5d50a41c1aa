"""What a drafter family is: the one interface a family folder implements (``core/drafters/<family>/``).

A family folder's ``family.py`` defines ``FAMILY``, an instance of a subclass of ``DrafterFamily``; the
registry (``registry.py``) finds it, as the trackers are found. The family

- recognises a config (``config_says``, ``config_hints``) or, when the config says nothing, weights
  (``own_key``); builds its spec (``spec``), its module (``build``) and its published config (``relabel``);
- adopts a training loop's module (``adopt``) and normalises checkpoint key spellings (``published_state``);
- declares what it needs from the cache (``cache_needs``) and its evaluation cost's extra fields
  (``cost_fields``);
- gives the replay its drafting objects: a runner that drives the module (``runner``) and a proposer that
  turns hidden states into drafts and trees (``proposer``); SpecForge's training masks are a capability
  (``specforge_difference``);
- carries its own figures (``figures``: names, labels, notes), so no generic module names a family.

``BlockFamily`` is the base of drafters that propose a whole block in one pass (DFlash, DFlash 2); the replay
drives every block family the same way (docs/method.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ...cache.needs import CacheNeeds
from ..loop.limits import MemoryLimits
from .spec import DrafterSpec, config_value, default_target_layer_ids, int_field, layer_id_list

# What ``DrafterFamily.runner`` and ``proposer`` return: a ``runners.DraftRunner`` and a ``proposers.Proposer``
# (those modules build on this one).
DraftRunner = Proposer = Any

# (numerator, denominator) of each figure a family computes from its per-depth counts.
Ratios = Callable[[Mapping[str, Sequence[float]]], dict[str, tuple[float, float]]]


@dataclass(frozen=True)
class Figure:
    """One figure a family adds: its metric key and what it is, in words (tables and charts prefix the family's
    label)."""

    key: str
    label: str
    # What to say when this walk's tau is above the drafter's own tau (a walk the family could have served).
    above_tau: str = ""


@dataclass(frozen=True)
class DepthFigure:
    """A per-depth figure a family adds: its list's name in ``results.json``'s ``per_depth``, its words, and the
    metric key at depth ``k``."""

    name: str
    label: str
    key: Callable[[int], str]
    short: str = ""  # its row's words in the report's per-depth table (12 characters at most)


@dataclass(frozen=True)
class FigureTable:
    """A table of pooled figures a family adds (metric keys from ``ratios``): the report prints it, rows by
    columns with their intervals, and the panels chart each column over its rows."""

    title: str
    row_header: str
    rows: tuple[str, ...]  # the rows' words
    columns: tuple[str, ...]  # the columns' words
    key: Callable[[int, int], str]  # (row index, column index) -> metric key


@dataclass(frozen=True)
class FamilyFigures:
    """What a family measures besides every drafter's figures (docs/metrics.md).

    ``walks``: replay walks besides the greedy one and the DDTree budgets, by their tau key (the proposer
    answers a hit per walk and depth, in this order); ``depth_counts``: per-depth anchor counts besides the
    served and SpecForge matches (the proposer answers them in this order); ``ratios``: the pooled and
    per-depth figures those counts give, as (numerator, denominator) from ``depth_total``, ``depth_match`` and
    the family's columns; ``pooled`` / ``per_depth``: which of them tables and charts show; ``tables``: tables of
    them the report prints; ``section``: the heading of the family's figures; ``note`` (under ``note_key``):
    what ``results.json`` says of them; ``specforge_scores``: what ``specforge/acc`` scores when it is not the
    served drafts."""

    walks: tuple[Figure, ...] = ()
    depth_counts: tuple[str, ...] = ()
    ratios: Ratios | None = None
    pooled: tuple[Figure, ...] = ()
    per_depth: tuple[DepthFigure, ...] = ()
    tables: tuple[FigureTable, ...] = ()
    section: str = ""
    # Figures the family computes in a pass of its own over the cache (``DrafterFamily.own_figures``), beside the
    # replay's: no interval (EAGLE-3: SpecForge's simulated_acc_len).
    own_pass: tuple[Figure, ...] = ()
    own_pass_prefix: str = ""  # the key prefix of the own pass's per-depth figures
    note_key: str = ""
    note: str = ""
    specforge_scores: str = ""

    def from_own_pass(self, key: str) -> bool:
        """Whether ``key`` is one of the figures of the family's own pass (the tools record them; a live
        evaluation does not run that pass)."""
        return any(f.key == key for f in self.own_pass) or bool(self.own_pass_prefix and
                                                                 key.startswith(self.own_pass_prefix))

    @property
    def walk_keys(self) -> tuple[str, ...]:
        return tuple(w.key for w in self.walks)

    def ratios_of(self, counts: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
        """``ratios`` of one sample's or a sum's counts; {} for a family without per-depth counts."""
        if self.ratios is None or not all(n in counts for n in self.depth_counts):
            return {}
        return self.ratios(counts)

    def remarks(self, metric: Callable[[str], float | None]) -> list[str]:
        """One line per walk whose tau is above the drafter's (``Figure.above_tau``), from ``metric(key)``."""
        tau = metric("tau")
        out = []
        for w in self.walks:
            value = metric(w.key)
            if w.above_tau and tau is not None and value is not None and value > tau:
                out.append(f"{w.above_tau} ({w.key} {value:.3f} > tau {tau:.3f})")
        return out

    def keys(self) -> tuple[str, ...]:
        """A key of every figure the family adds (its per-depth and table figures at their first depth and cell)."""
        keys = [f.key for f in (*self.walks, *self.pooled, *self.own_pass)]
        keys += [f.key(1) for f in self.per_depth] + [t.key(0, 0) for t in self.tables]
        keys += [k for k in (self.own_pass_prefix, self.note_key) if k]
        return tuple(keys)

    def namespaces(self) -> tuple[str, ...]:
        """The first segments of the family's metric keys (``selector`` of ``selector/recall``): a metric prefix
        must not end in one (``figures.metrics.key_namespaces``)."""
        return tuple(dict.fromkeys(k.split("/", 1)[0] for k in self.keys() if "/" in k))

    def labels(self, family_label: str) -> dict[str, str]:
        """Every figure's key -> its words, prefixed with the family's label."""
        return {f.key: f"{family_label}: {f.label}" for f in (*self.walks, *self.pooled)}


class DrafterFamily:
    """One drafter family (module docstring). Subclasses set the class attributes and implement what their
    drafters need; the defaults are what a family without that capability answers."""

    name: ClassVar[str]  # as results.json and DrafterSpec.family spell it
    label: ClassVar[str]  # in messages and tables
    architecture: ClassVar[str]  # the ``architectures`` entry of its published config
    kind: ClassVar[str]  # "block": one pass per block; "chain": one step per draft token
    # Whether a DDTree over the drafts is what a server verifies (a family whose depths depend on their parent
    # token drafts no such tree: its budgets are refused).
    supports_tree: ClassVar[bool] = True
    # Whether ``specforge/acc`` (SpecForge's accuracy of this drafter) is replayed; else it is left out, said why.
    specforge_accuracy: ClassVar[bool] = True
    figures: ClassVar[FamilyFigures] = FamilyFigures()
    # The speculative methods a server names when it serves this family (SGLang's ``speculative_algorithm``,
    # vLLM's ``method``, upper-cased): the served check compares only rounds of these.
    served_methods: ClassVar[tuple[str, ...]] = ("DFLASH",)
    # The prefix of this family's weights inside a target's own checkpoint, for a drafter the target ships (its
    # MTP head): ``checkpoints.load.extract_from_target`` reads them with ``config_from_target``'s config.
    target_prefix: ClassVar[str | None] = None
    # Weights a checkpoint of this family may leave out, the drafter then taking the target's (``build`` sees the
    # checkpoint's keys): a checkpoint is located by the rest.
    optional_keys: ClassVar[tuple[str, ...]] = ()
    # Config fields only this family's configs carry (``config_hints``), and what to add to a config that lacks
    # them (messages).
    config_fields: ClassVar[tuple[str, ...]] = ()

    def tree_refusal(self) -> str:
        """Why a drafter of this family is scored without DDTree (``supports_tree`` false)."""
        return (f"a {self.label} drafter drafts each depth from its parent token, so a DDTree of per-depth top-K is "
                "not what a server verifies")

    # -- recognising ---------------------------------------------------------
    def config_says(self, config: Any) -> bool:
        """Whether ``config`` names this family in its ``architectures``."""
        return self.architecture in (_get(config, "architectures") or ())

    def config_hints(self, config: Any) -> bool:
        """Whether a config that names no family carries a field only this family has."""
        cfg = _get(config, "dflash_config") or {}
        return any(f in cfg or _get(config, f) is not None for f in self.config_fields)

    def own_key(self, keys: Iterable[str]) -> str | None:
        """A weight name among ``keys`` that belongs to a part only this family has (how weights whose config
        says nothing are recognised), or None."""
        return None

    def how_to_say(self) -> str:
        """What a config must hold to say it is this family (messages)."""
        said = f"architectures [{self.architecture!r}]"
        return said + (f" and dflash_config's {', '.join(self.config_fields)}" if self.config_fields else "")

    def config_from_target(self, target_config: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
        """The drafter ``config.json`` of the drafter a target with ``target_config`` ships (``target_prefix``);
        a ValueError saying why when it ships none."""
        raise ValueError(f"a target does not ship a {self.label} drafter")

    # -- building ------------------------------------------------------------
    def spec(self, config: Any) -> DrafterSpec:
        raise NotImplementedError

    def module_class(self) -> type[nn.Module]:
        raise NotImplementedError

    def build(self, config: dict[str, Any], keys: Iterable[str] | None = None) -> nn.Module:
        """A freshly initialised drafter of this family from a ``config.json`` dict; ``keys``, when known, are the
        weight names of the checkpoint it will load (for a family whose checkpoints may leave out a part that is
        the target's)."""
        return self.module_class().from_config_dict(config)

    def relabel(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` saying this family (placeholders for fields it lacks: key names and shapes only)."""
        return {**config, "architectures": [self.architecture]}

    def published_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state dict with this family's keys as the published checkpoints spell them."""
        return state

    def adopt(self, module: nn.Module) -> nn.Module | None:
        """Our fast module sharing (not copying) the weights of a training loop's module of this family, or
        None when ``module`` is not one."""
        return None

    def tiny_fields(self, hidden_size: int) -> dict[str, Any]:
        """Small settings of the family's own config fields (``config_fields``), for demo and test drafters."""
        return {}

    # -- the cache, the cost -------------------------------------------------
    def cache_needs(self, spec: DrafterSpec, config: Any = None) -> CacheNeeds:
        """What a drafter of this family with ``spec`` (and its ``config``, when known) reads from a cache."""
        n_target = _get(config, "num_target_layers") if config is not None else None
        return CacheNeeds(self.label, tuple(spec.target_layer_ids), spec.target_hidden_size, spec.vocab_size,
                          int(n_target) if n_target is not None else None, spec.block_size, spec.mask_token_id)

    def block_cap(self, spec: DrafterSpec) -> int:
        """The largest block the replay may draft with this drafter: its trained block (a block drafter has no
        mask positions beyond it); a chain can unroll further."""
        return spec.block_size

    def draft_passes(self, block_size: int) -> int:
        """Drafter passes a cycle drafting blocks of ``block_size`` costs (the serving projection): one."""
        return 1

    def setting_label(self, block_size: int) -> str:
        """The greedy setting at ``block_size`` as tables name it."""
        return f"block {block_size}"

    def tree_candidates(self, spec: DrafterSpec) -> int | None:
        """How many children a DDTree node may have per position when fewer than the vocabulary (a family whose
        tree is over its own candidates), else None."""
        return None

    def tree_candidates_why(self, spec: DrafterSpec, block_size: int) -> str:
        """The words a budget above the tree's node limit is refused with, when ``tree_candidates`` sets it
        ("": the generic words)."""
        return ""

    def cost_fields(self, config: Any) -> dict[str, int]:
        """The evaluation cost model's fields this family adds (``costs.evaluation.DrafterShape``)."""
        return {}

    # -- the replay ----------------------------------------------------------
    def runner(self, drafter: Any, limits: MemoryLimits) -> DraftRunner | None:
        """The fastest exact runner for ``drafter`` if it is one of this family's modules, else None."""
        return None

    def callable_runner(self, fn: Any, spec: DrafterSpec, dtype: torch.dtype | None) -> DraftRunner | None:
        """A runner for a plain callable drafting for this family (``spec``), or None when the family's drafters
        must be modules."""
        return None

    def proposer(self, spec: DrafterSpec, module: Any, lm_head: torch.Tensor, mem_bytes: int,
                 embed: torch.Tensor | None = None) -> Proposer:
        """What this family's hidden states draft (``module``: the drafter, for weights beyond its blocks; None
        for a plain callable), with the target's head, its logits under ``mem_bytes``, and its input embedding
        ``embed`` (for a family that reads the tokens' embeddings)."""
        raise NotImplementedError

    def own_figures(self, cache: Any, drafter: Any, block_size: int, sample_ids: Sequence[str],
                    head: Any = None) -> dict[str, float]:
        """The family's ``figures.own_pass`` on ``cache`` (the samples ``sample_ids``) for ``drafter`` drafting blocks
        of ``block_size``, with the target ``head`` the evaluation holds (None: the cache's, loaded): {} for a
        family without them."""
        return {}

    def specforge_difference(self, config: Any, block_size: int) -> str | None:
        """Why SpecForge 0.2.0 trains a drafter of this config under other masks than it is served with."""
        return None

    # -- training ------------------------------------------------------------
    def extra_loss(self, drafter: Any, hidden: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor,
                   target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """What this family adds to the block objective (``training.dflash_loss``), or None."""
        return None

    def __repr__(self) -> str:
        return f"<drafter family {self.name}>"


class BlockFamily(DrafterFamily):
    """Drafters that propose a block in one pass over the cached context, from the verified token and a filler
    token at every other position (DFlash and the families on its backbone): the published ``dflash_config``
    format."""

    kind = "block"

    def spec(self, config: Any) -> DrafterSpec:
        ids = config_value(config, "target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(_get(config, "num_target_layers"), _get(config, "num_hidden_layers"))
        ids = layer_id_list(ids, "dflash_config.target_layer_ids")
        mask = config_value(config, "mask_token_id")
        if mask is None:
            raise ValueError(f"a {self.label} drafter config has no mask_token_id (expected in dflash_config)")
        softcap = config_value(config, "final_logit_softcapping")
        return DrafterSpec(
            block_size=int_field(config_value(config, "block_size", 16), "block_size"),
            target_layer_ids=tuple(ids),
            # The context features are target hidden states; the published format assumes equal widths.
            target_hidden_size=int(_get(config, "target_hidden_size") or _get(config, "hidden_size")),
            vocab_size=int_field(_get(config, "vocab_size"), "vocab_size"),
            mask_token_id=int_field(mask, "mask_token_id"),
            input_embedding_scale=float(config_value(config, "input_embedding_scale", 1.0) or 1.0),
            output_multiplier=float(config_value(config, "output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
            family=self.name,
            options=self.spec_options(config),
        )

    def spec_options(self, config: Any) -> tuple[tuple[str, Any], ...]:
        """The family's own spec settings (``DrafterSpec.options``)."""
        return ()


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)
