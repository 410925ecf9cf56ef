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
    """A JAX test starts thread pools that a later forking test would inherit, so test_jax.py is collected last, and
    xdist hands out whole files in collection order (its default reorders them by size)."""
    names = [item.path.name for item in request.session.items]
    if "test_jax.py" in names:
        first = names.index("test_jax.py")
        assert set(names[first:]) == {"test_jax.py"}
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
