"""Sharded, resumable corpus encoding: coverage, equality with an unsharded run, resume, refusal, CLI."""

from __future__ import annotations

import argparse
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dpr_gc.retrieval import encode
from dpr_gc.retrieval.encode import encode_corpus
from dpr_gc.retrieval.shards import read_manifests, resolve_shard, shard_range
from dpr_gc.base.errors import DprGcError
from dpr_gc.retrieval.fingerprint import LEGACY_KEY, is_legacy, legacy_weights_fingerprint
from tests.helpers import edit_off_the_sample, gather, passages, summary_rows, write_corpus

ROOT = Path(__file__).resolve().parents[1]
REAL_ENCODE_BLOCK = encode.encode_block
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 10, 11, 100, 1001])
@pytest.mark.parametrize("shards", [1, 2, 3, 7, 13])
def test_shard_ranges_cover_every_row_once(rows: int, shards: int) -> None:
    covered = []
    for k in range(shards):
        start, count = shard_range(rows, k, shards)
        assert count >= 0
        covered += range(start, start + count)
    assert covered == list(range(rows))


def test_resolve_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_shard(None, None) == (0, 1)
    assert resolve_shard(2, 5) == (2, 5)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_shard(None, None) == (3, 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    for bad in ((4, 4), (-1, 2), (0, 0)):
        with pytest.raises(DprGcError, match="--shard-id"):
            resolve_shard(*bad)


TORCHRUN_SHARD = ("under torchrun (2 ranks): torchrun gives each rank its shard (shard RANK of WORLD_SIZE, here of 2); "
                  "drop {flag}, or run without torchrun to encode a chosen shard")


@pytest.mark.parametrize("shard,said", [((0, None), "--shard-id 0"), ((0, 1), "--shard-id 0"),
                                        ((None, 1), "--num-shards 1"), ((None, 4), "--num-shards 4")])
def test_torchrun_refuses_a_shard_given_by_flags(monkeypatch: pytest.MonkeyPatch, shard: tuple, said: str) -> None:
    """Under torchrun, --shard-id 0 --num-shards 1 made every rank encode shard 0 (rank 1: 'in use by another run')
    and --num-shards 1 alone gave rank 1 'got shard 1 of 1', a shard id it never typed."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DprGcError) as refused:
        resolve_shard(*shard)
    assert str(refused.value) == f"{said} {TORCHRUN_SHARD.format(flag=said.split()[0])}"
    assert resolve_shard(None, 2) == (1, 2)


@pytest.mark.parametrize("fmt,n,shards", [("tsv", 7, 3), ("beir", 7, 1), ("jsonl", 7, 10), ("tsv", 11, 4)])
def test_sharded_encoding_matches_unsharded(tmp_path: Path, make_retriever, fmt: str, n: int, shards: int) -> None:
    retriever = make_retriever(pooling="mean", passage_max_length=32)
    rows = passages(n)
    path = write_corpus(tmp_path / "data", rows, fmt)
    cache = tmp_path / "cache"
    for k in range(shards):
        m = encode_corpus(retriever, path, tmp_path / "out", k, shards, batch_size=2, dtype="float32", block_size=2,
                          cache_dir=cache, show_progress=False)
        assert m["count"] == shard_range(n, k, shards)[1] and m["dim"] == retriever.dim
    ids, emb = gather(tmp_path / "out")
    assert ids == [r[0] for r in rows]
    expected = retriever.embed("passage", [r[2] for r in rows], [r[1] for r in rows], batch_size=n)
    np.testing.assert_allclose(emb, expected, atol=1e-5)
    encode_corpus(retriever, path, tmp_path / "whole", batch_size=4, dtype="float32", cache_dir=cache,
                  show_progress=False)
    np.testing.assert_allclose(gather(tmp_path / "whole")[1], emb, atol=1e-5)
    assert not list((tmp_path / "out").glob("*.part*")), "part files are removed once a shard is assembled"


def test_float16_and_bf16_autocast(tmp_path: Path, make_retriever) -> None:
    retriever = make_retriever(normalize=True, passage_max_length=32)
    path = write_corpus(tmp_path / "data", passages(9), "jsonl")
    m = encode_corpus(retriever, path, tmp_path / "a", dtype="float16", precision="bf16", cache_dir=tmp_path / "c",
                      show_progress=False)
    assert m["dtype"] == "float16" and m["precision"] == "bf16"
    half = np.load(tmp_path / "a" / m["embeddings"])
    assert half.dtype == np.float16 and half.shape == (9, retriever.dim)
    full = retriever.embed("passage", [r[2] for r in passages(9)], [r[1] for r in passages(9)])
    cos = (half.astype(np.float32) * full).sum(1)
    assert cos.min() > 0.99


def test_embeddings_that_overflow_float16_are_refused(tmp_path: Path, make_retriever) -> None:
    """A float16 shard of values beyond its range would hold inf: refused, naming the rows and --dtype float32,
    and nothing written; float32 stores them."""
    retriever = make_retriever(normalize=False, passage_max_length=32)
    with torch.no_grad():
        for p in retriever.passage_encoder.parameters():
            if p.dim() == 1:  # LayerNorm scales and biases: activations far beyond 65,504
                p.mul_(1e5)
    path = write_corpus(tmp_path / "data", passages(4), "jsonl")
    common = dict(precision="fp32", cache_dir=tmp_path / "c", show_progress=False)
    assert np.abs(retriever.embed("passage", [r[2] for r in passages(4)])).max() > 70_000
    with pytest.raises(DprGcError, match=r"embeddings overflow float16 in rows 0\.\.3; use --dtype float32"), \
            warnings.catch_warnings():
        warnings.simplefilter("error")  # the error line only: no numpy overflow warning before it
        encode_corpus(retriever, path, tmp_path / "half", dtype="float16", **common)
    assert not list((tmp_path / "half").glob("*.npy"))
    assert encode_corpus(retriever, path, tmp_path / "full", dtype="float32", **common)["dtype"] == "float32"


def test_the_float16_hint_names_a_flag_only_for_a_caller_that_has_one(tmp_path: Path, make_retriever,
                                                                      caplog) -> None:
    """encode's log says ``--dtype float32`` keeps full precision; the library (which the demo and mine encode with,
    neither having ``--dtype``) says it stores float16 and names no flag it does not have."""
    retriever = make_retriever(normalize=True, passage_max_length=32)
    path = write_corpus(tmp_path / "data", passages(3), "jsonl")
    common = dict(precision="fp32", cache_dir=tmp_path / "c", show_progress=False, dtype="float16")
    with caplog.at_level("INFO", logger="dpr_gc"):
        encode_corpus(retriever, path, tmp_path / "library", **common)
        encode_corpus(retriever, path, tmp_path / "command", dtype_flag="--dtype", **common)
    said = [r.getMessage() for r in caplog.records if "stored as float16" in r.getMessage()]
    assert len(said) == 2 and "--dtype" not in said[0] and "float32 keeps" not in said[0], said
    assert "(--dtype float32 keeps full precision)" in said[1], said


def test_int8_encoding_is_close_to_fp32_and_keeps_the_model(tmp_path: Path, make_retriever) -> None:
    import torch

    retriever = make_retriever(normalize=True, passage_max_length=32)
    before = {k: v.clone() for k, v in retriever.state_dict().items()}
    fingerprint = encode.model_fingerprint(retriever)
    path = write_corpus(tmp_path / "data", passages(9), "jsonl")
    m = encode_corpus(retriever, path, tmp_path / "q", dtype="float32", precision="int8", cache_dir=tmp_path / "c",
                      show_progress=False)
    assert m["precision"] == "int8" and m["model_fingerprint"] == fingerprint  # an fp32 query encoder still fits
    quantized = encode.quantize_int8(retriever)
    assert any("quantized" in type(mod).__module__ for mod in quantized.modules())
    assert all(torch.equal(v, before[k]) for k, v in retriever.state_dict().items())  # the original is untouched
    emb = np.load(tmp_path / "q" / m["embeddings"])
    full = retriever.embed("passage", [r[2] for r in passages(9)], [r[1] for r in passages(9)])
    assert not np.allclose(emb, full, atol=1e-6)  # really computed in int8
    assert (emb * full).sum(1).min() > 0.95


def test_torchrun_environment_picks_the_shard(tmp_path: Path, make_retriever, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = write_corpus(tmp_path / "data", passages(5), "tsv")
    m = encode_corpus(make_retriever(), path, tmp_path / "out", cache_dir=tmp_path / "c", show_progress=False)
    assert (m["shard_id"], m["num_shards"], m["start_row"], m["count"]) == (1, 2, 2, 3)
    assert (tmp_path / "out" / "shard-00001-of-00002.json").is_file()


class Interrupted(Exception):
    """Stands for a crash or Ctrl-C in the middle of encoding."""


def counting_encoder(monkeypatch: pytest.MonkeyPatch, fail_on_call: int | None = None) -> list[int]:
    """Wrap ``encode.encode_block`` to count calls (rows per call), optionally crashing on call ``fail_on_call``."""
    calls: list[int] = []

    def wrapped(retriever, titles, texts, *args, **kwargs):
        if fail_on_call is not None and len(calls) + 1 == fail_on_call:
            raise Interrupted("simulated interruption")
        calls.append(len(texts))
        return REAL_ENCODE_BLOCK(retriever, titles, texts, *args, **kwargs)

    monkeypatch.setattr(encode, "encode_block", wrapped)
    return calls


def test_resume_after_interruption(tmp_path: Path, make_retriever, monkeypatch: pytest.MonkeyPatch) -> None:
    retriever = make_retriever(passage_max_length=32)
    path = write_corpus(tmp_path / "data", passages(10), "beir")
    kw = dict(shard_id=0, num_shards=1, batch_size=2, dtype="float32", block_size=3, cache_dir=tmp_path / "c",
              show_progress=False)
    out = tmp_path / "out"
    counting_encoder(monkeypatch, fail_on_call=3)
    with pytest.raises(Interrupted):
        encode_corpus(retriever, path, out, **kw)
    assert sorted(p.name for p in out.glob("*.part*.npy")) == ["shard-00000-of-00001.part00000.npy",
                                                               "shard-00000-of-00001.part00001.npy"]
    assert not (out / "shard-00000-of-00001.json").exists()
    with pytest.raises(DprGcError, match="no finished embedding shards"):
        read_manifests(out)
    calls = counting_encoder(monkeypatch)
    encode_corpus(retriever, path, out, **kw)
    assert calls == [3, 1], "only the two unfinished blocks (rows 6-8 and 9) are encoded again"
    monkeypatch.undo()
    encode_corpus(retriever, path, tmp_path / "fresh", **kw)
    assert gather(out)[0] == gather(tmp_path / "fresh")[0]
    np.testing.assert_array_equal(gather(out)[1], gather(tmp_path / "fresh")[1])
    calls = counting_encoder(monkeypatch)
    encode_corpus(retriever, path, out, **kw)
    assert calls == [], "a finished shard is not encoded again"


def test_summary_counts_the_passages_encoded_in_this_run(tmp_path: Path, make_retriever, monkeypatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    """encode's table: the shard's passages, and those this run encoded, whose rate it reports -- a resumed run
    encoded fewer, a finished shard none (its rate was the shard's passages over the seconds of a run that encoded
    nothing)."""
    model = tmp_path / "model"
    make_retriever(passage_max_length=16).save(model)
    path = write_corpus(tmp_path / "data", passages(10), "tsv")
    parser = argparse.ArgumentParser()
    encode.add_cli(parser.add_subparsers())
    args = parser.parse_args(["encode", "--model", str(model), "--corpus", str(path), "--output", str(tmp_path / "out"),
                              "--batch-size", "2", "--block-size", "3", "--cache-dir", str(tmp_path / "c")])

    def table_row() -> dict[str, str]:
        return summary_rows(capsys.readouterr().out)

    counting_encoder(monkeypatch, fail_on_call=3)
    with pytest.raises(Interrupted):
        args.func(args)
    capsys.readouterr()
    monkeypatch.undo()
    args.func(args)
    row = table_row()
    assert (row["passages"], row["encoded this run"]) == ("10", "4")  # blocks 0 and 1 (rows 0-5) were kept
    assert float(row["passages/s"]) > 0
    args.func(args)
    row = table_row()
    assert (row["passages"], row["encoded this run"], row["passages/s"]) == ("10", "0", "-")


def test_crash_before_manifest_is_unfinished_and_cheap_to_redo(tmp_path: Path, make_retriever, monkeypatch) -> None:
    retriever = make_retriever()
    path = write_corpus(tmp_path / "data", passages(5), "jsonl")
    kw = dict(block_size=2, cache_dir=tmp_path / "c", show_progress=False)
    real_write_json = encode.write_json

    def crash_on_manifest(target, obj):
        if encode.MANIFEST_RE.match(Path(target).name):
            raise Interrupted("crash just before the manifest")
        real_write_json(target, obj)

    monkeypatch.setattr(encode, "write_json", crash_on_manifest)
    with pytest.raises(Interrupted):
        encode_corpus(retriever, path, tmp_path / "out", **kw)
    assert (tmp_path / "out" / "shard-00000-of-00001.npy").is_file()
    with pytest.raises(DprGcError, match="no finished embedding shards"):
        read_manifests(tmp_path / "out")
    monkeypatch.undo()
    calls = counting_encoder(monkeypatch)
    encode_corpus(retriever, path, tmp_path / "out", **kw)
    assert calls == [] and gather(tmp_path / "out")[0] == [r[0] for r in passages(5)]


def test_refuses_to_mix_models_or_settings(tmp_path: Path, make_retriever, monkeypatch) -> None:
    path = write_corpus(tmp_path / "data", passages(6), "tsv")
    kw = dict(batch_size=2, block_size=2, cache_dir=tmp_path / "c", show_progress=False)
    out = tmp_path / "out"
    counting_encoder(monkeypatch, fail_on_call=2)
    with pytest.raises(Interrupted):
        encode_corpus(make_retriever(seed=0), path, out, 0, 2, **kw)
    monkeypatch.undo()
    with pytest.raises(DprGcError, match="model_fingerprint"):
        encode_corpus(make_retriever(seed=1), path, out, 0, 2, **kw)
    with pytest.raises(DprGcError, match="dtype"):
        encode_corpus(make_retriever(seed=0), path, out, 0, 2, dtype="float32", **kw)
    with pytest.raises(DprGcError, match="block-size 2"):
        encode_corpus(make_retriever(seed=0), path, out, 0, 2, **{**kw, "block_size": 4})
    encode_corpus(make_retriever(seed=0), path, out, 0, 2, **kw)
    with pytest.raises(DprGcError, match="num_shards"):
        encode_corpus(make_retriever(seed=0), path, out, 0, 3, **kw)
    with pytest.raises(DprGcError, match="pooling"):
        encode_corpus(make_retriever(seed=0, pooling="cls"), path, out, 1, 2, **kw)
    write_corpus(tmp_path / "data", passages(9), "tsv")
    with pytest.raises(DprGcError, match="corpus_bytes"):
        encode_corpus(make_retriever(seed=0), path, out, 1, 2, **kw)


def test_resume_refuses_a_model_differing_only_off_the_sampled_weights(tmp_path: Path, make_retriever,
                                                                       monkeypatch) -> None:
    path = write_corpus(tmp_path / "data", passages(6), "tsv")
    kw = dict(batch_size=2, block_size=2, cache_dir=tmp_path / "c", show_progress=False)
    counting_encoder(monkeypatch, fail_on_call=2)
    with pytest.raises(Interrupted):
        encode_corpus(make_retriever(), path, tmp_path / "out", 0, 2, **kw)
    monkeypatch.undo()
    edited = make_retriever()
    edit_off_the_sample(edited.passage_encoder)
    with pytest.raises(DprGcError, match="model_fingerprint"):
        encode_corpus(edited, path, tmp_path / "out", 0, 2, **kw)


def as_legacy(record: Path, retriever) -> None:
    """Rewrite a manifest or progress file as dpr-gc wrote it before the full fingerprint (16 hex digits)."""
    data = json.loads(record.read_text())
    data.pop(LEGACY_KEY, None)
    data["model_fingerprint"] = legacy_weights_fingerprint(retriever.passage_encoder)
    record.write_text(json.dumps(data))


def test_shards_recording_the_legacy_fingerprint_resume_and_index_with_new_ones(tmp_path: Path, make_retriever,
                                                                                monkeypatch) -> None:
    from dpr_gc.retrieval.index import DenseIndex, IndexParams, build_index, read_meta
    from dpr_gc.retrieval.retrieve import check_compatible

    path = write_corpus(tmp_path / "data", passages(6), "tsv")
    kw = dict(batch_size=2, block_size=2, cache_dir=tmp_path / "c", show_progress=False)
    out, model, legacy = tmp_path / "out", make_retriever(), tmp_path / "legacy-index"
    encode_corpus(model, path, out, 0, 2, **kw)
    counting_encoder(monkeypatch, fail_on_call=2)
    with pytest.raises(Interrupted):
        encode_corpus(model, path, out, 1, 2, **kw)
    monkeypatch.undo()
    for record in ("shard-00000-of-00002.json", "shard-00001-of-00002.parts.json"):
        as_legacy(out / record, model)
    build_index(out, legacy, IndexParams("flat"), allow_partial=True)
    assert is_legacy(read_meta(legacy)["model_fingerprint"])
    with pytest.raises(DprGcError, match="model_fingerprint"):
        encode_corpus(make_retriever(seed=1), path, out, 1, 2, **kw)
    calls = counting_encoder(monkeypatch)
    m = encode_corpus(model, path, out, 1, 2, **kw)
    assert calls == [1], "the legacy progress file's finished block is reused"
    assert m["model_fingerprint"] == encode.model_fingerprint(model) and not is_legacy(m["model_fingerprint"])
    assert m[LEGACY_KEY] == legacy_weights_fingerprint(model.passage_encoder)
    build_index(out, legacy, IndexParams("flat"), append=True)
    build_index(out, tmp_path / "whole", IndexParams("flat"))
    edited = make_retriever()
    edit_off_the_sample(edited.passage_encoder)
    for folder in (legacy, tmp_path / "whole"):
        assert read_meta(folder)["model_fingerprint"] == m["model_fingerprint"]
        check_compatible(model, DenseIndex.read(folder))
        with pytest.raises(DprGcError, match="weights differ"):
            check_compatible(edited, DenseIndex.read(folder))


def test_partial_folders_are_not_finished(tmp_path: Path, make_retriever) -> None:
    path = write_corpus(tmp_path / "data", passages(5), "jsonl")
    out = tmp_path / "out"
    m = encode_corpus(make_retriever(), path, out, 0, 2, cache_dir=tmp_path / "c", show_progress=False)
    with pytest.raises(DprGcError, match=r"lacks finished shard\(s\) 1 of 2"):
        read_manifests(out)
    assert [x["shard_id"] for x in read_manifests(out, complete=False)] == [0]
    (out / "shard-00001-of-00002.part00000.npy").write_bytes(b"junk")
    (out / "shard-00001-of-00002.npy").write_bytes(b"junk")
    with pytest.raises(DprGcError, match="lacks finished shard"):
        read_manifests(out)
    (out / m["embeddings"]).unlink()
    with pytest.raises(DprGcError, match="missing although its manifest exists"):
        read_manifests(out, complete=False)


def test_encode_bad_inputs(tmp_path: Path, make_retriever) -> None:
    retriever = make_retriever()
    with pytest.raises(DprGcError, match="corpus file not found"):
        encode_corpus(retriever, tmp_path / "missing.tsv", tmp_path / "out", show_progress=False)
    empty = tmp_path / "empty.tsv"
    empty.write_text("id\ttext\ttitle\n")
    with pytest.raises(DprGcError, match="corpus is empty"):
        encode_corpus(retriever, empty, tmp_path / "out", cache_dir=tmp_path / "c", show_progress=False)
    path = write_corpus(tmp_path / "data", passages(3), "tsv")
    with pytest.raises(DprGcError, match="--dtype"):
        encode_corpus(retriever, path, tmp_path / "out", dtype="int8", show_progress=False)
    with pytest.raises(DprGcError, match="--shard-id"):
        encode_corpus(retriever, path, tmp_path / "out", 3, 3, cache_dir=tmp_path / "c", show_progress=False)
    with pytest.raises(DprGcError, match="--max-length 129 exceeds the model's limit of 128"):
        encode_corpus(retriever, path, tmp_path / "out", max_length=129, show_progress=False)
    with pytest.raises(DprGcError, match="embeddings folder not found"):
        read_manifests(tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(DprGcError, match="no finished embedding shards"):
        read_manifests(tmp_path / "out")


def test_cli_and_dpr_script(tmp_path: Path, make_retriever, capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "model"
    make_retriever(passage_max_length=16).save(model)
    path = write_corpus(tmp_path / "data", passages(8), "tsv")
    parser = argparse.ArgumentParser()
    encode.add_cli(parser.add_subparsers())
    args = parser.parse_args(["encode", "--model", str(model), "--corpus", str(path), "--output",
                              str(tmp_path / "cli"), "--num-shards", "2", "--shard-id", "1", "--batch-size", "3",
                              "--dtype", "float32", "--cache-dir", str(tmp_path / "c")])
    m = args.func(args)
    assert m["count"] == 4 and m["model"] == str(model) and m["max_length"] == 16
    rows = summary_rows(capsys.readouterr().out)
    assert rows["passages"] == "4" and rows["output"] == str(tmp_path / "cli" / m["embeddings"]), rows
    spec = importlib.util.spec_from_file_location("gde", ROOT / "scripts" / "generate_dense_embeddings.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rc = script.main([f"model_file={model}", f"ctx_file={path}", "shard_id=0", "num_shards=2",
                      f"out_file={tmp_path / 'cli'}", "batch_size=5", "--dtype", "float32",
                      "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    ids, emb = gather(tmp_path / "cli")
    assert ids == [r[0] for r in passages(8)] and emb.shape == (8, 32)
    assert script.main(["--model_file", str(model), "--ctx_file", str(path), "--out_file", str(tmp_path / "cli"),
                        "--shard_id", "5", "--num_shards", "2"]) == 2
    assert "--shard_id must be in [0, --num_shards)" in capsys.readouterr().err


@pytest.mark.parametrize("corpus, shard, said", [
    ("missing.tsv", [], "--corpus file not found: {tmp}/missing.tsv (check the path)"),
    ("folder", [], "--corpus file {tmp}/folder is a folder, not a file (check the path)"),
    ("c.tsv", ["--shard-id", "3", "--num-shards", "2"],
     "--shard-id must be in [0, --num-shards); got shard 3 of 2")])
def test_a_bad_corpus_or_shard_is_refused_before_the_model_loads(tmp_path: Path, monkeypatch, capsys, corpus: str,
                                                                 shard: list, said: str) -> None:
    """stages.md: flags are checked "before anything is read or written". A missing or folder --corpus and a
    --shard-id outside --num-shards were refused only once the model had loaded (30 s with MiniLM), the corpus error
    naming no flag: both are refused first, the corpus named by --corpus."""
    from dpr_gc.cli import main
    from dpr_gc.model.retriever import Retriever

    monkeypatch.setattr(Retriever, "load", lambda *a, **k: pytest.fail("the model loaded first"))
    write_corpus(tmp_path, passages(4), "tsv").rename(tmp_path / "c.tsv")
    (tmp_path / "folder").mkdir()
    argv = ["encode", "--model", "m", "--corpus", str(tmp_path / corpus), "--output", str(tmp_path / "emb"), *shard]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {said.format(tmp=tmp_path)}"], err
    assert not (tmp_path / "emb").exists()


def test_the_summarys_time_is_the_whole_commands_and_encoding_has_its_own_row(tmp_path: Path, make_retriever,
                                                                               monkeypatch, capsys) -> None:
    """The ``time`` row was the encoding alone (the model load left out), where every other stage's is the whole
    command's; it is the whole command's, and ``encoding`` gives the seconds that ``passages/s`` divides."""
    import time

    from dpr_gc.cli import main
    from dpr_gc.model.retriever import Retriever

    model = tmp_path / "model"
    make_retriever().save(model)
    corpus = tmp_path / "c.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(f"{i}\tpassage {i}\tt\n" for i in range(6)))
    load = Retriever.load.__func__
    monkeypatch.setattr(Retriever, "load", classmethod(lambda cls, *a, **k: (time.sleep(0.5), load(cls, *a, **k))[1]))
    assert main(["encode", "--model", str(model), "--corpus", str(corpus), "--output", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]) == 0
    rows = summary_rows(capsys.readouterr().out)
    whole, encoding = (float(rows[key].removesuffix(" s")) for key in ("time", "encoding"))
    assert whole >= 0.5 + encoding, rows


def test_the_encoding_row_times_the_encoding_alone(tmp_path: Path, make_retriever, monkeypatch, capsys) -> None:
    """The ``encoding`` row (and so ``passages/s``) counted reading, parsing and fingerprinting the corpus: 5.8 s
    for a 300k-passage TSV whose shard of 1,000 passages took ~1 s to encode. A corpus reader and fingerprint made
    slow (each moving the summary's clock on 1000 s) count in ``time`` and not in ``encoding``."""
    import time
    import types

    from dpr_gc.cli import main
    from dpr_gc.retrieval import encode

    model = tmp_path / "model"
    make_retriever().save(model)
    corpus = tmp_path / "c.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(f"{i}\tpassage {i}\tt\n" for i in range(6)))
    skipped = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skipped[0])

    def slow(real):
        def call(*args, **kwargs):
            skipped[0] += 1000
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(encode, "time", clock)
    monkeypatch.setattr(encode, "load_corpus", slow(encode.load_corpus))
    monkeypatch.setattr(encode, "dataset_fingerprint", slow(encode.dataset_fingerprint))
    assert main(["encode", "--model", str(model), "--corpus", str(corpus), "--output", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]) == 0
    rows = summary_rows(capsys.readouterr().out)
    whole, encoding = (float(rows[key].removesuffix(" s")) for key in ("time", "encoding"))
    assert encoding < 1000 <= 2000 <= whole and rows["encoded this run"] == "6", rows
    assert float(rows["passages/s"]) >= 0.1, rows  # 6 passages over the encoding's seconds, not over 1000 s


@pytest.mark.parametrize("name", ["shard-00000-of-00001.ids.txt", "shard-00000-of-00001.part00000.npy",
                                  ".shard-00000-of-00001.lock"])
def test_a_corpus_named_as_a_shard_file_in_the_output_is_refused(tmp_path: Path, monkeypatch, capsys,
                                                                 name: str) -> None:
    """formats.md: every command refuses an output that is one of its inputs. A --corpus inside --output named as
    a file encode writes there (the shard's ids, a part file, its lock) was overwritten with the shard's ids: it is
    refused in one line naming both flags, before the model loads, and left as it was; a link to it too."""
    from dpr_gc.cli import main
    from dpr_gc.model.retriever import Retriever

    monkeypatch.setattr(Retriever, "load", lambda *a, **k: pytest.fail("the model loaded first"))
    out = tmp_path / "emb"
    out.mkdir()
    corpus = write_corpus(tmp_path, passages(4), "tsv").rename(out / name)
    before = corpus.read_bytes()
    (tmp_path / "link.tsv").symlink_to(corpus)
    for given in (corpus, tmp_path / "link.tsv"):
        assert main(["encode", "--model", "m", "--corpus", str(given), "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: the input --corpus {given} is {name} in the output folder --output {out}, which the "
                       "run writes or removes; move the input out of that folder, or give another --output"], err
    assert corpus.read_bytes() == before and sorted(p.name for p in out.iterdir()) == [name]
