"""How a retriever turns text into vectors: :class:`RetrieverConfig`, the recipe every saved folder records.

The bottom of :mod:`dpr_gc.model`: the loaders of every folder and checkpoint format build their recipe from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from ..base.args import layer_size, positive_float, positive_int
from ..base.errors import DprGcError
from ..base.settings import check, setting
from ..engine.loss import TEMPERATURE_RANGE

POOLINGS = ("cls", "mean", "pooler", "last")
PASSAGE_FORMATS = ("pair", "concat")
# transformers model types of decoder-only language models, whose causal attention lets a token see only those
# before it: the first token (cls pooling) sees nothing of the text, so they take last-token pooling. Any other type
# with a causal LM class of transformers and no masked LM one counts too (:func:`is_causal_decoder`).
DECODER_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                 "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "opt", "olmo", "olmo2", "stablelm")
# types with a causal LM class whose base model attends both ways unless configured ``is_decoder``
BIDIRECTIONAL_TYPES = ("bert-generation",)
# what a decoder-only model starts with when the user sets neither (docs/distributed.md's LLM recipe)
DECODER_RECIPE = {"pooling": "last", "passage_format": "concat"}


def is_causal_decoder(model_config: Any) -> bool:
    """Whether a transformers model config describes causal attention, so the first token sees none of the text:
    an encoder configured as a decoder (``is_decoder``), or a decoder-only model (not an encoder-decoder) whose type
    is in :data:`DECODER_TYPES` or has a causal LM class in transformers but no masked LM one, or whose unknown
    type names ``architectures`` ending in ``ForCausalLM``. Encoders with a causal LM head class (BERT, RoBERTa,
    BART) are not decoders."""
    if getattr(model_config, "is_decoder", False) is True:
        return True
    if getattr(model_config, "is_encoder_decoder", False) is True:
        return False
    model_type = getattr(model_config, "model_type", None)
    if model_type in DECODER_TYPES:
        return True
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in BIDIRECTIONAL_TYPES:
        return False
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return True
    architectures = getattr(model_config, "architectures", None) or ()
    return any(str(a).endswith("ForCausalLM") for a in architectures)


@dataclasses.dataclass
class RetrieverConfig:
    """How text becomes a vector and how vectors are scored.

    ``passage_format="pair"`` encodes ``[CLS] title [SEP] text [SEP]`` (``[CLS] text [SEP]`` for an untitled
    passage, decided per passage) as DPR does; ``"concat"`` encodes
    ``title + " " + text`` as BEIR / sentence-transformers do. A learnable temperature lives in the model (so DDP
    averages its gradient like any weight) and is clamped to ``TEMPERATURE_RANGE``. Each field's help below says
    what it means (``dpr-gc train --help`` shows those that are flags); bad values are refused when it is built.
    """

    pooling: str = setting("cls", "--pooling", choices=POOLINGS,
                           help="token states to one vector: cls, mean, pooler, or last (the last non-padding "
                                "token's state, for decoder-only models; EOS appended when absent); a plain "
                                "decoder-only model (Llama, Qwen2) refuses cls and pooler, and takes last unless "
                                "given")
    normalize: bool = setting(False, "--normalize", help="L2-normalise representations (cosine similarity)")
    projection_dim: Optional[int] = setting(None, "--projection-dim", type=layer_size,
                                            help="add a linear projection to this many dimensions, at most 65536 "
                                                 "(default: none, the model's hidden size)")
    shared_encoder: bool = setting(True, "--separate-encoders", dest="separate_encoders", negate=True,
                                   help="two towers (query and passage) instead of one shared")
    query_max_length: int = setting(32, "--query-max-length", "--query_max_length", type=positive_int,
                                    help="query max tokens (longer queries are cut)")
    passage_max_length: int = setting(256, "--passage-max-length", "--sequence_length", type=positive_int,
                                      help="passage max tokens, title included (longer passages are cut)")
    temperature: float = setting(1.0, "--temperature", type=positive_float,
                                 help="scores are divided by it before the softmax")
    learn_temperature: bool = setting(False, "--learn-temperature",
                                      help="learn the temperature (starting from --temperature) with the weights")
    passage_format: str = setting("pair", "--passage-format", choices=PASSAGE_FORMATS,
                                  help="pair: [CLS] title [SEP] text [SEP] as DPR; concat: 'title text' as BEIR and "
                                       "sentence-transformers (a plain decoder-only model takes concat unless given)")
    query_prefix: str = setting("", help="text put before every query (the model's own)")
    passage_prefix: str = setting("", help="text put before every passage (the model's own)")

    def __post_init__(self) -> None:
        check(self)
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
