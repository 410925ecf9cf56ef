"""Corpus and query readers: three corpus formats, the Arrow cache, and clear errors for bad input."""

from __future__ import annotations

import csv
import gzip
import json
import os
from pathlib import Path

import pytest

from dpr_gc.data import corpus as corpus_mod
from dpr_gc.data.corpus import load_corpus, read_queries
from dpr_gc.data.qrels import read_qrels
from dpr_gc.data.training import load_dpr_files, load_training_data
from dpr_gc.base.errors import DprGcError
from tests.helpers import SHARED_DATA

PASSAGES = [
    ("p0", "Paris", 'The capital of "France" is Paris.'),
    ("p1", "", "A passage without a title, with a\ttab."),
    ("p2", "Music", "Music of the city."),
    ("3", "Rivers", "The river runs\nover two lines."),
]
# a passages TSV holds one passage per line (as DPR's psgs_w100.tsv): no tab or line break inside a text
TSV_PASSAGES = [(pid, title, " ".join(text.split())) for pid, title, text in PASSAGES]


def write_tsv(path: Path, rows=TSV_PASSAGES, header=("id", "text", "title")) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(header)
        for pid, title, text in rows:
            record = {"id": pid, "title": title, "text": text}
            w.writerow([record[h] for h in header])
    return path


def write_jsonl(path: Path, rows=PASSAGES, id_key="id") -> Path:
    lines = "".join(json.dumps({id_key: pid, "title": title, "text": text, "metadata": {}}) + "\n"
                    for pid, title, text in rows)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(lines)
    return path


@pytest.mark.parametrize("kind", ["tsv", "tsv.gz", "beir.jsonl.gz", "jsonl"])
def test_load_corpus_formats(tmp_path: Path, kind: str) -> None:
    if kind.startswith("tsv"):
        path = write_tsv(tmp_path / "psgs.tsv")
        if kind == "tsv.gz":
            gz = tmp_path / "psgs.tsv.gz"
            gz.write_bytes(gzip.compress(path.read_bytes()))
            path = gz
    else:
        path = write_jsonl(tmp_path / f"corpus.{kind.split('.', 1)[-1]}", id_key="_id" if "beir" in kind else "id")
    ds = load_corpus(path, tmp_path / "cache")
    assert ds.column_names == ["id", "title", "text"]
    assert [(r["id"], r["title"], r["text"]) for r in ds] == (TSV_PASSAGES if kind.startswith("tsv") else PASSAGES)
    assert ds.cache_files, "the dataset should be memory-mapped from an Arrow file"


def test_tsv_header_order_and_no_title(tmp_path: Path) -> None:
    ds = load_corpus(write_tsv(tmp_path / "a.tsv", header=("title", "id", "text")), tmp_path / "c")
    assert ds[0] == {"id": "p0", "title": "Paris", "text": TSV_PASSAGES[0][2]}
    no_title = tmp_path / "b.tsv"
    no_title.write_text("id\ttext\nx1\thello world\n")
    assert load_corpus(no_title, tmp_path / "c")[0] == {"id": "x1", "title": "", "text": "hello world"}


def test_cache_is_reused_and_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "c.jsonl")
    load_corpus(path, tmp_path / "cache")
    real = corpus_mod.iter_passages

    def fail(p):
        raise AssertionError("the cached corpus should not be parsed again")

    monkeypatch.setattr(corpus_mod, "iter_passages", fail)
    assert len(load_corpus(path, tmp_path / "cache")) == len(PASSAGES)
    monkeypatch.setattr(corpus_mod, "iter_passages", real)
    write_jsonl(path, PASSAGES[:2])
    os.utime(path, ns=(1, 1))
    assert len(load_corpus(path, tmp_path / "cache")) == 2


@pytest.mark.parametrize("name,content,needle", [
    ("missing_text.tsv", "id\ttitle\np1\tx\n", "missing_text.tsv:1: header lacks column(s) text"),
    ("fields.tsv", "id\ttext\ttitle\np1\thello\tt\np2\tonly two\n", "fields.tsv:3: expected 3"),
    ("multiline.tsv", 'id\ttext\ttitle\np1\t"two\nlines"\tt\np2\tx\tt\tEXTRA\n',
     "multiline.tsv:2: expected 3 tab-separated fields (id, text, title), got 2; a field there begins with '\"'"),
    ("quoted_tab.tsv", 'id\ttext\ttitle\np1\t"a\tb"\tt\n', "quoted_tab.tsv:2: expected 3 .* got 4; a field there"),
    ("bad.jsonl", '{"_id": "1", "text": "ok"}\n{"_id": "2", "text": \n', "bad.jsonl:2: invalid JSON"),
    ("notext.jsonl", '{"_id": "1", "text": "ok"}\n\n{"_id": "2", "title": "t"}\n', "notext.jsonl:3: missing"),
    ("noid.jsonl", '{"text": "ok"}\n', "noid.jsonl:1: missing passage id"),
    ("empty.tsv", "id\ttext\ttitle\n", "corpus is empty"),
    ("empty.jsonl", "\n\n", "corpus is empty"),
    ("blank.tsv", "", "corpus is empty"),
])
def test_bad_corpora(tmp_path: Path, name: str, content: str, needle: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DprGcError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_corpus(path, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.arrow")), "a failed parse must not leave a cache file"


def test_missing_corpus_file(tmp_path: Path) -> None:
    with pytest.raises(DprGcError, match="corpus file not found"):
        load_corpus(tmp_path / "nope.tsv", tmp_path / "cache")


def test_read_queries_dpr_tsv(tmp_path: Path) -> None:
    path = tmp_path / "nq-test.qa.csv"
    path.write_text('who is the king of france\t["Louis", "Henri"]\n'
                    "where is paris\t['France']\n"
                    'what is water\t["H2O"]\tq-77\n')
    assert read_queries(path) == [
        {"id": "1", "question": "who is the king of france", "answers": ["Louis", "Henri"]},
        {"id": "2", "question": "where is paris", "answers": ["France"]},
        {"id": "q-77", "question": "what is water", "answers": ["H2O"]},
    ]


def test_read_queries_jsonl_formats(tmp_path: Path) -> None:
    nq = tmp_path / "nq-open.jsonl"
    nq.write_text('{"question": "who wrote a book", "answer": ["Someone"]}\n'
                  '{"id": "x", "question": "q2", "answer": "single"}\n')
    assert read_queries(nq) == [{"id": "1", "question": "who wrote a book", "answers": ["Someone"]},
                                {"id": "x", "question": "q2", "answers": ["single"]}]
    beir = tmp_path / "queries.jsonl.gz"
    with gzip.open(beir, "wt") as f:
        f.write('{"_id": "0", "text": "a claim", "metadata": {}}\n{"_id": "12", "text": "another"}\n')
    assert read_queries(beir) == [{"id": "0", "question": "a claim", "answers": []},
                                  {"id": "12", "question": "another", "answers": []}]


@pytest.mark.parametrize("line,needle", [
    ("q\t[\"a\", \n", "answers must be a list"),
    ("q\t__import__('os').getcwd()\n", "answers must be a list"),
    ("q\t[1, 2]\n", "answers must be a string or a list of strings"),
    ("q\n", "expected 'question<TAB>answers'"),
])
def test_read_queries_bad_answers(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "qa.tsv"
    path.write_text('fine\t["x"]\n' + line)
    with pytest.raises(DprGcError, match=rf"qa.tsv:2: {needle}"):
        read_queries(path)


def test_read_queries_empty_or_bad(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DprGcError, match="no queries"):
        read_queries(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"_id": "1", "text": "ok"}\n{"_id": "2"}\n')
    with pytest.raises(DprGcError, match="bad.jsonl:2: missing question"):
        read_queries(bad)


@pytest.mark.slow
def test_scifact_corpus_and_queries(tmp_path: Path) -> None:
    folder = SHARED_DATA / "scifact"
    if not (folder / "corpus.jsonl.gz").is_file():
        pytest.skip(f"SciFact not found at {folder}")
    ds = load_corpus(folder / "corpus.jsonl.gz", tmp_path / "cache")
    assert len(ds) == 5183 and ds[0]["id"] == "4983" and ds[0]["title"].startswith("Microstructural")
    queries = read_queries(folder / "queries.jsonl")
    assert len(queries) == 1109 and all(q["answers"] == [] for q in queries)


# ------------------------------------------------------------------------------------ no silent data loss
ISSUE_EXAMPLE = 'id\ttext\ttitle\np1\t"He said hi\tT1\np2\tworld" ok\tT2\np3\tthird\tT3\n'


def test_unquoted_text_starting_with_a_quote_keeps_every_row(tmp_path: Path, caplog) -> None:
    path = tmp_path / "quotes.tsv"
    path.write_text(ISSUE_EXAMPLE)
    with caplog.at_level("INFO", logger="dpr_gc"):
        ds = load_corpus(path, tmp_path / "cache")
    assert ds[:] == {"id": ["p1", "p2", "p3"], "title": ["T1", "T2", "T3"],
                     "text": ['"He said hi', 'world" ok', "third"]}
    assert "quotes.tsv:2: field 2 begins with '\"'" in caplog.text and "read literally" in caplog.text
    assert "3 passages from 4 lines (1 header, 0 blank)" in caplog.text


def test_large_generated_tsv_reads_every_passage(tmp_path: Path, caplog) -> None:
    """50,000 passages, mixing DPR's CSV quoting ("" inside quoted fields) with unquoted text that opens a quote."""
    import random

    rng = random.Random(0)
    rows, lines = [], ["id\ttext\ttitle"]
    for i in range(50_000):
        kind = rng.random()
        if kind < 0.05:
            text, written = f'"unclosed quote {i}', f'"unclosed quote {i}'
        elif kind < 0.10:
            text, written = f'closes later {i}" here', f'closes later {i}" here'
        elif kind < 0.20:
            text = f'DPR quoted "inner" {i}'
            written = '"' + text.replace('"', '""') + '"'
        else:
            text = written = f"plain passage {i} " + " ".join(rng.choice("abcdefg") for _ in range(5))
        rows.append((f"id{i}", text, f"T{i}"))
        lines.append(f"id{i}\t{written}\tT{i}")
        if i % 10_000 == 0:
            lines.append("")
    path = tmp_path / "big.tsv"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level("INFO", logger="dpr_gc"):
        ds = load_corpus(path, tmp_path / "cache")
    assert len(ds) == 50_000
    assert list(zip(ds["id"], ds["text"], ds["title"])) == rows
    assert "50000 passages from 50006 lines (1 header, 5 blank)" in caplog.text


def test_a_line_of_only_whitespace_is_a_blank_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TSV is read one non-blank line per row: a line of spaces or tabs alone (one an editor left) is blank, skipped
    and counted as an empty line is, in a passages file and a QA file alike, not a row of too few fields."""
    path = tmp_path / "c.tsv"
    path.write_text("id\ttext\ttitle\n   \np1\thello\tt\n \t \n")
    with caplog.at_level("INFO", logger="dpr_gc"):
        assert load_corpus(path, tmp_path / "cache")[:] == {"id": ["p1"], "title": ["t"], "text": ["hello"]}
    assert "1 passages from 4 lines (1 header, 2 blank)" in caplog.text
    qa = tmp_path / "qa.tsv"
    qa.write_text('who is it\t["A"]\n  \nwhat is it\t["B"]\n')
    assert read_queries(qa) == [{"id": "1", "question": "who is it", "answers": ["A"]},
                                {"id": "3", "question": "what is it", "answers": ["B"]}]


def test_duplicate_passage_ids_are_refused_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "dups.tsv"
    path.write_text("id\ttext\ttitle\na\tone\tt\nb\ttwo\tt\n\nc\tthree\tt\nb\tfour\tt\na\tfive\tt\n")
    with pytest.raises(DprGcError, match=r"dups.tsv:6: passage id 'b' repeats the one at line 3 \(2 id\(s\) occur"):
        load_corpus(path, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.arrow"))
    jsonl = write_jsonl(tmp_path / "dups.jsonl", [("x", "", "a"), ("y", "", "b"), ("x", "", "c")], id_key="_id")
    with pytest.raises(DprGcError, match="dups.jsonl:3: passage id 'x' repeats the one at line 1"):
        load_corpus(jsonl, tmp_path / "cache")


@pytest.mark.parametrize("pid", ["two words", "tab\\there", "", " lead"])
def test_passage_ids_with_whitespace_are_refused(tmp_path: Path, pid: str) -> None:
    path = tmp_path / "ws.jsonl"
    path.write_text('{"_id": "ok", "text": "t"}\n' + json.dumps({"_id": pid.replace("\\t", "\t"), "text": "x"}) + "\n")
    with pytest.raises(DprGcError, match="ws.jsonl:2: passage id .* is empty or contains whitespace"):
        load_corpus(path, tmp_path / "cache")


def test_same_size_edit_with_restored_mtime_is_not_served_from_cache(tmp_path: Path) -> None:
    path = write_tsv(tmp_path / "c.tsv")
    first = load_corpus(path, tmp_path / "cache")
    assert first[2]["text"] == "Music of the city."
    stat = path.stat()
    path.write_text(path.read_text().replace("Music of the city.", "Films of the town."))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    again = load_corpus(path, tmp_path / "cache")
    assert again[2]["text"] == "Films of the town."
    assert corpus_mod.dataset_fingerprint(again) == corpus_mod.corpus_fingerprint(path)
    assert corpus_mod.dataset_fingerprint(first) != corpus_mod.dataset_fingerprint(again)


def test_an_edit_of_a_large_corpus_between_its_sampled_blocks_is_parsed_afresh(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus cache is keyed by the file's size and modification time besides its content fingerprint, whose
    hash of a file over 256 MiB samples blocks only (made so here: its first and last 16 bytes): an edit between
    them, a second later, is parsed again, not served from the old cache."""
    monkeypatch.setattr(corpus_mod, "FULL_HASH_BYTES", 0)
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(corpus_mod, "SAMPLE_BLOCK_BYTES", 16)
    path = write_tsv(tmp_path / "c.tsv")
    assert load_corpus(path, tmp_path / "cache")[2]["text"] == "Music of the city."
    stat, fingerprint, text = path.stat(), corpus_mod.corpus_fingerprint(path), path.read_text()
    assert 16 < text.index("Music of the city.") < len(text) - 32
    path.write_text(text.replace("Music of the city.", "Films of the town."))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert corpus_mod.corpus_fingerprint(path) == fingerprint
    assert load_corpus(path, tmp_path / "cache")[2]["text"] == "Films of the town."


def test_rows_for_ids_finds_each_row_in_every_block_of_the_scan(tmp_path: Path) -> None:
    """``rows_for_ids`` scans the id column a block (a million rows) at a time: a passage past the first block is
    found at its own corpus row, not at its place within its block; ids not in the corpus are left out."""
    rows = [(f"d{i}", f"title {i}", f"text {i}") for i in range(7)]
    corpus = load_corpus(write_tsv(tmp_path / "c.tsv", rows), tmp_path / "cache")
    wanted = ["d6", "d0", "d3", "d4", "absent"]
    for block in (1, 2, 3, 7, 1_000_000):
        found = corpus_mod.rows_for_ids(corpus, wanted, block_size=block)
        assert found == {"d0": 0, "d3": 3, "d4": 4, "d6": 6}, block
        assert [corpus[r]["id"] for r in found.values()] == list(found)


def test_fingerprint_samples_large_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.tsv"
    path.write_bytes(b"x" * 5_000_000)
    monkeypatch.setattr(corpus_mod, "FULL_HASH_BYTES", 1_000_000)
    before = corpus_mod.corpus_fingerprint(path)
    assert before.startswith("sampled-")
    with open(path, "r+b") as f:  # inside the first sampled block
        f.seek(10)
        f.write(b"y")
    assert corpus_mod.corpus_fingerprint(path) != before


# ------------------------------------------------------------------------------------ byte-order marks
BOM = "\ufeff"


def test_bom_is_skipped_by_every_text_reader(tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    qa.write_text(BOM + 'who is it\t["A"]\n', encoding="utf-8")
    assert read_queries(qa)[0]["question"] == "who is it"
    qa_csv = tmp_path / "qa.csv"
    qa_csv.write_text(BOM + 'question\tanswers\nwhat\t["B"]\n', encoding="utf-8")
    assert read_queries(qa_csv) == [{"id": "2", "question": "what", "answers": ["B"]}]
    tsv = tmp_path / "psgs.tsv"
    tsv.write_text(BOM + "id\ttext\ttitle\np1\thello\tt\n", encoding="utf-8")
    assert load_corpus(tsv, tmp_path / "c")[0] == {"id": "p1", "title": "t", "text": "hello"}
    jsonl = tmp_path / "corpus.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as f:
        f.write(BOM + '{"_id": "d1", "text": "x"}\n')
    assert load_corpus(jsonl, tmp_path / "c")[0]["id"] == "d1"
    queries = tmp_path / "queries.jsonl"
    queries.write_text(BOM + '{"_id": "q1", "text": "claim"}\n', encoding="utf-8")
    assert read_queries(queries)[0]["id"] == "q1"
    record = {"question": "who", "answers": ["A"], "positive_ctxs": [{"title": "t", "text": "x", "passage_id": "p"}]}
    for name, text in (("train.json", json.dumps([record])), ("train.jsonl", json.dumps(record) + "\n")):
        (tmp_path / name).write_text(BOM + text, encoding="utf-8")
        assert load_dpr_files([tmp_path / name], tmp_path / "c").dataset[0]["question"] == "who"
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text(BOM + "query-id\tcorpus-id\tscore\nq1\td1\t1\n", encoding="utf-8")
    assert read_qrels(qrels) == {"q1": {"d1": 1}}
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(BOM + '{"_id": "d1", "title": "t", "text": "x"}\n', encoding="utf-8")
    (beir / "queries.jsonl").write_text(BOM + '{"_id": "q1", "text": "claim"}\n', encoding="utf-8")
    (beir / "qrels" / "train.tsv").write_bytes(qrels.read_bytes())
    row = load_training_data([beir], tmp_path / "c").dataset[0]
    assert (row["question"], row["positives"][0]["id"]) == ("claim", "d1")


@pytest.mark.parametrize("content,kind", [
    (json.dumps([{"question": "q" * 20000, "answers": ["a"], "ctxs": []}] * 50), "a results JSON"),
    ("q1 Q0 " + "d" * 100000 + " 1 12.5 run\n", "a TREC run"),
    ("q1\t" + "y" * 100000 + "\n", None)], ids=["results", "trec-run", "tsv"])
def test_a_bad_qrels_line_is_quoted_cut_short_and_named_when_it_is_another_file(tmp_path: Path, content: str,
                                                                                 kind) -> None:
    """``evaluate --qrels big.json`` quoted the whole one-line file in its error (a 1 MB line); the quote is cut to
    60 characters with the line's length, and a line that looks like a results JSON or a TREC run says so."""
    path = tmp_path / "bad.qrels"
    path.write_text(content)
    with pytest.raises(DprGcError) as caught:
        read_qrels(path)
    message = str(caught.value)
    assert len(message) < 400 and "characters)" in message and message.count("\n") == 0, message[:500]
    assert (f"looks like {kind}" in message) if kind else "looks like" not in message, message


@pytest.mark.parametrize("content,name", [
    ("id\t" + "x" * 100000 + "\n1\ttext\n", "header"),
    (json.dumps({"_id": ["p"] * 50000, "text": "t"}) + "\n", "id")], ids=["header", "id"])
def test_a_long_bad_corpus_field_is_quoted_cut_short(tmp_path: Path, content: str, name: str) -> None:
    """The corpus readers quoted a bad header or passage id whole (a 100,000-character line in the error)."""
    path = tmp_path / ("c.tsv" if name == "header" else "c.jsonl")
    path.write_text(content)
    with pytest.raises(DprGcError) as caught:
        list(corpus_mod.iter_passages(path))
    assert len(str(caught.value)) < 400 and "characters)" in str(caught.value), str(caught.value)[:500]


def test_a_curatedtrec_pattern_answer_is_read_without_a_warning(tmp_path: Path) -> None:
    """CuratedTREC's answers are regular expressions (``['\\d+ inches']``); read as a Python literal they made Python
    print a raw 'SyntaxWarning: invalid escape sequence' (a DeprecationWarning before 3.12). The pattern is read
    as DPR reads it, without a warning."""
    import warnings

    path = tmp_path / "curatedtrec-test.txt"
    path.write_text("how tall is it\t['\\d+ inches', 'a\\.b']\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        queries = read_queries(path)
    assert queries[0]["answers"] == ["\\d+ inches", "a\\.b"]
    assert [str(w.message) for w in caught] == []


def test_answers_are_read_as_dpr_reads_them_a_python_literal_first(tmp_path: Path) -> None:
    """``["AC\\/DC"]`` was read as JSON (AC/DC) where DPR's eval gives AC\\/DC, the text its answer matching sees;
    the answers column is a Python literal first, JSON (true, false, null) only where it is none."""
    path = tmp_path / "qa.csv"
    path.write_text('who sang it\t["AC\\/DC"]\nwhat is it\t["caf\\u00e9", \'x\']\n')
    assert [q["answers"] for q in read_queries(path)] == [["AC\\/DC"], ["café", "x"]]
    path.write_text("q\t[true]\n")
    with pytest.raises(DprGcError, match="answers must be a string or a list of strings, got '\\[True\\]'"):
        read_queries(path)


@pytest.mark.parametrize("layout", ["list", "object", "one-line list"])
@pytest.mark.parametrize("reader", ["corpus", "questions"])
def test_a_json_list_or_pretty_printed_object_is_named_as_such_not_as_invalid_json(tmp_path, layout, reader):
    """Not "FILE:1: invalid JSON (Expecting value); fix or remove that line" (nor, for a list on one line, "expected
    a JSON object, got list"): the file is named for what it holds (a JSON list, one JSON object over several
    lines) and told these readers want one JSON object a line."""
    record = {"_id": "a", "text": "x"} if reader == "corpus" else {"question": "who", "answer": ["x"]}
    value = record if layout == "object" else [record, record]
    path = tmp_path / f"{reader}.json"
    path.write_text(json.dumps(value, indent=None if layout == "one-line list" else 1))
    kind = "one JSON object spread over several lines" if layout == "object" else "a JSON list"
    what = "passage" if reader == "corpus" else "question"
    with pytest.raises(DprGcError, match=rf"^{path} holds {kind}, not one {what} a line: this reader takes JSONL "
                                         rf"\(one JSON object a line\)") as e:
        list(corpus_mod.iter_passages(path)) if reader == "corpus" else read_queries(path)
    assert "invalid JSON" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("title", [False, 0, [], {}, 5, True, 0.0])
def test_a_title_that_is_not_a_string_is_refused_whatever_its_truth(tmp_path, title):
    """A false, 0, [] or {} title was read as no title while 5 or true was refused: every non-string is refused
    alike; only null (or no title) is an empty one."""
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"_id": "a", "text": "x", "title": None}) + "\n"
                    + json.dumps({"_id": "b", "text": "y", "title": title}) + "\n")
    with pytest.raises(DprGcError, match=rf"^{path}:2: 'title' must be a string, got {type(title).__name__}$"):
        list(corpus_mod.iter_passages(path))
    path.write_text(json.dumps({"_id": "a", "text": "x", "title": None}) + "\n" + json.dumps({"_id": "b", "text": "y"}))
    assert [t for _, t, _ in corpus_mod.iter_passages(path)] == ["", ""]
    path.write_text(json.dumps({"_id": "a", "text": title, "title": "t"}) + "\n")
    with pytest.raises(DprGcError, match=rf"^{path}:1: missing or non-string 'text'$"):
        list(corpus_mod.iter_passages(path))
