"""Foreign sentence-transformers folders, built by hand in its layout: each setting dpr-gc reads is honoured as
sentence-transformers honours it (max lengths, lower-casing), and one it cannot honour is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
from transformers import BertTokenizerFast

from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever
from tests.helpers import tiny_bert, write_vocab

TRANSFORMER = "sentence_transformers.models.Transformer"
MEAN = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}


def write_transformer(folder: Path, settings: dict, seed: int = 0, vocab: Optional[Path] = None,
                      **tokenizer_options: Any) -> Path:
    """A tiny BERT (128 positions) with its tokenizer and ``sentence_bert_config.json`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = BertTokenizerFast(vocab=str(vocab or write_vocab(folder.parent / "vocab.txt")), **tokenizer_options)
    tiny_bert(len(tokenizer), seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    return folder


def write_module(folder: Path, config: Optional[dict] = None) -> str:
    """A module folder holding ``config.json`` (none when ``config`` is None); returns its name."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder.name


def shared_folder(root: Path, settings: dict, pooling: dict = MEAN, prompts: Optional[dict] = None,
                  **tokenizer_options: Any) -> Path:
    """Transformer -> Pooling in ``root/model``, with ``prompts`` in ``config_sentence_transformers.json``."""
    folder = write_transformer(root / "model", settings, **tokenizer_options)
    write_module(folder / "1_Pooling", pooling)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    return folder


def router_folder(root: Path, query: dict, document: dict, **tokenizer_options: Any) -> Path:
    """A Router with query and document routes (Transformer -> Pooling each), their transformer settings given."""
    folder = root / "model"
    vocab = write_vocab(root / "vocab.txt")
    structure, types = {}, {}
    for route, settings in (("query", query), ("document", document)):
        write_transformer(folder / f"{route}_0_Transformer", settings, seed=len(route), vocab=vocab,
                          **tokenizer_options.get(route, {}))
        write_module(folder / f"{route}_1_Pooling", MEAN)
        structure[route] = [f"{route}_0_Transformer", f"{route}_1_Pooling"]
        types.update({f"{route}_0_Transformer": TRANSFORMER,
                      f"{route}_1_Pooling": "sentence_transformers.models.Pooling"})
    (folder / "router_config.json").write_text(json.dumps({"structure": structure, "types": types}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Router"}]))
    return folder


def test_each_route_of_a_router_keeps_its_own_max_length(tmp_path: Path) -> None:
    """docs/training.md: a Router's query route cuts queries at its own ``max_seq_length`` (8 here), as
    sentence-transformers does; they once got the document route's length, capped at 64."""
    folder = router_folder(tmp_path, {"max_seq_length": 8}, {"max_seq_length": 100})
    config = Retriever.load(folder).config
    assert (config.query_max_length, config.passage_max_length) == (8, 100)


@pytest.mark.parametrize("model_max_length, lengths", [(16, (16, 16)), (None, (64, 128))])
def test_a_folder_without_max_seq_length_cuts_where_sentence_transformers_does(
        tmp_path: Path, model_max_length: Optional[int], lengths: tuple) -> None:
    """docs/training.md: no ``max_seq_length``: the least of the tokenizer's ``model_max_length`` and the model's
    positions (128 here), queries at most 64 tokens; such folders once got 256."""
    options = {} if model_max_length is None else {"model_max_length": model_max_length}
    config = Retriever.load(shared_folder(tmp_path, {}, **options)).config
    assert (config.query_max_length, config.passage_max_length) == lengths


def test_a_router_whose_routes_have_different_vocabularies_is_refused(tmp_path: Path) -> None:
    """docs/formats.md: a retriever has one tokenizer; a Router whose document route has its own vocabulary is
    refused (its passages were once tokenised with the query route's tokenizer), as a DPR pair is."""
    folder = router_folder(tmp_path, {"max_seq_length": 32}, {"max_seq_length": 32})
    other = tmp_path / "other.txt"
    other.write_text("\n".join(write_vocab(tmp_path / "vocab.txt").read_text().split()[:-1]) + "\n")
    BertTokenizerFast(vocab=str(other)).save_pretrained(folder / "document_0_Transformer")
    with pytest.raises(DprGcError, match="document_0_Transformer have different vocabularies; dpr-gc needs one"):
        Retriever.load(folder)
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt")).save_pretrained(folder / "document_0_Transformer")
    assert Retriever.load(folder).passage_encoder is not None


def test_do_lower_case_lower_cases_every_text_and_a_save_keeps_it(tmp_path: Path) -> None:
    """docs/formats.md: ``do_lower_case`` in ``sentence_bert_config.json`` lower-cases texts and prompts before the
    tokenizer (a ``Lowercase`` normalizer first, as sentence-transformers puts it); it was once ignored, so "PARIS"
    became [UNK]s. A saved retriever writes ``do_lower_case`` again: transformers rebuilds a BERT normalizer."""
    folder = shared_folder(tmp_path, {"max_seq_length": 32, "do_lower_case": True}, prompts={"query": "Q: "},
                           do_lower_case=False)
    retriever = Retriever.load(folder)
    ids = retriever.tokenize_queries(["PARIS City"])["input_ids"].tolist()
    assert ids == retriever.tokenizer(["q: paris city"])["input_ids"] and 1 not in ids[0]  # no [UNK]
    retriever.save(tmp_path / "saved")
    settings = json.loads((tmp_path / "saved" / "sentence_bert_config.json").read_text())
    assert settings["do_lower_case"] is True
    assert Retriever.load(tmp_path / "saved").tokenize_queries(["PARIS City"])["input_ids"].tolist() == ids


@pytest.mark.parametrize("prompts, refused", [({"query": "query: "}, True), ({"query": ""}, False)])
def test_pooling_without_the_prompt_is_refused_when_there_is_a_prompt(tmp_path: Path, prompts: dict,
                                                                      refused: bool) -> None:
    """docs/formats.md: a Pooling config with ``include_prompt: false`` leaves the prompt's tokens out of the mean in
    sentence-transformers; dpr-gc pools them, so such a folder with a prompt is refused (it once loaded, embedding
    otherwise, and a save wrote ``include_prompt: true``); without a prompt the setting changes nothing."""
    folder = shared_folder(tmp_path, {"max_seq_length": 32}, {"pooling_mode": "mean", "include_prompt": False},
                           prompts=prompts)
    if refused:
        with pytest.raises(DprGcError, match=r"1_Pooling/config.json: include_prompt false .* set include_prompt"):
            Retriever.load(folder)
    else:
        assert Retriever.load(folder).config.pooling == "mean"


def test_a_projection_after_normalize_is_refused(tmp_path: Path) -> None:
    """docs/formats.md: Transformer -> Pooling -> Normalize -> Dense projects the normalised vector; dpr-gc
    normalises last, so such a folder is refused (it was once run as Dense -> Normalize)."""
    folder = shared_folder(tmp_path, {"max_seq_length": 32})
    write_module(folder / "2_Normalize")
    write_module(folder / "3_Dense", {"in_features": 32, "out_features": 8, "bias": True,
                                      "activation_function": "torch.nn.modules.linear.Identity"})
    modules = json.loads((folder / "modules.json").read_text()) + [
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(DprGcError, match=r"modules.json: a Dense module \(3_Dense\) after Normalize is not supported"):
        Retriever.load(folder)


@pytest.mark.parametrize("pooling, mode", [({"pooling_mode_cls_token": True}, "cls"),
                                           ({"pooling_mode_mean_tokens": True}, "mean"),
                                           ({"pooling_mode_lasttoken": True}, "last"), ({}, "mean"),
                                           ({"pooling_mode": "cls"}, "cls"), ({"pooling_mode": "lasttoken"}, "last")])
def test_each_way_a_pooling_config_names_its_mode_is_read(tmp_path: Path, pooling: dict, mode: str) -> None:
    """A Pooling config.json names its mode by ``pooling_mode`` or, in older folders, by one true
    ``pooling_mode_*`` flag (none: mean, as sentence-transformers defaults); each is read as that pooling, and a CLS
    folder embeds as sentence-transformers does (a legacy CLS flag read as mean changed every embedding)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    folder = shared_folder(tmp_path, {"max_seq_length": 32}, {"word_embedding_dimension": 32, **pooling})
    retriever = Retriever.load(folder)
    assert retriever.config.pooling == mode
    if mode == "cls":
        texts = ["the king of france", "a river in paris"]
        np.testing.assert_allclose(retriever.embed("passage", texts), SentenceTransformer(
            str(folder), device="cpu").encode_document(texts), rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompts, prefix", [({"query": "q: ", "passage": "p: "}, "p: "),
                                             ({"corpus": "c: "}, "c: "),
                                             ({"passage": "p: ", "corpus": "c: "}, "p: "),
                                             ({"document": "d: ", "passage": "p: ", "corpus": "c: "}, "d: "),
                                             ({"document": "", "passage": "p: "}, ""),
                                             ({"query": "q: "}, "")])
def test_a_passage_takes_the_first_document_prompt_in_sentence_transformers_order(tmp_path: Path, prompts: dict,
                                                                                  prefix: str) -> None:
    """docs/training.md: a folder's passage prefix is its "document" prompt, else its "passage" one, else its
    "corpus" one (the order sentence-transformers' ``encode_document`` documents), present even when empty."""
    folder = shared_folder(tmp_path, {"max_seq_length": 32}, prompts=prompts)
    assert Retriever.load(folder).config.passage_prefix == prefix
