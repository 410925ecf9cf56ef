"""Hostile-but-realistic input: every reader and every sub-command (and the DPR-compatible scripts) answers bad
files and bad flags with exactly one ``error: ...`` line on stderr and exit status 2 -- no traceback -- and leaves
nothing half-written that looks complete. Commands run in-process through ``main(argv)``; a handful run as real
subprocesses to check the exit status the shell sees. A seeded fuzz loop truncates and flips bytes of each input
format and requires every reader to either read the result or refuse it with a one-line :class:`DprGcError`.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest
import torch

import struct
import numpy as np
from tests.helpers import call, copy_run, load_script, train_argv
from dpr_gc.base.files import atomic_path
from dpr_gc.base.guard import atomic_folder, check_outputs
from dpr_gc.base.locks import exclusive_lock
from dpr_gc.model import folder as model_folder
from dpr_gc.base import args as flag_types
from dpr_gc import cli
from dpr_gc.data.corpus import load_corpus, read_queries
from dpr_gc.data.training import load_dpr_files, load_training_data
from dpr_gc.retrieval.encode import encode_corpus
from dpr_gc.base.errors import DiskFullError, DprGcError, flags_renamed, report_errors
from dpr_gc.evaluation.evaluate import read_qrels, read_results, read_run
from dpr_gc.retrieval.index import DenseIndex, IndexParams, build_index
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import tiny_bert, WORDS

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(pooling="mean", normalize=True, passage_format="concat", query_max_length=32, passage_max_length=32)
DEEP = "[" * 100_000 + "]" * 100_000
PROGRESS = re.compile(r"\[\d+:\d\d[<,]")


def passages(n: int = 16) -> list[tuple[str, str, str]]:
    rng = random.Random(0)
    return [(f"p{i}", rng.choice(WORDS), " ".join(rng.choice(WORDS) for _ in range(8))) for i in range(n)]


def tsv_bytes(rows: Sequence[tuple[str, str, str]]) -> bytes:
    return ("id\ttext\ttitle\n" + "".join(f"{pid}\t{text}\t{title}\n" for pid, title, text in rows)).encode()


def training_records(n: int = 4) -> list[dict]:
    ps = passages()
    return [{"question": f"what is {ps[i][1]}", "answers": [ps[i][1]],
             "positive_ctxs": [{"title": ps[i][1], "text": ps[i][2], "passage_id": ps[i][0]}],
             "hard_negative_ctxs": [{"title": ps[i + 1][1], "text": ps[i + 1][2], "passage_id": ps[i + 1][0]}],
             "negative_ctxs": []} for i in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> dict[str, Path]:
    """A saved tiny retriever, a TSV corpus encoded into one shard, an index, and one valid file of each kind."""
    root = tmp_path_factory.mktemp("bad_inputs")
    retriever = Retriever(tiny_bert(len(tiny_tokenizer), seed=0), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    retriever.save(root / "model")
    (root / "corpus.tsv").write_bytes(tsv_bytes(passages()))
    encode_corpus(retriever, root / "corpus.tsv", root / "emb", shard_id=0, num_shards=1, dtype="float32",
                  cache_dir=root / "cache", model_name=str(root / "model"), show_progress=False)
    build_index(root / "emb", root / "idx", IndexParams("flat"))
    (root / "qa.tsv").write_text('what is paris\t["paris"]\nwho sang\t["music"]\n')
    (root / "queries.jsonl").write_text('{"_id": "q1", "text": "paris city"}\n{"_id": "q2", "text": "music"}\n')
    (root / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tp0\t1\nq2\tp1\t1\n")
    (root / "run.trec").write_text("q1 Q0 p0 1 0.9 t\nq1 Q0 p1 2 0.5 t\nq2 Q0 p1 1 0.8 t\n")
    results = [{"id": "q1", "question": "what is paris", "answers": ["paris"],
                "ctxs": [{"id": "p0", "title": "t", "text": "paris is a city", "score": 1.0, "has_answer": True}]}]
    (root / "results.json").write_text(json.dumps(results))
    (root / "train.json").write_text(json.dumps(training_records()))
    return {"root": root, "model": root / "model", "corpus": root / "corpus.tsv", "emb": root / "emb",
            "idx": root / "idx", "qa": root / "qa.tsv", "queries": root / "queries.jsonl", "qrels": root / "qrels.tsv",
            "run": root / "run.trec", "results": root / "results.json", "train": root / "train.json"}


def messages(err: str) -> list[str]:
    """The lines of ``err`` other than progress bars (tqdm redraws such as ``50%|##  | 8/16 [00:01<00:01, ...]``)."""
    return [part for part in re.split(r"[\r\n]", err) if part.strip() and not PROGRESS.search(part)]


def assert_one_error(code: int, err: str, *needles: str) -> str:
    """Exit status 2 and exactly one message on stderr, an ``error:`` line that contains every needle."""
    lines = messages(err)
    assert code == 2, f"exit status {code}, stderr:\n{err}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one 'error:' line, got:\n{err}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def refused(argv: Sequence[Any], *needles: str, main: Callable[[list[str]], int] = cli.main) -> str:
    return assert_one_error(*call(main, argv), *needles)


def pickle_payload(marker: Path) -> Any:
    """An object whose unpickling would create ``marker`` (so a test can prove it never ran)."""
    class Payload:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    return {"weight": Payload()}


# --------------------------------------------------------------------------------------------- bad files
BAD_CORPORA = [
    ("bad_utf8.tsv", b"id\ttext\ttitle\np1\tfine\tt\np2\tbad \xff byte\tt\n", "bad_utf8.tsv:3: not valid UTF-8"),
    ("truncated.tsv.gz", gzip.compress(tsv_bytes(passages()))[:-12], "not a complete gzip file"),
    ("fake.tsv.gz", b"id\ttext\ttitle\np1\tnot gzip\tt\n", "not a complete gzip file"),
    ("list_line.jsonl", b'{"_id": "a", "text": "x"}\n[1, 2]\n', "list_line.jsonl:2: expected a JSON object"),
    ("deep.jsonl", b'{"_id": "a", "text": "x"}\n' + DEEP.encode() + b"\n", "deep.jsonl:2: JSON nested too deeply"),
    ("dup.tsv", b"id\ttext\ttitle\na\tx\tt\nb\ty\tt\na\tz\tt\n", "dup.tsv:4: passage id 'a' repeats the one at line 2"),
    ("space.tsv", b"id\ttext\ttitle\na b\tx\tt\n", "space.tsv:2: passage id 'a b' is empty or contains whitespace"),
    ("utf8.jsonl", b'{"_id": "a", "text": "\xc3\x28"}\n', "utf8.jsonl:1: not valid UTF-8"),
    ("zero_width.jsonl", b'{"_id": "d\\u200b1", "text": "x"}\n',
     "zero_width.jsonl:1: passage id 'd\\u200b1' holds invisible or control characters (U+200B)"),
]


@pytest.mark.parametrize("name,content,needle", BAD_CORPORA, ids=[c[0] for c in BAD_CORPORA])
def test_encode_refuses_bad_corpus(world: dict, tmp_path: Path, name: str, content: bytes, needle: str) -> None:
    corpus = tmp_path / name
    corpus.write_bytes(content)
    refused(["encode", "--model", world["model"], "--corpus", corpus, "--output", tmp_path / "emb",
             "--cache-dir", tmp_path / "cache", "--device", "cpu"], needle)
    assert not list(tmp_path.glob("emb/*.json")), "no shard may look finished"
    assert not list(tmp_path.glob("cache/*.arrow")) and not list(tmp_path.glob("cache/.*.tmp"))


BAD_QUERIES = [
    ("qa.tsv", b'fine\t["a"]\nbad \xfe\t["b"]\n', "qa.tsv:2: not valid UTF-8"),
    ("q.jsonl", b'{"_id": "1", "text": "a"}\n"just a string"\n', "q.jsonl:2: expected a JSON object"),
    ("deep.jsonl", DEEP.encode() + b"\n", "deep.jsonl:1: JSON nested too deeply"),
    ("qa.csv.gz", gzip.compress(b'q\t["a"]\n' * 50)[:-8], "not a complete gzip file"),
    ("answers.tsv", b"q\t" + DEEP.encode() + b"\n", "answers.tsv:1: answers must be a list"),
    ("zero_width.jsonl", b'{"_id": "q\\u200b1", "text": "a"}\n',
     "zero_width.jsonl:1: query id 'q\\u200b1' holds invisible or control characters (U+200B)"),
    ("empty.tsv", b'fine\t["a"]\n \t["b"]\n', "empty.tsv:2: the question is empty"),
    ("empty.jsonl", b'{"_id": "q1", "text": ""}\n', "empty.jsonl:1: the question is empty"),
]


@pytest.mark.parametrize("name,content,needle", BAD_QUERIES, ids=[c[0] for c in BAD_QUERIES])
def test_retrieve_refuses_bad_queries(world: dict, tmp_path: Path, name: str, content: bytes, needle: str) -> None:
    queries = tmp_path / name
    queries.write_bytes(content)
    out = tmp_path / "out.json"
    refused(["retrieve", "--index", world["idx"], "--model", world["model"], "--corpus", world["corpus"],
             "--queries", queries, "--output", out, "--trec-run", tmp_path / "run.trec",
             "--cache-dir", tmp_path / "cache", "--device", "cpu"], needle)
    assert not out.exists() and not (tmp_path / "run.trec").exists()


def test_retrieve_names_a_missing_queries_or_qrels_file_by_its_flag_before_loading_the_model(
        world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing or folder --queries / --qrels is named by its flag (not as a corpus file), before the query
    encoder loads."""
    def not_loaded(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Retriever, "load", not_loaded)
    base = ["retrieve", "--index", world["idx"], "--model", world["model"], "--corpus", world["corpus"],
            "--output", tmp_path / "x.json", "--cache-dir", tmp_path / "cache", "--device", "cpu"]
    missing = tmp_path / "nonexist.tsv"
    refused([*base, "--queries", missing], f"--queries file not found: {missing}")
    refused([*base, "--queries", world["model"]], f"--queries file {world['model']} is a folder")
    refused([*base, "--queries", world["qa"], "--qrels", world["model"]], f"--qrels file {world['model']} is a folder")
    refused([*base, "--queries", world["qa"], "--qrels", missing], f"--qrels file not found: {missing}")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, said", [
    (["evaluate", "--results", "{missing}"], "--results file not found: {missing}"),
    (["evaluate", "--run", "{missing}", "--qrels", "{qrels}"], "--run file not found: {missing}"),
    (["evaluate", "--results", "{qa}", "--qrels", "{missing}"], "--qrels file not found: {missing}"),
    (["mine", "--train-file", "{missing}", "--corpus", "{corpus}", "--output", "{out}"],
     "--train-file not found: {missing}"),
    (["mine", "--train-file", "{qa}", "--corpus", "{missing}", "--output", "{out}"],
     "--corpus file not found: {missing}"),
    (["index", "--embeddings", "{missing}", "--output", "{out}"], "--embeddings folder not found: {missing}"),
    (["encode", "--model", "{model}", "--corpus", "{missing}", "--output", "{out}"],
     "--corpus file not found: {missing}"),
    (["retrieve", "--index", "{idx}", "--queries", "{missing}", "--evaluate"],
     "--queries file not found: {missing}"),
    (["retrieve", "--index", "{missing}", "--queries", "{qa}", "--evaluate"],
     "--index folder not found: {missing} (build one with `dpr-gc index`)"),
    (["mine", "--source", "dense", "--index", "{missing}", "--train-file", "{train}", "--output", "{out}"],
     "--index folder not found: {missing} (build one with `dpr-gc index`)")])
def test_every_stage_names_a_missing_input_by_its_flag(world: dict, tmp_path: Path, argv: list, said: str) -> None:
    """retrieve, encode and train named the flag of a missing input ("--queries file not found"), evaluate, mine and
    index did not ("results file not found", "training file not found", "embeddings folder not found"), nor
    retrieve and mine a missing --index ("no complete index in X"): each does."""
    paths = {"missing": tmp_path / "missing.json", "out": tmp_path / "out", **world}
    refused([arg.format(**paths) for arg in argv], "error: " + said.format(**paths))


def test_evaluate_refuses_bad_qrels_runs_and_results(world: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"query-id\tcorpus-id\tscore\nq1\tp\xff\t1\n")
    refused(["evaluate", "--run", world["run"], "--qrels", bad], "bad.tsv:2: not valid UTF-8")
    fake = tmp_path / "qrels.tsv.gz"
    fake.write_bytes(b"\x1f\x8b\x08\x00garbage")
    refused(["evaluate", "--run", world["run"], "--qrels", fake], "qrels.tsv.gz: not a complete gzip file")
    run = tmp_path / "run.trec"
    run.write_bytes(b"q1 Q0 p0 1 0.9 t\n\x80\n")
    refused(["evaluate", "--run", run, "--qrels", world["qrels"]], "run.trec:2: not valid UTF-8")
    for name, content, needle in [("deep.json", DEEP, "deep.json:1: JSON nested too deeply"),
                                  ("trailing.json", world["results"].read_text() + " trailing", "after the end of the JSON list"),
                                  ("object.json", "{}", "expected a JSON list")]:
        (tmp_path / name).write_text(content)
        out = tmp_path / f"{name}.metrics.json"
        refused(["evaluate", "--results", tmp_path / name, "--output", out], needle)
        assert not out.exists()


BAD_TRAINING = [
    ("trailing.json", json.dumps(training_records()) + "\n]", "trailing.json:2: unexpected text after the end"),
    ("deep_item.json", "[" + json.dumps(training_records()[0]) + "," + DEEP + "]", "JSON nested too deeply"),
    ("deep_line.jsonl", json.dumps(training_records()[0]) + "\n" + DEEP + "\n", "deep_line.jsonl:2: JSON nested"),
    ("utf8.json", b"[" + json.dumps(training_records()[0]).encode()[:-2] + b'\xff"}]', "utf8.json:1: not valid UTF-8"),
    ("cut.json.gz", gzip.compress(json.dumps(training_records()).encode())[:-9], "not a complete gzip file"),
    ("dict.json", json.dumps({"data": training_records()}),
     "dict.json:1: it holds one JSON object with the records under 'data', not a JSON list or JSONL of records"),
    ("text.json", "question: what?\n", "text.json:1: invalid JSON"),
    ("empty_question.jsonl", "".join(json.dumps({**r, "question": q}) + "\n" for r, q in
                                     zip(training_records(2), ["what", " \t "])),
     "empty_question.jsonl:2: the question is empty; fix the record or pass --skip-bad-records"),
]


@pytest.mark.parametrize("name,content,needle", BAD_TRAINING, ids=[c[0] for c in BAD_TRAINING])
def test_prepare_data_and_train_refuse_bad_training_files(world: dict, tmp_path: Path, name: str, content: Any,
                                                          needle: str) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(["prepare-data", path, "--cache-dir", tmp_path / "cache"], needle)
    refused(["train", "--train", path, "--output", tmp_path / "out", "--model", world["model"],
             "--cache-dir", tmp_path / "cache", "--device", "cpu", "--num-workers", "0"], needle)
    assert not list(tmp_path.glob("cache/*.arrow")) and not list(tmp_path.glob("out/final"))


def test_beir_folder_with_a_line_that_is_not_an_object(tmp_path: Path) -> None:
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n')
    (beir / "queries.jsonl").write_text('{"_id": "q1", "text": "a"}\n["q2", "b"]\n')
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    refused(["prepare-data", beir, "--cache-dir", tmp_path / "cache"], "queries.jsonl:2: expected a JSON object")


def test_valid_70mb_record_is_read_and_the_limit_is_stated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpr_gc.base import streams

    record = training_records(1)[0]
    record["positive_ctxs"][0]["text"] = "word " * (14 << 20)  # 70 MiB of text in one record
    path = tmp_path / "huge.json"
    path.write_text(json.dumps([record, training_records(2)[1]]))
    loaded = load_dpr_files([path], tmp_path / "cache")
    assert len(loaded) == 2 and len(loaded.dataset[0]["positives"][0]["text"]) == 70 << 20
    monkeypatch.setattr(streams, "MAX_RECORD_CHARS", 8 << 20)
    with pytest.raises(DprGcError, match="huge.json:1: invalid JSON .* longer than the 8 MiB limit per record"):
        load_dpr_files([path], tmp_path / "cache2")


def test_damaged_manifests_metadata_and_configs(world: dict, tmp_path: Path) -> None:
    emb = tmp_path / "emb"
    shutil.copytree(world["emb"], emb)
    (emb / "shard-00000-of-00001.json").write_text("[]")
    refused(["index", "--embeddings", emb, "--output", tmp_path / "idx"],
            "shard-00000-of-00001.json: expected a JSON object")
    assert not (tmp_path / "idx" / "index_meta.json").exists()
    refused(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", emb, "--device", "cpu",
             "--cache-dir", tmp_path / "cache"], "expected a JSON object")
    idx = tmp_path / "idx2"
    shutil.copytree(world["idx"], idx)
    (idx / "index_meta.json").write_text("[1, 2]")
    refused(["retrieve", "--index", idx, "--queries", world["qa"], "--output", tmp_path / "o.json"], "index_meta")
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    (model / "retriever_config.json").write_text('["cls"]')
    refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--queries",
             world["qa"], "--output", tmp_path / "o.json", "--device", "cpu"], "retriever_config.json: expected")
    assert not (tmp_path / "o.json").exists()
    broken = '{\n  "dim": 8,\n  "oops" 1\n}'  # not JSON at all: the line is named, not a traceback
    (emb / "shard-00000-of-00001.json").write_text(broken)
    refused(["index", "--embeddings", emb, "--output", tmp_path / "idx"],
            f"{emb / 'shard-00000-of-00001.json'}:3: invalid JSON (")
    (idx / "index_meta.json").write_text(broken)
    refused(["retrieve", "--index", idx, "--queries", world["qa"], "--output", tmp_path / "o.json"],
            f"{idx / 'index_meta.json'}:3: invalid JSON (")
    (model / "retriever_config.json").write_text(broken)
    refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--queries",
             world["qa"], "--output", tmp_path / "o.json", "--device", "cpu"],
            f"{model / 'retriever_config.json'}:3: invalid JSON (")
    assert not (tmp_path / "o.json").exists() and not (tmp_path / "idx" / "index_meta.json").exists()


BAD_CONFIG_VALUES = [("pooling", "foo", "one of cls, mean, pooler, last"), ("passage_format", "tsv", "one of pair"),
                     ("temperature", 100.0, "a number from 0.01 to 10.0"), ("query_max_length", 0, "a positive"),
                     ("passage_max_length", True, "a positive")]  # JSON true is never taken for the integer 1


@pytest.mark.parametrize("key,value,need", BAD_CONFIG_VALUES, ids=[c[0] for c in BAD_CONFIG_VALUES])
def test_a_bad_value_in_a_model_config_names_the_file_and_field_not_a_flag(
        world: dict, tmp_path: Path, key: str, value: Any, need: str) -> None:
    """A value RetrieverConfig would refuse, read from MODEL/retriever_config.json, is named there by its field
    (the user gave no flag)."""
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    config = json.loads((model / "retriever_config.json").read_text())
    (model / "retriever_config.json").write_text(json.dumps({**config, key: value}))
    line = refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--queries",
                    world["qa"], "--output", tmp_path / "o.json", "--device", "cpu"],
                   f"{model / 'retriever_config.json'}: '{key}' must be {need}", "fix the file")
    assert "--" not in line.replace(str(tmp_path), "")


def test_pickled_weights_are_refused_in_one_line(world: dict, tmp_path: Path) -> None:
    """A transformer weights file that holds a pickle (where safetensors would be) is refused, never run.
    (Heads files are covered by the checkpoint tests, which follow the saved layout.)"""
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    marker = tmp_path / "payload-ran"
    weights = next(model.rglob("model.safetensors"))
    weights.unlink()
    torch.save(pickle_payload(marker), weights.parent / "pytorch_model.bin")
    refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--queries",
             world["qa"], "--output", tmp_path / "o.json", "--device", "cpu", "--cache-dir", tmp_path / "c",
             "--skip-model-check"], "refused")
    assert not marker.exists(), "the pickle payload must never run"
    assert not (tmp_path / "o.json").exists()


# --------------------------------------------------------------------------------------------- bad flags
def test_issue_flag_cases(world: dict, tmp_path: Path) -> None:
    common = ["--model", world["model"], "--device", "cpu"]
    refused(["retrieve", "--index", world["idx"], "--queries", world["qa"], "--batch-size", "0"],
            "--batch-size: '0' is not a positive integer")
    train = ["train", "--train", world["train"], "--output", tmp_path / "t", *common]
    refused([*train, "--learning-rate", "-1"], "argument --learning-rate: '-1' is not a positive number")
    refused([*train, "--learning_rate", "-1"], "argument --learning_rate: '-1' is not a positive number")
    refused([*train, "--num-workers", "-1"], "--num-workers: '-1' is neither auto nor an integer >= 0")
    refused([*train, "--max-steps", "-1"], "--max-steps: '-1' is not a positive integer")
    refused([*train, "--projection-dim", "0"], "--projection-dim: '0' is not an integer from 1 to 65536")
    refused([*train, "--query-chunk-size", "0"], "--query-chunk-size")
    assert not (tmp_path / "t").exists(), "a refused command must not create its output folder"
    encode = ["encode", "--corpus", world["corpus"], "--output", tmp_path / "e", *common]
    refused([*encode, "--max-length", "-5"], "--max-length: '-5' is not a positive integer")
    refused([*encode, "--max-length", "0"], "--max-length: '0' is not a positive integer")
    assert not (tmp_path / "e").exists()
    (tmp_path / "file").write_text("x")
    refused(["encode", *common, "--corpus", world["corpus"], "--output", tmp_path / "file"], "is a file, not a folder")
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", tmp_path],
            "--output: path", "is a folder")
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--plot", tmp_path], "--plot: path")
    refused(["retrieve", "--index", world["idx"], "--queries", world["qa"], "--output", tmp_path], "--output")
    refused(["mine", "--train-file", world["train"], "--corpus", world["corpus"], "--output", tmp_path], "--output")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="this machine has cuda:7")
def test_missing_gpu_is_refused(world: dict, tmp_path: Path) -> None:
    for device in (["cuda:7"] if torch.cuda.is_available() else ["cuda", "cuda:7"]):
        refused(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", tmp_path / "e",
                 "--device", device], f"--device: '{device}'")
        refused(["train", "--train", world["train"], "--output", tmp_path / "t", "--device", device], "--device")
    assert not (tmp_path / "e").exists() and not (tmp_path / "t").exists()


def test_flags_that_would_be_ignored_are_refused_saying_what_to_add_or_drop(world: dict, tmp_path: Path) -> None:
    """mine's dense flags without --source dense (it would mine with BM25), BM25 flags with it, --beir-split without
    --beir-dir, and retrieve's --k without --evaluate, --run-tag without --trec-run, --compact without --output are
    refused in one line, before anything is read or written; a flag given at its default value is not."""
    out = tmp_path / "o.json"
    mine = ["mine", "--train-file", world["train"], "--corpus", world["corpus"], "--output", out,
            "--cache-dir", tmp_path / "cache"]
    dense = [*mine, "--source", "dense", "--model", world["model"], "--index", world["idx"], "--device", "cpu"]
    bm25_default = "does not apply to --source bm25 (the default); add --source dense, or drop the flag"
    for extra, flag in [(["--index", world["idx"]], "--index"), (["--embeddings", tmp_path / "e"], "--embeddings"),
                        (["--device", "cpu"], "--device"), (["--batch-size", "8"], "--batch-size")]:
        refused([*mine, *extra], f"error: {flag} {bm25_default}")
    refused([*mine, "--model", world["model"], "--index", world["idx"]], "error: --model and --index do not apply to "
            "--source bm25 (the default); add --source dense, or drop them")  # every flag the rule refuses, at once
    refused([*dense, "--bm25-b", "0.5"], "error: --bm25-b does not apply to --source dense; drop the flag")
    refused([*dense, "--bm25-index", tmp_path / "b"], "error: --bm25-index does not apply to --source dense")
    for flag in ("--beir-split", "--split"):
        refused([*mine, flag, "test"], "error: --beir-split does not apply without --beir-dir")
    retrieve = ["retrieve", "--index", world["idx"], "--queries", world["qa"], "--device", "cpu",
                "--cache-dir", tmp_path / "cache"]
    refused([*retrieve, "--output", out, "--k", "2"],
            "error: --k does not apply without --evaluate (it sets the cut-offs evaluated); add --evaluate, or drop")
    refused([*retrieve, "--output", out, "--run-tag", "mine"], "error: --run-tag does not apply without --trec-run")
    refused([*retrieve, "--trec-run", tmp_path / "r.trec", "--compact"], "error: --compact does not apply without "
            "--output (it trims the results JSON); add --output FILE.json, or drop the flag")
    assert not out.exists() and not (tmp_path / "r.trec").exists() and not (tmp_path / "e").exists()
    code, err = call(cli.main, [*mine, "--beir-split", "train", "--bm25-k1", "0.9", "--batch-size", "64",
                                "--n-negatives", "1", "--top-k", "4"])
    assert code == 0 and "error" not in err, err
    assert out.is_file()


def test_gradient_cache_flags_with_no_grad_cache_are_refused_all_in_one_line(world: dict, tmp_path: Path) -> None:
    """``--no-grad-cache`` trains plainly, so chunk sizes, chunk tokens and a memory budget would be ignored: they
    are refused in one line naming each given, before anything is written; at their defaults (or without
    --no-grad-cache, or --loss-chunk-size, which the plain loss uses) they are not."""
    from dpr_gc.base.settings import refuse_flags_that_do_not_apply
    from dpr_gc.train.config import TrainConfig
    from dpr_gc.train.config import APPLIES

    out = tmp_path / "run"
    train = ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu"]
    refused([*train, "--no-grad-cache", "--query-chunk-size", "4", "--memory-budget", "1GB", "--query-chunk-tokens",
             "8"], "error: --query-chunk-size, --memory-budget and --query-chunk-tokens do not apply to plain training "
            "(--no-grad-cache: one graph over the whole batch); drop --no-grad-cache, or drop them")
    refused([*train, "--no-grad-cache", "--ctx_chunk_size", "4"], "error: --passage-chunk-size does not apply to "
            "plain training", "drop --no-grad-cache, or drop the flag")
    assert not out.exists()
    parser = cli.build_parser()
    at_defaults = ["--no-grad-cache", "--query-chunk-size", "auto", "--memory-budget", "0", "--loss-chunk-size", "8"]
    for extra in (["--no-grad-cache"], at_defaults, ["--query-chunk-size", "4", "--memory-budget", "1GB"]):
        refuse_flags_that_do_not_apply(TrainConfig, parser.parse_args([*map(str, train), *extra]), APPLIES)


def test_dev_flags_without_dev_are_refused_in_one_line(world: dict, tmp_path: Path) -> None:
    """--eval-every, --best-metric and the --dev-* limits only act on a dev set: without --dev they were silently
    ignored; now refused in one line naming each given, saying to add --dev. With --dev, or at their defaults, they
    are not."""
    from dpr_gc.base.settings import refuse_flags_that_do_not_apply
    from dpr_gc.train.config import TrainConfig
    from dpr_gc.train.config import APPLIES

    out = tmp_path / "run"
    train = ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu"]
    refused([*train, "--eval-every", "2", "--best-metric", "loss", "--dev-max-questions", "5"],
            "error: --eval-every, --best-metric and --dev-max-questions do not apply without --dev (there is no dev "
            "set to evaluate); add --dev FILE, or drop them")
    refused([*train, "--val_av_rank_hard_neg", "3"], "error: --dev-hard-negatives does not apply without --dev",
            "add --dev FILE, or drop the flag")
    assert not out.exists()
    parser = cli.build_parser()
    for extra in (["--best-metric", "avg_rank"], ["--dev", str(world["train"]), "--eval-every", "2"]):
        refuse_flags_that_do_not_apply(TrainConfig, parser.parse_args([*map(str, train), *extra]), APPLIES)


def test_lora_flags_without_lora_r_are_refused_in_one_line(world: dict, tmp_path: Path) -> None:
    """--lora-alpha, --lora-dropout and --lora-target-modules shape the adapters --lora-r brings: without it they were
    silently ignored (full fine-tuning, even with a module named foo); train and verify refuse them in one line naming
    each given, --lora-dropout 0 too (a given value, refused against a saved adapter's other dropout). With --lora-r
    they are not."""
    from dpr_gc.train.config import config_from_args

    out = tmp_path / "run"
    for command in ("train", "verify"):
        argv = [command, "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu"]
        refused([*argv, "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-target-modules", "foo"],
                "error: --lora-alpha, --lora-dropout and --lora-target-modules do not apply without --lora-r (LoRA is "
                "off: full fine-tuning); add --lora-r N, or drop them")
    assert not out.exists()
    parse = cli.build_parser().parse_args
    train = ["train", "--train", str(world["train"]), "--output", str(out)]
    assert config_from_args(parse([*train, "--lora-r", "4", "--lora-alpha", "8"])).model.lora.alpha == 8
    assert config_from_args(parse([*train])).model.lora is None
    with pytest.raises(DprGcError, match="--lora-dropout does not apply without --lora-r"):
        config_from_args(parse([*train, "--lora-dropout", "0"]))


def test_beir_flags_without_a_beir_folder_are_refused_in_one_line(world: dict, tmp_path: Path) -> None:
    """--beir-positives acts on BEIR folders among --train, --dev-beir-split on a BEIR folder given as --dev: with DPR
    files they were silently ignored; each is refused in one line saying what to give. With a BEIR folder they are
    not."""
    from dpr_gc.base.settings import refuse_flags_that_do_not_apply
    from dpr_gc.train.config import TrainConfig
    from dpr_gc.train.config import APPLIES

    out, beir = tmp_path / "run", tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    train = ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu"]
    refused([*train, "--beir-positives", "sample"], "error: --beir-positives does not apply without a BEIR folder "
            "among --train (a DPR file's record is one example); add a BEIR folder to --train, or drop the flag")
    for dev in ([], ["--dev", world["train"]]):
        refused([*train, *dev, "--dev-beir-split", "test"], "error: --dev-beir-split does not apply without a BEIR "
                "folder as --dev (it names the folder's qrels split); give --dev a BEIR folder, or drop the flag")
    assert not out.exists()
    parse = cli.build_parser().parse_args
    for extra in (["--train", str(beir), "--beir-positives", "sample"], ["--dev", str(beir), "--dev-beir-split", "test"]):
        refuse_flags_that_do_not_apply(TrainConfig, parse([*map(str, train), *extra]), APPLIES)
    # given at its default value, a flag changes nothing and passes, as settings built in code (which cannot tell)
    refuse_flags_that_do_not_apply(TrainConfig, parse([*map(str, train), "--dev-beir-split", "dev"]), APPLIES)


def test_existing_output_file_is_replaced_atomically(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    out.write_text("old")
    code, err = call(cli.main, ["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", out,
                                "--k", "1"])
    assert code == 0, err
    assert "qrels" in json.loads(out.read_text()) and not list(tmp_path.glob(".*.tmp"))


def test_an_output_file_is_never_half_written_under_its_name(tmp_path: Path) -> None:
    """``atomic_path``'s promise: while the block writes, and after it fails, the final name holds the old file
    whole; the new one appears under it only when the block succeeds; no temporary is left either way."""
    out = tmp_path / "scores.json"
    out.write_text("old")
    with pytest.raises(RuntimeError, match="stopped"):
        with atomic_path(out) as tmp:
            tmp.write_text("half")
            assert tmp != out and out.read_text() == "old"
            raise RuntimeError("stopped")
    assert out.read_text() == "old" and sorted(tmp_path.iterdir()) == [out]
    with atomic_path(out) as tmp:
        tmp.write_text("new")
        assert out.read_text() == "old"
    assert out.read_text() == "new" and sorted(tmp_path.iterdir()) == [out]


def test_an_output_gets_a_new_files_permissions_and_one_of_several_files_puts_its_record_in_last(
        tmp_path: Path, monkeypatch) -> None:
    """An output has the permissions any new file gets (0o666 less the umask), not the temporary's private 0o600.
    Files written as one output (``atomic_paths``) replace the old ones with the record, the last, withdrawn first
    and put in last, so a record never sits beside files of another output; none of the old files stays behind."""
    from dpr_gc.base import files

    umask = os.umask(0o022)
    try:
        files.write_json(tmp_path / "a.json", {})
        os.umask(0o002)
        files.write_json(tmp_path / "b.json", {})
    finally:
        os.umask(umask)
    assert [stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("a.json", "b.json")] == [0o644, 0o664]
    plot, record = tmp_path / "report.png", tmp_path / "metrics.json"
    plot.write_text("old plot")
    record.write_text("old record")
    moves, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moves.append((Path(a).name, Path(b).name)), replace(a, b))[1])
    with files.atomic_paths(plot, record) as (new_plot, new_record):
        new_plot.write_text("new plot")
        new_record.write_text("new record")
    hidden = [tuple("temporary" if name.startswith(".") else name for name in move) for move in moves]
    assert hidden == [("metrics.json", "temporary"), ("report.png", "temporary"), ("temporary", "report.png"),
                      ("temporary", "metrics.json")], moves
    assert (plot.read_text(), record.read_text()) == ("new plot", "new record")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "metrics.json", "report.png"]


BAD_VALUES = {flag_types.positive_int: "0", flag_types.nonnegative_int: "-1", flag_types.positive_float: "-1",
              flag_types.nonnegative_float: "-1", flag_types.any_float: "nan", flag_types.device_arg: "cuda:99",
              flag_types.unit_float: "1.5", flag_types.seed_int: str(2 ** 32), flag_types.layer_size: "65537"}


# flag type -> (the values at both ends of the range its words name, one past each end)
RANGE_ENDS = {"unit_float": (("0", "1"), ("-0.001", "1.001")),
              "seed_int": (("0", str(2 ** 32 - 1)), ("-1", str(2 ** 32))),
              "proper_fraction": (("0", "0.999"), ("-0.001", "1")), "layer_size": (("1", "65536"), ("0", "65537")),
              "positive_int": (("1",), ("0",)), "nonnegative_int": (("0",), ("-1",))}


@pytest.mark.parametrize("name", list(RANGE_ENDS))
def test_a_bounded_flag_type_takes_both_ends_its_words_name_and_refuses_past_them(name: str) -> None:
    """``--bm25-b`` says "0 to 1", ``--seed`` "from 0 to 4294967295", ``--projection-dim`` "from 1 to 65536": each
    end is taken, on the command line and in code alike, and one past either end refused with those words."""
    import argparse

    kind, (ends, past) = getattr(flag_types, name), RANGE_ENDS[name]
    for text in ends:
        assert kind(text) == type(kind(text))(text) and kind.accepts(kind(text)), text
    for text in past:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"is not {kind.__name__}")):
            kind(text)
        assert not kind.accepts(float(text) if "." in text else int(text)), text


def validated_flags(parser: Any, prefix: list[str]) -> list[tuple[list[str], str, str, str]]:
    """``(argv prefix + required flags, flag, bad value, needle)`` for every validated flag of a parser (typed or
    with choices; recursing into sub-commands); required flags get harmless dummy values."""
    import argparse

    cases = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                cases += validated_flags(sub, prefix + [name])
    required = [a for a in parser._actions if a.required and a.option_strings]
    base = prefix + [x for a in required for x in (a.option_strings[0], a.choices[0] if a.choices else "dummy")]
    for action in parser._actions:
        if not action.option_strings:
            continue
        flag = action.option_strings[0]
        bad = BAD_VALUES.get(action.type)
        if action.type is flag_types.output_file:
            bad = "/"
        elif action.type is flag_types.plot_file:
            bad = "curve.txt"
        elif action.type in (flag_types.output_dir, flag_types.input_dir):
            bad = str(ROOT / "README.md")
        elif getattr(action.type, "__name__", "").startswith("auto or "):  # auto or a number
            bad = "-1"
        elif getattr(action.type, "__name__", "") == "index_kind":
            bad = "no-such-kind"
        elif action.choices and not isinstance(action, argparse._SubParsersAction):
            bad = "no-such-choice"
        if bad is not None:
            cases.append((base, flag, bad, flag))  # the spelling typed (not every spelling, as argparse names it)
    return cases


def entry_points() -> list[tuple[str, Callable[[list[str]], int], Any]]:
    dense = load_script("dense_retriever")
    embeddings = load_script("generate_dense_embeddings")
    return [("dpr-gc", cli.main, cli.build_parser()), ("dense_retriever", dense.main, dense.build_parser()),
            ("generate_dense_embeddings", embeddings.main, embeddings_parser(embeddings))]


def embeddings_parser(module: Any) -> Any:
    parser = flag_types.ArgumentParser()
    module.add_arguments(parser, dpr_aliases=True)
    return parser


def test_every_numeric_and_path_flag_of_every_command_is_validated() -> None:
    checked = 0
    for name, main, parser in entry_points():
        cases = validated_flags(parser, [])
        assert cases, name
        for base, flag, bad, needle in cases:
            code, err = call(main, [*base, f"{flag}={bad}"])
            assert_one_error(code, err, needle)
            checked += 1
    assert checked > 80
    untyped = [a.option_strings for _, _, parser in entry_points() for a in all_actions(parser)
               if a.type in (int, float)]
    assert not untyped, f"flags parsed without validation: {untyped}"


def all_actions(parser: Any) -> list[Any]:
    import argparse

    out = []
    for action in parser._actions:
        out.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += all_actions(sub)
    return out


# --------------------------------------------------------------------------------------------- fuzz loop
def _mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out.append(data[:rng.randrange(len(data))])
        elif kind == 1:
            b = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out.append(bytes(b))
        else:
            pos = rng.randrange(len(data))
            out.append(data[:pos] + bytes([rng.choice(b'"\t\n{}[],\xff\x00\\')]) + data[pos:])
    return out


def _formats(world: dict) -> list[tuple[str, bytes, Callable[[Path, Path], Any]]]:
    corpus_jsonl = "".join(json.dumps({"_id": p, "title": t, "text": x}) + "\n" for p, t, x in passages(6)).encode()
    train_list = json.dumps(training_records(3)).encode()
    train_lines = "".join(json.dumps(r) + "\n" for r in training_records(3)).encode()
    return [
        ("corpus.tsv", tsv_bytes(passages(6)), lambda p, c: load_corpus(p, c)),
        ("corpus.jsonl", corpus_jsonl, lambda p, c: load_corpus(p, c)),
        ("corpus.jsonl.gz", gzip.compress(corpus_jsonl, mtime=0), lambda p, c: load_corpus(p, c)),
        ("qa.tsv", world["qa"].read_bytes(), lambda p, c: read_queries(p)),
        ("queries.jsonl", world["queries"].read_bytes(), lambda p, c: read_queries(p)),
        ("qrels.tsv", world["qrels"].read_bytes(), lambda p, c: read_qrels(p)),
        ("run.trec", world["run"].read_bytes(), lambda p, c: read_run(p)),
        ("results.json", world["results"].read_bytes(), lambda p, c: read_results(p)),
        ("train.json", train_list, lambda p, c: load_dpr_files([p], c)),
        ("train.jsonl", train_lines, lambda p, c: load_dpr_files([p], c)),
        ("train.json.gz", gzip.compress(train_list, mtime=0), lambda p, c: load_training_data([p], c)),
    ]


def test_fuzzed_inputs_are_read_or_refused_in_one_line(world: dict, tmp_path: Path) -> None:
    rng = random.Random(1234)
    outcomes = {"read": 0, "refused": 0}
    for name, data, read in _formats(world):
        read(_write(tmp_path / "valid" / name, data), tmp_path / "valid-cache")  # the unmutated file is valid
        for k, mutated in enumerate(_mutations(data, rng, 30)):
            path = _write(tmp_path / f"{k}" / name, mutated)
            cache = tmp_path / f"cache-{name}-{k}"
            try:
                read(path, cache)
                outcomes["read"] += 1
            except DprGcError as e:
                message = str(e)
                assert "\n" not in message and message, f"{name} mutation {k}: {message!r}"
                assert not list(cache.glob("*.arrow")), f"{name} mutation {k} left a cache file"
                outcomes["refused"] += 1
            assert not list(cache.glob(".*.tmp")) and not list(cache.glob("*.tmp")), "temporary files left"
    assert outcomes["refused"] > 100 and outcomes["read"] > 20, outcomes


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------------------------- real processes
def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _assert_process_refused(proc: subprocess.CompletedProcess, needle: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], proc.stderr
    assert needle in lines[-1]


def test_real_exit_status_of_cli_and_scripts(world: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"id\ttext\ttitle\np1\t\xff\tt\n")
    proc = _run(["-m", "dpr_gc.cli", "encode", "--model", str(world["model"]), "--corpus", str(bad), "--output",
                 str(tmp_path / "emb"), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"], tmp_path)
    _assert_process_refused(proc, "bad.tsv:2: not valid UTF-8")
    proc = _run([str(ROOT / "scripts" / "dense_retriever.py"), "--qa_file", str(world["qa"]), "--n_docs", "0"],
                tmp_path)
    _assert_process_refused(proc, "--n_docs: '0' is not a positive integer")
    proc = _run([str(ROOT / "scripts" / "train_dense_encoder.py"), "--train_file", str(world["train"]),
                 "--output_dir", str(tmp_path / "t"), "--learning_rate", "-1"], tmp_path)
    _assert_process_refused(proc, "'-1' is not a positive number")
    assert not (tmp_path / "emb").exists() and not (tmp_path / "t").exists()


def test_optional_flags_can_still_be_left_unset(world: dict) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--train", str(world["train"]), "--output", "out"])
    assert args.max_steps is None and args.projection_dim is None and args.device is None
    assert args.query_chunk_size == "auto" and args.num_workers == "auto"



def test_library_configs_refuse_what_the_flags_refuse(tmp_path: Path) -> None:
    from dpr_gc.train.config import DataConfig, OptimConfig, RunConfig

    for group, field, value in ((OptimConfig, "max_steps", -1), (DataConfig, "num_workers", -1),
                                (OptimConfig, "learning_rate", -1.0), (OptimConfig, "learning_rate", float("nan")),
                                (RunConfig, "eval_every", 0)):
        with pytest.raises(DprGcError, match="must be"):
            group(**{field: value})
    with pytest.raises(DprGcError, match="--projection-dim must be an integer from 1 to 65536"):
        RetrieverConfig(projection_dim=0)


def test_retrieve_and_mine_refuse_a_corpus_edited_after_encoding(world: dict, tmp_path: Path) -> None:
    """A same-size edit that restores the modification time must not pair new passage text with old vectors."""
    from dpr_gc.data.corpus import corpus_fingerprint

    corpus, cache = tmp_path / "corpus.tsv", tmp_path / "cache"
    shutil.copy(world["corpus"], corpus)
    encode_corpus(Retriever.load(world["model"]), corpus, tmp_path / "emb", 0, 1, dtype="float32", cache_dir=cache,
                  model_name=str(world["model"]), show_progress=False)
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    meta = json.loads((tmp_path / "idx" / "index_meta.json").read_text())
    assert meta["corpus_fingerprint"] == corpus_fingerprint(corpus)
    stat, text = corpus.stat(), passages()[3][2]
    corpus.write_text(corpus.read_text().replace(text, text[::-1]))
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert corpus.stat().st_size == stat.st_size and corpus.stat().st_mtime_ns == stat.st_mtime_ns
    out = tmp_path / "out.json"
    needle = "content differs from the one encoded"
    refused(["retrieve", "--index", tmp_path / "idx", "--queries", world["qa"], "--output", out,
             "--cache-dir", cache, "--device", "cpu"], needle, "re-run encode and index")
    refused(["mine", "--source", "dense", "--model", world["model"], "--index", tmp_path / "idx", "--train-file",
             world["train"], "--output", tmp_path / "mined.json", "--cache-dir", cache, "--device", "cpu"], needle)
    assert not out.exists() and not (tmp_path / "mined.json").exists()


def test_mine_refuses_a_bad_training_file(world: dict, tmp_path: Path) -> None:
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps(training_records()) + " garbage")
    refused(["mine", "--train-file", bad, "--corpus", world["corpus"], "--output", tmp_path / "mined.json",
             "--cache-dir", tmp_path / "cache"], "train.json:1: unexpected text after the end of the JSON list")
    assert not (tmp_path / "mined.json").exists()
    assert not (tmp_path / "cache").exists()  # the file is checked before the corpus is read (and cached)


# ------------------------------------------------------------------ guarantees every stage keeps (issue 25)


def retrieve_argv(world: dict, *extra: object) -> list:
    return ["retrieve", "--index", world["idx"], "--model", world["model"], "--corpus", world["corpus"],
            "--device", "cpu", *extra]


# --------------------------------------------------------------------------------------------- the output guard
def test_output_that_is_an_input_is_refused_in_every_stage(world: dict, tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    shutil.copy(world["qa"], qa)
    before = qa.read_bytes()
    refused(retrieve_argv(world, "--queries", qa, "--output", qa), "--output", "is the input --queries")
    run = tmp_path / "run.trec"
    shutil.copy(world["run"], run)
    refused(["evaluate", "--run", run, "--qrels", world["qrels"], "--output", run], "is the input --run")
    corpus = tmp_path / "c.tsv"
    shutil.copy(world["corpus"], corpus)
    refused(["mine", "--train-file", world["train"], "--corpus", corpus, "--output", corpus], "is the input --corpus")
    refused(["merge-lora", "--model", world["model"], "--output", world["model"]], "is the input --model")
    refused(["merge-lora", "--model", world["model"], "--output", world["root"]], "holds the input --model")
    refused(["index", "--embeddings", world["emb"], "--output", world["emb"]], "is the input --embeddings")
    assert qa.read_bytes() == before and run.read_text() == world["run"].read_text()
    assert corpus.read_bytes() == world["corpus"].read_bytes()


def guarded_stages(world: dict, dev: Path) -> list[tuple[list, dict[str, Path], list[str]]]:
    """Each stage (a command line without its inputs), the path each of its input flags reads, and its output
    flags with what each takes (a folder given where a file name belongs, or the reverse, is refused by the flag
    itself, before the guard; ``--plot`` takes only an image's name)."""
    return [(["retrieve", "--device", "cpu"], {"--index": world["idx"], "--model": world["model"], "--corpus":
                                               world["corpus"], "--queries": world["queries"], "--qrels":
                                               world["qrels"]}, ["--output FILE", "--trec-run FILE"]),
            (["evaluate"], {"--run": world["run"], "--qrels": world["qrels"]}, ["--output FILE"]),
            (["evaluate"], {"--results": world["results"]}, ["--output FILE"]),
            (["encode", "--device", "cpu"], {"--model": world["model"], "--corpus": world["corpus"]},
             ["--output DIR"]),
            (["index"], {"--embeddings": world["emb"]}, ["--output DIR"]),
            (["mine"], {"--train-file": world["train"], "--corpus": world["corpus"]}, ["--output FILE"]),
            (["train", "--device", "cpu"], {"--train": world["train"], "--dev": dev, "--model": world["model"]},
             ["--output DIR"]),
            (["merge-lora"], {"--model": world["model"]}, ["--output DIR"]),
            (["demo"], {"--model": world["model"]}, ["--output DIR"])]


def test_every_input_flag_of_every_stage_is_refused_as_each_of_its_outputs(world: dict, tmp_path: Path) -> None:
    """The guard knows each stage's inputs: any one of them given as any output of the run is refused in one line
    naming both flags, and nothing is written."""
    dev = tmp_path / "dev.json"
    shutil.copy(world["train"], dev)
    before = folder_bytes(world["root"], dev)
    for command, inputs, outputs in guarded_stages(world, dev):
        given = [a for flag, path in inputs.items() for a in (flag, path)]
        for in_flag, path in inputs.items():
            for out_flag, kind in (o.partition(" ")[::2] for o in outputs):
                if path.is_dir() != (kind == "DIR"):
                    continue
                refused(command + given + [out_flag, path], f"{out_flag} {path} is the input {in_flag} ")
    assert folder_bytes(world["root"], dev) == before


def own_index(world: dict, tmp_path: Path) -> dict[str, Path]:
    """A copy of the world's model and corpus, encoded and indexed in ``tmp_path`` (the index records both)."""
    model, corpus, cache = tmp_path / "model", tmp_path / "corpus.tsv", tmp_path / "cache"
    shutil.copytree(world["model"], model)
    shutil.copy(world["corpus"], corpus)
    encode_corpus(Retriever.load(model), corpus, tmp_path / "emb", 0, 1, dtype="float32", cache_dir=cache,
                  model_name=str(model), show_progress=False)
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams("flat"))
    return {"model": model, "corpus": corpus, "emb": tmp_path / "emb", "idx": tmp_path / "idx", "cache": cache}


def folder_bytes(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()}


def test_an_output_inside_an_input_folder_is_refused(world: dict, tmp_path: Path) -> None:
    """Files inside an input folder are inputs too: an index's, a model's (also the model and corpus an index
    records when --model/--corpus are left out), a BEIR folder's."""
    own = own_index(world, tmp_path)
    beir = tmp_path / "beir"
    shutil.copytree(ROOT / "data" / "examples" / "beir", beir)
    before = folder_bytes(own["model"], own["corpus"], own["idx"], beir)
    base = ["retrieve", "--index", own["idx"], "--queries", world["qa"], "--device", "cpu", "--cache-dir", own["cache"]]
    refused(base + ["--output", own["idx"] / "index_meta.json"], "--output", "lies inside the input --index")
    refused(base + ["--trec-run", own["model"] / "vocab.txt"], "--trec-run", "the index's recorded --model")
    refused(base + ["--output", own["corpus"]], "--output", "is the input the index's recorded --corpus")
    refused(base + ["--model", own["model"], "--output", own["model"] / "config.json"], "inside the input --model")
    refused(["mine", "--source", "bm25", "--beir-dir", beir, "--output", beir / "corpus.jsonl", "--cache-dir",
             own["cache"]], "--output", "lies inside the input --beir-dir")
    assert folder_bytes(own["model"], own["corpus"], own["idx"], beir) == before


@pytest.mark.parametrize("command", ["train", "encode", "mine", "retrieve", "prepare-data"])
@pytest.mark.parametrize("where", ["is", "inside"])
@pytest.mark.parametrize("how", ["--cache-dir", "$DPR_GC_CACHE"])
def test_the_cache_folder_is_an_output_never_an_input_nor_inside_one(world: dict, tmp_path: Path, command: str,
                                                                      where: str, how: str, monkeypatch) -> None:
    """``--cache-dir`` is written by every command that takes it: given as an input folder (a BEIR folder, a model)
    or inside one, it is refused in one line naming it before anything is written. So is ``$DPR_GC_CACHE`` when no
    ``--cache-dir`` is given (the caches went into the model folder)."""
    beir, model, out = tmp_path / "beir", tmp_path / "model", tmp_path / "out"
    shutil.copytree(ROOT / "data" / "examples" / "beir", beir)
    shutil.copytree(world["model"], model)
    folder, flag = (model, "--model") if command in ("encode", "retrieve") else (
        (beir, "the training source") if command == "prepare-data" else (beir, "--beir-dir" if command == "mine"
                                                                           else "--train"))
    cache = folder if where == "is" else folder / "cache"
    argv = {"train": ["train", "--train", beir, "--output", out, "--model", model, "--device", "cpu"],
            "encode": ["encode", "--model", model, "--corpus", world["corpus"], "--output", out, "--device", "cpu"],
            "mine": ["mine", "--beir-dir", beir, "--output", out / "mined.jsonl"],
            "retrieve": retrieve_argv({**world, "model": model}, "--queries", world["qa"], "--output",
                                      out / "r.json"),
            "prepare-data": ["prepare-data", beir]}[command]
    before = folder_bytes(beir, model)
    reason = f"is the input {flag} {folder}" if where == "is" else f"lies inside the input {flag} {folder}"
    if how == "--cache-dir":
        argv += ["--cache-dir", cache]
    else:
        monkeypatch.setenv("DPR_GC_CACHE", str(cache))
    refused(argv, f"{how} {cache} {reason}")
    assert folder_bytes(beir, model) == before and not out.exists()
    assert not (folder / "cache").exists()


def test_an_index_folder_holding_other_files_is_not_replaced(world: dict, tmp_path: Path) -> None:
    """An index folder is replaced whole, so a rebuild refuses one that holds anything but the index: here the
    model the shards were encoded with, and a note."""
    own = own_index(world, tmp_path)
    shutil.move(own["model"], own["idx"] / "model")
    (own["idx"] / "notes.txt").write_text("mine")
    refused(["index", "--embeddings", own["emb"], "--output", own["idx"]], "holds model, notes.txt beside its index")
    assert (own["idx"] / "notes.txt").read_text() == "mine" and (own["idx"] / "model" / "config.json").is_file()
    for name in ("model", "notes.txt"):
        shutil.move(own["idx"] / name, tmp_path / name)
    (own["idx"] / ".git").mkdir()
    refused(["index", "--embeddings", own["emb"], "--output", own["idx"]], "holds .git beside its index")
    assert (own["idx"] / ".git").is_dir()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    refused(["index", "--embeddings", own["emb"], "--output", notes], f"{notes} is a folder that holds no index")
    assert [p.name for p in notes.iterdir()] == ["notes.txt"] and (notes / "notes.txt").read_text() == "mine"


def test_an_empty_input_path_is_refused_naming_its_flag(world: dict, tmp_path: Path) -> None:
    refused(retrieve_argv(world, "--queries", "", "--output", tmp_path / "r.json"), "--queries is empty")
    refused(["evaluate", "--run", "", "--qrels", world["qrels"]], "--run is empty")


@pytest.mark.parametrize("command", ["index", "encode", "retrieve", "make-stdlib-data"])
def test_an_empty_output_path_is_refused(world: dict, tmp_path: Path, monkeypatch, command: str) -> None:
    """``--output ""`` would be the working folder: written into, or replaced whole by ``index``."""
    monkeypatch.chdir(tmp_path)
    argv = {"index": ["index", "--embeddings", world["emb"]],
            "encode": ["encode", "--model", world["model"], "--corpus", world["corpus"]],
            "retrieve": retrieve_argv(world, "--queries", world["qa"]), "make-stdlib-data": ["make-stdlib-data"]}
    refused(argv[command] + ["--output", ""], "--output", "empty")
    assert list(tmp_path.iterdir()) == []


def test_two_outputs_of_one_run_may_not_be_the_same_path(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "x"
    refused(retrieve_argv(world, "--queries", world["qa"], "--output", out, "--trec-run", out),
            "--trec-run", "are the same path")
    png = tmp_path / "x.png"
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", png, "--plot", png],
            "same path")
    refused(retrieve_argv(world, "--queries", world["qa"], "--output", out, "--cache-dir", out),
            f"--cache-dir {out} and --output {out} are the same path (or links to one)")
    assert not out.exists() and not png.exists()


def read_only(monkeypatch, folder: Path) -> None:
    """Make creating anything under ``folder`` fail as on a read-only file system (root ignores chmod)."""
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_CREAT | os.O_WRONLY | os.O_RDWR

    def refuse(path: Any) -> None:
        if os.path.abspath(path).startswith(f"{folder}{os.sep}"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def opened(path: Any, flags: int, *more: Any, **named: Any) -> int:
        if flags & writes:
            refuse(path)
        return real_open(path, flags, *more, **named)

    def made(path: Any, *more: Any, **named: Any) -> None:
        refuse(path)
        real_mkdir(path, *more, **named)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "mkdir", made)


STAGE_OUTPUTS = [("index", "idx"), ("index", "new/idx"), ("encode", "emb"), ("retrieve", "r.json"),
                 ("trec-run", "r.trec"), ("evaluate", "ev.json"), ("mine", "m.json"), ("train", "run"),
                 ("merge-lora", "merged"), ("make-stdlib-data", "std"), ("demo", "demo"),
                 ("dense_retriever.py", "r.json")]


def stage_argv(world: dict, tmp_path: Path, command: str, out: Path) -> tuple[list, str, Callable[[list], int]]:
    """(argv, the output's flag, main) of a run of ``command`` (a stage, ``trec-run`` or a DPR script) on the
    world's valid inputs that writes its output at ``out``."""
    cache, flag, main = tmp_path / "cache", "--output", cli.main
    argv = {"index": ["index", "--embeddings", world["emb"], "--output", out],
            "encode": ["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", out, "--device",
                       "cpu", "--cache-dir", cache],
            "retrieve": retrieve_argv(world, "--queries", world["qa"], "--output", out),
            "trec-run": retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / "r.json", "--trec-run",
                                      out),
            "evaluate": ["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", out],
            "mine": ["mine", "--train-file", world["train"], "--corpus", world["corpus"], "--output", out,
                     "--cache-dir", cache],
            "train": ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device",
                      "cpu", "--cache-dir", cache],
            "merge-lora": ["merge-lora", "--model", world["model"], "--output", out],
            "make-stdlib-data": ["make-stdlib-data", "--output", out],
            "demo": ["demo", "--output", out, "--model", world["model"]],
            "dense_retriever.py": ["--model_file", world["model"], "--qa_dataset", world["qa"], "--encoded_ctx_file",
                                   world["emb"], "--out_file", out]}[command]
    if command == "trec-run":
        flag = "--trec-run"
    elif command == "dense_retriever.py":
        flag, main = "--out_file", load_script("dense_retriever").main
    return argv, flag, main


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("command, output", STAGE_OUTPUTS)
def test_an_output_where_nothing_may_be_written_is_named_with_its_flag(world: dict, tmp_path: Path, monkeypatch,
                                                                       command: str, output: str, depth: int) -> None:
    """An output in a read-only folder was reported through its lock file (``error: ro/.idx.lock: Read-only file
    system``) or the folder created for it, without the flag; every command names the flag, the output and why.
    With ``depth`` 2 the read-only folder and its parent are new: the refused run leaves no empty folder behind."""
    ro = tmp_path.joinpath("ro", *["new"] * depth)
    if depth == 0:
        ro.mkdir()
    out = ro / output
    argv, flag, main = stage_argv(world, tmp_path, command, out)
    read_only(monkeypatch, ro)
    line = refused(argv, f"{flag} {out} cannot be written: read-only file system in {ro}", main=main)
    assert ".lock" not in line
    assert list(ro.iterdir()) == [] if depth == 0 else not (tmp_path / "ro").exists()


@pytest.mark.parametrize("command, output", STAGE_OUTPUTS)
def test_an_output_that_is_a_pipe_is_refused_and_left_as_it_is(world: dict, tmp_path: Path, command: str,
                                                               output: str) -> None:
    """Outputs are written to a new file or folder renamed into place: over a FIFO or a device (``/dev/null`` run
    as root) that would put a regular file in its place."""
    out = tmp_path / output
    out.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(out)
    argv, flag, main = stage_argv(world, tmp_path, command, out)
    refused(argv, flag, f"{out} is a device, pipe or socket, not a file", main=main)
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


@pytest.mark.parametrize("command", ["evaluate", "index"])
def test_an_output_that_is_a_link_is_written_through_it(world: dict, tmp_path: Path, command: str) -> None:
    """A symbolic link as the output keeps being a link: its target gets the output (file or whole folder). A loop
    of links, or a link into a folder that does not exist, is refused (the loop was replaced by a file, the missing
    folders were made). What a killed run left beside the target is cleaned up, as beside any output."""
    target, link = tmp_path / "elsewhere" / "target", tmp_path / "link"
    target.parent.mkdir()
    if command == "index":
        target.mkdir()
        (target.parent / ".target.dead1234.new").mkdir()  # what a killed run left beside the target
    else:
        (target.parent / ".target.dead1234.tmp").write_text("half")
    link.symlink_to(target)
    argv, _, main = stage_argv(world, tmp_path, command, link)
    code, err = call(main, argv)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "index.faiss").is_file() if command == "index" else "qrels" in json.loads(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link"]
    assert [p.name for p in target.parent.iterdir()] == ["target"]
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing" / "target")
    _, flag, _ = stage_argv(world, tmp_path, command, link)
    refused(stage_argv(world, tmp_path, command, tmp_path / "loop")[0], flag, "is a loop of symbolic links")
    refused(stage_argv(world, tmp_path, command, tmp_path / "nowhere")[0], flag,
            f"is a symbolic link into {tmp_path / 'missing'}, which is not a folder")
    assert (tmp_path / "loop").is_symlink() and not (tmp_path / "missing").exists()


def test_a_run_refused_for_a_missing_input_leaves_no_folders(world: dict, tmp_path: Path) -> None:
    """Output folders made for a run's locks go again when it is refused: none of ``new/`` is left."""
    missing, new = tmp_path / "missing", tmp_path / "new"
    refused(["evaluate", "--results", missing, "--output", new / "m" / "metrics.json", "--plot", new / "p" / "p.png"],
            "missing")
    refused(retrieve_argv(world, "--queries", missing, "--output", new / "o" / "r.json", "--trec-run",
                          new / "t" / "r.trec"), "missing")
    refused(["index", "--embeddings", missing, "--output", new / "i" / "idx"], "missing")
    refused(["merge-lora", "--model", missing, "--output", new / "l" / "merged"], "missing")
    refused(["train", "--train", missing, "--output", new / "r" / "run", "--model", world["model"], "--device", "cpu"],
            "missing")
    assert not new.exists()


@pytest.mark.parametrize("command", ["train", "encode", "mine", "retrieve", "prepare-data", "dense_retriever.py"])
@pytest.mark.parametrize("how", ["--cache-dir", "$DPR_GC_CACHE", "home"])
def test_a_cache_folder_where_nothing_may_be_written_is_refused_up_front_naming_what_set_it(
        world: dict, tmp_path: Path, monkeypatch, command: str, how: str) -> None:
    """Every command that caches parsed data probes its cache folder before anything runs: ``--cache-dir``, else
    ``$DPR_GC_CACHE``, else ``~/.cache/dpr_gc``, named by what set it (an unwritable ``$DPR_GC_CACHE`` failed when
    the first cache was written, train after its model loaded, as ``error: DIR: Read-only file system``)."""
    beir, ro, out = tmp_path / "beir", tmp_path / "ro", tmp_path / "out"
    shutil.copytree(ROOT / "data" / "examples" / "beir", beir)
    ro.mkdir()
    argv, main = {"train": ["train", "--train", beir, "--output", out, "--model", world["model"], "--device", "cpu"],
                  "encode": ["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", out,
                             "--device", "cpu"],
                  "mine": ["mine", "--beir-dir", beir, "--output", out],
                  "retrieve": retrieve_argv(world, "--queries", world["qa"], "--output", out),
                  "prepare-data": ["prepare-data", beir],
                  "dense_retriever.py": ["--model_file", world["model"], "--qa_dataset", world["qa"],
                                         "--encoded_ctx_file", world["emb"], "--out_file", out]}[command], cli.main
    flag = "--cache-dir"
    if command == "dense_retriever.py":
        flag, main = "--cache_dir", load_script("dense_retriever").main
    cache = ro / ".cache" / "dpr_gc" if how == "home" else ro / "cache"
    if how == "--cache-dir":
        argv += [flag, cache]
        want = f"{flag} {cache} cannot be written: read-only file system in {ro}; give an output in a folder"
    elif how == "$DPR_GC_CACHE":
        monkeypatch.setenv("DPR_GC_CACHE", str(cache))
        want = (f"$DPR_GC_CACHE {cache} cannot be written: read-only file system in {ro}; point DPR_GC_CACHE to a "
                f"folder this user can write to, or give {flag}")
    else:
        monkeypatch.delenv("DPR_GC_CACHE")
        monkeypatch.setenv("HOME", str(ro))
        want = (f"the cache folder {cache} ($DPR_GC_CACHE is not set) cannot be written: read-only file system in "
                f"{ro}; set DPR_GC_CACHE to a folder this user can write to, or give {flag}")
    import dpr_gc.train.trainer as trainer

    loaded: list[str] = []
    monkeypatch.setattr(trainer, "build_retriever", lambda *a, **k: loaded.append("model") or pytest.fail("loaded"))
    read_only(monkeypatch, ro)
    refused(argv, want, main=main)
    assert list(ro.iterdir()) == [] and not out.exists() and not loaded


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs, where no one may create files")
def test_an_output_in_sysfs_is_named_with_its_flag(world: dict) -> None:
    """The same without a stand-in: sysfs refuses new files and folders even to root."""
    out = Path("/sys/dpr-gc-test-index")
    line = refused(["index", "--embeddings", world["emb"], "--output", out], f"--output {out} cannot be written: ",
                   "in /sys;")
    assert ".lock" not in line and not out.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux procfs, where no one may create files")
def test_an_output_or_cache_folder_in_procfs_is_named_with_its_flag(world: dict, tmp_path: Path, monkeypatch) -> None:
    """procfs refuses a new file with "No such file or directory" in a folder that exists: an output there, or a
    cache folder, is named by its flag or variable, never by the lock beside it."""
    beir = tmp_path / "beir"
    shutil.copytree(ROOT / "data" / "examples" / "beir", beir)
    out, idx, cache = Path("/proc/dpr-gc-test.json"), Path("/proc/dpr-gc-test-index"), Path("/proc/dpr-gc-test-cache")
    line = refused(retrieve_argv(world, "--queries", world["qa"], "--output", out, "--cache-dir", tmp_path / "c"),
                   f"--output {out} cannot be written: ", "in /proc;")
    assert ".lock" not in line
    line = refused(["index", "--embeddings", world["emb"], "--output", idx], f"--output {idx} cannot be written: ",
                   "in /proc;")
    assert ".lock" not in line
    refused(["prepare-data", beir, "--cache-dir", cache], f"--cache-dir {cache} cannot be written: ", "in /proc;")
    monkeypatch.setenv("DPR_GC_CACHE", str(cache))
    refused(["prepare-data", beir], f"$DPR_GC_CACHE {cache} cannot be written: ", "in /proc;", "point DPR_GC_CACHE")
    assert not any(p.exists() for p in (out, idx, cache))


def test_links_to_an_input_are_refused(world: dict, tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    shutil.copy(world["qa"], qa)
    (tmp_path / "soft.tsv").symlink_to(qa)
    os.link(qa, tmp_path / "hard.tsv")
    for link in ("soft.tsv", "hard.tsv"):
        refused(retrieve_argv(world, "--queries", qa, "--output", tmp_path / link), "is the input --queries")
    (tmp_path / "dir").symlink_to(tmp_path)
    refused(retrieve_argv(world, "--queries", qa, "--output", tmp_path / "dir" / "qa.tsv"), "is the input")
    assert qa.read_bytes() == world["qa"].read_bytes()


def test_encode_refuses_an_index_or_model_folder_as_its_output(world: dict, tmp_path: Path) -> None:
    """Shards written into an index folder (or a folder inside one) made it one that index then refused; into a
    model folder, a mix."""
    for name in ("idx", "model"):
        folder = tmp_path / name
        shutil.copytree(world[name], folder)
        before = folder_bytes(folder)
        refused(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", folder, "--cache-dir",
                 tmp_path / "cache"], f"the output folder {folder} holds {'an index' if name == 'idx' else 'a model'}")
        assert folder_bytes(folder) == before
    inside = tmp_path / "idx" / "sub" / "emb"  # a rebuild replaces the index folder whole: refused, shards and all
    refused(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", inside, "--cache-dir",
             tmp_path / "cache"], f"the output folder {inside} lies inside the index folder {tmp_path / 'idx'}")
    assert not (tmp_path / "idx" / "sub").exists()
    script = load_script("dense_retriever")  # --save_or_load_index keeps the index beside the shards' folder
    assert script.dpr_index_path([tmp_path / "emb"]) == f"{tmp_path / 'emb'}.index"
    assert script.dpr_index_path([tmp_path / "emb" / "wiki_0"]) == f"{tmp_path / 'emb' / 'wiki'}.index"


def test_scripts_run_under_the_same_guard(world: dict, tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    shutil.copy(world["qa"], qa)
    script = load_script("dense_retriever")
    refused(["--model_file", world["model"], "--qa_dataset", qa, "--encoded_ctx_file", world["emb"],
             "--out_file", qa], "--out_file", "is the input --qa_dataset", main=script.main)
    refused(["--model_file", world["model"], "--qa_dataset", world["queries"], "--encoded_ctx_file", world["emb"]],
            "nothing to do: give --out_file FILE.json and/or --trec_run FILE, or --evaluate",
            main=script.main)  # questions without answers: with answers, the script evaluates them as DPR does
    with pytest.raises(DprGcError) as caught, flags_renamed(script.SCRIPT_FLAGS):
        raise DiskFullError("--top-k 3; --cache-dir x; --model_file m --k 5 --output-dir")
    assert str(caught.value).startswith("--n_docs 3; --cache_dir x; --model_file m --k 5 --output-dir: the disk")
    refused(["--model_file", world["model"], "--qa_dataset", qa, "--encoded_ctx_file", world["emb"], "--index_path",
             world["emb"], "--out_file", tmp_path / "o.json"], f"--index_path {world['emb']} is the input "
            f"--encoded_ctx_file", main=script.main)
    train = load_script("train_dense_encoder")
    refused(["--train_file", world["train"], "--output_dir", world["train"]], "--output_dir", main=train.main)
    refused(["--train_file", world["train"], "--output_dir", Path(world["model"]) / "run", "--model_file",
             world["model"]], f"--output_dir {Path(world['model']) / 'run'} lies inside the input --model_file",
            main=train.main)
    assert not (Path(world["model"]) / "run").exists()
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    refused(["--model_file", model, "--qa_dataset", qa, "--encoded_ctx_file", world["emb"], "--out_file",
             tmp_path / "o.json", "--cache_dir", model / "cache"], f"--cache_dir {model / 'cache'} lies inside the "
            f"input --model_file {model}", main=script.main)
    refused(["--train_file", world["train"], "--output_dir", tmp_path / "t", "--model", model, "--cache-dir", model],
            f"--cache-dir {model} is the input --model {model}", main=train.main)
    assert not (model / "cache").exists() and not (tmp_path / "t").exists()


def test_check_outputs_library() -> None:
    with pytest.raises(DprGcError, match="same path"):
        check_outputs({}, {"--a": "x/y", "--b": "x/./y"})
    check_outputs({"--in": "a.txt"}, {"--out": "b.txt"})


@pytest.mark.parametrize("name", [".out.json.partial", ".out.json.progress.json", ".out.json.retrieved.partial",
                                  ".out.json.lock", ".out.json.x1y2.tmp", ".out.json.x1y2.new",
                                  "..out.json.retrieved.progress.json.x1y2.tmp"])
def test_an_input_named_as_a_file_written_beside_an_output_is_refused(tmp_path: Path, name: str) -> None:
    """The partial file, progress record, lock and temporaries a run keeps beside output NAME (``.NAME.*``) would
    delete or overwrite an input of that name (or a link to one); other hidden names are inputs like any."""
    given = tmp_path / name
    given.write_text("q1\tquestion\n")
    link = tmp_path / "link.tsv"
    link.symlink_to(given)
    for source in (given, link):
        with pytest.raises(DprGcError) as e:
            check_outputs({"--queries": source}, {"--output": tmp_path / "out.json"})
        assert f"--queries {source}" in str(e.value) and f"--output {tmp_path / 'out.json'}" in str(e.value), e.value
    assert given.read_text() == "q1\tquestion\n"
    check_outputs({"--queries": given}, {"--output": tmp_path / "out.jso"})
    check_outputs({"--queries": given}, {"--output": tmp_path / "sub" / "out.json"})


@pytest.mark.parametrize("tower", ["", "query/", "checkpoint-1/model/"])
def test_the_base_model_of_a_lora_input_is_an_input_too(tmp_path: Path, tower: str) -> None:
    """The local base model folder a ``--model`` LoRA adapter (any tower's ``adapter_config.json``) names is read
    too: an output that is it, or lies inside it, is refused, and the base is left as it was."""
    import argparse

    from dpr_gc.base.guard import guarded

    base, adapted = tmp_path / "base", tmp_path / "adapted"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (adapted / tower).mkdir(parents=True)
    (adapted / tower / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    stage = guarded(inputs=("model",), outputs={"output": "whole"})(lambda args: "ran")
    for output in (base, base / "config.json"):
        with pytest.raises(DprGcError) as e:
            stage(argparse.Namespace(model=str(adapted), output=str(output)))
        assert f"--output {output}" in str(e.value) and str(base) in str(e.value), e.value
        assert "base model" in str(e.value)
    assert (base / "config.json").read_text() == "{}"
    assert stage(argparse.Namespace(model=str(adapted), output=str(tmp_path / "merged"))) == "ran"


def test_second_train_into_one_output_is_refused_at_once(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu",
            "--max-steps", "1", "--batch-size", "2", "--num-workers", "0", "--cache-dir", tmp_path / "cache"]
    out.mkdir()
    with exclusive_lock(out / ".dpr-gc.lock", "first run"):  # what a running `dpr-gc train` holds
        refused(argv, "in use by another run")
    assert sorted(p.name for p in out.iterdir()) == []


def test_refused_train_leaves_no_output_folder(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused(["train", "--train", tmp_path / "missing.json", "--output", out, "--model", world["model"],
             "--device", "cpu"], "not found")
    assert not out.exists()


def test_retrieve_removes_temporaries_a_killed_run_left(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    stale = tmp_path / ".res.json.abc123.tmp"
    stale.write_text("half")
    code, err = call(cli.main, retrieve_argv(world, "--queries", world["qa"], "--output", out, "--top-k", "2"))
    assert code == 0, err
    assert out.is_file() and not stale.exists()


def test_every_output_file_of_retrieve_is_locked_and_cleaned(world: dict, tmp_path: Path) -> None:
    """``--trec-run`` is an output like ``--output``: the temporaries a killed run left beside it are removed, and a
    second run writing it while another holds its lock is refused at once (docs/stages.md)."""
    out, trec = tmp_path / "r.json", tmp_path / "r.trec"
    stale = tmp_path / ".r.trec.abc123.tmp"
    stale.write_text("half")
    argv = retrieve_argv(world, "--queries", world["queries"], "--top-k", "2", "--cache-dir", tmp_path / "cache")
    code, err = call(cli.main, argv + ["--output", out, "--trec-run", trec])
    assert code == 0, err
    assert trec.is_file() and not stale.exists()
    with exclusive_lock(tmp_path / ".r.trec.lock", "first run"):  # what a running retrieve holds for its file
        refused(argv + ["--trec-run", trec], "in use by another run")
        refused(argv + ["--output", tmp_path / "other.json", "--trec-run", trec], "in use by another run")


def test_an_output_the_system_refuses_is_one_line_naming_it(world: dict, tmp_path: Path, monkeypatch) -> None:
    """An OSError the guard does not word itself (here: the output's lock name is taken by a folder) still ends as
    one ``error:`` line naming the path, exit status 2 (README: bad input is one line), never a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".o.json.lock").mkdir()
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", "o.json"], ".o.json.lock")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.json.lock"]


def test_text_no_output_can_hold_is_one_line(capsys) -> None:
    """A lone surrogate that reaches a UTF-8 output (``UnicodeEncodeError``) is one ``error:`` line, exit status 2."""
    assert report_errors(lambda: "x\ud800".encode()) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'\\ud800'" in lines[0], lines


def test_a_refusal_whose_message_holds_line_breaks_is_still_one_line(capsys) -> None:
    """errors.py: a DprGcError becomes one ``error:`` line whatever its message holds (a library's text quoted in it
    may span lines): printed as it was, its second line would be a line without ``error:``."""
    def refuse() -> None:
        raise DprGcError("model 'x': cannot load\nits config.json is not valid\n")

    assert report_errors(refuse) == 2
    assert capsys.readouterr().err == "error: model 'x': cannot load its config.json is not valid\n"


# --------------------------------------------------------------------------------------------- whole folders
def test_model_folder_appears_whole_or_not_at_all(make_retriever, tmp_path: Path, monkeypatch) -> None:
    retriever = make_retriever()
    target = tmp_path / "final"

    def killed(folder, r) -> None:  # the weights are written by now; the run dies before the folder is finished
        assert (Path(folder) / "model.safetensors").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(model_folder, "write_model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        retriever.save(target)
    assert not target.exists() and not list(tmp_path.iterdir()), "nothing half-written may remain"
    monkeypatch.undo()
    retriever.save(target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    monkeypatch.setattr(model_folder, "write_model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        make_retriever(seed=1).save(target)
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    Retriever.load(target)


def test_atomic_folder_refuses_to_replace_a_folder_that_holds_no_model(make_retriever, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DprGcError, match="holds no saved model"):
        make_retriever().save(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "x") as tmp:
        (tmp / "a").write_text("1")
        raise RuntimeError
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_folder_replaced_whole_gets_a_new_folders_permissions_and_leaves_no_sibling(tmp_path: Path) -> None:
    """atomic_folder: the folder it puts in place has the permissions any new folder gets (0o777 less the umask),
    not its temporary's private 0o700, and the folder it replaces is deleted, not left beside it as ``.NAME.*.old``."""
    umask = os.umask(0o022)
    try:
        for name, mask, text in (("a", 0o022, "old"), ("b", 0o002, "b"), ("a", 0o022, "new")):
            os.umask(mask)
            with atomic_folder(tmp_path / name) as tmp:
                (tmp / "f.txt").write_text(text)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (tmp_path / "a" / "f.txt").read_text() == "new"
    assert [stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("a", "b")] == [0o755, 0o775]


# ----------------------------------------------------------------------------------------- messages that say what is so
@pytest.mark.parametrize("name", ["r.json", "r.jsonl"])
def test_an_empty_results_file_is_called_empty(world: dict, tmp_path: Path, name: str) -> None:
    results = tmp_path / name
    results.write_bytes(b"")
    line = refused(["evaluate", "--results", results], str(results), "empty")
    assert "truncated" not in line, line


def test_a_shard_of_another_dtype_names_its_dtype(world: dict, tmp_path: Path) -> None:
    emb = tmp_path / "emb"
    shutil.copytree(world["emb"], emb)
    shard = emb / "shard-00000-of-00001.npy"
    np.save(shard, np.load(shard).astype(np.float64))
    line = refused(["index", "--embeddings", emb, "--output", tmp_path / "idx"], str(shard), "float64", "float32")
    assert "manifest says 16 x 32" not in line, line


def test_a_local_model_of_a_type_transformers_does_not_know_says_so(world: dict, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "evil_custom"}))
    line = refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device",
                    "cpu"], str(model), "'evil_custom'", "transformers")
    assert "reachable from this machine" not in line, line


def test_a_weights_file_given_as_the_model_is_told_to_pass_its_folder(world: dict, tmp_path: Path) -> None:
    weights = world["model"] / "model.safetensors"
    line = refused(["encode", "--model", weights, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device",
                    "cpu"], str(weights), f"pass the folder {world['model']}")
    assert "torch file" not in line, line


# --------------------------------------------------------------------------------------------- no code from a folder
def test_model_folder_with_custom_code_is_refused_and_never_run(world: dict, tmp_path: Path) -> None:
    model = tmp_path / "evil"
    shutil.copytree(world["model"], model)
    marker = tmp_path / "PWNED"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="evilbert", auto_map={"AutoModel": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "retriever_config.json").unlink()  # a plain Hugging Face folder: loaded through AutoModel
    for name in ("modules.json", "config_sentence_transformers.json"):
        (model / name).unlink()
    refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device", "cpu"],
            "config.json", "run its own code")
    assert not marker.exists()


def test_every_transformers_load_passes_trust_remote_code_false(world: dict, monkeypatch) -> None:
    import re

    import transformers

    root = Path(__file__).resolve().parents[1]
    sources = [*root.joinpath("dpr_gc").rglob("*.py"), *root.joinpath("scripts").glob("*.py")]
    calls = [(path.name, line) for path in sources
             for line in path.read_text().splitlines()
             if re.search(r"Auto\w+\.from_pretrained\(", line) and not line.strip().startswith(("'", '"'))]
    assert calls and all("trust_remote_code=False" in line for _, line in calls), calls
    seen = []
    for name in ("AutoModel", "AutoTokenizer"):
        original = getattr(transformers, name).from_pretrained

        def record(*args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", record)
    Retriever.load(world["model"])
    assert seen and all(value is False for value in seen), seen


def test_no_call_in_the_code_asks_a_loader_to_unpickle_or_to_run_a_folders_code() -> None:
    """No call in dpr_gc/ or scripts/ passes ``weights_only=False`` or ``use_safetensors=False`` (a pickle could be
    unpickled: from_pretrained takes weights_only, and whether it honours it depends on the transformers version
    pyproject.toml admits, so no test that loads a file tells) nor ``trust_remote_code=True``, on one line or several.
    Text that quotes such a call (advice to convert a file by hand) is no call."""
    import ast

    root = Path(__file__).resolve().parents[1]
    unsafe = {"weights_only": False, "use_safetensors": False, "trust_remote_code": True}
    found = [f"{path.relative_to(root)}:{node.lineno} {word.arg}={word.value.value}"
             for path in [*root.joinpath("dpr_gc").rglob("*.py"), *root.joinpath("scripts").glob("*.py")]
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Call)
             for word in node.keywords
             if word.arg in unsafe and isinstance(word.value, ast.Constant) and word.value.value is unsafe[word.arg]]
    assert not found, found


def test_paths_a_folder_declares_stay_inside_it(world: dict, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    other = tmp_path / "other"
    shutil.copytree(world["model"], other)
    modules = json.loads((model / "modules.json").read_text())
    modules[0]["path"] = "../other"
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(DprGcError, match="modules.json: path '../other' points outside"):
        Retriever.load(model)
    emb = tmp_path / "emb"
    shutil.copytree(world["emb"], emb)
    manifest_path = emb / "shard-00000-of-00001.json"
    manifest = json.loads(manifest_path.read_text())
    np.save(tmp_path / "outside.npy", np.zeros((16, 32), dtype=np.float32))
    manifest["embeddings"] = str(tmp_path / "outside.npy")
    manifest_path.write_text(json.dumps(manifest))
    refused(["index", "--embeddings", emb, "--output", tmp_path / "idx"], "embeddings", "points outside")


# --------------------------------------------------------------------------------------------- damaged weights
def _header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def damaged_safetensors(data: bytes) -> dict[str, bytes]:
    header, body = _header(data)
    names = [k for k in header if k != "__metadata__"]
    huge = json.loads(json.dumps(header))
    huge[names[0]]["shape"] = [2_000_000_000, 384]
    overlap = json.loads(json.dumps(header))
    a, b = (sorted(names, key=lambda k: header[k]["data_offsets"][0]))[:2]
    size_b = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    overlap[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size_b]
    dtype = json.loads(json.dumps(header))
    dtype[names[0]]["dtype"] = "Q9"
    return {"header_2_62": struct.pack("<Q", 1 << 62) + data[8:], "huge_tensor": _with_header(huge, body),
            "overlapping": _with_header(overlap, body), "bad_dtype": _with_header(dtype, body),
            "truncated": data[:len(data) // 2]}


@pytest.mark.parametrize("kind", ["header_2_62", "huge_tensor", "overlapping", "bad_dtype", "truncated"])
def test_damaged_model_weights_are_one_line(world: dict, tmp_path: Path, kind: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    weights = model / "model.safetensors"
    weights.write_bytes(damaged_safetensors(weights.read_bytes())[kind])
    line = refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--device",
                    "cpu", "--queries", world["qa"], "--output", tmp_path / "o.json", "--skip-model-check"],
                   "model.safetensors", "damaged")
    assert line.count("damaged safetensors file") == 1, line  # said once, not wrapped in itself
    assert not (tmp_path / "o.json").exists()


# --------------------------------------------------------------------------------------------- typed-value fuzz
WRONG = ["256", 16.5, -1, [1, 2, 3], None, True, "\ud800"]
# Hugging Face's own config.json: the fields a BERT's shape comes from (transformers checks the rest itself)
HF_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings",
           "model_type", "dtype", "pad_token_id", "layer_norm_eps", "intermediate_size")


def _json_mutations(data: object, keys: object = None, wrong: list = WRONG) -> list[tuple[str, object]]:
    """The file with each top-level value (the values of a list's second item, for a list) replaced by each wrong
    value, and the whole file replaced by each."""
    out = [(f"file={json.dumps(w)}", w) for w in WRONG]
    items = [(None, data)] if isinstance(data, dict) else list(enumerate(data))[1:2] if isinstance(data, list) else []
    for index, obj in items:
        if not isinstance(obj, dict):
            continue
        for key in [k for k in obj if keys is None or k in keys]:
            for w in wrong:
                copy = json.loads(json.dumps(data))
                (copy if index is None else copy[index])[key] = w
                out.append((f"{index}.{key}={json.dumps(w)}", copy))
    return out


def _use_retriever(folder: Path) -> None:
    retriever = Retriever.load(folder)
    retriever.embed("query", ["what is paris"])
    retriever.embed("passage", ["paris is a city"], ["paris"])


def _use_index(folder: Path) -> None:
    from dpr_gc.retrieval.index import DenseIndex, read_meta

    read_meta(folder)
    dense = DenseIndex.read(folder)
    dense.search(np.ones((1, dense.dim), dtype=np.float32), 2)


def _use_embeddings(folder: Path) -> None:
    from dpr_gc.retrieval.shards import open_shard, read_manifests

    for m in read_manifests(folder):
        open_shard(m, check_ids=True)


def _use_checkpoint(folder: Path) -> None:
    from dpr_gc.train.checkpoints import read_state

    read_state(folder)


@pytest.fixture(scope="module")
def json_kinds(world: dict, tmp_path_factory, tiny_tokenizer) -> list[tuple[Path, str, object]]:
    """(folder, file inside it, how to use the folder) for every JSON file kind dpr-gc reads."""
    from dpr_gc.model.retriever import RetrieverConfig
    from dpr_gc.train.checkpoints import write_state
    from tests.helpers import tiny_bert

    root = tmp_path_factory.mktemp("json_kinds")
    dense = root / "dense"
    Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer,
              RetrieverConfig(pooling="cls", projection_dim=8)).save(dense)
    towers = root / "towers"
    Retriever(tiny_bert(len(tiny_tokenizer)), tiny_bert(len(tiny_tokenizer), 1), tiny_tokenizer,
              RetrieverConfig(pooling="mean", shared_encoder=False)).save(towers)
    ckpt = root / "ckpt"
    ckpt.mkdir()
    write_state(ckpt, {"step": 3, "optimizer": {"state": {}}, "scheduler": {"last_epoch": 3}, "scaler": {},
                       "sampler": {"epoch": 0, "batches_done": 3}, "rng": {"python": (1, 2)}, "record": {"step": 3},
                       "best": [None, None]})
    model = world["model"]
    foreign = root / "foreign"  # a sentence-transformers folder dpr-gc did not write: its own settings are read
    shutil.copytree(model, foreign)
    (foreign / "retriever_config.json").unlink()
    kinds = [(model, name, _use_retriever) for name in
             ("retriever_config.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json",
              "tokenizer.json", "tokenizer_config.json", "config.json")]
    kinds.append((foreign, "config_sentence_transformers.json", _use_retriever))
    dense_config = next(p for p in dense.glob("*_Dense/config.json"))
    kinds += [(dense, str(dense_config.relative_to(dense)), _use_retriever),
              (towers, "router_config.json", _use_retriever),
              (world["idx"], "index_meta.json", _use_index),
              (world["emb"], "shard-00000-of-00001.json", _use_embeddings),
              (ckpt, "train_state.json", _use_checkpoint)]
    return kinds


@pytest.mark.slow
def test_fuzz_every_json_kind_with_wrongly_typed_values_ends_in_one_line_errors(json_kinds, tmp_path: Path) -> None:
    failures, refused_count, tried = [], 0, 0
    for source, name, use in json_kinds:
        folder = tmp_path / f"{source.name}-{name.replace('/', '_')}"
        shutil.copytree(source, folder)
        original = json.loads((source / name).read_text())
        hf_file = name in ("config.json", "tokenizer.json", "tokenizer_config.json")
        for label, data in _json_mutations(original, HF_KEYS if name == "config.json" else None,
                                      ["256", -1, None] if hf_file else WRONG):
            (folder / name).write_text(json.dumps(data))
            tried += 1
            try:
                use(folder)
            except DprGcError as e:
                refused_count += 1
                if "\n" in str(e) or len(str(e)) > 2000:
                    failures.append(f"{name} {label}: not one short line: {str(e)[:300]!r}")
            except Exception as e:  # noqa: BLE001 - anything else is a traceback for the user
                failures.append(f"{name} {label}: {type(e).__name__}: {str(e)[:200]}")
        (folder / name).write_text(json.dumps(original))
        use(folder)  # the untouched file still works
    Path("/tmp/guarantees-fuzz.txt").write_text(ascii("\n".join(failures)).replace("\\n", "\n"))
    assert not failures, f"{len(failures)} of {tried} cases crashed:\n" + "\n".join(failures[:40])
    assert refused_count > tried // 3


# --------------------------------------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize("kind", ["header_2_62", "overlapping", "truncated"])
def test_damaged_weights_inside_a_checkpoint_are_one_line_on_resume(trained, tmp_path: Path, kind: str) -> None:
    run = copy_run(trained, tmp_path)
    weights = run / "checkpoint-2" / "model" / "model.safetensors"
    weights.write_bytes(damaged_safetensors(weights.read_bytes())[kind])
    line = refused(train_argv(trained, run, str(run / "checkpoint-2")), "model.safetensors", "damaged")
    assert "pickle" not in line


def test_truncated_training_state_names_the_damage_and_latest_falls_back(trained, tmp_path: Path, caplog) -> None:
    run = copy_run(trained, tmp_path)
    state = run / "checkpoint-2" / "train_state.safetensors"
    state.write_bytes(state.read_bytes()[:-100])
    line = refused(train_argv(trained, run, str(run / "checkpoint-2")), "train_state.safetensors", "damaged")
    assert "pickle" not in line
    code, err = call(cli.main, train_argv(trained, run, "latest"))
    assert code == 0, err
    assert "resuming from the previous checkpoint" in caplog.text and "checkpoint-1" in caplog.text


# --------------------------------------------------------------------------------------------- values that lie
def _results(tmp_path: Path, **changes: object) -> Path:
    ctx = {"id": "p0", "title": "t", "text": "paris is a city", "score": 1.0, "has_answer": True}
    record = {"id": "q1", "question": "what is paris", "answers": ["paris"], "ctxs": [ctx]}
    for key, value in changes.items():
        (ctx if key.startswith("ctx_") else record)[key.removeprefix("ctx_")] = value
    path = tmp_path / "results.json"
    path.write_text(json.dumps([record]))
    return path


@pytest.mark.parametrize("changes, needle", [
    ({"ctx_score": "NaN"}, "is not a finite number"), ({"ctx_score": "inf"}, "is not a finite number"),
    ({"ctx_score": 10 ** 309}, "is not a finite number"),
    ({"ctx_has_answer": "false"}, "has_answer must be true or false"), ({"question": "  "}, "non-empty string"),
    ({"ctx_id": None}, "passage id must be a string or an integer"),
    ({"ctx_id": "p\u200b0"}, "invisible or control characters"), ({"ctx_id": "p\u200f0"}, "U+200F"),
    ({"ctx_id": "p\x000"}, "U+0000"), ({"ctx_id": "cafe\u0301"}, "not in Unicode NFC"),
    ({"id": "q\ud800"}, "lone surrogate"), ({"question": "what \ud800"}, "non-empty string")])
def test_evaluate_refuses_results_whose_values_lie(world: dict, tmp_path: Path, changes: dict, needle: str) -> None:
    results = _results(tmp_path, **changes)
    refused(["evaluate", "--results", results, "--k", "1"], "question 0", needle)


def test_run_ids_that_only_look_the_same_are_refused(world: dict, tmp_path: Path) -> None:
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 p0 1 0.9 t\nq1 Q0 p\u200b0 2 0.5 t\n", encoding="utf-8")
    refused(["evaluate", "--run", run, "--qrels", world["qrels"]], "run.trec:2", "U+200B")


def test_query_prefix_longer_than_the_query_max_length_is_refused(world: dict, tmp_path: Path) -> None:
    refused(retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / "o.json",
                          "--query-prefix", "represent this question for searching relevant passages " * 4),
            "--query-prefix", "leaves none for the query")
    assert not (tmp_path / "o.json").exists()


def test_huge_passage_is_cut_before_tokenising(make_retriever, monkeypatch) -> None:
    from dpr_gc.model import tokenize as tok

    retriever = make_retriever(passage_max_length=16)
    text = " ".join(["paris city river"] * 400_000)  # 6.8 MB
    seen = []
    tokenizer = retriever.tokenizer
    original = type(tokenizer).__call__

    def measure(self, first, *args, **kwargs):
        seen.extend(len(t) for t in (first if isinstance(first, list) else [first]))
        return original(self, first, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", measure)
    short = tok.token_ids(tokenizer, retriever.config, "passage", [text[:2000]], ["t"])
    huge = tok.token_ids(tokenizer, retriever.config, "passage", [text], ["t"])
    assert max(seen) <= 2 * 16 * tok.CHARS_PER_TOKEN
    assert torch.equal(short["input_ids"], huge["input_ids"])
    # whitespace makes no tokens, so a long run of it does not push the words after it out of the cut
    spaced = tok.token_ids(tokenizer, retriever.config, "query", [" " * 5000 + "the city by the river"])
    plain = tok.token_ids(tokenizer, retriever.config, "query", ["the city by the river"])
    assert torch.equal(spaced["input_ids"], plain["input_ids"])


def test_encode_assembles_shards_without_a_memory_map(world: dict, tmp_path: Path, monkeypatch) -> None:
    """A memory-mapped sparse file dies of SIGBUS when the disk fills; plain writes fail with one error line."""
    original = np.lib.format.open_memmap

    def no_memmap(filename, mode="r+", *args, **kwargs):
        if mode != "r":
            raise AssertionError("the shard must not be assembled through a writable memory map")
        return original(filename, mode, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "open_memmap", no_memmap)
    out = tmp_path / "emb"
    code, err = call(cli.main, ["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", out,
                                "--device", "cpu", "--cache-dir", tmp_path / "cache", "--block-size", "5"])
    assert code == 0, err
    ours, reference = (np.load(d / "shard-00000-of-00001.npy") for d in (out, world["emb"]))
    assert ours.shape == reference.shape and np.allclose(ours.astype(np.float32), reference, atol=2e-3)


SURROGATE_CASES = {
    "corpus text": ("c.jsonl", '{"_id": "a", "title": "t", "text": "x"}\n{"_id": "b", "title": "t", "text": "p \\ud800"}\n'),
    "passage id": ("c.jsonl", '{"_id": "a", "title": "t", "text": "x"}\n{"_id": "b\\ud800", "title": "t", "text": "x"}\n'),
    "question": ("q.jsonl", '{"id": "q1", "question": "a"}\n{"id": "q2", "question": "what \\udfff"}\n'),
    "answer (JSONL)": ("q.jsonl", '{"id": "q1", "question": "a"}\n{"id": "q2", "question": "b", "answers": ["\\ud800"]}\n'),
    "answer (TSV)": ("q.tsv", 'what is paris\t["paris"]\nwho sang\t["a\\udbff"]\n'),
    "training list": ("t.json", json.dumps(training_records(2)).replace('"what is', '"what\\ud800 is', 2)
                      .replace('"what\\ud800 is', '"what is', 1).replace("}, {", "},\n{")),
    "training lines": ("t.jsonl", "".join(json.dumps(r) + "\n" for r in training_records(2)).replace(
        '"what is', '"what\\ud800 is', 2).replace('"what\\ud800 is', '"what is', 1)),
}


@pytest.mark.parametrize("case", sorted(SURROGATE_CASES))
def test_lone_surrogates_in_every_text_input_are_one_line_naming_file_and_line(world: dict, tmp_path: Path,
                                                                               case: str) -> None:
    """Half a UTF-16 pair ("\\ud800" in JSON) is no character: refused where it is read, not late while writing."""
    name, content = SURROGATE_CASES[case]
    bad = tmp_path / name
    bad.write_text(content, encoding="utf-8")
    assert "\\ud" in bad.read_text().splitlines()[1] and "\\ud" not in bad.read_text().splitlines()[0]
    out, cache = tmp_path / "out", tmp_path / "cache"
    if name.startswith("c."):
        argv = ["encode", "--model", world["model"], "--corpus", bad, "--output", out, "--device", "cpu",
                "--cache-dir", cache]
    elif name.startswith("q."):
        argv = retrieve_argv(world, "--queries", bad, "--output", out, "--cache-dir", cache)
    else:
        argv = ["prepare-data", bad, "--cache-dir", cache]
    refused(argv, f"{bad}:2", "lone surrogate")
    assert not out.exists()


def test_dense_retriever_refuses_a_saved_index_of_other_embeddings(world: dict, tmp_path: Path) -> None:
    emb = tmp_path / "emb"
    shutil.copytree(world["emb"], emb)
    shutil.copytree(world["idx"], tmp_path / "old.index")
    manifest = emb / "shard-00000-of-00001.json"
    data = json.loads(manifest.read_text())
    data["corpus_fingerprint"] = "full-another-corpus"
    manifest.write_text(json.dumps(data))
    script = load_script("dense_retriever")
    refused(["--model_file", world["model"], "--qa_dataset", world["qa"], "--encoded_ctx_file", emb,
             "--index_path", tmp_path / "old.index", "--out_file", tmp_path / "o.json", "--no_cuda"],
            "corpus_fingerprint", "another --index_path", main=script.main)


# ------------------------------------------------------------------ guarantees, second round (issue 25)
def test_hnsw_m_outside_what_faiss_takes_is_refused(world: dict, tmp_path: Path) -> None:
    """FAISS dies of bad_alloc for a huge M and segfaults at M=1: the setting's declaration states the range."""
    for m in ("1000000", "1"):
        refused(["index", "--embeddings", world["emb"], "--output", tmp_path / "idx", "--kind", "hnsw",
                 "--hnsw-m", m], "--hnsw-m", f"'{m}' is not an integer from 2 to 512")
    with pytest.raises(DprGcError, match="--hnsw-m must be an integer from 2 to 512"):
        IndexParams("hnsw", hnsw_m=1)
    assert not (tmp_path / "idx").exists()


def test_cr_only_line_endings_are_named(world: dict, tmp_path: Path) -> None:
    corpus = tmp_path / "mac.tsv"
    corpus.write_bytes(tsv_bytes(passages(4)).replace(b"\n", b"\r"))
    refused(["encode", "--model", world["model"], "--corpus", corpus, "--output", tmp_path / "e", "--device", "cpu",
             "--cache-dir", tmp_path / "cache"], str(corpus), "carriage return only", "convert it")
    queries = tmp_path / "mac-qa.tsv"
    queries.write_bytes(world["qa"].read_bytes().replace(b"\n", b"\r"))
    refused(retrieve_argv(world, "--queries", queries, "--output", tmp_path / "o.json"), str(queries),
            "carriage return only")
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(world["qa"].read_bytes().replace(b"\n", b"\r\n"))
    assert len(read_queries(crlf)) == 2
    mixed = tmp_path / "mixed.tsv"  # the header ends in LF, the rows in CR: they read as one line of 2 rows
    head, rest = tsv_bytes(passages(4)).split(b"\n", 1)
    mixed.write_bytes(head + b"\n" + rest.replace(b"\n", b"\r"))
    refused(["encode", "--model", world["model"], "--corpus", mixed, "--output", tmp_path / "e", "--device", "cpu",
             "--cache-dir", tmp_path / "cache"], f"{mixed}:2: the line holds a carriage return", "convert the file")
    mixed.write_bytes(world["qa"].read_bytes().replace(b"\n", b"\r", 1))
    refused(retrieve_argv(world, "--queries", mixed, "--output", tmp_path / "o.json"), f"{mixed}:1:", "carriage")


def test_duplicate_query_ids_are_refused_when_the_file_is_read(world: dict, tmp_path: Path, monkeypatch) -> None:
    from dpr_gc.retrieval import retrieve as retrieve_module

    queries = tmp_path / "dup.tsv"
    queries.write_text('what is paris\t["paris"]\tq1\nwho sang\t["music"]\tq2\nwhat city\t["x"]\tq1\n')
    monkeypatch.setattr(retrieve_module, "iter_retrieve", lambda *a, **k: pytest.fail("retrieval ran"))
    for extra in ((), ("--evaluate",), ("--trec-run", tmp_path / "run.trec")):
        refused(retrieve_argv(world, "--queries", queries, "--output", tmp_path / "o.json", *extra),
                f"{queries}:3", "query id 'q1' repeats the one at line 1")
    with pytest.raises(DprGcError, match=r"dup.tsv:3: query id 'q1'"):
        read_queries(queries)
    assert not (tmp_path / "o.json").exists()


def test_queries_from_a_pipe_or_dev_null(world: dict, tmp_path: Path) -> None:
    """A pipe (``<(...)``) or device is read once into a copy; messages still name what was given. A device that
    never ends is refused."""
    import threading

    reference = tmp_path / "ref.json"
    assert call(cli.main, retrieve_argv(world, "--queries", world["qa"], "--output", reference))[0] == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    feeder = threading.Thread(target=lambda: fifo.write_bytes(world["qa"].read_bytes()), daemon=True)
    feeder.start()
    code, err = call(cli.main, retrieve_argv(world, "--queries", fifo, "--output", tmp_path / "o.json"))
    feeder.join(10)
    assert code == 0, err
    assert json.loads((tmp_path / "o.json").read_text()) == json.loads(reference.read_text())
    refused(retrieve_argv(world, "--queries", "/dev/null", "--output", tmp_path / "n.json"), "no queries in /dev/null")
    with pytest.raises(DprGcError, match="is a pipe or device"):
        read_queries("/dev/null")
    if Path("/dev/zero").exists():  # copied to its end, it filled the disk
        refused(["evaluate", "--run", "/dev/zero", "--qrels", world["qrels"]], "/dev/zero is a device that never ends")


@contextlib.contextmanager
def fed(data: bytes, fifo: Optional[Path] = None) -> Iterator[str]:
    """A pipe a thread writes ``data`` into once, as ``<(cat file)`` is: the named pipe ``fifo`` (made here), else an
    anonymous pipe by its ``/dev/fd/N`` name."""
    import threading

    if fifo is not None:
        os.mkfifo(fifo)
        feeder = threading.Thread(target=lambda: fifo.write_bytes(data), daemon=True)
        name, fds = str(fifo), ()
    else:
        read_end, write_end = os.pipe()

        def write() -> None:
            with os.fdopen(write_end, "wb") as f:
                f.write(data)

        feeder, name, fds = threading.Thread(target=write, daemon=True), f"/dev/fd/{read_end}", (read_end,)
    feeder.start()
    try:
        yield name
    finally:
        feeder.join(10)
        for fd in fds:
            os.close(fd)
        if fifo is not None:
            fifo.unlink()


def test_a_piped_corpus_is_named_as_given_in_log_lines_and_records(world: dict, tmp_path: Path, caplog) -> None:
    """``encode --corpus <(...)`` reads a temporary copy; its log lines and the shard manifest and index name the
    pipe given, never the copy (deleted when encode ends); retrieve without ``--corpus`` asks for it in one line."""
    caplog.set_level("INFO", logger="dpr_gc")
    with fed(world["corpus"].read_bytes()) as corpus:
        code, err = call(cli.main, ["encode", "--model", world["model"], "--corpus", corpus, "--output",
                                    tmp_path / "emb", "--dtype", "float32", "--cache-dir", tmp_path / "cache"])
    assert code == 0, err
    assert f"{corpus}: 16 passages from 17 lines" in caplog.text and "dpr-gc-input" not in caplog.text
    manifest = json.loads((tmp_path / "emb" / "shard-00000-of-00001.json").read_text())
    assert manifest["corpus"] == corpus and manifest["corpus_rows"] == 16
    assert call(cli.main, ["index", "--embeddings", tmp_path / "emb", "--output", tmp_path / "idx"])[0] == 0
    assert json.loads((tmp_path / "idx" / "index_meta.json").read_text())["corpus"] == corpus
    refused(["retrieve", "--index", tmp_path / "idx", "--queries", world["qa"], "--output", tmp_path / "o.json"],
            f"the recorded corpus {corpus} was a pipe; give --corpus")
    with fed(world["corpus"].read_bytes()) as again:
        code, err = call(cli.main, ["retrieve", "--index", tmp_path / "idx", "--corpus", again, "--queries",
                                    world["qa"], "--output", tmp_path / "o.json", "--cache-dir", tmp_path / "cache"])
    assert code == 0, err
    assert f"passages from {again}" in caplog.text and "dpr-gc-input" not in caplog.text + err
    assert len(json.loads((tmp_path / "o.json").read_text())) == 2
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 1, "the same text piped again parses again"


def test_a_piped_training_file_is_recorded_as_given_and_resumed_with(trained: dict, tmp_path: Path,
                                                                     caplog) -> None:
    """``train --train <(...)`` records the pipe given (train_config.json, the checkpoints' data record, the model
    card), so ``--resume latest`` with the same pipe resumes rather than refusing a changed ``--train``."""
    caplog.set_level("INFO", logger="dpr_gc")
    run, fifo = tmp_path / "run", tmp_path / "train-pipe"
    for more in (("--max-steps", 1), ("--max-steps", 2, "--resume", "latest")):
        with fed(trained["train"].read_bytes(), fifo) as train:
            code, err = call(cli.main, ["train", "--train", train, "--output", run, "--model", trained["model"],
                                        "--batch-size", 8, "--num-workers", 0, "--q_chunk_size", 3, "--ctx_chunk_size",
                                        5, "--cache-dir", tmp_path / "cache", "--save-every", 1, *more])
        assert code == 0, err
    assert json.loads((run / "train_config.json").read_text())["data"]["train_files"] == [train]
    assert f"{train}: 16 records" in caplog.text and "resumed from step 1" in caplog.text
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 1, "the same text piped again parses again"
    card = (run / "final" / "README.md").read_text()
    assert f"file: {train}" in card
    recorded = "".join(p.read_text(errors="replace") for p in run.rglob("*") if p.suffix in (".json", ".md"))
    assert "dpr-gc-input" not in recorded + caplog.text


def test_index_readers_always_see_one_whole_build(world: dict, tmp_path: Path) -> None:
    """``index`` rebuilding a folder (two builds in turn) while another process loads it in a loop: every load is
    one whole build -- never "no index", never one build's metadata with the other's vectors."""
    from tests.ranks import kill_group

    other = tmp_path / "other.tsv"
    other.write_bytes(tsv_bytes([(f"x{i}", t, f"{text} {i}") for i, (_, t, text) in enumerate(passages(24))]))
    encode_corpus(Retriever.load(world["model"]), other, tmp_path / "emb2", 0, 1, dtype="float32",
                  cache_dir=tmp_path / "cache", model_name=str(world["model"]), show_progress=False)
    expected = {str(len(np.load(f))): np.load(f)[0].tolist() for f in
                (world["emb"] / "shard-00000-of-00001.npy", tmp_path / "emb2" / "shard-00000-of-00001.npy")}
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    index = tmp_path / "idx"
    build_index(world["emb"], index, IndexParams("flat"))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = [sys.executable, "-m", "tests.index_race"]
    procs = [subprocess.Popen([*script, "write", str(index), "5", str(world["emb"]), str(tmp_path / "emb2")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True),
             subprocess.Popen([*script, "read", str(index), "5", str(tmp_path / "expected.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)]
    try:
        outputs = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    wrote, read = (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs)
    assert read["failed"] == 0, read
    assert wrote["builds"] >= 4 and len(read["seen"]) == 2 and read["reads"] >= 20, (wrote, read)


FILE_LIMIT = """import resource, runpy, sys
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv[0] = "dpr-gc"
runpy.run_module("dpr_gc.cli", run_name="__main__")
"""


def _run_with_file_limit(argv: Sequence[Any], limit_bytes: int, cwd: Path) -> subprocess.CompletedProcess:
    """``dpr-gc ARGV`` in a subprocess that may write no file larger than ``limit_bytes`` (RLIMIT_FSIZE, set by the
    child itself; Python ignores SIGXFSZ, so a write past it fails with EFBIG as one on a full disk with ENOSPC)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", FILE_LIMIT, str(limit_bytes), *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_disk_full_while_indexing_keeps_the_old_index(world: dict, tmp_path: Path) -> None:
    index = tmp_path / "idx"
    shutil.copytree(world["idx"], index)
    before = {p.name: p.read_bytes() for p in index.iterdir()}
    proc = _run_with_file_limit(["index", "--embeddings", world["emb"], "--output", index], 1500, tmp_path)
    _assert_process_refused(proc, f"{index}: the disk is full")
    assert "free space" in proc.stderr
    assert {p.name: p.read_bytes() for p in index.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"], "an unfinished build was left"


def test_disk_full_while_writing_a_checkpoint(world: dict, tmp_path: Path) -> None:
    """The model (100 KB) fits under the limit, the optimizer state (200 KB) does not. At the first checkpoint
    there is none to resume: the line says to run the same command again, which then trains to the end."""
    out = tmp_path / "run"
    argv = ["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu",
            "--max-steps", "2", "--save-every", "1", "--batch-size", "2", "--num-workers", "0", "--cache-dir",
            tmp_path / "cache"]
    proc = _run_with_file_limit(argv, 150_000, tmp_path)
    _assert_process_refused(proc, f"{out / 'checkpoint-1'}: the disk is full")
    assert "run the same command again" in proc.stderr and "--resume" not in proc.stderr
    assert not [p.name for p in out.iterdir() if p.name.startswith((".checkpoint", "checkpoint", "final"))]
    code, err = call(cli.main, argv)
    assert code == 0 and (out / "final").is_dir(), err


def _without_row_count(cache: Path) -> bytes:
    """The cache file cut after its last batch of rows (as a copy interrupted at a batch boundary would be)."""
    import pyarrow as pa

    with pa.memory_map(str(cache)) as source:
        reader = pa.ipc.open_stream(source)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, reader.schema) as writer:
            for batch in reader:
                if batch.num_rows:
                    writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _a_batch_lost(cache: Path) -> bytes:
    """The cache file without its first batch of rows, its closing row count kept (a copy that lost a block)."""
    import pyarrow as pa

    with pa.memory_map(str(cache)) as source:
        reader = pa.ipc.open_stream(source)
        batches = list(iter(reader.read_next_batch_with_custom_metadata, None))  # ends on StopIteration
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, reader.schema) as writer:
            for batch, custom in batches[1:]:
                writer.write_batch(batch, custom_metadata=custom)
    assert batches[0][0].num_rows and batches[-1][1]
    return sink.getvalue().to_pybytes()


def test_damaged_corpus_cache_is_rebuilt_with_one_warning(world: dict, tmp_path: Path, caplog) -> None:
    from dpr_gc.data.corpus import corpus_cache_path

    cache = tmp_path / "cache"
    other = tmp_path / "other.tsv"
    other.write_bytes(tsv_bytes(passages(5)))
    reference = load_corpus(world["corpus"], cache)[:]
    arrow = corpus_cache_path(world["corpus"], cache)
    good = arrow.read_bytes()
    load_corpus(other, cache)
    damages = {"truncated": good[:len(good) // 2], "garbage": b"\x00" * 512, "no row count": _without_row_count(arrow),
               "a batch lost": _a_batch_lost(arrow), "another corpus": corpus_cache_path(other, cache).read_bytes()}
    for what, data in damages.items():
        arrow.write_bytes(data)
        caplog.clear()
        assert load_corpus(world["corpus"], cache)[:] == reference, what
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and str(arrow) in warnings[0] and "rebuilding" in warnings[0], (what, warnings)
        assert arrow.read_bytes() == good, what


def test_damaged_training_cache_is_rebuilt_with_one_warning(tmp_path: Path, caplog) -> None:
    """formats.md: every Arrow cache file, a parsed training set's too, ends in an empty batch recording its row
    count; a cache that is cut short, garbage, lacks that batch or holds fewer rows than it records is rebuilt with one
    warning."""
    data = tmp_path / "train.json"
    data.write_text(json.dumps(training_records()))
    cache = tmp_path / "cache"
    reference = load_dpr_files([data], cache).dataset[:]
    arrow = next(cache.glob("*.arrow"))
    good = arrow.read_bytes()
    damages = {"truncated": good[:len(good) // 2], "garbage": b"\x00" * 512, "no row count": _without_row_count(arrow),
               "a batch lost": _a_batch_lost(arrow)}
    for what, damaged in damages.items():
        arrow.write_bytes(damaged)
        caplog.clear()
        assert load_dpr_files([data], cache).dataset[:] == reference, what
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and str(arrow) in warnings[0] and "rebuilding" in warnings[0], (what, warnings)
        assert arrow.read_bytes() == good, what


@pytest.mark.slow
def test_retrieve_resumes_after_a_real_ctrl_c(world: dict, tmp_path: Path, caplog) -> None:
    """SIGINT after the first chunk of questions: the finished records are kept beside the output (and nothing under
    its name), the same command continues after them, and the outputs equal an uninterrupted run's."""
    import signal
    import time

    from dpr_gc.retrieval.retrieve import QUERY_CHUNK
    from tests.ranks import kill_group

    rng = random.Random(0)
    queries = tmp_path / "many.tsv"
    queries.write_text("".join(f"{' '.join(rng.choices(WORDS, k=5))}\t[\"{rng.choice(WORDS)}\"]\n"
                               for _ in range(2 * QUERY_CHUNK + 50)))
    reference = [tmp_path / "ref.json", tmp_path / "ref.trec"]
    common = ("--queries", queries, "--top-k", "3", "--workers", "1", "--cache-dir", tmp_path / "cache")
    assert call(cli.main, retrieve_argv(world, *common, "--output", reference[0], "--trec-run", reference[1]))[0] == 0
    out, run = tmp_path / "o.json", tmp_path / "o.trec"
    argv = [str(a) for a in retrieve_argv(world, *common, "--output", out, "--trec-run", run)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # The run pauses after keeping its first chunk, so the Ctrl-C lands mid-run however loaded the machine is; it
    # takes SIGINT as a foreground process does even when started from a background job (which ignores SIGINT).
    # The pause is short sleeps: a signal the kernel hands to another of its threads (tqdm's monitor) does not wake
    # the main thread from one long sleep, only the next check between sleeps raises it.
    pause_after_first_chunk = (
        "import signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from dpr_gc.base.files import ChunkedOutput; from dpr_gc.cli import main; "
        "append = ChunkedOutput.append; "
        "ChunkedOutput.append = lambda self, *a: (append(self, *a), [time.sleep(0.1) for _ in range(1200)]); "
        "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", pause_after_first_chunk, *argv], cwd=tmp_path, env=env,
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        progress = tmp_path / ".o.json.retrieved.progress.json"
        deadline = time.monotonic() + 120
        while not progress.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        _, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    kept = tmp_path / ".o.json.retrieved.partial"
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert f"interrupted: {QUERY_CHUNK} questions retrieved are kept in {kept}; run the same command again" in err, err
    assert not out.exists() and not run.exists()
    caplog.set_level("INFO")
    code, err = call(cli.main, argv)
    assert code == 0, err
    assert f"resuming an interrupted run: {QUERY_CHUNK} questions already" in caplog.text
    assert out.read_bytes() == reference[0].read_bytes() and run.read_bytes() == reference[1].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_disk_full_while_encoding_is_one_line(world: dict, tmp_path: Path) -> None:
    """The shard (1 KB in float16) does not fit under the limit; the corpus cache is built beforehand."""
    load_corpus(world["corpus"], tmp_path / "cache")
    out = tmp_path / "emb"
    proc = _run_with_file_limit(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", out,
                                 "--device", "cpu", "--cache-dir", tmp_path / "cache"], 600, tmp_path)
    _assert_process_refused(proc, "the disk is full")
    assert str(out) in proc.stderr.strip().splitlines()[-1]
    assert not list(out.glob("*.npy")) and not list(out.glob("*.json"))


def test_disk_full_inside_an_encode_part_file_names_it(world: dict, tmp_path: Path) -> None:
    """The part file itself (64 rows of float32, 8 KB) overflows the limit while the progress record (1 KB) fits:
    the line names the part file and says to free space, and the same command then finishes."""
    corpus, cache, out = tmp_path / "c.tsv", tmp_path / "cache", tmp_path / "emb"
    corpus.write_bytes(tsv_bytes(passages(64)))
    load_corpus(corpus, cache)
    argv = ["encode", "--model", world["model"], "--corpus", corpus, "--output", out, "--device", "cpu",
            "--dtype", "float32", "--cache-dir", cache]
    proc = _run_with_file_limit(argv, 5000, tmp_path)
    part = out / "shard-00000-of-00001.part00000.npy"
    _assert_process_refused(proc, f"{part}: the disk is full")
    assert "free space" in proc.stderr.strip().splitlines()[-1]
    assert not part.exists() and not list(out.glob(".*.tmp"))
    assert call(cli.main, argv)[0] == 0
    assert np.load(out / "shard-00000-of-00001.npy").shape == (64, 32)


def _disk_full_run(argv: list, output: Path, limit: int, cwd: Path) -> str:
    """The error line of ``dpr-gc ARGV --output OUTPUT`` run under a file-size limit of ``limit`` bytes."""
    proc = _run_with_file_limit([*argv, "--output", output], limit, cwd)
    _assert_process_refused(proc, f"{output}: the disk is full")
    assert not output.exists()
    return proc.stderr.strip().splitlines()[-1]


def test_disk_full_while_retrieving_names_the_output(world: dict, tmp_path: Path) -> None:
    """The results (one chunk of 40 questions) overflow the limit before any chunk is kept: the line names the
    output, nothing torn is left beside it, and the same command then writes the whole results."""
    queries, cache = tmp_path / "q.tsv", tmp_path / "cache"
    queries.write_text("".join(f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]}\t[\"x\"]\n" for i in range(40)))
    load_corpus(world["corpus"], cache)
    argv = retrieve_argv(world, "--queries", queries, "--top-k", "5", "--workers", "1", "--cache-dir", cache)
    assert call(cli.main, [*argv, "--output", tmp_path / "ref.json"])[0] == 0
    out = tmp_path / "o.json"
    line = _disk_full_run(argv, out, (tmp_path / "ref.json").stat().st_size // 2, tmp_path)
    assert "free space" in line and "run the same command again" in line
    assert not list(tmp_path.glob(".o.json.*partial*")) and not list(tmp_path.glob(".o.json.*progress*"))
    assert call(cli.main, [*argv, "--output", out])[0] == 0
    assert out.read_bytes() == (tmp_path / "ref.json").read_bytes()


def test_disk_full_while_mining_keeps_the_finished_records(world: dict, tmp_path: Path) -> None:
    """Every record fits and the list's closing bracket does not: the line names the output and the kept file, which
    is cut back to the records recorded as finished, and the same command continues from them to the whole file."""
    train_file, cache = tmp_path / "train.json", tmp_path / "cache"
    train_file.write_text(json.dumps(training_records(12)))
    load_corpus(world["corpus"], cache)
    argv = ["mine", "--source", "dense", "--train-file", train_file, "--index", world["idx"], "--corpus",
            world["corpus"], "--cache-dir", cache, "--n-negatives", "2", "--top-k", "5", "--device", "cpu",
            "--workers", "1"]
    code, err = call(cli.main, [*argv, "--output", tmp_path / "ref.json"])
    assert code == 0, err
    reference = (tmp_path / "ref.json").read_bytes()
    out, kept = tmp_path / "mined.json", tmp_path / ".mined.json.partial"
    line = _disk_full_run(argv, out, len(reference) - 1, tmp_path)
    assert str(kept) in line and "run the same command again" in line
    progress = json.loads((tmp_path / ".mined.json.progress.json").read_text())
    assert kept.stat().st_size == progress["bytes"] and reference.startswith(kept.read_bytes())
    assert call(cli.main, [*argv, "--output", out])[0] == 0
    assert out.read_bytes() == reference


def _damaged_model_folder(world: dict, root: Path, kind: str) -> Path:
    """A model folder of the issue's poor-message cases, built in ``root``."""
    from safetensors.torch import load_file

    from dpr_gc.model.lora import LoraSettings, apply_lora
    from tests.llm_models import decoder_retriever, save_decoder

    if kind == "symlink loop":
        (root / "b").symlink_to(root / "a")
        (root / "a").symlink_to(root / "b")
        return root / "a"
    if kind.startswith("adapter"):
        retriever = Retriever.from_pretrained(str(save_decoder(root / "base")), decoder_retriever().config)
        apply_lora(retriever, LoraSettings(r=2))
        retriever.save(root / "lora")
        if kind == "adapter pickle":
            weights = root / "lora" / "adapter_model.safetensors"
            torch.save({**load_file(weights), "x": pickle_payload(root / "PWNED")["weight"]},
                       weights.with_name("adapter_model.bin"))
            weights.unlink()
        else:
            config = json.loads((root / "lora" / "adapter_config.json").read_text())
            config["base_model_name_or_path"] = str(root / "lora")
            (root / "lora" / "adapter_config.json").write_text(json.dumps(config))
        return root / "lora"
    if kind == "dense without out_features":
        tokenizer = Retriever.load(world["model"]).tokenizer
        Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(pooling="cls", projection_dim=8)).save(
            root / "dense")
        config_path = next((root / "dense").glob("*_Dense/config.json"))
        config = json.loads(config_path.read_text())
        del config["out_features"]
        config_path.write_text(json.dumps(config))
        return root / "dense"
    model = root / "model"
    shutil.copytree(world["model"], model)
    if kind.startswith("tokenizer_config"):
        settings = json.loads((model / "tokenizer_config.json").read_text())
        damaged = {"tokenizer_config a list": [settings], "tokenizer_config max length a string":
                   {**settings, "model_max_length": "abc"},
                   "tokenizer_config added tokens a list": {**settings, "added_tokens_decoder": ["[PAD]"]}}[kind]
        (model / "tokenizer_config.json").write_text(json.dumps(damaged))
        return model
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    del tokenizer["added_tokens"]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.mark.parametrize("kind, needle", [
    ("adapter pickle", "adapter weights are a pickle"), ("adapter is its own base", "not this folder"),
    ("symlink loop", "a symbolic link that loops"), ("tokenizer without added_tokens", "added_tokens"),
    ("dense without out_features", "'out_features' is missing"),
    ("tokenizer_config a list", "tokenizer_config.json: expected a JSON object"),
    ("tokenizer_config max length a string", "tokenizer_config.json: 'model_max_length' must be a positive integer"),
    ("tokenizer_config added tokens a list", "tokenizer_config.json: 'added_tokens_decoder' must be an object")])
def test_model_folders_that_cannot_load_are_one_line(world: dict, tmp_path: Path, kind: str, needle: str) -> None:
    """The issue's poor messages: a pickled LoRA adapter (never unpickled), an adapter naming its own folder as base
    (once a 32 KB recursion message), a symlink loop (once "Repo id must be in the form"), a tokenizer.json without
    added_tokens, a Dense layer without out_features (the typed-value fuzz changes values, these drop keys), a
    tokenizer_config.json that is no object or holds a wrongly typed model_max_length or added_tokens_decoder."""
    model = _damaged_model_folder(world, tmp_path, kind)
    line = refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device",
                    "cpu", "--cache-dir", tmp_path / "c"], needle)
    assert len(line) < 400 and str(model) in line
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "e").exists()



@pytest.mark.parametrize("kind, needles", [
    ("runs/nq", ("a training output folder", "use {runs}/final or {runs}/best")),
    ("runs/nq/checkpoint-2", ("a training checkpoint", "its model is {runs}/checkpoint-2/model")),
    ("empty", ("not a model folder (no config.json)",))])
@pytest.mark.parametrize("command", ["encode", "train"])
def test_a_folder_holding_no_model_says_what_it_is(tmp_path: Path, kind: str, needles: tuple, command: str) -> None:
    """A training output, one of its checkpoints or an empty folder as --model is one line saying what the folder
    is and where its model is (it once reached transformers: "Unrecognized model ... Should have a `model_type` key",
    with advice to give a Hugging Face name)."""
    runs = tmp_path / "runs" / "nq"
    for folder in ("checkpoint-2/model", "final", "best"):
        (runs / folder).mkdir(parents=True)
    (runs / "train_config.json").write_text("{}")
    (runs / "checkpoint-2" / "train_state.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "corpus.tsv").write_bytes(tsv_bytes(passages()))
    (tmp_path / "train.json").write_text(json.dumps(training_records()))
    model = tmp_path / kind
    argv = (["encode", "--corpus", tmp_path / "corpus.tsv", "--device", "cpu"] if command == "encode" else
            ["train", "--train", tmp_path / "train.json", "--max-steps", "1"])
    line = refused([*argv, "--model", model, "--output", tmp_path / "out", "--cache-dir", tmp_path / "c"],
                   *(needle.format(runs=runs) for needle in needles))
    assert str(model) in line and "model_type" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, needles", [
    ("fsdp", ("a training output folder", "its checkpoints are sharded FSDP checkpoints",
              "--fsdp --resume", "final/ or best/")),
    ("fsdp/checkpoint-1", ("a sharded FSDP training checkpoint", "--fsdp --resume", "{runs}/final or {runs}/best"))])
def test_an_fsdp_run_or_checkpoint_says_its_checkpoints_are_sharded(tmp_path: Path, kind: str,
                                                                     needles: tuple) -> None:
    """An FSDP run without final/ and one of its checkpoints (sharded/, no model/) as --model: one line saying the
    checkpoints hold sharded weights only a --fsdp --resume reads, pointing to final/ or best/ (not to a
    checkpoint-N/model that does not exist, nor 'no trained model yet')."""
    runs = tmp_path / "fsdp"
    for step in (1, 2):
        (runs / f"checkpoint-{step}" / "sharded").mkdir(parents=True)
        (runs / f"checkpoint-{step}" / "train_state.json").write_text("{}")
        (runs / f"checkpoint-{step}" / "train_config.json").write_text("{}")
    (runs / "train_config.json").write_text("{}")
    (tmp_path / "corpus.tsv").write_bytes(tsv_bytes(passages()))
    model = tmp_path / kind
    line = refused(["encode", "--corpus", tmp_path / "corpus.tsv", "--device", "cpu", "--model", model, "--output",
                    tmp_path / "out", "--cache-dir", tmp_path / "c"], *(n.format(runs=runs) for n in needles))
    assert str(model) in line and "checkpoint-2/model" not in line and "no trained model yet" not in line


@pytest.fixture(scope="module")
def lora_folder(world: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world's model with a LoRA adapter, saved: adapter_config.json + adapter_model.safetensors."""
    from dpr_gc.model.lora import LoraSettings, apply_lora

    retriever = Retriever.load(world["model"])
    apply_lora(retriever, LoraSettings(r=2))
    folder = tmp_path_factory.mktemp("lora") / "lora"
    retriever.save(folder)
    return folder


@pytest.mark.parametrize("fault, needles", [
    ({"lora_alpha": "16"}, ("adapter_config.json", "'lora_alpha' must be a positive number")),
    ({"r": "x"}, ("adapter_config.json", "'r' must be a positive integer")),
    ({"target_modules": 5}, ("adapter_config.json", "'target_modules' must be a string or a list of strings")),
    ({"lora_dropout": "0.1"}, ("adapter_config.json", "'lora_dropout' must be a number")),
    ({"rank_pattern": [1]}, ("adapter_config.json", "'rank_pattern' must be an object")),
    (None, ("no adapter_model.safetensors", "copy the file back or save the adapter again"))])
def test_a_lora_adapter_folder_with_wrong_fields_or_no_weights_is_one_line(world: dict, lora_folder: Path,
                                                                          tmp_path: Path, fault: Optional[dict],
                                                                          needles: tuple) -> None:
    """adapter_config.json values of the wrong type (peft raised TypeError tracebacks) and a missing
    adapter_model.safetensors (peft went to the Hub: a ConnectError traceback) are one error line naming the
    file or folder, from Retriever.load and from encode --model, before any output is written."""
    model = tmp_path / "lora"
    shutil.copytree(lora_folder, model)
    if fault is None:
        (model / "adapter_model.safetensors").unlink()
    else:
        config = json.loads((model / "adapter_config.json").read_text())
        (model / "adapter_config.json").write_text(json.dumps({**config, **fault}))
    with pytest.raises(DprGcError) as refusal:
        Retriever.load(model)
    assert str(model) in str(refusal.value) and "\n" not in str(refusal.value)
    line = refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device",
                    "cpu", "--cache-dir", tmp_path / "c"], *needles)
    assert str(model) in line and not (tmp_path / "e").exists()


@pytest.mark.parametrize("base", ["itself", "another adapter"])
def test_an_adapter_whose_base_is_an_adapter_folder_is_one_line(lora_folder: Path, tmp_path: Path, base: str) -> None:
    """An adapter_config.json whose base_model_name_or_path names an adapter folder (its own, or another adapter's)
    is refused in one line saying to point it at the base model: loading its base would load the adapter again."""
    model = tmp_path / "lora"
    shutil.copytree(lora_folder, model)
    named = model
    if base == "another adapter":
        named = tmp_path / "other"
        shutil.copytree(lora_folder, named)
    config = json.loads((model / "adapter_config.json").read_text())
    (model / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(named)}))
    with pytest.raises(DprGcError, match=f"base_model_name_or_path {re.escape(repr(str(named)))} must name a plain "
                                         "model .*point it at the base model$"):
        Retriever.load(model)


def _without_vocabulary(world: dict, root: Path, kind: str) -> Path:
    """A copy of the world's model without its tokenizer.json: no vocabulary file at all, an empty vocab.txt, or a
    vocab.txt without [UNK]."""
    from tests.helpers import write_vocab

    model = root / "model"
    shutil.copytree(world["model"], model)
    (model / "tokenizer.json").unlink()
    if kind == "empty vocab.txt":
        (model / "vocab.txt").write_text("")
    elif kind == "vocab.txt without [UNK]":
        words = write_vocab(root / "vocab.txt").read_text().splitlines()
        (model / "vocab.txt").write_text("".join(f"{word}\n" for word in words if word != "[UNK]"))
    return model


@pytest.mark.parametrize("kind, needle", [
    ("no vocabulary file", "the tokenizer has 5 tokens for the model's"),
    ("empty vocab.txt", "the tokenizer has 5 tokens for the model's"),
    ("vocab.txt without [UNK]", "Missing [UNK] token")])
def test_a_model_folder_without_its_vocabulary_is_refused(world: dict, tmp_path: Path, kind: str, needle: str) -> None:
    """From a folder without its vocabulary transformers builds a tokenizer of the special tokens alone, which turns
    every word into [UNK] (encode exited 0 with garbage); a WordPiece vocabulary without [UNK] raised a traceback
    mid-encode and left a half-written shard. Both are refused at load, in one line naming the folder, before
    --output is touched."""
    model = _without_vocabulary(world, tmp_path, kind)
    line = refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device",
                    "cpu", "--cache-dir", tmp_path / "c"], needle)
    assert str(model) in line and not (tmp_path / "e").exists()


def test_a_tokenizer_with_more_ids_than_the_model_has_embeddings_is_refused(world: dict, tmp_path: Path,
                                                                            tiny_tokenizer: Any) -> None:
    """Tokens added to a model folder's tokenizer without resize_token_embeddings loaded silently, and the first text
    holding one crashed mid-encode or mid-train with an IndexError traceback. The loader refuses the folder in one
    line naming both counts and what to do; a padded table (more embedding rows than tokens) still loads."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = len(tokenizer)
    tokenizer.add_tokens(["zebrafoo", "quuxbar"])
    tokenizer.save_pretrained(model)
    needles = (str(model), f"ids up to {rows + 1}", f"model has {rows} embeddings", "resize_token_embeddings",
               "remove the added tokens")
    with pytest.raises(DprGcError) as refusal:
        Retriever.load(model)
    assert all(needle in str(refusal.value) for needle in needles), refusal.value
    refused(["encode", "--model", model, "--corpus", world["corpus"], "--output", tmp_path / "e", "--device", "cpu",
             "--cache-dir", tmp_path / "c"], *needles)
    assert not (tmp_path / "e").exists()
    padded = Retriever(tiny_bert(len(tiny_tokenizer) + 64), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    padded.save(tmp_path / "padded")
    assert Retriever.load(tmp_path / "padded").tokenizer is not None


def test_a_single_token_past_the_embeddings_is_refused(world: dict, tmp_path: Path) -> None:
    """The bound of check_ids_have_embeddings: one added token, whose id equals the number of embedding rows, has no
    row (ids run from 0 to rows - 1) and is refused as two are."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = len(tokenizer)
    tokenizer.add_tokens(["zebrafoo"])
    tokenizer.save_pretrained(model)
    with pytest.raises(DprGcError, match=f"ids up to {rows} but the model has {rows} embeddings"):
        Retriever.load(model)


# ------------------------------------------------------------------ integers beyond what FAISS, OpenMP, a model take
def _ivf_index(world: dict, folder: Path) -> Path:
    build_index(world["emb"], folder, IndexParams("ivf-flat"))
    return folder


def test_faiss_integer_flags_beyond_their_range_are_refused_when_parsed(world: dict, tmp_path: Path) -> None:
    """--nprobe 99999999999 was saved into the index and failed every later search ('cur_nprobe > 0'); a huge
    --ef-construction overflowed a C int in a traceback. Every such flag states its range, on the command line and
    in code."""
    index = ["index", "--embeddings", world["emb"], "--output", tmp_path / "idx"]
    for kind, flag, value, limit in (("ivf-flat", "--nprobe", "99999999999", "1 to 2147483647"),
                                     ("hnsw", "--ef-construction", "99999999999", "1 to 1048576"),
                                     ("hnsw", "--ef-search", "2147483647", "1 to 1048576"),
                                     ("ivf-flat", "--nlist", "99999999999", "1 to 1048576"),
                                     ("ivf-pq", "--pq-nbits", "25", "1 to 24")):
        refused([*index, "--kind", kind, flag, value], flag, f"'{value}' is not an integer from {limit}")
    assert not (tmp_path / "idx").exists()
    for flag in ("--nprobe", "--ef-search"):
        refused(retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / "o.json", flag, "99999999999"),
                flag, "is not an integer from 1 to")
    assert not (tmp_path / "o.json").exists()
    with pytest.raises(DprGcError, match="--nprobe must be an integer from 1 to 2147483647"):
        IndexParams("ivf-flat", nprobe=2**31)
    with pytest.raises(DprGcError, match="--nprobe must be an integer from 1 to 2147483647"):
        DenseIndex.read(_ivf_index(world, tmp_path / "ivf")).set_search_params(nprobe=2**31)


def test_index_metadata_holding_an_out_of_range_parameter_is_refused_when_read(world: dict, tmp_path: Path) -> None:
    """An index saved with nprobe 99999999999 (by a version that took it, or edited) made every retrieve die in FAISS
    with a traceback; it is refused in one line naming the file and saying to rebuild."""
    meta_file = _ivf_index(world, tmp_path / "ivf") / "index_meta.json"
    meta = json.loads(meta_file.read_text())
    meta["params"]["nprobe"] = 99999999999
    meta_file.write_text(json.dumps(meta))
    line = refused(["retrieve", "--index", tmp_path / "ivf", "--queries", world["qa"], "--output", tmp_path / "o.json",
                    "--device", "cpu"], "nprobe 99999999999", "rebuild the index")
    assert str(meta_file) in line and not (tmp_path / "o.json").exists()


def test_more_threads_than_cpus_are_cut_to_the_cpus(world: dict, tmp_path: Path, caplog) -> None:
    """--threads 99999999999 overflowed omp_set_num_threads in a traceback (and tens of thousands of OpenMP threads
    abort the process); the count is cut to the CPUs this process may use, with a log line."""
    import faiss

    before = faiss.omp_get_max_threads()
    try:
        code, err = call(cli.main, ["index", "--embeddings", world["emb"], "--output", tmp_path / "idx",
                                    "--threads", "99999999999"])
        assert code == 0 and "Traceback" not in err, err
        assert faiss.omp_get_max_threads() == len(os.sched_getaffinity(0))
        code, err = call(cli.main, retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / "o.json",
                                                 "--threads", "99999999999"))
        assert code == 0 and "Traceback" not in err, err
    finally:
        faiss.omp_set_num_threads(before)
    assert "--threads 99999999999 is more than the" in caplog.text


def test_more_answer_matching_workers_than_cpus_are_cut_to_the_cpus(world: dict, tmp_path: Path, caplog) -> None:
    """--workers went straight to a process pool ("in 99999999999999 processes"); it is cut to the CPUs, said once,
    in every command that matches answers."""
    cpus, many = len(os.sched_getaffinity(0)), "99999999999999"
    runs = {"evaluate": ["evaluate", "--results", world["results"], "--match", "regex", "--workers", many],
            "retrieve": retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / "o.json", "--workers",
                                      many),
            "mine": ["mine", "--train-file", world["train"], "--corpus", world["corpus"], "--output", tmp_path / "m.json",
                     "--cache-dir", tmp_path / "cache", "--workers", many]}
    for name, argv in runs.items():
        caplog.clear()
        code, err = call(cli.main, argv)
        assert code == 0, (name, err)
        said = [r.getMessage() for r in caplog.records]
        assert [m for m in said if many in m] == [
            f"--workers {many} is more than the {cpus} CPU(s) this process may use; using {cpus}"], (name, said)


def _plain_bert(folder: Path, tokenizer: Any) -> Path:
    """A tiny random BERT (128 positions) and its tokenizer as a transformers folder: train starts a new retriever."""
    tiny_bert(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_train_max_lengths_beyond_the_model_positions_are_refused(world: dict, tmp_path: Path,
                                                                   tiny_tokenizer: Any) -> None:
    """train --query-max-length 100000 was saved into the retriever, and retrieving a long question with it died
    in the model's forward; it is refused as encode's --max-length is, before --output is created."""
    train = ["train", "--train", world["train"], "--output", tmp_path / "t", "--device", "cpu", "--max-steps", "1",
             "--batch-size", "2", "--num-workers", "0", "--model", _plain_bert(tmp_path / "bert", tiny_tokenizer),
             "--cache-dir", tmp_path / "c"]
    refused([*train, "--query-max-length", "100000"], "--query-max-length 100000 exceeds the model's limit of 128")
    refused([*train, "--passage-max-length", "129"], "--passage-max-length 129 exceeds the model's limit of 128")
    assert not (tmp_path / "t").exists()


def test_a_max_length_leaving_the_text_no_token_is_refused_before_anything_is_written(world: dict, tmp_path: Path,
                                                                                      tiny_tokenizer: Any) -> None:
    """A text needs a token of its own beside the tokenizer's special tokens (a pair-format passage: beside the
    pair's three). encode and train refuse a max length without one by its flag before writing anything (encode
    --max-length 1 wrote its progress record first, which then refused every corrected rerun), and the corrected
    command runs."""
    encode = ["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", tmp_path / "e",
              "--device", "cpu", "--cache-dir", tmp_path / "c"]
    refused([*encode, "--max-length", "1"], "--max-length 1 leaves no room for the passage's text beside the tokenizer's 2 special tokens")
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
    code, err = call(cli.main, encode)
    assert code == 0, err
    train = ["train", "--train", world["train"], "--output", tmp_path / "t", "--device", "cpu", "--max-steps", "1",
             "--batch-size", "2", "--num-workers", "0", "--model", _plain_bert(tmp_path / "bert", tiny_tokenizer),
             "--cache-dir", tmp_path / "c", "--passage-format", "pair"]
    refused([*train, "--passage-max-length", "3"], "--passage-max-length 3 leaves no room for a title and a text")
    refused([*train, "--query-max-length", "2"], "--query-max-length 2 leaves no room for the query's text")
    assert not (tmp_path / "t").exists()


def test_a_stored_prefix_is_checked_against_the_max_length_each_stage_uses(world: dict, tmp_path: Path) -> None:
    """A model stores prefixes that fill its own max lengths (32 passage, 16 query tokens). Loading it refuses
    nothing (merge-lora only merges weights); encode checks the passage prefix against its --max-length (a longer
    one runs), retrieve and mine a --query-prefix against the model's own length, named as such (they have no length
    flag; both once said to raise --query-/--passage-max-length, at load, whatever --max-length said)."""
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    config = json.loads((model / "retriever_config.json").read_text())
    (model / "retriever_config.json").write_text(json.dumps({
        **config, "query_max_length": 16, "passage_max_length": 32, "query_prefix": "paris " * 20,
        "passage_prefix": "river " * 34}))
    encode = ["encode", "--model", model, "--corpus", world["corpus"], "--device", "cpu", "--cache-dir",
              tmp_path / "c"]
    refused([*encode, "--output", tmp_path / "e1"], "the passage prefix 'river river",
            "tokens a passage has under the retriever's passage_max_length 32")
    code, err = call(cli.main, [*encode, "--output", tmp_path / "e2", "--max-length", "128"])
    assert code == 0, err
    refused(retrieve_argv(world, "--model", model, "--skip-model-check", "--queries", world["qa"], "--output",
                          tmp_path / "o.json", "--query-prefix", "paris " * 20), "the query prefix 'paris paris",
            "under the retriever's query_max_length 16", "give a shorter --query-prefix or a longer max length")
    refused(["mine", "--source", "dense", "--model", model, "--skip-model-check", "--index", world["idx"],
             "--train-file", world["train"], "--output", tmp_path / "mined.json", "--corpus", world["corpus"],
             "--device", "cpu", "--cache-dir", tmp_path / "c", "--query-prefix", "paris " * 20],
            "the query prefix 'paris paris", "under the retriever's query_max_length 16")
    assert not (tmp_path / "o.json").exists() and not (tmp_path / "mined.json").exists()
    refused(["merge-lora", "--model", model, "--output", tmp_path / "merged"], "no LoRA adapter to merge")


def test_a_saved_max_length_beyond_the_model_positions_is_cut_at_load(world: dict, tmp_path: Path, caplog) -> None:
    """A retriever saved with a query_max_length beyond its 128 positions (before train checked the flag) still
    retrieves a long question: texts are cut at the positions, with a log line saying so."""
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    config = json.loads((model / "retriever_config.json").read_text())
    (model / "retriever_config.json").write_text(json.dumps({**config, "query_max_length": 100_000}))
    (tmp_path / "long.tsv").write_text(" ".join(["paris"] * 2000) + '\t["paris"]\n')
    caplog.set_level("INFO", logger="dpr_gc")
    code, err = call(cli.main, ["retrieve", "--index", world["idx"], "--model", model, "--queries",
                                tmp_path / "long.tsv", "--output", tmp_path / "o.json", "--device", "cpu",
                                "--skip-model-check"])
    assert code == 0 and "Traceback" not in err, err
    assert "query_max_length 100000 exceeds the model's limit of 128 positions" in caplog.text
    assert len(json.loads((tmp_path / "o.json").read_text())[0]["ctxs"]) == 16
    assert Retriever.load(model).max_length("query") == 128


def test_a_file_that_is_not_a_model_is_one_line_without_advice_to_unpickle(world: dict, tmp_path: Path) -> None:
    """``--model`` naming a JSON file, or a pickle in an old protocol: one error line (torch's warnings about the
    pickle protocol stay quiet, in a real process where they would print), never torch's advice to load with
    ``weights_only=False``, and the pickle's code never runs."""
    marker = tmp_path / "PWNED"
    old = tmp_path / "old.cp"
    with open(old, "wb") as f:
        torch.save(pickle_payload(marker), f, pickle_protocol=2)
    for model, needle in ((world["train"], "not a model"), (old, "cannot be read as weights only")):
        result = subprocess.run([sys.executable, "-m", "dpr_gc.cli", "encode", "--model", str(model), "--corpus",
                                 str(world["corpus"]), "--output", str(tmp_path / "emb"), "--device", "cpu"],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        line = assert_one_error(result.returncode, result.stderr, needle)
        assert "weights_only=False" not in line or "where you trust the file" in line, line
    assert not marker.exists() and not (tmp_path / "emb").exists()


def test_refusals_name_the_file_or_flag_at_fault(world: dict, tmp_path: Path) -> None:
    """A file where --cache-dir or --embeddings needs a folder, a shard holding NaN, an empty results list: the one
    error line names the flag or the file."""
    a_file = tmp_path / "ok.json"
    a_file.write_text("{}")
    refused(["encode", "--model", world["model"], "--corpus", world["corpus"], "--output", tmp_path / "e",
             "--cache-dir", a_file], "--cache-dir", "is a file")
    refused(["index", "--embeddings", a_file, "--output", tmp_path / "i"], f"{a_file} is a file; give the folder")
    emb = tmp_path / "emb"
    shutil.copytree(world["emb"], emb)
    shard = next(emb.glob("shard-*.npy"))
    vectors = np.load(shard)
    vectors[1, 0] = np.nan
    np.save(shard, vectors)
    refused(["index", "--embeddings", emb, "--output", tmp_path / "i"], f"{shard} (rows 0-", "NaN")
    empty = tmp_path / "results.json"
    empty.write_text("[]")
    refused(["evaluate", "--results", empty], f"{empty}: no questions to evaluate")


@pytest.mark.parametrize("factory, needle", [
    ("", "--factory is empty"), ("HNSW1,Flat", "HNSW1 gives each node 1"),
    ("IDMap,Flat", "--factory 'IDMap,Flat': an IDMap index takes vectors only with ids"),
    ("IDMap2,Flat", "leave IDMap out"), ("Flat,IDMap", "leave IDMap out"),
    ("NSG4,Flat", "FAISS cannot build index 'NSG4,Flat' from these embeddings: Error: 'n > NUM_EVAL_POINTS' failed: "
                  "NNDescent.build cannot build a graph smaller than 100; check --factory")])
def test_a_factory_string_faiss_would_misread_is_refused(world: dict, tmp_path: Path, factory: str,
                                                        needle: str) -> None:
    """An empty --factory built a Flat index; HNSW with one neighbour per node crashed FAISS (a segfault); an IDMap
    (which takes vectors only with ids) and NSG over fewer than 100 vectors crashed it with a traceback."""
    refused(["index", "--embeddings", world["emb"], "--output", tmp_path / "i", "--factory", factory], needle)
    assert not (tmp_path / "i").exists()


def test_a_config_that_does_not_describe_its_weights_names_a_weight(tiny_tokenizer: Any, tmp_path: Path) -> None:
    """A config.json whose sizes differ from the weights': transformers points at a log report the quiet log hides;
    the one line names the first weight that differs, its saved and expected shapes."""
    folder = tmp_path / "model"
    tiny_bert(len(tiny_tokenizer)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=2 * config["hidden_size"], intermediate_size=2 * config["intermediate_size"])
    (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "c.tsv").write_bytes(tsv_bytes(passages()))
    line = refused(["encode", "--model", folder, "--corpus", tmp_path / "c.tsv", "--output", tmp_path / "emb"],
                   "config.json does not describe its weights", "more weights differ")
    assert re.search(r"\.(weight|bias) holds \[\d+(, \d+)?\] where the config makes \[\d+(, \d+)?\]", line), line
    assert "above report" not in line


@pytest.mark.parametrize("change, needle", [
    ("drop a weight", "its weights file lacks encoder.layer.1.attention.output.LayerNorm.bias that its "
                      "config.json makes (they would start at random)"),
    ("drop layer 1", "its config.json makes 2 layers (num_hidden_layers) but its weights file holds 1; fix "
                     "num_hidden_layers in config.json"),
    ("3 layers", "its config.json makes 3 layers (num_hidden_layers) but its weights file holds 2"),
    ("100000 layers", "its config.json makes 100,000 layers (num_hidden_layers) but its weights file holds 2"),
    ("1 layer", "its weights file holds encoder.layer.1.attention.output.LayerNorm.bias and 15 more that its "
                "config.json leaves out"),
    ("a task head", None),
    ("10**12 positions", "its config.json does not describe its weights")])
def test_weights_the_config_makes_but_the_file_lacks_are_refused(tiny_tokenizer: Any, tmp_path: Path, change: str,
                                                                  needle: Optional[str]) -> None:
    """Missing weights were started at random and encoded without a word (transformers' report is hidden by the
    quiet log); saved layers a smaller config leaves out were dropped. A checkpoint's task head loads as before. A
    config too large to build (to name the weight that differs) is still one line, and a config that makes more
    layers than were saved is refused before the model is built (100,000 layers were built for minutes first)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    tiny_bert(len(tiny_tokenizer)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    weights, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    if change == "drop a weight":
        del weights["encoder.layer.1.attention.output.LayerNorm.bias"]
    elif change == "drop layer 1":
        weights = {k: v for k, v in weights.items() if "layer.1." not in k}
    elif change == "a task head":
        weights["cls.predictions.bias"] = torch.zeros(len(tiny_tokenizer))
    elif change == "10**12 positions":  # naming the weight that differs needs a model this machine cannot allocate
        config["max_position_embeddings"] = 10 ** 12
    else:
        config["num_hidden_layers"] = int(change.split()[0])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "c.tsv").write_bytes(tsv_bytes(passages()))
    argv = ["encode", "--model", folder, "--corpus", tmp_path / "c.tsv", "--output", tmp_path / "emb"]
    if needle is None:
        assert call(cli.main, argv)[0] == 0
    else:
        refused(argv, f"cannot load --model '{folder}': ", needle)
        assert not (tmp_path / "emb").exists()


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 0), ("num_hidden_layers", -1),
                                       ("num_attention_heads", -1)])
def test_a_model_size_transformers_leaves_unchecked_must_be_positive(tmp_path: Path, key: str, value: int) -> None:
    """check_model_config: a config.json whose num_hidden_layers is 0 loaded as a model of no layers (its saved
    layers are of no kind it has, so none counts as extra) and encoded without a word; such a size is refused
    naming the file and the key."""
    from dpr_gc.model.pretrained import load_transformer

    folder = tmp_path / "model"
    tiny_bert(64).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(DprGcError, match=f"^{re.escape(str(folder / 'config.json'))}: {key} must be a positive "
                                         f"integer, got {value}$"):
        load_transformer(folder)


def test_a_safetensors_header_length_that_does_not_fit_is_said_once(tmp_path: Path) -> None:
    from dpr_gc.base.validate import check_safetensors

    garbage = tmp_path / "model.safetensors"
    garbage.write_bytes(b"garbage!garbage")
    with pytest.raises(DprGcError) as caught:
        check_safetensors(garbage)
    assert str(caught.value).count("damaged safetensors file") == 1 and "does not fit a file of 15 bytes" in str(
        caught.value), caught.value


@pytest.mark.parametrize("left, extra, needle", [
    ("checkpoint-4/train_state.json", [], "already holds checkpoints: pass --resume latest"),
    ("final/model.safetensors", [], "already holds the trained model of an earlier run (final/)"),
    (None, ["--resume", "latest"], "--resume latest: no finished checkpoint in"),
    (None, ["--resume", "elsewhere"], "--resume elsewhere: not a checkpoint folder"),
    ("checkpoint-4/train_state.json", ["--resume", ""], "--resume is empty")])
def test_an_earlier_run_or_a_missing_checkpoint_is_refused_before_the_model_and_data_load(
        world: dict, tmp_path: Path, monkeypatch, left: Optional[str], extra: list, needle: str) -> None:
    """A new run into an earlier run's folder (or a resume with nothing to resume) is refused before the model is
    loaded and the training data parsed: minutes on a large training set."""
    from dpr_gc.train.trainer import Trainer

    def loaded(self: Any) -> None:
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(Trainer, "build_model", loaded)
    out = tmp_path / "run"
    if left is not None:
        (out / left).parent.mkdir(parents=True)
        (out / left).write_text("{}")
    refused(["train", "--train", world["train"], "--output", out, "--model", world["model"], "--device", "cpu",
             "--cache-dir", tmp_path / "cache", *extra], needle)


LONG_INTEGER = "9" * 4301  # one digit more than Python converts (sys.get_int_max_str_digits)


def test_an_integer_longer_than_python_reads_is_invalid_json_in_every_reader(world: dict, tmp_path: Path) -> None:
    """An integer of over 4,300 digits made ``json.loads`` raise a ValueError the readers did not catch: a traceback
    for queries, QA answers, a corpus, training records, results and index metadata alike."""
    common = ["--output", tmp_path / "o.json", "--cache-dir", tmp_path / "cache", "--device", "cpu"]
    queries = _write(tmp_path / "q.jsonl", f'{{"_id": "q1", "text": "paris", "n": {LONG_INTEGER}}}\n'.encode())
    qa = _write(tmp_path / "qa.tsv", f"who sang\t[\"music\"]\nwhat is paris\t[{LONG_INTEGER}]\n".encode())
    for path, line in ((queries, 1), (qa, 2)):
        refused(["retrieve", "--index", world["idx"], "--model", world["model"], "--corpus", world["corpus"],
                 "--queries", path, *common], f"{path}:{line}: invalid JSON (an integer of 4301 digits")
    corpus = _write(tmp_path / "c.jsonl", f'{{"_id": "a", "text": "x"}}\n{{"_id": "b", "text": {LONG_INTEGER}}}\n'
                    .encode())
    refused(["encode", "--model", world["model"], "--corpus", corpus, *common], f"{corpus}:2: invalid JSON")
    record = json.dumps(training_records(1)[0])
    train = _write(tmp_path / "t.jsonl", f'{record}\n{record[:-1]}, "n": {LONG_INTEGER}}}\n'.encode())
    refused(["prepare-data", train, "--cache-dir", tmp_path / "cache"], f"{train}:2: invalid JSON")
    results = _write(tmp_path / "r.json", world["results"].read_text().replace("1.0", LONG_INTEGER).encode())
    refused(["evaluate", "--results", results, "--output", tmp_path / "m.json"], f"{results}:1: invalid JSON")
    idx = tmp_path / "idx"
    shutil.copytree(world["idx"], idx)
    meta = idx / "index_meta.json"
    meta.write_text(meta.read_text().replace("{", f'{{"n": {LONG_INTEGER}, ', 1))
    refused(["retrieve", "--index", idx, "--queries", world["qa"], *common], f"{meta}", "invalid JSON")
    assert not (tmp_path / "o.json").exists() and not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("rel", ["1" + "0" * 309, "7" * 5000, str(2 ** 31), "-2147483649"],
                         ids=["310-digits", "5000-digits", "2**31", "-2**31-1"])
def test_a_relevance_beyond_what_trec_eval_takes_is_refused_in_every_qrels_reader(world: dict, tmp_path: Path,
                                                                                 rel: str) -> None:
    """A relevance of 310 digits overflowed nDCG's float sums, one of 5,000 digits crashed int(); anything beyond a
    32-bit integer (trec_eval's and pytrec_eval's range) is refused naming file and line, in evaluate, mine and a
    BEIR training folder alike."""
    qrels = _write(tmp_path / "qrels.tsv", f"query-id\tcorpus-id\tscore\nq1\tp0\t1\nq2\tp1\t{rel}\n".encode())
    needle = f"{qrels}:3: relevance"
    refused(["evaluate", "--run", world["run"], "--qrels", qrels, "--output", tmp_path / "m.json"], needle,
            "out of range")
    refused(["mine", "--train-file", world["train"], "--corpus", world["corpus"], "--qrels", qrels, "--output",
             tmp_path / "mined.json", "--cache-dir", tmp_path / "cache"], needle, "out of range")
    beir = tmp_path / "beir"
    _write(beir / "corpus.jsonl", b'{"_id": "p0", "text": "x"}\n{"_id": "p1", "text": "y"}\n')
    _write(beir / "queries.jsonl", b'{"_id": "q1", "text": "a"}\n{"_id": "q2", "text": "b"}\n')
    shutil.copy(qrels, _write(beir / "qrels" / "train.tsv", b""))
    refused(["prepare-data", beir, "--cache-dir", tmp_path / "cache"], f"{beir / 'qrels' / 'train.tsv'}:3: relevance",
            "out of range")
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "mined.json").exists()


@pytest.mark.parametrize("command", ["train", "verify", "demo", "make-stdlib-data", "index"])
def test_a_seed_numpy_cannot_take_is_refused_while_the_command_line_is_parsed(world: dict, tmp_path: Path,
                                                                             command: str) -> None:
    """--seed 2**32 crashed train, verify and demo in numpy after work had started, and make-stdlib-data and index
    took it; every --seed is one flag type, refused before anything is read."""
    assert all(a.type is flag_types.seed_int for a in all_actions(cli.build_parser()) if "--seed" in a.option_strings)
    argv = {"train": ["train", "--train", world["train"], "--model", world["model"], "--output", tmp_path / "out"],
            "verify": ["verify", "--model", world["model"]], "demo": ["demo", "--output", tmp_path / "out"],
            "make-stdlib-data": ["make-stdlib-data", "--output", tmp_path / "out"],
            "index": ["index", "--embeddings", world["emb"], "--output", tmp_path / "out"]}[command]
    refused([*argv, "--seed", str(2 ** 32)], "--seed", "from 0 to 4294967295")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--projection-dim", "1000000000000"), ("--lora-r", "99999999999")])
def test_a_layer_wider_than_memory_holds_is_refused_while_the_command_line_is_parsed(world: dict, tmp_path: Path,
                                                                                    tiny_tokenizer: Any, flag: str,
                                                                                    value: str) -> None:
    """A projection to 10**12 dimensions or a LoRA rank of 10**11 crashed train with "can't allocate memory"."""
    bert = _plain_bert(tmp_path / "bert", tiny_tokenizer)
    refused(["train", "--train", world["train"], "--model", bert, "--output", tmp_path / "out", "--device", "cpu",
             flag, value], flag, "from 1 to 65536")
    assert not (tmp_path / "out").exists()


def test_a_name_longer_than_a_file_system_takes_is_refused_naming_its_flag(world: dict, tmp_path: Path) -> None:
    """A path component over 255 bytes made the output checks crash with OSError "File name too long" while the
    command line was parsed; inputs said it without their flag."""
    long = "a" * 300
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", tmp_path / f"{long}.json"],
            "--output", "file name too long (305 bytes")
    refused(["index", "--embeddings", world["emb"], "--output", tmp_path / long / "x"], "--output",
            "file name too long")
    refused(["retrieve", "--index", world["idx"], "--queries", world["qa"], "--output", tmp_path / "o.json",
             "--trec-run", tmp_path / long], "--trec-run", "file name too long")
    refused(["evaluate", "--run", tmp_path / f"{long}.trec", "--qrels", world["qrels"]], "--run", "file name too long")
    refused(["encode", "--model", world["model"], "--corpus", tmp_path / long, "--output", tmp_path / "emb"],
            "--corpus", "file name too long")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [250, 225])
def test_an_output_name_too_long_for_the_files_beside_it_is_refused_before_any_work(world: dict, tmp_path: Path,
                                                                                     size: int) -> None:
    """An output name a few bytes under 255 passed the checks and failed after the work, naming the lock or temporary
    file beside the output (``.NAME.lock``, ``..NAME.retrieved.progress.json.XXXXXXXX.tmp``) and leaving a partial
    file; it is refused up front naming its flag, and a name at the limit is written."""
    from dpr_gc.base.files import BESIDE_BYTES, NAME_MAX

    name = "a" * (size - 5) + ".json"
    refused(retrieve_argv(world, "--queries", world["qa"], "--output", tmp_path / name), "--output",
            f"{tmp_path / name}: file name too long ({size} bytes", "give a shorter name")
    refused(["index", "--embeddings", world["emb"], "--output", tmp_path / name[:-5]], "--output",
            f"{tmp_path / name[:-5]}: file name too long ({size - 5} bytes")
    assert list(tmp_path.iterdir()) == []
    fits = tmp_path / ("b" * (NAME_MAX - BESIDE_BYTES - 5) + ".json")
    assert call(cli.main, retrieve_argv(world, "--queries", world["qa"], "--output", fits))[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == [fits.name] and json.loads(fits.read_text())
    from dpr_gc.base.guard import refused_output  # a file system of shorter names refuses the lock beside it

    lock = OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(tmp_path / f".{fits.name}.lock"))
    assert str(refused_output(lock, {"--output": fits})) == (f"--output {fits} cannot be written: file name too "
                                                              f"long in {tmp_path}; give a shorter name")


@pytest.mark.parametrize("shards", [["--shard_id", "5", "--num_shards", "2"], ["--shard_id", "1"]])
def test_generate_dense_embeddings_refuses_a_shard_outside_num_shards_in_one_line(world: dict, tmp_path: Path,
                                                                                  shards: list) -> None:
    """The shard's output name was resolved before the error guard: a traceback ending in DprGcError."""
    script = load_script("generate_dense_embeddings")
    refused(["--model_file", world["model"], "--ctx_file", world["corpus"], "--out_file", tmp_path / "ge", *shards],
            "--shard_id must be in [0, --num_shards)", main=script.main)
    assert not list(tmp_path.iterdir())


def test_train_never_writes_into_the_checkpoint_it_resumes(trained, tmp_path: Path) -> None:
    """``--output`` may change on --resume, but not to the checkpoint read or a folder inside it: the run would
    rewrite its settings record and add checkpoints, metrics and final/ inside it."""
    run = copy_run(trained, tmp_path)
    checkpoint = run / "checkpoint-1"
    before = sorted(p.name for p in checkpoint.iterdir())
    for output in (checkpoint, checkpoint / "sub"):
        argv = train_argv(trained, run, str(checkpoint))
        argv[argv.index("--output") + 1] = output
        refused(argv, f"--output {output}", f"--resume {checkpoint}", "inputs are never overwritten")
    assert sorted(p.name for p in checkpoint.iterdir()) == before


def test_dense_mining_names_its_own_flags_in_the_encoding_and_indexing_it_runs(world: dict, tmp_path: Path) -> None:
    """mine --source dense builds its flat --index from --embeddings (encoding them first when the folder has none):
    the refusals of that shared code name mine's flags (they said --output, encode's and index's), and settings
    of encode's that mine lacks as encode's."""
    from dpr_gc.retrieval.mine import ENCODE_FLAGS

    emb = tmp_path / "emb"  # none yet: mine encodes the corpus into it, then indexes it
    refused(["mine", "--source", "dense", "--model", world["model"], "--embeddings", emb, "--index", emb / "idx",
             "--train-file", world["train"], "--output", tmp_path / "o.json", "--corpus", world["corpus"], "--device",
             "cpu", "--cache-dir", tmp_path / "c"], f"--index {emb / 'idx'} lies inside the input --embeddings {emb}")
    assert not (emb / "idx").exists() and not (tmp_path / "o.json").exists()
    with pytest.raises(DprGcError, match="^was started with dpr-gc encode --block-size 2; resume"), \
            flags_renamed(ENCODE_FLAGS):
        raise DprGcError("was started with --block-size 2; resume")


def test_dense_mining_never_overwrites_the_corpus_its_index_records(world: dict, tmp_path: Path) -> None:
    """Without --corpus, mine reads the passages the index records; an --output naming that file is refused, as
    retrieve refuses it."""
    from dpr_gc.retrieval.index import meta_path

    corpus, index = tmp_path / "corpus.tsv", tmp_path / "idx"
    shutil.copyfile(world["corpus"], corpus)
    shutil.copytree(world["idx"], index)
    meta = json.loads(meta_path(index).read_text())
    meta_path(index).write_text(json.dumps({**meta, "corpus": str(corpus)}))
    before = corpus.read_bytes()
    refused(["mine", "--source", "dense", "--model", world["model"], "--index", index, "--train-file", world["train"],
             "--output", corpus, "--device", "cpu", "--cache-dir", tmp_path / "c"],
            f"--output {corpus} is the input the index's recorded --corpus")
    assert corpus.read_bytes() == before


def test_renamed_flags_leave_a_quoted_dpr_gc_command_as_it_is() -> None:
    """A script's or mine's renaming reached into advice to run a dpr-gc command (`dpr-gc encode --out_file`, a flag
    encode lacks): a quoted dpr-gc command keeps its own flags, the rest of the message is renamed."""
    from dpr_gc.retrieval.mine import ENCODE_FLAGS

    with pytest.raises(DprGcError) as caught, flags_renamed({"--output": "--index"}):
        raise DprGcError("--output o: build one with 'dpr-gc index --embeddings DIR --output DIR'")
    assert str(caught.value) == "--index o: build one with 'dpr-gc index --embeddings DIR --output DIR'"
    with pytest.raises(DprGcError) as caught, flags_renamed(ENCODE_FLAGS):
        raise DprGcError("--shard-id 3 is missing; run `dpr-gc encode --shard-id 3 --output e` for it")
    assert str(caught.value) == ("dpr-gc encode --shard-id 3 is missing; run `dpr-gc encode --shard-id 3 --output e` "
                                 "for it")


def test_caches_built_earlier_are_read_from_a_read_only_cache_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    """The up-front probe leaves out a cache folder that exists: caches prepared beforehand (a shared, read-only
    folder) are read as before; only a folder that cannot be made is refused before anything runs."""
    beir, cache = tmp_path / "beir", tmp_path / "cache"
    shutil.copytree(ROOT / "data" / "examples" / "beir", beir)
    monkeypatch.setenv("DPR_GC_CACHE", str(cache))
    assert call(cli.main, ["prepare-data", beir])[0] == 0
    built = sorted(cache.rglob("*"))
    read_only(monkeypatch, cache)
    code, err = call(cli.main, ["prepare-data", beir])
    assert code == 0 and "| cached |" in capsys.readouterr().out, err
    assert sorted(cache.rglob("*")) == built


DEMO, TRAIN = ["demo", "--output", "{tmp}/demo"], ["train", "--train", "{tmp}/t.json", "--output", "{tmp}/run"]
ENCODE = ["encode", "--corpus", "{tmp}/t.json", "--output", "{tmp}/emb"]
MERGE = ["merge-lora", "--output", "{tmp}/merged"]
NOT_LOADED = {"missing": "no such folder", "qa.csv": "not a model folder nor a DPR .cp checkpoint"}


@pytest.mark.parametrize("stage, flag", [(DEMO, "--model"), (TRAIN, "--model"), (TRAIN, "--pretrained_model_cfg"),
                                         (ENCODE, "--model"), (MERGE, "--model")])
@pytest.mark.parametrize("model", NOT_LOADED)
def test_a_model_that_cannot_load_is_named_by_its_flag(tmp_path, capsys, stage, flag, model):
    """dpr-gc demo/train/encode --model /missing/path said "cannot load model '/missing/path'" without naming the
    flag it came from, and a file that is not a model (qa.csv) "qa.csv: not a model (Unsupported operand 119)",
    the unpickler's words: the line names the flag as typed and what the path is not."""
    from dpr_gc.cli import main

    (tmp_path / "t.json").write_text("[]")
    (tmp_path / "qa.csv").write_text('who?\t["me"]\n')
    path = str(tmp_path / model)
    assert main([word.format(tmp=tmp_path) for word in stage] + [flag, path]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    why = "a file, not a model folder" if stage == DEMO and model == "qa.csv" else NOT_LOADED[model]
    assert err.startswith(f"error: cannot load {flag} {path!r}: {why}"), err
    assert "operand" not in err


@pytest.mark.parametrize("shared, removed, needle", [
    (False, "router_config.json", "router_config.json"), (True, "config.json", "no config.json"),
    (False, "document_0_Transformer/config.json", "no config.json")])
def test_a_pipeline_folder_missing_a_file_names_that_file(make_retriever, tmp_path: Path, shared: bool, removed: str,
                                                         needle: str) -> None:
    """A saved retriever missing its router_config.json (separate towers) or a Transformer module's config.json (the
    shared tower's at the top, a separate tower's in its subfolder) is one line naming the missing file (not the
    legacy router config.json, nor transformers' 'Should have a model_type key')."""
    make_retriever(shared=shared).save(tmp_path / "m")
    (tmp_path / "m" / removed).unlink()
    with pytest.raises(DprGcError) as caught:
        Retriever.load(tmp_path / "m")
    line = str(caught.value)
    assert str(tmp_path / "m" / Path(removed).parent) in line and needle in line and "\n" not in line, line
    assert "model_type" not in line and (removed != "router_config.json" or "/config.json" not in line), line
