"""``dpr-gc`` command line: one sub-command per stage; each stage module registers its own parser."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable, Optional, Sequence

from . import pipeline
from .data import stdlib_data, training as data
from .evaluation import evaluate
from .model import lora
from .retrieval import encode, index, mine, retrieve
from .train import trainer as train
from .base.args import ArgumentParser
from .base.errors import DprGcError

STAGES = (pipeline, stdlib_data, data, train, encode, index, retrieve, evaluate, mine, lora)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dpr-gc", description="Dense passage retrieval with Gradient Cache.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in STAGES:
        stage.add_cli(subparsers)
    return parser


def report_errors(action: Callable[[], Any]) -> int:
    """Run ``action`` as a command: a :class:`DprGcError` (or an ``OSError``, e.g. a full disk) becomes one
    ``error: ...`` line on stderr and exit status 2, an interrupt exit status 130; an int result is the exit status,
    anything else 0."""
    try:
        result = action()
    except DprGcError as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON) reached a UTF-8 output
        print(f"error: the input holds text that is not valid Unicode ({ascii(e.object[e.start:e.end])}, a lone "
              "surrogate from a JSON escape); fix or remove it in the input file", file=sys.stderr)
        return 2
    except OSError as e:  # refused by the OS: permissions, a full disk, a folder where a file belongs
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}; check the path and free space", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished work is kept; run the same command again to resume", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


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
