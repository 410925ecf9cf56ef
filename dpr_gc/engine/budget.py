"""Memory budget of a cached step: which chunks keep their graph from the first pass instead of being run again.

A chunk's graph is measured exactly, as the bytes of the distinct storages autograd saves for its backward
(``torch.autograd.graph.saved_tensors_hooks``), leaving out the model's own parameters and buffers, which exist
anyway. :class:`BudgetLedger` keeps the graphs that fit and records what it kept; :func:`parse_memory` reads
``12GB``-style sizes and :func:`resolve_budget` turns ``"auto"`` into bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import gc
import itertools
import math
import os
import re
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from ..base.errors import DprGcError

MemoryBudget = Union[int, str, None]

UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
         "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MAX_SIZE_DIGITS = 30  # a size past 10**30 bytes is a typo, and its whole bytes would be a huge integer
NEGATIVE_HINT = "give a size such as 12GB, 0 (only the last chunk's graph) or 'auto'"
CPU_AUTO_SHARE = 0.5  # "auto" on the CPU: half of the RAM available when the step starts
CUDA_AUTO_MARGIN = 0.1  # "auto" on CUDA: free memory minus 10% of the device and twice the largest chunk graph
SIZE = re.compile(r"([+-]?)\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([A-Za-z]*)", re.IGNORECASE)


def parse_memory(text: Union[str, int, float]) -> MemoryBudget:
    """``12GB``, ``512MiB``, ``1.5G``, a number of bytes (``1e9`` too, rounded to a whole byte), or ``auto``;
    refuses anything else with one line: a negative size, one past ``10**MAX_SIZE_DIGITS`` bytes (a typo), and a
    size under one byte but zero (``0.5``: a unit missing, most likely), which would otherwise keep no graph at all."""
    value = str(text).strip()
    if isinstance(text, str) and value.lower() == "auto":
        return "auto"
    match = None if isinstance(text, bool) else SIZE.fullmatch(value)
    unit = match.group(3).upper() if match else None
    if match is None or unit not in UNITS:
        raise DprGcError(f"memory budget {text!r} is not a size: give bytes with a unit (e.g. 12GB, 512MiB, 0) or "
                         "'auto'")
    try:
        number = decimal.Decimal(match.group(2))
    except decimal.InvalidOperation:  # an exponent past decimal's own bounds (about 10**18 digits)
        raise DprGcError(f"memory budget {value} has an exponent beyond any size: {NEGATIVE_HINT}") from None
    size = exact_bytes(number, UNITS[unit])
    if size > 10**MAX_SIZE_DIGITS:
        raise DprGcError(f"memory budget {value} is beyond any machine's memory: {NEGATIVE_HINT}")
    if match.group(1) == "-" and size > 0:
        raise DprGcError(f"memory budget must be >= 0 bytes, got {value}: {NEGATIVE_HINT}")
    nbytes = int(size.to_integral_value(decimal.ROUND_HALF_EVEN))
    if nbytes == 0 and size > 0:
        raise DprGcError(f"memory budget {value} is under one byte: give a unit (e.g. 0.5GB), 0 (only the last "
                         "chunk's graph) or 'auto'")
    return nbytes


def exact_bytes(number: decimal.Decimal, unit: int) -> decimal.Decimal:
    """``number`` times ``unit`` without rounding (decimal's default context keeps 28 digits and reads an exponent
    under -999999 as 0); one whose exponent alone puts it past ``10**MAX_SIZE_DIGITS`` bytes is returned as that
    bound plus one, without the product's digits."""
    if number and number.adjusted() > MAX_SIZE_DIGITS:
        return decimal.Decimal(10**MAX_SIZE_DIGITS + 1)
    context = decimal.Context(prec=len(number.as_tuple().digits) + len(str(unit)), Emin=decimal.MIN_EMIN,
                              Emax=decimal.MAX_EMAX)
    return context.multiply(number, unit)


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def available_ram() -> int:
    """Bytes of RAM the kernel reports available (``MemAvailable``), or the free pages where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_budget(budget: MemoryBudget, device: torch.device, largest_graph: int = 0) -> int:
    """Bytes of kept graphs allowed this step (:func:`budget_reading` without its account)."""
    return budget_reading(budget, device, largest_graph)[0]


def budget_reading(budget: MemoryBudget, device: torch.device, largest_graph: int = 0) -> tuple[int, str]:
    """Bytes of kept graphs allowed this step, and for ``auto`` how they were read ('' otherwise). ``auto``: on
    CUDA the free memory (the driver's plus what PyTorch's cache holds unused) minus 10% of the device and twice the
    largest chunk graph measured so far (room for one more chunk and the backward's temporaries); on the CPU
    ``CPU_AUTO_SHARE`` of the available RAM, shared by the ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``),
    which all draw on the same RAM."""
    if budget != "auto":
        return int(budget or 0), ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        nbytes = max(0, int(free + cached - CUDA_AUTO_MARGIN * total - 2 * largest_graph))
        return nbytes, (f"{format_bytes(free)} free + {format_bytes(cached)} cached unused - "
                        f"{CUDA_AUTO_MARGIN:.0%} of {format_bytes(total)} - twice the largest chunk graph "
                        f"{format_bytes(largest_graph)}")
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    ram = available_ram()
    ranks = f", shared by {local_ranks} ranks on this machine" if local_ranks > 1 else ""
    return int(CPU_AUTO_SHARE * ram / local_ranks), f"{CPU_AUTO_SHARE:.0%} of {format_bytes(ram)} available RAM{ranks}"


def _storage(t: torch.Tensor) -> Optional[Any]:
    """The tensor's storage, or None for tensors without one plain storage (sparse; subclasses such as FSDP's
    sharded DTensor parameters)."""
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
        return storage
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def fixed_storages(modules: Iterable[nn.Module]) -> set[int]:
    """Data pointers of the parameters and buffers of ``modules``: saved for backward, but not the graph's memory."""
    return storages_of(t for module in modules for t in itertools.chain(module.parameters(), module.buffers()))


def storages_of(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the storages of ``tensors`` (:func:`fixed_storages` of tensors already listed)."""
    found = set()
    for t in tensors:
        storage = _storage(t)
        if storage is not None and storage.data_ptr():
            found.add(storage.data_ptr())
    return found


HALF_DTYPES = (torch.float16, torch.bfloat16)  # what autocast casts weights to
# Autograd nodes between a parameter and its autocast copy (a cast, then views such as the transpose a linear saves).
_CAST_OR_VIEW = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                           "ReshapeAliasBackward0", "ExpandBackward0", "UnsqueezeBackward0", "AliasBackward0"})


def casts_a_parameter(t: torch.Tensor) -> bool:
    """True when ``t`` is a low-precision copy of a parameter (or a view of one) made by autocast: its autograd
    history is a cast, possibly behind views, of a leaf. Autocast keeps one such copy per weight for as long as its
    outermost context is open, shared by every graph made inside it."""
    node, cast = t.grad_fn, False
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        cast = cast or type(node).__name__ == "ToCopyBackward0"
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return cast and node is not None and type(node).__name__ == "AccumulateGrad"


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (one cached step), as it was before on exit. A measured
    graph keeps a Python tensor object per saved tensor (over a thousand per forward of a deep model) until its
    backward; while they pile up, every few hundred of them set off a collection (now and then a full one, over
    every object of the process), on the host that a GPU step waits for. The step frees them itself, by reference
    count, as its backward passes them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _pack_hook(recording: list["GraphMeter"]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The pack hook of a :class:`GraphMeter`: records a saved tensor in the meter while it measures."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        for meter in recording:
            meter._record(t)
        # Detached: a saved output kept as itself would hold its own grad_fn (a reference cycle that only the
        # garbage collector frees, so every measured graph would outlive its backward).
        return t.detach()

    return pack


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class GraphMeter:
    """Measure the memory a forward's autograd graph holds: inside the block every tensor saved for backward is
    recorded by its storage; :meth:`nbytes` sums the distinct storages (those of ``exclude`` left out), at their
    size when it is called (FSDP frees its gathered parameters after the forward: they count 0). Autocast's weight
    copies are recorded apart, in :attr:`weight_copies`: every graph of one autocast context shares them, so the
    ledger counts each once, not once per chunk."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages: dict[int, Any] = {}
        self.weight_copies: dict[int, Any] = {}
        self.loose = 0  # tensors without a storage of their own, counted by their elements
        # Every tensor saved inside the block keeps the pack hook for as long as its graph lives, so the hook reaches
        # this meter only through ``_recording``, emptied on exit: a hook that held the meter would hold every
        # recorded storage until the whole graph is gone, and a kept graph could not free its saved tensors one node
        # at a time as its backward runs (a whole-batch budget then peaked 7-11 % above plain training on a GPU).
        self._recording: list["GraphMeter"] = [self]
        self._hooks: Optional[Any] = torch.autograd.graph.saved_tensors_hooks(_pack_hook(self._recording), _unpack)

    def _record(self, t: torch.Tensor) -> None:
        """Runs for every saved tensor, on the host a GPU step waits for: autograd's history is walked only for
        tensors in a half precision, the dtypes autocast copies weights to."""
        storage = _storage(t)
        if storage is None:
            self.loose += t.numel() * t.element_size()
            return
        ptr = storage.data_ptr()
        if ptr not in self.exclude:
            copy = t.dtype in HALF_DTYPES and casts_a_parameter(t)
            (self.weight_copies if copy else self.storages).setdefault(ptr or id(storage), storage)

    def __enter__(self) -> "GraphMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._recording.clear()

    def nbytes(self, output: Optional[torch.Tensor] = None) -> int:
        """Bytes of the saved storages other than weight copies, plus ``output``'s own storage when it is not one of
        them (the kept representation lives as long as the graph)."""
        storages = dict(self.storages)
        if output is not None:
            storage = _storage(output)
            if storage is not None and storage.data_ptr() not in self.exclude:
                storages.setdefault(storage.data_ptr() or id(storage), storage)
        return sum(s.nbytes() for s in storages.values()) + self.loose

    def copies_nbytes(self) -> int:
        """Bytes of the autocast weight copies the graph saved (shared with every other graph of the context)."""
        return sum(s.nbytes() for s in self.weight_copies.values())


@dataclasses.dataclass
class StepMemory:
    """What one cached step kept and measured (``GradCache.last_step``): chunks per model, chunks kept (graph from
    the first pass, not replayed), the share of the batch's tokens (rows where no sequence length is known) in
    kept chunks, the kept graphs' bytes, the largest chunk graph measured and the peak of graph memory held during
    the first pass (kept graphs plus the chunk being run), and the budget in bytes. ``kept_last`` is 1 when the step's
    last chunk kept its graph whatever the budget (the backward follows it at once; see ``keep_last_graph``);
    ``estimated_last`` is 1 when that graph was not measured but estimated (see :meth:`BudgetLedger.estimated`)."""

    budget: int = 0
    auto: str = ""  # how an ``auto`` budget was read (:func:`budget_reading`), '' for a given size
    chunks: list[int] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)
    kept_last: int = 0
    estimated_last: int = 0
    kept_tokens: int = 0
    tokens: int = 0
    kept_bytes: int = 0
    largest_graph: int = 0
    peak_graph_bytes: int = 0

    @property
    def kept_share(self) -> float:
        return self.kept_tokens / self.tokens if self.tokens else 0.0

    def brief(self) -> str:
        """A summary table's cell: the chunks kept, their share of the tokens, and the budget, named as such (at
        budget 0 the last chunk is still kept, so a bare size would read as that of the kept graphs)."""
        return (f"{sum(self.kept)}/{sum(self.chunks)} chunks, {100 * self.kept_share:.0f}% of tokens "
                f"(budget {format_bytes(self.budget)})")

    def describe(self) -> str:
        estimated = (" (its graph estimated from the bytes per token measured before on chunks at least as wide)"
                     if self.estimated_last else "")
        last = f"the step's last chunk, never replayed{estimated}, and " if self.kept_last else ""
        return (f"kept the graphs of {sum(self.kept)}/{sum(self.chunks)} chunks ({100 * self.kept_share:.0f}% of "
                f"tokens, {format_bytes(self.kept_bytes)}: {last}{sum(self.kept) - self.kept_last} within a budget "
                f"of {format_bytes(self.budget)}); "
                f"largest chunk graph {format_bytes(self.largest_graph)}, peak graph memory "
                f"{format_bytes(self.peak_graph_bytes)}")


class BudgetLedger:
    """One step's account of kept graphs against the budget. A chunk is run with its graph when its predicted
    size (:meth:`predicted`: from the largest bytes per token measured so far for that model, carried across steps
    in ``per_token``, and the widest padded width measured, in ``widest``) fits what is left; its measured size
    then decides whether the graph is kept."""

    def __init__(self, budget: int, per_token: dict[int, float], widest: Optional[dict[int, int]] = None,
                 auto: str = "") -> None:
        self.report = StepMemory(budget=budget, auto=auto)
        self.per_token = per_token
        self.widest = widest if widest is not None else {}
        self.held = 0
        self.copies: set[int] = set()  # the autocast weight copies that kept graphs hold (counted in ``held``)

    def knows(self, m: int, width: int) -> bool:
        """Whether model ``m``'s bytes per token were measured on a chunk at least ``width`` wide: bytes per token
        grow with the width (attention), so they bound a chunk's graph only up to the widest width measured."""
        return m in self.per_token and width <= self.widest.get(m, -1)

    def predicted(self, m: int, tokens: int, width: int) -> float:
        """A chunk's graph bytes, at most: its tokens times the bytes per token measured, scaled up by its width
        over the widest measured where it is wider (bytes per token are a per-token part plus one that grows in
        proportion to the width, so the scaled figure bounds them)."""
        widest = self.widest.get(m, 0)
        return self.per_token[m] * tokens * (max(1.0, width / widest) if widest else 1.0)

    def worth_trying(self, m: int, tokens: int, width: int = 0) -> bool:
        if self.report.budget <= self.held:
            return False
        return m not in self.per_token or self.predicted(m, tokens, width) <= self.report.budget - self.held

    def measured(self, m: int, tokens: int, nbytes: int, copies: Optional[dict[int, Any]] = None,
                 force: bool = False, width: int = 0) -> bool:
        """Record a measured chunk graph (``nbytes`` of its own, and the autocast weight copies it shares, of a
        chunk ``width`` wide); True when it is kept (it fits, or ``force``: the kept last chunk). Weight copies
        count once, with the first kept graph that holds them; the bytes per token that predict later chunks leave
        them out."""
        new_copies = {ptr: s for ptr, s in (copies or {}).items() if ptr not in self.copies}
        self.per_token[m] = max(self.per_token.get(m, 0.0), nbytes / max(1, tokens))
        self.widest[m] = max(self.widest.get(m, 0), width)
        return self._admit(nbytes + sum(s.nbytes() for s in new_copies.values()), new_copies, force)

    def estimated(self, m: int, tokens: int) -> None:
        """Keep the step's last chunk, run without a meter (only where :meth:`knows` its width): its graph is
        counted as its tokens times the largest bytes per token measured for model ``m`` (weight copies of its own
        left out). It is kept whatever it measures, so measuring it would decide nothing; the meter's saved-tensor
        hooks cost a Python call per saved tensor, which a GPU waits for."""
        self.report.estimated_last = 1
        self._admit(math.ceil(self.per_token[m] * tokens), {}, force=True)

    def _admit(self, cost: int, new_copies: dict[int, Any], force: bool) -> bool:
        """Count a chunk graph of ``cost`` bytes in the report; hold it when it fits (or ``force``)."""
        self.report.largest_graph = max(self.report.largest_graph, cost)
        self.report.peak_graph_bytes = max(self.report.peak_graph_bytes, self.held + cost)
        keep = force or self.held + cost <= self.report.budget
        self.report.kept_last += force
        if keep:
            self.held += cost
            self.copies.update(new_copies)
            self.report.kept_bytes = self.held
        return keep

    def holding(self) -> tuple[int, frozenset[int]]:
        """What the ledger holds now, for :meth:`let_go`."""
        return self.held, frozenset(self.copies)

    def let_go(self, holding: tuple[int, frozenset[int]]) -> None:
        """Drop the graphs admitted since ``holding`` was taken (their chunk is replayed after all)."""
        self.held, self.copies = holding[0], set(holding[1])
        self.report.kept_bytes = self.held

    def count(self, m: int, tokens: int, kept: bool) -> None:
        """Count a chunk of model ``m`` (kept or not) in the report."""
        while len(self.report.chunks) <= m:
            self.report.chunks.append(0)
            self.report.kept.append(0)
        self.report.chunks[m] += 1
        self.report.tokens += tokens
        if kept:
            self.report.kept[m] += 1
            self.report.kept_tokens += tokens
