"""The W&B comparison panels, built from code (``tools/wandb_panels.py``).

A saved workspace view (or, with ``--report``, a W&B Report) with the sections *Headline*,
*Uncertainty*, *Per category*, *Per depth*, *By position*, *Cost* and the samples table, every
line plot against ``trainer/global_step``. Every key a panel shows is built from the names in
``dflash_cb.metrics`` and the run's dimensions (``PanelLayout``: DDTree budgets, categories,
block size, position buckets, baselines), so a renamed metric breaks ``tests/test_panels.py``
instead of leaving an empty panel.

Uses ``wandb-workspaces`` (W&B's library for views and reports), imported lazily. Building and
serialising the view needs no network; only ``save()`` talks to W&B.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .baselines import CONVENTIONS
from .metrics import (
    ACCEPT_LENGTH_SERVED,
    ANCHORS_DRAFTED,
    ANCHORS_NEEDED,
    BEST_STEP,
    BEST_TAU,
    CYCLES,
    DELTA_TAU,
    EVAL_TIME,
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
    position_tau,
)
from .positions import DEFAULT_CYCLE_BUCKETS, DEFAULT_POSITION_EDGES, cycle_labels, position_labels

STEP_KEY = "trainer/global_step"  # the same as wandb_logging.STEP_KEY (kept import-free of wandb)
SAMPLE_TABLE = "sample_table"
COST_KEYS = (EVAL_TIME, CYCLES, TOKENS, ANCHORS_DRAFTED, ANCHORS_NEEDED)
SECTIONS = ("Headline", "Uncertainty", "Per category", "Per depth", "By position", "Cost", "Samples")


@dataclass
class PanelLayout:
    """What the run logs, besides the fixed names: the dimensions the keys are built from."""

    prefix: str = "dflash_eval/"
    budgets: Sequence[int] = (16, 32, 64)
    categories: Sequence[str] = ()
    block_size: int = 16
    position_buckets: Sequence[str] = field(default_factory=lambda: position_labels(DEFAULT_POSITION_EDGES))
    cycle_buckets: Sequence[str] = field(default_factory=lambda: cycle_labels(DEFAULT_CYCLE_BUCKETS))
    baselines: Sequence[str] = ()  # measured: "baseline/<name>" segments (Baseline.key)
    # "published/<name>/<metric>": a published figure under the live metric of its convention
    # (baselines.CONVENTIONS: tau, tau_request_mean or accept_length_served).
    published: Sequence[str] = ()
    cost: Sequence[str] = COST_KEYS


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
    top = max(layout.budgets) if layout.budgets else None

    def line(title: str, names: Iterable[str]) -> PanelSpec:
        return PanelSpec("line", title, tuple(p + n for n in names))

    def published(metric: str) -> list[str]:
        return [r for r in layout.published if r.endswith("/" + metric)]

    headline = [line("tau (pooled): live vs references", [TAU] + [f"{b}/{TAU}" for b in layout.baselines]
                     + published(TAU))]
    # A published figure is only ever drawn beside the live figure of its own convention.
    headline += [line(title, [m, *published(m)]) for title, m in (
        ("tau, mean over requests (dflash.benchmark): live vs published", TAU_REQUEST_MEAN),
        ("served accept length, mean over requests (SGLang): live vs published", ACCEPT_LENGTH_SERVED))]
    if layout.budgets:
        headline.append(line("DDTree tau per budget", [ddtree_tau(b) for b in layout.budgets]
                             + [f"{r}/{ddtree_tau(b)}" for r in layout.baselines for b in layout.budgets]))
    if layout.baselines:
        headline.append(line("live minus baseline (tau, paired)", [f"{b}/{DELTA_TAU}" for b in layout.baselines]))
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
                 line("acceptance per depth (given the previous depths matched)", [depth_acc_cond(k) for k in depths])]

    by_position = [line("tau by anchor position in the completion", [position_tau(b) for b in layout.position_buckets]),
                   line("tau by cycle index after the prompt", [cycle_tau(b) for b in layout.cycle_buckets])]

    cost = [line(f"cost: {n}", [n]) for n in layout.cost]
    samples = [PanelSpec("table", "samples: drafts vs target, per cycle", (p + SAMPLE_TABLE,))]
    return dict(zip(SECTIONS, [headline, uncertainty, per_category, per_depth, by_position, cost, samples],
                    strict=True))


def referenced_keys(plan: dict[str, list[PanelSpec]]) -> dict[str, set[str]]:
    """``{"line": history keys, "scalar": summary keys, "table": table keys}`` referenced by the plan."""
    out: dict[str, set[str]] = {"line": set(), "scalar": set(), "table": set()}
    for panels in plan.values():
        for spec in panels:
            out[spec.kind].update(spec.keys)
    return out


def layout_from_keys(keys: Iterable[str], prefix: str = "dflash_eval/") -> PanelLayout:
    """The dimensions of a run from the keys it logged (for a run made with other budgets, categories...)."""
    keys = [k[len(prefix):] for k in keys if k.startswith(prefix)]

    def grab(pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return sorted({m.group(1) for k in keys if (m := rx.fullmatch(k))})

    depths = [int(d) for d in grab(r"acceptance/depth_(\d+)")]
    return PanelLayout(
        prefix=prefix,
        budgets=sorted(int(b) for b in grab(r"ddtree/tau_b(\d+)")),
        categories=grab(r"category/(.+)/tau"),
        block_size=(max(depths) + 1) if depths else 16,
        position_buckets=sorted(grab(r"position/(\d+_\w+)/tau"), key=lambda b: int(b.split("_")[0])),
        cycle_buckets=sorted(grab(r"cycle/(\w+)/tau"), key=lambda b: int(b.rstrip("plus"))),
        baselines=[f"baseline/{n}" for n in grab(r"baseline/([^/]+)/tau")],
        published=[f"published/{n}" for n in grab(
            r"published/([^/]+/(?:" + "|".join(map(re.escape, CONVENTIONS.values())) + "))")],
        cost=[n for n in COST_KEYS if n in keys],
    )


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
                    "dflash-cb panels: Headline, Uncertainty, Per category, Per depth, By position, Cost, Samples.")
    p.add_argument("--entity", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--name", default="dflash-cb: drafter evaluation", help="view (or report) name")
    p.add_argument("--report", action="store_true", help="make a W&B Report with the same panels instead")
    p.add_argument("--url", default=None, help="update this existing saved view (its URL) instead of creating one")
    p.add_argument("--run", default=None,
                   help="take budgets, categories, block size, buckets and baselines from the keys this run logged "
                        "(its id in the project); otherwise from the options below")
    p.add_argument("--prefix", default="dflash_eval/")
    p.add_argument("--budgets", default="16,32,64", help="DDTree budgets the callback logs")
    p.add_argument("--categories", default="", help="comma-separated prompt categories")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--position-edges", default=",".join(map(str, DEFAULT_POSITION_EDGES)))
    p.add_argument("--cycle-buckets", type=int, default=DEFAULT_CYCLE_BUCKETS)
    p.add_argument("--baselines", default="", help="names of the measured baselines (callback baselines=)")
    p.add_argument("--published", default="",
                   help="published entries logged: NAME (convention pooled) or NAME:CONVENTION, CONVENTION one of "
                        + ", ".join(CONVENTIONS))
    p.add_argument("--dry-run", action="store_true", help="print the panels and build the view; do not save")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _published_key(item: str) -> str:
    """``NAME`` or ``NAME:CONVENTION`` -> ``published/<slug>/<metric of that convention>``."""
    from .baselines import _slug

    name, _, convention = item.partition(":")
    convention = convention or "pooled"
    if convention not in CONVENTIONS:
        raise ValueError(f"--published {item!r}: unknown convention {convention!r}; use one of {sorted(CONVENTIONS)}")
    return f"published/{_slug(name)}/{CONVENTIONS[convention]}"


def main(argv: Sequence[str] | None = None) -> int:
    import json

    from .baselines import _slug
    from .errors import DFlashCBError

    args = build_parser().parse_args(argv)
    if args.run:
        import wandb

        run = wandb.Api().run(f"{args.entity}/{args.project}/{args.run}")
        keys = set(run.summary.keys()) | {k for row in run.scan_history(page_size=1000) for k in row}
        layout = layout_from_keys(keys, args.prefix)
    else:
        try:
            layout = PanelLayout(prefix=args.prefix, budgets=[int(b) for b in _csv(args.budgets)],
                                 categories=_csv(args.categories), block_size=args.block_size,
                                 position_buckets=position_labels([int(x) for x in _csv(args.position_edges)]),
                                 cycle_buckets=cycle_labels(args.cycle_buckets),
                                 baselines=[f"baseline/{_slug(n)}" for n in _csv(args.baselines)],
                                 published=[_published_key(x) for x in _csv(args.published)])
        except ValueError as e:
            raise DFlashCBError(f"wandb_panels.py: {e}") from None
    plan = panel_plan(layout)
    view = (build_report if args.report else build_workspace)(args.entity, args.project, layout, args.name)
    if args.dry_run:
        print(json.dumps({s: [{"kind": p.kind, "title": p.title, "keys": list(p.keys)} for p in panels]
                          for s, panels in plan.items()}, indent=1))
        return 0
    if args.url and not args.report:
        import wandb_workspaces.workspaces as ws

        existing = ws.Workspace.from_url(args.url)
        existing.sections = view.sections
        view = existing
    view.save()  # the only network call (with from_url above)
    print(f"saved {'report' if args.report else 'workspace view'} {args.name!r}: {getattr(view, 'url', '')}")
    return 0
