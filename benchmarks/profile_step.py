"""Benchmark: where one cached step's time goes, per method -- kernels, launches and host syncs beside the step time.

bench_frontier.py's SciFact step (all-MiniLM-L6-v2, claims -> cited abstracts, one hard negative, bf16 autocast by
default) for each variant, each in a fresh process: two warm-up steps, ``--steps`` timed steps (median), then one
step under ``torch.profiler``. Reported per variant: the median step; the device's busy time (the kernels' own time,
each once; CUDA only) against the host's own operator time; the kernel launches; the host syncs
(``cudaStreamSynchronize`` on CUDA; on any device the ``aten::_local_scalar_dense`` reads a sync would come from,
e.g. ``.item()`` or ``bool()`` of a tensor) and where each came from (a second profiled step, recorded with Python
stacks; on CUDA, where those stacks came back empty on an H100, the line of every synchronising call from torch's
sync debug mode over one more step); the operators that took the most device time (CPU time on the CPU) and the
most host time. A step whose device is busy
for much less than the step is bound by the host (launches, Python, syncs), not by arithmetic. Variants: ``plain``
(the whole batch in one graph), ``budget0`` (dpr-gc, only the last chunk's graph kept), ``whole`` (dpr-gc, a budget
for the whole batch), and the peers ``luyug`` (luyug/GradCache) and ``cmnrl`` (sentence-transformers' CachedMNRL)
where installed. ``--shape llm`` profiles bench_llm.py's LoRA decoder on random token ids instead (plain and dpr-gc
only).
Results: JSON in benchmarks/results/profile-step-DEVICE.json; the run ends with a ``| item | value |`` table of each
variant's step, launches and syncs against plain's, the results file and the machine.

    python benchmarks/profile_step.py --device cuda --batch 256 --chunk 32       # the H200 frontier's shape
    python benchmarks/profile_step.py --shape llm --small --passage-length 128   # the CPU LoRA decoder's
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_frontier import (OURS, PLAIN, ST, available_peers, llm_step, scifact_step, shape_model,  # noqa: E402
                            timed_steps)
from bench_common import default_output, output_help, parser, setup_logging, summary_table  # noqa: E402
from bench_gradcache import ORIGINAL, RESULT_TAG, child_env, machine_info, run_child  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402

logger = logging.getLogger("profile_step")
VARIANTS = {"plain": {"method": PLAIN, "budget": None}, "budget0": {"method": OURS, "budget": 0},
            "whole": {"method": OURS, "budget": 10**15}, "luyug": {"method": ORIGINAL, "budget": None},
            "cmnrl": {"method": ST, "budget": None}}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
SITE_FRAMES = 6  # the innermost Python frames that name where a host sync or value read came from
SITE_PACKAGES = ("dpr_gc/", "grad_cache/", "sentence_transformers/")  # the methods' own code, beside the scripts


def host_events(events: list) -> list:
    """The host-side events (operators and runtime calls); an operator's self device time is the time of the
    kernels it launched itself."""
    return [e for e in events if e.device_type == DeviceType.CPU]


def device_busy_ms(events: list) -> float:
    """The device's busy time: the kernels' (and copies') own time, each counted once. The operator that launched a
    kernel carries the same time as its self device time, so summing every event would count each kernel twice."""
    return sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e3


def sync_sites(events: list) -> list[dict]:
    """Where a step's host syncs and value reads come from: each call site (the innermost ``SITE_FRAMES`` Python
    frames of the methods' own code and the benchmark scripts, from a profile recorded with stacks; the profiler
    names a frame by its path within its package) with its count and the host's own time there (for a sync, the
    wait)."""
    keys = SYNCS + ("aten::_local_scalar_dense",)
    sites: dict[tuple, dict] = {}
    for event in events:
        if event.name not in keys:
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None and len(frames) < SITE_FRAMES:
            file = parent.name.split(".py(")[0] if ".py(" in parent.name else None
            if file is not None and (file.startswith(SITE_PACKAGES) or "/" not in file):
                frames.append(parent.name)
            parent = parent.cpu_parent
        site = sites.setdefault((event.name, *frames), {"op": event.name, "calls": 0, "ms": 0.0, "stack": frames})
        site["calls"] += 1
        site["ms"] += event.self_cpu_time_total / 1e3
    return sorted(sites.values(), key=lambda site: site["ms"], reverse=True)


def sync_lines(step: Callable[[], None], device: torch.device) -> list[dict]:
    """CUDA only: the Python lines whose calls synchronised the host with the device in one more step, each with
    its count (torch's sync debug mode warns at each such call, from the line that made it)."""
    if device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = Counter(f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message))
    return [{"line": line, "calls": calls} for line, calls in lines.most_common()]


def profile_one(cfg: dict) -> dict:
    """One variant in this process: step times, then one profiled step's totals and top operators."""
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    build = scifact_step if cfg["shape"] == "scifact" else llm_step
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16"):
        step, module, engine = build(cfg, device)
        times = timed_steps(step, module, sync, 2 + cfg["steps"])  # two warm-ups first
        module.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            sync()
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(host_events(events), key=lambda e: getattr(e, by), reverse=True)[:cfg["top"]]
    host_top = sorted(host_events(events), key=lambda e: e.self_cpu_time_total, reverse=True)[:cfg["top"]]
    module.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=activities, with_stack=True) as stacked:
        step()
        sync()
    out = {**cfg, "step_s": statistics.median(times[2:]), "step_times_s": times[2:],
           "device_busy_ms": device_busy_ms(events) if device.type == "cuda" else None,
           "host_ops_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
           "kernel_launches": sum(count.get(k, 0) for k in LAUNCHES), "host_syncs": sum(count.get(k, 0) for k in SYNCS),
           "local_scalar_reads": count.get("aten::_local_scalar_dense", 0),
           "top_ops": [{"op": e.key, "ms": getattr(e, by) / 1e3, "calls": e.count} for e in top],
           "top_host_ops": [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in host_top],
           "sync_sites": sync_sites(stacked.events())}
    module.zero_grad(set_to_none=True)
    out["sync_lines"] = sync_lines(step, device)
    if engine is not None and engine.last_step is not None:
        out.update(chunks=engine.last_step.chunks, kept=engine.last_step.kept)
    return out


# the flags that size a run, and the command of the committed profile-step-cpu.json (benchmarks/README.md)
SIZING = ("shape", "small", "tiny", "variants", "precision", "batch", "chunk", "query_length", "passage_length",
          "steps", "top")
COMMITTED = (("--batch", "32", "--chunk", "8", "--passage-length", "128", "--steps", "2"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--shape", choices=("scifact", "llm"), default="scifact",
                   help="scifact or llm: bench_llm.py's LoRA decoder on random tokens (no peers)")
    p.add_argument("--small", action="store_true", help="the llm shape's 4-layer CPU model instead of Qwen2-0.5B's")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="bf16: autocast")
    p.add_argument("--batch", type=int, default=32, help="queries per step (passages: twice as many)")
    p.add_argument("--chunk", type=int, default=8, help="rows per chunk")
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--passage-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps before the profiled one")
    p.add_argument("--top", type=int, default=12, help="operators listed per variant")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per process")
    p.add_argument("--tiny", action="store_true", help="a tiny random BERT instead of all-MiniLM-L6-v2 (smoke runs)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help=output_help("profile-step-DEVICE"))
    args = p.parse_args(argv)
    if args.one is None and min(args.batch, args.chunk, args.query_length, args.passage_length, args.steps,
                                args.top) < 1:
        raise DprGcError("--batch, --chunk, --query-length, --passage-length, --steps and --top must be positive")
    if args.one is None and (args.small or args.tiny) and args.shape != ("llm" if args.small else "scifact"):
        raise DprGcError("--small belongs to --shape llm, --tiny to --shape scifact: give the shape that matches")
    if args.one is None and args.device == "cuda" and not torch.cuda.is_available():
        raise DprGcError("--device cuda: torch sees no CUDA device on this machine; run it where one is, or drop "
                         "the flag for the CPU")
    args.output = default_output(f"profile-step-{args.device}", p.parse_args, args, SIZING, COMMITTED)
    return args


def run(args: argparse.Namespace) -> dict:
    """Every variant whose package is installed, each in a fresh process, written after each."""
    peers, notes = available_peers([VARIANTS[v]["method"] for v in args.variants if v in ("luyug", "cmnrl")])
    report = {"machine": machine_info(args.device, args.threads), "settings": vars(args), "notes": notes, "runs": []}
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        model = shape_model(args.shape, args.small, args.tiny, Path(tmp))
        for name in args.variants:
            if name in ("luyug", "cmnrl") and (args.shape == "llm" or VARIANTS[name]["method"] not in peers):
                continue
            cfg = {"variant": name, **VARIANTS[name], "shape": args.shape, "small": args.small, "model": model,
                   "input": "uneven", "batch": args.batch, "chunk": args.chunk, "q_len": args.query_length,
                   "p_len": args.passage_length, "device": args.device, "threads": args.threads, "steps": args.steps,
                   "seed": args.seed, "precision": args.precision, "top": args.top, "mmap_threshold": 0}
            out = run_child(__file__, cfg, child_env(cfg), args.timeout)
            logger.info("%s: %s", name, out.get("error") or summary_line(out))
            report["runs"].append(out)
            write_json(Path(args.output), report)
    return report


def summary_line(out: dict) -> str:
    busy = "" if out["device_busy_ms"] is None else f", device busy {out['device_busy_ms']:.0f} ms"
    return (f"{out['step_s']:.3f} s/step{busy}, host ops {out['host_ops_ms']:.0f} ms, {out['kernel_launches']} "
            f"launches, {out['host_syncs']} syncs, {out['local_scalar_reads']} scalar reads")


def summary_items(runs: list[dict]) -> dict[str, str]:
    """The closing table's rows: each variant's step, launches and syncs (:func:`summary_line`) and its speed against
    plain training's where both ran."""
    plain = next((r for r in runs if r.get("variant") == "plain" and "error" not in r), None)
    items = {}
    for out in runs:
        if "error" in out:
            items[out["variant"]] = f"failed: {out['error']}"
            continue
        items[out["variant"]] = summary_line(out)
        if plain is not None and out is not plain:
            items[out["variant"]] += f", {plain['step_s'] / out['step_s']:.2f}x plain's speed"
    return items


def main(argv: Optional[list[str]] = None) -> int:
    def go() -> None:
        started = time.perf_counter()
        args = parse_args(argv)
        if args.one:
            print(RESULT_TAG + json.dumps(profile_one(json.loads(args.one))), flush=True)
            return
        setup_logging()
        report = run(args)
        logger.info("wrote %s", args.output)
        print(summary_table(summary_items(report["runs"]), args.output, report["machine"],
                            time.perf_counter() - started))
    return report_errors(go)


if __name__ == "__main__":
    sys.exit(main())
