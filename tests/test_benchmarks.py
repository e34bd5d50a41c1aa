"""Every benchmark script imports against the package as it is now (a moved name breaks a script no test runs
otherwise); the scripts' figures are their own to print, never asserted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_a_benchmark_script_imports(script: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    spec = importlib.util.spec_from_file_location(f"benchmark_{script[:-3]}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines its functions; main() runs only as a script
    assert module.__doc__, f"{script}: a benchmark says in its docstring what it measures and how to run it"
