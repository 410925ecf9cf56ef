"""Benchmark: the speed-memory frontier of a cached step under a memory budget, against plain training and peers.

For each shape and precision, in fresh processes (so each peak is its own):

1. ``plain``: the whole batch in one graph (the memory ceiling and the speed to beat);
2. ``dpr-gc`` with ``memory_budget`` from 0 (only the last chunk's graph kept) through one chunk's graph up to
   the whole batch's graphs (measured by a probe run that keeps everything), reporting step time, peak memory,
   the share of tokens whose graph was kept and the measured peak graph memory;
3. peers, each at a ladder of chunk sizes: sentence-transformers' ``CachedMultipleNegativesRankingLoss`` and the
   original luyug/GradCache (``grad_cache``; only when installed by hand, otherwise skipped with a note). For every
   dpr-gc budget the best peer is the fastest peer configuration whose peak memory fits dpr-gc's at that budget
   (+5%: the largest chunk that fits the same memory).

Shapes: ``scifact``: all-MiniLM-L6-v2 on SciFact claims -> cited abstracts with one random other abstract as hard
negative (uneven real text; generated text when /work/shared/data/scifact is absent); ``llm``: the Qwen2-shaped
LoRA retriever of bench_llm.py (``--small``: its 4-layer CPU shape) on random token ids of random lengths
(of the peers only luyug/GradCache: CachedMNRL needs a sentence-transformers model). Precisions: fp32 and bf16
autocast (the same outer autocast for every method). Peak memory: bench_gradcache.PeakMemory (CUDA
``max_memory_allocated``; CPU resident-set high-water mark). Results: JSON in benchmarks/results/; the run ends
with a ``| item | value |`` table of each budget's ratios (against plain and the best peer that fits), the results
file and the machine.

    python benchmarks/bench_frontier.py --device cuda --quick          # a few minutes on one GPU
    python benchmarks/bench_frontier.py --batch 32 --chunk 8 --passage-length 128 --small --steps 1   # a CPU run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import (check_choices, default_output, name_list, output_help, parser, require_cuda,  # noqa: E402
                          run_script, setup_logging, summary_table)
from bench_gradcache import (ORIGINAL, RESULT_TAG, TEMPERATURE, PeakMemory, build_inputs, child_env,  # noqa: E402
                             encoder_model, interleave, machine_info, make_step, original_version, run_child,
                             st_version)
from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss  # noqa: E402
from dpr_gc.base.args import positive_int  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import atomic_path, read_json_object, write_json  # noqa: E402
from dpr_gc.engine import frozen_casts, grad_cache, sparse_grads  # noqa: E402

logger = logging.getLogger("bench_frontier")
OURS, PLAIN, ST = "dpr-gc", "plain", "st-cmnrl"
FIT_SLACK = 1.05
SHAPES, PRECISIONS = ("scifact", "llm"), ("fp32", "bf16")


# ----------------------------------------------------------------------------------------------- one configuration
def scifact_step(cfg: dict, device: torch.device) -> tuple[Callable[[], float], Any, Optional[GradCache]]:
    """(step, module, engine) on SciFact text; peers and plain come from bench_gradcache's builders."""
    if cfg["method"] != OURS:
        prepare, tokenizer, module, _ = make_step(cfg, device)
        inputs, _ = build_inputs(cfg, tokenizer, cfg["batch"])
        return prepare(inputs), module, None
    from dpr_gc.model.retriever import Retriever, RetrieverConfig

    config = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", query_max_length=cfg["q_len"],
                             passage_max_length=cfg["p_len"], temperature=TEMPERATURE)
    retriever = Retriever.from_pretrained(cfg["model"], config).to(device).train()
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1, temperature=TEMPERATURE, similarity="cos").to(device)
    engine = GradCache([retriever.query_encoder, retriever.passage_encoder], cfg["chunk"], loss_fn,
                       memory_budget=cfg["budget"], chunking=Chunking(sort_by_length=True))
    inputs, _ = build_inputs(cfg, retriever.tokenizer, cfg["batch"])
    q = {k: v.to(device) for k, v in inputs[0].items()}
    p = {k: v.to(device) for k, v in interleave(inputs[1], inputs[2], retriever.tokenizer.pad_token_id).items()}
    return lambda: float(engine.cache_step(q, p)), retriever, engine


def llm_step(cfg: dict, device: torch.device) -> tuple[Callable[[], float], Any, Optional[GradCache]]:
    """(step, module, engine) on bench_llm.py's LoRA decoder shape and random token batches."""
    from bench_llm import build, random_batch

    retriever = build(argparse.Namespace(small=cfg["small"], lora_r=16), device)
    vocab = retriever.query_encoder.transformer.config.vocab_size
    q = {k: v.to(device) for k, v in random_batch(cfg["batch"], cfg["q_len"], vocab, 1).items()}
    p = {k: v.to(device) for k, v in random_batch(2 * cfg["batch"], cfg["p_len"], vocab, 2).items()}
    loss_fn = SimpleContrastiveLoss(1)
    if cfg["method"] == ORIGINAL:
        return original_llm_step(cfg, retriever, q, p), retriever, None
    if cfg["method"] == PLAIN:
        def plain() -> float:
            loss = loss_fn(retriever(kind="query", **q).float(), retriever(kind="passage", **p).float())
            loss.backward()
            return loss.item()
        return plain, retriever, None
    engine = GradCache([retriever, retriever], cfg["chunk"], loss_fn, memory_budget=cfg["budget"],
                       chunking=Chunking(sort_by_length=True))
    return lambda: float(engine(dict(q, kind="query"), dict(p, kind="passage"))), retriever, engine


def original_llm_step(cfg: dict, retriever: Any, q: dict, p: dict) -> Callable[[], float]:
    """luyug/GradCache's step on the LoRA decoder: its tied encoder (normalised, last-token pooled) as both models,
    at ``cfg["chunk"]`` rows, and its own contrastive loss on the dot products over the retriever's temperature,
    the loss dpr-gc's scaled representations give."""
    from grad_cache import GradCache as OriginalGradCache
    from grad_cache.loss import SimpleContrastiveLoss as OriginalLoss

    encoder, original_loss = retriever.query_encoder, OriginalLoss(n_hard_negatives=1)
    temperature = float(retriever.temperature)
    engine = OriginalGradCache([encoder, encoder], cfg["chunk"], lambda x, y: original_loss(x / temperature, y))
    return lambda: float(engine.cache_step(q, p))


def shape_model(shape: str, small: bool, tiny: bool, folder: Path) -> str:
    """The model a shape's configurations name: the llm shape's decoder size, else :func:`encoder_model`."""
    if shape == "llm":
        return "qwen2-small" if small else "qwen2-0.5b"
    return encoder_model(tiny, folder)


def timed_steps(step: Callable[[], float], module: Any, sync: Callable[[], None], count: int) -> list[float]:
    """Seconds of each of ``count`` steps, gradients freed before each clock starts."""
    times = []
    for _ in range(count):
        module.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def run_one(cfg: dict) -> dict:
    """Two warm-up steps, then ``steps`` timed steps (median) under the precision's autocast, then one more step for
    the peak memory above what is held before it (gradients freed), so one-time costs of the first step and what each
    library's imports hold are not counted. The peak has a step of its own because on the CPU the meter first hands
    the free heap back to the kernel (``malloc_trim``): the step after it faults every page in afresh, which a
    training loop does not pay (up to 1.5x the next step's time)."""
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    if "joined_max_tokens" in cfg:  # join_limit.py's comparison: this device's join limit replaced (None: no limit)
        limits = {k: v for k, v in grad_cache.JOINED_CHUNK_MAX_TOKENS.items() if k != device.type}
        grad_cache.JOINED_CHUNK_MAX_TOKENS = limits | ({} if cfg["joined_max_tokens"] is None
                                                        else {device.type: cfg["joined_max_tokens"]})
    if "chunk_overhead_tokens" in cfg:  # join_limit.py's comparison: this device's chunk overhead replaced
        overheads = {device.type: cfg["chunk_overhead_tokens"]}
        grad_cache.CHUNK_OVERHEAD_TOKENS = grad_cache.CHUNK_OVERHEAD_TOKENS | overheads
    if cfg.get("sparse_embedding_grads") is False:  # embedding_grads.py's comparison: dense gradients on this device
        sparse_grads.SPARSE_EMBEDDING_GRAD_DEVICES = tuple(t for t in sparse_grads.SPARSE_EMBEDDING_GRAD_DEVICES
                                                           if t != device.type)
    if cfg.get("frozen_linear_casts") is False:  # frozen_casts.py's comparison: autocast casts frozen weights per call
        grad_cache.FrozenLinearCasts = lambda models, dtypes, forwards=None: frozen_casts.FrozenLinearCasts(models, {})
    build = scifact_step if cfg["shape"] == "scifact" else llm_step
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16")
    with autocast:
        step, module, engine = build(cfg, device)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        module.zero_grad(set_to_none=True)
        step()
        first = dataclasses.replace(engine.last_step) if engine is not None and engine.last_step else None
        module.zero_grad(set_to_none=True)
        step()  # a second warm-up: from the second step a budget joins chunks (new shapes, new kernels to pick)
        times = timed_steps(step, module, sync, cfg["steps"])
        module.zero_grad(set_to_none=True)
        meter = PeakMemory(device)
        meter.start()
        step()
        sync()
        peak_mb = meter.stop()
    out = {**cfg, "step_s": statistics.median(times), "step_times_s": times, "peak_mb": round(peak_mb, 1),
           "memory_method": meter.method}
    if engine is not None and engine.last_step is not None:
        report = engine.last_step
        out.update(kept_token_share=report.kept_share, kept_graph_mb=report.kept_bytes / 2**20,
                   largest_chunk_graph_mb=report.largest_graph / 2**20, peak_graph_mb=report.peak_graph_bytes / 2**20,
                   chunks=sum(report.chunks), kept_chunks=sum(report.kept), budget_bytes=report.budget)
    if first is not None:  # the first step runs the configured chunks (later ones may join what the budget holds)
        out.update(first_largest_chunk_graph_mb=first.largest_graph / 2**20,
                   first_kept_graph_mb=first.kept_bytes / 2**20)
    return out


def launch(cfg: dict, timeout: int) -> dict:
    return run_child(__file__, cfg, child_env(cfg), timeout)


# ----------------------------------------------------------------------------------------------- the frontier
def budgets(probe: dict, steps: int) -> list[int]:
    """0, one chunk's graph, then evenly up to the whole batch's graphs (``steps`` points above one chunk), as the
    probe's first step measured them with the configured chunks."""
    one, whole = int(probe["first_largest_chunk_graph_mb"] * 2**20), int(probe["first_kept_graph_mb"] * 2**20)
    points = [0, one] + [one + (whole - one) * k // steps for k in range(1, steps + 1)]
    return sorted(set(points))


def ladder(chunk: int, batch: int) -> list[int]:
    sizes, size = [], chunk
    while size < batch:
        sizes.append(size)
        size *= 2
    return sizes + [batch]


def best_fitting_peer(ours: dict, peers: list[dict]) -> Optional[dict]:
    """The fastest peer configuration whose peak memory fits dpr-gc's at this budget (with ``FIT_SLACK``)."""
    fits = [p for p in peers if "error" not in p and p["peak_mb"] <= ours["peak_mb"] * FIT_SLACK]
    return min(fits, key=lambda p: p["step_s"]) if fits else None


def frontier(base: dict, args: argparse.Namespace, peers: list[str]) -> dict:
    """Every configuration of one shape and precision, and the comparisons at each budget."""
    def run(**kw: Any) -> dict:
        cfg = {**base, **kw}
        logger.info("%s %s %s budget %s chunk %s ...", cfg["shape"], cfg["precision"], cfg["method"],
                    cfg.get("budget"), cfg["chunk"])
        out = launch(cfg, args.timeout)
        logger.info("    %s", out.get("error") or f"{out['step_s']:.2f} s/step, peak {out['peak_mb']:.0f} MB")
        return out

    plain = run(method=PLAIN, budget=None)
    probe = run(method=OURS, budget=10**15)
    if "error" in probe:
        return {"plain": plain, "ours": [probe], "peers": [], "comparison": []}
    ours = [run(method=OURS, budget=b) for b in budgets(probe, 2 if args.quick else 4)[:-1]] + [probe]
    peer_rows = [run(method=m, budget=None, chunk=c) for m in peers for c in ladder(base["chunk"], base["batch"])]
    comparison = []
    for row in ours:
        if "error" in row:
            continue
        best = best_fitting_peer(row, peer_rows)
        comparison.append({
            "budget_mb": row["budget"] / 2**20 if row["budget"] < 10**15 else "whole batch",
            "kept_token_share": row["kept_token_share"], "step_s": row["step_s"], "peak_mb": row["peak_mb"],
            "speedup_vs_plain": plain["step_s"] / row["step_s"] if "error" not in plain else None,
            "memory_vs_plain": row["peak_mb"] / plain["peak_mb"] if "error" not in plain and plain["peak_mb"] else None,
            "best_peer": None if best is None else f"{best['method']} chunk {best['chunk']}",
            "speedup_vs_best_peer": None if best is None else best["step_s"] / row["step_s"]})
    return {"plain": plain, "ours": ours, "peers": peer_rows, "comparison": comparison}


def summary_items(runs: list[dict]) -> dict[str, str]:
    """The closing table's rows: each shape, precision and budget's speed and memory against plain training and its
    speed against the fastest peer that fits its memory."""
    items = {}
    for run in runs:
        name = f"{run['shape']} {run['precision']}"
        if not run.get("comparison"):
            failed = [r["error"] for r in [run.get("plain") or {}, *run.get("ours", [])] if "error" in r]
            items[name] = f"no budget ran: {failed[-1]}" if failed else "no budget ran"
        for row in run.get("comparison", []):
            budget = row["budget_mb"] if isinstance(row["budget_mb"], str) else f"{row['budget_mb']:.3g} MB"
            parts = [f"{row[k]:.2f}x plain's {what}" for k, what in (("speedup_vs_plain", "speed"),
                                                                     ("memory_vs_plain", "memory")) if row[k]]
            if row["best_peer"]:
                parts.append(f"{row['speedup_vs_best_peer']:.2f}x {row['best_peer']}'s speed")
            items[f"{name} budget {budget}"] = ", ".join(parts) or f"{row['step_s']:.2f} s/step"
    return items


def plot(report: dict, path: Path) -> Path:
    """A PNG beside the results: step time against peak memory for every shape and precision, one series per
    method (dpr-gc over its budgets, each peer over its chunk sizes, plain training as one point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        series = {"dpr-gc (memory budget)": run["ours"]}
        for row in run["peers"]:
            series.setdefault(f"{row['method']} (chunk size)", []).append(row)
        for label, rows in series.items():
            rows = sorted((r for r in rows if "error" not in r), key=lambda r: r["peak_mb"])
            ax.plot([r["peak_mb"] for r in rows], [r["step_s"] for r in rows], marker="o", label=label)
        if "error" not in run["plain"]:
            ax.plot([run["plain"]["peak_mb"]], [run["plain"]["step_s"]], marker="*", markersize=12, linestyle="",
                    label="plain (whole batch)")
        ax.set_title(f"{run['shape']}, {run['precision']}")
        ax.set_xlabel("peak memory (MiB)")
        ax.set_ylabel("seconds per step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    machine = report["machine"]
    fig.suptitle(f"speed-memory frontier: {machine.get('gpu') or machine.get('cpu')}, {machine.get('date', '')[:10]}")
    fig.tight_layout()
    png = path.with_suffix(".png")
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return png


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--shapes", default="scifact,llm", help=",".join(SHAPES))
    p.add_argument("--precisions", default="fp32,bf16", help="fp32,bf16 (bf16: autocast)")
    p.add_argument("--batch", type=positive_int, default=128, help="queries per step (passages: twice as many)")
    p.add_argument("--chunk", type=positive_int, default=32, help="rows per chunk (dpr-gc; the smallest peer chunk)")
    p.add_argument("--query-length", type=positive_int, default=32)
    p.add_argument("--passage-length", type=positive_int, default=256)
    p.add_argument("--llm-batch", type=positive_int, default=None,
                   help="queries per step of the llm shape (default: --batch)")
    p.add_argument("--llm-chunk", type=positive_int, default=None,
                   help="rows per chunk of the llm shape (default: --chunk)")
    p.add_argument("--small", action="store_true", help="the 4-layer llm shape instead of Qwen2-0.5B's")
    p.add_argument("--tiny", action="store_true", help="a tiny random BERT instead of all-MiniLM-L6-v2 (smoke runs)")
    p.add_argument("--peers", default=f"{ST},{ORIGINAL}", help=f"peers to run where installed: {ST}, {ORIGINAL}")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps per configuration (median; default: 3, 2 with --quick on a GPU)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per process (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="fewer budgets (0, one chunk, half, whole); on a GPU: batch 256 / chunk 32, llm batch 32 / "
                        "chunk 8, 2 steps unless --steps says otherwise -- a few minutes")
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ for the children (0: glibc's default, dynamic threshold)")
    p.add_argument("--output", default=None, help=output_help("frontier-DEVICE") + " (and its .png)")
    p.add_argument("--plot", metavar="RESULTS", help="only draw the PNG of an existing results file")
    args = p.parse_args(argv)
    if args.mmap_threshold < 0:
        raise DprGcError(f"--mmap-threshold {args.mmap_threshold}: give a size in bytes, or 0 for glibc's own "
                         "threshold")
    check_choices("--shapes", name_list(args.shapes), SHAPES)
    check_choices("--precisions", name_list(args.precisions), PRECISIONS)
    if any(name not in (ST, ORIGINAL) for name in name_list(args.peers)):  # none at all: no peers run
        check_choices("--peers", name_list(args.peers), (ST, ORIGINAL))
    require_cuda(args.device)
    return args


def available_peers(names: list[str]) -> tuple[list[str], list[str]]:
    found, notes = [], []
    for name in names:
        if name == ST and st_version() is None:
            notes.append("sentence-transformers is not installed: st-cmnrl skipped")
        elif name == ORIGINAL and original_version() is None:
            notes.append("the original GradCache (luyug/GradCache, module grad_cache) is not installed: skipped "
                         "(pip install it by hand to compare)")
        else:
            found.append(name)
    return found, notes


# the flags that size a run, and the command of the committed frontier-cpu.json (benchmarks/README.md)
SIZING = ("shapes", "precisions", "batch", "chunk", "query_length", "passage_length", "llm_batch", "llm_chunk",
          "small", "tiny", "peers", "steps", "quick")
COMMITTED = (("--device", "cpu", "--shapes", "scifact", "--batch", "32", "--chunk", "8", "--passage-length", "128",
              "--steps", "2", "--threads", "2"),)


def output_path(args: argparse.Namespace, device: str) -> str:
    """--output, else frontier-DEVICE.json for a run sized as the committed one, frontier-DEVICE-quick.json for any
    other (a --quick or --tiny run among them)."""
    return default_output(f"frontier-{device}", parse_args, args, SIZING, COMMITTED)


def settle(args: argparse.Namespace) -> str:
    """The device a run with ``args`` uses (``auto``: cuda where torch sees one), the sizes a --quick GPU run
    takes and the default --steps set in ``args``."""
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.quick and device == "cuda":
        args.batch, args.chunk, args.steps = 256, 32, args.steps or 2
        args.llm_batch, args.llm_chunk = args.llm_batch or 32, args.llm_chunk or 8
    args.steps = args.steps or 3
    return device


def results_file(args: argparse.Namespace) -> Path:
    """The results file a run with ``args`` writes (``args`` settled as :func:`main` does, see :func:`settle`)."""
    return Path(output_path(args, settle(args)))


def main(argv: Optional[list[str]] = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.one:
        print(RESULT_TAG + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    setup_logging()
    if args.plot:
        report = read_json_object(args.plot, "frontier results file")
        if not isinstance(report.get("runs"), list) or not isinstance(report.get("machine"), dict):
            raise DprGcError(f"{args.plot}: not a bench_frontier.py results file (no 'runs' list and 'machine')")
        logger.info("wrote %s", plot(report, Path(args.plot)))
        return
    device = settle(args)
    threads = args.threads or torch.get_num_threads()
    peers, notes = available_peers([n for n in args.peers.split(",") if n])
    for note in notes:
        logger.warning(note)
    report = {"machine": machine_info(device, threads), "settings": vars(args), "notes": notes, "runs": []}
    output = output_path(args, device)
    with tempfile.TemporaryDirectory(prefix="bench_frontier_") as tmp:
        for shape in name_list(args.shapes):
            llm = shape == "llm"
            base = {"shape": shape, "model": shape_model(shape, args.small, args.tiny, Path(tmp)),
                    "input": "uneven", "batch": (args.llm_batch or args.batch) if llm else args.batch,
                    "chunk": (args.llm_chunk or args.chunk) if llm else args.chunk, "q_len": args.query_length,
                    "p_len": args.passage_length, "small": args.small, "device": device, "threads": threads,
                    "steps": args.steps, "seed": args.seed, "mmap_threshold": args.mmap_threshold}
            for precision in name_list(args.precisions):
                shape_peers = [m for m in peers if m == ORIGINAL] if llm else peers
                result = frontier({**base, "precision": precision}, args, shape_peers)
                report["runs"].append({"shape": shape, "precision": precision, **result})
                for row in result["comparison"]:
                    logger.info("%s %s: %s", shape, precision, json.dumps(row))
                write_json(output, report)  # after each shape and precision: a run cut short keeps what it finished
    logger.info("wrote %s and %s", output, plot(report, Path(output)))
    print(summary_table(summary_items(report["runs"]), output, report["machine"], time.perf_counter() - started))


if __name__ == "__main__":
    sys.exit(run_script(main))
