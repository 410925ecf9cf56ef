#!/usr/bin/env python
"""Benchmark FAISS Flat vs HNSW vs IVF-PQ through ``dpr_gc.retrieval.index``: build seconds, queries/s, recall@k
against Flat.

The vectors imitate sentence embeddings (e.g. all-MiniLM-L6-v2, 384-d, unit length): a Gaussian mixture of
clusters in a low-dimensional latent space, mapped into ``--dim`` dimensions by a random linear map, plus a
little isotropic noise, then L2-normalised. Real text embeddings likewise sit near a low-dimensional, clustered
manifold; a pure isotropic Gaussian would be far harder for graph and quantisation indexes than real data.
Queries are perturbed copies of random data points. Exact (Flat) top-k is the ground truth.

    python benchmarks/bench_faiss.py                      # 200k x 384, 1k queries, k=100
    python benchmarks/bench_faiss.py --n 50000 --ef-search 128 256

Writes ``benchmarks/results/faiss.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

try:
    import dpr_gc  # noqa: F401
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import default_output, machine_info, output_help, parser, run_script
from dpr_gc.base.files import write_json
from dpr_gc.retrieval.index import DenseIndex, IndexParams, set_threads

BLOCK = 50_000


def make_data(n: int, n_queries: int, dim: int, latent: int, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Clustered, low-intrinsic-dimension unit vectors and queries near random data points (float32)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, latent)).astype(np.float32)
    lift = rng.standard_normal((latent, dim)).astype(np.float32) / np.sqrt(latent)
    data = np.empty((n, dim), dtype=np.float32)
    for s in range(0, n, BLOCK):
        m = min(BLOCK, n - s)
        z = centres[rng.integers(0, clusters, m)] + 0.6 * rng.standard_normal((m, latent), dtype=np.float32)
        data[s:s + m] = z @ lift + 0.15 * rng.standard_normal((m, dim), dtype=np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    picks = rng.choice(n, n_queries, replace=False)
    queries = data[picks] + 0.03 * rng.standard_normal((n_queries, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return data, queries


def build(params: IndexParams, data: np.ndarray, train_sample: int, seed: int) -> tuple[DenseIndex, float]:
    """Build like ``dpr_gc.retrieval.index.build_index``: resolve, train on a random sample, add in blocks; seconds
    taken."""
    started = time.perf_counter()
    n_train = min(train_sample, len(data))
    index = DenseIndex.build(data.shape[1], params.resolve(data.shape[1], len(data), n_train))
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(seed).choice(len(data), n_train, replace=False))
        index.train(data[rows])
    for s in range(0, len(data), BLOCK):
        index.add(data[s:s + BLOCK])
    return index, time.perf_counter() - started


def timed_search(index: DenseIndex, queries: np.ndarray, k: int, repeats: int) -> tuple[np.ndarray, float]:
    """Rows of the top-k and the best queries/s over ``repeats`` runs of the whole query batch."""
    best, rows = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        _, rows = index.search(queries, k)
        best = min(best, time.perf_counter() - started)
    return rows, len(queries) / best


def recall(rows: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(np.intersect1d(r, t)) / k for r, t in zip(rows, truth)]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    import faiss

    started = time.perf_counter()
    data, queries = make_data(args.n, args.queries, args.dim, args.latent, args.clusters, args.seed)
    print(f"data: {args.n} x {args.dim} ({time.perf_counter() - started:.1f}s), {args.queries} queries, k={args.k}, "
          f"{faiss.omp_get_max_threads()} FAISS threads", flush=True)
    rows_out = []

    flat, seconds = build(IndexParams("flat"), data, args.train_sample, args.seed)
    truth, flat_qps = timed_search(flat, queries, args.k, args.repeats)
    rows_out.append({"index": "Flat", "setting": "exact", "build_s": seconds, "qps": flat_qps, "recall": 1.0})
    print(f"Flat: {flat_qps:.0f} q/s", flush=True)
    del flat

    for m in args.hnsw_m:
        hnsw, seconds = build(IndexParams("hnsw", hnsw_m=m, ef_construction=args.ef_construction),
                              data, args.train_sample, args.seed)
        print(f"HNSW{m} built in {seconds:.1f}s", flush=True)
        for i, ef in enumerate(args.ef_search):
            hnsw.set_search_params(ef_search=ef)
            rows, qps = timed_search(hnsw, queries, args.k, args.repeats)
            rows_out.append({"index": f"HNSW{m} (efC {args.ef_construction})", "setting": f"efSearch={ef}",
                             "build_s": seconds if i == 0 else None, "qps": qps, "recall": recall(rows, truth)})
            print(f"  efSearch={ef}: {qps:.0f} q/s, recall {rows_out[-1]['recall']:.4f}", flush=True)
        del hnsw

    params = IndexParams("ivf-pq", nlist=args.nlist, pq_m=args.pq_m)
    ivfpq, seconds = build(params, data, args.train_sample, args.seed)
    name = ivfpq.meta["factory"]
    print(f"{name} built in {seconds:.1f}s", flush=True)
    for i, nprobe in enumerate(args.nprobe):
        ivfpq.set_search_params(nprobe=nprobe)
        rows, qps = timed_search(ivfpq, queries, args.k, args.repeats)
        rows_out.append({"index": name, "setting": f"nprobe={nprobe}", "build_s": seconds if i == 0 else None,
                         "qps": qps, "recall": recall(rows, truth)})
        print(f"  nprobe={nprobe}: {qps:.0f} q/s, recall {rows_out[-1]['recall']:.4f}", flush=True)

    for row in rows_out:
        row["speedup_vs_flat"] = row["qps"] / flat_qps
    hits = [r for r in rows_out if r["index"].startswith("HNSW") and r["recall"] >= args.target_recall
            and r["speedup_vs_flat"] >= args.target_speedup]
    best = max(hits, key=lambda r: r["speedup_vs_flat"]) if hits else None
    return {
        "config": {key: value for key, value in vars(args).items() if key != "output"},
        "machine": {**machine_info("cpu", faiss.omp_get_max_threads()), "faiss_version": faiss.__version__},
        "results": rows_out,
        "target": {"recall_at_k": args.target_recall, "speedup_vs_flat": args.target_speedup,
                   "met": best is not None, "setting": f"{best['index']} {best['setting']}" if best else None},
    }


def table(report: dict[str, Any]) -> str:
    k = report["config"]["k"]
    lines = [f"| index | setting | build s | queries/s | x Flat | recall@{k} |", "|---|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        build_s = f"{r['build_s']:.1f}" if r["build_s"] is not None else ""
        lines.append(f"| {r['index']} | {r['setting']} | {build_s} | {r['qps']:.0f} | {r['speedup_vs_flat']:.1f} "
                     f"| {r['recall']:.4f} |")
    t = report["target"]
    verdict = f"met by {t['setting']}" if t["met"] else "not met"
    lines.append(f"\ntarget (HNSW recall@{k} >= {t['recall_at_k']} at >= {t['speedup_vs_flat']}x Flat queries/s): "
                 f"{verdict}")
    return "\n".join(lines)


# the flags that size a run (the committed faiss.json: the defaults, --threads 1)
SIZING = ("n", "dim", "latent", "clusters", "queries", "k", "hnsw_m", "ef_construction", "ef_search", "nlist", "pq_m",
          "nprobe", "train_sample", "repeats")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=200_000, help="database vectors")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--latent", type=int, default=32, help="intrinsic dimension of the data")
    p.add_argument("--clusters", type=int, default=2000, help="mixture components")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--hnsw-m", type=int, nargs="+", default=[32])
    p.add_argument("--ef-construction", type=int, default=100)
    p.add_argument("--ef-search", type=int, nargs="+", default=[100, 128, 256])
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--pq-m", type=int, default=48, help="PQ bytes per vector")
    p.add_argument("--nprobe", type=int, nargs="+", default=[16, 64])
    p.add_argument("--train-sample", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=3, help="searches per setting; the fastest counts")
    p.add_argument("--threads", type=int, help="FAISS threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-recall", type=float, default=0.98)
    p.add_argument("--target-speedup", type=float, default=5.0)
    p.add_argument("--output", help=output_help("faiss"))
    args = p.parse_args(argv)
    args.output = default_output("faiss", p.parse_args, args, SIZING)
    return args


def main() -> None:
    args = parse_args(None)
    report = run(args)
    write_json(args.output, report)
    print()
    print(table(report))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    sys.exit(run_script(main))
