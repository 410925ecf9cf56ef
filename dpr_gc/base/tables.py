"""The one formatter of the markdown tables that commands print (summaries, counts, metrics)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

SUMMARY_HEADER = ("item", "value")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: Optional[Sequence[str]] = None) -> str:
    """A markdown table; ``align`` holds one separator cell per column (``---`` left, ``---:`` right)."""
    separator = align or ["---"] * len(header)
    lines = ["|" + "|".join(f" {h} " if h else " " for h in header) + "|", "|" + "|".join(separator) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    """A duration as the summaries' time row gives it: ``12.3 s``, and ``0.42 s`` under 10 s (a quick run's rates
    beside it stay checkable)."""
    return f"{seconds:.{2 if seconds < 10 else 1}f} s"


def format_summary(summary: Mapping[str, Any], seconds: float) -> str:
    """The closing summary every command prints: a two-column ``| item | value |`` table of ``summary`` (keys in
    words), then the ``time`` row of ``seconds`` (``12.3 s``), so every stage's table reads the same way."""
    return markdown_table(SUMMARY_HEADER, [*summary.items(), ("time", seconds_text(seconds))])
