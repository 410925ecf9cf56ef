"""Guarantees every stage and script keeps (issue 25): no output clobbers an input or another output (links
included), one run per output at a time, model folders appear whole or not at all, no code from a model folder,
and every file kind we read is validated (typed fields, ranges, paths inside their folder) into one error line."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dpr_gc import cli
from dpr_gc.base.errors import DprGcError
from dpr_gc.base.guard import atomic_folder, check_outputs
from dpr_gc.base.locks import exclusive_lock
from dpr_gc.model import card
from dpr_gc.model.retriever import Retriever
from tests.test_bad_inputs import call, load_script, refused, world  # noqa: F401 - world is a fixture


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


def test_two_outputs_of_one_run_may_not_be_the_same_file(world: dict, tmp_path: Path) -> None:
    out = tmp_path / "x"
    refused(retrieve_argv(world, "--queries", world["qa"], "--output", out, "--trec-run", out),
            "--trec-run", "are the same file")
    refused(["evaluate", "--run", world["run"], "--qrels", world["qrels"], "--output", out, "--plot", out],
            "same file")
    assert not out.exists()


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


def test_scripts_run_under_the_same_guard(world: dict, tmp_path: Path) -> None:
    qa = tmp_path / "qa.tsv"
    shutil.copy(world["qa"], qa)
    script = load_script("dense_retriever")
    refused(["--model_file", world["model"], "--qa_dataset", qa, "--encoded_ctx_file", world["emb"],
             "--out_file", qa], "--out_file", "is the input --qa_dataset", main=script.main)
    train = load_script("train_dense_encoder")
    refused(["--train_file", world["train"], "--output_dir", world["train"]], "--output_dir", main=train.main)


def test_check_outputs_library() -> None:
    with pytest.raises(DprGcError, match="same file"):
        check_outputs({}, {"--a": "x/y", "--b": "x/./y"})
    check_outputs({"--in": "a.txt"}, {"--out": "b.txt"})


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


# --------------------------------------------------------------------------------------------- whole folders
def test_model_folder_appears_whole_or_not_at_all(make_retriever, tmp_path: Path, monkeypatch) -> None:
    retriever = make_retriever()
    target = tmp_path / "final"

    def killed(folder, r) -> None:  # the weights are written by now; the run dies before the folder is finished
        assert (Path(folder) / "model.safetensors").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(card, "write_model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        retriever.save(target)
    assert not target.exists() and not list(tmp_path.iterdir()), "nothing half-written may remain"
    monkeypatch.undo()
    retriever.save(target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    monkeypatch.setattr(card, "write_model_card", killed)
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
    refused(["retrieve", "--index", world["idx"], "--model", model, "--corpus", world["corpus"], "--device", "cpu",
             "--queries", world["qa"], "--output", tmp_path / "o.json", "--skip-model-check"],
            "model.safetensors", "damaged")
    assert not (tmp_path / "o.json").exists()


# --------------------------------------------------------------------------------------------- typed-value fuzz
WRONG = ["256", 16.5, -1, [1, 2, 3], None, True, "\ud800"]
# Hugging Face's own config.json: the fields a BERT's shape comes from (transformers checks the rest itself)
HF_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings",
           "model_type", "dtype", "pad_token_id", "layer_norm_eps", "intermediate_size")


def _mutations(data: object, keys: object = None, wrong: list = WRONG) -> list[tuple[str, object]]:
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
    from dpr_gc.train.utils import read_state

    read_state(folder)


@pytest.fixture(scope="module")
def json_kinds(world: dict, tmp_path_factory, tiny_tokenizer) -> list[tuple[Path, str, object]]:
    """(folder, file inside it, how to use the folder) for every JSON file kind dpr-gc reads."""
    from dpr_gc.model.retriever import RetrieverConfig
    from dpr_gc.train.utils import write_state
    from tests.conftest import tiny_bert

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
        for label, data in _mutations(original, HF_KEYS if name == "config.json" else None,
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
from tests.test_security import copy_run, trained, train_argv  # noqa: E402,F401 - trained is a fixture


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
    short = tok.tokenize(tokenizer, retriever.config, "passage", [text[:2000]], ["t"])
    huge = tok.tokenize(tokenizer, retriever.config, "passage", [text], ["t"])
    assert max(seen) <= 16 * tok.CHARS_PER_TOKEN + 2
    assert torch.equal(short["input_ids"], huge["input_ids"])


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


def test_lone_surrogates_in_a_corpus_end_in_one_line(world: dict, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "a\\ud800", "title": "t", "text": "paris"}\n{"_id": "b", "title": "t", "text": "x"}\n')
    code, err = call(cli.main, ["encode", "--model", world["model"], "--corpus", corpus, "--output", tmp_path / "e",
                                "--device", "cpu", "--cache-dir", tmp_path / "cache"])
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")], err


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
