"""bench_gradcache.py as benchmarks/README.md describes it ("Gradient Cache step"): the results file rewritten after
every configuration, the closing table and target lines, --rounds, --merge, skipped peers and the --quick --tiny
smoke run. The configurations' processes are faked where the step itself is not under test."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_gradcache as gcb  # noqa: E402
from bench_common import run_script  # noqa: E402

SPEED = {"plain": 1.0, "dpr-gc": 2.0, "dpr-gc-features-off": 3.0, "grad_cache-original": 3.0, "st-cmnrl": 4.0}


def fake_result(cfg: dict, seconds: Optional[float] = None) -> dict:
    """What a configuration's process prints, with step times by method (dpr-gc the fastest but plain)."""
    step = SPEED[cfg["method"]] if seconds is None else seconds
    return {**cfg, "data": "generated", "step_s": step, "step_times_s": [step] * cfg["steps"],
            "examples_per_s": cfg["batch"] / step, "cpu_s": step, "cpu_times_s": [step] * cfg["steps"],
            "examples_per_cpu_s": cfg["batch"] / step, "sys_s": 0.0, "minor_faults": 0, "peak_mb": 10.0 + cfg["batch"],
            "memory_method": "fake", "baseline_rss_mb": 1.0, "losses": [0.5] * cfg["steps"],
            "attn_implementation": "sdpa", "real_tokens": 1, "token_slots": 1}


def run(argv: list[str], launch: Callable[[dict, int], dict], capsys: pytest.CaptureFixture,
        original: Optional[str] = "0.1.0 (fake)") -> tuple[int, str, str]:
    """``bench_gradcache.py ARGV`` as its ``__main__`` runs it, each configuration through ``launch``, no model
    built, sentence-transformers installed and the original package at version ``original`` (None: absent):
    (exit status, stdout, stderr)."""
    with mock.patch.object(gcb, "launch", launch), mock.patch.object(gcb, "encoder_model", lambda tiny, d: "m"), \
            mock.patch.object(gcb, "original_version", lambda: original), \
            mock.patch.object(gcb, "st_version", lambda: "6.2.0"):
        try:
            code = run_script(lambda: gcb.main(argv))
        except SystemExit as done:  # the parser's refusal
            code = done.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cpu_peak_memory_is_what_was_allocated_after_the_meter_started() -> None:
    """On the CPU the peak is the resident set's high-water mark above the resident set at start: a 64 MiB buffer
    filled and freed between start and stop reads as about 64 MiB, not the process's whole resident set nor its
    virtual size."""
    meter = gcb.PeakMemory(torch.device("cpu"))
    meter.start()
    buffer = torch.ones(16 * 2**20)  # 64 MiB, every page written
    time.sleep(0.05)  # where the kernel refuses the reset, the 1 ms sampler sees the buffer
    del buffer
    peak = meter.stop()
    assert 60 <= peak < 100, (peak, meter.method)


def test_a_configurations_step_time_is_the_median_of_its_timed_steps(monkeypatch, tmp_path: Path) -> None:
    """step_s (and examples/s) come from the median of the ``--steps`` timed steps: steps of 1, 6 and 2 s give 2 s."""
    clock = iter([0.0, 1.0, 10.0, 16.0, 20.0, 22.0])
    monkeypatch.setattr(gcb, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    cfg = {"method": "plain", "model": gcb.tiny_model(tmp_path), "input": "uneven", "batch": 4, "chunk": 2,
           "q_len": 8, "p_len": 16, "device": "cpu", "threads": 1, "steps": 3, "seed": 0}
    out = gcb.run_one(cfg)
    assert out["step_times_s"] == [1.0, 6.0, 2.0] and out["step_s"] == 2.0 and out["examples_per_s"] == 2.0


def test_the_results_file_is_rewritten_after_every_configuration(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Each configuration finds every earlier one in the file (machine, settings, results, targets), so a run that
    stops half way keeps what it measured; each result keeps its raw step times, losses and load average."""
    out = tmp_path / "gc.json"
    seen: list[dict] = []

    def launch(cfg: dict, timeout: int) -> dict:
        seen.append(json.loads(out.read_text()) if out.exists() else {})
        return fake_result(cfg)

    argv = ["--batches", "8,16", "--chunk", "4", "--methods", "plain,dpr-gc", "--inputs", "uneven", "--steps", "2",
            "--memory-check", "--memory-batches", "8,32", "--output", str(out)]
    assert run(argv, launch, capsys)[0] == 0
    assert len(seen) == 6 and seen[0] == {}
    for done, report in enumerate(seen[1:], start=1):
        assert len(report["results"]) + len(report["memory_check"]) == done, report
        assert report["machine"]["cpu"] and report["settings"]["batches"] == [8, 16] and "targets" in report
    final = json.loads(out.read_text())
    assert len(final["results"]) == 4 and len(final["memory_check"]) == 2
    for result in final["results"] + final["memory_check"]:
        (only,) = result["rounds"]
        assert only["step_times_s"] == [only["step_s"]] * result["steps"] and only["losses"]
        assert len(only["load_average"]) == 3
    assert final["targets"]["memory_check"]["met"] is False  # 42 MB against 18 MB


def test_the_run_ends_with_the_table_and_one_line_per_target(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--batches", "8,16", "--chunk", "4", "--methods", "plain,dpr-gc,st-cmnrl", "--memory-check",
            "--memory-batches", "8,32", "--output", str(tmp_path / "gc.json")]
    code, out, _ = run(argv, lambda cfg, timeout: fake_result(cfg), capsys)
    assert code == 0
    lines = out.strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| method | input q/p | batch |") and table[1].startswith("|---|")
    assert len(table) == 2 + 2 * 2 * 3 + 2  # inputs x batches x methods, and the memory check's two rows
    targets = [line for line in lines if line.startswith("- ")]
    assert len(targets) == 2 + 2 + 2 + 1, targets  # peak growth per input, fixed and uneven per batch, memory check
    assert "- fixed, batch 16 chunk 4: dpr-gc 2.00x the speed of st-cmnrl (target >= 1.00x: met)" in targets
    assert targets[-1].startswith("- memory check, batch 32 vs 8 (chunk 16):") and "NOT met" in targets[-1]
    assert lines[-1] == f"written {tmp_path / 'gc.json'}"


def test_each_rows_speed_ratios_are_its_speed_over_the_others_and_the_target_takes_the_fastest_peer(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A row's "speed vs" columns are its examples/s over plain's, the original's and CachedMNRL's (dpr-gc at 2 s a
    step: 0.50x plain at 1 s, 1.50x the original at 3 s, 2.00x CachedMNRL at 4 s); the target compares it with the
    fastest peer, the original."""
    argv = ["--batches", "8", "--chunk", "4", "--inputs", "fixed", "--methods", "plain,dpr-gc,grad_cache-original,"
            "st-cmnrl", "--output", str(tmp_path / "gc.json")]
    code, out, _ = run(argv, lambda cfg, timeout: fake_result(cfg), capsys)
    assert code == 0
    (row,) = [line for line in out.splitlines() if line.startswith("| dpr-gc | fixed ")]
    assert [cell.strip() for cell in row.split("|")[10:13]] == ["0.50", "1.50", "2.00"], row
    assert "- fixed, batch 8 chunk 4: dpr-gc 1.50x the speed of grad_cache-original (target >= 1.00x: met)" in out


def test_rounds_rotate_the_method_order_and_report_medians(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    order: list[str] = []

    def launch(cfg: dict, timeout: int) -> dict:
        order.append(cfg["method"])
        return fake_result(cfg, seconds=SPEED[cfg["method"]] * (1 + order.count(cfg["method"]) ** 2))

    out = tmp_path / "gc.json"
    argv = ["--batches", "8", "--chunk", "4", "--inputs", "fixed", "--methods", "plain,dpr-gc,st-cmnrl",
            "--rounds", "3", "--output", str(out)]
    assert run(argv, launch, capsys)[0] == 0
    assert order == ["plain", "dpr-gc", "st-cmnrl", "dpr-gc", "st-cmnrl", "plain", "st-cmnrl", "plain", "dpr-gc"]
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert [r["step_s"] for r in results["dpr-gc"]["rounds"]] == [4.0, 10.0, 20.0]  # mean 11.33
    assert results["dpr-gc"]["step_s"] == 10.0 and results["dpr-gc"]["examples_per_s"] == 8 / 10.0


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--steps", "0"], ["--skip-grid"]])
def test_a_command_line_that_runs_nothing_is_one_error_line(flags: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    code, _, err = run([*flags, "--output", str(tmp_path / "gc.json")], fake_result, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and flags[0] in err, err
    assert not (tmp_path / "gc.json").exists()


def test_a_peer_that_is_not_importable_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The original package absent: the other methods run without it; asked for alone, nothing is left to run and
    the command line is refused in one line before anything starts."""
    with mock.patch("importlib.util.find_spec", return_value=None):
        assert gcb.original_version() is None
    methods: list[str] = []
    launch = lambda cfg, timeout: methods.append(cfg["method"]) or fake_result(cfg)  # noqa: E731
    out = tmp_path / "gc.json"
    argv = ["--batches", "8", "--chunk", "4", "--inputs", "fixed", "--output", str(out)]
    code, printed, _ = run(argv, launch, capsys, original=None)
    assert code == 0 and methods == ["plain", "dpr-gc", "dpr-gc-features-off", "st-cmnrl"]
    assert "grad_cache-original skipped" in caplog.text and "| grad_cache-original |" not in printed
    out.unlink()
    code, _, err = run(argv + ["--methods", "grad_cache-original"], launch, capsys, original=None)
    assert code == 2 and err.count("\n") == 1 and "--methods grad_cache-original" in err and "install" in err, err
    assert len(methods) == 4 and not out.exists()


def test_merge_keeps_each_parts_settings_and_machine(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Runs made side by side, one method each, merged by the README's command (no --clock): the verdicts are on
    the clock the parts were measured on, and each part's settings and machine are under ``merged_from``, also
    when a merged file is merged again."""
    def launch(cfg: dict, timeout: int) -> dict:
        result = fake_result(cfg)
        if cfg["method"] == "st-cmnrl":  # the fastest on CPU time, the slowest on wall time
            result.update(cpu_s=1.0, examples_per_cpu_s=cfg["batch"] / 1.0)
        return result

    parts = []
    for method in ("dpr-gc", "st-cmnrl", "plain"):
        parts.append(tmp_path / f"{method}.json")
        argv = ["--batches", "8", "--chunk", "4", "--inputs", "uneven", "--methods", method, "--clock", "cpu",
                "--output", str(parts[-1])]
        assert run(argv, launch, capsys)[0] == 0
    merged = tmp_path / "merged.json"
    code, out, _ = run(["--merge", str(parts[0]), str(parts[1]), "--output", str(merged)], launch, capsys)
    assert code == 0 and "- uneven, batch 8 chunk 4: dpr-gc 0.50x the speed of st-cmnrl" in out, out
    report = json.loads(merged.read_text())
    assert report["targets"]["clock"] == "cpu" and report["targets"]["uneven_speedup_vs_best_peer"][0]["met"] is False
    cpu = report["machine"]["cpu"]
    assert [(m["file"], m["settings"]["methods"], m["machine"]["cpu"]) for m in report["merged_from"]] == [
        ("dpr-gc.json", ["dpr-gc"], cpu), ("st-cmnrl.json", ["st-cmnrl"], cpu)]
    again = tmp_path / "again.json"
    assert run(["--merge", str(merged), str(parts[2]), "--output", str(again)], launch, capsys)[0] == 0
    report = json.loads(again.read_text())
    assert [m["file"] for m in report["merged_from"]] == ["dpr-gc.json", "st-cmnrl.json", "plain.json"]
    assert [r["method"] for r in report["results"]] == ["dpr-gc", "st-cmnrl", "plain"]


def test_parts_measured_on_different_clocks_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parts = []
    for clock in ("cpu", "wall"):
        parts.append(tmp_path / f"{clock}.json")
        argv = ["--batches", "8", "--methods", "dpr-gc", "--clock", clock, "--output", str(parts[-1])]
        assert run(argv, lambda cfg, timeout: fake_result(cfg), capsys)[0] == 0
    code, _, err = run(["--merge", *map(str, parts), "--output", str(tmp_path / "m.json")], fake_result, capsys)
    assert code == 2 and err.count("\n") == 1 and "--clock" in err and "wall.json" in err, err
    code, _, _ = run(["--merge", *map(str, parts), "--clock", "cpu", "--output", str(tmp_path / "m.json")],
                     fake_result, capsys)
    assert code == 0 and json.loads((tmp_path / "m.json").read_text())["targets"]["clock"] == "cpu"


def test_the_quick_tiny_smoke_run_times_every_installed_method(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--quick --tiny: batch 8, chunk 4, short lengths, one step, one thread, the -quick results file; each method's
    real step on the tiny random BERT (in this process rather than one process each, which costs seconds of
    imports a configuration), within the minute the README promises."""
    args = gcb.parse_args(["--quick", "--tiny"])
    assert (args.batches, args.chunk, args.steps, args.threads, args.inputs) == ([8], 4, 1, 1, ["uneven"])
    assert args.uneven_lengths == [16, 64] and args.output.endswith("gradcache-quick.json")
    threads = torch.get_num_threads()
    out = tmp_path / "gc.json"
    start = time.perf_counter()
    try:
        with mock.patch.object(gcb, "launch", lambda cfg, timeout: gcb.run_one(cfg)), \
                mock.patch.object(gcb, "original_version", lambda: None):
            assert run_script(lambda: gcb.main(["--quick", "--tiny", "--output", str(out)])) == 0
    finally:
        torch.set_num_threads(threads)
    assert time.perf_counter() - start < 60
    results = json.loads(out.read_text())["results"]
    assert [r["method"] for r in results] == ["plain", "dpr-gc", "dpr-gc-features-off", "st-cmnrl"]
    assert all("error" not in r and r["model"] == "tiny-random-bert" for r in results), results
    assert all(0 < r["rounds"][0]["losses"][0] < 10 and r["peak_mb"] >= 0 for r in results), results
    assert "| dpr-gc | uneven 16/64 | 8 | 4 |" in capsys.readouterr().out
