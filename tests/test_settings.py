"""Settings declared once: every option of every command has help and shows its default, the library and the
command line apply one rule, a run records its resolved settings, and ``--resume`` refuses a changed setting that
changes the model or the training signal while allowing steps, cadence and workers to change."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from transformers import BertTokenizerFast

from dpr_gc import cli
from dpr_gc.base.errors import DprGcError
from dpr_gc.base.settings import FIXED, FREE, changed_settings, to_record
from dpr_gc.model.retriever import RetrieverConfig
from dpr_gc.retrieval.index_params import IndexParams
from dpr_gc.train.config import (SETTINGS_FILE, CacheConfig, DataConfig, ModelConfig, OptimConfig, RunConfig,
                                 TrainConfig, compare_recorded, config_from_args, resolve_defaults)
from dpr_gc.train.trainer import train
from tests.helpers import call, defaults_stated_twice, load_script, summary_rows, tiny_bert, write_vocab
from tests.train_data import make_records, write_dpr

ROOT = Path(__file__).resolve().parents[1]


def error_line(code: int, err: str) -> str:
    """The one ``error:`` line of a refused command (exit status 2)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------------------------- help
def sub_parsers(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += sub_parsers(sub, f"{name} {sub_name}")
    return out


def script_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    import importlib.util

    from dpr_gc.base.args import ArgumentParser

    out = []
    for name in ("dense_retriever", "download_dpr_data", "generate_dense_embeddings", "train_dense_encoder"):
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "build_parser"):
            out += sub_parsers(module.build_parser(), name)
        elif not hasattr(module, "add_arguments"):
            raise AssertionError(f"scripts/{name}.py builds its parser where this test cannot reach it")
        else:
            parser = ArgumentParser(prog=name)
            module.add_arguments(parser, dpr_aliases=True)
            out.append((name, parser))
    return out


def benchmark_parsers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser of each ``benchmarks/*.py`` script, caught as the script starts to read its command line."""
    import importlib

    from dpr_gc.base.args import ArgumentParser

    class Caught(Exception):
        pass

    def catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        caught.append(self)
        raise Caught

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(ArgumentParser, "parse_args", catch)
    out = []
    for path in sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "bench_common"):
        module, caught = importlib.import_module(path.stem), []
        start = getattr(module, "parse_args", None) or module.main
        with contextlib.suppress(Caught):
            start(["--help"])
        assert caught, f"benchmarks/{path.name} reads its command line where this test cannot reach it"
        out.append((f"benchmarks/{path.name}", caught[0]))
    return out


def help_gaps(parsers: list[tuple[str, argparse.ArgumentParser]], hidden_aliases_only: bool = True
              ) -> tuple[list[str], list[str], int]:
    """The visible options of ``parsers`` without help and those whose ``--help`` shows no default, and how many
    options were checked; with ``hidden_aliases_only`` a hidden option must alias a visible one."""
    missing, no_default, checked = [], [], 0
    for name, parser in parsers:
        visible = {a.dest for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            checked += 1
            if action.help == argparse.SUPPRESS:
                if hidden_aliases_only and action.dest not in visible:
                    missing.append(f"{name} {action.option_strings[0]}")
                continue
            if not (action.help or "").strip():
                missing.append(f"{name} {action.option_strings[0]}")
            elif not action.required and action.nargs != 0 and "default:" not in formatter._expand_help(action):
                no_default.append(f"{name} {action.option_strings[0]}")
            if "%%" in formatter._expand_help(action):  # a percent sign escaped twice shows doubled
                missing.append(f"{name} {action.option_strings[0]} (prints %%)")
    return missing, no_default, checked


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    missing, no_default, checked = help_gaps(sub_parsers(cli.build_parser(), "dpr-gc"))
    assert checked > 150
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose --help shows no default: {no_default}"


def test_every_visible_option_of_the_compat_scripts_has_help_and_shows_its_default() -> None:
    """GC-DPR's flags in ``scripts/`` (``--adam_eps``) printed bare; ``--eval_per_epoch`` said "not set" though
    one evaluation per epoch applies unless ``--eval-every`` is given; download_dpr_data.py's help formatter showed
    no default (``--output``'s data/dpr). The flags they accept and ignore stay hidden."""
    parsers = script_parsers()
    missing, no_default, checked = help_gaps(parsers, hidden_aliases_only=False)
    assert checked > 100
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose --help shows no default: {no_default}"
    train = dict(parsers)["train_dense_encoder train"]
    text = " ".join(train.format_help().split())
    assert "per epoch (default: 1, none when --eval-every is given)" in text, text
    assert "AdamW epsilon (default: 1e-08)" in text
    download = " ".join(dict(parsers)["download_dpr_data"].format_help().split())
    assert "download folder (default: data/dpr)" in download and "python scripts/download_dpr_data.py --list\n" in \
        dict(parsers)["download_dpr_data"].format_help()  # its examples keep their lines


def test_every_command_that_takes_a_beir_split_names_it_beir_split_and_takes_split_too(capsys) -> None:
    """One name for a BEIR folder's qrels split across commands: ``--beir-split`` in ``--help``, ``--split`` still
    accepted (same destination); mine's destination stays ``split``, the name its resume key records. (train's
    ``--dev-beir-split`` is the split of its ``--dev`` folder, named with the other ``--dev-*`` flags.)"""
    from dpr_gc.retrieval.mine import RESUME_FLAGS

    dests = {"dpr-gc mine": "split", "dpr-gc prepare-data": "beir_split"}
    found = {}
    for name, parser in sub_parsers(cli.build_parser(), "dpr-gc"):
        actions = [a for a in parser._actions if any("split" in s and not s.startswith("--dev-")
                                                     for s in a.option_strings)]
        if not actions:
            continue
        found[name] = {a.dest for a in actions}
        shown = [s for a in actions if a.help != argparse.SUPPRESS for s in a.option_strings]
        assert shown == ["--beir-split"], (name, shown)
        assert {s for a in actions for s in a.option_strings} == {"--beir-split", "--split"}, name
        with pytest.raises(SystemExit):
            parser.parse_args(["--help"])
        assert "--beir-split" in capsys.readouterr().out
        required = ["--output", "o.json"] if name.endswith("mine") else ["train.json"]
        for flag in ("--beir-split", "--split"):
            assert getattr(parser.parse_args([*required, flag, "dev"]), dests[name]) == "dev", (name, flag)
        assert getattr(parser.parse_args(required), dests[name]) == "train", name
    assert found == {name: {dest} for name, dest in dests.items()}
    assert "split" in RESUME_FLAGS


@pytest.mark.parametrize("argv, flag", [
    (["prepare-data", "train.json", "--beir-split="], "--beir-split"),
    (["prepare-data", "train.json", "--split="], "--split"),
    (["mine", "--beir-dir", "beir", "--output", "o.json", "--beir-split="], "--beir-split"),
    (["train", "--train", "t.json", "--output", "o", "--dev", "beir", "--dev-beir-split", " "], "--dev-beir-split"),
])
def test_an_empty_beir_split_is_refused_naming_its_flag(argv: list, flag: str) -> None:
    """An empty --beir-split= was read as the split '' and refused later as "... has no qrels/.tsv ...", the flag
    unnamed; it is refused as the flags are read."""
    line = error_line(*call(cli.main, argv))
    assert line.startswith(f"error: dpr-gc {argv[0]}: argument {flag}: the split is empty; give the qrels split to "
                           "read (qrels/SPLIT.tsv)"), line
    with pytest.raises(DprGcError, match="^--dev-beir-split: the split is empty"):
        __import__("dpr_gc.train.validation", fromlist=["DevLimits"]).DevLimits(beir_split="")


def test_train_help_says_which_settings_resume_may_change(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    raw = capsys.readouterr().out
    for flag, kind in (("--learning-rate", "fixed"), ("--pooling", "fixed"), ("--temperature", "fixed"),
                       ("--normalize", "fixed"), ("--max-steps", "may change"), ("--save-every", "may change"),
                       ("--num-workers", "may change")):
        after = " ".join(raw[raw.index("\n  " + flag):].split())
        note = after[after.index("[") + 1:after.index("]")]
        assert note == f"{kind} on --resume", (flag, note)


def test_help_says_defaults_one_way_and_only_what_applies(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """--help wrote defaults as "(default: X)" but for verify's --batches, index's --nlist and --pq-m, LoRA's alpha
    and dense_retriever.py ("(default 1)"), and index's --factory as "(default: None)"; verify tagged every flag
    "[fixed on --resume]" though it refuses --resume; cache said its files are named by a hash of their content,
    though the key holds the source's path, size and modification time (a copy elsewhere gets a file of its own).
    The benchmark scripts said many defaults twice ("(default 5) (default: 5)"), or an own "(default --batch)" beside
    the appended "(default: not set)": every option states its default once, the same way."""
    texts = {}
    parsers = [*sub_parsers(cli.build_parser(), "dpr-gc"), *script_parsers(), *benchmark_parsers(monkeypatch)]
    for name, parser in parsers:
        texts[name] = " ".join(parser.format_help().split())
        assert not re.search(r"\(default [^:]", texts[name]), (name, re.findall(r"\(default [^)]*\)", texts[name]))
        assert "(default: None" not in texts[name], (name, re.findall(r"\S+ [^(]*\(default: None[^)]*\)", texts[name]))
        assert "(default: )" not in texts[name], (name, re.findall(r"\S+ [^(]*\(default: \)", texts[name]))
        assert not defaults_stated_twice(parser), (name, defaults_stated_twice(parser))
    assert "on --resume]" not in texts["dpr-gc verify"] and "[fixed on --resume]" in texts["dpr-gc train"]
    assert "hash of its content" not in texts["dpr-gc cache"]
    assert "path, size, modification time" in texts["dpr-gc cache"], texts["dpr-gc cache"]


def test_verify_help_says_which_of_trains_flags_it_refuses_or_ignores(capsys) -> None:
    """verify --help described --resume as train does ("checkpoint folder, or 'latest'") though verify refuses it,
    and --save-every/--keep-checkpoints as if they acted; each says what verify does with it."""
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--resume RESUME refused: verify checks the starting model; to check a checkpoint's weights, give its "
            "model/ folder as --model") in text
    for flag in ("--save-every SAVE_EVERY", "--keep-checkpoints KEEP_CHECKPOINTS"):
        assert f"{flag} accepted and ignored: verify writes no checkpoints" in text, flag
    for flag in ("EVAL_EVERY", "{avg_rank,loss,accuracy}", "DEV_BATCH_SIZE"):
        assert f"{flag} accepted and ignored: verify runs no dev validation" in text, flag
    for flag in ("EPOCHS", "WARMUP_RATIO", "LEARNING_RATE"):
        assert f"{flag} accepted and ignored: verify compares gradients over --batches" in text, flag
    assert "latest" not in text and "steps between dev evaluations" not in text


def test_train_help_says_the_recipe_flags_default_to_the_models_own(capsys) -> None:
    """--help showed --temperature (default: 1.0) and --passage-format (default: pair) while the default model, a
    sentence-transformers folder, trains with its own recipe (0.05, concat), and --pooling showed no default at all
    (a help holding the word "default" was taken to state it)."""
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "folder, like the default model, brings its own recipe, which the flags given replace" in text
    for flag, default in (("--pooling", "cls"), ("--normalize", "False"), ("--temperature", "1.0"),
                          ("--query-max-length", "32"), ("--passage-format", "pair")):
        after = text[text.index(flag, text.index("retriever recipe:")):]
        shown = after[after.index("(default:"):after.index(")", after.index("(default:")) + 1]
        assert shown == f"(default: {default} for a plain Hugging Face model, else the model's own)", (flag, shown)


# --------------------------------------------------------------------------------------------- one rule
@pytest.mark.parametrize("flag, bad, build", [
    ("--batch-size", "0", lambda: DataConfig(batch_size=0)),
    ("--learning-rate", "-1", lambda: OptimConfig(learning_rate=-1.0)),
    ("--save-every", "0", lambda: RunConfig(save_every=0)),
    ("--temperature", "0", lambda: RetrieverConfig(temperature=0.0)),
    ("--dev-max-questions", "0", lambda: DataConfig(dev=__import__("dpr_gc.train.validation",
                                                                   fromlist=["DevLimits"]).DevLimits(0))),
])
def test_library_and_command_line_apply_one_rule(flag: str, bad: str, build: Callable[[], Any], tmp_path) -> None:
    line = error_line(*call(cli.main, ["train", "--train", "t.json", "--output", tmp_path / "o", flag, bad]))
    with pytest.raises(DprGcError) as refused:
        build()
    need = str(refused.value).split(" must be ")[1].split(",")[0]
    assert str(refused.value).startswith(f"{flag} must be ")
    assert flag in line and need in line, (line, str(refused.value))


@pytest.mark.parametrize("command, flag, value, refusal", [
    (["train", "--train", "t.json"], "--memory-budget", "-5GB", "memory budget must be >= 0 bytes, got -5GB"),
    (["encode", "--model", "m", "--corpus", "c.tsv"], "--device", "-cpu", "'-cpu' is not a torch device"),
    (["train", "--train", "t.json"], "--learning-rate", "-1e-3", "'-1e-3' is not a positive number")])
def test_a_value_starting_with_a_dash_says_how_to_write_it(command: list, flag: str, value: str, refusal: str,
                                                           tmp_path) -> None:
    """argparse reads a value that starts with '-' as a flag and said only "expected one argument"; the line names
    the flag and the value and says to write FLAG=VALUE, after which the value meets its own check. Negative numbers
    argparse takes as values (plain ones: -1, -.5, not -1e-3), and a real flag after a flag, keep their own
    messages."""
    argv = [*command, "--output", tmp_path / "o"]
    line = error_line(*call(cli.main, [*argv, flag, value]))
    assert f"argument {flag}: its value '{value}' starts with '-'" in line and f"write {flag}={value} if" in line, line
    line = error_line(*call(cli.main, [*argv, f"{flag}={value}"]))
    assert refusal in line and "write" not in line, line
    assert "'-1' is not" in error_line(*call(cli.main, [*argv, "--device", "-1"]))
    assert "expected one argument" in error_line(*call(cli.main, [*argv, flag, "--output", tmp_path / "p"]))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, said, ending", [
    (["encod"], "invalid choice: 'encod' (choose from 'demo', ", "; did you mean 'encode'? (see dpr-gc --help)"),
    (["train", "--train", "t.json", "--output", "o", "--pooling", "clss"], "argument --pooling: invalid choice: 'clss'",
     "; did you mean 'cls'? (see dpr-gc train --help)"),
    (["evaluate", "--resluts", "r.json"], "dpr-gc evaluate: unrecognized arguments: --resluts r.json",
     "; did you mean --results? (see dpr-gc evaluate --help)"),
    (["train", "--train", "t.json", "--output", "o", "--batch-szie=4"], "unrecognized arguments: --batch-szie=4",
     "; did you mean --batch-size? (see dpr-gc train --help)"),
    (["train", "--batch-szie", "4"], "error: dpr-gc train: unrecognized arguments: --batch-szie 4; did you mean "
     "--batch-size?; the following arguments are required: --train/--train_file, --output/--output_dir",
     "(see dpr-gc train --help)"),
    (["train", "--batch-szie", "4", "--output", "o"], "unrecognized arguments: --batch-szie 4; did you mean "
     "--batch-size?; the following arguments are required: --train/--train_file (see", "(see dpr-gc train --help)")])
def test_a_misspelt_command_flag_or_choice_is_named_with_the_closest_one(argv: list, said: str, ending: str) -> None:
    """One line naming what was given and the closest command, flag or choice, pointing to the help of the command
    it was given to; a word close to nothing gets argparse's line alone. A misspelt flag named before missing
    required ones keeps its value, as argparse's own line does (it once read "--batch-szie; did you mean")."""
    line = error_line(*call(cli.main, argv))
    assert said in line and line.endswith(ending), line
    for nothing_close in (["xyz"], ["train", "--train", "t.json", "--output", "o", "--zzzz"]):
        assert "did you mean" not in error_line(*call(cli.main, nothing_close))


TRAIN_BASE = ["train", "--train", "t.json", "--output", "o"]
SCRIPT_SAYS = ("{flag} is a GC-DPR/DPR flag dpr-gc {command} has no flag for; scripts/{script} takes DPR's whole "
               "command line")


@pytest.mark.parametrize("argv, hint", [
    ([*TRAIN_BASE, "--model_file", "tiny"], "--model_file is DPR's name: dpr-gc train takes --model"),
    (["train", "--model_file", "tiny"], "--model_file is DPR's name: dpr-gc train takes --model"),
    ([*TRAIN_BASE, "--train_files_upsample_rates", "[1]"],
     "--train_files_upsample_rates is DPR's name: dpr-gc train takes --sampling-rates"),
    ([*TRAIN_BASE, "--no_cuda"], "--no_cuda is DPR's name: dpr-gc train takes --device cpu"),
    (["retrieve", "--index", "i", "--qa_file", "q.csv", "--n_docs", "5"],
     "--qa_file is DPR's name: dpr-gc retrieve takes --queries"),
    (["retrieve", "--index", "i", "--queries", "q.csv", "--n_docs", "5"],
     "--n_docs is DPR's name: dpr-gc retrieve takes --top-k"),
    (["retrieve", "--index", "i", "--queries", "q.csv", "--n-docs", "100"],
     "--n-docs is DPR's name: dpr-gc retrieve takes --top-k"),
    (["encode", "--model", "m", "--ctx_file", "c.tsv", "--output", "o"],
     "--ctx_file is DPR's name: dpr-gc encode takes --corpus"),
    (["mine", "--model_file", "m"], "--model_file is DPR's name: dpr-gc mine takes --model"),
    *[([*TRAIN_BASE, flag, "1"], SCRIPT_SAYS.format(flag=flag, command="train", script="train_dense_encoder.py"))
      for flag in ("--log_batch_step", "--eval_per_epoch", "--gradient_accumulation_steps", "--encoder_model_type")],
    ([*TRAIN_BASE, "--do_lower_case"],
     SCRIPT_SAYS.format(flag="--do_lower_case", command="train", script="train_dense_encoder.py")),
    (["retrieve", "--index", "i", "--queries", "q.csv", "--encoded_ctx_file", "e"],
     SCRIPT_SAYS.format(flag="--encoded_ctx_file", command="retrieve", script="dense_retriever.py")),
    (["encode", "--model", "m", "--corpus", "c.tsv", "--output", "o", "--pretrained_model_cfg", "bert"],
     SCRIPT_SAYS.format(flag="--pretrained_model_cfg", command="encode", script="generate_dense_embeddings.py"))])
def test_a_dpr_flag_name_is_answered_with_the_dpr_gc_flag_or_the_script(argv: list, hint: str) -> None:
    """GC-DPR/DPR flag names typed into dpr-gc commands got lexical guesses (--model_file: "did you mean
    --dev_file?", --log_batch_step: "--batch_size?") or nothing: the line names the dpr-gc flag that takes the
    setting, or, for a GC-DPR setting the command has no flag for, the script that takes DPR's command line."""
    line = error_line(*call(cli.main, argv))
    assert f"; {hint}" in line and "did you mean" not in line, line


@pytest.mark.parametrize("flag, whose, target", [
    ("--eval_steps", "Hugging Face's", "--eval-every"), ("--save_steps", "Hugging Face's", "--save-every"),
    ("--save_total_limit", "Hugging Face's", "--keep-checkpoints"),
    ("--per_device_train_batch_size", "Hugging Face's", "--batch-size"),
    ("--lr", "sentence-transformers'", "--learning-rate"), ("--untie_encoder", "Tevatron's", "--separate-encoders"),
    ("--gc_q_chunk_size", "Tevatron's", "--query-chunk-size"),
    ("--gc_p_chunk_size", "Tevatron's", "--passage-chunk-size")])
def test_another_tools_train_flag_is_answered_with_the_train_flag_of_the_same_setting(flag: str, whose: str,
                                                                                      target: str) -> None:
    """Hugging Face's --eval_steps is evaluation's cadence, --save_steps checkpointing's: each other tool's name is
    answered with the ``dpr-gc train`` flag taking that setting, not a neighbour's."""
    line = error_line(*call(cli.main, [*TRAIN_BASE, flag, "2"]))
    assert f"; {flag} is {whose} name: dpr-gc train takes {target}" in line, line


def test_every_dpr_flag_a_script_takes_is_answered_by_its_command() -> None:
    """Each option string of a DPR-compatible script's DPR option (one with a name spelt as DPR does: --model_file,
    --n_docs, and its aliases: --n-docs, --local-rank) that its dpr-gc command lacks, typed into that command, is
    answered with a flag the command has or with the script; dpr-gc's own flags under DPR's spelling (--batch_size)
    are left to spelling. The scripts' parsers are the source, so a new script alias cannot go unanswered."""
    from dpr_gc.base.args import closest

    commands = {"train_dense_encoder train": "train", "generate_dense_embeddings": "encode",
                "dense_retriever": "retrieve"}
    for name, script in script_parsers():
        if name not in commands:
            continue
        command = cli.build_parser(commands[name])._subparsers._group_actions[0].choices[commands[name]]
        dpr = {flag for action in script._actions if any("_" in option for option in action.option_strings)
               for flag in action.option_strings}
        for flag in sorted(dpr - set(command._option_string_actions)):
            hint = command.closest_flag([flag])
            named = closest(flag, command._option_string_actions)
            assert hint.startswith(f"; {flag} is ") or named == flag.replace("_", "-"), (name, flag, hint)
            if " takes --" in hint:
                assert hint.split(" takes ")[1].split()[0] in command._option_string_actions, (name, hint)


@pytest.mark.parametrize("argv, hints", [
    (["encode", "--model_file", "m", "--ctx_file", "c.tsv", "--out_file", "o"],
     ["--model_file is DPR's name: dpr-gc encode takes --model", "--ctx_file is DPR's name: dpr-gc encode takes "
      "--corpus", "--out_file is DPR's name: dpr-gc encode takes --output"]),
    (["retrieve", "--model_file", "m", "--qa_file", "q.csv", "--n-docs", "5", "--index", "i"],
     ["--model_file is DPR's name: dpr-gc retrieve takes --model", "--qa_file is DPR's name: dpr-gc retrieve takes "
      "--queries", "--n-docs is DPR's name: dpr-gc retrieve takes --top-k"]),
    ([*TRAIN_BASE, "--eval_per_epoch", "2", "--model_file", "m", "--log_batch_step=3"],
     ["--model_file is DPR's name: dpr-gc train takes --model", "--eval_per_epoch, --log_batch_step are GC-DPR/DPR "
      "flags dpr-gc train has no flag for; scripts/train_dense_encoder.py takes DPR's whole command line"])])
def test_a_pasted_dpr_command_line_has_every_dpr_flag_answered(argv: list, hints: list) -> None:
    """A DPR command line pasted into a dpr-gc command answered only its first DPR flag, so each rerun met the
    next one: the one error line answers each of them."""
    line = error_line(*call(cli.main, argv))
    assert all(hint in line for hint in hints), line


@pytest.mark.parametrize("argv, hint", [
    ([*TRAIN_BASE, "--lr", "1e-5"], "--lr is sentence-transformers' name: dpr-gc train takes --learning-rate"),
    ([*TRAIN_BASE, "--per_device_train_batch_size", "4"],
     "--per_device_train_batch_size is Hugging Face's name: dpr-gc train takes --batch-size"),
    ([*TRAIN_BASE, "--model_name_or_path", "m"],
     "--model_name_or_path is Hugging Face's name: dpr-gc train takes --model"),
    ([*TRAIN_BASE, "--max_seq_length", "64"],
     "--max_seq_length is sentence-transformers' name: dpr-gc train takes --passage-max-length (and "
     "--query-max-length"),
    (["encode", "--model", "m", "--corpus", "c.tsv", "--output", "o", "--max_seq_length", "64"],
     "--max_seq_length is sentence-transformers' name: dpr-gc encode takes --max-length"),
    ([*TRAIN_BASE, "--q_max_len", "32"], "--q_max_len is Tevatron's name: dpr-gc train takes --query-max-length"),
    ([*TRAIN_BASE, "--p_max_len", "128"], "--p_max_len is Tevatron's name: dpr-gc train takes --passage-max-length"),
    ([*TRAIN_BASE, "--train_n_passages", "8"], "--train_n_passages is Tevatron's name: dpr-gc train takes "
                                               "--hard-negatives N-1 (Tevatron's N passages per query count its"),
    ([*TRAIN_BASE, "--gc_q_chunk_size", "4"], "--gc_q_chunk_size is Tevatron's name: dpr-gc train takes "
                                              "--query-chunk-size"),
    ([*TRAIN_BASE, "--gc_p_chunk_size", "4"], "--gc_p_chunk_size is Tevatron's name: dpr-gc train takes "
                                              "--passage-chunk-size")])
def test_another_tools_flag_name_is_answered_with_the_dpr_gc_flag(argv: list, hint: str) -> None:
    """Hugging Face, sentence-transformers and Tevatron flag names got lexical guesses far off in meaning (--lr:
    "did you mean --lora-r?", --per_device_train_batch_size: "--dev_batch_size?") or nothing: the line names the
    dpr-gc flag that takes the same setting, and no guess."""
    line = error_line(*call(cli.main, argv))
    assert f"; {hint}" in line and "did you mean" not in line, line


def test_a_guess_far_off_in_spelling_is_not_made() -> None:
    """A flag only loosely like one of the command's (difflib's 0.6: --lr and --lora-r) gets no "did you mean"."""
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--lo-rank", "4"]))
    assert "did you mean" not in line, line


def test_every_unknown_flag_gets_its_own_hint() -> None:
    """Several unknown flags got a hint for the first one only: each is answered, in the order given."""
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--warmup_ratio", "0.1", "--lr", "1e-5", "--batch-szie", "4"]))
    assert ("; did you mean --warmup-ratio?; --lr is sentence-transformers' name: dpr-gc train takes --learning-rate; "
            "did you mean --batch-size? (see") in line, line


@pytest.mark.parametrize("argv, flag, command", [
    (["evaluate", "--results", "r.json", "--verbose"], "--verbose", "evaluate"),
    (["evaluate", "--results", "r.json", "-v"], "-v", "evaluate"),
    (["train", "-v"], "-v", "train"),
    (["train", "--verbose", "--output", "o"], "--verbose", "train")])
def test_dpr_gcs_own_option_after_the_command_says_where_it_goes(argv: list, flag: str, command: str) -> None:
    """-v/--verbose after the command was "unrecognized arguments: --verbose" with no hint, or (train -v, required
    flags missing) left out of the line: it is named, with where it goes."""
    line = error_line(*call(cli.main, argv))
    assert (f"unrecognized arguments: {flag}; {flag} is dpr-gc's own option: put it before the command, dpr-gc "
            f"{flag} {command} ...") in line, line


@pytest.mark.parametrize("flag, need", [("--query-chunk-size", "a positive integer"),
                                        ("--passage-chunk-size", "a positive integer"),
                                        ("--num-workers", "an integer >= 0")])
def test_a_misspelt_auto_is_named_with_auto(flag: str, need: str) -> None:
    """stages.md: a misspelt choice names the closest one. --query-chunk-size atuo said "'atuo' is not a positive
    integer", though auto is valid (the default): the line says neither and names auto when the word is close."""
    line = error_line(*call(cli.main, [*TRAIN_BASE, flag, "atuo"]))
    said = f": 'atuo' is neither auto nor {need}; did you mean auto? (see dpr-gc train --help)"
    assert f"argument {flag}" in line and said in line, line
    line = error_line(*call(cli.main, [*TRAIN_BASE, flag, "lots"]))
    assert "is neither auto nor" in line and "did you mean" not in line, line
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--memory-budget", "atuo"]))
    assert line.endswith("or 'auto'; did you mean auto? (see dpr-gc train --help)"), line


def test_a_misspelt_resume_latest_is_named_with_latest(tmp_path, monkeypatch) -> None:
    """--resume lastest said "not a checkpoint folder (expected lastest/train_state.json)": where no such folder
    exists and the word is close to latest, the line names latest; a folder of that name keeps the first line."""
    monkeypatch.chdir(tmp_path)
    write_dpr(tmp_path / "t.json", make_records(8, 1))
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--resume", "lastest"]))
    assert line == ("error: --resume lastest: no such checkpoint folder; did you mean latest (the last checkpoint "
                    "in --output)?"), line
    (tmp_path / "lastest").mkdir()
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--resume", "lastest"]))
    assert "not a checkpoint folder (expected lastest/train_state.json)" in line and "latest (" not in line, line
    line = error_line(*call(cli.main, [*TRAIN_BASE, "--resume", "runs/x"]))
    assert "did you mean" not in line, line


def test_an_abbreviated_flag_with_an_underscore_alias_is_that_flag() -> None:
    """``--learning`` matches ``--learning-rate`` and its alias ``--learning_rate``: one flag, once refused as
    "ambiguous option: --learning could match --learning-rate, --learning_rate". Two flags stay ambiguous."""
    base = ["train", "--train", "t.json", "--output", "o"]
    parsed = cli.build_parser("train").parse_args([*base, "--learning", "1e-5", "--hard", "2", "--bat", "4"])
    assert (parsed.learning_rate, parsed.hard_negatives, parsed.batch_size) == (1e-5, 2, 4)
    line = error_line(*call(cli.main, [*base, "--dev-b", "4"]))
    assert "ambiguous option: --dev-b could match --dev-batch-size, " in line and "--dev-beir-split" in line, line


def test_an_abbreviation_never_reaches_a_hidden_old_flag() -> None:
    """--fp set precision fp16 through the hidden --fp16 and --grad was ambiguous with the hidden --grad_cache (a flag
    --help never shows); a prefix stands for a shown flag only, and a hidden one works spelt out."""
    base = ["train", "--train", "t.json", "--output", "o"]
    line = error_line(*call(cli.main, [*base, "--fp"]))
    assert line.startswith("error: dpr-gc train: unrecognized arguments: --fp;"), line
    parse = cli.build_parser("train").parse_args
    assert parse([*base, "--grad"]).gradient_checkpointing
    assert parse([*base, "--fp16"]).precision == "fp16" and parse([*base, "--grad_cache"]).grad_cache
    assert parse([*base, "--batch", "4"]).batch_size == 4


@pytest.mark.parametrize("given, earlier, later", [
    (["--batch-size", "4", "--batch_size", "8"], "--batch-size", "--batch_size"),
    (["--output_dir", "other"], "--output", "--output_dir"),
    (["--bat", "4", "--batch_size", "8"], "--batch-size", "--batch_size"),
    (["--precision", "bf16", "--fp16"], "--precision", "--fp16"),
    (["--fp16", "--precision", "bf16"], "--fp16", "--precision"),
    (["--no-grad-cache", "--grad_cache"], "--no-grad-cache", "--grad_cache"),
])
def test_two_spellings_of_a_setting_that_contradict_each_other_are_refused(given: list, earlier: str,
                                                                            later: str) -> None:
    """Two spellings of one setting (``--batch-size 4 --batch_size 8``; GC-DPR's hidden ``--fp16`` and
    ``--grad_cache`` beside ``--precision`` and ``--no-grad-cache``) given with different values: the last one
    silently won; the line names both. Agreeing ones are taken, and one spelling given again keeps the last."""
    base = ["train", "--train", "t.json", "--output", "o"]
    line = error_line(*call(cli.main, [*base, *given]))
    assert line == (f"error: dpr-gc train: argument {later}: contradicts {earlier}, given before it; give one of the "
                    "two (see dpr-gc train --help)")
    parse = cli.build_parser().parse_args
    assert parse([*base, "--precision", "fp16", "--fp16"]).precision == "fp16"
    assert parse([*base, "--fp16", "--fp16"]).precision == "fp16"
    assert parse([*base, "--batch-size", "4", "--batch_size", "4"]).batch_size == 4
    assert parse([*base, "--batch-size", "4", "--batch-size", "8"]).batch_size == 8


def test_an_interrupt_while_a_command_loads_is_one_line(monkeypatch) -> None:
    """Ctrl-C in the seconds a stage takes to import torch printed an 18-frame traceback and died of SIGINT."""
    def loading(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", loading)
    code, err = call(cli.main, ["encode", "--model", "m"])
    assert (code, err.strip()) == (130, "interrupted: stopped while the command was loading; nothing was written")


def test_negative_numbers_reach_the_flag_checks() -> None:
    """A negative number after a flag, one value or several, is the flag's value (argparse takes it so); the flag's
    own check refuses it."""
    for argv, needle in ((["train", "--train", "t.json", "--output", "o", "--seed", "-1"], "'-1' is not an integer"),
                         (["retrieve", "--index", "i", "--queries", "q", "--output", "o", "--k", "5", "-5"],
                          "'-5' is not a positive integer"),
                         (["train", "--train", "t.json", "--output", "o", "--learning-rate", "-.5"], "'-.5'")):
        line = error_line(*call(cli.main, argv))
        assert needle in line and "write" not in line, line


def test_a_wrongly_typed_value_in_code_is_refused_with_the_flag() -> None:
    with pytest.raises(DprGcError, match="--num-workers must be an integer >= 0 or 'auto', got '2'"):
        DataConfig(num_workers="2")  # type: ignore[arg-type]
    with pytest.raises(DprGcError, match="--precision must be one of fp32, bf16, fp16, got 'fp8'"):
        OptimConfig(precision="fp8")


@pytest.mark.parametrize("build, refusal", [
    (lambda: RunConfig(output_dir="x", device="tpu"), "--device: 'tpu' is not a torch device (use cpu, cuda or cuda:N)"),
    (lambda: OptimConfig(adam_betas=(1.5, 0.9)), "adam_betas must be a number in [0, 1), got 1.5"),
    (lambda: OptimConfig(adam_betas=(0.9,)), "adam_betas takes 2 values, got (0.9,)"),
    (lambda: DataConfig(train_files="train.json"), "--train takes a list of values, e.g. ['train.json'], got "
                                                   "'train.json'"),
    (lambda: DataConfig(sampling_rates=0.5), "--sampling-rates takes a list of values, e.g. [0.5], got 0.5"),
    (lambda: TrainConfig(run=RunConfig(eval_every=1)), "--eval-every does not apply without --dev (there is no dev "
                                                       "set to evaluate); add --dev FILE, or drop the flag"),
    (lambda: TrainConfig(cache=CacheConfig(enabled=False, memory_budget="1GB")), "--memory-budget does not apply to "
     "plain training (--no-grad-cache: one graph over the whole batch); drop --no-grad-cache, or drop the flag"),
    (lambda: RetrieverConfig(normalize="no"), "--normalize must be True or False, got 'no'"),
    (lambda: OptimConfig(mask_duplicate_positives="false"), "--mask-duplicate-positives must be True or False, got "
                                                            "'false'"),
    (lambda: RunConfig(output_dir="o", fsdp="false"), "--fsdp must be True or False, got 'false'"),
    (lambda: CacheConfig(enabled="false"), "enabled (--no-grad-cache) must be True or False, got 'false'"),
    (lambda: ModelConfig(query_prefix=5), "--query-prefix must be a str, got 5"),
    (lambda: DataConfig(train_files=[5]), "--train must be a path (str or os.PathLike), got 5"),
    (lambda: RunConfig(output_dir=5), "--output must be a path (str or os.PathLike), got 5"),
    (lambda: IndexParams(factory=5), "--factory must be a str, got 5"),
])
def test_settings_built_in_code_get_the_command_lines_checks(build: Callable[[], Any], refusal: str) -> None:
    """docs/library.md: checks and errors are the same in code and on the command line. Each of these was accepted in
    code and then failed with a raw error (the device, AdamW's betas), read a file name letter by letter, or was
    silently ignored where the command line refuses it."""
    with pytest.raises(DprGcError) as refused:
        build()
    assert str(refused.value) == refusal


def test_numpy_numbers_in_code_are_taken_as_python_numbers() -> None:
    """GradCache takes numpy integers (its docs); EncodeSettings(batch_size=np.int64(8)) was refused ("must be a
    positive integer, got np.int64(8)"). Any integer type but bool is taken, kept as an int, so a record holds a JSON
    number, and a numpy float where a number goes."""
    import numpy as np

    from dpr_gc.retrieval.encode import EncodeSettings

    assert type(EncodeSettings(batch_size=np.int64(8)).batch_size) is int
    data = DataConfig(batch_size=np.int32(4), sampling_rates=[np.float32(0.5), 1])
    assert (data.batch_size, data.sampling_rates) == (4, [0.5, 1])
    assert json.loads(json.dumps(to_record(data)))["batch_size"] == 4
    assert type(OptimConfig(learning_rate=np.float64(1e-5)).learning_rate) is float
    for bad in (True, 8.0, np.int64(0)):
        with pytest.raises(DprGcError, match="^--batch-size must be a positive integer, got "):
            EncodeSettings(batch_size=bad)


def test_verify_refuses_the_flags_train_refuses_as_not_applying() -> None:
    """``dpr-gc verify`` takes train's flags and builds the same settings, so a flag train refuses as ignored (a dev
    flag without --dev) is refused there too, before anything loads (it was accepted)."""
    line = error_line(*call(cli.main, ["verify", "--train", "t.json", "--eval-every", "2"]))
    assert line == ("error: --eval-every does not apply without --dev (there is no dev set to evaluate); add --dev "
                    "FILE, or drop the flag")


def test_paths_given_in_code_are_kept_as_strings(tmp_path) -> None:
    """docs/library.md: a setting that names a file or folder takes a ``Path`` too (``get_model_path()`` of an
    offline model returns one); it is kept as its string, so the run's record, checkpoints and model card are
    written (a Path used to train and then fail when the model card was written)."""
    from tests.train_data import init_model, train_config

    data = write_dpr(tmp_path / "train.json", make_records(16, 0))
    config = train_config(model=init_model(tmp_path), train_files=[data], output_dir=tmp_path / "out",
                          cache_dir=tmp_path / "cache", batch_size=8, num_workers=0, max_steps=1,
                          query_chunk_size=4, passage_chunk_size=4)
    assert isinstance(config.model.name, str) and isinstance(config.run.output_dir, str)
    assert all(isinstance(f, str) for f in config.data.train_files)
    train(config)
    assert (tmp_path / "out" / "final" / "README.md").is_file()


def test_flags_and_library_defaults_are_one_declaration(tmp_path) -> None:
    args = cli.build_parser().parse_args(["train", "--train", "t.json", "--output", str(tmp_path / "o")])
    parsed = config_from_args(args)
    library = TrainConfig()
    assert parsed.optim == library.optim and parsed.cache == library.cache and parsed.data.dev == library.data.dev
    assert parsed.model.retriever == RetrieverConfig()


def test_switches_that_negate_a_setting_turn_it_off(tmp_path) -> None:
    from dpr_gc.base.settings import from_args
    from dpr_gc.retrieval.retrieve import RetrieveJob

    parser = cli.build_parser()
    base = ["train", "--train", "t.json", "--output", str(tmp_path / "o")]
    assert config_from_args(parser.parse_args(base)).model.retriever.shared_encoder
    assert not config_from_args(parser.parse_args([*base, "--separate-encoders"])).model.retriever.shared_encoder
    assert not config_from_args(parser.parse_args([*base, "--no-grad-cache"])).cache.enabled
    assert config_from_args(parser.parse_args([*base, "--grad_cache"])).cache.enabled
    retrieve = ["retrieve", "--index", "i", "--queries", "q"]
    assert from_args(RetrieveJob, parser.parse_args(retrieve)).check_model
    assert not from_args(RetrieveJob, parser.parse_args([*retrieve, "--skip-model-check"])).check_model


def test_a_group_can_record_which_of_its_settings_were_given() -> None:
    """``group(..., given=NAME)``: flags default to unset, the group is built from those given (the others may come
    from elsewhere, e.g. a model folder's recipe) and NAME receives their names; --help still shows the default."""
    from dpr_gc.base.args import ArgumentParser
    from dpr_gc.base.settings import add_arguments, from_args, group, setting

    @dataclasses.dataclass
    class Inner:
        pooling: str = setting("cls", "--pooling", choices=("cls", "mean"), help="pooling")
        normalize: bool = setting(False, "--normalize", help="unit vectors")
        shared: bool = setting(True, "--separate", negate=True, help="two towers")

    @dataclasses.dataclass
    class Outer:
        inner: Optional[Inner] = group(Inner, "inner", given="inner_given")
        inner_given: Optional[tuple] = None

    parser = ArgumentParser(prog="toy")
    add_arguments(parser, Outer)
    assert from_args(Outer, parser.parse_args([])) == Outer(Inner(), ())
    assert from_args(Outer, parser.parse_args(["--pooling", "mean", "--no-normalize", "--separate"])) == \
        Outer(Inner("mean", False, False), ("pooling", "normalize", "shared"))
    text = " ".join(parser.format_help().split())
    assert "pooling (default: cls)" in text and "unit vectors (default: False)" in text
    assert "two towers (default: False)" in text  # the flag's value when not given, not the field's


def test_help_shows_a_negating_flags_default_as_the_flag_not_the_field() -> None:
    """``--separate-encoders`` sets ``shared_encoder`` to False: its help says False (one shared tower unless
    given), in dpr-gc train and in the GC-DPR compatible script alike."""
    parsers = [p for name, p in sub_parsers(cli.build_parser(), "dpr-gc") if name == "dpr-gc train"]
    parsers += [p for name, p in script_parsers() if name == "train_dense_encoder train"]
    assert len(parsers) == 2
    for parser in parsers:
        text = " ".join(parser.format_help().split())
        assert "--separate-encoders, --no-separate-encoders two towers (query and passage) instead of one shared " \
               "(default: False for a plain Hugging Face model, else the model's own)" in text


def test_changed_settings_name_each_flag_with_its_kind() -> None:
    old = TrainConfig(optim=OptimConfig(learning_rate=1e-3, max_steps=4))
    new = TrainConfig(optim=OptimConfig(learning_rate=2e-3, max_steps=8), data=DataConfig(num_workers=0))
    changes = {c.name: c for c in changed_settings(TrainConfig, to_record(old), to_record(new))}
    assert set(changes) == {"--learning-rate", "--max-steps", "--num-workers"}
    assert changes["--learning-rate"].resume == FIXED and str(changes["--learning-rate"]) == "--learning-rate 0.001 -> 0.002"
    assert changes["--max-steps"].resume == FREE and changes["--num-workers"].resume == FREE
    json.dumps(to_record(new))  # the record is plain JSON
    with pytest.raises(DprGcError, match=r"--learning-rate 0\.001 -> 0\.002") as refused:
        compare_recorded(new, to_record(old), "train_config.json")
    assert "--max-steps" not in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_lora_switched_on_or_off_is_one_change_of_lora_r_with_its_values() -> None:
    """An optional group recorded in one run and not the other is one change of the flag that brings it into being,
    with that flag's values (``--lora-r 4 -> (not set)``), not one value-less change per member of the group."""
    from dpr_gc.model.lora import LoraSettings
    from dpr_gc.train.config import ModelConfig

    plain = TrainConfig()
    lora = TrainConfig(model=ModelConfig(lora=LoraSettings(r=4, alpha=8, dropout=0.1)))
    for old, new, expected in ((lora, plain, "--lora-r 4 -> (not set)"), (plain, lora, "--lora-r (not set) -> 4")):
        changes = changed_settings(TrainConfig, to_record(old), to_record(new))
        assert [str(c) for c in changes] == [expected] and changes[0].resume == FIXED
        with pytest.raises(DprGcError) as refused:
            compare_recorded(new, to_record(old), "train_config.json")
        assert f"training signal: {expected}; resume with" in str(refused.value), str(refused.value)
    other = TrainConfig(model=ModelConfig(lora=LoraSettings(r=8, alpha=8, dropout=0.1)))
    assert [str(c) for c in changed_settings(TrainConfig, to_record(lora), to_record(other))] == ["--lora-r 4 -> 8"]


def test_resume_refuses_another_dev_beir_split() -> None:
    """docs/training.md: the dev set is fixed on --resume. --dev-beir-split picks the questions of a BEIR folder
    given as --dev, so a resume that changed it (it was accepted) had best/ compare average ranks over other
    questions; it is refused as the other dev settings are, and its help says so."""
    from dpr_gc.train.validation import DevLimits

    def run(split: str) -> TrainConfig:
        return TrainConfig(data=DataConfig(dev_file="beir", dev=DevLimits(beir_split=split)))

    with pytest.raises(DprGcError, match=r"--dev-beir-split 'dev' -> 'test'"):
        compare_recorded(run("test"), to_record(run("dev")), "train_config.json")
    action = cli.build_parser()._subparsers._group_actions[0].choices["train"]._option_string_actions
    assert action["--dev-beir-split"].note == "[fixed on --resume]"


def test_paths_compare_by_the_place_they_name() -> None:
    """A folder spelled ``beir/``, ``beir`` or ``./beir/`` is one setting (it was "--train ['beir/'] -> ['beir']");
    another folder, or a dev file added, is still a change."""
    def record(*train: str, dev: Optional[str] = None) -> dict:
        return to_record(TrainConfig(data=DataConfig(train_files=list(train), dev_file=dev)))

    assert changed_settings(TrainConfig, record("beir/"), record("beir")) == []
    assert changed_settings(TrainConfig, record("beir/", "x/../dpr.json"), record("./beir/", "dpr.json")) == []
    assert [str(c) for c in changed_settings(TrainConfig, record("beir/"), record("beir2", dev="dev/"))] == [
        "--train ['beir/'] -> ['beir2']", "--dev (not set) -> 'dev/'"]


# --------------------------------------------------------------------------------------------- resume
def init_model(folder: Path) -> Path:
    """A Hugging Face model folder (not a saved retriever, which would keep its own recipe whatever the flags)."""
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(folder / "vocab.txt")))
    tiny_bert(len(tokenizer)).save_pretrained(folder / "init")
    tokenizer.save_pretrained(folder / "init")
    return folder / "init"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> dict:
    """A 2-step run with a checkpoint after each step, made from the command line."""
    d = tmp_path_factory.mktemp("resume")
    argv = ["train", "--train", write_dpr(d / "train.json", make_records(32, 1)), "--model", init_model(d),
            "--batch-size", "8", "--num-workers", "0", "--learning-rate", "1e-3", "--query-chunk-size", "4",
            "--query-max-length", "16", "--passage-max-length", "32",
            "--passage-chunk-size", "8", "--cache-dir", d / "cache", "--save-every", "1", "--keep-checkpoints", "3"]
    out = d / "out"
    code, err = call(cli.main, [*argv, "--output", out, "--max-steps", "2"])
    assert code == 0, err
    return {"argv": [str(a) for a in argv], "out": out}


def test_a_run_records_its_resolved_settings(first_run) -> None:
    out = first_run["out"]
    recorded = json.loads((out / SETTINGS_FILE).read_text())
    args = cli.build_parser().parse_args([*first_run["argv"], "--output", str(out), "--max-steps", "2"])
    assert recorded == to_record(resolve_defaults(config_from_args(args))[0])
    assert recorded["optim"]["learning_rate"] == 1e-3 and recorded["model"]["retriever"]["pooling"] == "cls"
    assert recorded["data"]["hard_negatives"] == 1  # not given: a DPR file's default, resolved
    for step in (1, 2):  # each checkpoint carries the settings it was made with
        assert json.loads((out / f"checkpoint-{step}" / SETTINGS_FILE).read_text()) == recorded


def refuse_to_build(*args, **kwargs):
    raise AssertionError("the model was built before the resume was checked")


@pytest.mark.parametrize("change, needle", [
    (["--learning-rate", "5e-3"], "--learning-rate 0.001 -> 0.005"),
    (["--pooling", "mean"], "--pooling 'cls' -> 'mean'"),
    (["--temperature", "0.5"], "--temperature 1.0 -> 0.5"),
    (["--normalize"], "--normalize False -> True"),
    (["--no-mask-duplicate-positives"], "--mask-duplicate-positives True -> False"),
])
def test_resume_refuses_a_changed_model_or_training_signal(first_run, change, needle, monkeypatch) -> None:
    """Refused before the model is built (with a large model, minutes before)."""
    out = first_run["out"]
    before = (out / SETTINGS_FILE).read_text()
    argv = [*first_run["argv"], "--output", str(out), "--max-steps", "3", "--resume", "latest", *change]
    monkeypatch.setattr("dpr_gc.train.trainer.build_retriever", refuse_to_build)
    line = error_line(*call(cli.main, argv))
    assert needle in line and "--max-steps" not in line and "--resume" in line
    with pytest.raises(DprGcError) as refused:  # the library says the same
        train(config_from_args(cli.build_parser().parse_args(argv)))
    assert line == "error: " + str(refused.value)
    assert (out / SETTINGS_FILE).read_text() == before and not (out / "checkpoint-3").exists()


def test_resume_names_every_refused_change_in_one_line(first_run) -> None:
    argv = [*first_run["argv"], "--output", str(first_run["out"]), "--resume", "latest", "--learning-rate", "5e-3",
            "--pooling", "mean", "--temperature", "0.5", "--normalize", "--batch-size", "4"]
    line = error_line(*call(cli.main, argv))
    for flag in ("--learning-rate", "--pooling", "--temperature", "--normalize", "--batch-size"):
        assert f"{flag} " in line


def test_resume_accepts_changed_steps_cadence_and_workers(first_run, tmp_path, caplog) -> None:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    argv = [*first_run["argv"], "--output", str(out), "--resume", str(out / "checkpoint-2"), "--max-steps", "3",
            "--save-every", "3", "--num-workers", "1"]
    with caplog.at_level(logging.INFO, logger="dpr_gc.train.config"):
        code, err = call(cli.main, argv)
    assert code == 0, err
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming with changed settings")]
    assert len(logged) == 1 and all(f in logged[0] for f in ("--max-steps 2 -> 3", "--save-every 1 -> 3",
                                                              "--num-workers 0 -> 1")), logged
    recorded = json.loads((out / SETTINGS_FILE).read_text())
    assert recorded["optim"]["max_steps"] == 3 and recorded["run"]["save_every"] == 3
    assert recorded["data"]["num_workers"] == 1
    assert (out / "checkpoint-3").is_dir() and (out / "final").is_dir()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_an_extended_run_follows_the_schedule_of_its_new_length(first_run, tmp_path) -> None:
    """docs/training.md: resuming the finished 2-step run (lr 1e-3, no warm-up) with --max-steps 3 runs step 3 at
    the 3-step schedule's rate, 1e-3 / 3 (it ran at the 2-step schedule's end, 0.0: a step that changed nothing)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    argv = [*first_run["argv"], "--output", str(out), "--resume", "latest", "--max-steps", "3"]
    code, err = call(cli.main, argv)
    assert code == 0, err
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["lr"] == pytest.approx(1e-3 / 3)
    from dpr_gc.train.checkpoints import read_state

    assert read_state(out / "checkpoint-3")["scheduler"]["_last_lr"] == pytest.approx([0.0, 0.0])  # its end


def test_resume_takes_the_training_file_spelled_another_way(first_run, tmp_path, monkeypatch) -> None:
    """docs/training.md: the 2-step run's training file, given absolute, resumes given as ``./train.json`` from its
    folder (it was refused: "--train ['/.../train.json'] -> ['./train.json']")."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    argv = list(first_run["argv"])
    where = argv.index("--train") + 1
    monkeypatch.chdir(Path(argv[where]).parent)
    argv[where] = "./train.json"
    code, err = call(cli.main, [*argv, "--output", str(out), "--resume", "latest", "--max-steps", "3"])
    assert code == 0, err
    assert (out / "checkpoint-3").is_dir()


def test_a_run_started_with_relative_paths_resumes_from_another_folder_by_place(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """docs/training.md: paths compare by the place they name. A run started with relative paths resumes from another
    folder given the same files absolute (it was refused: the record held the spellings, which the check took from
    the new folder); a copy of its output elsewhere, resumed there with another dev.json spelled the same, is refused
    naming --dev (it was accepted)."""
    import shutil

    first = tmp_path / "first"
    first.mkdir()
    write_dpr(first / "train.json", make_records(16, 1))
    write_dpr(first / "dev.json", make_records(4, 2))
    init_model(first)
    argv = ["train", "--train", "train.json", "--dev", "dev.json", "--model", "init", "--batch-size", "8",
            "--num-workers", "0", "--query-chunk-size", "4", "--passage-chunk-size", "8", "--cache-dir", "cache",
            "--save-every", "1", "--output", "out"]
    monkeypatch.chdir(first)
    code, err = call(cli.main, [*argv, "--max-steps", "1"])
    assert code == 0, err
    recorded = json.loads((first / "out" / SETTINGS_FILE).read_text())
    assert recorded["data"]["train_files"] == [str(first / "train.json")]  # the place, not the spelling
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    absolute = [str(first / a) if a in ("train.json", "dev.json", "init", "cache", "out") else a for a in argv]
    capsys.readouterr()
    code, err = call(cli.main, [*absolute, "--max-steps", "2", "--resume", "latest"])
    assert code == 0, err
    assert (first / "out" / "checkpoint-2").is_dir()
    assert f" in {first / 'out' / 'best'}" in capsys.readouterr().out  # not 'out/best', read from here
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    write_dpr(copy / "dev.json", make_records(4, 3))
    monkeypatch.chdir(copy)
    line = error_line(*call(cli.main, [*argv, "--max-steps", "3", "--resume", "latest"]))
    assert f"--dev {str(first / 'dev.json')!r} -> 'dev.json'" in line, line
    assert not (copy / "out" / "checkpoint-3").exists()


def test_resuming_a_finished_run_says_so_and_trains_nothing(first_run, tmp_path, caplog, capsys) -> None:
    """docs/training.md: ``--resume latest`` on the finished 2-step run says it finished at step 2, prints the
    closing summary table of what the run holds (0 steps this run, the loss metrics.jsonl recorded, no speed, this
    command's time) and leaves final/ as it is; the library's summary gives the same loss. A final/ that is missing
    (stopped before it was written) is written."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    argv = [*first_run["argv"], "--output", str(out), "--resume", "latest", "--max-steps", "2"]
    final = {p: p.stat().st_mtime_ns for p in (out / "final").iterdir()}
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        code, err = call(cli.main, argv)
    assert code == 0, err
    assert "the run already finished at step 2 (of 2 steps): nothing to train" in caplog.text
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    rows = summary_rows(capsys.readouterr().out)
    assert "training 2 steps" not in caplog.text and rows["steps"] == "2 (0 this run, resumed from step 2)", rows
    assert rows["final loss"] == f"{last['loss']:.4f}" and rows["examples/s"] == "-", rows
    assert rows["time"] != "0.0 s" and float(rows["time"].split()[0]) > 0, rows
    assert {p: p.stat().st_mtime_ns for p in (out / "final").iterdir()} == final
    shutil.rmtree(out / "final")
    summary = train(config_from_args(cli.build_parser().parse_args(argv)))
    assert summary["steps"] == last["step"] == 2 and summary["final_loss"] == last["loss"]
    assert summary["already_finished"] and (out / "final" / "model.safetensors").is_file()
    assert "| steps done | 2 |" in (out / "final" / "README.md").read_text()


def test_resume_compares_with_the_checkpoint_record(first_run, tmp_path) -> None:
    """The checkpoint's record wins over the output folder's (a later resume may have rewritten the latter)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    record = json.loads((out / SETTINGS_FILE).read_text())
    (out / SETTINGS_FILE).write_text(json.dumps({**record, "optim": {**record["optim"], "learning_rate": 0.005}}))
    argv = [*first_run["argv"], "--output", str(out), "--resume", "latest", "--max-steps", "3"]
    code, err = call(cli.main, argv)
    assert code == 0, err


def test_a_checkpoint_without_a_record_resumes_with_a_warning(first_run, tmp_path, caplog) -> None:
    """docs/training.md: a run saved by an older version records no train_config.json (neither in its checkpoints
    nor in its output folder); it resumes, with a warning that its settings are not compared."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    for record in [out / SETTINGS_FILE, *out.glob(f"checkpoint-*/{SETTINGS_FILE}")]:
        record.unlink()
    argv = [*first_run["argv"], "--output", str(out), "--resume", "latest", "--max-steps", "3"]
    with caplog.at_level(logging.WARNING, logger="dpr_gc.train.config"):
        code, err = call(cli.main, argv)
    assert code == 0, err
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"checkpoint-2 holds no {SETTINGS_FILE} (written by an older version)" in w for w in warned), warned
    assert (out / "checkpoint-3").is_dir() and (out / SETTINGS_FILE).is_file()


# --------------------------------------------------------------------------------------------- encode / index record
def test_encode_and_index_record_their_settings(tmp_path, make_retriever) -> None:
    from dpr_gc.retrieval.encode import EncodeSettings, encode_corpus
    from dpr_gc.retrieval.index import build_index, read_meta
    from dpr_gc.retrieval.index_params import IndexParams

    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(f"p{i}\tpassage number {i}\tt{i}\n" for i in range(5)))
    settings = EncodeSettings(batch_size=2, dtype="float32", block_size=3, cache_dir=tmp_path / "c")
    manifest = encode_corpus(make_retriever(), corpus, tmp_path / "emb", settings=settings, show_progress=False)
    recorded = json.loads((tmp_path / "emb" / "shard-00000-of-00001.json").read_text())["settings"]
    assert recorded == manifest["settings"] == {
        "shard_id": 0, "num_shards": 1, "batch_size": 2, "max_length": manifest["max_length"],
        "dtype": "float32", "precision": "fp32", "block_size": 3, "cache_dir": str(tmp_path / "c")}
    build_index(tmp_path / "emb", tmp_path / "idx", IndexParams(kind="hnsw", hnsw_m=8), block_size=2)
    meta = read_meta(tmp_path / "idx")["settings"]
    assert meta["index"]["kind"] == "hnsw" and meta["index"]["hnsw_m"] == 8 and meta["build"]["block_size"] == 2


def test_encode_flags_and_library_share_one_declaration(tmp_path) -> None:
    from dpr_gc.retrieval.encode import EncodeJob, EncodeSettings

    args = cli.build_parser().parse_args(["encode", "--model", "m", "--corpus", "c", "--output", str(tmp_path / "o"),
                                          "--batch-size", "8"])
    job = __import__("dpr_gc.base.settings", fromlist=["from_args"]).from_args(EncodeJob, args)
    assert job.settings == EncodeSettings(batch_size=8, precision="auto")  # the command line's precision is auto
    with pytest.raises(DprGcError, match="--batch-size must be a positive integer, got 0"):
        EncodeSettings(batch_size=0)
    line = error_line(*call(cli.main, ["encode", "--model", "m", "--corpus", "c", "--output", tmp_path / "o",
                                       "--batch-size", "0"]))
    assert "--batch-size" in line and "a positive integer" in line


def test_library_and_command_line_defaults_differ_only_where_the_docs_say() -> None:
    """docs/library.md names every setting whose command-line default is not the library's (``cli_default``)."""
    from dpr_gc.base.settings import UNSET, _group, _setting
    from dpr_gc.train.config import ModelConfig
    from dpr_gc.data.training import Batching
    from dpr_gc.model.lora import LoraSettings
    from dpr_gc.retrieval.encode import EncodeSettings
    from dpr_gc.retrieval.index_params import IndexBuild, IndexParams
    from dpr_gc.retrieval.mine import MineSettings, SourceSettings
    from dpr_gc.retrieval.retrieve import RetrieveJob, RetrieveSettings

    classes, seen = [TrainConfig, EncodeSettings, IndexParams, IndexBuild, RetrieveSettings, RetrieveJob,
                     MineSettings, SourceSettings, Batching, LoraSettings, ModelConfig], set()
    differing = set()
    while classes:  # every settings class and the groups inside it, each field where it is declared
        cls = classes.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for field in dataclasses.fields(cls):
            decl, grp = _setting(field), _group(field)
            classes += [grp.cls] if grp is not None else []
            if decl is not None and decl.cli_default is not UNSET:
                differing.add(f"{cls.__name__}.{field.name}")
    page = (Path(__file__).resolve().parents[1] / "docs" / "library.md").read_text()
    documented = set(re.findall(r"`(\w+Settings\.\w+)`", page[page.index("## Settings objects"):]))
    assert differing == documented == {"EncodeSettings.precision", "RetrieveSettings.workers",
                                       "MineSettings.workers", "LoraSettings.r"}


def test_the_docs_list_every_setting_a_resume_may_change() -> None:
    """docs/training.md's ``[may change on --resume]`` list is every training flag declared ``resume=FREE``."""
    from dpr_gc.base.settings import FREE, _group, _setting

    free, classes = set(), [TrainConfig]
    while classes:
        for field in dataclasses.fields(classes.pop()):
            decl, grp = _setting(field), _group(field)
            classes += [grp.cls] if grp is not None else []
            if decl is not None and decl.resume == FREE and decl.flag:
                free.add(decl.flag)
    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    bullet = page[page.index("- `[may change on --resume]`:"):page.index("Changes are logged")]
    assert set(re.findall(r"`(--[a-z-]+)`", bullet)) == free


def test_a_checkpoint_without_a_settings_record_resumes_with_a_warning(first_run, tmp_path, caplog) -> None:
    """docs/training.md: a checkpoint written before runs recorded their settings resumes as it is, with a warning
    that its settings are not compared."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    for record in (out / "checkpoint-2" / SETTINGS_FILE, out / SETTINGS_FILE):
        record.unlink()
    argv = [*first_run["argv"], "--output", str(out), "--resume", str(out / "checkpoint-2"), "--max-steps", "3",
            "--learning-rate", "5e-3"]  # a change a record would refuse
    with caplog.at_level(logging.WARNING, logger="dpr_gc.train.config"):
        code, err = call(cli.main, argv)
    assert code == 0, err
    assert any(f"holds no {SETTINGS_FILE} (written by an older version)" in r.getMessage() for r in caplog.records)
    assert (out / "final").is_dir()


def test_a_sharded_checkpoint_resumes_only_with_fsdp(first_run, tmp_path, monkeypatch) -> None:
    """docs/distributed.md: a checkpoint holding FSDP shards is refused without --fsdp, in one line that says so,
    before the model is built (with a real sharded checkpoint, and a plain one under --fsdp, in
    tests/test_fsdp_cli.py)."""
    import shutil

    from dpr_gc.train.checkpoints import SHARDED

    out = tmp_path / "out"
    shutil.copytree(first_run["out"], out)
    (out / "checkpoint-2" / SHARDED).mkdir()
    argv = [*first_run["argv"], "--output", str(out), "--resume", str(out / "checkpoint-2"), "--max-steps", "3"]
    monkeypatch.setattr("dpr_gc.train.trainer.build_retriever", refuse_to_build)
    line = error_line(*call(cli.main, argv))
    assert "this checkpoint was written with --fsdp; resume it the same way" in line
    assert not (out / "checkpoint-3").exists()


def test_flags_given_counts_only_flags_set_to_other_than_their_default() -> None:
    """What ``refuse_flags_that_do_not_apply`` relies on: a command line giving only the required flags sets none
    but them (flags with non-None defaults, command-line defaults and switches included); a switch turned on,
    or a value other than the default, is counted; a value repeated at its default is not."""
    from dpr_gc.base.settings import flags_given
    from dpr_gc.retrieval.mine import MineJob
    from dpr_gc.retrieval.retrieve import RetrieveJob

    parse = cli.build_parser().parse_args
    sub = {"mine": (MineJob, ["mine", "--output", "o.json"], {"output": "--output"}),
           "retrieve": (RetrieveJob, ["retrieve", "--index", "i", "--queries", "q"], {"queries": "--queries"})}
    for name, (cls, required, given) in sub.items():
        assert flags_given(cls, parse(required)) == given, name
    args = parse(["mine", "--output", "o.json", "--skip-model-check", "--bm25-k1", "0.9", "--workers", "0",
                  "--split", "dev", "--batch-size", "8"])
    assert flags_given(MineJob, args) == {"output": "--output", "skip_model_check": "--skip-model-check",
                                          "split": "--beir-split", "batch_size": "--batch-size"}
    args = parse(["retrieve", "--index", "i", "--queries", "q", "--compact", "--k", "1", "--run-tag", "dpr-gc"])
    assert flags_given(RetrieveJob, args) == {"queries": "--queries", "compact": "--compact", "k": "--k"}


@pytest.mark.parametrize("command, argv, expanded", [
    ("encode", ["--model=~/m", "--corpus=~/c.tsv", "--output=~/emb", "--cache-dir=~/c"],
     {"model": "m", "corpus": "c.tsv", "output": "emb", "cache_dir": "c"}),
    ("index", ["--embeddings=~/e", "--output=~/idx"], {"embeddings": "e", "output": "idx"}),
    ("retrieve", ["--index=~/idx", "--queries=~/q.csv", "--output=~/r.json", "--trec-run=~/r.trec", "--model=~/m",
                  "--corpus=~/c.tsv", "--qrels=~/q.tsv"],
     {"index": "idx", "queries": "q.csv", "output": "r.json", "trec_run": "r.trec", "model": "m", "corpus": "c.tsv",
      "qrels": "q.tsv"}),
    ("evaluate", ["--run=~/r.trec", "--qrels=~/q.tsv", "--output=~/m.json", "--plot=~/p.png"],
     {"run": "r.trec", "qrels": "q.tsv", "output": "m.json", "plot": "p.png"}),
    ("evaluate", ["--results=~/r.json"], {"results": "r.json"}),
    ("mine", ["--output=~/mined.json", "--index=~/mi", "--embeddings=~/me", "--bm25-index=~/mb", "--model=~/m",
              "--train-file=~/t.json", "--corpus=~/c.tsv", "--qrels=~/q.tsv"],
     {"output": "mined.json", "index": "mi", "embeddings": "me", "bm25_index": "mb", "model": "m",
      "train_file": "t.json", "corpus": "c.tsv", "qrels": "q.tsv"}),
    ("mine", ["--output=~/mined.json", "--beir-dir=~/beir"], {"beir_dir": "beir"}),
    ("merge-lora", ["--model=~/m", "--output=~/merged"], {"model": "m", "output": "merged"}),
    ("make-stdlib-data", ["--output=~/data"], {"output": "data"}),
    ("demo", ["--output=~/demo", "--model=~/m"], {"output": "demo", "model": "m"}),
    ("train", ["--model=~/model", "--train=~/t.json", "--dev=~/d.json", "--output=~/run", "--resume=~/run/ckpt"],
     {"model": "model", "train_files": ["t.json"], "dev_file": "d.json", "output_dir": "run", "resume": "run/ckpt"}),
    ("prepare-data", ["t.json", "--cache-dir=~/c"], {"cache_dir": "c"}),
    ("cache", ["--cache-dir=~/c"], {"cache_dir": "c"}),
])
def test_a_path_flag_expands_the_home_folder(command, argv, expanded, tmp_path, monkeypatch):
    """A path flag given as ``--flag=~/x`` (the shell leaves ``~`` after ``=``) names ``$HOME/x``, not a folder
    named ``~`` in the working folder: every stage's path flags expand it while the command line is parsed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = cli.build_parser(command).parse_args([command, *argv])
    wanted = {dest: [str(tmp_path / v) for v in value] if isinstance(value, list) else str(tmp_path / value)
              for dest, value in expanded.items()}
    assert {dest: getattr(args, dest) for dest in expanded} == wanted


@pytest.mark.parametrize("argv", [
    ["evaluate", "--results", "r.json"],
    ["retrieve", "--index", "i", "--queries", "q.json", "--output", "o.json", "--evaluate"],
])
def test_cut_offs_given_twice_add_up(argv: list) -> None:
    """``--k 1 --k 5`` evaluated @5 only (argparse keeps the last); the repeats add up, and the first replaces
    evaluate's default cut-offs rather than adding to them."""
    parse = cli.build_parser().parse_args
    assert parse([*argv, "--k", "1", "--k", "5", "20"]).k == [1, 5, 20]
    assert parse([*argv, "--k", "3"]).k == [3]
    assert parse([*argv, "--k", "1", "--k", "5"]).k == [1, 5]  # the default list is not changed in place
    script = load_script("dense_retriever").build_parser().parse_args
    assert script(["--model_file", "m", "--qa_file", "q.csv", "--ctx_file", "c.tsv", "--encoded_ctx_file", "e",
                   "--out_file", "o.json", "--k", "1", "--k", "5"]).k == [1, 5]


def test_an_unknown_option_before_the_command_is_named_as_dpr_gcs_own(capsys) -> None:
    """``dpr-gc -q evaluate ...`` said "dpr-gc evaluate: unrecognized arguments: -q", as if given to evaluate."""
    code, err = call(cli.main, ["-q", "evaluate", "--results", "r.json"])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: dpr-gc: unrecognized option -q before the command: dpr-gc's own options are "), err
    assert "evaluate's options go after it (dpr-gc evaluate ... -q)" in err, err
