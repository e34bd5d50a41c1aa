"""The *Drafter family* section of the panels: each registered family's own figures (``FamilyFigures``), found
without importing the drafter modules where only their names are needed (``--show``, ``--dry-run``)."""

from __future__ import annotations

from typing import Any

from ...core.drafters.base import FamilyFigures
from ...core.figures.metrics import TAU, ci_high, ci_low


def family_figures() -> dict[str, FamilyFigures]:
    """Each drafter family's own figures by family name (``FIGURES`` of ``core/drafters/<family>/figures.py``; a
    family without that module has none), read without importing the families' drafter modules: the registry
    (``registry.families()``) imports every family's model and transformers with it, seconds that ``--show`` and
    ``--dry-run`` need not spend. tests/integrations/test_panels.py checks that this is what the registry's families carry."""
    import importlib
    import pkgutil

    from ...core import drafters

    out = {}
    for info in sorted(pkgutil.iter_modules(drafters.__path__), key=lambda m: m.name):
        name = f"{drafters.__name__}.{info.name}.figures"
        if not info.ispkg:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # a family without figures of its own
            raise
        figures = getattr(module, "FIGURES", None)
        if isinstance(figures, FamilyFigures):
            out[info.name] = figures
    return out


def family_walks() -> tuple[str, ...]:
    """Every family walk's tau key, in a fixed order (``compare.family_walks`` without the registry)."""
    return tuple(dict.fromkeys(w.key for figures in family_figures().values() for w in figures.walks))


def family_panels(family: str, depths: range, line: Any) -> list[Any]:
    """The *Drafter family* section of ``family``'s own figures (``FamilyFigures``): its walks' taus beside tau,
    with their intervals; its pooled figures; each per-depth figure; each column of its tables over the rows."""
    # Its label is the registry's (which imports the drafter modules: seconds, spent only for a family's section).
    from ...core.drafters.registry import family_named

    fam = family_named(family)
    figures, say = fam.figures, fam.label
    walks = [w.key for w in figures.walks]
    out = []
    if walks:
        out += [line(f"{say}: tau, " + ", ".join(w.label.removeprefix("tau ") for w in figures.walks), [TAU, *walks]),
                line(f"{say}: " + " / ".join(w.label for w in figures.walks) + ", with their 95% intervals",
                     [m for w in walks for m in (w, ci_low(w), ci_high(w))])]
    if figures.pooled:
        out.append(line(f"{say}: " + ", ".join(p.label for p in figures.pooled), [p.key for p in figures.pooled]))
    out += [line(f"{say}: {d.label}", [d.key(k) for k in depths]) for d in figures.per_depth]
    out += [line(f"{say}: {t.title}: {column} by {t.row_header}", [t.key(i, j) for i in range(len(t.rows))])
            for t in figures.tables for j, column in enumerate(t.columns)]
    return out
