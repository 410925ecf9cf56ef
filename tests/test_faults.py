"""Faults: kill -9 leaves no worker processes behind, concurrent or crashed runs never poison an output folder, and
interrupted runs clean up their own temporaries and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpr_gc.errors import DprGcError
from dpr_gc.train import train
from tests.test_train import config, init_model
from tests.train_data import make_records, write_dpr

REPO = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("faults")
    return {"dir": d, "model": init_model(d), "train": write_dpr(d / "train.json", make_records(64, 1))}


def long_records(n: int) -> list[dict]:
    """Records with 100-word passages: batches big enough to fill the pipe between a worker and the trainer."""
    records = make_records(n, 7)
    for r in records:
        for ctx in r["positive_ctxs"] + r["hard_negative_ctxs"]:
            ctx["text"] = " ".join([ctx["text"]] * 10)
    return records


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_train_leaves_no_dataloader_workers(task, tmp_path):
    """Killed while workers have tokenised batches waiting in a full pipe (what left them running for minutes)."""
    out = tmp_path / "run"
    model = init_model(tmp_path, passage_max_length=128)
    data = write_dpr(tmp_path / "long.json", long_records(256))
    cmd = [sys.executable, "-m", "dpr_gc", "train", "--train", str(data), "--model", str(model),
           "--output", str(out), "--num-workers", "2", "--batch-size", "32", "--max-steps", "100000",
           "--q_chunk_size", "8", "--ctx_chunk_size", "16", "--cache-dir", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        metrics = out / "metrics.jsonl"
        started = wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0 and len(children(proc.pid)) >= 2,
                           240)
        assert started, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "training did not start"
        workers = children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone = wait_for(lambda: not any(alive(w) for w in workers), 15)
        survivors = [w for w in workers if alive(w)]
        for w in survivors:
            os.kill(w, signal.SIGKILL)
        assert gone, f"{len(survivors)} DataLoader worker(s) outlived the killed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_partial_last_line_of_metrics_is_dropped_on_resume(task, tmp_path):
    common = dict(max_steps=4, save_every=2, batch_size=8)

    def crash(step: int, retriever) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(task, tmp_path / "b", **common), on_backward=crash)
    metrics = tmp_path / "b" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "epoch": 0, "lo')
    train(config(task, tmp_path / "b", resume="latest", **common))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    metrics.write_text('{"step": 1}\n{oops\n{"step": 2}\n')
    with pytest.raises(DprGcError, match="metrics.jsonl:2"):
        train(config(task, tmp_path / "b", resume="latest", **common))
