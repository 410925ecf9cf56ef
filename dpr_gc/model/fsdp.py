"""FSDP2 sharding of a retriever (``torch.distributed.fsdp.fully_shard``) and its sharded checkpoints.

Every transformer block of every tower is its own FSDP unit, and the retriever as a whole is the root unit (its
projection heads and temperature live there), so one block's full weights exist at a time. Parameters may be kept
in bf16 for compute while gradients are reduced in fp32 (:class:`MixedPrecisionPolicy`), and optionally live on the
CPU between uses (:class:`CPUOffloadPolicy`). Gradient Cache drives gradient synchronisation itself: see
:meth:`dpr_gc.GradCache.cache_step` (``set_requires_gradient_sync(False)`` for every chunk but the last).
Checkpoints are written with ``torch.distributed.checkpoint``: each rank writes its own shards, and any world size
can read them back.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..base.errors import DprGcError, alike_on_every_rank

BLOCK_LISTS = ("layers", "layer", "h", "blocks")  # Llama/Qwen2/Mistral, BERT-family, GPT-2, others


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer (under a PEFT wrapper too): the members of its layer ``ModuleList``."""
    blocks = [block for name, module in model.named_modules()
              if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS for block in module]
    if not blocks:
        raise DprGcError(f"--fsdp: cannot find the transformer blocks of {type(model).__name__} (a ModuleList "
                         f"named one of {', '.join(BLOCK_LISTS)})")
    return blocks


def mixed_precision(precision: str) -> Any:
    """bf16 parameters with fp32 gradient reduction for ``bf16``; full fp32 otherwise (fp16 is refused: FSDP2
    has no GradScaler support here)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16":
        raise DprGcError("--fsdp supports --precision fp32 or bf16, not fp16")
    return MixedPrecisionPolicy()


def shard_retriever(retriever: nn.Module, precision: str = "fp32", cpu_offload: bool = False,
                    mesh: Optional[Any] = None) -> nn.Module:
    """Shard ``retriever`` in place over all ranks (one FSDP unit per transformer block, the retriever the root);
    returns it. The process group must be initialised."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise DprGcError("--fsdp needs torch.distributed: run under torchrun")
    kwargs = {"mp_policy": mixed_precision(precision),
              "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(), "mesh": mesh}
    towers = {id(e): e for e in (retriever.query_encoder, retriever.passage_encoder)}.values()
    for encoder in towers:
        for block in transformer_blocks(encoder.transformer):
            fully_shard(block, **kwargs)
    # FSDP2 cannot shard a scalar: a learnable temperature stays replicated, its gradient averaged like DDP's.
    scalars = {p for p in retriever.parameters() if p.dim() == 0}
    for param in scalars:
        if param.requires_grad:
            param.register_hook(_average_over_ranks)
    fully_shard(retriever, **kwargs, ignored_params=scalars or None)
    return retriever


def _average_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's gradient averaged over the ranks (exact per backward: averaging is linear)."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


def save_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the sharded model and optimizer states of every rank into ``folder`` (call on all ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a checkpoint of :func:`save_sharded` into the sharded ``model`` and ``optimizer`` (all ranks). Nothing in
    it is unpickled: ``.metadata`` may name only checkpoint-layout classes and the saved settings load with
    ``weights_only=True``; anything else is refused in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(folder) / ".metadata").is_file():
        raise DprGcError(f"{folder}: not a sharded checkpoint (no .metadata); resume from a checkpoint written "
                         "with --fsdp")
    with alike_on_every_rank():  # every rank reads the same file: one line per machine says it
        read_metadata(Path(folder) / ".metadata")  # refused here in one line: torch logs its readers' errors
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, storage_reader=_safe_reader(folder), planner=_safe_planner(folder))
    except CheckpointException as e:  # a BaseException holding each rank's error
        errors = [exc for exc, _ in e.failures.values()]
        refusal = next((exc for exc in errors if isinstance(exc, DprGcError)), None)
        if refusal is None:
            first = str(errors[0]).splitlines()[0][:200] if errors else type(e).__name__
            refusal = DprGcError(f"{folder}: this sharded checkpoint does not fit the run ({first}); resume with "
                                 "the settings it was made with, or from another checkpoint")
        refusal.alike = True
        raise refusal from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _metadata_class(module: str, name: str) -> bool:
    """Whether a sharded checkpoint's ``.metadata`` may name the class ``module.name``: the checkpoint-layout
    classes, ``torch.Size``, dtypes and layouts, paths and ordered dicts (what ``dcp.save`` writes there)."""
    from torch.distributed.checkpoint import metadata

    if "." in name:
        return False
    if module == metadata.__name__:
        value = getattr(metadata, name, None)
        return isinstance(value, type) and value.__module__ == module
    if module == "torch" and name != "Size":
        return isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("collections", "OrderedDict"),
                              ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` file naming only :func:`_metadata_class` classes; any other is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if not _metadata_class(module, name):
            raise pickle.UnpicklingError(f"it would run code: {module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Any:
    """The ``Metadata`` of a sharded checkpoint's ``.metadata`` file ``path``, read with
    :class:`_MetadataUnpickler`; a file naming other classes, or damaged, is refused in one line."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError, IndexError,
            KeyError, MemoryError) as e:
        why = str(e) if str(e).startswith("it would run code") else "damaged or truncated"
        raise DprGcError(f"{path}: not a dpr-gc sharded checkpoint ({why}); resume from another checkpoint",
                         ) from None
    if not isinstance(metadata, Metadata):
        raise DprGcError(f"{path}: not a dpr-gc sharded checkpoint (it holds a {type(metadata).__name__}); resume "
                         "from another checkpoint")
    return metadata


def _safe_reader(folder: Path) -> Any:
    """A ``FileSystemReader`` of ``folder`` whose ``.metadata`` goes through :func:`read_metadata` (torch's own
    unpickles it, which would run any code a crafted file holds)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            metadata = read_metadata(Path(folder) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _safe_planner(folder: Path) -> Any:
    """torch's default load planner, but the saved non-tensor values (optimizer settings) load with
    ``weights_only=True``; torch's own unpickles them in full."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except (pickle.UnpicklingError, EOFError, RuntimeError):
                raise DprGcError(f"{folder}: not a dpr-gc sharded checkpoint (its {read_item.dest_index.fqn} "
                                 "would need unpickling); resume from another checkpoint") from None
            plain = io.BytesIO()  # torch's method reads the value again, unrestricted: hand it a vetted copy
            torch.save(loaded, plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return SafePlanner()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model weights on the CPU of rank 0 (empty elsewhere), e.g. to save a retriever folder: a
    snapshot, which later steps leave as it is. The sharded weights are gathered into new tensors, but the CPU
    tensors FSDP does not shard (a replicated temperature, buffers) would be the live ones: they are copied."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
            if not isinstance(t, DTensor)}
    return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in state.items()}


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a sharded model, whose gradients mix DTensor shards and the plain
    gradient of a replicated temperature: the global 2-norm (all shards), and every gradient scaled by
    ``max_norm / (norm + 1e-6)`` when that is below 1 (the same rule). Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, 2)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float().cpu() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = float(max_norm / (total + 1e-6))
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
    return total


def unsharded_copy(model: nn.Module, build: Any, is_main: bool) -> Optional[nn.Module]:
    """On the main rank, a fresh unsharded copy (from ``build()``) holding the sharded ``model``'s full weights, to
    save as an ordinary retriever folder; None elsewhere. Every rank must call it (the weights are gathered)."""
    state = full_state_dict(model)
    if not is_main:
        return None
    copy = build()
    copy.load_state_dict(state)
    return copy
