"""Mine hard negatives: retrieve top-K passages per training question, drop false negatives, keep N per question.

Candidates come from BM25 (bm25s; how DPR made its first negatives) or from a trained encoder and a FAISS index.
False negatives are dropped before anything is chosen: the question's gold passages (same id, or same text), passages
that contain an answer (``answers.AnswerMatcher``, the matching evaluation uses: each candidate passage tokenised once
per run) and qrels positives. Of the rest,
ranks ``<= skip_top`` are skipped and, with ``margin``, so is any candidate scoring above ``best positive score -
margin``; the first ``n_negatives`` left (by rank) become ``hard_negative_ctxs``. Training files stream through in
chunks of questions and are rewritten record by record, so memory holds one chunk, not the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from .bm25 import BM25Source, Gold
from ..data.corpus import rows_for_ids
from ..data.training import ID_KEYS, beir_training_records, iter_training_file
from ..base.args import any_float, device_arg, nonnegative_float, nonnegative_int, output_dir, output_file, positive_int
from ..base.errors import DprGcError
from ..base.guard import guarded
from ..base.files import ChunkedOutput, PathLike, file_identity, require_file
from ..base.locks import output_lock
from ..model.retriever import add_prefix_arguments
from .retrieve import DenseSource

logger = logging.getLogger(__name__)

CHUNK = 1024


@dataclasses.dataclass
class MiningSummary:
    """Counts over all mined questions and statistics of the chosen negatives' scores."""

    questions: int = 0
    judged: int = 0
    candidates: int = 0
    gold_dropped: int = 0
    answer_dropped: int = 0
    qrels_dropped: int = 0
    rank_skipped: int = 0
    margin_dropped: int = 0
    short: int = 0
    written: int = 0
    score_sum: float = 0.0
    score_min: float = math.inf
    score_max: float = -math.inf

    def merge(self, other: "MiningSummary") -> None:
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, {"score_min": min, "score_max": max}.get(f.name, lambda x, y: x + y)(a, b))

    def table(self) -> dict[str, Any]:
        """The rows of the closing summary table."""
        def stat(v: float) -> Any:
            return round(v, 4) if self.written else "-"

        return {"questions": self.questions, "questions in qrels": self.judged, "candidates seen": self.candidates,
                "gold dropped": self.gold_dropped, "answer-bearing dropped": self.answer_dropped,
                "qrels positives dropped": self.qrels_dropped, "skipped by rank": self.rank_skipped,
                "dropped by margin": self.margin_dropped, "questions short of N": self.short,
                "negatives written": self.written, "mean score": stat(self.score_sum / max(self.written, 1)),
                "min score": stat(self.score_min), "max score": stat(self.score_max)}


# ----------------------------------------------------------------------------------------------------- mining
def ctx_id(ctx: dict) -> str:
    """A DPR context's passage id (DPR files use ``passage_id``; others ``id``/``psg_id``/``_id``), or ''."""
    return str(next((ctx[k] for k in ID_KEYS if ctx.get(k) is not None), ""))


def _qid(record: dict) -> str:
    qid = record.get("id") if record.get("id") is not None else record.get("_id")
    return "" if qid is None else str(qid)


def _norm(text: str) -> str:
    return " ".join(text.split())


def _check_settings(n_negatives: int, top_k: int, skip_top: int, match_mode: str) -> None:
    from ..evaluation.evaluate import MATCH_MODES

    if n_negatives < 1:
        raise DprGcError(f"--n-negatives must be a positive integer, got {n_negatives}")
    if top_k < 1 or not 0 <= skip_top < top_k:
        raise DprGcError(f"need --top-k >= 1 and 0 <= --skip-top < --top-k, got top-k {top_k}, skip-top {skip_top}")
    if match_mode not in MATCH_MODES:
        raise DprGcError(f"--match must be one of {', '.join(MATCH_MODES)}, got {match_mode!r}")


def mine_hard_negatives(questions: Sequence[dict], source: Any, corpus: Any, n_negatives: int, top_k: int = 100,
                        skip_top: int = 0, margin: Optional[float] = None, match_mode: str = "string",
                        qrels: Optional[dict[str, dict[str, int]]] = None, *,
                        id_to_row: Optional[dict[str, int]] = None, matcher: Optional[Any] = None,
                        show_progress: bool = False) -> tuple[list[dict], MiningSummary]:
    """Hard negatives for DPR-style question records (``question``, ``answers``, ``positive_ctxs``, optional ``id``).

    Returns one ``{"id", "question", "hard_negative_ctxs"}`` per question -- each ctx ``{title, text, passage_id,
    score, rank}`` with ``rank`` the 1-based position in the retrieved list -- and a :class:`MiningSummary`.
    ``margin`` drops candidates scoring above the best positive's score minus ``margin``; questions whose positive
    has no score (BM25: positive not in the corpus) keep their candidates. ``id_to_row`` maps positive ids to corpus
    rows for BM25 margins (looked up here when missing). ``matcher``, an ``AnswerMatcher`` for ``match_mode`` kept
    across calls, caches tokenised candidates between chunks.
    """
    from ..evaluation.answers import AnswerMatcher

    _check_settings(n_negatives, top_k, skip_top, match_mode)
    if matcher is None:
        with AnswerMatcher(match_mode) as own:
            return mine_hard_negatives(questions, source, corpus, n_negatives, top_k, skip_top, margin, match_mode,
                                       qrels, id_to_row=id_to_row, matcher=own, show_progress=show_progress)
    if margin is not None and id_to_row is None and isinstance(source, BM25Source):
        id_to_row = rows_for_ids(corpus, (ctx_id(c) for q in questions for c in q.get("positive_ctxs") or []))
    summary, records = MiningSummary(), []
    for start in tqdm(range(0, len(questions), CHUNK), desc="mining", unit=" chunks", disable=not show_progress):
        chunk = questions[start:start + CHUNK]
        rows_of = id_to_row or {}
        golds = [[(rows_of.get(ctx_id(c)), c.get("title") or "", c.get("text") or "")
                  for c in q.get("positive_ctxs") or []] for q in chunk]
        scores, rows, best = source.retrieve([q["question"] for q in chunk], top_k,
                                             golds if margin is not None else None)
        unique = np.unique(rows[rows >= 0]).tolist()
        cols = corpus[unique] if unique else {"id": [], "title": [], "text": []}
        where = {r: i for i, r in enumerate(unique)}
        all_hits = [[(rank, score, str(cols["id"][i]), cols["title"][i] or "", cols["text"][i])
                     for rank, (score, i) in enumerate(zip(q_scores, (where.get(r) for r in q_rows)), start=1)
                     if i is not None] for q_scores, q_rows in zip(scores.tolist(), rows.tolist())]
        flags = matcher.flags([(q.get("answers") or [], [(h[2], h[4]) for h in hits])
                               for q, hits in zip(chunk, all_hits)])
        for q, gold, pos, hits, has in zip(chunk, golds, best, all_hits, flags):
            floor = pos - margin if margin is not None and pos is not None else None
            chosen = _select(q, gold, hits, has, n_negatives, skip_top, floor, qrels, summary)
            records.append({"id": q.get("id"), "question": q["question"], "hard_negative_ctxs": chosen})
    return records, summary


def _select(q: dict, gold: list[Gold], hits: list[tuple[int, float, str, str, str]], has_answer: list[bool],
            n_negatives: int, skip_top: int, floor: Optional[float], qrels: Optional[dict[str, dict[str, int]]],
            summary: MiningSummary) -> list[dict]:
    """Drop false negatives among one question's ranked hits (``has_answer``: their answer flags), then keep the
    first ``n_negatives`` in range."""
    gold_ids = {ctx_id(c) for c in q.get("positive_ctxs") or []} - {""}
    gold_texts = {_norm(text) for _, _, text in gold}
    judged = (qrels or {}).get(_qid(q), {})
    qrels_pos = {d for d, rel in judged.items() if rel > 0}
    chosen: list[dict] = []
    for (rank, score, pid, title, text), answer in zip(hits, has_answer):
        if pid in gold_ids or _norm(text) in gold_texts:
            summary.gold_dropped += 1
        elif answer:
            summary.answer_dropped += 1
        elif pid in qrels_pos:
            summary.qrels_dropped += 1
        elif rank <= skip_top:
            summary.rank_skipped += 1
        elif floor is not None and score > floor:
            summary.margin_dropped += 1
        elif len(chosen) < n_negatives:
            chosen.append({"title": title, "text": text, "passage_id": pid, "score": float(score), "rank": rank})
    scores = [c["score"] for c in chosen]
    summary.merge(MiningSummary(questions=1, judged=int(bool(judged)), candidates=len(hits),
                                short=int(len(chosen) < n_negatives), written=len(chosen), score_sum=sum(scores),
                                score_min=min(scores, default=math.inf), score_max=max(scores, default=-math.inf)))
    return chosen


def _merge(old: list, new: list[dict]) -> list:
    seen = {ctx_id(c) for c in old if isinstance(c, dict)}
    return list(old) + [c for c in new if c["passage_id"] not in seen]


def mine_to_file(records: Iterable[dict], output: PathLike, source: Any, corpus: Any, n_negatives: int,
                 top_k: int = 100, skip_top: int = 0, margin: Optional[float] = None, match_mode: str = "string",
                 qrels: Optional[dict[str, dict[str, int]]] = None, append: bool = False,
                 id_to_row: Optional[dict[str, int]] = None, chunk_size: int = CHUNK,
                 show_progress: bool = True, resume_key: Optional[dict] = None, workers: int = 1) -> MiningSummary:
    """Mine ``records`` chunk by chunk and write them with ``hard_negative_ctxs`` replaced (``append``: old ones
    kept, new ones added unless their id is already there), every other field kept. A JSON list, or JSONL when the
    name ends in ``.jsonl`` (``.gz`` compresses); the file appears only when complete.

    Each finished chunk is kept (:class:`~dpr_gc.files.ChunkedOutput`): a run with the same ``resume_key`` (the
    inputs and settings; ``None`` never resumes) continues after the last finished chunk of an interrupted one.
    ``workers`` processes tokenise new candidate passages for answer matching (one matcher for the whole run)."""
    from ..evaluation.answers import AnswerMatcher

    _check_settings(n_negatives, top_k, skip_top, match_mode)
    jsonl = Path(output).name.removesuffix(".gz").endswith(".jsonl")
    with output_lock(output) as final, AnswerMatcher(match_mode, workers) as matcher:
        writer = ChunkedOutput(final, {"settings": resume_key, "chunk_size": chunk_size, "append": append}
                               if resume_key is not None else None)
        state = writer.resume()
        summary, count = (MiningSummary(**state["summary"]), state["count"]) if state else (MiningSummary(), 0)
        if count:
            logger.info("resuming: %d questions of an interrupted run are already mined into %s", count, final)
        total = len(records) - count if isinstance(records, Sequence) else None
        buffer: list[dict] = []
        with tqdm(total=total, desc="mining", unit=" q", disable=not show_progress) as bar:

            def flush() -> None:
                nonlocal count
                mined, part = mine_hard_negatives(buffer, source, corpus, n_negatives, top_k, skip_top, margin,
                                                  match_mode, qrels, id_to_row=id_to_row, matcher=matcher)
                summary.merge(part)
                texts = []
                for record, m in zip(buffer, mined):
                    new = dict(record)
                    new["hard_negative_ctxs"] = (_merge(record.get("hard_negative_ctxs") or [],
                                                        m["hard_negative_ctxs"]) if append else m["hard_negative_ctxs"])
                    text = json.dumps(new, ensure_ascii=False)
                    texts.append(text + "\n" if jsonl else ("[\n" if count == 0 else ",\n") + text)
                    count += 1
                writer.append("".join(texts), {"count": count, "summary": dataclasses.asdict(summary)})
                bar.update(len(buffer))
                buffer.clear()

            for record in itertools.islice(records, count, None):
                buffer.append(record)
                if len(buffer) >= chunk_size:
                    flush()
            if buffer:
                flush()
        if count == 0:
            writer.discard()
            raise DprGcError(f"no training questions to mine (the input is empty); nothing written to {final}")
        writer.append("" if jsonl else "\n]\n", {"count": count, "summary": dataclasses.asdict(summary)})
        writer.finish()
    return summary


# ----------------------------------------------------------------------------------------------------- command line
SOURCES = ("dense", "bm25")
RESUME_FLAGS = ("source", "split", "model", "index", "bm25_k1", "bm25_b", "n_negatives", "top_k", "skip_top", "margin",
                "match", "append")


def open_source(kind: str, corpus: Any, *, model: Optional[str] = None, index: Optional[PathLike] = None,
                embeddings: Optional[PathLike] = None, corpus_path: Optional[PathLike] = None,
                bm25_index: Optional[PathLike] = None, k1: float = 0.9, b: float = 0.4, device: Optional[str] = None,
                batch_size: int = 64, cache_dir: Optional[PathLike] = None, check_model: bool = True,
                threads: int = 0, show_progress: bool = True, query_prefix: Optional[str] = None,
                passage_prefix: Optional[str] = None) -> Any:
    """A :class:`BM25Source`, or a :class:`DenseSource` over the index in ``index`` -- built first (flat) from the
    shards in ``embeddings``, which are encoded first when that folder has none -- checked against model and corpus.
    ``query_prefix`` / ``passage_prefix`` replace the model's own (None keeps them)."""
    if kind == "bm25":
        return BM25Source(corpus, k1, b, index_dir=bm25_index, n_threads=threads, show_progress=show_progress)
    if kind != "dense":
        raise DprGcError(f"unknown --source {kind!r}; use one of {', '.join(SOURCES)}")
    from ..base.devices import default_device
    from .encode import encode_corpus
    from .index import DenseIndex, IndexParams, build_index, index_exists, read_meta, set_threads
    from .shards import has_shards
    from ..model.retriever import Retriever
    from .retrieve import check_compatible, check_corpus, recorded_prefixes

    if not model:
        raise DprGcError("--source dense needs --model (the trained retriever folder)")
    set_threads(threads or None)
    if index_exists(index):
        query_prefix, passage_prefix = recorded_prefixes(read_meta(index), query_prefix, passage_prefix)
    retriever = Retriever.load(model, default_device(device), query_prefix, passage_prefix)
    if not index_exists(index):
        if embeddings is None:
            where = f"no index in {index}; " if index is not None else ""
            raise DprGcError(f"{where}--source dense needs --index DIR (from 'dpr-gc index') or --embeddings DIR "
                             "(encode shards; encoded now if the folder has none)")
        emb = Path(embeddings)
        if not has_shards(emb):
            if corpus_path is None:
                raise DprGcError("encoding the corpus needs --corpus")
            encode_corpus(retriever, corpus_path, emb, shard_id=0, num_shards=1, batch_size=batch_size,
                          cache_dir=cache_dir, model_name=str(model), show_progress=show_progress)
        index = index if index is not None else emb / "index"
        build_index(emb, index, IndexParams("flat"))
    dense = DenseIndex.read(index)
    check_compatible(retriever, dense, check_fingerprint=check_model)
    check_corpus(dense, corpus)
    return DenseSource(retriever, dense, batch_size)


@guarded(inputs=("train_file", "beir_dir", "corpus", "model", "index", "embeddings", "bm25_index", "qrels"),
         outputs={"output": "self"})
def _cli(args: argparse.Namespace) -> None:
    from ..data.corpus import load_corpus
    from ..data.training import find_beir_file
    from ..evaluation.answers import default_workers
    from ..base.devices import steady_malloc
    from ..evaluation.evaluate import read_qrels
    from .index import index_exists, meta_path, read_meta
    from ..base.tables import format_summary

    if args.source not in SOURCES:
        raise DprGcError(f"unknown --source {args.source!r}; use one of {', '.join(SOURCES)}")
    if bool(args.train_file) == bool(args.beir_dir):
        raise DprGcError("give exactly one of --train-file (DPR training file) or --beir-dir (BEIR folder)")
    _check_settings(args.n_negatives, args.top_k, args.skip_top, args.match)
    steady_malloc()
    beir = Path(args.beir_dir) if args.beir_dir else None
    if beir is not None:
        queries = find_beir_file(beir, "queries.jsonl")
        split_qrels = require_file(beir / "qrels" / f"{args.split}.tsv", f"qrels of split {args.split!r}")
    else:
        require_file(args.train_file, "training file")
    corpus_path = args.corpus or (find_beir_file(beir, "corpus.jsonl") if beir is not None else None)
    if corpus_path is None and index_exists(args.index):
        corpus_path = read_meta(args.index).get("corpus")
    if not corpus_path:
        raise DprGcError("give --corpus (the passages to mine from)")
    corpus = load_corpus(corpus_path, args.cache_dir)
    qrels = read_qrels(args.qrels) if args.qrels else None
    source = open_source(args.source, corpus, model=args.model, index=args.index, embeddings=args.embeddings,
                         corpus_path=corpus_path, bm25_index=args.bm25_index, k1=args.bm25_k1, b=args.bm25_b,
                         device=args.device, batch_size=args.batch_size, cache_dir=args.cache_dir,
                         check_model=not args.skip_model_check, threads=args.threads,
                         query_prefix=args.query_prefix, passage_prefix=args.passage_prefix)
    id_to_row = None
    if beir is not None:
        records, id_to_row = beir_training_records(queries, split_qrels, corpus)
    else:
        records = iter_training_file(args.train_file)
        if args.margin is not None and args.source == "bm25":
            golds = (ctx_id(c) for r in iter_training_file(args.train_file) for c in r.get("positive_ctxs") or [])
            id_to_row = rows_for_ids(corpus, golds)
    inputs = [args.train_file, corpus_path, args.qrels] + ([queries, split_qrels] if beir is not None else [])
    if index_exists(args.index):
        inputs.append(meta_path(args.index))
    key = {"inputs": [file_identity(p) for p in inputs if p],
           **{k: v for k, v in vars(args).items() if k in RESUME_FLAGS}}
    summary = mine_to_file(records, args.output, source, corpus, args.n_negatives, args.top_k, args.skip_top,
                           args.margin, args.match, qrels, args.append, id_to_row, resume_key=key,
                           workers=args.workers or default_workers())
    if qrels is not None and summary.judged == 0:
        logger.warning("no question id of the input appears in %s, so the qrels removed nothing", args.qrels)
    print(format_summary({"source": args.source, **summary.table(), "output": args.output}))


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc mine``."""
    p = subparsers.add_parser("mine", help="mine hard negatives (BM25 or dense) into a DPR training file",
                              description=__doc__.splitlines()[0] + " Interrupted, the same command resumes after "
                              "the last finished chunk of 1,024 questions.")
    p.add_argument("--source", default="bm25", help="where candidates come from: bm25 (bm25s) or dense (default bm25)")
    p.add_argument("--train-file", help="DPR training file (.json/.jsonl, optionally .gz) whose questions to mine for")
    p.add_argument("--beir-dir", help="BEIR folder (queries.jsonl, qrels/SPLIT.tsv, corpus.jsonl); positives: qrels")
    p.add_argument("--split", default="train", help="qrels split of --beir-dir (default train)")
    p.add_argument("--output", type=output_file, required=True,
                   help="DPR training file to write (.jsonl -> JSONL, else a JSON list)")
    p.add_argument("--corpus", help="passages to mine from (default: the BEIR corpus or the one recorded in --index)")
    p.add_argument("--model", help="trained retriever folder (dense source)")
    p.add_argument("--index", type=output_dir,
                   help="index folder from 'dpr-gc index'; built here from --embeddings if missing")
    p.add_argument("--embeddings", type=output_dir,
                   help="encode shards folder (encoded here if it has none), for a new flat index")
    p.add_argument("--bm25-index", type=output_dir,
                   help="folder to save the BM25 index to, or load it from if built already")
    p.add_argument("--bm25-k1", type=nonnegative_float, default=0.9, help="BM25 k1 (default 0.9, as Anserini)")
    p.add_argument("--bm25-b", type=nonnegative_float, default=0.4, help="BM25 b (default 0.4, as Anserini)")
    p.add_argument("--n-negatives", type=positive_int, default=30, help="hard negatives per question (default 30)")
    p.add_argument("--top-k", type=positive_int, default=100, help="candidates retrieved per question (default 100)")
    p.add_argument("--skip-top", type=nonnegative_int, default=0,
                   help="skip candidates ranked 1..N (likely false negatives)")
    p.add_argument("--margin", type=any_float, help="drop candidates scoring above (best positive score - MARGIN)")
    p.add_argument("--match", default="string", help="answer matching: string (NQ/TriviaQA) or regex (CuratedTREC)")
    p.add_argument("--qrels", help="relevance judgments: their positives (by question id) are never negatives")
    p.add_argument("--workers", type=nonnegative_int, default=0,
                   help="processes that tokenise candidates for answer matching (default 0: all cores)")
    p.add_argument("--append", action="store_true", help="keep existing hard_negative_ctxs and add the new ones")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="questions/passages per encoder batch (default 64)")
    p.add_argument("--device", type=device_arg, help="torch device (default: cuda if available)")
    p.add_argument("--cache-dir", help="where parsed corpora are cached")
    p.add_argument("--threads", type=nonnegative_int, default=0,
                   help="BM25 / FAISS search threads (default: bm25s 1, FAISS all)")
    p.add_argument("--skip-model-check", action="store_true",
                   help="do not refuse a model whose weights differ from the one that encoded the passages")
    add_prefix_arguments(p)
    p.set_defaults(func=_cli)
