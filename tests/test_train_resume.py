"""docs/stages.md's promise that a resumed train equals an uninterrupted one bit for bit, held for what the run
leaves: the final weights, every checkpoint's model and training state (optimizer, scheduler, sampler, RNG,
Gradient Cache, best record), each metrics.jsonl row but its timing, and ``best/``; for a run stopped by Ctrl-C
mid-step with DataLoader workers and dropout on, one stopped in the middle of a dev evaluation, and one killed (-9)
while it wrote a checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import dpr_gc.train.validation as validation
from dpr_gc.model.card import card_training
from dpr_gc.cli import main
from dpr_gc.train.checkpoints import finished_checkpoints
from dpr_gc.train.trainer import train
from tests.helpers import call, ctrl_c_at
from tests.ranks import run_command
from tests.train_data import init_model, make_records, model_params, task_config, write_dpr

TIMING = "examples_per_s"  # the only field that may differ between two runs of the same steps
REPO = Path(__file__).resolve().parents[1]
KILLED_AT_SECOND_STATE = """
import os, signal, sys
import dpr_gc.train.checkpoints as checkpoints
from dpr_gc.cli import main
real, calls = checkpoints.write_state, []
def killed(folder, state):
    calls.append(folder)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(folder, state)
checkpoints.write_state = killed
sys.exit(main(sys.argv[1:]))
"""  # `python -c` this with train's arguments: kill -9 while the second checkpoint's training state is written


def without_timing(value: Any, out: Path) -> Any:
    """A checkpoint's ``train_state.json`` content as nested dicts and lists (its key/value pair lists made dicts),
    without the step's timing and with the run folder spelt RUN."""
    if isinstance(value, dict) and "__dict__" in value:
        return {str(k): without_timing(v, out) for k, v in value["__dict__"] if k != TIMING}
    if isinstance(value, dict):
        return {k: without_timing(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [without_timing(v, out) for v in value]
    return value.replace(str(out), "RUN") if isinstance(value, str) else value


def run_record(out: Path) -> dict:
    """What a finished run left in ``out``, comparable between runs: final/, best/ and each checkpoint's model
    weights, each checkpoint's training state (JSON and tensors), and the metrics rows without their timing."""
    record: dict = {"metrics": [{k: v for k, v in json.loads(line).items() if k != TIMING}
                                for line in (out / "metrics.jsonl").read_text().splitlines()]}
    for checkpoint in sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        record[checkpoint.name] = {
            "state": without_timing(json.loads((checkpoint / "train_state.json").read_text()), out),
            "tensors": load_file(str(checkpoint / "train_state.safetensors")),
            "model": model_params(checkpoint / "model")}
    record["final"] = model_params(out / "final")
    record["best"] = model_params(out / "best") if (out / "best").is_dir() else None
    return record


def assert_same(a: Any, b: Any, where: str = "run") -> None:
    """``a`` equals ``b`` bit for bit (tensors by ``torch.equal``), naming the first place they differ."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_run_stopped_mid_step_with_workers_and_dropout_resumes_to_the_same_run(tmp_path: Path) -> None:
    """Two DataLoader workers and dropout 0.1, Ctrl-C in step 4 of 7 (4 steps an epoch, checkpoints every 2): the
    resumed run goes on mid-epoch and into the next one exactly as the uninterrupted run did."""
    task = {"dir": tmp_path, "model": init_model(tmp_path, dropout=0.1),
            "train": write_dpr(tmp_path / "t.json", make_records(32, 3))}
    common = dict(max_steps=7, save_every=2, keep_checkpoints=10, num_workers=2, learning_rate=5e-4, seed=11)
    train(task_config(task, tmp_path / "a", **common))
    with pytest.raises(KeyboardInterrupt):
        train(task_config(task, tmp_path / "b", **common), on_backward=ctrl_c_at(3))  # in step 4
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-2"]
    train(task_config(task, tmp_path / "b", resume="latest", **common))
    a, b = run_record(tmp_path / "a"), run_record(tmp_path / "b")
    assert [row["step"] for row in b["metrics"]] == list(range(1, 8))
    assert {k for k in a if k.startswith("checkpoint")} == {"checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                           "checkpoint-7"}
    assert_same(a, b)


def test_a_run_stopped_during_a_dev_evaluation_resumes_to_the_same_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while step 8's dev evaluation embeds the passages (dev every 2 steps, checkpoints every 3, best by the
    dev accuracy, which step 4 reaches and no later step beats): the resume from checkpoint-6 drops step 7's metrics
    row, keeps step 4's best record, and ends as the uninterrupted run did, best/ included."""
    task = {"dir": tmp_path, "model": init_model(tmp_path, dropout=0.1),
            "train": write_dpr(tmp_path / "t.json", make_records(32, 3)),
            "dev": write_dpr(tmp_path / "dev.json", make_records(8, 5))}
    common = dict(max_steps=9, save_every=3, eval_every=2, best_metric="accuracy", dev_file=str(task["dev"]),
                  keep_checkpoints=10, learning_rate=5e-4, seed=11)
    train(task_config(task, tmp_path / "a", **common))
    embed, calls = validation._embed_shared, []

    def interrupted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[1])
        if len(calls) == 10:  # the passages of the fifth evaluation (steps 0, 2, 4, 6, 8): step 8's
            raise KeyboardInterrupt
        return embed(*args, **kwargs)

    monkeypatch.setattr(validation, "_embed_shared", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(task_config(task, tmp_path / "b", **common))
    assert calls[-2:] == ["query", "passage"]
    assert [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == \
        list(range(8))
    monkeypatch.setattr(validation, "_embed_shared", embed)
    train(task_config(task, tmp_path / "b", resume="latest", **common))
    a, b = run_record(tmp_path / "a"), run_record(tmp_path / "b")
    assert [row["step"] for row in b["metrics"]] == list(range(10))
    assert [row["step"] for row in b["metrics"] if "dev_loss" in row] == [0, 2, 4, 6, 8, 9]
    assert {k for k in a if k.startswith("checkpoint")} == {"checkpoint-3", "checkpoint-6", "checkpoint-9"}
    assert a["checkpoint-9"]["state"]["best"][2] == 4  # recorded before checkpoint-6: the resume must keep it
    assert_same(a, b)


def test_a_run_killed_while_writing_a_checkpoint_resumes_to_the_same_run(tmp_path: Path) -> None:
    """kill -9 of ``dpr-gc train`` (two DataLoader workers, dropout) while checkpoint-4's training state is written:
    its hidden copy is removed, the run resumes from checkpoint-2, dropping the metrics rows of steps 3 and 4, and
    ends as an uninterrupted run of the same command did."""
    model, data = init_model(tmp_path, dropout=0.1), write_dpr(tmp_path / "t.json", make_records(32, 3))
    argv = ["train", "--train", data, "--model", model, "--batch-size", 8, "--num-workers", 2, "--max-steps", 7,
            "--save-every", 2, "--keep-checkpoints", 10, "--learning-rate", 5e-4, "--seed", 11, "--query-chunk-size",
            3, "--passage-chunk-size", 5, "--device", "cpu", "--cache-dir", tmp_path / "cache"]
    assert call(main, argv + ["--output", tmp_path / "a"])[0] == 0
    # the killed run's steps take this process's torch thread count: a sum split over other threads rounds otherwise
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(torch.get_num_threads()))
    killed = run_command([sys.executable, "-c", KILLED_AT_SECOND_STATE, *map(str, argv), "--output",
                          str(tmp_path / "b")], limit_s=240, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "b" / ".checkpoint-4.tmp" / "model").is_dir()
    code, err = call(main, argv + ["--output", tmp_path / "b", "--resume", "latest"])
    assert code == 0, err[-3000:]
    assert not (tmp_path / "b" / ".checkpoint-4.tmp").exists()
    a, b = run_record(tmp_path / "a"), run_record(tmp_path / "b")
    assert [row["step"] for row in b["metrics"]] == list(range(1, 8))
    assert_same(a, b)


def test_resuming_an_earlier_checkpoint_drops_what_the_run_it_redoes_wrote_after_it(tmp_path: Path, caplog) -> None:
    """``--resume OUT/checkpoint-1`` with checkpoint-2 and -3, final/ and best/ of step 3 in OUT kept them: rotation
    then removed the checkpoints the resumed run wrote, ``--resume latest`` and ``final/`` took the old step 3, and
    best/ matched no row of the cut metrics.jsonl. What came after step 1 is removed, said in one line, and the run
    ends as a run of its own length does."""
    task = {"dir": tmp_path, "model": init_model(tmp_path),
            "train": write_dpr(tmp_path / "t.json", make_records(16, 1)),
            "dev": write_dpr(tmp_path / "d.json", make_records(8, 2))}
    common = dict(save_every=1, keep_checkpoints=2, dev_file=str(task["dev"]), eval_every=1, learning_rate=1e-2)
    train(task_config(task, tmp_path / "a", max_steps=4, **{**common, "keep_checkpoints": 5}))
    train(task_config(task, tmp_path / "b", max_steps=4, **common))
    with caplog.at_level("WARNING", logger="dpr_gc.train.checkpoints"):
        train(task_config(task, tmp_path / "a", max_steps=4, resume=str(tmp_path / "a" / "checkpoint-1"), **common))
    assert "removed what the run it redoes wrote after step 1 (checkpoint-2/, checkpoint-3/, checkpoint-4/, final/" \
        in caplog.text
    a, b = run_record(tmp_path / "a"), run_record(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert [row["step"] for row in a["metrics"]] == [row["step"] for row in b["metrics"]] == [0, 1, 2, 3, 4]
    assert_same(a, b)
    train(task_config(task, tmp_path / "b", max_steps=3, resume=str(tmp_path / "b" / "checkpoint-3"), **common))
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-3"]  # latest: step 3
    assert card_training(tmp_path / "b" / "final")["steps"] == 3
    assert not (tmp_path / "b" / "best").exists() or card_training(tmp_path / "b" / "best")["steps"] <= 3


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A task and a run of 4 steps keeping every checkpoint (``task["run"]``), to copy and resume."""
    d = tmp_path_factory.mktemp("four")
    task = {"dir": d, "model": init_model(d), "train": write_dpr(d / "t.json", make_records(16, 1))}
    task["run"] = d / "run"
    train(task_config(task, task["run"], max_steps=4, save_every=1, keep_checkpoints=4))
    return task


def test_only_checkpoint_names_the_trainer_writes_are_checkpoints(four_steps: dict, tmp_path: Path) -> None:
    """A copy named checkpoint-04 (or with a non-ASCII digit) was taken for checkpoint 4: resuming checkpoint-2
    removed checkpoint-3 and -4, then failed on a checkpoint-4 already gone. Such copies are left alone."""
    out = tmp_path / "run"
    shutil.copytree(four_steps["run"], out)
    for name in ("checkpoint-04", "checkpoint-\u0664", "checkpoint-+4"):
        shutil.copytree(out / "checkpoint-4", out / name)
    assert [p.name for p in finished_checkpoints(out)] == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    train(task_config(four_steps, out, max_steps=4, save_every=1, keep_checkpoints=4,
                      resume=str(out / "checkpoint-2")))
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert names == sorted(["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-04",
                            "checkpoint-\u0664", "checkpoint-+4"]), names


def test_a_linked_checkpoint_or_final_is_removed_as_a_link(four_steps: dict, tmp_path: Path) -> None:
    """checkpoint-4 and final/ of --output as links to folders kept elsewhere: resuming checkpoint-2 stopped with
    'Cannot call rmtree on a symbolic link' after removing checkpoint-3, metrics.jsonl not cut. The links are
    removed, their targets kept; rotation does the same to a linked old checkpoint."""
    out, keep = tmp_path / "run", tmp_path / "keep"
    shutil.copytree(four_steps["run"], out)
    keep.mkdir()
    for name in ("checkpoint-4", "final", "checkpoint-1"):
        (out / name).rename(keep / name)
        (out / name).symlink_to(keep / name)
    kept = sorted(str(p.relative_to(keep)) for p in keep.rglob("*"))
    train(task_config(four_steps, out, max_steps=4, save_every=1, keep_checkpoints=2,
                      resume=str(out / "checkpoint-2")))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not any(p.is_symlink() for p in out.iterdir()) and (out / "final").is_dir()
    assert sorted(str(p.relative_to(keep)) for p in keep.rglob("*")) == kept
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_seeding_and_a_checkpoints_random_states_cover_python_numpy_and_torch() -> None:
    """rng.py: a run is seeded, and a checkpoint saves and restores the states of, Python's, NumPy's and torch's
    generators: after seeding alike, or restoring a state, each draws again what it drew (a user's code drawing
    from any of them resumes the same)."""
    import random

    import numpy as np

    from dpr_gc.train.rng import capture_rng, restore_rng, seed_everything

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    before = capture_rng()  # the test process's own, put back at the end
    try:
        seed_everything(3)
        state = capture_rng()
        first = draws()
        restore_rng(state)
        assert draws() == first
        seed_everything(3)
        assert draws() == first
    finally:
        restore_rng(before)


def test_an_os_error_naming_no_file_names_no_none_and_no_free_space() -> None:
    """An OSError naming no file (shutil's 'Cannot call rmtree on a symbolic link') was said as '...; check the path
    and free space'; free space is advised only for a full disk or quota."""
    from dpr_gc.base.errors import os_error_line

    assert os_error_line(OSError("Cannot call rmtree on a symbolic link")) == (
        "error: Cannot call rmtree on a symbolic link; check the paths and folders the command was given")
    assert os_error_line(OSError(errno.ENOTDIR, "Not a directory", "x/y")) == (
        "error: x/y: Not a directory; check the path")
    assert os_error_line(OSError(errno.ENOSPC, "No space left on device")) == (
        "error: No space left on device; free space or write somewhere else, then run the command again")
    assert "None" not in os_error_line(OSError(errno.EXDEV, "Invalid cross-device link", None, "b"))
