"""Retrieve: encode -> index -> retrieve -> evaluate end to end, output formats, query formats, refusals."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dpr_gc.retrieval.encode import encode_corpus
from dpr_gc.retrieval.shards import read_manifests
from dpr_gc.base.errors import DprGcError
from dpr_gc.evaluation.evaluate import qrels_metrics, read_qrels, read_run
from dpr_gc.retrieval.index import DenseIndex, IndexParams, build_index
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from dpr_gc.retrieval.retrieve import (add_cli, check_compatible, check_corpus, retrieve, retrieve_file,
                                       retrieve_to_files, write_results_json, write_trec_run)
from tests.helpers import edit_off_the_sample, summary_rows, tiny_bert, WORDS

ROOT = Path(__file__).resolve().parents[1]
N_PASSAGES = 48
CONFIG = dict(pooling="mean", normalize=True, passage_format="concat", query_max_length=64, passage_max_length=64)


def passages() -> list[dict]:
    rng = random.Random(0)
    return [{"id": f"p{i}", "title": rng.choice(WORDS), "text": " ".join(rng.choice(WORDS) for _ in range(12))}
            for i in range(N_PASSAGES)]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer) -> dict:
    """A saved tiny retriever, a JSONL corpus encoded in 2 float32 shards, and a flat index over them."""
    root = tmp_path_factory.mktemp("world")
    retriever = Retriever(tiny_bert(len(tiny_tokenizer), seed=0), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    retriever.save(root / "model")
    corpus_path = root / "corpus.jsonl"
    corpus_path.write_text("".join(json.dumps(p) + "\n" for p in passages()))
    for k in range(2):
        encode_corpus(retriever, corpus_path, root / "emb", shard_id=k, num_shards=2, dtype="float32",
                      cache_dir=root / "cache", model_name=str(root / "model"), show_progress=False)
    build_index(root / "emb", root / "idx", IndexParams("flat"))
    return {"root": root, "model": root / "model", "corpus": corpus_path, "emb": root / "emb", "idx": root / "idx",
            "cache": root / "cache"}


def cli(*argv: str) -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


def self_queries(tmp_path: Path, n: int = 10) -> tuple[Path, Path]:
    """BEIR queries whose text is passage i (title + text), and qrels pointing each to that passage."""
    ps = passages()[:n]
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": f"q{i}", "text": f"{p['title']} {p['text']}"}) + "\n"
                               for i, p in enumerate(ps)))
    qrels = tmp_path / "test.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{p['id']}\t1\n" for i, p in enumerate(ps)))
    return queries, qrels


def interrupt_after_five_records(monkeypatch) -> Any:
    """Make retrieval keep chunks of 4 questions and stop with Ctrl-C after the fifth record; returns the real
    ``iter_retrieve`` to put back."""
    from dpr_gc.retrieval import retrieve as retrieve_module

    real_iter_retrieve = retrieve_module.iter_retrieve

    def interrupted_after_five(*args, **kwargs):
        yield from itertools.islice(real_iter_retrieve(*args, **kwargs), 5)
        raise KeyboardInterrupt

    monkeypatch.setattr(retrieve_module, "QUERY_CHUNK", 4)
    monkeypatch.setattr(retrieve_module, "iter_retrieve", interrupted_after_five)
    return real_iter_retrieve


def test_end_to_end_encode_index_retrieve_evaluate(world, tmp_path, capsys):
    queries, qrels = self_queries(tmp_path)
    out, run = tmp_path / "results.json", tmp_path / "run.trec"
    cli("retrieve", "--index", world["idx"], "--queries", queries, "--top-k", 5, "--output", out, "--trec-run", run,
        "--qrels", qrels, "--evaluate", "--k", 1, 5, "--cache-dir", world["cache"], "--device", "cpu")
    printed = capsys.readouterr().out
    assert "| Recall | 1.0000 | 1.0000 |" in printed and "| queries | 10 |" in printed
    results = json.loads(out.read_text())
    assert [r["id"] for r in results] == [f"q{i}" for i in range(10)]
    assert all(r["ctxs"][0]["id"] == f"p{i}" for i, r in enumerate(results))
    metrics = qrels_metrics(read_run(run), read_qrels(qrels), [1, 5])
    assert metrics["Recall@1"] == 1.0 and metrics["MRR@10"] == 1.0


def test_results_equal_brute_force_over_the_shards(world):
    from dpr_gc.data.corpus import load_corpus

    retriever = Retriever.load(world["model"])
    index = DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    queries = [{"id": str(i), "question": q, "answers": []} for i, q in enumerate(["king of paris", "river water"])]
    results = retrieve(retriever, index, corpus, queries, top_k=7, batch_size=1, match=None, show_progress=False)
    shards = np.concatenate([np.load(m["embeddings"]) for m in read_manifests(world["emb"])])
    scores = retriever.embed("query", [q["question"] for q in queries]) @ shards.T
    by_id = {p["id"]: p for p in passages()}
    for record, row in zip(results, scores):
        want = np.argsort(-row, kind="stable")[:7]
        assert [c["id"] for c in record["ctxs"]] == [f"p{r}" for r in want]
        np.testing.assert_allclose([c["score"] for c in record["ctxs"]], row[want], rtol=1e-5, atol=1e-5)
        for ctx in record["ctxs"]:
            assert set(ctx) == {"id", "title", "text", "score"}
            assert (ctx["title"], ctx["text"]) == (by_id[ctx["id"]]["title"], by_id[ctx["id"]]["text"])
    # "none", the settings' word for no matching, is the same as None
    assert retrieve(retriever, index, corpus, queries, top_k=7, batch_size=1, match="none",
                    show_progress=False) == results


@pytest.mark.parametrize("fmt", ["dpr_tsv", "dpr_csv_literal", "nq_jsonl"])
def test_question_answer_formats(world, tmp_path, fmt):
    word = passages()[3]["text"].split()[0]
    if fmt == "dpr_tsv":
        path = tmp_path / "qa.tsv"
        path.write_text(f"who is {word}\t[\"{word}\", \"zzz\"]\nwhat city\t[\"qqq\"]\n")
    elif fmt == "dpr_csv_literal":
        path = tmp_path / "qa.csv"
        path.write_text(f"who is {word}\t['{word}']\nwhat city\t['qqq']\n")
    else:
        path = tmp_path / "nq.jsonl"
        path.write_text(json.dumps({"question": f"who is {word}", "answer": [word], "id": "a"}) + "\n"
                        + json.dumps({"question": "what city", "answer": ["qqq"], "id": "b"}) + "\n")
    out = tmp_path / "out.json"
    cli("retrieve", "--index", world["idx"], "--queries", path, "--top-k", N_PASSAGES, "--output", out,
        "--cache-dir", world["cache"], "--device", "cpu")
    results = json.loads(out.read_text())
    assert [r["question"] for r in results] == [f"who is {word}", "what city"]
    assert word in results[0]["answers"] and results[1]["answers"] == ["qqq"]
    first = results[0]["ctxs"]
    assert len(first) == N_PASSAGES
    assert [c["has_answer"] for c in first] == [word in c["text"].split() for c in first]
    assert any(c["has_answer"] for c in first) and not any(c["has_answer"] for c in results[1]["ctxs"])


def test_trec_run_and_results_json_are_written_atomically(tmp_path):
    results = [{"id": "q1", "question": "a?", "answers": [], "ctxs": [{"id": "d2", "score": 2.5},
                                                                        {"id": "d1", "score": 1.0}]},
               {"id": "q2", "question": "b?", "answers": [], "ctxs": [{"id": "d1", "score": 0.5}]}]
    run = write_trec_run(results, tmp_path / "run.trec", tag="mine")
    assert run.read_text().splitlines() == ["q1 Q0 d2 1 2.5 mine", "q1 Q0 d1 2 1.0 mine", "q2 Q0 d1 1 0.5 mine"]
    bad = results + [{"id": "q1", "ctxs": []}]
    with pytest.raises(DprGcError, match="'q1' appears twice"):
        write_trec_run(bad, run)
    with pytest.raises(DprGcError, match="contains whitespace"):
        write_trec_run([{"id": "q 3", "ctxs": []}], run)
    with pytest.raises(DprGcError, match="--run-tag"):
        write_trec_run(results, run, tag="two words")
    assert run.read_text().count("\n") == 3
    out = write_results_json(results, tmp_path / "r.json")
    assert json.loads(out.read_text()) == results
    with pytest.raises(TypeError):
        write_results_json([{"bad": {1, 2}}], out)
    assert json.loads(out.read_text()) == results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "run.trec"]


def test_wrong_model_or_corpus_is_refused(world, tiny_tokenizer, tmp_path):
    from dpr_gc.data.corpus import load_corpus

    index = DenseIndex.read(world["idx"])
    other = Retriever(tiny_bert(len(tiny_tokenizer), seed=5), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    with pytest.raises(DprGcError, match="weights differ"):
        check_compatible(other, index)
    check_compatible(other, index, check_fingerprint=False)
    projected = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer,
                          RetrieverConfig(**{**CONFIG, "projection_dim": 8}))
    with pytest.raises(DprGcError, match="8-dimensional vectors but the index built from model .* holds 32"):
        check_compatible(projected, index)
    cls_pooled = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer,
                           RetrieverConfig(**{**CONFIG, "pooling": "cls"}))
    with pytest.raises(DprGcError, match="pooling='cls'"):
        check_compatible(cls_pooled, index)
    unnormalized = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer,
                             RetrieverConfig(**{**CONFIG, "normalize": False}))
    with pytest.raises(DprGcError, match=r"normalize=False but the index built from model .* encoded with True; "
                                         "retrieve with the model that encoded the passages") as refused:
        check_compatible(unnormalized, index, check_fingerprint=False)
    assert "\n" not in str(refused.value)
    shorter = tmp_path / "short.jsonl"
    shorter.write_text("".join(json.dumps(p) + "\n" for p in passages()[:-1]))
    with pytest.raises(DprGcError, match="corpus of 48 passages .* has 47"):
        check_corpus(index, load_corpus(shorter, tmp_path / "cache"))
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({**p, "id": "x" + p["id"]}) + "\n" for p in passages()))
    with pytest.raises(DprGcError, match="corpus row 0 has id 'xp0' but the index expects 'p0'"):
        check_corpus(index, load_corpus(renamed, tmp_path / "cache"))
    queries, _ = self_queries(tmp_path)
    with pytest.raises(DprGcError, match="--ef-search does not apply"):
        cli("retrieve", "--index", world["idx"], "--queries", queries, "--output", tmp_path / "o.json",
            "--ef-search", 50, "--cache-dir", world["cache"])
    with pytest.raises(DprGcError, match="nothing to do"):
        cli("retrieve", "--index", world["idx"], "--queries", queries, "--cache-dir", world["cache"])


def test_a_model_differing_only_off_the_sampled_weights_is_refused(world, tiny_tokenizer):
    """The fingerprint reads every byte: a weight between the positions the legacy fingerprint sampled counts."""
    from dpr_gc.retrieval.fingerprint import legacy_weights_fingerprint

    index = DenseIndex.read(world["idx"])
    same = Retriever(tiny_bert(len(tiny_tokenizer), seed=0), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    check_compatible(same, index)
    sampled = legacy_weights_fingerprint(same.passage_encoder)
    edit_off_the_sample(same.passage_encoder)
    assert legacy_weights_fingerprint(same.passage_encoder) == sampled  # the legacy sample misses the edit
    with pytest.raises(DprGcError, match="weights differ"):
        check_compatible(same, index)


def test_an_index_recording_the_legacy_fingerprint_is_checked_by_it(world, tiny_tokenizer):
    """An index written before the full fingerprint (16 hex digits, no ``v2:``) accepts its model and refuses others."""
    from dpr_gc.retrieval.fingerprint import legacy_weights_fingerprint

    index = DenseIndex.read(world["idx"])
    assert index.meta["model_fingerprint"].startswith("v2:")
    same = Retriever(tiny_bert(len(tiny_tokenizer), seed=0), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    other = Retriever(tiny_bert(len(tiny_tokenizer), seed=5), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    index.meta["model_fingerprint"] = legacy_weights_fingerprint(same.passage_encoder)
    check_compatible(same, index)
    with pytest.raises(DprGcError, match="weights differ"):
        check_compatible(other, index)


def test_hnsw_index_retrieves_like_flat(world, tmp_path):
    build_index(world["emb"], tmp_path / "hnsw", IndexParams("hnsw", hnsw_m=8, ef_search=64))
    queries, qrels = self_queries(tmp_path)
    cli("retrieve", "--index", tmp_path / "hnsw", "--queries", queries, "--top-k", 3, "--trec-run",
        tmp_path / "run.trec", "--ef-search", 100, "--cache-dir", world["cache"], "--match", "none")
    assert qrels_metrics(read_run(tmp_path / "run.trec"), read_qrels(qrels), [1])["Recall@1"] == 1.0


def test_dense_retriever_script_with_dpr_flags(world, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("dense_retriever", ROOT / "scripts" / "dense_retriever.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main
    queries, qrels = self_queries(tmp_path)
    out = tmp_path / "dpr.json"
    code = main(["--model_file", str(world["model"]), "--qa_file", str(queries), "--ctx_file", str(world["corpus"]),
                 "--encoded_ctx_files", str(world["emb"] / "shard-*"), "--out_file", str(out), "--n_docs", "4",
                 "--index_path", str(tmp_path / "saved"), "--cache_dir", str(world["cache"]),
                 "--validation_workers", "16"])
    assert code == 0
    results = json.loads(out.read_text())
    assert len(results[0]["ctxs"]) == 4 and results[0]["ctxs"][0]["id"] == "p0"
    assert DenseIndex.read(tmp_path / "saved").ntotal == N_PASSAGES
    code = main([f"model_file={world['model']}", f"qa_dataset={queries}", f"index_path={tmp_path / 'saved'}",
                 f"out_file={tmp_path / 'again.json'}", "n_docs=4", f"cache_dir={world['cache']}"])
    assert code == 0 and json.loads((tmp_path / "again.json").read_text()) == results
    assert main(["--qa_file", str(queries), "--encoded_ctx_files", str(tmp_path / "none*"),
                 "--out_file", str(out)]) == 2
    assert "matches no files" in capsys.readouterr().err


def test_answers_are_matched_once_and_evaluate_reuses_the_flags(world, tmp_path, monkeypatch, capsys):
    """retrieve --evaluate tokenises each retrieved passage once (not once per question, nor again to evaluate),
    writes compact JSONL when asked, and evaluate's default reads those flags without matching."""
    from dpr_gc.evaluation import answers
    from dpr_gc.evaluation.evaluate import evaluate

    words = [p["text"].split()[0] for p in passages()[:3]]
    qa = tmp_path / "qa.tsv"
    qa.write_text("".join(f"who is {w}\t[\"{w}\"]\tq{i}\n" for i, w in enumerate(words)) + "what city\t[\"qqq\"]\tq9\n")
    calls: list[str] = []
    real = answers.prepare_passage
    monkeypatch.setattr(answers, "prepare_passage", lambda t, m: calls.append(t) or real(t, m))
    out = tmp_path / "res.jsonl"
    cli("retrieve", "--index", world["idx"], "--queries", qa, "--top-k", N_PASSAGES, "--output", out, "--compact",
        "--evaluate", "--k", 1, N_PASSAGES, "--workers", 1, "--cache-dir", world["cache"], "--device", "cpu")
    assert len(calls) == N_PASSAGES  # 4 questions x 48 passages, each passage tokenised once
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(c) == {"id", "score", "has_answer"} for r in records for c in r["ctxs"])
    by_id = {p["id"]: p["text"] for p in passages()}
    for r in records:
        assert [c["has_answer"] for c in r["ctxs"]] == [r["answers"][0] in by_id[c["id"]].split() for c in r["ctxs"]]
    first = [next((i for i, c in enumerate(r["ctxs"]) if c["has_answer"]), None) for r in records]
    printed = capsys.readouterr().out
    assert f"| Accuracy | {sum(f == 0 for f in first) / 4:.4f} | 0.7500 |" in printed
    assert "\nanswer accuracy (4 questions, match=string)\n" in printed, printed  # evaluate's heading
    calls.clear()
    report = evaluate([1, N_PASSAGES], out)
    assert not calls and report["answers"]["match"] == "stored"
    assert report["answers"]["metrics"][f"Accuracy@{N_PASSAGES}"] == 0.75
    with pytest.raises(DprGcError, match="compact results have none"):
        evaluate([1], out, mode="string")
    bare = tmp_path / "bare.jsonl"  # compact results of --match none: neither passage text nor answer flags
    bare.write_text("".join(json.dumps({**r, "ctxs": [{"id": c["id"], "score": c["score"]} for c in r["ctxs"]]})
                            + "\n" for r in records))
    for mode in ("string", None, "auto"):  # the advice never names a mode that fails the same way
        with pytest.raises(DprGcError, match="neither passage text nor has_answer flags") as refused:
            evaluate([1], bare, mode=mode)
        assert "--match stored" not in str(refused.value) and "give a match mode" not in str(refused.value)


def test_the_log_states_what_retrieve_took_without_being_told(world, tmp_path, caplog, capsys):
    """The model and corpus the index records, the device, the query encoder's precision, the search settings and
    FAISS's threads: one line at the start; the summary keeps the search settings."""
    from dpr_gc.retrieval.index import faiss_threads

    queries, _ = self_queries(tmp_path)
    with caplog.at_level("INFO", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", "--index", world["idx"], "--queries", queries, "--top-k", 3, "--output", tmp_path / "r.json",
            "--cache-dir", world["cache"], "--device", "cpu", "--batch-size", 5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("questions encoded by")]
    threads = torch.get_num_threads()
    assert lines == [f"questions encoded by {world['model']} (recorded in the index) on cpu in fp32, batch 5; "
                     f"{threads} CPU thread{'s' if threads != 1 else ''}; index Flat of {N_PASSAGES} vectors, search "
                     f"exact, FAISS threads {faiss_threads()}; passages from {world['corpus']} (recorded in the index)"]
    assert "| search | exact |" in capsys.readouterr().out


def test_threads_bound_the_question_encoder_and_the_log_says_so(world, tmp_path, caplog):
    """--threads also sets torch's CPU threads (one OpenMP runtime): its help says so, and the log line gives the
    question encoder's CPU threads beside FAISS's."""
    queries, _ = self_queries(tmp_path)
    before = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="dpr_gc.retrieval.retrieve"):
            cli("retrieve", "--index", world["idx"], "--queries", queries, "--top-k", 3, "--output",
                tmp_path / "r.json", "--cache-dir", world["cache"], "--device", "cpu", "--threads", 1)
    finally:
        torch.set_num_threads(before)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("questions encoded by"))
    assert "on cpu in fp32, batch 64; 1 CPU thread; index Flat" in line and "FAISS threads 1;" in line
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    helped = " ".join(parser._subparsers._group_actions[0].choices["retrieve"].format_help().split())
    assert "also bounds the question encoder's CPU threads" in helped


def test_the_log_and_summary_give_the_ef_search_the_search_ran_with(world, tmp_path, caplog, capsys):
    """An HNSW index whose efSearch (2) is below --top-k (5) is searched with efSearch 5: the log line and the
    summary table say so, not the index's 2 (docs/stages.md, retrieve)."""
    build_index(world["emb"], tmp_path / "hnsw", IndexParams("hnsw", hnsw_m=8, ef_search=2))
    queries, _ = self_queries(tmp_path)
    with caplog.at_level("INFO", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", "--index", tmp_path / "hnsw", "--queries", queries, "--top-k", 5, "--output",
            tmp_path / "r.json", "--cache-dir", world["cache"], "--device", "cpu")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("questions encoded by"))
    assert "search efSearch 5 (raised to --top-k 5), FAISS threads" in line
    assert "| search | efSearch 5 (raised to --top-k 5) |" in capsys.readouterr().out


def test_the_resume_key_changes_with_everything_the_records_depend_on(world, tmp_path):
    """stages.md: an interrupted retrieve continues only with the same questions, qrels, index build and search
    parameters, corpus, query encoder, --top-k and --match; each of them changes the key."""
    import dataclasses

    import torch

    from dpr_gc.data.corpus import load_corpus
    from dpr_gc.retrieval.retrieve import RetrieveJob, RetrieveSettings, retrieval_key

    queries, qrels = self_queries(tmp_path)
    (tmp_path / "other").mkdir()
    other_queries, other_qrels = self_queries(tmp_path / "other", n=5)
    retriever, index = Retriever.load(world["model"]), DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    job = RetrieveJob(queries=str(queries), qrels=str(qrels), settings=RetrieveSettings(top_k=5, match="string"))
    base = retrieval_key(retriever, index, corpus, job)
    assert retrieval_key(retriever, index, corpus, job) == base
    changed = {
        "queries": (retriever, index, corpus, dataclasses.replace(job, queries=str(other_queries))),
        "qrels": (retriever, index, corpus, dataclasses.replace(job, qrels=str(other_qrels))),
        "top_k": (retriever, index, corpus, dataclasses.replace(job, settings=RetrieveSettings(top_k=6,
                                                                                              match="string"))),
        "match": (retriever, index, corpus, dataclasses.replace(job, settings=RetrieveSettings(top_k=5,
                                                                                              match="regex"))),
    }
    index.meta = dict(index.meta, params={"nprobe": 99})
    changed["index"] = (retriever, index, corpus, job)
    index = DenseIndex.read(world["idx"])
    tuned = Retriever.load(world["model"])
    with torch.no_grad():
        next(tuned.parameters()).add_(1.0)
    changed["model"] = (tuned, index, corpus, job)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(p) + "\n" for p in passages()[:-1]))
    changed["corpus"] = (retriever, index, load_corpus(small, tmp_path / "cache"), job)
    for field, args in changed.items():
        assert retrieval_key(*args)[field] != base[field], field


def test_kept_records_of_an_interrupted_run_are_named_and_reported_by_later_runs(world, tmp_path, monkeypatch,
                                                                                caplog, capsys):
    """Ctrl-C names the hidden file of finished records and how to continue or delete it; a later run finishing
    into another output of the folder warns about it (it is as large as the results), deletes one that no run can
    continue, and leaves alone one whose output a running retrieval holds."""
    from dpr_gc.base.locks import output_lock
    from dpr_gc.cli import main
    from dpr_gc.retrieval import retrieve as retrieve_module
    from tests.helpers import call

    queries, _ = self_queries(tmp_path)
    real_iter_retrieve = interrupt_after_five_records(monkeypatch)

    def argv(out: Path) -> list:
        return ["retrieve", "--index", world["idx"], "--queries", queries, "--top-k", 3, "--output", out,
                "--cache-dir", world["cache"], "--device", "cpu", "--workers", 1]

    code, err = call(main, argv(tmp_path / "o.json"))
    kept, progress = tmp_path / ".o.json.retrieved.partial", tmp_path / ".o.json.retrieved.progress.json"
    assert code == 130 and kept.is_file() and not (tmp_path / "o.json").exists(), err
    assert (f"interrupted: 4 questions retrieved are kept in {kept}; run the same command again to continue after "
            f"them, or delete it and {progress.name} to give up") in err, err
    monkeypatch.setattr(retrieve_module, "iter_retrieve", real_iter_retrieve)
    abandoned = tmp_path / ".x.json.retrieved.partial"  # no progress record: nothing can continue it
    abandoned.write_text("{}\n")
    busy = tmp_path / ".y.json.retrieved.partial"  # the same, but a running retrieval holds y.json
    busy.write_text("{}\n")
    caplog.set_level("INFO")
    with output_lock(tmp_path / "y.json"):
        assert call(main, argv(tmp_path / "p.json"))[0] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{kept} (") and (
        f"keeps 4 questions an interrupted retrieval into {tmp_path / 'o.json'} finished; run that command again to "
        f"continue it, or delete it and {progress.name}") in warnings[0], warnings
    assert f"removed {abandoned}" in caplog.text and not abandoned.exists() and busy.exists() and kept.exists()
    caplog.clear()
    capsys.readouterr()
    assert call(main, argv(tmp_path / "o.json"))[0] == 0
    assert "resuming an interrupted run: 4 questions already retrieved" in caplog.text
    summary = capsys.readouterr().out  # the rate is over the 6 questions retrieved now, not all 10
    rows = summary_rows(summary)
    seconds, rate = float(rows["retrieval"].removesuffix(" s")), float(rows["queries/s"])
    assert (rows["queries"], rows["resumed (retrieved before)"], rows["output"]) == ("10", "4", str(tmp_path / "o.json"))
    assert abs(rate * seconds - 6) < abs(rate * seconds - 10), summary
    assert not kept.exists() and not progress.exists()
    assert [r["id"] for r in json.loads((tmp_path / "o.json").read_text())] == [f"q{i}" for i in range(10)]


def test_evaluation_cut_offs_stop_at_top_k(world, tmp_path, capsys, caplog):
    """retrieve --evaluate's default cut-offs are those below --top-k, and --top-k: an Accuracy@100 of 3 passages
    repeated Accuracy@3 under another name. A --k beyond --top-k is kept, with a warning saying what it counts;
    nDCG@10 and MRR@10, reported whatever the cut-offs, are named in that warning when --top-k is below 10."""
    queries, qrels = self_queries(tmp_path)
    common = ("--index", world["idx"], "--queries", queries, "--qrels", qrels, "--top-k", 3, "--cache-dir",
              world["cache"], "--device", "cpu", "--evaluate")
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", *common)
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| metric"))
    assert header == "| metric | @1 | @3 | @10 |", header  # @10: nDCG@10 and MRR@10 are always reported
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["nDCG@10 and MRR@10 beyond --top-k 3: those figures count only the 3 passages retrieved per "
                        "question"], warnings
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", *common, "--k", 1, 3, 20)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["--k 20, nDCG@10 and MRR@10 beyond --top-k 3: those figures count only the 3 passages "
                        "retrieved per question"], warnings
    assert "| metric | @1 | @3 | @10 | @20 |" in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):  # a --k of 10 names @10 itself
        cli("retrieve", *common, "--k", 1, 10)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["--k 10 beyond --top-k 3: those figures count only the 3 passages retrieved per question"]


def test_a_top_k_beyond_the_index_is_named_and_the_summary_gives_the_depth_retrieved(world, tmp_path, capsys, caplog):
    """Every question gets the whole index: the summary and the cut-offs said the depth asked for. Without --k one
    warning says so (a second once named a "--k 500" never given, the default cut-off at --top-k), and the default
    cut-offs stop at the depth retrieved (columns beyond it repeated its figures)."""
    queries, qrels = self_queries(tmp_path)
    vectors = len(passages())
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", "--index", world["idx"], "--queries", queries, "--qrels", qrels, "--top-k", 500, "--cache-dir",
            world["cache"], "--device", "cpu", "--evaluate", "--k", 1, 500, "--output", tmp_path / "top.json")
    assert f"--top-k 500 beyond the index's {vectors} vectors: each question gets those {vectors} passages" \
        in caplog.text
    assert f"--k 500 beyond the index's {vectors} vectors: those figures count only the {vectors} passages" \
        in caplog.text
    assert f"| top-k | {vectors} (--top-k 500) |" in capsys.readouterr().out
    assert {len(r["ctxs"]) for r in json.loads((tmp_path / "top.json").read_text())} == {vectors}
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):  # the default cut-offs: no --k to name
        cli("retrieve", "--index", world["idx"], "--queries", queries, "--qrels", qrels, "--top-k", 500, "--cache-dir",
            world["cache"], "--device", "cpu", "--evaluate")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"--top-k 500 beyond the index's {vectors} vectors: each question gets those {vectors} "
                        "passages"], warnings
    columns = [f"@{k}" for k in (1, 5, 10, 20, 100) if k < vectors] + [f"@{vectors}"]  # none repeats @{vectors}
    assert f"| metric | {' | '.join(columns)} |" in capsys.readouterr().out


@pytest.mark.parametrize("ids, judged, message", [
    (["q0", "q 1"], False, "{queries}:2: query id 'q 1' is empty or contains whitespace; a TREC run (--trec-run) "
                           "needs one-word query ids; rename it"),
    (["x0", "x1"], True, "no query id in {queries} (the first: 'x0') appears in {qrels} (the first judged: 'q0'); "
                       "check that the two files use the same ids")],
    ids=["spaced-id", "none-judged"])
def test_unusable_query_ids_and_unjudged_questions_are_refused_before_retrieval(world, tmp_path, monkeypatch, capsys,
                                                                                 ids, judged, message):
    """With --trec-run a spaced query id (an empty one is absent, the line number standing for it), and with --qrels
    a questions file none of whose ids is judged, are refused in one error line naming the file (and line) and the
    id or what to check: nothing embedded, nothing written."""
    from dpr_gc.cli import main

    asked: list[str] = []
    monkeypatch.setattr(Retriever, "embed", lambda self, kind, *a, **k: asked.append(kind))
    monkeypatch.setattr(DenseIndex, "search", lambda self, *a, **k: asked.append("search"))
    _, qrels = self_queries(tmp_path, n=3)  # judges q0, q1, q2
    queries = tmp_path / "asked.jsonl"
    queries.write_text("".join(json.dumps({"_id": qid, "text": "city river"}) + "\n" for qid in ids))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["retrieve", "--index", str(world["idx"]), "--queries", str(queries), "--cache-dir",
                 str(world["cache"]), "--device", "cpu", "--output", str(tmp_path / "r.json"), "--trec-run",
                 str(tmp_path / "run.trec"), *(["--qrels", str(qrels)] if judged else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + message.format(queries=queries, qrels=qrels)), err
    assert asked == [] and sorted(p.name for p in tmp_path.iterdir()) == before


def test_answer_patterns_that_do_not_compile_are_named_before_the_model_loads_and_never_match(world, tmp_path, caplog):
    """stages.md: retrieve --match regex warns once, while checking the questions (before the model loads), naming
    the file, the count and the first lines with the regex error; such a pattern never matches, as in DPR (the run
    failed after the model loaded and a chunk was retrieved, naming no file or line)."""
    qa = tmp_path / "q.tsv"
    qa.write_text('who is it\t["(unclosed"]\tq1\nwhat city\t["[x", "city"]\tq2\nwhere\t["."]\tq3\n')
    out = tmp_path / "r.json"
    with caplog.at_level("INFO", logger="dpr_gc"):
        cli("retrieve", "--index", world["idx"], "--queries", qa, "--top-k", 3, "--match", "regex", "--output", out,
            "--cache-dir", world["cache"], "--device", "cpu")
    messages = [r.getMessage() for r in caplog.records]
    warning = (f"{qa}: 2 answer patterns do not compile (line 1: '(unclosed': missing ) at position 9; line 2: '[x': "
               "unterminated character set at position 2); they never match, as in DPR")
    assert messages.count(warning) == 1, messages
    loaded = next(i for i, m in enumerate(messages) if m.startswith("questions encoded by"))
    assert messages.index(warning) < loaded
    flags = {r["id"]: [c["has_answer"] for c in r["ctxs"]] for r in json.loads(out.read_text())}
    assert flags["q1"] == [False] * 3 and flags["q3"] == [True] * 3


def test_evaluate_with_neither_answers_nor_qrels_is_refused_before_the_model_loads(world, tmp_path, monkeypatch,
                                                                                    capsys):
    """retrieve --evaluate over questions without answers (BEIR queries) and without --qrels is refused in one error
    line saying what to add or drop, as evaluate refuses the same (it printed no metrics and exited 0)."""
    from dpr_gc.cli import main

    loaded: list[str] = []
    monkeypatch.setattr(Retriever, "load", lambda *a, **k: loaded.append("model") or pytest.fail("model loaded"))
    queries, _ = self_queries(tmp_path, n=3)
    assert main(["retrieve", "--index", str(world["idx"]), "--queries", str(queries), "--evaluate", "--cache-dir",
                 str(world["cache"]), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {queries}: none of its 3 questions has answers, so --evaluate has nothing to evaluate "
                   "(no answer accuracy, no qrels): give --qrels FILE, or drop --evaluate"], err
    assert loaded == []


def test_the_qrels_heading_counts_the_judged_queries_the_metrics_average_over(world, tmp_path, capsys):
    """Qrels metrics are averaged over every judged query (one missing from the questions counts 0): the heading
    gives that count, as evaluate's does (it gave the 4 questions retrieved while averaging over 5)."""
    _, qrels = self_queries(tmp_path, n=5)
    (tmp_path / "four").mkdir()
    queries, _ = self_queries(tmp_path / "four", n=4)
    cli("retrieve", "--index", world["idx"], "--queries", queries, "--qrels", qrels, "--top-k", 3, "--evaluate",
        "--k", 1, "--cache-dir", world["cache"], "--device", "cpu")
    printed = capsys.readouterr().out
    assert "qrels metrics (5 judged queries)" in printed and "| Recall | 0.8000 |" in printed, printed
    assert "| queries | 4 |" in printed


def test_match_none_stores_no_flags_and_its_evaluation_says_it_matched_by_string(world, tmp_path, capsys, caplog):
    """--match none stores no has_answer flags; --evaluate then matches the answers by string: the heading said
    match=none over figures string matching gave. It and a log line name the matching used, and the figures are
    --match string's."""
    word = passages()[3]["text"].split()[0]
    qa = tmp_path / "qa.tsv"
    qa.write_text(f'who is {word}\t["{word}"]\tq1\nwhat city\t["qqq"]\tq2\n')
    tables = {}
    for match in ("none", "string"):
        with caplog.at_level("INFO", logger="dpr_gc"):
            cli("retrieve", "--index", world["idx"], "--queries", qa, "--top-k", 3, "--match", match, "--evaluate",
                "--output", tmp_path / f"{match}.json", "--cache-dir", world["cache"], "--device", "cpu")
        tables[match] = capsys.readouterr().out.split("| item |")[0]
    assert tables["none"] == tables["string"], tables
    assert "answer accuracy (2 questions, match=string)" in tables["none"], tables["none"]
    assert caplog.text.count("--match none stores no has_answer flags: --evaluate matches the answers of 2 questions "
                             "with string matching") == 1, caplog.text
    assert not any("has_answer" in c for r in json.loads((tmp_path / "none.json").read_text()) for c in r["ctxs"])


def qrels_section(printed: str) -> str:
    """The qrels heading and metric table a command printed (up to the blank line after it)."""
    start = printed.index("qrels metrics (")
    return printed[start:printed.index("\n\n", start)]


def answers_section(printed: str) -> str:
    """The answer accuracy heading (its question count and match mode) and table a command printed."""
    start = printed.index("answer accuracy (")
    return printed[start:printed.index("\n\n", start)]


def test_retrieve_evaluate_gives_the_qrels_metrics_evaluate_gives_for_what_it_wrote(world, tmp_path, capsys):
    """The qrels metrics retrieve --evaluate prints are those evaluate prints for the results file and the TREC run
    it wrote, figure for figure: graded judgments, a judged query never asked (0 in both) and imperfect rankings."""
    from dpr_gc.cli import main
    from dpr_gc.evaluation.evaluate import evaluate

    rng, ps = random.Random(1), passages()
    queries, qrels = tmp_path / "queries.jsonl", tmp_path / "qrels.tsv"
    queries.write_text("".join(json.dumps({"_id": f"q{i}", "text": " ".join(rng.sample(ps[i]["text"].split(), 3))})
                               + "\n" for i in range(8)))
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{ps[i]['id']}\t2\nq{i}\t{ps[i + 8]['id']}\t1\n"
                                                           for i in range(8)) + "q9\tp0\t1\n")
    out, run, ks = tmp_path / "r.json", tmp_path / "r.trec", ["1", "5", "10", "20"]
    assert main(["retrieve", "--index", str(world["idx"]), "--queries", str(queries), "--qrels", str(qrels), "--top-k",
                 "20", "--evaluate", "--k", *ks, "--output", str(out), "--trec-run", str(run), "--cache-dir",
                 str(world["cache"]), "--device", "cpu"]) == 0
    retrieved = qrels_section(capsys.readouterr().out)
    assert "qrels metrics (9 judged queries)" in retrieved and "| 1.0000 |" not in retrieved, retrieved
    for given in (["--results", str(out)], ["--run", str(run)]):
        assert main(["evaluate", *given, "--qrels", str(qrels), "--k", *ks]) == 0
        assert qrels_section(capsys.readouterr().out) == retrieved, given
    by_results = evaluate([1, 5, 10, 20], results_path=out, qrels_path=qrels)["qrels"]["metrics"]
    assert by_results == evaluate([1, 5, 10, 20], run_path=run, qrels_path=qrels)["qrels"]["metrics"]


def test_retrieve_evaluate_counts_questions_without_answers_as_misses_as_evaluate_does(world, tmp_path, capsys):
    """retrieve --evaluate on questions of which some have no answers prints the answer accuracy evaluate --results
    prints for the file it wrote: the questions without answers count as misses, in the denominator of both."""
    from dpr_gc.cli import main

    words = [p["text"].split()[0] for p in passages()[:2]]
    qa = tmp_path / "qa.tsv"
    qa.write_text("".join(f"who is {w}\t[\"{w}\"]\tq{i}\n" for i, w in enumerate(words))
                  + "".join(f"{w} city\t[]\tn{i}\n" for i, w in enumerate(words)))
    out, ks = tmp_path / "r.json", ["1", str(N_PASSAGES)]
    assert main(["retrieve", "--index", str(world["idx"]), "--queries", str(qa), "--top-k", str(N_PASSAGES),
                 "--evaluate", "--k", *ks, "--output", str(out), "--cache-dir", str(world["cache"]),
                 "--device", "cpu"]) == 0
    retrieved = answers_section(capsys.readouterr().out)
    assert [r["answers"] for r in json.loads(out.read_text())][2:] == [[], []]
    assert "(4 questions," in retrieved and retrieved.endswith("| 0.5000 |"), retrieved  # @48: 2 found of 4, not of 2
    for match in ("auto", "string"):  # the flags retrieve stored, and matched again
        assert main(["evaluate", "--results", str(out), "--k", *ks, "--match", match]) == 0
        printed = answers_section(capsys.readouterr().out)
        assert printed.split("\n", 1)[1] == retrieved.split("\n", 1)[1], (match, printed, retrieved)


def test_library_retrieve_names_answer_patterns_that_do_not_compile(world, caplog):
    """retrieve(match="regex") names the patterns that do not compile in one warning before retrieving, as the
    command does (the library call skipped them silently); they never match."""
    from dpr_gc.data.corpus import load_corpus

    retriever, index = Retriever.load(world["model"]), DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    queries = [{"id": "a", "question": "king of paris", "answers": ["(unclosed", "."]},
               {"id": "b", "question": "river water", "answers": ["."]}]
    with caplog.at_level("WARNING", logger="dpr_gc"):
        results = retrieve(retriever, index, corpus, iter(queries), top_k=3, match="regex", show_progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["queries: 1 answer pattern does not compile (question 0: '(unclosed': missing ) at "
                        "position 9); they never match, as in DPR"], warnings
    assert [r["id"] for r in results] == ["a", "b"] and all(c["has_answer"] for r in results for c in r["ctxs"])


def test_an_ivf_search_that_reaches_fewer_passages_says_how_many_and_what_to_raise(world, tmp_path, capsys, caplog):
    """FAISS marks the hits an IVF search probing too few lists did not reach with row -1: they are left out, and a
    warning at the end, the summary and the evaluation's note give the passages the questions got (the summary said
    --top-k and nothing warned), naming --nprobe to raise."""
    from dpr_gc.data.corpus import load_corpus

    build_index(world["emb"], tmp_path / "ivf", IndexParams("ivf-flat", nlist=8, nprobe=1))
    index = DenseIndex.read(tmp_path / "ivf")
    queries, qrels = self_queries(tmp_path)
    retriever = Retriever.load(world["model"])
    texts = [json.loads(line)["text"] for line in queries.read_text().splitlines()]
    got = (index.search(retriever.embed("query", texts), 40)[1] >= 0).sum(axis=1)
    assert got.max() < 40, got
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):
        cli("retrieve", "--index", tmp_path / "ivf", "--queries", queries, "--qrels", qrels, "--top-k", 40,
            "--cache-dir", world["cache"], "--device", "cpu", "--evaluate", "--output", tmp_path / "r.json")
    assert [len(r["ctxs"]) for r in json.loads((tmp_path / "r.json").read_text())] == got.tolist()
    mean = f"{got.mean():.1f}"
    assert (f"10 questions of 10 got fewer than the 40 passages asked for (fewest {got.min()}, mean {mean} per "
            "question): the IVF8,Flat search (nprobe 1 of 8 lists) reached no more; raise --nprobe to retrieve them "
            "all; the evaluation's figures count only the passages retrieved") in caplog.messages, caplog.messages
    # the most any question got, then what was asked (it read 'fewest..40' though none got 40)
    assert f"| top-k | {got.min()}..{got.max()}, mean {mean} of 40 asked (--top-k 40) |" in capsys.readouterr().out
    caplog.clear()
    corpus = load_corpus(world["corpus"], world["cache"])
    with caplog.at_level("WARNING", logger="dpr_gc.retrieval.retrieve"):
        records = retrieve(retriever, index, corpus, [{"id": "a", "question": texts[0]}], top_k=40, match=None,
                           show_progress=False)
    assert len(records[0]["ctxs"]) == got[0]


def test_a_search_flag_the_index_has_no_use_for_names_the_index(world, tmp_path):
    """--ef-search on an IVF index was refused as not applying "to a IVF8,Flat index"; the line names the index."""
    build_index(world["emb"], tmp_path / "ivf", IndexParams("ivf-flat", nlist=8))
    queries, _ = self_queries(tmp_path)
    with pytest.raises(DprGcError) as e:
        cli("retrieve", "--index", tmp_path / "ivf", "--queries", queries, "--output", tmp_path / "o.json",
            "--ef-search", 4, "--cache-dir", world["cache"], "--device", "cpu")
    assert str(e.value) == "--ef-search does not apply to the IVF8,Flat index; drop the flag"


def test_the_librarys_short_search_warnings_name_no_command_flags(world, tmp_path, caplog):
    """retrieve and retrieve_to_files (the demo's retrieval) over an IVF or HNSW index reaching fewer passages than
    asked advised raising --nprobe or --ef-search, flags of dpr-gc retrieve a library caller does not have: they
    name the index's parameter and DenseIndex.set_search_params (the command's, in
    test_an_ivf_search_that_reaches_fewer..., keep naming its flags)."""
    from dpr_gc.data.corpus import load_corpus

    build_index(world["emb"], tmp_path / "ivf", IndexParams("ivf-flat", nlist=8, nprobe=1))
    retriever, index = Retriever.load(world["model"]), DenseIndex.read(tmp_path / "ivf")
    corpus = load_corpus(world["corpus"], world["cache"])
    queries = [{"id": "a", "question": f"{p['title']} {p['text']}", "answers": ["x"]} for p in passages()[:2]]
    for search in (lambda: retrieve(retriever, index, corpus, queries, top_k=40, match=None, show_progress=False),
                   lambda: retrieve_to_files(retriever, index, corpus, queries, top_k=40, ks=[1],
                                             output=tmp_path / "r.json", show_progress=False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dpr_gc"):
            search()
        short = [m for m in caplog.messages if "got fewer than the 40 passages" in m]
        assert len(short) == 1 and "--" not in short[0], caplog.messages
        assert "(nprobe 1 of 8 lists) reached no more; raise the index's nprobe (DenseIndex.set_search_params) " \
               "to retrieve them all" in short[0], short
    build_index(world["emb"], tmp_path / "hnsw", IndexParams("hnsw", ef_search=4))
    hnsw = DenseIndex.read(tmp_path / "hnsw")
    assert hnsw.search_flags(flags=False) == ["efSearch"] and hnsw.search_flags() == ["--ef-search"]
    assert hnsw.search_settings(40, flags=False).startswith("efSearch 40 (raised to the top-k 40)")


def test_the_library_refuses_a_model_or_corpus_the_index_was_not_built_from(world, tiny_tokenizer, tmp_path):
    """retrieve() and retrieve_to_files() check the model and corpus as the command does (they returned results);
    check_model=False is --skip-model-check."""
    from dpr_gc.data.corpus import load_corpus
    from dpr_gc.retrieval.retrieve import retrieve_to_files

    index = DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    other = Retriever(tiny_bert(len(tiny_tokenizer), seed=5), None, tiny_tokenizer, RetrieverConfig(**CONFIG))
    queries = [{"id": "a", "question": "king of paris", "answers": []}]
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(json.dumps(p) + "\n" for p in passages()[::-1]))
    shuffled = load_corpus(reordered, tmp_path / "cache")
    out = tmp_path / "r.json"
    for call in (lambda r, c, **kw: retrieve(r, index, c, queries, top_k=3, match=None, show_progress=False, **kw),
                 lambda r, c, **kw: retrieve_to_files(r, index, c, queries, output=out, show_progress=False, **kw)):
        with pytest.raises(DprGcError, match="the model's weights differ from those that encoded the passages"):
            call(other, corpus)
        with pytest.raises(DprGcError, match=f"corpus row 0 has id 'p{N_PASSAGES - 1}' but the index expects 'p0'"):
            call(Retriever.load(world["model"]), shuffled)
        call(other, corpus, check_model=False)
    assert [r["id"] for r in json.loads(out.read_text())] == ["a"]


def test_library_retrieve_to_files_names_answer_patterns_that_do_not_compile_once(world, tmp_path, caplog):
    """retrieve_to_files(match="regex") over a stream names the patterns that do not compile in one warning once it
    has retrieved (it skipped them silently); retrieve_file, which checks its file first, names them once too."""
    from dpr_gc.data.corpus import load_corpus

    retriever, index = Retriever.load(world["model"]), DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    queries = [{"id": "a", "question": "king of paris", "answers": ["(unclosed", "."]},
               {"id": "b", "question": "river water", "answers": ["."]}]
    want = "1 answer pattern does not compile (question 0: '(unclosed': missing ) at position 9)"
    with caplog.at_level("WARNING", logger="dpr_gc"):
        retrieve_to_files(retriever, index, corpus, iter(queries), top_k=3, match="regex", output=tmp_path / "r.json",
                          show_progress=False)
    assert [r.getMessage() for r in caplog.records if want in r.getMessage()] == [
        f"queries: {want}; they never match, as in DPR"]
    caplog.clear()
    qa = tmp_path / "q.tsv"
    qa.write_text('king of paris\t["(unclosed", "."]\ta\n')
    with caplog.at_level("WARNING", logger="dpr_gc"):
        retrieve_file(retriever, index, corpus, qa, top_k=3, match="regex", output=tmp_path / "f.json",
                      show_progress=False)
    assert len([r for r in caplog.records if "does not compile" in r.getMessage()]) == 1


@pytest.mark.parametrize("where", ["search", "evaluation"])
def test_an_interrupt_while_retrieving_ends_stderr_with_the_interrupted_line(world, tmp_path, monkeypatch, where):
    """Ctrl-C inside the 'retrieving' bar, while FAISS searches (inside the generator that owns the bar) or while a
    retrieved question is evaluated (outside it): the bar is closed as the interrupt leaves, so the ``interrupted:``
    line is the last one on stderr; a stale bar came after it once the interrupt was collected."""
    import contextlib
    import gc
    import io

    from dpr_gc.cli import main
    from dpr_gc.evaluation.evaluate import RunEvaluation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    queries, qrels = self_queries(tmp_path)
    monkeypatch.setattr(*((DenseIndex, "search") if where == "search" else (RunEvaluation, "write")), interrupted)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(a) for a in ("retrieve", "--index", world["idx"], "--queries", queries, "--qrels", qrels,
                                      "--evaluate", "--top-k", 3, "--cache-dir", world["cache"], "--device", "cpu",
                                      "--workers", 1)])
        gc.collect()  # whatever the interrupt left open is closed now, into the same stderr
    lines = [line for line in err.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert code == 130 and "retrieving" in err.getvalue(), err.getvalue()
    assert lines[-1].startswith("interrupted: "), lines[-3:]
    assert "\ninterrupted: " in err.getvalue(), err.getvalue()  # on a line of its own, not after the bar's text


def test_the_librarys_depth_warnings_name_no_command_flags(world, tmp_path, caplog):
    """retrieve_to_files (the demo's retrieval: top_k=100 and its own cut-offs) warned of "--top-k 100" and
    "--k 20 100", flags of dpr-gc retrieve that the demo and a library caller do not have: its warnings say top-k
    and cut-offs in words (the command's, in test_a_top_k_beyond_the_index_is_named..., keep naming its flags)."""
    from dpr_gc.data.corpus import load_corpus

    retriever, index = Retriever.load(world["model"]), DenseIndex.read(world["idx"])
    corpus = load_corpus(world["corpus"], world["cache"])
    queries = [{"id": "a", "question": "king of paris", "answers": ["paris"]}]
    for top_k, ks, want in (
            (100, [1, 20, 100], [f"a top-k of 100 is beyond the index's {N_PASSAGES} vectors: each question gets "
                                 f"those {N_PASSAGES} passages",
                                 f"cut-off 100 beyond the index's {N_PASSAGES} vectors: those figures count only the "
                                 f"{N_PASSAGES} passages retrieved per question"]),
            (3, [1, 20], ["cut-off 20 beyond the top-k of 3: those figures count only the 3 passages retrieved per "
                          "question"])):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dpr_gc"):
            retrieve_to_files(retriever, index, corpus, queries, top_k=top_k, ks=ks, output=tmp_path / "r.json",
                              show_progress=False)
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == want


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_an_index_that_is_a_file_is_refused_as_the_command_line_is_read(tmp_path, monkeypatch, capsys, where):
    """retrieve --index FILE said "FILE: Not a directory; check the path and free space" once the questions were
    read: refused while the command line is parsed, naming --index, as mine's --index is."""
    from dpr_gc.cli import main

    monkeypatch.setattr(Retriever, "load", lambda *a, **k: pytest.fail("model loaded"))
    file = tmp_path / "qa.csv"
    file.write_text('who?\t["me"]\n')
    index = file if where == "file" else file / "idx"
    assert main(["retrieve", "--index", str(index), "--queries", str(file), "--output", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: dpr-gc retrieve: argument --index: path {index}: {file} is a file, not a folder; give "
                   "a folder (see dpr-gc retrieve --help)"], err
    assert not (tmp_path / "o.json").exists()


def test_with_qrels_only_the_judged_questions_are_retrieved(world, tmp_path, capsys):
    """``--qrels`` (``--help``: "only judged queries are retrieved"): a question the qrels do not judge is left out of
    the results, the TREC run and the summary's count."""
    queries, qrels = self_queries(tmp_path, 4)
    lines = qrels.read_text().splitlines()
    qrels.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # q0 is not judged
    out, run = tmp_path / "r.json", tmp_path / "run.trec"
    cli("retrieve", "--index", world["idx"], "--queries", queries, "--qrels", qrels, "--top-k", 3, "--output", out,
        "--trec-run", run, "--cache-dir", world["cache"], "--device", "cpu")
    assert [r["id"] for r in json.loads(out.read_text())] == ["q1", "q2", "q3"]
    assert {line.split()[0] for line in run.read_text().splitlines()} == {"q1", "q2", "q3"}
    assert summary_rows(capsys.readouterr().out)["queries"].startswith("3")


def test_a_rerun_with_other_settings_says_it_drops_what_the_interrupted_run_kept(world, tmp_path, monkeypatch,
                                                                                  caplog):
    """A re-run with another --top-k cannot continue the interrupted run's kept questions: it starts over (as it
    did) and now says so, naming the setting that changed (it dropped them without a word)."""
    from dpr_gc.cli import main
    from dpr_gc.retrieval import retrieve as retrieve_module
    from tests.helpers import call

    queries, _ = self_queries(tmp_path)
    real_iter_retrieve = interrupt_after_five_records(monkeypatch)
    argv = ["retrieve", "--index", world["idx"], "--queries", queries, "--output", tmp_path / "o.json",
            "--cache-dir", world["cache"], "--device", "cpu", "--workers", 1, "--top-k"]
    assert call(main, argv + [3])[0] == 130
    monkeypatch.setattr(retrieve_module, "iter_retrieve", real_iter_retrieve)
    caplog.set_level("INFO")
    assert call(main, argv + [2])[0] == 0
    kept = tmp_path / ".o.json.retrieved.partial"
    assert (f"starting over: the 4 questions an interrupted run kept in {kept} were retrieved with other settings "
            "(--top-k 3 -> 2)") in caplog.messages, caplog.messages
    assert "resuming an interrupted run" not in caplog.text
    assert all(len(r["ctxs"]) == 2 for r in json.loads((tmp_path / "o.json").read_text()))


def test_a_stored_length_beyond_the_positions_is_said_only_where_it_is_used(world, tmp_path, caplog):
    """A model storing passage_max_length 256 (128 positions) said at load that passages are cut at 128, also under
    encode --max-length 32 and in retrieve, which encodes no passage; the line comes where the stored length is the
    one texts are cut to: encode without --max-length."""
    import shutil

    from dpr_gc.cli import main
    from tests.helpers import call

    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    config = json.loads((model / "retriever_config.json").read_text())
    (model / "retriever_config.json").write_text(json.dumps({**config, "passage_max_length": 256}))
    said = "its passage_max_length 256 exceeds the model's limit of 128 positions; passages are cut at 128 tokens"
    encode = ["encode", "--model", model, "--corpus", world["corpus"], "--cache-dir", world["cache"], "--device", "cpu"]
    runs = {"encode --max-length 32": [*encode, "--output", tmp_path / "e32", "--max-length", 32],
            "retrieve": ["retrieve", "--index", world["idx"], "--model", model, "--queries", self_queries(tmp_path)[0],
                         "--output", tmp_path / "o.json", "--cache-dir", world["cache"], "--device", "cpu",
                         "--skip-model-check"],
            "encode": [*encode, "--output", tmp_path / "e"]}
    caplog.set_level("INFO", logger="dpr_gc")
    for run, argv in runs.items():
        caplog.clear()
        code, err = call(main, argv)
        assert code == 0, (run, err)
        assert caplog.text.count(said) == (run == "encode"), (run, caplog.text)
    assert json.loads((tmp_path / "e" / "shard-00000-of-00001.json").read_text())["max_length"] == 128


def test_retrieve_finds_the_model_moved_together_with_the_index(world, tmp_path, monkeypatch, caplog):
    """docs/stages.md: the index records the model and the corpus also relative to the index folder, so retrieve
    --index DIR finds them from any directory, and after the three are moved together (the old folder renamed away,
    paths given relative to where encode and index ran); the corpus was found by its absolute path only."""
    import shutil

    from dpr_gc.cli import main
    from tests.helpers import call

    before, after, elsewhere = tmp_path / "before", tmp_path / "after", tmp_path / "elsewhere"
    shutil.copytree(world["model"], before / "model")
    shutil.copy(world["corpus"], before / "corpus.jsonl")
    elsewhere.mkdir()
    monkeypatch.chdir(before)
    assert call(main, ["encode", "--model", "model", "--corpus", "corpus.jsonl", "--output", "emb", "--cache-dir",
                       world["cache"], "--device", "cpu"])[0] == 0
    assert call(main, ["index", "--embeddings", "emb", "--output", "idx"])[0] == 0
    before.rename(after)
    monkeypatch.chdir(elsewhere)
    queries, _ = self_queries(elsewhere)
    caplog.set_level("INFO", logger="dpr_gc")
    code, err = call(main, ["retrieve", "--index", after / "idx", "--queries", queries, "--top-k", 3, "--output",
                            "o.json", "--cache-dir", world["cache"], "--device", "cpu"])
    assert code == 0, err
    assert f"questions encoded by {after / 'idx' / '..' / 'model'} (recorded in the index)" in caplog.text
    assert str(after / "idx" / ".." / "corpus.jsonl") in caplog.text
    results = json.loads((elsewhere / "o.json").read_text())
    assert [r["ctxs"][0]["id"] for r in results] == [f"p{i}" for i in range(10)]


def test_retrieve_settings_in_code_meet_the_command_lines_rules():
    """docs/library.md: a setting that would not apply is refused in code as on the command line (a run tag without a
    TREC run, compact results without a results file); cut-offs alone turn evaluation on in code."""
    from dpr_gc.retrieval.retrieve import RetrieveSettings

    with pytest.raises(DprGcError) as refused:
        RetrieveSettings(run_tag="mine")
    assert str(refused.value) == ("--run-tag does not apply without --trec-run (it tags the run file's lines); add "
                                  "--trec-run FILE, or drop the flag")
    with pytest.raises(DprGcError, match=r"^--compact does not apply without --output"):
        RetrieveSettings(compact=True)
    assert RetrieveSettings(ks=[1, 5]).cutoffs() == [1, 5]
    assert RetrieveSettings(compact=True, output="o.json", trec_run="r.trec", run_tag="t").run_tag == "t"


def test_the_librarys_retrieve_bar_knows_its_total(world, tmp_path, monkeypatch):
    """The library's ``retrieve`` drew "retrieving: 10 q [..., q/s]", a bar with no total or ETA, where the command's
    shows 0/10; it counts to the number of questions given (an iterator of them too)."""
    import dpr_gc.retrieval.retrieve as retrieve_module
    from dpr_gc.data.corpus import load_corpus, read_queries

    bars: list = []

    class Bar:
        def __init__(self, total=None, **kw):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(retrieve_module, "tqdm", Bar)
    queries, _ = self_queries(tmp_path)
    results = retrieve_module.retrieve(Retriever.load(world["model"]), DenseIndex.read(world["idx"]),
                                       load_corpus(world["corpus"], cache_dir=world["cache"]),
                                       iter(read_queries(queries)), top_k=3, match=None)
    (bar,) = bars
    assert len(results) == bar.total == bar.n == 10
