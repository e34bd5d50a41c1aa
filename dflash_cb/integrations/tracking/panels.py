"""The W&B comparison panels, built from code (``tools/wandb_panels.py``).

A saved workspace view (or, with ``--report``, a W&B Report) with the sections *Headline*,
*Uncertainty*, *Per category*, *Per depth*, *Selector* (a DFlash 2 drafter's: where tau is lost), *By
position*, *Cost* and the samples table, every line plot against ``trainer/global_step``. Every key a panel shows is built from the names in
``dflash_cb.core.figures.metrics`` and the run's dimensions (``PanelLayout``: DDTree budgets, categories,
block size, position buckets, baselines), so a renamed metric breaks ``tests/integrations/test_panels.py``
instead of leaving an empty panel.

The panels follow the callback's evaluation profiles: every evaluation logs the light profile's figures
under the main keys (DDTree tau at ``light_ddtree_budgets``, strided statistics), and a full one adds
its exact figures (stride 1, every budget) under ``{prefix}full/``; so the other budgets are shown as
their ``full/`` keys. Reference series appear
only when they are known to be logged. With ``--run`` the run's keys are known (from W&B, or read
offline from a local offline run folder) and panels none of whose keys were logged are warned
about; from options alone nothing can be checked.

Uses ``wandb-workspaces`` (W&B's library for views and reports), imported lazily. Building and
serialising the view needs no network; only ``save()`` talks to W&B.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...common import cli
from ...common.errors import DFlashCBError
from ...core.figures.metrics import (
    ACCEPT_LENGTH_SERVED,
    ALL_ANCHOR_TAU,
    ANCHORS_DRAFTED,
    ANCHORS_NEEDED,
    BEST_STEP,
    BEST_TAU,
    CHAIN_TAU_ESTIMATE,
    CYCLES,
    DEFAULT_PREFIX,
    DELTA_TAU,
    EVAL_OVERHEAD,
    EVAL_STEP,
    EVAL_TIME,
    FULL_PREFIX,
    SERVED_BASELINE,
    SPECFORGE_ACC,
    STEP_KEY,
    TAU,
    TAU_REQUEST_MEAN,
    TOKENS,
    category_tau,
    ci_high,
    ci_low,
    cycle_tau,
    ddtree_tau,
    depth_acc,
    depth_acc_cond,
    hist_frac,
    position_cycles,
    position_tau,
    serving_key,
)
from ...core.figures.positions import (
    DEFAULT_CYCLE_BUCKETS,
    DEFAULT_POSITION_EDGES,
    cycle_labels,
    position_labels,
)
from ...core.results.baselines import CONVENTIONS
from .family_panels import family_figures, family_panels, family_walks

SAMPLE_TABLE = "sample_table"
COST_KEYS = (EVAL_TIME, EVAL_OVERHEAD, CYCLES, TOKENS, ANCHORS_DRAFTED, ANCHORS_NEEDED)
SECTIONS = ("Headline", "Uncertainty", "Per category", "Per depth", "Drafter family", "Serving (projected)", "By position",
            "Cost", "Samples")


@dataclass
class PanelLayout:
    """What the run logs, besides the fixed names: the dimensions the keys are built from."""

    prefix: str = DEFAULT_PREFIX
    budgets: Sequence[int] = (16, 32, 64)
    categories: Sequence[str] = ()
    block_size: int = 16
    position_buckets: Sequence[str] = field(default_factory=lambda: position_labels(DEFAULT_POSITION_EDGES))
    cycle_buckets: Sequence[str] = field(default_factory=lambda: cycle_labels(DEFAULT_CYCLE_BUCKETS))
    baselines: Sequence[str] = ()  # measured: "baseline/<name>" segments (Baseline.key): tau and delta_tau
    # "published/<name>/<metric>": a published figure under the live metric of its convention
    # (baselines.CONVENTIONS: tau, tau_request_mean or accept_length_served).
    published: Sequence[str] = ()
    cost: Sequence[str] = COST_KEYS
    # Budgets of the light evaluations; None = the callback's default, the largest budget.
    # The other budgets are logged by the full evaluations only, so their panel shows the full/ keys.
    light_ddtree_budgets: Sequence[int] | None = None
    served: bool = False  # "baseline/served/tau": the cache holds the server's counters (no samples, no delta)
    # DDTree budgets each reference ("baseline/<name>", "published/<name>") logged; a reference not
    # listed gets no DDTree series (a key nobody logged would be an empty line).
    reference_budgets: Mapping[str, Sequence[int]] = field(default_factory=dict)
    # The drafter family whose own figures get the *Drafter family* section (``FamilyFigures``: DFlash 2's
    # selector/... keys); None: a family without figures of its own.
    family: str | None = None
    # Settings with a serving projection (``serving/speedup_<setting>``: a run with ``cost_profile=``).
    serving: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2 (a block is the anchor and at least one drafted token), "
                             f"got {self.block_size}")

    @property
    def light_budgets(self) -> list[int]:
        """The budgets logged at every evaluation (light and full)."""
        if self.light_ddtree_budgets is not None:
            return sorted(int(b) for b in self.light_ddtree_budgets)
        return [max(self.budgets)] if self.budgets else []


@dataclass(frozen=True)
class PanelSpec:
    """One panel, independent of wandb-workspaces: a line plot of ``keys`` against the step, a
    scalar (a summary key), or a table (a logged ``wandb.Table``)."""

    kind: str  # "line", "scalar" or "table"
    title: str
    keys: tuple[str, ...]


def panel_plan(layout: PanelLayout) -> dict[str, list[PanelSpec]]:
    """Section name -> panels; every key is fully prefixed."""
    p = layout.prefix
    every = layout.light_budgets
    full_only = [b for b in layout.budgets if b not in every]
    top = max(every) if every else None

    def line(title: str, names: Iterable[str]) -> PanelSpec:
        return PanelSpec("line", title, tuple(p + n for n in names))

    def published(metric: str) -> list[str]:
        return [r for r in layout.published if r.endswith("/" + metric)]

    # Pooled references: measured baselines, the served counters, and published figures of the pooled convention.
    refs = [*layout.baselines, *([SERVED_BASELINE] if layout.served else []),
            *(r.rsplit("/", 1)[0] for r in published(TAU))]
    headline = [line("tau (pooled): live vs references", [TAU] + [f"{r}/{TAU}" for r in refs])]
    # A published figure is only ever drawn beside the live figure of its own convention.
    headline += [line(title, [m, *published(m)]) for title, m in (
        ("tau, mean over requests (dflash.benchmark): live vs published", TAU_REQUEST_MEAN),
        ("served accept length, mean over requests (SGLang): live vs published", ACCEPT_LENGTH_SERVED))]
    if every or full_only:
        title = "DDTree tau per budget" + (" (full/: full evaluations only)" if full_only else "")
        headline.append(line(title, [ddtree_tau(b) for b in every] + [FULL_PREFIX + ddtree_tau(b) for b in full_only]
                             + [f"{r}/{ddtree_tau(b)}" for r in refs for b in layout.reference_budgets.get(r, ())]))
    if layout.baselines:
        headline.append(line("live minus baseline (tau, paired)", [f"{b}/{DELTA_TAU}" for b in layout.baselines]))
    # The README's argument: the training's own accuracy (SpecForge's acc) beside tau, and tau beside the anchor
    # statistics (every anchor scored, not only the replay's cycles; a chain drafter's estimate from them).
    headline.append(line("training's accuracy (specforge/acc) against tau", [TAU, SPECFORGE_ACC]))
    headline.append(line("tau beside the all-anchor figures", [TAU, ALL_ANCHOR_TAU, CHAIN_TAU_ESTIMATE]))
    headline.append(PanelSpec("scalar", "best tau", (p + BEST_TAU,)))
    headline.append(PanelSpec("scalar", "step of the best tau", (p + BEST_STEP,)))

    uncertainty = [line("tau with its 95% interval", [TAU, ci_low(TAU), ci_high(TAU)])]
    if top is not None:
        m = ddtree_tau(top)
        uncertainty.append(line(f"DDTree tau (budget {top}) with its 95% interval", [m, ci_low(m), ci_high(m)]))
    for b in layout.baselines:
        m = f"{b}/{DELTA_TAU}"
        uncertainty.append(line(f"live - {b.split('/', 1)[1]}: paired 95% interval", [m, ci_low(m), ci_high(m)]))

    per_category = [line("tau per category", [category_tau(c) for c in layout.categories])] if layout.categories else []
    per_category += [line(f"tau, {c}, with its 95% interval",
                          [category_tau(c), ci_low(category_tau(c)), ci_high(category_tau(c))])
                     for c in layout.categories]

    depths = range(1, layout.block_size)
    per_depth = [line("acceptance per depth (unconditional)", [depth_acc(k) for k in depths]),
                 line("acceptance per depth (given the previous depths matched)", [depth_acc_cond(k) for k in depths]),
                 line("fraction of cycles committing n tokens (accepted + 1)",
                      [hist_frac(n) for n in range(1, layout.block_size + 1)])]

    selector = family_panels(layout.family, depths, line) if layout.family else []

    serving = []
    if layout.serving:
        serving = [
            line("projected speedup over plain decoding, per setting (a projection: its cost profile)",
                 [serving_key("speedup", s) for s in layout.serving]),
            line("projected speedup with its 95% interval", [k for s in layout.serving for k in (
                serving_key("speedup", s), ci_low(serving_key("speedup", s)), ci_high(serving_key("speedup", s)))]),
            line("projected tokens per second, per setting", [serving_key("tokens_per_s", s) for s in layout.serving]),
            line("break-even tau per setting (slower than plain decoding below it)",
                 [serving_key("breakeven_tau", s) for s in layout.serving])]

    by_position = [line("tau by anchor position in the completion", [position_tau(b) for b in layout.position_buckets]),
                   line("cycles by anchor position (what each bucket's tau rests on)",
                        [position_cycles(b) for b in layout.position_buckets]),
                   line("tau by cycle index after the prompt", [cycle_tau(b) for b in layout.cycle_buckets])]

    cost = [line(f"cost: {n}", [n]) for n in layout.cost]
    samples = [PanelSpec("table", "samples: drafts vs target, per cycle", (p + SAMPLE_TABLE,))]
    return dict(zip(SECTIONS, [headline, uncertainty, per_category, per_depth, selector, serving, by_position, cost,
                               samples], strict=True))


def referenced_keys(plan: dict[str, list[PanelSpec]]) -> dict[str, set[str]]:
    """``{"line": history keys, "scalar": summary keys, "table": table keys}`` referenced by the plan."""
    out: dict[str, set[str]] = {"line": set(), "scalar": set(), "table": set()}
    for panels in plan.values():
        for spec in panels:
            out[spec.kind].update(spec.keys)
    return out


def layout_from_keys(keys: Iterable[str], prefix: str = DEFAULT_PREFIX,
                     light_budgets: Sequence[int] | None = None) -> PanelLayout:
    """The dimensions of a run from the keys it logged (for a run made with other budgets, categories...).

    ``light_budgets``: the budgets of its light evaluations (``light_budgets`` of its history
    rows); None = the callback's default.
    """
    keys = [k[len(prefix):] for k in keys if k.startswith(prefix)]

    def grab(pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return sorted({m.group(1) for k in keys if (m := rx.fullmatch(k))})

    depths = [int(d) for d in grab(r"acceptance/depth_(\d+)")]
    named = grab(r"baseline/([^/]+)/tau")
    baselines = [f"baseline/{n}" for n in named if f"baseline/{n}" != SERVED_BASELINE]
    published = [f"published/{n}" for n in grab(
        r"published/([^/]+/(?:" + "|".join(map(re.escape, CONVENTIONS.values())) + "))")]
    refs = [*baselines, SERVED_BASELINE, *(r.rsplit("/", 1)[0] for r in published if r.endswith("/" + TAU))]
    return PanelLayout(
        prefix=prefix,
        # A full evaluation logs every budget under full/; the main keys hold the light budgets.
        budgets=sorted({int(b) for b in grab(r"(?:full/)?ddtree/tau_b(\d+)")}),
        categories=grab(r"category/(.+)/tau"),
        block_size=(max(depths) + 1) if depths else 16,
        position_buckets=sorted(grab(r"position/(\d+_\w+)/tau"), key=lambda b: int(b.split("_")[0])),
        cycle_buckets=sorted(grab(r"cycle/(\w+)/tau"), key=lambda b: int(b.rstrip("plus"))),
        baselines=baselines,
        published=published,
        cost=[n for n in COST_KEYS if n in keys],
        light_ddtree_budgets=light_budgets,
        served=SERVED_BASELINE in {f"baseline/{n}" for n in named},
        family=next((name for name, figures in family_figures().items() if figures.walks
                     and any(w.key in keys for w in figures.walks)), None),
        serving=[n for n in grab(r"serving/speedup_(.+)") if not n.endswith(("_ci_low", "_ci_high"))],
        reference_budgets={r: bs for r in refs
                           if (bs := sorted(int(b) for b in grab(re.escape(r) + r"/ddtree/tau_b(\d+)")))},
    )


def light_budgets(rows: Iterable[Mapping[str, Any]], prefix: str = DEFAULT_PREFIX) -> list[int] | None:
    """The DDTree budgets of a run's main keys: those its light evaluations run (every evaluation logs the
    light profile under the main keys; a full one adds every budget under ``full/``). None without any."""
    rx = re.compile(re.escape(prefix) + r"ddtree/tau_b(\d+)")
    found = sorted({int(m.group(1)) for r in rows if prefix + TAU in r for k in r if (m := rx.fullmatch(k))})
    return found or None


def unlogged_panels(plan: dict[str, list[PanelSpec]], logged: Iterable[str]) -> list[str]:
    """Titles of the panels none of whose keys the run logged (they would stay empty).

    A table counts as logged when any ``<table>/...`` key is (W&B stores a table's path and type).
    """
    logged = set(logged)
    out = []
    for panels in plan.values():
        for spec in panels:
            if spec.kind == "table":
                hit = any(k.startswith(t + "/") or k == t for t in spec.keys for k in logged)
            else:
                hit = any(k in logged for k in spec.keys)
            if not hit:
                out.append(spec.title)
    return out


# -- wandb-workspaces objects --------------------------------------------------------------

def _panel(spec: PanelSpec) -> Any:
    import wandb_workspaces.reports.v2 as wr

    if spec.kind == "line":
        return wr.LinePlot(title=spec.title, x=STEP_KEY, y=list(spec.keys))
    if spec.kind == "scalar":
        return wr.ScalarChart(title=spec.title, metric=wr.SummaryMetric(spec.keys[0]))
    return wr.WeavePanelSummaryTable(table_name=spec.keys[0])


def build_workspace(entity: str, project: str, layout: PanelLayout, name: str = "dflash-cb: drafter evaluation") -> Any:
    """A saved-view object (``wandb_workspaces.workspaces.Workspace``); call ``.save()`` to create it."""
    import wandb_workspaces.workspaces as ws

    sections = [ws.Section(name=title, panels=[_panel(s) for s in panels], is_open=title in ("Headline", "Uncertainty"))
                for title, panels in panel_plan(layout).items() if panels]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        settings=ws.WorkspaceSettings(x_axis=STEP_KEY))


def build_report(entity: str, project: str, layout: PanelLayout, title: str = "dflash-cb: drafter evaluation") -> Any:
    """The same panels as a W&B Report (one panel grid per section, over the project's runs)."""
    import wandb_workspaces.reports.v2 as wr

    blocks: list[Any] = [wr.P("tau is the exact acceptance length of the drafter replayed on cached target states; "
                              "intervals are 95% cluster-bootstrap intervals over the evaluated prompts.")]
    for title_, panels in panel_plan(layout).items():
        if panels:
            blocks += [wr.H2(title_), wr.PanelGrid(runsets=[wr.Runset(entity=entity, project=project)],
                                                   panels=[_panel(s) for s in panels])]
    return wr.Report(project=project, entity=entity, title=title, blocks=blocks)


# -- command line (tools/wandb_panels.py) ---------------------------------------------------

def build_parser() -> Any:
    import argparse

    p = argparse.ArgumentParser(
        prog="wandb_panels.py",
        description="Create or update a saved W&B workspace view (or, with --report, a Report) with the "
                    "dflash-cb panels: Headline, Uncertainty, Per category, Per depth, Selector (DFlash 2), By position, "
                    "Cost, Samples.")
    p.add_argument("--entity", default=None, help="W&B entity (not needed with --show on a local run folder)")
    p.add_argument("--project", default=None, help="W&B project (not needed with --show on a local run folder)")
    p.add_argument("--name", default="dflash-cb: drafter evaluation", help="view (or report) name")
    p.add_argument("--report", action="store_true", help="make a W&B Report with the same panels instead")
    p.add_argument("--url", default=None, help="update this existing saved view (its URL) instead of creating one")
    p.add_argument("--run", default=None,
                   help="take budgets, categories, block size, buckets and baselines from the keys this run logged: "
                        "its id in the project (read from W&B), or a local offline run folder "
                        "(wandb/offline-run-..., read without network); panels it never logged are warned about")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--budgets", default="16,32,64", help="DDTree budgets of the full evaluations (ddtree_budgets)")
    p.add_argument("--light-budgets", "--periodic-budgets", dest="light_budgets", default=None,
                   help="DDTree budgets of the light evaluations (light_ddtree_budgets; default: the largest "
                        "budget); the others show as full/ keys, logged by the full evaluations only")
    p.add_argument("--categories", default="", help="comma-separated prompt categories")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)))
    p.add_argument("--cycle-buckets", type=int, default=DEFAULT_CYCLE_BUCKETS)
    p.add_argument("--baselines", default="", help="names of the measured baselines (callback baselines=)")
    p.add_argument("--family", default=None,  # checked in main: the registry's names cost seconds to list
                   help="the drafter's family, as results.json names it (a registered family): add the section of its "
                        "own figures (docs/metrics.md)")
    p.add_argument("--served", action="store_true",
                   help="the cache holds the server's counters: show baseline/served/tau (no paired delta)")
    p.add_argument("--published", default="",
                   help="published entries logged: NAME (convention pooled) or NAME:CONVENTION, CONVENTION one of "
                        + ", ".join(CONVENTIONS))
    p.add_argument("--dry-run", action="store_true", help="print the panels and build the view; do not save")
    p.add_argument("--show", action="store_true",
                   help="print the series --run logged (one row per evaluation: step, tau with its interval, DDTree, "
                        "statistics, full/ figures) and stop; no login needed for a local offline run folder")
    return p


def series_table(rows: Iterable[Mapping[str, Any]], prefix: str = DEFAULT_PREFIX) -> str:
    """The evaluations a run logged under ``prefix``, one line each, in step order: what a panel plots."""
    evals: dict[int, dict[str, Any]] = {}
    for row in rows:
        if prefix + TAU in row:
            step = row.get(STEP_KEY, row.get(prefix + EVAL_STEP, row.get("_step")))
            evals.setdefault(int(step), {}).update(row)
    if not evals:
        return f"(no evaluation logged under {prefix!r})"
    keys = sorted({k for r in evals.values() for k in r}, key=str)
    ddtree = sorted((k for k in keys if re.fullmatch(re.escape(prefix) + r"ddtree/tau_b\d+", k)),
                    key=lambda k: int(k.rsplit("b", 1)[1]))
    columns = [(TAU, prefix + TAU), *[(k[len(prefix):], k) for k in ddtree],
               *[(k, prefix + k) for k in family_walks()],
               (SPECFORGE_ACC, prefix + SPECFORGE_ACC), (ALL_ANCHOR_TAU, prefix + ALL_ANCHOR_TAU),
               (FULL_PREFIX + TAU, prefix + FULL_PREFIX + TAU)]
    columns = [(name, key) for name, key in columns if any(key in r for r in evals.values())]
    lines = ["step".rjust(8) + "".join(f"  {name:>22}" for name, _ in columns)]
    for step in sorted(evals):
        r = evals[step]
        cells = []
        for _, key in columns:
            v = r.get(key)
            lo, hi = r.get(ci_low(key)), r.get(ci_high(key))
            text = "" if v is None else f"{v:.4f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None
                                                      else "")
            cells.append(f"  {text:>22}")
        lines.append(f"{step:>8}" + "".join(cells))
    return "\n".join(lines)


def every_key(rows: Sequence[Mapping[str, Any]]) -> str:
    """Every key the run logged, one a line: how many of its rows hold it and its last value (``--show``: the
    series table shows the headline; this, the rest)."""
    seen: dict[str, tuple[int, Any]] = {}
    for row in rows:
        for key, value in row.items():
            seen[key] = (seen.get(key, (0, None))[0] + 1, value)
    lines = [f"every key logged ({len(seen)}; rows holding it; last value):"]
    lines += [f"  {key}  {count}  {json.dumps(_brief(value), sort_keys=True, default=str)[:200]}"
              for key, (count, value) in sorted(seen.items())]
    return "\n".join(lines)


def _brief(value: Any, limit: int = 300) -> Any:
    """A config for one printed line: an entry longer than ``limit`` characters (the cache's identity) is named
    by its size, so the entries after it are still shown."""
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        text = json.dumps(v, sort_keys=True)
        out[k] = v if len(text) <= limit else f"({len(text)} characters: in the run's config)"
    return out


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _published_key(item: str) -> str:
    """``NAME`` or ``NAME:CONVENTION`` -> ``published/<slug>/<metric of that convention>``."""
    from ...common.arguments import metric_segment

    name, _, convention = item.partition(":")
    convention = convention or "pooled"
    if convention not in CONVENTIONS:
        raise ValueError(f"--published {item!r}: unknown convention {convention!r}; use one of {sorted(CONVENTIONS)}")
    return f"published/{metric_segment(name)}/{CONVENTIONS[convention]}"


class PanelsError(DFlashCBError, ValueError):
    """Bad panel options, a view URL of the wrong shape, or a W&B call that failed."""


WANDB_FIX = ("log in with `wandb login` (or set WANDB_API_KEY), check the network and WANDB_BASE_URL, "
             "or build the panels offline with --dry-run")


def check_view_url(url: str) -> str:
    """A saved workspace view's URL: ``https://<host>/<entity>/<project>?nw=<view id>``, checked offline."""
    from urllib.parse import parse_qs, urlparse

    u = urlparse(url)
    parts = [x for x in u.path.split("/") if x]
    nw = parse_qs(u.query).get("nw", [""])[0]
    if u.scheme not in ("http", "https") or not u.netloc or len(parts) not in (2, 3) or \
            (len(parts) == 3 and parts[2] != "workspace") or not nw or nw.startswith("nwuser"):
        raise PanelsError(f"--url {url!r}: not a saved workspace view; copy the view's URL from the browser, "
                          "shaped like https://wandb.ai/<entity>/<project>?nw=<view id> (personal views, "
                          "nw=nwuser..., cannot be updated)")
    return url


def _wandb(what: str, call: Any) -> Any:
    """Run one W&B call; its failure (no login, no network, a bad URL) becomes one line naming the fix."""
    try:
        return call()
    except DFlashCBError:
        raise
    except Exception as e:  # wandb raises many types (UsageError, CommError, requests errors...)
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise PanelsError(f"wandb_panels.py: {what} failed ({type(e).__name__}: {text}); {WANDB_FIX}") from None


def _run_history(run: str, entity: str, project: str) -> tuple[list[dict[str, Any]], set[str]]:
    """(history rows, summary keys) of ``--run``: a local offline run folder, or a run id on W&B."""
    from pathlib import Path

    if Path(run).exists():
        from .wandb_offline import offline_run_history

        rows, summary = offline_run_history(run)  # a resumed offline run: every part's steps
        return rows, set(summary)
    if not (entity and project) or "/" in run or os.sep in run or run.endswith(".wandb"):
        raise PanelsError(f"--run {run}: no such folder; give a local offline run folder (wandb/offline-run-<date>-"
                          "<id>, written with WANDB_MODE=offline), or the id of a run on W&B with --entity and "
                          "--project")

    def fetch() -> tuple[list[dict[str, Any]], set[str]]:
        import wandb

        r = wandb.Api().run(f"{entity}/{project}/{run}")
        return [dict(row) for row in r.scan_history(page_size=1000)], set(r.summary.keys())

    return _wandb(f"reading run {entity}/{project}/{run}", fetch)


def main(argv: Sequence[str] | None = None) -> int:
    import sys
    from pathlib import Path

    from ...common.arguments import metric_segment, parse_int_list, parse_position_edges

    args = build_parser().parse_args(argv)
    if args.block_size < 2:
        raise PanelsError(f"--block-size {args.block_size}: a block is the anchor and at least one drafted "
                          "token, so the block size is >= 2 (the drafter's block_size, e.g. 16)")
    if args.url:
        if args.report:
            raise PanelsError("--url updates a saved workspace view; a --report is always created anew: "
                              "drop one of the two")
        check_view_url(args.url)
    if args.family is not None:
        from ...core.drafters.registry import family_named

        try:
            family_named(args.family)
        except ValueError as e:
            raise PanelsError(f"--family {args.family}: {e}") from None
    if args.show and not args.run:
        raise PanelsError("--show prints the series of a run: give --run (a local offline run folder, or a run id "
                          "with --entity and --project)")
    if not (args.show or args.dry_run) and not (args.entity and args.project):
        raise PanelsError("--entity and --project are required to build the panels (the W&B project the runs log "
                          "to); --show --run <folder> and --dry-run need neither")
    logged: set[str] | None = None
    if args.run:
        rows, summary_keys = _run_history(args.run, args.entity, args.project)
        if args.show:
            if Path(args.run).exists():
                from .wandb_offline import offline_config

                ours = args.prefix.rstrip("/")  # {prefix}config, {prefix}baselines; eval_drafter's run: the prefix
                for key, value in offline_config(args.run).items():
                    if key.startswith(ours):
                        print(f"config {key}: {json.dumps(_brief(value), sort_keys=True)[:2000]}")
            print(series_table(rows, args.prefix))
            print(every_key(rows))
            return 0
        logged = {k for row in rows for k in row} | summary_keys
        layout = layout_from_keys(logged, args.prefix, light_budgets(rows, args.prefix))
    else:
        try:
            layout = PanelLayout(prefix=args.prefix, budgets=list(parse_int_list("--budgets", args.budgets, 1)),
                                 categories=_csv(args.categories), block_size=args.block_size,
                                 position_buckets=position_labels(parse_position_edges("--position-edges",
                                                                                       args.position_edges)),
                                 cycle_buckets=cycle_labels(args.cycle_buckets),
                                 baselines=[f"baseline/{metric_segment(n)}" for n in _csv(args.baselines)],
                                 published=[_published_key(x) for x in _csv(args.published)],
                                 light_ddtree_budgets=None if args.light_budgets is None
                                 else list(parse_int_list("--light-budgets", args.light_budgets, 1)),
                                 served=args.served, family=args.family)
        except ValueError as e:
            raise PanelsError(f"wandb_panels.py: {e}") from None
    plan = panel_plan(layout)
    if logged is not None:  # the run's keys are known: say which panels would stay empty
        empty = unlogged_panels(plan, logged)
        total = sum(len(p) for p in plan.values())
        if len(empty) == total:
            print(f"warning: run {args.run} logged none of the panels' keys under --prefix {args.prefix!r} "
                  f"({len(logged)} keys logged); check --prefix (the callback's prefix=) and the run",
                  file=sys.stderr)
        elif empty:
            print(f"warning: run {args.run} logged none of the keys of {len(empty)} panel(s): "
                  f"{'; '.join(empty)}", file=sys.stderr)
    if args.dry_run:
        print(json.dumps({s: [{"kind": p.kind, "title": p.title, "keys": list(p.keys)} for p in panels]
                          for s, panels in plan.items()}, indent=1))
        if args.entity and args.project:  # building the view checks it against wandb-workspaces; nothing is saved
            (build_report if args.report else build_workspace)(args.entity, args.project, layout, args.name)
        return 0
    view = (build_report if args.report else build_workspace)(args.entity, args.project, layout, args.name)
    if args.url:
        import wandb_workspaces.workspaces as ws

        existing = _wandb(f"reading the view {args.url}", lambda: ws.Workspace.from_url(args.url))
        existing.sections = view.sections
        view = existing
    _wandb("saving the view", view.save)  # the only network calls: here, from_url and --run
    print(f"saved {'report' if args.report else 'workspace view'} {args.name!r}: {getattr(view, 'url', '')}")
    return 0


command = cli.command(main)  # the ``dflash-panels`` console command
