"""Contrastive losses in JAX: in-batch negatives plus hard negatives, computed in fp32 whatever the input dtype.

Layout as in :mod:`dpr_gc.engine.loss`: ``queries`` holds B representations, ``passages`` B·(1+n) grouped per query with
the positive first, and every query is scored against every passage of the (global) batch. Scores are computed in row
blocks of about a million scores under ``jax.checkpoint`` (one block when the whole B × B·(1+n) matrix is smaller), so
neither the forward nor the backward pass holds more than one block; that keeps a Gradient Cache step's memory flat in
the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ..base.errors import DprGcError
from ..base.logs import counted
from ..engine.arguments import as_number, check_bool
from .grad_cache import is_integer

Array = jax.Array
TEMPERATURE_RANGE = (0.01, 10.0)  # the same clamp as dpr_gc.engine.loss, so bf16 training cannot blow the scores up
_AUTO_BLOCK_ELEMENTS = 1 << 20
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's eps


def _block_nll(x: Array, y: Array, scale: Array, targets: Array, row_keys: Optional[Array] = None,
               col_keys: Optional[Array] = None) -> Array:
    """Per-row ``-log softmax(scale * x y^T)[target]`` for one block of rows; with keys, a row's scores of the
    columns sharing its key (``>= 0``) are left out of the softmax, its target's excepted (torch's ``Exclusion``)."""
    scores = (x @ y.T) * scale
    target_scores = jnp.take_along_axis(scores, targets[:, None], axis=1)[:, 0]
    if row_keys is not None:
        drop = (row_keys[:, None] == col_keys[None, :]) & (row_keys[:, None] >= 0)
        drop &= jnp.arange(y.shape[0])[None, :] != targets[:, None]
        scores = jnp.where(drop, -jnp.inf, scores)
    return jax.nn.logsumexp(scores, axis=1) - target_scores


def blocked_nll(x: Array, y: Array, scale: Array, targets: Array, block: Optional[int] = None,
                row_keys: Optional[Array] = None, col_keys: Optional[Array] = None) -> Array:
    """Per-row InfoNCE losses of ``x`` over ``y`` (fp32), ``block`` rows at a time; ``block=0`` is the dense path.

    ``row_keys`` ``[len(x)]`` and ``col_keys`` ``[len(y)]`` (integers, ``-1`` for none) drop, per row, the columns
    holding its key other than its target, as torch's ``Exclusion`` does. Rows are padded to a multiple of the block
    with zero queries whose losses are dropped, so any batch size works.
    """
    x, y, scale = x.astype(jnp.float32), y.astype(jnp.float32), jnp.asarray(scale, jnp.float32)
    rows = x.shape[0]
    if block is None:
        block = max(1, min(rows, _AUTO_BLOCK_ELEMENTS // max(1, y.shape[0])))
    if block == 0 or block >= rows:
        return _block_nll(x, y, scale, targets, row_keys, col_keys)
    n_block = math.ceil(rows / block)
    pad = n_block * block - rows
    xb = jnp.pad(x, ((0, pad), (0, 0))).reshape(n_block, block, -1)
    tb = jnp.pad(targets, (0, pad)).reshape(n_block, block)
    if row_keys is None:
        one_block = jax.checkpoint(lambda xs: _block_nll(xs[0], y, scale, xs[1]))
        return jax.lax.map(one_block, (xb, tb)).reshape(-1)[:rows]
    kb = jnp.pad(row_keys, (0, pad), constant_values=-1).reshape(n_block, block)
    one_block = jax.checkpoint(lambda xs: _block_nll(xs[0], y, scale, xs[1], xs[2], col_keys))
    return jax.lax.map(one_block, (xb, tb, kb)).reshape(-1)[:rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _inward_clip(value: Array, lo: float, hi: float) -> Array:
    """Clip whose gradient is kept wherever a descent step would move the value back into ``[lo, hi]`` (a plain
    clip's is 0 past a bound, so a value there could never come back), as the torch twin's ``_InwardClamp``."""
    return jnp.clip(value, lo, hi)


def _inward_clip_fwd(value: Array, lo: float, hi: float) -> tuple[Array, Array]:
    return jnp.clip(value, lo, hi), value


def _inward_clip_bwd(lo: float, hi: float, value: Array, grad: Array) -> tuple[Array]:
    outward = ((value < lo) & (grad > 0)) | ((value > hi) & (grad < 0))
    return (jnp.where(outward, jnp.zeros_like(grad), grad),)


_inward_clip.defvjp(_inward_clip_fwd, _inward_clip_bwd)


def temperature_from_log(log_temperature: Array) -> Array:
    """A learnable temperature stored on the log scale, clamped to ``TEMPERATURE_RANGE`` in every use; past a bound
    its gradient is kept where descent brings it back (see :func:`_inward_clip`)."""
    lo, hi = TEMPERATURE_RANGE
    return jnp.exp(_inward_clip(jnp.asarray(log_temperature, jnp.float32), math.log(lo), math.log(hi)))


def _describe(loss_params: Any) -> str:
    """Short words for what was passed as the loss's parameters (keys, not values: they may be traced)."""
    if isinstance(loss_params, Mapping):
        return f"a dict with keys {sorted(map(str, loss_params))}" if loss_params else "an empty dict"
    return type(loss_params).__name__


@dataclasses.dataclass(frozen=True)
class ContrastiveLoss:
    """In-batch-negative InfoNCE loss, the JAX twin of :class:`dpr_gc.engine.loss.SimpleContrastiveLoss`.

    ``loss(loss_params, queries, passages)`` returns the mean loss (fp32). ``loss_params`` comes from :meth:`init`:
    ``{"log_temperature": ...}`` when the temperature is learnable, else ``{}``. ``similarity`` is ``"dot"`` or
    ``"cos"``; ``symmetric`` adds the passage→query direction and averages the two; ``block`` is the number of score
    rows per block (``None``: about 1M scores; ``0``: dense). With ``axis_name`` (inside ``shard_map``/``pmap``) the
    representations of all devices are all-gathered so every local query is scored against the global batch;
    the loss is the mean over this device's queries (see :mod:`dpr_gc.jax.parallel` for the gradient rule).

    Inputs: ``queries`` ``[B, D]`` and ``passages`` ``[B·(1+n), D]`` (grouped per query, positive first), any float
    dtype. Returns a 0-dim fp32 array, differentiable in ``loss_params`` and both inputs.

    Duplicate positives: ``loss(loss_params, queries, passages, passage_ids)`` with ``passage_ids`` (one integer per
    passage row, equal for the same passage, ``-1`` when unknown; int32 under JAX's default precision) drops, for
    every query, each other row holding the passage of its positive (another query's positive, a hard negative),
    and in the symmetric direction every other query whose positive is that passage: the torch loss's
    ``passage_ids`` masking, the ids gathered over ``axis_name`` with the passages
    (``test_passage_ids_mask_duplicate_positives_as_the_torch_loss``). The Gradient Cache steps pass extra
    arguments after ``key`` on to the loss: ``step(params, loss_params, batches, key, passage_ids)``.

    References: Gao et al. 2021 (Gradient Cache; luyug/GradCache's JAX ``cachex`` has no loss class, this is the
    torch package's loss in JAX); Karpukhin et al. 2020 (DPR's in-batch negatives).

    Example (the same number as the torch loss):
        >>> import jax
        >>> import numpy as np
        >>> import torch
        >>> from dpr_gc import SimpleContrastiveLoss
        >>> from dpr_gc.jax import ContrastiveLoss
        >>> loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.05, learn_temperature=True, similarity="cos")
        >>> queries = jax.random.normal(jax.random.key(0), (4, 8))
        >>> passages = jax.random.normal(jax.random.key(1), (8, 8))   # per query: its positive, a hard negative
        >>> value, grads = jax.value_and_grad(loss)(loss.init(), queries, passages)
        >>> value.shape, value.dtype, sorted(grads)
        ((), dtype('float32'), ['log_temperature'])
        >>> twin = SimpleContrastiveLoss(1, temperature=0.05, similarity="cos")
        >>> expected = twin(torch.tensor(np.asarray(queries)), torch.tensor(np.asarray(passages)))
        >>> bool(np.isclose(value, expected.item(), rtol=1e-5))
        True
    """

    n_hard_negatives: int = 0
    temperature: float = 1.0
    learn_temperature: bool = False
    similarity: str = "dot"
    symmetric: bool = False
    block: Optional[int] = None
    axis_name: Optional[str] = None

    def __post_init__(self) -> None:
        """Refuse what the torch twin refuses, in the same words: a switch that is not True or False (``"no"``
        would switch it on), a temperature that is not a number in ``TEMPERATURE_RANGE``, a bad block or count."""
        check_bool("learn_temperature", self.learn_temperature)
        check_bool("symmetric", self.symmetric)
        as_number("temperature", self.temperature, *TEMPERATURE_RANGE)
        if self.similarity not in ("dot", "cos"):
            raise DprGcError(f"similarity must be 'dot' or 'cos', got {self.similarity!r}")
        if not is_integer(self.n_hard_negatives) or self.n_hard_negatives < 0:
            raise DprGcError(f"n_hard_negatives must be an integer >= 0, got {self.n_hard_negatives!r}")
        if self.block is not None and (not is_integer(self.block) or self.block < 0):
            raise DprGcError(f"block must be a positive number of score rows per block, 0 for the dense score matrix, "
                             f"or None for automatic blocks; got {self.block!r}")

    def init(self) -> dict[str, Array]:
        """The loss's trainable parameters (fp32 even when the encoders are bf16)."""
        if not self.learn_temperature:
            return {}
        return {"log_temperature": jnp.asarray(math.log(self.temperature), jnp.float32)}

    def current_temperature(self, loss_params: dict[str, Array]) -> Array:
        """The temperature in use: the learnt one (clamped) from ``loss_params``, or the fixed one."""
        if self.learn_temperature:
            if not isinstance(loss_params, Mapping) or "log_temperature" not in loss_params:
                raise DprGcError("ContrastiveLoss(learn_temperature=True) needs its parameters: pass the params from "
                                 f"loss.init() (a dict with 'log_temperature'), got {_describe(loss_params)}")
            return temperature_from_log(loss_params["log_temperature"])
        return jnp.asarray(self.temperature, jnp.float32)

    def _prepare(self, reps: Array) -> Array:
        """fp32 representations, L2-normalised for ``"cos"`` as torch's ``F.normalize`` (``x / max(|x|, 1e-12)``).

        The norm is taken as ``sqrt(max(|x|^2, 1e-24))``: the same value, but its gradient is 0 below the floor
        (``F.normalize``'s), where ``jnp.linalg.norm``'s gradient at a zero row is NaN and spreads to every
        parameter (``test_a_zero_representation_keeps_cosine_gradients_finite_as_in_torch``)."""
        reps = reps.astype(jnp.float32)
        if self.similarity == "cos":
            squares = jnp.sum(reps * reps, axis=-1, keepdims=True)
            reps = reps / jnp.sqrt(jnp.maximum(squares, _NORM_EPS * _NORM_EPS))
        return reps

    def _check(self, queries: Array, passages: Array, passage_ids: Optional[Array]) -> None:
        group = 1 + self.n_hard_negatives
        if queries.ndim != 2 or passages.ndim != 2 or queries.shape[1] != passages.shape[1]:
            raise DprGcError(f"representations must be [B, D] and [B*(1+n), D] with equal D; got {queries.shape} "
                             f"and {passages.shape}")
        if passages.shape[0] != queries.shape[0] * group:
            raise DprGcError(f"{queries.shape[0]} queries need {queries.shape[0] * group} passages (1 positive + "
                             f"{counted(self.n_hard_negatives, 'hard negative')} each), got {passages.shape[0]}")
        if passage_ids is not None and (jnp.shape(passage_ids) != (passages.shape[0],)
                                        or not jnp.issubdtype(jnp.result_type(passage_ids), jnp.integer)):
            raise DprGcError(f"passage_ids must hold one integer id per passage row ({passages.shape[0]}), got shape "
                             f"{jnp.shape(passage_ids)} of {jnp.result_type(passage_ids)}")

    def __call__(self, loss_params: dict[str, Array], queries: Array, passages: Array,
                 passage_ids: Optional[Array] = None) -> Array:
        self._check(queries, passages, passage_ids)
        x, y = self._prepare(queries), self._prepare(passages)
        b, group = x.shape[0], 1 + self.n_hard_negatives
        offset = 0
        x_all, y_all, ids_all = x, y, passage_ids
        if self.axis_name is not None:
            offset = jax.lax.axis_index(self.axis_name) * b
            x_all = jax.lax.all_gather(x, self.axis_name, tiled=True)
            y_all = jax.lax.all_gather(y, self.axis_name, tiled=True)
            if passage_ids is not None:
                ids_all = jax.lax.all_gather(jnp.asarray(passage_ids), self.axis_name, tiled=True)
        scale = 1.0 / self.current_temperature(loss_params)
        rows = offset + jnp.arange(b)
        # With ids, a query's own positive's id is its row key and every passage's id a column key, so no copy of
        # its positive is a negative; the symmetric direction swaps them (the torch loss's two Exclusions).
        forward_keys = backward_keys = (None, None)
        if ids_all is not None:
            ids_all = jnp.asarray(ids_all)
            forward_keys = (ids_all[rows * group], ids_all)
            backward_keys = (ids_all[rows * group], ids_all[::group])
        loss = jnp.mean(blocked_nll(x, y_all, scale, rows * group, self.block, *forward_keys))
        if self.symmetric:
            loss = (loss + jnp.mean(blocked_nll(y[::group], x_all, scale, rows, self.block, *backward_keys))) / 2
        return loss

    def scores(self, loss_params: dict[str, Array], queries: Array, passages: Array) -> Array:
        """Dense fp32 score matrix ``[len(queries), len(passages)]`` (evaluation, small batches)."""
        return (self._prepare(queries) @ self._prepare(passages).T) / self.current_temperature(loss_params)

