"""The command line's output: ``encode``, ``index``, ``retrieve`` and BM25 ``mine`` on the example files, and
``train`` of a tiny GPT-2 with gradient checkpointing, print only the toolkit's own log lines, its progress bars and
the final table (no FAISS loader lines, no datasets/JAX notice, no transformers or bm25s bars, no transformers
warnings, no bm25s debug lines, no dependency's deprecation warnings, no cursor movements of nested bars);
``--verbose`` lets the dependencies speak; each automatic choice is logged once at the start."""

from __future__ import annotations

import contextlib
import os
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import foreign_lines, load_script

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "data" / "examples"
TABLE_LINE = re.compile(r"^(\|.*\||answer accuracy \(\d+ questions?, match=\w+\)"
                        r"|qrels metrics \(\d+ judged quer(y|ies)\))?$")


def run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpr_gc", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache = tmp_path_factory.mktemp("cache")
    return dict(os.environ, PYTHONPATH=str(ROOT), DPR_GC_CACHE=str(cache))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertTokenizerFast

    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from tests.helpers import tiny_bert, write_vocab

    folder = tmp_path_factory.mktemp("model")
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(folder / "vocab.txt")), do_lower_case=True)
    Retriever(tiny_bert(len(tokenizer)), None, tokenizer, RetrieverConfig(pooling="mean")).save(folder / "retriever")
    return folder / "retriever"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, env: dict, model_dir: Path) -> dict:
    """``encode``, ``index`` and ``retrieve`` on the example files, as a user types them."""
    out = tmp_path_factory.mktemp("runs")
    done = {"encode": run(["encode", "--model", str(model_dir), "--corpus", str(EXAMPLES / "passages.tsv"),
                           "--output", str(out / "emb")], env)}
    done["index"] = run(["index", "--embeddings", str(out / "emb"), "--output", str(out / "index")], env)
    done["retrieve"] = run(["retrieve", "--index", str(out / "index"), "--queries", str(EXAMPLES / "qa.tsv"),
                            "--top-k", "3", "--output", str(out / "results.json"), "--evaluate"], env)
    done["mine"] = run(["mine", "--train-file", str(EXAMPLES / "train.json"), "--corpus", str(EXAMPLES / "passages.tsv"),
                        "--output", str(out / "mined.json"), "--workers", "2"], env)
    done["out"] = out
    return done


@pytest.mark.slow
def test_encode_index_retrieve_and_mine_print_only_their_own_lines(runs: dict) -> None:
    for name in ("encode", "index", "retrieve", "mine"):
        result = runs[name]
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stderr, f"{name}: a cursor movement in the log"
        assert foreign_lines(result.stderr) == [], f"{name} printed lines that are not dpr-gc's own"
        assert all(TABLE_LINE.match(line) for line in result.stdout.splitlines()), result.stdout
    encoded = runs["encode"].stderr
    assert "encode shard-00000-of-00001 (~tokens)" in encoded  # the bar counts estimated tokens
    # the automatic choices, once, at the start: device, compute precision, stored dtype, batch, max length
    choice = re.findall(r"shard-00000-of-00001: 6 passages on cpu in (\w+) compute, stored as float16 .*; batch 64, "
                        r"max length 128 tokens; \d+ CPU threads?\n", encoded)
    assert len(choice) == 1 and choice[0] in ("bf16", "fp32")
    assert len(re.findall(r"--precision auto on cpu: (bf16|fp32) \(", encoded)) == 1
    retrieved = runs["retrieve"].stderr  # the questions are counted by the check before the bar opens, not inside it
    assert retrieved.index("qa.tsv: 4 questions from 4 lines") < retrieved.index("retrieving:"), retrieved


def tiny_gpt2(folder: Path) -> Path:
    """A Hugging Face folder holding a tiny random GPT-2 (whose forward warns of ``use_cache`` under gradient
    checkpointing) and a small tokenizer."""
    from transformers import GPT2Config, GPT2Model

    from tests.llm_models import decoder_tokenizer

    tokenizer = decoder_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_train_prints_only_its_own_lines(tmp_path: Path, env: dict) -> None:
    """``train --gradient-checkpointing`` of a GPT-2: neither transformers' "`use_cache=True` is incompatible with
    gradient checkpointing" (GPT-2's forward logs it in training; ``--verbose`` shows it) nor its "Loading weights"
    and "Writing model shards" bars reach stderr, only the toolkit's log lines and its own bar; stdout holds only the
    closing table."""
    from tests.train_data import make_records, write_dpr

    data, model = write_dpr(tmp_path / "train.json", make_records(8, 1)), tiny_gpt2(tmp_path / "gpt2")
    argv = ["train", "--train", str(data), "--model", str(model), "--gradient-checkpointing", "--max-steps", "2",
            "--batch-size", "4", "--num-workers", "0", "--device", "cpu"]
    quiet = run([*argv, "--output", str(tmp_path / "quiet")], env)
    assert quiet.returncode == 0, quiet.stderr
    assert foreign_lines(quiet.stderr) == [], quiet.stderr
    assert "use_cache" not in quiet.stderr and "Loading weights" not in quiet.stderr, quiet.stderr
    assert all(TABLE_LINE.match(line) for line in quiet.stdout.splitlines()), quiet.stdout


def test_faiss_native_warnings_reach_the_log_not_raw_stderr(runs: dict, env: dict) -> None:
    """FAISS's C++ prints its warning on too few training points straight to the stderr descriptor; it comes out as
    one of dpr-gc's own warning lines instead."""
    out = runs["out"]
    result = run(["index", "--embeddings", str(out / "emb"), "--output", str(out / "ivf"), "--kind", "ivf-flat",
                  "--nlist", "2"], env)
    assert result.returncode == 0, result.stderr
    assert foreign_lines(result.stderr) == [], result.stderr
    assert re.search(r"WARNING dpr_gc\.retrieval\.index: FAISS: WARNING clustering 6 points to 2 centroids",
                     result.stderr), result.stderr


def test_a_native_line_printed_again_and_again_is_logged_once_with_its_count(caplog) -> None:
    import logging
    import os

    from dpr_gc.base.logs import native_stderr_logged

    log = logging.getLogger("dpr_gc.test_native")
    with caplog.at_level(logging.WARNING, logger=log.name), native_stderr_logged(log, "FAISS"):
        for _ in range(96):
            os.write(2, b"WARNING clustering 5260 points to 256 centroids\n")
        os.write(2, b"another line\n")
    assert [r.getMessage() for r in caplog.records] == [
        "FAISS: WARNING clustering 5260 points to 256 centroids (printed 96 times)", "FAISS: another line"]


@pytest.mark.slow
def test_verbose_lets_the_dependencies_speak(runs: dict, env: dict) -> None:
    out = runs["out"]
    verbose = run(["--verbose", "index", "--embeddings", str(out / "emb"), "--output", str(out / "index2")], env)
    assert verbose.returncode == 0, verbose.stderr
    assert "faiss.loader" in verbose.stderr  # the lines the quiet run hides exist, and --verbose shows them


def test_no_cursor_movement_from_a_nested_bar_in_a_log_file(make_retriever, capsys) -> None:
    """A bar opened while another is open stays off when stderr is a file (retrieve's query embedding inside its
    'retrieving' bar), so the log holds no ESC [A."""
    from tqdm import tqdm

    retriever = make_retriever()
    with tqdm(total=1, desc="outer", disable=False):
        retriever.embed("query", ["the city"] * 130, batch_size=64, show_progress=True)
    err = capsys.readouterr().err
    assert "outer" in err and "embed query texts" not in err and "\x1b[A" not in err


def test_quiet_hides_dependencies_deprecations_and_debug_lines_only() -> None:
    """A deprecation warning a dependency raises is for its callers' developers (peft's call of a deprecated
    transformers property warns on every LoRA run), and so is peft's advice on settings it adjusts itself; ours and
    other warnings still show. bm25s sets its own logger
    to DEBUG when imported, after the quiet levels were set: the filter still holds its debug lines back."""
    from dpr_gc.base.logs import quiet_dependencies

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_dependencies()
        for module, category in (("transformers.modeling_utils", FutureWarning), ("peft.peft_model", FutureWarning),
                                 ("torch.distributed", DeprecationWarning), ("dpr_gc.engine", FutureWarning),
                                 ("transformers.modeling_utils", UserWarning), ("peft.tuners.lora.model", UserWarning)):
            warnings.warn_explicit(f"{module} {category.__name__}", category, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["dpr_gc.engine FutureWarning", "transformers.modeling_utils UserWarning"]
    bm25s = logging.getLogger("bm25s")
    bm25s.setLevel(logging.DEBUG)
    assert not bm25s.filter(bm25s.makeRecord("bm25s", logging.DEBUG, "x.py", 1, "debug", (), None))
    assert bm25s.filter(bm25s.makeRecord("bm25s", logging.WARNING, "x.py", 1, "warning", (), None))


def test_log_counts_take_the_singular_for_one() -> None:
    from dpr_gc.base.logs import counted

    assert [counted(n, "passage") for n in (0, 1, 2)] == ["0 passages", "1 passage", "2 passages"]
    assert counted(1, "query", "queries") == "1 query" and counted(3, "query", "queries") == "3 queries"


def test_matplotlibs_font_cache_notice_is_kept_quiet(tmp_path: Path) -> None:
    """On a machine where matplotlib has no font cache yet (a fresh ``MPLCONFIGDIR``), drawing the demo's or
    evaluate's plot logged "INFO matplotlib.font_manager: generated new fontManager"; it is a dependency's line."""
    code = ("from dpr_gc.base.logs import setup_logging\nsetup_logging(False)\nimport matplotlib\n"
            "matplotlib.use('Agg')\nimport matplotlib.pyplot\n")
    fresh = tmp_path / "mplconfig"
    fresh.mkdir()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), MPLCONFIGDIR=str(fresh)))
    assert result.returncode == 0, result.stderr
    assert any(fresh.iterdir()), "matplotlib built no font cache: the test did not reach the notice"
    assert result.stderr == "", result.stderr


def test_library_load_and_save_draw_no_transformers_bars_and_keep_the_users_settings(make_retriever, tmp_path: Path,
                                                                                    capfd) -> None:
    """In library use, ``Retriever.save`` and ``Retriever.load`` print none of transformers' bars or lines; a user's
    own transformers settings (bar on, info verbosity) hold again after each call."""
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())
    hf_logging.enable_progress_bar()
    hf_logging.set_verbosity_info()
    try:
        make_retriever().save(tmp_path / "saved")
        assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == logging.INFO
        Retriever = type(make_retriever())
        Retriever.load(tmp_path / "saved")
        assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == logging.INFO
    finally:
        (hf_logging.enable_progress_bar if before[0] else hf_logging.disable_progress_bar)()
        hf_logging.set_verbosity(before[1])
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and "\x1b" not in err, err


def test_library_lora_fit_of_a_checkpointed_gpt2_prints_nothing_of_its_dependencies(tmp_path: Path, capfd) -> None:
    """``Trainer(config).fit()`` of a GPT-2 with LoRA on c_attn,c_proj and gradient checkpointing, called from
    code: no "Loading weights"/"Writing model shards" bar, no transformers ``use_cache`` line, no peft
    ``fan_in_fan_out`` warning."""
    import dataclasses

    from dpr_gc.model.lora import LoraSettings
    from dpr_gc.train.trainer import Trainer
    from tests.train_data import make_records, task_config, write_dpr

    task = {"dir": tmp_path, "model": tiny_gpt2(tmp_path / "gpt2"),
            "train": write_dpr(tmp_path / "train.json", make_records(8, 1))}
    config = task_config(task, tmp_path / "run", batch_size=4, max_steps=2, save_every=1, gradient_checkpointing=True)
    config.model = dataclasses.replace(config.model, lora=LoraSettings(r=4, target_modules=("c_attn", "c_proj")))
    capfd.readouterr()  # the test's own GPT-2 save
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(config).fit()
    err = capfd.readouterr().err
    for text in ("Loading weights", "Writing model shards", "use_cache", "fan_in_fan_out", "\x1b"):
        assert text not in err, err
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]


def test_an_in_process_verbose_command_leaves_the_library_quiet_after_it(tmp_path) -> None:
    """``main(["--verbose", ...])`` in a process left the toolkit noting verbose, so a library load later in it drew
    transformers' bars and deprecations (a test's helper did, after an earlier test's --verbose run)."""
    from transformers.utils import logging as hf_logging

    from dpr_gc.base.logs import transformers_quiet
    from dpr_gc.cli import main

    assert main(["--verbose", "evaluate", "--results", str(tmp_path / "missing.json")]) == 2
    missing = str(tmp_path / "missing")
    scripts = {"dense_retriever": ["--model_file", missing, "--qa_dataset", missing, "--ctx_datatsets", missing,
                                   "--encoded_ctx_files", missing, "--out_file", str(tmp_path / "out.json")],
               "generate_dense_embeddings": ["--model_file", missing, "--ctx_file", missing, "--out_file", missing],
               "train_dense_encoder": ["--train_file", missing, "--output_dir", str(tmp_path / "out")]}
    for script, argv in scripts.items():  # the DPR-compatible scripts' --verbose too
        assert load_script(script).main(["--verbose", *argv]) == 2, script
        assert not logging.getLogger("dpr_gc").verbose_dependencies, script
    before = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        with transformers_quiet():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
    finally:
        if not before:
            hf_logging.disable_progress_bar()


@pytest.mark.parametrize("shared", [True, False])
def test_loading_a_retriever_shorter_than_the_tokenizer_probe_prints_nothing(make_retriever, tmp_path: Path, capfd,
                                                                             caplog, shared: bool) -> None:
    """A saved retriever whose max lengths are shorter than the tokenizer check's probe text loads without
    transformers' 'Token indices sequence length is longer ...' line (logged or printed) for either tower.
    Its logger is watched as well as stderr, so a record is caught whatever transformers' handler does with it."""
    make_retriever(shared=shared, query_max_length=4, passage_max_length=5).save(tmp_path / "short")
    capfd.readouterr()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            type(make_retriever()).load(tmp_path / "short")
    finally:
        hf_logger.removeHandler(caplog.handler)
    err = capfd.readouterr().err
    assert "sequence length" not in err and "sequence length" not in caplog.text, (err, caplog.text)
    assert not [w for w in caught if "sequence length" in str(w.message)], [str(w.message) for w in caught]


@contextlib.contextmanager
def a_users_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A notebook's process before its first command: no root handler (pytest's own are set aside, so the command's
    ``basicConfig`` adds one), the root at WARNING, no quiet settings in the environment or on the dependencies'
    loggers, transformers at INFO with its bar on, datasets' bar on (where its environment allowed), and a warning
    filter of the user's own; pytest's settings return after it."""
    import datasets
    from transformers.utils import logging as hf_logging

    from dpr_gc.base.logs import QUIET_ENVIRONMENT, QUIET_LOGGERS

    root, loggers = logging.getLogger(), [logging.getLogger(name) for name in QUIET_LOGGERS]
    saved = (root.level, root.handlers[:], [(lg.level, lg.filters[:]) for lg in loggers],
             hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), datasets.are_progress_bars_disabled())
    for name in QUIET_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    for logger in loggers:
        logger.setLevel(logging.NOTSET)
        logger.filters.clear()
    hf_logging.set_verbosity_info()
    with warnings.catch_warnings():  # datasets refuses where its environment variable was set at its import
        warnings.simplefilter("ignore")
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="a warning of the user's")
            yield
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for logger, (level, filters) in zip(loggers, saved[2]):
            logger.setLevel(level)
            logger.filters[:] = filters
        hf_logging.set_verbosity(saved[3])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (hf_logging.enable_progress_bar if saved[4] else hf_logging.disable_progress_bar)()
            (datasets.disable_progress_bars if saved[5] else datasets.enable_progress_bars)()


def process_settings() -> dict:
    """What a command run in-process could leave changed: the environment, warning filters, the root logger's level,
    handlers and their filters, the dependencies' loggers, transformers' and datasets' verbosity and bars."""
    import datasets
    from transformers.utils import logging as hf_logging

    from dpr_gc.base.logs import QUIET_LOGGERS

    root = logging.getLogger()
    return {"environ": dict(os.environ), "warnings": warnings.filters[:], "root": (root.level, root.handlers[:]),
            "handler filters": [h.filters[:] for h in root.handlers],
            "loggers": {name: (logging.getLogger(name).level, logging.getLogger(name).filters[:])
                        for name in (*QUIET_LOGGERS, "dpr_gc")},
            "verbose": getattr(logging.getLogger("dpr_gc"), "verbose_dependencies", False),
            "transformers": (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()),
            "datasets": (datasets.logging.get_verbosity(), datasets.are_progress_bars_disabled())}


def a_dependency_speaks(args, model_flag: str = "--model") -> int:
    """A stage in which FAISS logs an INFO line and transformers a warning."""
    from transformers.utils import logging as hf_logging

    logging.getLogger("faiss").info("a line of faiss")
    hf_logging.get_logger("transformers.modeling_utils").warning("a warning of transformers")
    return 0


def failing_stage(args, model_flag: str = "--model") -> int:
    raise RuntimeError("a stage failed")


@pytest.mark.parametrize("verbose", [[], ["--verbose"]])
@pytest.mark.parametrize("ending", ["success", "error", "exception"])
def test_a_command_run_in_process_leaves_the_process_as_it_found_it(tmp_path: Path, monkeypatch, ending: str,
                                                                    verbose: list) -> None:
    """``main([...])`` from a notebook sets up the command's log (a root handler and level, the dependencies quiet
    through their loggers, warning filters, environment variables, transformers' and datasets' own settings): each
    returns to what it was once the command ends, whether it succeeds, fails with an ``error:`` line (exit 2) or
    raises."""
    from dpr_gc import cli
    from tests.helpers import call

    if ending == "exception":
        monkeypatch.setattr(cli, "run_stage", failing_stage)
    argv = {"success": ["cache", "--cache-dir", str(tmp_path)], "error": ["evaluate", "--results",
                                                                          str(tmp_path / "missing.json")],
            "exception": ["evaluate", "--results", str(tmp_path / "missing.json")]}[ending]
    with a_users_process(monkeypatch):
        before = process_settings()
        with pytest.raises(RuntimeError, match="a stage failed") if ending == "exception" else contextlib.nullcontext():
            code, err = call(cli.main, [*verbose, *argv])
            assert code == (0 if ending == "success" else 2), err
        assert process_settings() == before


def test_a_verbose_command_after_a_quiet_one_lets_the_dependencies_speak(tmp_path: Path, monkeypatch) -> None:
    """In one process, ``main([...])`` then ``main(["--verbose", ...])``: the second shows FAISS's INFO line and
    transformers' warning, which the first kept quiet (its quiet loggers, root handler and transformers' level had
    stayed, so the verbose command showed neither)."""
    from dpr_gc import cli
    from tests.helpers import call

    monkeypatch.setattr(cli, "run_stage", a_dependency_speaks)
    argv = ["evaluate", "--results", str(tmp_path / "results.json")]
    with a_users_process(monkeypatch):
        quiet, verbose = call(cli.main, argv), call(cli.main, ["--verbose", *argv])
    assert quiet[0] == 0 and "faiss" not in quiet[1] and "a warning of transformers" not in quiet[1], quiet
    assert verbose[0] == 0 and re.search(r"INFO faiss: a line of faiss\n", verbose[1]), verbose
    assert "[transformers] a warning of transformers" in verbose[1], verbose


IMPORTED_DURING = '''
import logging, os, sys
from dpr_gc.cli import main
from dpr_gc.base.logs import QUIET_ENVIRONMENT
assert "transformers" not in sys.modules
assert main(["merge-lora", "--model", sys.argv[1], "--output", sys.argv[2]]) == 2
from transformers.utils import logging as hf_logging
quiet = [name for name in QUIET_ENVIRONMENT if name in os.environ]
print(hf_logging.get_verbosity(), logging.getLogger("transformers").filters, quiet)
'''


def test_transformers_first_imported_by_an_in_process_command_is_at_its_default_verbosity(tmp_path: Path) -> None:
    """transformers, imported during a command (its import reads the quiet ``TRANSFORMERS_VERBOSITY=error``), is
    left at the verbosity a plain import gives (warnings), with no quiet filter and none of the quiet variables."""
    from dpr_gc.base.logs import QUIET_ENVIRONMENT

    clean = {name: value for name, value in os.environ.items() if name not in QUIET_ENVIRONMENT}
    result = subprocess.run([sys.executable, "-c", IMPORTED_DURING, str(tmp_path / "missing"), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=dict(clean, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{logging.WARNING} [] []\n", result.stdout + result.stderr
