"""Rooms a contributor can hold in their head: no module of the replay over 400 lines, none in the package over
600, no function with more than 35 branch points (``if``/``elif``, loops, ``except``, conditional expressions,
each extra operand of ``and``/``or``, each ``if`` of a comprehension, ``case``), counted from the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cb"
REPLAY_LINES, MODULE_LINES, BRANCHES = 400, 600, 35


def branch_points(fn: ast.AST) -> int:
    n = 0
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.match_case)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += len(node.ifs)
    return n


def test_no_module_is_over_its_size() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        limit = REPLAY_LINES if path.parent == PACKAGE / "core" / "replay" else MODULE_LINES
        if lines > limit:
            over.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines (at most {limit})")
    assert not over, "\n".join(over)


def test_no_function_has_more_than_35_branch_points() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and branch_points(node) > BRANCHES:
                over.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: "
                            f"{branch_points(node)} branch points")
    assert not over, "\n".join(over)


def test_the_count_sees_branches() -> None:
    fn = ast.parse("def f(x):\n    if x and y or z:\n        return [a for a in x if a if a > 1]\n"
                   "    for i in x:\n        try:\n            pass\n        except E:\n            pass\n"
                   "    return 1 if x else 2\n").body[0]
    assert branch_points(fn) == 1 + 2 + 2 + 1 + 1 + 1
