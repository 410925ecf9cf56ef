"""Functional Gradient Cache for loaders that yield small batches: decorate the model call and the loss.

:func:`cached` runs the model call without a graph and returns a closure that replays it; :func:`cat_input_tensor`
and :func:`gather_input_tensor` let the loss take the list of cached representations (and, under DDP, those of
every rank). The decorators of luyug/GradCache's ``grad_cache.functional`` (Gao et al. 2021), with the same names
and calls; :func:`cached`'s example is the whole step. Tensors passed as keyword arguments are treated like
positional ones everywhere (RNG devices, concatenation, gathering).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist

from ..base.devices import at_least_fp32
from ..base.errors import DprGcError
from .grad_cache import RandState, replayable, tensors_in
from .loss import all_gather_with_grad


def cached(func: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
    """Run ``func`` without a graph; return a leaf copy of its output and a closure that replays it with a graph:
    luyug/GradCache's ``grad_cache.functional.cached`` (Gao et al. 2021), called the same way. The closure, called
    with the leaf after the loss's backward, re-runs ``func`` under the RNG state of the first run (CPU and the CUDA
    devices of every tensor argument and of a model's parameters and buffers; other devices are refused) and
    backpropagates ``leaf.grad`` into the parameters.

    Args:
        func: the model call, returning a representation tensor ``[rows, ...]`` or, as in the original, a tuple.

    Returns:
        The decorated function, returning ``(leaf, closure)`` (``(leaf_1, ..., leaf_k, closure)`` for a tuple): each
        representation detached, fp32, requiring grad; ``closure(leaf)`` returns None, adds nothing for a leaf the
        loss did not use, and raises :class:`RuntimeError` if no leaf has a gradient yet.

    Example (a batch in sub-batches of 2, equal to the full-batch gradient):
        >>> import torch
        >>> from dpr_gc import SimpleContrastiveLoss
        >>> from dpr_gc.engine.functional import cached, cat_input_tensor
        >>> encoder, loss = torch.nn.Linear(8, 4), SimpleContrastiveLoss()
        >>> encode = cached(lambda model, batch: model(batch))
        >>> loss_fn = cat_input_tensor(lambda x, y: loss(x, y))
        >>> queries, passages = torch.randn(4, 8), torch.randn(4, 8)
        >>> q_reps, q_replays = zip(*(encode(encoder, b) for b in queries.split(2)))   # no graphs kept
        >>> p_reps, p_replays = zip(*(encode(encoder, b) for b in passages.split(2)))
        >>> loss_fn(list(q_reps), list(p_reps)).backward()       # d loss / d rep lands in each rep's .grad
        >>> _ = [replay(rep) for replay, rep in zip(q_replays + p_replays, q_reps + p_reps)]  # replay, push in
        >>> cached_grad, encoder.weight.grad = encoder.weight.grad.clone(), None
        >>> loss(encoder(queries), encoder(passages)).backward()
        >>> torch.allclose(cached_grad, encoder.weight.grad, atol=1e-6)
        True
    """

    @functools.wraps(func)
    def cache_func(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        given = list(args) + list(kwargs.values())
        devices = {t.device for t in tensors_in(given)} | {torch.device("cpu")}
        devices |= {t.device for a in given if isinstance(a, torch.nn.Module)
                    for t in itertools.chain(a.parameters(), a.buffers())}
        state = RandState(replayable(devices))
        with torch.no_grad():
            reps = _as_reps(func(*args, **kwargs))
        leaves = tuple(rep.detach().to(at_least_fp32(rep.dtype)).requires_grad_() for rep in reps)

        def forward_backward(cached_reps: Union[torch.Tensor, Sequence[torch.Tensor]]) -> None:
            cached_reps = _as_reps(cached_reps)
            if len(cached_reps) != len(leaves):
                raise DprGcError(f"the closure takes the {len(leaves)} cached representation(s) its call returned, "
                                 f"got {len(cached_reps)}")
            if all(rep.grad is None for rep in cached_reps):
                raise RuntimeError("the cached representation has no gradient: run the loss's backward first")
            with state.replay():
                replayed = _as_reps(func(*args, **kwargs))
            surrogate = sum(torch.sum(rep.to(leaf.dtype) * leaf.grad.to(rep.device))
                            for rep, leaf in zip(replayed, cached_reps) if leaf.grad is not None)
            surrogate.backward()

        return leaves + (forward_backward,)

    return cache_func


def _as_reps(value: Any) -> tuple[torch.Tensor, ...]:
    """A model call's representation(s) as a tuple of tensors (a tensor, or a tuple/list of them)."""
    reps = (value,) if isinstance(value, torch.Tensor) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if not reps or not all(isinstance(rep, torch.Tensor) for rep in reps):
        raise DprGcError(f"a cached function must return a tensor or a tuple of tensors, got {type(value).__name__}")
    return reps


def _map_lists(value: Any, fn: Callable[[list], Any]) -> Any:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return fn(list(value))
    return value


def cat_input_tensor(func: Callable[..., Any]) -> Callable[..., Any]:
    """Concatenate every list/tuple-of-tensors argument (positional or keyword) along dim 0 before calling.

    Other arguments pass unchanged; the decorated function returns what ``func`` returns. The original's
    ``cat_input_tensor`` (luyug/GradCache), which takes lists; tuples are concatenated too.

    Example:
        >>> import torch
        >>> from dpr_gc.engine.functional import cat_input_tensor
        >>> rows = cat_input_tensor(lambda x, scale=1: x.size(0) * scale)
        >>> rows([torch.ones(2, 4), torch.ones(3, 4)], scale=10)
        50
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_map_lists(a, torch.cat) for a in args)
        kwargs = {k: _map_lists(v, torch.cat) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    return wrapper


def gather_input_tensor(func: Callable[..., Any], axis: int = 0) -> Callable[..., Any]:
    """All-gather every tensor argument (positional or keyword) over ranks, concatenated along ``axis`` in rank
    order, gradients flowing back to each rank.

    The wrapped loss sees the global batch. If it returns the global-batch mean, the parameter gradients after
    DDP's averaging are exact: the gather's backward sums the W ranks' (identical) loss gradients, which cancels
    DDP's division by W. No world-size factor is needed. Every rank must pass tensors of the same shape; other
    arguments pass unchanged, and so does everything when no process group is initialised.

    The original's ``gather_input_tensor`` (luyug/GradCache), whose gather carries the gradient of this rank's part
    only; here every rank's part gets its gradient, as described above.

    Args:
        func: the loss, called with the gathered arguments; the decorated function returns what it returns.
        axis: the dimension the ranks' tensors are concatenated along (the original's argument).

    Example (no process group here, so the loss sees this process's tensors):
        >>> import torch
        >>> from dpr_gc import SimpleContrastiveLoss
        >>> from dpr_gc.engine.functional import gather_input_tensor
        >>> loss_fn = gather_input_tensor(SimpleContrastiveLoss())
        >>> x, y = torch.randn(4, 8), torch.randn(4, 8)
        >>> torch.equal(loss_fn(x, y), SimpleContrastiveLoss()(x, y))
        True
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized():
            def gather(v: Any) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                return all_gather_with_grad(v.movedim(axis, 0)).movedim(0, axis)

            args = tuple(gather(a) for a in args)
            kwargs = {k: gather(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    return wrapper
