"""Benchmark: a whole-batch budget's step with the engine's limit on joined chunks and without, beside plain training.

Under a memory budget the engine joins consecutive chunks into larger ones; on the CPU a joined chunk stops at
``JOINED_CHUNK_MAX_TOKENS`` tokens (benchmarks/chunk_cost.py measures why: larger chunks run slower per token).
This script measures what the limit buys in a whole step: bench_frontier.py's SciFact step (all-MiniLM-L6-v2,
claims and cited abstracts, one hard negative, chunks grouped by length) at a budget that holds the whole batch's
graphs, once with the engine's limit and once with none, and plain training (one graph) beside them. Every
configuration runs in a fresh process; the order of the three rotates from round to round; a configuration's
figure is the median over its rounds of its per-round median step. Children run with glibc's own mmap threshold
(``--mmap-threshold 0``, as ``dpr-gc train`` does) unless told otherwise.

    python benchmarks/join_limit.py --passage-lengths 128 256 --precisions fp32 bf16 --rounds 2
    python benchmarks/join_limit.py --also-limits 2048     # and a whole-batch step at another limit beside them
    python benchmarks/join_limit.py --also-overheads 1024  # ... at another chunk overhead (how readily chunks join)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_frontier import OURS, PLAIN, launch, shape_model  # noqa: E402
from bench_common import default_output, output_help, parser, setup_logging  # noqa: E402
from bench_gradcache import machine_info  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.engine.grad_cache import (CHUNK_OVERHEAD_TOKENS, DEFAULT_CHUNK_OVERHEAD_TOKENS,  # noqa: E402
                                      JOINED_CHUNK_MAX_TOKENS)

logger = logging.getLogger("join_limit")
WHOLE_BATCH = 10**15
# the flags that size a grid run (a script's own, e.g. --also-limits, add variants beside these)
GRID_SIZING = ("passage_lengths", "precisions", "batch", "chunk", "query_length", "steps", "rounds", "tiny", "shape",
               "small")
VARIANTS = {"plain": {"method": PLAIN, "budget": None},
            "limited": {"method": OURS, "budget": WHOLE_BATCH},
            "unlimited": {"method": OURS, "budget": WHOLE_BATCH, "joined_max_tokens": None}}


def grid_parser(description: str, name: str) -> argparse.ArgumentParser:
    """The flags of a grid of passage lengths x precisions, each variant in fresh processes (shared with
    embedding_grads.py and frozen_casts.py); results go to ``benchmarks/results/NAME-DEVICE.json`` by default
    (``NAME-DEVICE-quick.json`` for a run of other sizes than the committed one, see :func:`check_grid_args`)."""
    p = parser(description)
    p.set_defaults(results_name=name)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every variant runs")
    p.add_argument("--passage-lengths", type=int, nargs="+", default=[128, 256], help="passage max lengths")
    p.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                   help="fp32 and/or bf16 autocast")
    p.add_argument("--batch", type=int, default=32, help="queries per step (passages: twice as many)")
    p.add_argument("--chunk", type=int, default=8, help="rows per chunk before joining")
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=2, help="timed steps per process, after two warm-ups")
    p.add_argument("--rounds", type=int, default=2, help="processes per configuration")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per process")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="MALLOC_MMAP_THRESHOLD_ for the children (0: glibc's dynamic threshold)")
    p.add_argument("--tiny", action="store_true", help="a tiny random BERT instead of all-MiniLM-L6-v2 (smoke runs; "
                   "with --shape scifact, as the llm shape's small model is --small)")
    p.add_argument("--shape", choices=("scifact", "llm"), default="scifact",
                   help="bench_frontier.py's shape: scifact (MiniLM on SciFact text) or llm (LoRA decoder, random ids)")
    p.add_argument("--small", action="store_true", help="the llm shape's 4-layer CPU size")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help=output_help(f"{name}-DEVICE"))
    return p


def check_grid_args(p: argparse.ArgumentParser, argv: Optional[list[str]],
                    committed: tuple[tuple[str, ...], ...] = ((),)) -> argparse.Namespace:
    """The grid's flags read from ``argv`` and checked; the results file ``NAME-DEVICE.json`` for a run sized as one
    of the ``committed`` commands (those of the committed file; the defaults unless given), else the ``-quick`` one."""
    args = p.parse_args(argv)
    if min(args.passage_lengths + [args.batch, args.chunk, args.query_length, args.steps, args.rounds]) < 1:
        raise DprGcError("--passage-lengths, --batch, --chunk, --query-length, --steps and --rounds must be positive")
    if args.small and args.shape != "llm":
        raise DprGcError("--small: the 4-layer size belongs to the llm shape; add --shape llm or drop --small")
    if args.tiny and args.shape == "llm":
        raise DprGcError("--tiny: the tiny random BERT is the scifact shape's; for a small llm shape give --small")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DprGcError("--device cuda: torch sees no CUDA device on this machine; run it where one is, or drop "
                         "the flag for the CPU")
    if args.mmap_threshold < 0:
        raise DprGcError(f"--mmap-threshold {args.mmap_threshold}: give a size in bytes, or 0 for glibc's own "
                         "threshold")
    args.output = default_output(f"{args.results_name}-{args.device}", p.parse_args, args, GRID_SIZING, committed)
    return args


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = grid_parser(__doc__.splitlines()[0], "join-limit")
    p.add_argument("--also-limits", type=int, nargs="+", default=[], metavar="TOKENS",
                   help="more join limits to run beside the engine's and none (each a variant limit-TOKENS)")
    p.add_argument("--also-overheads", type=int, nargs="+", default=[], metavar="TOKENS",
                   help="chunk overheads to run beside the engine's (each a variant overhead-TOKENS): a chunk joins "
                        "the next while the padding it adds stays under this many tokens per chunk saved")
    args = check_grid_args(p, argv)
    for flag, values in (("--also-limits", args.also_limits), ("--also-overheads", args.also_overheads)):
        if any(n < 1 for n in values):
            raise DprGcError(f"{flag} {' '.join(map(str, values))}: give positive token counts")
    return args


def variants_of(args: argparse.Namespace) -> dict[str, dict]:
    """Plain, the engine's limit, none, a ``limit-N`` variant for each of ``--also-limits`` and an ``overhead-N``
    variant (the engine's limit, another chunk overhead) for each of ``--also-overheads``."""
    return VARIANTS | {f"limit-{n}": {"method": OURS, "budget": WHOLE_BATCH, "joined_max_tokens": n}
                       for n in args.also_limits} | {
        f"overhead-{n}": {"method": OURS, "budget": WHOLE_BATCH, "chunk_overhead_tokens": n}
        for n in args.also_overheads}


def medians(runs: dict[str, list[dict]]) -> dict:
    """Per variant: the median step and peak over its rounds (errors kept as they are)."""
    out: dict = {}
    for name, rounds in runs.items():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            out[name] = {"error": rounds[-1]["error"] if rounds else "no round ran"}
            continue
        out[name] = {"step_s": statistics.median(r["step_s"] for r in ok),
                     "peak_mb": statistics.median(r["peak_mb"] for r in ok),
                     "chunks": ok[-1].get("chunks"), "kept_chunks": ok[-1].get("kept_chunks"),
                     "rounds": [{k: r.get(k) for k in ("step_s", "step_times_s", "peak_mb")} for r in ok]}
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each variant's medians; the ratios between them."""
    out = medians(runs)
    if all("step_s" in out.get(name, {}) for name in VARIANTS):
        limited = out["limited"]["step_s"]
        out["speedup_of_the_limit"] = out["unlimited"]["step_s"] / limited
        out["limited_vs_plain"] = out["plain"]["step_s"] / limited
        out["unlimited_vs_plain"] = out["plain"]["step_s"] / out["unlimited"]["step_s"]
        for name in runs:
            if name.startswith(("limit-", "overhead-")) and "step_s" in out[name]:
                out[f"{name}_vs_limited"] = out[name]["step_s"] / limited
    return out


def measure(base: dict, args: argparse.Namespace, variants: dict[str, dict],
            progress: Callable[[dict[str, list[dict]]], None] = lambda runs: None) -> dict[str, list[dict]]:
    """Every variant of one passage length and precision, ``--rounds`` times in rotating order; ``progress`` sees
    the runs so far after each."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            out = launch({**base, **variants[name]}, args.timeout)
            logger.info("%s %s %s round %d: %s", base["p_len"], base["precision"], name, rnd + 1,
                        out.get("error") or f"{out['step_s']:.2f} s/step, peak {out['peak_mb']:.0f} MB, "
                                            f"{out.get('chunks', '-')} chunks")
            runs[name].append(out)
            progress(runs)
    return runs


def run_grid(args: argparse.Namespace, report: dict, variants: dict[str, dict],
             summary: Callable[[dict[str, list[dict]]], dict]) -> dict:
    """Every passage length x precision of ``args`` into ``report["runs"]``, written after each process (a run cut
    short keeps what it finished)."""
    report["runs"] = []
    with tempfile.TemporaryDirectory(prefix="grid_") as tmp:
        model = shape_model(args.shape, args.small, args.tiny, Path(tmp))
        for length in args.passage_lengths:
            for precision in args.precisions:
                base = {"shape": args.shape, "model": model, "input": "uneven", "batch": args.batch,
                        "chunk": args.chunk, "q_len": args.query_length, "p_len": length, "small": args.small,
                        "device": args.device, "threads": args.threads, "steps": args.steps, "seed": args.seed,
                        "mmap_threshold": args.mmap_threshold, "precision": precision}
                report["runs"].append({})

                def progress(runs: dict[str, list[dict]]) -> None:
                    report["runs"][-1] = {"passage_length": length, "precision": precision, **summary(runs)}
                    write_json(Path(args.output), report)

                measure(base, args, variants, progress)
    logger.info("wrote %s", args.output)
    return report


def run(argv: Optional[list[str]]) -> None:
    args = parse_args(argv)
    report = {"benchmark": "a whole-batch budget with and without the CPU join limit, and plain training",
              "machine": machine_info(args.device, args.threads), "settings": dict(vars(args)),
              "engine_joined_chunk_max_tokens": JOINED_CHUNK_MAX_TOKENS.get(args.device),
              "engine_chunk_overhead_tokens": CHUNK_OVERHEAD_TOKENS.get(args.device, DEFAULT_CHUNK_OVERHEAD_TOKENS)}
    run_grid(args, report, variants_of(args), summarize)
    others = [f"limit-{n}" for n in args.also_limits] + [f"overhead-{n}" for n in args.also_overheads]
    print("| passage tokens | precision | plain s | limited s (chunks) | unlimited s (chunks) | limit's speed-up |"
          + "".join(f" {name} s (chunks) |" for name in others)
          + "\n|---:|---|---:|---:|---:|---:|" + "---:|" * len(others))
    for r in report["runs"]:
        if "speedup_of_the_limit" in r:
            print(f"| {r['passage_length']} | {r['precision']} | {r['plain']['step_s']:.2f} | "
                  f"{r['limited']['step_s']:.2f} ({r['limited']['chunks']}) | {r['unlimited']['step_s']:.2f} "
                  f"({r['unlimited']['chunks']}) | {r['speedup_of_the_limit']:.2f} |"
                  + "".join(f" {r[name]['step_s']:.2f} ({r[name]['chunks']}) |" if "step_s" in r.get(name, {})
                            else " - |" for name in others))


def grid_main(run_script: Callable[[Optional[list[str]]], None], argv: Optional[list[str]]) -> int:
    """A grid script's entry: timestamped log lines, dependencies quiet, a bad flag as one error line (exit 2)."""
    setup_logging()
    return report_errors(lambda: run_script(argv))


def main(argv: Optional[list[str]] = None) -> int:
    return grid_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
