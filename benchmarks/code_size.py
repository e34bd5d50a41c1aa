#!/usr/bin/env python
"""The largest functions and classes by line count, read from the source with ``ast`` (nothing imported).

    python benchmarks/code_size.py                          # the whole package, top 15 of each
    python benchmarks/code_size.py dflash_cb/cache --top 10 # one folder (or file)

A definition's size is its line span, decorators and docstring included (``end_lineno - lineno + 1``
of the ``def``/``class``, from the first decorator). Methods are named ``Class.method``; nested
functions ``outer.<locals>.inner``. Prints Markdown: one table of functions, one of classes, and a
line of totals (files, lines, definitions over ``--over`` lines).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Definition = tuple[int, str, str]  # (lines, kind, "path:line qualified.name")


def _span(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def definitions(path: Path, shown: str) -> Iterator[Definition]:
    """Every function and class of one file, with its size."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Definition]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                yield _span(child), "class", f"{shown}:{child.lineno} {name}"
                yield from walk(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield _span(child), "function", f"{shown}:{child.lineno} {name}"
                yield from walk(child, name + ".<locals>.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(), str(path)), "")


def python_files(targets: list[Path]) -> list[Path]:
    files: list[Path] = []
    for t in targets:
        files.extend(sorted(t.rglob("*.py")) if t.is_dir() else [t])
    return files


def report(targets: list[Path], top: int, over: int) -> str:
    files = python_files(targets)
    found: list[Definition] = []
    lines = 0
    for f in files:
        lines += len(f.read_text().splitlines())
        shown = str(f.resolve().relative_to(ROOT)) if f.resolve().is_relative_to(ROOT) else str(f)
        found.extend(definitions(f, shown))
    out = []
    for kind in ("function", "class"):
        rows = sorted((d for d in found if d[1] == kind), key=lambda d: (-d[0], d[2]))
        out += [f"| lines | {kind} |", "|---:|---|"]
        out += [f"| {n} | `{where}` |" for n, _, where in rows[:top]]
        out.append("")
    funcs = [d for d in found if d[1] == "function"]
    classes = [d for d in found if d[1] == "class"]
    out.append(f"{len(files)} files, {lines} lines; {len(funcs)} functions ({sum(d[0] > over for d in funcs)} over "
               f"{over} lines), {len(classes)} classes ({sum(d[0] > 5 * over for d in classes)} over {5 * over} lines)")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("paths", nargs="*", type=Path, default=[ROOT / "dflash_cb"],
                   help="folders or files (default: the dflash_cb package)")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--over", type=int, default=50,
                   help="count functions longer than this, and classes longer than 5 times this (default 50)")
    args = p.parse_args()
    missing = [str(t) for t in args.paths if not t.exists()]
    if missing:
        p.error(f"no such file or folder: {', '.join(missing)}")
    print(report(args.paths, args.top, args.over))


if __name__ == "__main__":
    main()
