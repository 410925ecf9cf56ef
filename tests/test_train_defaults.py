"""Defaults a newcomer from DPR or sentence-transformers meets in ``dpr-gc train``: ``--hard-negatives`` follows the
data (0 on BEIR folders, which have no negatives: in-batch negatives only, as MultipleNegativesRankingLoss; 1 on DPR
files), the starting model's dev score is the baseline ``best/`` must beat, and the dev file's load is logged once."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import BertTokenizerFast

from dpr_gc import cli
from dpr_gc.base.errors import DprGcError
from dpr_gc.train.checkpoints import check_start
from dpr_gc.model.retriever import Retriever, RetrieverConfig
from dpr_gc.train.config import SETTINGS_FILE, DataConfig, config_from_args
from dpr_gc.train.trainer import Trainer
from tests.helpers import call, tiny_bert, write_vocab
from tests.train_data import make_records, train_config, write_beir, write_dpr

FILLED = "are filled with the positive of a random other question"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A BEIR folder (12 queries, 16 qrels pairs, no negatives), a DPR file (2 hard negatives a question) and a
    sentence-transformers folder (mean pooling, normalised: what the README's recipe fine-tunes)."""
    d = tmp_path_factory.mktemp("defaults")
    write_beir(d / "beir")
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(d / "vocab.txt")), do_lower_case=True)
    config = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", query_max_length=16,
                             passage_max_length=32)
    Retriever(tiny_bert(len(tokenizer)), None, tokenizer, config).save(d / "st")
    for name in ("retriever_config.json", "heads.safetensors"):
        (d / "st" / name).unlink()
    return {"dir": d, "beir": d / "beir", "dpr": write_dpr(d / "train.json", make_records(16, 0)), "st": d / "st"}


def argv(task: dict, out: Path, *extra: object) -> list:
    return ["train", "--train", task["beir"], "--model", task["st"], "--output", out, "--batch-size", "4",
            "--num-workers", "0", "--query-chunk-size", "2", "--passage-chunk-size", "4", "--device", "cpu",
            "--cache-dir", task["dir"] / "cache", "--save-every", "1", *extra]


def recorded(out: Path) -> int:
    return json.loads((out / SETTINGS_FILE).read_text())["data"]["hard_negatives"]


# --------------------------------------------------------------------------------------------- --hard-negatives
def test_hard_negatives_default_by_the_data_and_help_states_the_rule(task: dict, capsys, monkeypatch) -> None:
    args = cli.build_parser().parse_args(["train", "--train", str(task["beir"]), "--output", "o"])
    data = config_from_args(args).data
    assert data.hard_negatives is None and DataConfig().hard_negatives is None  # not given: resolved by the data
    assert (data.default_hard_negatives(), data.passages_per_query) == (0, 1)
    both = DataConfig(train_files=[str(task["beir"]), str(task["dpr"])])
    assert both.default_hard_negatives() == DataConfig(train_files=[str(task["dpr"])]).default_hard_negatives() == 1
    assert DataConfig(train_files=[str(task["beir"])], hard_negatives=1).passages_per_query == 2  # given wins
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside words
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("hard negatives per query (default: 0 when every --train source is a BEIR folder, which has none: "
            "in-batch negatives only, as sentence-transformers' MultipleNegativesRankingLoss; else 1, the hard "
            "negatives of DPR files; on --resume the recorded value)") in text


def test_a_beir_folder_trains_on_in_batch_negatives_and_records_it(task: dict, tmp_path: Path, caplog) -> None:
    """The README's sentence-transformers recipe (a BEIR folder, no --hard-negatives) in code: one passage per query
    (no filled slot), recorded as 0 in train_config.json and the model card, and said in the log and the recipe's
    line of what was taken."""
    config = train_config(model=str(task["st"]), train_files=[str(task["beir"])], output_dir=str(tmp_path / "out"),
                          batch_size=4, num_workers=0, max_steps=1, query_chunk_size=2, passage_chunk_size=4,
                          cache_dir=str(task["dir"] / "cache"), device="cpu")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = Trainer(config)
        batch = next(iter(trainer.loader))
        summary = trainer.fit()
    assert trainer.passages_per_query == summary["passages_per_query"] == 1
    assert len(batch["passage"]["input_ids"]) == len(batch["query"]["input_ids"]) == 4
    assert recorded(tmp_path / "out") == 0
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "| hard negatives per query | 0 |" in card and "hard_negatives: 0" in card
    assert FILLED not in caplog.text
    assert "--hard-negatives 0 (not given: every --train source is a BEIR folder" in caplog.text
    recipe = next(r.getMessage() for r in caplog.records if "is a sentence-transformers folder" in r.getMessage())
    assert "hard_negatives=0" in recipe.split("(given:")[0], recipe


def test_a_dpr_file_keeps_one_hard_negative(task: dict, tmp_path: Path, caplog) -> None:
    config = train_config(model=str(task["st"]), train_files=[str(task["dpr"])], output_dir=str(tmp_path / "out"),
                          batch_size=4, num_workers=0, query_chunk_size=2, passage_chunk_size=4,
                          cache_dir=str(task["dir"] / "cache"), device="cpu")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = Trainer(config)
    assert (trainer.config.data.hard_negatives, trainer.passages_per_query) == (1, 2)
    assert "--hard-negatives 1 (not given: DPR training files carry hard negatives" in caplog.text


def test_an_explicit_value_fills_a_beir_folder_as_given(task: dict, tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(cli.main, argv(task, out, "--hard-negatives", "1", "--max-steps", "1"))
    assert code == 0, err
    assert recorded(out) == 1 and FILLED in caplog.text and "--hard-negatives 1 (not given" not in caplog.text
    recipe = next(r.getMessage() for r in caplog.records if "is a sentence-transformers folder" in r.getMessage())
    assert "(given: hard_negatives=1)" in recipe, recipe


def test_a_resumed_run_keeps_its_recorded_hard_negatives(task: dict, tmp_path: Path, caplog) -> None:
    """A resume without the flag takes the recorded value: a BEIR run started with the default (0) goes on with 0;
    one recorded with 1 (given, or the default of earlier versions) goes on with 1; another value given is
    refused as any changed training signal."""
    fresh, older = tmp_path / "fresh", tmp_path / "older"
    assert call(cli.main, argv(task, fresh, "--max-steps", "1"))[0] == 0
    assert call(cli.main, argv(task, older, "--max-steps", "1", "--hard-negatives", "1"))[0] == 0
    assert (recorded(fresh), recorded(older)) == (0, 1)
    code, err = call(cli.main, argv(task, fresh, "--max-steps", "2", "--resume", "latest", "--hard-negatives", "1"))
    assert code == 2 and "--hard-negatives 0 -> 1" in err, err
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        for out in (fresh, older):
            code, err = call(cli.main, argv(task, out, "--max-steps", "2", "--resume", "latest"))
            assert code == 0, err
    assert (recorded(fresh), recorded(older)) == (0, 1)
    assert "--hard-negatives 1 (not given: the value the resumed run recorded)" in caplog.text
    assert (older / "checkpoint-2").is_dir() and (fresh / "checkpoint-2").is_dir()


def test_a_sentence_transformers_run_records_and_resumes_the_recipe_it_used(task: dict, tmp_path: Path) -> None:
    """docs/training.md: train_config.json holds the recipe the folder gave (mean pooling, normalised, temperature
    0.05), not the library's defaults (cls, False, 1.0), so --resume takes the value used (--pooling mean was refused
    as "--pooling 'cls' -> 'mean'") and names a real change (--pooling cls was refused only as
    "model.retriever_flags [...] -> [...]"). A record of an earlier version (defaults, and the flags given) is
    compared as the recipe that run used."""
    out = tmp_path / "out"
    assert call(cli.main, argv(task, out, "--max-steps", "1"))[0] == 0
    record = json.loads((out / SETTINGS_FILE).read_text())
    recipe = record["model"]["retriever"]
    assert (recipe["pooling"], recipe["normalize"], recipe["temperature"]) == ("mean", True, 0.05)
    assert (recipe["passage_format"], recipe["query_max_length"]) == ("concat", 16)
    assert "retriever_flags" not in record["model"]
    older = dict(record, model=dict(record["model"], retriever=dataclasses.asdict(RetrieverConfig()),
                                    retriever_flags=[]))
    for path in (out / SETTINGS_FILE, out / "checkpoint-1" / SETTINGS_FILE):
        path.write_text(json.dumps(older))
    for step in (2, 3):  # against the earlier version's record, then against the one step 2 wrote
        code, err = call(cli.main, argv(task, out, "--max-steps", "4", "--resume", "latest", "--pooling", "cls"))
        assert code == 2 and "--pooling 'mean' -> 'cls'" in err and "retriever_flags" not in err, err
        code, err = call(cli.main, argv(task, out, "--max-steps", step, "--resume", "latest", "--pooling", "mean"))
        assert code == 0, err
    assert json.loads((out / SETTINGS_FILE).read_text())["model"]["retriever"] == recipe


def test_a_saved_retriever_run_records_the_recipe_it_keeps_and_names_flags_it_does_not_use(task: dict, tmp_path: Path,
                                                                                          caplog) -> None:
    """Training again from a trained retriever (the quality loop): it keeps its own recipe, which the record holds
    (it held the library's defaults, so --resume --pooling mean, the value used, was refused as "'cls' -> 'mean'"),
    and a recipe flag given with another value is named in a warning, since it is not used."""
    first = tmp_path / "first"
    assert call(cli.main, argv(task, first, "--max-steps", "1"))[0] == 0
    again, saved = tmp_path / "again", str(first / "final")
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(cli.main, argv(task, again, "--model", saved, "--max-steps", "1", "--pooling", "cls",
                                        "--temperature", "0.05"))
    assert code == 0, err
    assert (f"{saved} is a saved retriever and keeps its own recipe: --pooling 'cls' not used (it has pooling "
            "'mean')") in caplog.text
    recipe = json.loads((again / SETTINGS_FILE).read_text())["model"]["retriever"]
    assert (recipe["pooling"], recipe["normalize"]) == ("mean", True) and recipe["temperature"] == pytest.approx(0.05)
    for flags in (("--pooling", "mean"), ("--temperature", "0.05"), ()):
        code, err = call(cli.main, argv(task, again, "--model", saved, "--max-steps", "2", "--resume", "latest",
                                        *flags))
        assert code == 0, err


# --------------------------------------------------------------------------------------------- best/
def scripted_dev(monkeypatch: pytest.MonkeyPatch, scores: dict, seen: dict) -> None:
    """Make every dev evaluation report ``scores[step]`` as its average rank (and keep the weights evaluated)."""
    def evaluate(self: Trainer) -> dict:
        seen[self.step] = {k: v.clone() for k, v in self.retriever.state_dict().items()}
        return {"dev_loss": 1.0, "dev_accuracy": 0.5, "dev_avg_rank": scores[self.step]}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def dev_run(task: dict, out: Path, **kw: object) -> object:
    return train_config(model=str(task["st"]), train_files=[str(task["dpr"])], dev_file=str(task["dpr"]),
                        output_dir=str(out), batch_size=4, num_workers=0, query_chunk_size=2, passage_chunk_size=4,
                        cache_dir=str(task["dir"] / "cache"), device="cpu", eval_every=1, **kw)


def saved_weights(folder: Path) -> dict:
    return Retriever.load(folder).state_dict()


def test_the_starting_model_is_the_baseline_best_must_beat(task: dict, tmp_path: Path, monkeypatch, caplog,
                                                            capsys) -> None:
    """Dev scores 2.0 before training, then 3.0 and 2.5 (worse): no step is "new best", best/ holds the starting
    model (written once, at step 0) and the summary says so."""
    seen: dict = {}
    scripted_dev(monkeypatch, {0: 2.0, 1: 3.0, 2: 2.5}, seen)
    saves: list = []
    real_save = Retriever.save
    monkeypatch.setattr(Retriever, "save", lambda self, path: (saves.append(Path(path).name), real_save(self, path)))
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        summary = Trainer(dev_run(task, tmp_path / "out", max_steps=2)).fit()
    assert "new best" not in caplog.text
    assert (summary["best"], summary["best_step"]) == (2.0, 0) and saves.count("best") == 1
    best = saved_weights(tmp_path / "out" / "best")
    assert all(torch.equal(best[k], v) for k, v in seen[0].items())
    assert not all(torch.equal(best[k], v) for k, v in seen[2].items())  # training did move the weights
    printed = capsys.readouterr().out
    assert "the starting model, no step beat it" in printed
    # each evaluation after a step is logged as the first is, and the table gives the last beside the best (only
    # metrics.jsonl held them): here the trained model scores worse than the starting one
    assert "dev at step 1: {'dev_loss': 1.0, 'dev_accuracy': 0.5, 'dev_avg_rank': 3.0}" in caplog.messages
    assert "| last dev | avg_rank 2.5000 (step 2) |" in printed


def test_a_step_that_beats_the_baseline_is_the_new_best(task: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    seen: dict = {}
    scripted_dev(monkeypatch, {0: 2.0, 1: 1.5, 2: 1.8}, seen)
    summary = Trainer(dev_run(task, tmp_path / "out", max_steps=2)).fit()
    assert (summary["best"], summary["best_step"]) == (1.5, 1)
    best = saved_weights(tmp_path / "out" / "best")
    assert all(torch.equal(best[k], v) for k, v in seen[1].items())
    printed = capsys.readouterr().out
    assert "avg_rank 1.5000 (lower is better) in " in printed and "best (step 1) |" in printed, printed


@pytest.mark.parametrize("metric, better", [("avg_rank", -1), ("loss", -1), ("accuracy", 1)])
def test_best_metric_picks_by_its_direction_and_a_tie_is_no_new_best(task: dict, tmp_path: Path, monkeypatch,
                                                                      metric: str, better: int) -> None:
    """--best-metric: accuracy is better higher, avg_rank and loss lower. The start scores 2.0, step 1 ties it (no
    new best: best/ is written again only for a better score), step 2 is better, step 3 better than the start but
    worse than step 2: best/ holds step 2's model, written twice in all (the start and step 2)."""
    scores = {0: 2.0, 1: 2.0, 2: 2.0 + 0.5 * better, 3: 2.0 + 0.2 * better}
    seen: dict = {}

    def evaluate(self: Trainer) -> dict:
        seen[self.step] = {k: v.clone() for k, v in self.retriever.state_dict().items()}
        return {"dev_loss": 1.0, "dev_accuracy": 0.5, "dev_avg_rank": 3.0, f"dev_{metric}": scores[self.step]}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    saves: list = []
    real_save = Retriever.save
    monkeypatch.setattr(Retriever, "save", lambda self, path: (saves.append(Path(path).name), real_save(self, path)))
    summary = Trainer(dev_run(task, tmp_path / "out", max_steps=3, best_metric=metric)).fit()
    assert (summary["best"], summary["best_step"], summary["best_metric"]) == (scores[2], 2, metric)
    assert saves.count("best") == 2
    best = saved_weights(tmp_path / "out" / "best")
    assert all(torch.equal(best[k], v) for k, v in seen[2].items())


def test_resume_keeps_the_baseline(task: dict, tmp_path: Path, monkeypatch) -> None:
    """Stopped after step 1 (worse than the start), resumed: step 2 (still worse) is no new best either."""
    seen: dict = {}
    scripted_dev(monkeypatch, {0: 2.0, 1: 3.0, 2: 2.5}, seen)
    Trainer(dev_run(task, tmp_path / "out", max_steps=1, save_every=1)).fit()
    summary = Trainer(dev_run(task, tmp_path / "out", max_steps=2, save_every=1, resume="latest")).fit()
    best = saved_weights(tmp_path / "out" / "best")
    assert all(torch.equal(best[k], v) for k, v in seen[0].items())
    assert (summary["best"], summary.get("best_step")) == (2.0, 0)


def test_a_resume_into_a_new_output_keeps_its_best_there(task: dict, tmp_path: Path, monkeypatch, caplog) -> None:
    """--resume OTHER/checkpoint-2 --output NEW named OTHER/best in NEW's summary, though OTHER/best held another
    step's model by then. The checkpoint's own model, when it is the best recorded, is copied to NEW/best;
    otherwise the record is reset (one line says so) and NEW's next dev evaluation writes NEW/best."""
    seen: dict = {}
    scripted_dev(monkeypatch, {0: 3.0, 1: 2.5, 2: 2.0, 3: 2.2, 4: 1.0}, seen)
    Trainer(dev_run(task, tmp_path / "other", max_steps=4, save_every=2)).fit()  # other/best: step 4's model
    scripted_dev(monkeypatch, {3: 2.5, 4: 2.6}, seen)  # no step of the resumed run beats step 2
    summary = Trainer(dev_run(task, tmp_path / "new", max_steps=4,
                              resume=str(tmp_path / "other" / "checkpoint-2"))).fit()
    assert (summary["best_model"], summary["best_step"]) == (str(tmp_path / "new" / "best"), 2), summary
    best, step2 = saved_weights(tmp_path / "new" / "best"), saved_weights(tmp_path / "other" / "checkpoint-2" / "model")
    assert all(torch.equal(best[k], v) for k, v in step2.items())
    scripted_dev(monkeypatch, {0: 3.0, 1: 2.0, 2: 2.5}, seen)
    Trainer(dev_run(task, tmp_path / "other2", max_steps=2, save_every=2)).fit()  # best: step 1, no checkpoint
    scripted_dev(monkeypatch, {3: 2.7, 4: 2.6}, seen)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        summary = Trainer(dev_run(task, tmp_path / "new2", max_steps=4,
                                  resume=str(tmp_path / "other2" / "checkpoint-2"))).fit()
    assert f"{tmp_path / 'new2'} has no best/ yet" in caplog.text, caplog.text
    assert (summary["best_model"], summary["best_step"], summary["best"]) == (str(tmp_path / "new2" / "best"), 4,
                                                                              2.6), summary
    best = saved_weights(tmp_path / "new2" / "best")
    assert all(torch.equal(best[k], v) for k, v in seen[4].items())


def argv_without_checkpoints(task: dict, out: Path, *extra: str) -> list[str]:
    """The command line of a run on the task's DPR file that saves no checkpoint (no --save-every)."""
    args = argv(task, out, "--train", task["dpr"], *extra)
    at = args.index("--save-every")
    return args[:at] + args[at + 2:]


def interrupt_at_step(monkeypatch, step: int) -> Callable:
    """Make training raise KeyboardInterrupt (Ctrl-C) when it reaches ``step``; returns the real train_step, to put
    back with ``monkeypatch.setattr(Trainer, "train_step", ...)``."""
    real_step = Trainer.train_step

    def interrupted(self: Trainer, batch: dict) -> object:
        if self.step == step:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    return real_step


def test_a_run_stopped_before_its_first_checkpoint_starts_over(task: dict, tmp_path: Path, monkeypatch) -> None:
    """best/ then holds only the starting model (written before training): the same command starts over, as the
    interrupt's advice says; an earlier run's trained best/ is still refused."""
    scripted_dev(monkeypatch, {0: 2.0, 1: 3.0, 2: 2.5}, {})
    out = tmp_path / "out"
    args = argv_without_checkpoints(task, out, "--dev", task["dpr"], "--max-steps", "2")
    real_step = interrupt_at_step(monkeypatch, 1)
    code, err = call(cli.main, args)
    assert code == 130 and "run the same command again to start over" in err, err
    assert (out / "best").is_dir() and not (out / "final").exists()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    code, err = call(cli.main, args)
    assert code == 0, err
    left = tmp_path / "left"
    shutil.copytree(out / "best", left / "best")  # a starting model's best/ alone: replaced by a new run
    check_start(left, None)
    card = left / "best" / "README.md"
    card.write_text(card.read_text().replace("\n    steps: 0\n", "\n    steps: 2\n"))  # a trained one: kept
    with pytest.raises(DprGcError, match=r"already holds the trained model of an earlier run \(best/\)"):
        check_start(left, None)


def test_a_new_run_from_the_starting_model_left_in_best_is_refused_and_removes_nothing(task: dict, tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """A run stopped before its first checkpoint leaves the starting model in best/, which a new run in that
    --output removes: a new run that starts from it (--model OUT/best --output OUT) is refused in one line, and
    best/ is kept."""
    scripted_dev(monkeypatch, {0: 2.0, 1: 3.0}, {})
    out = tmp_path / "out"
    real_step = interrupt_at_step(monkeypatch, 1)
    code, err = call(cli.main, argv_without_checkpoints(task, out, "--dev", task["dpr"], "--max-steps", "2"))
    assert code == 130 and (out / "best").is_dir(), err
    monkeypatch.setattr(Trainer, "train_step", real_step)
    before = saved_weights(out / "best")
    args = argv_without_checkpoints(task, out, "--max-steps", "1")
    args[args.index("--model") + 1] = out / "best"
    code, err = call(cli.main, args)
    assert code == 2 and err.strip() == (f"error: the input --model {out / 'best'} is best in the output folder "
                                         f"--output {out}, which the run writes or removes; move the input out of "
                                         "that folder, or give another --output"), err
    after = saved_weights(out / "best")
    assert all(torch.equal(before[k], after[k]) for k in before)
    shutil.copytree(out / "best", tmp_path / "copy")
    args[args.index("--model") + 1] = tmp_path / "copy"
    code, err = call(cli.main, args)
    assert code == 0 and (out / "final").is_dir(), err


def test_a_run_stopped_with_a_trained_best_before_its_first_checkpoint_says_what_to_do(task: dict, tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """Stopped after a step beat the starting model (best/ holds it) but before any checkpoint: the same command
    would be refused (a trained best/), so the advice names best/ and says to move or delete it; doing so, the same
    command starts over and finishes."""
    scripted_dev(monkeypatch, {0: 3.0, 1: 2.0, 2: 2.5, 3: 2.4}, {})
    out = tmp_path / "out"
    args = argv_without_checkpoints(task, out, "--dev", task["dpr"], "--max-steps", "3", "--eval-every", "1")
    real_step = interrupt_at_step(monkeypatch, 2)
    code, err = call(cli.main, args)
    last = err.strip().splitlines()[-1]
    assert code == 130 and last == (f"interrupted: no checkpoint was saved yet and {out / 'best'} holds the best "
                                    "model so far (step 1); move or delete it, then run the same command again to "
                                    "start over"), err
    monkeypatch.setattr(Trainer, "train_step", real_step)
    shutil.rmtree(out / "best")
    code, err = call(cli.main, args)
    assert code == 0, err


# --------------------------------------------------------------------------------------------- the dev file's log
def test_the_dev_files_load_is_logged_once_per_run(task: dict, tmp_path: Path, caplog) -> None:
    """Evaluated before training and after each of 2 steps, the dev file is loaded (and its counts logged) once."""
    dev = write_dpr(tmp_path / "dev.json", make_records(8, 5))
    config = train_config(model=str(task["st"]), train_files=[str(task["dpr"])], dev_file=str(dev),
                          output_dir=str(tmp_path / "out"), batch_size=4, num_workers=0, query_chunk_size=2,
                          passage_chunk_size=4, cache_dir=str(task["dir"] / "cache"), device="cpu", eval_every=1,
                          max_steps=2)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        Trainer(config).fit()
    loads = [r for r in caplog.records if r.getMessage().startswith(f"{dev}: 8 records, 8 kept")]
    evaluations = [r for r in caplog.records if r.getMessage().startswith("dev validation over 8 questions")]
    assert (len(loads), len(evaluations)) == (1, 3), caplog.text


@pytest.mark.parametrize("member, given", [
    ("metrics.jsonl", "metrics.jsonl"), (SETTINGS_FILE, SETTINGS_FILE), ("final", "final/dev.jsonl"),
    ("best", "best/dev.jsonl"), ("checkpoint-3", "checkpoint-3/dev.jsonl"), (".metrics.jsonl.x.tmp", None)])
def test_an_input_that_a_run_writes_in_its_output_is_refused(task: dict, tmp_path: Path, monkeypatch, member: str,
                                                              given: str) -> None:
    """A --dev (or --train) file named as what train writes or removes in --output (metrics.jsonl, which a new
    run deletes; train_config.json; a file inside final/, best/ or checkpoint-N/; a temporary of one) is refused in
    one line naming both flags, before the model loads, and kept."""
    monkeypatch.setattr(Retriever, "load", lambda *a, **k: pytest.fail("the model loaded first"))
    out = tmp_path / "run"
    dev = out / (given or member)
    dev.parent.mkdir(parents=True)
    shutil.copy(task["dpr"], dev)
    before = dev.read_bytes()
    for flag in ("--dev", "--train"):
        args = argv(task, out, "--max-steps", "1", *(["--dev", dev] if flag == "--dev" else []))
        args[args.index("--train") + 1] = dev if flag == "--train" else task["dpr"]
        code, err = call(cli.main, args)
        assert code == 2 and err.strip() == (f"error: the input {flag} {dev} is {member} in the output folder "
                                             f"--output {out}, which the run writes or removes; move the input out "
                                             "of that folder, or give another --output"), err
        assert dev.read_bytes() == before
