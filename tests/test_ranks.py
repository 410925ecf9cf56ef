"""The test-rank helpers never let a stuck process outlive its test; the suite's order keeps forks away from
JAX."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ranks import run_command, run_ranks


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_run_command_kills_the_whole_process_group_on_its_limit(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    with pytest.raises(TimeoutError, match="process group was killed"):
        run_command([sys.executable, "-c", code], limit_s=5)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(grandchild), "the rank (grandchild) outlived the killed launcher"


def test_run_command_returns_like_subprocess_run():
    done = run_command([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def report_worker(rank: int, folder: str) -> None:
    """Write what the rank started with: a variable its test set, its torch threads, whether peft came preloaded."""
    preloaded = "peft" in sys.modules
    Path(folder, f"rank-{rank}.txt").write_text(f"{os.environ.get('DPR_GC_TEST_MARK')} {torch.get_num_threads()} "
                                                 f"{preloaded}")


def sleeping_worker(rank: int, folder: str) -> None:
    Path(folder, f"pid-{rank}.txt").write_text(str(os.getpid()))
    time.sleep(120)


def test_a_rank_starts_with_its_tests_environment_and_threads(tmp_path, monkeypatch):
    run_ranks(report_worker, (str(tmp_path),), 1)  # the fork server is up before the variable is set
    monkeypatch.setenv("DPR_GC_TEST_MARK", "set-by-the-test")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_ranks(report_worker, (str(tmp_path),), 2)
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)] == ["set-by-the-test 1 True"] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_run_ranks_kills_its_ranks_on_its_limit(tmp_path):
    with pytest.raises(TimeoutError, match="still running after 5 s"):
        run_ranks(sleeping_worker, (str(tmp_path),), 2, limit_s=5)
    pids = [int((tmp_path / f"pid-{r}.txt").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(pid) for pid in pids), "a rank outlived its limit"


def test_the_two_jax_files_run_last(request) -> None:
    """conftest.py's order, as this process collected it: the two JAX files last (no fork after JAX's threads
    start), one for each worker at the suite's tail."""
    files = list(dict.fromkeys(item.path.name for item in request.session.items))
    if "test_jax.py" not in files or "test_jax_training.py" not in files:
        pytest.skip("run with the whole suite collected")
    assert files[-2:] == ["test_jax.py", "test_jax_training.py"]
