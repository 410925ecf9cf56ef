"""``dpr-gc verify``: check on the user's own set-up that the cached step is the full batch's step.

With ``dpr-gc train``'s settings unchanged, :func:`verify` builds the model, data and Gradient Cache exactly as
training would, draws the first ``batches`` batches, and for each runs from the same weights and random state (a)
one cached step and (b) one full-batch step in one autograd graph, dropout on. It compares the loss, the parameter
gradients (relative error overall and of the worst tensor, named) and the learnable temperature's gradient (relative
to the absolute sum of its terms, which have both signs) against the precision's tolerance, and reports the time and
peak memory of both steps. A model without active dropout runs the full batch in one forward per side
(batch-dependent layers and padding are then checked too); with dropout the one graph is built chunk by chunk in the
cached step's order, so both steps draw the same masks, and each batch is checked a second time with every dropout
module's ``p`` set to 0 (put back after), the full batch then in one forward per side, so batch-dependent layers and
padding are checked there too. Every cached step of a batch's checks chunks as training's step over that batch would
(:meth:`Verifier.training_step`).

An fp32 gap past the tolerance is re-measured with the towers in float64 (not under FSDP): where the two steps
agree there, the cached step is exact and the gap is fp32 rounding, which a small temperature amplifies (logits
scaled by 100 at 0.01), and the batch passes with a note saying so; a gap of :data:`FP32_ROUNDING_LIMIT` or more
fails, its note saying that float64 closes it. Gradients are compared unscaled; under fp16, where a step's scaled
gradients overflow, both steps run again at a lower loss scale, as training's GradScaler lowers it on skipping such
a step (:func:`lower_scale`), the batch's note naming both scales. Gradients or a loss not finite all the same (after
:data:`SCALE_TRIES` halvings, or in fp32 / bf16) fail the batch, the verdict saying so, as nothing can be compared.

Under torchrun, W ranks of B rows are compared with the global batch of W*B: each rank's rows in one graph, the
loss over every rank's representations gathered with their gradient, parameter gradients summed over ranks (FSDP:
reduced by its own backward). Under DDP the full step runs on the unwrapped towers and takes its gradients with
``torch.autograd.grad``, leaving DDP's reducer as the cached step left it. Nothing is written to ``--output``: the
trainer is built in a temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import tempfile
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base.args import positive_int
from ..base.devices import at_least_fp32, autocast_dtype
from ..base.errors import DprGcError, alike_on_every_rank
from ..base.logs import infos_from_rank_zero
from ..base.tables import format_summary
from ..engine.budget import GraphMeter, StepMemory, fixed_storages, format_bytes
from ..engine.chunking import pad_sequence_dim, take_rows
from ..engine.grad_cache import is_data_parallel
from ..engine.loss import SimpleContrastiveLoss, all_gather_with_grad, gather_loss_ids
from .chunks import both_chunk_sizes
from .config import TrainConfig, add_train_arguments, config_from_args
from .rng import capture_rng, restore_rng

logger = logging.getLogger(__name__)

# Relative gradient error allowed per precision. fp32: rounding only (the sums run in another order in chunks).
# bf16 / fp16 autocast: the encoders' matmuls round to 8 / 11 significant bits, and a kernel may split a sum
# differently for a chunk than for the whole batch, so the two steps can differ by a few units of that rounding.
TOLERANCES = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
# The largest fp32 gap that a float64 agreement can put down to rounding; past it the batch fails whatever float64 says.
FP32_ROUNDING_LIMIT = 1e-3

# How many times fp16's loss scale is halved at most where a step's scaled gradients overflow (check_batch).
SCALE_TRIES = 24


@dataclasses.dataclass
class StepCost:
    """Seconds and peak memory of one step (CUDA: the device's peak allocation; CPU: the graph peak, of graphs the
    engine measured, or, after its first step, estimated from the bytes per token it measured: the replayed graphs
    and the kept last chunk's, see ``GradCache.last_step``)."""

    seconds: float
    peak_bytes: int
    peak_kind: str


@dataclasses.dataclass
class BatchCheck:
    """One batch's comparison of the cached step (``cached_*``) with the full-batch step (``full_*``)."""

    queries: int
    cached_loss: float
    full_loss: float
    grad_error: float
    worst_tensor: str
    worst_error: float
    temperature_grad: Optional[tuple[float, float]]
    cached: StepCost
    full: StepCost
    note: str = ""
    memory: Optional[StepMemory] = None  # what the cached step kept under the memory budget
    float64_error: Optional[float] = None  # the worst error with the towers in float64, where fp32 was past tolerance
    temperature_scale: float = 0.0  # the absolute sum of the temperature gradient's terms (Verifier.temperature_terms)
    label: str = ""  # which check of its batch this is ("dropout 0"), where a batch has two
    not_finite: str = ""  # where the loss or gradients hold inf/NaN on some rank: at which scales, and what it means

    @property
    def loss_error(self) -> float:
        return loss_gap(self.cached_loss, self.full_loss)

    @property
    def temperature_error(self) -> float:
        """The temperature gradient's gap (:func:`temperature_gap`); 0 without a learnable temperature."""
        if self.temperature_grad is None:
            return 0.0
        return temperature_gap(*self.temperature_grad, self.temperature_scale)

    def worst(self) -> float:
        """The largest of the gaps the tolerance bounds: loss, overall gradient, temperature. The worst tensor's is
        shown to locate a gap, not judged: a tensor whose exact gradient is zero or nearly so (an attention key
        bias: softmax ignores a shift common to a query's logits) holds only rounding, in bf16 past the tolerance
        of a step that is right (2.8e-2 on all-MiniLM-L6-v2)."""
        return max(self.grad_error, self.loss_error, self.temperature_error)

    def passes(self, tolerance: float) -> bool:
        """Finite, and within the tolerance or an fp32 gap below :data:`FP32_ROUNDING_LIMIT` that float64 closes."""
        if self.not_finite:
            return False
        if self.worst() < tolerance:
            return True
        return (self.float64_error is not None and self.float64_error < tolerance
                and self.worst() < FP32_ROUNDING_LIMIT)


def loss_gap(cached: float, full: float) -> float:
    """The cached loss's gap relative to the full one's."""
    return abs(cached - full) / max(abs(full), 1e-12)


def temperature_gap(cached: float, full: float, scale: float) -> float:
    """The temperature gradient's gap relative to ``scale``, the absolute sum of its terms (at least the gradient's
    own size): the terms have both signs, and where they nearly cancel, their rounding is a large share of the sum."""
    return abs(cached - full) / max(abs(full), scale, 1e-12)


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found: one :class:`BatchCheck` per batch, the precision and its tolerance, the
    world size, the chunking, and whether every check passed."""

    precision: str
    tolerance: float
    world: int
    chunking: str
    reference: str
    batches: list[BatchCheck] = dataclasses.field(default_factory=list)
    rank: int = 0
    device: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.batches) and all(b.passes(self.tolerance) for b in self.batches)

    def table(self) -> str:
        """The short table and the verdict ``dpr-gc verify`` prints."""
        on = f" on {self.device}" if self.device else ""
        lines = [f"verify{on}: {self.chunking}; {self.precision} (tolerance {self.tolerance:g}); {self.world} rank(s); "
                 f"reference: {self.reference}",
                 "| batch | queries | loss cached / full | grad rel. error | worst tensor (rel. error) | "
                 "temperature grad cached / full | cached step | graphs kept (budget) | full step |",
                 "|---|---|---|---|---|---|---|---|---|"]
        notes = []
        for i, b in zip(batch_numbers(self.batches), self.batches):
            temp = "-" if b.temperature_grad is None else f"{b.temperature_grad[0]:.6g} / {b.temperature_grad[1]:.6g}"
            errors = ("not finite", "not finite") if b.not_finite else \
                (f"{b.grad_error:.2e}", f"{b.worst_tensor} ({b.worst_error:.2e})")
            lines.append(f"| {i} | {b.queries} | {b.cached_loss:.6f} / {b.full_loss:.6f} | {errors[0]} | {errors[1]} | "
                         f"{temp} | {cost(b.cached)} | {kept(b.memory)} | {cost(b.full)} |")
            if b.note:
                notes.append(f"note (batch {i}): {b.note}")
        lines += ["", *notes, self.verdict()]  # notes below the table: after its rows a line would read as one
        return "\n".join(lines)

    def verdict(self) -> str:
        """The PASS / FAIL line: a check whose loss or gradients are not finite first (nothing was compared), else
        the check furthest past the tolerance, its gaps given."""
        if self.passed:
            return f"PASS: the cached step equals the full-batch step within {self.tolerance:g}"
        broken = [(n, b) for n, b in zip(batch_numbers(self.batches), self.batches) if b.not_finite]
        if broken:
            return f"FAIL: batch {broken[0][0]}: the gradients are not finite (inf/NaN) {broken[0][1].not_finite}"
        failed = [b for b in self.batches if not b.passes(self.tolerance)]
        worst = max(failed, key=BatchCheck.worst) if failed else None
        check = f" ({worst.label})" if worst and worst.label else ""
        where = (f"{check}: worst tensor {worst.worst_tensor} ({worst.worst_error:.2e}), "
                 f"gradient {worst.grad_error:.2e}, loss {worst.loss_error:.2e}, "
                 f"temperature {worst.temperature_error:.2e}") if worst else ""
        return f"FAIL: the cached step differs from the full-batch step beyond {self.tolerance:g}{where}"

    def summary(self, seconds: float) -> str:
        """The closing summary ``dpr-gc verify`` prints below :meth:`table`, as every command ends."""
        return format_summary({"batches checked": sum(not b.label for b in self.batches),
                               "result": "PASS" if self.passed else "FAIL",
                               "precision": f"{self.precision} (tolerance {self.tolerance:g})",
                               "device": self.device or "-", "ranks": self.world}, seconds)


def batch_numbers(batches: list[BatchCheck]) -> list[str]:
    """Each check's batch number (a labelled check is a further check of the batch before it), with its label."""
    numbers, n = [], 0
    for b in batches:
        n += not b.label
        numbers.append(f"{n} ({b.label})" if b.label else str(n))
    return numbers


def cost(c: StepCost) -> str:
    return f"{c.seconds:.2f} s, {c.peak_kind} {format_bytes(c.peak_bytes)}"


def kept(memory: Optional[StepMemory]) -> str:
    """The graphs the cached step kept and the budget (``auto`` resolved to bytes) they were kept under."""
    return "-" if memory is None else memory.brief()


def is_oom(error: BaseException) -> bool:
    """An allocation failure we can recover from (CUDA's, or a CPU allocator's refusal)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower() \
        or "can't allocate memory" in str(error).lower()


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Every dropout module of ``model`` at ``p`` 0 for the block, its own ``p`` put back after."""
    modules = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    saved = [m.p for m in modules]
    for m in modules:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(modules, saved):
            m.p = p


def has_dropout(model: nn.Module) -> bool:
    """Whether a forward in train mode draws dropout masks (then the full step must draw them in the same order)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in model.modules())


class Verifier:
    """Both steps on a trainer's model and batches (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.fsdp = trainer.config.run.fsdp
        self.model = trainer.retriever if self.fsdp else trainer.towers  # the reference never syncs through DDP
        self.cache = trainer.cache  # the float64 re-check under DDP swaps in one over the unwrapped towers
        self.named = [(n, p) for n, p in trainer.retriever.named_parameters() if p.requires_grad]
        is_data_parallel(self.model)  # its first call imports FSDP (seconds): not part of the cached step's time
        self.chunked = has_dropout(trainer.retriever)
        self.planning: Optional[dict] = None  # the engine's planning state the batch's training step starts from
        self.stepped: Optional[dict] = None  # and the state that step leaves (after the batch's first cached step)
        trainer.retriever.tau.keep_in_range_()  # as each training step does first
        self.loss_fn = SimpleContrastiveLoss(trainer.passages_per_query - 1, symmetric=trainer.config.optim.symmetric,
                                             loss_chunk_size=trainer.config.cache.loss_chunk_size)

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        """Every cached step in the block chunks as training's step over the batch would: each starts from the
        engine's planning state as it is now (bytes per token and widest chunks measured, the last step's report,
        which decide the chunks joined and the graphs kept), and the block leaves the state the first of them left.
        Otherwise a batch's second check would run the chunks training joins from its next step on (under a budget
        holding the whole batch, one per side: plain training, which no batch-dependent layer can fail)."""
        self.planning, self.stepped = self.cache.state_dict(), None
        try:
            yield
        finally:
            if self.stepped is not None:
                self.cache.load_state_dict(self.stepped)
            self.planning = self.stepped = None

    # ----------------------------------------------------------------- the two steps
    def cached_step(self, query: dict, passage: dict, ids: dict) -> tuple[float, dict, StepCost]:
        """The trainer's cached step (``ids``: the loss's passage and positive ids, as the trainer passes them),
        from the planning state of :meth:`training_step` where one is open."""
        trainer = self.trainer
        if self.planning is not None:
            self.cache.load_state_dict(self.planning)
        with measured(trainer.device) as peak:
            started = time.perf_counter()
            synced = trainer.world > 1 and is_data_parallel(self.cache.models[0])
            loss = self.cache(dict(query, kind="query"), dict(passage, kind="passage"), no_sync_except_last=synced,
                              **ids)
            seconds = time.perf_counter() - started
        if self.planning is not None and self.stepped is None:
            self.stepped = self.cache.state_dict()
        if trainer.world > 1 and not synced:
            self.sum_over_ranks()
        report = self.cache.last_step
        graph_peak = report.peak_graph_bytes if report is not None else 0
        return self.global_loss(loss), self.gradients(), self.step_cost(seconds, peak, graph_peak)

    def full_step(self, query: dict, passage: dict, ids: dict) -> tuple[float, dict, StepCost, float]:
        """One graph over the batch (this rank's rows, the loss over every rank's, masked by every rank's ``ids``),
        one backward; also returns :meth:`temperature_terms` of its representations."""
        trainer = self.trainer
        exclude = fixed_storages([trainer.retriever])
        with measured(trainer.device) as peak, GraphMeter(exclude) as meter:
            started = time.perf_counter()
            reps = [self.encode(kind, batch) for kind, batch in (("query", query), ("passage", passage))]
            if trainer.world > 1:
                reps = [all_gather_with_grad(r) for r in reps]
                ids = global_ids(ids, reps[0].device)
            loss = self.loss_fn(*reps, **ids)
            graph = meter.nbytes() + meter.copies_nbytes()
            self.backward(trainer.scaler.scale(loss))
            seconds = time.perf_counter() - started
        if trainer.world > 1 and not self.fsdp:
            self.sum_over_ranks()
        terms = self.temperature_terms(reps, ids)
        return float(loss.detach()), self.gradients(), self.step_cost(seconds, peak, graph), terms

    def temperature_terms(self, reps: list[torch.Tensor], ids: dict) -> float:
        """The absolute sum of the terms of the temperature's gradient (0 without a learnable temperature). Each
        representation ``r`` is scaled by ``1/sqrt(tau)``, so the loss's gradient on ``log tau`` is the sum over every
        element of ``-g*r/2`` (``g``: the loss's gradient on ``r``, from the loss over the whole batch's ``reps``).
        Those terms have both signs, and fp32 rounds each to its own size, not to the sum's: their absolute sum is
        the scale the temperature's error is measured against."""
        if self.temperature_name() is None:
            return 0.0
        leaves = [r.detach().requires_grad_() for r in reps]
        with torch.enable_grad():
            grads = torch.autograd.grad(self.loss_fn(*leaves, **ids), leaves)
        return 0.5 * sum(float((g.double() * r.detach().double()).abs().sum()) for g, r in zip(grads, leaves))

    def backward(self, loss: torch.Tensor) -> None:
        """The reference's gradients into ``.grad``. FSDP reduces them in its backward's hooks. Otherwise they come
        from ``torch.autograd.grad``, which runs no parameter's gradient accumulator and so none of the DDP hooks
        on it: a ``backward()`` through the unwrapped towers marks their parameters used in DDP's reducer, and
        the next cached step, finding one used with its gradient cleared, fails (``--batches 2`` in
        tests/test_verify_distributed.py)."""
        if self.fsdp:
            loss.backward()
            return
        params = [p for _, p in self.named]
        for param, grad in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            param.grad = grad

    def encode(self, kind: str, batch: dict) -> torch.Tensor:
        """Representations with their graph: in one forward, or (dropout) chunk by chunk in the cached step's
        order and padding, put back in row order."""
        batch = {k: v.to(self.trainer.device) for k, v in batch.items()}
        dtype = autocast_dtype(self.trainer.config.optim.precision)
        m = 0 if kind == "query" else 1
        with torch.autocast(self.trainer.device.type, dtype=dtype, enabled=dtype is not None):
            if not self.chunked:
                return widened(self.call(kind, batch))
            cache = self.cache  # the cached step ran first: its chunks, joined as it joined them
            plan = cache._plan(m, dict(batch, kind=kind), cache.joined_tokens[m] if cache.joined_tokens else None)
            parts = [widened(pad_sequence_dim(self.call(kind, {k: v for k, v in c.items() if k != "kind"}), w))
                     for c, w in zip(plan.chunks, plan.widths)]
        reps = torch.cat(parts)
        if plan.order is None:
            return reps
        return reps[torch.argsort(plan.order).to(reps.device)]

    def call(self, kind: str, batch: dict) -> torch.Tensor:
        return self.model(kind, **batch) if self.fsdp else self.model(kind=kind, **batch)

    # ----------------------------------------------------------------- pieces
    def gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's gradient (full tensors under FSDP), unscaled by fp16's loss scale, then
        cleared."""
        grads, scale = {}, self.trainer.scaler.get_scale()
        for name, param in self.named:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name] = widened(grad.detach()) / scale
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return grads

    def sum_over_ranks(self) -> None:
        """The global gradient: each rank's loss is the global one, so its gather's backward sums W equal parts;
        summing over ranks and dividing by W gives every rank the global batch's gradient."""
        for _, param in self.named:
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= self.trainer.world

    def global_loss(self, loss: torch.Tensor) -> float:
        if self.trainer.world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= self.trainer.world
        return float(loss)

    def step_cost(self, seconds: float, peak: dict, graph_bytes: int) -> StepCost:
        if self.trainer.device.type == "cuda":
            return StepCost(seconds, peak["bytes"], "device peak")
        return StepCost(seconds, graph_bytes, "graph peak")

    def temperature_name(self) -> Optional[str]:
        return next((n for n, _ in self.named if n.endswith("tau.log_value")), None)


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in :func:`~dpr_gc.base.devices.at_least_fp32` of its dtype (the float64 re-check keeps float64)."""
    return tensor.to(at_least_fp32(tensor.dtype))


@contextlib.contextmanager
def measured(device: torch.device):
    """Reset CUDA's peak counter; afterwards ``peak["bytes"]`` holds the peak allocation above the start."""
    peak = {"bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    yield peak
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak["bytes"] = torch.cuda.max_memory_allocated(device) - start


WORST_FLOOR = 1e-3  # a tensor's error is taken relative to at least this share of the whole gradient's norm


def compare(cached: dict, full: dict, scales: Optional[dict[str, float]] = None) -> tuple[float, str, float]:
    """Overall relative error and the worst tensor: its error relative to its own gradient's norm, or to
    ``WORST_FLOOR`` times the whole gradient's when its own is smaller (a gradient that is zero in exact arithmetic,
    like an attention key bias's, is pure rounding and would otherwise always look worst), or to its entry in
    ``scales`` when larger (the temperature's: the absolute sum of its gradient's terms)."""
    num = sum(float((cached[n] - full[n]).double().norm() ** 2) for n in full) ** 0.5
    den = sum(float(full[n].double().norm() ** 2) for n in full) ** 0.5
    worst, worst_error = "-", -1.0
    for name, want in full.items():
        scale = max(float(want.double().norm()), WORST_FLOOR * den, (scales or {}).get(name, 0.0), 1e-30)
        err = float((cached[name] - want).double().norm()) / scale
        if err > worst_error:
            worst, worst_error = name, err
    return num / max(den, 1e-30), worst, worst_error


def global_ids(ids: dict, device: torch.device) -> dict:
    """Every rank's loss ids, gathered as :class:`~dpr_gc.engine.loss.DistributedContrastiveLoss` gathers them."""
    passages, positives = gather_loss_ids(ids.get("passage_ids"), ids.get("positive_ids"), device)
    return {k: v for k, v in (("passage_ids", passages), ("positive_ids", positives)) if v is not None}


def smaller(query: dict, passage: dict, ids: dict, per_query: int) -> tuple[dict, dict, dict]:
    """The first half of the batch's queries, their passages and their loss ids."""
    keep = max(1, query["input_ids"].size(0) // 2)
    rows = {"passage_ids": torch.arange(keep * per_query), "positive_ids": torch.arange(keep)}
    return (take_rows(query, torch.arange(keep)), take_rows(passage, torch.arange(keep * per_query)),
            {k: v[rows[k]] for k, v in ids.items()})


def both_steps(verifier: Verifier, query: dict, passage: dict, ids: dict) -> tuple[tuple, tuple, Optional[Exception]]:
    """The cached and the full step from the same RNG state, and the full step's out-of-memory error, if any."""
    rng = capture_rng()
    cached = verifier.cached_step(query, passage, ids)
    restore_rng(rng)
    try:
        full, failed = verifier.full_step(query, passage, ids), None
    except RuntimeError as e:
        if not is_oom(e):
            raise
        full, failed = (None, None, None, 0.0), e
        verifier.trainer.optimizer.zero_grad(set_to_none=True)
    restore_rng(rng)
    return cached, full, failed


def finite_everywhere(verifier: Verifier, cached: dict, full: Optional[dict], *losses: float) -> bool:
    """Whether both steps' gradients (and ``losses``) are finite on every rank."""
    finite = all(bool(torch.isfinite(g).all()) for grads in (cached, full or {}) for g in grads.values())
    finite = finite and all(math.isfinite(loss) for loss in losses)
    return not any_rank(not finite, verifier.trainer.world)


def overflow_note(trainer: Any, overflowed: Optional[float], finite: bool) -> tuple[str, str]:
    """The note on fp16's loss scales (``overflowed``: the scale the gradients overflowed at first), and where the
    steps are not finite (``finite`` False), at which scales and what that means for training."""
    scale = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None
    if overflowed is None:
        broken = (f"in {trainer.config.optim.precision}: the step itself overflows (training stops at such a step as "
                  "diverged)")
        return "", "" if finite else broken
    if finite:
        return (f"the scaled gradients overflow at loss scale {overflowed:g}; compared at loss scale {scale:g} "
                "(training's GradScaler skips a step that overflows and lowers its scale)."), ""
    return "", (f"at loss scale {overflowed:g} nor after {SCALE_TRIES} halvings down to {scale:g}: the fp16 step "
                "overflows whatever its loss scale (training would skip every step until it stops the run as "
                "diverged); try --precision bf16 or fp32")


def lower_scale(verifier: Verifier, cached: dict, full: Optional[dict], first: Optional[float]) -> Optional[float]:
    """Under fp16, where either step's gradients are not finite on any rank, halve the loss scale (the scaler's
    backoff, as training's GradScaler does on skipping such a step) and return the scale they overflowed at first;
    None where they are finite, or after :data:`SCALE_TRIES` halvings."""
    scaler = verifier.trainer.scaler
    if not scaler.is_enabled() or finite_everywhere(verifier, cached, full):
        return None
    scale = scaler.get_scale()
    first = scale if first is None else first
    if scale <= first * scaler.get_backoff_factor() ** SCALE_TRIES:
        return None
    scaler.update(scale * scaler.get_backoff_factor())
    return first


def check_batch(verifier: Verifier, query: dict, passage: dict, ids: dict, tolerance: float) -> BatchCheck:
    """Both steps from the same RNG state (``ids``: the loss's passage and positive ids, as training passes them);
    where the full batch runs out of memory, retry both on halves (every rank at once) and say so; under fp16, where
    the scaled gradients overflow, retry both at a lower loss scale (:func:`lower_scale`) and say at which; an error
    past ``tolerance`` is re-measured in float64."""
    trainer, note, overflowed = verifier.trainer, "", None
    while True:
        (cached_loss, cached_grads, cached_cost), (full_loss, full_grads, full_cost, terms), failed = \
            both_steps(verifier, query, passage, ids)
        if not any_rank(failed is not None, trainer.world):
            first = lower_scale(verifier, cached_grads, full_grads, overflowed)
            if first is None:
                break
            overflowed = first
            continue
        size = query["input_ids"].size(0)
        if size == 1:
            raise DprGcError(f"the full batch does not fit even at one query per rank: {failed}")
        note += (f"the full batch of {size * trainer.world} queries needs more than the "
                 f"{format_bytes(device_memory(trainer.device))} available; ")
        query, passage, ids = smaller(query, passage, ids, trainer.passages_per_query)
        note += f"verified on {query['input_ids'].size(0) * trainer.world} queries with the same chunking. "
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    scales, not_finite = overflow_note(trainer, overflowed,
                                       finite_everywhere(verifier, cached_grads, full_grads, cached_loss, full_loss))
    temp = verifier.temperature_name()
    error, worst, worst_error = compare(cached_grads, full_grads, {temp: terms} if temp else None)
    temperature = (float(cached_grads[temp]), float(full_grads[temp])) if temp else None
    check = BatchCheck(query["input_ids"].size(0) * trainer.world, cached_loss, full_loss, error, worst, worst_error,
                       temperature, cached_cost, full_cost, (note + scales).strip(), trainer.cache.last_step,
                       temperature_scale=terms, not_finite=not_finite)
    if not not_finite and any_rank(check.worst() >= tolerance, trainer.world):
        recheck_in_float64(verifier, check, query, passage, ids)
    return check


def recheck_in_float64(verifier: Verifier, check: BatchCheck, query: dict, passage: dict, ids: dict) -> None:
    """Run both steps again, from the same random state, with the towers in float64 (fp32 runs without FSDP only)
    and record the worst error there: near zero means the fp32 gap is rounding. Under DDP both steps run on the
    unwrapped towers (DDP's buckets are fp32) and sum their gradients over the ranks as the full step does."""
    trainer = verifier.trainer
    tensors = [*trainer.retriever.parameters(), *trainer.retriever.buffers()]
    if (trainer.config.optim.precision != "fp32" or verifier.fsdp
            or any(t.is_floating_point() and t.dtype != torch.float32 for t in tensors)):
        return
    rng = capture_rng()
    trainer.retriever.double()  # fp32 -> float64 -> fp32 is exact: the weights come back unchanged
    trainer.retriever.tau.keep_in_range_()  # a bound's fp32 value can lie a hair past its float64 value
    verifier.cache = trainer.build_cache(trainer.towers) if trainer.world > 1 else trainer.cache
    try:
        cached_loss, cached, _ = verifier.cached_step(query, passage, ids)
        restore_rng(rng)
        full_loss, full, _, terms = verifier.full_step(query, passage, ids)
    finally:
        trainer.retriever.float()
        rewrap(verifier)
        restore_rng(rng)
    temp = verifier.temperature_name()
    error, _, _ = compare(cached, full, {temp: terms} if temp else None)
    temperature = temperature_gap(float(cached[temp]), float(full[temp]), terms) if temp else 0.0
    check.float64_error = max(error, loss_gap(cached_loss, full_loss), temperature)  # as BatchCheck.worst
    if check.passes(TOLERANCES["fp32"]):
        verdict = "fp32 rounding"
    elif check.float64_error < TOLERANCES["fp32"]:
        verdict = f"float64 closes it, but past the {FP32_ROUNDING_LIMIT:g} fp32 rounding can explain"
    else:
        verdict = "not rounding"
    check.note = (check.note + f" {verdict}: the steps differ by {check.worst():.2e} in fp32 and by "
                  f"{check.float64_error:.2e} with the towers in float64").strip()


def rewrap(verifier: Verifier) -> None:
    """After the float64 re-check: under DDP wrap the towers again and build their cache anew. Changing a parameter's
    dtype drops its gradient accumulator, on which DDP hooked its all-reduce: the old wrapper's cached step would keep
    each rank's own gradients from the next batch on."""
    trainer = verifier.trainer
    if trainer.world > 1:
        trainer.towers, trainer.model = trainer.wrap_model()
        trainer.cache = trainer.build_cache()
        verifier.model = trainer.towers
    verifier.cache = trainer.cache


def any_rank(flag: bool, world: int) -> bool:
    if world == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value)
    return bool(value.item())


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    from ..engine.budget import available_ram

    return available_ram()


def describe_chunking(trainer: Any) -> str:
    cache = trainer.config.cache
    sides = both_chunk_sizes(trainer.chunks, [cache.query_chunk_tokens, cache.passage_chunk_tokens])
    budget = cache.memory_budget if cache.memory_budget == "auto" else format_bytes(cache.memory_budget)
    return f"batch {trainer.config.data.batch_size} per rank, {sides}, memory budget {budget}"


def verify(config: TrainConfig, batches: int = 1, hook: Optional[Callable[[Any], None]] = None) -> VerifyReport:
    """Verify the cached step of ``config`` (``dpr-gc train``'s settings) on its first ``batches`` batches; nothing
    is written to ``config.run.output_dir``. ``hook(trainer)`` may adjust the built trainer (tests). Returns a
    :class:`VerifyReport` (``passed``; per batch, the cached step's loss and gradients against one full-batch graph's).
    """
    with alike_on_every_rank():  # refusals of the command line and the files alone, alike on every rank
        check_verify(config, batches)
    with tempfile.TemporaryDirectory(prefix="dpr-gc-verify-") as scratch:
        with alike_on_every_rank():
            trainer = verify_trainer(config, batches, scratch)
        try:
            if hook is not None:
                hook(trainer)
            return run_checks(trainer, batches)
        finally:
            if trainer.owns_group and dist.is_initialized():
                dist.destroy_process_group()


def check_verify(config: TrainConfig, batches: int) -> None:
    """Refuse what verify cannot check: no Gradient Cache, no batch, a ``--resume``."""
    if not config.cache.enabled:
        raise DprGcError("verify checks the Gradient Cache step against the full batch: drop --no-grad-cache")
    if batches < 1:
        raise DprGcError(f"--batches must be >= 1, got {batches}")
    if config.run.resume is not None:
        raise DprGcError(f"--resume {config.run.resume} does not apply to verify: it checks the starting model; to "
                         "check a checkpoint's weights, give its model/ folder as --model")


def verify_trainer(config: TrainConfig, batches: int, scratch: str) -> Any:
    """The trainer whose first ``batches`` batches are checked, writing into ``scratch``: its own few steps, no
    warm-up (the schedule changes no gradient, and a "--warmup-ratio R of N steps" line about the checked batches
    would read as the training run's)."""
    from .trainer import Trainer

    run = dataclasses.replace(config.run, output_dir=scratch, resume=None, eval_every=None)
    data = dataclasses.replace(config.data, num_workers=0, dev_file=None)  # no validation: the dev file unread
    return Trainer(dataclasses.replace(config, run=run, data=data, optim=dataclasses.replace(
        config.optim, max_steps=batches, warmup_ratio=None, warmup_steps=0)))


def run_checks(trainer: Any, batches: int) -> VerifyReport:
    verifier = Verifier(trainer)
    precision = trainer.config.optim.precision
    whole = "one graph, one forward per side over the whole batch"
    reference = (f"one graph, built chunk by chunk in the cached step's order (dropout draws the same masks); "
                 f"dropout 0: {whole}" if verifier.chunked else whole)
    report = VerifyReport(precision, TOLERANCES[precision], trainer.world, describe_chunking(trainer), reference,
                          rank=trainer.rank, device=str(trainer.device))
    trainer.retriever.train()
    for batch in itertools.islice(drawn_batches(trainer), batches):
        step = (dict(batch["query"]), dict(batch["passage"]), trainer.loss_ids(batch))
        with verifier.training_step():  # both checks run the chunks of training's step over this batch
            report.batches.append(check_batch(verifier, *step, report.tolerance))
            if verifier.chunked:
                report.batches.append(check_without_dropout(verifier, step, report.tolerance))
    return report


def check_without_dropout(verifier: Verifier, step: tuple[dict, dict, dict], tolerance: float) -> BatchCheck:
    """:func:`check_batch` with every dropout module at ``p`` 0 and the full batch in one forward per side: the
    chunk-by-chunk reference that dropout needs cannot see layers using batch statistics or the padded width."""
    verifier.chunked = False
    try:
        with dropout_off(verifier.trainer.retriever):
            check = check_batch(verifier, *step, tolerance)
    finally:
        verifier.chunked = True
    check.label = "dropout 0"
    return check


def drawn_batches(trainer: Any) -> Iterator[dict]:
    """The trainer's batches in training's order: epoch after epoch, each sampler seeded for its epoch as
    ``Trainer.train_epoch`` does, so ``--batches`` past one epoch checks the next epoch's batches (not fewer)."""
    if trainer.sampler.batches_per_epoch < 1:
        return
    for epoch in itertools.count():
        trainer.sampler.set_epoch(epoch)
        yield from trainer.loader


IGNORED_TRAIN_FLAGS = {
    ("--save-every", "--keep-checkpoints"): "verify writes no checkpoints",
    ("--dev", "--eval-every", "--best-metric", "--dev-max-questions", "--dev-hard-negatives", "--dev-other-negatives",
     "--dev-batch-size", "--dev-encode-batch-size", "--dev-beir-split"): "verify runs no dev validation",
    ("--epochs", "--max-steps", "--warmup-steps", "--warmup-ratio", "--learning-rate", "--weight-decay",
     "--max-grad-norm"): "verify compares gradients over --batches batches and takes no optimizer step",
}


def add_cli(subparsers: Any) -> None:
    """Register ``verify``: ``dpr-gc train``'s flags plus ``--batches``."""
    p = subparsers.add_parser("verify")
    add_train_arguments(p, resume_kinds=False)  # verify refuses --resume: no flag is tagged with what it keeps
    output = p._option_string_actions["--output"]  # argparse keeps no public handle on an added flag
    output.required, output.default = False, None
    output.help = "accepted and ignored: verify writes nothing, so a dpr-gc train command line runs as it is"
    for flags, why in IGNORED_TRAIN_FLAGS.items():
        for flag in flags:
            p._option_string_actions[flag].help = f"accepted and ignored: {why}"
    p._option_string_actions["--resume"].help = ("refused: verify checks the starting model; to check a checkpoint's "
                                                 "weights, give its model/ folder as --model")
    p.add_argument("--batches", type=positive_int, default=1, help="batches to check")
    p.set_defaults(func=_cli_verify)


def _cli_verify(args: Any) -> int:
    infos_from_rank_zero()
    started = time.perf_counter()
    with alike_on_every_rank():
        config = config_from_args(args)
    report = verify(config, args.batches)
    if report.rank == 0:
        print(report.table())
        print()  # the closing summary apart from the table above
        print(report.summary(time.perf_counter() - started))
    return 0 if report.passed else 1
