"""Shared fixtures: tiny random BERTs and tokenizers built in code (no download, seconds to run)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from transformers import BertTokenizerFast

from dpr_gc.model.retriever import Retriever, RetrieverConfig
from tests.helpers import tiny_bert, write_vocab


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (pytest.ini runs two workers) each worker takes its share of the cores for torch and for
    the processes its tests start (torchrun ranks, CLI runs), so the workers do not oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# The files run last, in this order (see pytest_collection_modifyitems).
LAST_FILES = ("test_jax.py", "test_jax_training.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The JAX tests run last: JAX's thread pools stay up for the rest of the process once started, and a later test
    that forks (DataLoader workers, answer-matching pools) would fork a multithreaded process, which JAX warns may
    deadlock. Under pytest-xdist, ``--dist loadfile --no-loadscope-reorder`` (pytest.ini) hands the files out in
    this order, so a worker that takes a JAX file runs nothing after it but the other JAX file. The JAX tests are
    two files of about equal length, so each worker can take one at the end of the run."""
    items.sort(key=lambda item: LAST_FILES.index(item.path.name) if item.path.name in LAST_FILES else -1)


@pytest.fixture(scope="session", autouse=True)
def parse_cache_in_the_sessions_temp(tmp_path_factory: pytest.TempPathFactory):
    """Corpora and training sets parsed by the tests (and by the CLI runs they start) are cached in the session's
    temporary folder, not in the user's ``~/.cache/dpr_gc``, which would otherwise gain files at every run."""
    before = os.environ.get("DPR_GC_CACHE")
    os.environ["DPR_GC_CACHE"] = str(tmp_path_factory.mktemp("dpr_gc_cache"))
    yield
    if before is None:
        os.environ.pop("DPR_GC_CACHE", None)
    else:
        os.environ["DPR_GC_CACHE"] = before


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Each test starts with the process's torch thread count: benchmark children run in-process by some tests set
    their own (``--threads 1``), which would otherwise hold for every later test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class CurrentStderr:
    """A stream that writes to whatever ``sys.stderr`` is at the moment of writing."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def transformers_lines_in_the_tests_stderr():
    """transformers' handler keeps the ``sys.stderr`` of the moment transformers set up its logger (pytest's capture
    at collection), so ``capfd``, ``capsys`` and ``helpers.call`` saw none of its lines, and a test that a command
    or call prints nothing of its dependencies could not fail for one. For each test the handler writes to the
    stderr of the moment instead, and gets its own stream back after. A benchmark script run in-process
    (bench_common's ``quiet_dependencies``, never undone) sets transformers to errors only for the rest of the
    process (right in its own process), which would blind every later test in the worker; transformers' level
    returns after each test."""
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    handlers = [h for h in hf_logger.handlers if type(h) is logging.StreamHandler]
    streams = [h.setStream(CurrentStderr()) for h in handlers]
    yield
    for handler, stream in zip(handlers, streams):
        handler.setStream(stream)
    hf_logger.setLevel(level)


@pytest.fixture(scope="module")
def jax_quick_compiles():
    """For the JAX test files: compile with XLA's optimisations off. They check numbers and memory layout, not speed,
    and compiling is most of their time (the memory figures are the same either way; benchmarks/bench_jax_memory.py
    measures them with full optimisation)."""
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> BertTokenizerFast:
    vocab = write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")
    return BertTokenizerFast(vocab=str(vocab), do_lower_case=True)


@pytest.fixture
def make_retriever(tiny_tokenizer: BertTokenizerFast):
    """Factory: ``make_retriever(shared=True, dropout=0.0, **config_fields)`` -> a tiny random Retriever.

    Mean pooling by default: a random BERT's CLS vector barely depends on the input, so scores would all be equal
    and gradients would be differences of near-equal numbers.
    """

    def make(shared: bool = True, dropout: float = 0.0, seed: int = 0, **fields) -> Retriever:
        fields.setdefault("pooling", "mean")
        config = RetrieverConfig(shared_encoder=shared, **fields)
        vocab_size = len(tiny_tokenizer)
        q = tiny_bert(vocab_size, seed, dropout)
        p = None if shared else tiny_bert(vocab_size, seed + 1, dropout)
        return Retriever(q, p, tiny_tokenizer, config)

    return make


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A tiny run trained two steps with a checkpoint after each (for resume and damaged-state tests)."""
    from dpr_gc.cli import main
    from tests.helpers import train_argv
    from tests.train_data import init_model, make_records, write_dpr

    d = tmp_path_factory.mktemp("sec")
    task = {"dir": d, "model": init_model(d), "train": write_dpr(d / "t.json", make_records(16, 5))}
    argv = [str(a) for a in train_argv(task, d / "run", None)[:-2]]
    assert main(argv + ["--max-steps", "2", "--save-every", "1", "--keep-checkpoints", "2"]) == 0
    return task
