"""The main job end to end (tiny model): before/after metrics, outputs in one folder, resumable."""

from __future__ import annotations

import dataclasses
import json
import re

from transformers import BertTokenizerFast

from dpr_gc.cli import main
from dpr_gc.base.errors import DprGcError
from dpr_gc.evaluation.evaluate import evaluate_answers, qrels_metrics, read_qrels, read_results, read_run
from dpr_gc.pipeline import DemoConfig, demo_training, warmup_within_run
from tests.helpers import summary_rows, tiny_bert, write_vocab

import pytest


def tiny_model_folder(tmp_path):
    """A tiny random BERT and its tokenizer saved as a transformers folder (the demo's --model)."""
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(tmp_path / "vocab.txt")))
    tiny_bert(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.mark.slow  # ~20 CPU-seconds or more (measured)
def test_demo_runs_end_to_end_and_resumes(tmp_path, capsys):
    model_dir = tiny_model_folder(tmp_path)
    out = tmp_path / "demo"
    args = ["demo", "--output", str(out), "--model", str(model_dir), "--max-examples", "600", "--train-queries", "96", "--batch-size", "32",
            "--chunk-size", "8", "--passage-max-length", "32"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "before training" in printed and "nDCG@10" in printed
    report = json.loads((out / "metrics.json").read_text())
    after = {"model": out / "training" / "final", "index": out / "after" / "index", "run": out / "after" / "run.trec",
             "results": out / "after" / "results.json", "metrics": out / "metrics.json", "plot": out / "report.png"}
    assert report["outputs"] == {name: str(path) for name, path in after.items()}  # the trained model's, not before's
    rows = summary_rows(printed)
    assert [rows[name] for name in ("trained retriever", "index", "run file", "metrics", "plot")] == [
        str(after[name]) for name in ("model", "index", "run", "metrics", "plot")], rows
    qrels = read_qrels(next((out / "data").rglob("test.tsv")))
    for name in ("before", "after"):
        assert report[name]["questions"] == report["dataset"]["test_queries"]
        assert report[name]["passages"] == report["dataset"]["corpus_passages"]
        ks = [int(k.split("@")[1]) for k in report[name]["answers"]]
        assert report[name]["qrels"] == qrels_metrics(read_run(out / name / "run.trec"), qrels, ks)
        assert report[name]["answers"] == evaluate_answers(read_results(out / name / "results.json"), ks)
    assert report["before"]["qrels"] != report["after"]["qrels"]
    assert len(report["training_loss"]) == 3
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "training" / "final" / "retriever_config.json").is_file()
    assert not list((out / "training").glob("checkpoint-*"))  # only a resume needs it; final/ is saved
    assert (out / "after" / "run.trec").stat().st_size > 0
    for name, model in (("before", out / "base_model"), ("after", out / "training" / "final")):
        recorded = json.loads((out / name / "index" / "index_meta.json").read_text())["model"]
        assert recorded == str(model.resolve()), (name, recorded)  # so retrieve --index needs no --model
    queries = out / "data" / "test_queries.jsonl"
    assert main(["retrieve", "--index", str(out / "after" / "index"), "--queries", str(queries), "--top-k", "5",
                 "--output", str(tmp_path / "again.json")]) == 0
    again = {r["question"]: [round(float(c["score"]), 4) for c in r["ctxs"]]
             for r in read_results(tmp_path / "again.json")}
    demo_top5 = {r["question"]: [round(float(c["score"]), 4) for c in r["ctxs"][:5]]
                 for r in read_results(out / "after" / "results.json")}
    assert again == demo_top5  # the same scores (the tiny model's ties may come in another order)

    outputs = [out / "training" / "final" / "retriever_config.json", out / "before" / "results.json",
               out / "after" / "results.json", out / "after" / "index" / "index_meta.json"]
    stamps = [p.stat().st_mtime_ns for p in outputs]
    assert main(args) == 0
    assert [p.stat().st_mtime_ns for p in outputs] == stamps, "the second run redid finished work"
    rerun = json.loads((out / "metrics.json").read_text())
    assert rerun["after"] == report["after"]
    assert rerun["seconds"] >= report["seconds"] > 1  # the demo's time over both runs, not the rerun's 0.1 s


@pytest.mark.slow  # ~20 CPU-seconds (a demo interrupted in training, then the rest)
def test_demo_interrupted_in_training_resumes_from_its_checkpoint(tmp_path, capsys, monkeypatch, caplog):
    """README: "Interrupted, the same command resumes where it stopped." Ctrl-C in training step 5 (after the
    checkpoint of step 4): the rerun keeps the measured "before" stage, resumes training at checkpoint-4, and ends
    with all 5 steps in the curve. A full disk in between says to run the demo again (it has no --resume)."""
    import logging

    from dpr_gc.base.errors import NOTHING_KEPT, DiskFullError
    from dpr_gc.data import stdlib_data
    from dpr_gc.train import trainer
    from dpr_gc.train.trainer import Trainer

    model_dir = tiny_model_folder(tmp_path)
    out = tmp_path / "demo"
    args = ["demo", "--output", str(out), "--model", str(model_dir), "--max-examples", "600", "--train-queries",
            "160", "--batch-size", "32", "--chunk-size", "8", "--passage-max-length", "32"]
    real_step, real_build = Trainer.train_step, stdlib_data.build_stdlib_dataset

    def interrupted(self, batch):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self, batch)

    def stop_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    def disk_full(config):
        raise DiskFullError(out / "training" / "checkpoint-5", "free space, then run the same command with "
                            "--resume latest")

    monkeypatch.setattr(stdlib_data, "build_stdlib_dataset", stop_at_once)  # before any stage: nothing to resume
    assert main(args) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"interrupted: {NOTHING_KEPT}"
    monkeypatch.setattr(stdlib_data, "build_stdlib_dataset", real_build)
    monkeypatch.setattr(Trainer, "train_step", interrupted)
    assert main(args) == 130
    assert (f"interrupted: the dataset, the base model and the 'before' measurement are kept in {out}; training's "
            f"checkpoint-4 is kept in {out / 'training'} and training resumes from it; run the same command again to "
            "resume") in capsys.readouterr().err
    assert (out / "training" / "checkpoint-4").is_dir() and not (out / "training" / "final").exists()
    before = (out / "before" / "results.json").stat().st_mtime_ns
    monkeypatch.setattr(Trainer, "train_step", real_step)
    monkeypatch.setattr(trainer, "train", disk_full)  # a full disk while training: the demo's own advice, not train's
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "run the same command again: the demo resumes" in err and "--resume" not in err, err
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        assert main(args) == 0
    assert (out / "before" / "results.json").stat().st_mtime_ns == before, "the rerun measured 'before' again"
    assert "resumed from step 4 (epoch 0, 4 batches into it)" in caplog.text, caplog.text[-2000:]
    assert [step for step, _ in json.loads((out / "metrics.json").read_text())["training_loss"]] == [1, 2, 3, 4, 5]


def test_demo_interrupted_in_its_first_encoding_names_what_is_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the demo encodes the corpus for "before" (training not started) names the stages that finished
    and the encoder's own line, the blocks it kept and where; it claimed "the stages finished and training's
    checkpoints are kept" (there were none) and hid the encoder's line."""
    from dpr_gc.retrieval import encode

    out = tmp_path / "demo"
    args = ["demo", "--output", str(out), "--model", str(tiny_model_folder(tmp_path)), "--max-examples", "200",
            "--train-queries", "64", "--batch-size", "32", "--chunk-size", "8", "--passage-max-length", "32"]
    real_encode, real_part, calls = encode.encode_corpus, encode._encode_part, []

    def second_block_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_part(*args, **kwargs)

    monkeypatch.setattr(encode, "encode_corpus", lambda *a, **kw: real_encode(*a, **{**kw, "block_size": 16}))
    monkeypatch.setattr(encode, "_encode_part", second_block_interrupted)
    assert main(args) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"interrupted: the dataset and the base model are kept in {out}; shard-00000-of-00001: "
                           f"1 of ") and f"blocks of 16 passages are kept in {out / 'before' / 'embeddings'}" in line
    assert "checkpoint" not in line and "training" not in line and not (out / "training").exists()
    kept_time = json.loads((out / "before" / ".encode_seconds.json").read_text())["seconds"]
    assert isinstance(kept_time, float) and kept_time >= 0  # the encoding's time so far, counted on resuming


def test_a_measured_stage_shows_retrieval_progress_out_of_the_test_questions(tmp_path, make_retriever, monkeypatch):
    """The demo knows its test questions before retrieving them: the "retrieving" bar counts to their number
    (it showed a bare count with no total, so no fraction done and no ETA). A stage stopped after its index resumes
    with that index, not another build."""
    from dpr_gc.data.stdlib_data import build_stdlib_dataset
    from dpr_gc.pipeline import measure
    from dpr_gc.retrieval import retrieve

    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))  # the demo's corpus cache goes to the default place
    bars = []
    real_tqdm = retrieve.tqdm
    monkeypatch.setattr(retrieve, "tqdm", lambda **kw: bars.append(kw) or real_tqdm(**kw))
    manifest = build_stdlib_dataset(tmp_path / "data", max_examples=20)
    make_retriever(passage_max_length=32).save(tmp_path / "model")
    from dpr_gc.base import devices
    from dpr_gc.model.retriever import Retriever

    loaded, real_load = [], Retriever.load

    def load(path, device="cpu", **kwargs):
        loaded.append(device)
        return real_load(path, device, **kwargs)

    monkeypatch.setattr(devices, "default_device", lambda device=None: "cpu:0")  # as "cuda:0" where a GPU is
    monkeypatch.setattr(Retriever, "load", load)
    metrics = measure(tmp_path / "model", "before", tmp_path, tmp_path / "data", manifest, top_k=5,
                      encode_batch_size=16)
    assert loaded == ["cpu:0"]  # the stage encodes where training runs: on the GPU when there is one
    assert [bar["total"] for bar in bars if bar["desc"] == "retrieving"] == [metrics["questions"]]
    assert metrics["questions"] == manifest["counts"]["test_queries"] > 0
    index = tmp_path / "before" / "index" / "index_meta.json"
    built = index.stat().st_mtime_ns
    (tmp_path / "before" / "metrics.json").unlink()  # as a run stopped after the index, before the results
    again = measure(tmp_path / "model", "before", tmp_path, tmp_path / "data", manifest, top_k=5, encode_batch_size=16)
    assert index.stat().st_mtime_ns == built, "the resumed stage built its index again"
    assert {**again, "encode_seconds": 0} == {**metrics, "encode_seconds": 0}


def test_demo_needs_a_batch_several_times_the_chunk():
    training = demo_training()
    assert training.cache.query_chunk_size == training.cache.passage_chunk_size == 16
    with pytest.raises(DprGcError, match="--batch-size 32 should be at least 4x --chunk-size 16"):
        DemoConfig(training=dataclasses.replace(training, data=dataclasses.replace(training.data, batch_size=32)))
    DemoConfig(training=dataclasses.replace(training, data=dataclasses.replace(training.data, batch_size=64)))


def test_demo_help_states_the_batch_to_chunk_rule(capsys, monkeypatch):
    """The demo refuses a --batch-size under 4x --chunk-size; the help of both flags says so."""
    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside the flags' names
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    helps = " ".join(capsys.readouterr().out.split())
    for flag in ("--batch-size", "--chunk-size"):
        shown = re.search(rf" {flag} [A-Z_]+ (.*?) \(default", helps)
        assert shown and "at least 4x --chunk-size" in shown.group(1), (flag, helps)


def test_the_demos_warm_up_never_outlasts_its_run():
    """``demo --train-queries 64`` trains one step of 64, and its 2-step warm-up drew train's warning naming a
    ``--warmup-steps`` the demo has not; the warm-up is cut to the run, the default run's 16 steps keep 2."""
    recipe = demo_training()
    assert warmup_within_run(recipe, 64).optim.warmup_steps == 1
    assert warmup_within_run(recipe, 1024).optim.warmup_steps == recipe.optim.warmup_steps == 2
    two_epochs = dataclasses.replace(recipe, optim=dataclasses.replace(recipe.optim, epochs=2))
    assert warmup_within_run(two_epochs, 64).optim.warmup_steps == 2


def test_fewer_train_queries_than_one_batch_are_refused_before_anything_is_written(tmp_path):
    """``--train-queries 8 --batch-size 64`` is known too small from the flags: refused in one line before the
    dataset is built (it once built it, wrote demo_settings.json, and only then refused)."""
    from tests.helpers import call

    out = tmp_path / "d1"
    code, err = call(main, ["demo", "--output", out, "--train-queries", "8", "--batch-size", "64"])
    assert (code, err) == (2, "error: --train-queries 8: too few training questions (8) for one batch of 64 x 1 "
                              "rank(s); lower --batch-size\n")
    assert not out.exists()


def test_the_readme_describes_the_demos_defaults():
    """README, "What the demo does": mean pooling, normalised, temperature 0.05, top 100; 1,024 training questions,
    batch 64, chunk 16 (4 chunks per step), 16 steps, lr 5e-5 -- the defaults of DemoConfig and demo_training."""
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    config, retriever = DemoConfig(), demo_training().model.retriever
    training = config.training
    steps = training.optim.epochs * config.train_queries // training.data.batch_size
    chunk = training.cache.passage_chunk_size
    assert (retriever.pooling, retriever.normalize, retriever.temperature) == ("mean", True, 0.05)
    assert chunk == training.cache.query_chunk_size
    assert ("(mean pooling, normalised, temperature 0.05), indexes it (FAISS Flat), retrieves the top "
            f"{config.top_k} for") in readme
    assert (f"on {config.train_queries:,} training questions: batch {training.data.batch_size}, chunk {chunk} "
            f"({training.data.batch_size // chunk} chunks per step") in readme
    assert f"{steps} steps, lr {training.optim.learning_rate:.0e}".replace("e-0", "e-") in readme


def test_the_readmes_demo_table_is_the_recorded_run():
    """README's before/after table is the ``metrics.json`` of a default ``dpr-gc demo`` run kept in
    ``benchmarks/results/demo-xeon.json``, to the 4 decimals shown."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    recorded = json.loads((root / "benchmarks" / "results" / "demo-xeon.json").read_text())
    assert recorded["config"] == json.loads(json.dumps(dataclasses.asdict(DemoConfig())))
    rows = re.findall(r"^\| (Accuracy@\d+|nDCG@10|MRR@10|Recall@100) \| ([\d.]+) \| ([\d.]+) \|$",
                      (root / "README.md").read_text(), re.M)
    assert len(rows) == 7
    for metric, *shown in rows:
        part = "answers" if metric.startswith("Accuracy") else "qrels"
        assert shown == [f"{recorded[stage][part][metric]:.4f}" for stage in ("before", "after")], metric


def test_a_demo_folder_resumes_only_the_same_settings(tmp_path):
    """The first run records its settings; a re-run with others is refused in one line naming what changed (it
    would reuse the measured stages and the trained model as they are), the same settings resume, and a folder of
    other files without the record is refused."""
    from dpr_gc.pipeline import SETTINGS_FILE, check_demo_settings

    out, config = tmp_path / "demo", DemoConfig()
    check_demo_settings(out, config)
    assert (out / SETTINGS_FILE).is_file()
    check_demo_settings(out, config)
    (out / "before").mkdir()  # a stage wrote something
    (out / "before" / "metrics.json").write_text("{}")
    training = dataclasses.replace(config.training, optim=dataclasses.replace(config.training.optim,
                                                                             learning_rate=1e-3))
    with pytest.raises(DprGcError, match=r"other settings \(--max-examples \(not set\) there, 300 now; top_k 100 "
                                         r"there, 5 now\); its before/ would be reused as it is"):  # not the rate
        check_demo_settings(out, dataclasses.replace(config, training=training, max_examples=300, top_k=5))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DprGcError, match="holds files but no demo_settings.json"):
        check_demo_settings(tmp_path / "other", config)


def test_a_changed_demo_setting_is_named_by_its_flag(tmp_path):
    """A demo rerun with other settings names each demo flag that changed once, with its value there and now, not
    the config keys it sets (--chunk-size sets both chunk sizes); every demo flag is covered."""
    from dpr_gc.pipeline import DemoFlags, check_demo_settings

    others = {"model": "other-model", "max_examples": 300, "train_queries": 512, "batch_size": 128, "chunk_size": 8,
              "hard_negatives": 1, "epochs": 2, "learning_rate": 1e-4, "passage_max_length": 64,
              "precision": "bf16", "seed": 1}
    assert set(others) == {f.name for f in dataclasses.fields(DemoFlags)} - {"output"}
    out = tmp_path / "demo"
    check_demo_settings(out, DemoFlags(output=str(out)).config())
    (out / "after").mkdir()
    (out / "after" / "metrics.json").write_text("{}")
    for name, value in others.items():
        default = getattr(DemoFlags(), name)
        flag = "--" + name.replace("_", "-")
        shown = "(not set)" if default is None else repr(default)
        expected = re.escape(f"other settings ({flag} {shown} there, {value!r} now); ")
        with pytest.raises(DprGcError, match=expected):
            check_demo_settings(out, dataclasses.replace(DemoFlags(output=str(out)), **{name: value}).config())
    with pytest.raises(DprGcError, match=r"\(--chunk-size 16 there, 8 now; --seed 0 there, 1 now\); "):
        check_demo_settings(out, DemoFlags(output=str(out), chunk_size=8, seed=1).config())


def test_a_demo_record_protects_only_finished_stages(tmp_path):
    """A folder where no stage wrote anything (only the dataset, which checks its own settings, and the record)
    takes new settings, and records them, its demo time and encoding times, the old settings', restarting; once a
    stage wrote something, the old settings are refused again."""
    from dpr_gc.pipeline import ENCODE_SECONDS_FILE, SECONDS_FILE, SETTINGS_FILE, check_demo_settings

    out, config = tmp_path / "demo", DemoConfig()
    check_demo_settings(out, config)
    (out / "data").mkdir()
    (out / "before").mkdir()
    for clock in (out / SECONDS_FILE, out / "before" / ENCODE_SECONDS_FILE):  # the old settings' times
        clock.write_text('{"seconds": 5.0}')
    other = dataclasses.replace(config, max_examples=20)
    check_demo_settings(out, other)
    assert json.loads((out / SETTINGS_FILE).read_text())["max_examples"] == 20
    assert not (out / SECONDS_FILE).exists() and not (out / "before" / ENCODE_SECONDS_FILE).exists()  # restart
    (out / "before" / "metrics.json").write_text("{}")
    with pytest.raises(DprGcError, match=r"other settings \(--max-examples 20 there, \(not set\) now\)"):
        check_demo_settings(out, config)


def test_a_refused_demo_leaves_nothing_blocking_the_corrected_rerun(tmp_path, monkeypatch):
    """--max-examples below 3 is refused before anything is written; too few training questions for the batch is
    refused before the first stage, and the rerun with a lower --batch-size goes on (to measuring, stubbed here)."""
    from dpr_gc import pipeline
    from tests.helpers import call

    out = tmp_path / "dm"
    code, err = call(main, ["demo", "--output", out, "--max-examples", "1"])
    assert (code, err) == (2, "error: --max-examples must be at least 3 (got 1)\n")
    assert not out.exists()
    model = tiny_model_folder(tmp_path)
    argv = ["demo", "--output", out, "--model", model, "--max-examples", "20", "--passage-max-length", "32"]
    code, err = call(main, argv)
    assert code == 2 and err.startswith("error: too few training questions (15) for one batch of 64 ") and \
        err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["data", "demo_settings.json"]

    def measured(*args, **kwargs):
        raise DprGcError("measuring")

    monkeypatch.setattr(pipeline, "measure", measured)
    assert call(main, [*argv, "--batch-size", "8", "--chunk-size", "2"]) == (2, "error: measuring\n")


def test_the_demo_table_is_a_markdown_table_of_its_own_after_trainings(tmp_path, monkeypatch, capsys):
    """Training's summary table ends just before the demo prints its before/after table: a blank line parts the
    two, or as Markdown the demo's rows would run on as rows of training's table."""
    from dpr_gc import pipeline
    from dpr_gc.base.tables import format_summary

    measured = {"answers": {f"Accuracy@{k}": 0.5 for k in pipeline.TABLE_KS},
                "qrels": {"nDCG@10": 0.5, "MRR@10": 0.5, "Recall@100": 0.5}}
    outputs = {name: str(tmp_path / name) for name in ("model", "index", "run", "results", "metrics", "plot")}

    def trained_and_measured(config):
        print(format_summary({"steps": 5}, 1.0))  # as train ends, inside the demo
        return {"before": measured, "after": measured, "seconds": 1.0, "outputs": outputs}

    monkeypatch.setattr(pipeline, "run_demo", trained_and_measured)
    assert main(["demo", "--output", str(tmp_path / "demo")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| metric (held-out test) | before training | after training |")
    assert lines[header - 1] == "" and lines[header - 2] == "| time | 1.00 s |", lines
    assert summary_rows("\n".join(lines[header:]))["trained retriever"] == outputs["model"]


def test_a_resumed_demos_time_row_is_this_runs_and_its_metrics_keep_the_total(tmp_path, monkeypatch, capsys):
    """docs/stages.md: every closing summary's ``time`` row is the command's own. A demo resumed after runs that took
    (as its ``.seconds.json`` says) a million seconds printed those in its ``time`` row (a 2.3 s rerun printed
    575.9 s); the row is this run's, and ``metrics.json``'s ``seconds`` keeps the total of every run (README)."""
    from dpr_gc import pipeline
    from dpr_gc.data import stdlib_data

    out, earlier = tmp_path / "demo", 10.0**6
    measured = {"answers": {f"Accuracy@{k}": 0.5 for k in pipeline.TABLE_KS},
                "qrels": {"nDCG@10": 0.5, "MRR@10": 0.5, "Recall@100": 0.5}}

    def trained(training, out, train_file):
        (out / "training" / "final").mkdir(parents=True)
        (out / "training" / "final" / "retriever_config.json").write_text("{}")
        (out / "training" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')

    monkeypatch.setattr(stdlib_data, "build_stdlib_dataset", lambda folder, **kwargs: {
        "counts": {"train_queries": 64}, "files": {"dpr_train": "dpr_train.json"}})
    monkeypatch.setattr(pipeline, "check_start_model", lambda name: None)
    monkeypatch.setattr(pipeline, "save_base_model", lambda model, folder: None)
    monkeypatch.setattr(pipeline, "_subset_training_file", lambda source, target, limit: source)
    monkeypatch.setattr(pipeline, "measure", lambda *args: measured)
    monkeypatch.setattr(pipeline, "train_demo", trained)
    out.mkdir()
    (out / pipeline.SECONDS_FILE).write_text(json.dumps({"seconds": earlier}))  # the earlier runs' time
    assert main(["demo", "--output", str(out), "--batch-size", "64", "--chunk-size", "16"]) == 0
    time_row = summary_rows(capsys.readouterr().out.split("| metric (held-out test) |")[-1])["time"]
    assert float(time_row.removesuffix(" s")) < earlier, time_row
    assert json.loads((out / "metrics.json").read_text())["seconds"] >= earlier


@pytest.mark.parametrize("model, why", [("absolute", "no such folder"), ("./missing", "no such folder"),
                                        ("../missing", "no such folder"), ("beside/missing", "no such folder"),
                                        ("empty", "not a model folder"), ("hub-org/hub-model", "HF_HUB_OFFLINE"),
                                        ("beside/qa.csv", "a file, not a model folder"),
                                        ("dpr.cp", "a file, not a model folder")])
def test_a_model_that_cannot_load_is_refused_before_anything_is_written(tmp_path, monkeypatch, model, why):
    """README: "Settings are checked before anything is written where the flags tell". A --model path that does not
    exist (absolute, ./ or ../, or inside a folder that exists here: no Hub name), a folder holding no model, a file
    (the demo starts from a folder or a Hub name; a DPR .cp checkpoint too is a file), or a Hub name while the Hub
    is off was found only once the whole dataset was built, which stayed in --output with the settings record."""
    from dpr_gc.data import stdlib_data
    from tests.helpers import call

    def not_built(*args, **kwargs):
        raise AssertionError("the dataset was built before the model was checked")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(stdlib_data, "build_stdlib_dataset", not_built)
    (tmp_path / "beside").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "beside" / "qa.csv").write_text("who?\t[\"me\"]\n")
    (tmp_path / "dpr.cp").write_bytes(b"PK")
    name = str(tmp_path / "nonexistent") if model == "absolute" else model
    out = tmp_path / "demo"
    code, err = call(main, ["demo", "--output", out, "--model", name])
    assert code == 2 and err.count("\n") == 1 and f"model {name!r}" in err and why in err, err
    assert not out.exists()


def test_a_passage_length_with_no_room_is_refused_before_the_base_model_is_saved(tmp_path, monkeypatch):
    """--passage-max-length 1 leaves a BERT passage no token beside [CLS] and [SEP]: refused, naming the flag, before
    the base model is saved, so the rerun with a length that has room goes on. The base model was saved first and
    the 'before' encoding refused the length; the rerun was then refused as a run with other settings."""
    from dpr_gc import pipeline
    from tests.helpers import call

    out = tmp_path / "pl"
    argv = ["demo", "--output", out, "--model", tiny_model_folder(tmp_path), "--max-examples", "8", "--train-queries",
            "4", "--batch-size", "4", "--chunk-size", "1"]
    assert call(main, [*argv, "--passage-max-length", "1"]) == (
        2, "error: --passage-max-length 1 leaves no room for the passage's text beside the tokenizer's 2 special "
           "tokens; raise it\n")
    assert not (out / "base_model").exists()

    def measured(*args, **kwargs):
        raise DprGcError("measuring")

    monkeypatch.setattr(pipeline, "measure", measured)
    assert call(main, [*argv, "--passage-max-length", "16"]) == (2, "error: measuring\n")
    assert json.loads((out / "base_model" / "retriever_config.json").read_text())["passage_max_length"] == 16


def test_a_diverged_training_leaves_nothing_blocking_the_rerun_with_another_learning_rate(tmp_path, monkeypatch):
    """--learning-rate 1e30 diverges before training's first checkpoint: the training folder holds nothing a rerun
    would reuse, so the rerun with another learning rate records it and goes on to train (stopped here), keeping
    the base model and the 'before' measurement, which do not depend on it. It was refused as a run with other
    settings, though no rerun could ever resume that training."""
    from dpr_gc import pipeline
    from dpr_gc.pipeline import SETTINGS_FILE
    from tests.helpers import call

    def measured(model_dir, name, out, *args):
        (out / name).mkdir(exist_ok=True)
        (out / name / "metrics.json").write_text("{}")  # a finished stage, as measure leaves it
        return {}

    monkeypatch.setattr(pipeline, "measure", measured)
    out = tmp_path / "lr"
    argv = ["demo", "--output", out, "--model", tiny_model_folder(tmp_path), "--max-examples", "200",
            "--train-queries", "64", "--batch-size", "32", "--chunk-size", "8", "--passage-max-length", "32"]
    code, err = call(main, [*argv, "--learning-rate", "1e30"])
    assert code == 2 and "training diverged" in err and "no checkpoint was written" in err, err
    base = (out / "base_model" / "retriever_config.json").stat().st_mtime_ns

    def trained(*args):
        raise DprGcError("training")

    monkeypatch.setattr(pipeline, "train_demo", trained)
    assert call(main, argv) == (2, "error: training\n")
    assert json.loads((out / SETTINGS_FILE).read_text())["training"]["optim"]["learning_rate"] == 5e-5
    assert (out / "base_model" / "retriever_config.json").stat().st_mtime_ns == base


def test_a_demo_record_protects_the_settings_of_the_stages_that_hold_work(tmp_path):
    """A changed setting is refused only where a stage that holds work a rerun reuses depends on it: the base model
    on the model and its retriever settings, 'before' on those, the dataset's and the measuring's, training (once
    it has a checkpoint) on every training setting. The others are recorded anew, and the training subset, cut for
    the old settings, is cut again."""
    from dpr_gc.pipeline import SETTINGS_FILE, check_demo_settings

    out, config = tmp_path / "demo", DemoConfig()
    check_demo_settings(out, config)
    for name in ("base_model/retriever_config.json", "before/metrics.json", "train_subset.json",
                 "training/metrics.jsonl", "training/train_config.json", "cache/train_subset.json-1.arrow"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    r, training = dataclasses.replace, config.training
    faster = r(config, training=r(training, optim=r(training.optim, learning_rate=1e-4)))
    check_demo_settings(out, faster)
    assert json.loads((out / SETTINGS_FILE).read_text())["training"]["optim"]["learning_rate"] == 1e-4
    assert not (out / "train_subset.json").exists()
    shorter = r(faster, training=r(training, model=r(training.model, retriever=r(training.model.retriever,
                                                                                passage_max_length=64))))
    with pytest.raises(DprGcError, match=r"other settings \(--passage-max-length 128 "
                                         r"there, 64 now\); its base_model/ and before/ would be reused as they are"):
        check_demo_settings(out, shorter)
    with pytest.raises(DprGcError, match=r"\(top_k 100 there, 20 now\); its before/ would be reused"):
        check_demo_settings(out, r(faster, top_k=20))
    reseeded = r(faster, training=r(faster.training, run=r(faster.training.run, seed=1)))  # another dataset
    with pytest.raises(DprGcError, match=r"\(--seed 0 there, 1 now\); its before/ would be reused as it is"):
        check_demo_settings(out, reseeded)
    (out / "training" / "checkpoint-4").mkdir()
    (out / "training" / "checkpoint-4" / "train_state.json").write_text("{}")
    with pytest.raises(DprGcError, match=r"--learning-rate 0\.0001 there, 5e-05 now\); its training/ would be reused"):
        check_demo_settings(out, config)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_the_demos_time_survives_a_run_stopped_by_a_signal(tmp_path, sig):
    """README: ``metrics.json``'s ``seconds`` counts every run of the demo. A run stopped by SIGTERM (``timeout``,
    Slurm, ``docker stop``) stops as Ctrl-C does, saying what it kept, and saves its time; one killed (SIGKILL) has
    its time saved while it ran, to within the saving period. Both lost it: the time was saved only on the way out
    of Python."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from dpr_gc.pipeline import CLOCK_SAVE_SECONDS, SECONDS_FILE

    out, marker = tmp_path / "demo", tmp_path / "building"
    script = ("import sys, time\nfrom dpr_gc import pipeline\nfrom dpr_gc.data import stdlib_data\n"
              "pipeline.CLOCK_SAVE_SECONDS = 0.5\n"
              f"def building(*args, **kwargs):\n    open({str(marker)!r}, 'w').close()\n"
              "    for _ in range(1200):\n        time.sleep(0.1)\n"  # short sleeps: see the Ctrl-C test of retrieve
              "stdlib_data.build_stdlib_dataset = building\nfrom dpr_gc.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), DPR_GC_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-c", script, "demo", "--output", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the demo did not reach its dataset"
        time.sleep(2.5)
        proc.send_signal(getattr(signal, sig))
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    seconds = json.loads((out / SECONDS_FILE).read_text())["seconds"]
    if sig == "SIGTERM":
        assert code == 130 and err.strip().splitlines()[-1].startswith("interrupted: "), err
        assert seconds >= 2.5
    else:
        assert code == -signal.SIGKILL and seconds >= 1.5
    readme = " ".join((root / "README.md").read_text().split())
    assert f"a run killed outright loses at most the last {CLOCK_SAVE_SECONDS:.0f} s of its time" in readme



@pytest.mark.parametrize("member", ["training/final", "base_model", "data/model"])
def test_a_model_inside_what_the_demo_writes_in_its_folder_is_refused(tmp_path, monkeypatch, member):
    """The demo writes data/, base_model/, training/, before/ and after/ in --output: a --model inside one of them
    (a trained model given back as the base of a rerun in the same folder) would be overwritten or removed by the
    run; refused before anything is written, naming the member and both flags."""
    from dpr_gc.data import stdlib_data
    from dpr_gc.pipeline import DemoFlags, check_demo_settings
    from tests.helpers import call

    def not_built(*args, **kwargs):
        raise AssertionError("the demo ran")

    monkeypatch.setattr(stdlib_data, "build_stdlib_dataset", not_built)
    out = tmp_path / "demo"
    model = out / member
    check_demo_settings(out, DemoFlags(output=str(out), model=str(model)).config())
    model.parent.mkdir(parents=True, exist_ok=True)
    tiny_model_folder(tmp_path).rename(model)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    top = member.split("/")[0]
    code, err = call(main, ["demo", "--output", out, "--model", model])
    assert (code, err) == (2, f"error: the input --model {model} is {top} in the output folder --output {out}, which "
                              "the run writes or removes; move the input out of that folder, or give another "
                              "--output\n")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
