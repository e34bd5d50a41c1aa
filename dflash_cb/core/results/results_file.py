"""``results.json``: what an evaluation measured, and enough metadata to know later what it was.

One typed, versioned schema (``Results``), written by ``write_results`` and read by
``load_results``, nowhere else. Every scalar lives once, in ``metrics`` (names from
``dflash_cb.core.figures.metrics``: ``tau``, ``ddtree/tau_b32``, ``category/<c>/tau``, their ``_ci_low`` /
``_ci_high`` bootstrap intervals, ``position/<b>/tau``, ``cycle/<b>/tau``, ...). The per-sample
acceptance lengths (greedy and DDTree) are kept too, so any figure can be recomputed on a subset
of samples (``baselines``) or compared sample by sample (``compare``).

Written by ``tools/eval_drafter.py`` and the demo; read back as a baseline by the callback, which
refuses a baseline measured on another cache (the manifest hash differs), and by
``tools/compare_results.py``. Version 5 adds the drafter's family (``meta.drafter_family``) and what a
family measures besides DFlash's (a DFlash 2 drafter: each sample's ``walks``, the lengths of its
unary-argmax and perfect-selector replays, and a ``selector_recall`` count in its anchor statistics;
``per_depth.selector_recall`` / ``selector_acc``); version 4 added each sample's anchor statistics (its
offset and integer counts per statistics stride, ``anchor_statistics``) and ``meta.anchor_seed``. Versions 3
and 4 are read as DFlash evaluations (version 3 files with no anchor statistics: their figures have no
intervals, and their statistics set started every sample at its first anchor). The development formats
before version 3 are refused with the command that writes the file again.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...cache.identity import cache_difference
from ...cache.states import StateCache
from ...common.arguments import is_int
from ...common.cli import describe_os_error
from ...common.errors import DFlashCBError
from ...common.fileio import atomic_write_text, check_outputs_apart, output_path
from ...common.version import __version__
from ..drafters.registry import family_named, family_names
from ..drafters.spec import DEFAULT_FAMILY
from ..figures.bootstrap import DEFAULT_RESAMPLES
from ..figures.derived import derived_metrics
from ..figures.metrics import (
    ANCHOR_SEED,
    ANCHOR_STRIDE,
    ANCHORS_DRAFTED,
    ANCHORS_NEEDED,
    T1_TAU_ESTIMATE,
    TAU,
    AnchorCounts,
    per_depth,
)
from ..figures.positions import (
    DEFAULT_POSITION_EDGES,
)
from ..loop.cycles import TAIL_BLOCKS
from ..replay import QUANTITY, EvalReport, series_names

RESULTS_FORMAT = "dflash-cb-results"
RESULTS_VERSION = 5
T1_NOTE = ("estimate: expected accepted length at temperature 1 from per-depth overlap sum_x min(p, q) "
           "with the target's stored top-K log-probs, along the greedy path; not an exact replay")
INTERVAL_NOTE = ("95% cluster-bootstrap percentile intervals over samples (whole samples resampled with their "
                 "cycles): uncertainty from the choice of prompts, for this cache's prompt distribution")


class ResultsError(DFlashCBError, ValueError):
    """A results.json that cannot be read or does not belong with the cache it is used with."""


@dataclass
class SampleRecord:
    """One scored sample: the same fields as ``engine.SampleResult`` that the metrics need."""

    id: str
    category: str
    acceptance_lengths: list[int]
    ddtree: dict[int, list[int]] = field(default_factory=dict)
    # Per statistics stride: the sample's offset and its anchor-statistic counts (version 4 on).
    anchor_offsets: dict[int, int] = field(default_factory=dict)
    anchor_counts: dict[int, AnchorCounts] = field(default_factory=dict)
    # The drafter family's own walks by their tau key (version 5 on; DFlash 2: the unary path, a perfect selector).
    walks: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "category": self.category, "acceptance_lengths": list(self.acceptance_lengths),
               "ddtree": {str(b): list(v) for b, v in sorted(self.ddtree.items())}}
        if self.walks:
            out["walks"] = {k: list(v) for k, v in self.walks.items()}
        if self.anchor_counts:
            out["anchor_statistics"] = {str(k): {"offset": self.anchor_offsets[k], **c.to_dict()}
                                        for k, c in sorted(self.anchor_counts.items())}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleRecord:
        if not isinstance(d, dict):
            raise ValueError(f"a sample entry is a {type(d).__name__}, expected an object")
        dd = d.get("ddtree") or {}
        if not isinstance(dd, dict):
            raise ValueError(f"sample {d.get('id')!r}: 'ddtree' is a {type(dd).__name__}; expected "
                             "{budget: [acceptance lengths]}")
        walks = d.get("walks") or {}
        if not isinstance(walks, dict):
            raise ValueError(f"sample {d.get('id')!r}: 'walks' is a {type(walks).__name__}; expected "
                             "{walk: [acceptance lengths]}")
        offsets, counts = _anchor_statistics(d.get("anchor_statistics") or {}, d.get("id"))
        return cls(str(d["id"]), str(d.get("category", "")), _lengths(d["acceptance_lengths"], d.get("id")),
                   {_budget(b, d.get("id")): _lengths(v, d.get("id"), f"ddtree {b!r}") for b, v in dd.items()},
                   offsets, counts, {str(k): _lengths(v, d.get("id"), f"walk {k!r}") for k, v in walks.items()})

    @classmethod
    def of(cls, s: Any) -> SampleRecord:
        """The record of a scored ``engine.SampleResult``."""
        return cls(s.id, s.category, list(s.acceptance_lengths), {b: list(v) for b, v in s.ddtree.items()},
                   dict(s.anchor_offsets), dict(s.anchor_counts), {k: list(v) for k, v in s.walks.items()})


@dataclass
class Results:
    """The content of a ``results.json`` (version 5)."""

    metrics: dict[str, float | None]
    samples: list[SampleRecord]
    per_depth: dict[str, list[float | None]]
    histogram: dict[str, int]  # produced value -> cycles
    meta: dict[str, Any]  # cache_path, cache_manifest_sha256, block_size, ddtree_budgets, drafter, ...
    breakdown: dict[str, Any] = field(default_factory=dict)  # position_edges, position, cycle tables
    notes: dict[str, str] = field(default_factory=dict)

    # -- accessors: the one way to read a figure ---------------------------------------------
    def metric(self, name: str) -> float | None:
        v = self.metrics.get(name)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    @property
    def tau(self) -> float | None:
        return self.metric(TAU)

    @property
    def budgets(self) -> list[int]:
        return [int(b) for b in self.meta.get("ddtree_budgets") or []]

    @property
    def categories(self) -> list[str]:
        return sorted({s.category for s in self.samples})

    @property
    def manifest_sha256(self) -> str | None:
        return self.meta.get("cache_manifest_sha256")

    @property
    def drafter_path(self) -> str | None:
        """The scored drafter's path (``meta.drafter``)."""
        d = self.meta.get("drafter")
        path = d.get("path") if isinstance(d, dict) else d
        return str(path) if path else None

    @property
    def drafter_step(self) -> int | None:
        """The scored checkpoint's global step, when known."""
        d = self.meta.get("drafter")
        return d.get("global_step") if isinstance(d, dict) else None

    @property
    def block_size(self) -> int | None:
        b = self.meta.get("block_size")
        return int(b) if b is not None else None

    @property
    def family(self) -> str:
        """The scored drafter's family (``registry.family_names``); files before version 5 scored DFlash drafters."""
        return str(self.meta.get("drafter_family") or DEFAULT_FAMILY)

    @property
    def series(self) -> dict[str, Any]:
        """What identifies these figures (``request.series_names``), as recorded (None: not recorded)."""
        return {name: self.meta.get(name) for name in series_names()}

    @property
    def tail_blocks(self) -> str | None:
        """The replay's tail-block convention (``replay.TAIL_BLOCKS``), None when the file does not say."""
        return self.meta.get("tail_blocks")

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, "meta": self.meta,
                "metrics": {k: _clean(v) for k, v in self.metrics.items()},
                "per_depth": self.per_depth, "histogram": self.histogram, "breakdown": self.breakdown,
                "notes": self.notes, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "results") -> Results:
        if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
            raise ResultsError(f"{where}: not a dflash-cb results file (format {_get(data, 'format')!r}); "
                               "produce it with tools/eval_drafter.py")
        version = data.get("version")
        if version in (1, 2):
            raise ResultsError(f"{where}: results version {version}, a development format this version no longer "
                               "reads; rerun tools/eval_drafter.py on the drafter to write it again")
        if version not in (3, 4, RESULTS_VERSION):
            raise ResultsError(f"{where}: results version {version!r} is not known to dflash-cb {__version__} "
                               f"(it reads 3 to {RESULTS_VERSION}); upgrade dflash-cb or rerun tools/eval_drafter.py")
        try:
            res = cls(dict(data.get("metrics") or {}), [SampleRecord.from_dict(s) for s in data.get("samples") or []],
                      dict(data.get("per_depth") or {}), dict(data.get("histogram") or {}),
                      dict(data.get("meta") or {}), dict(data.get("breakdown") or {}), dict(data.get("notes") or {}))
            _check_meta(res.meta, where)
        except ResultsError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ResultsError(f"{where}: damaged results file ({what}); rerun "
                               "tools/eval_drafter.py to write it again") from e
        check_fields(res, where)
        check_samples(res.samples, res.block_size, where)
        return res


def _lengths(values: Any, sample: Any, what: str = "acceptance_lengths") -> list[int]:
    if not isinstance(values, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise ValueError(f"sample {sample!r}: {what} must be a list of integers, got {str(values)[:60]}")
    return list(values)


def _anchor_statistics(data: Any, sample: Any) -> tuple[dict[int, int], dict[int, AnchorCounts]]:
    """``{stride: {"offset": o, <AnchorCounts fields>}}`` -> (offsets, counts) by stride."""
    if not isinstance(data, dict):
        raise ValueError(f"sample {sample!r}: 'anchor_statistics' is a {type(data).__name__}; expected "
                         "{stride: {offset, anchors, ...}}")
    offsets, counts = {}, {}
    for key, entry in data.items():
        stride = _budget(key, sample, "anchor statistics stride")
        if not isinstance(entry, dict):
            raise ValueError(f"sample {sample!r}: anchor statistics of stride {key!r} are not an object")
        fields = dict(entry)
        offset = fields.pop("offset", None)
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < stride:
            raise ValueError(f"sample {sample!r}: anchor statistics of stride {stride}: offset {offset!r} is not "
                             f"an integer in [0, {stride})")
        try:
            counts[stride] = AnchorCounts.from_dict(fields)
        except ValueError as e:
            raise ValueError(f"sample {sample!r}, stride {stride}: {e}") from None
        offsets[stride] = offset
    return offsets, counts


def _budget(key: Any, sample: Any, what: str = "ddtree budget") -> int:
    try:
        b = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"sample {sample!r}: {what} {key!r} is not an integer") from None
    if b < 1:
        raise ValueError(f"sample {sample!r}: {what} {key!r} is not positive")
    return b


def check_samples(samples: list[SampleRecord], block_size: int | None, where: str) -> None:
    """Each sample once, and every acceptance length a cycle can produce (``1..block_size``).

    A sample id twice would make any reader keep one copy silently (and move a comparison); a
    length outside the range cannot come from a replay and would make every figure wrong.
    """
    dup = sorted(i for i, n in Counter(s.id for s in samples).items() if n > 1)
    if dup:
        raise ResultsError(f"{where}: sample id(s) {dup[:5]}{' ...' if len(dup) > 5 else ''} appear more than once "
                           "(a results file scores each sample once): rerun tools/eval_drafter.py to write it again")
    hi = block_size if block_size and block_size >= 1 else None
    for s in samples:
        for what, lens in (("acceptance_lengths", s.acceptance_lengths),
                           *((f"ddtree budget {b}", v) for b, v in sorted(s.ddtree.items())),
                           *((f"walk {k}", v) for k, v in sorted(s.walks.items()))):
            bad = [x for x in lens if x < 1 or (hi is not None and x > hi)]
            if bad:
                rng = f"1..{hi} (block_size)" if hi is not None else ">= 1"
                raise ResultsError(f"{where}: sample {s.id!r}: {what} holds {bad[:3]}, outside {rng}: not lengths "
                                   "a replay produces; rerun tools/eval_drafter.py to write the file again")


_RERUN = "rerun tools/eval_drafter.py to write it again"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_meta(meta: Any, where: str) -> None:
    """The meta fields readers compute with: nothing is coerced (``"16"`` is not a budget, ``True`` not a size)."""
    if not isinstance(meta, dict):
        raise ResultsError(f"{where}: 'meta' is a {type(meta).__name__}, expected an object; {_RERUN}")
    budgets = meta.get("ddtree_budgets")
    if budgets is not None and (not isinstance(budgets, list) or not all(
            is_int(b) and b >= 1 for b in budgets) or len(set(budgets)) != len(budgets)):
        raise ResultsError(f"{where}: meta.ddtree_budgets is {budgets!r}, expected a list of distinct positive "
                           f"integers; {_RERUN}")
    block = meta.get("block_size")
    if block is not None and not (is_int(block) and block >= 1):
        raise ResultsError(f"{where}: meta.block_size is {block!r}, expected a positive integer; {_RERUN}")
    family = meta.get("drafter_family")
    if family is not None and family not in family_names():
        raise ResultsError(f"{where}: meta.drafter_family is {family!r}, expected one of {', '.join(family_names())}; "
                           f"{_RERUN}")
    tail = meta.get("tail_blocks")
    if tail is not None and tail not in TAIL_BLOCKS:
        raise ResultsError(f"{where}: meta.tail_blocks is {tail!r}, expected one of {', '.join(TAIL_BLOCKS)} "
                           f"(docs/method.md, \"Tail blocks\"); {_RERUN}")


def check_fields(res: Results, where: str) -> None:
    """Every figure a reader uses is a number (or null): a string ``tau`` would otherwise vanish from the
    series without a word. Per-sample DDTree lengths exist exactly for the file's budgets."""
    bad = {k: v for k, v in res.metrics.items() if v is not None and not _is_number(v)}
    if bad:
        k, v = next(iter(bad.items()))
        raise ResultsError(f"{where}: metrics.{k} is {v!r}, not a number"
                           + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + f"; {_RERUN}")
    for name, values in res.per_depth.items():
        if not isinstance(values, list) or not all(v is None or _is_number(v) for v in values):
            raise ResultsError(f"{where}: per_depth.{name} is {str(values)[:60]}, expected a list of numbers; {_RERUN}")
    for n, count in res.histogram.items():
        if not (str(n).isdigit() and is_int(count) and count >= 0):
            raise ResultsError(f"{where}: histogram entry {n!r}: {count!r}, expected \"<length>\": <cycles>; {_RERUN}")
    budgets = set(res.budgets)
    stray = sorted({b for s in res.samples for b in s.ddtree} - budgets)
    if stray:
        raise ResultsError(f"{where}: samples hold DDTree lengths for budget(s) {stray}, not in meta.ddtree_budgets "
                           f"{sorted(budgets)}; {_RERUN}")
    scored = [s for s in res.samples if s.acceptance_lengths]
    empty = sorted(b for b in budgets if scored and not any(s.ddtree.get(b) for s in scored))
    if empty:
        raise ResultsError(f"{where}: meta.ddtree_budgets lists {empty} but no sample holds DDTree lengths for "
                           f"{'it' if len(empty) == 1 else 'them'}; {_RERUN}")


def series_mismatch(labelled: Sequence[tuple[str, Mapping[str, Any]]], kind: str | None = QUANTITY,
                    blocks_compared: bool = False, chain: bool = False) -> str | None:
    """What to say when evaluations set side by side were measured with different settings of what
    identifies a series (``request.series_fields``: by default the quantities, the block drafted, the tail
    convention, the compute dtype; ``kind=None`` adds the anchor set), or one does not record one: their
    figures are not like for like. None when they agree. ``labelled``: (label, its series: ``Results.series``,
    ``EvalRequest.series``); a name some record does not hold at all is not compared (a value None is: it was
    not recorded). ``blocks_compared`` (compare_results, a sweep across blocks): blocks that differ are a comparison
    of blocks (``chain``: a chain drafter's lengths K, block - 1), said as one: tau grows with the block, so it does
    not rank them; elsewhere (a baseline of the live run) another block is not like for like."""
    clauses, blocks = [], None
    for name in series_names(kind):
        if not all(name in record for _, record in labelled):
            continue
        values = [(label, record.get(name)) for label, record in labelled]
        if len({repr(v) for _, v in values}) == 1 and values[0][1] is not None:
            continue
        if blocks_compared and name == "block_size" and all(isinstance(v, int) for _, v in values):
            shown = ", ".join(f"{label} {v - 1 if chain else v}" for label, v in values)
            blocks = (f"{'chain lengths K' if chain else 'block_size'} differ ({shown}): tau grows with the "
                      f"{'chain' if chain else 'block'} drafted (a cycle can accept more drafts), so a higher tau "
                      "is not a faster setting; compare the projected speedup (tools/eval_drafter.py --profile) "
                      f"to choose {'a K' if chain else 'a block'}, or score each drafter at one "
                      f"{'--speculative-tokens' if chain else '--block-size'} to compare drafters")
            continue
        shown = ", ".join(f"{label} {v!r}" if v is not None else f"{label} (not recorded)" for label, v in values)
        clauses.append(f"{name} differ ({shown})" + (_TAIL_NOTE if name == "tail_blocks" else ""))
    if not clauses:
        return blocks
    options = ", ".join(_OPTION.get(c.split(" ", 1)[0], c.split(" ", 1)[0]) for c in clauses)
    return "; ".join(clauses) + (f": the figures are not like for like; score each with tools/eval_drafter.py "
                                 f"and the same {options}") + (f"; {blocks}" if blocks else "")


# Why a tail convention matters, and the option that sets each series field on the command line.
_TAIL_NOTE = ": near max_new_tokens the replays draft blocks of different lengths (docs/method.md, \"Tail blocks\")"
_OPTION = {"block_size": "--block-size", "tail_blocks": "--tail-blocks", "dtype": "--dtype",
           "anchor_stride": "--anchor-stride", "anchor_seed": "--anchor-seed"}


def _get(data: Any, key: str) -> Any:
    return data.get(key) if isinstance(data, dict) else None


def _clean(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


# -- building ----------------------------------------------------------------------------------

def report_to_results(report: EvalReport, cache: StateCache, meta: dict[str, Any] | None = None, *,
                      position_edges: tuple[int, ...] = DEFAULT_POSITION_EDGES,
                      n_resamples: int = DEFAULT_RESAMPLES) -> Results:
    summary = report.summary
    counts = report.counts
    hist = counts.data["hist"].tolist()
    scalars, tables = derived_metrics(report.samples, report.budgets, counts.categories, position_edges,
                                      n_resamples=n_resamples, anchor_stride=report.anchor_stride)
    metrics = {**summary, **scalars}
    notes = {"intervals": INTERVAL_NOTE}
    if T1_TAU_ESTIMATE in summary:
        notes[T1_TAU_ESTIMATE] = T1_NOTE
    figures = (report.family or family_named(report.spec.family)).figures
    if figures.note:  # what the family's own figures are (DFlash 2: where tau is lost)
        notes[figures.note_key] = figures.note
    samples = [SampleRecord.of(s) for s in report.samples]
    return Results(
        metrics={k: _clean(v) for k, v in metrics.items()},
        samples=samples,
        per_depth={k: [_clean(v) for v in vals] for k, vals in per_depth(summary, report.block_size, report.spec.family).items()},
        histogram={str(n): int(hist[n]) for n in range(1, report.block_size + 1)},
        meta={
            "cache_path": str(cache.path),
            **cache.identity_meta,  # the manifest's hash, and the content identity compared (cache.identity)
            "block_size": report.block_size,  # the block every cycle drafted (evaluate(block_size=...))
            "drafter_block_size": report.spec.block_size,  # the drafter's trained block (>= block_size)
            "drafter_family": report.spec.family,  # registry.family_names: what the figures score
            "ddtree_budgets": list(report.budgets),
            "categories": list(counts.categories),
            "dflash_cb_version": __version__,
            "wall_time_s": round(report.wall_time_s, 3),
            "samples_evaluated": len(report.samples),
            ANCHOR_STRIDE: report.anchor_stride,
            ANCHOR_SEED: report.anchor_seed,  # each sample's offset: samples[].anchor_statistics
            "specforge_masks": report.specforge_note or "served",  # how specforge/acc was computed
            "tail_blocks": report.tail_blocks,  # replay.TAIL_BLOCKS; docs/method.md, "Tail blocks"
            ANCHORS_DRAFTED: int(counts.data["anchors_drafted"].item()),
            ANCHORS_NEEDED: int(counts.data["anchors_needed"].item()),
            **report.series,  # what identifies the figures (request.series_fields), the names above included
            **(meta or {}),
        },
        breakdown=tables,
        notes=notes,
    )


def drafter_provenance(path: str | os.PathLike, global_step: int | None = None) -> dict[str, Any]:
    """Which drafter was scored: ``{"path", "kind": "folder" | "checkpoint", "global_step"}``.

    ``global_step``: a Lightning checkpoint's, as ``checkpoints.extract_drafter`` reports it (the
    checkpoint is read once, there); a drafter folder has none.
    """
    p = Path(path).resolve()
    return {"path": str(p), "kind": "folder" if p.is_dir() else "checkpoint", "global_step": global_step}


# -- files ---------------------------------------------------------------------------------

def check_results_path(path: str | os.PathLike, option: str = "--out", example: str = "results.json") -> Path:
    """Fail now, not after the evaluation, when ``path`` cannot receive an output file (``option`` names it).

    Creates the missing parent folders and writes (then removes) a probe file next to ``path``.
    """
    path = Path(path)
    real = output_path(path)  # a symbolic link is written through: check where the file will land
    if real.is_dir() and (real / "config.json").is_file():  # a model's folder: a file there ships with it
        raise ResultsError(f"{option} {path}: is a model folder (config.json); write {option} outside it, e.g. "
                           f"{option} {example}")
    if real.is_dir():
        raise ResultsError(f"{option} {path}: is a folder; give a file path, e.g. {path / example}")
    for parent in real.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ResultsError(f"{option} {path}: {parent} is a file, not a folder; choose another path")
            break
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ResultsError(f"{option} {path}: cannot write there ({describe_os_error(e)})") from None
    return path


def report_paths(out: str, header: str, example: str, inputs: Sequence[tuple[str, Any]] = (),
                 option: str = "--out") -> tuple[Path, Path]:
    """A report tool's ``OUT.md`` and ``OUT.png``, checked before any work: ``out`` names a file stem (``.md`` or
    ``.png`` at its end dropped; any other suffix kept, so ``report.final`` writes ``report.final.md``, never
    ``report.md``), and an existing ``.md`` is replaced only when it is this tool's own earlier report (its first
    line is ``header``): a user's notes of the same name are never overwritten. Neither may be one of ``inputs``
    (``check_outputs_apart``)."""
    text = str(out).strip()
    if not text or Path(text).name in ("", ".", "..") or text.endswith(("/", os.sep)):
        raise ResultsError(f"{option} {out!r}: a file stem is needed (OUT.md and OUT.png are written), e.g. "
                           f"{option} {example}")
    base = Path(text)
    if base.suffix in (".md", ".png"):
        base = base.with_suffix("")
    md, png = Path(f"{base}.md"), Path(f"{base}.png")
    check_outputs_apart(inputs, files=[(option, md), (option, png)])
    real = output_path(md)
    if real.is_file():
        try:
            with open(real, encoding="utf-8", errors="replace") as f:
                first = f.readline().rstrip("\n")
        except OSError:
            first = ""
        if first != header:
            raise ResultsError(f"{option} {out}: {md} exists and is not an earlier report of this tool (its first "
                               f"line is not {header!r}); give another {option}, or move that file")
    return (check_results_path(md, option, f"{example}.md"), check_results_path(png, option, f"{example}.png"))


def write_results(results: Results, path: str | os.PathLike) -> None:
    path = Path(path)
    output_path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, results_text(results.to_dict()))


def results_text(data: dict[str, Any]) -> str:
    """A results file's JSON: the figures indented, each sample on a line of its own. Indented JSON goes
    through the json module's Python encoder; one line a sample keeps the file readable and diffable and
    writes the per-sample lists (most of a file) at the C encoder's speed."""
    samples = data.get("samples")
    if not samples:
        return json.dumps(data, indent=1) + "\n"
    head = json.dumps({k: v for k, v in data.items() if k != "samples"}, indent=1)
    rows = ",\n".join("  " + json.dumps(sample) for sample in samples)
    return f'{head[:-2]},\n "samples": [\n{rows}\n ]\n}}\n'


def load_results(path: str | os.PathLike, cache: StateCache | None = None) -> Results:
    """Read a results.json; with ``cache``, refuse one measured on a different cache."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file; create it with tools/eval_drafter.py --out {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: not valid JSON ({e}); rerun tools/eval_drafter.py --out {path}") from e
    res = Results.from_dict(data, str(path))
    why = cache_difference(res.meta, cache.identity_meta) if cache is not None else None
    if cache is not None and why is not None:
        raise ResultsError(
            f"{path}: measured on cache {res.meta.get('cache_path')!r}, but this run evaluates {cache.path} "
            f"({why}). Numbers from different caches are not "
            f"comparable: rerun python tools/eval_drafter.py --states {shlex.quote(str(cache.path))} "
            f"--drafter {shlex.quote(res.drafter_path or '<the reference drafter folder>')} --out {shlex.quote(str(path))}"
        )
    return res
