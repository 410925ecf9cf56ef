"""What the benchmark scripts share: where a results file goes by default (a smoke run never overwrites the
committed results of a full one), their command line (comma-separated list flags, a CUDA device checked up front)
and how a script runs (a bad input is one ``error:`` line and exit status 2, as for ``dpr-gc``; the dependencies'
INFO lines and progress bars off, as ``dpr-gc`` has them without ``--verbose``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from dpr_gc.base.args import ArgumentParser  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.logs import quiet_dependencies  # noqa: E402


def results_path(stem: str, smoke: bool) -> str:
    """The default results file ``benchmarks/results/STEM.json``, or ``STEM-quick.json`` for a smoke run
    (``--quick``, ``--tiny``): the committed results of a full run are never the target of a smoke run."""
    return str(RESULTS / f"{stem}{'-quick' if smoke else ''}.json")


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, named by the first line of its docstring: a bad flag or value is one ``error:`` line."""
    return ArgumentParser(description=doc.strip().splitlines()[0])


def int_list(text: str) -> list[int]:
    """A list flag's type: comma-separated positive integers (``8,32,128``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 8,32)")
    return values


def name_list(text: str) -> list[str]:
    """A list flag's type: comma-separated names (``plain,gc``), empty entries dropped."""
    return [x for x in text.split(",") if x]


def check_choices(flag: str, given: list[str], choices: tuple[str, ...]) -> None:
    """Refuse names in ``given`` that are not among ``choices``, naming the flag."""
    unknown = [x for x in given if x not in choices]
    if unknown or not given:
        raise DprGcError(f"{flag} {','.join(unknown) or '(none)'}: choose from {','.join(choices)}")


def require_cuda(device: str) -> None:
    """Refuse ``--device cuda`` (or ``cuda:N``) where torch sees no CUDA device, before anything starts."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise DprGcError(f"--device {device}: torch sees no CUDA device on this machine; run it where one is, or "
                         "give --device cpu")


def setup_logging(fmt: str = "%(asctime)s %(message)s", level: int = logging.INFO) -> None:
    """A script's log: its own lines at ``level`` in ``fmt``; the dependencies' (FAISS's loader, datasets' "JAX
    version ... available", transformers' "Loading weights" and "Writing model shards" bars) quiet, children too."""
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S")
    quiet_dependencies()


def run_script(main: Callable[[], Any]) -> int:
    """Run a script's ``main`` as a command, the dependencies quiet from the start (see :func:`setup_logging`): a
    :class:`DprGcError` or an ``OSError`` becomes one ``error:`` line and exit status 2 (see
    :func:`dpr_gc.base.errors.report_errors`); the exit status to pass to ``sys.exit``."""
    quiet_dependencies()
    return report_errors(main)
