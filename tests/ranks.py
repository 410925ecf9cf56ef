"""Start test ranks (torch.multiprocessing, or a command such as torchrun) without ever hanging the suite.

``run_ranks`` forks each rank from a fork server that has imported torch, transformers, peft and the engine once for
the whole test process (``PRELOAD``): a spawned rank paid 5-7 s of imports on a 2-core machine, for every rank of
every test. A rank starts with the environment of the test that starts it (the server's is the one it was started
with) and, where ``OMP_NUM_THREADS`` is set, that many torch threads.

A rank that has done its work leaves through ``os._exit`` (a loaded machine once left one stuck in interpreter
shutdown after the checks had passed), and the whole group fails after a time limit instead of waiting forever:
every process it started is killed, so no rank outlives its test.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_LIMIT_S = 420.0
PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "dpr_gc.engine.grad_cache", "dpr_gc.model.retriever",
           "dpr_gc.train.trainer"]


def _run_rank(rank: int, worker: Callable[..., None], args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    worker(rank, *args)
    leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def leave_group() -> None:
    """Tear the process group down after the worker's frame is gone: its DDP wrappers are freed first (a wrapper
    freed after the group is destroyed is gloo's last owner, and its destructor can deadlock joining a thread), then
    the ranks meet and the group is destroyed."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, limit_s: float = RANK_LIMIT_S) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes forked from the fork server; raise if one fails or the
    group outlives ``limit_s`` seconds (the stuck processes are killed)."""
    mp.set_forkserver_preload(PRELOAD)
    context = mp.start_processes(_run_rank, args=(worker, args, dict(os.environ)), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            raise TimeoutError(f"ranks {alive} still running after {limit_s:.0f} s")


def run_command(cmd: Sequence[str], limit_s: float = RANK_LIMIT_S, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own; past ``limit_s`` seconds the
    whole process group is killed (torchrun AND its ranks: ``subprocess.run``'s own timeout kills only torchrun,
    leaving the ranks orphaned) and ``TimeoutError`` carries the end of its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(map(str, cmd[:6]))} ... still running after {limit_s:.0f} s; its process "
                           f"group was killed. stderr:\n{err[-3000:]}") from None
    except BaseException:
        kill_group(proc)
        raise
    finally:
        kill_group(proc)  # a rank that outlived a finished torchrun is a stuck one
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it was started with ``start_new_session=True``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


def rank_errors(folder: Path) -> str:
    """The tracebacks the ranks wrote to ``error-*.txt``."""
    return "\n".join(p.read_text() for p in sorted(folder.glob("error-*.txt")))
