"""Reading the reports' Markdown tables back in tests."""

from __future__ import annotations


def table_after(md: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table after the line that starts with ``heading``."""
    lines = md.split("\n" + heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|---")) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def difference_rows(md: str, heading: str) -> list[tuple[str, str]]:
    """(difference [interval], verdict) of each row of a table of paired differences."""
    return [(r[-2], r[-1]) for r in table_after(md, heading)]
