"""Edge cases of the input readers: which key gives a record's id, headers after blank lines or repeated, gzip
files named without .gz, and what gzipped outputs record as their name."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.base.files import ChunkedOutput, require_file
from dpr_gc.data.corpus import iter_passages, read_queries
from dpr_gc.data.qrels import read_qrels
from dpr_gc.data.training import context_id
from dpr_gc.evaluation.evaluate import read_results, read_run
from dpr_gc.evaluation.results import open_results
from dpr_gc.retrieval import mine as mine_mod


def test_a_null_or_empty_underscore_id_gives_way_to_id_in_corpus_queries_and_mine(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": null, "id": "p1", "text": "a"}\n{"_id": "", "id": "p2", "text": "b"}\n'
                      '{"_id": "p3", "id": "other", "text": "c"}\n')
    assert [pid for pid, _, _ in iter_passages(corpus)] == ["p1", "p2", "p3"]
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"_id": null, "id": "q1", "text": "a"}\n{"_id": "", "id": "q2", "text": "b"}\n'
                       '{"_id": "q3", "id": "other", "text": "c"}\n')
    assert [q["id"] for q in read_queries(queries)] == ["q1", "q2", "q3"]
    assert [mine_mod._qid(r) for r in ({"_id": None, "id": 4}, {"_id": "q5", "id": "x"}, {"_id": ""})] == [
        "4", "q5", ""]
    assert context_id({"passage_id": "", "_id": None, "id": 7}) == 7


def test_an_empty_query_id_is_absent_so_the_line_number_stands_for_it(tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    qa.write_text('which river\t["Seine"]\t\nwhich sea\t["North"]\t \nwhich lake\t["Geneva"]\tq3\n')
    assert [q["id"] for q in read_queries(qa)] == ["1", "2", "q3"]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"_id": "", "text": "a"}\n{"id": "  ", "text": "b"}\n')
    assert [q["id"] for q in read_queries(jsonl)] == ["1", "2"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "", "text": "a"}\n')
    with pytest.raises(DprGcError, match=r"c.jsonl:1: passage id '' is empty or contains whitespace"):
        list(iter_passages(corpus))


def test_a_header_after_blank_lines_is_skipped_and_one_repeated_later_is_named(tmp_path: Path) -> None:
    qrels = tmp_path / "q.tsv"
    qrels.write_text("\nquery-id\tcorpus-id\tscore\nq1\tp1\t1\n")
    assert read_qrels(qrels) == {"q1": {"p1": 1}}
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\tp1\t1\nquery-id\tcorpus-id\tscore\nq2\tp2\t1\n")
    with pytest.raises(DprGcError, match=r"q.tsv:3: line 3 repeats the header \(files joined\?\); remove it"):
        read_qrels(qrels)
    qa = tmp_path / "qa.tsv"
    qa.write_text('\n\nquestion\tanswers\nwhich river\t["Seine"]\n')
    assert [q["question"] for q in read_queries(qa)] == ["which river"]
    qa.write_text('question\tanswers\nwhich river\t["Seine"]\nquestion\tanswers\n')
    with pytest.raises(DprGcError, match=r"qa.tsv:3: line 3 repeats the header \(files joined\?\); remove it"):
        read_queries(qa)


def test_a_gzip_file_named_without_gz_is_named_as_such_by_every_reader(tmp_path: Path) -> None:
    def gzipped(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_bytes(gzip.compress(text.encode()))
        return path

    readers = [(lambda p: list(iter_passages(p)), gzipped("c.jsonl", '{"_id": "p1", "text": "a"}\n')),
               (read_queries, gzipped("q.tsv", 'which river\t["Seine"]\n')),
               (read_qrels, gzipped("qrels.tsv", "q1\tp1\t1\n")),
               (read_run, gzipped("r.trec", "q1 Q0 p1 1 1.0 t\n")),
               (read_results, gzipped("r.json", '[{"question": "q", "answers": [], "ctxs": []}]'))]
    for read, path in readers:
        with pytest.raises(DprGcError) as e:
            read(path)
        assert str(e.value) == (f"{path} is gzipped, though its name does not end in .gz; rename it "
                                f"{path.name}.gz"), read


@pytest.mark.parametrize("name", ["r.jsonl", "r.jsonl.gz"])
def test_a_results_jsonl_holding_a_json_list_is_told_to_be_named_json(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    text = '[{"id": "1", "question": "q", "answers": [], "ctxs": []}]'
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    json_name = name.replace(".jsonl", ".json")
    with pytest.raises(DprGcError, match=rf"r.jsonl(.gz)? holds a JSON list, not one question a line; name it "
                                         rf"{json_name}"):
        read_results(path)


@pytest.mark.parametrize("text", ["", "[]", "\n"])
def test_mine_names_the_empty_train_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.json"
    path.write_text(text)
    with pytest.raises(DprGcError, match=rf"--train-file {path} holds no training questions to mine"):
        mine_mod.scan_training_file(path)


def _gzip_names(path: Path) -> list[str]:
    """The FNAME field of every gzip member header of ``path`` (mine's output is one member per chunk)."""
    data, names, pos = path.read_bytes(), [], 0
    while pos < len(data):
        assert data[pos:pos + 2] == b"\x1f\x8b" and data[pos + 3] & 0x08, "a member without a name"
        end = data.index(b"\0", pos + 10)
        names.append(data[pos + 10:end].decode("latin-1"))
        member = zlib.decompressobj(-zlib.MAX_WBITS)
        member.decompress(data[end + 1:])
        pos = len(data) - len(member.unused_data) + 8  # past the CRC32 and size trailer
    return names


def test_gzipped_outputs_record_their_own_name_not_the_temporary_one(tmp_path: Path) -> None:
    results = tmp_path / "r5.jsonl.gz"
    with open_results(results) as w:
        w.write({"id": "1", "question": "q", "answers": [], "ctxs": []})
    assert _gzip_names(results) == ["r5.jsonl"]
    mined = tmp_path / "mg.jsonl.gz"
    out = ChunkedOutput(mined, {"k": 1})
    out.append('{"a": 1}\n', {"n": 1})
    out.append('{"a": 2}\n', {"n": 2})
    out.finish()
    assert _gzip_names(mined) == ["mg.jsonl", "mg.jsonl"]
    assert gzip.decompress(mined.read_bytes()) == b'{"a": 1}\n{"a": 2}\n'


def test_a_beir_folder_given_as_a_file_names_the_file_inside_to_give(tmp_path: Path, capsys) -> None:
    from dpr_gc.cli import main

    beir = tmp_path / "b1"
    (beir / "qrels").mkdir(parents=True)
    for name in ("corpus.jsonl", "queries.jsonl.gz", "qrels/test.tsv", "qrels/train.tsv"):
        (beir / name).write_text("")
    run = tmp_path / "r.trec"
    run.write_text("q1 Q0 p1 1 1.0 t\n")
    assert main(["evaluate", "--run", str(run), "--qrels", str(beir)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --qrels file {beir} is a BEIR folder, not a file; give the file inside it: "
        f"--qrels {beir}/qrels/test.tsv or {beir}/qrels/train.tsv")
    for what, inside in (("--corpus file", "--corpus " + str(beir / "corpus.jsonl")),
                         ("--queries file", "--queries " + str(beir / "queries.jsonl.gz")),
                         ("corpus file", str(beir / "corpus.jsonl"))):
        with pytest.raises(DprGcError) as e:
            require_file(beir, what)
        assert str(e.value) == f"{what} {beir} is a BEIR folder, not a file; give the file inside it: {inside}"
    with pytest.raises(DprGcError, match=r"is a folder, not a file \(check the path\)"):
        require_file(beir / "qrels", "--corpus file")
