"""One tokenisation for training, encoding and queries: per-passage title rule and whole-pair truncation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dpr_gc.data import training as D
from dpr_gc.retrieval.encode import encode_block
from dpr_gc.base.errors import DprGcError
from dpr_gc.model.tokenize import token_ids
from dpr_gc.train.trainer import train
from tests.train_data import init_model
from tests.train_data import make_records, train_config, write_dpr

LONG_TITLE = " ".join(["science protein cell gene water music film book"] * 6)  # 48 words, > 32 tokens


def ids_of(batch, row: int) -> list[int]:
    mask = batch["attention_mask"][row].bool()
    return batch["input_ids"][row][mask].tolist()


def test_untitled_passage_tokenises_the_same_whatever_its_companions(make_retriever):
    retriever = make_retriever(passage_max_length=24)
    alone = retriever.tokenize_passages([""], ["music of london"])
    mixed = retriever.tokenize_passages(["paris", ""], ["a city in france", "music of london"])
    assert ids_of(mixed, 1) == ids_of(alone, 0)
    sep = retriever.tokenizer.sep_token_id
    assert ids_of(alone, 0).count(sep) == 1  # [CLS] text [SEP]
    assert ids_of(mixed, 0).count(sep) == 2  # [CLS] title [SEP] text [SEP]
    assert mixed["token_type_ids"][0].max() == 1 and mixed["token_type_ids"][1].max() == 0


def test_passage_embedding_does_not_depend_on_batch_companions(make_retriever):
    retriever = make_retriever(passage_max_length=32).eval()
    titles, texts = ["", "paris"], ["music of london and the river", "a city in france"]
    together = encode_block(retriever, titles, texts, batch_size=2)
    alone = encode_block(retriever, titles[:1], texts[:1], batch_size=2)
    np.testing.assert_allclose(together[0], alone[0], atol=1e-5)
    np.testing.assert_allclose(retriever.embed("passage", texts[:1], titles[:1]), alone, atol=1e-5)
    # Training batches: the collator's rows give the same vector as encoding the passage on its own.
    collate = D.Collator(retriever)
    batch = collate([{"question": "what is music?", "passages": list(zip(titles, texts))}])
    with torch.no_grad():
        trained = retriever("passage", scale=False, **batch["passage"])
    np.testing.assert_allclose(trained[0].numpy(), alone[0], atol=1e-5)


@pytest.mark.parametrize("passage_format", ["pair", "concat"])
def test_title_longer_than_max_length_is_cut_text_first(make_retriever, passage_format):
    retriever = make_retriever(passage_max_length=32, passage_format=passage_format)
    tok = retriever.tokenizer
    title_ids = tok(LONG_TITLE, add_special_tokens=False)["input_ids"]
    assert len(title_ids) > 32
    batch = retriever.tokenize_passages([LONG_TITLE, "paris"], ["the river of london", "a city"])
    row = ids_of(batch, 0)
    assert len(row) == 32 and row[0] == tok.cls_token_id
    kept = 29 if passage_format == "pair" else 30
    assert row[1:1 + kept] == title_ids[:kept]  # no text token survives; the title is cut at its end
    assert ids_of(batch, 1)[1] == tok("paris", add_special_tokens=False)["input_ids"][0]
    encoded = encode_block(retriever, [LONG_TITLE, "paris"], ["the river of london", "a city"])
    np.testing.assert_allclose(encoded[:1], encode_block(retriever, [LONG_TITLE], ["the river of london"]), atol=1e-5)
    # A title that fits keeps it whole and cuts the text.
    short = retriever.tokenize_passages(["paris city"], ["the river " * 40])
    assert len(ids_of(short, 0)) == 32 and ids_of(short, 0)[1:3] == tok("paris city", add_special_tokens=False)["input_ids"]


def test_same_tokenisation_in_training_encoding_and_queries(make_retriever):
    retriever = make_retriever(passage_max_length=32, query_max_length=8)
    collate = D.Collator(retriever)
    batch = collate([{"question": LONG_TITLE, "passages": [(LONG_TITLE, "the river"), ("", "a city")]}])
    direct = token_ids(retriever.tokenizer, retriever.config, "passage", ["the river", "a city"], [LONG_TITLE, ""])
    assert torch.equal(batch["passage"]["input_ids"], direct["input_ids"])
    assert batch["query"]["input_ids"].shape == (1, 8)
    assert torch.equal(batch["query"]["input_ids"], retriever.tokenize_queries([LONG_TITLE])["input_ids"])
    with pytest.raises(DprGcError, match="no room"):
        retriever.tokenize_passages(["paris"], ["a city"], max_length=3)


def test_training_with_a_title_longer_than_passage_max_length(tmp_path: Path):
    records = make_records(16, 3)
    for r in records[:4]:
        r["positive_ctxs"][0]["title"] = LONG_TITLE
        r["hard_negative_ctxs"][0]["title"] = LONG_TITLE
    model = init_model(tmp_path)
    config = train_config(train_files=[str(write_dpr(tmp_path / "t.json", records))], output_dir=str(tmp_path / "out"),
                          model=str(model), batch_size=8, num_workers=0, max_steps=2,
                          query_chunk_size=4, passage_chunk_size=8, cache_dir=str(tmp_path / "cache"))
    summary = train(config)
    assert summary["steps"] == 2
