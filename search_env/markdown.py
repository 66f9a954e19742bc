"""GitHub-flavoured Markdown tables from a header and rows of cells (tables with aligned columns or
rows rendered elsewhere, as study/cost.py and the GPU smoke report, write their own lines)."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table: the header, its ``---`` line, one line per row (cells as ``str``); ends in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
