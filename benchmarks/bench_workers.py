"""Benchmark: what DataLoader workers cost and buy in ``dpr-gc train`` on the CPU.

Runs the same short training (the offline all-MiniLM-L6-v2, a DPR training file) once per ``--num-workers`` value,
alternating, and samples the proportional set size (PSS: shared pages split between the processes sharing them)
and the RSS of the whole process tree (the trainer and its forked workers) every 0.3 s; reports the peak of each
and the examples/s of the last logged step, as ratios against the first value given (the baseline), in
``--output`` (JSON), and ends with a ``| item | value |`` table of those ratios, the results file and the machine.

    nice -n 5 python benchmarks/bench_workers.py runs/demo/data/dpr_train.json --workers 0 2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (ROOT, default_output, machine_info, output_help, parser, run_script,  # noqa: E402
                          summary_table)
from dpr_gc.base.args import nonnegative_int, positive_int  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402


def process_tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return found


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(PSS, RSS) of the processes, MiB."""
    pss = rss = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except OSError:
            pass
    return pss / 1024, rss / 1024


def last_error(log: Path) -> str:
    """The trainer's last ``error:`` line in ``log`` (its message without the prefix), else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def run(train: str, workers: int, args: argparse.Namespace) -> dict:
    out = Path(args.work_dir) / f"workers-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "dpr_gc", "train", "--train", train, "--output", str(out), "--batch-size",
           str(args.batch_size), "--query-chunk-size", str(args.chunk), "--passage-chunk-size", str(args.chunk),
           "--passage-max-length", str(args.passage_max_length), "--max-steps", str(args.steps),
           "--num-workers", str(workers), "--cache-dir", str(Path(args.work_dir) / "cache"), "--save-every", "100000"]
    began = time.perf_counter()
    log = Path(args.work_dir) / f"workers-{workers}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    peak_pss = peak_rss = 0.0
    while proc.poll() is None:
        pss, rss = memory_mib(process_tree(proc.pid))
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.3)
    if proc.returncode != 0:
        raise DprGcError(f"training with {workers} workers failed: {last_error(log)} (its log: {log})")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return {"workers": workers, "peak_pss_mib": round(peak_pss), "peak_rss_mib": round(peak_rss),
            "examples_per_s": round(last["examples_per_s"], 3), "wall_s": round(time.perf_counter() - began, 1)}


def summary_items(runs: list[dict], workers: list[int]) -> dict[str, str]:
    """The closing table's rows: the baseline's (``workers[0]``) speed and memory, then each other value's best
    speed and lowest peak PSS over the rounds against the baseline's."""
    best = {w: (max(r["examples_per_s"] for r in runs if r["workers"] == w),
                min(r["peak_pss_mib"] for r in runs if r["workers"] == w)) for w in workers}
    speed, pss = best[workers[0]]
    items = {f"{workers[0]} workers (baseline)": f"{speed:.2f} examples/s, {pss:.0f} MiB peak PSS"}
    for w in workers[1:]:
        ratios = [f"{mine / base:.2f}x" if base else "-" for mine, base in zip(best[w], (speed, pss))]
        items[f"{w} workers"] = f"{ratios[0]} the speed, {ratios[1]} the memory (PSS) of {workers[0]} workers"
    return items


# the flags that size a run, and those of the committed workers.json's command (its training file aside)
SIZING = ("workers", "rounds", "batch_size", "chunk", "passage_max_length", "steps")
COMMITTED = (("TRAIN", "--workers", "0", "2", "--rounds", "2", "--batch-size", "16", "--chunk", "8",
              "--passage-max-length", "64", "--steps", "8"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("train", help="a DPR training file (e.g. the demo's data/dpr_train.json)")
    p.add_argument("--workers", type=nonnegative_int, nargs="+", default=[0, 2],
                   help="values to compare (first: baseline)")
    p.add_argument("--rounds", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--chunk", type=positive_int, default=16)
    p.add_argument("--passage-max-length", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_workers"), help="the runs' folders and logs")
    p.add_argument("--output", help=output_help("workers"))
    args = p.parse_args(argv)
    args.output = default_output("workers", p.parse_args, args, SIZING, COMMITTED)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if not Path(args.train).is_file():
        raise DprGcError(f"{args.train}: no such training file; give a DPR training file, e.g. the demo's "
                         "runs/demo/data/dpr_train.json")
    machine = machine_info()
    runs = [run(args.train, w, args) for _ in range(args.rounds) for w in args.workers]
    base = [r for r in runs if r["workers"] == args.workers[0]]
    for r in runs:
        r["pss_vs_baseline"] = round(r["peak_pss_mib"] / min(b["peak_pss_mib"] for b in base), 3)
        r["speed_vs_baseline"] = round(r["examples_per_s"] / max(b["examples_per_s"] for b in base), 3)
        print(r, flush=True)
    write_json(args.output, {"machine": machine, "settings": vars(args), "load_average_at_end": os.getloadavg(),
                             "runs": runs})
    print(summary_table(summary_items(runs, args.workers), args.output, machine, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
