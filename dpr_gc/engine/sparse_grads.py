"""Sparse embedding gradients through a cached step: each chunk's backward adds only the rows its tokens touch.

A dense ``nn.Embedding`` backward makes a fresh vocabulary-sized gradient for every backward that reaches it and adds
it into ``.grad``: plain training once per encoder call, a cached step once per chunk. On the CPU that costs: glibc
maps a tensor above its largest mmap threshold (32 MiB; BERT's 30,522 x 384 table takes 45 MiB) afresh each time and
faults in every page. So on the devices in ``SPARSE_EMBEDDING_GRAD_DEVICES``
a cached step switches each trainable embedding to sparse gradients for its forwards and gives its weight one dense
zero ``.grad`` before the first backward: every chunk then adds only the rows its tokens touch into that tensor.
``.grad`` stays dense, as optimizers and clipping expect, and its memory stays the table's whatever the batch (an
accumulated sparse gradient would grow with the batch's tokens). Measured (benchmarks/embedding_grads.py): MiniLM at
budget 0, chunks of 8 x 128 tokens, 1.05x faster in bf16 and 1.04x in fp32, at 8-10 % less peak memory.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

# Device types whose cached steps give trainable embeddings sparse per-chunk gradients (CUDA fills a dense table in
# microseconds, and is not measured).
SPARSE_EMBEDDING_GRAD_DEVICES = ("cpu",)
# Weight dtypes switched: a sparse gradient is summed in another order than the dense one, exact to rounding in these.
EXACT_DTYPES = (torch.float32, torch.float64)


def switchable_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The embeddings of ``model`` whose gradient a cached step may keep sparse: trainable, dense so far, in an
    exact dtype, on a device listed in ``SPARSE_EMBEDDING_GRAD_DEVICES``, and with no gradient hook of the user's on
    the weight (a hook written for dense gradients, a clamp say, would get a sparse one)."""
    return [module for module in model.modules()
            if isinstance(module, nn.Embedding) and not module.sparse and module.weight.requires_grad
            and module.weight.dtype in EXACT_DTYPES and module.weight.device.type in SPARSE_EMBEDDING_GRAD_DEVICES
            and not has_gradient_hooks(module.weight)]


def has_gradient_hooks(param: torch.Tensor) -> bool:
    """Hooks registered with ``register_hook`` or ``register_post_accumulate_grad_hook``."""
    return bool(getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None))


class SparseEmbeddingGrads:
    """Context of one cached step: the embeddings of ``models`` (None: a model left as it is, e.g. a frozen or
    data-parallel one) run with ``sparse=True`` inside it and get their flag back on exit. Which of them the step's
    forwards call is recorded, so that one the model never reads keeps no ``.grad``, as in plain training."""

    def __init__(self, models: Sequence[Optional[nn.Module]]) -> None:
        found = {id(m): switchable_embeddings(m) for m in models if m is not None}  # tied towers: walked once
        self.embeddings = [found[id(model)] if model is not None else [] for model in models]
        self.called: set[int] = set()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> SparseEmbeddingGrads:
        for module in {id(m): m for embeddings in self.embeddings for m in embeddings}.values():
            module.sparse = True
            self._hooks.append(module.register_forward_pre_hook(lambda m, args: self.called.add(id(m))))
        return self

    def __exit__(self, *exc: object) -> None:
        for embeddings in self.embeddings:
            for module in embeddings:
                module.sparse = False
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.called = [], set()

    def dense_grads(self, used: Sequence[bool]) -> None:
        """Before the chunks' backward: a dense zero ``.grad`` for each switched weight of a model whose
        representation the loss used, that the forwards called and which has none yet, for every chunk's sparse
        gradient to be added into; a sparse ``.grad`` the loss's own backward left (a loss that calls the model's
        embedding) is made dense."""
        for embeddings, is_used in zip(self.embeddings, used):
            for module in embeddings:
                grad = module.weight.grad
                if grad is not None and grad.is_sparse:
                    module.weight.grad = grad.to_dense()
                elif is_used and grad is None and id(module) in self.called:
                    module.weight.grad = torch.zeros_like(module.weight)
