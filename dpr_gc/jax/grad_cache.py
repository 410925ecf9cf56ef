"""Gradient Cache in JAX: the original package's functional API, working on current JAX, plus a complete step.

The original's JAX functions keep their names, arguments and meanings, so its users switch by changing the import:

* :func:`tree_chunk` / :func:`tree_unchunk` add / remove a leading chunk axis on every leaf of a batch pytree;
* :func:`chunk_encode` encodes chunked keyword inputs one chunk at a time (``lax.scan``), with no gradient kept;
* :func:`grad_with_cache` is the gradient of ``sum(f(params, ...) * cache)``, i.e. one chunk's VJP with the cached
  d loss / d representation;
* :func:`cache_grad` scans the chunks, adding every chunk's cached-gradient VJP into an accumulator;
* :func:`unchunk_args` decorates a loss so chosen positional arguments arrive without the chunk axis;
* :func:`grad_cached` is the single-decorator form: ``jax.checkpoint`` around each chunk of a ``lax.scan`` lets XLA
  derive the backward pass, rematerialising one chunk at a time.

:func:`cached_value_and_grad` puts the two passes together for any number of encoders with per-chunk dropout keys,
batches that the chunk does not divide, a learnable loss parameter and data parallelism (see :mod:`.parallel`).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..base.errors import DprGcError

Array = jax.Array
Encoder = Callable[[Any, Any, Array], Array]


def _leading_size(tree: Any, axis: int = 0) -> int:
    sizes = {leaf.shape[axis] for leaf in jax.tree_util.tree_leaves(tree)}
    if len(sizes) != 1:
        raise DprGcError(f"every leaf of a batch must have the same size along axis {axis}; got sizes {sorted(sizes)}")
    return sizes.pop()


def _check_positive(name: str, value: Any) -> None:
    """Refuse a count that is not a positive integer (a float, a bool, 0) in one line naming the argument."""
    if not is_integer(value) or value < 1:
        raise DprGcError(f"{name} must be a positive integer, got {value!r}")


def tree_chunk(tree: Any, n_chunk: int, axis: int = 0) -> Any:
    """Split axis ``axis`` of every leaf into ``(n_chunk, size // n_chunk)``; the size must divide evenly."""
    _check_positive("n_chunk", n_chunk)
    size = _leading_size(tree, axis)
    if size % n_chunk:
        raise DprGcError(f"cannot split a batch of {size} into {n_chunk} equal chunks; pick a number of chunks that "
                         "divides the batch, or pad it with pad_to_multiple (cached_value_and_grad pads for you)")
    return jax.tree_util.tree_map(lambda v: v.reshape(v.shape[:axis] + (n_chunk, size // n_chunk) + v.shape[axis + 1:]),
                                  tree)


def tree_unchunk(tree: Any, axis: int = 0) -> Any:
    """Merge the chunk axis ``axis`` and the one after it back into one batch axis."""
    return jax.tree_util.tree_map(lambda v: v.reshape(v.shape[:axis] + (-1,) + v.shape[axis + 2:]), tree)


def pad_to_multiple(tree: Any, multiple: int) -> tuple[Any, int]:
    """Pad the leading axis of every leaf up to a multiple of ``multiple`` by repeating the last row.

    Returns the padded tree and the real size. Repeated rows are valid inputs (no empty attention mask, no division
    by zero in pooling); callers drop their representations before the loss, so they receive exactly zero gradient.
    """
    _check_positive("multiple", multiple)
    size = _leading_size(tree)
    extra = -size % multiple
    if extra == 0:
        return tree, size
    return jax.tree_util.tree_map(lambda v: jnp.concatenate([v, jnp.repeat(v[-1:], extra, axis=0)]), tree), size


def grad_with_cache(f: Callable[..., Array], **grad_kwargs: Any) -> Callable[..., Any]:
    """``jax.grad`` of ``sum(f(params, *args, **kwargs) * cache)`` taking ``(params, cache, *args, **kwargs)``.

    With ``cache`` = d loss / d representations this is the chunk's share of d loss / d params. The product is
    taken in fp32 whatever the representations' dtype.
    """
    def dot_with_cache(params: Any, cache: Array, *args: Any, **kwargs: Any) -> Array:
        reps = f(params, *args, **kwargs)
        return jnp.sum(reps.astype(jnp.float32) * cache.astype(jnp.float32))

    return jax.grad(dot_with_cache, **grad_kwargs)


def chunk_encode(encode_fn: Callable[..., Array]) -> Callable[..., Array]:
    """Turn ``encode_fn(**inputs)`` into a function of chunked keyword inputs returning ``[n_chunk, chunk, ...]``
    representations, computed one chunk at a time by ``lax.scan``."""
    def encode_chunks(**chunked: Any) -> Array:
        def one_chunk(carry: None, inputs: dict) -> tuple[None, Array]:
            return carry, encode_fn(**inputs)

        return jax.lax.scan(one_chunk, None, chunked)[1]

    return encode_chunks


def cache_grad(encode_fn: Callable[..., Array]) -> Callable[..., Any]:
    """Turn ``encode_fn(params=..., **inputs)`` into ``f(params, grad_accumulator, cached_grad, **chunked)``, which
    adds every chunk's gradient (its VJP with its slice of ``cached_grad``, ``[n_chunk, chunk, ...]``) to
    ``grad_accumulator`` and returns the sum."""
    def chunk_grad(params: Any, cache: Array, inputs: dict) -> Any:
        return grad_with_cache(lambda p: encode_fn(params=p, **inputs))(params, cache)

    def accumulate(params: Any, grad_accumulator: Any, cached_grad: Array, **chunked: Any) -> Any:
        def step(acc: Any, xs: tuple[Array, dict]) -> tuple[Any, None]:
            grads = chunk_grad(params, *xs)
            return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads), None

        return jax.lax.scan(step, grad_accumulator, (cached_grad, chunked))[0]

    return accumulate


def unchunk_args(axis: int = 0, argnums: Iterable[int] = ()) -> Callable[[Callable], Callable]:
    """Decorator: the positional arguments ``argnums`` are passed through :func:`tree_unchunk` first."""
    argnums = tuple(argnums)

    def decorate(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            args = tuple(tree_unchunk(a, axis) if i in argnums else a for i, a in enumerate(args))
            return f(*args, **kwargs)

        return wrapped

    return decorate


def grad_cached(f: Callable[[Any, Any], Array],
                policy: Callable[..., bool] = jax.checkpoint_policies.nothing_saveable,
                prevent_cse: bool = True) -> Callable[[Any, Any], Array]:
    """Single-decorator Gradient Cache: ``f(params, batch) -> reps`` becomes a function of a chunked batch (leading
    chunk axis, e.g. from :func:`tree_chunk`) returning the whole batch's representations.

    The forward runs the chunks in a ``lax.scan`` under ``jax.checkpoint(policy)``, so no chunk's activations are
    kept; ``jax.grad`` through it makes XLA replay one chunk at a time in the backward pass, and the result is the
    full-batch gradient. Per-chunk dropout keys belong in the batch (e.g. ``jax.random.split(key, n_chunk)``), so the
    replay sees the same key as the forward.
    """
    def cached_f(params: Any, batch: Any) -> Array:
        def one_chunk(carry: None, chunk: Any) -> tuple[None, Array]:
            return carry, f(params, chunk)

        reps = jax.lax.scan(jax.checkpoint(one_chunk, policy=policy, prevent_cse=prevent_cse), None, batch)[1]
        return reps.reshape((-1,) + reps.shape[2:])

    return cached_f


def is_integer(value: Any) -> bool:
    """An integer of any kind (``int``, ``np.int64`` ...), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _as_sizes(chunk_sizes: int | Sequence[int], n: int) -> list[int]:
    """One positive chunk size per encoder, from one integer (numpy's included) or a sequence of them."""
    if is_integer(chunk_sizes):
        sizes = [chunk_sizes] * n
    elif isinstance(chunk_sizes, (Sequence, np.ndarray)) and not isinstance(chunk_sizes, str) \
            and np.ndim(chunk_sizes) == 1:
        sizes = list(chunk_sizes)
    else:
        sizes = []
    if len(sizes) != n or any(not is_integer(s) or s < 1 for s in sizes):
        raise DprGcError(f"chunk sizes must be one positive integer or one per encoder ({n}); got {chunk_sizes!r}")
    return [operator.index(s) for s in sizes]


def _check_inputs(batches: Sequence[Any], n_encoders: int, key: Any) -> None:
    """One non-empty batch per encoder (an empty one has nothing to encode, and no loss to average), and a key."""
    _check_key(key)
    if len(batches) != n_encoders:
        raise DprGcError(f"{n_encoders} encoders need {n_encoders} batches, got {len(batches)}")
    for i, batch in enumerate(batches):
        if _leading_size(batch) == 0:
            raise DprGcError(f"batch {i} is empty (0 rows): every encoder needs at least one row to encode")


def _check_key(key: Any) -> None:
    """A step's ``key`` is a PRNG key or None (no encoder draws dropout); anything else is named, not split."""
    if key is not None and not isinstance(key, (jax.Array, np.ndarray)):
        raise DprGcError(f"key must be a PRNG key (e.g. jax.random.key(0)) or None when no encoder draws dropout; "
                         f"got {type(key).__name__}")


def _split_key(key: Optional[Array], n: int) -> Any:
    """``n`` keys from ``key``, or ``n`` Nones when there is no key."""
    return [None] * n if key is None else jax.random.split(key, n)


def _chunked(batch: Any, chunk_size: int, key: Optional[Array]) -> tuple[Any, Optional[Array], int]:
    """Pad ``batch`` to a multiple of the chunk, add the chunk axis, and draw one dropout key per chunk (None
    without a key). A chunk larger than the batch is the batch: one chunk, no padding rows to encode."""
    padded, size = pad_to_multiple(batch, min(chunk_size, _leading_size(batch)))
    chunk_size = min(chunk_size, size)
    n_chunk = _leading_size(padded) // chunk_size
    return tree_chunk(padded, n_chunk), None if key is None else jax.random.split(key, n_chunk), size


def _encode_no_grad(encoder: Encoder, params: Any, chunks: Any, keys: Optional[Array], size: int) -> Array:
    def one_chunk(carry: None, xs: tuple[Any, Array]) -> tuple[None, Array]:
        return carry, jax.lax.stop_gradient(encoder(params, *xs))

    reps = jax.lax.scan(one_chunk, None, (chunks, keys))[1]
    return reps.reshape((-1,) + reps.shape[2:])[:size]


def _accumulate(encoder: Encoder, params: Any, acc: Any, chunks: Any, keys: Optional[Array], rep_grad: Array) -> Any:
    n_chunk = jax.tree_util.tree_leaves(chunks)[0].shape[0]
    padded = jnp.zeros((math.prod(jax.tree_util.tree_leaves(chunks)[0].shape[:2]),) + rep_grad.shape[1:],
                       jnp.float32).at[:rep_grad.shape[0]].set(rep_grad)
    cache = padded.reshape((n_chunk, -1) + rep_grad.shape[1:])
    chunk_grad = grad_with_cache(lambda p, chunk, key: encoder(p, chunk, key))

    def step(carry: Any, xs: tuple[Any, Optional[Array], Array]) -> tuple[Any, None]:
        chunk, key, cached = xs
        grads = chunk_grad(params, cached, chunk, key)
        return jax.tree_util.tree_map(lambda a, g: a + g.astype(jnp.float32), carry, grads), None

    return jax.lax.scan(step, acc, (chunks, keys, cache))[0]


def cached_value_and_grad(encoders: Sequence[Encoder], loss_fn: Callable[..., Array],
                          chunk_sizes: int | Sequence[int], axis_name: Optional[str] = None) -> Callable[..., Any]:
    """Gradient Cache step for several encoders: returns ``f(params, loss_params, batches, key, *loss_inputs) ->
    (loss, (grads, loss_grads))`` with the gradients of ``loss_fn(loss_params, *[enc(params, batch) for ...],
    *loss_inputs)`` over whole batches (``loss_inputs``: e.g. :class:`ContrastiveLoss`'s ``passage_ids``).

    Each encoder sees the whole ``params`` tree (tied towers share a subtree) and a dropout key. A batch is padded to
    a multiple of its chunk size (the padding's representations dropped before the loss); each chunk's key is used
    in the no-gradient pass and in the replay, so the gradient is exact with dropout on. Pass 1 encodes every chunk
    without a graph; the loss and its gradient to all representations are computed once (fp32); pass 2 replays one
    chunk at a time, accumulating its VJP with the cached gradient in fp32 (returned in the parameters' dtypes):
    memory is one chunk plus the representations. With ``axis_name`` it runs per device inside ``shard_map`` and
    averages loss and gradients over that axis (:mod:`.parallel`).

    Args:
        encoders: one ``f(params, batch, key) -> reps [rows, D]`` per batch (e.g. :func:`encoder_fn`).
        loss_fn: ``loss_fn(loss_params, *reps) -> scalar`` (e.g. :class:`ContrastiveLoss`).
        chunk_sizes: rows per chunk, one int or one per encoder (one larger than its batch is the batch).
        axis_name: the ``shard_map`` axis to average over (None: one device).

    Returns:
        That step (jit-compatible): ``batches`` one pytree per encoder (rows first), ``key`` a PRNG key or None (each
        encoder then gets None, as an ``encoder_fn(model, train=False)`` takes), ``loss_inputs`` the other loss inputs.

    References: Gao et al. 2021; luyug/GradCache's JAX ``cachex`` (:func:`chunk_encode`, :func:`cache_grad`).

    Example (a linear encoder shared by queries and passages; the whole batch's gradient, chunk by chunk):
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from dpr_gc.jax import ContrastiveLoss, cached_value_and_grad
        >>> def encode(params, batch, key):                  # an Encoder's encoder_fn(model) has this signature
        ...     return batch @ params["w"]
        >>> params = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
        >>> queries = jax.random.normal(jax.random.key(1), (6, 8))
        >>> passages = jax.random.normal(jax.random.key(2), (12, 8))  # a positive and a hard negative per query
        >>> loss = ContrastiveLoss(n_hard_negatives=1, learn_temperature=True)
        >>> step = jax.jit(cached_value_and_grad([encode, encode], loss, chunk_sizes=2))
        >>> value, (grads, loss_grads) = step(params, loss.init(), [queries, passages], jax.random.key(3))
        >>> full = jax.grad(lambda p: loss(loss.init(), encode(p, queries, None), encode(p, passages, None)))(params)
        >>> bool(jnp.allclose(grads["w"], full["w"], atol=1e-6)), sorted(loss_grads)
        (True, ['log_temperature'])
    """
    sizes = _as_sizes(chunk_sizes, len(encoders))

    def value_and_grad(params: Any, loss_params: Any, batches: Sequence[Any], key: Array,
                       *loss_inputs: Any) -> tuple[Array, Any]:
        _check_inputs(batches, len(encoders), key)
        parts = [_chunked(b, s, k) for b, s, k in zip(batches, sizes, _split_key(key, len(encoders)))]
        reps = [_encode_no_grad(enc, params, *part) for enc, part in zip(encoders, parts)]
        loss, (loss_grads, rep_grads) = jax.value_and_grad(lambda lp, rs: loss_fn(lp, *rs, *loss_inputs),
                                                           argnums=(0, 1))(loss_params, reps)
        acc = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        for enc, (chunks, keys, _), rep_grad in zip(encoders, parts, rep_grads):
            acc = _accumulate(enc, params, acc, chunks, keys, rep_grad)
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), acc, params)
        if axis_name is not None:
            loss, grads, loss_grads = jax.lax.pmean((loss, grads, loss_grads), axis_name)
        return loss, (grads, loss_grads)

    return value_and_grad


def remat_value_and_grad(encoders: Sequence[Encoder], loss_fn: Callable[..., Array],
                         chunk_sizes: int | Sequence[int], axis_name: Optional[str] = None) -> Callable[..., Any]:
    """The same step as :func:`cached_value_and_grad` (same arguments, ``loss_inputs`` too, padding and per-chunk
    keys, so the same numbers) built on :func:`grad_cached`: XLA derives the backward pass and rematerialises each
    chunk."""
    sizes = _as_sizes(chunk_sizes, len(encoders))

    def total_loss(params: Any, loss_params: Any, batches: Sequence[Any], key: Array, *loss_inputs: Any) -> Array:
        reps = []
        for enc, batch, size, k in zip(encoders, batches, sizes, _split_key(key, len(encoders))):
            chunks, keys, real = _chunked(batch, size, k)
            encode = grad_cached(lambda p, xs, enc=enc: enc(p, *xs))
            reps.append(encode(params, (chunks, keys))[:real])
        return loss_fn(loss_params, *reps, *loss_inputs)

    def value_and_grad(params: Any, loss_params: Any, batches: Sequence[Any], key: Array,
                       *loss_inputs: Any) -> tuple[Array, Any]:
        _check_inputs(batches, len(encoders), key)
        loss, (grads, loss_grads) = jax.value_and_grad(total_loss, argnums=(0, 1))(params, loss_params, batches, key,
                                                                                   *loss_inputs)
        if axis_name is not None:
            loss, grads, loss_grads = jax.lax.pmean((loss, grads, loss_grads), axis_name)
        return loss, (grads, loss_grads)

    return value_and_grad


def cache_train_step(loss_fn: Callable[..., Array], state: Any, ss: dict, tt: dict, axis: str = "device") -> Any:
    """The original's ``cache_train_step`` for a Flax ``TrainState`` under ``pmap``/``shard_map`` over ``axis``:
    chunked keyword batches ``ss`` (queries) and ``tt`` (passages) share ``state.apply_fn``; ``loss_fn(xx, yy,
    axis=axis)`` returns per-query losses. Returns ``(loss, new_state)`` with loss and gradients averaged over
    ``axis``."""
    def encode(params: Any, **inputs: Any) -> Array:
        return state.apply_fn(params=params, **inputs)

    s_reps = chunk_encode(functools.partial(encode, state.params))(**ss)
    t_reps = chunk_encode(functools.partial(encode, state.params))(**tt)

    @unchunk_args(axis=0, argnums=(0, 1))
    def mean_loss(xx: Array, yy: Array) -> Array:
        return jnp.mean(loss_fn(xx, yy, axis=axis))

    loss, (s_grad, t_grad) = jax.value_and_grad(mean_loss, argnums=(0, 1))(s_reps, t_reps)
    accumulate = cache_grad(encode)
    grads = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    grads = accumulate(state.params, accumulate(state.params, grads, s_grad, **ss), t_grad, **tt)
    loss, grads = jax.lax.pmean((loss, grads), axis)
    return loss, state.apply_gradients(grads=grads)
