"""Retriever loading: saved retrievers round-trip; sentence-transformers folders keep their own recipe."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever, RetrieverConfig


def test_save_and_load_round_trip(make_retriever, tmp_path):
    retriever = make_retriever(shared=False, projection_dim=8, learn_temperature=True, temperature=0.07)
    retriever.save(tmp_path / "r")
    loaded = Retriever.load(tmp_path / "r")
    assert loaded.config.projection_dim == 8 and loaded.passage_encoder is not loaded.query_encoder
    assert abs(float(loaded.temperature.detach()) - 0.07) < 1e-6
    texts = ["the city of paris", "a river"]
    for kind in ("query", "passage"):
        # The reloaded model may run another attention kernel (SDPA vs the fixture's eager): equal to rounding.
        np.testing.assert_allclose(retriever.embed(kind, texts), loaded.embed(kind, texts), rtol=0, atol=1e-6)
    assert loaded.embed("query", texts).shape == (2, 8)


def test_sentence_transformers_folder_keeps_its_recipe(make_retriever, tmp_path):
    retriever = make_retriever()
    folder = tmp_path / "st"
    retriever.query_encoder.transformer.save_pretrained(folder)
    retriever.tokenizer.save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    loaded = Retriever.load(folder)
    assert (loaded.config.pooling, loaded.config.normalize, loaded.config.passage_format) == ("mean", True, "concat")
    assert loaded.config.passage_max_length == 100
    assert np.allclose(np.linalg.norm(loaded.embed("passage", ["paris city"]), axis=1), 1.0)


def test_bad_settings_and_models(tmp_path):
    with pytest.raises(DprGcError, match="--pooling"):
        RetrieverConfig(pooling="max")
    with pytest.raises(DprGcError, match="--temperature"):
        RetrieverConfig(temperature=0.0)
    with pytest.raises(DprGcError, match="cannot load model"):
        Retriever.load(tmp_path / "nothing-here")


def test_embed_runs_in_eval_mode_and_leaves_the_mode_as_it_was(make_retriever):
    """``Retriever.embed``: eval mode inside (dropout off, so two calls agree in training mode), the caller's mode
    back after."""
    retriever = make_retriever(dropout=0.5).train()
    texts = ["the city of paris", "a river"]
    first, second = (retriever.embed("passage", texts) for _ in range(2))
    assert retriever.training and all(m.training for m in retriever.modules())
    np.testing.assert_array_equal(first, second)
    retriever.eval()
    retriever.embed("query", texts)
    assert not retriever.training


def test_embed_and_forward_take_query_or_passage_and_one_title_per_text(make_retriever):
    """``Retriever.embed``'s and ``forward``'s ``kind`` is "query" or "passage": another ("queries", "doc") is
    refused instead of silently running the passage tower; ``titles`` gives one title per text."""
    retriever = make_retriever(shared=False)
    for kind in ("queries", "doc"):
        with pytest.raises(DprGcError, match=f"unknown text kind '{kind}'"):
            retriever.embed(kind, ["the city of paris"])
        with pytest.raises(DprGcError, match=f"unknown text kind '{kind}'"):
            retriever(kind, **retriever.tokenize_queries(["the city of paris"]))
    with pytest.raises(DprGcError, match="1 titles for 2 passage texts"):
        retriever.embed("passage", ["the city of paris", "a river"], titles=["paris"])
    with pytest.raises(DprGcError, match="3 titles for 2 passage texts"):
        retriever.embed("passage", ["the city of paris", "a river"], titles=["paris", "river", "extra"])


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_left_padding_tokenizer_embeds_a_text_as_alone_and_as_right_padded(make_retriever, pooling):
    """An encoder whose tokenizer pads on the left: ``cls`` pools each row's first real token (column 0 is padding
    there), positions follow the mask, so a text embeds as it does alone and as under right padding."""
    texts = ["the city of paris", "a river", "one two three four five six seven eight nine"]
    retriever = make_retriever(pooling=pooling)
    right = retriever.embed("passage", texts)
    retriever.tokenizer = copy.deepcopy(retriever.tokenizer)
    retriever.tokenizer.padding_side = "left"
    together = retriever.embed("passage", texts)
    alone = np.concatenate([retriever.embed("passage", [t]) for t in texts])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(together, right, rtol=1e-5, atol=1e-5)


def test_embed_returns_rows_in_input_order_when_character_and_token_lengths_disagree(make_retriever):
    """``Retriever.embed`` promises float32 [N, D] in input order: it sorts by characters, then batches by tokens;
    texts whose two orders disagree (long vocabulary words are one token each, single letters too), in batches
    of two, give each text its own vector, as embedding it alone does."""
    texts = ["science protein", "a b c d e f", "london france", "x y z w v", "music paris", "1 2 3 4"]
    retriever = make_retriever()
    batched = retriever.embed("passage", texts, batch_size=2)
    alone = np.concatenate([retriever.embed("passage", [t]) for t in texts])
    assert batched.dtype == np.float32 and batched.shape == (len(texts), retriever.dim)
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)


def test_pooler_pooling_refuses_left_padded_input(make_retriever):
    """The pooler layer reads column 0, padding under a left-padding tokenizer: refused in one line, not pooled."""
    retriever = make_retriever(pooling="pooler")
    retriever.tokenizer = copy.deepcopy(retriever.tokenizer)
    retriever.tokenizer.padding_side = "left"
    with pytest.raises(DprGcError, match="--pooling pooler.*left"):
        retriever.embed("passage", ["the city of paris", "a river"])
