"""The benchmark scripts' shared behaviour: where results go by default, and how a bad input is reported."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_frontier  # noqa: E402
import join_limit  # noqa: E402
import profile_step  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def test_a_smoke_run_never_writes_over_committed_results() -> None:
    """--quick and --tiny runs default to NAME-quick.json; a full run to NAME.json; --output always wins."""
    for flags, name in (([], "frontier-cpu.json"), (["--quick"], "frontier-cpu-quick.json"),
                        (["--tiny"], "frontier-cpu-quick.json"), (["--quick", "--tiny"], "frontier-cpu-quick.json")):
        assert bench_frontier.output_path(bench_frontier.parse_args(flags), "cpu") == str(RESULTS / name)
    given = bench_frontier.parse_args(["--quick", "--output", "x.json"])
    assert bench_frontier.output_path(given, "cpu") == "x.json"
    assert join_limit.parse_args(["--device", "cpu", "--tiny"]).output == str(RESULTS / "join-limit-cpu-quick.json")
    assert join_limit.parse_args(["--device", "cpu"]).output == str(RESULTS / "join-limit-cpu.json")
    assert profile_step.parse_args(["--device", "cpu", "--tiny"]).output == str(RESULTS / "profile-step-cpu-quick.json")
