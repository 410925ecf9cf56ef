"""The Gradient Cache engine: the drop-in for luyug/GradCache (Gao et al. 2021) a user's own training loop imports.

:class:`~dpr_gc.engine.grad_cache.GradCache` (the three phases of a cached step) and
:class:`~dpr_gc.engine.chunking.Chunking` (also ``from dpr_gc import ...``), the contrastive losses and
:class:`~dpr_gc.engine.loss.Temperature` in :mod:`dpr_gc.engine.loss`, and the functional decorators in
:mod:`dpr_gc.engine.functional`; each docstring has a runnable example. It depends on torch and :mod:`dpr_gc.base`
only, so it can be used (and read) without the retriever, data or training code above it.
"""
