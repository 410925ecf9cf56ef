"""Contrastive losses over query and passage representations (DPR's in-batch negatives plus hard negatives).

Layout: ``x`` holds B query representations; ``y`` holds B·(1+n) passage representations grouped per query with the
positive first. Every query is scored against every passage in the batch, so each query sees the other queries'
positives and everyone's hard negatives as negatives.

Scores and loss are computed in fp32 whatever the input dtype, with autocast switched off inside the loss (forward
and backward stay fp32 under an outer fp16/bf16 autocast), and, by default, in row blocks of
``loss_chunk_size`` queries by a custom autograd function, so the full B × B·(1+n) score matrix never exists: the
backward pass recomputes each block's scores instead of keeping them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.errors import DprGcError

TEMPERATURE_RANGE = (0.01, 10.0)
REDUCTIONS = ("mean", "sum", "none")
_AUTO_BLOCK_ELEMENTS = 1 << 20


class _BlockedCrossEntropy(torch.autograd.Function):
    """Per row i, ``-log softmax(scale * x_i · y^T)[t_i]``, computed ``block`` rows at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, targets: torch.Tensor, block: int) -> torch.Tensor:
        lse = torch.empty(x.size(0), dtype=x.dtype, device=x.device)
        for start in range(0, x.size(0), block):
            scores = (x[start:start + block] @ y.T) * scale
            lse[start:start + block] = torch.logsumexp(scores, dim=1)
        target_scores = (x * y[targets]).sum(1) * scale
        ctx.save_for_backward(x, y, scale, targets, lse)
        ctx.block = block
        return lse - target_scores

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, y, scale, targets, lse = ctx.saved_tensors
        g = grad_out.to(x.dtype)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_y = torch.zeros_like(y) if ctx.needs_input_grad[1] else None
        grad_scale = x.new_zeros(()) if ctx.needs_input_grad[2] else None
        for start in range(0, x.size(0), ctx.block):
            xb = x[start:start + ctx.block]
            raw = xb @ y.T
            probs = torch.exp(raw * scale - lse[start:start + ctx.block, None])
            rows = torch.arange(xb.size(0), device=x.device)
            probs[rows, targets[start:start + ctx.block]] -= 1.0
            probs *= g[start:start + ctx.block, None]
            if grad_scale is not None:
                grad_scale += torch.vdot(probs.flatten(), raw.flatten())
            probs *= scale
            if grad_x is not None:
                grad_x[start:start + ctx.block] = probs @ y
            if grad_y is not None:
                grad_y += probs.T @ xb
        return grad_x, grad_y, grad_scale, None, None


def check_loss_chunk_size(block: Optional[int]) -> None:
    """``None`` (automatic), 0 (the dense reference path) or a positive number of rows per block."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 0):
        raise DprGcError(f"loss_chunk_size (--loss-chunk-size) must be a positive number of rows per block, 0 for the "
                         f"dense score matrix, or None for automatic blocks; got {block!r}")


def blocked_cross_entropy(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, targets: torch.Tensor,
                          block: Optional[int] = None) -> torch.Tensor:
    """Per-query InfoNCE losses of queries ``x`` over passages ``y``, never materialising more than ``block`` rows
    of scores. Computed in fp32, or in fp64 when the representations are fp64 (fp16/bf16 are raised to fp32)."""
    check_loss_chunk_size(block)
    if block is None:
        block = max(1, min(x.size(0), _AUTO_BLOCK_ELEMENTS // max(1, y.size(0))))
    if block == 0:
        raise DprGcError("blocked_cross_entropy needs a positive block (loss_chunk_size 0 is the dense path)")
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    return _BlockedCrossEntropy.apply(x.to(dtype), y.to(dtype), scale.to(dtype), targets, int(block))


def reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    return losses.mean() if reduction == "mean" else losses.sum() if reduction == "sum" else losses


class _InwardClamp(torch.autograd.Function):
    """Clamp whose gradient is kept wherever a descent step would move the value back into the range: a value
    past a bound is not pushed further out, but can always come back (a plain clamp's gradient there is 0)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        ctx.save_for_backward(value)
        ctx.lo, ctx.hi = lo, hi
        return value.clamp(lo, hi)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (value,) = ctx.saved_tensors
        outward = ((value < ctx.lo) & (grad > 0)) | ((value > ctx.hi) & (grad < 0))
        return grad.masked_fill(outward, 0.0), None, None


class Temperature(nn.Module):
    """A positive temperature: fixed (a buffer) or learnable (a parameter on the log scale), clamped to
    ``TEMPERATURE_RANGE`` in every use so fp16/bf16 training cannot blow the scores up. A learnable one stays
    learnable at a bound: its gradient is kept whenever the step would bring it back into the range."""

    def __init__(self, value: float, learnable: bool = False) -> None:
        super().__init__()
        lo, hi = TEMPERATURE_RANGE
        if not lo <= value <= hi:
            raise DprGcError(f"temperature must lie in [{lo}, {hi}], got {value}")
        log_value = torch.tensor(math.log(value), dtype=torch.float32)
        if learnable:
            self.log_value = nn.Parameter(log_value)
        else:
            self.register_buffer("log_value", log_value, persistent=False)

    def forward(self) -> torch.Tensor:
        lo, hi = TEMPERATURE_RANGE
        return _InwardClamp.apply(self.log_value, math.log(lo), math.log(hi)).exp()


class SimpleContrastiveLoss(nn.Module):
    """In-batch-negative InfoNCE loss, drop-in for GradCache's ``SimpleContrastiveLoss``.

    Args:
        n_hard_negatives: passages per query beyond the positive (``y`` has B·(1+n) rows).
        temperature: scores are divided by it (1.0 reproduces the original loss).
        learn_temperature: make the temperature a parameter (clamped to ``TEMPERATURE_RANGE``).
        similarity: ``"dot"`` or ``"cos"`` (L2-normalised dot product).
        symmetric: add a passage→query term (each positive must pick its query among the batch's queries) and
            average the two directions.
        loss_chunk_size: rows per block of the score matrix; ``None`` picks a block of about 1M scores (4 MB);
            ``0`` computes the dense matrix with plain autograd (the reference path); negative values are refused.

    ``forward(x, y, target=None, reduction="mean")`` as in the original: ``target`` holds, per query, the index of
    its positive among the rows of ``y`` (then ``y`` may have any number of rows); ``reduction`` is ``"mean"``,
    ``"sum"`` or ``"none"`` (one loss per query) on every path.
    """

    def __init__(self, n_hard_negatives: int = 0, temperature: float = 1.0, learn_temperature: bool = False,
                 similarity: str = "dot", symmetric: bool = False, loss_chunk_size: Optional[int] = None) -> None:
        super().__init__()
        if similarity not in ("dot", "cos"):
            raise DprGcError(f"similarity must be 'dot' or 'cos', got {similarity!r}")
        if n_hard_negatives < 0:
            raise DprGcError(f"n_hard_negatives must be >= 0, got {n_hard_negatives}")
        self.n_hard_negatives = n_hard_negatives
        self.similarity = similarity
        self.symmetric = symmetric
        check_loss_chunk_size(loss_chunk_size)
        self.loss_chunk_size = loss_chunk_size
        self.tau = Temperature(temperature, learn_temperature)

    @property
    def temperature(self) -> torch.Tensor:
        return self.tau()

    def _check(self, x: torch.Tensor, y: torch.Tensor, target: Optional[torch.Tensor], reduction: str,
               queries: Optional[int] = None) -> None:
        """``queries``: how many entries ``target`` needs (the global batch for the distributed loss)."""
        if reduction not in REDUCTIONS:
            raise DprGcError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        if x.dim() != 2 or y.dim() != 2 or x.size(1) != y.size(1):
            raise DprGcError(f"representations must be [B, D] and [N, D] with equal D; got {tuple(x.shape)} "
                             f"and {tuple(y.shape)}")
        if target is not None:
            queries = x.size(0) if queries is None else queries
            if target.shape != (queries,) or target.dtype.is_floating_point:
                raise DprGcError(f"target must hold one passage index per query ({queries}), got shape "
                                 f"{tuple(target.shape)} of {target.dtype}")
            if queries and not (0 <= int(target.min()) and int(target.max()) < y.size(0) * self._world()):
                raise DprGcError(f"target indexes passage rows, which run from 0 to {y.size(0) * self._world() - 1}")
            return
        group = 1 + self.n_hard_negatives
        if y.size(0) != x.size(0) * group:
            raise DprGcError(f"{x.size(0)} queries need {x.size(0) * group} passages (1 positive + "
                             f"{self.n_hard_negatives} hard negatives each), got {y.size(0)}: check the batch layout "
                             "or n_hard_negatives, or pass target")

    def _world(self) -> int:
        return 1

    def _prepare(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = x.float(), y.float()
        if self.similarity == "cos":
            x, y = nn.functional.normalize(x, dim=-1), nn.functional.normalize(y, dim=-1)
        return x, y

    def _direction(self, x: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        scale = self.temperature.to(x.device).reciprocal()
        if self.loss_chunk_size == 0:
            return nn.functional.cross_entropy((x @ y.T) * scale, targets, reduction=reduction)
        return reduce(blocked_cross_entropy(x, y, scale, targets, self.loss_chunk_size), reduction)

    def _loss(self, x: torch.Tensor, y_all: torch.Tensor, targets: torch.Tensor, x_all: torch.Tensor,
              query_index: torch.Tensor, reduction: str) -> torch.Tensor:
        """Loss of the queries ``x``, whose positives sit at rows ``targets`` of ``y_all``, against all passages;
        the symmetric term scores those positives against all queries ``x_all`` (``x`` is ``x_all[query_index]``).
        Autocast is off: an outer fp16/bf16 autocast would otherwise lower the scores' precision."""
        with torch.autocast(x.device.type, enabled=False):
            x, y_all = self._prepare(x, y_all)
            loss = self._direction(x, y_all, targets, reduction)
            if self.symmetric:
                x_all, positives = self._prepare(x_all, y_all[targets])
                loss = (loss + self._direction(positives, x_all, query_index, reduction)) / 2
            return loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, target: Optional[torch.Tensor] = None,
                reduction: str = "mean") -> torch.Tensor:
        self._check(x, y, target, reduction)
        query_index = torch.arange(x.size(0), device=x.device)
        targets = query_index * (1 + self.n_hard_negatives) if target is None else target.to(x.device)
        return self._loss(x, y, targets, x, query_index, reduction)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums every rank's gradient and returns this rank's slice.

    Written with all_reduce rather than reduce_scatter so it runs on gloo as well as nccl.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        ctx.rank, ctx.size = rank, tensor.size(0)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's gradient may have other consumers
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size]


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank (equal sizes); gradients flow back to each rank's own part."""
    return _AllGather.apply(tensor)


class DistributedContrastiveLoss(SimpleContrastiveLoss):
    """The same loss over the global batch of all ranks (create it after the process group is initialised).

    Each rank gathers every rank's queries and passages with gradient, and returns the mean loss of ITS OWN queries
    against all passages. The gradient rule: the backward of the gather sums all ranks' contributions into each
    rank's representations, so after DDP averages the parameter gradients over the W ranks every rank holds exactly
    the gradient of the global-batch mean loss (W·B queries) -- no world-size factor is needed anywhere. This holds
    when every rank has the same local batch size, which the gather requires. A learnable temperature is local to
    this module: :class:`~dpr_gc.GradCache` averages its gradient over ranks. As in the original package, a
    ``target`` holds one index per query of the GLOBAL batch (rank order) into the gathered passages.
    """

    def __init__(self, n_hard_negatives: int = 0, **kwargs) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise DprGcError("DistributedContrastiveLoss needs torch.distributed initialised first "
                             "(init_process_group); use SimpleContrastiveLoss in a single process")
        super().__init__(n_hard_negatives=n_hard_negatives, **kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def _world(self) -> int:
        return self.world_size

    def forward(self, x: torch.Tensor, y: torch.Tensor, target: Optional[torch.Tensor] = None,
                reduction: str = "mean") -> torch.Tensor:
        self._check(x, y, target, reduction, queries=x.size(0) * self.world_size)
        x_all = all_gather_with_grad(x)
        y_all = all_gather_with_grad(y)
        query_index = torch.arange(x.size(0), device=x.device) + self.rank * x.size(0)
        if target is None:
            targets = query_index * (1 + self.n_hard_negatives)
        else:
            targets = target.to(x.device)[query_index]
        return self._loss(x, y_all, targets, x_all, query_index, reduction)
