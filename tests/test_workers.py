"""DataLoader workers default to ``auto``: none on the CPU, where forked workers share the step's cores and add to its
memory (benchmarks/README.md, "DataLoader workers"), two on a GPU; the start-up log says so."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from dpr_gc.base.errors import DprGcError
from dpr_gc.cli import build_parser
from dpr_gc.train.config import DataConfig, config_from_args
from dpr_gc.train.trainer import Trainer
from tests.helpers import command_help
from tests.train_data import make_records, train_config, write_dpr


def test_auto_resolves_by_device() -> None:
    assert DataConfig().num_workers == "auto"
    assert (DataConfig().resolve_workers("cpu"), DataConfig().resolve_workers("cuda")) == (0, 2)
    assert DataConfig(num_workers=3).resolve_workers("cpu") == 3
    with pytest.raises(DprGcError, match="--num-workers"):
        DataConfig(num_workers=-1)
    args = build_parser().parse_args(["train", "--train", "x", "--output", "o"])
    assert config_from_args(args).data.num_workers == "auto"
    args = build_parser().parse_args(["train", "--train", "x", "--output", "o", "--num-workers", "1"])
    assert config_from_args(args).data.num_workers == 1


def workers_bullet() -> str:
    """docs/training.md's ``**Workers**`` bullet, up to the next bullet or heading."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    return re.search(r"- \*\*Workers\*\*(.*?)(?=\n- |\n#)", text, re.S).group(1)


def test_the_docs_workers_figures_and_help_are_those_of_the_results_file() -> None:
    """The figures docs/training.md gives for workers on the CPU are benchmarks/results/workers.json's (it gave +39 %
    PSS, a figure of no results file, against the file's 1.02x), with its date and command; and ``--num-workers``'s
    help claims no speed the file contradicts (it said "measured no faster", the file's run with two was faster)."""
    results = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/workers.json").read_text())
    bullet = " ".join(workers_bullet().split())
    assert "benchmarks/results/workers.json" in bullet and results["machine"]["date"][:10] in bullet
    assert "bench_workers.py" in bullet and "+39" not in bullet
    base, two = (next(r for r in results["runs"] if r["workers"] == w) for w in (0, 2))
    for run in (base, two):
        assert f"{run['peak_pss_mib']:,} MiB" in bullet or f"{run['peak_pss_mib']:,} against" in bullet
        assert f"{run['peak_rss_mib']:,}" in bullet
    assert f"{two['pss_vs_baseline']:.2f}×" in bullet
    assert f"{base['examples_per_s']:.2f} against {two['examples_per_s']:.2f} examples/s" in bullet
    help_text = command_help("train", "--num-workers")
    if two["speed_vs_baseline"] > 1:
        assert "no faster" not in help_text and "no faster" not in bullet


def test_cpu_training_starts_no_workers_and_says_so(tmp_path: Path, make_retriever, caplog) -> None:
    make_retriever().save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(16, 0))
    config = train_config(model=str(tmp_path / "model"), train_files=[str(data)], batch_size=4, device="cpu",
                          output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"),
                          query_chunk_size=4, passage_chunk_size=4)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = Trainer(config)
        trainer.announce()
    assert trainer.loader.num_workers == 0
    assert "fp32 on cpu, 0 DataLoader workers (auto)" in caplog.text
    threads = torch.get_num_threads()  # torch's choice (one per core, or OMP_NUM_THREADS) is said too
    assert f"0 DataLoader workers (auto); {threads} CPU thread{'' if threads == 1 else 's'}\n" in caplog.text


def test_the_demo_takes_the_same_default(tmp_path: Path) -> None:
    """docs/training.md: the demo trains with ``--num-workers auto`` too (it fixed 1 worker, against the measured
    default); a demo folder recorded with 1 worker still resumes (workers give the same batches)."""
    from dpr_gc.pipeline import SETTINGS_FILE, DemoConfig, check_demo_settings, demo_training

    data = demo_training().data
    assert data.num_workers == DataConfig().num_workers == "auto"
    assert (data.resolve_workers("cpu"), data.resolve_workers("cuda")) == (0, 2)
    out = tmp_path / "demo"
    check_demo_settings(out, DemoConfig())
    record = json.loads((out / SETTINGS_FILE).read_text())
    record["training"]["data"]["num_workers"] = 1  # as an earlier version recorded it
    (out / SETTINGS_FILE).write_text(json.dumps(record))
    (out / "training" / "checkpoint-4").mkdir(parents=True)  # training holds work: every training setting counts
    (out / "training" / "checkpoint-4" / "train_state.json").write_text("{}")
    check_demo_settings(out, DemoConfig())


@pytest.mark.parametrize("native", [False, True])
def test_train_in_bf16_on_a_cpu_that_emulates_it_warns(tmp_path: Path, make_retriever, caplog, monkeypatch,
                                                       native) -> None:
    """Emulated bf16 runs slower than fp32: the run says so at its start rather than leaving the user to guess."""
    from dpr_gc.base import devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    make_retriever().save(tmp_path / "model")
    data = write_dpr(tmp_path / "train.json", make_records(16, 0))
    config = train_config(model=str(tmp_path / "model"), train_files=[str(data)], batch_size=4, device="cpu",
                          output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), precision="bf16",
                          query_chunk_size=4, passage_chunk_size=4)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        Trainer(config).announce()
    assert ("--precision bf16 on a CPU without native bf16" in caplog.text) != native
