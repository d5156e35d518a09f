"""Helpers shared by the benches: a wide console and a rich table as Markdown (for README.md)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def console() -> Console:
    """A console wide enough for the bench tables, also when the output is a pipe."""
    return Console(width=220)


def markdown(table: Table) -> str:
    """``table`` as a GitHub Markdown table (title as a bold line, caption below)."""
    cols = table.columns
    rows = [[str(c) for c in col._cells] for col in cols]
    lines = [f"**{table.title}**", ""] if table.title else []
    lines.append("| " + " | ".join(str(c.header) for c in cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    lines.extend("| " + " | ".join(r[i] for r in rows) + " |" for i in range(table.row_count))
    if table.caption:
        lines += ["", str(table.caption)]
    return "\n".join(lines) + "\n"


def show(table: Table, out: Console, as_markdown: bool) -> None:
    """Print ``table`` on ``out``, as Markdown with ``as_markdown``."""
    if as_markdown:
        out.print(markdown(table), markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(table)
