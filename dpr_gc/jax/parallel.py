"""Data-parallel Gradient Cache with ``shard_map``: every device scores against the global batch.

The gradient rule (the same as :class:`dpr_gc.engine.loss.DistributedContrastiveLoss` under DDP). With W devices each
holding B local queries and their passages:

1. each device runs both Gradient Cache passes on its own batch; its loss ``L_d`` is the mean loss of ITS OWN B
   queries scored against the all-gathered representations of all W·B queries' passages;
2. the transpose of ``all_gather`` is a reduce-scatter, so the cached gradient each device gets for its own
   representations is ``sum over d' of dL_d' / d(its representations)``, every device's loss included;
3. each device pushes that cached gradient through its own chunks, and the parameter (and temperature) gradients are
   then averaged over devices with ``pmean``: ``(1/W) · sum_d dL_d/dθ``, which is exactly the gradient of the
   global-batch mean loss ``(1/(W·B)) · sum over all W·B queries``. No other world-size factor appears anywhere.

This requires the same local batch on every device (the all-gather needs equal shapes), which ``shard_map`` with
the batch split along the mesh axis guarantees. The map runs with ``check_vma=False``: every collective is explicit
above, so no implicit reduction is inserted for the replicated parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..base.errors import DprGcError
from ..base.logs import counted
from .grad_cache import Encoder, _check_key, cached_value_and_grad, remat_value_and_grad
from .loss import ContrastiveLoss

DATA_AXIS = "data"


def data_mesh(devices: Optional[Sequence[Any]] = None, axis_name: str = DATA_AXIS) -> Mesh:
    """A one-axis mesh over ``devices`` (default: all local devices) for data parallelism."""
    return Mesh(np.asarray(devices if devices is not None else jax.devices()), (axis_name,))


def data_parallel_value_and_grad(encoders: Sequence[Encoder], loss_fn: Callable[..., Any],
                                 chunk_sizes: int | Sequence[int], mesh: Mesh, axis_name: str = DATA_AXIS,
                                 remat: bool = False) -> Callable[..., Any]:
    """The Gradient Cache step of :func:`~dpr_gc.jax.cached_value_and_grad` over ``mesh``.

    Returns ``f(params, loss_params, batches, key, *loss_inputs) -> (loss, (grads, loss_grads))`` taking the GLOBAL
    batches and loss inputs (e.g. ``passage_ids``, which :class:`~dpr_gc.jax.ContrastiveLoss` gathers with the
    passages), split along their leading axis across the devices (each device's share must be the same size), with
    replicated parameters; the outputs are replicated and equal to the single-device global-batch step's.
    ``loss_fn`` must gather over ``axis_name``: a :class:`~dpr_gc.jax.ContrastiveLoss` built with another
    ``axis_name`` (None included) is refused, since it would score each device's queries against its own passages.
    Each device draws its dropout keys from ``fold_in(key, device index)`` (a ``key`` of None stays None, for
    encoders without dropout). ``remat=True`` uses the single-decorator form instead of the two passes.
    """
    if isinstance(loss_fn, ContrastiveLoss) and loss_fn.axis_name != axis_name:
        raise DprGcError(f"data_parallel_value_and_grad: ContrastiveLoss(axis_name={loss_fn.axis_name!r}) would score "
                         "each device's queries against its own passages only, another loss than the global batch's; "
                         f"pass ContrastiveLoss(..., axis_name={axis_name!r})")
    build = remat_value_and_grad if remat else cached_value_and_grad
    local_step = build(encoders, loss_fn, chunk_sizes, axis_name=axis_name)

    def per_device(params: Any, loss_params: Any, batches: Sequence[Any], key: jax.Array,
                   loss_inputs: tuple) -> Any:
        device_key = None if key is None else jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        return local_step(params, loss_params, batches, device_key, *loss_inputs)

    replicated, split = PartitionSpec(), PartitionSpec(axis_name)
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(replicated, replicated, split, replicated, split),
                           out_specs=replicated, check_vma=False)

    def step(params: Any, loss_params: Any, batches: Sequence[Any], key: jax.Array, *loss_inputs: Any) -> Any:
        check_global_batch(batches, loss_inputs, len(encoders), loss_fn, mesh.shape[axis_name])
        _check_key(key)  # before each device folds its index into it
        return mapped(params, loss_params, batches, key, tuple(loss_inputs))

    return step


def check_global_batch(batches: Sequence[Any], loss_inputs: Sequence[Any], n_encoders: int, loss_fn: Any,
                       n_devices: int) -> None:
    """Refuse, before the batch is split, what each device's step would refuse with its own share's counts: the
    errors name the global batch's sizes and the device count."""
    where = f"data_parallel_value_and_grad ({n_devices} devices)"
    if len(batches) != n_encoders:
        raise DprGcError(f"{where}: {n_encoders} encoders need {n_encoders} global batches, got {len(batches)}")
    rows = [_rows(batch, f"batch {i}", where) for i, batch in enumerate(batches)]
    for i, n in enumerate(rows):
        if n == 0:
            raise DprGcError(f"{where}: global batch {i} is empty (0 rows): every encoder needs at least one row "
                             "on every device")
    check_divisible(batches, n_devices)
    check_divisible(loss_inputs, n_devices, "loss input")
    if isinstance(loss_fn, ContrastiveLoss) and len(rows) == 2:
        group = 1 + loss_fn.n_hard_negatives
        if rows[1] != rows[0] * group:
            raise DprGcError(f"{where}: the global batch's {rows[0]} queries need {rows[0] * group} passages "
                             f"(1 positive + {counted(loss_fn.n_hard_negatives, 'hard negative')} each), got "
                             f"{rows[1]}")
        if loss_inputs and (np.shape(loss_inputs[0]) != (rows[1],)
                            or not np.issubdtype(np.result_type(loss_inputs[0]), np.integer)):
            raise DprGcError(f"{where}: passage_ids must hold one integer id per passage row of the global batch "
                             f"({rows[1]}), got shape {np.shape(loss_inputs[0])} of {np.result_type(loss_inputs[0])}")


def _rows(batch: Any, what: str, where: str) -> int:
    """The leading size every leaf of a global batch shares."""
    sizes = sorted({np.shape(leaf)[0] if np.ndim(leaf) else 0 for leaf in jax.tree_util.tree_leaves(batch)})
    if len(sizes) != 1:
        raise DprGcError(f"{where}: every leaf of global {what} must have the same number of rows; got {sizes}")
    return sizes[0]


def check_divisible(batches: Sequence[Any], n_devices: int, what: str = "batch") -> None:
    """Refuse a global batch (or loss input) whose leading axis the ``n_devices`` devices do not split evenly."""
    for i, batch in enumerate(batches):
        sizes = sorted({np.shape(leaf)[0] if np.ndim(leaf) else 0 for leaf in jax.tree_util.tree_leaves(batch)})
        uneven = [n for n in sizes if n % n_devices]
        if uneven:
            raise DprGcError(f"data_parallel_value_and_grad: global {what} {i} has {uneven[0]} rows, which "
                             f"{n_devices} devices do not split evenly; use a global batch that is a multiple of "
                             f"{n_devices}")
