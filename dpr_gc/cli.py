"""``dpr-gc`` command line: one sub-command per stage; each stage module registers its own parser."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from . import pipeline
from .data import stdlib_data, training as data
from .evaluation import evaluate
from .model import lora
from .retrieval import encode, index, mine, retrieve
from .train import trainer as train
from .base.args import ArgumentParser
from .base.errors import report_errors

STAGES = (pipeline, stdlib_data, data, train, encode, index, retrieve, evaluate, mine, lora)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dpr-gc", description="Dense passage retrieval with Gradient Cache.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in STAGES:
        stage.add_cli(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a refused command line (its one error line is printed) returns 2; --help still exits
        if e.code in (0, None):
            raise
        return int(e.code) if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return report_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
