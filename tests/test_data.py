"""Training data: DPR/BEIR readers, validation errors, sampling, top-up, sharding, resume and the collator."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import SHARED_DATA
from dpr_gc.data import training as D
from dpr_gc.base import streams
from dpr_gc.base.errors import DprGcError
from dpr_gc.base.files import die_with_parent
from dpr_gc.data.sampling import MixedBatchSampler


def ctx(pid: str, title: str, text: str, key: str = "passage_id") -> dict:
    return {key: pid, "title": title, "text": text, "score": 12345}


def records(n: int = 6) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"question": f"question {i} about the city?", "answers": [f"answer {i}"],
                    "positive_ctxs": [ctx(f"p{i}", f"title {i}", f"the positive text {i}"),
                                      ctx(f"p{i}b", f"title {i}b", f"second positive {i}", key="id")],
                    "negative_ctxs": [ctx(f"n{i}{j}", "neg", f"random negative {i} {j}") for j in range(3)],
                    "hard_negative_ctxs": [ctx(f"h{i}{j}", "hard", f"hard negative {i} {j}") for j in range(2)]})
    return out


def write(path: Path, recs: list, fmt: str) -> Path:
    text = json.dumps(recs, indent=2) if fmt == "list" else "".join(json.dumps(r) + "\n" for r in recs)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def load(tmp_path: Path, *paths: Path, skip_bad: bool = False) -> D.TrainingData:
    return D.load_dpr_files(list(paths), cache_dir=tmp_path / "cache", skip_bad=skip_bad)


@pytest.mark.parametrize("chunk", [streams.CHUNK_CHARS, 7])
def test_json_list_jsonl_and_gz_give_the_same_rows(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(streams, "CHUNK_CHARS", chunk)  # 7 chars forces records and numbers across chunk borders
    recs = records()
    rows = [load(tmp_path, write(tmp_path / name, recs, fmt)).dataset.to_list()
            for name, fmt in [("a.json", "list"), ("b.jsonl", "lines"), ("c.jsonl.gz", "lines"), ("d.json.gz", "list")]]
    assert rows[0] == rows[1] == rows[2] == rows[3]
    assert len(rows[0]) == 6
    first = rows[0][0]
    assert first["positives"][1] == {"id": "p0b", "title": "title 0b", "text": "second positive 0"}
    assert [c["id"] for c in first["hard_negatives"]] == ["h00", "h01"] and len(first["negatives"]) == 3
    assert first["answers"] == ["answer 0"]


def test_questions_without_positive_are_skipped_and_counted(tmp_path):
    recs = records(4)
    recs[1]["positive_ctxs"] = []
    data = load(tmp_path, write(tmp_path / "t.json", recs, "list"))
    assert len(data) == 3 and data.sizes == [3]
    assert data.stats[0] == {"source": str(tmp_path / "t.json"), "records": 4, "kept": 3, "no_positive": 1,
                             "bad": 0, "dropped_negatives": 0, "parsed_now": True}
    assert "question 1 about the city?" not in data.dataset["question"]


def test_invalid_json_names_file_and_line(tmp_path, monkeypatch):
    lines = [json.dumps(r) for r in records(4)]
    lines[2] = lines[2][:-5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DprGcError, match=rf"{bad}:3: invalid JSON"):
        load(tmp_path, bad)
    data = load(tmp_path, bad, skip_bad=True)
    assert len(data) == 3 and data.stats[0]["bad"] == 1 and data.stats[0]["records"] == 4

    monkeypatch.setattr(streams, "CHUNK_CHARS", 64)
    text = json.dumps(records(3), indent=2).splitlines()
    k = next(i for i, t in enumerate(text) if "second positive 2" in t)
    text[k] = text[k].replace('",', '" oops,')
    broken = tmp_path / "broken.json"
    broken.write_text("\n".join(text))
    for skip in (False, True):  # broken syntax inside a JSON list cannot be skipped
        with pytest.raises(DprGcError, match=rf"{broken}:{k + 1}: invalid JSON"):
            load(tmp_path, broken, skip_bad=skip)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(json.dumps(records(2))[:-30])
    with pytest.raises(DprGcError, match=rf"{truncated}:1: "):
        load(tmp_path, truncated)


def test_an_integer_longer_than_python_reads_is_invalid_json(tmp_path, monkeypatch):
    """Python refuses to read an integer of over 4,300 digits (a ValueError, not a JSONDecodeError): in a JSONL file
    it is a bad record like any other, in a JSON list broken syntax, named by file and line."""
    recs = records(3)
    recs[1]["n"] = "LONG"
    lines = tmp_path / "long.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in recs).replace('"LONG"', "9" * 4301) + "\n")
    with pytest.raises(DprGcError, match=rf"{lines}:2: invalid JSON \(an integer of 4301 digits"):
        load(tmp_path, lines)
    data = load(tmp_path, lines, skip_bad=True)
    assert len(data) == 2 and data.stats[0]["bad"] == 1 and data.stats[0]["records"] == 3
    monkeypatch.setattr(streams, "CHUNK_CHARS", 64)
    listed = tmp_path / "long.json"
    listed.write_text(json.dumps(recs, indent=2).replace('"LONG"', "9" * 4301))
    line = 1 + json.dumps(recs, indent=2).split('"LONG"')[0].count("\n")
    with pytest.raises(DprGcError, match=rf"{listed}:{line}: invalid JSON \(an integer of 4301 digits"):
        load(tmp_path, listed, skip_bad=True)


@pytest.mark.parametrize("chunk", [5, 6, 7, 8, 9])
def test_non_object_items_of_a_json_list_are_bad_records(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(streams, "CHUNK_CHARS", chunk)  # the number must be read whole even across chunk borders
    path = tmp_path / "items.json"
    path.write_text(json.dumps(records(1) + [123456789, records(1)[0]]))
    with pytest.raises(DprGcError, match=rf"{path}:1 \(record 1\): a record must be a JSON object, got int"):
        load(tmp_path, path)
    data = load(tmp_path, path, skip_bad=True)
    assert len(data) == 2 and data.stats[0]["bad"] == 1


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("question"), "missing field 'question'"),
    (lambda r: r.pop("positive_ctxs"), "missing field 'positive_ctxs'"),
    (lambda r: r.update(question=["not", "a", "string"]), "field 'question' must be a string"),
    (lambda r: r.update(hard_negative_ctxs="text"), "field 'hard_negative_ctxs' must be a list"),
    (lambda r: r["positive_ctxs"][1].update(text=None), r"positive_ctxs\[1\].text must be a string"),
    (lambda r: r.update(answers=[1, 2]), "field 'answers' must be a list of strings"),
    (lambda r: r.update(question=""), "the question is empty"),
    (lambda r: r.update(question=" \t\n "), "the question is empty"),
])
def test_bad_records_error_or_are_skipped(tmp_path, change, message):
    recs = records(4)
    change(recs[2])
    listed = write(tmp_path / "l.json", recs, "list")
    lines = write(tmp_path / "l.jsonl", recs, "lines")
    record_line = 2 + sum(json.dumps(r, indent=2).count("\n") + 1 for r in recs[:2])
    with pytest.raises(DprGcError, match=rf"{listed}:{record_line} \(record 2\): {message}.*--skip-bad-records"):
        load(tmp_path, listed)
    with pytest.raises(DprGcError, match=rf"{lines}:3: {message}"):
        load(tmp_path, lines)
    for path in (listed, lines):
        data = load(tmp_path, path, skip_bad=True)
        assert len(data) == 3 and data.stats[0]["bad"] == 1


def test_skip_bad_records_counts_every_bad_record_and_its_parse_serves_no_run_without_it(tmp_path):
    """formats.md: a bad record is refused naming its file and line, or skipped and counted with
    ``--skip-bad-records``: each one counted (two here, not one), and the parse that skipped them, cached, is not
    what a later run without the flag reads (it would train on the file instead of refusing it)."""
    recs = records(5)
    recs[1]["question"] = ""
    recs[3]["positive_ctxs"] = "p3"
    path = write(tmp_path / "t.jsonl", recs, "lines")
    for _ in range(2):  # parsed, then read from the cache
        data = load(tmp_path, path, skip_bad=True)
        assert len(data) == 3 and (data.stats[0]["records"], data.stats[0]["bad"]) == (5, 2)
    assert not data.stats[0]["parsed_now"]
    with pytest.raises(DprGcError, match=rf"^{path}:2: the question is empty; fix the record or pass --skip-bad"):
        load(tmp_path, path)


@pytest.mark.parametrize("name", ["passages.tsv", "pairs.csv", "train.tsv.gz"])
def test_a_tsv_or_csv_given_as_training_data_is_refused_by_its_name(tmp_path, name):
    """Not "line 1: invalid JSON ... or pass --skip-bad-records", which would skip every line of it."""
    path = tmp_path / name
    text = "id\ttext\ttitle\n1\tsome passage\tsome title\n"
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    with pytest.raises(DprGcError, match=rf"^{path} is a (TSV|CSV) file: training data is DPR JSON or JSONL") as e:
        load(tmp_path, path)
    assert "skip-bad-records" not in str(e.value)


TRAINING_FORMATS = (r"; training data is DPR records \(a JSON list or JSONL of \{question, answers, positive_ctxs, "
                    r"negative_ctxs, hard_negative_ctxs\}, optionally \.gz\) or a BEIR folder; see docs/formats\.md$")
OTHER_FORMATS = {  # name: (content, what it looks like)
    "triplets.jsonl": ('{"anchor": "q", "positive": "p", "negative": "n"}\n{"anchor": "r", "positive": "s", '
                       '"negative": "t"}\n', r"sentence-transformers \(anchor, positive, negative\) records"),
    "pairs.json": ('[{"anchor": "q", "positive": "p"}]', r"sentence-transformers \(anchor, positive\) records"),
    "bge.jsonl": ('{"query": "q", "pos": ["p"], "neg": ["n"]}\n', r"FlagEmbedding \(query, pos, neg\) records"),
    "corpus.jsonl": ('{"_id": "d1", "title": "", "text": "x"}\n', r"a BEIR corpus or queries file \(_id, text, "
                     r"title\), not DPR"),
    "nq-open.jsonl": ('{"question": "who", "answer": ["x"]}\n', r"a questions file \(question, answer\) without "
                      r"passages, not DPR training records \(its first record has none of positive_ctxs, "
                      r"negative_ctxs, hard_negative_ctxs\)"),
    "results.json": ('[{"question": "who", "answers": ["x"], "ctxs": [{"id": "1", "text": "t", "score": 1.0}]}]',
                     r"retrieval results \(question, answers, ctxs: what retrieve --output and DPR's "
                     r"dense_retriever\.py write\), not DPR training records \(no positive_ctxs\); "
                     r"evaluate --results reads it, and mine --train-file mines hard negatives into training records"),
    "other.jsonl": ('{"sentence": "x", "label": 1}\n', r"records with the fields label, sentence"),
    "strings.json": ('["one", "two"]', r"a list of str, not of records"),
    "pretty.json": (json.dumps(records(1)[0], indent=2), r"one JSON object spread over several lines, not a JSON "
                    r"list or JSONL of records"),
    "packed.json": ("GZIP", r"gzipped, though its name does not end in \.gz; rename it packed\.json\.gz"),
}


@pytest.mark.parametrize("name", OTHER_FORMATS)
def test_a_file_in_another_format_is_refused_once_with_a_format_hint(tmp_path, name):
    """Not "line 1: missing field 'question' ... or pass --skip-bad-records", advice that would skip every record:
    a file whose first record has none of the DPR fields is named for what it looks like, in one line, by
    training and by ``mine --train-file``."""
    content, looks = OTHER_FORMATS[name]
    path = tmp_path / name
    data = gzip.compress(json.dumps(records(2)).encode()) if content == "GZIP" else content.encode()
    path.write_bytes(data)
    with pytest.raises(DprGcError, match=rf"^{path}(:1: it | )(looks like|holds|is) .*{looks}") as e:
        load(tmp_path, path, skip_bad=True)
    assert re.search(TRAINING_FORMATS, str(e.value)) and "\n" not in str(e.value) and "skip-bad" not in str(e.value)
    with pytest.raises(DprGcError, match=rf"^{path}(:1: it | )(looks like|holds|is) .*{looks}"):
        list(D.iter_training_file(path))


@pytest.mark.parametrize("title", [False, 0, [], {}, 5, True])
def test_a_context_title_that_is_not_a_string_is_a_bad_record_whatever_its_truth(tmp_path, title):
    """A false, 0, [] or {} title was read as no title while 5 or true made a bad record: every non-string does;
    only null (or no title) is an empty one."""
    recs = records(3)
    recs[1]["positive_ctxs"][0]["title"] = title
    recs[2]["positive_ctxs"][0]["title"] = None
    path = write(tmp_path / "t.jsonl", recs, "lines")
    with pytest.raises(DprGcError, match=r"t\.jsonl:2: positive_ctxs\[0\] has a title that is not a string"):
        load(tmp_path, path)
    data = load(tmp_path, path, skip_bad=True)
    assert data.stats[0]["bad"] == 1 and data.dataset[1]["positives"][0]["title"] == ""


@pytest.mark.parametrize("pid", [True, False, 1.5])
def test_a_context_id_that_is_a_bool_or_a_float_is_a_bad_record(tmp_path, pid):
    """A passage id of true was read as the id "True" (bool is an int to Python); the corpus refuses it, so do
    training records (an int id stays its decimal string)."""
    recs = records(3)
    recs[1]["positive_ctxs"][0]["passage_id"] = pid
    recs[2]["positive_ctxs"][0]["passage_id"] = 7
    path = write(tmp_path / "t.jsonl", recs, "lines")
    with pytest.raises(DprGcError, match=r"t\.jsonl:2: positive_ctxs\[0\] has .* an id that is not a string/int"):
        load(tmp_path, path)
    data = load(tmp_path, path, skip_bad=True)
    assert data.stats[0]["bad"] == 1 and data.dataset[1]["positives"][0]["id"] == "7"


def test_a_file_whose_first_record_is_a_bad_dpr_record_keeps_the_record_advice(tmp_path):
    recs = records(3)
    del recs[0]["positive_ctxs"]
    path = write(tmp_path / "t.jsonl", recs, "lines")
    with pytest.raises(DprGcError, match=r":1: missing field 'positive_ctxs'; fix the record or pass "
                                         r"--skip-bad-records$"):
        load(tmp_path, path)
    assert len(load(tmp_path, path, skip_bad=True)) == 2


def test_a_cached_parse_is_named_by_the_path_this_run_gave(tmp_path, caplog, monkeypatch):
    """The same file spelt from another folder reuses the parse; the log and counts name the path given now, not
    the first run's (``../demo/train.json`` from a folder where it names nothing)."""
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "train.json", records(3), "list")
    monkeypatch.chdir(tmp_path)
    assert load(tmp_path, Path("a/train.json")).stats[0]["source"] == "a/train.json"
    monkeypatch.chdir(tmp_path / "a")
    with caplog.at_level("INFO", logger="dpr_gc.data.training"):
        data = load(tmp_path, Path("train.json"))
    assert data.stats[0]["source"] == "train.json" and not data.stats[0]["parsed_now"]
    assert "train.json: 3 records" in caplog.text and "a/train.json" not in caplog.text


def write_beir(folder: Path, recs: list) -> Path:
    """The same content as ``recs`` (positives only) in the BEIR layout, plus one query judged only with score 0."""
    (folder / "qrels").mkdir(parents=True)
    docs = {c["passage_id"] if "passage_id" in c else c["id"]: c for r in recs for c in r["positive_ctxs"]}
    docs["z"] = ctx("z", "", "judged but not relevant")
    with gzip.open(folder / "corpus.jsonl.gz", "wt") as f:
        for pid, c in reversed(list(docs.items())):
            f.write(json.dumps({"_id": pid, "title": c["title"], "text": c["text"]}) + "\n")
    queries = [{"_id": f"q{i}", "text": r["question"]} for i, r in enumerate(recs)] + [{"_id": "qz", "text": "zero"}]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in reversed(queries)))
    qrels = ["query-id\tcorpus-id\tscore"]
    for i, r in enumerate(recs):
        qrels += [f"q{i}\t{c.get('passage_id', c.get('id'))}\t1" for c in r["positive_ctxs"]]
    qrels.append("qz\tz\t0")
    (folder / "qrels" / "train.tsv").write_text("\n".join(qrels) + "\n")
    return folder


def test_beir_and_dpr_readers_give_the_same_examples(tmp_path):
    recs = [{k: v for k, v in r.items() if k != "answers"} | {"negative_ctxs": [], "hard_negative_ctxs": []}
            for r in records(5)]
    dpr = load(tmp_path, write(tmp_path / "same.json", recs + [recs[0] | {"positive_ctxs": []}], "list"))
    beir = D.load_beir_training(write_beir(tmp_path / "beir", recs), cache_dir=tmp_path / "cache")
    assert beir.dataset.to_list() == dpr.dataset.to_list()
    counts = [(x.stats[0]["kept"], x.stats[0]["no_positive"]) for x in (beir, dpr)]
    assert counts == [(5, 1), (5, 1)]
    a, b = (D.TrainingExamples(x.dataset, 2, 1, shuffle_positives=True, seed=3) for x in (dpr, beir))
    for key in [(0, 0, 0), (3, 1, 17), (4, 2, 5)]:
        assert a[key] == b[key]
        assert len(a[key]["passages"]) == 4


def test_a_beir_query_becomes_a_record_with_every_key_of_a_dpr_training_file(tmp_path):
    """``mine --beir-dir`` writes these records: they lacked ``negative_ctxs``, which DPR's older loaders (GC-DPR's)
    read as ``sample['negative_ctxs']``, so the mined file failed there."""
    from dpr_gc.data.corpus import load_corpus

    beir = write_beir(tmp_path / "beir", records(2))
    corpus = load_corpus(beir / "corpus.jsonl.gz", cache_dir=tmp_path / "cache")
    built, _ = D.beir_training_records(beir / "queries.jsonl", beir / "qrels" / "train.tsv", corpus)
    assert [sorted(r) for r in built] == [["answers", "hard_negative_ctxs", "id", "negative_ctxs", "positive_ctxs",
                                          "question"]] * 2
    assert all(r["negative_ctxs"] == r["hard_negative_ctxs"] == [] for r in built)


def test_a_first_line_of_other_header_words_is_named_as_a_header(tmp_path):
    """A header other than BEIR's ('qid docid rel') was refused as "relevance 'rel' is not an integer", no advice;
    the error says line 1 was read as a judgment and what header is taken. A later bad line gets no such advice."""
    from dpr_gc.data.qrels import read_qrels

    qrels = tmp_path / "q.tsv"
    qrels.write_text("qid\tdocid\trel\nq1\td1\t1\n")
    with pytest.raises(DprGcError, match=rf"^{qrels}:1: relevance 'rel' is not an integer \(line 1 is read as a "
                                         r"judgment: a header is BEIR's 'query-id<TAB>corpus-id<TAB>score'; rename its "
                                         r"columns so, or remove it\)$"):
        read_qrels(qrels)
    qrels.write_text("q1\td1\t1\nq2\td2\trel\n")
    with pytest.raises(DprGcError, match=rf"^{qrels}:2: relevance 'rel' is not an integer$"):
        read_qrels(qrels)
    qrels.write_text("qid\tdocid\tscore\nq1\td1\t1\n")  # a last column named score is a header
    assert read_qrels(qrels) == {"q1": {"d1": 1}}


def test_bad_beir_qrels(tmp_path):
    folder = write_beir(tmp_path / "beir", records(2))
    qrels = folder / "qrels" / "train.tsv"
    qrels.write_text(qrels.read_text() + "q0\tmissing-doc\t1\nnot a qrels line\n")
    with pytest.raises(DprGcError, match=rf"{qrels}:8: relevance 'line' is not an integer"):
        D.load_beir_training(folder, cache_dir=tmp_path / "c1")
    qrels.write_text(qrels.read_text().replace("not a qrels line\n", ""))
    with pytest.raises(DprGcError, match=rf"{qrels}:7: corpus id 'missing-doc' has no text"):
        D.load_beir_training(folder, cache_dir=tmp_path / "c2")
    data = D.load_beir_training(folder, cache_dir=tmp_path / "c3", skip_bad=True)
    assert len(data) == 1 and data.stats[0]["bad"] == 1


def test_training_refuses_the_qrels_lines_evaluate_and_mine_refuse(tmp_path):
    """A judgment given again with another relevance, or an id that only looks like another (a zero-width space),
    is refused by the one qrels reader's checks naming file and line, as ``evaluate --qrels`` and ``mine
    --beir-dir`` refuse it; with ``--skip-bad-records`` the line is skipped and counted, the first judgment kept."""
    from dpr_gc.data.qrels import read_qrels

    folder = write_beir(tmp_path / "beir", records(3))
    qrels = folder / "qrels" / "train.tsv"
    judged = qrels.read_text()
    lines = len(judged.splitlines())
    for extra, problem in (("q0\tp0\t0\n", "conflicting relevance for query 'q0' doc 'p0'"),
                           ("q1\tp1\u200b\t1\n", r"document id 'p1\\u200b' holds invisible or control characters")):
        qrels.write_text(judged + extra)
        with pytest.raises(DprGcError, match=rf"^{qrels}:{lines + 1}: {problem}"):
            read_qrels(qrels)
        with pytest.raises(DprGcError, match=rf"^{qrels}:{lines + 1}: {problem}.*; fix the record or pass "
                                             "--skip-bad-records$"):
            D.load_beir_training(folder, cache_dir=tmp_path / "cache")
        data = D.load_beir_training(folder, cache_dir=tmp_path / "cache", skip_bad=True)
        assert data.stats[0]["bad"] == 1 and len(data) == 3
        assert [[c["id"] for c in row] for row in data.dataset["positives"]] == [["p0", "p0b"], ["p1", "p1b"],
                                                                                  ["p2", "p2b"]]


def test_a_judgment_repeated_alike_is_one_positive_as_read_qrels_reads_it(tmp_path):
    """A qrels line given again with the same relevance (two files joined) is no conflict, and training reads the pair
    once, as :func:`read_qrels` (``evaluate``, ``mine``) does: the query keeps one positive per passage, so
    ``--beir-positives pairs`` trains on that pair once an epoch, not twice."""
    from dpr_gc.data.qrels import read_qrels

    folder = write_beir(tmp_path / "beir", records(2))
    qrels = folder / "qrels" / "train.tsv"
    qrels.write_text(qrels.read_text() + "q0\tp0\t1\n")
    data = D.load_beir_training(folder, cache_dir=tmp_path / "cache")
    assert data.stats[0]["bad"] == 0
    assert [[c["id"] for c in row] for row in data.dataset["positives"]] == [["p0", "p0b"], ["p1", "p1b"]]
    assert sorted(read_qrels(qrels)["q0"]) == ["p0", "p0b"]
    assert D.example_index(data, "pairs")[1] == [4]


def test_a_judged_query_without_text_is_a_bad_record_at_its_first_judgment(tmp_path):
    """A query the qrels judge relevant to a passage but ``queries.jsonl`` lacks is a bad record named by the qrels
    line that first judges it (line 4 of q1's two), or skipped and counted with ``--skip-bad-records``."""
    folder = write_beir(tmp_path / "beir", records(3))
    queries = folder / "queries.jsonl"
    queries.write_text("".join(line + "\n" for line in queries.read_text().splitlines() if '"q1"' not in line))
    qrels = folder / "qrels" / "train.tsv"
    assert [line.split("\t")[0] for line in qrels.read_text().splitlines()][3:5] == ["q1", "q1"]
    with pytest.raises(DprGcError, match=rf"^{qrels}:4: query id 'q1' has no text in queries\.jsonl; fix the record"):
        D.load_beir_training(folder, cache_dir=tmp_path / "cache")
    data = D.load_beir_training(folder, cache_dir=tmp_path / "cache", skip_bad=True)
    assert len(data) == 2 and data.stats[0]["bad"] == 1 and records(3)[1]["question"] not in data.dataset["question"]


def test_gzipped_qrels_of_a_beir_folder_are_found(tmp_path, capsys):
    """Every text file of a BEIR folder may be gzipped: ``qrels/train.tsv.gz`` trains as ``qrels/train.tsv`` does
    (train, prepare-data); a split with neither is one line naming the folder, the split and the splits it has."""
    from dpr_gc.cli import main

    plain = write_beir(tmp_path / "plain", records(3))
    folder = write_beir(tmp_path / "beir", records(3))
    qrels = folder / "qrels" / "train.tsv"
    (folder / "qrels" / "train.tsv.gz").write_bytes(gzip.compress(qrels.read_bytes()))
    qrels.unlink()
    loaded = [D.load_training_data([f], tmp_path / "cache").dataset.to_list() for f in (plain, folder)]
    assert loaded[0] == loaded[1] and len(loaded[0]) == 3
    assert main(["prepare-data", str(folder), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert main(["prepare-data", str(folder), "--cache-dir", str(tmp_path / "cache"), "--beir-split", "dev"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {folder} has no qrels/dev.tsv (or qrels/dev.tsv.gz); its qrels splits: train")


@pytest.mark.parametrize("kind", ["passage", "query"])
def test_beir_folder_with_a_repeated_id_is_refused(tmp_path: Path, kind: str) -> None:
    """Training reads a BEIR folder with the readers ``mine --beir-dir`` uses, so a corpus.jsonl that repeats a passage
    id, or a queries.jsonl that repeats a query id, is refused naming the file and both lines, not trained on."""
    folder = write_beir(tmp_path / "beir", records(2))
    if kind == "passage":
        path = folder / "corpus.jsonl.gz"
        lines = gzip.decompress(path.read_bytes()).decode().splitlines()
        repeated, first = "p0", next(i for i, line in enumerate(lines, 1) if json.loads(line)["_id"] == "p0")
        lines.append(json.dumps({"_id": "p0", "title": "Other", "text": "Completely different text."}))
        path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    else:
        path = folder / "queries.jsonl"
        lines = path.read_text().splitlines()
        repeated, first = "q1", next(i for i, line in enumerate(lines, 1) if json.loads(line)["_id"] == "q1")
        lines.append(json.dumps({"_id": "q1", "text": "again"}))
        path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DprGcError, match=rf"^{path}:{len(lines)}: {kind} id '{repeated}' repeats the one at line "
                                         rf"{first}[ ;(]"):
        D.load_training_data([folder], tmp_path / "cache")


def test_training_and_evaluation_read_qrels_alike(tmp_path):
    """One qrels reader: TREC qrels (``qid 0 docid rel``) train exactly as the BEIR TSV they restate, and the
    evaluation reader sees the same judgments."""
    from dpr_gc.evaluation.evaluate import read_qrels

    folder = write_beir(tmp_path / "beir", records(3))
    tsv = folder / "qrels" / "train.tsv"
    beir = D.load_beir_training(folder, cache_dir=tmp_path / "c1")
    judged = read_qrels(tsv)
    lines = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
    tsv.write_text("".join(f"{q} 0 {d} {r}\n" for q, d, r in lines))
    assert read_qrels(tsv) == judged
    trec = D.load_beir_training(folder, cache_dir=tmp_path / "c2")
    assert [trec.dataset[i] for i in range(len(trec))] == [beir.dataset[i] for i in range(len(beir))]


def test_cache_is_reused_until_the_file_changes(tmp_path, monkeypatch):
    path = write(tmp_path / "t.jsonl", records(3), "lines")
    first = load(tmp_path, path).dataset.to_list()
    monkeypatch.setattr(D, "_dpr_records", lambda p: (_ for _ in ()).throw(AssertionError("re-parsed")))
    assert load(tmp_path, path).dataset.to_list() == first
    write(path, records(2), "lines")
    os.utime(path, ns=(1, 1))
    with pytest.raises(AssertionError, match="re-parsed"):
        load(tmp_path, path)


def test_an_edit_that_keeps_size_and_mtime_is_parsed_afresh(tmp_path):
    """The training cache is keyed by the file's content, so an edit in place with its size and modification time
    restored (``cp -p``, rsync, a checkout of another version) trains on the new records, not the old parse."""
    path = write(tmp_path / "t.jsonl", records(3), "lines")
    before = load(tmp_path, path).dataset.to_list()
    stat = path.stat()
    edited = path.read_text().replace(before[0]["question"], before[0]["question"][::-1])
    assert len(edited) == len(path.read_text())
    path.write_text(edited)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = load(tmp_path, path).dataset.to_list()
    assert after[0]["question"] == before[0]["question"][::-1]


def sample_only_the_ends(monkeypatch) -> None:
    """Make every file "large": its fingerprint then hashes only its first and last 16 bytes (as a file over
    256 MiB, whose fingerprint samples 1,024 blocks), so an edit in between leaves the fingerprint as it was."""
    from dpr_gc.data import corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "FULL_HASH_BYTES", 0)
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCK_BYTES", 16)


def edit_between_samples(path: Path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (same length) in the middle of ``path``, one second later than its mtime."""
    stat, text = path.stat(), path.read_text()
    assert len(old) == len(new) and 16 < text.index(old) < len(text) - 16 - len(old)
    path.write_text(text.replace(old, new, 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def test_an_edit_of_a_large_file_between_its_sampled_blocks_is_parsed_afresh(tmp_path, monkeypatch):
    """The training cache key holds each file's size and modification time besides the content fingerprint, as the
    corpus cache's does: an edit of a file over 256 MiB outside the fingerprint's sampled blocks is not served from
    the old parse (a DPR file, and a BEIR folder's queries)."""
    sample_only_the_ends(monkeypatch)
    from dpr_gc.data.corpus import source_fingerprint

    path = write(tmp_path / "t.jsonl", records(3), "lines")
    before, fingerprint = load(tmp_path, path).dataset.to_list(), source_fingerprint(path)
    edit_between_samples(path, "question 1 about", "QUESTION 1 ABOUT")
    assert source_fingerprint(path) == fingerprint
    assert load(tmp_path, path).dataset.to_list()[1]["question"] == "QUESTION 1 ABOUT the city?" != \
        before[1]["question"]
    folder = write_beir(tmp_path / "beir", records(3))
    questions = lambda: D.load_beir_training(folder, cache_dir=tmp_path / "cache").dataset["question"]  # noqa: E731
    assert "question 1 about the city?" in questions()
    edit_between_samples(folder / "queries.jsonl", "question 1 about", "QUESTION 1 ABOUT")
    assert "QUESTION 1 ABOUT the city?" in questions()


def test_concurrent_loads_parse_the_training_file_once(tmp_path, monkeypatch):
    """Like torchrun's ranks, two loaders of one training file at once: one parses it, the other waits for its
    cache (before the shared Arrow cache, each parsed the whole file and wrote a cache of its own)."""
    import threading
    import time

    path = write(tmp_path / "t.jsonl", records(4), "lines")
    parsed, real = [], D._dpr_records
    start = threading.Barrier(2)

    def slow(p):
        for item in real(p):
            parsed.append(item[0])
            time.sleep(0.05)  # long enough for the other loader to arrive while this one parses
            yield item

    monkeypatch.setattr(D, "_dpr_records", slow)
    results, errors = [None, None], []

    def run(i):
        try:
            start.wait()
            results[i] = load(tmp_path, path).dataset.to_list()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(parsed) == 4
    assert results[0] == results[1] and len(results[0]) == 4
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 1


def test_top_up_and_positive_choice(tmp_path):
    recs = records(8)
    recs[0]["hard_negative_ctxs"] = recs[0]["hard_negative_ctxs"][:1]  # 1 hard, 3 other
    recs[1]["hard_negative_ctxs"], recs[1]["negative_ctxs"] = [], []  # nothing: other questions' positives
    data = load(tmp_path, write(tmp_path / "t.jsonl", recs, "lines"))
    ex = D.TrainingExamples(data.dataset, hard_negatives=3, other_negatives=1, seed=1)
    got = ex[(0, 0, 0)]["passages"]
    assert got[0] == ("title 0", "the positive text 0") and len(got) == 5
    assert got[1] == ("hard", "hard negative 0 0") and len(set(got)) == 5
    assert all(t == "neg" for t, _ in got[2:])
    filled = ex[(1, 0, 1)]["passages"][1:]
    assert len(filled) == 4
    assert all(text.startswith("the positive text") and not text.endswith(" 1") for _, text in filled)
    assert ex[(1, 0, 1)] == ex[(1, 0, 1)] and ex[(1, 0, 1)] != ex[(1, 1, 1)]
    assert {D.TrainingExamples(data.dataset, shuffle_positives=True)[(2, 0, p)]["passages"][0][1] for p in range(30)} \
        == {"the positive text 2", "second positive 2"}
    kept = D.TrainingExamples(data.dataset, 2, 3, shuffle_negatives=False)[(2, 5, 5)]["passages"]
    in_order = ["hard negative 2 0", "hard negative 2 1"] + [f"random negative 2 {j}" for j in range(3)]
    assert [t for _, t in kept[1:]] == in_order


def test_fill_never_uses_a_passage_of_the_question_itself(tmp_path):
    recs = [r | {"negative_ctxs": [], "hard_negative_ctxs": []} for r in records(3)]
    recs[0]["positive_ctxs"] = [ctx("p1", "title", "the same passage id as question 1, other text")]
    data = load(tmp_path, write(tmp_path / "t.jsonl", recs, "lines"))
    ex = D.TrainingExamples(data.dataset, hard_negatives=2, other_negatives=1)
    filled = {p for pos in range(20) for p in ex[(1, 0, pos)]["passages"][1:]}
    assert filled == {("title 2", "the positive text 2")}
    with pytest.raises(DprGcError, match="cannot find 3 negatives"):
        D.TrainingExamples(data.dataset.select(range(2)), 2, 1)[(1, 0, 0)]
    with pytest.raises(DprGcError, match="one training question"):
        D.TrainingExamples(data.dataset.select(range(1)), 1, 0)


def twin_records() -> list[dict]:
    """Six questions, two of which ask the same (up to case and spacing) with different positives."""
    recs = [r | {"negative_ctxs": [], "hard_negative_ctxs": []} for r in records(6)]
    recs[3]["question"] = "  QUESTION 0 about  the city?"
    return recs


def asked(question: str) -> str:
    return " ".join(question.lower().split())


def test_rows_asking_the_same_question_are_one_question_for_the_loss(tmp_path, tiny_tokenizer):
    """Two rows with the same question text and different positives: each draw of one counts the other's positives
    as its own (masked, never a negative), the two never share a global batch, the refusal of a batch larger than
    the distinct questions counts texts, and no filled-in negative is the positive of a batch question's twin."""
    data = load(tmp_path, write(tmp_path / "t.json", twin_records(), "list"))
    examples = D.TrainingExamples(data.dataset, 0, 0)
    keys = [set(examples[(row, 0, row)]["positive_keys"]) for row in range(6)]
    assert keys[0] == keys[3] and len(keys[0]) == 8  # the two rows' two positives each, by id and by text
    assert all(keys[0].isdisjoint(keys[row]) for row in (1, 2, 4, 5))
    batch = D.Collator(tiny_tokenizer)([examples[(row, 0, row)] for row in (0, 3)])
    assert set(batch["passage_ids"][1].tolist()) <= set(batch["positive_ids"][0].tolist())  # row 3's positive
    for seed in range(10):
        loader = D.make_dataloader(data, lambda e: e, batch_size=2, hard_negatives=1, seed=seed)
        for epoch in range(3):
            loader.batch_sampler.set_epoch(epoch)
            for drawn in loader:
                questions = [asked(e["question"]) for e in drawn]
                assert len(set(questions)) == 2, questions  # the twins never share a batch
                twins = {c["text"] for row in data.dataset if asked(row["question"]) in questions
                         for c in row["positives"]}
                assert not {text for e in drawn for _, text in e["passages"][1:]} & twins  # nor are filled in
    with pytest.raises(DprGcError, match=r"^--batch-size 6 is more than the 5 distinct queries of the training data"):
        D.make_dataloader(data, lambda e: e, batch_size=6, hard_negatives=0)


def test_beir_queries_with_other_ids_and_the_same_text_are_one_question(tmp_path):
    """SciFact's train queries 89 and 90 hold the same claim: rows with other query ids and the same text are
    grouped as one query, as repeated pairs of one query id are."""
    recs = twin_records()
    recs[3]["question"] = recs[0]["question"]
    data = D.load_beir_training(write_beir(tmp_path / "beir", recs), cache_dir=tmp_path / "cache")
    assert len(data) == 6
    with pytest.raises(DprGcError, match=r"more than the 5 distinct queries"):
        D.make_dataloader(data, lambda e: e, batch_size=6, hard_negatives=0, beir_positives="sample")
    loader = D.make_dataloader(data, lambda e: e, batch_size=5, hard_negatives=0, beir_positives="pairs")
    for epoch in range(5):
        loader.batch_sampler.set_epoch(epoch)
        assert all(len({e["question"] for e in drawn}) == 5 for drawn in loader)


def test_rates_are_per_source_and_deterministic():
    s = MixedBatchSampler([10, 4], batch_size=2, rates=[0.5, 2.0], seed=7)
    order = s.epoch_order(0)
    assert len(order) == 13 and s.batches_per_epoch == len(s) == 6
    assert (order < 10).sum() == 5 and len(set(order[order < 10])) == 5
    assert sorted(order[order >= 10].tolist()) == [10, 10, 11, 11, 12, 12, 13, 13]
    assert np.array_equal(order, MixedBatchSampler([10, 4], 2, [0.5, 2.0], seed=7).epoch_order(0))
    assert not np.array_equal(order, s.epoch_order(1))
    assert [row for batch in s for row, _, _ in batch] == order[:12].tolist()  # last incomplete batch dropped
    with pytest.raises(DprGcError, match="sampling-rates"):
        MixedBatchSampler([10, 4], 2, rates=[1.0])


def test_the_seed_decides_each_epochs_order(tmp_path, make_retriever):
    """``--seed`` is the seed of the sampling (``Batching.seed``): the epoch order depends on ``(seed, epoch)``, so
    another seed draws another order, in the sampler and in the batches ``make_dataloader`` draws by it."""
    orders = {seed: MixedBatchSampler([10, 4], 2, [0.5, 2.0], seed=seed).epoch_order(0) for seed in (0, 5)}
    assert not np.array_equal(orders[0], orders[5])
    data = load(tmp_path, write(tmp_path / "t.jsonl", records(8), "lines"))
    collate = D.Collator(make_retriever())
    drawn = {seed: [row for batch in D.make_dataloader(data, collate, batch_size=2, seed=seed).batch_sampler
                    for row, _, _ in batch] for seed in (0, 5)}
    assert sorted(drawn[0]) == sorted(drawn[5]) == list(range(8)) and drawn[0] != drawn[5]


def test_rank_sharding_disjoint_equal_parts_and_per_file_batches():
    sizes, b, w = [17, 9], 2, 3
    shards = [list(MixedBatchSampler(sizes, b, world_size=w, rank=r, seed=1)) for r in range(w)]
    assert [len(x) for x in shards] == [4, 4, 4]
    positions = [p for shard in shards for batch in shard for _, _, p in batch]
    assert sorted(positions) == list(range(24))  # disjoint, 26 -> 24 (tail dropped)
    grouped = MixedBatchSampler(sizes, b, world_size=w, rank=0, seed=1, per_file_batches=True)
    order = grouped.epoch_order(0)
    assert grouped.batches_per_epoch == 2 + 1
    assert all(len({int(r >= 17) for r in order[i:i + b * w]}) == 1 for i in range(0, len(order), b * w))


def test_resume_reproduces_the_remaining_batches():
    def run(sampler, epochs):
        out = []
        for e in epochs:
            sampler.set_epoch(e)
            out.append(list(sampler))
        return out

    full = run(MixedBatchSampler([11, 6], 3, [1.0, 1.5], seed=4), [0, 1, 2])
    first = MixedBatchSampler([11, 6], 3, [1.0, 1.5], seed=4)
    first.set_epoch(1)
    state = json.loads(json.dumps(first.state_dict(batches_done=2)))
    resumed = MixedBatchSampler([11, 6], 3, [1.0, 1.5], seed=4)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full[1]) - 2
    assert run(resumed, [1, 2]) == [full[1][2:], full[2]]
    assert first.state_dict(first.batches_per_epoch)["epoch"] == 2
    with pytest.raises(DprGcError, match="cannot resume.*batch_size"):
        MixedBatchSampler([11, 6], 4, [1.0, 1.5], seed=4).load_state_dict(state)


def test_resume_counts_only_the_files_a_beir_folder_trains_on(tmp_path, make_retriever, capsys):
    """A qrels split training never reads (``qrels/test.tsv`` added after the checkpoint) does not block
    ``--resume``; an edit of a file it reads is refused naming that file."""
    from dpr_gc.cli import main
    from tests.train_data import write_beir as write_beir_task

    write_beir_task(tmp_path / "beir")
    make_retriever().save(tmp_path / "model")
    argv = ["train", "--train", str(tmp_path / "beir"), "--output", str(tmp_path / "out"), "--model",
            str(tmp_path / "model"), "--num-workers", "0", "--cache-dir", str(tmp_path / "cache"), "--batch-size", "4",
            "--hard-negatives", "0", "--save-every", "1", "--query-chunk-size", "4", "--passage-chunk-size", "4"]
    assert main([*argv, "--max-steps", "1"]) == 0
    (tmp_path / "beir" / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1-0\t1\n")
    assert main([*argv, "--max-steps", "2", "--resume", "latest"]) == 0, capsys.readouterr().err
    corpus = tmp_path / "beir" / "corpus.jsonl"
    corpus.write_text(corpus.read_text().replace("passage", "text"))
    assert main([*argv, "--max-steps", "3", "--resume", "latest"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: cannot resume: the content of the training files changed since the checkpoint ({corpus} changed); "
        "resume with the files it was trained on, or train into a new --output")


def test_a_checkpoint_of_an_earlier_version_resumes_by_the_fingerprint_it_recorded(tmp_path):
    """A sampler state without a per-file record fingerprinted a BEIR folder with every qrels split: such a
    fingerprint still resumes; one that differs names the source."""
    from dpr_gc.data.corpus import source_files, source_fingerprint
    from tests.train_data import write_beir as write_beir_task

    folder = tmp_path / "beir"
    write_beir_task(folder)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1-0\t1\n")
    files = [{"source": str(folder), "files": source_files(folder)}]
    sampler = MixedBatchSampler([12], batch_size=4)
    sampler.data_fingerprints, sampler.data_files = [source_fingerprint(folder, files=files[0]["files"])], files
    old = {k: v for k, v in sampler.state_dict(1).items() if k != "data_files"}
    legacy = source_fingerprint(folder, files=source_files(folder, every_qrels=True))
    assert legacy != sampler.data_fingerprints[0]
    sampler.load_state_dict({**old, "data_fingerprints": [legacy]})
    with pytest.raises(DprGcError, match=rf"changed since the checkpoint \({folder} changed\); resume"):
        sampler.load_state_dict({**old, "data_fingerprints": ["0" * 32]})


def test_collator_matches_retriever_tokenisation(make_retriever):
    retriever = make_retriever(query_max_length=16, passage_max_length=24)
    collate = D.Collator(retriever, passage_max_length=20)
    batch = collate([{"question": "what is paris?", "passages": [("paris", "a city in france"), ("", "music")]},
                     {"question": "who was king?", "passages": [("war", "the king of london"), ("t", "x")]}])
    assert batch["query"]["input_ids"].shape[0] == 2 and batch["passage"]["input_ids"].shape[0] == 4
    expected = retriever.tokenize_passages(["paris", "", "war", "t"],
                                           ["a city in france", "music", "the king of london", "x"], max_length=20)
    assert torch.equal(batch["passage"]["input_ids"], expected["input_ids"])
    queries = retriever.tokenize_queries(["what is paris?", "who was king?"])
    assert torch.equal(batch["query"]["input_ids"], queries["input_ids"])
    sep = retriever.tokenizer.sep_token_id
    assert (batch["passage"]["input_ids"][0] == sep).sum() == 2  # [CLS] title [SEP] text [SEP]
    concat = D.Collator(retriever.tokenizer, retriever.config, passage_format="concat")
    assert (concat([{"question": "q", "passages": [("paris", "city")]}])["passage"]["input_ids"][0] == sep).sum() == 1


def test_passage_key_ids_are_the_same_in_every_process():
    """The collator's ``passage_ids`` and ``positive_ids`` are hashes of the passage keys that agree across ranks
    (``key_id``: the same in every process, where Python's ``hash`` is salted per process): an interpreter with
    another hash seed than this one's gives this one's ids."""
    import subprocess
    import sys

    keys = ["id:p1", "text:title 1\nthe positive text 1", "text:\nno title"]
    code = f"from dpr_gc.data.training import key_id; print([key_id(k) for k in {keys!r}])"
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).parents[1])})
    ids = [D.key_id(k) for k in keys]
    assert run.stdout == f"{ids}\n" and all(0 <= i < 2 ** 63 for i in ids) and len(set(ids)) == 3


def test_dataloader_workers_match_and_batches_are_rectangular(tmp_path, make_retriever):
    data = load(tmp_path, write(tmp_path / "t.jsonl", records(9), "lines"))
    collate = D.Collator(make_retriever())
    kwargs = dict(batch_size=2, hard_negatives=2, other_negatives=2, shuffle_positives=True, seed=5, rank=1,
                  world_size=2)
    serial = list(D.make_dataloader(data, collate, num_workers=0, **kwargs))
    loader = D.make_dataloader(data, collate, num_workers=2, **kwargs)
    assert loader.worker_init_fn.keywords == {"parent": os.getpid()}  # workers outlive this process by no second
    with pytest.MonkeyPatch.context() as patch:  # a forkserver's workers are the server's children, not ours
        patch.setattr(torch.multiprocessing, "get_start_method", lambda *a, **k: "forkserver")
        assert D.make_dataloader(data, collate, num_workers=2, **kwargs).worker_init_fn is die_with_parent
    parallel = list(loader)
    assert len(serial) == len(parallel) == 2
    for a, b in zip(serial, parallel):
        assert a["passage"]["input_ids"].shape[0] == 2 * 5 and a["query"]["input_ids"].shape[0] == 2
        for kind in ("query", "passage"):
            assert torch.equal(a[kind]["input_ids"], b[kind]["input_ids"])


def test_mixed_sources_and_cli(tmp_path, capsys):
    a = write(tmp_path / "a.json", records(3), "list")
    beir = write_beir(tmp_path / "beir", records(2))
    data = D.load_training_data([a, beir], cache_dir=tmp_path / "cache")
    assert data.sizes == [3, 2] and len(data) == 5
    parser = argparse.ArgumentParser()
    D.add_cli(parser.add_subparsers())
    args = parser.parse_args(["prepare-data", str(a), str(beir), "--cache-dir", str(tmp_path / "cache")])
    args.func(args)
    out = capsys.readouterr().out  # load_training_data above parsed both: this run reads them from the cache
    assert f"| {a} | 3 | 3 | 0 | 0 | 0 | cached |" in out and f"| {beir} | 3 | 2 | 1 | 0 | 0 | cached |" in out, out


def test_prepare_data_says_what_it_parsed_now_and_counts_negatives_that_were_positives(tmp_path, capsys, caplog):
    """prepare-data's table counts the (hard) negatives dropped as their question's own positive (only the log
    said so) and whether each source was parsed now or read from an earlier run's cache; the log names the cache."""
    recs = records(3)
    recs[0]["hard_negative_ctxs"] = [dict(recs[0]["positive_ctxs"][0])]
    a = write(tmp_path / "a.json", recs, "list")
    parser = argparse.ArgumentParser()
    D.add_cli(parser.add_subparsers())
    args = parser.parse_args(["prepare-data", str(a), "--cache-dir", str(tmp_path / "cache")])
    with caplog.at_level("INFO", logger="dpr_gc.data.training"):
        args.func(args)
        assert f"| {a} | 3 | 3 | 0 | 0 | 1 | new |" in capsys.readouterr().out
        args.func(args)
        assert f"| {a} | 3 | 3 | 0 | 0 | 1 | cached |" in capsys.readouterr().out
    cache = next((tmp_path / "cache").glob("a.json-*.arrow"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{a}: 3 records")]
    assert lines == [f"{a}: 3 records, 3 kept, 0 without a positive (skipped), 0 bad (skipped); parsed into {cache}",
                     f"{a}: 3 records, 3 kept, 0 without a positive (skipped), 0 bad (skipped); read from the parse "
                     f"cached in {cache}"]


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "scifact").is_dir(), reason="SciFact not available")
def test_scifact_training_questions(tmp_path):
    data = D.load_beir_training(SHARED_DATA / "scifact", cache_dir=tmp_path)
    qids = {line.split("\t")[0] for line in (SHARED_DATA / "scifact/qrels/train.tsv").read_text().splitlines()[1:]}
    assert len(data) == len(qids) and data.stats[0]["bad"] == 0
    assert all(row["positives"] and row["question"] for row in data.dataset.select(range(20)))


def test_an_empty_beir_qrels_file_is_named_as_mine_names_it(tmp_path):
    """Not "no usable training question (0 records, 0 without a positive, 0 bad)", naming neither the file nor what
    to do: the empty qrels file is named, in the words ``mine --beir-dir`` and every qrels reader use."""
    from dpr_gc.data.qrels import read_qrels

    beir = write_beir(tmp_path / "beir", records(2))
    qrels = beir / "qrels" / "train.tsv"
    for text in ("", "query-id\tcorpus-id\tscore\n"):
        qrels.write_text(text)
        with pytest.raises(DprGcError) as mine:
            read_qrels(qrels)
        assert re.match(rf"{qrels}: no relevance judgments found; ", str(mine.value))
        for _ in range(2):  # parsed, then read from the cache
            with pytest.raises(DprGcError) as e:
                D.load_beir_training(beir, cache_dir=tmp_path / "cache")
            assert str(e.value) == str(mine.value) and "TAB" in str(e.value)


@pytest.mark.parametrize("text", ["", "\n\n", "[]", " [\n]\n"])
def test_an_empty_training_file_is_said_to_hold_no_records(tmp_path, text):
    path = tmp_path / "train.json"
    path.write_text(text)
    with pytest.raises(DprGcError, match=rf"^{path}: the file holds no training records \(it is empty"):
        load(tmp_path, path)
