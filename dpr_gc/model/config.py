"""How a retriever turns text into vectors: :class:`RetrieverConfig`, the recipe every saved folder records.

The bottom of :mod:`dpr_gc.model`: the loaders of every folder and checkpoint format build their recipe from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from ..base.errors import DprGcError
from ..engine.loss import TEMPERATURE_RANGE

POOLINGS = ("cls", "mean", "pooler", "last")
PASSAGE_FORMATS = ("pair", "concat")


@dataclasses.dataclass
class RetrieverConfig:
    """How text becomes a vector and how vectors are scored.

    ``passage_format="pair"`` encodes ``[CLS] title [SEP] text [SEP]`` (``[CLS] text [SEP]`` for an untitled
    passage, decided per passage) as DPR does; ``"concat"`` encodes
    ``title + " " + text`` as BEIR / sentence-transformers do. A learnable temperature lives in the model (so DDP
    averages its gradient like any weight) and is clamped to ``TEMPERATURE_RANGE``.
    """

    pooling: str = "cls"
    normalize: bool = False
    projection_dim: Optional[int] = None
    shared_encoder: bool = True
    query_max_length: int = 32
    passage_max_length: int = 256
    temperature: float = 1.0
    learn_temperature: bool = False
    passage_format: str = "pair"
    query_prefix: str = ""
    passage_prefix: str = ""

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise DprGcError(f"--pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.passage_format not in PASSAGE_FORMATS:
            raise DprGcError(f"--passage-format must be one of {', '.join(PASSAGE_FORMATS)}, got {self.passage_format!r}")
        lo, hi = TEMPERATURE_RANGE
        if not lo <= self.temperature <= hi:
            raise DprGcError(f"--temperature must lie in [{lo}, {hi}], got {self.temperature}")
        if self.query_max_length <= 0 or self.passage_max_length <= 0:
            raise DprGcError("--query-max-length and --passage-max-length must be positive")
        if self.projection_dim is not None and self.projection_dim < 1:
            raise DprGcError(f"--projection-dim must be a positive integer (or left out), got {self.projection_dim}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RetrieverConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
