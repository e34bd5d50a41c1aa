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


def _is_clock(node: ast.AST, imported: set[str]) -> bool:
    """A clock read, called or passed on (``time.perf_counter``, ``process_time`` imported by name, ...)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in CLOCK_MODULES and node.attr in CLOCKS
    return isinstance(node, ast.Name) and node.id in imported


class _Scope:
    """What one function knows: names holding a clock's reading (``raw``: a timestamp, a deadline) and names
    holding a measured time (``measured``: a difference of readings, a default ``PhaseTimer``)."""

    def __init__(self, imported: set[str], helpers: set[str]):
        self.imported, self.helpers = imported, helpers
        self.raw: set[str] = set()
        self.measured: set[str] = set()

    def reads(self, expr: ast.AST) -> bool:
        return any(_is_clock(n, self.imported) or (isinstance(n, ast.Name) and n.id in self.raw | self.measured)
                   for n in ast.walk(expr))

    def measures(self, expr: ast.AST) -> bool:
        """A time measured in ``expr``: two readings subtracted or compared, a measured name, a helper that
        returns one, or a ``PhaseTimer`` on its default clock. A single reading (a timestamp, ``now + 30`` for a
        deadline) measures nothing."""
        for n in ast.walk(expr):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and (self.reads(n.left) or self.reads(n.right)):
                return True
            if isinstance(n, ast.Compare) and sum(map(self.reads, [n.left, *n.comparators])) >= 2:
                return True
            if isinstance(n, ast.Name) and n.id in self.measured:
                return True
            if isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                if name in self.helpers or (name == "PhaseTimer" and not n.args
                                            and not any(k.arg == "clock" for k in n.keywords)):
                    return True
        return False

    def learn(self, bindings: list[tuple[set[str], ast.AST]]) -> None:
        grew = True
        while grew:
            grew = False
            for names, value in bindings:
                if not names <= self.measured and self.measures(value):
                    self.measured |= names
                    grew = True
                elif not names <= self.raw | self.measured and self.reads(value):
                    self.raw |= names
                    grew = True


def _bound_names(target: ast.AST) -> set[str]:
    """Names a target binds or mutates (``x``, ``x[i]``, ``x.y``, tuples of those)."""
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _bindings(nodes: list[ast.AST]) -> list[tuple[set[str], ast.AST]]:
    """(names bound, the expression they come from) for every assignment, loop and ``with`` among a function's
    ``nodes``."""
    out = []
    for n in nodes:
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
    nodes = {fn: list(ast.walk(fn)) for fn in functions}  # each function read once, used on every pass below
    bindings = {fn: _bindings(nodes[fn]) for fn in functions}
    returns = {fn: [n.value for n in nodes[fn] if isinstance(n, ast.Return) and n.value is not None]
               for fn in functions}
    asserts = {fn: [n for n in nodes[fn] if isinstance(n, ast.Assert)] for fn in functions}
    helpers: set[str] = set()
    changed = True
    while changed:  # a helper that returns what a clock measured is a clock itself
        changed = False
        for fn in functions:
            if fn.name in helpers:
                continue
            scope = _Scope(imported, helpers)
            scope.learn(bindings[fn])
            if any(map(scope.measures, returns[fn])):
                helpers.add(fn.name)
                changed = True
    found = []
    for fn in functions:
        scope = _Scope(imported, helpers)
        scope.learn(bindings[fn])
        found += [f"{filename}:{n.lineno}" for n in asserts[fn] if scope.measures(n.test)]
    return sorted(set(found))


def test_the_check_sees_a_timed_assert_and_lets_a_deadline_pass():
    """The check itself, on small sources: what it must refuse and what it must let through."""
    refused = {
        "def test_a():\n    t0 = time.perf_counter()\n    run()\n    assert time.perf_counter() - t0 < 1\n",
        "def secs(f):\n    s = time.process_time()\n    f()\n    return time.process_time() - s\n"
        "def test_b():\n    out = []\n    for _ in range(3):\n        out.append(secs(g))\n    assert min(out) < 2\n",
        "from time import monotonic as m\ndef test_c():\n    s = m()\n    total = m() - s\n    assert total < 3\n",
        "def test_d():\n    timer = PhaseTimer()\n    run(timer)\n    assert timer.total > 0\n",
        "def test_h():\n    deadline = time.monotonic() + 30\n    run()\n    assert time.monotonic() < deadline\n",
    }
    for source in refused:
        assert timed_asserts(source, "x.py"), source
    allowed = ("def test_e():\n    deadline = time.monotonic() + 30\n    while time.monotonic() < deadline:\n"
               "        if done():\n            break\n    assert done()\n"
               "def test_f():\n    timer = PhaseTimer(clock=ticks)\n    run(timer)\n    assert timer.total <= 9\n"
               "def answer():\n    return {'created': int(time.time())}\n"
               "def test_g():\n    a = answer()\n    assert a['created'] > 0\n")
    assert timed_asserts(allowed, "x.py") == []


def test_no_test_asserts_on_a_measured_time():
    found = []
    for path in sorted(TESTS.rglob("*.py")):  # the tests, their folders and their support modules
        found += timed_asserts(path.read_text(), str(path.relative_to(TESTS)))
    assert not found, "assertions on measured time (assert counted work; time it in benchmarks/):\n" + "\n".join(found)
