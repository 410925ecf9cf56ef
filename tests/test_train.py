"""The trainer: learns, resumes exactly, saves loadable retrievers, matches DDP, and rejects bad input."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from dpr_gc.cli import main
from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever
from dpr_gc.train.trainer import Trainer, train
from dpr_gc.train.config import TrainConfig
from tests.train_data import init_model, make_records, write_dpr
from tests.train_data import model_params as params, task_config as config
from tests.helpers import call, ctrl_c_at, summary_rows
from tests.llm_models import save_decoder
from tests.ranks import run_command

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("train")
    return {"dir": d, "model": init_model(d), "train": write_dpr(d / "train.json", make_records(96, 1)),
            "dev": write_dpr(d / "dev.json", make_records(32, 2))}


@pytest.mark.slow  # 28 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_dev_loss_falls_and_outputs(task, tmp_path):
    trainer = Trainer(config(task, tmp_path / "out", dev_file=str(task["dev"]), epochs=2, eval_every=6))
    summary = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in records if "dev_loss" in r]
    assert dev[0]["step"] == 0 and dev[-1]["step"] == summary["steps"] == 24
    assert dev[-1]["dev_loss"] < dev[0]["dev_loss"] - 0.1
    assert dev[-1]["dev_avg_rank"] < dev[0]["dev_avg_rank"]
    assert (tmp_path / "out" / "best" / "retriever_config.json").is_file()
    assert (tmp_path / "out" / "checkpoint-24" / "train_state.json").is_file()
    # final/ and the last checkpoint hold the weights the run ended with, exactly, and embed as the trained model does.
    trained, texts = trainer.retriever, ["paris city", "the river of london"]
    for folder in ("final", "checkpoint-24/model"):
        saved = Retriever.load(tmp_path / "out" / folder)
        weights = saved.state_dict()
        assert weights.keys() == trained.state_dict().keys()
        assert all(torch.equal(weights[k], v) for k, v in trained.state_dict().items())
        for kind in ("query", "passage"):
            assert np.array_equal(saved.embed(kind, texts), trained.embed(kind, texts))
    initial = Retriever.load(task["model"])
    assert not np.allclose(initial.embed("query", texts), trained.embed("query", texts))


def test_a_line_logged_while_training_goes_above_the_progress_bar(task, tmp_path):
    """On a terminal the first step's "Gradient Cache:" line and every mid-run dev line were printed onto the train
    bar's line: while the bar is drawn, the log's console handler writes through tqdm."""
    import logging

    console = logging.StreamHandler(sys.stderr)
    logging.root.addHandler(console)
    seen = []
    try:
        train(config(task, tmp_path / "run", max_steps=1),
              on_backward=lambda step, retriever: seen.extend(type(h).__name__ for h in logging.root.handlers))
    finally:
        logging.root.removeHandler(console)
    assert "_TqdmLoggingHandler" in seen and "StreamHandler" not in seen, seen


@pytest.mark.slow  # 33 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_resume_equals_uninterrupted(tmp_path):
    model = init_model(tmp_path, dropout=0.1)
    task = {"dir": tmp_path, "model": model, "train": write_dpr(tmp_path / "t.json", make_records(48, 3))}
    common = dict(max_steps=9, save_every=2, learning_rate=5e-4, batch_size=8)
    train(config(task, tmp_path / "a", **common))

    with pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "b", **common), on_backward=ctrl_c_at(5))
    assert (tmp_path / "b" / "checkpoint-4").is_dir() and not (tmp_path / "b" / "final").exists()
    with pytest.raises(DprGcError, match="--resume latest"):
        train(config(task, tmp_path / "b", **common))
    train(config(task, tmp_path / "b", resume="latest", **common))
    a, b = params(tmp_path / "a" / "final"), params(tmp_path / "b" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))


def test_plain_and_cached_training_take_the_same_first_step(task, tmp_path):
    grads = {}

    def keep(step: int, retriever) -> None:
        grads.setdefault(len(grads), torch.cat([p.grad.flatten() for p in retriever.parameters() if p.grad is not None]))

    cached = Trainer(config(task, tmp_path / "gc", max_steps=1), on_backward=keep)
    assert cached.cache.chunk_sizes == [3, 5]
    cached.fit()
    plain = Trainer(config(task, tmp_path / "plain", max_steps=1, grad_cache=False), on_backward=keep)
    assert plain.cache is None  # plain training builds no GradCache
    plain.fit()
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-5


def test_bad_input_errors(task, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(make_records(1, 0)[0]) + "\n{not json\n")
    assert main(["train", "--train", str(bad), "--output", str(tmp_path / "o"), "--model", str(task["model"])]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    assert main(["train", "--train", str(task["train"]), "--output", str(tmp_path / "o"), "--model",
                 str(task["model"]), "--q_chunk_size", "0"]) == 2
    assert "chunk" in capsys.readouterr().err
    assert main(["train", "--train", str(task["train"]), "--output", str(tmp_path / "o"), "--model",
                 str(task["model"]), "--batch-size", "8", "--query-chunk-size", "16"]) == 2
    assert "--query-chunk-size 16 is larger than --batch-size 8" in capsys.readouterr().err
    assert main(["train", "--train", str(tmp_path / "missing.json"), "--output", str(tmp_path / "o"),
                 "--model", str(task["model"])]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["train", "--train", str(task["train"]), "--output", str(tmp_path / "o"),
                 "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["train", "--train", str(task["train"]), "--output", "o", "--precision", "fp8"]) == 2
    assert capsys.readouterr().err.startswith("error: dpr-gc train: argument --precision: invalid choice")
    with pytest.raises(DprGcError, match="needs training data"):  # a library config without data or output
        train(TrainConfig())


def refused_train(task: dict, out: Path, capsys: pytest.CaptureFixture, *extra: object) -> str:
    """Run a one-step ``train`` of ``task`` into ``out`` that must be refused; return its one ``error:`` line."""
    argv = ["train", "--train", task["train"], "--output", out, "--model", task["model"], "--max-steps", 1,
            "--batch-size", 8, "--device", "cpu", "--num-workers", 0, "--cache-dir", out.parent / "cache", *extra]
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


DEV_RECORD = {"question": "q", "answers": ["a"], "negative_ctxs": [], "hard_negative_ctxs": []}


@pytest.mark.parametrize("records, needle", [
    ([{**DEV_RECORD, "positive_ctxs": [None]}],
     "dev.json:1 (record 0): positive_ctxs[0] must be an object, got NoneType; fix the record"),
    ([{**DEV_RECORD, "positive_ctxs": []}], "dev.json: no usable training question"),
    (None, "--dev data not found")])
def test_a_refused_dev_file_is_named_and_leaves_no_output(task, tmp_path, capsys, records, needle):
    """A bad --dev file was refused only at the first evaluation, after train_config.json was written into --output,
    and its messages read as the training data's (and advised --skip-bad-records, which does not apply to it): it
    is now read before anything is written, and its errors say --dev."""
    dev = tmp_path / "dev.json"
    if records is not None:
        dev.write_text(json.dumps(records))
    err = refused_train(task, tmp_path / "out", capsys, "--dev", dev)
    assert needle in err and "--dev" in err and "--skip-bad-records" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_train_refused_at_its_first_batch_leaves_no_output(task, tmp_path, capsys):
    """No hard negatives in the data, --hard-negatives 1 and a batch of every question: the first batch's negative
    cannot be found. The refusal comes at the first step, after train_config.json was written: the folder the run
    created is removed, and in a folder it found, what it wrote (train_config.json, metrics.jsonl) is."""
    data = write_dpr(tmp_path / "nohn.json", make_records(8, 1, hard=0))
    for out in (tmp_path / "out", tmp_path / "mine"):
        if out.name == "mine":
            out.mkdir()
            (out / "notes.txt").write_text("kept")
        argv = ["train", "--train", data, "--output", out, "--model", task["model"], "--batch-size", 8, "--device",
                "cpu", "--num-workers", 0, "--cache-dir", tmp_path / "cache", "--hard-negatives", 1]
        code, err = call(main, argv)  # the progress bar had started: its line comes before the error's
        errors = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(errors) == 1 and "cannot find 1 negatives" in errors[0], err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_refusal_on_another_rank_at_the_first_batch_leaves_no_output(task, tmp_path):
    """Under torchrun rank 1 cannot find its first batch's negative (its question has none, and every other passage
    holds its answer) while rank 0 can: rank 0 went on into the step's collectives, lost its peer or was stopped by
    torchrun, and left train_config.json in --output. The refusal is shared: both ranks stop with one error line,
    rank 0's naming rank 1, and the folder rank 0 created is removed."""
    records = [{"question": f"question number {i}", "answers": ["zzz"], "negative_ctxs": [],
                "positive_ctxs": [{"title": "t", "text": f"zzz passage {i}", "passage_id": f"p{i}"}],
                "hard_negative_ctxs": [{"title": "n", "text": f"neg {i}", "passage_id": f"n{i}"}] if i < 2 else []}
               for i in range(4)]
    data, out = write_dpr(tmp_path / "half.json", records), tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                       "dpr_gc.cli", "train", "--model", str(task["model"]), "--train", str(data), "--hard-negatives",
                       "1", "--batch-size", "1", "--seed", "3", "--max-steps", "2", "--num-workers", "0", "--device",
                       "cpu", "--cache-dir", str(tmp_path / "cache"), "--output", str(out)], limit_s=150, env=env)
    errors = sorted(line[line.index("error:"):] for line in run.stderr.splitlines() if "error:" in line)
    assert run.returncode != 0 and len(errors) == 2, run.stderr[-3000:]
    assert errors[0].startswith("error: cannot find 1 negatives for training row"), errors
    assert errors[1].startswith("error: rank 1 stopped: cannot find 1 negatives"), errors
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_model_without_its_vocabulary_trains_nothing(task, tmp_path, capsys):
    """A model folder whose tokenizer lost its vocabulary loaded as special tokens alone and trained on [UNK]s; the
    model loader refuses it, before --output is written."""
    model = tmp_path / "model"
    shutil.copytree(task["model"], model)
    (model / "tokenizer.json").unlink()
    err = refused_train({**task, "model": model}, tmp_path / "out", capsys)
    assert f"{model}: the tokenizer has 5 tokens" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # 25 s in a full run on 2 idle AMD EPYC cores (2026-11-26)
def test_torchrun_two_ranks_match_the_single_process_step(task, tmp_path):
    """Tied towers through a real torchrun launch; separate towers under two trainer ranks are checked by
    tests/test_verify_distributed.py (the trainer's DDP step against the global batch)."""
    single = tmp_path / "single.pt"
    script = REPO / "tests" / "ddp_train_script.py"
    model = task["model"]
    common = [str(task["train"]), str(model), str(task["dir"] / "cache")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    alone = run_command([sys.executable, str(script), *common, str(tmp_path / "o1"), str(single), "16"], env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(script), *common, str(tmp_path / "o2"), str(tmp_path / "ddp.pt"), "8"], env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = torch.load(single)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"ddp.pt.rank{rank}")
        assert float((got - expected).norm() / expected.norm()) < 1e-5
    assert (tmp_path / "o2" / "final" / "retriever_config.json").is_file()
    writes = {rank: json.loads((tmp_path / f"ddp.pt.writes.rank{rank}").read_text()) for rank in (0, 1)}
    assert writes[1] == [], writes[1][:5]  # only rank 0 writes files
    assert any(path.endswith("retriever_config.json") for _, path in writes[0]), writes[0][:5]  # the hook sees writes
    read = {rank: json.loads((tmp_path / f"ddp.pt.fingerprinted.rank{rank}").read_text()) for rank in (0, 1)}
    assert read == {0: [str(task["train"])], 1: []}  # rank 0 fingerprints the training files and sends the result
    first = [json.loads((tmp_path / out / "metrics.jsonl").read_text().splitlines()[0]) for out in ("o1", "o2")]
    for key in ("loss", "grad_norm", "masked_scores"):  # the record of the global batch, as one process's
        assert first[1][key] == pytest.approx(first[0][key], rel=1e-5), (key, first)
    for rank in (0, 1):  # every rank's summary counts the examples of both ranks' batches
        counted = json.loads((tmp_path / f"ddp.pt.summary.rank{rank}").read_text())
        assert counted["effective_batch"] == 16 and counted["examples"] == pytest.approx(16), counted
    for rank in (0, 1):  # the gradient syncs on the last chunk of each tower's input only (here 3 + 4 chunks)
        syncs = json.loads((tmp_path / f"ddp.pt.syncs.rank{rank}").read_text())
        assert syncs["buckets"] > 0 and syncs["calls"] == 2 * syncs["buckets"], syncs


@pytest.mark.parametrize("stop_at, advice", [
    (2, "checkpoint-2 is kept; add --resume latest to the same command to continue from it"),
    (0, "no checkpoint was saved yet; run the same command again to start over")])
def test_an_interrupted_train_says_how_to_resume(task, tmp_path, monkeypatch, stop_at, advice):
    """Ctrl-C in train: a fresh run refuses a folder with checkpoints, so the advice names --resume latest (and the
    advised command finishes the run); before any checkpoint the same command starts over."""
    from tests.helpers import call

    argv = ["train", "--train", task["train"], "--output", tmp_path / "run", "--model", task["model"], "--batch-size",
            8, "--num-workers", 0, "--max-steps", 3, "--save-every", 1, "--cache-dir", task["dir"] / "cache"]
    real_step = Trainer.train_step

    def interrupted(self, batch):
        if self.step == stop_at:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    code, err = call(main, argv)
    assert code == 130 and err.strip().splitlines()[-1] == f"interrupted: {advice}", err
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert call(main, argv + (["--resume", "latest"] if stop_at else []))[0] == 0


def test_a_resumed_run_announces_and_sums_up_its_own_steps(task, tmp_path, capsys, caplog):
    """A resume trains the steps after its checkpoint: the start-up line names them among the run's, and the
    summary's steps row, beside this invocation's time and examples/s, says how many of them it trained."""
    import logging

    common = dict(max_steps=5, save_every=2)
    with caplog.at_level(logging.INFO, logger="dpr_gc"), pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "run", **common), on_backward=ctrl_c_at(2))  # checkpoint-2 kept
    assert "training 5 steps: batch 8 per rank" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        summary = train(config(task, tmp_path / "run", resume="latest", **common))
    assert "training steps 3-5 of 5: batch 8 per rank" in caplog.text
    assert "| steps | 5 (3 this run, resumed from step 2) |" in capsys.readouterr().out
    assert summary["steps"] == 5 and summary["resumed_from"] == 2
    assert summary["examples_per_s"] == pytest.approx(3 * 8 / summary["seconds"])


def test_a_resumed_run_purges_the_tensorboard_steps_after_its_checkpoint(task, tmp_path, monkeypatch):
    """A run stopped after its checkpoint had logged later steps to TensorBoard, which the resume logs again: its
    writer purges the events from the step after the checkpoint on; a fresh run's purges none (a stub writer: the
    tensorboard package is optional)."""
    import types

    opened, logged = [], []

    class Writer:
        def __init__(self, log_dir: str, purge_step=None) -> None:
            opened.append((Path(log_dir).name, purge_step))

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            logged.append(step)

        def close(self) -> None:
            pass

    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)
    common = dict(max_steps=5, save_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "run", **common), on_backward=ctrl_c_at(3))  # steps 1-3 logged, 2 kept
    train(config(task, tmp_path / "run", resume="latest", **common))
    assert opened == [("tensorboard", None), ("tensorboard", 3)]
    assert sorted(set(logged)) == [1, 2, 3, 4, 5]


def test_frozen_position_embeddings_stay_as_loaded(task, tmp_path):
    """``--freeze-position-embeddings`` (train short, evaluate long): the position table of the saved model is the
    loaded one while the other weights train; a model without such a table (rotary positions) is refused."""
    Trainer(config(task, tmp_path / "run", max_steps=2, freeze_position_embeddings=True)).fit()
    before, after = params(task["model"]), params(tmp_path / "run" / "final")
    positions = [name for name in before if "position_embeddings" in name]
    assert positions and all(torch.equal(before[name], after[name]) for name in positions)
    assert not torch.equal(before["query_encoder.transformer.embeddings.word_embeddings.weight"],
                           after["query_encoder.transformer.embeddings.word_embeddings.weight"])
    decoder = save_decoder(tmp_path / "llama")
    code, err = call(main, ["train", "--train", task["train"], "--model", decoder, "--output", tmp_path / "d",
                            "--freeze-position-embeddings", "--device", "cpu", "--max-steps", "1"])
    assert code == 2 and err.startswith("error: --freeze-position-embeddings: ") and "rotary" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "d").exists()


@pytest.mark.parametrize("kind", ["bert", "llama", "qwen2"])
def test_biases_normalisation_weights_and_the_temperature_are_not_decayed(task, tmp_path, kind):
    """AdamW's weight decay skips every bias, every normalisation layer's weights (BERT's LayerNorm; Llama's and
    Qwen2's RMSNorm, named input_layernorm/post_attention_layernorm/norm) and the learnable temperature, and decays
    the rest."""
    from dpr_gc.cli import build_parser
    from dpr_gc.train.config import config_from_args

    model = task["model"] if kind == "bert" else save_decoder(tmp_path / kind, kind)
    argv = ["train", "--train", str(task["train"]), "--model", str(model), "--output", str(tmp_path / "out"),
            "--weight-decay", "0.1", "--learn-temperature", "--num-workers", "0", "--cache-dir",
            str(task["dir"] / "cache"), "--device", "cpu"]
    extra = [] if kind == "bert" else ["--pooling", "last", "--passage-format", "concat"]
    trainer = Trainer(config_from_args(build_parser("train").parse_args(argv + extra)))
    names = {id(p): n for n, p in trainer.towers.named_parameters() if p.requires_grad}
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in trainer.optimizer.param_groups}
    assert set(groups) == {0.1, 0.0} and not groups[0.1] & groups[0.0]
    assert groups[0.1] | groups[0.0] == set(names.values())
    plain = {n for n in names.values() if n.endswith("bias") or "norm" in n.lower() or n.endswith("tau.log_value")}
    assert groups[0.0] == plain
    assert any(n.endswith("LayerNorm.weight" if kind == "bert" else "layernorm.weight") for n in plain)
    assert any(n.endswith("tau.log_value") for n in plain) == (kind != "bert")  # the saved BERT keeps a fixed one
    trainer.close()


def test_only_the_newest_checkpoints_are_kept(task, tmp_path):
    """``--keep-checkpoints N``: each new checkpoint deletes all but the newest N (the default keeps 2). Without
    ``--dev`` there is no ``best/`` (README: "``best/`` with ``--dev``")."""
    Trainer(config(task, tmp_path / "run", max_steps=4, save_every=1, keep_checkpoints=2)).fit()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert (tmp_path / "run" / "final").is_dir() and not (tmp_path / "run" / "best").exists()
    Trainer(config(task, tmp_path / "one", max_steps=3, save_every=1, keep_checkpoints=1)).fit()
    assert [p.name for p in (tmp_path / "one").glob("checkpoint-*")] == ["checkpoint-3"]



class SkewedClock:
    """The trainer module's ``time``, whose ``perf_counter`` runs ahead by the seconds :meth:`after` adds: minutes
    of loading or validation, deterministic and without the wait."""

    def __init__(self) -> None:
        self.skew = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.skew

    def after(self, seconds: float, work: Callable) -> Callable:
        """``work``, taking ``seconds`` longer."""
        def slow(*args, **kwargs):
            self.skew += seconds
            return work(*args, **kwargs)

        return slow


@pytest.mark.parametrize("way", ["command", "library"])
def test_the_summarys_time_is_the_whole_runs_and_training_has_its_own_row(task, tmp_path, monkeypatch, capsys, way):
    """The ``time`` row was the step loop's alone (the data and model loading and the first dev validation left
    out), where every other stage's is the whole command's; it is the whole command's (in code, from the
    ``Trainer``'s construction), and ``training`` gives the seconds that ``examples/s`` divides."""
    import dpr_gc.train.trainer as trainer_module

    clock = SkewedClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(Trainer, "build_data", clock.after(100, Trainer.build_data))  # loading takes 100 s
    if way == "command":
        assert main([str(a) for a in ["train", "--train", task["train"], "--model", task["model"], "--output",
                                      tmp_path / "run", "--batch-size", 8, "--num-workers", 0, "--query-chunk-size",
                                      4, "--passage-chunk-size", 8, "--max-steps", 2, "--cache-dir",
                                      task["dir"] / "cache"]]) == 0
    else:
        summary = Trainer(config(task, tmp_path / "run", max_steps=2)).fit()
        assert summary["total_seconds"] >= 100 + summary["seconds"], summary
    rows = summary_rows(capsys.readouterr().out)
    whole, training = (float(rows[key].removesuffix(" s")) for key in ("time", "training"))
    assert whole >= 100 + training - 0.05 and training < 100, rows  # time is shown to 0.1 s past 10 s
    rate = float(rows["examples/s"])  # 2 steps of 8 over the training row's seconds; both rounded as shown
    shown = 0.006 if training < 10 else 0.06  # seconds shown to 0.01 s under 10 s, to 0.1 s past it
    assert 2 * 8 / (training + shown) - 0.006 <= rate <= 2 * 8 / max(training - shown, 1e-3) + 0.006, rows


def test_examples_per_second_leaves_out_dev_validation_which_has_its_own_row(task, tmp_path, monkeypatch, capsys):
    """examples/s divided the loop's time, dev validations inside it included (the bar said 23.2, the table 2.96);
    it divides the steps' time alone (the ``training`` row), and ``dev validation`` gives the validations'
    seconds (before training and at steps 1 and 2 here, 100 s each)."""
    import dpr_gc.train.trainer as trainer_module

    clock = SkewedClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    monkeypatch.setattr(trainer_module, "evaluate_dev", clock.after(100, trainer_module.evaluate_dev))
    summary = Trainer(config(task, tmp_path / "run", max_steps=2, eval_every=1, dev_file=str(task["dev"]))).fit()
    rows = summary_rows(capsys.readouterr().out)
    whole, training, validation = (float(rows[key].removesuffix(" s")) for key in ("time", "training",
                                                                                    "dev validation"))
    assert 300 <= validation < 400 and training < 100 and whole >= training + validation - 0.1, rows  # 0.1 s shown
    assert summary["validation_seconds"] >= 300 and summary["examples_per_s"] == 2 * 8 / summary["seconds"]
    assert summary["total_seconds"] >= summary["seconds"] + summary["validation_seconds"], summary
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["examples_per_s"] > 2 * 8 / 100, logged  # the bar's rate, left out the validation at step 1
