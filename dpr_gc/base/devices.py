"""Where and in which precision models run: the one device picker and the one precision -> autocast dtype map."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


def default_device(device: Optional[str] = None) -> str:
    """``device`` when given, else ``cuda:LOCAL_RANK`` (torchrun's, else 0) when a GPU is available, else ``cpu``.

    A bare ``cuda`` also means this process's GPU, ``cuda:LOCAL_RANK``: ``torch.cuda.set_device`` needs an index, and
    under ``torchrun --device cuda`` each rank must take its own GPU."""
    if device == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if device:
        return device
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"


def cpu_threads(device: torch.device) -> str:
    """For a log line about work on ``device``: ``; N CPU threads`` (torch's intra-op threads, which ``OMP_NUM_THREADS``
    or ``torch.set_num_threads`` set, else one per core) on the CPU, nothing on a GPU."""
    if torch.device(device).type != "cpu":
        return ""
    n = torch.get_num_threads()
    return f"; {n} CPU thread{'' if n == 1 else 's'}"


def autocast_dtype(precision: Optional[str]) -> Optional[torch.dtype]:
    """The autocast dtype of a precision name: bf16 and fp16 autocast, anything else (fp32, int8, None) runs
    without autocast."""
    return AUTOCAST_DTYPES.get(precision) if precision is not None else None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX), where bf16 autocast speeds encoding up
    (1.3-1.5x on MiniLM, benchmarks/results/encode.json); elsewhere it is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_if_emulated(precision: Optional[str], device: torch.device) -> None:
    """Warn that bf16 asked for on a CPU without native bf16 is emulated there: slower than fp32, not faster."""
    if precision == "bf16" and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        logger.warning("--precision bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
                       "bf16 is emulated here and runs slower than fp32; leave --precision out for fp32")


def pick_precision(precision: str, device: torch.device) -> Optional[str]:
    """Resolve ``auto``: bf16 on GPUs that support it, else fp16; bf16 on CPUs with native bf16, else fp32."""
    if precision != "auto":
        return None if precision == "fp32" else precision
    if device.type != "cuda":
        return "bf16" if cpu_has_native_bf16() else None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def steady_malloc(threshold: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for a long streaming job (``retrieve``, ``mine``); returns
    whether it was set.

    glibc raises the threshold each time a large block is freed, so later large tensors come from the heap, which
    fragments: a retrieval run's peak RSS then creeps up with the number of questions (788 -> 863-906 MB from 10,570
    to 50,000 questions) although nothing is kept. A fixed threshold sends blocks of at least 1 MiB straight back to
    the system (729 -> 744 MB, benchmarks/results/answers.json). Left alone when the user set
    ``MALLOC_MMAP_THRESHOLD_`` or the C library is not glibc.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD


def at_least_fp32(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype representations, scores and losses are kept in: fp16/bf16 raised to fp32, float64 kept."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out
