"""Models come in as they were saved, or are refused in one line: weights saved in fp16/bf16 load as float32 (the
precision of a run is autocast's alone); separate towers of different widths are refused at load; a
sentence-transformers Dense layer without a bias loads and saves as it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer
from transformers import BertConfig, BertModel

from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import gather, passages, tiny_bert, write_corpus

TEXTS = ["who was the king of france", "a film with music from london", "paris is the city of france on the river"]


def save_in_dtypes(tokenizer, folder: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    """One tiny BERT rounded to ``dtype``, saved in ``dtype`` and, the same rounded weights, in float32."""
    model = tiny_bert(len(tokenizer), seed=4).to(dtype)
    half, full = folder / "half", folder / "fp32"
    model.save_pretrained(half)
    model.float().save_pretrained(full)
    for path in (half, full):
        tokenizer.save_pretrained(path)
    return half, full


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_load_as_float32(tiny_tokenizer, tmp_path, dtype) -> None:
    """A model saved in fp16/bf16 loads with float32 parameters (transformers 5 would keep the saved dtype, so
    AdamW would update half weights and ``--precision fp32`` would compute in half), embedding exactly as the fp32
    copy of the same weights; a DPR ``.cp`` whose config was saved in half builds float32 towers too."""
    half, full = save_in_dtypes(tiny_tokenizer, tmp_path, dtype)
    retriever = Retriever.load(half)
    assert {p.dtype for p in retriever.parameters()} == {torch.float32}
    np.testing.assert_array_equal(retriever.embed("passage", TEXTS), Retriever.load(full).embed("passage", TEXTS))
    weights = {f"{side}.{k}": v for k, v in retriever.query_encoder.transformer.state_dict().items()
               for side in ("question_model", "ctx_model")}
    torch.save({"model_dict": weights, "encoder_params": {"pretrained_model_cfg": str(half)}}, tmp_path / "dpr.cp")
    assert {p.dtype for p in Retriever.load(tmp_path / "dpr.cp").parameters()} == {torch.float32}


def test_encode_at_fp32_computes_in_fp32_from_half_weights(tiny_tokenizer, tmp_path) -> None:
    """``dpr-gc encode --precision fp32`` on a model saved in fp16 writes the shards of its fp32 copy."""
    from dpr_gc.cli import main

    half, full = save_in_dtypes(tiny_tokenizer, tmp_path, torch.float16)
    corpus = write_corpus(tmp_path / "data", passages(6), "jsonl")
    for model in (half, full):
        assert main(["encode", "--model", str(model), "--corpus", str(corpus), "--output",
                     str(tmp_path / f"emb_{model.name}"), "--cache-dir", str(tmp_path / "cache"), "--precision",
                     "fp32", "--device", "cpu"]) == 0
    np.testing.assert_array_equal(gather(tmp_path / "emb_half")[1], gather(tmp_path / "emb_fp32")[1])


def wide_bert(vocab_size: int, hidden: int) -> BertModel:
    """A random 1-layer BERT of hidden size ``hidden``."""
    torch.manual_seed(5)
    return BertModel(BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=37, max_position_embeddings=128))


@pytest.mark.parametrize("kind", ["dpr-gc", "sentence-transformers"])
def test_towers_of_different_widths_are_refused_in_one_line(tiny_tokenizer, tmp_path, capsys, kind) -> None:
    """A separate-tower folder whose query transformer is 32 wide and document transformer 64 (a dpr-gc folder, or
    a foreign sentence-transformers Router folder) is refused at load, naming the folder and both widths, where
    encode failed with a broadcast traceback and train at its first step."""
    from dpr_gc.cli import main

    folder = tmp_path / "model"
    vocab = len(tiny_tokenizer)
    Retriever(wide_bert(vocab, 32), wide_bert(vocab, 64), tiny_tokenizer, RetrieverConfig(shared_encoder=False)) \
        .save(folder)
    if kind == "sentence-transformers":
        for name in ("retriever_config.json", "heads.safetensors"):
            (folder / name).unlink()
    corpus = write_corpus(tmp_path / "data", passages(3), "jsonl")
    capsys.readouterr()  # transformers' save bars
    assert main(["encode", "--model", str(folder), "--corpus", str(corpus), "--output", str(tmp_path / "emb"),
                 "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {folder}: the query tower gives vectors of width 32 and the passage (document) "
                          "tower of width 64") and len(err.splitlines()) == 1, err


def test_a_dense_layer_without_bias_loads_and_saves_as_it_is(make_retriever, tiny_tokenizer, tmp_path) -> None:
    """A sentence-transformers folder whose projection Dense layer has ``"bias": false`` (refused before: "not the
    projection this retriever expects ('linear.bias')") embeds as transformer -> mean pooling -> the bias-less
    linear -> normalize computed by hand, and saved again keeps its layer bias-less (sentence-transformers loads it
alike)."""
    folder = tmp_path / "st"
    make_retriever(projection_dim=8, normalize=True).save(folder)
    for name in ("retriever_config.json", "heads.safetensors"):
        (folder / name).unlink()
    torch.manual_seed(6)
    weight = torch.randn(8, 32)
    save_file({"linear.weight": weight}, str(folder / "2_Dense" / "model.safetensors"))
    dense = json.loads((folder / "2_Dense" / "config.json").read_text())
    (folder / "2_Dense" / "config.json").write_text(json.dumps({**dense, "bias": False}))
    retriever = Retriever.load(folder)
    assert retriever.query_encoder.projection.bias is None
    with torch.no_grad():
        batch = tiny_tokenizer(TEXTS, padding=True, return_tensors="pt")
        states = BertModel.from_pretrained(folder).eval()(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize(((states * mask).sum(1) / mask.sum(1)) @ weight.T, dim=-1)
    np.testing.assert_allclose(retriever.embed("passage", TEXTS), expected.numpy(), rtol=0, atol=1e-5)
    retriever.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "2_Dense" / "config.json").read_text())["bias"] is False
    np.testing.assert_array_equal(Retriever.load(tmp_path / "again").embed("passage", TEXTS),
                                  retriever.embed("passage", TEXTS))
    st_model = SentenceTransformer(str(tmp_path / "again"), device="cpu")
    np.testing.assert_allclose(st_model.encode(TEXTS), expected.numpy(), rtol=0, atol=1e-5)
