"""Reference numbers to show next to a live drafter: measured baselines and published figures.

Two kinds, never mixed up:

- **measured**: a ``results.json`` written by ``tools/eval_drafter.py`` for a reference drafter
  (e.g. the public z-lab drafter) *on the same cache*. It is refused when its cache manifest hash
  differs (``results.load_results``). When the live evaluation scores only a subset of the
  samples, the baseline's tau, DDTree tau and per-category tau are recomputed on that same subset
  from its per-sample acceptance lengths, so "ours vs reference" compares like with like.
- **published**: figures reported by papers (``configs/baselines/published.yaml``), with their
  source. They were measured on other prompts and hardware: context, not a like-for-like
  comparison. Entries marked ``placeholder: true`` or whose values are null are never logged.
  Each entry declares the convention of its acceptance length (``CONVENTIONS``: pooled over cycles,
  mean over requests, or SGLang's served per-request figure) and is shown only beside the live
  figure of that convention (docs/method.md, "Conventions").
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...cache.states import StateCache
from ...common.arguments import metric_segment
from ...common.errors import DFlashCBError
from ..figures.bootstrap import metric_sums
from ..figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    CHAIN_TAU_ESTIMATE,
    CI_HIGH_SUFFIX,
    CI_LOW_SUFFIX,
    SERVED_BASELINE,
    SPECFORGE_ACC,
    TAU,
    TAU_REQUEST_MEAN,
    category_tau,
    category_tau_request_mean,
    ddtree_tau,
)
from .results_file import Results, SampleRecord, load_results, series_mismatch

MEASURED = "measured"
PUBLISHED = "published"
SERVED = "served"  # the server's own counters, stored by the precompute (dflash_cb/cache/served.py)

# A published acceptance length's convention -> the live metric that uses the same one.
CONVENTIONS = {
    "pooled": TAU,  # all committed tokens over all cycles
    "request_mean": TAU_REQUEST_MEAN,  # dflash.benchmark "Average Acceptance length"
    "served_request_mean": ACCEPT_LENGTH_SERVED,  # mean of SGLang's per-request spec_accept_length
}


@dataclass
class Baseline:
    """One reference: unprefixed metric names (as in ``metrics.summarize``) and where they come from."""

    name: str
    kind: str  # MEASURED or PUBLISHED
    metrics: dict[str, float]
    per_depth: list[float] | None = None  # unconditional acceptance at depths 1..block_size-1
    source: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    # Measured baselines: the per-sample lengths (restricted to the live evaluation's samples), for
    # the paired difference ``live - baseline`` (``compare.delta_metrics``).
    samples: list[SampleRecord] | None = None
    budgets: tuple[int, ...] = ()
    series: dict[str, Any] = field(default_factory=dict)  # what identifies a measured file's figures (Results.series)

    @property
    def label(self) -> str:
        if self.kind == SERVED:
            subset = self.details.get("of")
            over = f", over {self.details['samples']} of {subset} samples" if subset and subset != self.details.get(
                "samples") else ""
            return f"{self.name} (served, measured online{over})"
        if self.kind == PUBLISHED:
            return f"{self.name} (published, not measured here; {self.details.get('convention', 'pooled')})"
        return f"{self.name} (reference)"

    @property
    def key(self) -> str:
        """Metric-name segment: ``baseline/<name>``, ``baseline/served`` or ``published/<name>``."""
        if self.kind == SERVED:
            return SERVED_BASELINE
        return f"{'published' if self.kind == PUBLISHED else 'baseline'}/{metric_segment(self.name)}"


def _finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# -- measured -----------------------------------------------------------------------------

def load_measured(path: str | os.PathLike, cache: StateCache, name: str | None = None,
                  sample_ids: Sequence[str] | None = None, series: Mapping[str, Any] | None = None) -> Baseline:
    """A ``results.json`` as a baseline; refused if it was measured on another cache.

    ``sample_ids``: the samples the live evaluation scores. Tau, DDTree tau and per-category tau
    are recomputed on them; per-depth acceptance (stored aggregated) stays the whole-cache figure.
    ``series``: what identifies the live evaluation's figures (``request.EvalRequest.series``; the names it
    holds are compared); a file measured with another block, tail convention or compute dtype (or that does
    not say) is warned about (``RuntimeWarning``), as ``tools/compare_results.py`` does.
    """
    res = load_results(path, cache)
    if series is not None:
        mismatch = series_mismatch([("this run", series),
                                    (f"baseline {path}", {k: res.series.get(k) for k in series})])
        if mismatch:
            warnings.warn(mismatch, RuntimeWarning, stacklevel=2)
    name = name or Path(path).stem
    # Every scalar the file holds (one place: ``Results.metrics``), intervals and breakdowns included.
    metrics = {k: v for k, v in ((k, _finite(x)) for k, x in res.metrics.items()) if v is not None}
    per_depth = [(_finite(v) if _finite(v) is not None else math.nan)
                 for v in res.per_depth.get("unconditional") or []] or None
    details: dict[str, Any] = {
        "path": str(path),
        "cache_manifest_sha256": res.manifest_sha256,
        "drafter": res.drafter_path,
        "dtype": res.meta.get("dtype"),
        "block_size": res.block_size,
        "tail_blocks": res.tail_blocks,
        "samples_in_file": len(res.samples),
        "family": res.family,
    }
    samples = res.samples
    if sample_ids is not None:
        samples = _restrict(metrics, res, list(sample_ids), details)
    return Baseline(name, MEASURED, metrics, per_depth, source=f"tools/eval_drafter.py -> {path}", details=details,
                    samples=samples, budgets=tuple(res.budgets), series=res.series)


def _restrict(metrics: dict[str, float], res: Results, ids: list[str], details: dict[str, Any]) -> list[SampleRecord]:
    """Recompute the per-sample-derived metrics on ``ids`` (the live evaluation's samples); returns those samples."""
    by_id = {s.id: s for s in res.samples}
    if set(ids) == set(by_id):
        return [by_id[i] for i in ids]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"{details['path']}: the baseline has no results for {len(missing)} of the evaluated "
                         f"samples (e.g. {missing[:3]}); rerun tools/eval_drafter.py on the whole cache")
    chosen = [by_id[i] for i in ids]
    # Whole-file figures that depend on which samples were scored are dropped; tau, DDTree and
    # per-category tau are recomputed on the subset (the same per-sample sums as the intervals).
    for k in [k for k in metrics if k.startswith(("category/", "position/", "cycle/")) or k.endswith(
            (CI_LOW_SUFFIX, CI_HIGH_SUFFIX))]:
        del metrics[k]
    for k, sums in metric_sums(chosen, res.budgets, sorted({s.category for s in chosen})).items():
        if sums.cycles.sum() > 0:
            metrics[k] = sums.value
    # Aggregated in the file: cannot be restricted, so they describe the whole cache.
    details["subset"] = f"{len(ids)} of {len(by_id)} samples (tau, DDTree, per-category recomputed on the subset; " \
                        "per-depth and all-anchor figures are whole-cache)"
    return chosen


def load_served(cache: StateCache, sample_ids: Sequence[str] | None = None) -> Baseline | None:
    """The served drafter's online tau from the counters the precompute stored, or None if there are none.

    Tau in the replay's convention (``served.served_rounds_and_tau``), pooled over ``sample_ids``
    that have counters. Measured by the server on its hardware, not replayed here.
    """
    from ...cache.served import served_block_size, served_tau

    config = cache.manifest.served_spec_config or {}
    got = served_tau(cache.samples, sample_ids, served_block_size(config))
    if got is None:
        return None
    tau, rounds, n = got
    path = config.get("draft_model_path")
    name = Path(str(path).rstrip("/")).name if path else "served"
    counted = ("vLLM's /metrics deltas per request (spec_decode_num_drafts)" if config.get("server") == "vllm"
               else "SGLang spec_verify_ct")
    evaluated = len(sample_ids) if sample_ids is not None else len(cache.samples)
    details: dict[str, Any] = {"samples": n, "rounds": rounds, "server": config, "of": evaluated}
    if n < evaluated:  # beside a tau over every evaluated sample: say it is another set
        details["subset"] = (f"{n} of {evaluated} samples: those whose served counters count (tools/eval_drafter.py "
                             "--served-check lists why the others do not)")
    return Baseline(name, SERVED, {TAU: tau}, None,
                    source=f"{counted} stored in {cache.path} by the precompute", details=details)


# -- published ----------------------------------------------------------------------------

@dataclass
class PublishedFile:
    baselines: list[Baseline]
    skipped: list[str]  # "name: why" for placeholder or empty entries


class PublishedError(DFlashCBError, ValueError):
    """A published-figures file that cannot be used as it is; the message names the file, entry and field."""


_ENTRY_FIELDS = ("name", "source", "url", "target", "drafter", "setting", "placeholder", "convention", "metrics",
                 "per_depth", "note")
# Figures a paper may report that the live evaluation logs too, pooled (``tau`` goes by the convention).
_POOLED_FIGURES = (ALL_ANCHOR_TAU, CHAIN_TAU_ESTIMATE, SPECFORGE_ACC)
_FRACTIONS = (SPECFORGE_ACC,)  # a share of matches, in [0, 1]; every other figure is a length, >= 1
# The live per-category figure of each convention (a served per-request figure exists over the whole cache only).
_PER_CATEGORY = {"pooled": category_tau, "request_mean": category_tau_request_mean}


def load_published(path: str | os.PathLike, names: Sequence[str] | None = None,
                   budgets: Sequence[int] | None = None) -> PublishedFile:
    """Read the published-figures YAML. Placeholders and entries without numbers are skipped, not logged.

    Format: ``entries: [{name, source, url?, target?, drafter?, setting?, placeholder?,
    convention, metrics: {tau: 6.5, ddtree/tau_b32: ...}, per_depth: [...]?, note?}]``. Metric names are
    the unprefixed names of ``dflash_cb.core.figures.metrics`` (``tau``, ``ddtree/tau_b<B>``, ...). ``convention``
    (required, ``CONVENTIONS``) says how the paper averaged its ``tau``; it is stored under the live
    metric of that convention (``published_metric``), so it is only ever shown beside that one.

    Everything is checked, placeholders included: ``PublishedError`` names the file (and line, for a
    YAML error), the entry and the field for an unknown field or metric, a value that is not a number
    or null (``"6,5"``), a figure no convention allows (a tau below 1, an accuracy outside [0, 1]), a
    ``placeholder`` that is not true/false, two names logged under one key, an entry of ``names`` that
    has no numbers to log, and with ``budgets`` (the live DDTree budgets) a DDTree figure at another budget.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PublishedError(f"{path}: no such published-figures file (see configs/baselines/published.yaml)") from None
    except UnicodeDecodeError as e:
        raise PublishedError(f"{path}: not a text file ({e.reason} at byte {e.start}); give the YAML of published "
                             "figures (configs/baselines/published.yaml)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PublishedError(f"{path}{at}: not valid YAML ({problem}); see configs/baselines/published.yaml "
                             "for the format") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise PublishedError(f"{path}: expected a top-level 'entries:' list")
    wanted = set(names) if names is not None else None
    out: list[Baseline] = []
    skipped: list[str] = []
    seen: dict[str, str] = {}  # metric segment -> entry name
    for i, e in enumerate(entries):
        name, convention, metrics, per_depth = _published_entry(path, i, e, seen)
        if wanted is not None and name not in wanted:
            continue
        why = (f"placeholder ({e.get('note', 'value not verified')})" if e.get("placeholder")
               else None if metrics or per_depth else "no numbers")
        if why is not None:
            if wanted is not None:
                raise PublishedError(f"{path}: entry {name!r} is requested (published_entries) but has "
                                     f"{'no numbers' if why == 'no numbers' else 'placeholder: true'}; verify its "
                                     "figures and fill them in, or leave it out of published_entries")
            skipped.append(f"{name}: {why}")
            continue
        if budgets is not None:
            _check_budgets(f"{path}: entry {name!r}", metrics, budgets)
        details = {k: e[k] for k in ("url", "target", "drafter", "setting", "note", "convention")
                   if e.get(k) is not None}
        out.append(Baseline(name, PUBLISHED, metrics, per_depth, source=str(e["source"]), details=details))
    if wanted is not None:
        unknown = sorted(wanted - set(seen.values()))
        if unknown:
            raise PublishedError(f"{path}: no entries named {unknown}; known: {sorted(seen.values())}")
    return PublishedFile(out, skipped)


def _published_entry(path: Path, i: int, e: Any, seen: dict[str, str]
                     ) -> tuple[str, str, dict[str, float], list[float] | None]:
    """One entry checked: (name, convention, figures under their live names, per-depth acceptance)."""
    if not isinstance(e, dict) or not _text(e.get("name")) or not _text(e.get("source")):
        raise PublishedError(f"{path}: entry {i} needs at least 'name' and 'source' (non-blank text)")
    name = e["name"]
    where = f"{path}: entry {name!r}"
    unknown = sorted(str(k) for k in e if k not in _ENTRY_FIELDS)
    if unknown:
        raise PublishedError(f"{where}: unknown field(s) {unknown}; an entry has {', '.join(_ENTRY_FIELDS)}")
    key = metric_segment(name)
    if key in seen:
        raise PublishedError(f"{where}: " + (f"duplicate entry name {name!r}" if seen[key] == name else
                             f"logged as published/{key}/... like entry {seen[key]!r}; rename one of them"))
    seen[key] = name
    convention = e.get("convention")
    if convention not in CONVENTIONS:
        raise PublishedError(f"{where} has convention {convention!r}; declare how its acceptance "
                             f"length was averaged: one of {sorted(CONVENTIONS)} (docs/method.md, \"Conventions\")")
    if not isinstance(e.get("placeholder", False), bool):
        raise PublishedError(f"{where}: placeholder is {e['placeholder']!r}; write true or false (unquoted)")
    raw = e.get("metrics")
    if raw is not None and not isinstance(raw, dict):
        raise PublishedError(f"{where}: metrics is {raw!r}; expected {{metric: value}}, e.g. {{tau: 6.5}}")
    metrics: dict[str, float] = {}
    for k, v in (raw or {}).items():
        live = published_metric(str(k), convention, where)
        value = _figure(f"{where}: metrics.{k}", v, fraction=k in _FRACTIONS)
        if value is not None:
            metrics[live] = value
    per_depth = e.get("per_depth")
    if per_depth is not None:
        if not isinstance(per_depth, list):
            raise PublishedError(f"{where}: per_depth is {per_depth!r}; expected a list of acceptances, depth 1 first")
        per_depth = [_figure(f"{where}: per_depth[{d}]", v, fraction=True) for d, v in enumerate(per_depth)]
        per_depth = [math.nan if v is None else v for v in per_depth] if any(v is not None for v in per_depth) else None
    return name, convention, metrics, per_depth


def _text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def _figure(where: str, v: Any, fraction: bool) -> float | None:
    """A published value: a finite number (None: not known yet), one a convention allows."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PublishedError(f"{where} is {v!r}, not a number; write it as a number (6.5) or null")
    if fraction and not 0.0 <= v <= 1.0:
        raise PublishedError(f"{where} is {v!r}: an acceptance is a fraction in [0, 1]")
    if not fraction and v < 1.0:
        raise PublishedError(f"{where} is {v!r}: an acceptance length is at least 1 (every cycle commits the "
                             "target's own token; docs/method.md)")
    return float(v)


def _check_budgets(where: str, metrics: dict[str, float], budgets: Sequence[int]) -> None:
    live = {ddtree_tau(b) for b in budgets}
    other = sorted(m for m in metrics if m.startswith("ddtree/") and m not in live)
    if other:
        raise PublishedError(f"{where}: metrics.{other[0]} has no live counterpart (the DDTree budgets evaluated are "
                             f"{sorted(budgets)}); drop it or evaluate that budget")


def published_metric(metric: str, convention: str, where: str) -> str:
    """The live metric a published figure stands beside: its ``tau`` goes to the convention's metric.

    ``category/<c>/tau`` (a figure over one benchmark's prompts) goes to the convention's per-category metric
    (``category_tau``, ``category_tau_request_mean``). Other figures (DDTree tau, ...) exist live only pooled,
    so a non-pooled entry may give only those two.
    A name the live evaluation never logs (a typo, a per-request name given directly) is refused.
    """
    if metric == TAU:
        return CONVENTIONS[convention]
    if metric in CONVENTIONS.values():
        given = next(c for c, m in CONVENTIONS.items() if m == metric)
        raise PublishedError(f"{where}: metrics.{metric}: give it as tau with convention: {given}")
    category = re.fullmatch(r"category/([^/]+)/(.+)", metric)
    if category and category[2] != TAU and category[2] in CONVENTIONS.values():
        given = next(c for c, m in CONVENTIONS.items() if m == category[2])
        raise PublishedError(f"{where}: metrics.{metric}: give it as category/{category[1]}/tau with convention: "
                             f"{given}")
    if category and category[2] == TAU:
        if convention not in _PER_CATEGORY:
            raise PublishedError(f"{where}: {metric!r} under convention {convention!r}: per category dflash-cb "
                                 f"measures {' and '.join(sorted(_PER_CATEGORY))} only; give it in an entry with one "
                                 "of those, or drop it")
        # A figure over one benchmark's prompts: the convention's figure over that category's requests.
        return _PER_CATEGORY[convention](category[1])
    if not (metric in _POOLED_FIGURES or re.fullmatch(r"ddtree/tau_b[1-9][0-9]*", metric)
            or re.fullmatch(r"category/[^/]+/tau", metric)):
        raise PublishedError(f"{where}: metrics.{metric}: not a figure dflash-cb logs; use tau, ddtree/tau_b<budget>, "
                             f"category/<category>/tau, {', '.join(_POOLED_FIGURES)}")
    if convention != "pooled":
        raise PublishedError(f"{where}: {metric!r} under convention {convention!r}: dflash-cb measures it pooled only; "
                             "give it in an entry with convention: pooled, or drop it")
    return metric


# -- what gets logged -----------------------------------------------------------------------

# Headline figures logged as constant series next to the live ones (per-depth goes to the chart).
def is_headline(metric: str) -> bool:
    if metric.endswith((CI_LOW_SUFFIX, CI_HIGH_SUFFIX)):
        return False  # a baseline's own intervals stay in the run summary, not as series
    return metric in (TAU, TAU_REQUEST_MEAN, ACCEPT_LENGTH_SERVED, ALL_ANCHOR_TAU, SPECFORGE_ACC,
                      CHAIN_TAU_ESTIMATE) or metric.startswith(("ddtree/", "category/"))


def baseline_scalars(baselines: Sequence[Baseline], prefix: str) -> dict[str, float]:
    """``{prefix}{baseline|published}/<name>/<metric>`` for the headline metrics of every baseline."""
    out: dict[str, float] = {}
    for b in baselines:
        for k, v in b.metrics.items():
            if is_headline(k):
                out[f"{prefix}{b.key}/{k}"] = v
    return out
