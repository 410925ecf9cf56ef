"""Gradient Cache: the exact gradient of a large-batch contrastive loss in chunk-sized memory (Gao et al. 2021).

One cached step (:meth:`GradCache.cache_step`) runs in three parts, one method each, named as in the original:

1. :meth:`~GradCache.forward_no_grad`: forward every chunk without a graph and keep only its representations (the
   RNG state is recorded first);
2. :meth:`~GradCache.build_cache`: compute the loss over the whole batch of representations and backpropagate to
   them, caching d loss / d rep in fp32;
3. :meth:`~GradCache.forward_backward`: re-run each chunk with a graph under its recorded RNG state and
   backpropagate the cached gradient into the encoder (``sum(rep * cached_grad)`` has exactly that gradient).

Beyond the original module: bf16 autocast beside fp16 + GradScaler; every chunk of a model whose output ignores
padding (dpr-gc's retrievers; any model with ``Chunking(trim=True)``) is trimmed to its own longest sequence
(token-level representations are padded back, so the loss sees the untrimmed shape); the batch can be
grouped by length before chunking, and chunked by tokens; the very last chunk keeps its graph from part 1 instead of
being run again, and under a memory budget so does every chunk whose measured graph fits (under DDP or FSDP those run
without gradient sync and each model's last chunk is replayed to carry it); the RNG state is replayed on
every CUDA device the model's parameters and the inputs live on; a frozen model runs once, without a graph;
running buffers (BatchNorm statistics) see each example once; the gradients of a loss's own parameters (a
learnable temperature) are averaged over ranks like DDP averages the encoders'; on the CPU each chunk adds a
trainable embedding's gradient sparsely into one dense ``.grad`` (:mod:`dpr_gc.engine.sparse_grads`). The input
helpers live in :mod:`dpr_gc.engine.chunking`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .arguments import as_int, check_bool, check_callable, is_integer
from .budget import (BudgetLedger, GraphMeter, MemoryBudget, StepMemory, collections_paused, parse_memory,
                     budget_reading, storages_of)
from .chunking import (Chunking, call_model, chunk_tokens, chunk_width, chunk_widths, cut_padding, length_order,
                       join_chunks, pad_sequence_dim, rows_in, sequence_lengths, split_by_tokens, split_input,
                       take_rows, tensors_in, to_device, trim_padding, trimmed_width)
from .frozen_casts import FrozenLinearCasts, Forwards
from .sparse_grads import SparseEmbeddingGrads
from ..base.devices import at_least_fp32, autocast_dtype
from ..base.errors import DprGcError

__all__ = ["Chunking", "GradCache", "RandState", "is_ddp", "is_fsdp", "rng_devices", "split_input", "tensors_in",
           "trim_padding", "unwrap"]

REPLAYABLE_DEVICES = ("cpu", "cuda")
JOIN_MARGIN = 0.9  # share of the budget left that joined chunks may be predicted to take
# A chunk's fixed cost in tokens, by device type, when deciding whether joining chunks pays for the padding it adds:
# a CUDA chunk costs its kernel launches (a MiniLM step on an H100 spends about as long launching one chunk as
# computing 30k tokens). A CPU chunk costs its operator calls and small matrix products: measured 82-122 tokens
# through MiniLM, 178-241 through BERT-base under bf16 autocast; a 4-layer LoRA decoder's whole-batch step ran 1.15x
# faster in bf16 (1.01x in fp32) with its chunks joined at 256 than apart at 64, MiniLM's on SciFact level
# (benchmarks/README.md, "The CPU's price of a chunk"). Pricing a chunk above its cost adds at most that many padded
# tokens per join.
CHUNK_OVERHEAD_TOKENS = {"cuda": 16384, "cpu": 256}
DEFAULT_CHUNK_OVERHEAD_TOKENS = 64
# The most tokens a joined chunk may compute, by device type (none listed: no limit). Larger CPU chunks run slower
# per token: one chunk of 64 rows x 256 tokens took 1.89x (fp32) and 1.87x (bf16) the time per token of the fastest
# split through MiniLM, one of 32 x 256 through a BERT-base shape 1.52x and 1.22x, while chunks of 4,096 tokens were
# the fastest split or within 3 % of it in all four (benchmarks/README.md, "When a chunk is too large"). Much of it is
# glibc mapping and page-faulting afresh every tensor above its largest mmap threshold (32 MiB): with mmap off,
# MiniLM's 64-row chunk took 1.18x and 1.54x. CUDA's caching allocator reuses its blocks.
JOINED_CHUNK_MAX_TOKENS = {"cpu": 4096}
# The original package's per-model phase methods, by their leading parameters there ("*" marks ``*args``), and what
# a subclass overrides here instead: dpr-gc's phases of those names run every model at once.
ORIGINAL_PHASES = {
    "forward_no_grad": (("model", "model_inputs"), "model_call and get_reps (each chunk's call and representation)"),
    "build_cache": (("*reps",), "compute_loss (the loss over every model's representations)"),
    "forward_backward": (("model", "model_inputs", "cached_gradients", "random_states"),
                         "model_call and get_reps (each chunk's call and representation)"),
}


def refuse_original_phases(cls: type) -> None:
    """Refuse a :class:`GradCache` subclass that overrides a phase with the original package's per-model signature
    (:data:`ORIGINAL_PHASES`): the engine would call it with all models' arguments, and the step would fail or its
    gradient be wrong. Overrides with dpr-gc's signatures are left alone."""
    for name, (leading, alternative) in ORIGINAL_PHASES.items():
        method = cls.__dict__.get(name)
        try:
            params = list(inspect.signature(method).parameters.values())[1:] if callable(method) else None
        except (TypeError, ValueError):
            params = None
        if params is None:
            continue
        names = tuple(("*" if p.kind is p.VAR_POSITIONAL else "") + p.name for p in params)
        if names[:len(leading)] == leading:
            raise DprGcError(f"{cls.__name__}.{name}({', '.join(names)}) overrides the original GradCache's "
                             f"per-model {name}, which dpr-gc never calls that way (its {name} runs every model at "
                             f"once): override {alternative} instead")


def checked_models(models: Any) -> list[nn.Module]:
    """``models`` as a list: a list, tuple or ``nn.ModuleList`` of at least one ``nn.Module``. A single module is
    refused (an ``nn.Sequential`` would otherwise be taken for a list of its layers)."""
    if isinstance(models, nn.Module) and not isinstance(models, nn.ModuleList):
        raise DprGcError(f"models must be a list of models, got one module ({type(models).__name__}): pass [model] "
                         "for one input, or [model, model] for queries and passages through one tower")
    if not isinstance(models, (list, tuple, nn.ModuleList)):
        raise DprGcError(f"models must be a list or tuple of torch.nn.Module, got {type(models).__name__}")
    if len(models) == 0:
        raise DprGcError("models must hold at least one model (one per model input), got none")
    for i, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise DprGcError(f"models[{i}] is a {type(model).__name__}, not a torch.nn.Module")
    return list(models)


def checked_chunk_sizes(chunk_sizes: Any, models: int) -> list[int]:
    """One positive int per model, from one int for all or a list (numpy integers too)."""
    if not (is_integer(chunk_sizes) or isinstance(chunk_sizes, (list, tuple))):
        raise DprGcError(f"chunk_sizes must be an int or a list of ints (one per model), got {chunk_sizes!r}")
    sizes = [chunk_sizes] * models if is_integer(chunk_sizes) else list(chunk_sizes)
    if len(sizes) != models:
        raise DprGcError(f"got {len(sizes)} chunk sizes for {models} models")
    return [as_int("chunk size", size, 1) for size in sizes]


def check_precision(fp16: Any, bf16: Any, scaler: Any) -> None:
    """fp16 and bf16 are bools, not both; fp16 comes with a GradScaler. An enabled GradScaler without fp16 is
    accepted, as the original package accepts it, and left unused (the loss is scaled only under fp16), with a
    warning: code that then calls ``scaler.step()`` finds nothing scaled. A disabled one passes quietly
    (``GradScaler(enabled=fp16)``, as the trainer passes)."""
    check_bool("fp16", fp16)
    check_bool("bf16", bf16)
    if fp16 and bf16:
        raise DprGcError("choose one of fp16 and bf16")
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise DprGcError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if fp16 and scaler is None:
        raise DprGcError("fp16 needs a GradScaler: GradCache(..., fp16=True, scaler=torch.amp.GradScaler())")
    if scaler is not None and not fp16 and getattr(scaler, "is_enabled", lambda: True)():
        warnings.warn("GradCache got an enabled GradScaler without fp16=True: it is not used (the loss is scaled "
                      "only under fp16; bf16 and fp32 need no scaler), so scaler.step() would find nothing scaled; "
                      "pass fp16=True, or scaler=None", stacklevel=3)


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
    return replayable_devices(itertools.chain(model.parameters(), model.buffers(), tensors_in(model_input)))


def replayable_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The devices of ``tensors`` and the CPU, refused where their RNG cannot be replayed (:func:`rng_devices`)."""
    return replayable({t.device for t in tensors} | {torch.device("cpu")})


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


def wrapped_module(model: nn.Module) -> nn.Module:
    """The user's module inside ``torch.compile``, DDP and ``nn.DataParallel`` wrappers (FSDP2 shards it in place)."""
    inner = unwrap(model)
    return unwrap(inner.module) if isinstance(inner, (DistributedDataParallel, nn.DataParallel)) else inner


def trims_exactly(model: nn.Module, model_input: Any, trim: Optional[bool] = None) -> bool:
    """Whether ``model_input``'s chunks are cut to their longest rows for ``model``, as ``Chunking.trim`` says: False
    never; None (automatic) only where the model declares its output ignores padding positions (an
    ``ignores_padding`` attribute that is true, as dpr-gc's retrievers have, whose pooling masks padding: a raw
    model's representation may read them, a mean without the mask or the last column); True where the user vouches
    for it. Left padding shifts every real token to a lower column, so it is cut only where positions do not follow
    columns: the input carries ``position_ids`` (cut with it), or the model counts positions from each row's first
    real token (a true ``counts_positions_from_mask``). A raw decoder with absolute (GPT-2) or rotary positions
    keeps its left padding."""
    inner = wrapped_module(model)
    if trim is False or (trim is None and not getattr(inner, "ignores_padding", False)):
        return False
    mask = model_input.get("attention_mask") if isinstance(model_input, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.size(1) == 0 or "position_ids" in model_input:
        return True
    if getattr(inner, "counts_positions_from_mask", False):
        return True
    return not bool(((mask[:, 0] == 0) & (mask != 0).any(1)).any())  # no row starts with padding


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
    for model in {id(m): m for m in models}.values():  # tied towers: walked once
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


def all_reduce_ints(values: list[int], op: Any) -> list[int]:
    """``values`` reduced over the default process group with ``op`` (on the current CUDA device under NCCL)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    reduced = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=op)
    return reduced.tolist()


def all_ranks_agree(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (one tiny all-reduce)."""
    return bool(all_reduce_ints([int(flag)], dist.ReduceOp.MIN)[0])


def agreed_chunks(m: int, model_input: Any, chunks: list[Any], splittable: bool) -> list[Any]:
    """``chunks`` split further until every rank runs as many as the rank with the most: under FSDP each chunk's
    forward and backward are collective, while each rank plans its chunks from its own rows (chunks by tokens, joins
    from measured graphs). Splitting the chunk of most tokens in two by rows keeps every token limit and the gradient
    exact. Every rank refuses together when one cannot (too few rows, or chunks of ``split_input_fn``)."""
    rows = rows_in(model_input) or 0
    most, neg_rows, neg_chunks = all_reduce_ints([len(chunks), -rows, -len(chunks)], dist.ReduceOp.MAX)
    if most > -neg_rows or (not splittable and most != -neg_chunks):
        raise DprGcError(f"model input {m}: the ranks of an FSDP-sharded model must run as many chunks each, but one "
                         f"rank plans {most} chunks and one has {-neg_rows} rows (split by split_input_fn: "
                         f"{not splittable}): give every rank as many rows, or chunks by rows")
    chunks = list(chunks)
    while len(chunks) < most:
        i = max(range(len(chunks)), key=lambda j: (rows_in(chunks[j]) > 1, _computed_tokens(chunks[j]), -j))
        chunks[i:i + 1] = split_input(chunks[i], (rows_in(chunks[i]) + 1) // 2)
    return chunks


def _computed_tokens(chunk: Any) -> int:
    """Rows times the longest row of a chunk with a 2-D attention mask (its trimmed tokens), else its rows."""
    lengths = sequence_lengths(chunk)
    rows = rows_in(chunk) or 0
    return rows * int(lengths.max()) if lengths is not None and rows else rows


def cached_gradient(cache: torch.Tensor, rows: Union[slice, torch.Tensor], chunk_rep: torch.Tensor) -> torch.Tensor:
    """The cached fp32 gradient of a chunk's rows (a slice, or an index on the cache's device), on the chunk's device
    and in its dtype: the gradient that ``sum(chunk_rep.float() * cached)`` sends back to ``chunk_rep``."""
    return cache[rows].to(device=chunk_rep.device, dtype=chunk_rep.dtype)


class _Plan:
    """One model's chunks, the original rows each holds, its RNG states and its trimmed widths (for padding back),
    and the first pass's representations gathered into one fp32 buffer (float64 for float64 models) in the
    original row order."""

    def __init__(self, m: int, chunks: list[Any], widths: list[Optional[tuple[int, int, str]]],
                 order: Optional[torch.Tensor]) -> None:
        self.m, self.chunks, self.widths, self.order = m, chunks, widths, order
        self.rows: list[torch.Tensor] = []
        self.states: dict[int, RandState] = {}  # the RNG state before each chunk that is replayed
        self.counts = [rows_in(c) for c in chunks]
        self.tokens = [chunk_tokens(c) for c in chunks]
        self.padded = [chunk_width(c) for c in chunks]  # each chunk's padded width, as it runs
        self.known = all(n is not None for n in self.counts)
        self.starts = list(itertools.accumulate([0] + self.counts[:-1])) if self.known else []
        self.orders: dict[torch.device, torch.Tensor] = {}  # ``order`` on each device that indexes with it
        self.buffer: Optional[torch.Tensor] = None
        self.parts: list[torch.Tensor] = []
        self.kept: dict[int, torch.Tensor] = {}  # chunk index -> its representation with the graph, not replayed

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
            self.parts.append(chunk_rep.to(at_least_fp32(chunk_rep.dtype), copy=True))
            return
        if self.buffer is None:
            rows = (sum(self.counts), *chunk_rep.shape[1:])
            self.buffer = chunk_rep.new_empty(rows, dtype=at_least_fp32(chunk_rep.dtype))
        self._check_shape(self.buffer, chunk_rep)
        # One buffer in the original row order: a chunk's representation may be a view (e.g. the [CLS] row)
        # whose base tensor would otherwise stay alive with it.
        self.buffer[self.index(i, self.buffer.device)] = chunk_rep.to(self.buffer.dtype)

    def index(self, i: int, device: torch.device) -> Union[slice, torch.Tensor]:
        """Where chunk ``i``'s rows sit in the original order, to index a tensor on ``device``: a slice when the
        rows were not reordered, else a view of the order moved to the device once per step (a blocking copy per
        chunk would make the host wait for every kernel queued before it)."""
        if not self.known:
            return self.rows[i].to(device)
        if self.order is None:
            return slice(self.starts[i], self.starts[i] + self.counts[i])
        if device not in self.orders:
            self.orders[device] = self.order.to(device)
        return self.orders[device][self.starts[i]:self.starts[i] + self.counts[i]]

    def reps(self) -> torch.Tensor:
        return self.buffer if self.known else torch.cat(self.parts)

    def _check_shape(self, first: torch.Tensor, chunk_rep: torch.Tensor) -> None:
        if first.shape[1:] != chunk_rep.shape[1:]:
            raise DprGcError(f"the chunks of model {self.m} gave representations of shapes {tuple(first.shape[1:])} "
                             f"and {tuple(chunk_rep.shape[1:])} per row (a per-token representation is padded back "
                             "after trimming only with Chunking(token_states=True)): pass token_states=True, or "
                             "trim=False")


class _ListedTensors:
    """The parameters and buffers of each model, listed once per step: walking the modules of a large model (a LoRA
    decoder of 24 layers has about 2,000) costs milliseconds of host time, which a GPU step waits for, and the first
    pass and the replay each need them per model input (twice for tied towers)."""

    def __init__(self) -> None:
        self._listed: dict[int, list[torch.Tensor]] = {}
        self._fixed: dict[int, set[int]] = {}
        self.held: set[int] = set()  # storages the step holds beside them (the frozen weights' autocast copies)

    def clear(self) -> None:
        self._listed.clear()
        self._fixed.clear()

    def of(self, model: nn.Module) -> list[torch.Tensor]:
        if id(model) not in self._listed:
            self._listed[id(model)] = list(itertools.chain(model.parameters(), model.buffers()))
        return self._listed[id(model)]

    def meter(self, model: nn.Module) -> GraphMeter:
        """A graph meter for a chunk of ``model``, its parameters and buffers and :attr:`held` left out (their
        storages listed once per step too)."""
        if id(model) not in self._fixed:
            self._fixed[id(model)] = storages_of(self.of(model)) | self.held
        return GraphMeter(self._fixed[id(model)])


class GradCache:
    """Run one contrastive training step over a large batch, ``chunk_sizes`` rows of each model input at a time.

    The gradient is that of the loss over the whole batch, in the memory of one chunk: every chunk is encoded
    without a graph, the loss's gradient with respect to all representations is cached, and each chunk is encoded
    again with a graph to push its share of that gradient into the model. The optimizer step stays with the caller.
    A model without trainable parameters (a frozen tower) runs once per chunk without a graph and is not replayed;
    a representation the loss does not use is not replayed either. Running buffers (BatchNorm statistics) are
    updated once per example: by the first pass, and put back after the replay.

    Args:
        models: a list (tuple, ``nn.ModuleList``) of one module per model input, e.g. ``[encoder, encoder]`` (tied
            towers) or ``[query_encoder, passage_encoder]``; a single module is refused.
        chunk_sizes: rows per chunk, one int for all models or one per model (numpy integers too).
        loss_fn: ``loss_fn(*reps, **loss_kwargs)``, one representation per model, returning a scalar tensor (e.g.
            :class:`~dpr_gc.engine.loss.SimpleContrastiveLoss`).
        split_input_fn: ``f(model_input, chunk_size) -> list`` for inputs other than tensors, lists/tuples of
            tensors, dicts and BatchEncodings; the rows of each chunk are then counted on its representation.
        get_rep_fn: ``f(model_output) -> Tensor`` when the model does not return the representation itself. It may
            return token-level states ``[rows, seq, ...]``; with ``Chunking(trim=True, token_states=True)``
            trimmed chunks are padded back with zeros at the cut (padding) positions, which receive no gradient;
            the loss must mask padding, as it would anyway. A raw model's chunks are not trimmed unless
            ``Chunking(trim=True)`` says its representation ignores padding (:class:`Chunking`), so one that reads
            padding positions (a mean without the mask, the last column) gets the full batch's gradient.
        fp16: fp16 autocast with ``scaler`` (a ``torch.amp.GradScaler``, required) scaling the loss.
        scaler: the ``GradScaler`` of ``fp16``; the caller steps it (``scaler.step(optimizer)``, ``update()``).
            An enabled one without ``fp16`` is accepted, as the original package accepts it, with a warning that
            it goes unused (the loss is scaled only under fp16); ``GradScaler(enabled=False)`` passes quietly.
        bf16: bf16 autocast, no scaler.
        memory_budget: bytes (or ``"12GB"``, or ``"auto"``: see :func:`dpr_gc.engine.budget.budget_reading`) of
            first-pass graphs to keep: a chunk whose graph, measured exactly with saved-tensor hooks, fits what is
            left keeps it and is not run again (its backward takes the cached gradient directly); the others are
            replayed. 0 (default): only the last chunk, as ``chunking.keep_last_graph`` says (kept whatever its
            size, it is measured only where it is wider than every chunk measured before; the others are estimated,
            :attr:`last_step` says so).
            Peak graph memory stays within the budget plus one chunk's graph. From the second step on, chunks the
            budget holds are joined into fewer, larger ones where that saves more than the padding it adds (on CUDA
            a budget for the whole batch makes the step plain training, one chunk per model; docs/training.md,
            "Memory budget and chunks"). Under DDP/FSDP each model's last chunk is still replayed: its backward
            carries the gradient sync. Under FSDP, whose chunk forwards and backwards are collectives, the ranks
            agree on each model's chunk count and on every kept graph (a tiny all-reduce each).
        chunking: how chunks are formed and run (:class:`~dpr_gc.engine.chunking.Chunking`: sort by length,
            trim padding (by default for dpr-gc's retrievers only), keep the last graph, size chunks by tokens).

    Inputs, ``gc(*model_inputs, no_sync_except_last=False, **loss_kwargs)`` (:meth:`cache_step`):
        one input per model, each a tensor, a list/tuple of tensors, a dict or ``BatchEncoding`` (rows on dim 0;
        a tensor without them, 0-d or broadcast as ``[1, T]``, goes whole to every chunk), or anything
        ``split_input_fn`` splits; ``loss_kwargs`` (``target``, ``passage_ids``, ...) go to
        ``loss_fn``.

    Returns:
        The loss, detached; the parameter gradients are accumulated into their ``.grad``.

    References:
        Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"; a drop-in for
        the ``GradCache`` class of their package, luyug/GradCache (same seven arguments, same call). A subclass
        may override the original's hooks, called as there: :meth:`compute_loss`, :meth:`get_reps`,
        :meth:`model_call`, :meth:`split_inputs` (then treated as ``split_input_fn``) and
        :meth:`get_input_tensors`. Overriding its per-model ``forward_no_grad``, ``build_cache`` or
        ``forward_backward`` with the original's signatures is refused when the class is created: here they are
        the phases of the step over all models at once.
        sentence-transformers' ``CachedMultipleNegativesRankingLoss`` is this step with
        :class:`~dpr_gc.engine.loss.SimpleContrastiveLoss`: a ``SentenceTransformer`` is given its features dicts
        (its forward takes the dict whole) with ``get_rep_fn=lambda out: out["sentence_embedding"]``.

    Example:
        >>> import torch
        >>> from dpr_gc import GradCache, SimpleContrastiveLoss
        >>> encoder = torch.nn.Linear(8, 4)                           # one tower for queries and passages
        >>> queries, passages = torch.randn(6, 8), torch.randn(12, 8)  # a positive and a hard negative per query
        >>> loss_fn = SimpleContrastiveLoss(n_hard_negatives=1)
        >>> gc = GradCache([encoder, encoder], chunk_sizes=2, loss_fn=loss_fn)
        >>> loss = gc(queries, passages)                              # gradients are now in encoder.weight.grad
        >>> cached = encoder.weight.grad.clone()
        >>> encoder.zero_grad()
        >>> loss_fn(encoder(queries), encoder(passages)).backward()   # the whole batch in one graph
        >>> torch.allclose(cached, encoder.weight.grad, atol=1e-6)
        True
    """

    def __init__(self, models: Sequence[nn.Module], chunk_sizes: Union[int, Sequence[int]],
                 loss_fn: Callable[..., torch.Tensor],
                 split_input_fn: Optional[Callable[[Any, int], list]] = None,
                 get_rep_fn: Optional[Callable[[Any], torch.Tensor]] = None, fp16: bool = False,
                 scaler: Optional[torch.amp.GradScaler] = None, *, bf16: bool = False,
                 memory_budget: MemoryBudget = 0, chunking: Chunking = Chunking()) -> None:
        self.models = checked_models(models)
        self.chunk_sizes = checked_chunk_sizes(chunk_sizes, len(self.models))
        check_callable("loss_fn", loss_fn, "SimpleContrastiveLoss() (loss_fn(*reps, **loss_kwargs) -> scalar)")
        for name, fn in (("split_input_fn", split_input_fn), ("get_rep_fn", get_rep_fn)):
            if fn is not None:
                check_callable(name, fn, "lambda out: out.pooler_output" if name == "get_rep_fn"
                               else "lambda model_input, chunk_size: [...]")
        check_precision(fp16, bf16, scaler)
        self.loss_fn = loss_fn
        self.split_input_fn = split_input_fn
        self.get_rep_fn = get_rep_fn
        self.fp16, self.bf16, self.scaler = fp16, bf16, scaler
        if not isinstance(chunking, Chunking):
            raise DprGcError(f"chunking must be a dpr_gc.engine.chunking.Chunking, got {type(chunking).__name__}")
        self.chunking = chunking
        self.memory_budget = parse_memory(memory_budget if memory_budget is not None else 0)
        self.chunk_tokens = chunking.token_limits(len(self.models))
        if self.user_split and any(limit is not None for limit in self.chunk_tokens):
            raise DprGcError("chunk tokens split by the attention mask; they cannot be combined with split_input_fn "
                             "or an overridden split_inputs")
        self._per_token: dict[int, float] = {}  # largest graph bytes per token measured, per model, across steps
        self._widest: dict[int, int] = {}  # and the widest padded chunk measured, per model
        self._replayed_graph: dict[int, int] = {}  # largest replayed chunk graph measured per model
        self._replayed_per_token: dict[int, float] = {}  # and its largest bytes per token
        self._replayed_widest: dict[int, int] = {}  # and the widest replayed chunk measured
        self.last_step: Optional[StepMemory] = None  # what the last step kept and measured
        self.joined_tokens: list[Optional[tuple[int, int]]] = []  # the last step's join limits per model (_plan)
        self._tensors = _ListedTensors()  # each model's parameters and buffers, listed afresh in every step
        self._cast_forwards: Forwards = {}  # frozen Linears' forwards under autocast, the same objects every step

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_original_phases(cls)

    def __call__(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> torch.Tensor:
        return self.cache_step(*model_inputs, no_sync_except_last=no_sync_except_last, **loss_kwargs)

    # ----------------------------------------------------------------- the original package's hooks
    def split_inputs(self, model_input: Any, chunk_size: int) -> list[Any]:
        """One model input in chunks of ``chunk_size`` rows: ``split_input_fn`` when given, else
        :func:`~dpr_gc.engine.chunking.split_input`. A subclass that overrides it makes every input's chunks, as
        ``split_input_fn`` does (in row order: no ``sort_by_length``, no chunk tokens, no joined chunks)."""
        if self.split_input_fn is not None:
            return list(self.split_input_fn(model_input, chunk_size))
        return split_input(model_input, chunk_size)

    def get_input_tensors(self, model_input: Any) -> list[torch.Tensor]:
        """The tensors of a chunk, whose devices' RNG states are recorded before its first pass and replayed (with
        those of the model's parameters and buffers)."""
        return tensors_in(model_input)

    def model_call(self, model: nn.Module, model_input: Any) -> Any:
        """Run ``model`` on a chunk (on the model's device, inside the step's autocast), as
        :func:`~dpr_gc.engine.chunking.call_model` does."""
        return call_model(model, model_input)

    def get_reps(self, model_out: Any) -> torch.Tensor:
        """The representation tensor of a model output: ``get_rep_fn(model_out)``, or the output itself."""
        return self.get_rep_fn(model_out) if self.get_rep_fn is not None else model_out

    def compute_loss(self, *reps: torch.Tensor, **loss_kwargs: Any) -> torch.Tensor:
        """The loss over every model's representations (fp32; float64 for float64 models): ``loss_fn``'s."""
        return self.loss_fn(*reps, **loss_kwargs)

    @property
    def user_split(self) -> bool:
        """Whether the user makes the chunks: ``split_input_fn``, or a subclass's :meth:`split_inputs`."""
        return self.split_input_fn is not None or type(self).split_inputs is not GradCache.split_inputs

    def state_dict(self) -> dict[str, Any]:
        """What the engine learnt in its steps that decides the later ones, as plain numbers (for a checkpoint):
        the bytes per token and widest chunk measured per model (the join limits, the graphs tried and the chunks
        measured again), the largest replayed graphs, and the last step's report (whether a step ran; its largest
        graph sizes an ``auto`` budget)."""
        last = dataclasses.asdict(self.last_step) if self.last_step is not None else None
        return {"per_token": dict(self._per_token), "widest": dict(self._widest),
                "replayed_graph": dict(self._replayed_graph), "replayed_per_token": dict(self._replayed_per_token),
                "replayed_widest": dict(self._replayed_widest), "last_step": last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next step chunks, joins and keeps graphs as the steps that
        learnt it would have gone on to (a resumed run equals an uninterrupted one). A state without the widest
        chunks measured has the next step measure its chunks again."""
        try:
            per_token = {int(m): float(v) for m, v in state["per_token"].items()}
            widest = {int(m): int(v) for m, v in state.get("widest", {}).items()}
            replayed_widest = {int(m): int(v) for m, v in state.get("replayed_widest", {}).items()}
            replayed = {int(m): int(v) for m, v in state["replayed_graph"].items()}
            replayed_per_token = {int(m): float(v) for m, v in state["replayed_per_token"].items()}
            last = StepMemory(**state["last_step"]) if state["last_step"] is not None else None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DprGcError(f"not a GradCache state ({e})") from None
        self._per_token, self._replayed_graph, self._replayed_per_token = per_token, replayed, replayed_per_token
        self._widest, self._replayed_widest = widest, replayed_widest
        self.last_step = last

    # ----------------------------------------------------------------- pieces
    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if not (self.fp16 or self.bf16):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype("fp16" if self.fp16 else "bf16"))

    def _pass_autocast(self) -> contextlib.ExitStack:
        """One autocast context around a whole pass (the per-chunk contexts nest inside it): autocast caches the
        low-precision copy of each weight until its outermost context exits, so every chunk of the pass, and every
        graph kept from it, shares one copy instead of casting (and, when kept, holding) its own."""
        stack = contextlib.ExitStack()
        for device in {model_device(model) for model in self.models}:
            stack.enter_context(self._autocast(device))
        return stack

    def _autocast_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each model device's chunks run in under autocast: the engine's own (``fp16``/``bf16``), else
        that of the caller's autocast context open around the step; a device without autocast is left out."""
        dtypes = {}
        for device in {model_device(model) for model in self.models}:
            if self.fp16 or self.bf16:
                dtypes[device.type] = autocast_dtype("fp16" if self.fp16 else "bf16")
            elif torch.is_autocast_enabled(device.type):
                dtypes[device.type] = torch.get_autocast_dtype(device.type)
        return dtypes

    def _rep(self, output: Any) -> torch.Tensor:
        rep = self.get_reps(output)
        if not isinstance(rep, torch.Tensor):
            raise DprGcError(f"the model output (or get_rep_fn, get_reps) gave {type(rep).__name__}, not a tensor: "
                             "pass a get_rep_fn that returns the representation tensor")
        return rep

    def _input_devices(self, chunk: Any) -> set[torch.device]:
        """The devices of :meth:`get_input_tensors` of a chunk."""
        tensors = self.get_input_tensors(chunk)
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise DprGcError(f"get_input_tensors gave {type(tensors).__name__}, not a list of tensors: return the "
                             "chunk's tensors as a list")
        return {t.device for t in tensors}

    def _forward(self, model: nn.Module, chunk: Any, width: Optional[tuple[int, int, str]]) -> torch.Tensor:
        device = model_device(model)
        with self._autocast(device):
            rep = self._rep(self.model_call(model, to_device(chunk, device)))
        return pad_sequence_dim(rep, width, self.chunking.token_states)

    def _plan(self, m: int, model_input: Any, joined: Optional[tuple[int, int]] = None) -> _Plan:
        """Model ``m``'s chunks (grouped by length, split by rows or tokens, trimmed); with ``joined`` =
        (tokens to keep, tokens per replayed chunk) consecutive chunks are joined to those sizes (see
        :meth:`_join_limits`)."""
        user_split = self.user_split
        order = length_order(model_input) if self.chunking.sort_by_length and not user_split else None
        if order is not None:
            model_input = take_rows(model_input, order)
        trim = trims_exactly(self.models[m], model_input, self.chunking.trim)
        if user_split:
            chunks = list(self.split_inputs(model_input, self.chunk_sizes[m]))
        elif self.chunk_tokens[m] is not None:
            chunks = split_by_tokens(model_input, self.chunk_sizes[m], self.chunk_tokens[m], trim)
        else:
            chunks = split_input(model_input, self.chunk_sizes[m])
        if joined is not None and not user_split:
            overhead = CHUNK_OVERHEAD_TOKENS.get(model_device(self.models[m]).type, DEFAULT_CHUNK_OVERHEAD_TOKENS)
            # A model under DDP/FSDP replays its last chunk (its backward syncs), so that chunk stays small.
            chunks = join_chunks(model_input, chunks, joined[0], joined[1], trim, overhead,
                                 join_last=not is_data_parallel(self.models[m]))
        if is_fsdp(self.models[m]):
            chunks = agreed_chunks(m, model_input, chunks, not user_split)
        if not chunks or rows_in(model_input) == 0:
            raise DprGcError(f"model input {m} is empty: a cached step needs at least one row per model")
        if not trim:
            widths = [None] * len(chunks)
        elif not user_split:
            widths = chunk_widths(model_input, chunks)
        else:
            widths = [trimmed_width(c) for c in chunks]
        chunks = [cut_padding(c, w) if w is not None else c for c, w in zip(chunks, widths)]
        plan = _Plan(m, chunks, widths, order)
        if order is not None and plan.known:
            plan.index(0, model_device(self.models[m]))  # the order's one copy to the device, before any forward
        return plan

    def _join_limits(self, m: int, trainable: bool, ledger: BudgetLedger, width: int) -> Optional[tuple[int, int]]:
        """(tokens, tokens) of model ``m``: the leading chunks that the rest of the budget should hold are joined
        up to that size and kept, and the chunks after it are joined up to the size of the whole budget (kept graphs
        are freed before the replay), both over the bytes per token measured for the model in earlier steps
        (:meth:`BudgetLedger.predicted` at the input's padded ``width``), with ``JOIN_MARGIN`` to spare. Fewer,
        larger chunks mean far fewer kernel launches on a GPU (where padding is cheaper than a launch, see
        ``CHUNK_OVERHEAD_TOKENS``); on the CPU both sizes stop at ``JOINED_CHUNK_MAX_TOKENS``. None before the first
        measurement, for frozen models and at budget 0."""
        left = ledger.report.budget - ledger.held
        if not trainable or not self._per_token.get(m) or ledger.report.budget <= 0:
            return None
        per_token = ledger.predicted(m, 1, width)
        first, rest = int(JOIN_MARGIN * max(0, left) / per_token), int(JOIN_MARGIN * ledger.report.budget / per_token)
        most = JOINED_CHUNK_MAX_TOKENS.get(model_device(self.models[m]).type)
        return (first, rest) if most is None else (min(first, most), min(rest, most))

    def _first_pass(self, plan: _Plan, trainable: bool, keep_last: bool, ledger: BudgetLedger) -> None:
        """Run the chunks of ``plan`` into its buffer. A chunk whose graph may fit the budget runs with it, measured;
        a graph that fits (or, with ``keep_last``, the last chunk's) is kept in ``plan.kept`` and not replayed. The
        others run (or are dropped) without a graph, their RNG state recorded first for the replay. Under DDP/FSDP
        kept graphs run without gradient sync and the last chunk is always replayed: its backward syncs."""
        model = self.models[plan.m]
        devices = replayable_devices(self._tensors.of(model)) if trainable else set()
        data_parallel, last = is_data_parallel(model), len(plan.chunks) - 1
        sharded = trainable and is_fsdp(model)
        for i, (chunk, width) in enumerate(zip(plan.chunks, plan.widths)):
            force = keep_last and i == last
            if trainable:
                plan.states[i] = RandState(devices | self._input_devices(chunk))
            holding = ledger.holding() if sharded else None
            if trainable and not (data_parallel and i == last) and (
                    force or ledger.worth_trying(plan.m, plan.tokens[i], plan.padded[i])):
                self._run_with_graph(plan, i, ledger, force)
            else:
                with torch.no_grad():
                    plan.store(self._forward(model, chunk, width))
            if sharded and i != last and not all_ranks_agree(i in plan.kept) and i in plan.kept:
                del plan.kept[i]  # another rank replays this chunk: FSDP's collectives must pair up rank by rank
                ledger.let_go(holding)
            ledger.count(plan.m, plan.tokens[i], i in plan.kept)
            if i in plan.kept:
                del plan.states[i]

    def _run_with_graph(self, plan: _Plan, i: int, ledger: BudgetLedger, force: bool) -> None:
        """Run chunk ``i`` with its graph, measured; keep the graph when the ledger admits it, else drop it. The
        step's last chunk, kept whatever its size (``force``), is measured in the engine's first step, and later
        where it is wider than any chunk its model measured; the others are estimated
        (:meth:`BudgetLedger.estimated`)."""
        model = self.models[plan.m]
        measure = not force or self.last_step is None or not ledger.knows(plan.m, plan.padded[i])
        with self._sync_context(model, False), (self._tensors.meter(model) if measure else contextlib.nullcontext()) \
                as meter:
            chunk_rep = self._forward(model, plan.chunks[i], plan.widths[i])
        if meter is None:
            ledger.estimated(plan.m, plan.tokens[i])
            plan.kept[i] = chunk_rep
        elif ledger.measured(plan.m, plan.tokens[i], meter.nbytes(chunk_rep), meter.weight_copies, force,
                             plan.padded[i]):
            plan.kept[i] = chunk_rep
        del meter
        plan.store(chunk_rep.detach())

    # ----------------------------------------------------------------- the step
    def cache_step(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> torch.Tensor:
        """One cached step: returns the detached loss; parameter gradients are accumulated into ``.grad``.

        With ``no_sync_except_last`` only each model's last chunk runs DDP's all-reduce (FSDP2's reduce-scatter:
        ``set_requires_gradient_sync(False)`` for the others). A module listed twice (tied encoders) is therefore
        reduced twice per step, which is exact: averaging is linear and leaves an already-averaged part unchanged.
        Under DDP and FSDP, kept graphs (see ``memory_budget``) are backpropagated first without sync and every
        model's last chunk is replayed with it, so the sync always runs on the last backward. What the step kept
        and measured is left in :attr:`last_step`. On the CPU each chunk adds a trainable embedding's gradient
        sparsely, only the rows its tokens touch, into one dense ``.grad`` (single process; see
        :mod:`dpr_gc.engine.sparse_grads`). Under autocast, the frozen ``nn.Linear`` weights of a model that trains (a
        LoRA base) are cast to the autocast dtype once for the step instead of once per chunk (see
        :mod:`dpr_gc.engine.frozen_casts`). Python's cyclic garbage collector is paused for the step (see
        :func:`~dpr_gc.engine.budget.collections_paused`).
        """
        if len(model_inputs) != len(self.models):
            raise DprGcError(f"got {len(model_inputs)} model inputs for {len(self.models)} models")
        check_bool("no_sync_except_last", no_sync_except_last)
        trainable = [is_trainable(m) for m in self.models]
        if no_sync_except_last and not all(is_data_parallel(m) for m, t in zip(self.models, trainable) if t):
            raise DprGcError("no_sync_except_last=True needs every trainable model wrapped in DistributedDataParallel "
                             "or sharded with fully_shard")
        with collections_paused(), SparseEmbeddingGrads([m if t and not is_data_parallel(m) else None
                                   for m, t in zip(self.models, trainable)]) as embeddings, \
                FrozenLinearCasts([m for m, t in zip(self.models, trainable) if t], self._autocast_dtypes(),
                                  self._cast_forwards) as casts:
            self._tensors.held = storages_of(casts.copies)
            try:
                plans, reps = self.forward_no_grad(model_inputs, trainable)
                loss = self.build_cache(reps, **loss_kwargs)
                cache = [rep.grad for rep in reps]
                embeddings.dense_grads([grad is not None for grad in cache])
                self.forward_backward(plans, cache, no_sync_except_last)
            finally:
                self._tensors.clear()  # holds no tensor past the step (a later .to() replaces buffers)
                self._tensors.held = set()
        return loss.detach()

    def forward_no_grad(self, model_inputs: Sequence[Any], trainable: list[bool]) -> tuple[list[_Plan], list[torch.Tensor]]:
        """Part 1: every model's chunks and representations (fp32, original row order, requiring grad where the
        model trains). Chunks whose graphs fit the memory budget keep them; so does the very last chunk (of the
        last model) when ``chunking.keep_last_graph`` allows: it is the one chunk whose graph can live until the loss
        without raising peak memory beyond one chunk (not under DDP or FSDP, whose last chunks carry the sync)."""
        budget, auto = self._budget_bytes()
        ledger = BudgetLedger(budget, self._per_token, self._widest, auto=auto)
        plans, reps = [], []
        self.joined_tokens = []
        self._tensors.clear()  # a step lists them afresh: the caller may have added or frozen some
        with self._pass_autocast():
            for m, model_input in enumerate(model_inputs):
                self.joined_tokens.append(self._join_limits(m, trainable[m], ledger, chunk_width(model_input)))
                plan = self._plan(m, model_input, self.joined_tokens[m])
                keep = (self.chunking.keep_last_graph and m == len(self.models) - 1 and trainable[m]
                        and not is_data_parallel(self.models[m]))
                self._first_pass(plan, trainable[m], keep, ledger)
                plans.append(plan)
                reps.append(plan.reps().requires_grad_(trainable[m]))
        self.last_step = ledger.report
        return plans, reps

    def _budget_bytes(self) -> tuple[int, str]:
        """This step's budget in bytes and how an ``auto`` one was read (on the first model's device, now)."""
        largest = self.last_step.largest_graph if self.last_step is not None else 0
        return budget_reading(self.memory_budget, model_device(self.models[0]), largest)

    def build_cache(self, reps: list[torch.Tensor], **loss_kwargs: Any) -> torch.Tensor:
        """Part 2: the loss over the whole batch of representations, backpropagated to them: their ``.grad`` (fp32)
        is the cache. The gradients of the loss's own parameters are averaged over ranks here."""
        loss = self.compute_loss(*reps, **loss_kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise DprGcError(f"loss_fn must return the loss as a scalar tensor (as must an overridden compute_loss), "
                             f"got {shape}: return extra outputs elsewhere, and reduce per-query losses "
                             "(reduction='mean' or 'sum')")
        if loss.requires_grad:
            (self.scaler.scale(loss) if self.fp16 else loss).backward()
        self._average_loss_parameter_grads()
        return loss

    def forward_backward(self, plans: list[_Plan], cache: list[Optional[torch.Tensor]], no_sync: bool) -> None:
        """Part 3: push the cached gradient into the encoders: first through every kept graph (no gradient sync),
        then by replaying each other chunk with a graph under its recorded RNG state, models last to first. A
        representation the loss did not use is not replayed (and its kept graphs are dropped at once). Buffers are
        put back afterwards: the first pass already counted every example in the running statistics."""
        for plan, grad in zip(plans, cache):
            if grad is None:
                plan.kept.clear()
        with buffers_kept([self.models[m] for m, grad in enumerate(cache) if grad is not None]):
            self._backward_kept(plans, cache)
            with self._pass_autocast():
                for m in reversed(range(len(self.models))):
                    if cache[m] is not None:
                        self._replay(plans[m], cache[m], no_sync)

    def _backward_kept(self, plans: list[_Plan], cache: list[Optional[torch.Tensor]]) -> None:
        """Backpropagate the cached gradient through every kept graph of every model in one backward call, without
        gradient sync (their forwards ran without it too; each model's replayed last chunk carries it under
        DDP/FSDP). One call lets autograd free each graph as it goes and sum a parameter's gradient over the chunks
        before accumulating it, as plain training does, instead of holding every other kept graph while the first
        one's gradients are made."""
        roots, grads, models = [], [], {}
        for plan, grad in zip(plans, cache):
            for i in sorted(plan.kept):
                rep = plan.kept.pop(i)
                roots.append(rep)
                grads.append(cached_gradient(grad, plan.index(i, grad.device), rep))
                models[id(self.models[plan.m])] = self.models[plan.m]
        if not roots:
            return
        with contextlib.ExitStack() as stack:
            for model in models.values():
                stack.enter_context(self._sync_context(model, False))
            for device_type in {rep.device.type for rep in roots}:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            torch.autograd.backward(roots, grads)

    def _replay(self, plan: _Plan, cache: torch.Tensor, no_sync: bool) -> None:
        """One model's part 3 for the chunks without a kept graph; with ``no_sync`` only the last chunk runs DDP's
        all-reduce (FSDP's reduce-scatter)."""
        model, end, m = self.models[plan.m], len(plan.chunks) - 1, plan.m
        for i in sorted(plan.states):
            widest = max(self._widest.get(m, 0), self._replayed_widest.get(m, 0))
            measure = m not in self._replayed_graph or plan.padded[i] > widest
            with self._sync_context(model, not no_sync or i == end):
                with plan.states[i].replay(), \
                        (self._tensors.meter(model) if measure else contextlib.nullcontext()) as meter:
                    chunk_rep = self._forward(model, plan.chunks[i], plan.widths[i])
                if meter is not None:
                    nbytes = meter.nbytes(chunk_rep)
                    self._measured_replay(m, nbytes, plan.tokens[i], plan.padded[i])
                    del meter
                else:
                    per_token = max(self._per_token.get(m, 0.0), self._replayed_per_token.get(m, 0.0))
                    nbytes = int(per_token * plan.tokens[i])
                self._note_replayed_graph(nbytes)
                self._backward_chunk(chunk_rep, plan.index(i, cache.device), cache)
                del chunk_rep

    def _measured_replay(self, m: int, nbytes: int, tokens: int, width: int) -> None:
        """Record a replayed chunk's measured graph (``width`` wide): later replays of model ``m`` up to the widest
        width measured are estimated from it where no first-pass graph was measured (budget 0 without a kept last
        chunk, and every model under DDP/FSDP)."""
        self._replayed_graph[m] = max(self._replayed_graph.get(m, 0), nbytes)
        self._replayed_per_token[m] = max(self._replayed_per_token.get(m, 0.0), nbytes / max(1, tokens))
        self._replayed_widest[m] = max(self._replayed_widest.get(m, 0), width)

    def _note_replayed_graph(self, nbytes: int) -> None:
        """Count a replayed chunk's graph in :attr:`last_step` (kept graphs are all freed before the replay). Replayed
        graphs are measured in a model's first replay and where a chunk is wider than any its model measured; the
        others are estimated as their tokens times the largest bytes per token measured: the saved-tensor hook
        costs a Python call per saved tensor, which a GPU waits for."""
        if self.last_step is not None:
            self.last_step.largest_graph = max(self.last_step.largest_graph, nbytes)
            self.last_step.peak_graph_bytes = max(self.last_step.peak_graph_bytes, nbytes)

    @staticmethod
    def _backward_chunk(chunk_rep: torch.Tensor, rows: Union[slice, torch.Tensor], cache: torch.Tensor) -> None:
        """Backpropagate a chunk's cached gradient into its encoder, outside autocast as a plain step's backward
        (the replay pass's autocast context stays open around it, keeping its weight copies)."""
        with torch.autocast(chunk_rep.device.type, enabled=False):
            chunk_rep.backward(cached_gradient(cache, rows, chunk_rep))

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
