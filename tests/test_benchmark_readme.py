"""benchmarks/README.md's figures each say where they came from: every section (``##``-``####`` heading) holding a
table of measured numbers names a results file under ``results/``, a date and a command (``python ...`` or
``dpr-gc ...``), as the guide asks of every figure in the docs."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path
from typing import Optional

import pytest

from dpr_gc.base.errors import DprGcError

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


def _readme_commands() -> list[tuple[str, list[str]]]:
    """(script, arguments) of every ``python benchmarks/NAME.py ...`` line in the README's bash blocks, continuation
    lines joined and trailing comments dropped; lines with an elided ``...`` are left out."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split("  #")[0].strip()
            found = re.match(r"python benchmarks/(\w+)\.py\b(.*)", line)
            if found and "..." not in line:
                commands.append((found.group(1), shlex.split(found.group(2))))
    return commands


def test_every_readme_command_is_one_its_script_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's command for gradcache-512.json gave ``--methods gradcache,st-cmnrl``, a method since renamed
    ``dpr-gc``: the script refused it. Each command the README gives is parsed by its script (those with a
    ``parse_args``); a refusal only because this machine has no GPU or lacks a peer package is not the command's."""
    monkeypatch.syspath_prepend(str(README.parent))
    checked = 0
    for script, args in _readme_commands():
        module = importlib.import_module(script)
        if not hasattr(module, "parse_args"):
            continue
        try:
            module.parse_args(args)
        except SystemExit as refused:
            pytest.fail(f"{script}.py refused the README's command {' '.join(args)} (exit {refused.code})")
        except DprGcError as refused:
            assert "CUDA" in str(refused) or "package" in str(refused), (script, args, str(refused))
        checked += 1
    assert checked >= 30, checked


def _resolved_output(module: object, args: object) -> Optional[Path]:
    """Where a parsed README command writes its results file by default (None where the script names none)."""
    if hasattr(module, "output_path") and getattr(args, "device", None) in ("cpu", "cuda"):
        return Path(module.output_path(args, args.device))
    output = getattr(args, "output", None)
    return Path(output) if isinstance(output, str) and output.endswith(".json") else None


def test_every_readme_command_writing_a_committed_name_writes_that_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A README command that writes a committed file under benchmarks/results by default writes one the README names
    (a trial run of other sizes goes to NAME-quick.json, see bench_common), and the README's commands for the
    committed frontier-cpu.json, gradcache.json, chunk-cost-cpu.json,
    join-limit-cpu.json, frozen-casts-cpu.json and profile-step-cpu.json resolve to them."""
    monkeypatch.syspath_prepend(str(README.parent))
    text, results, written = README.read_text(encoding="utf-8"), README.parent / "results", set()
    for script, args in _readme_commands():
        module = importlib.import_module(script)
        try:
            output = _resolved_output(module, module.parse_args(args)) if hasattr(module, "parse_args") else None
        except DprGcError:  # no GPU or peer here (checked above)
            continue
        if output is None or not output.is_file() or output.parent.resolve() != results.resolve():
            continue
        assert f"results/{output.name}" in text, (script, args, output.name)
        written.add(output.name)
    expected = {"frontier-cpu.json", "gradcache.json", "chunk-cost-cpu.json", "join-limit-cpu.json",
                "frozen-casts-cpu.json", "profile-step-cpu.json"}
    assert expected <= written, expected - written


DOCS = [README, README.parents[1] / "README.md", *sorted((README.parents[1] / "docs").glob("*.md"))]
# committed results no benchmark script writes under their name, each with where it came from
NOT_WRITTEN_BY_A_SCRIPT = {
    "answers-tokenizer-engine.json": "bench_answers.py runs on two commits' tokenizer engines, gathered by hand",
    "demo-xeon.json": "the metrics.json of `dpr-gc demo --output runs/demo` (README.md)",
    "scifact-before-fix.json": "scifact.py's scifact.json of an earlier commit, renamed",
    "scifact-e3-lr1e-4.json": "scifact.py's scifact.json of an earlier commit's variant, renamed",
    "scifact-loop-seed1.json": "scifact-loop.json's training phases rerun with --seed 1, gathered by hand",
}


def _quoted_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(script, arguments) of every ``python benchmarks/NAME.py ...`` command ``path`` quotes: in its bash blocks
    (continuation lines joined, trailing comments dropped), its indented code and its inline code; those with an
    elided ``...`` are left out."""
    text, commands = path.read_text(encoding="utf-8"), []
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
             for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    inline = re.findall(r"`[^`]*?\b(python\s+benchmarks/[^`]+)`", prose)
    for line in lines + inline + re.findall(r"^ {4,}(python benchmarks/.*)$", prose, flags=re.MULTILINE):
        found = re.match(r"\s*python\s+benchmarks/(\w+)\.py\b(.*)", line.split("  #")[0], flags=re.DOTALL)
        if found and "..." not in line:
            commands.append((found.group(1), shlex.split(found.group(2))))
    return commands


def _written_file(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> Optional[Path]:
    """The results file a quoted command writes, as its script's parse_args and output resolution have it
    (nothing run); a command naming ``cuda`` resolves as on a machine with a GPU, luyug/GradCache as installed.
    None where the script refuses it."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: "cuda" in " ".join(args))
    module = importlib.import_module(script)
    monkeypatch.setattr(module, "require_cuda", lambda device: None, raising=False)
    monkeypatch.setattr(module, "original_version", lambda: "installed", raising=False)
    try:
        parsed = module.parse_args(args)
        output = module.results_file(parsed) if hasattr(module, "results_file") else getattr(parsed, "output", None)
    except (SystemExit, DprGcError):
        return None
    return Path(output).resolve() if output else None


def test_every_committed_results_file_is_written_by_a_quoted_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """chunk-cost-cuda-h200.json, chunk-cost-cpu-minilm-256.json, frontier-cpu-bf16-512.json and others were
    quoted beside commands without --output, which write chunk-cost-cuda.json, frontier-cpu-quick.json, ...: the
    commands no longer reproduced them. Every committed results JSON is the file one command quoted in
    benchmarks/README.md, README.md or docs/ writes, resolved by its script's parse_args (nothing run)."""
    monkeypatch.syspath_prepend(str(README.parent))
    written = {_written_file(script, args, monkeypatch) for path in DOCS for script, args in _quoted_commands(path)}
    committed = sorted((README.parent / "results").glob("*.json"))
    missing = {f.name for f in committed if f.resolve() not in written}
    assert missing == set(NOT_WRITTEN_BY_A_SCRIPT), (f"{len(missing)} of {len(committed)} committed results files no "
                                                     f"quoted command writes: {sorted(missing)}")


def test_the_quoted_commands_are_read_from_blocks_inline_code_and_continuation_lines(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("text (`MALLOC_MMAP_MAX_=0 python benchmarks/chunk_cost.py --rows 64\n--repeats 3`) and\n"
                   "```bash\npython benchmarks/chunk_cost.py --device cuda \\\n    --output x.json  # a note\n"
                   "python benchmarks/chunk_cost.py ... elided\n```\n", encoding="utf-8")
    assert sorted(_quoted_commands(doc)) == [("chunk_cost", ["--device", "cuda", "--output", "x.json"]),
                                             ("chunk_cost", ["--rows", "64", "--repeats", "3"])]


def test_a_command_without_output_does_not_write_a_hand_named_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(README.parent))
    args = ["--device", "cuda", "--rows", "512", "--chunks", "1", "2", "4", "8", "16", "32", "64", "--precisions",
            "bf16"]
    results = (README.parent / "results").resolve()
    assert _written_file("chunk_cost", args, monkeypatch) == results / "chunk-cost-cuda-quick.json"
    named = [*args, "--output", "benchmarks/results/chunk-cost-cuda-h200.json"]
    assert _written_file("chunk_cost", named, monkeypatch) == results / "chunk-cost-cuda-h200.json"
