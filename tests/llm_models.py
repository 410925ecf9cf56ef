"""Tiny random decoder-only models (Llama, Qwen2, Granite) and a decoder-style fast tokenizer, built in code (no
download).

The tokenizer behaves like Llama's: it adds BOS but not EOS and has no padding token, so loading it exercises
dpr-gc's pad-token default and the EOS that last-token pooling appends.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Optional

import torch
from transformers import (GraniteConfig, GraniteModel, LlamaConfig, LlamaModel, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2Model)

from dpr_gc import GradCache, SimpleContrastiveLoss
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import WORDS, grads, make_batch, models_of, reference_grads, rel_err, zero

BOS, EOS, UNK, QWEN_PAD = "<s>", "</s>", "<unk>", "<|endoftext|>"
TEXTS = ["the king of france was in paris", "a", "music film book of the river", "what city"]


def decoder_tokenizer(padding_side: str = "right", add_eos: bool = False,
                      pad_token: Optional[str] = None) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer covering any ASCII text that adds ``<s>`` (and ``</s>`` with ``add_eos``); no padding
    token unless ``pad_token`` names one (Qwen2's tokenizers have ``<|endoftext|>``, Llama's none)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = dict.fromkeys([UNK, BOS, EOS] + ([pad_token] if pad_token else []) + WORDS + chars + [f"##{c}" for c in chars])
    ids = {token: i for i, token in enumerate(vocab)}
    backend = Tokenizer(models.WordPiece(ids, unk_token=UNK))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    single = f"{BOS} $A" + (f" {EOS}" if add_eos else "")
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B" + (f" {EOS}" if add_eos else ""),
        special_tokens=[(BOS, ids[BOS]), (EOS, ids[EOS])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   padding_side=padding_side, **({"pad_token": pad_token} if pad_token else {}))


def tiny_decoder(kind: str, vocab_size: int, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A random 2-layer Llama, Qwen2 or Granite (eager attention: the same kernel whatever the sequence length)."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  attn_implementation="eager")
    if kind == "llama":
        return LlamaModel(LlamaConfig(**fields))
    if kind == "qwen2":
        return Qwen2Model(Qwen2Config(**fields))
    if kind == "granite":
        return GraniteModel(GraniteConfig(**fields))
    raise ValueError(f"unknown decoder kind {kind!r}")


def save_decoder(folder: Path, kind: str = "llama", padding_side: str = "right", seed: int = 0) -> Path:
    """A Hugging Face folder holding a tiny random decoder and its tokenizer, as a Llama/Qwen2 download would."""
    tokenizer = decoder_tokenizer(padding_side, pad_token=QWEN_PAD if kind == "qwen2" else None)
    tiny_decoder(kind, len(tokenizer), seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def decoder_retriever(kind: str = "llama", padding_side: str = "right", shared: bool = True, **fields) -> Retriever:
    fields.setdefault("pooling", "last")
    fields.setdefault("passage_format", "concat")
    tokenizer = decoder_tokenizer(padding_side)
    tokenizer.pad_token = EOS
    p_model = None if shared else tiny_decoder(kind, len(tokenizer), seed=1)
    config = RetrieverConfig(shared_encoder=shared, **fields)
    return Retriever(tiny_decoder(kind, len(tokenizer)), p_model, tokenizer, config)


def cached_step_error(retriever: Retriever, seed: int, **cache_options) -> float:
    """Relative gradient error of a Gradient Cache step (chunk 3) against the full-batch graph, same 8-query batch."""
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 8, 1, seed=seed)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    GradCache(modules, 3, loss_fn, **cache_options)(q, p)
    return rel_err(grads(modules), expected)


def lora_decoder():
    """A left-padded tiny Llama with random LoRA adapters and a learnable temperature, in train mode."""
    from dpr_gc.model.lora import LoraSettings, apply_lora

    from tests.helpers import randomise_adapters

    retriever = decoder_retriever("llama", "left", learn_temperature=True, temperature=0.2)
    apply_lora(retriever, LoraSettings(r=4))
    randomise_adapters(retriever)
    return retriever.train()
