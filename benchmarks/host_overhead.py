"""Benchmark: the host time a cached step adds to plain training when the step is bound by the host, not arithmetic.

A GPU step of a deep LoRA decoder in small chunks waits on the host: every operator, every walk of the model's
modules, every hook. This measures that overhead where it can be seen on any machine: bench_llm.py's 256-wide
Qwen2-shaped LoRA retriever with ``--layers`` layers (24, as Qwen2-0.5B: about 2,000 modules with the adapters) on
rows of a few tokens, so the arithmetic is negligible, bf16 autocast (``--precision fp32``: none; on a CPU without
native bf16 the emulated bf16 arithmetic, not the host, is the bound), one thread; or, with ``--device cuda``, on
a GPU (``--shape qwen2-0.5b`` for Qwen2-0.5B's widths), each step synchronised. The variants (``--variants``)
alternate step by step in one process, the order reversed every step:

* ``plain``: plain training, one graph per model input;
* ``whole``: dpr-gc at a budget for the whole batch (the same two graphs, measured by the graph meter);
* ``whole-unmetered``: the same with the graph meter replaced by one that records nothing, an ablation that shows
  what the meter's saved-tensor hooks cost (not a mode of the engine: the budget holds everything either way);
* ``whole-hooks``: the same with saved-tensor hooks that only detach each tensor, as the meter's do, and record
  nothing: PyTorch's cost of a hook per saved tensor, apart from the meter's record of it;
* ``whole-allocator`` (``--device cuda`` only): the same with each graph measured by the CUDA caching allocator (the
  bytes a forward leaves allocated) instead of hooks, and its kept bytes beside the hooks' (``graph_bytes``);
* ``budget0``: dpr-gc at budget 0, ``--chunk`` rows per chunk (only the last chunk's graph kept);
* ``grad_cache-original``: luyug/GradCache at ``--chunk`` rows (installed by hand; its own loss on the same scores).

The medians after two warm-ups (wall and process CPU time), their ratio to ``plain`` (also paired: the median of
the ratios within one round, see :func:`paired_ratios`), and the garbage collections that ran in each variant's steps
(count and time) go to a results file.

    python benchmarks/host_overhead.py                      # benchmarks/results/host-overhead-cpu.json
    python benchmarks/host_overhead.py --layers 4 --steps 40
    python benchmarks/host_overhead.py --precision fp32 --variants plain,whole,whole-unmetered,budget0
    python benchmarks/host_overhead.py --device cuda --shape qwen2-0.5b --rows 32 --query-length 32 \
        --passage-length 256 --variants plain,whole,whole-unmetered,whole-hooks,whole-allocator --steps 6
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_llm  # noqa: E402
from bench_gradcache import ORIGINAL, machine_info, original_version  # noqa: E402
from bench_common import default_output, output_help, parser, setup_logging  # noqa: E402
from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.base.tables import markdown_table  # noqa: E402
from dpr_gc.engine import grad_cache as engine_module  # noqa: E402

logger = logging.getLogger("host_overhead")
WHOLE_BATCH = 10**15
VARIANTS = ("plain", "whole", "whole-unmetered", "whole-hooks", "whole-allocator", "budget0", ORIGINAL)


class UnmeteredGraph:
    """A graph meter that records nothing (``whole-unmetered``): no saved-tensor hooks, every graph 1 byte (not 0:
    the engine joins a model's chunks only once it has measured some bytes per token)."""

    def __init__(self, exclude: set[int]) -> None:
        del exclude
        self.weight_copies: dict = {}

    def __enter__(self) -> "UnmeteredGraph":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def nbytes(self, output: Optional[torch.Tensor] = None) -> int:
        return 1


class HookedGraph(UnmeteredGraph):
    """A graph meter whose saved-tensor hooks only detach each tensor (``whole-hooks``), recording nothing."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__(exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, lambda t: t)

    def __enter__(self) -> "HookedGraph":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class AllocatorGraph(UnmeteredGraph):
    """A graph meter that reads the CUDA caching allocator instead of hooking saved tensors (``whole-allocator``):
    the bytes allocated during the forward and still held after it, its output included. Autocast's weight copies
    fall to the first chunk that makes them, and FSDP's root keeps its gathered weights: a benchmark-only ablation
    to weigh an allocator count against the hooks on a GPU, not a mode of the engine."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__(exclude)
        self.start = self.held = 0

    def __enter__(self) -> "AllocatorGraph":
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.held = torch.cuda.memory_allocated() - self.start

    def nbytes(self, output: Optional[torch.Tensor] = None) -> int:
        return max(1, self.held)


def original_step(retriever: Any, chunk: int, q: dict, p: dict) -> Callable[[], None]:
    """luyug/GradCache on the tied decoder at ``chunk`` rows, its loss over the retriever's temperature (the scores
    dpr-gc's scaled representations give)."""
    from grad_cache import GradCache as OriginalGradCache
    from grad_cache.loss import SimpleContrastiveLoss as OriginalLoss

    encoder, loss = retriever.query_encoder, OriginalLoss(n_hard_negatives=1)
    temperature = float(retriever.temperature)
    engine = OriginalGradCache([encoder, encoder], chunk, lambda x, y: loss(x / temperature, y))
    return lambda: engine.cache_step(q, p)


def steps(args: argparse.Namespace) -> tuple[dict[str, Callable[[], None]], dict[str, GradCache]]:
    """The ``--variants`` steps on one model and batch, each zeroing the gradients first, and dpr-gc's engines."""
    shape = dict(bench_llm.QWEN2_05B if args.shape == "qwen2-0.5b" else bench_llm.SMALL, num_hidden_layers=args.layers)
    device = torch.device(args.device)
    retriever = bench_llm.build_shape(shape, lora_r=16, device=device)
    vocab = shape["vocab_size"]
    q = {k: v.to(device) for k, v in bench_llm.random_batch(args.rows, args.query_length, vocab, 1).items()}
    p = {k: v.to(device) for k, v in bench_llm.random_batch(2 * args.rows, args.passage_length, vocab, 2).items()}
    loss_fn = SimpleContrastiveLoss(1)

    engines = {}

    def engine(name: str, budget: int, chunk: int) -> Callable[[], None]:
        cache = engines[name] = GradCache([retriever, retriever], chunk, loss_fn, memory_budget=budget,
                                          chunking=Chunking(sort_by_length=True))
        return lambda: cache(dict(q, kind="query"), dict(p, kind="passage"))

    def plain() -> None:
        loss_fn(retriever(kind="query", **q).float(), retriever(kind="passage", **p).float()).backward()

    def metered_by(meter: type, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with mock.patch.object(engine_module, "GraphMeter", meter):
                step()
        return run

    built = {"plain": lambda: plain, "whole": lambda: engine("whole", WHOLE_BATCH, args.rows),
             "whole-unmetered": lambda: metered_by(UnmeteredGraph, engine("whole-unmetered", WHOLE_BATCH, args.rows)),
             "whole-hooks": lambda: metered_by(HookedGraph, engine("whole-hooks", WHOLE_BATCH, args.rows)),
             "whole-allocator": lambda: metered_by(AllocatorGraph, engine("whole-allocator", WHOLE_BATCH, args.rows)),
             "budget0": lambda: engine("budget0", 0, args.chunk),
             ORIGINAL: lambda: original_step(retriever, args.chunk, q, p)}
    return {name: timed(built[name](), retriever, args.precision, device) for name in args.variants}, engines


def timed(step: Callable[[], None], model: torch.nn.Module, precision: str, device: torch.device) -> Callable[[], None]:
    """``step`` after zeroing ``model``'s gradients, under bf16 autocast unless ``precision`` is fp32; on CUDA the
    device has finished the step when it returns."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


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
    """Alternate the variants ``--steps`` times each (order reversed every step); medians after two warm-ups, their
    ratio to ``plain``, and the garbage collections that ran inside each variant's timed steps."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    variants, engines = steps(args)
    wall, cpu = {name: [] for name in variants}, {name: [] for name in variants}
    collections = {name: Collections() for name in variants}
    for i in range(args.steps + 2):
        for name in list(variants) if i % 2 else list(variants)[::-1]:
            with counted(collections[name], i >= 2):
                start, start_cpu = time.perf_counter(), time.process_time()
                variants[name]()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    ms = {name: 1e3 * statistics.median(t[2:]) for name, t in wall.items()}
    cpu_ms = {name: 1e3 * statistics.median(t[2:]) for name, t in cpu.items()}
    return {"ms": ms, "cpu_ms": cpu_ms,
            "vs_plain": {name: ms[name] / ms["plain"] for name in ms} if "plain" in ms else {},
            "paired_vs_plain": paired_ratios(cpu) if "plain" in cpu else {},
            "step_times_s": wall, "step_cpu_times_s": cpu,
            "chunks": {name: cache.last_step.brief() for name, cache in engines.items()},
            "graph_bytes": {name: {"kept": cache.last_step.kept_bytes, "largest": cache.last_step.largest_graph}
                            for name, cache in engines.items()},
            "collections_per_step": {name: c.count / args.steps for name, c in collections.items()},
            "collection_ms_per_step": {name: 1e3 * c.seconds / args.steps for name, c in collections.items()}}


def paired_ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Per variant, the median over the timed rounds of its CPU time over plain training's in the same round: steps
    a few seconds apart share the machine's state (clock, neighbours' load), which drifts by a quarter over a run on
    a shared virtual machine, so this ratio is steadier than the ratio of the medians."""
    return {name: statistics.median(a / b for a, b in zip(t[2:], times["plain"][2:])) for name, t in times.items()}


@contextlib.contextmanager
def counted(collections: Collections, timed_step: bool) -> Iterator[None]:
    """Count the garbage collections of the block in ``collections`` when it is a timed step."""
    if timed_step:
        gc.callbacks.append(collections)
    try:
        yield
    finally:
        if timed_step:
            gc.callbacks.remove(collections)


# the flags that size a run (benchmarks/README.md's runs: the defaults, with their own --output)
SIZING = ("layers", "rows", "query_length", "passage_length", "steps", "shape", "variants", "chunk", "precision")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B has 24)")
    p.add_argument("--rows", type=int, default=2, help="queries per step (passages: twice as many)")
    p.add_argument("--query-length", type=int, default=4)
    p.add_argument("--passage-length", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="timed steps per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast or fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    p.add_argument("--shape", choices=("small", "qwen2-0.5b"), default="small",
                   help="the decoder's width: bench_llm.py's 256-wide shape or Qwen2-0.5B's (--layers layers "
                        "either way)")
    p.add_argument("--variants", default="plain,whole", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--chunk", type=int, default=1, help="rows per chunk of budget0 and the original")
    p.add_argument("--output", default=None, help=output_help("host-overhead-DEVICE"))
    args = p.parse_args(argv)
    args.output = default_output(f"host-overhead-{args.device}", p.parse_args, args, SIZING)
    for flag in ("layers", "rows", "query_length", "passage_length", "steps", "threads", "chunk"):
        if getattr(args, flag) < 1:
            raise DprGcError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a positive integer")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DprGcError("--device cuda: no CUDA device is available here; leave --device out to run on the CPU")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        raise DprGcError(f"--variants {','.join(unknown) or '(none)'}: choose from {', '.join(VARIANTS)}")
    if "whole-allocator" in args.variants and args.device != "cuda":
        raise DprGcError("--variants whole-allocator reads the CUDA caching allocator: give --device cuda")
    if ORIGINAL in args.variants and original_version() is None:
        raise DprGcError(f"--variants {ORIGINAL}: the original GradCache package (module grad_cache) is not "
                         "installed; install it by hand (pip install --no-deps from github.com/luyug/GradCache)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    def go() -> None:
        setup_logging()
        args = parse_args(argv)
        result = measure(args)
        write_json(Path(args.output), {"machine": machine_info(args.device, args.threads), "settings": vars(args),
                                       "result": result})
        header = ("variant", "ms a step", "CPU ms", "vs plain (CPU, paired)", "collections a step (ms)")
        print(markdown_table(header, [
            [name, f"{result['ms'][name]:.1f}", f"{result['cpu_ms'][name]:.1f}",
             f"{result['paired_vs_plain'].get(name, float('nan')):.3f}x",
             f"{result['collections_per_step'][name]:.1f} ({result['collection_ms_per_step'][name]:.1f})"]
            for name in result["ms"]]))
        for name, chunks in result["chunks"].items():
            print(f"{name}: {chunks}")
        print(f"written {args.output}")
    return report_errors(go)


if __name__ == "__main__":
    sys.exit(main())
