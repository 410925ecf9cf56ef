"""Questions and results stream in and out: peak memory of retrieve (reading the questions file, writing +
evaluating) and evaluate does not grow with the number of questions (generated 2k vs 10k question runs, measured
with tracemalloc; 2k questions fill more than one chunk of QUERY_CHUNK, where the peak levels off); a bad question
line fails before any retrieval; the compact form round-trips."""

from __future__ import annotations

import json
import random
import tracemalloc
from typing import Callable

import numpy as np
import pytest

from dpr_gc.evaluation.evaluate import evaluate
from dpr_gc.evaluation.results import iter_results
from dpr_gc.base.errors import DprGcError
from dpr_gc.retrieval.retrieve import retrieve_file, retrieve_to_files

WORDS = "paris london river king music film science protein cell gene water book war city".split()
POOL = 300


def pool_passages() -> list[dict]:
    rng = random.Random(0)
    return [{"id": f"p{i}", "title": rng.choice(WORDS), "text": " ".join(rng.choices(WORDS, k=12))}
            for i in range(POOL)]


class StubCorpus:
    """Rows of a fixed passage pool, looked up like the memory-mapped corpus dataset."""

    def __init__(self) -> None:
        self.rows = pool_passages()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, rows: list[int]) -> dict[str, list]:
        return {key: [self.rows[r][key] for r in rows] for key in ("id", "title", "text")}


class StubRetriever:
    dim = 8

    def __init__(self) -> None:
        self.embedded = 0

    def embed(self, kind: str, texts: list[str], batch_size: int = 64, show_progress: bool = False) -> np.ndarray:
        self.embedded += len(texts)
        return np.ones((len(texts), self.dim), dtype=np.float32)


class StubIndex:
    """Deterministic pseudo-random top-k rows out of the pool."""
    dim, ntotal = 8, POOL

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def search(self, emb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.argsort(self.rng.random((len(emb), POOL)), axis=1)[:, :k]
        return -np.sort(-self.rng.random((len(emb), k)), axis=1).astype(np.float32), rows


def questions(n: int) -> list[dict]:
    rng = random.Random(1)
    return [{"id": f"q{i}", "question": f"where {rng.choice(WORDS)}", "answers": [rng.choice(WORDS)]}
            for i in range(n)]


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak traced allocation of ``fn()`` (call it once before measuring, so imports are not counted)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_retrieve_and_evaluate_memory_is_flat_in_the_number_of_questions(tmp_path):
    peaks: dict[str, list[int]] = {"retrieve": [], "evaluate": [], "evaluate --match string": []}
    warm = tmp_path / "warm.json"
    retrieve_to_files(StubRetriever(), StubIndex(), StubCorpus(), questions(10), top_k=5, output=warm, ks=[1, 5],
                      workers=1, show_progress=False)
    evaluate([1, 5], warm, mode="string", workers=1)
    for n in (2_000, 10_000):
        queries, out = questions(n), tmp_path / f"res-{n}.json"
        metrics = {}
        peaks["retrieve"].append(peak_bytes(lambda: metrics.update(retrieve_to_files(
            StubRetriever(), StubIndex(), StubCorpus(), queries, top_k=5, output=out, ks=[1, 5], workers=1,
            show_progress=False))))
        reports = []
        peaks["evaluate"].append(peak_bytes(lambda: reports.append(evaluate([1, 5], out, workers=1))))
        peaks["evaluate --match string"].append(peak_bytes(lambda: reports.append(
            evaluate([1, 5], out, mode="string", workers=1))))
        assert reports[0]["answers"]["questions"] == n and reports[0]["answers"]["match"] == "stored"
        assert reports[0]["answers"]["metrics"] == reports[1]["answers"]["metrics"] == metrics["answers"]
        assert 0 < metrics["answers"]["Accuracy@1"] < metrics["answers"]["Accuracy@5"] < 1
    for name, (small, large) in peaks.items():
        assert large < 1.3 * small + (1 << 20), f"{name}: peak {small} B at 2k questions, {large} B at 10k"


def write_questions(path, n: int) -> None:
    with open(path, "w") as f:
        for q in questions(n):
            f.write(json.dumps(q) + "\n")


@pytest.mark.slow
def test_retrieve_from_a_questions_file_holds_one_chunk_of_questions(tmp_path):
    peaks, counts = [], []
    for n in (10, 2_000, 10_000):
        path = tmp_path / f"q-{n}.jsonl"
        write_questions(path, n)
        retriever = StubRetriever()
        peaks.append(peak_bytes(lambda: counts.append(retrieve_file(
            retriever, StubIndex(), StubCorpus(), path, top_k=5, output=tmp_path / f"res-{n}.jsonl", compact=True,
            ks=[1, 5], workers=1, show_progress=False)[1])))
        assert retriever.embedded == n
    assert counts == [10, 2_000, 10_000]
    small, large = peaks[1:]
    assert large < 1.3 * small + (1 << 20), f"peak {small} B at 2k questions, {large} B at 10k"


def test_a_bad_question_line_fails_before_any_retrieval(tmp_path):
    path = tmp_path / "q.jsonl"
    write_questions(path, 3000)
    with open(path, "a") as f:
        f.write('{"question": 7}\n')
    retriever, out = StubRetriever(), tmp_path / "res.json"
    with pytest.raises(DprGcError, match=r"q.jsonl:3001: missing question"):
        retrieve_file(retriever, StubIndex(), StubCorpus(), path, top_k=5, output=out, show_progress=False)
    assert retriever.embedded == 0 and not out.exists()


def test_compact_results_round_trip_and_evaluate(tmp_path):
    queries = questions(30)
    full, compact, run = tmp_path / "full.json", tmp_path / "compact.jsonl.gz", tmp_path / "run.trec"
    a = retrieve_to_files(StubRetriever(), StubIndex(), StubCorpus(), queries, top_k=4, output=full, trec_run=run,
                          ks=[1, 4], show_progress=False)
    b = retrieve_to_files(StubRetriever(), StubIndex(), StubCorpus(), queries, top_k=4, output=compact, ks=[1, 4],
                          compact=True, show_progress=False)
    assert a == b
    records, small = json.loads(full.read_text()), list(iter_results(compact))
    by_id = {p["id"]: p for p in pool_passages()}
    for r, s in zip(records, small):
        assert [set(c) for c in s["ctxs"]] == [{"id", "score", "has_answer"}] * 4
        assert [{k: c[k] for k in ("id", "score", "has_answer")} for c in r["ctxs"]] == s["ctxs"]
        assert all(c["text"] == by_id[c["id"]]["text"] for c in r["ctxs"])
        assert {k: r[k] for k in ("id", "question", "answers")} == {k: s[k] for k in ("id", "question", "answers")}
    assert evaluate([1, 4], compact)["answers"]["metrics"] == a["answers"]
    assert evaluate([1, 4], full, mode="string")["answers"]["metrics"] == a["answers"]
    assert len(run.read_text().splitlines()) == 30 * 4
