"""FAISS index: every kind builds and searches, save/load is exact, bad inputs give one-line errors."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

import faiss
import numpy as np
import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.retrieval.fingerprint import LEGACY_KEY
from dpr_gc.retrieval.index import (IDS_FILE, INDEX_FILE, META_FILE, DenseIndex, IndexParams, add_shards, build_index,
                          check_built_from, read_ids, sample_embeddings, summary_text)
from tests.helpers import summary_rows

DIM = 16
KIND_PARAMS = {
    "flat": IndexParams("flat"),
    "hnsw": IndexParams("hnsw", hnsw_m=8, ef_construction=40, ef_search=64),
    "ivf-flat": IndexParams("ivf-flat", nlist=8, nprobe=8),
    "ivf-pq": IndexParams("ivf-pq", nlist=4, pq_m=4, pq_nbits=4, nprobe=4),
    "factory": IndexParams(factory="IVF4,Flat", nprobe=4),
}


def write_shards(folder: Path, emb: np.ndarray, num_shards: int = 2, model: str = "tiny", fingerprint: str = "fp0",
                 dtype: str = "float32", only: Optional[list[int]] = None, passage_format: str = "pair",
                 ids: Optional[list[str]] = None, legacy: Optional[str] = None,
                 settings: Optional[dict] = None) -> Path:
    """Write encode-format shards of ``emb`` (npy, ids.txt, then the JSON manifest), as shards.md specifies."""
    folder.mkdir(parents=True, exist_ok=True)
    n, dim = emb.shape
    ids = ids or [f"doc{i}" for i in range(n)]
    for k in range(num_shards):
        if only is not None and k not in only:
            continue
        start, end = k * n // num_shards, (k + 1) * n // num_shards
        name = f"shard-{k:05d}-of-{num_shards:05d}"
        np.save(folder / f"{name}.npy", emb[start:end].astype(dtype))
        (folder / f"{name}.ids.txt").write_text("".join(f"{i}\n" for i in ids[start:end]))
        manifest = {"model": model, "model_fingerprint": fingerprint, "pooling": "cls", "normalize": True,
                    "passage_format": passage_format, "dim": dim, "dtype": dtype, "count": end - start,
                    "start_row": start, "shard_id": k, "num_shards": num_shards, "corpus": "/data/corpus.jsonl",
                    "corpus_rows": n, "embeddings": f"{name}.npy", "ids": f"{name}.ids.txt",
                    **({LEGACY_KEY: legacy} if legacy else {}), **(settings or {})}
        (folder / f"{name}.json").write_text(json.dumps(manifest))
    return folder


def unit_vectors(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return unit_vectors(800)


@pytest.fixture(scope="module")
def queries() -> np.ndarray:
    return unit_vectors(20, seed=1)


def exact_top_k(data: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries @ data.T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


def test_flat_from_shards_equals_numpy_top_k(tmp_path, data, queries):
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=3)
    summary = build_index(emb_dir, tmp_path / "idx", IndexParams("flat"), block_size=50)
    assert summary["ntotal"] == len(data) and summary["complete"] and summary["shards_added"] == 3
    scores, rows = DenseIndex.read(tmp_path / "idx").search(queries, 10)
    want_scores, want_rows = exact_top_k(data, queries, 10)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_shards_are_indexed_by_their_first_row_as_a_number(tmp_path, data, queries):
    """FAISS row r is corpus row r: shards are taken by their first row as a number (0, 66, 133, ..., 733 for 12
    shards of 800 rows, where as text 66 would come after 533)."""
    from dpr_gc.retrieval.shards import read_manifests

    emb_dir = write_shards(tmp_path / "emb", data, num_shards=12)
    assert [m["start_row"] for m in read_manifests(emb_dir)] == [k * len(data) // 12 for k in range(12)]
    build_index(emb_dir, tmp_path / "idx", IndexParams("flat"))
    np.testing.assert_array_equal(DenseIndex.read(tmp_path / "idx").search(queries, 10)[1],
                                  exact_top_k(data, queries, 10)[1])


@pytest.mark.parametrize("kind", sorted(KIND_PARAMS))
def test_each_kind_builds_searches_and_reloads_identically(tmp_path, data, queries, kind):
    emb_dir = write_shards(tmp_path / "emb", data, dtype="float16")
    trains = {"train_sample": 700} if kind not in ("flat", "hnsw") else {}  # refused for a kind training nothing
    build_index(emb_dir, tmp_path / "idx", KIND_PARAMS[kind], **trains)
    index = DenseIndex.read(tmp_path / "idx")
    assert index.ntotal == len(data) and index.dim == DIM
    scores, rows = index.search(queries, 10)
    assert rows.shape == (len(queries), 10) and rows.dtype == np.int64
    exact = exact_top_k(data.astype(np.float16).astype(np.float32), queries, 10)[1]
    recall = np.mean([len(set(r) & set(e)) / 10 for r, e in zip(rows, exact)])
    assert recall >= (0.3 if kind == "ivf-pq" else 0.9), recall
    again = DenseIndex.read(tmp_path / "idx")
    scores2, rows2 = again.search(queries, 10)
    np.testing.assert_array_equal(rows, rows2)
    np.testing.assert_array_equal(scores, scores2)
    assert again.meta["params"] == index.meta["params"]


def test_search_params_are_saved_and_restored(tmp_path, data):
    emb_dir = write_shards(tmp_path / "emb", data)
    build_index(emb_dir, tmp_path / "idx", IndexParams("ivf-flat", nlist=8, nprobe=3))
    index = DenseIndex.read(tmp_path / "idx")
    assert index.meta["params"]["nprobe"] == 3
    index.set_search_params(nprobe=5)
    index.write(tmp_path / "idx")
    assert faiss.extract_index_ivf(DenseIndex.read(tmp_path / "idx").index).nprobe == 5
    with pytest.raises(DprGcError, match="--ef-search does not apply"):
        index.set_search_params(ef_search=10)


def test_the_log_and_summary_say_what_was_picked_and_how_searches_run(tmp_path, data, caplog):
    """index picks nlist / pq-m from the data when not given, and a search runs with efSearch / nprobe (or exactly):
    the log says so at the start, with FAISS's threads, and the summary keeps the search settings."""
    import logging

    emb_dir = write_shards(tmp_path / "emb", data)
    threads = faiss.omp_get_max_threads()
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.index"):
        ivf = build_index(emb_dir, tmp_path / "ivf", IndexParams("ivf-pq", nprobe=3, pq_nbits=4), train_sample=800)
        flat = build_index(emb_dir, tmp_path / "flat", IndexParams("flat"))
        hnsw = build_index(emb_dir, tmp_path / "hnsw", IndexParams("hnsw", hnsw_m=8, ef_search=40))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("building ")]
    assert lines == [f"building IVF20,PQ4x4 over 800 vectors with --nlist 20 (about 4*sqrt(vectors), at most one "
                     f"list per 39 training vectors) and --pq-m 4 (the largest divisor of the dimension up to a "
                     f"quarter of it); search: nprobe 3 of 20 lists, PQ4x4 codes; FAISS threads {threads}",
                     f"building Flat over 800 vectors; search: exact; FAISS threads {threads}",
                     f"building HNSW8,Flat over 800 vectors; search: efSearch 40; FAISS threads {threads}"]
    assert [s["search"] for s in (ivf, flat, hnsw)] == ["nprobe 3 of 20 lists, PQ4x4 codes", "exact",
                                                          "efSearch 40"]
    assert ivf["faiss_threads"] == threads
    one_list = DenseIndex.build(DIM, IndexParams("ivf-flat", nlist=1, nprobe=32))
    assert one_list.search_settings() == "nprobe 32 of 1 list (all)"


def test_folder_layout_ids_and_metadata(tmp_path, data):
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=2)
    build_index(emb_dir, tmp_path / "idx", IndexParams("hnsw", hnsw_m=8))
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == sorted([INDEX_FILE, META_FILE, IDS_FILE])
    assert list(read_ids(tmp_path / "idx")) == [f"doc{i}" for i in range(len(data))]
    meta = json.loads((tmp_path / "idx" / META_FILE).read_text())
    assert meta["model"] == "tiny" and meta["model_fingerprint"] == "fp0" and meta["dim"] == DIM
    assert meta["ntotal"] == len(data) and meta["kind"] == "hnsw" and meta["factory"] == "HNSW8,Flat"
    assert meta["metric"] == "inner_product" and meta["first_id"] == "doc0" and meta["last_id"] == "doc799"
    assert [s["start_row"] for s in meta["shards"]] == [0, 400]


@pytest.mark.parametrize("params", [IndexParams("flat"), IndexParams(factory="SQfp16")], ids=["flat", "SQfp16"])
def test_partial_then_append_equals_full_build(tmp_path, data, queries, params):
    """stages.md: an index with nothing to train and no graph (flat, a --factory string such as SQfp16) built with
    --allow-partial and completed by --append is the index built all at once: the same rows, ids and hits."""
    full = write_shards(tmp_path / "full", data, num_shards=3)
    build_index(full, tmp_path / "full_idx", params)
    part = write_shards(tmp_path / "part", data, num_shards=3, only=[0, 1])
    with pytest.raises(DprGcError, match="lacks finished shard"):
        build_index(part, tmp_path / "idx", params)
    summary = build_index(part, tmp_path / "idx", params, allow_partial=True)
    assert summary["ntotal"] == 2 * len(data) // 3 and not summary["complete"]
    write_shards(tmp_path / "part", data, num_shards=3, only=[2])
    summary = build_index(part, tmp_path / "idx", params, append=True)
    assert summary["added"] == len(data) - 2 * len(data) // 3 and summary["complete"]
    a = DenseIndex.read(tmp_path / "idx").search(queries, 5)
    b = DenseIndex.read(tmp_path / "full_idx").search(queries, 5)
    np.testing.assert_array_equal(a[1], b[1])
    assert list(read_ids(tmp_path / "idx")) == list(read_ids(tmp_path / "full_idx"))


def test_a_rerun_of_a_finished_append_says_up_to_date_writes_nothing_and_exits_0(tmp_path, data, caplog):
    """``index --append`` run again with no new shard resumes as encode does: exit 0, a log line saying the index
    is up to date, and the index folder left as it was."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb, idx = write_shards(tmp_path / "emb", data, num_shards=2), tmp_path / "idx"
    argv = ["index", "--embeddings", emb, "--output", idx, "--append"]
    assert call(main, argv)[0] == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in idx.iterdir()}
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.index"):
        code, err = call(main, argv)
    assert code == 0 and "error" not in err
    assert f"{idx} is already up to date: every shard in {emb} is in it; nothing written" in caplog.messages
    assert {p.name: p.stat().st_mtime_ns for p in idx.iterdir()} == stamps
    summary = build_index(emb, idx, IndexParams("flat"), append=True)
    assert (summary["added"], summary["shards_added"], summary["ntotal"]) == (0, 0, len(data))


def test_shards_added_counts_the_shards_holding_rows(tmp_path, capsys):
    """8 shards over 6 passages leave shards 0 and 4 empty: the summary said "6 from 7 shards" (the empty shard at
    row 0 left out, the one in the middle counted); every shard holding no row is left out of the count."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", unit_vectors(6), num_shards=8)
    assert [json.loads(p.read_text())["count"] for p in sorted(emb.glob("*.json"))] == [0, 1, 1, 1, 0, 1, 1, 1]
    summary = build_index(emb, tmp_path / "idx", IndexParams("flat"))
    assert (summary["added"], summary["shards_added"], summary["ntotal"]) == (6, 6, 6)
    assert call(main, ["index", "--embeddings", emb, "--output", tmp_path / "idx2"])[0] == 0
    assert summary_rows(capsys.readouterr().out)["added this run"].startswith("6 from 6 shards in ")


def test_appending_to_an_index_with_a_damaged_ids_file_names_it_and_says_rebuild(tmp_path, data):
    """An ``ids.txt`` that lost a line is named as damaged (not a hidden temporary folder, not the shards) and the
    index is to be rebuilt without --append; the index is left as it was."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb, idx = write_shards(tmp_path / "emb", data, num_shards=2, only=[0]), tmp_path / "idx"
    assert call(main, ["index", "--embeddings", emb, "--output", idx, "--allow-partial"])[0] == 0
    lines = (idx / IDS_FILE).read_text().splitlines(keepends=True)
    (idx / IDS_FILE).write_text("".join(lines[:2] + lines[3:]))
    write_shards(emb, data, num_shards=2, only=[1])
    before = {p.name: p.read_bytes() for p in idx.iterdir()}
    code, err = call(main, ["index", "--embeddings", emb, "--output", idx, "--append"])
    assert code == 2 and err == (f"error: {idx / IDS_FILE}: {len(lines) - 1} passage ids for {len(lines)} index rows, "
                                 "so the index is damaged; rebuild it (without --append)\n")
    assert {p.name: p.read_bytes() for p in idx.iterdir()} == before


def test_allow_partial_indexes_the_shards_before_one_still_being_encoded(tmp_path, data, caplog):
    """Shards 0 and 2 of 3 encoded, 1 still running: --allow-partial indexes shard 0 (it refused the folder) and a
    warning names shard 2 as waiting for rows 266..532; once shard 1 is there, --append gives the index built all at
    once. With shard 0 missing there is nothing to index yet, said in one line."""
    from dpr_gc.cli import main
    from tests.helpers import call

    n, idx = len(data), tmp_path / "idx"
    emb = write_shards(tmp_path / "emb", data, num_shards=3, only=[0, 2])
    with pytest.raises(DprGcError, match="lacks finished shard"):
        build_index(emb, idx, IndexParams("flat"))
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        summary = build_index(emb, idx, IndexParams("flat"), allow_partial=True)
    assert summary["ntotal"] == n // 3 and not summary["complete"]
    assert ("left out shard-00002-of-00003 (from corpus row 533): they wait for rows 266..532, whose shard is not "
            "encoded yet, since FAISS rows must equal corpus rows; a later `dpr-gc index --append` adds them"
            ) in caplog.messages, caplog.messages
    write_shards(emb, data, num_shards=3, only=[1])
    assert build_index(emb, idx, IndexParams("flat"), append=True)["added"] == n - n // 3
    full = build_index(write_shards(tmp_path / "full", data, num_shards=3), tmp_path / "full_idx", IndexParams("flat"))
    assert full["ntotal"] == DenseIndex.read(idx).ntotal == n
    np.testing.assert_array_equal(DenseIndex.read(idx).index.reconstruct_n(0, n),
                                  DenseIndex.read(tmp_path / "full_idx").index.reconstruct_n(0, n))
    assert list(read_ids(idx)) == list(read_ids(tmp_path / "full_idx"))
    late = write_shards(tmp_path / "late", data, num_shards=3, only=[1, 2])
    code, err = call(main, ["index", "--embeddings", late, "--output", tmp_path / "late_idx", "--allow-partial"])
    assert code == 2 and err == (f"error: nothing to index in {late} yet: corpus rows 0..265 are not encoded, and "
                                 "the shards after them (shard-00001-of-00003, shard-00002-of-00003) wait for them, "
                                 "since FAISS rows must equal corpus rows; encode the first shard, then index\n"), err


@pytest.mark.parametrize("given, factory, picked", [
    (["--kind", "ivf-flat"], "IVF6,Flat", "; --nlist 6 picked for them"),
    (["--factory", "IVF4,Flat"], "IVF4,Flat", "")])
def test_a_partial_build_of_a_trained_index_warns_that_append_keeps_its_training(tmp_path, data, caplog, capsys,
                                                                                 given, factory, picked):
    """stages.md said a later --append gives the index built all at once, but an IVF index's lists are trained (and
    their number picked) on the vectors present at the --allow-partial build and --append keeps them (c300k, 2 of 4
    shards: IVF1095 trained on 75000 vectors, where the index built at once was IVF1549 trained on 100000; 175 of 500
    top-10s differed). The partial build warns in one line that --append keeps its training and how to get the index
    built all at once; the --append says in its log and its summary that the training covered fewer vectors than the
    index holds. A flat index, which trains nothing, warns of neither."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb, idx = write_shards(tmp_path / "emb", data, num_shards=3, only=[0]), tmp_path / "idx"
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        assert call(main, ["index", "--embeddings", emb, "--output", idx, "--allow-partial", *given])[0] == 0
    assert (f"--allow-partial: the {factory} index's IVF lists are trained on the 266 vectors present (of 800 corpus "
            f"rows{picked}), and a later --append keeps them; once every shard is encoded, build it again without "
            "--append for the index built all at once") in caplog.messages, caplog.messages
    meta = json.loads((idx / META_FILE).read_text())
    assert (meta["trained_on"], meta["trained_from"]) == (266, 266)
    write_shards(emb, data, num_shards=3, only=[1, 2])
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        assert call(main, ["index", "--embeddings", emb, "--output", idx, "--append"])[0] == 0
    assert (f"--append keeps the training of the {factory} index: its IVF lists were trained on the 266 vectors "
            "present at its build, and it now holds 800; build it again without --append for the index built all at "
            "once") in caplog.messages, caplog.messages
    assert summary_rows(capsys.readouterr().out)["trained on"] == "kept: the 266 vectors present at its build, of 800"
    flat = write_shards(tmp_path / "flat", data, num_shards=3, only=[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        assert call(main, ["index", "--embeddings", flat, "--output", tmp_path / "f", "--allow-partial"])[0] == 0
        write_shards(flat, data, num_shards=3, only=[1, 2])
        capsys.readouterr()
        assert call(main, ["index", "--embeddings", flat, "--output", tmp_path / "f", "--append"])[0] == 0
    assert not [m for m in caplog.messages if "keep" in m], caplog.messages
    assert summary_rows(capsys.readouterr().out)["trained on"] == "-"
    sampled, sampled_idx = write_shards(tmp_path / "s", data, num_shards=3, only=[0]), tmp_path / "s_idx"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        build_index(sampled, sampled_idx, IndexParams(factory="IVF2,Flat"), train_sample=100, allow_partial=True)
        meta = json.loads((sampled_idx / META_FILE).read_text())
        del meta["trained_from"]  # as an index of an earlier version
        (sampled_idx / META_FILE).write_text(json.dumps(meta))
        write_shards(sampled, data, num_shards=3, only=[1, 2])
        summary = build_index(sampled, sampled_idx, IndexParams(factory="IVF2,Flat"), append=True)
    assert [m.split(": ", 1)[1].split(", and")[0] for m in caplog.messages if "keep" in m] == [
        "the IVF2,Flat index's IVF lists are trained on a sample of 100 of the 266 vectors present (of 800 corpus "
        "rows)", "its IVF lists were trained on 100 vectors, drawn from at most the 266 it held before this append"]
    assert summary["training_kept"] == {"trained_on": 100, "trained_from": None, "held_before": 266}
    assert "kept: 100 vectors, drawn from at most the 266 it held before this append, of 800" in summary_text(summary)


def test_an_hnsw_graph_completed_by_append_is_not_the_graph_built_at_once(tmp_path, data, queries):
    """stages.md: an HNSW graph built with --allow-partial and completed by --append differs from the one built at
    once: FAISS draws each vector's level from a generator it restarts when it reads the index, so the appended
    vectors get other levels, and an approximate search can return other hits."""
    params = IndexParams("hnsw", hnsw_m=8, ef_construction=40, ef_search=16)
    build_index(write_shards(tmp_path / "full", data, num_shards=3), tmp_path / "full_idx", params)
    part = write_shards(tmp_path / "part", data, num_shards=3, only=[0])
    build_index(part, tmp_path / "idx", params, allow_partial=True)
    write_shards(part, data, num_shards=3, only=[1, 2])
    build_index(part, tmp_path / "idx", IndexParams("hnsw"), append=True)
    once, appended = DenseIndex.read(tmp_path / "full_idx").index, DenseIndex.read(tmp_path / "idx").index
    np.testing.assert_array_equal(once.reconstruct_n(0, len(data)), appended.reconstruct_n(0, len(data)))
    levels = [faiss.vector_to_array(index.hnsw.levels) for index in (once, appended)]
    assert (levels[0][:266] == levels[1][:266]).all() and (levels[0][266:] != levels[1][266:]).any()


def test_an_append_of_shards_encoded_otherwise_is_refused(tmp_path, data, caplog):
    """Shards encoded with another --max-length, --dtype or --precision (encode refuses them in one folder) are
    refused in one line naming each difference, appended to an index (which records them) or copied into one
    folder; an index written before they were recorded still appends, with a warning that they go unchecked."""
    from dpr_gc.cli import main
    from dpr_gc.retrieval.shards import read_manifests
    from tests.helpers import call

    ea = write_shards(tmp_path / "ea", data, num_shards=3, only=[0], dtype="float16",
                      settings={"max_length": 64, "precision": "fp32"})
    eb = write_shards(tmp_path / "eb", data, num_shards=3, only=[1], settings={"max_length": 8, "precision": "fp32"})
    ixm = tmp_path / "ixm"
    assert call(main, ["index", "--embeddings", ea, "--output", ixm, "--allow-partial"])[0] == 0
    meta = json.loads((ixm / META_FILE).read_text())
    assert (meta["max_length"], meta["precision"], meta["dtype"]) == (64, "fp32", "float16")
    code, err = call(main, ["index", "--embeddings", eb, "--output", ixm, "--append", "--allow-partial"])
    assert code == 2 and err == (f"error: embeddings in {eb} do not match the index: max_length 8 (the index: 64); "
                                 "dtype 'float32' (the index: 'float16'); encode the same corpus with the same model "
                                 "and encode settings, or build a new index in another folder\n"), err
    for key in ("max_length", "precision", "dtype"):  # as an index of an earlier version records it
        del meta[key]
    (ixm / META_FILE).write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="dpr_gc.retrieval.index"):
        assert build_index(eb, ixm, IndexParams("flat"), append=True, allow_partial=True)["added"] == 267
    assert ("the index records no max_length, precision, dtype (built before dpr-gc recorded them), so the shards "
            "appended cannot be checked against how its passages were encoded; rebuild the index to get that check"
            ) in caplog.messages
    for name in ("shard-00001-of-00003.npy", "shard-00001-of-00003.ids.txt", "shard-00001-of-00003.json"):
        (ea / name).write_bytes((eb / name).read_bytes())
    with pytest.raises(DprGcError, match=r"^shards in .* disagree on max_length \(64 vs 8\); re-encode them into one "
                                         "folder with one model and the same encode settings$"):
        read_manifests(ea, complete=False)


def test_appended_shards_that_overlap_the_indexed_rows_are_refused(tmp_path, data):
    """shard_rows_from: shards added to an index must continue its rows without overlaps too (a 3-way split's
    second shard starts inside the rows a 2-way split's first shard already put there)."""
    build_index(write_shards(tmp_path / "a", data, num_shards=2, only=[0]), tmp_path / "idx", IndexParams("flat"),
                allow_partial=True)
    other_split = write_shards(tmp_path / "b", data, num_shards=3, only=[1, 2])
    with pytest.raises(DprGcError, match="overlaps indexed rows"):
        build_index(other_split, tmp_path / "idx", IndexParams("flat"), append=True, allow_partial=True)


def test_mixed_models_and_dimensions_are_refused(tmp_path, data):
    mixed = write_shards(tmp_path / "mixed", data, num_shards=2, only=[0])
    write_shards(mixed, data, num_shards=2, only=[1], fingerprint="other")
    with pytest.raises(DprGcError, match="model_fingerprint"):
        build_index(mixed, tmp_path / "idx", IndexParams("flat"))
    formats = write_shards(tmp_path / "formats", data, num_shards=2, only=[0])
    write_shards(formats, data, num_shards=2, only=[1], passage_format="concat")
    with pytest.raises(DprGcError, match=r"disagree on passage_format \('pair' vs 'concat'\)"):
        build_index(formats, tmp_path / "idx", IndexParams("flat"))
    build_index(write_shards(tmp_path / "a", data, num_shards=2, only=[0]), tmp_path / "idx", IndexParams("flat"),
                allow_partial=True)
    other_model = write_shards(tmp_path / "b", data, num_shards=2, only=[1], model="big", fingerprint="fp9")
    with pytest.raises(DprGcError, match="do not match the index"):
        build_index(other_model, tmp_path / "idx", IndexParams("flat"), append=True, allow_partial=True)
    wider = write_shards(tmp_path / "c", unit_vectors(800, dim=24), num_shards=2, only=[1])
    with pytest.raises(DprGcError, match=r"do not match the index: dim 24 \(the index: 16\);"):
        build_index(wider, tmp_path / "idx", IndexParams("flat"), append=True, allow_partial=True)
    edited = write_shards(tmp_path / "d", data, num_shards=2, only=[1])
    for manifest in edited.glob("*.json"):
        manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"corpus_fingerprint": "edited"}))
    with pytest.raises(DprGcError, match=r"do not match the index: the corpus's content \(/data/corpus.jsonl; the "
                                         r"index: /data/corpus.jsonl; as many rows, other text\); encode the same"):
        build_index(edited, tmp_path / "idx", IndexParams("flat"), append=True, allow_partial=True)


def test_shards_of_both_fingerprint_forms_index_together_only_when_bridged(tmp_path, data):
    """A shard encoded into a folder of legacy-fingerprint shards records the model's legacy fingerprint beside the
    full one: with it the folder is one model's; without it, or with another model's, it is refused."""
    old, new, other = "0123456789abcdef", "v2:" + "1" * 32, "v2:" + "2" * 32
    bridged = write_shards(tmp_path / "bridged", data, num_shards=3, only=[0], fingerprint=old)
    write_shards(bridged, data, num_shards=3, only=[1, 2], fingerprint=new, legacy=old)
    build_index(bridged, tmp_path / "idx", IndexParams("flat"))
    meta = json.loads((tmp_path / "idx" / META_FILE).read_text())
    assert meta["model_fingerprint"] == new and meta[LEGACY_KEY] == old
    refused = [({"fingerprint": old}, {"fingerprint": new}),  # a full fingerprint without the legacy one
               ({"fingerprint": old}, {"fingerprint": new, "legacy": "fedcba9876543210"}),  # another model's
               ({"fingerprint": new, "legacy": old}, {"fingerprint": other, "legacy": old})]  # two full ones
    for k, (second, third) in enumerate(refused):
        folder = write_shards(tmp_path / f"mixed{k}", data, num_shards=3, only=[0], fingerprint=old)
        write_shards(folder, data, num_shards=3, only=[1], **second)
        write_shards(folder, data, num_shards=3, only=[2], **third)
        with pytest.raises(DprGcError, match="disagree on model_fingerprint"):
            build_index(folder, tmp_path / "idx2", IndexParams("flat"))


def test_shard_file_disagreeing_with_manifest_is_refused(tmp_path, data):
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=2)
    np.save(emb_dir / "shard-00001-of-00002.npy", data[:10])
    with pytest.raises(DprGcError, match="manifest says 400 x 16"):
        build_index(emb_dir, tmp_path / "idx", IndexParams("flat"))
    emb_dir = write_shards(tmp_path / "emb2", data, num_shards=2)
    (emb_dir / "shard-00001-of-00002.ids.txt").write_text("x\n")
    with pytest.raises(DprGcError, match="1 ids for 400 embeddings"):
        build_index(emb_dir, tmp_path / "idx2", IndexParams("flat"))
    assert not (tmp_path / "idx2" / META_FILE).exists()


def test_a_zip_named_as_a_shard_is_refused_in_one_line(tmp_path, data):
    """``np.savez`` bytes under a shard's ``.npy`` name (NumPy would open them as an archive) are refused naming
    the file; an encode part file holding them counts as not written, so it is encoded again."""
    import io

    from dpr_gc.retrieval.encode import _part_ok

    emb_dir = write_shards(tmp_path / "emb", data, num_shards=1)
    archive = io.BytesIO()
    np.savez(archive, emb=data)
    (emb_dir / "shard-00000-of-00001.npy").write_bytes(archive.getvalue())
    with pytest.raises(DprGcError) as e:
        build_index(emb_dir, tmp_path / "idx", IndexParams("flat"))
    assert len(str(e.value).splitlines()) == 1 and "shard-00000-of-00001.npy" in str(e.value), e.value
    assert "not a .npy array" in str(e.value) and "re-encode this shard" in str(e.value)
    assert not _part_ok(emb_dir / "shard-00000-of-00001.npy", *data.shape)


@pytest.mark.parametrize("flags, said", [
    (["--kind", "hnsw", "--nprobe", "4"], "--nprobe 4 does not apply to --kind hnsw, which it would not change: drop "
     "--nprobe, or give --kind ivf-flat or ivf-pq"),
    (["--ef-search", "5"], "--ef-search 5 does not apply to --kind flat, which it would not change: drop --ef-search, "
     "or give --kind hnsw"),
    (["--kind", "ivf-flat", "--hnsw-m", "16"], "--hnsw-m 16 does not apply to --kind ivf-flat"),
    (["--factory", "HNSW16,Flat", "--hnsw-m", "8"], "--hnsw-m 8 does not apply to --factory 'HNSW16,Flat' (write it "
     "into the string (HNSW32)): drop --hnsw-m"),
    (["--factory", "PQ16np", "--nprobe", "8"], "--nprobe 8 does not apply to --factory 'PQ16np' (the string has no "
     "IVF part): drop --nprobe"),
    (["--kind", "flat", "--train-sample", "500"], "--train-sample 500 does not apply to --kind flat, which trains "
     "nothing: drop it, or give --kind ivf-flat or ivf-pq"),
    (["--kind", "hnsw", "--train-sample", "500"], "--train-sample 500 does not apply to --kind hnsw, which trains "
     "nothing: drop it"),
    (["--seed", "3"], "--seed 3 does not apply to --kind flat, which trains nothing: drop it"),
    (["--factory", "HNSW8,Flat", "--train-sample", "50", "--seed", "3"], "--train-sample 50 and --seed 3 do not "
     "apply to --factory 'HNSW8,Flat', which trains nothing: drop them, or name a part that trains in the string"),
    (["--kind", "ivf-flat", "--factory", "Flat"], "--kind ivf-flat does not apply beside --factory 'Flat' (the string "
     "says the whole index); drop --kind, or --factory"),
    (["--kind", "flat", "--factory", "Flat"], "--kind flat does not apply beside --factory 'Flat'")])
def test_a_parameter_the_index_would_not_use_is_refused(tmp_path, data, capsys, flags, said):
    """index accepted --nprobe for an HNSW index, --ef-search for a flat one and --train-sample / --seed for one that
    trains nothing (flat, HNSW over flat vectors), and ignored them (retrieve refuses the search flags on such an
    index); the refusal comes before anything is written. An index that trains (a factory's SQ8 part) takes them."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", data, num_shards=1)
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "idx", *flags])
    assert code == 2 and err.strip().startswith(f"error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "idx").exists()
    assert call(main, ["index", "--embeddings", emb, "--output", tmp_path / "ok", "--kind", "ivf-flat", "--nlist", 2,
                       "--nprobe", 2])[0] == 0
    assert call(main, ["index", "--embeddings", emb, "--output", tmp_path / "sq", "--factory", "HNSW8,SQ8",
                       "--train-sample", 300, "--seed", 3])[0] == 0


def test_a_kind_given_beside_a_factory_in_code_is_refused():
    """IndexParams(kind="hnsw", factory=...) built the factory string's index without a word about the kind."""
    from dpr_gc.retrieval.index_params import IndexParams

    with pytest.raises(DprGcError, match=r"^--kind hnsw does not apply beside --factory 'Flat'"):
        IndexParams(kind="hnsw", factory="Flat")
    assert IndexParams(factory="Flat").kind == "factory"


def test_unknown_kind_and_bad_parameters(tmp_path, data):
    with pytest.raises(DprGcError, match="unknown index kind 'annoy'.*flat, hnsw, ivf-flat, ivf-pq"):
        IndexParams("annoy")
    with pytest.raises(DprGcError, match="FAISS cannot build index 'Bogus7'"):
        DenseIndex.build(DIM, IndexParams(factory="Bogus7"))
    with pytest.raises(DprGcError, match="--pq-m 5 must divide"):
        DenseIndex.build(DIM, IndexParams("ivf-pq", nlist=4, pq_m=5))
    with pytest.raises(DprGcError, match="--hnsw-m must be an integer from 2 to 512"):
        IndexParams("hnsw", hnsw_m=0)
    with pytest.raises(DprGcError, match="^an ivf-flat index needs --nlist"):
        IndexParams("ivf-flat").factory_string(DIM)
    with pytest.raises(DprGcError, match="--nlist 64 is a setting of ivf-flat and ivf-pq indexes, which --kind hnsw"):
        IndexParams("hnsw", nlist=64)
    with pytest.raises(DprGcError, match="--pq-m 4 is a setting of ivf-pq indexes, which --kind ivf-flat does not"):
        IndexParams("ivf-flat", nlist=4, pq_m=4)
    with pytest.raises(DprGcError, match="--nlist 8 .* --factory 'IVF4,Flat' \\(write it into the string\\)"):
        IndexParams(factory="IVF4,Flat", nlist=8)
    with pytest.raises(DprGcError, match="--pq-nbits 4 is a setting of ivf-pq indexes, which --kind ivf-flat does"):
        IndexParams("ivf-flat", nlist=4, pq_nbits=4)
    with pytest.raises(DprGcError, match="--pq-nbits 6 .* --factory 'IVF4,PQ4' \\(write it into the string\\)"):
        IndexParams(factory="IVF4,PQ4", pq_nbits=6)
    emb_dir = write_shards(tmp_path / "emb", data)
    with pytest.raises(DprGcError, match="raise --train-sample to at least 64 \\(the embeddings hold 800 vectors\\), "
                                         "or lower --nlist to at most 20$"):
        build_index(emb_dir, tmp_path / "idx", IndexParams("ivf-flat", nlist=64), train_sample=20)


def test_dimension_mismatch_untrained_and_nan_give_clear_errors(data):
    index = DenseIndex.build(DIM, IndexParams("flat"))
    index.add(data)
    with pytest.raises(DprGcError, match="shape \\(2, 8\\).*16-dimensional"):
        index.search(unit_vectors(2, dim=8), 5)
    with pytest.raises(DprGcError, match="--top-k must be a positive"):
        index.search(data[:2], 0)
    with pytest.raises(DprGcError, match="NaN"):
        index.add(np.full((1, DIM), np.nan, dtype=np.float32))
    ivf = DenseIndex.build(DIM, IndexParams("ivf-flat", nlist=4))
    with pytest.raises(DprGcError, match="must be trained"):
        ivf.add(data)
    with pytest.raises(DprGcError, match="index is empty"):
        DenseIndex.build(DIM, IndexParams("flat")).search(data[:1], 3)
    scores, rows = index.search(data[:1], 5000)
    assert rows.shape == (1, len(data))


def test_empty_or_missing_embeddings_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DprGcError, match="no finished embedding shards"):
        build_index(tmp_path / "empty", tmp_path / "idx", IndexParams("flat"))
    with pytest.raises(DprGcError, match="not found"):
        build_index(tmp_path / "nope", tmp_path / "idx", IndexParams("flat"))


@pytest.mark.parametrize("field, value, flag", [("seed", -1, "--seed"), ("block_size", 0, "--block-size"),
                                               ("train_sample", 0, "--train-sample")])
def test_build_settings_in_code_are_checked_as_the_flags_first(tmp_path, data, field, value, flag):
    """A bad IndexBuild field given to build_index is refused with the flag's error before anything is built, for
    every kind (IVF used to fail in numpy on a negative seed, a flat index was written and only then refused)."""
    from dpr_gc.cli import main
    from dpr_gc.retrieval.index_params import IndexBuild

    emb_dir = write_shards(tmp_path / "emb", data)
    for params in (IndexParams("flat"), IndexParams("ivf-flat", nlist=8)):
        with pytest.raises(DprGcError, match=f"^{flag} must be"):
            build_index(emb_dir, tmp_path / "idx", params, **{field: value})
        with pytest.raises(DprGcError, match=f"^{flag} must be"):
            build_index(emb_dir, tmp_path / "idx", params, IndexBuild(**{field: value}))
        assert not (tmp_path / "idx").exists()
    assert main(["index", "--embeddings", str(emb_dir), "--output", str(tmp_path / "cli"), flag, str(value)]) == 2
    assert not (tmp_path / "cli").exists()


def test_reading_incomplete_or_inconsistent_folders(tmp_path, data):
    with pytest.raises(DprGcError, match="no complete index"):
        DenseIndex.read(tmp_path)
    (tmp_path / "a-file").write_text("not an index")
    for path in (tmp_path / "a-file", tmp_path / "a-file" / "idx"):  # "Not a directory" is no complete index either
        with pytest.raises(DprGcError, match=f"^no complete index in {path} "):
            DenseIndex.read(path)
    emb_dir = write_shards(tmp_path / "emb", data)
    build_index(emb_dir, tmp_path / "idx", IndexParams("flat"))
    meta_path = tmp_path / "idx" / META_FILE
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "ntotal": 5}))
    with pytest.raises(DprGcError, match="disagrees"):
        DenseIndex.read(tmp_path / "idx")


def test_training_sample_is_distinct_rows_of_the_shards(tmp_path, data):
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=3)
    from dpr_gc.retrieval.shards import read_manifests

    manifests = read_manifests(emb_dir)
    sample = sample_embeddings(manifests, 100, seed=3)
    assert sample.shape == (100, DIM) and sample.dtype == np.float32
    matches = [np.flatnonzero((data == row).all(axis=1)) for row in sample]
    assert all(len(m) == 1 for m in matches) and len({int(m[0]) for m in matches}) == 100
    np.testing.assert_array_equal(sample_embeddings(manifests, 10_000), data)


def test_add_shards_in_memory_and_block_size_does_not_matter(tmp_path, data, queries):
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=2)
    small, shards, _ = add_shards(emb_dir, IndexParams("flat"), block_size=7)
    big, _, _ = add_shards(emb_dir, IndexParams("flat"), block_size=100_000)
    assert len(shards) == 2
    np.testing.assert_array_equal(small.search(queries, 8)[1], big.search(queries, 8)[1])


def test_index_cli(tmp_path, data, capsys):
    from dpr_gc.retrieval.index import add_cli

    emb_dir = write_shards(tmp_path / "emb", data)
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["index", "--embeddings", str(emb_dir), "--output", str(tmp_path / "idx"), "--kind",
                              "ivf-flat", "--nlist", "8", "--nprobe", "2", "--threads", "1"])
    threads = faiss.omp_get_max_threads()
    try:
        args.func(args)
        assert faiss.omp_get_max_threads() == 1
    finally:
        faiss.omp_set_num_threads(threads)
    out = capsys.readouterr().out
    rows = summary_rows(out)
    assert (rows["vectors"], rows["factory"], rows["FAISS threads"]) == ("800", "IVF8,Flat", "1"), rows
    assert DenseIndex.read(tmp_path / "idx").meta["params"]["nprobe"] == 2
    with pytest.raises(SystemExit):  # refused as the command line is read (test_a_misspelt_index_kind_...)
        parser.parse_args(["index", "--embeddings", str(emb_dir), "--output", str(tmp_path / "x"), "--kind", "lsh"])
    assert "argument --kind: invalid choice: 'lsh'" in capsys.readouterr().err


def test_hnsw_beam_narrower_than_k_still_returns_k_hits(data):
    index = DenseIndex.build(DIM, IndexParams("hnsw", hnsw_m=4, ef_search=2))
    index.add(data)
    _, rows = index.search(data[:5], 200)
    assert (rows >= 0).all() and all(len(set(r)) == 200 for r in rows)
    assert index.index.hnsw.efSearch == 2


def test_search_settings_at_a_depth_name_the_ef_search_that_runs(data):
    """A search of top-k over an HNSW beam narrower than k runs with efSearch k (at most the vectors): the settings
    of a search at that depth say so; a beam already as wide, or no depth, reads the index's own."""
    index = DenseIndex.build(DIM, IndexParams("hnsw", hnsw_m=4, ef_search=128))
    index.add(data)
    assert index.search_settings() == index.search_settings(100) == "efSearch 128"
    assert index.search_settings(200) == "efSearch 200 (raised to --top-k 200)"
    assert index.search_settings(10 ** 6) == (f"efSearch {len(data)} (raised to --top-k 1000000, cut to the "
                                              f"{len(data)} vectors)")
    assert index.index.hnsw.efSearch == 128


@pytest.mark.parametrize("factory", ["PCA16,HNSW32,Flat", "HNSW32,Flat,RFlat", "IVF4_HNSW32,Flat"])
def test_hnsw_settings_reach_a_graph_inside_the_index(tmp_path, data, factory):
    """An HNSW graph behind a transform, under a refinement or as an IVF quantizer is built with --ef-construction
    (FAISS's default 40 was kept, while index_meta.json recorded the flag), and a search graph's beam narrower than
    top-k is widened for that search as a top-level one is (PCA16,HNSW32,Flat gave fewer hits than asked)."""
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=1)
    build_index(emb_dir, tmp_path / "idx", IndexParams(factory=factory, ef_construction=500, ef_search=7))
    index = DenseIndex.read(tmp_path / "idx")
    layers = [faiss.downcast_index(index.index)]
    while layers[-1] is not None and not hasattr(layers[-1], "hnsw"):
        inner = next((getattr(layers[-1], name) for name in ("index", "base_index", "quantizer")
                      if getattr(layers[-1], name, None) is not None), None)
        layers.append(None if inner is None else faiss.downcast_index(inner))
    assert layers[-1].hnsw.efConstruction == 500 == index.meta["params"]["ef_construction"]
    if "IVF" in factory:  # the quantizer's beam finds the lists to probe: top-k does not widen it
        return
    _, rows = index.search(data[:5], 200)
    assert (rows >= 0).all() and all(len(set(r)) == 200 for r in rows)
    assert index.search_settings(200).startswith("efSearch 200 (raised to --top-k 200)")
    assert index.search_settings().startswith("efSearch 7") and layers[-1].hnsw.efSearch == 7


@pytest.mark.parametrize("changed, said", [
    ({"max_length": 128}, "max_length=64 but the embeddings in {emb} have max_length=128"),
    ({"precision": "bf16", "passage_prefix": "passage: "},
     "precision='fp32', passage_prefix='' but the embeddings in {emb} have precision='bf16', "
     "passage_prefix='passage: '"),
    ({"dtype": "float16"}, "dtype='float32' but the embeddings in {emb} have dtype='float16'")])
def test_a_saved_index_is_refused_for_shards_encoded_with_other_settings(tmp_path, data, changed, said):
    """dense_retriever.py --save_or_load_index reused an index after its shards were re-encoded with another
    --max-length, precision, dtype or passage prefix (only the model, encoding and corpus were compared), so it
    retrieved from stale vectors silently; those are compared too, each difference named in one line."""
    settings = {"max_length": 64, "precision": "fp32", "passage_prefix": "", "query_prefix": ""}
    build_index(write_shards(tmp_path / "emb", data, settings=settings), tmp_path / "idx", IndexParams("flat"))
    index = DenseIndex.read(tmp_path / "idx")
    check_built_from(index, tmp_path / "emb", tmp_path / "idx")  # what the script calls before reusing the index
    dtype = changed.pop("dtype", "float32")
    emb = write_shards(tmp_path / "emb2", data, dtype=dtype, settings={**settings, **changed})
    with pytest.raises(DprGcError) as caught:
        check_built_from(index, emb, tmp_path / "idx")
    assert str(caught.value) == (f"the index in {tmp_path / 'idx'} was built with {said.format(emb=emb)}; delete the "
                                 "old index or give another --index_path")


def test_an_nsg_graph_is_built_in_one_add_and_never_appended_to(tmp_path, data, caplog):
    """FAISS builds an NSG graph in one add and refuses a second: over several shards (or more rows than
    --block-size) dpr-gc's block-by-block adds failed with FAISS's 'NSG does not support incremental addition'. Its
    rows are gathered into one add, said in the log; an --append to such an index, and an --allow-partial build that
    a later --append would have to finish, are refused in one line before anything is added."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", data, num_shards=2)
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.index"):
        summary = build_index(emb, tmp_path / "idx", IndexParams(factory="PCA8,NSG16,Flat"), block_size=50)
    assert summary["ntotal"] == len(data) == DenseIndex.read(tmp_path / "idx").ntotal
    assert ("its NSG graph is built in one add: gathering all 800 vectors (0.0 MiB as float32) in memory, whatever "
            "--block-size") in caplog.messages, caplog.messages
    partial = write_shards(tmp_path / "partial", data, num_shards=2, only=[0])
    code, err = call(main, ["index", "--embeddings", partial, "--output", tmp_path / "p", "--factory", "NSG16,Flat",
                            "--allow-partial"])
    assert code == 2 and err == ("error: --allow-partial: the NSG16,Flat index builds its NSG graph in one add and "
                                 "could not take corpus rows 400..799, not encoded yet, later; wait for their shards, "
                                 "then index without --allow-partial\n"), err
    assert not (tmp_path / "p").exists()
    build_index(partial, tmp_path / "p", IndexParams("flat"), allow_partial=True)  # as an NSG index built earlier
    flat = DenseIndex.read(tmp_path / "p")
    nsg = DenseIndex.build(DIM, IndexParams(factory="NSG16,Flat"))
    nsg.add(data[:400])
    nsg.meta = {**flat.meta, **{key: nsg.meta[key] for key in ("kind", "factory", "params")}}
    nsg.write(tmp_path / "p", ids=read_ids(tmp_path / "p"))
    write_shards(partial, data, num_shards=2, only=[1])
    code, err = call(main, ["index", "--embeddings", partial, "--output", tmp_path / "p", "--append"])
    assert code == 2 and err == (f"error: --append: the NSG16,Flat index built its NSG graph in one add and cannot "
                                 f"take the 400 vectors of {partial} it lacks; build a new index over all the shards "
                                 "without --append\n"), err
    assert DenseIndex.read(tmp_path / "p").ntotal == 400


def test_ivf_pq_skips_polysemous_training():
    index = DenseIndex.build(DIM, IndexParams("ivf-pq", nlist=4, pq_m=4))
    assert faiss.downcast_index(faiss.extract_index_ivf(index.index)).do_polysemous_training is False


@pytest.mark.parametrize("factory, search", [
    ("PQ4np", "approximate (PQ4 codes)"), ("PCA8,Flat", "approximate (PCA to 8, flat)"),
    ("NSG16,Flat", "approximate (NSG graph)"), ("HNSW8_SQ8", "efSearch 128, SQ8bit codes"),
    ("PCA8,IVF4,Flat", "nprobe 32 of 4 lists (all), PCA to 8"), ("RR16,Flat", "exact"),
    ("PCA16,Flat", "approximate (PCA centring, flat)")])
def test_an_index_is_said_to_search_exactly_only_when_it_does(tmp_path, data, caplog, factory, search):
    """How a search runs is read from the FAISS index's structure: compressed codes, a dimension-reducing transform
    or a graph make it approximate, and the log, the summary and a reloaded index say so (and why); only a flat
    index over the vectors as given (a rotation before it included) searches exactly."""
    emb_dir = write_shards(tmp_path / "emb", data, num_shards=1)  # an NSG graph is built by one add
    with caplog.at_level(logging.INFO, logger="dpr_gc.retrieval.index"):
        summary = build_index(emb_dir, tmp_path / "idx", IndexParams(factory=factory))
    assert f"building {factory} over 800 vectors; search: {search};" in " ".join(caplog.messages)
    assert summary["search"] == search == DenseIndex.read(tmp_path / "idx").search_settings()


def test_a_full_rank_pca_is_not_exact_its_centring_changes_the_ranking(data, queries):
    """PCA centres the vectors: (q - m).(p - m) moves each passage's score by its own -m.p, so even a PCA that keeps
    every dimension ranks otherwise than the dot product; its index must not call its search exact."""
    index = DenseIndex.build(data.shape[1], IndexParams(factory="PCA16,Flat"))
    index.train(data)
    index.add(data)
    _, rows = exact_top_k(data, queries, 10)
    _, found = index.search(queries, 10)
    assert (found != rows).any() and index.search_settings() == "approximate (PCA centring, flat)"


def test_an_index_faiss_builds_with_the_l2_metric_is_refused_at_build_and_read(tmp_path, data):
    """FAISS builds HNSW over PQ codes with the L2 metric whatever metric is asked for: its search would return
    distances, smallest first, read as scores. `dpr-gc index` refuses the factory in one line, and a folder holding
    such an index (built elsewhere) is refused when read."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", data)
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "a", "--factory", "HNSW8_PQ4"])
    assert code == 2 and err.startswith("error: FAISS builds index 'HNSW8_PQ4' with its IndexHNSWPQ part ranking "
                                        "by the L2 distance") and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()
    hnsw_pq = faiss.index_factory(data.shape[1], "HNSW8_PQ4", faiss.METRIC_INNER_PRODUCT)
    hnsw_pq.train(data)
    hnsw_pq.add(data)
    build_index(emb, tmp_path / "b", IndexParams(factory="HNSW8,Flat"))
    meta = json.loads((tmp_path / "b" / META_FILE).read_text())
    DenseIndex(hnsw_pq, dict(meta, factory="HNSW8_PQ4")).write(tmp_path / "b")
    with pytest.raises(DprGcError, match=r"was built with its IndexHNSWPQ part ranking by the L2 distance"):
        DenseIndex.read(tmp_path / "b")


def test_too_few_vectors_to_train_advises_what_can_help(tmp_path):
    """Training needs a vector per IVF list / PQ centroid: with every vector sampled, --train-sample cannot help
    and is not named; the fix is written as the index was given (a flag, or the number in the --factory string)."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", unit_vectors(400))
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "a", "--kind", "ivf-flat",
                            "--nlist", "1000"])
    assert code == 2 and err.endswith("; the embeddings hold only 400 vectors: lower --nlist to at most 400\n")
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "b", "--factory", "IVF1000,Flat"])
    assert code == 2 and err.endswith("; the embeddings hold only 400 vectors: lower IVF1000 in --factory "
                                      "'IVF1000,Flat' to at most IVF400\n")
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "c", "--kind", "ivf-pq", "--nlist",
                            "4", "--pq-nbits", "12", "--train-sample", "300"])
    assert code == 2 and err.endswith("; the embeddings hold only 400 vectors and --train-sample takes 300 of them: "
                                      "lower --pq-nbits to at most 8\n")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_append_keeps_how_the_index_was_built_and_sets_search_flags(tmp_path, data):
    """``--append`` adds vectors to the index as it was built: a build flag other than the index's (--kind, --nlist,
    --hnsw-m, --factory, --train-sample...) is refused in one line naming it, the index left as it was; a search flag
    (--nprobe, --ef-search) is set on the index, as FAISS sets it on a loaded one, and index_meta.json records the
    index's real settings."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb, idx = write_shards(tmp_path / "emb", data, only=[0]), tmp_path / "idx"
    run = ["index", "--embeddings", emb, "--output", idx]
    assert call(main, [*run, "--kind", "ivf-flat", "--nlist", "4", "--nprobe", "4", "--allow-partial"])[0] == 0
    before = {p.name: p.read_bytes() for p in idx.iterdir()}
    refused = {("--nprobe", "1", "--kind", "hnsw"): "--kind hnsw: --append only adds vectors to the IVF4,Flat index in "
                                                    f"{idx} (built with --kind ivf-flat) and would ignore it; drop it, "
                                                    "or build a new index in another folder",
               ("--nlist", "8"): "--nlist 8: --append only adds vectors to the IVF4,Flat index in "
                                 f"{idx} (built with --nlist 4) and would ignore it",
               ("--hnsw-m", "8", "--seed", "3"): "--hnsw-m 8 and --seed 3: --append only adds vectors to the "
                                                 f"IVF4,Flat index in {idx} (built with --seed 0) and would ignore "
                                                 "them; drop them",
               ("--factory", "IVF8,Flat"): "--factory IVF8,Flat: --append",
               ("--ef-search", "16"): "--ef-search does not apply to the IVF4,Flat index; drop the flag"}
    for flags, message in refused.items():
        code, err = call(main, [*run, "--append", "--allow-partial", *flags])
        assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, (flags, err)
        assert {p.name: p.read_bytes() for p in idx.iterdir()} == before
    write_shards(tmp_path / "emb", data, only=[1])
    assert call(main, [*run, "--append", "--nprobe", "1", "--kind", "ivf-flat", "--nlist", "4"])[0] == 0
    index = DenseIndex.read(idx)
    assert (index.ntotal, index.search_settings(), index.meta["factory"]) == (800, "nprobe 1 of 4 lists", "IVF4,Flat")
    recorded = index.meta["settings"]["index"]
    assert (recorded["kind"], recorded["nlist"], recorded["nprobe"], index.meta["params"]["nprobe"]) == \
        ("ivf-flat", 4, 1, 1)
    assert call(main, [*run, "--append", "--nprobe", "2"])[0] == 0  # nothing to add: the search setting is written
    assert DenseIndex.read(idx).search_settings() == "nprobe 2 of 4 lists"
    assert DenseIndex.read(idx).meta["settings"]["index"]["nprobe"] == 2
    meta = json.loads((idx / META_FILE).read_text())  # as earlier versions wrote it: pq_nbits 8 for every kind
    meta["params"]["pq_nbits"] = 8
    del meta["settings"]
    (idx / META_FILE).write_text(json.dumps(meta))
    assert call(main, [*run, "--append", "--nprobe", "3"])[0] == 0
    assert DenseIndex.read(idx).meta["settings"]["index"]["nprobe"] == 3


def test_an_append_with_training_flags_to_an_index_that_trains_nothing_is_refused_as_such(tmp_path, data):
    """--append --train-sample onto a flat index said it was "built with --train-sample 100000", a sample it never
    took (trained_on 0); the flags are refused as ones the index has no use for, the index left as it was."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb, idx = write_shards(tmp_path / "emb", data, only=[0]), tmp_path / "idx"
    run = ["index", "--embeddings", emb, "--output", idx]
    assert call(main, [*run, "--allow-partial"])[0] == 0
    before = {p.name: p.read_bytes() for p in idx.iterdir()}
    code, err = call(main, [*run, "--append", "--train-sample", "500"])
    assert code == 2 and err == (f"error: --train-sample 500 does not apply to the Flat index in {idx}, which trains "
                                 "nothing: drop it\n"), err
    assert {p.name: p.read_bytes() for p in idx.iterdir()} == before


@pytest.mark.parametrize("factory", ["Flat", "PCA8,Flat", "PCAR16,Flat", "OPQ4,IVF4,PQ4x4", "IVF4,SQ8", "SQ8",
                                     "HNSW8", "IVF4,PQ4x4,RFlat", "L2norm,Flat"])
def test_pair_scores_are_the_scores_a_search_gives(factory):
    """DenseIndex.pair_scores gives a vector the score a search of the index gives it (transforms, codes,
    refinement), so a passage scored outside a search (mine's positives) compares with the search's hits."""
    rng = np.random.default_rng(0)
    x, q = rng.standard_normal((300, DIM)).astype(np.float32), rng.standard_normal((4, DIM)).astype(np.float32)
    dense = DenseIndex.build(DIM, IndexParams(factory=factory, nprobe=4))
    dense.train(x)
    dense.add(x)
    scores, rows = dense.search(q, 10)
    for i in range(len(q)):
        pairs = dense.pair_scores(np.repeat(q[i:i + 1], 10, axis=0), x[rows[i]])
        np.testing.assert_allclose(pairs, scores[i], rtol=1e-4, atol=1e-4)


def test_a_misspelt_index_kind_is_named_with_the_closest_kind(tmp_path, data, capsys):
    """docs/stages.md: a misspelt choice names the closest one. --kind hsnw was refused after parsing as "unknown
    index kind 'hsnw'; use one of ...", naming neither the flag nor hnsw: refused as the command line is read, and
    IndexParams in code names --kind and the closest kind too."""
    from dpr_gc.cli import main

    emb_dir = write_shards(tmp_path / "emb", data)
    assert main(["index", "--embeddings", str(emb_dir), "--output", str(tmp_path / "idx"), "--kind", "hsnw"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: dpr-gc index: argument --kind: invalid choice: 'hsnw' (choose from 'flat', 'hnsw', "
                   "'ivf-flat', 'ivf-pq', or --factory STRING); did you mean 'hnsw'? (see dpr-gc index --help)"], err
    assert not (tmp_path / "idx").exists()
    with pytest.raises(DprGcError, match=r"^--kind: unknown index kind 'ivfpq'; use one of .*; did you mean 'ivf-pq'"):
        IndexParams(kind="ivfpq")
    with pytest.raises(DprGcError, match=r"^--kind: unknown index kind 'zzz'; use one of [^?]*$"):
        IndexParams(kind="zzz")


def test_ivf_pq_picks_the_bits_its_training_sample_supports_and_advises_on_rough_centroids(tmp_path, caplog):
    """Without --pq-nbits, ivf-pq takes the most bits whose 2**bits codes get 39 training vectors each (8 wanted
    9,984: on 1,000 vectors FAISS warned 'please provide at least 9984 training points' with no advice), and says so;
    a --pq-nbits given too large for the sample is kept, with a warning naming the flag to lower."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", unit_vectors(1000))
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, _ = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "a", "--kind", "ivf-pq"])
    assert code == 0 and "--pq-nbits 4 (not 8: 256 codes want 9984 training vectors, 39 each)" in caplog.text
    assert json.loads((tmp_path / "a" / META_FILE).read_text())["params"]["pq_nbits"] == 4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, _ = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "b", "--kind", "ivf-pq",
                              "--nlist", "4", "--pq-nbits", "8"])
    warned = [r.getMessage() for r in caplog.records
              if r.name == "dpr_gc.retrieval.index" and "rough" in r.getMessage()]
    assert code == 0 and warned == ["1000 training vectors are fewer than the 39 per IVF list / PQ centroid k-means "
                                    "wants, so the centroids are rough: the embeddings hold only 1000 vectors: lower "
                                    "--pq-nbits to at most 4"]


def test_too_few_vectors_for_a_factory_string_are_refused_before_training_starts(tmp_path):
    """An 'OPQ..,IVF..,PQ..' string with more IVF lists than vectors failed only after FAISS trained the OPQ rotation
    (minutes on a small corpus); the count is checked first and nothing is trained."""
    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", unit_vectors(300))
    code, err = call(main, ["index", "--embeddings", emb, "--output", tmp_path / "a", "--factory", "OPQ8,IVF512,PQ8"])
    assert code == 2 and err == ("error: training the OPQ8,IVF512,PQ8 index on 300 vectors cannot work (each IVF list "
                                 "and PQ centroid needs a training vector of its own), so it was not started; the "
                                 "embeddings hold only 300 vectors: lower IVF512 in --factory 'OPQ8,IVF512,PQ8' to at "
                                 "most IVF300\n"), err
    assert not (tmp_path / "a").exists()


def test_the_summarys_time_is_the_whole_commands(tmp_path, monkeypatch, capsys):
    """The ``time`` row was FAISS's training and adding alone (0.26 s of a 1.04 s command: reading the shards and
    writing the index, 60+ GB for psgs_w100, left out); it is the whole command's, and the ``trained on`` and
    ``added this run`` rows keep the seconds of those two."""
    import time

    from dpr_gc.cli import main
    from tests.helpers import call

    emb = write_shards(tmp_path / "emb", unit_vectors(40), num_shards=2)
    write = DenseIndex.write
    monkeypatch.setattr(DenseIndex, "write", lambda *a, **k: (time.sleep(0.5), write(*a, **k))[1])
    assert call(main, ["index", "--embeddings", emb, "--output", tmp_path / "idx", "--kind", "ivf-flat",
                       "--nlist", 2])[0] == 0
    rows = summary_rows(capsys.readouterr().out)
    added, trained = (float(rows[key].rsplit(" in ", 1)[1].removesuffix(" s")) for key in ("added this run",
                                                                                         "trained on"))
    assert float(rows["time"].removesuffix(" s")) >= 0.5 + added + trained, rows
