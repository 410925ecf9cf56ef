"""benchmarks/README.md's figures each say where they came from: every section (``##``-``####`` heading) holding a
table of measured numbers names a results file under ``results/``, a date and a command (``python ...`` or
``dpr-gc ...``), as the guide asks of every figure in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
RULE = re.compile(r"^\|[-:| ]+\|$", re.MULTILINE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
FIGURE = re.compile(r"^\**[-+−~]?\d")
COMMAND = re.compile(r"\b(python|dpr-gc)\s+\S")


def _sections() -> list[tuple[str, str]]:
    """(heading, text) of each section of the README, split at every heading of level 2 to 4."""
    parts = re.split(r"\n(?=#{2,4} )", README.read_text(encoding="utf-8"))
    return [(part.split("\n", 1)[0], part) for part in parts]


def _has_measured_table(text: str) -> bool:
    """Whether a table in ``text`` has a cell that is a figure (it starts with a number, bold or not); a table of
    names and meanings has none."""
    for block in re.findall(r"(?:^\|.*\|\n)+", text, flags=re.MULTILINE):
        rows = block.splitlines()
        if len(rows) > 2 and RULE.match(rows[1]) and any(FIGURE.match(cell.strip()) for row in rows[2:]
                                                                for cell in row.split("|")):
            return True
    return False


@pytest.mark.parametrize("heading, text", [pytest.param(*s, id=s[0].lstrip("# ")[:50]) for s in _sections()
                                           if _has_measured_table(s[1])])
def test_every_table_of_figures_names_its_results_file_date_and_command(heading: str, text: str) -> None:
    missing = [name for name, found in (("a results/ file", "results/" in text), ("a date", DATE.search(text)),
                                        ("a command", COMMAND.search(text))) if not found]
    assert not missing, f"{heading}: its table of figures names no {', '.join(missing)}"


def test_a_section_with_a_bare_table_is_caught() -> None:
    assert _has_measured_table("| a | b |\n|---|---|\n| x | 1.5 |\n")
    assert not _has_measured_table("| name | what |\n|---|---|\n| plain | the whole batch |\n")
