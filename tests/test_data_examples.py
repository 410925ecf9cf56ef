"""The examples in data/examples/ (one per input format, documented in data/README.md) read as documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpr_gc.cli import main
from dpr_gc.data.corpus import iter_passages, read_queries
from dpr_gc.data.training import load_training_data
from dpr_gc.evaluation.evaluate import evaluate_answers, qrels_metrics, read_qrels, read_results, read_run
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import tiny_bert

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "examples"
PASSAGE_IDS = ["1", "2", "3", "4", "5", "6"]


def test_every_documented_example_exists():
    readme = (EXAMPLES.parent / "README.md").read_text()
    named = {name for line in readme.splitlines() if line.startswith("| ")
             for name in re.findall(r"`(examples/[^`]+)`", line.split("|")[2])}
    assert len(named) == 11
    for name in named:
        assert (EXAMPLES.parent / name).exists(), name


def test_passage_files_tsv_and_beir_agree():
    tsv = list(iter_passages(EXAMPLES / "passages.tsv"))
    beir = list(iter_passages(EXAMPLES / "beir" / "corpus.jsonl"))
    assert [pid for pid, _, _ in tsv] == PASSAGE_IDS
    assert [pid for pid, _, _ in beir] == [f"d{i}" for i in PASSAGE_IDS]
    assert [(t, x) for _, t, x in tsv] == [(t, x) for _, t, x in beir]
    assert tsv[2][2] == "Paris, the capital of France, is known for its museums; the Louvre is the most visited."


def test_training_files_load_with_documented_counts(tmp_path):
    as_list = load_training_data([EXAMPLES / "train.json"], cache_dir=tmp_path)
    as_lines = load_training_data([EXAMPLES / "train.jsonl"], cache_dir=tmp_path)
    assert as_list.stats[0]["records"] == 4 and as_list.stats[0]["kept"] == 3
    assert as_list.stats[0]["no_positive"] == 1
    assert as_list.dataset.to_list() == as_lines.dataset.to_list()
    first = as_list.dataset[0]
    assert first["question"] == "which river flows through paris"
    assert [p["id"] for p in first["positives"]] == ["1"]
    assert [p["id"] for p in first["hard_negatives"]] == ["2"]
    beir = load_training_data([EXAMPLES / "beir"], cache_dir=tmp_path)
    assert [r["question"] for r in beir.dataset] == ["which river flows through paris",
                                                      "what is the capital of the united kingdom",
                                                      "what does a gene code for"]
    assert [[p["id"] for p in r["positives"]] for r in beir.dataset] == [["d1"], ["d4"], ["d6"]]


def test_question_files():
    qa = read_queries(EXAMPLES / "qa.tsv")
    assert [q["answers"] for q in qa] == [["Seine"], ["London"], ["a protein", "an RNA molecule"], ["Louvre"]]
    assert read_queries(EXAMPLES / "qa.csv")[0] == {"id": "1", "question": "which river flows through paris",
                                                      "answers": ["Seine"]}
    assert read_queries(EXAMPLES / "nq-open.jsonl")[1]["answers"] == ["a protein", "an RNA molecule"]
    beir = read_queries(EXAMPLES / "beir" / "queries.jsonl")
    assert [q["id"] for q in beir] == ["q1", "q2", "q3", "q4"] and all(q["answers"] == [] for q in beir)


def test_run_qrels_and_results_evaluate_to_known_values():
    metrics = qrels_metrics(read_run(EXAMPLES / "run.trec"), read_qrels(EXAMPLES / "beir" / "qrels" / "test.tsv"),
                            [1, 2])
    assert metrics["Recall@1"] == 0.0 and metrics["Recall@2"] == 1.0
    assert metrics["MRR@10"] == 0.5
    assert metrics["nDCG@2"] == pytest.approx(1 / 1.5849625007211562)
    results = read_results(EXAMPLES / "results.json")
    assert evaluate_answers(results, [1, 2]) == {"Accuracy@1": 0.5, "Accuracy@2": 1.0}
    assert evaluate_answers(results, [1, 2], mode=None) == {"Accuracy@1": 0.5, "Accuracy@2": 1.0}


def test_examples_run_through_encode_index_retrieve(tmp_path, tiny_tokenizer):
    """The passages TSV and QA TSV drive the whole retrieval path; every question gets every passage once."""
    model = tmp_path / "model"
    Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer, RetrieverConfig(pooling="mean")).save(model)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["encode", "--model", str(model), "--corpus", str(EXAMPLES / "passages.tsv"),
                 "--output", str(tmp_path / "emb"), "--dtype", "float32", *cache]) == 0
    assert main(["index", "--embeddings", str(tmp_path / "emb"), "--output", str(tmp_path / "idx")]) == 0
    out = tmp_path / "res.json"
    assert main(["retrieve", "--index", str(tmp_path / "idx"), "--model", str(model), "--corpus",
                 str(EXAMPLES / "passages.tsv"), "--queries", str(EXAMPLES / "qa.tsv"), "--top-k", "6",
                 "--output", str(out), *cache]) == 0
    results = json.loads(out.read_text())
    assert [r["question"] for r in results] == [q["question"] for q in read_queries(EXAMPLES / "qa.tsv")]
    for r in results:
        assert sorted(c["id"] for c in r["ctxs"]) == PASSAGE_IDS
        assert any(c["has_answer"] for c in r["ctxs"])


def _results_flags(command: str) -> list[str]:
    """The flags of ``dpr-gc COMMAND`` that take a results file (their dest names results)."""
    import argparse

    from dpr_gc.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return [a.option_strings[0] for a in sub._actions if a.option_strings and "results" in a.dest]


def test_the_docs_name_only_commands_that_read_results_files_as_their_readers():
    """data/README.md said `mine` reads DPR retriever results and formats.md listed mining as a use of the compact
    form, and `retrieve --help` said --compact results are "for evaluate and mine", but mine has no flag taking a
    results file: every reader the two tables and the help name has one."""
    import argparse

    from dpr_gc.cli import STAGES, build_parser

    parser = build_parser("retrieve")
    retrieve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["retrieve"]
    compact = next(a.help for a in retrieve._actions if "--compact" in a.option_strings)
    named = [word for word in re.findall(r"[a-z-]+", compact) if word in STAGES]
    assert named, compact
    for command in named:
        assert _results_flags(command), f"retrieve --help names {command} as reading --compact results: {compact}"
    readme = (EXAMPLES.parent / "README.md").read_text().splitlines()
    formats = (EXAMPLES.parents[1] / "docs" / "formats.md").read_text().splitlines()
    cells = [line.split("|")[3] for line in readme if line.startswith("| DPR retriever results")]
    cells += [line.split("|")[3] for line in formats if line.startswith("| DPR (default)") or
              line.startswith("| compact (`--compact`)")]
    assert len(cells) == 3
    for cell in cells:
        assert "mine" not in cell and "mining" not in cell, cell
        for command in {name.split()[0] for name in re.findall(r"`([a-z-]+(?: --[a-z-]+)?)`", cell)}:
            assert _results_flags(command), f"{command} is named as reading results files: {cell}"
