"""Training a retriever: the grouped settings, the trainer, its checkpoints and dev validation.

The trainer wires data (:mod:`dpr_gc.data`), the retriever (:mod:`dpr_gc.model`) and the cached step
(:mod:`dpr_gc.engine`) together; nothing below imports it.
"""
