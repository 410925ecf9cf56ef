"""Benchmark: the host time a cached step adds to plain training when the step is bound by the host, not arithmetic.

A GPU step of a deep LoRA decoder in small chunks waits on the host: every operator, every walk of the model's
modules, every hook. This measures that overhead where it can be seen on any machine: bench_llm.py's 256-wide
Qwen2-shaped LoRA retriever with ``--layers`` layers (24, as Qwen2-0.5B: about 2,000 modules with the adapters) on
rows of a few tokens, so the arithmetic is negligible, bf16 autocast, one thread. Plain training (one graph) and
dpr-gc at a budget for the whole batch (the same two graphs, one per model) alternate step by step in one process,
the order swapped every step; the medians after two warm-ups, their ratio, and the garbage collections that ran in
each variant's steps (count and time) go to a results file.

    python benchmarks/host_overhead.py                      # benchmarks/results/host-overhead-cpu.json
    python benchmarks/host_overhead.py --layers 4 --steps 40
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_llm  # noqa: E402
from bench_gradcache import machine_info  # noqa: E402
from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402

logger = logging.getLogger("host_overhead")
WHOLE_BATCH = 10**15


def steps(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """The two steps on one model and batch: ``plain`` and ``whole`` (dpr-gc, a budget for the whole batch)."""
    shape = dict(bench_llm.SMALL, num_hidden_layers=args.layers)
    retriever = bench_llm.build_shape(shape, lora_r=16, device=torch.device("cpu"))
    vocab = shape["vocab_size"]
    q = bench_llm.random_batch(args.rows, args.query_length, vocab, 1)
    p = bench_llm.random_batch(2 * args.rows, args.passage_length, vocab, 2)
    loss_fn = SimpleContrastiveLoss(1)
    engine = GradCache([retriever, retriever], args.rows, loss_fn, memory_budget=WHOLE_BATCH,
                       chunking=Chunking(sort_by_length=True))

    def plain() -> None:
        loss_fn(retriever(kind="query", **q).float(), retriever(kind="passage", **p).float()).backward()

    def whole() -> None:
        engine(dict(q, kind="query"), dict(p, kind="passage"))

    def timed(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            retriever.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                step()
        return run

    return {"plain": timed(plain), "whole": timed(whole)}


class Collections:
    """A ``gc.callbacks`` entry: the cyclic garbage collections started while it is registered, and their time."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.count, self._start = self.count + 1, time.perf_counter()
        elif self._start is not None:
            self.seconds, self._start = self.seconds + time.perf_counter() - self._start, None


def measure(args: argparse.Namespace) -> dict:
    """Alternate the two steps ``--steps`` times each (order swapped every step); medians after two warm-ups, and
    the garbage collections that ran inside each variant's timed steps."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    variants, times = steps(args), {"plain": [], "whole": []}
    collections = {"plain": Collections(), "whole": Collections()}
    for i in range(args.steps + 2):
        for name in ("plain", "whole") if i % 2 else ("whole", "plain"):
            if i >= 2:
                gc.callbacks.append(collections[name])
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
            if i >= 2:
                gc.callbacks.remove(collections[name])
    medians = {name: statistics.median(t[2:]) for name, t in times.items()}
    return {"plain_ms": 1e3 * medians["plain"], "whole_ms": 1e3 * medians["whole"],
            "overhead_ms": 1e3 * (medians["whole"] - medians["plain"]),
            "whole_vs_plain": medians["whole"] / medians["plain"], "step_times_s": times,
            "collections_per_step": {name: c.count / args.steps for name, c in collections.items()},
            "collection_ms_per_step": {name: 1e3 * c.seconds / args.steps for name, c in collections.items()}}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="decoder layers (default 24, as Qwen2-0.5B)")
    p.add_argument("--rows", type=int, default=2, help="queries per step (passages: twice as many; default 2)")
    p.add_argument("--query-length", type=int, default=4)
    p.add_argument("--passage-length", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="timed steps per variant (default 24)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "host-overhead-cpu.json"))
    args = p.parse_args(argv)
    for flag in ("layers", "rows", "query_length", "passage_length", "steps", "threads"):
        if getattr(args, flag) < 1:
            raise DprGcError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a positive integer")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    def go() -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
        args = parse_args(argv)
        result = measure(args)
        write_json(Path(args.output), {"machine": machine_info("cpu", args.threads), "settings": vars(args),
                                       "result": result})
        gcs = ", ".join(f"{name} {n:.1f} ({result['collection_ms_per_step'][name]:.1f} ms)"
                        for name, n in result["collections_per_step"].items())
        print(f"plain {result['plain_ms']:.1f} ms, dpr-gc whole batch {result['whole_ms']:.1f} ms: "
              f"{result['overhead_ms']:+.1f} ms a step ({result['whole_vs_plain']:.3f}x); garbage collections a step: "
              f"{gcs}; written {args.output}")
    return report_errors(go)


if __name__ == "__main__":
    sys.exit(main())
