"""``dpr-gc`` command line: one sub-command per stage; each stage module registers its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from .base.args import ArgumentParser
from .base.errors import report_errors
from .base.logs import setup_logging

# sub-command -> the stage module (under dpr_gc) that registers it, in the order ``--help`` lists them
STAGES = {"demo": "pipeline", "make-stdlib-data": "data.stdlib_data", "prepare-data": "data.training",
          "train": "train.trainer", "verify": "train.verify", "encode": "retrieval.encode", "index": "retrieval.index",
          "retrieve": "retrieval.retrieve", "evaluate": "evaluation.evaluate", "mine": "retrieval.mine",
          "merge-lora": "model.lora", "cache": "data.arrow_cache"}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The ``dpr-gc`` parser; given a known ``command``, only that stage is imported and registered, so a command
    loads what it uses and no more (``dpr-gc evaluate`` loads no torch)."""
    parser = ArgumentParser(prog="dpr-gc", description="Dense passage retrieval with Gradient Cache.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, plus the dependencies' own log lines and progress bars")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in STAGES.items():
        if command not in STAGES or command == name:
            importlib.import_module(f"{__package__}.{module}").add_cli(subparsers)
    return parser


def requested_command(argv: Sequence[str]) -> Optional[str]:
    """The sub-command named on the command line (the first argument that is not an option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(requested_command(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a refused command line (its one error line is printed) returns 2; --help still exits
        if e.code in (0, None):
            raise
        return int(e.code) if isinstance(e.code, int) else 2
    setup_logging(args.verbose)
    return report_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
