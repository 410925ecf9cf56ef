"""Functions stay small: none in dpr_gc/ is longer than 60 lines or takes more than 12 parameters (``self`` and
``cls`` not counted; ``*args`` and ``**kwargs`` count one each). Long parameter lists become settings objects."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dpr_gc"
MAX_LINES = 60
MAX_PARAMETERS = 12


def functions() -> list[tuple[str, int, int]]:
    """``(module:function, lines, parameters)`` for every function and method in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            positional = args.posonlyargs + args.args
            count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
            if positional and positional[0].arg in ("self", "cls"):
                count -= 1
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((f"{path.relative_to(PACKAGE.parent)}:{node.name}", node.end_lineno - start + 1, count))
    return out


def test_the_checker_sees_every_function() -> None:
    found = {name for name, _, _ in functions()}
    assert "dpr_gc/retrieval/retrieve.py:run_retrieval" in found and len(found) > 300


def test_no_function_is_longer_than_60_lines() -> None:
    long = [f"{name} ({lines} lines)" for name, lines, _ in functions() if lines > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_no_function_takes_more_than_12_parameters() -> None:
    wide = [f"{name} ({count} parameters)" for name, _, count in functions()
            if count > MAX_PARAMETERS]
    assert not wide, f"functions with more than {MAX_PARAMETERS} parameters: {wide}"
