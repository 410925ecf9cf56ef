"""The one formatter of the markdown tables that commands print (summaries, counts, metrics)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: Optional[Sequence[str]] = None) -> str:
    """A markdown table; ``align`` holds one separator cell per column (``---`` left, ``---:`` right)."""
    separator = align or ["---"] * len(header)
    lines = ["|" + "|".join(f" {h} " if h else " " for h in header) + "|", "|" + "|".join(separator) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_summary(summary: Mapping[str, Any], header: Sequence[str] = ("item", "value")) -> str:
    """A two-column table of a summary dict (long jobs end with one)."""
    return markdown_table(header, summary.items())
