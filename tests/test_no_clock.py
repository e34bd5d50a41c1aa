"""No test asserts on a measured time: a busy machine must not fail the suite.

A test asserts counted work (blocks drafted, passes, heap pops, the cost model's predicted work against the work
counted); the timing comparisons live in ``benchmarks/`` scripts that print them. The check reads every test
module's source: an ``assert`` that uses a clock (``time.perf_counter``, ``process_time``, ``monotonic``,
``time.time``, ``timeit``, a ``PhaseTimer`` on its default clock) or a name computed from one, in the same
function, is refused. A clock used for a deadline (``while time.monotonic() < deadline``) is fine: it bounds a
wait, it asserts nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "process_time", "process_time_ns", "monotonic", "monotonic_ns",
          "thread_time", "thread_time_ns", "time", "time_ns", "timeit", "default_timer", "getrusage", "times"}
CLOCK_MODULES = {"time", "timeit", "resource", "os"}


def _is_clock(node: ast.AST, imported: set[str], helpers: set[str]) -> bool:
    """A clock read (called or passed on), a PhaseTimer on its default clock, or a module helper that reads one."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in CLOCK_MODULES and node.attr in CLOCKS
    if isinstance(node, ast.Name):
        return node.id in imported
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name == "PhaseTimer" and not any(k.arg == "clock" for k in node.keywords) and len(node.args) < 1:
            return True
        return name in helpers
    return False


def _uses(expr: ast.AST, tainted: set[str], imported: set[str], helpers: set[str]) -> bool:
    return any(_is_clock(n, imported, helpers) or (isinstance(n, ast.Name) and n.id in tainted)
               for n in ast.walk(expr))


def _bound_names(target: ast.AST) -> set[str]:
    """Names a target binds or mutates (``x``, ``x[i]``, ``x.y``, tuples of those)."""
    out = set()
    for n in ast.walk(target):
        if isinstance(n, ast.Name):
            out.add(n.id)
    return out


def _bindings(fn: ast.AST) -> list[tuple[set[str], ast.AST]]:
    """(names bound, the expression they come from) for every assignment, loop and ``with`` in ``fn``."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            out.append((set().union(*map(_bound_names, n.targets)), n.value))
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            out.append((_bound_names(n.target), n.value))
        elif isinstance(n, (ast.For, ast.comprehension)):
            out.append((_bound_names(n.target), n.iter))
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            out.append((_bound_names(n.optional_vars), n.context_expr))
        elif isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute):
            # ``times.append(time.perf_counter() - t0)``: the receiver holds what goes in
            if isinstance(n.value.func.value, ast.Name):
                out.append(({n.value.func.value.id}, n.value))
    return out


def timed_asserts(source: str, filename: str) -> list[str]:
    """``file:line`` of every ``assert`` on a measured time in ``source``."""
    tree = ast.parse(source, filename)
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module in CLOCK_MODULES for a in n.names if a.name in CLOCKS}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    helpers: set[str] = set()
    changed = True
    while changed:  # a helper that returns what a clock measured is a clock itself
        changed = False
        for fn in functions:
            if fn.name not in helpers and any(_is_clock(n, imported, helpers) for n in ast.walk(fn)) and any(
                    isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn)):
                helpers.add(fn.name)
                changed = True
    found = []
    for fn in functions:
        tainted: set[str] = set()
        bindings = _bindings(fn)
        grew = True
        while grew:
            grew = False
            for names, value in bindings:
                if not names <= tainted and _uses(value, tainted, imported, helpers):
                    tainted |= names
                    grew = True
        found += [f"{filename}:{n.lineno}" for n in ast.walk(fn)
                  if isinstance(n, ast.Assert) and _uses(n.test, tainted, imported, helpers)]
    return sorted(set(found))


def test_the_check_sees_a_timed_assert_and_lets_a_deadline_pass():
    """The check itself, on small sources: what it must refuse and what it must let through."""
    refused = {
        "def test_a():\n    t0 = time.perf_counter()\n    run()\n    assert time.perf_counter() - t0 < 1\n",
        "def secs(f):\n    s = time.process_time()\n    f()\n    return time.process_time() - s\n"
        "def test_b():\n    out = []\n    for _ in range(3):\n        out.append(secs(g))\n    assert min(out) < 2\n",
        "from time import monotonic as m\ndef test_c():\n    s = m()\n    total = m() - s\n    assert total < 3\n",
        "def test_d():\n    timer = PhaseTimer()\n    run(timer)\n    assert timer.total > 0\n",
    }
    for source in refused:
        assert timed_asserts(source, "x.py"), source
    allowed = ("def test_e():\n    deadline = time.monotonic() + 30\n    while time.monotonic() < deadline:\n"
               "        if done():\n            break\n    assert done()\n"
               "def test_f():\n    timer = PhaseTimer(clock=ticks)\n    run(timer)\n    assert timer.total <= 9\n")
    assert timed_asserts(allowed, "x.py") == []


def test_no_test_asserts_on_a_measured_time():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += timed_asserts(path.read_text(), path.name)
    assert not found, "assertions on measured time (assert counted work; time it in benchmarks/):\n" + "\n".join(found)
