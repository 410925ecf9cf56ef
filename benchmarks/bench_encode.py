"""Benchmark: passages/s of ``dpr_gc.retrieval.encode`` against sentence-transformers' ``encode`` in the same run.

Same model (the offline all-MiniLM-L6-v2 with its own recipe: mean pooling + L2 normalisation), same passages
(SciFact title + " " + text, or generated text when SciFact is absent), same max length, batch size and threads.
Each method is warmed up. The passages are split into chunks and every chunk is encoded by all methods back to
back, in an order that rotates from chunk to chunk, so load from other processes hits all methods alike; passages/s
is over all chunks (median over rounds), and the per-chunk time ratios are reported too. Our path is timed end to end
through ``encode_corpus`` (part files, assembly and manifest included; the parsed-corpus cache is built beforehand).
Embeddings are checked against sentence-transformers by cosine.

``--precision int8`` (dynamic int8 Linear layers) and bf16 autocast are timed in the same rotation. The quality phase
(``--quality``, on by default when SciFact is present) encodes the whole SciFact corpus in fp32, bf16 and int8,
embeds the test queries in fp32 (as ``dpr-gc retrieve`` does), searches exactly and reports nDCG@10 per precision
and per stored dtype (``--quality-dtypes float16``: the passages cast to float16 as ``encode``'s default shards);
the embeddings are cached in ``--work-dir`` so an interrupted run resumes.

    nice -n 5 python benchmarks/bench_encode.py --docs 1000 --max-length 256 --batch-size 64 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import default_output, machine_info, output_help, parser, run_script, setup_logging  # noqa: E402
from dpr_gc.data.corpus import load_corpus  # noqa: E402
from dpr_gc.base.devices import cpu_has_native_bf16  # noqa: E402
from dpr_gc.retrieval.encode import encode_block, encode_corpus, quantize_int8  # noqa: E402
from dpr_gc.base.files import iter_jsonl, write_json  # noqa: E402
from dpr_gc.model.pretrained import default_model_path  # noqa: E402
from dpr_gc.model.retriever import Retriever, RetrieverConfig  # noqa: E402

# /work/shared beside a checkout in /work/main, or two levels up from a worktree in /work/wt/NAME
SCIFACT = next((f for f in (r / "shared" / "data" / "scifact" / "corpus.jsonl.gz" for r in ROOT.parents[:2])
                if f.is_file()), ROOT.parent / "shared" / "data" / "scifact" / "corpus.jsonl.gz")
WORDS = ("cell protein gene expression tumour patients study results increased risk mice treatment clinical "
         "analysis response levels disease model associated receptor activity signalling pathway").split()


def load_passages(docs: int) -> tuple[list[dict], str]:
    """First ``docs`` SciFact abstracts, or deterministic generated text if SciFact is absent."""
    if SCIFACT.is_file():
        rows = []
        for _, obj in iter_jsonl(SCIFACT):
            rows.append({"id": obj["_id"], "title": obj.get("title") or "", "text": obj["text"]})
            if len(rows) == docs:
                break
        return rows, str(SCIFACT)
    rng = random.Random(0)
    rows = [{"id": str(i), "title": " ".join(rng.choices(WORDS, k=rng.randint(3, 12))),
             "text": " ".join(rng.choices(WORDS, k=rng.randint(20, 300)))} for i in range(docs)]
    return rows, "generated"


def search_metrics(q_emb: np.ndarray, p_emb: np.ndarray, corpus: list[tuple], queries: list[dict],
                   qrels: dict) -> dict:
    """nDCG@10 and Recall@100 of exact inner-product search (scores in float32, as the index computes them)."""
    from dpr_gc.evaluation.evaluate import qrels_metrics

    scores = q_emb.astype(np.float32) @ p_emb.astype(np.float32).T
    top = np.argsort(-scores, axis=1)[:, :100]
    run = {str(q["id"]): {corpus[j][0]: float(scores[i, j]) for j in top[i]} for i, q in enumerate(queries)}
    metrics = qrels_metrics(run, qrels, [10, 100])
    return {"nDCG@10": metrics["nDCG@10"], "Recall@100": metrics["Recall@100"]}


def scifact_quality(retriever: Retriever, max_length: int, batch_size: int, work: Path,
                    precisions: list[str], dtypes: list[str]) -> dict:
    """nDCG@10 (and Recall@100) on SciFact test for passage embeddings computed in fp32, bf16 and int8 and stored
    as each of ``dtypes`` (queries fp32). Keys: the precision for float32 storage, ``<precision>+float16`` for
    float16 shards (``encode`` stores float16 by ``astype``; the index scores in float32)."""
    from dpr_gc.data.corpus import read_queries
    from dpr_gc.evaluation.evaluate import read_qrels

    folder = SCIFACT.parent
    qrels = read_qrels(folder / "qrels" / "test.tsv")
    queries = [q for q in read_queries(folder / "queries.jsonl") if str(q["id"]) in qrels]
    corpus = [(o["_id"], o.get("title") or "", o["text"]) for _, o in iter_jsonl(SCIFACT)]
    q_emb = retriever.embed("query", [q["question"] for q in queries], batch_size=batch_size)
    work.mkdir(parents=True, exist_ok=True)
    int8 = quantize_int8(retriever)
    out = {"queries": len(queries), "passages": len(corpus), "query_precision": "fp32", "max_length": max_length}
    for name, model, autocast in (("fp32", retriever, None), ("bf16", retriever, "bf16"), ("int8", int8, None)):
        if name not in precisions:
            continue
        cached = work / f"scifact-{name}-{max_length}.npy"
        if not cached.is_file():
            started = time.perf_counter()
            emb = encode_block(model, [c[1] for c in corpus], [c[2] for c in corpus], batch_size, max_length, autocast)
            np.save(cached, emb)
            print(f"SciFact corpus in {name}: {time.perf_counter() - started:.0f} s", flush=True)
        emb = np.load(cached)
        for dtype in dtypes:
            key = name if dtype == "float32" else f"{name}+{dtype}"
            out[key] = search_metrics(q_emb, emb.astype(dtype), corpus, queries, qrels)
            print(f"SciFact {key}: nDCG@10 {out[key]['nDCG@10']:.4f}", flush=True)
    for key in out:
        if isinstance(out[key], dict) and key != "fp32":
            out[key]["nDCG@10_minus_fp32"] = out[key]["nDCG@10"] - out["fp32"]["nDCG@10"]
    return out


def timed(fn: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def time_methods(args: argparse.Namespace, retriever: Retriever, rows: list[dict], path: str) -> dict:
    """Passages/s of each method on ``rows`` (methods rotate per chunk) and cosine against sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = args.max_length
    work = Path(tempfile.mkdtemp(prefix="bench_encode_"))
    chunks = [rows[i:i + args.chunk] for i in range(0, len(rows), args.chunk)]
    files = []
    for c, chunk in enumerate(chunks):
        files.append(work / f"chunk{c}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in chunk))

    def ours(precision: str | None) -> Callable[[int], np.ndarray]:
        def run(c: int) -> np.ndarray:
            out = Path(tempfile.mkdtemp(dir=work))
            m = encode_corpus(retriever, files[c], out, 0, 1, batch_size=args.batch_size, dtype="float32",
                              precision=precision or "fp32", cache_dir=work / "cache", show_progress=False)
            return np.load(out / m["embeddings"])
        return run

    def sbert(c: int) -> np.ndarray:
        texts = [f"{r['title']} {r['text']}" if r["title"] else r["text"] for r in chunks[c]]
        return st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False)

    methods = {"dpr_gc fp32": ours(None), "sentence-transformers fp32": sbert, "dpr_gc bf16 autocast": ours("bf16"),
               "dpr_gc int8": ours("int8")}
    names = list(methods)
    for c in range(len(chunks)):  # builds each chunk's parsed-corpus cache outside the timings
        load_corpus(files[c], work / "cache")
    warm = rows[:args.batch_size]
    for model, precision in ((retriever, None), (retriever, "bf16"), (quantize_int8(retriever), None)):
        encode_block(model, [r["title"] for r in warm], [r["text"] for r in warm], args.batch_size,
                     args.max_length, precision)
    st.encode([f"{r['title']} {r['text']}" for r in warm], batch_size=args.batch_size, show_progress_bar=False)
    seconds = {k: [[0.0] * len(chunks) for _ in range(args.rounds)] for k in names}
    outputs: dict[str, list[np.ndarray]] = {k: [np.empty(0)] * len(chunks) for k in names}
    for rnd in range(args.rounds):
        for c in range(len(chunks)):
            shift = (rnd + c) % len(names)
            for name in names[shift:] + names[:shift]:
                seconds[name][rnd][c], outputs[name][c] = timed(lambda: methods[name](c))
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {len(rows) / sum(seconds[k][rnd]):.1f}/s" for k in names),
              flush=True)
    return summarize(args, len(rows), seconds, outputs)


def summarize(args: argparse.Namespace, n_rows: int, seconds: dict, outputs: dict) -> dict:
    """Per method: median passages/s, speed against sentence-transformers (whole rounds and per chunk) and the
    cosine of its embeddings against sentence-transformers'; printed as a table."""
    ref = np.concatenate(outputs["sentence-transformers fp32"]).astype(np.float64)
    st_chunks = np.array(seconds["sentence-transformers fp32"])
    results = {}
    for name in seconds:
        emb = np.concatenate(outputs[name]).astype(np.float64)
        cos = (emb * ref).sum(1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
        totals = [sum(r) for r in seconds[name]]
        med = statistics.median(totals)
        results[name] = {"seconds_per_round": totals, "median_seconds": med, "passages_per_s": n_rows / med,
                         "ratio_vs_st": statistics.median(sum(s) for s in st_chunks) / med,
                         "median_chunk_ratio_vs_st": float(np.median(st_chunks / np.array(seconds[name]))),
                         "min_cosine_vs_st": float(cos.min()), "mean_cosine_vs_st": float(cos.mean())}
    print(f"\n{n_rows} passages, max length {args.max_length}, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds\n")
    print("| method | passages/s | speed vs sentence-transformers | median per-chunk ratio | min cosine vs ST |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['passages_per_s']:.1f} | {r['ratio_vs_st']:.2f}x | {r['median_chunk_ratio_vs_st']:.2f}x "
              f"| {r['min_cosine_vs_st']:.5f} |", flush=True)
    return results


# the flags that size a run, and the command of the committed encode.json (benchmarks/README.md)
SIZING = ("docs", "max_length", "batch_size", "rounds", "chunk", "quality", "timing", "quality_max_length",
          "quality_precisions", "quality_dtypes")
COMMITTED = (("--docs", "256", "--chunk", "128", "--no-quality"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--chunk", type=int, default=256, help="passages per timed call; methods rotate per chunk")
    p.add_argument("--output", help=output_help("encode"))
    p.add_argument("--quality", action=argparse.BooleanOptionalAction, default=SCIFACT.is_file(),
                        help="also measure SciFact nDCG@10 per precision (default: when SciFact is present)")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                        help="time the methods on --docs passages (--no-timing: only the quality phase)")
    p.add_argument("--quality-max-length", type=int, help="passage max length of the quality phase "
                        "(default: --max-length)")
    p.add_argument("--quality-precisions", nargs="+", default=["fp32", "bf16", "int8"],
                        choices=["fp32", "bf16", "int8"], help="precisions of the quality phase (fp32 is the reference)")
    p.add_argument("--quality-dtypes", nargs="+", default=["float32"], choices=["float32", "float16"],
                        help="stored embedding dtypes of the quality phase (float32 is the reference; encode's "
                             "default is float16)")
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_encode"), help="cached SciFact embeddings")
    args = p.parse_args(argv)
    args.output = default_output("encode", p.parse_args, args, SIZING, COMMITTED)
    return args


def main() -> None:
    args = parse_args(None)
    setup_logging("%(message)s", logging.WARNING)

    load_before = list(os.getloadavg())
    rows, source = load_passages(args.docs)
    path = default_model_path()
    config = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat",
                             passage_max_length=args.max_length)
    retriever = Retriever.from_pretrained(path, config).eval()
    results = time_methods(args, retriever, rows, path) if args.timing else {}
    report = {"passages": len(rows), "source": source, "model": path, "max_length": args.max_length,
              "batch_size": args.batch_size, "chunk": args.chunk, "rounds": args.rounds,
              "machine": machine_info("cpu", torch.get_num_threads()), "native_bf16": cpu_has_native_bf16(),
              "results": results, "load_average_before": load_before}
    write_json(args.output, report)
    if args.quality:
        report["scifact_quality"] = scifact_quality(retriever, args.quality_max_length or args.max_length,
                                                    args.batch_size, Path(args.work_dir),
                                                    ["fp32", *args.quality_precisions],
                                                    list(dict.fromkeys(["float32", *args.quality_dtypes])))
        report["load_average_after"] = list(os.getloadavg())
    write_json(args.output, report)
    print(f"\nwritten {args.output}")


if __name__ == "__main__":
    sys.exit(run_script(main))
