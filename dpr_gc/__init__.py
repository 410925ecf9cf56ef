"""dpr-gc: dense passage retrieval with Gradient Cache.

The public API, importable from here:

>>> from dpr_gc import GradCache, Chunking, SimpleContrastiveLoss, DistributedContrastiveLoss  # the drop-in
>>> from dpr_gc import Retriever, RetrieverConfig  # the model
>>> from dpr_gc import Trainer, TrainConfig  # training: Trainer(TrainConfig(...)).fit()
>>> from dpr_gc import verify  # verify(config) -> report: the cached step vs the full batch
>>> from dpr_gc import encode_corpus, build_index, retrieve, evaluate, mine_hard_negatives  # the stages

Each name is imported on first use (module ``__getattr__``), so ``import dpr_gc`` loads neither torch nor any
sub-package, and a command that needs no model (``dpr-gc evaluate``) does not pay for one. ``dpr_gc.train`` is the
training sub-package; its entry point is :class:`Trainer` (or :func:`dpr_gc.train.trainer.train`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module (under dpr_gc) that defines it
_EXPORTS = {
    "GradCache": "engine.grad_cache",
    "Chunking": "engine.chunking",
    "SimpleContrastiveLoss": "engine.loss",
    "DistributedContrastiveLoss": "engine.loss",
    "Retriever": "model.retriever",
    "RetrieverConfig": "model.config",
    "TrainConfig": "train.config",
    "Trainer": "train.trainer",
    "verify": "train.verify",
    "load_training_data": "data.training",
    "load_corpus": "data.corpus",
    "read_queries": "data.corpus",
    "read_qrels": "data.qrels",
    "encode_corpus": "retrieval.encode",
    "IndexParams": "retrieval.index_params",
    "DenseIndex": "retrieval.index",
    "build_index": "retrieval.index",
    "retrieve": "retrieval.retrieve",
    "retrieve_to_files": "retrieval.retrieve",
    "mine_hard_negatives": "retrieval.mine",
    "evaluate": "evaluation.evaluate",
    "evaluate_answers": "evaluation.answers",
    "DprGcError": "base.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
