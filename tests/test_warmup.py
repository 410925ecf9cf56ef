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


def _trainer(tmp_path: Path, make_retriever, records: int, **settings) -> Trainer:
    make_retriever().save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(records, 0))
    config = train_config(model=str(tmp_path / "model"), train_files=[str(data)], batch_size=4, num_workers=0,
                          output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), query_chunk_size=4,
                          passage_chunk_size=4, **settings)
    return Trainer(config)


def test_a_warm_up_longer_than_the_run_is_a_warning(tmp_path: Path, make_retriever, caplog) -> None:
    """A warm-up as long as the run reaches the full rate at its last step (s / warm-up steps at step s): it was
    warned of as never reaching it ("the last step runs at 5e-05", the full rate); only a longer one is."""
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        _trainer(tmp_path, make_retriever, 24, max_steps=4, warmup_steps=50, learning_rate=1e-3).announce()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "--warmup-steps 50" in r.getMessage()]
    assert len(warned) == 1
    assert "never reaches --learning-rate 0.001 (the last step runs at 8e-05)" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        _trainer(tmp_path / "equal", make_retriever, 24, max_steps=4, warmup_steps=4, learning_rate=1e-3).announce()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING], caplog.text


def test_max_steps_decides_the_length_over_epochs(tmp_path: Path, make_retriever, caplog) -> None:
    """``--max-steps`` trains that many steps whatever ``--epochs`` says (as Hugging Face's Trainer), and says so."""
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = _trainer(tmp_path, make_retriever, 32, epochs=1, max_steps=12)
        trainer.announce()
    assert trainer.steps_per_epoch == 8 and trainer.total_steps == 12
    assert "--max-steps 12: 1.5 epochs of 8 steps each (--max-steps decides the run's length" in caplog.text
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_max_grad_norm_clips_the_gradient_the_optimizer_sees(tmp_path: Path, make_retriever) -> None:
    import torch

    trainer = _trainer(tmp_path, make_retriever, 24, max_steps=1, max_grad_norm=1e-3, learning_rate=1e-3)
    seen = []
    step = trainer.scaler.step
    trainer.scaler.step = lambda optimizer: (seen.append(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in trainer.params if p.grad is not None])).item()),
        step(optimizer))
    _, grad_norm = trainer.train_step(next(iter(trainer.loader)))
    assert float(grad_norm) > 1e-2 and seen == [pytest.approx(1e-3, rel=1e-4)]


def test_the_model_card_records_the_epochs_trained_not_the_epochs_flag(tmp_path: Path, make_retriever) -> None:
    """``--max-steps 5`` over 2 steps an epoch trains 2.5 epochs whatever ``--epochs`` says: the card's epochs (its
    metadata and its table) are those trained, as the log states them."""
    from dpr_gc.model.card import card_training

    trainer = _trainer(tmp_path, make_retriever, 8, epochs=1, max_steps=5)
    assert trainer.steps_per_epoch == 2
    trainer.fit()
    record = card_training(tmp_path / "out" / "final")
    assert record["epochs"] == 2.5 and record["steps"] == 5, record
    assert "| epochs done | 2.5 |" in (tmp_path / "out" / "final" / "README.md").read_text(encoding="utf-8")
