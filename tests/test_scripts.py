"""Command-line scripts: argument handling (the DPR download cannot run offline; nothing is downloaded here), and
the GC-DPR/DPR README command lines on tiny data, which print only dpr-gc's own lines as dpr-gc does (the scripts
configured logging themselves and let FAISS's loader lines, datasets' JAX notice and transformers' weight-loading
bars through) unless given --verbose."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import foreign_lines, load_script

REPO = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                          cwd=REPO)


def assert_quiet(result: subprocess.CompletedProcess, script: str) -> None:
    """``script`` succeeded printing only dpr-gc's log lines and bars: no dependency's line, no cursor movement."""
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\x1b" not in result.stderr, f"{script}: a cursor movement in the log"
    assert foreign_lines(result.stderr) == [], f"{script} printed lines that are not dpr-gc's own"


def test_download_lists_and_dry_runs(tmp_path):
    listed = run("download_dpr_data.py", "--list")
    assert listed.returncode == 0 and "psgs_w100" in listed.stdout and "nq-train" in listed.stdout
    dry = run("download_dpr_data.py", "--dry-run", "--output", str(tmp_path / "dpr"), "nq-train", "nq-test")
    assert dry.returncode == 0
    assert "biencoder-nq-train.json.gz" in dry.stdout and "nq-test.qa.csv" in dry.stdout
    assert not (tmp_path / "dpr").exists()
    (tmp_path / "dpr").mkdir()
    (tmp_path / "dpr" / "nq-test.qa.csv").write_text("q\t['a']\n")
    again = run("download_dpr_data.py", "--dry-run", "--output", str(tmp_path / "dpr"), "nq-test")
    assert "already there" in again.stdout


@pytest.mark.parametrize("args,message", [(["nq-trian"], "unknown resource nq-trian; choose from nq-train, "),
                                          ([], "at least one resource"),
                                          (["--bogus"], "unrecognized arguments: --bogus")])
def test_download_rejects_bad_arguments_in_one_line(args, message):
    bad = run("download_dpr_data.py", *args)
    assert bad.returncode == 2 and message in bad.stderr
    assert bad.stderr.startswith("error: download_dpr_data.py: ") and bad.stderr.count("\n") == 1, bad.stderr
    assert ("did you mean nq-train?" in bad.stderr) == (args == ["nq-trian"])


def test_dense_retriever_names_the_closest_flag_of_one_it_takes_with_no_effect(tmp_path):
    """DPR's retriever takes flags it has no use for (hydra overrides) with a warning; a misspelt flag of its own is
    among them, so the warning names the flag it is close to."""
    result = run("dense_retriever.py", "--model_file", str(tmp_path / "m"), "--qa_file", str(tmp_path / "q.csv"),
                 "--ctx_file", str(tmp_path / "c.tsv"), "--encoded_ctx_file", str(tmp_path / "e"), "--out_file",
                 str(tmp_path / "o.json"), "--n_dosc", "5")
    warning = next(line for line in result.stderr.splitlines() if "WARNING" in line)
    assert warning.endswith("accepted with no effect here: --n_dosc 5 (did you mean --n_docs?)"), warning


def test_train_script_names_itself_and_the_closest_flag():
    """The script runs ``dpr-gc train``'s parser as its only command: a misspelt flag's line names the script (not a
    ``train`` command never typed) and the closest GC-DPR flag."""
    bad = run("train_dense_encoder.py", "--q_chunk_sise", "4")
    assert bad.returncode == 2 and bad.stderr == ("error: train_dense_encoder.py: unrecognized arguments: "
                                                  "--q_chunk_sise 4; did you mean --q_chunk_size? (see "
                                                  "train_dense_encoder.py --help)\n"), bad.stderr


def test_train_script_accepts_gc_dpr_flags(tmp_path):
    result = run("train_dense_encoder.py", "--train_file", str(tmp_path / "missing.json"), "--output_dir",
                 str(tmp_path / "out"), "--grad_cache", "--q_chunk_size", "4", "--ctx_chunk_size", "8",
                 "--batch_size", "16", "--hard_negatives", "1", "--other_negatives", "0", "--fp16",
                 "--pretrained_model_cfg", str(tmp_path / "model"))
    assert result.returncode == 2
    assert "missing.json" in result.stderr and "unrecognized" not in result.stderr


# ------------------------------------------------------------------ GC-DPR / DPR command lines on tiny data
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny Hugging Face BERT folder, DPR training/dev files, a passages TSV and a QA file."""
    import json

    from transformers import BertTokenizerFast

    from tests.helpers import tiny_bert, write_vocab
    from tests.train_data import make_records, write_dpr

    d = tmp_path_factory.mktemp("dpr")
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(d / "vocab.txt")), do_lower_case=True)
    tiny_bert(len(tokenizer)).save_pretrained(d / "bert")
    tokenizer.save_pretrained(d / "bert")
    records = make_records(40, 7)
    (d / "data").mkdir()
    write_dpr(d / "data" / "nq-train.json", records[:32])
    write_dpr(d / "data" / "nq-dev.json", records[32:])
    rows = [c for r in records for c in r["positive_ctxs"] + r["hard_negative_ctxs"]]
    (d / "psgs.tsv").write_text("id\ttext\ttitle\n" + "".join(f"{c['passage_id']}\t{c['text']}\t{c['title']}\n"
                                                               for c in rows))
    (d / "qa.csv").write_text("".join(f"{r['question']}\t{json.dumps(r['answers'])}\n" for r in records[:6]))
    return {"dir": d, "bert": d / "bert", "records": records}


def gc_dpr_readme_command(tiny: dict, out: Path) -> list[str]:
    """GC-DPR README's single-GPU NQ command, sizes shrunk to the tiny data (every flag as documented)."""
    d = tiny["dir"]
    return ["--max_grad_norm", "2.0", "--encoder_model_type", "hf_bert", "--pretrained_model_cfg", str(tiny["bert"]),
            "--seed", "12345", "--sequence_length", "32", "--warmup_steps", "2", "--batch_size", "8",
            "--do_lower_case", "--train_file", str(d / "data" / "nq-train*"), "--dev_file", str(d / "data" / "nq-dev*"),
            "--output_dir", str(out), "--learning_rate", "2e-05", "--num_train_epochs", "2", "--dev_batch_size", "4",
            "--val_av_rank_start_epoch", "30", "--grad_cache", "--global_loss_buf_sz", "2097152",
            "--val_av_rank_max_qs", "5", "--q_chunk_size", "4", "--ctx_chunk_size", "8", "--eval_per_epoch", "2"]


def test_gc_dpr_readme_training_command_runs(tiny, tmp_path):
    import json

    result = run("train_dense_encoder.py", *gc_dpr_readme_command(tiny, tmp_path / "out"), "--num-workers", "0",
                 "--cache-dir", str(tmp_path / "cache"))
    assert_quiet(result, "train_dense_encoder.py")
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "--do_lower_case" in warnings[0] and "--global_loss_buf_sz" in warnings[0]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "dev_avg_rank" in r] == [0, 2, 4, 6, 8]  # 4 steps/epoch, 2 evals each
    # and a checkpoint each time (docs/dpr.md), of which the default --keep-checkpoints 2 leaves the newest two
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert "dev validation over 5 questions" in result.stderr
    from dpr_gc.model.retriever import Retriever

    assert not Retriever.load(tmp_path / "out" / "final").config.shared_encoder  # DPR's two towers


def test_eval_per_epoch_without_a_dev_file_is_logged_as_checkpoints_only(caplog):
    """GC-DPR's ``--eval_per_epoch`` evaluates and saves N times an epoch; without ``--dev_file`` only the
    checkpoints happen, and the log says so (it announced dev evaluations that never ran)."""
    import logging
    from types import SimpleNamespace

    from dpr_gc.train.trainer import Trainer

    for dev_file, said in ((None, "2 checkpoints (no --dev_file: nothing to evaluate) per epoch: every 32 steps"),
                           ("dev.json", "2 dev evaluations and checkpoints per epoch: every 32 steps")):
        config = SimpleNamespace(run=SimpleNamespace(eval_every=None, save_every=None, eval_per_epoch=2),
                                 data=SimpleNamespace(dev_file=dev_file))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
            assert Trainer.schedule(SimpleNamespace(config=config, steps_per_epoch=64)) == (32, 32)
        assert [r.getMessage() for r in caplog.records] == [said]


def test_eval_per_epoch_logs_the_evaluations_that_happen(caplog):
    """``--eval_per_epoch 3`` with 4 steps an epoch evaluates every 2 steps: twice an epoch, which the line says (it
    said 3); with 5 steps an epoch, every 2 steps is two or three times an epoch."""
    import logging
    from types import SimpleNamespace

    from dpr_gc.train.trainer import Trainer

    for steps, said in ((4, "2 dev evaluations and checkpoints per epoch: every 2 steps (--eval_per_epoch 3)"),
                        (5, "2 to 3 dev evaluations and checkpoints per epoch: every 2 steps (--eval_per_epoch 3)"),
                        (6, "3 dev evaluations and checkpoints per epoch: every 2 steps")):
        config = SimpleNamespace(run=SimpleNamespace(eval_every=None, save_every=None, eval_per_epoch=3),
                                 data=SimpleNamespace(dev_file="dev.json"))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dpr_gc.train.trainer"):
            assert Trainer.schedule(SimpleNamespace(config=config, steps_per_epoch=steps)) == (2, 2)
        assert [r.getMessage() for r in caplog.records] == [said]


def test_gc_dpr_flags_land_in_the_config(tiny, tmp_path, monkeypatch):
    """Every GC-DPR/DPR flag with a meaning here lands in the field of its group (and nothing else moves)."""
    from dpr_gc.train.config import TrainConfig
    from dpr_gc.train.validation import DevLimits

    script = load_script("train_dense_encoder.py")
    argv = gc_dpr_readme_command(tiny, tmp_path / "out") + [
        "--adam_eps", "1e-6", "--adam_betas", "(0.8, 0.99)", "--projection_dim", "16", "--log_batch_step", "3",
        "--hard_negatives", "2", "--other_negatives", "1", "--shuffle_positive_ctx", "--val_av_rank_hard_neg", "7",
        "--val_av_rank_other_neg", "3", "--val_av_rank_bsz", "9", "--fp16", "--no_cuda", "--weight_decay", "0.01",
        "--checkpoint_file_name", "dpr_biencoder", "--train_files_upsample_rates", "[2]",
        "--model_file", str(tiny["bert"] / "missing.cp")]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = script.build_parser().parse_args(["train", *argv, "--local_rank", "1"])
    given = script.typed_flags(argv)
    config = script.config_from_args(args, given)
    assert os.environ["LOCAL_RANK"] == "1"  # torch.distributed.launch's --local_rank: the rank's device
    monkeypatch.setenv("LOCAL_RANK", "0")
    script.config_from_args(args, given)
    assert os.environ["LOCAL_RANK"] == "0"  # a launcher's own LOCAL_RANK wins
    assert isinstance(config, TrainConfig)
    model, data, optim, cache, run = config.model, config.data, config.optim, config.cache, config.run
    assert model.name == str(tiny["bert"] / "missing.cp")  # --model_file wins over --pretrained_model_cfg
    r = model.retriever
    assert (r.query_max_length, r.passage_max_length, r.projection_dim, r.shared_encoder) == (32, 32, 16, False)
    assert data.train_files == [str(tiny["dir"] / "data" / "nq-train.json")]
    assert data.dev_file == str(tiny["dir"] / "data" / "nq-dev.json")
    assert (data.batch_size, data.hard_negatives, data.other_negatives, data.shuffle_positives) == (8, 2, 1, True)
    assert data.sampling_rates == [2.0]
    assert data.dev == DevLimits(max_questions=5, hard_negatives=7, other_negatives=3, batch_size=4,
                                 encode_batch_size=9)
    assert (optim.max_grad_norm, optim.warmup_steps, optim.epochs, optim.precision) == (2.0, 2, 2, "fp16")
    assert (optim.learning_rate, optim.adam_eps, optim.adam_betas, optim.weight_decay) == (2e-5, 1e-6, (0.8, 0.99), 0.01)
    assert (cache.enabled, cache.query_chunk_size, cache.passage_chunk_size) == (True, 4, 8)
    assert (run.output_dir, run.seed, run.device, run.log_every, run.eval_per_epoch) == (
        str(tmp_path / "out"), 12345, "cpu", 3, 2)
    assert "--checkpoint_file_name" in " ".join(script.ignored_flags(given))
    assert args.model == str(tiny["bert"]) and args.projection_dim == 16 and args.epochs == 2.0  # args left as parsed
    plain = script.config_from_args(script.build_parser().parse_args(
        ["train", "--train_file", str(tiny["dir"] / "data" / "nq-train.json"), "--output_dir", "o",
         "--pretrained_model_cfg", "m"]), set())
    assert plain.cache.enabled is False and plain.run.eval_per_epoch == 1  # GC-DPR: plain without --grad_cache
    assert plain.model.name == "m" and plain.model.retriever.shared_encoder is False
    assert (plain.model.retriever.query_max_length, plain.model.retriever.passage_max_length) == (32, 256)
    assert plain.optim.adam_betas == (0.9, 0.999) and plain.run.device is None and plain.run.log_every == 1


@pytest.mark.parametrize("extra,message", [
    (["--gradient_accumulation_steps", "2"], "--gradient_accumulation_steps 2"),
    (["--num_train_epochs", "2.5"], "--num_train_epochs must be a whole number"),
    (["--adam_betas", "0.9"], "--adam_betas must be two numbers"),
    (["--encoder_model_type", "fairseq_roberta"], "only Hugging Face models")])
def test_gc_dpr_flags_without_a_meaning_here_stop_in_one_line(tiny, tmp_path, extra, message):
    result = run("train_dense_encoder.py", *gc_dpr_readme_command(tiny, tmp_path / "out"), *extra)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("rates,message", [
    ("[1,x]", "must be a list of positive numbers"), ("abc", "must be a list of positive numbers"),
    ("[0]", "must be a list of positive numbers"), ("2", "must be a list of positive numbers"),
    ("[1" + "0" * 400 + "]", "must be a list of positive numbers"), ("[1,2]", "needs one rate per --train_file (1: ")])
def test_bad_upsample_rates_are_refused_up_front_naming_the_scripts_flag(tiny, tmp_path, rates, message):
    """A malformed ``--train_files_upsample_rates`` was a ValueError traceback; a wrong count was refused only once
    the model and data had loaded, naming dpr-gc's --sampling-rates. Both are now one line naming the script's flag,
    from the command line's translation (nothing loaded yet)."""
    from dpr_gc.base.errors import DprGcError

    script = load_script("train_dense_encoder.py")
    argv = [*gc_dpr_readme_command(tiny, tmp_path / "out"), "--train_files_upsample_rates", rates]
    with pytest.raises(DprGcError, match="^--train_files_upsample_rates ") as refused:
        script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    assert message in str(refused.value) and rates in str(refused.value)
    if rates == "[1,x]":
        result = run("train_dense_encoder.py", *argv)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "--train_files_upsample_rates" in errors[0] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("betas", ["(1" + "0" * 400 + ", 0.9)", "(0.9, -1" + "0" * 400 + ")", "(1e400, 0.9)"])
def test_adam_betas_too_large_for_a_float_are_one_line(betas: str) -> None:
    """An --adam_betas integer past the float range ((1000...0, 0.9), 400 zeros) was an OverflowError traceback; it
    is refused in the flag's one line."""
    from dpr_gc.base.errors import DprGcError

    with pytest.raises(DprGcError, match=r"^--adam_betas must be two numbers, each in \[0, 1\)"):
        load_script("train_dense_encoder.py")._betas(betas)


def dpr_checkpoint(tiny: dict, path: Path, projection: int = 0, wrap: Any = None) -> Path:
    """A checkpoint laid out as DPR's ``dpr_biencoder.N.cp`` (two BERT towers, optional encode_proj); with ``wrap``,
    as hydra-era DPR saves it: ``encoder_params = {"do_lower_case": ..., "encoder": wrap(the encoder's settings)}``."""
    from collections import OrderedDict

    import torch

    from tests.helpers import tiny_bert

    towers = {"question_model.": tiny_bert(_vocab(tiny), seed=3),
              "ctx_model.": tiny_bert(_vocab(tiny), seed=4)}
    model_dict = OrderedDict()
    for prefix, model in towers.items():
        model_dict.update({prefix + k: v for k, v in model.state_dict().items()})
        if projection:
            model_dict[prefix + "encode_proj.weight"] = torch.randn(projection, 32)
            model_dict[prefix + "encode_proj.bias"] = torch.zeros(projection)
    params = {"do_lower_case": True, "pretrained_model_cfg": str(tiny["bert"]), "encoder_model_type": "hf_bert",
              "pretrained_file": None, "projection_dim": projection, "sequence_length": 24}
    if wrap is not None:
        params = {"do_lower_case": params.pop("do_lower_case"), "encoder": wrap(params)}
    torch.save({"model_dict": model_dict, "optimizer_dict": None, "scheduler_dict": None, "offset": 0, "epoch": 3,
                "encoder_params": params}, path)
    return path


def _vocab(tiny: dict) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(tiny["bert"])))


def test_dpr_checkpoint_loads_without_unpickling(tiny, tmp_path, capsys):
    import argparse as ap

    import torch

    from dpr_gc.base.errors import DprGcError
    from dpr_gc.model.retriever import Retriever

    cp = dpr_checkpoint(tiny, tmp_path / "dpr_biencoder.3.cp", projection=8)
    retriever = Retriever.load(cp)
    assert retriever.config.pooling == "cls" and not retriever.config.shared_encoder and retriever.dim == 8
    assert retriever.config.passage_max_length == 24
    state = torch.load(cp, weights_only=True)["model_dict"]
    assert torch.equal(retriever.passage_encoder.transformer.embeddings.word_embeddings.weight,
                       state["ctx_model.embeddings.word_embeddings.weight"])
    assert not torch.equal(state["question_model.encode_proj.weight"], state["ctx_model.encode_proj.weight"])
    for encoder, prefix in ((retriever.query_encoder, "question_model."), (retriever.passage_encoder, "ctx_model.")):
        for part in ("weight", "bias"):  # each tower's projection from its own encode_proj
            assert torch.equal(getattr(encoder.projection, part), state[f"{prefix}encode_proj.{part}"]), (prefix, part)
    script = load_script("train_dense_encoder.py")  # DPR's validation-only run: --model_file and --dev_file
    assert script.main(["--model_file", str(cp), "--dev_file", str(tiny["dir"] / "data" / "nq-dev.json"),
                        "--val_av_rank_max_qs", "3", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "| questions | 3 |" in capsys.readouterr().out
    pickled = tmp_path / "namespace.cp"
    torch.save({"model_dict": state, "encoder_params": ap.Namespace(sequence_length=24)}, pickled)
    with pytest.raises(DprGcError, match=r"cannot be read as weights only .*convert it"):
        Retriever.load(pickled)
    result = run("generate_dense_embeddings.py", "--model_file", str(pickled), "--ctx_file", str(tiny["dir"] / "psgs.tsv"),
                 "--out_file", str(tmp_path / "emb" / "wiki"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")][0].count("convert it") == 1


@pytest.mark.parametrize("script", [True, False])
@pytest.mark.parametrize("held", [(), (4, 8)])
def test_resume_from_a_missing_checkpoint_names_those_there_are(tiny, tmp_path, capsys, script, held):
    """train_dense_encoder.py and dpr-gc train: --resume checkpoint-9, which does not exist, is one error: line
    naming it and the checkpoints the output folder holds (or that it holds none), exit 2, nothing trained."""
    from dpr_gc.cli import main
    from dpr_gc.train.checkpoints import STATE_JSON

    out = tmp_path / "out"
    for step in held:
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / STATE_JSON).write_text("{}\n")
    flags = (["--pretrained_model_cfg", str(tiny["bert"]), "--train_file", str(tiny["dir"] / "data" / "nq-train.json"),
              "--output_dir", str(out), "--batch_size", "4"] if script else
             ["train", "--model", str(tiny["bert"]), "--train", str(tiny["dir"] / "data" / "nq-train.json"),
              "--output", str(out), "--batch-size", "4"])
    entry = load_script("train_dense_encoder.py").main if script else main
    assert entry([*flags, "--num-workers", "0", "--resume", "checkpoint-9", "--cache-dir", str(tmp_path / "c")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    output_flag = "--output_dir" if script else "--output"
    there = (f"{output_flag} {out} holds checkpoint-4, checkpoint-8" if held else
             f"{output_flag} {out} holds no finished checkpoint")
    assert len(errors) == 1 and errors[0].startswith("error: --resume checkpoint-9: not a checkpoint folder") \
        and there in errors[0], errors
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{step}" for step in held] if held else \
        not out.exists() or not any(out.iterdir())


def test_a_hydra_era_dpr_checkpoint_loads_with_its_nested_encoder_settings(tiny, tmp_path):
    """Hydra-era DPR saves ``encoder_params = {"do_lower_case": ..., "encoder": cfg.encoder}``: read as plain data,
    the encoder's settings (config, projection, length) come from the nested ``encoder``."""
    from dpr_gc.model.retriever import Retriever

    retriever = Retriever.load(dpr_checkpoint(tiny, tmp_path / "dpr_biencoder.1.cp", projection=8, wrap=dict))
    assert retriever.dim == 8 and retriever.config.passage_max_length == 24 and retriever.config.pooling == "cls"


@pytest.mark.parametrize("wrap, folder", [("Namespace", "plain"), ("UserDict", "plain"), ("Namespace", "it's here")])
def test_the_conversion_a_pickled_dpr_checkpoint_is_refused_with_gives_a_file_that_loads(tiny, tmp_path, wrap,
                                                                                         folder):
    """Hydra-era DPR's ``encoder`` is an OmegaConf DictConfig (simulated by objects that need unpickling, a mapping
    and an attribute bag): the refusal quotes torch's reason whole-worded, and its shell command, run as printed
    (also for a path holding a quote and a space), writes a ``.safe`` file of plain nested dicts that loads, the path
    it says to pass."""
    import argparse as ap
    import collections
    import re

    import torch

    from dpr_gc.base.errors import DprGcError
    from dpr_gc.model.retriever import Retriever

    make = (lambda d: ap.Namespace(**d)) if wrap == "Namespace" else (
        lambda d: collections.UserDict({**d, "nested": collections.UserDict({"a": [1, 2]})}))
    (tmp_path / folder).mkdir()
    cp = dpr_checkpoint(tiny, tmp_path / folder / "dpr_biencoder.2.cp", projection=8, wrap=make)
    with pytest.raises(DprGcError) as refused:
        Retriever.load(cp)
    message = str(refused.value)
    with pytest.raises(Exception) as torch_refused:
        torch.load(cp, weights_only=True)
    quoted = re.search(r"weights only \((.*?)(\.\.\.)?\); convert it", message)
    assert quoted and "GLOBAL" in quoted.group(1), message
    assert re.search(re.escape(quoted.group(1)) + r"(\W|$)", str(torch_refused.value)), message  # no word cut
    command, passed = message.split("convert it where you trust the file: ", 1)[1].rsplit(" and pass ", 1)
    assert command.startswith("python -c "), message
    shell_command = shlex.quote(sys.executable) + command.removeprefix("python")
    done = subprocess.run(["bash", "-c", shell_command], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert shlex.split(passed) == [f"{cp}.safe"], passed
    retriever = Retriever.load(f"{cp}.safe")
    assert retriever.dim == 8 and retriever.config.passage_max_length == 24


def test_the_validation_only_run_takes_the_device_and_precision_and_ends_with_a_summary(tiny, tmp_path, capsys,
                                                                                         monkeypatch, caplog):
    """DPR's validation-only run (``--model_file`` and ``--dev_file``) loaded the model on the CPU whatever the device,
    ignored ``--fp16``, showed no progress and ended with a JSON blob; it loads on the run's device, embeds under the
    precision asked, says both, and ends with the ``| item | value |`` summary of its dev metrics."""
    import logging

    from dpr_gc.base.devices import default_device
    from dpr_gc.model.retriever import Retriever
    from tests.helpers import summary_rows

    loaded, embedded = [], []
    load, embed = Retriever.load.__func__, Retriever.embed
    monkeypatch.setattr(Retriever, "load", classmethod(lambda cls, path, **kw: (loaded.append(kw.get("device")),
                                                                                load(cls, path, **kw))[1]))
    monkeypatch.setattr(Retriever, "embed", lambda self, kind, texts, *a, **kw: (
        embedded.append((kind, kw.get("dtype"), kw.get("progress") is not None)),
        embed(self, kind, texts, *a, **kw))[1])
    script = load_script("train_dense_encoder.py")
    with caplog.at_level(logging.INFO, logger="train_dense_encoder"):
        assert script.main(["--model_file", str(tiny["bert"]), "--dev_file", str(tiny["dir"] / "data" / "nq-dev.json"),
                            "--val_av_rank_max_qs", "3", "--fp16", "--cache-dir", str(tmp_path / "cache")]) == 0
    device = default_device(None)
    assert loaded == [device]
    import torch

    assert embedded == [("query", torch.float16, True), ("passage", torch.float16, True)]
    assert any(f"on {device}, precision fp16" in m for m in caplog.messages), caplog.messages
    rows = summary_rows(capsys.readouterr().out)
    assert (rows["questions"], rows["device"], rows["precision"]) == ("3", device, "fp16"), rows
    assert {"model", "dev file", "passages", "loss", "accuracy", "average rank"} <= set(rows), rows


def test_a_dpr_checkpoint_whose_config_makes_more_layers_is_refused_before_building(tiny, tmp_path):
    """The config a checkpoint names (``pretrained_model_cfg``) with 100,000 layers: both towers were built layer by
    layer for minutes before their weights were found missing; now one line names both counts at once."""
    import json
    import shutil

    import torch

    from dpr_gc.base.errors import DprGcError
    from dpr_gc.model.retriever import Retriever

    config_dir = tmp_path / "bert"
    shutil.copytree(tiny["bert"], config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    state = torch.load(dpr_checkpoint(tiny, tmp_path / "dpr_biencoder.0.cp"), weights_only=True)
    state["encoder_params"]["pretrained_model_cfg"] = str(config_dir)
    torch.save(state, tmp_path / "dpr_biencoder.0.cp")
    with pytest.raises(DprGcError, match=r"makes 100,000 layers \(num_hidden_layers\) but the checkpoint holds 2; "
                                         r"point pretrained_model_cfg at the config it was trained from"):
        Retriever.load(tmp_path / "dpr_biencoder.0.cp")


@pytest.mark.slow  # 79 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_dpr_readme_embedding_and_retrieval_commands(tiny, tmp_path, monkeypatch, capsys):
    import json

    from dpr_gc.retrieval.index import DenseIndex

    cp = dpr_checkpoint(tiny, tmp_path / "dpr_biencoder.3.cp")
    d, emb = tiny["dir"], tmp_path / "emb" / "wiki"
    for shard in ("0", "1"):
        result = run("generate_dense_embeddings.py", "--model_file", str(cp), "--ctx_file", str(d / "psgs.tsv"),
                     "--shard_id", shard, "--num_shards", "2", "--out_file", str(emb), "--batch_size", "16",
                     "--fp16", "--do_lower_case", "--cache-dir", str(tmp_path / "cache"))
        assert_quiet(result, "generate_dense_embeddings.py")
        assert len(list((tmp_path / "emb" / f"wiki_{shard}").glob("shard-*-of-*.npy"))) == 1
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "--do_lower_case" in warnings[0]
    out = tmp_path / "results.json"
    command = ["--model_file", str(cp), "--ctx_file", str(d / "psgs.tsv"), "--qa_file", str(d / "qa.csv"),
               "--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*"), "--out_file", str(out), "--n-docs", "5",
               "--validation_workers", "32", "--batch_size", "64", "--save_or_load_index",
               "--cache_dir", str(tmp_path / "cache")]
    result = run("dense_retriever.py", *command)
    assert_quiet(result, "dense_retriever.py")
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "--validation_workers" in warnings[0]
    results = json.loads(out.read_text())
    assert len(results) == 6 and all(len(r["ctxs"]) == 5 for r in results)
    assert DenseIndex.read(tmp_path / "emb" / "wiki.index").ntotal == 3 * 40  # both shards in one index
    again = run("dense_retriever.py", *command[:-2], "--cache_dir", str(tmp_path / "cache"),
                "--verbose")  # the lines the quiet runs hide exist, and --verbose shows them
    assert again.returncode == 0 and "loading the index from" in again.stderr and "faiss.loader" in again.stderr
    assert json.loads(out.read_text()) == results
    capsys.readouterr()
    script = load_script("dense_retriever.py")
    assert script.main([*command, "--hnsw_index"]) == 2  # the saved index is flat: refused, not reused
    assert "but --hnsw_index asks for an hnsw index" in capsys.readouterr().err
    added: list[int] = []  # --index_buffer: the rows added to an index built in memory per call
    real_add = DenseIndex.add
    monkeypatch.setattr(DenseIndex, "add", lambda self, rows: (added.append(len(rows)), real_add(self, rows))[1])
    in_memory = [a for a in command if a != "--save_or_load_index"]
    assert script.main(in_memory + ["--out_file", str(tmp_path / "r2.json"), "--index_buffer", "7"]) == 0
    assert sum(added) == 3 * 40 and max(added) == 7, added
    assert json.loads((tmp_path / "r2.json").read_text()) == results


def test_dense_retriever_says_dpr_pickled_embeddings_are_never_read(tmp_path, capsys):
    """DPR's ``--encoded_ctx_file`` pickles were met with advice to run ``dpr-gc encode --out_file`` (the script's
    renaming reached into a dpr-gc command, which has no --out_file): the advice keeps encode's own flag, and files
    that look like DPR's pickles are named as never read (nothing is unpickled) and to be re-encoded."""
    import pickle

    script = load_script("dense_retriever.py")
    (tmp_path / "m.cp").write_bytes(b"x")
    (tmp_path / "qa.csv").write_text("q\t['a']\n")
    (tmp_path / "psgs.tsv").write_text("id\ttext\ttitle\n1\tt\tT\n")
    common = ["--model_file", str(tmp_path / "m.cp"), "--qa_file", str(tmp_path / "qa.csv"), "--ctx_file",
              str(tmp_path / "psgs.tsv"), "--out_file", str(tmp_path / "o.json")]
    dpremb, empty = tmp_path / "dpremb", tmp_path / "empty"
    dpremb.mkdir(), empty.mkdir()
    for shard in (0, 1):  # written as DPR writes them; this test never loads them either
        (dpremb / f"wikipedia_passages_{shard}").write_bytes(pickle.dumps([(f"{shard}", [0.5, 0.25])], protocol=4))
    assert script.main(common + ["--encoded_ctx_file", str(dpremb / "wikipedia_passages_*")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: no finished embedding shards in {dpremb}, only what look "
                                                   "like DPR's pickled embedding files (wikipedia_passages_0, "
                                                   "wikipedia_passages_1); dpr-gc never reads them"), err
    assert "never unpickles" in err and "re-encode" in err and "`dpr-gc encode --output DIR`" in err
    assert "generate_dense_embeddings.py --out_file" in err
    assert script.main(common + ["--encoded_ctx_file", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: no finished embedding shards in {empty} (run `dpr-gc encode --output {empty}` first)"


def test_a_refused_encoder_model_type_is_not_first_called_accepted(tiny, tmp_path):
    """``--encoder_model_type fairseq_roberta`` drew the warning "accepted with no effect here: --encoder_model_type"
    and then the refusal; now the refusal is the only line, before any warning."""
    result = run("train_dense_encoder.py", "--train_file", str(tiny["dir"] / "data" / "nq-train.json"),
                 "--output_dir", str(tmp_path / "out"), "--pretrained_model_cfg", str(tiny["bert"]),
                 "--do_lower_case", "--encoder_model_type", "fairseq_roberta")
    assert result.returncode == 2 and "accepted with no effect" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: --encoder_model_type fairseq_roberta: only Hugging Face models")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("given,named", [(["--shard_id", "3", "--num_shards", "2"], "--shard_id must be in [0, "
                                          "--num_shards); got shard 3 of 2"),
                                         (["shard_id=3", "num_shards=2"], "--shard_id must be in [0, --num_shards)"),
                                         (["--shard-id", "3", "--num_shards", "2"], "--shard-id must be in [0, "
                                          "--num_shards)")])
def test_generate_dense_embeddings_errors_name_the_flags_typed(tmp_path, capsys, given, named):
    """The script's errors named dpr-gc encode's --shard-id/--num-shards/--output, flags a DPR command line never
    has: they now name DPR's spelling, or the one typed; a quoted dpr-gc command keeps its own flags."""
    from dpr_gc.base.errors import DprGcError, flags_renamed

    script = load_script("generate_dense_embeddings.py")
    argv = ["--model_file", str(tmp_path / "m"), "--ctx_file", str(tmp_path / "c.tsv"), "--out_file",
            str(tmp_path / "emb" / "wiki"), *given]
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {named}" or err.startswith(f"error: {named}"), err
    assert not (tmp_path / "emb").exists()
    names = script.script_flags(script.build_parser(), {"--sequence_length"})
    with pytest.raises(DprGcError) as caught, flags_renamed(names):
        raise DprGcError("--output x was written with --max-length 8; run `dpr-gc encode --output x --shard-id 1`")
    assert str(caught.value) == ("--out_file x was written with --sequence_length 8; run "
                                 "`dpr-gc encode --output x --shard-id 1`")


def test_generate_dense_embeddings_gives_each_ignored_flag_its_own_reason(tmp_path, caplog, capsys):
    """--fp16_opt_level and --local_rank were said to be defined by the model file, which defines neither."""
    import logging

    script = load_script("generate_dense_embeddings.py")
    with caplog.at_level(logging.WARNING):
        script.main(["--model_file", str(tmp_path / "m"), "--ctx_file", str(tmp_path / "c.tsv"), "--out_file",
                     str(tmp_path / "emb"), "--fp16_opt_level", "O2", "--local_rank", "0", "--projection_dim", "8",
                     "--do_lower_case"])
    capsys.readouterr()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0] == ("accepted with no effect here: --projection_dim --do_lower_case (the model file defines "
                           "them); --fp16_opt_level (an apex setting: --fp16 encodes under torch autocast); "
                           "--local_rank (the shard comes from --shard_id/--num_shards, else torchrun's RANK and "
                           "WORLD_SIZE)"), warnings


def test_an_out_file_ending_in_a_slash_receives_the_shard_files_directly(tmp_path, tiny_tokenizer, capsys):
    """generate_dense_embeddings.py's docstring: an --out_file that does not exist yet but ends in / is a folder
    that receives the shard files, not DPR's ``{out_file}_{shard_id}``."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from tests.helpers import tiny_bert

    (tmp_path / "c.tsv").write_text("id\ttext\ttitle\n" + "".join(f"{i}\tword{i} hello\tT{i}\n" for i in range(4)))
    retriever = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer, RetrieverConfig(pooling="mean"))
    retriever.save(tmp_path / "m")
    out = tmp_path / "new"
    assert load_script("generate_dense_embeddings.py").main([
        "--model_file", str(tmp_path / "m"), "--ctx_file", str(tmp_path / "c.tsv"), "--out_file", f"{out}/",
        "--shard_id", "1", "--num_shards", "2", "--cache_dir", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("shard-")) == [
        f"shard-00001-of-00002{suffix}" for suffix in (".ids.txt", ".json", ".npy")]
    assert not list(tmp_path.glob("new_*"))


def test_gc_dpr_two_process_launch_line_runs_and_logs_info_once(tiny, tmp_path):
    """GC-DPR's ``python -m torch.distributed.launch --nproc_per_node=2 train_dense_encoder.py ...``: torch >= 2
    passes ``--local-rank=N`` (it was refused: only ``--local_rank`` was known), and rank 1 logs no INFO line."""
    from tests.ranks import run_command

    command = gc_dpr_readme_command(tiny, tmp_path / "out")
    command[command.index("--num_train_epochs") + 1] = "1"
    command[command.index("--eval_per_epoch") + 1] = "1"
    result = run_command([sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc_per_node=2",
                          str(REPO / "scripts" / "train_dense_encoder.py"), *command, "--no_cuda", "--num-workers",
                          "0", "--cache-dir", str(tmp_path / "cache")], limit_s=240, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "final").is_dir()
    for info in ("an epoch:", "dev before training:", "dev evaluation and checkpoint per epoch", "steps: batch 8"):
        assert sum(info in line for line in result.stderr.splitlines()) == 1, (info, result.stderr[-3000:])


@pytest.mark.parametrize("extra,named", [
    ([], ["--q_chunk_size (training is plain without --grad_cache)", "--dev_batch_size (there is no --dev_file)"]),
    (["--grad_cache"], ["--dev_batch_size (there is no --dev_file)"]),
    (["--grad_cache", "--dev_file", "dev.json"], [])])
def test_train_script_names_flags_that_do_not_apply_in_its_warning(extra, named, tmp_path, monkeypatch):
    """``dpr-gc train`` refuses a dev flag without --dev and a chunk flag of plain training; a GC-DPR command line
    carries them whether or not they apply, so the script takes them, names them in its no-effect warning and trains
    as without them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.json").write_text("[]")
    (tmp_path / "dev.json").write_text("[]")
    script = load_script("train_dense_encoder.py")
    argv = ["--train_file", "t.json", "--output_dir", "o", "--dev_batch_size", "3", "--q_chunk_size", "4", *extra]
    args = script.build_parser().parse_args(["train", *argv])
    assert script.ignored_flags(script.typed_flags(argv), args) == named
    config = script.config_from_args(args, script.typed_flags(argv))  # TrainConfig would refuse them
    assert config.data.dev.batch_size == (3 if "--dev_file" in extra else 64)
    assert config.cache.query_chunk_size == (4 if "--grad_cache" in extra else "auto")


def test_a_dev_file_glob_matching_several_files_is_refused_naming_them(tiny, tmp_path):
    """``--dev_file GLOB`` validated on the first match only and dropped the rest silently; one dev file is
    validated, so a glob matching several is refused in one line that names every match."""
    from dpr_gc.base.errors import DprGcError

    script = load_script("train_dense_encoder.py")
    dev = tiny["dir"] / "data" / "nq-dev.json"
    for part in ("0", "1"):
        (tmp_path / f"dev-{part}.json").write_text(dev.read_text())
    argv = ["--train_file", str(tiny["dir"] / "data" / "nq-train.json"), "--dev_file", str(tmp_path / "dev-*"),
            "--output_dir", str(tmp_path / "out"), "--pretrained_model_cfg", str(tiny["bert"])]
    with pytest.raises(DprGcError) as refused:
        script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    assert str(refused.value) == (f"--dev_file {str(tmp_path / 'dev-*')!r} matches 2 files ({tmp_path / 'dev-0.json'}, "
                                  f"{tmp_path / 'dev-1.json'}); validation reads one dev file: give one of them, "
                                  "or join them into one")
    argv[3] = str(tmp_path / "dev-1*")
    config = script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    assert config.data.dev_file == str(tmp_path / "dev-1.json")


@pytest.mark.parametrize("extra, named", [
    (["--batch_size", "100"], "batch of 100 x 1 rank(s); lower --batch_size"),
    (["--batch-size", "100"], "batch of 100 x 1 rank(s); lower --batch-size"),
    (["--batch_size", "8", "final"], "choose a new --output_dir, or delete it first")])
def test_train_script_errors_name_the_flags_typed(tiny, tmp_path, capsys, extra, named):
    """The script's errors named dpr-gc's spellings (--batch-size, --output) for GC-DPR's --batch_size and
    --output_dir; they name each flag as it was typed, as the other two scripts' do."""
    out = tmp_path / "out"
    if "final" in extra:
        (out / "final").mkdir(parents=True)
        extra = extra[:-1]
    argv = ["--pretrained_model_cfg", str(tiny["bert"]), "--train_file", str(tiny["dir"] / "data" / "nq-train.json"),
            "--output_dir", str(out), "--num-workers", "0", "--cache-dir", str(tmp_path / "cache"), *extra]
    assert load_script("train_dense_encoder.py").main(argv) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and named in error[0], error
    assert not {"--output", "--batch-size"} & set(error[0].replace(";", " ").replace(",", " ").split()) or \
        "--batch-size" in extra, error


def test_a_chunk_larger_than_the_batch_is_one_chunk_as_in_gc_dpr(tiny, tmp_path, caplog):
    """GC-DPR takes ``--q_chunk_size 16`` with ``--batch_size 8`` (one chunk); the script refused it ("larger than
    --batch-size 8"). It caps each chunk at the batch and says so (``dpr-gc train`` itself still refuses)."""
    import logging

    script = load_script("train_dense_encoder.py")
    argv = ["--pretrained_model_cfg", str(tiny["bert"]), "--train_file", str(tiny["dir"] / "data" / "nq-train.json"),
            "--output_dir", str(tmp_path / "out"), "--batch_size", "8", "--grad_cache", "--q_chunk_size", "16",
            "--ctx_chunk_size", "100", "--hard_negatives", "1"]
    config = script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    assert (config.cache.query_chunk_size, config.cache.passage_chunk_size) == (8, 16)
    with caplog.at_level(logging.INFO, logger="train_dense_encoder"):
        assert script.main([*argv, "--max-steps", "1", "--num-workers", "0",
                            "--cache-dir", str(tmp_path / "cache")]) == 0
    assert ("--q_chunk_size 16 is more than --batch_size 8: one chunk of 8 questions, as in GC-DPR" in caplog.messages
            and "--ctx_chunk_size 100 is more than the 16 passages of a batch: one chunk of 16 passages, as in GC-DPR"
            in caplog.messages), caplog.messages
    argv[argv.index("--q_chunk_size") + 1] = "4"
    config = script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    assert config.cache.query_chunk_size == 4


@pytest.mark.parametrize("betas", ["(2,0.5)", "(1e999,0.9)", "(0.9, 1.0)", "(-0.1, 0.999)", "(nan, 0.999)"])
def test_adam_betas_outside_zero_to_one_are_refused_up_front(tiny, tmp_path, betas):
    """Betas AdamW refuses (each must be finite and in [0, 1)) passed the script's check and ended in torch's
    ValueError traceback once the model had loaded; they are one line naming --adam_betas, before anything loads."""
    from dpr_gc.base.errors import DprGcError

    script = load_script("train_dense_encoder.py")
    argv = [*gc_dpr_readme_command(tiny, tmp_path / "out"), "--adam_betas", betas]
    with pytest.raises(DprGcError, match=r"^--adam_betas .*each in \[0, 1\)"):
        script.config_from_args(script.build_parser().parse_args(["train", *argv]), script.typed_flags(argv))
    if betas == "(2,0.5)":
        result = run("train_dense_encoder.py", *argv)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
            "error: --adam_betas must be two numbers, each in [0, 1), e.g. '(0.9, 0.999)'; got '(2,0.5)'"]


def test_an_output_inside_a_folder_the_embeddings_glob_matches_is_refused(tmp_path, capsys):
    """``--encoded_ctx_file "emb/wiki_*"`` reached the output guard as the glob itself, so ``--out_file
    emb/wiki_0/x.json`` was written into an input shard folder; each folder the glob matches is guarded."""
    script = load_script("dense_retriever.py")
    for shard in (0, 1):
        (tmp_path / "emb" / f"wiki_{shard}").mkdir(parents=True)
    (tmp_path / "qa.csv").write_text("q\t['a']\n")
    out = tmp_path / "emb" / "wiki_0" / "x.json"
    assert script.main(["--model_file", str(tmp_path / "m"), "--qa_file", str(tmp_path / "qa.csv"),
                        "--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*"), "--out_file", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out_file {out} lies inside the input --encoded_ctx_file {tmp_path / 'emb' / 'wiki_0'}"
                          "; "), err
    assert err.count("\n") == 1 and not out.exists()


def test_the_merged_view_of_shard_folders_links_only_their_shards(tmp_path):
    """Several ``--encoded_ctx_file`` folders form one index through a folder of links: every file of each was
    linked, so a file beside the shards in two folders (a results file, a lock) stopped the run as a shard
    'encoded twice'. Only shard files are linked, and a folder without finished shards is named."""
    from dpr_gc.base.errors import DprGcError

    script = load_script("dense_retriever.py")
    folders = [tmp_path / f"wiki_{shard}" for shard in (0, 1)]
    for shard, folder in enumerate(folders):
        folder.mkdir()
        for suffix in (".json", ".npy", ".ids.txt"):
            (folder / f"shard-{shard:05d}-of-00002{suffix}").write_text("{}")
        (folder / "x.json").write_text("[]")
        (folder / ".dpr-gc.lock").write_text("")
    view = tmp_path / "view"
    view.mkdir()
    script.merged_view(folders, view)
    assert sorted(p.name for p in view.iterdir()) == sorted(f"shard-{s:05d}-of-00002{suffix}" for s in (0, 1)
                                                            for suffix in (".json", ".npy", ".ids.txt"))
    (tmp_path / "dpremb").mkdir()
    (tmp_path / "dpremb" / "wikipedia_passages_0").write_bytes(b"\x80\x04N.")
    with pytest.raises(DprGcError, match=rf"^no finished embedding shards in {tmp_path / 'dpremb'}, only what look "
                                         "like DPR's pickled embedding files"):
        script.merged_view([folders[0], tmp_path / "dpremb"], tmp_path / "view2")


@pytest.mark.parametrize("form", [['encoded_ctx_files=["{a}","{b}"]'], ["encoded_ctx_files=['{a}', '{b}']"],
                                  ["encoded_ctx_files=[{a},{b}]"], ["--encoded_ctx_file", "{a}", "{b}"]])
def test_the_hydra_list_of_embedding_globs_in_dprs_readme_is_read(tmp_path, capsys, form):
    """DPR's README writes ``encoded_ctx_files=[\\"emb1/wiki_*\\",\\"emb2/wiki_*\\"]`` (the shell leaves the quotes):
    the brackets were removed but the quotes kept and the commas not split, so no file matched. Each glob of the
    list is read, as are several after --encoded_ctx_file, and every folder they match is an input."""
    script = load_script("dense_retriever.py")
    for root in ("emb1", "emb2"):
        (tmp_path / root / "wiki_0").mkdir(parents=True)
    (tmp_path / "qa.csv").write_text("q\t['a']\n")
    a, b = tmp_path / "emb1" / "wiki_*", tmp_path / "emb2" / "wiki_*"
    listed = [word.format(a=a, b=b) for word in form]
    args, unknown = script.build_parser().parse_known_args(script.hydra_to_flags([*listed, "qa_dataset=q.csv"]))
    assert args.embeddings == [str(a), str(b)] and unknown == []
    assert script.hydra_to_flags(['encoded_ctx_files=["out/emb/wiki_*"]', "ctx_datatsets=[dpr_wiki]"]) == [
        "--encoded_ctx_files=out/emb/wiki_*", "--ctx_datatsets=dpr_wiki"]
    out = tmp_path / "emb2" / "wiki_0" / "x.json"
    readme = ['model_file=' + str(tmp_path / "m"), f'qa_dataset={tmp_path / "qa.csv"}', "ctx_datatsets=[dpr_wiki]",
              f'encoded_ctx_files=["{a}","{b}"]', f"out_file={out}"]
    assert script.main(readme) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out_file {out} lies inside the input --encoded_ctx_file") and err.count("\n") == 1
    assert f" {tmp_path / 'emb2' / 'wiki_0'}; " in err, err
    assert script.main([*readme[:3], f'encoded_ctx_files=["{a}","{tmp_path / "nope_*"}"]',
                        f"out_file={tmp_path / 'r.json'}"]) == 2
    assert f"{str(tmp_path / 'nope_*')!r} matches no files" in capsys.readouterr().err


@pytest.mark.parametrize("typed,named", [
    (["--qa_file", "{qa}", "--out_file", "{qa}"], "--out_file {qa} is the input --qa_file {qa}"),
    (["--qa_file", "{qa}", "--ctx_file", "{c}", "--out_file", "{c}"], "--out_file {c} is the input --ctx_file {c}"),
    (["--qa_file", "{qa}", "--ctx_datasets", "{c}", "--out_file", "{c}"], "is the input --ctx_datasets {c}"),
    (["qa_dataset={qa}", "out_file={qa}"], "--out_file {qa} is the input --qa_dataset {qa}"),
    (["--qa_file", "{qa}", "--model", "{qa}", "--out_file", "{qa}"], "--out_file {qa} is the input --model {qa}"),
    (["--qa_file", "{qa}", "--encoded_ctx_files", "{e}", "--out_file", "{e}/x.json"],
     "--out_file {e}/x.json lies inside the input --encoded_ctx_files {e}")])
def test_dense_retriever_errors_name_the_flags_typed(tmp_path, capsys, typed, named):
    """The retriever's guard named DPR's hydra names (--qa_dataset, --ctx_datatsets) whatever was typed, and its
    messages one fixed spelling (--n_docs for --n-docs); docs/dpr.md promises the flags as typed."""
    from dpr_gc.base.errors import DprGcError, flags_renamed

    script = load_script("dense_retriever.py")
    paths = {"qa": tmp_path / "qa.csv", "c": tmp_path / "psgs.tsv", "e": tmp_path / "emb"}
    paths["qa"].write_text("q\t['a']\n"), paths["c"].write_text("id\ttext\ttitle\n1\tt\tT\n"), paths["e"].mkdir()
    argv = [word.format(**paths) for word in typed]
    if "--model" not in argv:
        argv += ["--model_file", str(tmp_path / "m")]
    assert script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named.format(**paths) in err and err.count("\n") == 1, err
    parser = script.build_parser()
    with pytest.raises(DprGcError) as caught, flags_renamed(script.script_flags(parser, {"--n-docs", "--trec-run"})):
        raise DprGcError("--top-k 3 beyond the index; --trec-run r; --output o")
    assert str(caught.value) == "--n-docs 3 beyond the index; --trec-run r; --out_file o"


@pytest.mark.parametrize("typed", ["--n_docs", "--n-docs"])
def test_dense_retriever_warnings_name_the_flags_typed(tmp_path, tiny_tokenizer, caplog, capsys, typed):
    """The retriever's warnings and its summary table (its retrieval is dpr-gc retrieve's) named --top-k, a flag
    the script does not have, where its errors named --n_docs: they name each flag as typed too."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from dpr_gc.retrieval.encode import encode_corpus
    from tests.helpers import tiny_bert

    retriever = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer, RetrieverConfig(pooling="mean"))
    retriever.save(tmp_path / "model")
    (tmp_path / "psgs.tsv").write_text("id\ttext\ttitle\n" + "".join(f"{i}\tword {i}\tT{i}\n" for i in range(5)))
    (tmp_path / "qa.csv").write_text("word 1\t['1']\n")
    encode_corpus(retriever, tmp_path / "psgs.tsv", tmp_path / "emb", cache_dir=tmp_path / "cache",
                  model_name=str(tmp_path / "model"), show_progress=False)
    argv = ["--model_file", str(tmp_path / "model"), "--ctx_file", str(tmp_path / "psgs.tsv"), "--qa_file",
            str(tmp_path / "qa.csv"), "--encoded_ctx_file", str(tmp_path / "emb"), "--out_file",
            str(tmp_path / "r.json"), typed, "10", "--cache_dir", str(tmp_path / "cache"), "--no_cuda"]
    with caplog.at_level("WARNING"):
        assert load_script("dense_retriever.py").main(argv) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{typed} 10 beyond the index's 5 vectors: each question gets those 5 passages" in warnings, warnings
    assert not any("--top-k" in w for w in warnings), warnings
    table = capsys.readouterr().out
    assert f"| top-k | 5 ({typed} 10) |" in table and "--top-k" not in table, table


@pytest.mark.parametrize("script, flags", [
    ("generate_dense_embeddings.py", ["--model_file", "{m}", "--ctx_file", "{d}/c.tsv", "--out_file", "{d}/emb"]),
    ("dense_retriever.py", ["--model_file", "{m}", "--ctx_file", "{d}/c.tsv", "--qa_file", "{d}/q.csv",
                            "--out_file", "{d}/o.json"]),
    ("train_dense_encoder.py", ["--pretrained_model_cfg", "{m}", "--train_file", "{d}/t.json", "--output_dir",
                                "{d}/out"]),
    ("train_dense_encoder.py", ["--model_file", "{m}", "--dev_file", "{d}/t.json"])])
def test_dpr_scripts_name_a_model_that_cannot_load_by_the_flag_typed(tmp_path, tiny_tokenizer, script, flags):
    """A model that cannot load is named by the flag the script took it with (dpr-gc's commands do so): the scripts
    said "model", so a user of several model flags could not tell which one to fix."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from dpr_gc.retrieval.encode import encode_corpus
    from tests.helpers import tiny_bert

    (tmp_path / "c.tsv").write_text("id\ttext\ttitle\n1\thello\tT\n")
    (tmp_path / "q.csv").write_text('hello\t["hello"]\n')
    (tmp_path / "t.json").write_text('[{"question": "q", "answers": ["a"], "positive_ctxs": [{"text": "a"}]}]')
    model = str(tmp_path / "no-model")
    argv = [f.format(m=model, d=tmp_path) for f in flags]
    if script == "dense_retriever.py":  # shards encoded by a model that loads; --model_file names one that does not
        retriever = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer, RetrieverConfig(pooling="mean"))
        encode_corpus(retriever, tmp_path / "c.tsv", tmp_path / "emb", cache_dir=tmp_path / "cache",
                      model_name="tiny", show_progress=False)
        argv += ["--encoded_ctx_file", str(tmp_path / "emb"), "--cache_dir", str(tmp_path / "cache")]
    result = run(script, *argv)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"error: cannot load {argv[0]} '{model}': no such folder"), errors


@pytest.mark.parametrize("missing,named", [("qa.csv", "--qa_file"), ("c.tsv", "--ctx_file"),
                                            ("m", "--model_file")])
def test_dense_retriever_checks_its_inputs_before_building_the_index(tmp_path, tiny_tokenizer, capsys, missing, named):
    """A missing --qa_file, --ctx_file or --model_file was reported only once the whole index was built and saved
    (hours with --hnsw_index over 21M passages): each is refused, named as typed, before any index file is written."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from dpr_gc.retrieval.encode import encode_corpus
    from tests.helpers import tiny_bert

    (tmp_path / "c.tsv").write_text("id\ttext\ttitle\n1\thello\tT\n")
    (tmp_path / "qa.csv").write_text('hello\t["hello"]\n')
    retriever = Retriever(tiny_bert(len(tiny_tokenizer)), None, tiny_tokenizer, RetrieverConfig(pooling="mean"))
    retriever.save(tmp_path / "m")
    encode_corpus(retriever, tmp_path / "c.tsv", tmp_path / "emb", cache_dir=tmp_path / "cache", model_name="tiny",
                  show_progress=False)
    paths = {name: str(tmp_path / (f"no-{name}" if name == missing else name)) for name in ("qa.csv", "c.tsv", "m")}
    argv = ["--model_file", paths["m"], "--qa_file", paths["qa.csv"], "--ctx_file", paths["c.tsv"],
            "--encoded_ctx_file", str(tmp_path / "emb"), "--out_file", str(tmp_path / "o.json"),
            "--save_or_load_index", "--hnsw_index", "--cache_dir", str(tmp_path / "cache")]
    assert load_script("dense_retriever.py").main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and named in err[0] and f"no-{missing}" in err[0], err
    assert not (tmp_path / "emb.index").exists() and not (tmp_path / "o.json").exists()


def two_saved_shards(tmp_path: Path, tokenizer: Any) -> list[str]:
    """A tiny retriever saved to ``m``, a 4-passage corpus ``c.tsv`` encoded as DPR's ``emb/wiki_0`` and ``wiki_1``,
    a QA file; returns dense_retriever.py's command line over ``emb/wiki_*`` keeping its index (no output yet)."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from dpr_gc.retrieval.encode import encode_corpus
    from tests.helpers import tiny_bert

    (tmp_path / "c.tsv").write_text("id\ttext\ttitle\n" + "".join(f"{i}\tword{i} hello\tT{i}\n" for i in range(4)))
    (tmp_path / "qa.csv").write_text('hello\t["hello"]\n')
    retriever = Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(pooling="mean"))
    retriever.save(tmp_path / "m")
    for shard in (0, 1):
        encode_corpus(retriever, tmp_path / "c.tsv", tmp_path / "emb" / f"wiki_{shard}", shard, 2,
                      cache_dir=tmp_path / "cache", model_name=str(tmp_path / "m"), show_progress=False)
    return ["--model_file", str(tmp_path / "m"), "--qa_file", str(tmp_path / "qa.csv"), "--ctx_file",
            str(tmp_path / "c.tsv"), "--save_or_load_index", "--cache_dir", str(tmp_path / "cache")]


@pytest.mark.parametrize("first,then,named", [
    ([], ["--hnsw_index"], "is a flat index (Flat) but --hnsw_index asks for an hnsw index; delete {index} to build "
                           "it anew, or drop --hnsw_index"),
    (["--hnsw_index"], [], "is an hnsw index (HNSW32,Flat) but a flat index is asked for (no --hnsw_index); "
                           "delete {index} to build it anew, or add --hnsw_index"),
    (["--kind", "ivf-flat", "--nlist", "2"], ["--kind", "ivf-flat", "--nlist", "1"],
     "was built with --nlist 2 but --nlist 1 is asked for; delete {index} to build it anew, or give --nlist 2"),
    (["--hnsw_index", "--hnsw-m", "16"], ["--hnsw_index"],
     "was built with --hnsw-m 16 but --hnsw-m 32 is asked for; delete {index} to build it anew, or give --hnsw-m 16")])
def test_a_saved_index_of_another_kind_or_settings_is_refused(tmp_path, tiny_tokenizer, capsys, first, then, named):
    """--save_or_load_index reused a saved Flat index though --hnsw_index was given (and an HNSW one without it), and
    an index saved with --nlist 2 when --nlist 1 was asked for (and --hnsw-m alike)."""
    script = load_script("dense_retriever.py")
    argv = two_saved_shards(tmp_path, tiny_tokenizer) + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*")]
    assert script.main(argv + first + ["--out_file", str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    assert script.main(argv + then + ["--out_file", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named.format(index=tmp_path / "emb" / "wiki.index") in err, err
    assert not (tmp_path / "b.json").exists()


def test_a_saved_index_of_other_shards_is_refused(tmp_path, tiny_tokenizer, capsys):
    """An index saved from emb/wiki_* was reused for --encoded_ctx_file emb/wiki_0 alone (answers from shard 1)."""
    script = load_script("dense_retriever.py")
    argv = two_saved_shards(tmp_path, tiny_tokenizer)
    assert script.main(argv + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*"), "--out_file",
                               str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    assert script.main(argv + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_0"), "--out_file",
                               str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    index = tmp_path / "emb" / "wiki.index"
    assert err.count("\n") == 0 and err.startswith(f"error: the index in {index} was built from the shards "
                                                    "shard-00000-of-00002.npy, shard-00001-of-00002.npy but "
                                                    "--encoded_ctx_file gives shard-00000-of-00002.npy; delete "), err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("answered", [True, False])
def test_dense_retriever_evaluates_questions_with_answers_by_default(tmp_path, tiny_tokenizer, capsys, caplog,
                                                                     answered):
    """DPR's dense_retriever always prints its top-k accuracy when the QA file has answers; the script printed none
    without --evaluate. It evaluates such questions unasked, saying so in one log line; BEIR queries (no answers)
    are retrieved without evaluation, and without the refusal --evaluate draws for them."""
    import json
    import logging

    argv = two_saved_shards(tmp_path, tiny_tokenizer) + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*"),
                                                         "--out_file", str(tmp_path / "o.json"), "--n_docs", "2"]
    if not answered:
        (tmp_path / "q.jsonl").write_text(json.dumps({"_id": "q1", "text": "hello"}) + "\n")
        argv[argv.index("--qa_file") + 1] = str(tmp_path / "q.jsonl")
    with caplog.at_level(logging.INFO):
        assert load_script("dense_retriever.py").main(argv) == 0
    out = capsys.readouterr().out
    assert ("answer accuracy (1 question, match=string)" in out) == answered, out
    said = [r.getMessage() for r in caplog.records if "evaluated as DPR's dense_retriever does" in r.getMessage()]
    assert len(said) == answered, said


@pytest.mark.parametrize("typed,named", [("--encoded_ctx_files", "--encoded_ctx_files"),
                                         ("--encoded_ctx_file", "--encoded_ctx_file"),
                                         ("encoded_ctx_files=[{glob}]", "--encoded_ctx_files")])
def test_an_embeddings_glob_matching_nothing_is_named_by_the_flag_typed(tmp_path, capsys, typed, named):
    """``--encoded_ctx_files nothere_*`` (DPR's plural) was refused naming ``--encoded_ctx_file``."""
    (tmp_path / "qa.csv").write_text('hello\t["hello"]\n')
    pattern = str(tmp_path / "nothere_*")
    given = [typed.format(glob=pattern)] if "=" in typed else [typed, pattern]
    assert load_script("dense_retriever.py").main(["--qa_file", str(tmp_path / "qa.csv"), *given, "--out_file",
                                                   str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {named} {pattern!r} matches no files; give the encode output folder(s)", err


def test_dense_retrievers_cache_dir_is_typed_as_dpr_gcs(tmp_path, monkeypatch):
    """The retriever's --cache_dir takes dpr-gc's --cache-dir type: a '~' the shell left (after '=') is the home
    folder, not a folder named '~', and a file is refused as the command line is read."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    import argparse

    parser = load_script("dense_retriever.py").build_parser()
    typed = next(a for a in parser._actions if "--cache_dir" in a.option_strings).type
    assert typed is not None and typed("~/c") == str(tmp_path / "home" / "c")
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError):
        typed(str(tmp_path / "f"))


@pytest.mark.parametrize("script,switch,dest,on,off", [
    ("dense_retriever.py", "hnsw_index", "hnsw_index", True, False),
    ("dense_retriever.py", "save_or_load_index", "save_or_load_index", True, False),
    ("generate_dense_embeddings.py", "fp16", "precision", "fp16", "auto"),
    ("generate_dense_embeddings.py", "no_cuda", "no_cuda", True, False)])
def test_hydra_booleans_of_dprs_switches_are_read(tmp_path, capsys, script, switch, dest, on, off):
    """DPR's hydra booleans (``hnsw_index=True``, ``fp16=false``) were passed on as ``--key=True``, refused by the
    switch ('ignored explicit argument', or 'unrecognized arguments: True'): true/True/1 gives the switch, false/
    False/0 leaves it off, any other value is refused in one line naming key=value."""
    loaded = load_script(script)
    parser = loaded.build_parser()
    for value, expected in (("True", on), ("true", on), ("1", on), ("False", off), ("false", off), ("0", off)):
        needed = ["--qa_file", "q.csv"] if script == "dense_retriever.py" else ["--model_file", "m", "--ctx_file",
                                                                                 "c.tsv", "--out_file", "emb"]
        parsed, unknown = parser.parse_known_args(loaded.hydra_to_flags([*needed, f"{switch}={value}"], parser))
        assert unknown == [] and getattr(parsed, dest) == expected, (value, parsed)
    with pytest.raises(SystemExit) as exited:
        loaded.hydra_to_flags([f"{switch}=yes"], parser)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"{switch}=yes: --{switch} is a switch; give {switch}=true" in err, err


def test_several_passage_files_in_one_hydra_list_are_refused_naming_the_key(tmp_path, capsys):
    """``ctx_datatsets=[pa.tsv,pb.tsv]`` retrieved from pa.tsv only, pb.tsv named as 'accepted with no effect': a list
    of several values for a flag that takes one is refused in one line naming the key."""
    script = load_script("dense_retriever.py")
    assert script.hydra_to_flags(["ctx_datatsets=[pa.tsv]"]) == ["--ctx_datatsets=pa.tsv"]
    with pytest.raises(SystemExit) as exited:
        script.hydra_to_flags(["ctx_datatsets=[pa.tsv,pb.tsv]"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert "ctx_datatsets=[pa.tsv,pb.tsv] gives 2 values but --ctx_datatsets takes one" in err, err


def test_shard_folders_of_different_corpora_are_named_as_separate_encodings(tmp_path):
    """Two folders each holding shard 0 of 1 were refused as a shard 'encoded twice'; where their manifests name
    different corpora, the line says they look like separate encodings of those corpora."""
    import json

    from dpr_gc.base.errors import DprGcError

    script = load_script("dense_retriever.py")
    folders = [tmp_path / name / "wiki_0" for name in ("emba", "embb")]
    for folder, corpus in zip(folders, ("pa.tsv", "pb.tsv")):
        folder.mkdir(parents=True)
        for suffix in (".npy", ".ids.txt"):
            (folder / f"shard-00000-of-00001{suffix}").write_text("")
        manifest = {"corpus_name": corpus, "corpus": f"/d/{corpus}", "corpus_fingerprint": f"full-{corpus}"}
        (folder / "shard-00000-of-00001.json").write_text(json.dumps(manifest))
    (tmp_path / "view").mkdir()
    with pytest.raises(DprGcError, match=r"look like separate encodings \(of /d/pa.tsv and /d/pb.tsv\)"):
        script.merged_view(folders, tmp_path / "view")
    (tmp_path / "same").mkdir()
    (folders[1] / "shard-00000-of-00001.json").write_text((folders[0] / "shard-00000-of-00001.json").read_text())
    with pytest.raises(DprGcError, match="each shard must be encoded once$"):
        script.merged_view(folders, tmp_path / "same")


@pytest.mark.parametrize("extra,named", [
    (["--trec_run", "{d}/r.trec", "--compact"], "--compact does not apply without --out_file (it trims the results "
                                                "JSON); add --out_file FILE.json, or drop the flag"),
    (["--out_file", "{d}/o.json", "--k", "5"], "--k does not apply without --evaluate"),
    (["--out_file", "{d}/o.json", "--run_tag", "x"], "--run_tag does not apply without --trec_run (it tags the run "
                                                     "file's lines); add --trec_run FILE, or drop the flag"),
    (["--out_file", "{d}/o.json", "run_tag=dpr-gc"], "--run_tag does not apply without --trec_run")])
def test_dense_retriever_refuses_the_flags_dpr_gc_retrieve_refuses(tmp_path, tiny_tokenizer, capsys, extra, named):
    """dpr-gc retrieve refuses a flag that would be ignored (docs/stages.md); the script took them silently:
    --compact with no --out_file, --k without --evaluate (BEIR queries: no answers turn it on), --run_tag without
    --trec_run (also typed at its default value)."""
    import json

    argv = two_saved_shards(tmp_path, tiny_tokenizer) + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*")]
    (tmp_path / "q.jsonl").write_text(json.dumps({"_id": "q1", "text": "hello"}) + "\n")
    argv[argv.index("--qa_file") + 1] = str(tmp_path / "q.jsonl")
    capsys.readouterr()
    assert load_script("dense_retriever.py").main(argv + [w.format(d=tmp_path) for w in extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and named in err, err
    assert not (tmp_path / "o.json").exists() and not (tmp_path / "r.trec").exists()


@pytest.mark.parametrize("key,name", [("data.retriever.nq-train", "nq-train"), ("data.retriever.nq-dev", "nq-dev"),
                                      ("data.retriever.qas.nq-test", "nq-test"),
                                      ("data.retriever.qas.nq-dev", "nq-dev-qa"),
                                      ("data.wikipedia_split.psgs_w100", "psgs_w100")])
def test_dprs_download_command_line_names_the_resources(tmp_path, key, name):
    """DPR's ``download_data.py --resource KEY --output_dir DIR`` was refused ('unrecognized arguments: --resource
    --output_dir x', the key taken as a resource name): --resource takes DPR's keys the script knows, each as its
    resource, and --output_dir is --output."""
    script = load_script("download_dpr_data.py")
    args = script.parse_args(["--resource", key, "--output_dir", str(tmp_path / "x")])
    assert args.resources == [name] and args.output == str(tmp_path / "x")
    dry = run("download_dpr_data.py", "--dry-run", "--resource", key, "--output_dir", str(tmp_path / "x"))
    assert dry.returncode == 0 and f"-> {tmp_path / 'x' / script.RESOURCES[name][1]}" in dry.stdout, dry.stderr


def test_an_unknown_dpr_resource_key_is_refused_naming_the_closest(tmp_path):
    bad = run("download_dpr_data.py", "--resource", "data.retriever.nq-trian", "--output_dir", str(tmp_path / "x"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--resource data.retriever.nq-trian is no DPR resource this script downloads" in bad.stderr, bad.stderr
    assert "did you mean data.retriever.nq-train?" in bad.stderr, bad.stderr


def test_dprs_hydra_era_training_command_is_refused_naming_the_argparse_flags():
    """DPR's hydra-era ``train_dense_encoder.py train_datasets=[x.json] ... output_dir=o`` stopped with
    'unrecognized arguments: ...'; the line says only the argparse-era form is taken and names the flags for the
    keys given."""
    bad = run("train_dense_encoder.py", "train_datasets=[nq_train]", "dev_datasets=[nq_dev]", "train=biencoder_local",
              "output_dir=o")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "only the argparse-era command line of DPR/GC-DPR is taken, not hydra's key=value words" in bad.stderr
    assert ("train_datasets= is --train_file, dev_datasets= is --dev_file, output_dir= is --output_dir"
            in bad.stderr), bad.stderr
    assert "unrecognized" not in bad.stderr


@pytest.mark.parametrize("script,argv,named", [
    ("dense_retriever.py", ["--qa_file", "q.csv", "n_docs=0"], "argument --n_docs: '0' is not a positive integer"),
    ("dense_retriever.py", ["--qa_file", "q.csv", "--n-docs", "0"], "argument --n-docs: '0' is not a positive"),
    ("train_dense_encoder.py", ["--num_train_epochs", "0"], "argument --num_train_epochs: "),
    ("train_dense_encoder.py", ["--epochs=0"], "argument --epochs: ")])
def test_a_bad_flag_value_names_the_flag_as_typed(script, argv, named):
    """argparse named every spelling of a flag with a bad value ('argument --n-docs/--n_docs: ...'); docs/dpr.md
    promises messages name flags as typed, so the line names the spelling given."""
    bad = run(script, *argv)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and named in bad.stderr, bad.stderr
    assert "/--" not in bad.stderr, bad.stderr


def test_the_retrieve_summarys_time_is_the_whole_commands(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    """The retriever's ``time`` row was the writing of the results alone (0.23 s of a 12.8 s run, the index build
    and model load left out), where every other stage's is the whole command's; it is the whole command's, and the
    retrieval's own seconds have a row of their own."""
    import time

    from tests.helpers import summary_rows

    script = load_script("dense_retriever.py")
    built = script.load_or_build_index
    monkeypatch.setattr(script, "load_or_build_index", lambda *a, **k: (time.sleep(0.5), built(*a, **k))[1])
    argv = two_saved_shards(tmp_path, tiny_tokenizer) + ["--encoded_ctx_file", str(tmp_path / "emb" / "wiki_*"),
                                                         "--out_file", str(tmp_path / "o.json")]
    capsys.readouterr()
    assert script.main(argv) == 0
    rows = summary_rows(capsys.readouterr().out)
    whole, retrieval = (float(rows[key].split()[0]) for key in ("time", "retrieval"))
    assert whole >= 0.5 + retrieval, rows


@pytest.mark.parametrize("flag", ["--dev_file", "--train_file"])
def test_an_input_the_train_script_writes_in_its_output_dir_is_refused(tiny, tmp_path, capsys, flag):
    """As in dpr-gc train: a --dev_file or --train_file named as what a run writes or removes in --output_dir (here
    its metrics.jsonl, which a new run deletes) is refused in one line naming both flags as typed, and kept."""
    out = tmp_path / "out"
    out.mkdir()
    given = out / "metrics.jsonl"
    given.write_bytes((tiny["dir"] / "data" / "nq-train.json").read_bytes())
    before = given.read_bytes()
    files = {"--train_file": str(tiny["dir"] / "data" / "nq-train.json"), "--dev_file": str(tiny["dir"] / "data" / "nq-dev.json")}
    files[flag] = str(given)
    argv = ["--pretrained_model_cfg", str(tiny["bert"]), *(x for f, p in files.items() for x in (f, p)),
            "--output_dir", str(out), "--num-workers", "0", "--cache-dir", str(tmp_path / "cache"), "--batch_size", "8"]
    assert load_script("train_dense_encoder.py").main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: the input {flag} {given} is metrics.jsonl in the output folder --output_dir {out}, which the run "
        "writes or removes; move the input out of that folder, or give another --output_dir")
    assert given.read_bytes() == before
