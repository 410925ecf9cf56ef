"""Gradient Cache's chunk size when none is given: probed on a GPU, fixed on the CPU; and how a chunk size reads."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..base.devices import autocast_dtype
from ..base.logs import counted
from ..engine.chunking import sequence_lengths
from ..engine.grad_cache import trims_exactly

CPU_CHUNK_SIZE = 32


FIRST_PROBE_ROWS = 8


def auto_chunk_size(towers: nn.Module, collator: Any, device: torch.device, max_rows: int, precision: str) -> int:
    """The largest chunk of at most ``max_rows`` rows, a power of two or ``max_rows`` itself, whose forward+backward
    at full passage length fits in 80% of free GPU memory after room for AdamW's states; on CPU, where memory is
    rarely the limit, a chunk of 32 rows keeps the cores busy."""
    if device.type != "cuda":
        return min(CPU_CHUNK_SIZE, max_rows)
    params = sum(p.numel() * p.element_size() for p in towers.parameters() if p.requires_grad)
    free, _ = torch.cuda.mem_get_info(device)
    budget = 0.8 * free - 2 * params
    return largest_fitting_rows(lambda rows: probe_peak_bytes(towers, collator, device, rows, precision), budget,
                                max_rows)


def auto_chunk_rows(auto: int, rows: int, keep_before_last: bool) -> int:
    """An automatic chunk size for a side of ``rows`` rows per rank: ``auto`` rows (the device's choice) at most
    ``rows``; with ``keep_before_last`` (DDP or FSDP with a memory budget) at most half of them. There each tower's
    last chunk is replayed, since its backward syncs the gradients, so only the chunks before it can keep their
    graphs: one chunk per tower would keep none."""
    return min(auto, max(1, rows // 2) if keep_before_last else rows)


def auto_chunk_reason(cuda: bool, parallel: str, keep_before_last: bool) -> str:
    """Why the automatic chunk sizes are what they are, as the log says it (``parallel``: "DDP", "FSDP2" or ""
    in one process; ``keep_before_last``: see :func:`auto_chunk_rows`)."""
    why = ("the largest that fits 80% of the GPU's free memory, probed at full passage length" if cuda else
           f"on the CPU {CPU_CHUNK_SIZE} rows keep the cores busy")
    replayed = f"under {parallel} each tower's last chunk is replayed, its backward syncing the gradients"
    if keep_before_last:
        return f"{why}, at most half the per-rank batch: {replayed}, so the chunks before it keep their graphs"
    if cuda:
        return why
    why += ", at most the batch; memory is rarely the limit there"
    if parallel:
        return (f"{why}, but {replayed}: with --memory-budget auto, chunks of at most half the per-rank batch keep "
                "the graphs of all but the last")
    return f"{why}: --memory-budget auto keeps the graphs that fit and skips their second forward"


def largest_fitting_rows(peak_bytes: Callable[[int], float], budget: float, max_rows: int) -> int:
    """The largest of 1, 2, 4, ... below ``max_rows`` and ``max_rows`` itself whose ``peak_bytes`` fits ``budget``
    (1 when none does): probed upwards from 8 rows (or ``max_rows`` if smaller), downwards if that does not fit."""
    sizes = sorted({min(2 ** k, max_rows) for k in range(max(1, max_rows).bit_length() + 1)})
    first = sizes.index(min(FIRST_PROBE_ROWS, max_rows))
    if peak_bytes(sizes[first]) > budget:
        return next((rows for rows in reversed(sizes[:first]) if peak_bytes(rows) <= budget), 1)
    best = sizes[first]
    for rows in sizes[first + 1:]:
        if peak_bytes(rows) > budget:
            break
        best = rows
    return best


def probe_peak_bytes(towers: nn.Module, collator: Any, device: torch.device, rows: int, precision: str) -> float:
    """The CUDA memory one training forward+backward of ``rows`` passages at full length takes (inf when it runs
    out of memory). Its dropout draws leave the random state as it was: how many probes run depends on the precision
    and the free memory, which would otherwise decide the masks of every batch after."""
    dtype = autocast_dtype(precision)
    text = " ".join(["passage"] * collator.config.passage_max_length)
    batch = collator.tokenize_passages([""] * rows, [text] * rows)
    batch = {k: v.to(device) for k, v in batch.items()}
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            towers(kind="passage", **batch).float().sum().backward()
        peak = float(torch.cuda.max_memory_allocated(device) - start)
    except torch.cuda.OutOfMemoryError:
        peak = float("inf")
    towers.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return peak


def chunk_sizes(rows: int, tokens: Optional[int]) -> str:
    """A side's chunk size as train's log and verify's header say it: "chunks of 5 rows / 1 token"."""
    return f"chunks of {rows_and_tokens(rows, tokens)}"


def rows_and_tokens(rows: int, tokens: Optional[int]) -> str:
    """A chunk size in words: "5 rows / 1 token", "5 rows" without a token limit."""
    return counted(rows, "row") + (f" / {counted(tokens, 'token')}" if tokens else "")


def both_chunk_sizes(rows: Sequence[int], tokens: Sequence[Optional[int]], joiner: str = ", ") -> str:
    """The query and passage chunk sizes in the first step's words: "query chunks of 8 rows / 2 tokens, passage
    chunks of 16 rows" (``joiner`` between the sides)."""
    return joiner.join(f"{side} {chunk_sizes(n, t)}" for side, n, t in zip(("query", "passage"), rows, tokens))


def longest_row_tokens(model: nn.Module, model_input: dict, trim: Optional[bool] = None) -> Optional[int]:
    """The tokens a chunk by tokens counts for the longest row of ``model_input`` run through ``model``: its real
    tokens where the engine trims the chunks (``trim`` as ``Chunking.trim``), else the padded width; None without a
    2-D attention mask. A limit below it leaves that row a chunk of its own
    (:func:`~dpr_gc.engine.chunking.token_spans`)."""
    lengths = sequence_lengths(model_input)
    if lengths is None or lengths.numel() == 0:
        return None
    return int(lengths.max()) if trims_exactly(model, model_input, trim) else int(model_input["attention_mask"].size(1))
