"""What a training run starts from: its sources checked before anything is built, and the retriever it trains."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..base.errors import DprGcError
from ..model.dpr_hub import find_dpr_pair
from ..model.retriever import Retriever, RetrieverConfig
from .config import DataConfig, ModelConfig

logger = logging.getLogger(__name__)


def check_sources(data: DataConfig, output: str) -> None:
    """Refuse a missing training or dev source, or no output folder, before anything is built."""
    if not data.train_files or not output:
        raise DprGcError("training needs training data (--train) and an output folder (--output)")
    for source in data.train_files + ([data.dev_file] if data.dev_file else []):
        if not Path(source).exists():
            raise DprGcError(f"training data not found: {source} (give DPR files or BEIR folders)")


def build_retriever(model: ModelConfig) -> Retriever:
    """A saved retriever folder, an official DPR pair or a DPR ``.cp`` file loads as it is (prefixes given as flags
    replace its own); any other model name or folder starts a new one from ``model.retriever``."""
    name = model.path()
    if (Path(name) / "retriever_config.json").is_file() or Path(name).is_file() or find_dpr_pair(Path(name)):
        retriever = Retriever.load(name, query_prefix=model.query_prefix, passage_prefix=model.passage_prefix)
        if model.retriever is not None:
            logger.info("%s is a saved retriever: its own pooling/temperature/lengths are used", name)
        return retriever
    prefixes = {k: v for k, v in (("query_prefix", model.query_prefix), ("passage_prefix", model.passage_prefix))
                if v is not None}
    return Retriever.from_pretrained(name, dataclasses.replace(model.retriever or RetrieverConfig(), **prefixes))
