"""Contrastive losses over query and passage representations (DPR's in-batch negatives plus hard negatives).

Layout: ``x`` holds B query representations; ``y`` holds B·(1+n) passage representations grouped per query with the
positive first. Every query is scored against every passage in the batch, so each query sees the other queries'
positives and everyone's hard negatives as negatives.

Scores and loss are computed in fp32 (float64 inputs stay float64), with autocast switched off inside the loss
(forward and backward stay fp32 under an outer fp16/bf16 autocast), and, by default, in row blocks of
``loss_chunk_size`` queries by a custom autograd function, so the full B × B·(1+n) score matrix never exists: the
backward pass recomputes each block's scores instead of keeping them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.devices import at_least_fp32
from ..base.errors import DprGcError
from ..base.logs import counted
from .arguments import as_int, as_number, check_bool, is_integer

TEMPERATURE_RANGE = (0.01, 10.0)
REDUCTIONS = ("mean", "sum", "none")
_AUTO_BLOCK_ELEMENTS = 1 << 20


class Exclusion:
    """Which scores of a score matrix are dropped: those whose row and column share a key (the same passage),
    except each row's target column (its own positive).

    ``row_keys`` is ``[R, Kr]`` and ``col_keys`` ``[C, Kc]`` (int64, ``-1`` for no key): row ``r`` drops column
    ``c`` when any of its keys equals any of the column's. Masks are built one block of rows at a time, so the full
    ``R x C`` mask never exists either.
    """

    def __init__(self, row_keys: torch.Tensor, col_keys: torch.Tensor, targets: torch.Tensor) -> None:
        self.row_keys, self.col_keys, self.targets = row_keys, col_keys, targets

    def block(self, start: int, stop: int) -> torch.Tensor:
        """The ``[stop - start, C]`` boolean mask of rows ``start:stop`` (True: dropped)."""
        rows = self.row_keys[start:stop]
        mask = torch.zeros(rows.size(0), self.col_keys.size(0), dtype=torch.bool, device=rows.device)
        for a in range(rows.size(1)):
            key = rows[:, a, None]
            for c in range(self.col_keys.size(1)):
                mask |= (key == self.col_keys[None, :, c]) & (key >= 0)
        mask[torch.arange(rows.size(0), device=rows.device), self.targets[start:stop]] = False
        return mask

    def dense(self) -> torch.Tensor:
        return self.block(0, self.row_keys.size(0))

    def count(self, block: int) -> int:
        """How many scores are dropped in all."""
        return sum(int(self.block(s, s + block).sum()) for s in range(0, self.row_keys.size(0), block))


def _no_autocast(tensor: torch.Tensor) -> torch.autocast:
    """Autocast off on ``tensor``'s device: a backward runs under whatever autocast is active where ``.backward()``
    is called (GradCache calls it inside the user's step), so it is switched off to keep the forward's precision."""
    return torch.autocast(tensor.device.type, enabled=False)


class _Scores(torch.autograd.Function):
    """``x @ y.T`` whose backward stays in the inputs' precision under an outer autocast (the dense path)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, y)
        return x @ y.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        with _no_autocast(x):
            grad = grad.to(x.dtype)
            return (grad @ y if ctx.needs_input_grad[0] else None), (grad.T @ x if ctx.needs_input_grad[1] else None)


class _BlockedCrossEntropy(torch.autograd.Function):
    """Per row i, ``-log softmax(scale * x_i · y^T)[t_i]`` over the scores ``exclusion`` keeps, computed ``block``
    rows at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, targets: torch.Tensor, block: int,
                exclusion: Optional[Exclusion] = None) -> torch.Tensor:
        lse = torch.empty(x.size(0), dtype=x.dtype, device=x.device)
        target_scores = torch.empty_like(lse)
        for start in range(0, x.size(0), block):
            scores = (x[start:start + block] @ y.T) * scale
            # The target's score from the same product as the log-sum-exp (a separate dot product sums in another
            # order): a row's loss is then never negative, and exactly 0 when its target is the only score kept.
            target_scores[start:start + block] = scores.gather(1, targets[start:start + block, None]).squeeze(1)
            if exclusion is not None:
                scores.masked_fill_(exclusion.block(start, start + block), float("-inf"))
            lse[start:start + block] = torch.logsumexp(scores, dim=1)
        ctx.save_for_backward(x, y, scale, targets, lse)
        ctx.block, ctx.exclusion = block, exclusion
        return lse - target_scores

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with _no_autocast(grad_out):
            return _BlockedCrossEntropy._backward(ctx, grad_out) + (None,)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor):
        x, y, scale, targets, lse = ctx.saved_tensors
        g = grad_out.to(x.dtype)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_y = torch.zeros_like(y) if ctx.needs_input_grad[1] else None
        grad_scale = x.new_zeros(()) if ctx.needs_input_grad[2] else None
        for start in range(0, x.size(0), ctx.block):
            xb = x[start:start + ctx.block]
            raw = xb @ y.T
            probs = torch.exp(raw * scale - lse[start:start + ctx.block, None])
            if ctx.exclusion is not None:
                probs.masked_fill_(ctx.exclusion.block(start, start + ctx.block), 0.0)
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
    if block is not None and (not is_integer(block) or block < 0):
        raise DprGcError(f"loss_chunk_size (--loss-chunk-size) must be a positive number of rows per block, 0 for the "
                         f"dense score matrix, or None for automatic blocks; got {block!r}")


def blocked_cross_entropy(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, targets: torch.Tensor,
                          block: Optional[int] = None, exclusion: Optional[Exclusion] = None) -> torch.Tensor:
    """Per-query InfoNCE losses of queries ``x`` over passages ``y`` (without the scores ``exclusion`` drops), never
    materialising more than ``block`` rows of scores. Computed in fp32, or in fp64 when the representations are fp64
    (fp16/bf16 are raised to fp32), forward and backward, whatever autocast is active."""
    check_loss_chunk_size(block)
    if block is None:
        block = max(1, min(x.size(0), _AUTO_BLOCK_ELEMENTS // max(1, y.size(0))))
    if block == 0:
        raise DprGcError("blocked_cross_entropy needs a positive block (loss_chunk_size 0 is the dense path)")
    dtype = at_least_fp32(x.dtype, y.dtype)
    with _no_autocast(x):  # the forward's products too: an outer autocast would run them in bf16/fp16
        return _BlockedCrossEntropy.apply(x.to(dtype), y.to(dtype), scale.to(dtype), targets, int(block), exclusion)


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
    learnable at a bound: its gradient is kept whenever the step would bring it back into the range.

    Past a bound that rule holds per call, on the gradient of that call alone, so a step that calls the temperature
    more than once (a model applying it in every forward, once per Gradient Cache chunk) would get a gradient that
    depends on how the batch was split. Inside the range, the bounds included, the gradient is the plain one, exact
    however the batch is split: :meth:`keep_in_range_` before each step (as the trainer does) keeps it there.

    Args:
        value: the starting temperature, within ``TEMPERATURE_RANGE`` (else a :class:`DprGcError`).
        learnable: make it a parameter (``log_value``, on the log scale as CLIP's, Radford et al. 2021).

    Returns:
        ``tau()``: the temperature, a 0-dim fp32 tensor (differentiable when learnable).

    Example:
        >>> import torch
        >>> from dpr_gc.engine.loss import Temperature
        >>> tau = Temperature(0.05, learnable=True)
        >>> round(tau().item(), 4)
        0.05
        >>> with torch.no_grad():              # as if an optimizer step took it past the upper bound, 10
        ...     _ = tau.log_value.fill_(5.0)
        >>> round(tau().item(), 4)             # every use is clamped
        10.0
        >>> tau.keep_in_range_()               # and this puts the parameter back on the bound
        >>> round(tau.log_value.exp().item(), 4)
        10.0
    """

    def __init__(self, value: float, learnable: bool = False) -> None:
        super().__init__()
        value = as_number("temperature", value, *TEMPERATURE_RANGE)
        log_value = torch.tensor(math.log(value), dtype=torch.float32)
        if check_bool("learnable", learnable):
            self.log_value = nn.Parameter(log_value)
        else:
            self.register_buffer("log_value", log_value, persistent=False)

    def forward(self) -> torch.Tensor:
        lo, hi = TEMPERATURE_RANGE
        return _InwardClamp.apply(self.log_value, math.log(lo), math.log(hi)).exp()

    def keep_in_range_(self) -> None:
        """Put a value that an optimizer step (or a loaded file) left past a bound back onto that bound."""
        lo, hi = TEMPERATURE_RANGE
        with torch.no_grad():
            self.log_value.clamp_(math.log(lo), math.log(hi))


class SimpleContrastiveLoss(nn.Module):
    """In-batch-negative InfoNCE loss (DPR's), a drop-in for GradCache's ``SimpleContrastiveLoss``.

    Every query is scored against every passage of the batch, so the other queries' positives and everyone's hard
    negatives are its negatives; its loss is the cross-entropy of its positive among them.

    Args:
        n_hard_negatives: passages per query beyond the positive (``y`` has B·(1+n) rows).
        temperature: scores are divided by it (1.0 reproduces the original loss).
        learn_temperature: make the temperature a parameter (clamped to ``TEMPERATURE_RANGE``).
        similarity: ``"dot"`` or ``"cos"`` (L2-normalised dot product).
        symmetric: add a passage→query term (each positive must pick its query among the batch's queries) and
            average the two directions.
        loss_chunk_size: rows per block of the score matrix; ``None`` picks a block of about 1M scores (4 MB);
            ``0`` computes the dense matrix with plain autograd (the reference path); negative values are refused.

    Inputs, ``forward(x, y, target=None, reduction="mean", passage_ids=None, positive_ids=None)`` as in the original:
        ``x`` ``[B, D]`` query and ``y`` ``[N, D]`` passage representations, any float dtype; ``y`` is grouped per
        query with the positive first (``N = B·(1+n)``), unless ``target`` (integer ``[B]``) gives, per query, the
        row of ``y`` holding its positive (then ``N`` is free). ``reduction`` is ``"mean"``, ``"sum"`` or
        ``"none"`` on every path.

    Returns:
        The loss in fp32 (float64 for float64 inputs) under any outer autocast: a scalar, or ``[B]`` with
        ``reduction="none"``.

    References:
        Karpukhin et al. 2020, "Dense Passage Retrieval for Open-Domain Question Answering" (in-batch negatives);
        Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", whose package
        (luyug/GradCache) has the ``SimpleContrastiveLoss`` this replaces. With ``similarity="cos"`` and
        ``temperature=1/scale`` it is sentence-transformers' ``MultipleNegativesRankingLoss(model, scale)``, and
        with ``symmetric=True`` the same with ``directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction"``; their ``CachedMultipleNegativesRankingLoss`` is
        ``GradCache(models, chunk_sizes, SimpleContrastiveLoss(...))`` here (the same gradients with dropout off;
        with it on, the two draw their masks for differently shaped chunks).

    Duplicate positives: when two queries of a batch share a positive passage, or one passage appears twice, a
    query would see a copy of its own positive as a negative. ``passage_ids`` (int64, one per row of ``y``, equal
    for the same passage, ``-1`` when unknown; or ``[N, K]``, several keys per row, two rows holding the same
    passage when any key is equal, e.g. its id and its text) drops, for every query, each other row holding the
    passage of its positive; ``positive_ids`` (int64 ``[B, K]``, ``-1`` padding) adds all the passages a query
    counts as positive.
    :attr:`masked_scores` then says how many scores the last call dropped (this rank's queries);
    ``GradCache(...)(q, p, passage_ids=ids)`` passes them on.

    Example:
        >>> import torch
        >>> from dpr_gc import SimpleContrastiveLoss
        >>> loss_fn = SimpleContrastiveLoss(n_hard_negatives=1, temperature=0.05, similarity="cos")
        >>> queries = torch.randn(4, 8, requires_grad=True)
        >>> passages = torch.randn(8, 8)          # per query: its positive, then its hard negative
        >>> loss = loss_fn(queries, passages)
        >>> loss.shape, loss.dtype
        (torch.Size([]), torch.float32)
        >>> loss.backward()
        >>> loss_fn(queries, passages, reduction="none").shape
        torch.Size([4])
        >>> x, y = torch.randn(2, 8), torch.randn(2, 8)
        >>> dedup = SimpleContrastiveLoss()
        >>> float(dedup(x, y, passage_ids=torch.tensor([7, 7]))), dedup.masked_scores  # both positives: passage 7
        (0.0, 2)
    """

    def __init__(self, n_hard_negatives: int = 0, temperature: float = 1.0, learn_temperature: bool = False,
                 similarity: str = "dot", symmetric: bool = False, loss_chunk_size: Optional[int] = None) -> None:
        super().__init__()
        if similarity not in ("dot", "cos"):
            raise DprGcError(f"similarity must be 'dot' or 'cos', got {similarity!r}")
        self.n_hard_negatives = as_int("n_hard_negatives", n_hard_negatives, 0)
        self.similarity = similarity
        self.symmetric = check_bool("symmetric", symmetric)
        check_loss_chunk_size(loss_chunk_size)
        self.loss_chunk_size = None if loss_chunk_size is None else int(loss_chunk_size)
        self.tau = Temperature(temperature, check_bool("learn_temperature", learn_temperature))
        self.masked_scores = 0

    @property
    def temperature(self) -> torch.Tensor:
        return self.tau()

    @property
    def target_per_qry(self) -> int:
        """Passages per query (its positive and hard negatives): the original loss's attribute, for its subclasses."""
        return self.n_hard_negatives + 1

    @target_per_qry.setter
    def target_per_qry(self, value: int) -> None:
        self.n_hard_negatives = as_int("target_per_qry", value, 1) - 1

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
        self._check_layout(x, y)

    def _check_layout(self, x: torch.Tensor, y: torch.Tensor) -> None:
        group = 1 + self.n_hard_negatives
        if y.size(0) != x.size(0) * group:
            raise DprGcError(f"{x.size(0)} queries need {x.size(0) * group} passages (1 positive + "
                             f"{counted(self.n_hard_negatives, 'hard negative')} each), got {y.size(0)}: check the "
                             "batch layout "
                             "or n_hard_negatives, or pass target")

    @staticmethod
    def _check_ids(x: torch.Tensor, y: torch.Tensor, passage_ids: Optional[torch.Tensor],
                   positive_ids: Optional[torch.Tensor]) -> None:
        if passage_ids is None:
            if positive_ids is not None:
                raise DprGcError("positive_ids needs passage_ids (one id per passage row)")
            return
        if passage_ids.dim() not in (1, 2) or passage_ids.size(0) != y.size(0) or passage_ids.dtype.is_floating_point:
            raise DprGcError(f"passage_ids must hold one integer id per passage row ({y.size(0)}), or [rows, K] ids, "
                             f"got shape {tuple(passage_ids.shape)} of {passage_ids.dtype}")
        if positive_ids is not None and (positive_ids.dim() != 2 or positive_ids.size(0) != x.size(0)
                                         or positive_ids.dtype.is_floating_point):
            raise DprGcError(f"positive_ids must be integer ids [queries ({x.size(0)}), K], got shape "
                             f"{tuple(positive_ids.shape)} of {positive_ids.dtype}")

    def _world(self) -> int:
        return 1

    @staticmethod
    def _keys(passage_ids: torch.Tensor, targets: torch.Tensor,
              positive_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``passage_ids`` as ``[N, K]`` keys per passage row, and the ``[B, K']`` keys of every passage each query
        counts as positive: its target's, then ``positive_ids``."""
        passage_ids = passage_ids.long().reshape(passage_ids.size(0), -1)
        own = passage_ids[targets]
        positives = own if positive_ids is None else torch.cat([own, positive_ids.to(own.device).long()], dim=1)
        return passage_ids, positives

    def _prepare(self, dtype: torch.dtype, *reps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``reps`` in ``dtype``, each row normalised once under ``"cos"``."""
        reps = tuple(rep.to(dtype) for rep in reps)
        if self.similarity == "cos":
            reps = tuple(nn.functional.normalize(rep, dim=-1) for rep in reps)
        return reps

    def _direction(self, x: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, reduction: str,
                   exclusion: Optional[Exclusion]) -> torch.Tensor:
        scale = self.temperature.to(x.device).reciprocal()
        if self.loss_chunk_size == 0:
            scores = _Scores.apply(x, y) * scale
            if exclusion is not None:
                scores = scores.masked_fill(exclusion.dense(), float("-inf"))
            return nn.functional.cross_entropy(scores, targets, reduction=reduction)
        return reduce(blocked_cross_entropy(x, y, scale, targets, self.loss_chunk_size, exclusion), reduction)

    def _loss(self, x: torch.Tensor, y_all: torch.Tensor, targets: torch.Tensor, x_all: torch.Tensor,
              query_index: torch.Tensor, reduction: str, keys: Optional[tuple[torch.Tensor, torch.Tensor]] = None
              ) -> torch.Tensor:
        """Loss of the queries ``x``, whose positives sit at rows ``targets`` of ``y_all``, against all passages;
        the symmetric term scores those positives against all queries ``x_all`` (``x`` is ``x_all[query_index]``).
        ``keys``: the ids ``[N_all, K]`` of every row of ``y_all`` and the positive ids ``[B_all, K']`` of every
        query of ``x_all`` (duplicate positives are dropped). Autocast is off: an outer fp16/bf16 autocast would
        otherwise lower the scores' precision (the backward passes switch it off too)."""
        forward_mask = backward_mask = None
        if keys is not None:
            passage_ids, positive_keys = keys
            forward_mask = Exclusion(positive_keys[query_index], passage_ids, targets)
            backward_mask = Exclusion(passage_ids[targets], positive_keys, query_index)
            self.masked_scores = forward_mask.count(max(1, _AUTO_BLOCK_ELEMENTS // max(1, y_all.size(0))))
        else:
            self.masked_scores = 0
        with torch.autocast(x.device.type, enabled=False):
            dtype = at_least_fp32(x.dtype, y_all.dtype)
            x, y_all = self._prepare(dtype, x, y_all)
            loss = self._direction(x, y_all, targets, reduction, forward_mask)
            if self.symmetric:  # y_all's rows are normalised already
                x_all, = self._prepare(dtype, x_all)
                loss = (loss + self._direction(y_all[targets], x_all, query_index, reduction, backward_mask)) / 2
            return loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, target: Optional[torch.Tensor] = None,
                reduction: str = "mean", passage_ids: Optional[torch.Tensor] = None,
                positive_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check(x, y, target, reduction)
        self._check_ids(x, y, passage_ids, positive_ids)
        query_index = torch.arange(x.size(0), device=x.device)
        targets = query_index * (1 + self.n_hard_negatives) if target is None else target.to(x.device, torch.long)
        keys = None
        if passage_ids is not None:
            keys = self._keys(passage_ids.to(x.device), targets, positive_ids)
        return self._loss(x, y, targets, x, query_index, reduction, keys)


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


def gather_ids(ids: torch.Tensor) -> torch.Tensor:
    """Concatenate the ``[n, K]`` integer ids of every rank (``n`` equal; ``K`` may differ: padded with -1)."""
    width = torch.tensor([ids.size(1)], device=ids.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    ids = nn.functional.pad(ids, (0, int(width) - ids.size(1)), value=-1)
    parts = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, ids.contiguous())
    return torch.cat(parts, dim=0)


def gather_loss_ids(passage_ids: Optional[torch.Tensor], positive_ids: Optional[torch.Tensor],
                    device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Every rank's passage ids ``[n]`` (or ``[n, K]``) and positive ids ``[n, K]`` (either may be None), in rank
    order on ``device``: what the loss over the gathered batch masks by."""
    passages = None
    if passage_ids is not None:
        passages = gather_ids(passage_ids.to(device).long().reshape(passage_ids.size(0), -1))
        passages = passages[:, 0] if passage_ids.dim() == 1 else passages
    positives = None if positive_ids is None else gather_ids(positive_ids.to(device).long())
    return passages, positives


class DistributedContrastiveLoss(SimpleContrastiveLoss):
    """The same loss over the global batch of all ranks (create it after the process group is initialised).

    Each rank gathers every rank's queries and passages with gradient, and returns the mean loss of ITS OWN queries
    against all passages. The gradient rule: the backward of the gather sums all ranks' contributions into each
    rank's representations, so after DDP averages the parameter gradients over the W ranks every rank holds exactly
    the gradient of the global-batch mean loss (W·B queries) -- no world-size factor is needed anywhere. This holds
    when every rank has the same local batch size, which the gather requires. A learnable temperature is local to
    this module: :class:`~dpr_gc.GradCache` averages its gradient over ranks.

    Args:
        n_hard_negatives: and every other argument as in :class:`SimpleContrastiveLoss`.

    Inputs, ``forward(x, y, target=None, reduction="mean", passage_ids=None, positive_ids=None)``:
        this rank's ``x`` ``[B, D]`` and ``y`` ``[N, D]``, laid out as for :class:`SimpleContrastiveLoss`, with
        the same ``B`` and ``N`` on every rank. As in the original package, ``target`` holds one index per query of
        the GLOBAL batch (``[W·B]``, rank order) into the gathered passages.

    Returns:
        The fp32 loss of this rank's queries against the passages of all ranks (``[B]`` with ``reduction="none"``).

    References:
        ``DistributedContrastiveLoss`` of luyug/GradCache (Gao et al. 2021), which this replaces, taking its
        arguments and global ``target``. Two differences: it returns this rank's queries' loss (their mean) where
        the original returns the global batch's, and its parameter gradients are W times the original's (whose
        gather passes no gradient to other ranks, so after DDP's averaging it holds 1/W of the global-batch
        gradient); here they are exactly the global-batch mean loss's gradient.

    Example (one process here; under ``torchrun`` every rank runs the same lines on its own batch):
        >>> import tempfile
        >>> import torch
        >>> import torch.distributed as dist
        >>> from dpr_gc import DistributedContrastiveLoss, SimpleContrastiveLoss
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0,
        ...                         world_size=1)
        >>> x, y = torch.randn(4, 8), torch.randn(8, 8)
        >>> loss = DistributedContrastiveLoss(n_hard_negatives=1)(x, y)
        >>> torch.allclose(loss, SimpleContrastiveLoss(n_hard_negatives=1)(x, y))  # one rank: the plain loss
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, n_hard_negatives: int = 0, **kwargs) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise DprGcError("DistributedContrastiveLoss needs torch.distributed initialised first "
                             "(init_process_group); use SimpleContrastiveLoss in a single process")
        super().__init__(n_hard_negatives=n_hard_negatives, **kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def word_size(self) -> int:
        """The world size under the original loss's name for it, for its subclasses."""
        return self.world_size

    def _world(self) -> int:
        return self.world_size

    def gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` concatenated in rank order, with gradient flowing back to each rank's own rows (the
        original's hook: a subclass overriding it gathers the representations its own way)."""
        return all_gather_with_grad(t)

    def forward(self, x: torch.Tensor, y: torch.Tensor, target: Optional[torch.Tensor] = None,
                reduction: str = "mean", passage_ids: Optional[torch.Tensor] = None,
                positive_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``passage_ids`` and ``positive_ids`` are this rank's (its passages, its queries); they are gathered, so
        a query's positive is dropped from the negatives of every rank's queries."""
        self._check(x, y, target, reduction, queries=x.size(0) * self.world_size)
        self._check_ids(x, y, passage_ids, positive_ids)
        x_all = self.gather_tensor(x)
        y_all = self.gather_tensor(y)
        query_index = torch.arange(x.size(0), device=x.device) + self.rank * x.size(0)
        every_query = torch.arange(x_all.size(0), device=x.device)
        all_targets = every_query * (1 + self.n_hard_negatives) if target is None else target.to(x.device,
                                                                                                   torch.long)
        keys = None
        if passage_ids is not None:
            ids, positive = gather_loss_ids(passage_ids, positive_ids, x.device)
            keys = self._keys(ids, all_targets, positive)
        return self._loss(x, y_all, all_targets[query_index], x_all, query_index, reduction, keys)
