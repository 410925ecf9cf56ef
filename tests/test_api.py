"""The public API: ``from dpr_gc import ...`` gives the library's entry points, loaded on first use, so importing
the package (or running a command that needs no model) loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dpr_gc

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_import_dpr_gc_loads_no_torch_and_no_sub_package() -> None:
    run_python("import sys, dpr_gc; assert 'torch' not in sys.modules; "
               "loaded = [m for m in sys.modules if m.startswith('dpr_gc.')]; assert not loaded, loaded")


def test_every_public_name_is_the_object_its_module_defines() -> None:
    expected = {"GradCache", "Chunking", "SimpleContrastiveLoss", "DistributedContrastiveLoss", "Retriever", "RetrieverConfig",
                "Trainer", "TrainConfig", "encode_corpus", "build_index", "retrieve", "evaluate",
                "mine_hard_negatives"}
    assert expected <= set(dpr_gc.__all__)
    for name in dpr_gc.__all__:
        module = importlib.import_module(f"dpr_gc.{dpr_gc._EXPORTS[name]}")
        assert getattr(dpr_gc, name) is getattr(module, name), name
        assert name in dir(dpr_gc)


def test_public_imports_work_in_a_fresh_interpreter() -> None:
    run_python("from dpr_gc import GradCache, SimpleContrastiveLoss, DistributedContrastiveLoss, Retriever, "
               "RetrieverConfig, Trainer, TrainConfig, encode_corpus, build_index, retrieve, evaluate, "
               "mine_hard_negatives; from dpr_gc import *; assert callable(Trainer.fit)")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Retreiver'"):
        dpr_gc.Retreiver  # noqa: B018
    with pytest.raises(ImportError):
        exec("from dpr_gc import Retreiver", {})


def test_evaluate_command_loads_no_torch(tmp_path: Path) -> None:
    """``dpr-gc evaluate`` imports only its own stage: a results file is scored with torch never loaded."""
    results = tmp_path / "results.json"
    results.write_text('[{"question": "q", "answers": ["paris"], "ctxs": [{"id": "1", "text": "in paris"}]}]')
    run_python("import sys; from dpr_gc import cli; "
               f"assert cli.main(['evaluate', '--results', {str(results)!r}, '--k', '1']) == 0; "
               "assert 'torch' not in sys.modules, 'torch loaded'")


def test_full_parser_still_lists_every_command() -> None:
    from dpr_gc import cli

    parser = cli.build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert list(choices) == list(cli.STAGES)
    assert cli.requested_command(["-v", "evaluate", "--k", "1"]) == "evaluate"


def test_listing_the_commands_loads_no_torch() -> None:
    """``dpr-gc --help``, a bare ``dpr-gc`` and a misspelt command list the commands without importing a stage (torch
    takes seconds to load); the listing is the full parser's, word for word."""
    run_python("import contextlib, io, sys; from dpr_gc import cli; out = io.StringIO()\n"
               "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit): cli.main(['--help'])\n"
               "assert 'merge-lora' in out.getvalue() and 'top-k answer accuracy' in out.getvalue(), out.getvalue()\n"
               "with contextlib.redirect_stderr(io.StringIO()): assert cli.main([]) == 2 and cli.main(['encod']) == 2\n"
               "assert 'torch' not in sys.modules, 'torch loaded'\n"
               "assert not [m for m in sys.modules if m.startswith('dpr_gc.') and m.split('.')[1] != 'base' and "
               "m != 'dpr_gc.cli']")
    from dpr_gc import cli

    assert cli.build_parser(listing=True).format_help() == cli.build_parser().format_help()


def test_each_command_is_described_in_its_own_help() -> None:
    from dpr_gc import cli

    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    for name, parser in commands.items():
        assert parser.description, name
    assert commands["train"].description == "Train a retriever with Gradient Cache (DPR files or BEIR folders)."
