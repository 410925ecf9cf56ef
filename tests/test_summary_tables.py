"""Every command ends with one closing summary of one shape, built by :func:`dpr_gc.base.tables.format_summary`:
a two-column ``| item | value |`` table, keys in words, and a ``time`` row in seconds (``12.3 s``, ``0.42 s``)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import summary_rows

PACKAGE = Path(__file__).resolve().parents[1] / "dpr_gc"
# the tables that are no closing summary: metric tables, per-source counts, the cache listing, the demo's before/after
DETAIL_TABLES = {("evaluation/evaluate.py", "format_table"), ("data/training.py", "_cli_prepare"),
                 ("data/arrow_cache.py", "cache_listing"), ("pipeline.py", "format_report"),
                 ("jax/example.py", "format_report"),
                 ("base/tables.py", "format_summary")}


def calls_in(name: str) -> list[tuple[str, str, ast.Call]]:
    """Each call of ``name`` in the package: its file, the function holding it and the call."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [(path.relative_to(PACKAGE).as_posix(), func.name, call) for call in ast.walk(func)
                          if isinstance(call, ast.Call) and getattr(call.func, "id", None) == name]
    return found


def test_every_closing_summary_has_a_time_row_and_no_table_is_built_by_hand() -> None:
    """A stage's table drifted (a horizontal header, '| count | value |', '| training | |', snake_case keys, the time
    as 'seconds' or none) as each built its own; each goes through format_summary with its seconds, and the only
    other tables are the detail tables above."""
    summaries = calls_in("format_summary")
    assert len(summaries) >= 10, summaries
    assert {(f, fn) for f, fn, _ in calls_in("markdown_table")} <= DETAIL_TABLES


def test_each_stages_closing_summary_follows_the_convention() -> None:
    """train, index, retrieve and verify render their library summaries (whose keys stay as they are) in words,
    with the shared rows named alike."""
    from dpr_gc.retrieval import index, retrieve
    from dpr_gc.train.report import summary_table
    from dpr_gc.train.verify import VerifyReport

    train = summary_rows(summary_table({
        "steps": 2, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": [4, 8], "precision": "fp32",
        "final_loss": 0.5, "seconds": 3.04, "total_seconds": 4.5, "examples_per_s": 5.0, "validation_seconds": 1.2,
        "final_model": "runs/r1/final", "best_model": None, "best": None, "best_metric": "avg_rank", "device": "cpu"}))
    assert (train["time"], train["output"], train["device"], train["precision"]) == ("4.50 s", "runs/r1/final", "cpu",
                                                                                      "fp32")
    assert (train["training"], train["examples/s"], train["dev validation"]) == ("3.04 s", "5.00", "1.20 s"), train
    built = summary_rows(index.summary_text({
        "index": "runs/idx", "factory": "IVF8,Flat", "search": "nprobe 1 of 8 lists", "faiss_threads": 2,
        "model": "m", "dim": 8, "ntotal": 800, "added": 800, "shards_added": 2, "train_vectors": 800,
        "train_seconds": 0.25, "add_seconds": 1.0, "complete": True}))
    assert built["time"] == "1.25 s" and built["output"] == "runs/idx" and built["vectors"] == "800", built
    assert built["added this run"] == "800 from 2 shards in 1.00 s" and built["trained on"] == "800 vectors in 0.25 s"
    retrieved = summary_rows(retrieve.summary_text({
        "queries": 4, "top-k": 5, "vectors": 10, "search": "exact", "seconds": 2.0, "queries/s": 2.0,
        "results": "out.json", "trec run": "-"}, "runs/idx"))
    assert list(retrieved)[:3] == ["queries", "top-k", "index"] and retrieved["output"] == "out.json", retrieved
    assert "seconds" not in retrieved and retrieved["time"] == "2.00 s"
    verified = summary_rows(VerifyReport("fp32", 1e-5, 1, "chunk 2", "full batch", device="cpu").summary(0.5))
    assert (verified["result"], verified["device"], verified["time"]) == ("FAIL", "cpu", "0.50 s")


def test_prepare_data_prints_its_summary_apart_from_its_table(tmp_path, capsys) -> None:
    """prepare-data printed its per-source table and the closing summary with no line between, which Markdown
    renders as one table; a blank line parts them, as in retrieve, evaluate and the demo."""
    from dpr_gc.cli import main

    data = Path(__file__).resolve().parents[1] / "data" / "examples" / "train.json"
    assert main(["prepare-data", str(data), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "|\n\n| item | value |" in out, out
