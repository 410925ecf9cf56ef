"""Every ``dpr-gc`` command shown in the README and docs/ parses: its sub-command and every flag exist and take the
values shown (a renamed or removed flag fails here before it fails a reader)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dpr_gc.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced code blocks in a shell language (or none named)."""
    blocks, body, language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, language = [], line[3:].strip()
            else:
                if language in SHELL:
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def shown_commands(page: Path) -> list[tuple[str, list[str]]]:
    """``(where, argv)`` for every ``dpr-gc ...`` line of the page's code blocks, continuation lines joined and
    comments cut, ``&&`` chains split; lines that elide flags with ``...`` are left out (they are not whole commands)."""
    found = []
    for block in shell_blocks(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] != ["dpr-gc"] or "..." in words or "<" in part:
                    continue
                found.append((f"{page.name}: {part.strip()[:80]}", words[1:]))
    return found


COMMANDS = [c for page in PAGES for c in shown_commands(page)]


def test_the_pages_show_commands() -> None:
    shown = {argv[0] for _, argv in COMMANDS if argv}
    assert {"train", "encode", "index", "retrieve", "evaluate", "mine", "demo"} <= shown


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_a_documented_command_parses(argv: list[str]) -> None:
    command = next((word for word in argv if not word.startswith("-")), None)
    try:
        build_parser(command).parse_args(argv)
    except SystemExit as stop:
        pytest.fail(f"dpr-gc {' '.join(argv)}: exit {stop.code}")
