"""Two single-rank "nodes" (torchrun --nnodes 2 on 127.0.0.1) where one lacks its copy of --train: the rank that
refused before joining the process group left the other waiting in init_process_group for gloo's 30 minutes (on one
machine torchrun kills siblings, across machines nothing does). The ranks now join first and refuse together."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.ranks import kill_group
from tests.train_data import make_records, write_dpr

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 150.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_missing_its_training_file_stops_every_node_in_one_line(tmp_path):
    data = write_dpr(tmp_path / "train.json", make_records(8, 1))
    port, env = free_port(), dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    nodes = []
    for node, train in ((0, data), (1, tmp_path / "missing.json")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "dpr_gc.cli", "train", "--train", str(train), "--model", str(tmp_path / "no-model"),
               "--output", str(tmp_path / f"out{node}"), "--device", "cpu", "--num-workers", "0"]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True, cwd=tmp_path))
    deadline = time.monotonic() + LIMIT_S
    try:
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            time.sleep(1)
        alive = [i for i, p in enumerate(nodes) if p.poll() is None]
    finally:
        for p in nodes:
            kill_group(p)
    errs = [p.communicate()[1] for p in nodes]
    assert not alive, f"nodes {alive} still running after {LIMIT_S:.0f} s:\n" + "\n".join(e[-1500:] for e in errs)
    lines = [[line for line in err.splitlines() if line.startswith("error:")] for err in errs]
    assert "--train data not found" in lines[1][0] and "missing.json" in lines[1][0], errs[1][-2000:]
    assert "rank 1 stopped: --train data not found" in lines[0][0], errs[0][-2000:]
    assert [len(node_lines) for node_lines in lines] == [1, 1], lines  # (torchrun's agent adds its own report)
