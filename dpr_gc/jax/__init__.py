"""Gradient Cache for JAX/Flax (``pip install -e .[jax]``): exact large-batch contrastive gradients on CPU, GPU, TPU.

The original package's JAX API under the same names (``tree_chunk``, ``tree_unchunk``, ``chunk_encode``,
``cache_grad``, ``grad_with_cache``, ``unchunk_args``, ``grad_cached``, ``cache_train_step``), the complete step
(:func:`cached_value_and_grad`, :func:`remat_value_and_grad`), fp32 contrastive losses (:class:`ContrastiveLoss`),
data parallelism with ``shard_map`` (:func:`data_parallel_value_and_grad`) and a small Flax encoder. Importing
``dpr_gc`` alone never imports JAX; only this subpackage does.
"""

from .grad_cache import (cache_grad, cache_train_step, cached_value_and_grad, chunk_encode, grad_cached,
                         grad_with_cache, pad_to_multiple, remat_value_and_grad, tree_chunk, tree_unchunk,
                         unchunk_args)
from .loss import ContrastiveLoss, blocked_nll, temperature_from_log
from .model import Encoder, EncoderConfig, cast_params, encoder_fn, load_bert
from .parallel import data_mesh, data_parallel_value_and_grad

__all__ = ["tree_chunk", "tree_unchunk", "chunk_encode", "cache_grad", "grad_with_cache", "unchunk_args",
           "grad_cached", "cache_train_step", "pad_to_multiple", "cached_value_and_grad", "remat_value_and_grad",
           "ContrastiveLoss", "blocked_nll", "temperature_from_log", "Encoder", "EncoderConfig", "encoder_fn",
           "cast_params", "load_bert", "data_mesh", "data_parallel_value_and_grad"]
