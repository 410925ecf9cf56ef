"""Start test ranks with torch.multiprocessing without ever hanging the suite.

A rank that has done its work leaves through ``os._exit`` (a loaded machine once left one stuck in interpreter
shutdown after the checks had passed), and the whole group fails after a time limit instead of waiting forever.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def _run_rank(rank: int, worker: Callable[..., None], args: tuple) -> None:
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, limit_s: float = 600.0) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; raise if one fails or the group outlives
    ``limit_s`` seconds (the stuck processes are killed)."""
    context = mp.start_processes(_run_rank, args=(worker, args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks {alive} still running after {limit_s:.0f} s")


def rank_errors(folder: Path) -> str:
    """The tracebacks the ranks wrote to ``error-*.txt``."""
    return "\n".join(p.read_text() for p in sorted(folder.glob("error-*.txt")))
