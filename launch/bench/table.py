"""The table a person reads after a benchmark, beside its JSON lines: stdout keeps one
JSON record per line (for files and tools), the table goes to stderr with the progress."""

from __future__ import annotations

import sys


def cell(value, digits: int = 1) -> str:
    """A figure as a table shows it: rounded, "-" for none."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(title: str, header: list[str], rows: list[list[str]], notes: list[str] = ()) -> str:
    """title, then the columns (right-aligned under their headers), then notes."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    lines = [title, rule, "  ".join(h.rjust(w) for h, w in zip(header, widths)), rule]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join([*lines, rule, *notes])


def show(text: str) -> None:
    print(f"\n{text}", file=sys.stderr, flush=True)
