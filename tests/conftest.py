"""Shared fixtures: tiny random BERTs and tokenizers built in code (no download, seconds to run)."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

from dpr_gc.model.retriever import Retriever, RetrieverConfig

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WORDS = ("the a of and to in is was for on with as by at from that this it are be or an which what who when "
         "where how city river king war science protein cell gene paris london france music film book water").split()


def write_vocab(path: Path) -> Path:
    """A WordPiece vocabulary covering any ASCII text (whole words, single characters and ## pieces)."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + chars + [f"##{c}" for c in chars]
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return path


def tiny_bert(vocab_size: int, seed: int = 0, dropout: float = 0.0, layers: int = 2, attn: str = "eager") -> BertModel:
    """A random 2-layer BERT. Eager attention by default: the CPU SDPA kernel rounds differently for different
    sequence lengths, which would blur fp32 gradient comparisons between padded and trimmed batches."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=128, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, attn_implementation=attn)
    return BertModel(config)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> BertTokenizerFast:
    vocab = write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")
    return BertTokenizerFast(vocab=str(vocab), do_lower_case=True)


@pytest.fixture
def make_retriever(tiny_tokenizer: BertTokenizerFast):
    """Factory: ``make_retriever(shared=True, dropout=0.0, **config_fields)`` -> a tiny random Retriever.

    Mean pooling by default: a random BERT's CLS vector barely depends on the input, so scores would all be equal
    and gradients would be differences of near-equal numbers.
    """

    def make(shared: bool = True, dropout: float = 0.0, seed: int = 0, **fields) -> Retriever:
        fields.setdefault("pooling", "mean")
        config = RetrieverConfig(shared_encoder=shared, **fields)
        vocab_size = len(tiny_tokenizer)
        q = tiny_bert(vocab_size, seed, dropout)
        p = None if shared else tiny_bert(vocab_size, seed + 1, dropout)
        return Retriever(q, p, tiny_tokenizer, config)

    return make
