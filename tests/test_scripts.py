"""Command-line scripts: argument handling (the DPR download cannot run offline; nothing is downloaded here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                          cwd=REPO)


def test_download_lists_and_dry_runs(tmp_path):
    listed = run("download_dpr_data.py", "--list")
    assert listed.returncode == 0 and "psgs_w100" in listed.stdout and "nq-train" in listed.stdout
    dry = run("download_dpr_data.py", "--dry-run", "--output", str(tmp_path / "dpr"), "nq-train", "nq-test")
    assert dry.returncode == 0
    assert "biencoder-nq-train.json.gz" in dry.stdout and "nq-test.qa.csv" in dry.stdout
    assert not (tmp_path / "dpr").exists()
    (tmp_path / "dpr").mkdir()
    (tmp_path / "dpr" / "nq-test.qa.csv").write_text("q\t['a']\n")
    again = run("download_dpr_data.py", "--dry-run", "--output", str(tmp_path / "dpr"), "nq-test")
    assert "already there" in again.stdout


@pytest.mark.parametrize("args,message", [(["nq-trian"], "unknown resource nq-trian"), ([], "at least one resource")])
def test_download_rejects_bad_arguments(args, message):
    bad = run("download_dpr_data.py", *args)
    assert bad.returncode == 2 and message in bad.stderr


def test_train_script_accepts_gc_dpr_flags(tmp_path):
    result = run("train_dense_encoder.py", "--train_file", str(tmp_path / "missing.json"), "--output_dir",
                 str(tmp_path / "out"), "--grad_cache", "--q_chunk_size", "4", "--ctx_chunk_size", "8",
                 "--batch_size", "16", "--hard_negatives", "1", "--other_negatives", "0", "--fp16",
                 "--pretrained_model_cfg", str(tmp_path))
    assert result.returncode == 2
    assert "missing.json" in result.stderr and "unrecognized" not in result.stderr
