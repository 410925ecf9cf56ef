"""The test-rank helpers never let a stuck process outlive its test."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.ranks import run_command


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
