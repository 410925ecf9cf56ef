"""Gradient Cache: the exact gradient of a large-batch contrastive loss in chunk-sized memory (Gao et al. 2021).

One cached step (:meth:`GradCache.cache_step`) runs in three parts, one method each, named as in the original:

1. :meth:`~GradCache.forward_no_grad`: forward every chunk without a graph and keep only its representations (the
   RNG state is recorded first);
2. :meth:`~GradCache.build_cache`: compute the loss over the whole batch of representations and backpropagate to
   them, caching d loss / d rep in fp32;
3. :meth:`~GradCache.forward_backward`: re-run each chunk with a graph under its recorded RNG state and
   backpropagate the cached gradient into the encoder (``sum(rep * cached_grad)`` has exactly that gradient).

Beyond the original module: bf16 autocast beside fp16 + GradScaler; every chunk is trimmed to its own longest
sequence (token-level representations are padded back, so the loss sees the untrimmed shape); the batch can be
grouped by length before chunking; the very last chunk keeps its graph from part 1 instead of being run again (not
under DDP or FSDP, where that graph's backward would reach the gradient hooks out of order); the RNG state is replayed on
every CUDA device the model's parameters and the inputs live on; a frozen model runs once, without a graph;
running buffers (BatchNorm statistics) see each example once; the gradients of a loss's own parameters (a
learnable temperature) are averaged over ranks like DDP averages the encoders'. The input helpers live in
:mod:`dpr_gc.chunking`.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .chunking import (call_model, length_order, pad_sequence_dim, rows_in, split_input, take_rows, tensors_in,
                       to_device, trim_padding, trimmed_width)
from ..base.devices import autocast_dtype
from ..base.errors import DprGcError

__all__ = ["GradCache", "RandState", "is_ddp", "is_fsdp", "rng_devices", "split_input", "tensors_in", "trim_padding", "unwrap"]

REPLAYABLE_DEVICES = ("cpu", "cuda")


class RandState:
    """The CPU RNG state plus the CUDA RNG state of each given device, captured now and restorable later."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.cpu = torch.get_rng_state()
        indices = {d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"}
        self.cuda = {index: torch.cuda.get_rng_state(index) for index in sorted(indices)}

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the captured states, then put back whatever states were current before."""
        saved = RandState(torch.device("cuda", i) for i in self.cuda)
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda.items():
            torch.cuda.set_rng_state(state, index)
        try:
            yield
        finally:
            torch.set_rng_state(saved.cpu)
            for index, state in saved.cuda.items():
                torch.cuda.set_rng_state(state, index)


def rng_devices(model: Any, model_input: Any) -> set[torch.device]:
    """Every device whose RNG a chunk's forward may draw from: those of all parameters, buffers and input tensors.

    Refuses devices whose RNG cannot be replayed here (MPS, XPU, ...): dropout would silently differ between the
    two passes and the gradient would be wrong.
    """
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    return replayable(devices | {t.device for t in tensors_in(model_input)} | {torch.device("cpu")})


def replayable(devices: set[torch.device]) -> set[torch.device]:
    """``devices``, after refusing any whose RNG state cannot be captured and replayed here."""
    unsupported = sorted({str(d) for d in devices if d.type not in REPLAYABLE_DEVICES})
    if unsupported:
        raise DprGcError(f"GradCache replays random state (dropout) on CPU and CUDA only, but the model or its input "
                         f"lives on {', '.join(unsupported)}: move it to CPU or CUDA")
    return devices


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile`` wrappers (``OptimizedModule._orig_mod``), the model itself otherwise."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def is_ddp(model: nn.Module) -> bool:
    return isinstance(unwrap(model), DistributedDataParallel)


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


def is_data_parallel(model: nn.Module) -> bool:
    """DDP or FSDP2: gradients are synchronised by backward hooks, which Gradient Cache holds off until the last
    chunk."""
    return is_ddp(model) or is_fsdp(model)


def is_trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@contextlib.contextmanager
def buffers_kept(models: Iterable[nn.Module]) -> Iterator[None]:
    """Put every buffer of ``models`` back to its current value after the block (the replay must not count a
    chunk's examples twice in BatchNorm-style running statistics)."""
    saved = {}
    for model in models:
        for name, buffer in model.named_buffers():
            saved.setdefault((id(model), name), (model, name, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for model, name, value in saved.values():
                model.get_buffer(name).copy_(value)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of DDP's ``no_sync``: gradients accumulate unsharded, without reduce-scatter, until a
    backward outside the block."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _Plan:
    """One model's chunks, the original rows each holds, its RNG states and its trimmed widths (for padding back),
    and the first pass's representations gathered into one fp32 buffer in the original row order."""

    def __init__(self, m: int, chunks: list[Any], widths: list[Optional[tuple[int, int, str]]],
                 order: Optional[torch.Tensor]) -> None:
        self.m, self.chunks, self.widths, self.order = m, chunks, widths, order
        self.rows: list[torch.Tensor] = []
        self.states: list[RandState] = []
        self.counts = [rows_in(c) for c in chunks]
        self.known = all(n is not None for n in self.counts)
        self.buffer: Optional[torch.Tensor] = None
        self.parts: list[torch.Tensor] = []
        self.kept: Optional[torch.Tensor] = None  # the last chunk's representation, with its graph, when kept

    def store(self, chunk_rep: torch.Tensor) -> None:
        """Keep the next chunk's (detached) representation. The rows it holds come from its input when that has
        tensors, else from the representation itself."""
        i, start = len(self.rows), sum(len(r) for r in self.rows)
        n = chunk_rep.size(0) if chunk_rep.dim() else 0
        if self.known and n != self.counts[i]:
            raise DprGcError(f"model {self.m} gave {n} representation rows for a chunk of {self.counts[i]} input rows")
        rows = torch.arange(start, start + n) if self.order is None else self.order[start:start + n]
        self.rows.append(rows)
        if not self.known:
            if self.parts:
                self._check_shape(self.parts[0], chunk_rep)
            self.parts.append(chunk_rep.to(torch.float32, copy=True))
            return
        if self.buffer is None:
            self.buffer = chunk_rep.new_empty((sum(self.counts), *chunk_rep.shape[1:]), dtype=torch.float32)
        self._check_shape(self.buffer, chunk_rep)
        # One fp32 buffer in the original row order: a chunk's representation may be a view (e.g. the [CLS] row)
        # whose base tensor would otherwise stay alive with it.
        self.buffer[rows.to(self.buffer.device)] = chunk_rep.float()

    def reps(self) -> torch.Tensor:
        return self.buffer if self.known else torch.cat(self.parts)

    def _check_shape(self, first: torch.Tensor, chunk_rep: torch.Tensor) -> None:
        if first.shape[1:] != chunk_rep.shape[1:]:
            raise DprGcError(f"the chunks of model {self.m} gave representations of shapes {tuple(first.shape[1:])} "
                             f"and {tuple(chunk_rep.shape[1:])} per row (a per-token representation with fewer than "
                             "3 dimensions cannot be padded back after trimming): pass trim=False")


class GradCache:
    """Run one contrastive training step over a large batch, ``chunk_sizes`` rows of each model input at a time.

    Drop-in for the original ``GradCache`` class: ``models`` may hold the same module twice (tied encoders) or
    different ones; ``chunk_sizes`` is one int or one per model; ``loss_fn(*reps, **loss_kwargs)`` returns a scalar
    (``gc(q, p, target=t)`` passes ``target`` on). The optimizer step stays with the caller. A model without
    trainable parameters (a frozen tower) runs once per chunk without a graph and is not replayed; a
    representation the loss does not use is not replayed either. Running buffers (BatchNorm statistics) are updated
    once per example: by the first pass, and put back after the replay.

    Args:
        split_input_fn: ``f(model_input, chunk_size) -> list`` for inputs other than tensors, lists/tuples of
            tensors, dicts and BatchEncodings; the rows of each chunk are then counted on its representation.
        get_rep_fn: ``f(model_output) -> Tensor`` when the model does not return the representation itself. It may
            return token-level states ``[rows, seq, ...]``: trimmed chunks are then padded back with zeros at the
            cut (padding) positions, which receive no gradient; the loss must mask padding, as it would anyway.
        fp16: fp16 autocast with ``scaler`` (a ``torch.amp.GradScaler``) scaling the loss.
        bf16: bf16 autocast, no scaler.
        sort_by_length: group rows of similar length into the same chunk (representations are returned and the
            loss is computed in the original order; inputs without a 2-D attention mask are left in order).
        trim: cut every chunk to its longest sequence, on its padding side (right or left).
        keep_last_graph: keep the graph of the last model's last chunk from the first pass instead of running it
            again (ignored for DDP-wrapped and FSDP-sharded models); it is backpropagated first, so peak memory stays one chunk.
    """

    def __init__(self, models: Sequence[nn.Module], chunk_sizes: Union[int, Sequence[int]], loss_fn: Callable[..., torch.Tensor],
                 split_input_fn: Optional[Callable[[Any, int], list]] = None,
                 get_rep_fn: Optional[Callable[[Any], torch.Tensor]] = None, fp16: bool = False,
                 scaler: Optional[torch.amp.GradScaler] = None, *, bf16: bool = False, sort_by_length: bool = False,
                 trim: bool = True, keep_last_graph: bool = True) -> None:
        self.models = list(models)
        sizes = [chunk_sizes] * len(self.models) if isinstance(chunk_sizes, int) else list(chunk_sizes)
        if len(sizes) != len(self.models):
            raise DprGcError(f"got {len(sizes)} chunk sizes for {len(self.models)} models")
        for size in sizes:
            if not isinstance(size, int) or size <= 0:
                raise DprGcError(f"chunk size must be a positive integer, got {size!r}")
        if fp16 and bf16:
            raise DprGcError("choose one of fp16 and bf16")
        if fp16 and scaler is None:
            raise DprGcError("fp16 needs a GradScaler: GradCache(..., fp16=True, scaler=torch.amp.GradScaler())")
        self.chunk_sizes = sizes
        self.loss_fn = loss_fn
        self.split_input_fn = split_input_fn
        self.get_rep_fn = get_rep_fn
        self.fp16, self.bf16, self.scaler = fp16, bf16, scaler
        self.sort_by_length, self.trim, self.keep_last_graph = sort_by_length, trim, keep_last_graph

    def __call__(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> torch.Tensor:
        return self.cache_step(*model_inputs, no_sync_except_last=no_sync_except_last, **loss_kwargs)

    # ----------------------------------------------------------------- pieces
    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if not (self.fp16 or self.bf16):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype("fp16" if self.fp16 else "bf16"))

    def _rep(self, output: Any) -> torch.Tensor:
        rep = self.get_rep_fn(output) if self.get_rep_fn is not None else output
        if not isinstance(rep, torch.Tensor):
            raise DprGcError(f"the model output (or get_rep_fn) gave {type(rep).__name__}, not a tensor: pass a "
                             "get_rep_fn that returns the representation tensor")
        return rep

    def _forward(self, model: nn.Module, chunk: Any, width: Optional[tuple[int, int, str]]) -> torch.Tensor:
        device = model_device(model)
        with self._autocast(device):
            rep = self._rep(call_model(model, to_device(chunk, device)))
        return pad_sequence_dim(rep, width)

    def _plan(self, m: int, model_input: Any) -> _Plan:
        order = length_order(model_input) if self.sort_by_length and self.split_input_fn is None else None
        if order is not None:
            model_input = take_rows(model_input, order)
        if self.split_input_fn is not None:
            chunks = list(self.split_input_fn(model_input, self.chunk_sizes[m]))
        else:
            chunks = split_input(model_input, self.chunk_sizes[m])
        if not chunks or rows_in(model_input) == 0:
            raise DprGcError(f"model input {m} is empty: a cached step needs at least one row per model")
        widths = [trimmed_width(c) if self.trim else None for c in chunks]
        chunks = [trim_padding(c) if w is not None else c for c, w in zip(chunks, widths)]
        return _Plan(m, chunks, widths, order)

    def _first_pass(self, plan: _Plan, trainable: bool, keep_graph: bool) -> None:
        """Run the chunks of ``plan`` without a graph into its buffer, recording each one's RNG state first for the
        replay; with ``keep_graph`` the last chunk runs with its graph instead, kept as ``plan.kept`` (it is not
        replayed)."""
        model = self.models[plan.m]
        devices = rng_devices(model, None) if trainable else set()
        without_graph = len(plan.chunks) - 1 if keep_graph else len(plan.chunks)
        for chunk, width in zip(plan.chunks[:without_graph], plan.widths):
            if trainable:
                plan.states.append(RandState(devices | {t.device for t in tensors_in(chunk)}))
            with torch.no_grad():
                plan.store(self._forward(model, chunk, width))
        if keep_graph:
            plan.kept = self._forward(model, plan.chunks[-1], plan.widths[-1])
            plan.store(plan.kept.detach())

    # ----------------------------------------------------------------- the step
    def cache_step(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> torch.Tensor:
        """One cached step: returns the detached loss; parameter gradients are accumulated into ``.grad``.

        With ``no_sync_except_last`` only each model's last chunk runs DDP's all-reduce (FSDP2's reduce-scatter:
        ``set_requires_gradient_sync(False)`` for the others). A module listed twice (tied encoders) is therefore
        reduced twice per step, which is exact: averaging is linear and leaves an already-averaged part unchanged.
        The kept-graph shortcut is off for DDP and FSDP models, whose hooks must see the chunks in replay order.
        """
        if len(model_inputs) != len(self.models):
            raise DprGcError(f"got {len(model_inputs)} model inputs for {len(self.models)} models")
        trainable = [is_trainable(m) for m in self.models]
        if no_sync_except_last and not all(is_data_parallel(m) for m, t in zip(self.models, trainable) if t):
            raise DprGcError("no_sync_except_last=True needs every trainable model wrapped in DistributedDataParallel "
                             "or sharded with fully_shard")
        plans, reps = self.forward_no_grad(model_inputs, trainable)
        loss = self.build_cache(reps, **loss_kwargs)
        self.forward_backward(plans, [rep.grad for rep in reps], no_sync_except_last)
        return loss.detach()

    def forward_no_grad(self, model_inputs: Sequence[Any], trainable: list[bool]) -> tuple[list[_Plan], list[torch.Tensor]]:
        """Part 1: every model's chunks and representations, computed without graphs (fp32, original row order,
        requiring grad where the model trains). The very last chunk (of the last model) keeps its graph when
        allowed: it is the one chunk whose graph can live until the loss without raising peak memory (not under
        DDP or FSDP, where that graph's backward would reach the gradient hooks out of order)."""
        plans, reps = [], []
        for m, model_input in enumerate(model_inputs):
            plan = self._plan(m, model_input)
            keep = (self.keep_last_graph and m == len(self.models) - 1 and trainable[m]
                    and not is_data_parallel(self.models[m]))
            self._first_pass(plan, trainable[m], keep)
            plans.append(plan)
            reps.append(plan.reps().requires_grad_(trainable[m]))
        return plans, reps

    def build_cache(self, reps: list[torch.Tensor], **loss_kwargs: Any) -> torch.Tensor:
        """Part 2: the loss over the whole batch of representations, backpropagated to them: their ``.grad`` (fp32)
        is the cache. The gradients of the loss's own parameters are averaged over ranks here."""
        loss = self.loss_fn(*reps, **loss_kwargs)
        if loss.requires_grad:
            (self.scaler.scale(loss) if self.fp16 else loss).backward()
        self._average_loss_parameter_grads()
        return loss

    def forward_backward(self, plans: list[_Plan], cache: list[Optional[torch.Tensor]], no_sync: bool) -> None:
        """Part 3: replay each chunk with a graph under its recorded RNG state and push its cached gradient into the
        encoder, models last to first. A representation the loss did not use is not replayed (and a kept graph of
        it is dropped at once). Buffers are put back afterwards: the first pass already counted every example in
        the running statistics."""
        for plan, grad in zip(plans, cache):
            if grad is None:
                plan.kept = None
        with buffers_kept([self.models[m] for m, grad in enumerate(cache) if grad is not None]):
            for m in reversed(range(len(self.models))):
                if cache[m] is not None:
                    self._replay(plans[m], cache[m], no_sync)

    def _replay(self, plan: _Plan, cache: torch.Tensor, no_sync: bool) -> None:
        """One model's part 3. A kept chunk goes first of all, so its graph is freed before any other chunk is
        re-run; with ``no_sync`` only the last chunk runs DDP's all-reduce (FSDP's reduce-scatter)."""
        model, end = self.models[plan.m], len(plan.chunks) - 1
        replayed = range(len(plan.chunks))
        if plan.kept is not None:
            self._backward_chunk(plan.kept, plan.rows[end], cache)
            plan.kept, replayed = None, range(end)
        for i in replayed:
            with self._sync_context(model, not no_sync or i == end):
                with plan.states[i].replay():
                    chunk_rep = self._forward(model, plan.chunks[i], plan.widths[i])
                self._backward_chunk(chunk_rep, plan.rows[i], cache)
                del chunk_rep

    @staticmethod
    def _backward_chunk(chunk_rep: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor) -> None:
        """Backpropagate a chunk's cached gradient into its encoder: ``sum(rep * cached_grad)`` has exactly that
        gradient."""
        cached = cache[rows.to(cache.device)].to(chunk_rep.device)
        torch.sum(chunk_rep.float() * cached).backward()

    @staticmethod
    def _sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if not sync and is_ddp(model):
            return unwrap(model).no_sync()
        if not sync and is_fsdp(model):
            return _fsdp_no_sync(unwrap(model))
        return contextlib.nullcontext()

    def _average_loss_parameter_grads(self) -> None:
        """Average the gradients of the loss's own parameters over ranks, as DDP does for the encoders'."""
        if not (isinstance(self.loss_fn, nn.Module) and dist.is_available() and dist.is_initialized()):
            return
        for param in self.loss_fn.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
