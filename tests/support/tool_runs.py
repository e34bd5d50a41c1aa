"""Test helpers: the command-line tools as the oracle of the live numbers (``tools/eval_drafter.py`` on the
weights a loop saved at an evaluated step), and small comparisons."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from figures import T1_RTOL, is_float_figure

from dflash_cb.core.figures.metrics import CI_HIGH_SUFFIX, CI_LOW_SUFFIX

BUDGETS = [4, 8]
PREFIX = "dflash_eval/"


def same(a: float, b: float) -> bool:
    """Equal to the last bit (every figure but the float estimate is a ratio of integer counts: tests/support/figures.py),
    NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path: a folder left as it was has the same digest."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def tool_metrics(cache: Path, drafter_dir: Path, out: Path, light: bool, block_size: int,
                 budgets: tuple[int, ...] = BUDGETS) -> dict[str, Any]:
    """``tools/eval_drafter.py`` on a saved drafter, with the profile of the live evaluation (``budgets``: the
    live evaluation's DDTree budgets, none for a family without trees)."""
    from dflash_cb.integrations.cli import eval_drafter as eval_cli

    profile = (["--anchor-stride", str(block_size), "--ddtree-budgets", str(max(budgets)) if budgets else ""]
               if light else ["--ddtree-budgets", ",".join(map(str, budgets))])
    assert eval_cli.main(["--states", str(cache), "--drafter", str(drafter_dir), "--out", str(out), *profile,
                          "--device", "cpu", "--dtype", "float32"]) == 0
    return json.loads(out.read_text())["metrics"]


def assert_logged_equals_tool(logged: dict[str, float], expected: dict[str, Any], where: Any, prefix: str = PREFIX,
                              skip: tuple[str, ...] = (), approx: tuple[str, ...] = ()) -> None:
    from dflash_cb.core.drafters.registry import families
    from dflash_cb.core.figures.metrics import EVAL_TIME

    assert logged[prefix + "tau"] == expected["tau"], where
    for k, v in expected.items():
        if k == EVAL_TIME or k in skip or any(f.figures.from_own_pass(k) for f in families()):
            continue  # a family's own pass (EAGLE-3: SpecForge's accuracy) is the tools', not the live evaluation's
        if v is None:  # NaN in results.json, not logged
            assert prefix + k not in logged, (where, k)
        elif is_float_figure(k.removesuffix(CI_LOW_SUFFIX).removesuffix(CI_HIGH_SUFFIX)) or k in approx:
            # The forward's batch-shape rounding (tests/support/figures.py): the live pass and the tool's batch differently.
            assert logged[prefix + k] == pytest.approx(v, rel=T1_RTOL), (where, k, logged[prefix + k], v)
        else:
            assert same(logged[prefix + k], v), (where, k, logged[prefix + k], v)


def assert_step_equals_tool(cache: Path, drafter_dir: Path, out: Path, logged: dict[str, float], full: bool,
                            block_size: int, where: Any, approx: tuple[str, ...] = (),
                            budgets: tuple[int, ...] = BUDGETS) -> None:
    """One evaluated step against the tool on that step's weights: the main keys are the light profile's
    at every evaluation; a full evaluation's ``full/`` keys are the tool's default (stride 1, every budget).
    The cost keys describe the pass that ran (the full one at a full evaluation); how a light pass drafted
    (``anchors_drafted``) is the evaluator's choice: it drafts every anchor at once where that is cheaper.
    ``approx``: more keys compared as the float estimate is (``figures.is_float_figure``, to ``T1_RTOL``)."""
    light = tool_metrics(cache, drafter_dir, out.with_suffix(".light.json"), True, block_size, budgets)
    assert_logged_equals_tool(logged, light, where, skip=("anchors_drafted", "anchors_needed") if full
                              else ("anchors_drafted",), approx=approx)
    if full:
        exact = tool_metrics(cache, drafter_dir, out.with_suffix(".full.json"), False, block_size, budgets)
        assert_logged_equals_tool(logged, exact, where, prefix=PREFIX + "full/", approx=approx)
