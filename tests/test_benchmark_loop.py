"""The SciFact loop benchmark's own pieces: the dev split, the command runner, reading the toolkit's reports."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from dpr_gc.base.errors import DprGcError
from dpr_gc.base.tables import format_summary
from dpr_gc.evaluation.evaluate import evaluate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import scifact_loop as loop  # noqa: E402


def write_qrels(path: Path, n: int) -> list[str]:
    lines = [f"q{i}\td{i}\t1" for i in range(n)] + [f"q{i}\tx{i}\t1" for i in range(0, n, 3)]
    path.write_text("query-id\tcorpus-id\tscore\n" + "".join(line + "\n" for line in lines))
    return lines


def test_dev_split_is_a_stable_partition_of_the_training_queries(tmp_path):
    lines = write_qrels(tmp_path / "train.tsv", 1000)
    fit, dev = loop.dev_split(tmp_path / "train.tsv", 0.2, seed=0)
    assert sorted(fit + dev) == sorted(lines)
    fit_q, dev_q = {x.split("\t")[0] for x in fit}, {x.split("\t")[0] for x in dev}
    assert not fit_q & dev_q  # a query's judgments all land on one side
    assert 150 < len(dev_q) < 250
    assert loop.dev_split(tmp_path / "train.tsv", 0.2, seed=0) == (fit, dev)
    assert loop.dev_split(tmp_path / "train.tsv", 0.2, seed=1) != (fit, dev)
    _, larger = loop.dev_split(tmp_path / "train.tsv", 0.3, seed=0)
    assert set(dev) <= set(larger)  # a larger fraction only adds queries


def test_reports_of_the_toolkit_are_read_back(tmp_path):
    write_qrels(tmp_path / "qrels.tsv", 3)
    (tmp_path / "run.trec").write_text("q0 Q0 d0 1 2.0 t\nq0 Q0 x0 2 1.0 t\nq1 Q0 z 1 3.0 t\nq1 Q0 d1 2 2.0 t\n")
    metrics = loop.qrels_metrics(evaluate([10, 100], run_path=tmp_path / "run.trec", qrels_path=tmp_path / "qrels.tsv"))
    # q0 finds both its passages first, q1 its one at rank 2, q2 is missing from the run (counts 0)
    assert metrics == {"ndcg@10": round((1 + 1 / math.log2(3)) / 3, 4), "mrr@10": round(1.5 / 3, 4),
                       "recall@100": round(2 / 3, 4)}
    with pytest.raises(DprGcError, match="nDCG@10"):
        loop.qrels_metrics({"k": [10]})
    printed = format_summary({"source": "dense", "dropped by max negative ratio": 9, "mean score": 0.5526})
    assert loop.table_rows(printed) == {"source": "dense", "dropped by max negative ratio": 9, "mean score": 0.5526}


@pytest.mark.slow  # two toolkit subprocesses: ~40 s on the loaded 2-core machine
def test_runner_records_each_command_once_and_stops_on_a_failure(tmp_path, monkeypatch):
    runner = loop.Runner(tmp_path, None)
    record = runner.cli("help", ["--help"], capture=True)
    assert record["command"] == "python -m dpr_gc.cli --help" and "mine" in record["stdout"]
    assert record["wall_s"] > 0 and record["peak_rss_mb"] > 10  # the child's own peak, from os.wait4
    monkeypatch.setattr(loop.Runner, "_run", lambda *a: pytest.fail("ran a finished command again"))
    assert loop.Runner(tmp_path, None).cli("help", ["--help"]) == record
    monkeypatch.undo()
    with pytest.raises(DprGcError, match="mine-bad failed .exit 2."):
        runner.cli("mine-bad", ["mine", "--n-negatives", "0"])
    assert not (tmp_path / "phases" / "mine-bad.json").exists()


def test_bad_loop_settings_give_one_error_line(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scifact_loop.py"), "--output",
                           str(tmp_path / "w"), "--filters", "none", "0"], capture_output=True, text=True, cwd=REPO)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith("error: --filters: '0'")
    assert not (tmp_path / "w").exists()
    for changes, message in (({"mine_source": "splade"}, "--mine-source"), ({"dev_fraction": 1.5}, "--dev-fraction"),
                             ({"round2_init": "last"}, "--round2-init"), ({"filters": ("none", "x")}, "--filters")):
        with pytest.raises(DprGcError, match=message):
            loop.check(loop.LoopSettings(**changes))


class FakeLoop:
    """Stands in for the commands: dev nDCG@10 of round 1 is 0.70 without the filter and 0.72 with ratio 0.95."""

    def __init__(self, refit: bool) -> None:
        self.s = loop.LoopSettings(refit=refit, filters=("none", "0.95"))
        self.run = type("R", (), {"phases": []})()
        self.calls: list[tuple] = []

    def _phase(self, name: str) -> None:
        self.run.phases.append({"name": name, "wall_s": 1.0, "peak_rss_mb": 100.0 + len(self.run.phases)})

    def index(self, tag, model):
        self._phase(f"{tag}-encode")
        return Path(tag) / "index"

    def evaluate(self, tag, model, index, splits=("test", "dev")):
        self._phase(f"{tag}-retrieve")
        dev = 0.72 if "0.95" in tag else 0.70
        return {s: {"ndcg@10": dev if s == "dev" else 0.5, "mrr@10": 0.4, "recall@100": 0.9} for s in splits}

    def mine(self, tag, split, ratio, dense, bm25):
        self.calls.append(("mine", tag, split, ratio, dense[0] if dense else None, bm25))
        self._phase(f"{tag}-mine")
        return Path(tag) / "train.jsonl", {"dense": {"dropped by max negative ratio": 3}}

    def train(self, tag, file, init, hard_negatives=None, batch_size=None):
        self.calls.append(("train", tag, str(file), init))
        self._phase(f"{tag}-train")
        return f"{tag}/final", {"wall_s": 10.0, "peak_rss_mb": 500.0, "steps": 18}


@pytest.mark.parametrize("refit", [True, False])
def test_loop_chooses_the_filter_on_dev_and_mines_round_2_with_the_round_1_model(refit):
    fake = FakeLoop(refit)
    out = loop.run_loop(fake, "base")
    assert out["chosen_filter"] == "0.95" and [s["filter"] for s in out["selection"]] == ["none", "0.95"]
    assert [r["name"] for r in out["rounds"]] == ["round0 zero-shot", "round1", "round2"]
    assert all({"ndcg@10", "mrr@10", "recall@100", "train_s", "peak_rss_mb"} <= set(r) for r in out["rounds"])
    mines = [c for c in fake.calls if c[0] == "mine"]
    assert mines[:2] == [("mine", "select-none-mine", "fit", None, "base", False),
                         ("mine", "select-0.95-mine", "fit", 0.95, "base", False)]
    round1_model = "round1/final" if refit else "select-0.95-round1/final"
    assert mines[-1] == ("mine", "round2-mine", "train" if refit else "fit", 0.95, round1_model, False)
    assert fake.calls[-1] == ("train", "round2", "round2-mine/train.jsonl", "base")  # round 2 starts from the base
    assert out["rounds"][1]["dev_held_out"] is not refit and out["rounds"][2]["dev_held_out"] is not refit
    assert out["rounds"][2]["train_s"] == 10.0 and out["rounds"][2]["phases"][0] == "round2-mine-mine"
