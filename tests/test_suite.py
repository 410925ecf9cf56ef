"""The suite's own set-up (README, pytest.ini, conftest.py): two pytest-xdist workers that split the cores, and the
JAX tests last in whichever worker takes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_each_worker_takes_its_share_of_the_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        pytest.skip("one process (-n 0 or -n 1): nothing to split")
    threads = max(1, (os.cpu_count() or 1) // workers)
    assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == str(threads)


def test_the_jax_tests_come_last_and_the_files_are_handed_out_in_that_order(request: pytest.FixtureRequest) -> None:
    """A JAX test starts thread pools that a later forking test would inherit, so the JAX files (test_jax.py,
    test_jax_training.py) are collected last, and xdist hands out whole files in collection order (its default
    reorders them by size)."""
    names = [item.path.name for item in request.session.items]
    jax_files = {"test_jax.py", "test_jax_training.py"}
    firsts = [names.index(name) for name in jax_files if name in names]
    if firsts:
        assert set(names[min(firsts):]) <= jax_files
    addopts = request.config.getini("addopts")  # a worker's own options are reset, so read what pytest.ini says
    assert "-n" in addopts and addopts[addopts.index("--dist") + 1] == "loadfile"
    assert "--no-loadscope-reorder" in addopts


def test_the_reliability_loop_names_tests_that_exist() -> None:
    """benchmarks/rank_tests_loop.py runs the multi-process tests by node id; pytest fails on an id that names no
    test, so a renamed or merged test must be renamed there too."""
    import ast
    import re

    source = (REPO / "benchmarks" / "rank_tests_loop.py").read_text()
    node_ids = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "NODE_IDS")
    assert len(node_ids) > 5
    for node_id in node_ids:
        path, _, name = node_id.partition("::")
        assert (REPO / path).is_file(), node_id
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), node_id


@pytest.fixture
def transformers_warns():
    """transformers' own logger passes warnings for the test (an in-process command run earlier in the worker may
    have set it to errors only), and returns to its level after."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    yield hf_logging.get_logger("transformers.modeling_utils")
    hf_logging.set_verbosity(before)


def test_a_transformers_line_logged_inside_call_is_in_the_stderr_it_returns(transformers_warns) -> None:
    """transformers' handler writes to the stderr of the moment transformers was set up (pytest's capture then), so
    ``helpers.call`` would hand back an empty stderr for a command whose dependency warned: the quietness checks
    built on it could not fail for a transformers line."""
    from tests.helpers import call

    def main(argv: list[str]) -> int:
        transformers_warns.warning("a warning of transformers")
        return 0

    assert call(main, []) == (0, "[transformers] a warning of transformers\n")


@pytest.mark.parametrize("fixture", ["capfd", "capsys"])
def test_a_transformers_line_reaches_the_tests_capture(transformers_warns, request: pytest.FixtureRequest,
                                                        fixture: str) -> None:
    """``capfd`` and ``capsys`` see what transformers logs during the test, as they see any other stderr line."""
    capture = request.getfixturevalue(fixture)
    capture.readouterr()
    transformers_warns.warning("a warning of transformers")
    assert capture.readouterr().err == "[transformers] a warning of transformers\n"


NEXT_TEST = '''
from transformers.utils import logging as hf_logging

from dpr_gc.base.logs import quiet_dependencies


def test_a_benchmark_quiets_the_dependencies_in_process():
    quiet_dependencies()


def test_after_it(capfd):
    hf_logging.get_logger("transformers.modeling_utils").warning("a warning of transformers")
    assert "a warning of transformers" in capfd.readouterr().err
'''


def test_quieting_in_process_leaves_the_next_test_seeing_transformers_warnings(tmp_path: Path) -> None:
    """A benchmark script run in-process sets transformers to errors only for the rest of the process (as it should
    in its own process; a dpr-gc command undoes it as it ends), so every later test in a worker would be blind to
    transformers' warnings; each test starts at transformers' level of the moment the suite began. Run as a suite of
    its own under this conftest.py, in an environment without the quiet settings an in-process benchmark here left
    in ``os.environ``."""
    import subprocess
    import sys

    from dpr_gc.base.logs import QUIET_ENVIRONMENT

    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403\n")
    (tmp_path / "test_next.py").write_text(NEXT_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    clean = {name: value for name, value in os.environ.items() if name not in QUIET_ENVIRONMENT}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                             "test_next.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=dict(clean, PYTHONPATH=str(REPO)))
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout + result.stderr
