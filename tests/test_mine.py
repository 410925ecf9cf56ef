"""Hard-negative mining: false negatives never mined, rank range and margin, file round trip, both sources, errors."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from dpr_gc.data.corpus import load_corpus
from dpr_gc.data.training import load_dpr_files
from dpr_gc.retrieval.encode import encode_corpus
from dpr_gc.base.errors import DprGcError, Interrupted
from dpr_gc.evaluation.evaluate import has_answer
from dpr_gc.retrieval.index import DenseIndex, IndexParams, build_index
from dpr_gc.retrieval.mine import (BM25Source, DenseSource, add_cli, iter_training_file, mine_hard_negatives, mine_to_file,
                         open_source)
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import build_passages, N_EXTRA, questions, summary_rows, tiny_bert, TOPICS

CONFIG = dict(pooling="mean", normalize=True, passage_format="concat", query_max_length=32, passage_max_length=48)
QRELS = {f"q{i}": {f"r{i}": 1, f"d{i}_0": 0} for i in range(len(TOPICS))}


def false_negatives(i: int) -> set[str]:
    """Question i's gold passage, its copy, its answer-bearing passages and its qrels positive."""
    return {f"g{i}", f"dup{i}", f"a{i}x", f"a{i}y", f"r{i}"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer) -> dict:
    root = tmp_path_factory.mktemp("mine")
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in build_passages()))
    (root / "train.json").write_text(json.dumps(questions()))
    (root / "q.tsv").write_text("".join(f"{q}\t{d}\t{r}\n" for q, j in QRELS.items() for d, r in j.items()))
    corpus = load_corpus(root / "corpus.jsonl", root / "cache")
    retriever = Retriever(tiny_bert(len(tiny_tokenizer), seed=0), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    retriever.save(root / "model")
    return {"root": root, "corpus": corpus, "retriever": retriever,
            "bm25": BM25Source(corpus, index_dir=root / "bm25", show_progress=False)}


def cli(*argv: object) -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


def check_clean(records: list[dict], n_max: int) -> None:
    for i, (q, r) in enumerate(zip(questions(), records)):
        negs = r["hard_negative_ctxs"]
        assert len(negs) <= n_max
        assert not false_negatives(i) & {c["passage_id"] for c in negs}
        assert not any(has_answer(q["answers"], c["text"]) for c in negs)
        assert [c["rank"] for c in negs] == sorted({c["rank"] for c in negs})
        assert all(a["score"] >= b["score"] - 1e-6 for a, b in zip(negs, negs[1:]))


def test_bm25_never_mines_gold_answer_or_qrels_positives(world):
    corpus, n_q = world["corpus"], len(TOPICS)
    records, summary = mine_hard_negatives(questions(), world["bm25"], corpus, n_negatives=100, top_k=len(corpus),
                                           qrels=QRELS)
    check_clean(records, 100)
    assert [r["id"] for r in records] == [q["id"] for q in questions()]
    src = world["bm25"]
    matching = [np.flatnonzero(src.bm25.get_scores(src.tokenizer.tokenize([q["question"]], update_vocab=False,
                                                                          show_progress=False)[0]) > 0)
                for q in questions()]  # passages sharing a term with the question: the only BM25 candidates
    for r, rows in zip(records, matching):
        assert {c["passage_id"] for c in r["hard_negative_ctxs"]} <= {corpus[int(i)]["id"] for i in rows}
    n_matching = sum(len(m) for m in matching)
    assert (summary.questions, summary.judged, summary.candidates) == (n_q, n_q, n_matching)
    assert (summary.gold_dropped, summary.answer_dropped, summary.qrels_dropped) == (2 * n_q, 2 * n_q, n_q)
    assert summary.written == n_matching - 5 * n_q and summary.short == n_q
    # Each question's own distractors share its topic word, so BM25 ranks them first among the fair negatives.
    for i, r in enumerate(records):
        assert {c["passage_id"] for c in r["hard_negative_ctxs"][:N_EXTRA]} == {f"d{i}_{j}" for j in range(N_EXTRA)}
    table = summary.table()
    assert table["negatives written"] == summary.written and table["min score"] <= table["mean score"]


def test_rank_range_and_margin_selection(world):
    corpus, src = world["corpus"], world["bm25"]
    full, _ = mine_hard_negatives(questions(), src, corpus, n_negatives=100, top_k=len(corpus))
    skipped, summary = mine_hard_negatives(questions(), src, corpus, n_negatives=2, top_k=len(corpus), skip_top=6)
    for a, b in zip(full, skipped):
        assert b["hard_negative_ctxs"] == [c for c in a["hard_negative_ctxs"] if c["rank"] > 6][:2]
    assert summary.rank_skipped > 0 and summary.written == 2 * len(TOPICS)

    golds = [[(next(i for i in range(len(corpus)) if corpus[i]["id"] == f"g{k}"), "", "")] for k in range(len(TOPICS))]
    best = [max(p) for p in src.retrieve([q["question"] for q in questions()], 5, golds)[2]]
    margin = max(b - a["hard_negative_ctxs"][0]["score"] for a, b in zip(full, best)) + 1e-3
    kept, summary = mine_hard_negatives(questions(), src, corpus, n_negatives=3, top_k=len(corpus), margin=margin)
    assert summary.margin_dropped > 0
    for a, b, pos in zip(full, kept, best):
        assert b["hard_negative_ctxs"] == [c for c in a["hard_negative_ctxs"] if c["score"] <= pos - margin][:3]


def test_a_gold_passage_is_never_mined_by_its_id_when_the_training_files_text_differs(world):
    """A gold passage is never mined: by its id even when the training file holds another revision of its text (the
    text rule cannot see it; a question without answers, so the answer rule cannot either)."""
    corpus, src, qs = world["corpus"], world["bm25"], questions()
    qs[0]["answers"] = []
    qs[0]["positive_ctxs"][0]["text"] = "an older revision of the gold passage"
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    assert "g0" not in ids_of(records)[0]
    assert "dup0" in ids_of(records)[0]  # its corpus copy under another id is mined: BM25 ranked g0's text


def test_a_candidate_scoring_exactly_the_margin_below_the_best_positive_is_kept(world):
    """--margin drops candidates scoring above best positive - margin: with --margin 0 a candidate scoring exactly
    what the positive scores is kept, every one above it dropped."""
    corpus, src, qs = world["corpus"], world["bm25"], questions()[:1]
    full, _ = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    negs = full[0]["hard_negative_ctxs"]
    i = next(i for i in range(len(negs) - 1) if negs[i]["score"] == negs[i + 1]["score"])  # a tie to stand on
    positive, twin = negs[i], negs[i + 1]
    qs[0]["positive_ctxs"] = [{"passage_id": positive["passage_id"], "title": positive["title"],
                               "text": positive["text"]}]
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus), margin=0.0)
    assert ids_of(records)[0] == [c["passage_id"] for c in negs[i + 1:]]
    assert ids_of(records)[0][0] == twin["passage_id"] and twin["score"] == positive["score"]
    assert summary.margin_dropped == i > 0


def test_dense_source_mines_clean_negatives_with_true_scores(world):
    root, corpus, retriever = world["root"], world["corpus"], world["retriever"]
    encode_corpus(retriever, root / "corpus.jsonl", root / "emb", 0, 1, dtype="float32", cache_dir=root / "cache",
                  show_progress=False)
    build_index(root / "emb", root / "idx", IndexParams("flat"))
    src = DenseSource(retriever, DenseIndex.read(root / "idx"))
    records, summary = mine_hard_negatives(questions(), src, corpus, n_negatives=5, top_k=len(corpus), qrels=QRELS)
    check_clean(records, 5)
    assert summary.gold_dropped == 2 * len(TOPICS) and summary.written == 5 * len(TOPICS)
    q_emb = retriever.embed("query", [q["question"] for q in questions()])
    for q_vec, r in zip(q_emb, records):
        negs = r["hard_negative_ctxs"]
        p_emb = retriever.embed("passage", [c["text"] for c in negs], titles=[c["title"] for c in negs])
        np.testing.assert_allclose(p_emb @ q_vec, [c["score"] for c in negs], atol=1e-4)
    pos = [float(q_vec @ retriever.embed("passage", [q["positive_ctxs"][0]["text"]],
                                         titles=[q["positive_ctxs"][0]["title"]])[0])
           for q_vec, q in zip(q_emb, questions())]
    kept, summary = mine_hard_negatives(questions(), src, corpus, n_negatives=5, top_k=len(corpus), margin=0.0)
    assert all(c["score"] <= p + 1e-5 for r, p in zip(kept, pos) for c in r["hard_negative_ctxs"])


@pytest.mark.parametrize("name", ["out.json", "out.jsonl.gz"])
def test_written_file_keeps_fields_and_reads_back_as_training_data(world, tmp_path, name):
    records = questions()
    ref, _ = mine_hard_negatives(records[:1], world["bm25"], world["corpus"], n_negatives=3, top_k=20)
    ref_ids = [c["passage_id"] for c in ref[0]["hard_negative_ctxs"]]
    records[0]["hard_negative_ctxs"] = [{"passage_id": "old", "title": "", "text": "kept from before"},
                                        {"passage_id": ref_ids[1], "title": "", "text": "an old copy"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / name
    summary = mine_to_file(iter_training_file(src), out, world["bm25"], world["corpus"], n_negatives=3, top_k=20,
                           append=True, chunk_size=4, show_progress=False)
    assert summary.questions == len(TOPICS)
    with (gzip.open(out, "rt") if name.endswith(".gz") else open(out)) as f:
        written = [json.loads(line) for line in f] if name.endswith(".gz") else json.load(f)
    assert [{k: v for k, v in w.items() if k != "hard_negative_ctxs"} for w in written] == \
           [{k: v for k, v in r.items() if k != "hard_negative_ctxs"} for r in records]
    first = [c["passage_id"] for c in written[0]["hard_negative_ctxs"]]
    assert first == ["old", ref_ids[1], ref_ids[0], ref_ids[2]]  # appended, deduplicated by id
    data = load_dpr_files([out], cache_dir=tmp_path / "cache")
    assert len(data) == len(TOPICS)
    for w, row in zip(written, data.dataset):
        assert [c["id"] for c in row["hard_negatives"]] == [c["passage_id"] for c in w["hard_negative_ctxs"]]
    mine_to_file(iter_training_file(out), tmp_path / "again.json", world["bm25"], world["corpus"], n_negatives=3,
                 top_k=20, show_progress=False)
    assert [len(r["hard_negative_ctxs"]) for r in json.loads((tmp_path / "again.json").read_text())] == [3] * 6



def test_append_counts_the_negatives_it_added_not_those_already_in_the_record(world, tmp_path, capsys, caplog):
    """mine --append said "negatives written" before dropping the mined ids the record already held (it gained 44
    and said 81): written, the score statistics and "questions short of N" now count what was added, and the
    negatives already in the record are their own row and part of the log line."""
    import logging

    root = world["root"]
    base = ("mine", "--corpus", root / "corpus.jsonl", "--cache-dir", tmp_path / "c", "--bm25-index", root / "bm25",
            "--top-k", 20)
    cli(*base, "--train-file", root / "train.json", "--n-negatives", 3, "--output", tmp_path / "first.json")
    first = json.loads((tmp_path / "first.json").read_text())
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        cli(*base, "--train-file", tmp_path / "first.json", "--n-negatives", 5, "--append", "--output",
            tmp_path / "second.json")
    printed = capsys.readouterr().out
    second = json.loads((tmp_path / "second.json").read_text())
    added = [b["hard_negative_ctxs"][len(a["hard_negative_ctxs"]):] for a, b in zip(first, second)]
    n_added, scores = sum(map(len, added)), [c["score"] for negs in added for c in negs]
    assert 0 < n_added < 5 * len(TOPICS) and all(negs[:3] == a["hard_negative_ctxs"]
                                                 for negs, a in zip([b["hard_negative_ctxs"] for b in second], first))
    already = 5 * len(TOPICS) - n_added  # every question found 5; the first 3 of each were there already
    assert f"| negatives written | {n_added} |" in printed, printed
    assert f"| negatives already in the record (not added) | {already} |" in printed
    assert f"| min score | {round(min(scores), 4)} |" in printed
    assert f"| max score | {round(max(scores), 4)} |" in printed
    assert f"| questions short of N | {sum(len(negs) < 5 for negs in added)} |" in printed
    assert summary_rows(printed)["output"] == str(tmp_path / "second.json")
    assert f"{n_added} negatives written ({already} already in the record, not added)" in caplog.text
    capsys.readouterr()
    cli(*base, "--train-file", root / "train.json", "--n-negatives", 3, "--output", tmp_path / "third.json")
    assert "already in the record" not in capsys.readouterr().out  # without --append the row is left off

def test_append_drops_existing_negatives_that_are_gold_answer_bearing_or_qrels_positives(world, tmp_path, capsys,
                                                                                           caplog):
    """mine --append kept a record's existing hard negatives as they were, its gold passage and --qrels positives
    among them, though they are never mined: the existing ones go through the same gold (id or text), answer and
    qrels checks as the mined ones, those failing are dropped and counted in their own row."""
    root, by_id = world["root"], {p["id"]: p for p in build_passages()}
    existing = ["g0", "dup0", "a0x", "r0", "d0_0"]  # gold, gold's text, answer-bearing, qrels positive, a fair one
    record = {**questions()[0], "hard_negative_ctxs": [
        {"passage_id": pid, "title": by_id[pid]["title"], "text": by_id[pid]["text"]} for pid in existing]}
    (tmp_path / "one.json").write_text(json.dumps([record]))
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        cli("mine", "--train-file", tmp_path / "one.json", "--corpus", root / "corpus.jsonl", "--cache-dir",
            tmp_path / "c", "--bm25-index", root / "bm25", "--top-k", 20, "--n-negatives", 3, "--append", "--qrels",
            root / "q.tsv", "--output", tmp_path / "out.json", "--workers", 1)
    rows = summary_rows(capsys.readouterr().out)
    negs = [c["passage_id"] for c in json.loads((tmp_path / "out.json").read_text())[0]["hard_negative_ctxs"]]
    assert negs[0] == "d0_0" and not false_negatives(0) & set(negs), negs
    assert rows["existing negatives dropped"] == "4", rows
    assert "4 existing negatives dropped" in caplog.text
    capsys.readouterr()
    cli("mine", "--train-file", tmp_path / "one.json", "--corpus", root / "corpus.jsonl", "--cache-dir",
        tmp_path / "c", "--bm25-index", root / "bm25", "--top-k", 20, "--output", tmp_path / "plain.json")
    assert "existing negatives dropped" not in capsys.readouterr().out  # without --append the row is left off


def test_bm25_index_is_saved_and_reused_only_for_the_same_corpus(world, tmp_path, monkeypatch):
    import bm25s

    root = world["root"]
    assert (root / "bm25" / "bm25_meta.json").is_file()
    monkeypatch.setattr(bm25s.BM25, "index", lambda *a, **k: pytest.fail("rebuilt a saved BM25 index"))
    again = BM25Source(world["corpus"], index_dir=root / "bm25", show_progress=False)
    qs = [q["question"] for q in questions()]
    for a, b in zip(world["bm25"].retrieve(qs, 10)[:2], again.retrieve(qs, 10)[:2]):
        np.testing.assert_allclose(a, b)
    for change, words in (({"k1": 1.2}, "k1 (k1=0.9)"), ({"b": 0.75}, "b (b=0.4)")):  # refused as made, not damaged
        with pytest.raises(DprGcError, match=re.escape(f"was built with other {words}; give the same corpus and")):
            BM25Source(world["corpus"], index_dir=root / "bm25", **change)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(p) + "\n" for p in build_passages()[:10]))
    with pytest.raises(DprGcError, match="corpus_rows"):
        BM25Source(load_corpus(small, tmp_path / "cache"), index_dir=root / "bm25")
    edited = tmp_path / "edited.jsonl"  # the same ids, one passage's text changed
    rows = build_passages()
    rows[3] = dict(rows[3], text=rows[3]["text"] + " and something new")
    edited.write_text("".join(json.dumps(p) + "\n" for p in rows))
    with pytest.raises(DprGcError, match="corpus_fingerprint"):
        BM25Source(load_corpus(edited, tmp_path / "cache"), index_dir=root / "bm25")


def _swap_rising_pair(indptr: np.ndarray) -> np.ndarray:
    """``indptr`` with two neighbours that rise swapped, so it decreases there while its ends stay right."""
    j = 1 + int(np.flatnonzero(np.diff(indptr[1:-1]) > 0)[0])
    indptr[j], indptr[j + 1] = indptr[j + 1], indptr[j]
    return indptr


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


BM25_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "vocab": (lambda d: (d / "vocab.index.json").write_text('{"a":1}'), "vocab.index.json"),
    "indices": (lambda d: np.save(d / "indices.csc.index.npy", np.full_like(np.load(d / "indices.csc.index.npy"),
                                                                            10**6)), "indices.csc.index.npy"),
    "indices one past": (lambda d: np.save(d / "indices.csc.index.npy", np.full_like(
        np.load(d / "indices.csc.index.npy"), json.loads((d / "params.index.json").read_text())["num_docs"])),
                         "indices.csc.index.npy points outside"),  # row N of N passages: one past the last
    "indptr": (lambda d: np.save(d / "indptr.csc.index.npy", _swap_rising_pair(np.load(d / "indptr.csc.index.npy"))),
               "indptr.csc.index.npy decreases"),
    "data": (lambda d: np.save(d / "data.csc.index.npy", np.load(d / "data.csc.index.npy") * np.nan),
             "data.csc.index.npy"),
    "num_docs": (lambda d: _edit_json(d / "params.index.json", lambda p: p.update(num_docs=3)), "num_docs=3"),
    "tokenizer": (lambda d: _edit_json(d / "vocab.tokenizer.json", lambda v: v["word_to_id"].update(city=10**6)),
                  "vocab.tokenizer.json"),
    "deep": (lambda d: (d / "vocab.index.json").write_text('{"a":' * 5000 + "1" + "}" * 5000), "nested too deeply"),
    **{f"backend {name}": (lambda d, name=name: _edit_json(d / "params.index.json",
                                                           lambda p: p.update(backend=name)), f"backend={name!r}")
       for name in ("numba", "jax", "bogus")},
}


@pytest.mark.parametrize("damage", BM25_DAMAGE)
def test_damaged_bm25_index_is_refused_in_one_line(world, tmp_path, damage):
    """A BM25 index folder whose files disagree (vocabulary ids, CSC arrays, passage count, the tokenizer's copy of
    the vocabulary) is refused before mining, in one line naming the folder, not by a traceback deep in bm25s."""
    from dpr_gc.cli import main
    from tests.helpers import call

    root, folder = world["root"], tmp_path / "bm25"
    shutil.copytree(root / "bm25", folder)
    change, needle = BM25_DAMAGE[damage]
    change(folder)
    code, err = call(main, ["mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl",
                            "--cache-dir", root / "cache", "--bm25-index", folder, "--output", tmp_path / "o.json"])
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {folder}: damaged BM25 index (") and needle in lines[0], err
    assert lines[0].count("damaged BM25 index") == 1, err
    assert lines[0].endswith("delete the folder to rebuild it") and not (tmp_path / "o.json").exists()


def test_question_without_an_indexed_word_gets_no_bm25_candidate(tmp_path):
    """An ordinary question can consist of unseen words or stopwords only: it shares no term with any passage, so it
    gets no candidate (not the passages without an indexed word, which bm25s's empty-text token would match), its
    positive scores 0, mining goes on, and the summary counts it."""
    rows = [("p1", "Seine", "The Seine is a river in Paris."), ("p2", "", "it is a"),
            ("p3", "Thames", "The Thames flows through London.")]
    path = tmp_path / "c.tsv"
    path.write_text("id\ttext\ttitle\n" + "".join(f"{i}\t{x}\t{t}\n" for i, t, x in rows))
    corpus = load_corpus(path, tmp_path / "cache")
    src = BM25Source(corpus, show_progress=False)
    scores, found, positive = src.retrieve(["zyxxy qwertz", "the of and", "paris river"], 3,
                                           [[(1, "", "it is a")], [(0, "", "")], [(0, "", "")]])
    assert (found[:2] == -1).all() and (scores[:2] == 0).all() and positive[:2] == [[0.0], [0.0]]
    assert found[2, 0] == 0 and positive[2][0] > 0
    qs = [{"question": q, "answers": [], "positive_ctxs": [{"passage_id": "p3", "title": "Thames", "text": "x"}]}
          for q in ("zyxxy qwertz", "paris river")]
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=2, top_k=3)
    assert records[0]["hard_negative_ctxs"] == [] and [c["passage_id"] for c in records[1]["hard_negative_ctxs"]] \
        == ["p1"]
    assert summary.no_candidates == 1 and summary.table()["questions without a candidate"] == 1


def test_bm25_indexes_each_passages_title_with_its_text(tmp_path):
    """BM25Source's promise: the index is over ``title + " " + text``, so a question naming a passage's title alone
    finds it (and only it: the other passages share no word with the question)."""
    rows = [("p1", "Zanzibar", "An island off the coast."), ("p2", "", "A city by a river."),
            ("p3", "Thames", "It flows through London.")]
    path = tmp_path / "c.tsv"
    path.write_text("id\ttext\ttitle\n" + "".join(f"{i}\t{x}\t{t}\n" for i, t, x in rows))
    scores, found, _ = BM25Source(load_corpus(path, tmp_path / "cache"), show_progress=False).retrieve(
        ["where is zanzibar", "the thames"], 3)
    assert found.tolist() == [[0, -1, -1], [2, -1, -1]] and (scores[:, 0] > 0).all(), (found, scores)


def beir_folder(beir: Path) -> Path:
    """A BEIR folder of the test passages and questions (plus an unjudged query), positives in qrels/train.tsv."""
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": p["id"], "title": p["title"], "text": p["text"]})
                                               + "\n" for p in build_passages()))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": q["id"], "text": q["question"]}) + "\n"
                                                for q in questions() + [{"id": "extra", "question": "unjudged"}]))
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\tg{i}\t1\nq{i}\tr{i}\t1\n" for i in range(len(TOPICS))))
    return beir


def test_dense_mining_takes_the_model_the_index_records_as_retrieve_does(world, tmp_path, caplog):
    """An index built by dpr-gc index records its model: `mine --source dense --index IDX` without --model uses it
    (said in the log), mining what --model gives; with neither, one line before the corpus is read."""
    root = world["root"]
    common = ("--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache",
              "--n-negatives", 2, "--top-k", 20, "--device", "cpu", "--source", "dense")
    cli("mine", *common, "--model", root / "model", "--embeddings", tmp_path / "emb", "--index", tmp_path / "idx",
        "--output", tmp_path / "given.json")
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        cli("mine", *common, "--index", tmp_path / "idx", "--output", tmp_path / "recorded.json")
    assert f"model {root / 'model'} (recorded in the index)" in caplog.messages
    assert json.loads((tmp_path / "recorded.json").read_text()) == json.loads((tmp_path / "given.json").read_text())
    with pytest.raises(DprGcError, match=r"^--source dense needs --model"):
        cli("mine", *common, "--embeddings", tmp_path / "emb", "--index", tmp_path / "none",
            "--output", tmp_path / "x.json")


NEEDS_INDEX = ("--source dense needs --index DIR (from dpr-gc index; it records the model and corpus) or "
               "--embeddings DIR with --model and --corpus")


@pytest.mark.parametrize("given", [(), ("--corpus",), ("--model", "--corpus")])
def test_dense_mining_without_an_index_says_what_it_needs_in_one_line_before_loading(world, tmp_path, monkeypatch,
                                                                                    given):
    """`mine --source dense` with neither --index nor --embeddings asked for --corpus, then --model, and only after
    the model loaded for --index or --embeddings, though --index alone is enough: one line says so first."""
    monkeypatch.setattr(Retriever, "load", lambda *a, **k: pytest.fail("the model loaded"))
    paths = {"--corpus": world["root"] / "corpus.jsonl", "--model": world["root"] / "model"}
    with pytest.raises(DprGcError) as refused:
        cli("mine", "--train-file", world["root"] / "train.json", "--source", "dense",
            *[word for flag in given for word in (flag, paths[flag])], "--output", tmp_path / "o.json")
    assert str(refused.value) == NEEDS_INDEX
    (tmp_path / "none").mkdir(exist_ok=True)  # a folder holding no index (a missing one is named by its flag)
    with pytest.raises(DprGcError, match=f"^no index in {re.escape(str(tmp_path / 'none'))}; " + re.escape(NEEDS_INDEX)):
        cli("mine", "--train-file", world["root"] / "train.json", "--source", "dense", "--index", tmp_path / "none",
            "--output", tmp_path / "o.json")


def test_cli_bm25_dense_and_beir(world, tmp_path, capsys):
    root = world["root"]
    common = ("--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache", "--n-negatives", 2, "--top-k", 20)
    cli("mine", "--train-file", root / "train.json", "--output", tmp_path / "bm25.jsonl", *common,
        "--bm25-index", root / "bm25", "--margin", 0, "--qrels", root / "q.tsv")
    printed = capsys.readouterr().out
    assert "| negatives written | 12 |" in printed and "| questions judged in --qrels | 6 |" in printed
    assert "| qrels positives dropped |" in printed
    cli("mine", "--source", "dense", "--model", root / "model", "--embeddings", tmp_path / "emb", "--index",
        tmp_path / "idx", "--train-file", root / "train.json", "--output", tmp_path / "dense.json", "--device", "cpu",
        *common)
    assert (tmp_path / "idx" / "index_meta.json").is_file() and "| source | dense |" in capsys.readouterr().out
    check_clean(json.loads((tmp_path / "dense.json").read_text()), 2)

    beir = beir_folder(tmp_path / "beir")
    cli("mine", "--beir-dir", beir, "--output", tmp_path / "beir.json", "--cache-dir", tmp_path / "cache",
        "--n-negatives", 2, "--top-k", 20, "--margin", 0.5)
    printed = capsys.readouterr().out  # positives from the BEIR qrels, no --qrels filter: no row about one
    assert "| questions | 6 |" in printed and "--qrels" not in printed and "questions in qrels" not in printed
    assert "qrels positives dropped" not in printed  # the BEIR qrels' positives count as gold
    written = json.loads((tmp_path / "beir.json").read_text())
    assert [[c["passage_id"] for c in w["positive_ctxs"]] for w in written] == [[f"g{i}", f"r{i}"] for i in range(6)]
    for i, w in enumerate(written):  # BEIR queries have no answers: gold (by id or text) and qrels positives go
        assert not {c["passage_id"] for c in w["hard_negative_ctxs"]} & {f"g{i}", f"dup{i}", f"r{i}"}
    assert len(load_dpr_files([tmp_path / "beir.json"], cache_dir=tmp_path / "cache")) == len(TOPICS)


def test_mine_finds_the_gzipped_qrels_of_a_beir_folder(world, tmp_path):
    """``mine --beir-dir`` reads ``qrels/SPLIT.tsv.gz`` where the folder holds no ``qrels/SPLIT.tsv``, as it reads
    ``corpus.jsonl.gz`` and ``queries.jsonl.gz``: the same records as from the plain file."""
    beir = beir_folder(tmp_path / "beir")
    common = ("--cache-dir", tmp_path / "cache", "--n-negatives", 2, "--top-k", 20)
    cli("mine", "--beir-dir", beir, "--output", tmp_path / "plain.json", *common)
    qrels = beir / "qrels" / "train.tsv"
    (beir / "qrels" / "train.tsv.gz").write_bytes(gzip.compress(qrels.read_bytes()))
    qrels.unlink()
    cli("mine", "--beir-dir", beir, "--output", tmp_path / "gz.json", *common)
    assert json.loads((tmp_path / "gz.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
    with pytest.raises(DprGcError, match=rf"^{beir} has no qrels/dev.tsv \(or qrels/dev.tsv.gz\); its qrels splits: "
                                         "train$"):
        cli("mine", "--beir-dir", beir, "--output", tmp_path / "dev.json", "--split", "dev", *common)


def test_the_log_says_where_candidates_come_from_and_how_answers_are_matched(world, tmp_path, caplog):
    """One line at the start: BM25's parameters and scoring threads, or the dense encoder's device, precision and
    batch with the index's search settings and FAISS threads; the candidates per question and the matching
    processes (--workers 0: all cores)."""
    import torch

    from dpr_gc.evaluation.answers import default_workers
    from dpr_gc.retrieval.index import faiss_threads

    root = world["root"]
    common = ("--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache",
              "--top-k", 20)
    with caplog.at_level("INFO", logger="dpr_gc.retrieval.mine"):
        cli("mine", *common, "--output", tmp_path / "bm25.json", "--threads", 1, "--workers", 1)
        cli("mine", *common, "--output", tmp_path / "dense.json", "--source", "dense", "--model", root / "model",
            "--embeddings", tmp_path / "emb", "--index", tmp_path / "idx", "--device", "cpu", "--batch-size", 8)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("candidates:")]
    processes = f"{default_workers()} process" + ("es" if default_workers() != 1 else "")
    cpu = f"{torch.get_num_threads()} CPU thread" + ("s" if torch.get_num_threads() != 1 else "")
    assert lines == ["candidates: BM25 (k1 0.9, b 0.4, 1 scoring thread), top 20 per question; answers matched with "
                     "string matching in 1 process",
                     f"candidates: dense (questions encoded on cpu in fp32, batch 8; {cpu}; index Flat of "
                     f"{len(world['corpus'])} vectors, search exact, FAISS threads {faiss_threads()}), top 20 per "
                     f"question; answers matched with string matching in {processes}"], lines


def test_the_dense_log_gives_the_encoder_threads_and_the_ef_search_that_runs(tmp_path):
    """mine's dense line names the question encoder's CPU threads (--threads bounds them too: its help says so) and
    the efSearch a --top-k search runs with: an HNSW index's 2 is raised to --top-k 20."""
    import torch

    from dpr_gc.retrieval.mine import describe_source

    index = DenseIndex.build(8, IndexParams("hnsw", hnsw_m=4, ef_search=2))
    index.add(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32))
    threads = torch.get_num_threads()
    line = describe_source(DenseSource(torch.nn.Linear(1, 1), index, 8), 20)
    assert line.startswith(f"dense (questions encoded on cpu in fp32, batch 8; {threads} CPU thread")
    assert "search efSearch 20 (raised to --top-k 20), FAISS threads" in line
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    helped = " ".join(parser._subparsers._group_actions[0].choices["mine"].format_help().split())
    assert "also bounds the question encoder's CPU threads" in helped


def test_mining_progress_bar_counts_to_the_number_of_questions(world, tmp_path, monkeypatch):
    """Each source and input gives the "mining" bar its total, the questions (a streamed --train-file is counted in
    the pass that checks it), and the bar ends there."""
    import dpr_gc.retrieval.mine as mine

    root, bars, real = world["root"], [], mine.tqdm

    def recorded(*args, **kwargs):
        bars.append(real(*args, **kwargs))
        bars[-1].asked_for = not kwargs.get("disable")  # close() turns disable on
        return bars[-1]

    monkeypatch.setattr(mine, "tqdm", recorded)
    beir = beir_folder(tmp_path / "beir")
    common = ("--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache", "--n-negatives", 2, "--top-k", 20)
    dense = ("--source", "dense", "--model", root / "model", "--embeddings", tmp_path / "emb", "--index",
             tmp_path / "idx", "--device", "cpu")
    for i, (source, given) in enumerate([(dense, ("--train-file", root / "train.json")), (dense, ("--beir-dir", beir)),
                                         (("--source", "bm25"), ("--train-file", root / "train.json")),
                                         (("--source", "bm25"), ("--beir-dir", beir))]):
        bars.clear()
        cli("mine", *given, *source, *common, "--output", tmp_path / f"out{i}.jsonl")
        # the library's bar, within each chunk, is off
        (bar,) = [b for b in bars if getattr(b, "unit", None) == " q" and b.asked_for]
        assert (bar.total, bar.n) == (len(TOPICS), len(TOPICS)), (source[1], given[0])


def test_the_librarys_mining_bar_counts_questions(tmp_path, monkeypatch):
    """``mine_hard_negatives(show_progress=True)`` counted chunks of 1,024 questions (2 for 1,030: no rate or ETA
    in questions); it counts the questions, as the command's bar does."""
    import dpr_gc.retrieval.mine as mine

    path = tmp_path / "c.tsv"
    path.write_text("id\ttext\ttitle\np1\tThe Seine is a river in Paris.\tSeine\n")
    corpus = load_corpus(path, tmp_path / "cache")
    bars, real = [], mine.tqdm
    monkeypatch.setattr(mine, "tqdm", lambda *a, **kw: bars.append(real(*a, **kw)) or bars[-1])
    qs = [{"question": f"paris river {i}", "answers": [], "positive_ctxs": []} for i in range(1030)]
    records, _ = mine_hard_negatives(qs, BM25Source(corpus, show_progress=False), corpus, n_negatives=1, top_k=1,
                                     show_progress=True)
    (bar,) = bars
    assert len(records) == 1030 and (bar.unit, bar.total, bar.n) == (" q", 1030, 1030), (bar.unit, bar.total, bar.n)


def test_dense_embeddings_without_an_index_folder_are_refused_before_encoding(world, tmp_path, monkeypatch):
    """``--embeddings E`` builds a flat index, which may not lie inside E (an output inside an input): without
    ``--index`` the run is refused at once, naming the flag, before the model loads or the corpus is encoded."""
    from dpr_gc.model.retriever import Retriever

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(Retriever, "load", no_load)
    root = world["root"]
    with pytest.raises(DprGcError, match=re.escape(f"give --index DIR for the flat index built from --embeddings "
                                                   f"{tmp_path / 'emb'}")):
        cli("mine", "--source", "dense", "--model", root / "model", "--embeddings", tmp_path / "emb", "--device",
            "cpu", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--cache-dir",
            root / "cache", "--output", tmp_path / "dense.json")
    assert not (tmp_path / "emb").exists() and not (tmp_path / "dense.json").exists()


def test_answer_patterns_that_do_not_compile_are_named_before_the_corpus_is_read(tmp_path, caplog):
    """stages.md: mine --match regex warns once, while checking the training file (before the corpus is read),
    naming the file, the count and the first lines with the regex error, as retrieve and evaluate do: such a
    pattern never matches, so the passage holding the answer can be mined as a hard negative (it was, silently)."""
    corpus, train = tmp_path / "c.tsv", tmp_path / "rx.jsonl"
    corpus.write_text("id\ttext\ttitle\nans1\tMany rivers exist; the SEINE is famous.\tRivers\n"
                      "p1\tsomething else entirely\tT\n")
    record = {"question": "which rivers exist and are famous", "answers": ["(SEINE"],
              "positive_ctxs": [{"title": "x", "text": "unrelated", "passage_id": "zz"}]}
    train.write_text(json.dumps({**record, "answers": ["some(thing)"]}) + "\n" + json.dumps(record) + "\n")
    with caplog.at_level("INFO", logger="dpr_gc"):
        cli("mine", "--train-file", train, "--corpus", corpus, "--output", tmp_path / "out.jsonl", "--n-negatives", 3,
            "--top-k", 5, "--workers", 1, "--match", "regex", "--cache-dir", tmp_path / "cache")
    messages = [r.getMessage() for r in caplog.records]
    warning = (f"{train}: 1 answer pattern does not compile (line 2: '(SEINE': missing ) at position 6); they never "
               "match, as in DPR, so a passage holding such an answer may be mined as a hard negative")
    assert messages.count(warning) == 1, messages
    assert messages.index(warning) < next(i for i, m in enumerate(messages) if "passages from" in m)


def test_bad_inputs_give_one_line_errors(world, tmp_path):
    root, corpus, src = world["root"], world["corpus"], world["bm25"]
    base = ("mine", "--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache", "--output", tmp_path / "o.json")
    with pytest.raises(DprGcError, match="--train-file not found"):
        cli(*base, "--train-file", tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("[]\n")
    with pytest.raises(DprGcError, match="no training questions"):
        cli(*base, "--train-file", tmp_path / "empty.json", "--bm25-index", root / "bm25")
    assert not (tmp_path / "o.json").exists()
    (tmp_path / "bad.jsonl").write_text(json.dumps(questions()[0]) + "\n" + json.dumps({"answers": []}) + "\n")
    with pytest.raises(DprGcError, match=r"bad.jsonl:2: missing field 'question'"):
        list(iter_training_file(tmp_path / "bad.jsonl"))
    with pytest.raises(SystemExit):  # refused as the command line is parsed (test_bad_inputs: one error line)
        cli(*base, "--train-file", root / "train.json", "--source", "tfidf")
    with pytest.raises(DprGcError, match="unknown --source"):
        open_source("splade", corpus)
    with pytest.raises(DprGcError, match="needs --model"):
        open_source("dense", corpus)
    for kwargs, message in (({"n_negatives": 0}, "--n-negatives"), ({"n_negatives": 1, "skip_top": 5, "top_k": 5},
                            "--skip-top"), ({"n_negatives": 1, "match": "fuzzy"}, "--match")):
        with pytest.raises(DprGcError, match=message):
            mine_hard_negatives(questions(), src, corpus, **kwargs)
    with pytest.raises(DprGcError, match="exactly one of --train-file"):
        cli(*base)


def test_candidates_are_tokenised_once_across_chunks(world, tmp_path, monkeypatch):
    """One matcher serves the whole file: a candidate seen by several questions or chunks is tokenised once, and the
    output does not depend on the chunking or the number of answer-matching workers."""
    from dpr_gc.evaluation import answers

    corpus = world["corpus"]
    with answers.AnswerMatcher() as matcher:
        _, summary = mine_hard_negatives(questions(), world["bm25"], corpus, n_negatives=3, top_k=len(corpus),
                                         matcher=matcher)
        distinct = matcher.prepared
    assert distinct < summary.candidates  # questions share candidates
    outputs, real = [], answers.prepare_passage
    for chunk_size, workers in ((len(TOPICS), 1), (1, 1), (2, 2)):
        seen: list[str] = []
        monkeypatch.setattr(answers, "prepare_passage", lambda t, m: seen.append(t) or real(t, m))
        out = tmp_path / f"out-{chunk_size}-{workers}.jsonl"
        mine_to_file(questions(), out, world["bm25"], corpus, n_negatives=3, top_k=len(corpus),
                     chunk_size=chunk_size, workers=workers, show_progress=False)
        assert len(seen) == distinct
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] == outputs[2]


# ------------------------------------------------------------------------------------------ positive-aware mining
def two_positive_questions() -> list[dict]:
    """Each question with two positives, its gold passage and its qrels positive ``r<i>``, which score differently."""
    out = questions()
    for i, (q, t) in enumerate(zip(out, TOPICS)):
        q["positive_ctxs"].append({"passage_id": f"r{i}", "title": t, "text": f"{t} protein cell science"})
    return out


def bm25_positive_scores(world, qs: list[dict]) -> list[list[float]]:
    """Each question's positives' BM25 scores, computed here from bm25s's score vector."""
    src, ids = world["bm25"], list(world["corpus"]["id"])
    out = []
    for q in qs:
        tokens = src.tokenizer.tokenize([q["question"]], update_vocab=False, show_progress=False)[0]
        vector = src.bm25.get_scores(tokens)
        out.append([float(vector[ids.index(c["passage_id"])]) for c in q["positive_ctxs"]])
    return out


def kept_and_removed(full: list[dict], ceilings: list[float]) -> tuple[list[list[str]], int]:
    """The negatives of ``full`` at or below each question's ceiling (ids), and how many are above."""
    kept = [[c["passage_id"] for c in r["hard_negative_ctxs"] if c["score"] <= cap] for r, cap in zip(full, ceilings)]
    return kept, sum(len(r["hard_negative_ctxs"]) for r in full) - sum(map(len, kept))


def ids_of(records: list[dict]) -> list[list[str]]:
    return [[c["passage_id"] for c in r["hard_negative_ctxs"]] for r in records]


def test_positive_aware_filters_remove_exactly_the_candidates_above_the_lowest_positive(world):
    corpus, src, qs = world["corpus"], world["bm25"], two_positive_questions()
    pos = bm25_positive_scores(world, qs)
    assert all(min(p) < max(p) for p in pos)  # so the lowest positive, not the best, is what the rules must use
    full, _ = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    ratios = sorted(c["score"] / min(p) for r, p in zip(full, pos) for c in r["hard_negative_ctxs"])
    ratio = ratios[len(ratios) // 2]
    kept, removed = kept_and_removed(full, [ratio * min(p) for p in pos])
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus),
                                           max_negative_ratio=ratio)
    assert ids_of(records) == kept and 0 < removed < len(ratios)
    assert (summary.ratio_dropped, summary.min_margin_dropped, summary.unscored) == (removed, 0, 0)
    assert summary.written == len(ratios) - removed and summary.table()["dropped by max negative ratio"] == removed

    gaps = sorted(min(p) - c["score"] for r, p in zip(full, pos) for c in r["hard_negative_ctxs"])
    margin = gaps[len(gaps) // 3]
    kept_m, removed_m = kept_and_removed(full, [min(p) - margin for p in pos])
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus), min_margin=margin)
    assert ids_of(records) == kept_m and summary.min_margin_dropped == removed_m > 0

    both, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus),
                                        max_negative_ratio=ratio, min_margin=margin)
    ceilings = [min(ratio * min(p), min(p) - margin) for p in pos]
    kept_b, removed_b = kept_and_removed(full, ceilings)
    assert ids_of(both) == kept_b
    assert summary.ratio_dropped == removed and summary.ratio_dropped + summary.min_margin_dropped == removed_b
    first3, _ = mine_hard_negatives(qs, src, corpus, n_negatives=3, top_k=len(corpus), max_negative_ratio=ratio)
    assert ids_of(first3) == [k[:3] for k in kept]  # the first N that pass, by rank

    qs[0]["positive_ctxs"].append({"passage_id": "f0", "title": "", "text": corpus[len(corpus) - 6]["text"]})
    assert bm25_positive_scores(world, qs)[0][-1] == 0  # a positive sharing no word with the question
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus),
                                           max_negative_ratio=ratio)
    assert ids_of(records)[0] == [c for c in ids_of(full)[0] if c != "f0"]  # a ratio of 0 would drop all: skipped
    assert ids_of(records)[1:] == kept[1:] and summary.ratio_unapplied == 1


def test_positive_aware_filters_use_the_dense_models_positive_scores(world, tmp_path):
    root, corpus, retriever = world["root"], world["corpus"], world["retriever"]
    encode_corpus(retriever, root / "corpus.jsonl", tmp_path / "emb", 0, 1, dtype="float32",
                  cache_dir=root / "cache", show_progress=False)
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    src, qs = DenseSource(retriever, DenseIndex.read(tmp_path / "idx")), two_positive_questions()
    q_emb = retriever.embed("query", [q["question"] for q in qs])
    pos = [(retriever.embed("passage", [c["text"] for c in q["positive_ctxs"]],
                            titles=[c["title"] for c in q["positive_ctxs"]]) @ v).tolist() for q, v in zip(qs, q_emb)]
    full, _ = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    gaps = sorted(min(p) - c["score"] for r, p in zip(full, pos) for c in r["hard_negative_ctxs"])
    margin, ratio = gaps[len(gaps) // 2], 0.9
    ceilings = [min(min(p) - margin, ratio * min(p) if min(p) > 0 else np.inf) for p in pos]
    kept, removed = kept_and_removed(full, ceilings)
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus), min_margin=margin,
                                           max_negative_ratio=ratio)
    assert ids_of(records) == kept and summary.ratio_dropped + summary.min_margin_dropped == removed > 0


def test_mine_cli_reports_each_rules_removals_and_resumes_with_them(world, tmp_path, capsys, caplog):
    import logging

    from dpr_gc.retrieval.mine import RESUME_FLAGS
    from tests.helpers import Recording

    root, corpus, qs = world["root"], world["corpus"], two_positive_questions()
    (tmp_path / "train.json").write_text(json.dumps(qs))
    _, ref = mine_hard_negatives(qs, world["bm25"], corpus, n_negatives=2, top_k=20, max_negative_ratio=0.7,
                                 min_margin=0.7)
    assert ref.ratio_dropped > 0 and ref.min_margin_dropped > 0
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        cli("mine", "--train-file", tmp_path / "train.json", "--output", tmp_path / "out.jsonl", "--corpus",
            root / "corpus.jsonl", "--cache-dir", root / "cache", "--bm25-index", root / "bm25", "--n-negatives", 2,
            "--top-k", 20, "--max-negative-ratio", 0.7, "--min-margin", 0.7)
    printed = capsys.readouterr().out
    assert f"| dropped by max negative ratio | {ref.ratio_dropped} |" in printed
    assert f"| dropped by min margin | {ref.min_margin_dropped} |" in printed
    assert "dropped by margin" not in printed and "skipped by rank" not in printed  # rules off: no rows of zeros
    assert f"{ref.ratio_dropped} by --max-negative-ratio 0.7, {ref.min_margin_dropped} by --min-margin 0.7" in \
        caplog.text
    assert {"max_negative_ratio", "min_margin"} <= set(RESUME_FLAGS)  # a changed rule never resumes an old run

    rows = {p: corpus["id"].index(p) for q in qs for p in (c["passage_id"] for c in q["positive_ctxs"])}
    common = dict(n_negatives=2, top_k=20, chunk_size=2, show_progress=False, max_negative_ratio=0.7, min_margin=0.7,
                  id_to_row=rows)  # a wrapped BM25 source is not recognised as one: the positives' rows are given
    out, key = tmp_path / "resumed.jsonl", {"inputs": "the same"}
    with pytest.raises(KeyboardInterrupt) as nothing_kept:  # inside the first chunk: no advice of its own
        mine_to_file(qs, out, Recording(world["bm25"], fail_at=1), corpus, resume_key=key, **common)
    assert not isinstance(nothing_kept.value, Interrupted)
    with pytest.raises(Interrupted, match=f"^2 questions mined are kept in {tmp_path / '.resumed.jsonl.partial'}; "
                       "run the same command again to continue after them$"):
        mine_to_file(qs, out, Recording(world["bm25"], fail_at=2), corpus, resume_key=key, **common)
    again = Recording(world["bm25"])
    summary = mine_to_file(qs, out, again, corpus, resume_key=key, **common)
    assert len(again.asked) == 2 and summary == ref  # counts of the interrupted part survive the resume
    assert out.read_text() == (tmp_path / "out.jsonl").read_text()


@pytest.mark.parametrize("flag,value,message", [("--max-negative-ratio", "0", "is not a positive number"),
                                                ("--max-negative-ratio", "nan", "is not a positive number"),
                                                ("--min-margin", "inf", "is not a finite number"),
                                                ("--min-margin", "x", "is not a finite number")])
def test_bad_positive_aware_values_give_one_error_line(world, tmp_path, capsys, flag, value, message):
    from dpr_gc.cli import main

    root = world["root"]
    assert main(["mine", "--train-file", str(root / "train.json"), "--output", str(tmp_path / "o.json"),
                 "--corpus", str(root / "corpus.jsonl"), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and flag in err[0] and message in err[0]
    assert not (tmp_path / "o.json").exists()


def test_bad_positive_aware_values_in_the_library(world):
    corpus, src = world["corpus"], world["bm25"]
    for kwargs, message in (({"max_negative_ratio": 0.0}, "--max-negative-ratio"),
                            ({"max_negative_ratio": float("inf")}, "--max-negative-ratio"),
                            ({"min_margin": float("nan")}, "--min-margin")):
        with pytest.raises(DprGcError, match=message):
            mine_hard_negatives(questions(), src, corpus, n_negatives=2, **kwargs)
        with pytest.raises(DprGcError, match=message):
            mine_to_file(questions(), world["root"] / "never.json", src, corpus, n_negatives=2, show_progress=False,
                         **kwargs)
    assert not (world["root"] / "never.json").exists()


@pytest.mark.parametrize("jax_first", [False, True])
def test_bm25_mining_does_not_start_jax_in_a_process_that_forks(tmp_path, jax_first):
    """bm25s imports JAX where it is installed and starts XLA's threads; mining forks answer-matching workers
    afterwards. Loaded through import_bm25s, bm25s takes its numpy top-k and JAX's backend stays down, also in a
    process that imported JAX before; JAX still imports and runs for whoever wants it after."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed, so bm25s cannot start it")
    probe = ("import sys\n" + ("import jax\n" if jax_first else "") +
             "from dpr_gc.retrieval.bm25 import import_bm25s\nbm25s = import_bm25s()\nimport bm25s.selection\n"
             "from jax._src import xla_bridge\n"
             "print(bm25s.selection.JAX_IS_AVAILABLE, bool(xla_bridge._backends))\n"
             "import jax.numpy\nprint(jax.numpy.zeros(2).shape)\n")
    repo = str(Path(__file__).resolve().parents[1])  # this checkout's dpr_gc, whatever pip has installed
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": repo})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False False", "(2,)"]


def test_a_dense_run_resumes_only_with_the_same_encoder_and_prefixes(world, tmp_path, monkeypatch):
    """The resume key of ``dpr-gc mine`` holds the query encoder's weights and settings: the same command gives the
    same key; another --query-prefix, or retrained weights in the same folder, give another (else a re-run would
    resume and mix the candidates of two encoders)."""
    import shutil

    import torch

    import dpr_gc.retrieval.mine as mine

    keys = []
    monkeypatch.setattr(mine, "mine_to_file",
                        lambda *a, resume_key, **k: keys.append(resume_key) or mine.MiningSummary())
    root, model = world["root"], tmp_path / "model"
    shutil.copytree(root / "model", model)
    argv = ("mine", "--source", "dense", "--model", model, "--embeddings", tmp_path / "emb", "--index",
            tmp_path / "idx", "--train-file", root / "train.json", "--output", tmp_path / "dense.json", "--device",
            "cpu", "--corpus", root / "corpus.jsonl", "--cache-dir", root / "cache")
    cli(*argv)
    cli(*argv)
    cli(*argv, "--query-prefix", "query: ")
    assert keys[0] == keys[1] and keys[0] != keys[2]
    retriever = Retriever.load(model)
    with torch.no_grad():
        next(retriever.query_encoder.parameters()).add_(1.0)
    shutil.rmtree(model)
    retriever.save(model)
    cli(*argv, "--skip-model-check")  # the passages were encoded by the old weights
    assert keys[3]["encoder"] != keys[0]["encoder"]


def test_an_input_edited_with_its_size_and_mtime_restored_is_not_resumed_into(world, tmp_path, monkeypatch):
    """The resume key of ``dpr-gc mine`` holds its inputs' content fingerprints: a training file or qrels edited in
    place with the same size and modification time (``cp -p``, rsync, a checkout) gives another key, so the re-run
    starts over instead of continuing with chunks mined from the old text; an unchanged input gives the same key."""
    import os

    import dpr_gc.retrieval.mine as mine

    keys = []
    monkeypatch.setattr(mine, "mine_to_file",
                        lambda *a, resume_key, **k: keys.append(resume_key) or mine.MiningSummary())
    train, qrels = tmp_path / "train.json", tmp_path / "q.tsv"
    shutil.copy(world["root"] / "train.json", train)
    shutil.copy(world["root"] / "q.tsv", qrels)
    argv = ("mine", "--train-file", train, "--qrels", qrels, "--output", tmp_path / "out.json", "--corpus",
            world["root"] / "corpus.jsonl", "--cache-dir", world["root"] / "cache", "--bm25-index",
            world["root"] / "bm25")

    def edit_keeping_size_and_mtime(path: Path, old: str, new: str) -> None:
        stat, text = path.stat(), path.read_text()
        assert len(old) == len(new) and old in text
        path.write_text(text.replace(old, new, 1))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    cli(*argv)
    cli(*argv)
    question = questions()[0]["question"]
    edit_keeping_size_and_mtime(train, question, question[::-1])
    cli(*argv)
    edit_keeping_size_and_mtime(qrels, "\tr0\t1", "\tr0\t0")
    cli(*argv)
    assert keys[0] == keys[1] and len({json.dumps(k, sort_keys=True) for k in keys[1:]}) == 3


def test_a_piped_training_file_gives_the_same_resume_key_for_the_same_text(world, tmp_path, monkeypatch):
    """``mine --train-file <(...)`` reads a new temporary copy at every run: its resume key holds the copy's content,
    not its path or time, so the same text piped again resumes the run, and other text starts over."""
    import os
    import threading

    import dpr_gc.retrieval.mine as mine

    keys = []
    monkeypatch.setattr(mine, "mine_to_file",
                        lambda *a, resume_key, **k: keys.append(resume_key) or mine.MiningSummary())
    text = (world["root"] / "train.json").read_text()
    question = questions()[0]["question"]
    for data in (text, text, text.replace(question, question[::-1], 1)):
        fifo = tmp_path / "train-pipe"
        os.mkfifo(fifo)
        feeder = threading.Thread(target=lambda: fifo.write_text(data), daemon=True)
        feeder.start()
        cli("mine", "--train-file", fifo, "--output", tmp_path / "out.json", "--corpus", world["root"] / "corpus.jsonl",
            "--cache-dir", tmp_path / "cache", "--bm25-index", world["root"] / "bm25")
        feeder.join(10)
        fifo.unlink()
    assert keys[0] == keys[1] and keys[1] != keys[2]


def test_the_resume_key_holds_each_inputs_size_and_mtime(world, tmp_path, monkeypatch):
    """The resume key of ``dpr-gc mine`` holds each input's size and modification time besides its content
    fingerprint: the fingerprint of a file over 256 MiB hashes sampled blocks only (made so here for every file), so
    an edit between them, or a file only touched, gives another key and the re-run starts over."""
    import os

    import dpr_gc.data.corpus as corpus_mod
    import dpr_gc.retrieval.mine as mine

    monkeypatch.setattr(corpus_mod, "FULL_HASH_BYTES", 0)  # every file "large": only its first and last 16 bytes
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCK_BYTES", 16)
    keys = []
    monkeypatch.setattr(mine, "mine_to_file",
                        lambda *a, resume_key, **k: keys.append(resume_key) or mine.MiningSummary())
    train = tmp_path / "train.json"
    shutil.copy(world["root"] / "train.json", train)
    argv = ("mine", "--train-file", train, "--output", tmp_path / "out.json", "--corpus",
            world["root"] / "corpus.jsonl", "--cache-dir", tmp_path / "cache", "--bm25-index", tmp_path / "bm25")
    cli(*argv)
    cli(*argv)
    stat, fingerprint = train.stat(), corpus_mod.source_fingerprint(train)
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched
    cli(*argv)
    question = questions()[1]["question"]
    train.write_text(train.read_text().replace(question, question[::-1], 1))  # between the sampled ends
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    assert corpus_mod.source_fingerprint(train) == fingerprint
    cli(*argv)
    assert keys[0] == keys[1] and len({json.dumps(k, sort_keys=True) for k in keys[1:]}) == 3


def test_two_runs_sharing_a_bm25_folder_build_it_one_at_a_time(world, tmp_path):
    """While one run builds (or loads) a BM25 folder, another waits for it, then loads what it saved: two builders
    writing one folder in turn could leave one corpus's vocabulary beside another's score matrix."""
    import fcntl
    import threading

    folder, built = tmp_path / "bm25", []
    with open(tmp_path / ".bm25.lock", "w") as held:  # what a running build of that folder holds
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: built.append(BM25Source(world["corpus"], index_dir=folder,
                                                                         show_progress=False)))
        second.start()
        second.join(1.0)
        assert second.is_alive() and not folder.exists(), "the second run did not wait for the first"
        fcntl.flock(held, fcntl.LOCK_UN)
    second.join(60)
    assert not second.is_alive() and built and (folder / "bm25_meta.json").is_file()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_bm25_folder_holding_other_files_is_refused(world, tmp_path):
    """``--bm25-index DIR`` holding the user's files and no BM25 index is refused before anything is written, naming
    the flag and a file it holds (hidden ones too); a folder an interrupted build left (the index's own files, the
    metadata's temporary) is built into, and a finished index is read even with a note beside it."""
    root, folder, cache = world["root"], tmp_path / "bm25", tmp_path / "cache"
    argv = ("mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--cache-dir", cache,
            "--n-negatives", 2, "--top-k", 5, "--bm25-index", folder, "--output", tmp_path / "o.json")
    folder.mkdir()
    (folder / "data.csc.index.npy").write_text("half written")
    for entry in ("notes.txt", ".git"):
        (folder / entry).mkdir()
        before = _files(folder)
        with pytest.raises(DprGcError, match=re.escape(f"--bm25-index {folder} holds {entry} and no BM25 index")):
            cli(*argv)
        assert _files(folder) == before and (folder / "data.csc.index.npy").read_text() == "half written"
        assert not (tmp_path / "o.json").exists() and not cache.exists()
        (folder / entry).rmdir()
    (folder / ".bm25_meta.json.x1y2.tmp").write_text("{")  # what a kill while writing the metadata leaves
    cli(*argv)
    assert (folder / "bm25_meta.json").is_file() and (tmp_path / "o.json").is_file()
    assert not (folder / ".bm25_meta.json.x1y2.tmp").exists()  # deleted under the folder's lock
    (folder / "notes.txt").write_text("mine")
    cli(*argv[:-1], tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "o.json").read_text()
    with pytest.raises(DprGcError, match=re.escape(f"--bm25-index {tmp_path} holds ")):
        BM25Source(world["corpus"], index_dir=tmp_path, show_progress=False)


def test_folders_mine_builds_are_outputs_never_inside_its_inputs(world, tmp_path):
    """A folder mine writes when it holds nothing yet -- the BM25 index, and for --source dense the index and the
    shards -- is an output: refused where it is an input or lies inside an input folder (the BEIR folder, the
    model), before anything is written. Built, it is an input and may be read where it lies; separate folders still
    work."""
    root = world["root"]
    beir = beir_folder(tmp_path / "beir")
    before = _files(beir)
    bm25 = ("mine", "--beir-dir", beir, "--cache-dir", tmp_path / "cache", "--n-negatives", 2, "--top-k", 5)
    dense = ("mine", "--source", "dense", "--model", root / "model", "--device", "cpu", *bm25[1:])
    refused = [((*bm25, "--bm25-index", beir / "bm25"), f"--bm25-index {beir / 'bm25'} lies inside the input "
                                                         f"--beir-dir {beir}"),
               ((*bm25, "--bm25-index", beir), f"--bm25-index {beir} is the input --beir-dir {beir}"),
               ((*dense, "--embeddings", beir / "emb"), f"--embeddings {beir / 'emb'} lies inside the input "
                                                        f"--beir-dir"),
               ((*dense, "--embeddings", tmp_path / "emb", "--index", root / "model" / "idx"),
                f"--index {root / 'model' / 'idx'} lies inside the input --model")]
    for argv, message in refused:
        with pytest.raises(DprGcError, match=re.escape(message)):
            cli(*argv, "--output", tmp_path / "o.json")
    assert _files(beir) == before and not (root / "model" / "idx").exists() and not (tmp_path / "o.json").exists()
    assert not (tmp_path / "emb").exists()

    cli(*bm25, "--bm25-index", tmp_path / "bm25", "--output", tmp_path / "o.json")
    assert (tmp_path / "bm25" / "bm25_meta.json").is_file() and (tmp_path / "o.json").is_file()
    shutil.copytree(tmp_path / "bm25", beir / "bm25")  # built already: an input, read where it lies
    cli(*bm25, "--bm25-index", beir / "bm25", "--output", tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "o.json").read_text()
    cli(*dense, "--embeddings", tmp_path / "emb", "--index", tmp_path / "idx", "--output", tmp_path / "dense.json")
    assert (tmp_path / "idx" / "index_meta.json").is_file() and (tmp_path / "dense.json").is_file()



def test_no_output_inside_a_folder_mine_builds_even_before_it_is_built(world, tmp_path):
    """--output (or --cache-dir) inside the --bm25-index or --index folder mine would build is refused on the first
    run, as the identical rerun (the folder then built, an input) refuses it: accepted once, the run could not
    resume, and the index folder would hold a foreign file. Nothing is written; outside the folder the run works."""
    root = world["root"]
    bm25 = ("mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--n-negatives", 2,
            "--top-k", 5, "--bm25-index", tmp_path / "bm25")
    dense = ("mine", "--source", "dense", "--model", root / "model", "--device", "cpu", *bm25[1:9],
             "--embeddings", tmp_path / "emb", "--index", tmp_path / "idx")
    refused = [((*bm25, "--cache-dir", tmp_path / "c", "--output", tmp_path / "bm25" / "o.json"), "--output",
                "--bm25-index"),
               ((*bm25, "--cache-dir", tmp_path / "bm25" / "c", "--output", tmp_path / "o.json"), "--cache-dir",
                "--bm25-index"),
               ((*dense, "--cache-dir", tmp_path / "c", "--output", tmp_path / "idx" / "o.json"), "--output",
                "--index")]
    for argv, flag, built in refused:
        with pytest.raises(DprGcError, match=re.escape(f"{flag} ") + ".* lies inside " + re.escape(built)):
            cli(*argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    cli(*bm25, "--cache-dir", tmp_path / "c", "--output", tmp_path / "o.json")
    cli(*bm25, "--cache-dir", tmp_path / "c", "--output", tmp_path / "o.json")  # the same command again runs
    assert _files(tmp_path / "bm25") and (tmp_path / "o.json").is_file()

def test_a_question_whose_positive_is_not_in_the_corpus_keeps_its_candidates_and_is_reported(world, tmp_path, caplog):
    """BM25 cannot score a positive missing from the corpus: --margin and --max-negative-ratio leave that question's
    candidates alone, the summary counts it under ``unscored``, and the log warns that the rules did not apply."""
    import logging

    corpus, src, qs = world["corpus"], world["bm25"], questions()
    qs[0]["positive_ctxs"] = [{"passage_id": "elsewhere", "title": TOPICS[0], "text": "a passage of another corpus"}]
    full, _ = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        summary = mine_to_file(qs, out, src, corpus, n_negatives=100, top_k=len(corpus), margin=1e6,
                               max_negative_ratio=1e-9, show_progress=False)
    mined = [json.loads(line) for line in out.read_text().splitlines()]
    assert ids_of(full)[0] and ids_of(mined)[0] == ids_of(full)[0]  # kept, though the rules would drop all
    assert ids_of(mined)[1:] == [[]] * (len(TOPICS) - 1) and summary.margin_dropped > 0  # the rules did apply
    assert summary.unscored == 1 and summary.table()["questions without a positive score"] == 1
    assert "1 question without a positive score (positive not in the corpus): the margin and positive-aware rules " \
           "did not apply to them" in caplog.text


@pytest.mark.parametrize("name", ["closed.json", "closed.json.gz"])
def test_a_run_stopped_after_the_list_is_closed_resumes_to_the_same_valid_file(world, tmp_path, monkeypatch, name):
    """A JSON list's closing ``]`` is recorded with the run's progress: a run stopped after it was written but
    before the file got its name (Ctrl-C; a kill -9 leaves the same files) says what it kept, and the next run
    only renames the file, which holds one ``]`` and equals an uninterrupted run's."""
    from dpr_gc.base.files import ChunkedOutput
    from tests.helpers import Recording

    corpus, qs, bm25 = world["corpus"], questions(), world["bm25"]
    common = dict(n_negatives=2, top_k=20, chunk_size=2, show_progress=False)
    reference = mine_to_file(qs, tmp_path / f"ref-{name}", bm25, corpus, **common)
    out, key = tmp_path / name, {"inputs": "the same"}

    def stopped(self: ChunkedOutput) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(ChunkedOutput, "finish", stopped)
        with pytest.raises(Interrupted, match=f"^all {len(qs)} questions are mined into "
                           f"{re.escape(str(tmp_path / f'.{name}.partial'))}; run the same command again to "
                           f"finish {re.escape(str(out))}$"):
            mine_to_file(qs, out, bm25, corpus, resume_key=key, **common)
    again = Recording(bm25)
    assert mine_to_file(qs, out, again, corpus, resume_key=key, **common) == reference
    read = (lambda p: gzip.decompress(p.read_bytes()).decode()) if name.endswith(".gz") else (lambda p: p.read_text())
    assert again.asked == [] and read(out) == read(tmp_path / f"ref-{name}")
    assert len(json.loads(read(out))) == len(qs) and not list(tmp_path.glob(".*"))


def test_a_rerun_with_other_settings_says_it_drops_what_the_interrupted_run_kept(world, tmp_path, monkeypatch,
                                                                                  caplog):
    """A re-run with another --n-negatives cannot continue the interrupted run's kept questions: it starts over and
    says so, naming the flag that changed (as retrieve does), where it dropped them without a word."""
    import dataclasses

    from dpr_gc.retrieval import mine as mine_module

    root, real_from_args, real_mine = world["root"], mine_module.from_args, mine_module.mine_hard_negatives
    monkeypatch.setattr(mine_module, "from_args", lambda cls, args: dataclasses.replace(real_from_args(cls, args),
                        chunk_size=2) if cls is mine_module.MineSettings else real_from_args(cls, args))
    calls = []

    def stopped_at_the_second_chunk(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_mine(*args, **kwargs)

    argv = ("mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--cache-dir",
            root / "cache", "--bm25-index", root / "bm25", "--top-k", 20, "--output", tmp_path / "out.json",
            "--workers", 1, "--n-negatives")
    with monkeypatch.context() as patch:
        patch.setattr(mine_module, "mine_hard_negatives", stopped_at_the_second_chunk)
        with pytest.raises(Interrupted, match="^2 questions mined are kept in "):
            cli(*argv, 2)
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.mine"):
        cli(*argv, 3)
    kept = tmp_path / ".out.json.partial"
    assert (f"starting over: the 2 questions an interrupted run kept in {kept} were mined with other settings "
            "(--n-negatives 2 -> 3)") in caplog.messages, caplog.messages
    assert "resuming an interrupted run" not in caplog.text
    assert all(len(r["hard_negative_ctxs"]) == 3 for r in json.loads((tmp_path / "out.json").read_text()))


def test_a_stop_while_a_chunk_is_written_names_the_questions_the_progress_keeps(world, tmp_path, monkeypatch):
    """Ctrl-C while a chunk is being written (before its progress is recorded) names the questions of the chunks
    recorded before it, from which the next run goes on, not those of the chunk it stopped in."""
    from dpr_gc.base.files import ChunkedOutput
    from tests.helpers import Recording

    corpus, qs, bm25 = world["corpus"], questions(), world["bm25"]
    common = dict(n_negatives=2, top_k=20, chunk_size=2, show_progress=False)
    reference = mine_to_file(qs, tmp_path / "ref.jsonl", bm25, corpus, **common)
    out, key, append, calls = tmp_path / "out.jsonl", {"inputs": "the same"}, ChunkedOutput.append, []

    def stopped_at_the_second(self: ChunkedOutput, text: str, state: object) -> None:
        calls.append(state)
        if len(calls) == 2:
            raise KeyboardInterrupt
        append(self, text, state)

    with monkeypatch.context() as patch:
        patch.setattr(ChunkedOutput, "append", stopped_at_the_second)
        with pytest.raises(Interrupted, match="^2 questions mined are kept in "):
            mine_to_file(qs, out, bm25, corpus, resume_key=key, **common)
    again = Recording(bm25)
    assert mine_to_file(qs, out, again, corpus, resume_key=key, **common) == reference
    assert len(again.asked) == 2 and out.read_text() == (tmp_path / "ref.jsonl").read_text()


def test_answer_patterns_of_beir_queries_that_do_not_compile_are_named_before_the_corpus_is_read(tmp_path, caplog):
    """The BEIR twin of the training-file check: with --beir-dir and --match regex, the judged queries' answer
    patterns that do not compile are named in one warning (file and lines) before the corpus is read."""
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in (
        ("ans1", "Rivers", "Many rivers exist; the SEINE is famous."), ("p1", "T", "something else entirely"),
        ("pos", "x", "unrelated"))))
    queries = [{"_id": "q1", "text": "which rivers exist and are famous", "answers": ["some(thing)"]},
               {"_id": "q2", "text": "which rivers exist and are famous", "answers": ["(SEINE"]},
               {"_id": "q3", "text": "not judged, not mined", "answers": ["(unjudged"]}]
    (beir / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tpos\t1\nq2\tpos\t1\n")
    with caplog.at_level("INFO", logger="dpr_gc"):
        cli("mine", "--beir-dir", beir, "--output", tmp_path / "out.jsonl", "--n-negatives", 3, "--top-k", 5,
            "--workers", 1, "--match", "regex", "--cache-dir", tmp_path / "cache")
    messages = [r.getMessage() for r in caplog.records]
    warning = (f"{beir / 'queries.jsonl'}: 1 answer pattern does not compile (line 2: '(SEINE': missing ) at "
               "position 6); they never match, as in DPR, so a passage holding such an answer may be mined as a "
               "hard negative")
    assert messages.count(warning) == 1, messages
    assert messages.index(warning) < next(i for i, m in enumerate(messages) if "passages from" in m)


def test_positive_scores_are_the_index_scores_of_a_pca_index(world, tmp_path):
    """A positive is scored as the index scores candidates: through a PCA index's centring and projection (a shift of
    every score of a question and a loss of what the projection drops), not by the full-space dot product the
    candidates' scores are no longer on the scale of. Each gold positive is in the corpus, so its score equals the
    one the index's search gives its row, and the rules cut the candidates at those scores."""
    root, corpus, retriever = world["root"], world["corpus"], world["retriever"]
    encode_corpus(retriever, root / "corpus.jsonl", tmp_path / "emb", 0, 1, dtype="float32",
                  cache_dir=root / "cache", show_progress=False)
    build_index(tmp_path / "emb", tmp_path / "pca", IndexParams(factory="PCA8,Flat"))
    src, qs = DenseSource(retriever, DenseIndex.read(tmp_path / "pca")), questions()
    scores, rows, positive = src.retrieve([q["question"] for q in qs], len(corpus), [[(None, c["title"], c["text"])
                                          for c in q["positive_ctxs"]] for q in qs])
    ids = list(corpus["id"])
    for q, q_scores, q_rows, pos in zip(qs, scores, rows, positive):
        row = ids.index(q["positive_ctxs"][0]["passage_id"])
        np.testing.assert_allclose(pos, [q_scores[list(q_rows).index(row)]], rtol=1e-4, atol=1e-4)
    full, _ = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus))
    margin = float(np.median([p[0] - c["score"] for r, p in zip(full, positive) for c in r["hard_negative_ctxs"]]))
    kept, removed = kept_and_removed(full, [p[0] - margin for p in positive])
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus), min_margin=margin)
    assert ids_of(records) == kept and summary.min_margin_dropped == removed > 0


def test_positive_aware_rules_are_refused_for_an_index_that_cannot_score_a_positive(world, tmp_path):
    """An index whose search scores otherwise than its codes' inner product (FAISS's HNSW over PQ codes ranks by L2)
    gives no positive score comparable with its candidates': the rules that need one are refused in one line."""
    import faiss

    retriever, corpus = world["retriever"], world["corpus"]
    vectors = retriever.embed("passage", list(corpus["text"]), titles=list(corpus["title"]))
    index = faiss.index_factory(vectors.shape[1], "HNSW8_PQ4x4", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add(vectors)
    src = DenseSource(retriever, DenseIndex(index, {"factory": "HNSW8_PQ4x4"}))
    mine_hard_negatives(questions(), src, corpus, n_negatives=2, top_k=10)  # no rule needs a positive's score
    for rule in (dict(margin=0.1), dict(max_negative_ratio=0.9), dict(min_margin=0.1)):
        with pytest.raises(DprGcError, match="^--margin, --max-negative-ratio and --min-margin compare candidates "
                           "with the positives' scores as the index gives them, which the HNSW8_PQ4x4 index cannot"):
            mine_hard_negatives(questions(), src, corpus, n_negatives=2, top_k=10, **rule)


def test_positive_scores_follow_the_max_length_and_dtype_the_index_was_encoded_with(world, tmp_path):
    """A corpus encoded with a --max-length other than the model's passage max length (and stored as float16): each
    positive, in the corpus, gets the score the index's search gives its row, not that of the model's own length,
    so every negative a ratio keeps scores at most R x its positive's index score."""
    root, corpus, retriever = world["root"], world["corpus"], world["retriever"]
    encode_corpus(retriever, root / "corpus.jsonl", tmp_path / "emb", 0, 1, max_length=6, cache_dir=root / "cache",
                  show_progress=False)
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    index, qs = DenseIndex.read(tmp_path / "idx"), questions()
    src, ids = DenseSource(retriever, index), list(corpus["id"])
    rows = [ids.index(q["positive_ctxs"][0]["passage_id"]) for q in qs]
    q_emb = retriever.embed("query", [q["question"] for q in qs])
    indexed = [float(index.index.reconstruct(row) @ v) for row, v in zip(rows, q_emb)]
    _, _, positive = src.retrieve([q["question"] for q in qs], 5, [[(None, c["title"], c["text"])
                                                                     for c in q["positive_ctxs"]] for q in qs])
    np.testing.assert_allclose([p[0] for p in positive], indexed, rtol=1e-5, atol=1e-5)
    records, summary = mine_hard_negatives(qs, src, corpus, n_negatives=100, top_k=len(corpus),
                                           max_negative_ratio=0.95)
    assert summary.ratio_dropped > 0
    assert all(c["score"] <= 0.95 * p + 1e-6 for r, p in zip(records, indexed) for c in r["hard_negative_ctxs"])


@pytest.mark.parametrize("qrels_line", ["q0\tnot-in-corpus\t1\n", "unknown\tg0\t1\n"])
def test_beir_qrels_the_corpus_or_queries_do_not_match_are_refused_before_anything_is_encoded(world, tmp_path,
                                                                                             qrels_line):
    """A BEIR split whose qrels name a positive missing from the corpus, or no query of the folder, is refused once
    the corpus is read: before the corpus is encoded, indexed or BM25-indexed, so none of those folders is left."""
    root, beir = world["root"], beir_folder(tmp_path / "beir")
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels_line)
    message = "positive passage id" if "not-in-corpus" in qrels_line else "no query of"
    sources = [("--source", "dense", "--model", root / "model", "--embeddings", tmp_path / "emb", "--index",
                tmp_path / "idx", "--device", "cpu"), ("--bm25-index", tmp_path / "bm25")]
    for source in sources:
        with pytest.raises(DprGcError, match=message):
            cli("mine", "--beir-dir", beir, *source, "--cache-dir", root / "cache", "--output", tmp_path / "out.json")
    assert not {"emb", "idx", "bm25", "out.json"} & {p.name for p in tmp_path.iterdir()}


def test_qrels_judging_no_question_of_the_input_are_refused_before_the_corpus_is_read(world, tmp_path, monkeypatch):
    """``--qrels`` sharing no question id with ``--train-file`` (or the BEIR queries mined) would remove nothing:
    one line naming both files and their first ids, before the corpus is read; qrels judging some of the questions
    mine as before."""
    import dpr_gc.data.corpus as corpus_module

    root, beir = world["root"], beir_folder(tmp_path / "beir")
    (tmp_path / "other.tsv").write_text("x1\tg0\t1\nx2\tg1\t1\n")
    (tmp_path / "some.tsv").write_text("x1\tg0\t1\nq1\tr1\t1\n")
    common = ("--qrels", tmp_path / "other.tsv", "--cache-dir", root / "cache", "--output", tmp_path / "out.json")
    real = corpus_module.load_corpus
    monkeypatch.setattr(corpus_module, "load_corpus", lambda *a, **kw: pytest.fail("the corpus was read"))
    with pytest.raises(DprGcError, match=re.escape(f"no question id of --train-file {root / 'train.json'} (the "
                                                   f"first: 'q0') appears in --qrels {tmp_path / 'other.tsv'} (the "
                                                   "first judged: 'x1')")):
        cli("mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", *common)
    monkeypatch.setattr(corpus_module, "load_corpus", real)
    with pytest.raises(DprGcError, match=re.escape(f"no query id of --beir-dir {beir} (the first with a positive in "
                                                   f"{beir / 'qrels' / 'train.tsv'}: 'q0') appears in --qrels")):
        cli("mine", "--beir-dir", beir, *common)
    assert not (tmp_path / "out.json").exists()
    cli("mine", "--train-file", root / "train.json", "--corpus", root / "corpus.jsonl", "--qrels",
        tmp_path / "some.tsv", "--cache-dir", root / "cache", "--output", tmp_path / "out.json")
    assert (tmp_path / "out.json").is_file()


def test_dense_mining_shows_the_questions_and_positives_it_embeds_batch_by_batch(world, tmp_path, monkeypatch):
    """The "mining" bar moves once per chunk of questions; under it, on a terminal, a dense source opens, as retrieve
    does, a bar for the chunk's questions and one for its positives, each advancing batch by batch."""
    import sys

    import dpr_gc.model.retriever as retriever_module

    root, real, bars = world["root"], retriever_module.tqdm, []

    def recorded(*args, **kwargs):
        bar = real(*args, **kwargs)
        bars.append((kwargs.get("desc"), bar.disable, bar, []))  # as opened: a closed bar reads disabled
        bar.update = lambda n=1, _bar=bar, _steps=bars[-1][3]: _steps.append(n) or real.update(_bar, n)
        return bar

    monkeypatch.setattr(retriever_module, "tqdm", recorded)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    cli("mine", "--source", "dense", "--model", root / "model", "--embeddings", tmp_path / "emb", "--index",
        tmp_path / "idx", "--device", "cpu", "--batch-size", 2, "--train-file", root / "train.json", "--corpus",
        root / "corpus.jsonl", "--cache-dir", root / "cache", "--n-negatives", 2, "--top-k", 10,
        "--max-negative-ratio", 0.9, "--output", tmp_path / "out.json")
    shown = [(desc, bar.n, steps) for desc, disabled, bar, steps in bars if not disabled]
    assert shown == [("embed query texts", 6, [2, 2, 2]), ("embed passage texts", 6, [2, 2, 2])]


def test_source_settings_in_code_meet_the_command_lines_rules():
    """docs/library.md: settings that would not apply are refused in code as on the command line; open_source("bm25")
    ignored a dense source's model, index and batch size (and "dense" BM25's k1) without a word."""
    from dpr_gc.retrieval.mine import SourceSettings

    with pytest.raises(DprGcError) as refused:
        open_source("bm25", None, SourceSettings(model="x", index="y", batch_size=8))
    assert str(refused.value) == ("--model, --index and --batch-size do not apply to --source bm25 (the default); add "
                                  "--source dense, or drop them")
    with pytest.raises(DprGcError, match=r"^--bm25-k1 does not apply to --source dense; drop the flag$"):
        open_source("dense", None, k1=1.2)
