"""The benchmark scripts' shared behaviour: where results go by default, and how a bad input is reported."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_frontier  # noqa: E402
import join_limit  # noqa: E402
import profile_step  # noqa: E402
from bench_common import run_script  # noqa: E402
from tests.helpers import summary_rows  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


FRONTIER_CPU = ["--shapes", "scifact", "--batch", "32", "--chunk", "8", "--passage-length", "128", "--steps", "2"]


def test_a_smoke_run_never_writes_over_committed_results() -> None:
    """--quick and --tiny runs default to NAME-quick.json; the committed run's command to NAME.json; --output always
    wins."""
    for flags, name in ((FRONTIER_CPU, "frontier-cpu.json"), (["--quick"], "frontier-cpu-quick.json"),
                        (["--tiny"], "frontier-cpu-quick.json"), (["--quick", "--tiny"], "frontier-cpu-quick.json"),
                        ([*FRONTIER_CPU, "--quick"], "frontier-cpu-quick.json")):
        assert bench_frontier.output_path(bench_frontier.parse_args(flags), "cpu") == str(RESULTS / name)
    given = bench_frontier.parse_args(["--quick", "--output", "x.json"])
    assert bench_frontier.output_path(given, "cpu") == "x.json"
    assert join_limit.parse_args(["--device", "cpu", "--tiny"]).output == str(RESULTS / "join-limit-cpu-quick.json")
    assert join_limit.parse_args(["--device", "cpu"]).output == str(RESULTS / "join-limit-cpu.json")
    assert profile_step.parse_args(["--device", "cpu", "--tiny"]).output == str(RESULTS / "profile-step-cpu-quick.json")


def test_bench_gradcache_smoke_and_merge_runs_never_default_to_committed_results(
        capsys: pytest.CaptureFixture) -> None:
    """--tiny alone is a smoke run (gradcache-quick.json); --merge names its --output, never the default file."""
    import bench_gradcache

    for flags in (["--tiny"], ["--quick"], ["--quick", "--tiny"]):
        assert bench_gradcache.parse_args(flags).output == str(RESULTS / "gradcache-quick.json"), flags
    committed = ["--batches", "32,128", "--chunk", "32", "--plain-max-batch", "32", "--steps", "1", "--clock", "cpu"]
    assert bench_gradcache.parse_args(committed).output == str(RESULTS / "gradcache.json")
    one_error_line(capsys, "bench_gradcache.py", "--merge", "a.json", "b.json", words=("--merge", "--output"))


def one_error_line(capsys: pytest.CaptureFixture, script: str, *args: str, words: tuple[str, ...] = (),
                   argv: Optional[list[str]] = []) -> None:
    """``benchmarks/SCRIPT ARGS``, run as its ``__main__`` runs it: exit 2, one ``error:`` line naming ``words``
    (``argv`` None: its ``main()`` reads ``sys.argv``, for the scripts whose ``main`` takes no arguments)."""
    module = importlib.import_module(script.removesuffix(".py"))
    call = (lambda: module.main()) if argv is None else (lambda: module.main(list(args)))
    with mock.patch("torch.cuda.is_available", return_value=False), pytest.raises(SystemExit) as done:
        sys.exit(run_script(call))
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("script, args, words", [
    ("bench_llm.py", ["--batches", "2,x"], ["--batches", "2,x"]),
    ("bench_jax_memory.py", ["--batches", "4,x"], ["--batches", "4,x"]),
    ("bench_jax_memory.py", ["--chunk", "0"], ["--chunk", "positive integer"]),
    ("bench_jax_memory.py", ["--query-length", "0"], ["--query-length", "positive integer"]),
    ("bench_jax_memory.py", ["--passage-length", "-3"], ["--passage-length", "positive integer"]),
    ("bench_jax_memory.py", ["--hard-negatives", "-1"], ["--hard-negatives", "integer >= 0"]),
    ("bench_gradcache.py", ["--device", "cuda"], ["--device cuda", "no CUDA device"]),
    ("bench_frontier.py", ["--device", "cuda"], ["--device cuda", "no CUDA device"]),
    ("duplicate_positives.py", ["--data", "/nonexistent"], ["--data /nonexistent", "BEIR folder"]),
    ("filled_negatives.py", ["--data", "/nonexistent"], ["--data /nonexistent", "BEIR folder"]),
    ("frozen_casts.py", ["--tiny"], ["--tiny", "scifact shape", "give --small"]),  # its default shape is llm
])
def test_a_bad_flag_is_one_error_line(capsys: pytest.CaptureFixture, script: str, args: list[str],
                                      words: list[str]) -> None:
    one_error_line(capsys, script, *args, words=tuple(words))


BEIR = str(REPO / "data" / "examples" / "beir")


@pytest.mark.parametrize("script, args, words", [
    ("bench_frontier.py", ["--batch", "0"], ["--batch", "positive integer"]),
    ("bench_frontier.py", ["--llm-chunk", "-2"], ["--llm-chunk", "positive integer"]),
    ("bench_frontier.py", ["--precisions", "fp32,fp8"], ["--precisions fp8", "fp32,bf16"]),
    ("bench_frontier.py", ["--shapes", "foo"], ["--shapes foo", "scifact,llm"]),
    ("bench_frontier.py", ["--peers", "st-cmnrl,cmnrl"], ["--peers cmnrl", "st-cmnrl,grad_cache-original"]),
    ("bench_workers.py", ["t.json", "--workers", "0", "-1"], ["--workers", "integer >= 0"]),
    ("bench_workers.py", ["t.json", "--rounds", "0"], ["--rounds", "positive integer"]),
    ("bench_gradcache.py", ["--chunk", "0"], ["--chunk", "positive integer"]),
    ("duplicate_positives.py", ["--data", BEIR, "--epochs", "0"], ["--epochs", "positive integer"]),
    ("duplicate_positives.py", ["--data", BEIR, "--batch-size", "0"], ["--batch-size", "positive integer"]),
    ("duplicate_positives.py", ["--data", BEIR, "--hard-negatives", "-1"], ["--hard-negatives", "integer >= 0"]),
])
def test_a_count_below_its_range_is_refused_before_any_work(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                            script: str, args: list[str], words: list[str]) -> None:
    """One error: line naming the flag, exit 2, from the flags alone: no model, data or child process is touched."""
    out = tmp_path / "x.json"
    with mock.patch("subprocess.run") as child, mock.patch("duplicate_positives.load_training_data") as load:
        one_error_line(capsys, script, *args, "--output", str(out), words=tuple(words))
    child.assert_not_called()
    load.assert_not_called()
    assert not out.exists()


SCRIPTS = sorted(f.name for f in (REPO / "benchmarks").glob("*.py") if "parse_args(" in f.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_scripts_unknown_flag_is_one_error_line(capsys: pytest.CaptureFixture, script: str) -> None:
    """Each script's parser is bench_common's: an unknown flag is one error: line naming it and exit status 2,
    argparse's usage lines not printed (a positional argument given where the script takes one)."""
    argv = [script, "--no-such-flag"] + (["train.json"] if script == "bench_workers.py" else [])
    with mock.patch.object(sys, "argv", argv):
        one_error_line(capsys, script, words=("unrecognized arguments: --no-such-flag", script), argv=None)
    assert "argparse.ArgumentParser(" not in (REPO / "benchmarks" / script).read_text()


def test_bench_workers_writes_its_results_beside_the_others_from_any_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The default --output is benchmarks/results/workers.json of the checkout, not of the working directory, and
    the default --work-dir is the checkout's runs/bench_workers."""
    import bench_workers

    train = tmp_path / "train.json"
    train.write_text("[]\n")
    written: list[str] = []
    fake = {"workers": 0, "peak_pss_mib": 1, "peak_rss_mib": 1, "wall_s": 1.0, "examples_per_s": 1.0}
    monkeypatch.chdir(tmp_path)
    work_dirs: list[str] = []

    def run(path: str, workers: int, args: Any) -> dict:
        work_dirs.append(args.work_dir)
        return {**fake, "workers": workers}

    with mock.patch.object(bench_workers, "run", run), \
            mock.patch.object(bench_workers, "write_json", lambda path, data: written.append(path)):
        assert bench_workers.main([str(train), "--workers", "0"]) == 0
    assert written == [str(RESULTS / "workers-quick.json")]  # not the committed run's sizes
    assert work_dirs == [str(REPO / "runs" / "bench_workers")]


def test_merging_a_missing_or_foreign_file_is_one_error_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"runs": []}\n')
    for bad in (tmp_path / "missing.json", other):
        out = tmp_path / "merged.json"
        one_error_line(capsys, "bench_gradcache.py", "--merge", str(bad), "--output", str(out), words=(str(bad),))
        assert not out.exists()


def test_merging_into_one_of_its_inputs_is_one_error_line(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--output naming one of the --merge files (by any spelling of its path) is refused; the file stays as it was."""
    part = tmp_path / "a.json"
    part.write_text('{"runs": []}\n')
    monkeypatch.chdir(tmp_path)
    for output in (str(part), "./a.json"):
        one_error_line(capsys, "bench_gradcache.py", "--merge", str(part), str(tmp_path / "b.json"), "--output",
                       output, words=("--output " + output, "--merge", "another file"))
        assert part.read_text() == '{"runs": []}\n'


def test_bench_gradcache_refuses_a_grid_with_nothing_to_run(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """plain alone above --plain-max-batch leaves no configuration: refused before any model or child starts."""
    out = tmp_path / "x.json"
    with mock.patch("subprocess.run") as child:
        one_error_line(capsys, "bench_gradcache.py", "--tiny", "--methods", "plain", "--batches", "256", "--output",
                       str(out), words=("nothing to run", "--methods plain", "--batches 256", "--plain-max-batch 128"))
    child.assert_not_called()
    assert not out.exists()


def test_bench_llm_refuses_cuda_without_a_gpu_before_any_child(capsys: pytest.CaptureFixture) -> None:
    with mock.patch("subprocess.run") as child:
        one_error_line(capsys, "bench_llm.py", "--device", "cuda", words=("--device cuda", "no CUDA device"))
    child.assert_not_called()


def test_bench_llm_fails_and_writes_nothing_when_every_configuration_failed(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    import bench_llm

    out = tmp_path / "llm.json"
    failed = subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: out of memory\n")
    with mock.patch("subprocess.run", return_value=failed):
        code = bench_llm.main(["--device", "cpu", "--batches", "2", "--methods", "plain", "--output", str(out)])
    assert code == 1 and not out.exists()
    assert "every configuration failed" in capsys.readouterr().err


def test_bench_workers_says_why_training_failed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A missing training file is refused up front; a failed training shows the trainer's last error: line."""
    import bench_workers

    one_error_line(capsys, "bench_workers.py", str(tmp_path / "missing.json"), words=("missing.json",))
    train = tmp_path / "train.json"
    train.write_text("[]\n")
    trainer = "import sys; print('INFO starting'); print('error: train.json: no examples', file=sys.stderr); exit(2)"
    popen = subprocess.Popen
    with mock.patch.object(bench_workers.subprocess, "Popen",
                           lambda cmd, **kw: popen([sys.executable, "-c", trainer], **kw)):
        one_error_line(capsys, "bench_workers.py", str(train), "--work-dir", str(tmp_path / "work"),
                       words=("training with 0 workers failed: train.json: no examples",))


def test_a_script_prints_none_of_its_dependencies_lines(tmp_path: Path) -> None:
    """No datasets "JAX version ... available", FAISS loader or transformers bar: every script sets its log up
    through bench_common (the dependencies quiet), none by logging.basicConfig of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "duplicate_positives.py"), "--data",
                           str(REPO / "data" / "examples" / "beir"), "--batch-size", "2", "--epochs", "1",
                           "--output", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    rows = summary_rows(done.stdout)
    assert rows["results file"] == str(tmp_path / "out.json") and rows["machine"]
    assert "share of scores masked" in rows and "questions affected per epoch" in rows
    out = done.stdout + done.stderr
    assert "dpr_gc.data.training" in out
    assert not [line for line in out.splitlines() if " datasets:" in line or " faiss" in line or "it/s]" in line]
    for script in (REPO / "benchmarks").glob("*.py"):
        assert script.name == "bench_common.py" or "logging.basicConfig" not in script.read_text(), script


def test_every_results_file_records_the_machine_through_one_helper() -> None:
    """bench_common.machine_info: date-time UTC, CPU model and flags, torch, device, load, command; every script
    that writes results uses it (directly or through bench_gradcache's), none platform.machine() of its own."""
    import bench_common

    with mock.patch.object(sys, "argv", ["benchmarks/x.py", "--data", "a b"]):
        info = bench_common.machine_info("cpu", 2)
    assert info["date"].endswith("+00:00") and info["cpu"] and isinstance(info["cpu_flags"], list)
    assert info["torch"] and info["threads"] == 2 and info["device"] == "cpu"
    assert len(info["load_average_at_start"]) == 3 and info["command"] == "benchmarks/x.py --data 'a b'"
    for script in (REPO / "benchmarks").glob("*.py"):
        text = script.read_text()
        if script.name in ("bench_common.py", "rank_tests_loop.py") or "results" not in text:
            continue
        assert "machine_info" in text or "write_report" in text, script  # scifact_grid: scifact_loop's report
        assert "platform.machine()" not in text and "platform.processor()" not in text, script


def test_the_machine_record_keeps_the_cpus_flags_and_the_load_the_system_gives(monkeypatch) -> None:
    """The CPU's model and flags of interest come from /proc/cpuinfo's first processor, the load average is the
    system's three figures as given, and the closing table's machine shows the 1-minute one."""
    import io

    import bench_common

    cpuinfo = ("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 sse amx_tile\n\n"
               "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: avx512f\n")
    monkeypatch.setattr(bench_common, "open", lambda path, encoding=None: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(bench_common.os, "getloadavg", lambda: (1.5, 2.5, 3.75))
    info = bench_common.machine_info("cpu", 2)
    assert (info["cpu"], info["cpu_flags"]) == ("Test CPU 9000", ["avx2", "amx_tile"])
    assert list(info["load_average_at_start"]) == [1.5, 2.5, 3.75]
    assert bench_common.machine_text(info) == "Test CPU 9000, cpu, load 1.5"


def test_printed_ratios_say_which_clock_they_are_on() -> None:
    """bench_answers' worker row is compared on wall time (the parent's CPU time leaves the workers out);
    host_overhead's paired ratio, a CPU-time one, says so beside its wall-time column."""
    import bench_answers

    results = {"baseline per-call has_answer": {"cpu_s": 30.0, "wall_s": 30.0},
               "AnswerMatcher 1 process": {"cpu_s": 6.0, "wall_s": 6.0, "speedup_cpu_vs_baseline": 5.0,
                                           "speedup_wall_vs_baseline": 5.0},
               "AnswerMatcher 2 workers": {"cpu_s": 1.4, "wall_s": 3.16, "speedup_cpu_vs_baseline": 21.4,
                                           "speedup_wall_vs_baseline": 9.5}}
    table = bench_answers.matching_table(results).splitlines()
    assert table[0].startswith("| method |") and table[1].startswith("|---|")
    assert table[-1].endswith("| 9.5x (wall) |") and table[-2].endswith("| 5.0x (CPU) |")
    assert '"vs plain (CPU, paired)"' in (REPO / "benchmarks" / "host_overhead.py").read_text()


def test_bench_encode_gives_each_methods_median_speed_against_sentence_transformers(capsys) -> None:
    """passages/s over the median round, and sentence-transformers' median seconds over the method's (above 1: the
    method is faster), whole rounds and per chunk; the cosines against sentence-transformers' embeddings."""
    import numpy as np

    import bench_encode

    st, ours = "sentence-transformers fp32", "dpr_gc fp32"
    seconds = {st: [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]], ours: [[0.5, 0.5], [1.0, 1.0], [4.5, 4.5]]}
    emb = [np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[1.0, 1.0], [1.0, 0.0]])]
    outputs = {st: emb, ours: [emb[0], np.array([[1.0, 1.0], [1.0, 1.0]])]}
    args = SimpleNamespace(max_length=16, batch_size=4, rounds=3)
    results = bench_encode.summarize(args, 8, seconds, outputs)
    assert results[ours]["median_seconds"] == 2.0 and results[ours]["passages_per_s"] == 4.0
    assert results[ours]["ratio_vs_st"] == 2.0 and results[ours]["median_chunk_ratio_vs_st"] == 2.0
    assert results[st]["ratio_vs_st"] == 1.0 and results[st]["min_cosine_vs_st"] == pytest.approx(1.0)
    assert results[ours]["min_cosine_vs_st"] == pytest.approx(2 ** -0.5)
    assert "| dpr_gc fp32 | 4.0 | 2.00x | 2.00x |" in capsys.readouterr().out


def test_bench_faiss_gives_each_settings_speed_against_flat_and_the_fastest_hnsw_that_meets_the_target(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """speedup_vs_flat is a setting's queries/s over Flat's; the target names the fastest HNSW setting at or above
    --target-speedup (IVF-PQ, faster still, is not an HNSW one)."""
    import bench_faiss

    real, qps = bench_faiss.timed_search, iter([100.0, 600.0, 800.0, 300.0, 900.0, 400.0])
    monkeypatch.setattr(bench_faiss, "timed_search", lambda *a: (real(*a)[0], next(qps)))
    args = bench_faiss.parse_args(["--n", "500", "--dim", "8", "--latent", "4", "--clusters", "5", "--queries", "10",
                                   "--k", "5", "--hnsw-m", "8", "--ef-construction", "16", "--ef-search", "16", "32",
                                   "64", "--nlist", "4", "--pq-m", "2", "--nprobe", "1", "2", "--train-sample", "500",
                                   "--repeats", "1", "--threads", "1", "--target-recall", "0"])
    report = bench_faiss.run(args)
    assert [r["speedup_vs_flat"] for r in report["results"]] == [1.0, 6.0, 8.0, 3.0, 9.0, 4.0]
    assert report["target"]["met"] and report["target"]["setting"] == "HNSW8 (efC 16) efSearch=32"


def test_bench_llm_ends_with_its_ratios_against_plain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each method's step time and peak memory against plain training at the same batch, in the closing table."""
    import bench_llm

    real = subprocess.run

    def child(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        if "--method" not in cmd:  # not one of the script's children
            return real(cmd, **kw)
        method, batch = cmd[cmd.index("--method") + 1], int(cmd[cmd.index("--batch") + 1])
        row = {"method": method, "batch": batch, "step_s": 2.0 if method == "plain" else 3.0,
               "peak_mb": 400.0 if method == "plain" else 100.0}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")

    out = tmp_path / "llm.json"
    with mock.patch("subprocess.run", child):
        assert bench_llm.main(["--device", "cpu", "--batches", "2", "--methods", "plain,gc", "--output", str(out)]) == 0
    rows = summary_rows(capsys.readouterr().out)
    assert rows["batch 2 gc"] == "3.00 s/step (0.67x plain's speed), 100 MB (0.25x plain's memory)", rows
    assert rows["results file"] == str(out) and "cpu" in rows["machine"]


def test_bench_frontier_ends_with_each_budgets_ratios(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    comparison = [{"budget_mb": 0.0, "kept_token_share": 0.25, "step_s": 2.0, "peak_mb": 50.0, "speedup_vs_plain": 0.5,
                   "memory_vs_plain": 0.25, "best_peer": "st-cmnrl chunk 8", "speedup_vs_best_peer": 1.5}]
    monkeypatch.setattr(bench_frontier, "frontier", lambda base, args, peers: {"comparison": comparison})
    monkeypatch.setattr(bench_frontier, "plot", lambda report, path: path)
    out = tmp_path / "f.json"
    bench_frontier.main(["--tiny", "--shapes", "scifact", "--precisions", "fp32", "--output", str(out)])
    rows = summary_rows(capsys.readouterr().out)
    assert rows["scifact fp32 budget 0 MB"] == ("0.50x plain's speed, 0.25x plain's memory, 1.50x st-cmnrl chunk 8's "
                                                "speed"), rows
    assert rows["results file"] == str(out) and rows["machine"]


def test_filled_negatives_ends_with_the_false_negative_shares(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import filled_negatives

    out = tmp_path / "filled.json"
    assert filled_negatives.main(["--data", str(REPO / "data" / "examples" / "beir"), "--batch-size", "2",
                                  "--epochs", "1", "--output", str(out)]) == 0
    rows = summary_rows(capsys.readouterr().out)
    assert rows["false negatives, whole data set draw"].endswith(" fills"), rows
    assert "false negatives, global batch exclusion" in rows and rows["results file"] == str(out)


def test_scifact_padding_ends_with_each_shapes_padding_ratios(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import gzip

    import scifact_padding

    (tmp_path / "queries.jsonl").write_text("".join(f'{{"_id": "q{i}", "text": "claim {i}"}}\n' for i in range(4)))
    with gzip.open(tmp_path / "corpus.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"_id": f"d{i}", "title": "t", "text": "passage" + " more" * i}) + "\n"
                     for i in range(4))
    out = tmp_path / "padding.json"
    assert scifact_padding.main(["--data", str(tmp_path), "--batch", "4", "--chunk", "2", "--samples", "2",
                                 "--output", str(out)]) == 0
    rows = summary_rows(capsys.readouterr().out)
    assert rows["passages 128 tokens: padded vs real"].endswith("x"), rows
    assert "queries 32 tokens: padded vs grouped chunks" in rows and rows["results file"] == str(out)


def test_bench_workers_ends_with_each_values_ratios_against_the_baseline(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    import bench_workers

    train = tmp_path / "train.json"
    train.write_text("[]\n")
    speeds = {0: 10.0, 2: 12.0}

    def fake(path: str, workers: int, args: object) -> dict:
        return {"workers": workers, "peak_pss_mib": 100 * (1 + workers), "peak_rss_mib": 1, "wall_s": 1.0,
                "examples_per_s": speeds[workers]}

    out = tmp_path / "workers.json"
    with mock.patch.object(bench_workers, "run", fake):
        assert bench_workers.main([str(train), "--workers", "0", "2", "--output", str(out)]) == 0
    rows = summary_rows(capsys.readouterr().out)
    assert rows["2 workers"] == "1.20x the speed, 3.00x the memory (PSS) of 0 workers", rows
    assert rows["results file"] == str(out) and rows["machine"]


def test_a_scifact_smoke_run_writes_its_results_to_its_work_folder() -> None:
    """``scifact.py --quick`` wrote benchmarks/results/scifact-quick.*, replacing a committed file with numbers of a
    200-passage subset, and ``scifact.py --epochs 1`` wrote over the committed scifact.{json,md}; a smoke run's
    results go to its out folder, as do those of any run with other settings than the committed one (the README's
    command, whose go to benchmarks/results); ``--results`` wins over all."""
    import scifact

    committed = ["--sweep-lengths", "--no-precision-check", "--timing-queries", "256", "--variant", "epochs=3",
                 "learning_rate=1e-4", "--variant", "batch_size=128", "learning_rate=2e-4", "epochs=4"]
    assert scifact.results_folder(scifact.parse_args(["--quick"])) == REPO / "runs" / "scifact-quick"
    assert scifact.results_folder(scifact.parse_args(["--quick", "--out", "w/x"])) == Path("w/x-quick")
    assert scifact.results_folder(scifact.parse_args(committed)) == RESULTS
    assert scifact.results_folder(scifact.parse_args([*committed, "--threads", "2"])) == RESULTS
    assert scifact.results_folder(scifact.parse_args([*committed, "--epochs", "1"])) == REPO / "runs" / "scifact"
    assert scifact.results_folder(scifact.parse_args([])) == REPO / "runs" / "scifact"
    assert scifact.results_folder(scifact.parse_args(["--quick", "--results", "r"])) == Path("r")


@pytest.mark.parametrize("script, default", [("join_limit", "fp32 bf16"), ("embedding_grads", "fp32 bf16"),
                                             ("frozen_casts", "bf16")])
def test_the_precisions_help_gives_each_scripts_own_default(capsys: pytest.CaptureFixture, script: str,
                                                            default: str) -> None:
    """frozen_casts.py --help said '--precisions ... (default both) (default: bf16)': the shared flag's text named
    join_limit's default, where frozen_casts takes bf16 only."""
    with pytest.raises(SystemExit):
        importlib.import_module(script).main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"fp32 and/or bf16 autocast (default: {default})" in text, text


# (script, a command that wrote the committed file, the file, a smaller run of it): from each file's recorded settings
# or command and benchmarks/README.md
COMMITTED_RUNS = [
    ("chunk_cost", ["--repeats", "3"], "chunk-cost-cpu.json", ["--repeats", "1"]),
    ("bench_llm", ["--small", "--device", "cpu", "--precision", "fp32", "--batches", "4,8,16", "--chunk", "4",
                   "--steps", "2"], "llm.json", ["--small", "--device", "cpu", "--precision", "fp32", "--batches", "4",
                                      "--chunk", "4", "--steps", "2"]),
    ("bench_llm", ["--small", "--device", "cpu", "--precision", "fp32", "--batches", "32", "--chunk", "4", "--steps",
                   "2", "--append"], "llm.json", ["--small", "--device", "cpu", "--precision", "fp32", "--batches",
                                                  "32", "--chunk", "4", "--steps", "1", "--append"]),
    ("bench_jax_memory", ["--batches", "64,1024", "--chunk", "16"], "jax_memory.json", ["--batches", "64"]),
    ("bench_answers", [], "answers.json", ["--questions", "100"]),
    ("bench_answers", ["--no-matching", "--repeats", "3"], "answers.json", ["--no-matching", "--repeats", "1"]),
    ("bench_encode", ["--docs", "256", "--chunk", "128", "--no-quality"], "encode.json",
     ["--docs", "16", "--chunk", "8", "--no-quality"]),
    ("bench_workers", ["T", "--workers", "0", "2", "--rounds", "2", "--batch-size", "16", "--chunk", "8",
                       "--passage-max-length", "64", "--steps", "8"], "workers.json", ["T", "--rounds", "1"]),
    ("bench_faiss", ["--threads", "1"], "faiss.json", ["--n", "5000", "--threads", "1"]),
    ("attention_backward", ["--threads", "2"], "attention-backward-cpu.json", ["--repeats", "1"]),
    ("frozen_casts", ["--shape", "llm", "--small", "--passage-lengths", "128", "--rounds", "3", "--steps", "3"],
     "frozen-casts-cpu.json", ["--small", "--rounds", "1"]),
    ("join_limit", ["--passage-lengths", "128", "256", "--precisions", "fp32", "bf16", "--rounds", "2"],
     "join-limit-cpu.json", ["--passage-lengths", "128"]),
    ("embedding_grads", [], "embedding-grads-cpu.json", ["--steps", "1"]),
    ("profile_step", ["--batch", "32", "--chunk", "8", "--passage-length", "128", "--steps", "2", "--threads", "2"],
     "profile-step-cpu.json", ["--batch", "8"]),
    ("bench_gradcache", ["--batches", "32,128", "--chunk", "32", "--plain-max-batch", "32", "--steps", "1",
                         "--threads", "1", "--clock", "cpu"], "gradcache.json", ["--batches", "32", "--chunk", "32"]),
    ("duplicate_positives", ["--data", "../shared/data/scifact", "--batch-size", "256", "--hard-negatives", "1"],
     "duplicate-positives.json", ["--epochs", "1"]),
    ("filled_negatives", [], "filled-negatives.json", ["--epochs", "1"]),
    ("scifact_padding", [], "scifact-padding.json", ["--samples", "5"]),
    ("rank_tests_loop", ["--iterations", "20", "--no-load", "--iteration-limit", "1200"], "rank-tests-loop.json",
     ["--iterations", "2", "--no-load", "--iteration-limit", "1200"]),
]


@pytest.mark.parametrize("script, command, name, smaller", COMMITTED_RUNS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(COMMITTED_RUNS)])
def test_only_the_committed_runs_sizes_write_its_results_file(script: str, command: list[str], name: str,
                                                              smaller: list[str]) -> None:
    """``bench_workers.py --rounds 1``, ``chunk_cost.py``'s default 5 repeats or any smaller --steps / --batches
    wrote over the committed results file (only --quick and --tiny went elsewhere): the committed file is the default
    only for the sizes that produced it; any other run goes to NAME-quick.json, and --output still wins."""
    parse = importlib.import_module(script).parse_args
    assert (RESULTS / name).is_file(), name
    assert parse(command).output == str(RESULTS / name)
    assert parse(smaller).output == str(RESULTS / name.replace(".json", "-quick.json"))
    assert parse([*smaller, "--output", "x.json"]).output == "x.json"


def test_the_default_results_file_follows_the_sizing_flags_only() -> None:
    """bench_common.default_output: the committed file when every sizing flag has one committed command's value
    (the parser's defaults for the flags it leaves out), whatever the other flags; else the -quick sibling."""
    import argparse

    from bench_common import default_output

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output")
    committed = (("--steps", "5"), ("--steps", "7"))
    for argv, name in ((["--steps", "5"], "x.json"), (["--steps", "7", "--threads", "4"], "x.json"),
                       ([], "x-quick.json"), (["--steps", "2"], "x-quick.json")):
        assert default_output("x", p.parse_args, p.parse_args(argv), ("steps",), committed) == str(RESULTS / name)
    assert default_output("x", p.parse_args, p.parse_args([]), ("steps",)) == str(RESULTS / "x.json")
    assert default_output("x", p.parse_args, p.parse_args(["--output", "o.json"]), ("steps",), committed) == "o.json"
