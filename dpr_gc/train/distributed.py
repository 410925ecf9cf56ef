"""The process group under ``torchrun`` and the module DDP wraps."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import nn

from ..base.devices import default_device
from ..base.errors import DprGcError
from ..model.retriever import Retriever

T = TypeVar("T")


def setup_distributed(device: Optional[str]) -> tuple[int, int, torch.device]:
    """Join the ``torchrun`` process group when its environment is set (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(default_device(device))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, (dist.get_world_size() if dist.is_initialized() else 1), dev


def refused_together(check: Callable[[], None]) -> None:
    """Run ``check`` (a refusal of this rank's inputs) on every rank and share the outcome, so that every rank refuses
    when one does (on several machines nothing else would stop the others). Call it after joining the group: a rank
    that refused before would leave the other machines' ranks waiting to join for gloo's 30 minutes. A refusal every
    rank made alike is printed once per machine; otherwise each rank prints its own (``rank N stopped: ...``)."""
    try:
        check()
        error = None
    except DprGcError as refused:
        error = str(refused)
    if not dist.is_initialized():
        if error is not None:
            raise DprGcError(error)
        return
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    refusing = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not refusing:
        return
    refused = DprGcError(error if error is not None else f"rank {refusing[0][0]} stopped: {refusing[0][1]}")
    refused.alike = all(e == errors[0] for e in errors)  # else each rank's line is its own: each prints it
    raise refused


def from_rank0(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, its result sent to every other rank, which does not compute it: for what each rank
    needs but costs a read of the inputs (the training files' fingerprints). Without a process group, ``compute()``."""
    if not dist.is_initialized():
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every_rank(value: T, world: int) -> Union[T, list[T]]:
    """``value`` itself in one process, else every rank's as a list (a checkpoint restores each rank's own)."""
    if world == 1:
        return value
    values: list = [None] * world
    dist.all_gather_object(values, value)
    return values


def same_on_every_rank(value: Any, what: str, fix: str) -> None:
    """Refuse, on every rank at once, a ``value`` that differs between ranks (each rank's digest of what it read):
    ranks that trained on different data would average gradients of different batches without a word. Without a
    process group, nothing to compare."""
    if not dist.is_initialized():
        return
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        ranks = ", ".join(map(str, differing))
        refused = DprGcError(f"{what} differs between ranks: rank{'s' if len(differing) > 1 else ''} {ranks} loaded "
                             f"other data than rank 0; {fix}")
        refused.alike = True  # every rank raises these words
        raise refused


class Towers(nn.Module):
    """What DDP wraps: ``forward(kind=..., **batch)`` encodes one side (Gradient Cache chunks);
    ``forward(query=..., passage=...)`` encodes both in one call (plain training needs one forward per backward)."""

    ignores_padding = True  # the retriever's outputs (:attr:`dpr_gc.model.retriever.Encoder.ignores_padding`)

    def __init__(self, retriever: Retriever) -> None:
        super().__init__()
        self.retriever = retriever

    @property
    def counts_positions_from_mask(self) -> bool:
        """The retriever's (:attr:`dpr_gc.model.retriever.Retriever.counts_positions_from_mask`): left padding is cut
        from the chunks exactly when positions follow the mask."""
        return self.retriever.counts_positions_from_mask

    def forward(self, kind: Optional[str] = None, query: Any = None, passage: Any = None, **batch: torch.Tensor) -> Any:
        if kind is not None:
            return self.retriever(kind, **batch)
        return self.retriever("query", **query), self.retriever("passage", **passage)
