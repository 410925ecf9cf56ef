"""The SciFact loop benchmark's own pieces: the dev split, the command runner, reading the toolkit's reports."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import types
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
    printed = format_summary({"source": "dense", "dropped by max negative ratio": 9, "mean score": 0.5526}, 1.0)
    assert loop.table_rows(printed) == {"source": "dense", "dropped by max negative ratio": 9, "mean score": 0.5526,
                                        "time": "1.00 s"}


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
                             ({"round2": ("base:round0",)}, "--round2: 'base:round0'"),
                             ({"round2": ("base:union:0.9:1",)}, "--round2: 'base:union:0.9:1'"),
                             ({"round2": ("base:union:-1",)}, "FILTER must be none or a ratio"),
                             ({"round2": ("base:union", "base:union")}, "--round2 needs one or more different"),
                             ({"filters": ("none", "x")}, "--filters"),
                             ({"train_seeds": (1, 0)}, "--train-seeds needs different seeds other than --seed 0"),
                             ({"train_seeds": (2, 2)}, "--train-seeds needs different seeds"),
                             ({"train_seeds": (1,), "refit": False}, "cannot go with --no-refit")):
        with pytest.raises(DprGcError, match=message):
            loop.check(loop.LoopSettings(**changes))


class FakeLoop:
    """Stands in for the commands: dev nDCG@10 is 0.70 for a model, 0.72 for round 1 mined with ratio 0.95 and
    0.80 for the round-2 recipe base:union; a mined file holds 2 queries with 3 negatives (6 when appended)."""

    def __init__(self, work: Path, refit: bool, parallel: int = 1, **settings) -> None:
        self.s = loop.LoopSettings(refit=refit, **{"filters": ("none", "0.95"), **settings})
        self.run, self.work = loop.Runner(work, None, parallel), work
        self.calls: list[tuple] = []

    def _phase(self, name: str) -> None:
        self.run.phases.append({"name": name, "wall_s": 1.0, "peak_rss_mb": 100.0 + len(name)})

    def index(self, tag, model):
        self._phase(f"{tag}-encode")
        return Path(tag) / "index"

    def evaluate(self, tag, model, index, splits=("test", "dev")):
        self._phase(f"{tag}-retrieve")
        dev = 0.80 if tag.startswith("cand-base-union") else 0.72 if "0.95" in tag else 0.70
        return {s: {"ndcg@10": dev if s == "dev" else 0.5, "mrr@10": 0.4, "recall@100": 0.9} for s in splits}

    def mine(self, tag, split, ratio, dense, bm25, append_to=None):
        self.calls.append(("mine", tag, split, ratio, dense[0] if dense else None, bm25,
                           append_to and str(append_to.relative_to(self.work))))
        self._phase(f"{tag}-mine-dense")
        path = self.work / tag / "train.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"hard_negative_ctxs": [{}] * (6 if append_to else 3)}) + "\n"
        path.write_text(line * 2)
        return path, {"dense": {"dropped by max negative ratio": 3}}

    def train(self, tag, file, init, hard_negatives=None, batch_size=None, mask=True, seed=None):
        seeded = (seed,) if seed is not None else ()
        self.calls.append(("train", tag, str(Path(file).relative_to(self.work)), init) + seeded)
        self._phase(f"{tag}-train")
        return f"{tag}/final", {"wall_s": 10.0, "peak_rss_mb": 500.0, "steps": 18}


@pytest.mark.parametrize("refit", [True, False])
def test_loop_chooses_the_filter_and_the_round2_recipe_on_dev(tmp_path, refit):
    fake = FakeLoop(tmp_path, refit)
    out = loop.run_loop(fake, "base")
    assert out["chosen_filter"] == "0.95" and [s["filter"] for s in out["selection"]] == ["none", "0.95"]
    assert out["chosen_round2"] == "base:union"
    assert [(c["candidate"], c["dev"]["ndcg@10"], c["negatives_per_query"]) for c in out["round2_selection"]] == [
        ("base:round1", 0.70, 3.0), ("round1:round1", 0.70, 3.0), ("base:union", 0.80, 6.0)]
    assert [r["name"] for r in out["rounds"]] == ["round0 zero-shot", "round1", "round2"]
    assert all({"ndcg@10", "mrr@10", "recall@100", "train_s", "peak_rss_mb"} <= set(r) for r in out["rounds"])
    mines = [c[1:] for c in fake.calls if c[0] == "mine"]
    fit_round1 = "select-0.95-round1/final"
    assert mines[:4] == [("select-none-mine", "fit", None, "base", False, None),
                         ("select-0.95-mine", "fit", 0.95, "base", False, None),
                         ("cand-mine-round1", "fit", 0.95, fit_round1, False, None),
                         ("cand-mine-union", "fit", 0.95, fit_round1, False, "select-0.95-mine/train.jsonl")]
    trains = [c[1:] for c in fake.calls if c[0] == "train"]
    assert trains[2:5] == [("cand-base-round1", "cand-mine-round1/train.jsonl", "base"),
                           ("cand-round1-round1", "cand-mine-round1/train.jsonl", fit_round1),
                           ("cand-base-union", "cand-mine-union/train.jsonl", "base")]
    if refit:  # round 1 again on all queries; round 2's union adds to round 1's own round-0 file
        assert mines[4:] == [("round1-mine", "train", 0.95, "base", False, None),
                             ("round2-mine-union", "train", 0.95, "round1/final", False, "round1-mine/train.jsonl")]
        assert trains[5:] == [("round1", "round1-mine/train.jsonl", "base"),
                              ("round2", "round2-mine-union/train.jsonl", "base")]
        assert out["rounds"][2]["recipe"] == "base:union"
        assert out["rounds"][2]["phases"][0] == "round2-mine-union-mine-dense"
    else:  # rounds 1 and 2 are the chosen options as trained on fit
        assert len(mines) == 4 and len(trains) == 5
        assert out["rounds"][2]["dev"]["ndcg@10"] == 0.80 and out["rounds"][2]["trained_on"] == "fit"
    assert out["rounds"][1]["dev_held_out"] is not refit and out["rounds"][2]["dev_held_out"] is not refit
    assert out["rounds"][2]["train_s"] == 10.0


def test_the_loop_in_parallel_gives_the_sequential_results(tmp_path):
    sequential = loop.run_loop(FakeLoop(tmp_path / "a", True), "base")
    parallel = loop.run_loop(FakeLoop(tmp_path / "b", True, parallel=3), "base")
    for out in (sequential, parallel):  # the files' places differ by work folder
        for option in out["selection"] + out["round2_selection"]:
            option.pop("file")
    assert parallel == sequential


def test_single_choices_train_nothing_on_fit(tmp_path):
    fake = FakeLoop(tmp_path, True, filters=("none",), round2=("round1:union",))
    out = loop.run_loop(fake, "base")
    assert out["selection"] == [] and out["round2_selection"] == [] and out["chosen_round2"] == "round1:union"
    assert [c[1] for c in fake.calls] == ["round1-mine", "round1", "round2-mine-union", "round2"]
    assert fake.calls[-1] == ("train", "round2", "round2-mine-union/train.jsonl", "round1/final")
    fake = FakeLoop(tmp_path / "two-recipes", True, filters=("0.9",), round2=("round1:round1", "base:union"))
    out = loop.run_loop(fake, "base")  # one filter: its fit round 1 is trained for the recipes and scored beside them
    assert [o["filter"] for o in out["selection"]] == ["0.9"] and out["selection"][0]["dev"]["ndcg@10"] == 0.70
    assert out["chosen_filter"] == "0.9" and len(out["round2_selection"]) == 2
    assert "select-0.9-round1-retrieve" in [p["name"] for p in fake.run.phases]


def test_a_round2_recipe_may_name_its_own_mining_filter(tmp_path):
    fake = FakeLoop(tmp_path, True, filters=("none",),
                    round2=("round1:round1", "round1:round1:0.95", "round1:union:none"))
    out = loop.run_loop(fake, "base")
    assert [(c["candidate"], c["filter"], c["dev"]["ndcg@10"]) for c in out["round2_selection"]] == [
        ("round1:round1", "none", 0.70), ("round1:round1:0.95", "0.95", 0.72), ("round1:union:none", "none", 0.70)]
    assert out["chosen_round2"] == "round1:round1:0.95"
    mines = [c[1:4] for c in fake.calls if c[0] == "mine"]
    assert mines == [("select-none-mine", "fit", None), ("cand-mine-round1", "fit", None),
                     ("cand-mine-round1-0.95", "fit", 0.95), ("cand-mine-union", "fit", None),
                     ("round1-mine", "train", None), ("round2-mine-round1", "train", 0.95)]
    trains = [c[1:] for c in fake.calls if c[0] == "train"]
    assert ("cand-round1-round1-0.95", "cand-mine-round1-0.95/train.jsonl", "select-none-round1/final") in trains
    assert trains[-1] == ("round2", "round2-mine-round1/train.jsonl", "round1/final")
    assert out["rounds"][2]["filter"] == "0.95" and out["rounds"][1]["filter"] == "none"
    assert out["round2_selection"][1]["phases"] == ["cand-mine-round1-0.95-mine-dense",
                                                    "cand-round1-round1-0.95-train", "cand-round1-round1-0.95-encode",
                                                    "cand-round1-round1-0.95-retrieve"]


class SeededFakeLoop(FakeLoop):
    """FakeLoop whose test nDCG@10 is 0.79 for round 1 and 0.80 for round 2, plus 0.01 per training seed."""

    def evaluate(self, tag, model, index, splits=("test", "dev")):
        scores = super().evaluate(tag, model, index, splits)
        seed = int(tag[4:tag.index("-")]) if tag.startswith("seed") else 0
        if tag.endswith(("round1", "round2")) and "test" in scores:
            scores["test"]["ndcg@10"] = round((0.79 if tag.endswith("round1") else 0.80) + 0.01 * seed, 4)
        return scores


def test_train_seeds_repeat_the_refit_rounds_and_give_their_spread(tmp_path):
    fake = SeededFakeLoop(tmp_path, True, filters=("none",), round2=("round1:round1:0.95",), train_seeds=(1, 3))
    out = loop.run_loop(fake, "base")
    trains = [c[1:] for c in fake.calls if c[0] == "train"]
    assert trains == [("round1", "round1-mine/train.jsonl", "base"),
                      ("round2", "round2-mine-round1/train.jsonl", "round1/final"),
                      ("seed1-round1", "round1-mine/train.jsonl", "base", 1),  # round 1's negatives, not mined again
                      ("seed1-round2", "seed1-round2-mine-round1/train.jsonl", "seed1-round1/final", 1),
                      ("seed3-round1", "round1-mine/train.jsonl", "base", 3),
                      ("seed3-round2", "seed3-round2-mine-round1/train.jsonl", "seed3-round1/final", 3)]
    mines = [c[1:5] for c in fake.calls if c[0] == "mine"]
    assert mines[2:] == [("seed1-round2-mine-round1", "train", 0.95, "seed1-round1/final"),
                         ("seed3-round2-mine-round1", "train", 0.95, "seed3-round1/final")]
    assert [(r["seed"], [(e["name"], e["seed"], e["ndcg@10"]) for e in r["rounds"]]) for r in out["replicates"]] == [
        (1, [("round1", 1, 0.80), ("round2", 1, 0.81)]), (3, [("round1", 3, 0.82), ("round2", 3, 0.83)])]
    assert out["replicates"][0]["rounds"][1]["phases"][0] == "seed1-round2-mine-round1-mine-dense"
    spread = out["seed_spread"]
    assert spread["seeds"] == [0, 1, 3] and spread["round1"]["ndcg@10"] == [0.79, 0.80, 0.82]
    assert spread["round2"]["mean"] == pytest.approx(0.8133, abs=1e-4) and spread["round2"]["at_least_0.80"] == 3
    assert spread["round1"]["sd"] == pytest.approx(0.0153, abs=1e-4) and spread["round1"]["at_least_0.80"] == 2
    assert spread["round2_minus_round1"] == {"per_seed": [0.01, 0.01, 0.01], "mean": 0.01, "sd": 0.0, "positive": 3}


def sleeper(runner: "loop.Runner") -> "loop.Runner":
    """The runner with a stand-in command: ``python -c`` sleeping ARG seconds, then exiting with ARG2 (or 0)."""
    runner.program = [sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); "
                                            "sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)"]
    return runner


def test_runner_runs_n_commands_at_once_in_order(tmp_path):
    runner = sleeper(loop.Runner(tmp_path, None, parallel=2))
    began = time.perf_counter()
    records = runner.map(lambda i: runner.cli(f"job{i}", [0.3 * (4 - i)]), range(4))
    assert [r["name"] for r in records] == ["job0", "job1", "job2", "job3"]  # the order of the items
    assert max(r["concurrent"] for r in records) == 2 and time.perf_counter() - began < 0.3 * 10
    assert runner.env()["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2)) or "OMP_NUM_THREADS" in os.environ
    assert loop.concurrency(runner)["parallel"] == 2


def test_a_failed_command_stops_the_others(tmp_path):
    runner = sleeper(loop.Runner(tmp_path, None, parallel=2))

    def late() -> None:  # asks for its command only after the failure
        deadline = time.perf_counter() + 60
        while not runner._stopped and time.perf_counter() < deadline:
            time.sleep(0.05)
        runner.cli("late", [0])

    began = time.perf_counter()
    with pytest.raises(DprGcError, match=r"quick failed \(exit 3\)"):
        runner.all(lambda: runner.cli("slow", [30]), lambda: runner.cli("quick", [0, 3]), late)
    assert time.perf_counter() - began < 20  # the slow one was terminated, not waited for
    assert not (tmp_path / "phases" / "slow.json").exists() and not (tmp_path / "phases" / "late.json").exists()


# ------------------------------------------------------------------ the scripts end to end, on a stand-in toolkit
def tiny_beir(folder: Path) -> Path:
    """A BEIR folder --quick can cut from: 60 training and 25 test queries with one positive each, 120 passages."""
    import gzip

    (folder / "qrels").mkdir(parents=True)
    with gzip.open(folder / "corpus.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i}"}) + "\n" for i in range(120))
    ids = [f"q{i}" for i in range(60)] + [f"t{i}" for i in range(25)]
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": f"claim {q}"}) + "\n" for q in ids))
    for split, names in (("train", ids[:60]), ("test", ids[60:])):
        (folder / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\td{i}\t1\n" for i, q in enumerate(names)))
    return folder


class StandInToolkit:
    """``Runner._run`` without the toolkit: each command line is parsed by the real ``dpr-gc`` parser (a wrong flag
    fails the test) and the outputs the scripts read are written: metrics, mined files, metrics.jsonl."""

    def __init__(self, parser) -> None:
        self.parser, self.commands = parser, []

    def __call__(self, runner, name: str, args: list[str], capture: bool) -> dict:
        try:
            self.parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{name}: the toolkit refuses {args}")
        self.commands.append(args)
        value = {flag: args[i + 1] for i, flag in enumerate(args[:-1]) if flag.startswith("--")}
        out = getattr(self, args[0], lambda v, a: "")(value, args)
        return {"name": name, "command": "python -m dpr_gc.cli " + " ".join(args), "wall_s": 0.1,
                "peak_rss_mb": 50.0, "concurrent": 1, "stdout": out if capture else None}

    @staticmethod
    def evaluate(value: dict, args: list) -> str:
        score = 0.6 + 0.01 * (len(value["--output"]) % 7)  # differs between models, so choices are made
        Path(value["--output"]).parent.mkdir(parents=True, exist_ok=True)
        Path(value["--output"]).write_text(json.dumps({"qrels": {"nDCG@10": score, "MRR@10": 0.5,
                                                                 "Recall@100": 0.9}}))
        return ""

    @staticmethod
    def mine(value: dict, args: list) -> str:
        if "--train-file" in value:
            records = [json.loads(line) for line in Path(value["--train-file"]).read_text().splitlines()]
        else:
            qrels = Path(value["--beir-dir"]) / "qrels" / f"{value['--beir-split']}.tsv"
            records = [{"question": line.split("\t")[0], "hard_negative_ctxs": []}
                       for line in qrels.read_text().splitlines()[1:]]
        for r in records:
            r["hard_negative_ctxs"] += [{"passage_id": f"n{len(r['hard_negative_ctxs']) + k}"} for k in range(3)]
        Path(value["--output"]).parent.mkdir(parents=True, exist_ok=True)
        Path(value["--output"]).write_text("".join(json.dumps(r) + "\n" for r in records))
        return format_summary({"source": "dense", "dropped by max negative ratio": 1}, 1.0)

    @staticmethod
    def train(value: dict, args: list) -> str:
        out = Path(value["--output"])
        out.mkdir(parents=True, exist_ok=True)
        masked = 0 if "--no-mask-duplicate-positives" in args else 2
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "masked_scores": masked}) + "\n")
        return ""


@pytest.fixture(scope="module")
def toolkit_parser():
    from dpr_gc.cli import build_parser

    return build_parser()


@pytest.fixture
def stand_in(toolkit_parser) -> StandInToolkit:
    return StandInToolkit(toolkit_parser)


def test_the_loop_script_runs_end_to_end_on_a_stand_in_toolkit(tmp_path, monkeypatch, stand_in, capsys):
    monkeypatch.setattr(loop.Runner, "_run", lambda runner, *a: stand_in(runner, *a))
    results = tmp_path / "loop.json"
    assert loop.main(["--quick", "--data", str(tiny_beir(tmp_path / "beir")), "--output", str(tmp_path / "w"),
                      "--results", str(results), "--parallel", "3", "--model", "MODEL", "--filters", "none", "0.95",
                      "--round2", "base:round1", "round1:round1", "base:union"]) == 0
    report = json.loads(results.read_text())
    assert [r["name"] for r in report["rounds"]] == ["round0 zero-shot", "round1", "round2"]
    assert [c["candidate"] for c in report["round2_selection"]] == ["base:round1", "round1:round1", "base:union"]
    assert report["chosen_round2"] in report["settings"]["round2"] and report["rounds"][2]["recipe"] == \
        report["chosen_round2"]
    assert report["round2_selection"][2]["negatives_per_query"] == 6.0  # round 0's 3 and round 1's 3
    assert report["concurrency"]["parallel"] == 3 and report["dev_split"]["test_queries"] == 20 and report["complete"]
    assert [s["filter"] for s in report["selection"]] == ["none", "0.95"]
    retrieves = [c for c in stand_in.commands if c[0] == "retrieve"]
    assert retrieves and all(c[c.index("--qrels") + 1].endswith("test+dev.tsv") for c in retrieves)
    assert "round2" in capsys.readouterr().out
    ran = len(stand_in.commands)  # seeds added to the finished run: only the replicates' commands run
    assert loop.main(["--quick", "--data", str(tmp_path / "beir"), "--output", str(tmp_path / "w"), "--results",
                      str(results), "--parallel", "3", "--model", "MODEL", "--filters", "none", "0.95",
                      "--round2", "base:round1", "round1:round1", "base:union", "--train-seeds", "4"]) == 0
    added = stand_in.commands[ran:]
    assert [c[0] for c in added] == ["train", "encode", "index", "retrieve", "evaluate", "evaluate", "mine", "train",
                                     "encode", "index", "retrieve", "evaluate", "evaluate"]
    assert all(c[c.index("--seed") + 1] == "4" for c in added if c[0] == "train")
    report = json.loads(results.read_text())
    assert report["seed_spread"]["seeds"] == [0, 4] and report["replicates"][0]["rounds"][1]["seed"] == 4
    assert "round2 nDCG@10 over seeds [0, 4]" in capsys.readouterr().out


def test_the_grid_script_runs_the_masking_pair_on_a_stand_in_toolkit(tmp_path, monkeypatch, stand_in):
    import scifact_grid as grid

    monkeypatch.setattr(loop.Runner, "_run", lambda runner, *a: stand_in(runner, *a))
    results = tmp_path / "grid.json"
    assert grid.main(["--quick", "--data", str(tiny_beir(tmp_path / "beir")), "--output", str(tmp_path / "w"),
                      "--results", str(results), "--parallel", "2", "--batches", "16", "--negatives", "1",
                      "--masking", "on", "off", "--model", "MODEL"]) == 0
    report = json.loads(results.read_text())
    assert report["complete"] and [(c["masking"], c["masked_scores"]) for c in report["cells"]] == [("on", 2),
                                                                                                 ("off", 0)]
    assert report["masking_effect"][0]["batch_size"] == 16 and "masking off" in report["table_ndcg@10"]
    trains = {c[c.index("--output") + 1]: "--no-mask-duplicate-positives" in c for c in stand_in.commands
              if c[0] == "train"}
    assert trains == {str(tmp_path / "w" / "b16-h1" / "model"): False,
                      str(tmp_path / "w" / "b16-h1-nomask" / "model"): True}


def test_a_grid_cut_short_leaves_its_finished_cells(tmp_path, monkeypatch, stand_in):
    """With --parallel 2, a cell runs to its end before the third one starts: when the k-th training begins, the
    results file holds at least k - 2 cells (every cell started before it but the one that may run beside it)."""
    import scifact_grid as grid

    results, saved_at_train = tmp_path / "grid.json", []

    def run(runner, name: str, args: list[str], capture: bool) -> dict:
        if args[0] == "train":
            saved_at_train.append(len(json.loads(results.read_text())["cells"]) if results.is_file() else 0)
            time.sleep(0.2)  # every cell asks for its training at once unless the grid holds the later ones back
        return stand_in(runner, name, args, capture)

    monkeypatch.setattr(loop.Runner, "_run", run)
    assert grid.main(["--quick", "--data", str(tiny_beir(tmp_path / "beir")), "--output", str(tmp_path / "w"),
                      "--results", str(results), "--parallel", "2", "--batches", "8", "16", "--negatives", "0", "1",
                      "--masking", "on", "--model", "MODEL"]) == 0
    assert len(json.loads(results.read_text())["cells"]) == 4
    assert all(saved >= k - 2 for k, saved in enumerate(sorted(saved_at_train), start=1)), saved_at_train


def test_a_report_holds_its_head_its_body_and_every_phase(tmp_path: Path) -> None:
    """Both SciFact benchmarks write their results through one writer: title, settings and machine first, then the
    benchmark's own fields, then each phase's command and the wall times."""
    runner = loop.Runner(tmp_path / "work", None)
    runner.cli("help", ["--help"])
    args = argparse.Namespace(quick=True, device=None)
    head = loop.ReportHead("SciFact test", args, types.SimpleNamespace(run=runner), {"epochs": 1}, "model", 0.0)
    report = loop.write_report(tmp_path / "results.json", head, {"rounds": []}, complete=True)
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(report))
    assert report["benchmark"].startswith("SciFact test -- SMOKE RUN") and report["complete"] is True
    assert report["settings"] == {"epochs": 1} and report["rounds"] == []
    assert report["commands"] == [runner.phases[0]["command"]] and report["wall_s_all_phases"] >= 0
    keys = list(report)
    assert keys.index("concurrency") < keys.index("rounds") < keys.index("phases")


@pytest.mark.parametrize("quick", [True, False])
def test_a_smoke_run_writes_its_results_into_its_work_folder(tmp_path: Path, quick: bool) -> None:
    """--quick without --results writes WORK/results.json, never a committed file under benchmarks/results (the
    README cites scifact-loop-quick.json), and so does a run with other settings than the committed one (a run with
    --epochs 1 wrote over the committed scifact-loop.json); a run with the committed settings defaults to
    benchmarks/results/NAME.json; --results wins."""
    import dataclasses

    @dataclasses.dataclass
    class Settings:
        batch: int = 8

    args = argparse.Namespace(quick=quick, output=str(tmp_path / "w"), results=None, model="MODEL",
                              data=str(tmp_path))
    work, results, _ = loop.open_work(args, "scifact-loop", Settings(), Settings())
    assert work == tmp_path / "w"
    assert results == (work / "results.json" if quick else REPO / "benchmarks" / "results" / "scifact-loop.json")
    args.output = str(tmp_path / "w4")  # a work folder holds one run's settings
    assert loop.open_work(args, "scifact-loop", Settings(batch=4), Settings())[1] == tmp_path / "w4" / "results.json"
    args.results = str(tmp_path / "r.json")
    assert loop.open_work(args, "scifact-loop", Settings(batch=4), Settings())[1] == tmp_path / "r.json"


@pytest.mark.parametrize("script, command", [
    ("scifact_loop", ["--filters", "none", "--round2", "round1:round1", "round1:union", "round1:round1:0.95",
                      "round1:union:0.95"]),
    ("scifact_grid", [])])
def test_the_committed_settings_are_those_of_the_committed_files_command(script: str, command: list[str]) -> None:
    """The settings a script writes benchmarks/results with are those its README command for the committed file
    (scifact-loop.json, scifact-grid-cpu.json) gives, read as the script reads them; --epochs 1 is another run."""
    import importlib

    module = importlib.import_module(script)
    settings_class = loop.LoopSettings if script == "scifact_loop" else module.GridSettings
    p = loop.common_parser("x", script)
    loop.add_settings_flags(p, settings_class, skip=getattr(module, "GRID_ONLY", ()))
    assert loop.settings_from(p.parse_args(command), settings_class, module.QUICK) == module.COMMITTED
    assert loop.settings_from(p.parse_args([*command, "--epochs", "1"]), settings_class, module.QUICK) != \
        module.COMMITTED
