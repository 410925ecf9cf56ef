"""Reliability loop: the multi-process tests (DDP, FSDP, torchrun ranks) run N times in a row while a second
process loads the machine with the rest of the suite.

Each iteration is one ``pytest -n 0 -p no:cacheprovider -q <node ids>`` (one process, not pytest.ini's two
workers) in a session of its own (killed with its ranks past ``--iteration-limit``); the load is
``pytest -n 0 -q -p no:cacheprovider -m "not slow" tests`` with those node ids deselected, restarted whenever it
finishes. Per iteration it records passes, failures, wall time and the load
average; a failing iteration's output is saved next to the results and the loop stops (``--keep-going`` runs on).

    python benchmarks/rank_tests_loop.py --iterations 20 --output benchmarks/results/rank-tests-loop.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_output, output_help, parser, run_script, setup_logging  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("rank_tests_loop")

NODE_IDS = (
    "tests/test_distributed.py::test_ddp_cached_step_matches_global_batch",
    "tests/test_grad_cache_distributed.py::test_two_ranks",
    "tests/test_loss_fidelity.py::test_distributed_loss_masks_duplicates_across_ranks",
    "tests/test_memory_budget_distributed.py::test_budget_under_ddp_and_fsdp",
    "tests/test_verify_distributed.py::test_verify_two_ranks_ddp_and_fsdp",
    "tests/test_validation.py::test_sharded_validation_equals_one_process",
    "tests/test_fsdp.py::test_fsdp_gradient_cache_step_equals_one_process_and_resumes",
    "tests/test_fsdp_cli.py::test_fsdp_training_through_the_cli_equals_one_process_and_resumes",
    "tests/test_fsdp_cli.py::test_fsdp_plain_training_equals_one_process",
    "tests/test_train.py::test_torchrun_two_ranks_match_the_single_process_step",
    "tests/test_ranks.py",
)


def environment() -> dict[str, str]:
    """The current environment with this checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def start_load(node_ids: list[str]) -> subprocess.Popen:
    """The rest of the suite (quick tests, the loop's own node ids deselected) in a shell loop, in its own session."""
    deselect = " ".join(f"--deselect {n}" for n in node_ids if "::" in n)
    ignore = " ".join(f"--ignore {n}" for n in node_ids if "::" not in n)
    loop = (f'while true; do {sys.executable} -m pytest -n 0 -q -p no:cacheprovider -m "not slow" tests {deselect} '
            f"{ignore} > /dev/null 2>&1; done")
    return subprocess.Popen(["bash", "-c", loop], cwd=ROOT, env=environment(), start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (the pytest run and every rank it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def counts(output: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, ...}`` from pytest's last summary line."""
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", output.splitlines()[-1] if output else "")
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in found}


def iteration(node_ids: list[str], limit_s: float) -> tuple[dict, str]:
    """One run of the node ids: ``(record, its output)``."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", *node_ids]
    proc = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop(proc)
        out, _ = proc.communicate()
        timed_out = True
    finally:
        stop(proc)
    wall = time.perf_counter() - started
    record = {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 1), **counts(out.strip()),
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    return record, out


def commit() -> str | None:
    """The checkout's commit, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# the flags that size a run, and the command of the committed rank-tests-loop.json (benchmarks/README.md)
SIZING = ("iterations", "iteration_limit", "load", "node_ids")
COMMITTED = (("--iterations", "20", "--no-load", "--iteration-limit", "1200"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--iterations", type=int, default=20, help="runs of the multi-process tests")
    p.add_argument("--iteration-limit", type=float, default=1800.0, help="seconds before a run is killed")
    p.add_argument("--load", action=argparse.BooleanOptionalAction, default=True,
                        help="load the machine with the rest of the suite meanwhile")
    p.add_argument("--keep-going", action="store_true", help="go on after a failing iteration")
    p.add_argument("--output", help=output_help("rank-tests-loop"))
    p.add_argument("node_ids", nargs="*", default=list(NODE_IDS), help="tests to repeat (default: all "
                        "multi-process tests)")
    args = p.parse_args(argv)
    args.output = default_output("rank-tests-loop", p.parse_args, args, SIZING, COMMITTED)
    return args


def main() -> None:
    args = parse_args(None)
    setup_logging()
    output = Path(args.output)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(), "command": " ".join(sys.argv),
              "node_ids": args.node_ids,
              "cpus": os.cpu_count(), "load": args.load, "iterations": []}
    load = start_load(args.node_ids) if args.load else None
    try:
        for i in range(args.iterations):
            record, out = iteration(args.node_ids, args.iteration_limit)
            report["iterations"].append(record)
            log.info("iteration %d: %s", i + 1, json.dumps(record))
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(report, indent=2) + "\n")
            if record["rc"] != 0:
                failed = output.with_name(f"{output.stem}-failure-{i + 1}.txt")
                failed.write_text(out)
                log.error("iteration %d failed (rc %s); output in %s", i + 1, record["rc"], failed)
                if not args.keep_going:
                    break
    finally:
        if load is not None:
            stop(load)
    walls = [r["wall_s"] for r in report["iterations"]]
    report["summary"] = {"iterations": len(walls), "clean": sum(r["rc"] == 0 for r in report["iterations"]),
                         "worst_wall_s": max(walls, default=0.0), "total_wall_s": round(sum(walls), 1)}
    output.write_text(json.dumps(report, indent=2) + "\n")
    log.info("summary: %s", json.dumps(report["summary"]))


if __name__ == "__main__":
    sys.exit(run_script(main))
