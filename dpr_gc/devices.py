"""Where and in which precision models run: the one device picker and the one precision -> autocast dtype map."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


def default_device(device: Optional[str] = None) -> str:
    """``device`` when given, else ``cuda:LOCAL_RANK`` (torchrun's, else 0) when a GPU is available, else ``cpu``."""
    if device:
        return device
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"


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


def pick_precision(precision: str, device: torch.device) -> Optional[str]:
    """Resolve ``auto``: bf16 on GPUs that support it, else fp16; bf16 on CPUs with native bf16, else fp32."""
    if precision != "auto":
        return None if precision == "fp32" else precision
    if device.type != "cuda":
        return "bf16" if cpu_has_native_bf16() else None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
