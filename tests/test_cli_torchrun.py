"""Stages without a distributed mode refuse a torchrun launch in one line (each rank did all the work: index's
second rank reported its sibling's lock as another run, retrieve's ranks wrote the same file); encode under a real
torchrun launch writes one shard per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpr_gc import cli
from dpr_gc.cli import main
from dpr_gc.train.checkpoints import STATE_JSON
from tests.helpers import call, gather, load_script, passages, summary_rows, write_corpus
from tests.ranks import run_command
from tests.train_data import make_records, write_dpr

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [["index", "--embeddings", "emb", "--output", "idx"],
                                  ["retrieve", "--index", "idx", "--queries", "q.csv", "--output", "out.json"],
                                  ["mine", "--output", "mined.json"]])
def test_stages_without_a_distributed_mode_refuse_torchrun_in_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: run dpr-gc {argv[0]} without torchrun: it has no distributed mode (only train, verify, "
                   "encode run under torchrun)\n"), err
    assert not any(tmp_path.iterdir()), "nothing is written"
    monkeypatch.setenv("LOCAL_RANK", "1")  # every rank reaches the refusal alike: the machine's first prints it
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == ""


def test_a_single_process_is_not_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["index", "--embeddings", "emb", "--output", "idx"]) == 2
    assert "without torchrun" not in capsys.readouterr().err


def test_a_world_size_that_is_not_a_number_is_one_error_line(tmp_path, monkeypatch, capsys):
    """A WORLD_SIZE that is no whole number is refused in one line naming it (a traceback before)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert cli.main(["cache"]) == 2
    assert capsys.readouterr().err == ("error: the environment's WORLD_SIZE must be a whole number (torchrun sets it), "
                                       "got 'abc'; unset it to run in one process\n")


@pytest.mark.parametrize("env,said", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are not: launch "
                          "with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "WORLD_SIZE=2 is set but RANK is not: launch with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT are "
                                                          "not: launch with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "RANK=2 is not below WORLD_SIZE=2: launch with torchrun, or unset WORLD_SIZE"),
    ({"RANK": "abc"}, "the environment's RANK must be a whole number (torchrun sets it), got 'abc'; unset it to run "
                      "in one process"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"},
     "the environment's LOCAL_RANK must be a whole number (torchrun sets it), got 'x'; unset it to run in one process"),
])
def test_a_launch_environment_torchrun_would_not_set_is_one_error_line(env, said, tmp_path, monkeypatch, capsys):
    """WORLD_SIZE=2 without RANK ended in init_process_group's 44-line traceback, RANK=abc in int()'s ValueError; each
    is refused in one line naming the variable, before anything loads (no process group is joined here: an attempt
    fails the test at once, where joining would wait for ranks that never come)."""
    import torch.distributed as dist

    def joined(*args, **kwargs):
        raise AssertionError("a process group was joined")

    monkeypatch.setattr(dist, "init_process_group", joined)
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", "--train", "t.json", "--output", "out"]) == 2
    assert capsys.readouterr().err == f"error: {said}\n"
    assert not any(tmp_path.iterdir()), "nothing is written"


def encode_under_torchrun(tmp_path: Path, model: Path, corpus: Path, *flags: str) -> subprocess.CompletedProcess:
    """``dpr-gc encode`` launched by torchrun on 2 CPU ranks, killed with its ranks on a time limit."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "dpr_gc.cli", "encode", "--model", str(model), "--corpus", str(corpus), "--device", "cpu",
                        "--cache-dir", str(tmp_path / "c"), "--batch-size", "4", *flags], limit_s=180, env=env)


def test_each_torchrun_rank_encodes_its_own_shard_into_one_folder(tmp_path, make_retriever):
    """stages.md: under torchrun each rank encodes its own shard into one folder; the two shards hold the corpus
    whole, as one process encodes it. A --shard-id under torchrun is refused in one line: rank 1 found rank 0's
    lock on shard 0 ('in use by another run') and torchrun reported a failed child."""
    make_retriever(passage_max_length=16).save(tmp_path / "model")
    rows = passages(11)
    corpus = write_corpus(tmp_path / "data", rows, "tsv")
    run = encode_under_torchrun(tmp_path, tmp_path / "model", corpus, "--output", str(tmp_path / "emb"),
                                "--precision", "fp32", "--dtype", "float32")
    assert run.returncode == 0, run.stderr[-3000:]
    # rank 1 logs warnings only, as train's ranks do; each rank's table names its shard
    assert "shard-00000-of-00002: 5 passages written" in run.stderr, run.stderr[-3000:]
    assert "shard-00001-of-00002" not in "\n".join(line for line in run.stderr.splitlines() if " INFO " in line)
    tables = ["| item |" + table for table in run.stdout.split("| item |")[1:]]
    assert sorted(summary_rows(table)["shard"] for table in tables) == ["0 of 2", "1 of 2"], run.stdout
    assert sorted(p.name for p in (tmp_path / "emb").glob("*.json")) == ["shard-00000-of-00002.json",
                                                                        "shard-00001-of-00002.json"]
    ids, emb = gather(tmp_path / "emb")
    assert main(["encode", "--model", str(tmp_path / "model"), "--corpus", str(corpus), "--device", "cpu",
                 "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "one"), "--precision", "fp32",
                 "--dtype", "float32"]) == 0
    one_ids, one = gather(tmp_path / "one")
    assert ids == one_ids == [r[0] for r in rows]
    np.testing.assert_allclose(emb, one, atol=1e-5)

    run = encode_under_torchrun(tmp_path, tmp_path / "model", corpus, "--output", str(tmp_path / "refused"),
                                "--shard-id", "0", "--num-shards", "1")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode != 0 and len(errors) == 1 and "torchrun gives each rank its shard" in errors[0], errors
    assert "in use by another run" not in run.stderr and not (tmp_path / "refused").exists()


def test_a_refusal_every_rank_reaches_alike_is_one_line(tmp_path, make_retriever):
    """training.md: one process shows the refusal. A new run into a folder holding checkpoints printed the same
    `error:` line once per rank (8 copies on 8 GPUs)."""
    make_retriever(passage_max_length=16).save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    (tmp_path / "out" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-1" / STATE_JSON).write_text("{}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       "-m", "dpr_gc.cli", "train", "--model", str(tmp_path / "model"), "--train", str(data),
                       "--output", str(tmp_path / "out"), "--device", "cpu", "--num-workers", "0",
                       "--cache-dir", str(tmp_path / "c")], limit_s=180, env=env)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode != 0 and len(errors) == 1 and "already holds checkpoints" in errors[0], run.stderr[-3000:]


def test_a_bad_command_line_under_torchrun_is_one_line(tmp_path):
    """A flag argparse refuses is refused alike by every rank: each machine's first rank prints the `error:` line,
    the others exit 2 silently (2 ranks printed it twice)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       "-m", "dpr_gc.cli", "train", "--bogus-flag", "--model", "m", "--train", "t.json",
                       "--output", str(tmp_path / "out")], limit_s=120, env=env)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode != 0 and len(errors) == 1 and "--bogus-flag" in errors[0], run.stderr[-3000:]


def test_help_under_torchrun_prints_once(tmp_path):
    """``--help`` under torchrun: each machine's first rank prints the help, the others exit 0 silently (2 ranks
    printed it twice, interleaved)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       "-m", "dpr_gc.cli", "train", "--help"], limit_s=120, env=env)
    assert run.returncode == 0 and run.stdout.count("usage: dpr-gc train") == 1, run.stdout[-3000:]


@pytest.mark.parametrize("case", ["corpus line", "model", "other shards"])
def test_encodes_refusals_of_its_files_are_printed_by_one_rank(tmp_path, monkeypatch, capsys, make_retriever, case):
    """docs/distributed.md: a refusal every rank reaches alike is printed by each machine's first rank, the others
    exit with its status silently. encode's refusals of a damaged --corpus line, a --model that does not load, and
    an --output holding shards of another number of shards came once per rank."""
    model, out = tmp_path / "model", tmp_path / "emb"
    make_retriever(passage_max_length=16).save(model)
    corpus = write_corpus(tmp_path / "data", passages(6), "tsv")
    if case == "corpus line":
        corpus.write_text(corpus.read_text() + "bad\tline\n")
    if case == "model":
        model = tmp_path / "not-a-model"
        model.mkdir()
    if case == "other shards":
        assert main(["encode", "--model", str(model), "--corpus", str(corpus), "--output", str(out), "--device",
                     "cpu", "--cache-dir", str(tmp_path / "c")]) == 0
    argv = ["encode", "--model", str(model), "--corpus", str(corpus), "--output", str(out), "--device", "cpu",
            "--cache-dir", str(tmp_path / "c")]
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main(argv) == 2
    shown = capsys.readouterr().err
    assert shown.startswith("error: ") and shown.count("\n") == 1, shown
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err == ""


def test_a_later_rank_command_run_in_process_leaves_the_info_lines_on(tmp_path, monkeypatch, caplog):
    """A command run in-process as a torchrun rank other than 0 turns the INFO lines off for its run (a filter on
    the root logger's handlers); as it ends they are on again, so the process's later lines (a library call, the
    next command) are not lost. The filter stayed on every handler it met."""
    import logging

    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert main(["encode", "--model", str(tmp_path / "missing"), "--corpus", str(tmp_path / "c.tsv"), "--output",
                 str(tmp_path / "emb")]) == 2
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    with caplog.at_level(logging.INFO):
        logging.getLogger("dpr_gc.test").info("a later line")
    assert "a later line" in caplog.text
    assert not any(f.__name__ == "warnings_and_errors" for h in logging.getLogger().handlers
                   for f in h.filters if callable(f)), logging.getLogger().handlers


def test_dense_retriever_refuses_torchrun_as_retrieve_does(tmp_path, monkeypatch):
    """The DPR-style front end of retrieve refuses a torchrun launch in the same one line (each rank built the index
    and wrote the same results file)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code, err = call(load_script("dense_retriever").main, ["--model_file", "m", "--qa_file", "q.csv",
                                                            "--encoded_ctx_file", "emb", "--out_file", "out.json"])
    assert (code, err) == (2, "error: run dense_retriever.py without torchrun: it has no distributed mode (only train, "
                              "verify, encode run under torchrun)\n")
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_download_dpr_data_refuses_torchrun_as_the_stages_do(tmp_path, monkeypatch):
    """The download script under torchrun had every rank download every file into the same folder; it refuses the
    launch in the same one line as the stages without a distributed mode, before it writes or fetches anything
    (the resource's URL is a closed local port: a fetch would end in another error)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    script = load_script("download_dpr_data")
    monkeypatch.setattr(script, "RESOURCES", {"qa": ("http://127.0.0.1:1/qa.csv", "qa.csv", "", None)})
    for extra in ([], ["--dry-run"]):
        code, err = call(script.main, ["--output", str(tmp_path / "dpr"), "qa", *extra])
        assert (code, err) == (2, "error: run download_dpr_data.py without torchrun: it has no distributed mode (only "
                                  "train, verify, encode run under torchrun)\n")
    assert not any(tmp_path.iterdir()), "nothing is written"
