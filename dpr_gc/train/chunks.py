"""Gradient Cache's chunk size when none is given: probed on a GPU, fixed on the CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base.devices import autocast_dtype

CPU_CHUNK_SIZE = 32


def auto_chunk_size(towers: nn.Module, collator: Any, device: torch.device, max_rows: int, precision: str) -> int:
    """The largest power-of-two chunk whose forward+backward at full passage length fits in 80% of GPU memory after
    room for AdamW's states; on CPU, where memory is rarely the limit, a chunk of 32 rows keeps the cores busy."""
    if device.type != "cuda":
        return min(CPU_CHUNK_SIZE, max_rows)
    params = sum(p.numel() * p.element_size() for p in towers.parameters() if p.requires_grad)
    free, total = torch.cuda.mem_get_info(device)
    budget = 0.8 * free - 2 * params
    dtype = autocast_dtype(precision)
    text = " ".join(["passage"] * collator.config.passage_max_length)
    best, rows = 1, 8
    while rows <= max_rows:
        batch = collator.tokenize_passages([""] * rows, [text] * rows)
        batch = {k: v.to(device) for k, v in batch.items()}
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        try:
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                towers(kind="passage", **batch).float().sum().backward()
            peak = torch.cuda.max_memory_allocated(device) - start
        except torch.cuda.OutOfMemoryError:
            peak = float("inf")
        towers.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if peak > budget:
            break
        best, rows = rows, rows * 2
    return min(max(best, 1), max_rows)
