"""Gradient Cache: the exact gradient of a large-batch contrastive loss in chunk-sized memory (Gao et al. 2021).

One cached step runs in three parts:

1. forward every chunk without a graph and keep only its representations (the RNG state is recorded first);
2. compute the loss over the whole batch of representations and backpropagate to them, caching d loss / d rep in
   fp32;
3. re-run each chunk with a graph under its recorded RNG state and backpropagate the cached gradient into the
   encoder (``sum(rep * cached_grad)`` has exactly that gradient).

Beyond the original module: bf16 autocast beside fp16 + GradScaler; every chunk is trimmed to its own longest
sequence; the batch can be grouped by length before chunking; the very last chunk keeps its graph from part 1
instead of being run again (not under DDP, where that graph's backward would reach the gradient hooks out of
order); the
RNG state is replayed on the model's device as well as the inputs'; the gradients of a loss's own parameters (a
learnable temperature) are averaged over ranks like DDP averages the encoders'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import DprGcError


class RandState:
    """The CPU RNG state plus the CUDA RNG state of each given device, captured now and restorable later."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = {d.index: torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}

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


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tensors, lists, tuples and mappings."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def batch_size_of(model_input: Any) -> int:
    tensors = tensors_in(model_input)
    if not tensors:
        raise DprGcError(f"cannot find a tensor in a model input of type {type(model_input).__name__}; "
                         "pass split_input_fn")
    return tensors[0].size(0)


def take_rows(obj: Any, index: torch.Tensor) -> Any:
    """Select rows ``index`` of every tensor in ``obj`` (keeps the container types, BatchEncoding included)."""
    if isinstance(obj, torch.Tensor):
        return obj[index.to(obj.device)]
    if isinstance(obj, Mapping):
        return obj.__class__({k: take_rows(v, index) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(take_rows(v, index) for v in obj)
    return obj


def slice_rows(obj: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of every tensor in ``obj`` as views (no copy; keeps the container types)."""
    if isinstance(obj, torch.Tensor):
        return obj[start:end]
    if isinstance(obj, Mapping):
        return obj.__class__({k: slice_rows(v, start, end) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(slice_rows(v, start, end) for v in obj)
    return obj


def split_input(model_input: Any, chunk_size: int) -> list[Any]:
    """Split tensors, lists/tuples of tensors, dicts and BatchEncodings into chunks of ``chunk_size`` rows (views)."""
    n = batch_size_of(model_input)
    return [slice_rows(model_input, s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def trim_padding(chunk: Any) -> Any:
    """Cut a right-padded chunk to its own longest sequence; exact because padded positions are masked out."""
    if not isinstance(chunk, Mapping) or not isinstance(chunk.get("attention_mask"), torch.Tensor):
        return chunk
    mask = chunk["attention_mask"]
    if mask.dim() != 2:
        return chunk
    lengths = mask.sum(1)
    longest = int(lengths.max())
    if longest == mask.size(1) or not bool((mask[:, longest:] == 0).all()):
        return chunk
    width = mask.size(1)
    return chunk.__class__({k: v[:, :longest] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.size(1) == width
                            else v for k, v in chunk.items()})


def length_order(model_input: Any) -> Optional[torch.Tensor]:
    """Row order by descending sequence length (stable), or None when the input has no attention mask."""
    if isinstance(model_input, Mapping) and isinstance(model_input.get("attention_mask"), torch.Tensor):
        lengths = model_input["attention_mask"].sum(1)
        return torch.sort(lengths.cpu(), descending=True, stable=True).indices
    return None


def call_model(model: nn.Module, model_input: Any) -> Any:
    if isinstance(model_input, Mapping):
        return model(**model_input)
    if isinstance(model_input, (list, tuple)):
        return model(*model_input)
    return model(model_input)


def model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return obj.__class__({k: to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class GradCache:
    """Run one contrastive training step over a large batch, ``chunk_sizes`` rows of each model input at a time.

    Drop-in for the original ``GradCache`` class: ``models`` may hold the same module twice (tied encoders) or
    different ones; ``chunk_sizes`` is one int or one per model; ``loss_fn(*reps, **loss_kwargs)`` returns a scalar.
    The optimizer step stays with the caller.

    Args:
        split_input_fn: ``f(model_input, chunk_size) -> list`` for inputs other than tensors, lists/tuples of
            tensors, dicts and BatchEncodings.
        get_rep_fn: ``f(model_output) -> Tensor`` when the model does not return the representation itself.
        fp16: fp16 autocast with ``scaler`` (a ``torch.amp.GradScaler``) scaling the loss.
        bf16: bf16 autocast, no scaler.
        sort_by_length: group rows of similar length into the same chunk (representations are returned and the
            loss is computed in the original order).
        trim: cut every chunk to its longest sequence (right padding assumed; left-padded chunks are left alone).
        keep_last_graph: keep the graph of the last model's last chunk from the first pass instead of running it
            again (ignored for DDP-wrapped models); it is backpropagated first, so peak memory stays one chunk.
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
        return torch.autocast(device.type, dtype=torch.float16 if self.fp16 else torch.bfloat16)

    def _rep(self, output: Any) -> torch.Tensor:
        rep = self.get_rep_fn(output) if self.get_rep_fn is not None else output
        if not isinstance(rep, torch.Tensor):
            raise DprGcError(f"the model output (or get_rep_fn) gave {type(rep).__name__}, not a tensor: pass a "
                             "get_rep_fn that returns the representation tensor")
        return rep

    def _forward(self, model: nn.Module, chunk: Any) -> torch.Tensor:
        device = model_device(model)
        with self._autocast(device):
            return self._rep(call_model(model, to_device(chunk, device)))

    def _chunks(self, model_input: Any, chunk_size: int) -> tuple[list[Any], Optional[torch.Tensor]]:
        order = length_order(model_input) if self.sort_by_length and self.split_input_fn is None else None
        if order is not None:
            model_input = take_rows(model_input, order)
        if self.split_input_fn is not None:
            chunks = list(self.split_input_fn(model_input, chunk_size))
        else:
            chunks = split_input(model_input, chunk_size)
        if self.trim:
            chunks = [trim_padding(c) for c in chunks]
        return chunks, order

    @staticmethod
    def _rows(chunks: list[Any], order: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """For each chunk, the rows of the original (unsorted) batch it holds."""
        sizes = [batch_size_of(c) for c in chunks]
        index = torch.arange(sum(sizes)) if order is None else order
        return list(index.split(sizes))

    # ----------------------------------------------------------------- the step
    def cache_step(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> torch.Tensor:
        """One cached step: returns the detached loss; parameter gradients are accumulated into ``.grad``.

        With ``no_sync_except_last`` only each model's last chunk runs DDP's all-reduce. A module listed twice (tied
        encoders) is therefore reduced twice per step, which is exact: averaging is linear and leaves an
        already-averaged part unchanged.
        """
        if len(model_inputs) != len(self.models):
            raise DprGcError(f"got {len(model_inputs)} model inputs for {len(self.models)} models")
        if no_sync_except_last and not all(isinstance(m, DistributedDataParallel) for m in self.models):
            raise DprGcError("no_sync_except_last=True needs every model wrapped in DistributedDataParallel")
        is_ddp = [isinstance(m, DistributedDataParallel) for m in self.models]

        # Part 1: representations without graphs. The very last chunk (of the last model) keeps its graph when
        # allowed: it is the one chunk whose graph can live until the loss without raising peak memory.
        plans, reps, kept_rep = [], [], None
        for m, (model, model_input, chunk_size) in enumerate(zip(self.models, model_inputs, self.chunk_sizes)):
            chunks, order = self._chunks(model_input, chunk_size)
            rows = self._rows(chunks, order)
            states, rep = [], None
            keep = self.keep_last_graph and m == len(self.models) - 1 and not is_ddp[m]
            for i, chunk in enumerate(chunks):
                states.append(RandState({model_device(model)} | {t.device for t in tensors_in(chunk)}))
                if i == len(chunks) - 1 and keep:
                    kept_rep = self._forward(model, chunk)
                    chunk_rep = kept_rep.detach()
                else:
                    with torch.no_grad():
                        chunk_rep = self._forward(model, chunk)
                if rep is None:
                    rep = chunk_rep.new_empty((sum(len(r) for r in rows), *chunk_rep.shape[1:]), dtype=torch.float32)
                # Copied into one fp32 buffer in the original row order: a chunk's representation may be a view
                # (e.g. the [CLS] row) whose base tensor would otherwise stay alive with it.
                rep[rows[i].to(rep.device)] = chunk_rep.float()
                del chunk_rep
            plans.append((chunks, rows, states))
            reps.append(rep.requires_grad_())

        # Part 2: the loss over the whole batch, and its gradient with respect to every representation (fp32).
        loss = self.loss_fn(*reps, **loss_kwargs)
        (self.scaler.scale(loss) if self.fp16 else loss).backward()
        self._average_loss_parameter_grads()

        # Part 3: replay each chunk with a graph and push its cached gradient into the encoder. Models go last to
        # first and the kept chunk first of all, so its graph is freed before any other chunk is re-run.
        for m in reversed(range(len(self.models))):
            model, (chunks, rows, states), rep = self.models[m], plans[m], reps[m]
            kept_here = kept_rep is not None and m == len(self.models) - 1
            last = len(chunks) - 1
            for i in ([last] + list(range(last)) if kept_here else range(len(chunks))):
                sync = not no_sync_except_last or i == last
                with self._sync_context(model, sync):
                    if i == last and kept_here:
                        chunk_rep, kept_rep = kept_rep, None
                    else:
                        with states[i].replay():
                            chunk_rep = self._forward(model, chunks[i])
                    torch.sum(chunk_rep.float() * rep.grad[rows[i].to(rep.device)].to(chunk_rep.device)).backward()
                    del chunk_rep
        return loss.detach()

    @staticmethod
    def _sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if not sync and isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def _average_loss_parameter_grads(self) -> None:
        """Average the gradients of the loss's own parameters over ranks, as DDP does for the encoders'."""
        if not (isinstance(self.loss_fn, nn.Module) and dist.is_available() and dist.is_initialized()):
            return
        for param in self.loss_fn.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
