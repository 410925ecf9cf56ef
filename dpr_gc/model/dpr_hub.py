"""The Hub's DPR models in: a transformers ``DPRQuestionEncoder`` / ``DPRContextEncoder`` pair (the layout of
``facebook/dpr-question_encoder-single-nq-base`` and ``facebook/dpr-ctx_encoder-single-nq-base``) becomes a
separate-tower retriever with DPR's pooling, so dpr-gc can evaluate and fine-tune the published DPR models.
(DPR's own ``.cp`` training checkpoints are another format.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..base.errors import DprGcError
from ..base.files import JSON_ERRORS
from ..base.logs import transformers_quiet
from .config import RetrieverConfig
from .pretrained import load_tokenizer

DPR_ARCHITECTURES = {"DPRQuestionEncoder": "question", "DPRContextEncoder": "context"}


def find_dpr_pair(folder: Path) -> Optional[tuple[Path, Path]]:
    """``(question encoder folder, context encoder folder)`` when ``folder`` holds official DPR checkpoints (as
    ``facebook/dpr-question_encoder-single-nq-base`` and ``facebook/dpr-ctx_encoder-single-nq-base``), else None."""
    if not folder.is_dir():
        return None
    found: dict[str, list[Path]] = {"question": [], "context": []}
    for config_file in sorted(folder.glob("*/config.json")):
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, *JSON_ERRORS):  # UnicodeDecodeError is a ValueError
            continue  # not a model folder this reader is looking for
        architectures = config.get("architectures") if isinstance(config, dict) else None
        for architecture in architectures or []:
            if architecture in DPR_ARCHITECTURES:
                found[DPR_ARCHITECTURES[architecture]].append(config_file.parent)
    if not any(found.values()):
        return None
    if len(found["question"]) != 1 or len(found["context"]) != 1:
        raise DprGcError(f"{folder}: expected one DPRQuestionEncoder and one DPRContextEncoder folder, found "
                         f"{len(found['question'])} and {len(found['context'])}")
    return found["question"][0], found["context"][0]


def load_dpr(retriever_cls: Any, question_dir: Path, context_dir: Path) -> Any:
    """A separate-tower retriever from official DPR checkpoints: DPR's pooling (the [CLS] vector, then DPR's
    ``encode_proj`` when ``projection_dim > 0``), dot product, ``[CLS] title [SEP] text [SEP]``, 256 tokens."""
    from transformers import DPRContextEncoder, DPRQuestionEncoder

    from ..base.validate import check_weights_folder, refuse_custom_code

    for folder in (question_dir, context_dir):
        refuse_custom_code(folder)
        check_weights_folder(folder)
    question = _load_tower(DPRQuestionEncoder, question_dir).question_encoder
    context = _load_tower(DPRContextEncoder, context_dir).ctx_encoder
    query_bert, context_bert = _dpr_bert(question), _dpr_bert(context)
    tokenizer = one_tokenizer(question_dir, query_bert, context_dir, context_bert)
    projection = question.config.projection_dim or None
    config = RetrieverConfig(pooling="cls", normalize=False, projection_dim=projection, shared_encoder=False,
                             query_max_length=256, passage_max_length=256, passage_format="pair")
    retriever = retriever_cls(query_bert, context_bert, tokenizer, config)
    if projection:
        retriever.query_encoder.projection.load_state_dict(question.encode_proj.state_dict())
        retriever.passage_encoder.projection.load_state_dict(context.encode_proj.state_dict())
    retriever.training_info["imported_from"] = {"DPRQuestionEncoder": str(question_dir),
                                                "DPRContextEncoder": str(context_dir)}
    return retriever.check_widths(question_dir.parent)


def _load_tower(encoder_cls: Any, folder: Path) -> nn.Module:
    """One DPR encoder from ``folder`` in float32 whatever the saved dtype (precision is autocast's, see
    load_transformer); weights that are a pickle are refused in one line, never unpickled."""
    import pickle

    try:
        with transformers_quiet():
            return encoder_cls.from_pretrained(str(folder), dtype=torch.float32)
    except pickle.UnpicklingError:
        weights = next(iter(sorted(folder.glob("*.bin"))), folder)
        raise DprGcError(f"{weights}: the weights are a pickle, which is never unpickled; convert them to "
                         "model.safetensors (save_pretrained(..., safe_serialization=True))") from None
    except (OSError, ValueError) as e:
        raise DprGcError(f"cannot load the DPR checkpoints in {folder.parent}: {str(e).splitlines()[0]}") from None


def one_tokenizer(query_dir: Path, query_model: nn.Module, passage_dir: Path, passage_model: nn.Module) -> Any:
    """The query tower's tokenizer, refused when the passage tower's own has another vocabulary: a retriever has one
    tokenizer, and the passage tower would be fed ids it was not trained on."""
    tokenizer = load_tokenizer(query_dir, query_model)
    if tokenizer.get_vocab() != load_tokenizer(passage_dir, passage_model).get_vocab():
        raise DprGcError(f"{query_dir} and {passage_dir} have different vocabularies; dpr-gc needs one tokenizer "
                         "for both towers, so give both the same tokenizer files")
    return tokenizer


def _dpr_bert(encoder: nn.Module) -> nn.Module:
    """DPR's inner BERT as a plain ``BertModel`` (a DPRConfig would make AutoModel rebuild a DPR wrapper)."""
    from transformers import BertConfig, BertModel

    settings = {k: v for k, v in encoder.bert_model.config.to_dict().items()
                if k not in ("model_type", "architectures", "projection_dim", "transformers_version")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # DPR has no pooler; a fixed one keeps the folder loading without "new weights"
        bert = BertModel(BertConfig(**settings))
    missing, unexpected = bert.load_state_dict(encoder.bert_model.state_dict(), strict=False)
    if unexpected or any(not key.startswith("pooler.") for key in missing):
        raise DprGcError(f"unexpected DPR encoder weights: missing {missing}, unexpected {unexpected}")
    return bert
