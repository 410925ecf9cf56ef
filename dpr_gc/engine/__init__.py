"""The Gradient Cache engine: the drop-in a user's own training loop imports.

:class:`~dpr_gc.engine.grad_cache.GradCache` (the three phases of a cached step), the contrastive losses, the model-input
chunking it relies on and the functional decorators. It depends on torch and :mod:`dpr_gc.base` only, so it can be
used (and read) without the retriever, data or training code above it.
"""
