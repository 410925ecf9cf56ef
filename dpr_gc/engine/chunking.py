"""Model inputs for Gradient Cache: find their tensors, split them into chunks, trim padding, call the model.

Tensors, lists/tuples, dicts and ``BatchEncoding``s (any ``Mapping``; one whose class cannot be built from a dict,
such as a ``defaultdict``, is rebuilt as a dict) are handled, their rows on dimension 0 (:func:`rows_in`: a 0-d
tensor or one broadcast over the rows goes whole to every chunk); the original package's
``(args_list, kwargs_dict)`` tuple is called as ``model(*args, **kwargs)``, a dict as ``model(**dict)``, or as
``model(dict)`` for a model whose forward takes the features dict whole (sentence-transformers'). Other objects pass
through untouched (a user's ``split_input_fn`` splits them).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from ..base.errors import DprGcError
from .arguments import is_integer


TokenLimits = Union[None, int, Sequence[Optional[int]]]


@dataclass(frozen=True)
class Chunking:
    """How :class:`~dpr_gc.engine.grad_cache.GradCache` forms and runs its chunks (the defaults keep the gradient
    exact for any model; they change time and memory only).

    Args:
        sort_by_length: group rows of similar length into the same chunk (representations are returned and the
            loss is computed in the original order; inputs without a 2-D attention mask are left in order).
        trim: cut every chunk to its longest sequence, on its padding side. None (default): only for a model that
            declares its output ignores padding positions (``ignores_padding``: dpr-gc's retrievers, whose pooling
            masks them); a raw model runs its chunks at the batch's width, as the original package does, since its
            representation may read padding (a mean without the mask, the last column). True: for every model, as
            the user vouches its representation masks padding (or returns token states, ``token_states=True``);
            False: never. Right padding is cut wherever trimming is on, left padding only where positions do not
            follow columns (:func:`~dpr_gc.engine.grad_cache.trims_exactly`).
        keep_last_graph: keep the graph of the last model's last chunk from the first pass instead of running it
            again (under DDP/FSDP it is replayed, since its backward carries the gradient sync); it is
            backpropagated first, so peak memory stays one chunk.
        tokens: one int per model (or one for all; None: rows only; numpy integers too): a chunk holds as many
            rows (at most its chunk size) as fit this many tokens, counted as rows times the chunk's longest
            sequence (untrimmed, times the full width; after ``sort_by_length``, short sequences make
            chunks of more rows). Needs a 2-D attention mask.
        token_states: whether a representation's dimension 1 runs over the tokens, so that a trimmed chunk's is
            padded back with zeros to the batch's width: True for token-level states (``[rows, tokens, ...]``, two
            dimensions or more; ColBERT-style losses), False for pooled vectors or a fixed number of vectors per
            row (``[rows, K, D]``: poly-encoder codes), None (default): pooled ``[rows, D]`` pass as they are and a
            ``[rows, n, ...]`` output whose ``n`` is the length a chunk was trimmed to is refused, since it could be
            either.
    """

    sort_by_length: bool = False
    trim: Optional[bool] = None
    keep_last_graph: bool = True
    tokens: TokenLimits = None
    token_states: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("sort_by_length", "keep_last_graph"):
            if not isinstance(getattr(self, name), bool):
                raise DprGcError(f"Chunking.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("trim", "token_states"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise DprGcError(f"Chunking.{name} must be True, False or None, got {getattr(self, name)!r}")
        one = self.tokens is None or isinstance(self.tokens, numbers.Integral)
        if not one and not isinstance(self.tokens, (list, tuple)):
            raise DprGcError(f"chunk tokens must be a positive integer, None, or a list of them (one per model), got "
                             f"{self.tokens!r}")
        limits = [self.tokens] if one else list(self.tokens)
        for limit in limits:
            if limit is not None and (not is_integer(limit) or limit <= 0):
                raise DprGcError(f"chunk tokens must be a positive integer (or None), got {limit!r}")
        limits = [None if limit is None else int(limit) for limit in limits]
        object.__setattr__(self, "tokens", limits[0] if one else tuple(limits))

    def token_limits(self, models: int) -> list[Optional[int]]:
        """One token limit (or None) per model."""
        if self.tokens is None or isinstance(self.tokens, int):
            return [self.tokens] * models
        if len(self.tokens) != models:
            raise DprGcError(f"got {len(self.tokens)} chunk token limits for {models} models")
        return list(self.tokens)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tensors, lists, tuples and mappings."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def rows_in(model_input: Any) -> Optional[int]:
    """Rows of an input: the first dimension of its first tensor of more than one row (of its first tensor that has
    dimensions, when none has more), or None when it holds no tensor we can see. A 0-d tensor and a tensor
    broadcast over the rows (HF-style ``position_ids`` of shape ``[1, T]``) are not rows of the batch."""
    sizes = [t.size(0) for t in tensors_in(model_input) if t.dim() > 0]
    return next((n for n in sizes if n != 1), sizes[0]) if sizes else None


def rebuilt(mapping: Mapping, items: dict) -> Mapping:
    """``items`` in the class of ``mapping`` (a ``BatchEncoding`` stays one), or as a dict where that class cannot
    be built from a dict (a ``defaultdict``)."""
    try:
        return mapping.__class__(items)
    except TypeError:
        return items


def take_rows(obj: Any, index: torch.Tensor) -> Any:
    """Select rows ``index`` of every tensor in ``obj`` that holds the input's rows (:func:`rows_in`); the others
    (a 0-d tensor, a broadcast ``[1, T]``) are kept whole. Keeps the container types, BatchEncoding included. The
    index is copied to each device once, not once per tensor: a blocking copy waits for every queued kernel."""
    moved: dict[torch.device, torch.Tensor] = {}
    rows = rows_in(obj)

    def take(part: Any) -> Any:
        if isinstance(part, torch.Tensor):
            if part.dim() == 0 or part.size(0) != rows:
                return part
            if part.device not in moved:
                moved[part.device] = index.to(part.device)
            return part[moved[part.device]]
        if isinstance(part, Mapping):
            return rebuilt(part, {k: take(v) for k, v in part.items()})
        if isinstance(part, (list, tuple)):
            return type(part)(take(v) for v in part)
        return part

    return take(obj)


def slice_rows(obj: Any, start: int, end: int, rows: Optional[int] = None) -> Any:
    """Rows ``start:end`` of every tensor in ``obj`` that holds the input's ``rows`` (:func:`rows_in` when not
    given), as views (no copy; keeps the container types); the others (a 0-d tensor, a broadcast ``[1, T]``) are
    kept whole, for every chunk."""
    rows = rows_in(obj) if rows is None else rows
    if isinstance(obj, torch.Tensor):
        return obj[start:end] if obj.dim() > 0 and obj.size(0) == rows else obj
    if isinstance(obj, Mapping):
        return rebuilt(obj, {k: slice_rows(v, start, end, rows) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(slice_rows(v, start, end, rows) for v in obj)
    return obj


def split_input(model_input: Any, chunk_size: int) -> list[Any]:
    """Split tensors, lists/tuples of tensors, dicts and BatchEncodings into chunks of ``chunk_size`` rows (views)."""
    n = rows_in(model_input)
    if n is None:
        raise DprGcError(f"cannot find a tensor in a model input of type {type(model_input).__name__}; "
                         "pass split_input_fn")
    return [slice_rows(model_input, s, min(s + chunk_size, n), n) for s in range(0, n, chunk_size)]


def sequence_lengths(model_input: Any) -> Optional[torch.Tensor]:
    """Real tokens per row (the 2-D attention mask's nonzero entries; float and bool masks too), or None without
    such a mask."""
    if isinstance(model_input, Mapping) and isinstance(model_input.get("attention_mask"), torch.Tensor):
        mask = model_input["attention_mask"]
        if mask.dim() == 2:
            return (mask != 0).sum(1).cpu()
    return None


def token_spans(lengths: list[int], width: int, max_rows: int, max_tokens: int, trim: bool) -> list[tuple[int, int]]:
    """Consecutive row spans, each as many rows as fit ``max_tokens`` computed tokens (rows times the chunk's
    longest sequence when trimmed, else times the full ``width``) and at most ``max_rows``; at least one row each."""
    spans, start = [], 0
    while start < len(lengths):
        end, longest = start + 1, lengths[start] if trim else width
        while end < len(lengths) and end - start < max_rows:
            wider = max(longest, lengths[end]) if trim else width
            if (end - start + 1) * wider > max_tokens:
                break
            end, longest = end + 1, wider
        spans.append((start, end))
        start = end
    return spans


def split_by_tokens(model_input: Any, max_rows: int, max_tokens: int, trim: bool = True) -> list[Any]:
    """Split an input with a 2-D attention mask into chunks of at most ``max_tokens`` tokens (see
    :func:`token_spans`): short sequences make chunks of more rows. Group rows by length first for even chunks."""
    lengths = sequence_lengths(model_input)
    if lengths is None:
        raise DprGcError("chunks by tokens need a dict-like model input with a 2-D attention_mask; give chunk sizes "
                         "in rows instead")
    width = model_input["attention_mask"].size(1)
    spans = token_spans(lengths.tolist(), width, max_rows, max_tokens, trim)
    return [slice_rows(model_input, s, e) for s, e in spans]


def join_chunks(model_input: Any, chunks: list[Any], first_tokens: int, rest_tokens: int, trim: bool = True,
                chunk_overhead: Optional[int] = None, join_last: bool = False) -> list[Any]:
    """Join consecutive chunks of ``model_input`` (row slices in order) into larger ones: the first of at most
    ``first_tokens`` computed tokens (rows times the longest sequence; the full width untrimmed), the following ones
    of at most ``rest_tokens``. The last chunk stays as it is unless ``join_last`` and the first joined chunk reaches
    it (the whole input fits ``first_tokens``). With ``chunk_overhead`` (a chunk's fixed cost, in tokens) a chunk
    joins only while the joined chunk computes no more tokens than its parts plus that cost for every part it saves:
    padding a short chunk to a long one's width costs more than running it apart. A chunk that alone exceeds its
    limit stays as it is. Inputs without a 2-D attention mask are returned unchanged."""
    lengths = sequence_lengths(model_input)
    if lengths is None or len(chunks) < (2 if join_last else 3):
        return chunks
    width, rows_of, lengths = model_input["attention_mask"].size(1), [rows_in(c) or 0 for c in chunks], lengths.tolist()
    starts = list(itertools.accumulate(rows_of, initial=0))
    widths = [max(lengths[s:s + n]) if trim and n else width for s, n in zip(starts, rows_of)]
    joined, i, limit = [], 0, first_tokens
    while i < len(chunks) - 1:
        rows, longest, parts, j = 0, 0, 0, i
        stop = len(chunks) if join_last and i == 0 else len(chunks) - 1
        while j < stop:
            wider, cost = max(longest, widths[j]), parts + rows_of[j] * widths[j]
            too_big = (rows + rows_of[j]) * wider > limit
            padded = chunk_overhead is not None and (rows + rows_of[j]) * wider > cost + chunk_overhead * (j - i)
            if j > i and (too_big or padded):
                break
            rows, longest, parts, j = rows + rows_of[j], wider, cost, j + 1
        joined.append(chunks[i] if j == i + 1 else slice_rows(model_input, starts[i], starts[i] + rows))
        i, limit = j, rest_tokens
    return joined + chunks[i:]


def _first_matrix(chunk: Any) -> Optional[torch.Tensor]:
    """A chunk's first tensor of two dimensions or more (its sequence width is dimension 1), None without one."""
    return next((t for t in tensors_in(chunk) if t.dim() >= 2), None)


def chunk_tokens(chunk: Any) -> int:
    """Tokens a chunk computes: rows times its sequence width (after trimming), or its rows without a 2-D input."""
    matrix, rows = _first_matrix(chunk), rows_in(chunk) or 0
    return rows * int(matrix.size(1)) if matrix is not None else rows


def chunk_width(chunk: Any) -> int:
    """A chunk's padded sequence width (dimension 1 of :func:`_first_matrix`), 0 without one: a graph's bytes per
    token grow with it (attention)."""
    matrix = _first_matrix(chunk)
    return int(matrix.size(1)) if matrix is not None else 0


def trimmed_width(chunk: Any) -> Optional[tuple[int, int, str]]:
    """``(width, longest, side)`` when a chunk with a 2-D attention mask has padding columns beyond its longest row
    on one side (``"right"``, or ``"left"`` for a decoder tokenizer's left padding), else None. A chunk of padding
    rows only is cut to one column, not none (a model cannot reshape a sequence of width 0)."""
    if not isinstance(chunk, Mapping) or not isinstance(chunk.get("attention_mask"), torch.Tensor):
        return None
    mask = chunk["attention_mask"]
    if mask.dim() != 2 or mask.size(0) == 0:
        return None
    width, longest = mask.size(1), max(1, int((mask != 0).sum(1).max()))  # a chunk of padding rows keeps a column
    if longest >= width:
        return None
    if bool((mask[:, longest:] == 0).all()):
        return width, longest, "right"
    if bool((mask[:, :width - longest] == 0).all()):
        return width, longest, "left"
    return None


def chunk_widths(model_input: Any, chunks: list[Any]) -> list[Optional[tuple[int, int, str]]]:
    """:func:`trimmed_width` of each chunk, for chunks that are consecutive row slices of ``model_input``, from one
    read of the mask's per-row extents: on a GPU each chunk's own read would wait for every queued kernel."""
    if not isinstance(model_input, Mapping) or not isinstance(model_input.get("attention_mask"), torch.Tensor) \
            or model_input["attention_mask"].dim() != 2:
        return [trimmed_width(c) for c in chunks]
    mask = model_input["attention_mask"]
    width = mask.size(1)
    real = mask != 0
    columns = torch.arange(width, device=mask.device)
    first = torch.where(real, columns, width).amin(1) if width else torch.zeros_like(mask[:, 0])
    end = torch.where(real, columns + 1, 0).amax(1) if width else torch.zeros_like(mask[:, 0])
    lengths, first, end = torch.stack([real.sum(1), first, end]).cpu().tolist()
    widths, start = [], 0
    for chunk in chunks:
        rows = rows_in(chunk) or 0
        widths.append(_width(lengths[start:start + rows], first[start:start + rows], end[start:start + rows], width))
        start += rows
    return widths


def _width(lengths: list[int], first: list[int], end: list[int], width: int) -> Optional[tuple[int, int, str]]:
    """:func:`trimmed_width` from a chunk's row lengths, first real columns and ends past the last real ones."""
    if not lengths:
        return None
    longest = max(1, max(lengths))  # a chunk of padding rows only keeps one column: models cannot take width 0
    if longest >= width:
        return None
    if max(end) <= longest:
        return width, longest, "right"
    if min(first) >= width - longest:
        return width, longest, "left"
    return None


def trim_padding(chunk: Any) -> Any:
    """Cut a padded chunk to its own longest sequence, dropping all-padding columns on its padding side.

    Exact because padded positions are masked out -- for left padding, provided the model counts positions from
    each row's first real token (:class:`dpr_gc.model.retriever.Encoder` passes such ``position_ids``); a raw model that
    counts from the first column sees every position shifted. This helper cuts either side; a cached step cuts left
    padding only where it is exact (:func:`dpr_gc.engine.grad_cache.trims_exactly`).
    """
    trim = trimmed_width(chunk)
    return chunk if trim is None else cut_padding(chunk, trim)


def cut_padding(chunk: Any, trim: tuple[int, int, str]) -> Any:
    """Cut a chunk to ``trim`` = ``(width, longest, side)`` from :func:`trimmed_width` (or :func:`chunk_widths`)."""
    full, longest, side = trim
    cut = slice(0, longest) if side == "right" else slice(full - longest, full)
    return rebuilt(chunk, {k: v[:, cut] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.size(1) == full
                           else v for k, v in chunk.items()})


def pad_sequence_dim(rep: torch.Tensor, trim: Optional[tuple[int, int, str]],
                     token_states: Optional[bool] = None) -> torch.Tensor:
    """Pad a token-level representation ``[rows, longest, ...]`` of a trimmed chunk back to ``[rows, width, ...]``
    with zeros on the side that was cut, so the loss sees the untrimmed shape; the padded positions get no
    gradient. ``token_states`` as :class:`Chunking` says: True pads (two dimensions or more), False passes, None
    passes pooled ``[rows, D]`` and refuses a ``[rows, longest, ...]`` of a chunk cut shorter (it could be
    either)."""
    if trim is None or token_states is False or rep.dim() < 2 or (token_states is None and rep.dim() < 3):
        return rep
    full, longest, side = trim
    if rep.size(1) != longest:
        if token_states:
            raise DprGcError(f"Chunking(token_states=True), but a chunk trimmed to {longest} tokens gave a "
                             f"representation of shape {tuple(rep.shape)}: its dimension 1 is not per token; pass "
                             "token_states=False (or None)")
        return rep
    if longest == full:
        return rep
    if token_states is None:
        raise DprGcError(f"a chunk trimmed from {full} to {longest} tokens gave a representation of shape "
                         f"{tuple(rep.shape)}: say whether its dimension 1 runs over the tokens: "
                         f"Chunking(token_states=True) pads it back to {full} (token-level states), "
                         "token_states=False leaves it (a fixed number of vectors per row); or pass trim=False")
    cut = full - longest
    return nn.functional.pad(rep, (0, 0) * (rep.dim() - 2) + ((0, cut) if side == "right" else (cut, 0)))


def length_order(model_input: Any) -> Optional[torch.Tensor]:
    """Row order by descending sequence length (stable), or None without a 2-D attention mask."""
    if isinstance(model_input, Mapping) and isinstance(model_input.get("attention_mask"), torch.Tensor):
        mask = model_input["attention_mask"]
        if mask.dim() == 2:
            return torch.sort((mask != 0).sum(1).cpu(), descending=True, stable=True).indices
    return None


def is_args_kwargs(model_input: Any) -> bool:
    """The original package's ``(list_of_args, dict_of_kwargs)`` input."""
    return (isinstance(model_input, tuple) and len(model_input) == 2 and isinstance(model_input[0], list)
            and isinstance(model_input[1], Mapping))


@functools.lru_cache(maxsize=None)
def required_positionals(forward: Any) -> tuple[str, ...]:
    """The names of the positional parameters ``forward`` (a class's function) requires, ``self`` left out."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def takes_features(model: nn.Module, model_input: Mapping) -> bool:
    """Whether ``model`` takes a dict input whole, as one argument (sentence-transformers' models:
    ``forward(features)``), rather than its entries as keywords: its forward (inside torch.compile's and data
    parallel wrappers) requires exactly one positional parameter, and the dict has no entry of that name."""
    inner = model
    while isinstance(getattr(inner, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
        inner = inner._orig_mod
    if isinstance(inner, (nn.DataParallel, nn.parallel.DistributedDataParallel)):  # they pass their arguments on
        inner = inner.module
    required = required_positionals(getattr(type(inner), "forward", None))
    return len(required) == 1 and required[0] not in model_input


def call_model(model: nn.Module, model_input: Any) -> Any:
    if is_args_kwargs(model_input):
        return model(*model_input[0], **model_input[1])
    if isinstance(model_input, Mapping):
        return model(model_input) if takes_features(model, model_input) else model(**model_input)
    if isinstance(model_input, (list, tuple)):
        return model(*model_input)
    return model(model_input)


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return rebuilt(obj, {k: to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
