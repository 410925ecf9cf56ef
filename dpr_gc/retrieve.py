"""Retrieve passages for questions: encode them in batches, search the index, write DPR JSON and a TREC run.

FAISS row r is corpus row r, so hits are looked up in the memory-mapped corpus dataset directly. Output records
follow DPR's retriever JSON (``question``, ``answers``, ``ctxs`` with ``id``, ``title``, ``text``, ``score``,
``has_answer``) plus the query ``id``, which joins them with qrels; the TREC run carries the same ranking.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm.auto import tqdm

from .errors import DprGcError
from .files import PathLike, atomic_open
from .index import KINDS, DenseIndex, IndexParams, build_index, set_threads
from .model import add_prefix_arguments

logger = logging.getLogger(__name__)

MATCH_CHOICES = ("string", "regex", "none")
QUERY_CHUNK = 1024


def check_compatible(retriever: Any, index: DenseIndex, check_fingerprint: bool = True) -> None:
    """Refuse a query encoder that does not fit the index: other dimension, pooling or (optionally) weights."""
    meta = index.meta
    built = f"index built from model {meta.get('model')}" if meta.get("model") else "index"
    if retriever.dim != index.dim:
        raise DprGcError(f"the model gives {retriever.dim}-dimensional vectors but the {built} holds {index.dim}-"
                         "dimensional ones; retrieve with the model that encoded the passages")
    for key in ("pooling", "normalize", "passage_format"):
        ours = getattr(retriever.config, key)
        if meta.get(key) is not None and meta[key] != ours:
            raise DprGcError(f"the model uses {key}={ours!r} but the {built} was encoded with {meta[key]!r}; "
                             "retrieve with the model that encoded the passages")
    if check_fingerprint and meta.get("model_fingerprint"):
        from .encode import model_fingerprint

        if model_fingerprint(retriever) != meta["model_fingerprint"]:
            raise DprGcError(f"the model's weights differ from those that encoded the passages ({built}); use that "
                             "model, or pass --skip-model-check if the passage encoder changed on purpose")


def check_corpus(index: DenseIndex, corpus: Any) -> None:
    """Refuse a corpus that is not the one the index rows point into (size and first/last passage ids)."""
    meta, n = index.meta, len(corpus)
    if meta.get("corpus_rows") is not None and int(meta["corpus_rows"]) != n:
        raise DprGcError(f"the index was built for a corpus of {meta['corpus_rows']} passages ({meta.get('corpus')}) "
                         f"but --corpus has {n}; give the corpus that was encoded")
    if index.ntotal > n:
        raise DprGcError(f"the index holds {index.ntotal} vectors but the corpus only {n} passages; wrong --corpus")
    if index.ntotal < n:
        logger.warning("the index covers %d of %d corpus passages (built with --allow-partial)", index.ntotal, n)
    for key, row in (("first_id", 0), ("last_id", index.ntotal - 1)):
        if meta.get(key) is not None and str(corpus[row]["id"]) != meta[key]:
            raise DprGcError(f"corpus row {row} has id {corpus[row]['id']!r} but the index expects {meta[key]!r}; "
                             "give the corpus that was encoded")


def retrieve(retriever: Any, index: DenseIndex, corpus: Any, queries: list[dict], top_k: int = 100,
             batch_size: int = 64, match: Optional[str] = "string", show_progress: bool = True) -> list[dict]:
    """Top-``top_k`` passages for each query as DPR retriever records (plus the query ``id``).

    Questions are embedded ``batch_size`` at a time and searched in chunks; ``match`` ("string"/"regex") fills
    each passage's ``has_answer`` with DPR's answer matching, ``None`` leaves the field out.
    """
    from .evaluate import MATCH_MODES, has_answer

    if match is not None and match not in MATCH_MODES:
        raise DprGcError(f"--match must be one of {', '.join(MATCH_CHOICES)}, got {match!r}")
    if retriever.dim != index.dim:
        check_compatible(retriever, index, check_fingerprint=False)
    results: list[dict] = []
    for start in tqdm(range(0, len(queries), QUERY_CHUNK), desc="retrieving", unit=" chunks",
                      disable=not show_progress or len(queries) <= QUERY_CHUNK):
        chunk = queries[start:start + QUERY_CHUNK]
        emb = retriever.embed("query", [q["question"] for q in chunk], batch_size=batch_size,
                              show_progress=show_progress)
        scores, rows = index.search(emb, top_k)
        unique = np.unique(rows[rows >= 0]).tolist()
        passages = corpus[unique] if unique else {"id": [], "title": [], "text": []}
        where = {row: i for i, row in enumerate(unique)}
        for q, q_scores, q_rows in zip(chunk, scores, rows):
            answers = q.get("answers") or []
            ctxs = []
            for score, row in zip(q_scores.tolist(), q_rows.tolist()):
                if row < 0:
                    continue
                i = where[row]
                ctx = {"id": str(passages["id"][i]), "title": passages["title"][i] or "",
                       "text": passages["text"][i], "score": score}
                if match is not None:
                    ctx["has_answer"] = bool(answers) and has_answer(answers, ctx["text"], match)
                ctxs.append(ctx)
            results.append({"id": str(q["id"]), "question": q["question"], "answers": answers, "ctxs": ctxs})
    return results


def write_results_json(results: list[dict], path: PathLike) -> Path:
    """Write DPR retriever JSON (a list of question records), atomically."""
    with atomic_open(path) as f:
        json.dump(results, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return Path(path)


def write_trec_run(results: list[dict], path: PathLike, tag: str = "dpr-gc") -> Path:
    """Write a TREC run (``qid Q0 docid rank score tag``) from retriever records, atomically."""
    if not tag or any(c.isspace() for c in tag):
        raise DprGcError(f"--run-tag must be one word without spaces, got {tag!r}")
    seen: set[str] = set()
    with atomic_open(path) as f:
        for record in results:
            qid = str(record["id"])
            if not qid or any(c.isspace() for c in qid) or qid in seen:
                problem = "appears twice" if qid in seen else "is empty or contains whitespace"
                raise DprGcError(f"query id {qid!r} {problem}; a TREC run needs unique one-word query ids")
            seen.add(qid)
            for rank, ctx in enumerate(record["ctxs"], start=1):
                docid = str(ctx["id"])
                if not docid or any(c.isspace() for c in docid):
                    raise DprGcError(f"passage id {docid!r} is empty or has whitespace; a TREC run cannot hold it")
                f.write(f"{qid} Q0 {docid} {rank} {float(ctx['score'])!r} {tag}\n")
    return Path(path)


def filter_judged(queries: list[dict], qrels: dict[str, dict[str, int]], qrels_path: PathLike) -> list[dict]:
    """Keep the queries that have relevance judgments (BEIR queries.jsonl lists every split's queries)."""
    kept = [q for q in queries if str(q["id"]) in qrels]
    if not kept:
        raise DprGcError(f"no query id in the queries file appears in {qrels_path}; check that the ids match")
    return kept


def evaluate_results(results: list[dict], ks: list[int], match: Optional[str],
                     qrels: Optional[dict[str, dict[str, int]]]) -> dict[str, dict[str, float]]:
    """Answer accuracy (when questions have answers) and qrels metrics (when qrels are given)."""
    from .evaluate import evaluate_answers, qrels_metrics, run_from_results

    report = {}
    if any(r["answers"] for r in results):
        report["answers"] = evaluate_answers(results, ks, match or "string")
    if qrels is not None:
        report["qrels"] = qrels_metrics(run_from_results(results), qrels, ks)
    return report


# ----------------------------------------------------------------------------------------------- command line
def format_summary(summary: dict[str, Any]) -> str:
    """A two-column markdown table of a summary dict (long jobs end with one)."""
    return "\n".join(["| item | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in summary.items()])


def add_index_arguments(p: argparse.ArgumentParser) -> None:
    """Flags choosing and tuning the index (shared by ``dpr-gc index`` and ``scripts/dense_retriever.py``)."""
    p.add_argument("--kind", default="flat", help=f"index kind: {', '.join(KINDS)} (default flat = exact search)")
    p.add_argument("--factory", help="any faiss.index_factory string, e.g. 'OPQ64,IVF4096,PQ64' (overrides --kind)")
    p.add_argument("--hnsw-m", type=int, default=32, help="HNSW neighbours per node (default 32)")
    p.add_argument("--ef-construction", type=int, default=200, help="HNSW build-time beam (default 200)")
    p.add_argument("--ef-search", type=int, default=128, help="HNSW search beam, keep >= top-k (default 128)")
    p.add_argument("--nlist", type=int, help="IVF inverted lists (default about 4*sqrt(N))")
    p.add_argument("--pq-m", type=int, help="PQ sub-quantizers, must divide the dimension (default about dim/4)")
    p.add_argument("--pq-nbits", type=int, default=8, help="bits per PQ code (default 8)")
    p.add_argument("--nprobe", type=int, default=32, help="IVF lists visited per query (default 32)")
    p.add_argument("--train-sample", type=int, default=100_000, help="vectors sampled to train IVF/PQ (default 100k)")
    p.add_argument("--block-size", type=int, default=65_536, help="rows added per block (default 65536)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training sample")


def params_from_args(args: argparse.Namespace) -> IndexParams:
    return IndexParams(kind=args.kind, factory=args.factory, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
                       ef_search=args.ef_search, nlist=args.nlist, pq_m=args.pq_m, pq_nbits=args.pq_nbits,
                       nprobe=args.nprobe)


def _index_cli(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    summary = build_index(args.embeddings, args.output, params_from_args(args), train_sample=args.train_sample,
                          block_size=args.block_size, seed=args.seed, append=args.append,
                          allow_partial=args.allow_partial)
    print(format_summary(summary))


def recorded_model(index_dir: Optional[PathLike], meta: dict) -> Optional[str]:
    """The model an index records: its absolute path, else the path relative to the index folder (the two were
    moved together), else the name as recorded (a Hugging Face name, or a relative path from an older version)."""
    model = meta.get("model")
    if model and Path(model).is_absolute() and Path(model).exists():
        return model
    relative = meta.get("model_from_index")
    if relative and index_dir is not None and (Path(index_dir) / relative).exists():
        return str(Path(index_dir) / relative)
    return model


def run_retrieval(args: argparse.Namespace, index: DenseIndex, index_name: str) -> list[dict]:
    """Shared by ``dpr-gc retrieve`` and ``scripts/dense_retriever.py``: load, retrieve, write, evaluate, summarise."""
    import torch

    from .corpus import load_corpus, read_queries
    from .evaluate import format_table, read_qrels
    from .model import Retriever

    if not (args.output or args.trec_run or args.evaluate):
        raise DprGcError("nothing to do: give --output FILE.json and/or --trec-run FILE, or --evaluate")
    model = args.model or recorded_model(getattr(args, "index", None), index.meta)
    corpus_path = args.corpus or index.meta.get("corpus")
    if not model or not corpus_path:
        raise DprGcError("give --model and --corpus (the index does not record them)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    retriever = Retriever.load(model, device, args.query_prefix, args.passage_prefix)
    check_compatible(retriever, index, check_fingerprint=not args.skip_model_check)
    corpus = load_corpus(corpus_path, args.cache_dir)
    check_corpus(index, corpus)
    queries = read_queries(args.queries)
    qrels = read_qrels(args.qrels) if args.qrels else None
    if qrels is not None:
        queries = filter_judged(queries, qrels, args.qrels)
    match = None if args.match == "none" else args.match
    started = time.perf_counter()
    results = retrieve(retriever, index, corpus, queries, args.top_k, args.batch_size, match)
    seconds = time.perf_counter() - started
    if args.output:
        write_results_json(results, args.output)
    if args.trec_run:
        write_trec_run(results, args.trec_run, args.run_tag)
    if args.evaluate:
        for name, metrics in evaluate_results(results, args.k, match, qrels).items():
            print(f"\n{name} metrics ({len(results)} queries)")
            print(format_table(metrics))
    print(format_summary({"queries": len(queries), "top-k": args.top_k, "index": index_name,
                          "vectors": index.ntotal, "seconds": round(seconds, 2),
                          "queries/s": round(len(queries) / seconds, 1) if seconds > 0 else "n/a",
                          "results": args.output or "-", "trec run": args.trec_run or "-"}))
    return results


def _retrieve_cli(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    index = DenseIndex.read(args.index)
    if args.ef_search is not None or args.nprobe is not None:
        index.set_search_params(ef_search=args.ef_search, nprobe=args.nprobe)
    run_retrieval(args, index, f"{index.meta['factory']} in {args.index}")


def add_retrieve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``dpr-gc retrieve`` other than the index location."""
    p.add_argument("--model", help="retriever folder or HF model (default: the model recorded in the index)")
    p.add_argument("--corpus", help="passages the index was built from (default: the corpus recorded in the index)")
    p.add_argument("--queries", required=True, help="DPR QA TSV/CSV, NQ-open JSONL or BEIR queries.jsonl")
    p.add_argument("--top-k", type=int, default=100, help="passages per question (default 100)")
    p.add_argument("--batch-size", type=int, default=64, help="questions per encoder batch (default 64)")
    p.add_argument("--match", choices=MATCH_CHOICES, default="string",
                   help="answer matching for has_answer: string (NQ/TriviaQA), regex (CuratedTREC) or none")
    p.add_argument("--output", help="write DPR retriever JSON here")
    p.add_argument("--trec-run", help="write a TREC run file here")
    p.add_argument("--run-tag", default="dpr-gc", help="tag column of the TREC run (default dpr-gc)")
    p.add_argument("--qrels", help="relevance judgments: only judged queries are retrieved; used by --evaluate")
    p.add_argument("--evaluate", action="store_true", help="print answer accuracy and/or qrels metrics")
    p.add_argument("--k", type=int, nargs="+", default=[1, 5, 10, 20, 100], help="cut-offs for --evaluate")
    p.add_argument("--device", help="torch device for the question encoder (default: cuda if available)")
    p.add_argument("--cache-dir", help="where parsed corpora are cached")
    p.add_argument("--skip-model-check", action="store_true",
                   help="do not refuse a model whose weights differ from the one that encoded the passages")
    add_prefix_arguments(p)


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc index`` and ``dpr-gc retrieve``."""
    p = subparsers.add_parser("index", help="build a FAISS index (flat, hnsw, ivf-flat, ivf-pq, factory) from shards",
                              description="Build a FAISS inner-product index from the shards written by encode.")
    p.add_argument("--embeddings", required=True, help="folder of encode shards (shard-*.npy/.ids.txt/.json)")
    p.add_argument("--output", required=True, help="index folder to write (index.faiss, ids.txt, index_meta.json)")
    add_index_arguments(p)
    p.add_argument("--append", action="store_true", help="add new shards to the existing index in --output")
    p.add_argument("--allow-partial", action="store_true", help="index although some shards are not encoded yet")
    p.add_argument("--threads", type=int, help="FAISS threads (default: all cores)")
    p.set_defaults(func=_index_cli)

    p = subparsers.add_parser("retrieve", help="top-k passages for questions: DPR JSON and a TREC run",
                              description=__doc__.splitlines()[0])
    p.add_argument("--index", required=True, help="index folder written by 'dpr-gc index'")
    add_retrieve_arguments(p)
    p.add_argument("--ef-search", type=int, help="override the index's HNSW efSearch")
    p.add_argument("--nprobe", type=int, help="override the index's IVF nprobe")
    p.add_argument("--threads", type=int, help="FAISS threads (default: all cores)")
    p.set_defaults(func=_retrieve_cli)
