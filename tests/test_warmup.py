"""``--warmup-ratio``: warm-up as a fraction of all steps (rounded up, as Hugging Face's trainers), refused together
with ``--warmup-steps``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.cli import main
from dpr_gc.train.config import OptimConfig
from dpr_gc.train.trainer import Trainer
from tests.train_data import make_records, train_config, write_dpr


def test_ratio_counts_steps_as_hugging_face() -> None:
    assert OptimConfig(warmup_ratio=0.1).warmup_for(12) == 2  # ceil(1.2)
    assert OptimConfig(warmup_ratio=0.0).warmup_for(12) == 0
    assert OptimConfig(warmup_steps=3).warmup_for(12) == 3
    with pytest.raises(DprGcError, match="not both"):
        OptimConfig(warmup_steps=3, warmup_ratio=0.1)
    with pytest.raises(DprGcError, match=r"--warmup-ratio must lie in \[0, 1\)"):
        OptimConfig(warmup_ratio=1.5)


def test_both_flags_are_one_error_line(tmp_path: Path, capsys) -> None:
    code = main(["train", "--train", "x.json", "--output", str(tmp_path / "o"), "--warmup-steps", "0",
                 "--warmup-ratio", "0.1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "--warmup-ratio" in err[0]


def test_the_schedule_warms_up_over_the_ratio(tmp_path: Path, make_retriever, caplog) -> None:
    make_retriever().save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(40, 0))
    config = train_config(model=str(tmp_path / "model"), train_files=[str(data)], batch_size=4, epochs=2,
                          warmup_ratio=0.25, learning_rate=1e-3, num_workers=0, output_dir=str(tmp_path / "out"),
                          cache_dir=str(tmp_path / "cache"), query_chunk_size=4, passage_chunk_size=4)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = Trainer(config)
    assert trainer.total_steps == 20 and "--warmup-ratio 0.25 of 20 steps: 5 warm-up steps" in caplog.text
    rates = []
    for _ in range(7):
        rates.append(trainer.scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.scheduler.step()
    assert rates == pytest.approx([1e-3 * k / 5 for k in (1, 2, 3, 4, 5)] + [1e-3, 1e-3 * 14 / 15])


def test_metrics_record_the_learning_rate_each_step_used(tmp_path: Path, make_retriever) -> None:
    """docs/training.md: ``lr`` in metrics.jsonl (and on the progress bar) is the rate the step ran at, not the next
    step's: without warm-up step 1 runs at the full rate and the last at a sixth of it (it showed 1.667e-05 and 0.0)."""
    import json

    make_retriever().save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(24, 0))
    config = train_config(model=str(tmp_path / "model"), train_files=[str(data)], batch_size=4, max_steps=6,
                          learning_rate=2e-5, num_workers=0, output_dir=str(tmp_path / "out"),
                          cache_dir=str(tmp_path / "cache"), query_chunk_size=4, passage_chunk_size=4)
    Trainer(config).fit()
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["lr"] for line in lines] == pytest.approx([2e-5 * (6 - k) / 6 for k in range(6)])
