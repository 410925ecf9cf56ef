"""How many CPUs this process may use, and counts of threads or processes cut to them (without importing torch:
``dpr-gc evaluate`` runs without it)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cap_to_cpus(count: int, flag: str) -> int:
    """``count`` threads or processes (a ``flag`` value) cut to :func:`usable_cpus`, with a log line when cut.

    Cut rather than refused: the work is compute-bound, so more than the CPUs never runs faster, while OpenMP asked
    for tens of thousands of threads aborts the process and a pool of that many processes forks without end. A fixed
    upper bound would be wrong on some machine, while the CPU count is right everywhere and a command line that names
    more than this machine has still runs here."""
    cpus = usable_cpus()
    if count > cpus:
        logger.warning("%s %d is more than the %d CPU(s) this process may use; using %d", flag, count, cpus, cpus)
        return cpus
    return count
