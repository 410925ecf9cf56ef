"""fp16 training: a step the GradScaler skips (inf/NaN gradients) is reported, in the log, metrics.jsonl and the
summary, never as torch's raw warning; every JSON file the trainer writes stays valid JSON; a resume stays exact."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dpr_gc.cli import main
from dpr_gc.train.trainer import train
from tests.helpers import ctrl_c_at
from tests.train_data import init_model, make_records, model_params, task_config, write_dpr


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: Python's reader takes bare NaN and Infinity, which JSON has not."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def fp16_task(folder: Path, temperature: float) -> dict:
    """A task whose first fp16 steps overflow at the GradScaler's starting scale: a small learnable temperature
    scales the logits up (0.01: every one of the first steps; 0.1: the first three)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"dir": folder, "model": init_model(folder, learn_temperature=True, temperature=temperature),
            "train": write_dpr(folder / "train.json", make_records(48, 3))}


def test_steps_the_fp16_scaler_skips_are_reported_and_written_as_valid_json(tmp_path, capsys, caplog):
    task = fp16_task(tmp_path, 0.01)
    out = tmp_path / "out"
    argv = ["train", "--model", task["model"], "--train", task["train"], "--output", out, "--batch-size", 8,
            "--query-chunk-size", 3, "--passage-chunk-size", 5, "--max-steps", 3, "--save-every", 2,
            "--precision", "fp16", "--num-workers", 0, "--cache-dir", tmp_path / "cache"]
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="dpr_gc"):
        warnings.simplefilter("always")
        assert main([str(a) for a in argv]) == 0
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
    skips = [r.getMessage() for r in caplog.records if "skipped by fp16's GradScaler" in r.getMessage()]
    assert skips == ["step 1 skipped by fp16's GradScaler: inf/NaN gradients at loss scale 65536; it lowers the "
                     "scale and goes on (metrics.jsonl marks each skipped step, the summary counts them)"]
    rows = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["grad_norm"]) for r in rows] == [(1, True, None), (2, True, None),
                                                                         (3, True, None)]
    strict_json((out / "checkpoint-2" / "train_state.json").read_text())
    assert "| skipped steps | 3 of 3 (inf/NaN gradients: the weights stayed as they were) |" in capsys.readouterr().out


def test_a_resumed_fp16_run_with_skipped_steps_equals_the_uninterrupted_one(tmp_path):
    task = fp16_task(tmp_path, 0.1)
    common = dict(max_steps=6, save_every=2, precision="fp16")
    whole = train(task_config(task, tmp_path / "a", **common))
    with pytest.raises(KeyboardInterrupt):
        train(task_config(task, tmp_path / "b", **common), on_backward=ctrl_c_at(3))
    resumed = train(task_config(task, tmp_path / "b", resume="latest", **common))
    assert whole["skipped_steps"] == resumed["skipped_steps"] == 3
    a, b = model_params(tmp_path / "a" / "final"), model_params(tmp_path / "b" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)

    def rows(run: str) -> list[dict]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in strict_json(line).items() if k != "examples_per_s"} for line in lines]

    assert rows("a") == rows("b") and [r["skipped"] for r in rows("b")] == [True] * 3 + [False] * 3
