"""Tests for the stdlib dataset builder: leak-free passages, valid formats, module-disjoint splits, determinism."""

from __future__ import annotations

import argparse
import ast
import csv
import json
import shutil
from pathlib import Path

import pytest

from dpr_gc.data import stdlib_data
from dpr_gc.data.corpus import load_corpus
from dpr_gc.base.errors import DprGcError
from dpr_gc.data.stdlib_data import add_cli, build_stdlib_dataset, collect_definitions, is_informative, split_docstring
from tests.helpers import summary_rows

N = 80


def _folded(text: str) -> str:
    return " ".join(text.lower().split())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _qrels(path: Path) -> list[tuple[str, str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "query-id\tcorpus-id\tscore"
    return [tuple(line.split("\t")) for line in lines[1:]]


@pytest.fixture(scope="module")
def parsed() -> dict:
    """collect_definitions' answers in ``built``'s build, by its arguments (filled when ``built`` runs)."""
    return {}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, parsed: dict) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("stdlib")
    collect = stdlib_data.collect_definitions

    def recording(root: Path, max_passage_words: int) -> tuple[list, int]:
        parsed[(root, max_passage_words)] = collect(root, max_passage_words)
        return parsed[(root, max_passage_words)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stdlib_data, "collect_definitions", recording)
        return out, build_stdlib_dataset(out, max_examples=N, seed=3)


def parse_once(parsed: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds in the calling test take ``built``'s parse of the stdlib (its Definitions are frozen) instead of
    parsing it again: for the tests of a build's folder handling, not of the parse (test_deterministic_bytes
    parses again)."""
    monkeypatch.setattr(stdlib_data, "collect_definitions",
                        lambda root, max_passage_words: (list(parsed[(root, max_passage_words)][0]),
                                                         parsed[(root, max_passage_words)][1]))


def test_manifest_counts_match_files(built: tuple[Path, dict]) -> None:
    out, manifest = built
    counts = manifest["counts"]
    assert sum(counts[f"{s}_queries"] for s in ("train", "dev", "test")) == N
    assert all(counts[f"{s}_queries"] > 0 for s in ("train", "dev", "test"))
    assert len(_jsonl(out / "corpus.jsonl")) == counts["corpus_passages"] > N
    assert len(_jsonl(out / "queries.jsonl")) == N
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert all((out / rel).is_file() for rel in manifest["files"].values())


def test_summary_never_in_gold_passage_and_answer_is(built: tuple[Path, dict]) -> None:
    out, _ = built
    corpus = {d["_id"]: d for d in _jsonl(out / "corpus.jsonl")}
    queries = {q["_id"]: q["text"] for q in _jsonl(out / "queries.jsonl")}
    for split in ("train", "dev", "test"):
        for qid, pid, score in _qrels(out / "qrels" / f"{split}.tsv"):
            assert score == "1"
            assert _folded(queries[qid]) not in _folded(corpus[pid]["text"])
            assert pid.rsplit(".", 1)[1].lower() in corpus[pid]["text"].lower()
            assert len(corpus[pid]["text"].split()) <= 200 and corpus[pid]["title"] == pid


def test_qrels_resolve_and_splits_disjoint(built: tuple[Path, dict]) -> None:
    out, _ = built
    corpus_ids = {d["_id"] for d in _jsonl(out / "corpus.jsonl")}
    queries = {q["_id"]: q["text"] for q in _jsonl(out / "queries.jsonl")}
    packages, qids, texts = {}, {}, {}
    for split in ("train", "dev", "test"):
        rows = _qrels(out / "qrels" / f"{split}.tsv")
        assert rows and all(pid in corpus_ids and qid in queries for qid, pid, _ in rows)
        packages[split] = {pid.split(".")[0] for _, pid, _ in rows}
        qids[split] = {qid for qid, _, _ in rows}
        texts[split] = {_folded(queries[qid]) for qid in qids[split]}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not packages[a] & packages[b], "a package (hence a module) straddles splits"
        assert not qids[a] & qids[b] and not texts[a] & texts[b]
    all_texts = [_folded(t) for t in queries.values()]
    assert len(set(all_texts)) == len(all_texts), "duplicate queries"


def test_dpr_files_match_qrels(built: tuple[Path, dict]) -> None:
    out, _ = built
    by_text = {q["text"]: q["_id"] for q in _jsonl(out / "queries.jsonl")}
    corpus = {d["_id"]: d for d in _jsonl(out / "corpus.jsonl")}
    for split in ("train", "dev"):
        gold = {qid: pid for qid, pid, _ in _qrels(out / "qrels" / f"{split}.tsv")}
        records = json.loads((out / f"dpr_{split}.json").read_text(encoding="utf-8"))
        assert len(records) == len(gold)
        for r in records:
            pos = r["positive_ctxs"]
            assert len(pos) == 1 and gold[by_text[r["question"]]] == pos[0]["passage_id"]
            assert pos[0]["text"] == corpus[pos[0]["passage_id"]]["text"]
            assert r["answers"] == [pos[0]["passage_id"].rsplit(".", 1)[1]]
            negs = r["hard_negative_ctxs"] + r["negative_ctxs"]
            assert r["hard_negative_ctxs"] and r["negative_ctxs"]
            assert all(n["passage_id"] in corpus and n["passage_id"] != pos[0]["passage_id"] for n in negs)
            assert all(r["answers"][0].lower() not in n["text"].lower() for n in negs)


def test_test_qa_tsv_and_passages_tsv_parse(built: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = built
    with open(out / "test_qa.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    tq = _jsonl(out / "test_queries.jsonl")
    assert len(rows) == len(tq) == len(_qrels(out / "qrels" / "test.tsv"))
    for (question, answers), q in zip(rows, tq):
        assert ast.literal_eval(answers) == json.loads(answers) == q["answers"]
        assert question == q["question"]
    with open(out / "passages.tsv", encoding="utf-8", newline="") as f:
        prows = list(csv.reader(f, delimiter="\t"))
    assert prows[0] == ["id", "text", "title"]
    corpus = {d["_id"]: d for d in _jsonl(out / "corpus.jsonl")}
    assert {r[0]: r[1] for r in prows[1:]} == {k: d["text"] for k, d in corpus.items()}
    passages = load_corpus(out / "passages.tsv", tmp_path / "cache")
    assert {r["id"]: r["text"] for r in passages} == {k: d["text"] for k, d in corpus.items()}


def test_deterministic_bytes(built: tuple[Path, dict], tmp_path: Path) -> None:
    out, manifest = built
    again = build_stdlib_dataset(tmp_path, max_examples=N, seed=3)
    assert again["counts"] == manifest["counts"]
    for rel in manifest["files"].values():
        assert (tmp_path / rel).read_bytes() == (out / rel).read_bytes(), rel


def test_resume_skips_rebuild_unless_params_change(built: tuple[Path, dict], monkeypatch) -> None:
    out, manifest = built

    def boom(*args, **kwargs):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(stdlib_data, "collect_definitions", boom)
    assert build_stdlib_dataset(out, max_examples=N, seed=3) == manifest
    with pytest.raises(AssertionError, match="rebuilt"):
        build_stdlib_dataset(out, max_examples=N, seed=4)


def test_cli_prints_summary(built: tuple[Path, dict], capsys) -> None:
    out, manifest = built
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["make-stdlib-data", "--output", str(out), "--max-examples", str(N), "--seed", "3"])
    args.func(args)
    printed = capsys.readouterr().out
    rows = summary_rows(printed)
    assert rows["train queries"] == str(manifest["counts"]["train_queries"]) and rows["output"] == str(out), rows


def test_bad_arguments_raise() -> None:
    with pytest.raises(DprGcError, match="max-examples"):
        build_stdlib_dataset("unused", max_examples=0)
    with pytest.raises(DprGcError, match="fractions"):
        build_stdlib_dataset("unused", dev_fraction=0.5, test_fraction=0.6)


def test_split_docstring_and_filter() -> None:
    assert split_docstring("Split the path. Return a pair.\n\nMore text here.") == (
        "Split the path.", "Return a pair.\n\nMore text here.")
    assert split_docstring("Wrapped summary\n  over two lines.") == ("Wrapped summary over two lines.", "")
    assert is_informative("Split the pathname into a pair.", "splitext")
    assert not is_informative("Return self.", "f")
    assert not is_informative("Docstring for the thing here.", "f")
    assert not is_informative("splitext(p) -> tuple of root and ext", "splitext")
    assert not is_informative("Too short.", "f")


def test_collect_definitions_strips_docstrings_and_skips(tmp_path: Path) -> None:
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_a.py").write_text('def skipped():\n    """Never seen in the output."""\n')
    (tmp_path / "_private.py").write_text('def hidden():\n    """Never seen in the output either."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "mod.py").write_text(
        "# é before the code so byte and character columns differ\n"
        "class Widget(object):\n"
        '    """Make a widget for the toolkit.\n\n    Widgets hold state."""\n'
        "    size = 3\n"
        "    def grow(self, n):\n"
        '        """Grow the widget by n units."""\n'
        "        return n + 1\n"
        "    def _private(self):\n"
        '        """Hidden helper method docstring."""\n'
        'def one_liner(x): """Return x doubled for the caller (é)."""; return 2 * x\n'
        "def bare(y):\n    return y\n", encoding="utf-8")
    defs, skipped = collect_definitions(tmp_path, max_passage_words=200)
    assert skipped == 1
    by_pid = {d.pid: d for d in defs}
    assert set(by_pid) == {"mod.Widget", "mod.Widget.grow", "mod.one_liner", "mod.bare"}
    widget, grow, one = by_pid["mod.Widget"], by_pid["mod.Widget.grow"], by_pid["mod.one_liner"]
    assert widget.summary == "Make a widget for the toolkit."
    assert "Widgets hold state." in widget.text and "def grow(self, n)" in widget.text and "size = 3" in widget.text
    assert "Grow the widget" not in widget.text and "make a widget" not in widget.text.lower()
    assert grow.summary == "Grow the widget by n units." and "Grow" not in grow.text and "return n + 1" in grow.text
    assert one.summary == "Return x doubled for the caller (é)." and "doubled" not in one.text
    assert "return 2 * x" in one.text
    assert by_pid["mod.bare"].summary is None and "return y" in by_pid["mod.bare"].text


def test_a_summary_its_passage_repeats_or_two_definitions_share_is_no_query(tmp_path: Path) -> None:
    """build_stdlib_dataset's promises: the summary never leaks into its own passage (a definition whose code or
    remaining docstring repeats it, here in a comment, gets no query), and a summary shared by two definitions is
    dropped as a query for both (one question with two gold passages is unanswerable); each still joins the corpus."""
    (tmp_path / "mod.py").write_text(
        "def leaky(x):\n"
        '    """Return the number of widgets in the box."""\n'
        "    # Return the number of widgets in the box.\n"
        "    return x\n"
        "def first(a):\n"
        '    """Open the named archive for reading."""\n'
        "    return a\n"
        "def second(b):\n"
        '    """Open the named  archive for reading."""\n'
        "    return b\n"
        "def kept(c):\n"
        '    """Close the archive and flush its buffers."""\n'
        "    return c\n")
    defs, _ = collect_definitions(tmp_path, max_passage_words=200)
    summaries = {d.name: d.summary for d in defs}
    assert summaries == {"leaky": None, "first": None, "second": None,
                         "kept": "Close the archive and flush its buffers."}
    assert all("return" in d.text for d in defs)


def test_a_folder_of_the_users_files_is_not_overwritten(tmp_path: Path) -> None:
    """Without this dataset's manifest (or an interrupted build's marker), a file the build would write is the
    user's: refused before anything is written."""
    (tmp_path / "passages.tsv").write_text("mine")
    with pytest.raises(DprGcError, match="already holds passages.tsv, not written by make-stdlib-data"):
        build_stdlib_dataset(tmp_path, max_examples=N, seed=3)
    assert (tmp_path / "passages.tsv").read_text() == "mine"
    assert sorted(tmp_path.iterdir()) == [tmp_path / "passages.tsv"]


def interrupt_build(folder: Path, seed: int, monkeypatch) -> None:
    """A build of ``folder`` with ``seed`` stopped by Ctrl-C once it has half-written corpus.jsonl."""
    write = stdlib_data._write_outputs

    def killed(out: Path, *args) -> None:
        (out / "corpus.jsonl").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(stdlib_data, "_write_outputs", killed)
    with pytest.raises(KeyboardInterrupt):
        build_stdlib_dataset(folder, max_examples=N, seed=seed)
    monkeypatch.setattr(stdlib_data, "_write_outputs", write)


def test_an_interrupted_build_is_finished_by_the_rerun(tmp_path: Path, monkeypatch, built, parsed) -> None:
    """A build killed after some files (before the manifest) leaves its marker, so the re-run overwrites its own
    files and finishes with the same dataset."""
    parse_once(parsed, monkeypatch)
    interrupt_build(tmp_path, 3, monkeypatch)
    manifest = build_stdlib_dataset(tmp_path, max_examples=N, seed=3)
    out, first = built
    assert manifest["counts"] == first["counts"] and not (tmp_path / stdlib_data.BUILD_MARKER).exists()
    assert (tmp_path / "corpus.jsonl").read_bytes() == (out / "corpus.jsonl").read_bytes()


def test_a_rebuild_stopped_midway_is_never_reused_under_the_earlier_manifest(tmp_path: Path, monkeypatch,
                                                                             built, parsed) -> None:
    """A rebuild with other settings stopped after some files removes the finished build's manifest first, so
    re-running the earlier settings rebuilds rather than reusing the stopped build's files under that manifest."""
    out, first = built
    parse_once(parsed, monkeypatch)
    shutil.copytree(out, tmp_path / "ds")
    interrupt_build(tmp_path / "ds", 4, monkeypatch)
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert build_stdlib_dataset(tmp_path / "ds", max_examples=N, seed=3)["counts"] == first["counts"]
    assert (tmp_path / "ds" / "corpus.jsonl").read_bytes() == (out / "corpus.jsonl").read_bytes()


@pytest.mark.parametrize("manifest", ['{"my": "project manifest"}', '["not", "an object"]', "not JSON"])
def test_a_users_manifest_json_does_not_make_the_folder_this_commands(tmp_path: Path, manifest: str) -> None:
    """Only a manifest of this command's shape (its format version and files) marks an earlier build: a folder
    holding another manifest.json is the user's, refused before anything is written."""
    (tmp_path / "manifest.json").write_text(manifest)
    (tmp_path / "corpus.jsonl").write_text("mine")
    with pytest.raises(DprGcError, match="already holds corpus.jsonl, manifest.json, not written by make-stdlib"):
        build_stdlib_dataset(tmp_path, max_examples=N, seed=3)
    assert (tmp_path / "manifest.json").read_text() == manifest and (tmp_path / "corpus.jsonl").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "manifest.json"]
