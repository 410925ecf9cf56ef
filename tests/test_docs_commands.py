"""Every command shown in the README and docs/ parses: ``dpr-gc`` (also under ``torchrun -m dpr_gc.cli``), the DPR
scripts and the JAX example, in code blocks and inline -- its sub-command and every flag exist and take the values
shown (a renamed or removed flag fails here before it fails a reader). A command that elides flags with ``...`` is
checked for the flags it shows; only the required ones it leaves out are excused. Flags are spelt out: a unique
prefix parses (argparse's abbreviations) but a page shows the whole flag."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Callable, Optional

import pytest

from dpr_gc.base.args import ArgumentParser
from dpr_gc.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
PLACEHOLDERS = re.compile(r"<|\[|\bCOMMAND\b")  # `dpr-gc COMMAND --help`, `verify <the same flags> [--batches N]`
MISSING = "the following arguments are required"


def shell_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks in a shell language (or none named), continuation lines joined."""
    lines, body, language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, language = [], line[3:].strip()
            else:
                if language in SHELL:
                    lines += "\n".join(body).replace("\\\n", " ").splitlines()
                body = None
        elif body is not None:
            body.append(line)
    return lines


def inline_commands(text: str) -> list[str]:
    """Inline code spans outside code blocks that are commands (``dpr-gc ...``, ``scripts/X.py ...``)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    return re.findall(r"`((?:dpr-gc|scripts/\w+\.py|python |torchrun ) ?[^`]*)`", prose)


def program_and_argv(words: list[str]) -> Optional[tuple[str, list[str]]]:
    """``(program, argv)`` of a shown command: ``dpr-gc``, a ``scripts/*.py`` file or ``dpr_gc.jax.example``."""
    if words[:1] == ["torchrun"] and "dpr_gc.cli" in words:
        return "dpr-gc", words[words.index("dpr_gc.cli") + 1:]
    if words[:3] == ["python", "-m", "dpr_gc.jax.example"]:
        return "dpr_gc.jax.example", words[3:]
    if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("scripts/"):
        words = words[1:]
    if words[:1] == ["dpr-gc"] or (words and words[0].startswith("scripts/") and words[0].endswith(".py")):
        return words[0], words[1:]
    return None


def without_elisions(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` with each ``...`` gone (a flag it stood for the value of gets a placeholder value)."""
    out = []
    for word in argv:
        if word == "...":
            if out and out[-1].startswith("--"):
                out.append("x")
            continue
        out.append(word)
    return out, len(out) != len(argv) or "..." in argv


def shown_commands(page: Path) -> list[tuple[str, str, list[str], bool]]:
    """``(where, program, argv, elided)`` for every command of the page; ``&&`` chains split, comments cut. An
    inline one counts as elided: prose names a command with the flags it is about, not all it needs."""
    found = []
    text = page.read_text()
    lines = [(line, False) for line in shell_lines(text)] + [(span, True) for span in inline_commands(text)]
    for part, inline in ((p, inline) for line, inline in lines for p in line.split("&&")):
        if PLACEHOLDERS.search(part):
            continue
        parsed = program_and_argv(shlex.split(part, comments=True))
        if parsed is not None and parsed[1]:
            argv, elided = without_elisions(parsed[1])
            found.append((f"{page.name}: {part.strip()[:80]}", parsed[0], argv, elided or inline))
    return found


COMMANDS = [c for page in PAGES for c in shown_commands(page)]


ERROR_EXAMPLES = {("dpr-gc", ("train", "--batch-szie", "4"))}  # shown with the error they print


def parser_of(program: str, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """What parses ``argv`` for ``program`` (exits or raises on a bad flag), and the words put before ``argv``."""
    if program == "dpr-gc":
        command = next((word for word in argv if not word.startswith("-")), None)
        return build_parser(command), []
    if program == "dpr_gc.jax.example":
        pytest.importorskip("jax")
        from dpr_gc.jax.example import build_parser as example_parser

        return example_parser(), []
    path = ROOT / program
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if path.name == "train_dense_encoder.py":  # dpr-gc train's parser under DPR's flags: main() prepends "train"
        return module.build_parser(), ["train"]
    if hasattr(module, "build_parser"):
        return module.build_parser(), []
    return ParseOnly(module.parse_args), []


class ParseOnly(argparse.ArgumentParser):
    """A script's ``parse_args(argv)`` function (its parser and checks in one), as a parser without options."""

    def __init__(self, parse: Callable[[list[str]], object]) -> None:
        super().__init__()
        self.parse = parse

    def parse_args(self, args: Optional[list[str]] = None, namespace: object = None) -> object:
        return self.parse(list(args or []))


def parsers_in(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its sub-commands' parsers."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for child in a.choices.values() for p in parsers_in(child))]


def abbreviated(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The flags of ``argv`` that are no option's whole name (prefixes argparse took for one)."""
    names = {o for p in parsers_in(parser) for a in p._actions for o in a.option_strings}
    return [w.split("=")[0] for w in argv if w.startswith("--") and w.split("=")[0] not in names]


def without_required(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with no option required, so an elided command is checked for every flag it shows."""
    for p in parsers_in(parser):
        for action in p._actions:
            if action.required and action.option_strings:
                action.required, action.default = False, None
            elif not action.option_strings and action.nargs in (None, "+"):  # a positional: may be left out
                action.nargs, action.default = ("?" if action.nargs is None else "*"), None
    return parser


def test_the_pages_show_commands() -> None:
    shown = {argv[0] for _, program, argv, _ in COMMANDS if program == "dpr-gc"}
    assert {"train", "encode", "index", "retrieve", "evaluate", "mine", "demo", "merge-lora", "prepare-data"} <= shown
    programs = {program for _, program, _, _ in COMMANDS}
    assert {"scripts/download_dpr_data.py", "scripts/train_dense_encoder.py", "scripts/generate_dense_embeddings.py",
            "scripts/dense_retriever.py", "dpr_gc.jax.example"} <= programs
    assert any(elided for *_, elided in COMMANDS) and any(w.startswith("distributed.md: torchrun")
                                                         for w, *_ in COMMANDS)


def test_no_shown_command_passes_a_literal_backslash_n() -> None:
    """A newline in a shown flag value (an instruction prefix "...\\nQuery: ") is written $'...\\n...': bash passes
    a backslash and an n from "..." or '...', and dpr-gc would store them as they are."""
    literal = re.compile(r'"(?:[^"\\]|\\.)*\\n(?:[^"\\]|\\.)*"' + r"|(?<!\$)'[^']*\\n[^']*'")
    found = [f"{page.name}: {line.strip()}" for page in PAGES for line in shell_lines(page.read_text(encoding="utf-8"))
             if literal.search(line)]
    assert not found, found


@pytest.mark.parametrize("program, argv, elided", [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_a_documented_command_parses(program: str, argv: list[str], elided: bool, monkeypatch) -> None:
    def refuse(parser: argparse.ArgumentParser, message: str) -> None:
        raise ValueError(message)

    for cls in (argparse.ArgumentParser, ArgumentParser):  # dpr-gc's prints its one-line error and exits
        monkeypatch.setattr(cls, "error", refuse)
    if (program, tuple(argv)) in ERROR_EXAMPLES:
        return
    parser, before = parser_of(program, argv)
    try:
        try:
            parser.parse_args([*before, *argv])
        except ValueError as e:
            if not (elided and str(e).startswith(MISSING)):
                raise
            _, left = without_required(parser).parse_known_args([*before, *argv])  # the flags shown, beside the
            flags = [word for word in left if word.startswith("-")]  # ones left out ("--fsdp ...": no value)
            if flags:
                raise ValueError(f"unrecognized arguments: {' '.join(flags)}") from None
    except ValueError as e:
        pytest.fail(f"{program} {' '.join(argv)}: {e}")
    except SystemExit as stop:
        if not (stop.code == 0 and "--help" in argv):
            pytest.fail(f"{program} {' '.join(argv)}: exit {stop.code}")
    assert isinstance(parser, ParseOnly) or not abbreviated(parser, argv), f"{program} {' '.join(argv)}: spell it out"


def test_every_dotted_name_of_the_package_resolves() -> None:
    """Each ``dpr_gc.module.name`` that the package's docstrings, README, docs/, benchmarks/ and scripts/ name is a
    module or an attribute of one (a package move leaves no reference to the old path)."""
    import importlib

    files = [*ROOT.glob("dpr_gc/**/*.py"), *PAGES, *ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/*.md"),
             *ROOT.glob("scripts/*.py")]
    names = {m for f in files for m in re.findall(r"\b(dpr_gc(?:\.[A-Za-z_]\w*)+)", f.read_text())}
    assert len(names) > 50
    def is_module(dotted: str) -> bool:
        try:
            return importlib.util.find_spec(dotted) is not None
        except ModuleNotFoundError:  # a parent that is not a package
            return False

    broken = []
    for name in sorted(names):
        parts = name.split(".")
        stop = next(i for i in range(len(parts), 0, -1) if is_module(".".join(parts[:i])))
        obj = importlib.import_module(".".join(parts[:stop]))
        for attribute in parts[stop:]:
            obj = getattr(obj, attribute, None)
        if obj is None:
            broken.append(name)
    assert not broken, broken


def test_shown_shard_file_names_are_the_ones_encode_writes() -> None:
    """Every shard file named in the README and docs/ (``shard-00000-of-00001.npy`` in an example table) is spelt as
    encode names it (:func:`dpr_gc.retrieval.shards.shard_name`: five digits each), so a reader's glob finds it."""
    from dpr_gc.retrieval.shards import shard_name

    shown = {name for page in PAGES for name in re.findall(r"shard-\d+-of-\d+", page.read_text())}
    assert shown
    assert not [name for name in shown if name != shard_name(*map(int, re.findall(r"\d+", name)))], shown
