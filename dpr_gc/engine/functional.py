"""Functional Gradient Cache for loaders that yield small batches: decorate the model call and the loss.

    @cached
    def encode(model, batch): return model(**batch).pooler_output

    @cat_input_tensor
    def loss(x, y): ...

    reps, closures = zip(*(encode(model, b) for b in sub_batches))   # no graphs kept
    loss(list(reps), ...).backward()                                  # d loss / d rep lands in rep.grad
    for closure, rep in zip(closures, reps): closure(rep)             # replay with graph, push the gradient in

Tensors passed as keyword arguments are treated like positional ones everywhere (RNG devices, concatenation,
gathering).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import torch
import torch.distributed as dist

from .grad_cache import RandState, replayable, tensors_in
from .loss import all_gather_with_grad


def cached(func: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
    """Run ``func`` without a graph; return a leaf copy of its output and a closure that replays it with a graph.

    The closure, called with the leaf after the loss's backward, re-runs ``func`` under the RNG state of the first
    run (CPU and the CUDA devices of every tensor argument, and of every parameter and buffer of a model passed in,
    positionally or by keyword; other devices are refused) and backpropagates ``leaf.grad`` into the parameters.
    """

    @functools.wraps(func)
    def cache_func(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
        given = list(args) + list(kwargs.values())
        devices = {t.device for t in tensors_in(given)} | {torch.device("cpu")}
        devices |= {t.device for a in given if isinstance(a, torch.nn.Module)
                    for t in itertools.chain(a.parameters(), a.buffers())}
        state = RandState(replayable(devices))
        with torch.no_grad():
            rep = func(*args, **kwargs)
        leaf = rep.detach().float().requires_grad_()

        def forward_backward(cached_rep: torch.Tensor) -> None:
            if cached_rep.grad is None:
                raise RuntimeError("the cached representation has no gradient: run the loss's backward first")
            with state.replay():
                replayed = func(*args, **kwargs)
            torch.sum(replayed.float() * cached_rep.grad.to(replayed.device)).backward()

        return leaf, forward_backward

    return cache_func


def _map_lists(value: Any, fn: Callable[[list], Any]) -> Any:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return fn(list(value))
    return value


def cat_input_tensor(func: Callable[..., Any]) -> Callable[..., Any]:
    """Concatenate every list/tuple-of-tensors argument (positional or keyword) along dim 0 before calling."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_map_lists(a, torch.cat) for a in args)
        kwargs = {k: _map_lists(v, torch.cat) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    return wrapper


def gather_input_tensor(func: Callable[..., Any]) -> Callable[..., Any]:
    """All-gather every tensor argument (positional or keyword) over ranks, gradients flowing back to each rank.

    The wrapped loss sees the global batch. If it returns the global-batch mean, the parameter gradients after
    DDP's averaging are exact: the gather's backward sums the W ranks' (identical) loss gradients, which cancels
    DDP's division by W. No world-size factor is needed.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dist.is_available() and dist.is_initialized():
            gather = lambda v: all_gather_with_grad(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
            args = tuple(gather(a) for a in args)
            kwargs = {k: gather(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    return wrapper
