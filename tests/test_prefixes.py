"""Query and passage prefixes (E5's ``query: `` / ``passage: ``, a BGE instruction): stored with the model and applied
identically in training batches, corpus encoding, queries (retrieve, mine) and sentence-transformers; the
``--query-prefix`` / ``--passage-prefix`` flags of train, encode, retrieve and mine set or replace them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from dpr_gc.cli import main
from dpr_gc.data.corpus import load_corpus
from dpr_gc.data.training import Collator
from dpr_gc.retrieval.index import IndexParams, build_index
from dpr_gc.retrieval.mine import open_source
from dpr_gc.model.retriever import Retriever
from dpr_gc.train.trainer import train
from dpr_gc.train.config import ModelConfig
from dpr_gc.train.setup import build_retriever
from tests.helpers import call, gather
from tests.train_data import init_model
from tests.train_data import make_records, train_config, write_dpr

QP, PP = "what: ", "a book: "  # whole words of the tiny vocabulary
QUERIES = ["who was the king of france", "the river in paris"]
PASSAGES = [{"id": "p0", "title": "paris", "text": "the city of france on the river"},
            {"id": "p1", "title": "", "text": "a war of the king of london"},
            {"id": "p2", "title": "music", "text": "a film with music from london"}]


def unprefixed(retriever: Retriever) -> Retriever:
    """The same weights with no prefixes: given the prefixed text by hand it must give the same vectors."""
    config = dataclasses.replace(retriever.config, query_prefix="", passage_prefix="")
    return Retriever(retriever.query_encoder.transformer, None, retriever.tokenizer, config)


def test_training_batches_encoding_and_queries_use_the_same_prefixes(make_retriever, tiny_tokenizer):
    retriever = make_retriever(query_prefix=QP, passage_prefix=PP, passage_format="concat")
    batch = Collator(retriever)([{"question": QUERIES[0], "passages": [("paris", "the city")]}])
    assert torch.equal(batch["query"]["input_ids"], tiny_tokenizer([QP + QUERIES[0]], return_tensors="pt")["input_ids"])
    assert torch.equal(batch["passage"]["input_ids"],
                       tiny_tokenizer([PP + "paris the city"], return_tensors="pt")["input_ids"])
    plain = unprefixed(retriever)
    np.testing.assert_array_equal(retriever.embed("query", QUERIES), plain.embed("query", [QP + q for q in QUERIES]))
    texts = [p["text"] for p in PASSAGES]
    np.testing.assert_array_equal(retriever.embed("passage", texts, ["paris"] * 3),
                                  plain.embed("passage", [f"{PP}paris {t}" for t in texts]))
    assert not np.allclose(retriever.embed("query", QUERIES), plain.embed("query", QUERIES), atol=1e-3)


def test_pair_format_prefixes_titled_over_long_titled_and_untitled_passages(make_retriever, tiny_tokenizer):
    """``--passage-format pair`` (the default): the passage prefix opens every passage, before the title of one whose
    title fits, of one whose title is cut for length, and before the text of an untitled one."""
    retriever = make_retriever(passage_prefix=PP, passage_max_length=16)
    assert retriever.config.passage_format == "pair"
    long_title = " ".join(["science protein cell gene"] * 6)  # 24 tokens: the text is dropped, the title cut
    titles, texts = ["paris", long_title, ""], ["the city of france", "a war", "a war of the king"]
    batch = retriever.tokenize_passages(titles, texts)
    prefix = tiny_tokenizer(PP, add_special_tokens=False)["input_ids"]
    for row, title in enumerate(titles):
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        assert ids[0] == tiny_tokenizer.cls_token_id and ids[1:1 + len(prefix)] == prefix, (title, ids)
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True).startswith("a book :"), title
    assert len(batch["input_ids"][1][batch["attention_mask"][1].bool()]) == 16  # the long title was cut


def test_train_flags_are_stored_with_the_model(tmp_path):
    model = init_model(tmp_path)
    data = write_dpr(tmp_path / "train.json", make_records(16, 1))
    base = dict(train_files=[str(data)], output_dir=str(tmp_path / "out"), model=str(model), batch_size=4,
                num_workers=0, max_steps=2, query_chunk_size=2, passage_chunk_size=3, cache_dir=str(tmp_path / "c"))
    seen = []
    train(train_config(**base, query_prefix=QP, passage_prefix=PP),
          on_backward=lambda step, r: seen.append((r.config.query_prefix, r.config.passage_prefix)))
    assert seen == [(QP, PP)] * 2  # the collator tokenises with this same config
    final = tmp_path / "out" / "final"
    stored = json.loads((final / "retriever_config.json").read_text())
    assert (stored["query_prefix"], stored["passage_prefix"]) == (QP, PP)
    prompts = json.loads((final / "config_sentence_transformers.json").read_text())["prompts"]
    assert prompts == {"query": QP, "document": PP}
    retriever = Retriever.load(final)
    np.testing.assert_allclose(SentenceTransformer(str(final), device="cpu").encode_query(QUERIES),
                               retriever.embed("query", QUERIES), rtol=0, atol=1e-4)
    # Continuing from the saved model keeps its prefixes unless a flag replaces one.
    again = build_retriever(ModelConfig(name=str(final), passage_prefix="on ")).config
    assert (again.query_prefix, again.passage_prefix) == (QP, "on ")
    main(["train", "--train", str(data), "--model", str(model), "--output", str(tmp_path / "cli"), "--max-steps", "1",
          "--batch-size", "4", "--num-workers", "0", "--query-chunk-size", "2", "--passage-chunk-size", "3",
          "--cache-dir", str(tmp_path / "c"), "--query-prefix", QP])
    stored = json.loads((tmp_path / "cli" / "final" / "retriever_config.json").read_text())
    assert (stored["query_prefix"], stored["passage_prefix"]) == (QP, "")


def test_encode_retrieve_and_mine_apply_stored_prefixes_and_flags(make_retriever, tmp_path):
    retriever = make_retriever(query_prefix=QP, passage_prefix=PP, passage_format="concat", normalize=True)
    retriever.save(tmp_path / "model")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    titles, texts = [p["title"] for p in PASSAGES], [p["text"] for p in PASSAGES]
    common = ["--corpus", str(corpus), "--dtype", "float32", "--precision", "fp32", "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]
    assert main(["encode", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "emb"), *common]) == 0
    assert main(["encode", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "plain"),
                 "--passage-prefix", "", *common]) == 0
    np.testing.assert_allclose(gather(tmp_path / "emb")[1], retriever.embed("passage", texts, titles), rtol=0, atol=1e-4)
    plain = unprefixed(retriever)
    np.testing.assert_allclose(gather(tmp_path / "plain")[1], plain.embed("passage", texts, titles), rtol=0, atol=1e-4)

    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": f"q{i}", "text": q}) + "\n" for i, q in enumerate(QUERIES)))
    passages = retriever.embed("passage", texts, titles)
    for flags, encoder, query_texts in (([], retriever, QUERIES), (["--query-prefix", "on "], plain,
                                                                    ["on " + q for q in QUERIES])):
        out = tmp_path / f"results{len(flags)}.json"
        assert main(["retrieve", "--index", str(tmp_path / "idx"), "--queries", str(queries), "--top-k", "3",
                     "--output", str(out), "--match", "none", "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                     *flags]) == 0
        expected = np.sort(encoder.embed("query", query_texts) @ passages.T, axis=1)[:, ::-1]
        scores = [[c["score"] for c in r["ctxs"]] for r in json.loads(out.read_text())]
        np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-4)

    source = open_source("dense", load_corpus(corpus, tmp_path / "c"), model=str(tmp_path / "model"),
                         index=tmp_path / "idx", device="cpu", query_prefix="on ", show_progress=False)
    assert (source.retriever.config.query_prefix, source.retriever.config.passage_prefix) == ("on ", PP)


def test_prefixes_given_to_encode_are_recorded_and_used_by_retrieve_and_mine(make_retriever, tmp_path, capsys):
    """`encode --query-prefix/--passage-prefix` override the model's; the index records them, so retrieve and mine
    embed queries under the same ones without repeating the flags (an explicit flag still wins). A --passage-prefix
    other than the index's is refused naming the flag, the index's prefix and the remedy, in the command's words
    (it blamed the model, which is the one that encoded the passages)."""
    retriever = make_retriever(query_prefix=QP, passage_prefix=PP, passage_format="concat", normalize=True)
    retriever.save(tmp_path / "model")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    common = ["--corpus", str(corpus), "--dtype", "float32", "--precision", "fp32", "--cache-dir", str(tmp_path / "c"),
              "--device", "cpu"]
    assert main(["encode", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "emb"),
                 "--query-prefix", "on ", "--passage-prefix", "", *common]) == 0
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    meta = json.loads((tmp_path / "idx" / "index_meta.json").read_text())
    assert (meta["query_prefix"], meta["passage_prefix"]) == ("on ", "")
    plain = unprefixed(retriever)
    passages = plain.embed("passage", [p["text"] for p in PASSAGES], [p["title"] for p in PASSAGES])
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": f"q{i}", "text": q}) + "\n" for i, q in enumerate(QUERIES)))
    out = tmp_path / "results.json"
    assert main(["retrieve", "--index", str(tmp_path / "idx"), "--queries", str(queries), "--top-k", "3",
                 "--output", str(out), "--match", "none", "--device", "cpu", "--cache-dir", str(tmp_path / "c")]) == 0
    expected = np.sort(plain.embed("query", ["on " + q for q in QUERIES]) @ passages.T, axis=1)[:, ::-1]
    np.testing.assert_allclose([[c["score"] for c in r["ctxs"]] for r in json.loads(out.read_text())], expected,
                               rtol=0, atol=1e-4)
    capsys.readouterr()
    assert main(["retrieve", "--index", str(tmp_path / "idx"), "--queries", str(queries), "--output", str(out),
                 "--match", "none", "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                 "--passage-prefix", PP]) == 2  # passages were encoded without it
    refusal = (f"error: --passage-prefix {PP!r} differs from the '' the index built from model {tmp_path / 'model'} "
               "was encoded with; drop --passage-prefix ({} then takes the index's) or give ''\n")
    assert capsys.readouterr().err == refusal.format("retrieve")
    train = tmp_path / "train.json"
    train.write_text(json.dumps([{"question": q, "answers": ["zzz"], "positive_ctxs": [PASSAGES[0]]} for q in QUERIES]))
    assert main(["mine", "--source", "dense", "--index", str(tmp_path / "idx"), "--train-file", str(train),
                 "--output", str(tmp_path / "mined.json"), "--corpus", str(corpus), "--device", "cpu",
                 "--cache-dir", str(tmp_path / "c"), "--model", str(tmp_path / "model"), "--passage-prefix", PP]) == 2
    assert capsys.readouterr().err == refusal.format("mine") and not (tmp_path / "mined.json").exists()
    source = open_source("dense", load_corpus(corpus, tmp_path / "c"), model=str(tmp_path / "model"),
                         index=tmp_path / "idx", device="cpu", show_progress=False)
    assert (source.retriever.config.query_prefix, source.retriever.config.passage_prefix) == ("on ", "")


def test_mine_scores_queries_under_the_prefixes_the_index_records(make_retriever, tmp_path):
    """docs/stages.md: mine embeds queries under the prefixes the index records (encode's --query-prefix over the
    model's own): each mined negative's score is the query embedded with that prefix dotted with its passage's
    vector, not the score under the model's own query prefix."""
    retriever = make_retriever(query_prefix=QP, passage_prefix=PP, passage_format="concat")
    retriever.save(tmp_path / "model")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    code, err = call(main, ["encode", "--model", tmp_path / "model", "--output", tmp_path / "emb", "--corpus",
                            corpus, "--query-prefix", "on ", "--dtype", "float32", "--precision", "fp32",
                            "--cache-dir", tmp_path / "c", "--device", "cpu"])
    assert code == 0, err
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    train = tmp_path / "train.json"
    train.write_text(json.dumps([{"question": q, "answers": ["zzz"], "positive_ctxs": [PASSAGES[0]]} for q in QUERIES]))
    code, err = call(main, ["mine", "--source", "dense", "--index", tmp_path / "idx", "--train-file", train,
                            "--corpus", corpus, "--model", tmp_path / "model", "--output", tmp_path / "mined.json",
                            "--n-negatives", "2", "--top-k", "3", "--workers", "1", "--device", "cpu",
                            "--cache-dir", tmp_path / "c"])
    assert code == 0, err
    mined = json.loads((tmp_path / "mined.json").read_text())
    by_id = {p["id"]: p for p in PASSAGES}
    plain = unprefixed(retriever)
    for record in mined:
        negatives = record["hard_negative_ctxs"]
        assert negatives, record
        rows = [by_id[c["passage_id"]] for c in negatives]
        passages = retriever.embed("passage", [p["text"] for p in rows], [p["title"] for p in rows])
        scores = [c["score"] for c in negatives]
        query = plain.embed("query", ["on " + record["question"]])[0]
        np.testing.assert_allclose(scores, passages @ query, rtol=0, atol=1e-4)
        own = retriever.embed("query", [record["question"]])[0]  # the model's own prefix scores otherwise
        assert np.abs(passages @ own - scores).max() > 1e-3
