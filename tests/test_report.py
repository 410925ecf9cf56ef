"""report.png marks the k the demo's table reports and has a title; evaluate's default cut-offs fill the @10 column
(Recall/MAP/Accuracy beside nDCG@10 and MRR@10)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dpr_gc.cli import main
from dpr_gc.pipeline import TABLE_KS, format_report, report_figure, write_report

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "data" / "examples"


def fake_report() -> dict:
    answers = {f"Accuracy@{k}": min(1.0, 0.4 + 0.1 * i) for i, k in enumerate((1, 5, 10, 20, 100))}
    qrels = {"nDCG@10": 0.5, "MRR@10": 0.45, "Recall@100": 0.9}
    return {"before": {"answers": answers, "qrels": qrels}, "after": {"answers": answers, "qrels": qrels},
            "training_loss": [[1, 2.0], [2, 1.5]], "dataset": {"test_queries": 398},
            "config": {"training": {"data": {"batch_size": 64}, "cache": {"passage_chunk_size": 16}}},
            "outputs": {"metrics": "metrics.json", "plot": "report.png"}}


def test_report_ticks_are_the_tables_k_and_it_has_a_title() -> None:
    import matplotlib.pyplot as plt

    report = fake_report()
    fig = report_figure(report)
    try:
        right = fig.axes[1]
        assert [int(t) for t in right.get_xticks()] == list(TABLE_KS)
        assert [t.get_text() for t in right.get_xticklabels()] == [str(k) for k in TABLE_KS]
        assert "398 held-out questions" in fig._suptitle.get_text()
        assert "batch 64, chunk 16" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
    table = format_report(report)
    assert [f"Accuracy@{k}" for k in TABLE_KS] == [line.split("|")[1].strip() for line in table.splitlines()
                                                   if "Accuracy@" in line]


def test_the_demo_table_gives_every_metric_before_then_after_training() -> None:
    """The demo's table: Accuracy@k at the k of TABLE_KS, then nDCG@10, MRR@10 and Recall@100 from the qrels, each
    with its value before training in the first column and after training in the second."""
    report = fake_report()
    report["after"] = {"answers": {f"Accuracy@{k}": 0.05 * i for i, k in enumerate((1, 5, 10, 20, 100))},
                       "qrels": {"nDCG@10": 0.25, "MRR@10": 0.2, "Recall@100": 0.75}}
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in format_report(report).splitlines()[2:]]
    assert rows == [["Accuracy@1", "0.4000", "0.0000"], ["Accuracy@5", "0.5000", "0.0500"],
                    ["Accuracy@20", "0.7000", "0.1500"], ["Accuracy@100", "0.8000", "0.2000"],
                    ["nDCG@10", "0.5000", "0.2500"], ["MRR@10", "0.4500", "0.2000"],
                    ["Recall@100", "0.9000", "0.7500"]], rows


def test_demo_metrics_and_report_are_replaced_together(tmp_path, monkeypatch) -> None:
    """The demo's metrics.json and report.png are one output: a failure at any of the renames that replace them (a
    kill between the two writes, simulated by os.replace raising) leaves the earlier pair byte-identical and no
    temporary; the JSON is put in last and records the plot's SHA-256."""
    import os

    write_report(fake_report(), tmp_path)
    metrics, plot = tmp_path / "metrics.json", tmp_path / "report.png"
    before = metrics.read_bytes(), plot.read_bytes()
    newer = {**fake_report(), "training_loss": [[1, 3.0], [2, 0.5]], "seconds": 12.0}
    real_replace = os.replace
    for fail_at in range(1, 5):
        calls = []

        def replace(src, dst, fail_at=fail_at, calls=calls):
            calls.append(Path(dst).name)
            if len(calls) == fail_at:
                raise OSError(f"simulated failure at rename {fail_at}")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(OSError, match="simulated"):
            write_report(newer, tmp_path)
        monkeypatch.setattr(os, "replace", real_replace)
        assert (metrics.read_bytes(), plot.read_bytes()) == before, f"failure at rename {fail_at}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "report.png"]
    renamed = []
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(Path(dst).name), real_replace(src, dst)))
    write_report(newer, tmp_path)
    assert renamed[-1] == "metrics.json" and json.loads(metrics.read_text())["seconds"] == 12.0
    assert plot.read_bytes() != before[1]
    # the JSON records the plot beside it, as evaluate's does: provably its own
    assert json.loads(metrics.read_text())["plot"] == {"file": str(plot),
                                                       "sha256": hashlib.sha256(plot.read_bytes()).hexdigest()}


def test_metric_table_titles_take_the_singular_for_one(capsys) -> None:
    """evaluate's table titles count with :func:`~dpr_gc.base.logs.counted`: "1 judged query", not "1 judged
    queries"."""
    code = main(["evaluate", "--results", str(EXAMPLES / "results.json"), "--run", str(EXAMPLES / "run.trec"),
                 "--qrels", str(EXAMPLES / "beir" / "qrels" / "test.tsv")])
    out = capsys.readouterr().out
    assert code == 0 and "qrels metrics (1 judged query)" in out and "answer accuracy (2 questions, match=" in out, out


def test_evaluate_default_k_fills_the_at_10_column(capsys) -> None:
    code = main(["evaluate", "--results", str(EXAMPLES / "results.json"), "--run", str(EXAMPLES / "run.trec"),
                 "--qrels", str(EXAMPLES / "beir" / "qrels" / "test.tsv")])
    out = capsys.readouterr().out
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("| metric"))
    assert [c.strip() for c in header.split("|")][2:-1] == ["@1", "@5", "@10", "@20", "@100"]  # the default k
    column = [c.strip() for c in header.split("|")].index("@10")
    rows = [line for line in out.splitlines() if line.split("|")[1:2] and line.split("|")[1].strip() in
            ("Accuracy", "Recall", "MAP", "nDCG")]
    assert len(rows) == 5  # answers' Accuracy; qrels' Recall, nDCG, MAP, Accuracy
    assert all([c.strip() for c in line.split("|")][column] for line in rows), out


def test_a_finished_runs_summary_reads_what_metrics_jsonl_recorded(tmp_path: Path) -> None:
    """A finished run resumed trains nothing: its table takes the loss and last dev value from metrics.jsonl and
    shows no speed ('-', not 0.00) and no loss where none was recorded ('-', not nan)."""
    from dpr_gc.train.report import recorded_dev, recorded_lines, recorded_loss, summary_table

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "dev_accuracy": 0.25}\n{"step": 1, "loss": 0.7, "dev_accuracy": 0.5}\nnot json\n'
                       '{"step": 2, "loss": 0.6}\n')
    records = recorded_lines(metrics)
    assert recorded_loss(records, 2) == 0.6 and recorded_dev(records, "accuracy") == {"step": 1, "loss": 0.7,
                                                                                      "dev_accuracy": 0.5}
    assert recorded_dev(records, "loss") is None and recorded_dev(recorded_lines(tmp_path / "none"), "accuracy") is None
    summary = {"steps": 2, "resumed_from": 2, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": None,
               "precision": "fp32", "final_loss": recorded_loss(records, 2), "seconds": 1.5, "examples_per_s": 0.0,
               "final_model": "o/final", "best_model": None, "best": None, "best_metric": "accuracy",
               "dev": "dev.json", "last_dev": recorded_dev(records, "accuracy")}
    table = summary_table(summary)
    assert all(row in table for row in ("| steps | 2 (0 this run, resumed from step 2) |", "| final loss | 0.6000 |",
                                        "| examples/s | - |", "| last dev | accuracy 0.5000 (step 1) |")), table
    assert "| final loss | - |" in summary_table({**summary, "final_loss": recorded_loss(records, 3)})


def test_the_training_summary_names_the_best_dev_metric_or_says_there_was_no_dev_set() -> None:
    """train's summary table: the best dev value with its metric and folder (a bare 4.25 did not say which metric
    or whether lower is better), or that no --dev was given (it printed None)."""
    from dpr_gc.train.report import summary_table

    summary = {"steps": 2, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": [4, 8],
               "precision": "fp32", "final_loss": 0.5, "seconds": 3.0, "examples_per_s": 5.0,
               "final_model": "runs/r1/final", "best_model": None, "best": None, "best_metric": "avg_rank"}
    assert "| best dev | none (no --dev) |" in summary_table(summary)
    summary.update(best=4.25, best_model="runs/r1/best")
    assert "| best dev | avg_rank 4.2500 (lower is better) in runs/r1/best |" in summary_table(summary)
    summary.update(best=0.625, best_metric="accuracy")
    assert "| best dev | accuracy 0.6250 (higher is better) in runs/r1/best |" in summary_table(summary)
    summary.update(best_step=0)  # no step beat the starting model's dev score (tests/test_train_defaults.py)
    assert ("| best dev | accuracy 0.6250 (higher is better) in runs/r1/best: the starting model, no step beat it |"
            in summary_table(summary))
    summary.update(best_step=12)
    assert "| best dev | accuracy 0.6250 (higher is better) in runs/r1/best (step 12) |" in summary_table(summary)
    assert "last dev" not in summary_table(summary)  # no --dev: the best row says so
    summary.update(dev="dev.json")
    assert "| last dev | - |" in summary_table(summary)  # no evaluation after a step in this run
    summary.update(last_dev={"step": 16, "dev_loss": 0.7, "dev_accuracy": 0.5, "dev_avg_rank": 1.2})
    assert "| last dev | accuracy 0.5000 (step 16) |" in summary_table(summary)


def test_a_resumed_run_that_trained_steps_shows_its_speed_and_a_finished_one_its_last_dev_after_a_step() -> None:
    """examples/s is '-' only where this invocation trained no step; a run resumed at step 2 that trained to step 5
    shows its own rate. The last dev value a finished run's table reads from metrics.jsonl is one after a step:
    the dev evaluation before training (step 0) is not one."""
    from dpr_gc.train.report import recorded_dev, summary_table

    summary = {"steps": 5, "resumed_from": 2, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": None,
               "precision": "fp32", "final_loss": 0.5, "seconds": 1.5, "examples_per_s": 16.0,
               "final_model": "o/final", "best_model": None, "best": None, "best_metric": "accuracy"}
    assert "| examples/s | 16.00 |" in summary_table(summary)
    assert recorded_dev([{"step": 0, "dev_accuracy": 0.25}], "accuracy") is None


@pytest.mark.parametrize("skipped, row", [(0, "| skipped steps | 0 of 4 |"),
                                          (1, "| skipped steps | 1 of 4 (inf/NaN gradients: the weights stayed as "
                                              "they were) |")], ids=["none", "one"])
def test_an_fp16_runs_summary_always_counts_its_skipped_steps(skipped, row) -> None:
    """Under fp16 the table says how many steps the GradScaler skipped, none included (a reader of an fp16 run
    otherwise cannot tell 'none' from 'not counted'); outside fp16 the row shows only where there were any."""
    from dpr_gc.train.report import summary_table

    summary = {"steps": 4, "effective_batch": 8, "passages_per_query": 2, "chunk_sizes": None, "precision": "fp16",
               "final_loss": 0.5, "seconds": 1.5, "examples_per_s": 16.0, "final_model": "o/final",
               "best_model": None, "best": None, "best_metric": "accuracy", "skipped_steps": skipped}
    assert row in summary_table(summary)
    assert ("skipped steps" in summary_table({**summary, "precision": "bf16"})) == bool(skipped)



def test_the_epoch_line_and_the_model_card_count_every_ranks_batch() -> None:
    """Under torchrun each step takes --batch-size queries on every rank: the epoch's log line counts the examples
    its steps use and leave out by the global batch (8 x 2 ranks), and the model card's batch_size is that global
    batch beside the per-rank one."""
    from types import SimpleNamespace

    from dpr_gc.data.sampling import MixedBatchSampler
    from dpr_gc.train.config import DataConfig, ModelConfig, RunConfig, TrainConfig
    from dpr_gc.train.report import describe_epoch, describe_training

    sampler = MixedBatchSampler([100], batch_size=8, rank=1, world_size=2)
    data = SimpleNamespace(stats=[{"source": "train.json", "records": 100, "kept": 100}], sizes=[100],
                           source_format=lambda i: "dpr")
    assert describe_epoch(data, sampler, "pairs").startswith(
        "an epoch: train.json: 100 questions; 6 steps of 16 use 96 of the 100 examples, 4 left out (")
    config = TrainConfig(model=ModelConfig(name="m"), data=DataConfig(train_files=["train.json"], batch_size=8),
                         run=RunConfig(output_dir="o"))
    card = describe_training(config, data.stats, 2, (4, 4), 6)
    assert (card["batch_size"], card["batch_size_per_rank"], card["world_size"]) == (16, 8, 2), card
