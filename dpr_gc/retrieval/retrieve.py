"""Retrieve passages for questions: encode them in batches, search the index, write DPR JSON and a TREC run.

FAISS row r is corpus row r, so hits are looked up in the memory-mapped corpus dataset directly. Output records
follow DPR's retriever JSON (``question``, ``answers``, ``ctxs`` with ``id``, ``title``, ``text``, ``score``,
``has_answer``) plus the query ``id``, which joins them with qrels; the TREC run carries the same ranking.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import numpy as np
from tqdm.auto import tqdm

from ..evaluation.answers import MATCH_MODES, AnswerMatcher, UncompiledPatterns, default_workers
from ..base.args import home_expanded, input_dir, nonnegative_int, output_file, positive_int
from ..base.errors import DprGcError, Interrupted, rename_flags
from ..base.guard import check_outputs, guarded
from ..base.logs import counted, nested_bar_disabled
from ..evaluation.evaluate import ALWAYS_REPORTED, RunEvaluation, always_beyond
from ..base.files import ChunkedOutput, PathLike, is_stream, iter_jsonl, require_file, require_folder
from ..base.locks import output_lock
from .index import DenseIndex, Unscorable, set_threads
from .index_params import hnsw_ef, ivf_nprobe
from ..base.settings import (FREE, AppliesWhen, add_arguments, cache_dir_setting, check, device_setting,
                             flag_values, from_args, group, passage_prefix_setting, query_prefix_setting,
                             refuse_flags_that_do_not_apply, setting)
from ..evaluation.results import check_run_tag, open_results, open_trec_run
from ..base.tables import format_summary, seconds_text

logger = logging.getLogger(__name__)

MATCH_CHOICES = ("string", "regex", "none")
KEPT = ".retrieved"  # the finished records of output NAME are kept in .NAME.retrieved.partial
QUERY_CHUNK = 1024
KS = (1, 5, 10, 20, 100)


@dataclasses.dataclass
class RetrieveSettings:
    """What a retrieval writes and measures: passages per question, encoder batch, answer matching, the results
    file and TREC run, and the cut-offs evaluated (``ks`` None: no evaluation; on the command line ``--evaluate``
    turns on ``--k``)."""

    top_k: int = setting(100, "--top-k", type=positive_int, help="passages per question")
    batch_size: int = setting(64, "--batch-size", type=positive_int, help="questions per encoder batch")
    match: Optional[str] = setting("string", "--match", choices=MATCH_CHOICES,
                                   help="answer matching for has_answer: string (NQ/TriviaQA), regex (CuratedTREC) "
                                        "or none (None in code: no has_answer flags stored; --evaluate then matches "
                                        "answers by string)")
    output: Optional[PathLike] = setting(None, "--output", type=output_file,
                                         help="write DPR retriever JSON here (JSONL when named .jsonl; .gz compresses)")
    compact: bool = setting(False, "--compact", help="results without passage title and text: ids, scores and "
                                                     "has_answer (all that evaluate reads)")
    workers: int = setting(1, "--workers", type=nonnegative_int, cli_default=0,
                           help="processes that tokenise passages for answer matching (0: all cores; default: 0 on "
                                "the command line, 1 in code)")
    trec_run: Optional[PathLike] = setting(None, "--trec-run", type=output_file, help="write a TREC run file here")
    run_tag: str = setting("dpr-gc", "--run-tag", help="tag column of the TREC run")
    evaluate: bool = setting(False, "--evaluate", help="print answer accuracy and/or qrels metrics at --k")
    ks: Optional[list[int]] = setting(None, "--k", dest="k", type=positive_int, nargs="+", extend=True,
                                      help="cut-offs for --evaluate (default: those of 1 5 10 20 100 below --top-k, "
                                           "and --top-k)")

    def __post_init__(self) -> None:
        check(self)
        in_code = {dest: rule for dest, rule in APPLIES.items() if dest != "k"}  # ks alone turns evaluation on here
        refuse_flags_that_do_not_apply(RetrieveSettings, flag_values(self), in_code)

    def cutoffs(self, depth: Optional[int] = None) -> Optional[list[int]]:
        """The cut-offs to evaluate at (None: no evaluation): ``ks``, or when ``evaluate`` asks the defaults below
        the depth retrieved (``top_k``, or ``depth`` where the index holds fewer vectors) and that depth itself (a
        cut-off beyond the passages retrieved would repeat the depth's figure under another name)."""
        if self.ks:
            return list(self.ks)
        deepest = self.top_k if depth is None else min(self.top_k, depth)
        return sorted({k for k in KS if k < deepest} | {deepest}) if self.evaluate else None


@dataclasses.dataclass
class RetrieveJob:
    """``dpr-gc retrieve`` besides the index: which questions, with which model against which corpus, and how."""

    queries: str = setting("", "--queries", type=home_expanded,
                           required=True, help="DPR QA TSV/CSV, NQ-open JSONL or BEIR queries.jsonl")
    model: Optional[str] = setting(None, "--model", type=home_expanded,
                                   help="retriever folder or HF model (default: the model recorded in the index)")
    corpus: Optional[str] = setting(None, "--corpus", type=home_expanded,
                                    help="passages the index was built from (default: the corpus "
                                         "recorded in the index)")
    qrels: Optional[str] = setting(None, "--qrels", type=home_expanded,
                                   help="relevance judgments: only judged queries are retrieved; "
                                        "used by --evaluate")
    device: Optional[str] = device_setting("torch device for the question encoder (default: cuda if available)")
    cache_dir: Optional[str] = cache_dir_setting()
    check_model: bool = setting(True, "--skip-model-check", dest="skip_model_check", negate=True, resume=FREE,
                                help="do not refuse a model whose weights differ from the one that encoded the "
                                     "passages")
    query_prefix: Optional[str] = query_prefix_setting()
    passage_prefix: Optional[str] = passage_prefix_setting()
    settings: RetrieveSettings = group(RetrieveSettings, "retrieval")

    def __post_init__(self) -> None:
        check(self)


def check_compatible(retriever: Any, index: DenseIndex, check_fingerprint: bool = True,
                     passage_prefix: Optional[str] = None, verb: str = "retrieve") -> None:
    """Refuse a query encoder that does not fit the index: other dimension, pooling or (optionally) passage encoder
    weights, every byte of them (or, for an index recording the legacy fingerprint, its sample; see fingerprint.py).
    ``passage_prefix``: the ``--passage-prefix`` given (None: not given), named as the cause where the index's
    prefix differs; ``verb``: the command (retrieve, mine), as the remedy says it."""
    meta = index.meta
    built = f"index built from model {meta.get('model')}" if meta.get("model") else "index"
    if retriever.dim != index.dim:
        raise DprGcError(f"the model gives {retriever.dim}-dimensional vectors but the {built} holds {index.dim}-"
                         f"dimensional ones; {verb} with the model that encoded the passages")
    for key in ("pooling", "normalize", "passage_format", "passage_prefix"):
        ours = getattr(retriever.config, key)
        if meta.get(key) is None or meta[key] == ours:
            continue
        if key == "passage_prefix" and passage_prefix is not None:
            raise DprGcError(f"--passage-prefix {passage_prefix!r} differs from the {meta[key]!r} the {built} was "
                             f"encoded with; drop --passage-prefix ({verb} then takes the index's) or give "
                             f"{meta[key]!r}")
        raise DprGcError(f"the model uses {key}={ours!r} but the {built} was encoded with {meta[key]!r}; "
                         f"{verb} with the model that encoded the passages")
    if check_fingerprint and meta.get("model_fingerprint"):
        from .fingerprint import fingerprint_matches

        if not fingerprint_matches(retriever.passage_encoder, meta["model_fingerprint"]):
            raise DprGcError(f"the model's weights differ from those that encoded the passages ({built}); use that "
                             "model, or pass --skip-model-check if the passage encoder changed on purpose")


def check_corpus(index: DenseIndex, corpus: Any) -> None:
    """Refuse a corpus that is not the one the index rows point into (content fingerprint, size, first/last ids)."""
    from ..data.corpus import dataset_fingerprint

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
    recorded, current = meta.get("corpus_fingerprint"), dataset_fingerprint(corpus)
    if recorded and current and recorded != current:
        raise DprGcError(f"the corpus's content differs from the one encoded ({meta.get('corpus')}; fingerprint "
                         f"{current} vs {recorded}): if it was edited, re-run encode and index on it; otherwise give "
                         "the corpus that was encoded")
    if not recorded:
        logger.warning("the index records no corpus fingerprint (built before dpr-gc recorded one), so the corpus "
                       "contents cannot be checked against it; rebuild the index to get that check")


def check_inputs(retriever: Any, index: DenseIndex, corpus: Any, check_model: bool = True) -> None:
    """The command's checks of the query encoder (:func:`check_compatible`; ``check_model=False``: not its weights,
    as ``--skip-model-check``) and of the corpus (:func:`check_corpus`) against the index, for the library's entry
    points (``test_the_library_refuses_a_model_or_corpus_the_index_was_not_built_from``). An index object that records
    nothing (no ``meta``: any object with FAISS's ``search``) has only its dimension checked, as it is searched."""
    if getattr(index, "meta", None) is None:
        return
    check_compatible(retriever, index, check_fingerprint=check_model)
    check_corpus(index, corpus)


@dataclasses.dataclass
class HitCount:
    """Passages each question got, counted from the records (``write``, as the outputs are): FAISS returns fewer
    than ``asked`` (rows -1, dropped) where an IVF search probes lists holding fewer vectors or an HNSW beam reaches
    fewer, so the warning and the summary give what was retrieved, not what was asked."""

    asked: int
    questions: int = 0
    hits: int = 0
    fewest: Optional[int] = None
    most: int = 0
    short: int = 0

    def write(self, record: dict) -> None:
        n = len(record["ctxs"])
        self.questions, self.hits, self.short = self.questions + 1, self.hits + n, self.short + (n < self.asked)
        self.fewest = n if self.fewest is None else min(self.fewest, n)
        self.most = max(self.most, n)

    def depth(self, top_k: int) -> Any:
        """The summary's "top-k": ``top_k``, else the passages the questions got (fewest..most, mean), what was
        asked where no question got it all, and the flag."""
        if self.short:
            asked = f" of {self.asked} asked" if self.most < self.asked else ""
            return (f"{self.fewest}..{self.most}, mean {self.hits / self.questions:.1f}{asked} "
                    f"(--top-k {top_k})")
        return top_k if top_k == self.asked else f"{self.asked} (--top-k {top_k})"

    def warn(self, index: DenseIndex, evaluated: bool, flags: bool = False) -> None:
        """One warning, once the questions are retrieved, when some got fewer passages than asked: how many, the
        fewest and mean per question, and which search parameter of the index to raise; ``flags``: as ``dpr-gc
        retrieve``'s flag (``--nprobe``), else as the index's parameter (``nprobe``), which a library caller sets
        with :meth:`DenseIndex.set_search_params`."""
        if not self.short:
            return
        knobs = index.search_flags(flags)
        if not knobs:
            advice = "search it with a wider index"
        elif flags:
            advice = f"raise {' or '.join(knobs)}"
        else:
            advice = f"raise the index's {' or '.join(knobs)} " \
                     "(DenseIndex.set_search_params)"
        logger.warning("%s of %d got fewer than the %d passages asked for (fewest %d, mean %.1f per question): the "
                       "%s search (%s) reached no more; %s to retrieve them all%s",
                       counted(self.short, "question"), self.questions, self.asked, self.fewest,
                       self.hits / self.questions, index.meta.get("factory"),
                       index.search_settings(self.asked, flags=flags), advice,
                       "; the evaluation's figures count only the passages retrieved" if evaluated else "")


def iter_retrieve(retriever: Any, index: DenseIndex, corpus: Any, queries: Iterable[dict], top_k: int = 100,
                  batch_size: int = 64, matcher: Optional[AnswerMatcher] = None,
                  show_progress: bool = True, total: Optional[int] = None) -> Iterator[dict]:
    """Top-``top_k`` passages for each query as DPR retriever records (plus the query ``id``), yielded in order.

    Questions are embedded ``batch_size`` at a time and searched ``QUERY_CHUNK`` at a time, so memory holds one
    chunk; ``matcher`` (an :class:`AnswerMatcher`) fills each passage's ``has_answer``, ``None`` leaves it out.
    A question may get fewer than ``top_k`` passages: the hits an approximate search did not reach (FAISS row -1)
    are left out (:class:`HitCount` counts what each got).
    """
    if retriever.dim != index.dim:
        check_compatible(retriever, index, check_fingerprint=False)
    queries = iter(queries)
    bar = tqdm(desc="retrieving", unit=" q", total=total, disable=nested_bar_disabled(show_progress))
    try:  # closed as an interrupt or error leaves too, before the command prints its last line
        while chunk := list(itertools.islice(queries, QUERY_CHUNK)):
            emb = retriever.embed("query", [q["question"] for q in chunk], batch_size=batch_size,
                                  show_progress=show_progress and len(chunk) > batch_size)
            records = searched_records(chunk, *index.search(emb, top_k), corpus)
            if matcher is not None:
                flags = matcher.flags([(r["answers"], [(c["id"], c["text"]) for c in r["ctxs"]]) for r in records])
                for record, row in zip(records, flags):
                    for ctx, flag in zip(record["ctxs"], row):
                        ctx["has_answer"] = flag
            bar.update(len(chunk))
            yield from records
    finally:
        bar.close()


def searched_records(chunk: list[dict], scores: np.ndarray, rows: np.ndarray, corpus: Any) -> list[dict]:
    """The DPR retriever records of the questions ``chunk`` from their search's ``scores`` and corpus ``rows``
    (a row -1, a hit the search did not reach, is left out)."""
    unique = np.unique(rows[rows >= 0]).tolist()
    passages = corpus[unique] if unique else {"id": [], "title": [], "text": []}
    where = {row: i for i, row in enumerate(unique)}
    records = []
    for q, q_scores, q_rows in zip(chunk, scores.tolist(), rows.tolist()):
        ctxs = [{"id": str(passages["id"][i]), "title": passages["title"][i] or "", "text": passages["text"][i],
                 "score": score} for score, i in ((s, where[r]) for s, r in zip(q_scores, q_rows) if r >= 0)]
        records.append({"id": str(q["id"]), "question": q["question"], "answers": q.get("answers") or [],
                        "ctxs": ctxs})
    return records


class DenseSource:
    """Candidates from a FAISS index (row r = corpus row r) searched with ``retriever``'s question encoder.

    A positive's score is the one the index's search gives it (:meth:`DenseIndex.pair_scores`: the question and the
    positive embedded by the same encoders, the positive at the max length, precision and stored dtype the index
    records its passages were encoded with, through the index's transforms and codes; the dot product for a flat
    index), so it compares with the candidates' scores; :meth:`retrieve` returns, per question, the scores of all
    its positives. ``show_progress``: the questions and the positives of more than one batch are embedded under a
    bar each, as ``retrieve`` embeds a chunk's questions (nested: off in a log file while another bar is open).
    """

    def __init__(self, retriever: Any, index: Any, batch_size: int = 64, show_progress: bool = False) -> None:
        from .encode import PassagesAsEncoded

        self.retriever, self.index, self.batch_size, self.show_progress = retriever, index, batch_size, show_progress
        self.positives = PassagesAsEncoded(retriever, getattr(index, "meta", None))

    def check_positive_scores(self) -> None:
        """Refuse, in one line, the rules that compare candidates with positives' scores when the index cannot give
        a positive the score its search would."""
        dim = self.index.dim
        try:
            self.index.pair_scores(np.zeros((1, dim), np.float32), np.zeros((1, dim), np.float32))
        except Unscorable as e:
            raise DprGcError(f"--margin, --max-negative-ratio and --min-margin compare candidates with the "
                             f"positives' scores as the index gives them, which the {self.index.meta.get('factory')} "
                             f"index cannot ({e}); mine with another index (flat, IVF, PQ, HNSW over flat "
                             "vectors) or drop those flags") from None

    def retrieve(self, questions: list[str], k: int,
                 positives: Optional[list[list[tuple]]] = None) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
        emb = self.retriever.embed("query", questions, batch_size=self.batch_size,
                                   show_progress=self.show_progress and len(questions) > self.batch_size)
        scores, rows = self.index.search(emb, k)
        positive_scores: list[list[float]] = [[] for _ in questions]
        flat = [(i, g) for i, gs in enumerate(positives or []) for g in gs]
        if flat:
            self.check_positive_scores()
            pemb = self.positives.embed([g[1] for _, g in flat], [g[2] for _, g in flat], self.batch_size,
                                        self.show_progress and len(flat) > self.batch_size)
            for (i, _), s in zip(flat, self.index.pair_scores(emb[[i for i, _ in flat]], pemb).tolist()):
                positive_scores[i].append(s)
        return scores, rows, positive_scores


def retrieve(retriever: Any, index: DenseIndex, corpus: Any, queries: Iterable[dict], top_k: int = 100,
             batch_size: int = 64, match: Optional[str] = "string", show_progress: bool = True,
             workers: int = 1, check_model: bool = True) -> list[dict]:
    """All records of :func:`iter_retrieve` in a list (small runs); ``match`` ("string"/"regex") fills
    ``has_answer`` with DPR's answer matching, ``None`` (or ``"none"``, as the settings say it) leaves the field
    out. ``queries``: dicts as :func:`~dpr_gc.data.corpus.read_queries` gives them; ``corpus``: as
    :func:`~dpr_gc.data.corpus.load_corpus` gives it. Each record is DPR's retriever output, ``{"id", "question",
    "answers", "ctxs": [{"id", "title", "text", "score", "has_answer"}, ...]}``, best passage first. With ``match``
    "regex", answer patterns that do not compile are named in one warning before anything is retrieved: they never
    match, as in DPR. The model and corpus are checked against the index as the command checks them
    (:func:`check_inputs`; ``check_model=False`` is ``--skip-model-check``), and questions that got fewer passages
    than asked are named in a warning at the end (:class:`HitCount`)."""
    match = None if match == "none" else match
    if match is not None and match not in MATCH_MODES:
        raise DprGcError(f"--match must be one of {', '.join(MATCH_CHOICES)}, got {match!r}")
    check_inputs(retriever, index, corpus, check_model)
    queries = list(queries)  # the bar's total (the results are a list anyway)
    if match == "regex":
        uncompiled = UncompiledPatterns()
        for i, q in enumerate(queries):
            uncompiled.check(q.get("answers") or (), f"question {i}")
        uncompiled.warn("queries")
    with AnswerMatcher(match or "string", workers) as matcher:
        results = list(iter_retrieve(retriever, index, corpus, queries, top_k, batch_size,
                                     matcher if match is not None else None, show_progress, total=len(queries)))
    hits = HitCount(min(top_k, index.ntotal))
    for record in results:
        hits.write(record)
    hits.warn(index, evaluated=False)
    return results


def write_results_json(results: Iterable[dict], path: PathLike, compact: bool = False) -> Path:
    """Write DPR retriever JSON (a list of question records; JSONL when named .jsonl), atomically."""
    with open_results(path, compact) as out:
        for record in results:
            out.write(record)
    return Path(path)


def write_trec_run(results: Iterable[dict], path: PathLike, tag: str = "dpr-gc") -> Path:
    """Write a TREC run (``qid Q0 docid rank score tag``) from retriever records, atomically."""
    with open_trec_run(path, tag) as out:
        for record in results:
            out.write(record)
    return Path(path)


def scan_queries(path: PathLike, qrels: Optional[dict[str, dict[str, int]]] = None,
                 qrels_path: Optional[PathLike] = None, run_ids: bool = False,
                 match: Optional[str] = None) -> tuple[int, int]:
    """First pass over a questions file, before any retrieval: parse every line (a malformed one fails now, not an
    hour in), check the ids a TREC run needs (``run_ids``: non-empty, one word), and count the questions to
    retrieve (with ``qrels``, the judged ones) and those of them with answers. Repeated ids are refused by the
    reader, naming their lines. With ``match`` "regex", answer patterns that do not compile are named in one warning
    now: they never match, as in DPR. Returns ``(questions, questions with answers)``."""
    from ..data.corpus import iter_numbered_queries

    count = total = answered = 0
    first = None
    uncompiled = UncompiledPatterns()
    for line_no, q in iter_numbered_queries(path):
        qid, total = str(q["id"]), total + 1
        first = qid if first is None else first
        if run_ids and (not qid or any(c.isspace() for c in qid)):
            raise DprGcError(f"{path}:{line_no}: query id {qid!r} is empty or contains whitespace; a TREC run "
                             "(--trec-run) needs one-word query ids; rename it")
        if qrels is None or qid in qrels:
            count, answered = count + 1, answered + bool(q.get("answers"))
            if match == "regex":
                uncompiled.check(q.get("answers") or (), f"line {line_no}")
    if not total:
        raise DprGcError(f"no queries in {path} (the file is empty)")
    if not count:
        judged = next(iter(qrels), None) if qrels else None
        raise DprGcError(f"no query id in {path} (the first: {first!r}) appears in {qrels_path} (the first judged: "
                         f"{judged!r}); check that the two files use the same ids")
    uncompiled.warn(str(path))
    return count, answered


def queries_to_retrieve(queries_path: PathLike, qrels_path: Optional[PathLike],
                        s: RetrieveSettings) -> tuple[Optional[dict[str, dict[str, int]]], int]:
    """Read the qrels and check the questions (:func:`scan_queries`) before anything loads or is retrieved, and
    refuse ``--evaluate`` with nothing to evaluate against: no question has answers and no qrels are given (BEIR
    queries). Returns the qrels (None without) and the number of questions to retrieve."""
    from ..data.qrels import read_qrels

    qrels = read_qrels(qrels_path) if qrels_path else None
    count, answered = scan_queries(queries_path, qrels, qrels_path, run_ids=bool(s.trec_run), match=s.match)
    if s.cutoffs() is not None and qrels is None and not answered:
        raise DprGcError(f"{queries_path}: none of its {counted(count, 'question')} has answers, so --evaluate has "
                         "nothing to evaluate (no answer accuracy, no qrels): give --qrels FILE, or drop --evaluate")
    if s.cutoffs() is not None and answered and s.match in (None, "none"):
        logger.info("--match none stores no has_answer flags: --evaluate matches the answers of %s with %s matching",
                    counted(answered, "question"), evaluation_match(s.match))
    return qrels, count


def evaluation_match(match: Optional[str]) -> str:
    """The answer matching an evaluation of a retrieval with ``match`` uses: its own, or string matching where
    ``match`` (None, "none") stores no ``has_answer`` flags to evaluate."""
    return "string" if match in (None, "none") else match


def judged_queries(path: PathLike, qrels: Optional[dict[str, dict[str, int]]] = None) -> Iterator[dict]:
    """The questions of ``path`` one at a time; with ``qrels``, only the judged ones (BEIR queries.jsonl lists every
    split's queries)."""
    from ..data.corpus import iter_queries

    return (q for q in iter_queries(path, log=False) if qrels is None or str(q["id"]) in qrels)


def retrieve_to_files(retriever: Any, index: DenseIndex, corpus: Any, queries: Iterable[dict],
                      settings: Optional[RetrieveSettings] = None, *, qrels: Optional[dict[str, dict[str, int]]] = None,
                      show_progress: bool = True, total: Optional[int] = None, resume_key: Optional[dict] = None,
                      check_model: bool = True, **options: Any) -> dict[str, dict[str, float]]:
    """Retrieve ``queries`` (any iterable, read once; ``total``: their number, for the progress bar) with
    ``settings`` (fields of :class:`RetrieveSettings` may also be given as keywords), writing the results file
    (``compact``: without passage text) and the TREC run as records come and evaluating them on the way at the
    cut-offs (:meth:`RetrieveSettings.cutoffs`); returns the metrics (empty without evaluation).

    With a ``resume_key`` (what the records depend on: inputs and settings) finished records are kept chunk by chunk
    beside the first output (:func:`retrieve_kept`), and a run with the same key continues after the last finished
    chunk of an interrupted one. Answers are matched once per run: evaluation reuses the ``has_answer`` flags
    written to the results (with ``match`` None or ``none`` they are matched for the evaluation only, with DPR's
    string matching). The model and corpus are first checked against the index as the command checks them
    (:func:`check_inputs`; ``check_model=False`` is ``--skip-model-check``); questions that got fewer passages than
    asked are named in a warning at the end (:class:`HitCount`), and so, with ``match`` "regex", are answer patterns
    that do not compile (they never match, as in DPR).
    """
    s = dataclasses.replace(settings or RetrieveSettings(), **options)
    check_inputs(retriever, index, corpus, check_model)
    uncompiled = UncompiledPatterns()
    if s.match == "regex":
        queries = patterns_noted(queries, uncompiled)
    metrics = write_retrieval(retriever, index, corpus, queries, s, qrels, show_progress, total, resume_key)[0]
    uncompiled.warn("queries")
    return metrics


def patterns_noted(queries: Iterable[dict], uncompiled: UncompiledPatterns) -> Iterator[dict]:
    """``queries`` as they are read, each one's answer patterns that do not compile noted in ``uncompiled`` (a stream
    is read once, so :func:`retrieve_to_files` names them when it has retrieved)."""
    for i, q in enumerate(queries):
        uncompiled.check(q.get("answers") or (), f"question {i}")
        yield q


def write_retrieval(retriever: Any, index: DenseIndex, corpus: Any, queries: Iterable[dict], s: RetrieveSettings,
                    qrels: Optional[dict[str, dict[str, int]]], show_progress: bool, total: Optional[int],
                    resume_key: Optional[dict], flags: bool = False) -> tuple[dict[str, dict[str, float]], HitCount]:
    """:func:`retrieve_to_files` once its inputs are checked (:func:`run_retrieval` checks them as they load, each
    once); returns the metrics and the passages the questions got. ``flags``: the settings came as ``dpr-gc
    retrieve``'s flags, which its warnings then name (a library caller, the demo among them, has none)."""
    match = None if s.match == "none" else s.match
    if s.trec_run:
        check_run_tag(s.run_tag)
    depth = retrieved_depth(s.top_k, index, flags)
    warn_cut_offs_beyond(s, depth, flags, judged=qrels is not None)
    hits = HitCount(depth)
    with AnswerMatcher(evaluation_match(match), default_workers(s.workers)) as matcher:
        def records(todo: Iterable[dict], left: Optional[int]) -> Iterator[dict]:
            return iter_retrieve(retriever, index, corpus, todo, s.top_k, s.batch_size,
                                 matcher if match is not None else None, show_progress, left)

        def write(done: Iterable[dict]) -> dict[str, dict[str, float]]:
            return write_outputs(done, s, qrels, matcher if match is None else None, hits)

        first = s.output or s.trec_run
        if resume_key is None or not first:
            with contextlib.closing(records(queries, total)) as todo:  # its bar closes as an interrupt leaves
                metrics = write(todo)
        else:
            metrics = retrieve_kept(Path(first), resume_key, queries, total, records, write)
    hits.warn(index, evaluated=s.cutoffs() is not None, flags=flags)
    return metrics, hits


def kept_records(first: Path, key: Optional[dict] = None) -> ChunkedOutput:
    """The finished records a retrieval into the output ``first`` keeps beside it: ``.NAME.retrieved.partial``, with
    its progress record ``.NAME.retrieved.progress.json``."""
    return ChunkedOutput(first.with_name(first.name + KEPT), key, output=first)


def retrieve_kept(first: Path, key: dict, queries: Iterable[dict], total: Optional[int],
                  records: Callable[[Iterable[dict], Optional[int]], Iterator[dict]],
                  write: Callable[[Iterator[dict]], Any]) -> Any:
    """Retrieve into a hidden file of finished records beside the output ``first`` (one JSON record per line,
    :func:`kept_records`, a chunk of ``QUERY_CHUNK`` questions at a time), skipping the questions an interrupted
    run with the same ``key`` finished; then ``write`` the outputs from it, whole, and delete it. Interrupted, the
    message names the kept file and how to continue or drop it; finished, the run reports what interrupted runs
    into other outputs left in the folder (:func:`report_kept_elsewhere`). Returns what ``write`` returns."""
    kept = kept_records(first, key)
    note = kept.discarded_note("retrieved", {"top_k": "--top-k", "match": "--match"})
    if note:
        logger.info("%s", note)
    done = int((kept.resume() or {}).get("count", 0))
    if done:
        logger.info("resuming an interrupted run: %s already retrieved (kept in %s)", counted(done, "question"),
                    kept.partial)
    try:
        chunk: list[str] = []
        count = done
        for record in records(itertools.islice(queries, done, None), None if total is None else total - done):
            chunk.append(json.dumps(record, ensure_ascii=False) + "\n")
            if len(chunk) == QUERY_CHUNK:
                count += len(chunk)
                kept.append("".join(chunk), {"count": count})
                chunk = []
        kept.append("".join(chunk), {"count": count + len(chunk)})
        result = write(record for _, record in iter_jsonl(kept.partial))
    except KeyboardInterrupt:
        if kept.saved() is None:
            raise
        raise Interrupted(kept_advice(kept)) from None
    except Exception:
        if kept.saved() is not None:
            logger.warning("%s", kept_advice(kept))
        raise
    kept.discard()
    report_kept_elsewhere(first)
    return result


def kept_advice(kept: ChunkedOutput) -> str:
    """What an interrupted retrieval kept (``kept`` holds finished records), and how to continue or drop it."""
    return (f"{counted(kept_count(kept), 'question')} retrieved are kept in {kept.partial}; run the same command "
            f"again to continue after them, or delete it and {kept.progress.name} to give up")


def kept_count(kept: ChunkedOutput) -> int:
    """How many questions the finished records in ``kept`` answer, as its progress record says (0 if it cannot)."""
    state = (kept.saved() or {}).get("state")
    count = state.get("count") if isinstance(state, dict) else None
    return count if type(count) is int else 0


def report_kept_elsewhere(first: Path) -> None:
    """Warn about each file of finished records that an interrupted retrieval into another output of ``first``'s
    folder left there (as large as its results), naming it and how to continue or delete it; delete those no run
    can continue (no usable progress record). Files of a running retrieval (its output locked) are left alone."""
    folder = first.parent
    names = {p.name[1:].removesuffix(suffix) for suffix in (f"{KEPT}.partial", f"{KEPT}.progress.json")
             for p in folder.glob(f".*{suffix}")}
    for name in sorted(names - {first.name}):
        output = folder / name
        kept = kept_records(output)
        try:
            with output_lock(output):
                saved = kept.saved()
                if saved is None or saved["key"] is None:
                    kept.discard()
                    logger.info("removed %s, left by an interrupted retrieval into %s: no run can continue it",
                                kept.partial, output)
                else:
                    logger.warning("%s (%.1f MiB) keeps %s an interrupted retrieval into %s finished; run that "
                                   "command again to continue it, or delete it and %s", kept.partial,
                                   kept.partial.stat().st_size / 2**20, counted(kept_count(kept), "question"),
                                   output, kept.progress.name)
        except DprGcError:  # a running retrieval holds the output (or it is a folder): not ours to judge
            continue


def write_outputs(records: Iterable[dict], s: RetrieveSettings, qrels: Optional[dict[str, dict[str, int]]],
                  matcher: Optional[AnswerMatcher], hits: Optional[HitCount] = None) -> dict[str, dict[str, float]]:
    """Write ``records`` to the results file and the TREC run of ``s`` (each atomically) and evaluate them at its
    cut-offs (``matcher``: match answers for the evaluation, else use the records' ``has_answer``); ``hits`` counts
    the passages each record holds (the default cut-offs stop at the depth it was asked for)."""
    ks = s.cutoffs(hits.asked if hits is not None else None)
    with contextlib.ExitStack() as stack:
        writers: list[Any] = [hits] if hits is not None else []
        if s.output:
            writers.append(stack.enter_context(open_results(s.output, s.compact)))
        if s.trec_run:
            writers.append(stack.enter_context(open_trec_run(s.trec_run, s.run_tag)))
        evaluation = None
        if ks is not None:
            evaluation = RunEvaluation(ks, qrels, matcher)
            writers.append(evaluation)
        for record in records:
            for writer in writers:
                writer.write(record)
        return evaluation.report() if evaluation is not None else {}


# ----------------------------------------------------------------------------------------------- command line
def recorded_prefixes(meta: dict, query_prefix: Optional[str],
                      passage_prefix: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """The prefixes to load the query encoder with: the flags when given, else those the passages were encoded
    under (recorded by ``encode``, its own flags included), else None (the model's own)."""
    return (query_prefix if query_prefix is not None else meta.get("query_prefix"),
            passage_prefix if passage_prefix is not None else meta.get("passage_prefix"))


def recorded_corpus(meta: dict, index_dir: Optional[PathLike] = None) -> Optional[str]:
    """The corpus an index records (None when it records none), found as :func:`recorded_model` finds the model; one
    that was a pipe or device (``--corpus <(...)`` recorded as ``/dev/fd/63``) is gone, or is now another stream, so
    it is refused in one line asking for ``--corpus``."""
    corpus = meta.get("corpus")
    if corpus and (is_stream(corpus) or Path(corpus).parts[:2] in (("/", "dev"), ("/", "proc"))):
        raise DprGcError(f"the recorded corpus {corpus} was a pipe; give --corpus (the passages encoded)")
    return recorded_path(index_dir, meta, "corpus")


def recorded_model(index_dir: Optional[PathLike], meta: dict) -> Optional[str]:
    """The model an index records: its absolute path, else the path relative to the index folder (the two were
    moved together), else the name as recorded (a Hugging Face name, or a relative path from an older version)."""
    return recorded_path(index_dir, meta, "model")


def recorded_path(index_dir: Optional[PathLike], meta: dict, key: str) -> Optional[str]:
    """``meta[key]`` where it exists, else ``meta[key + "_from_index"]`` under ``index_dir`` where that exists (the
    index moved together with it), else ``meta[key]`` as recorded."""
    path = meta.get(key)
    if path and Path(path).is_absolute() and Path(path).exists():
        return path
    relative = meta.get(f"{key}_from_index")
    if relative and index_dir is not None and (Path(index_dir) / relative).exists():
        return str(Path(index_dir) / relative)
    return path


QUERIES, QRELS = "--queries file", "--qrels file"


def run_retrieval(index: DenseIndex, job: RetrieveJob,
                  index_dir: Optional[PathLike] = None) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Load the query encoder (default: the model the index records, relative to ``index_dir`` if moved with it),
    the corpus and the questions of ``job``, retrieve while writing and evaluating (see :class:`RetrieveSettings`).
    Returns ``(metrics, summary)``."""
    from ..data.corpus import load_corpus
    from ..base.devices import default_device
    from ..model.retriever import Retriever

    s = job.settings
    if not (s.output or s.trec_run or s.cutoffs() is not None):
        raise DprGcError("nothing to do: give --output FILE.json and/or --trec-run FILE, or --evaluate")
    model = job.model or recorded_model(index_dir, index.meta)
    corpus_path = job.corpus or recorded_corpus(index.meta, index_dir)
    if not model or not corpus_path:
        raise DprGcError("give --model and --corpus (the index does not record them)")
    require_file(job.queries, QUERIES)  # before the model loads, and named by its flag
    if job.qrels:
        require_file(job.qrels, QRELS)
    check_outputs({"the index's recorded --model": None if job.model else model,
                   "the index's recorded --corpus": None if job.corpus else corpus_path},
                  {"--output": s.output, "--trec-run": s.trec_run, "--cache-dir": job.cache_dir})
    qrels, count = queries_to_retrieve(job.queries, job.qrels, s)  # a bad question fails before the model loads
    retriever = Retriever.load(model, default_device(job.device),
                               *recorded_prefixes(index.meta, job.query_prefix, job.passage_prefix)).check_room("query")
    check_compatible(retriever, index, job.check_model, job.passage_prefix)  # before the corpus loads
    passages = load_corpus(corpus_path, job.cache_dir)
    check_corpus(index, passages)
    log_choices(job, model, corpus_path, retriever, index)
    key = retrieval_key(retriever, index, passages, job)
    first = s.output or s.trec_run
    resumed = kept_before(Path(first), key) if first else 0
    started = time.perf_counter()
    metrics, hits = write_retrieval(retriever, index, passages, judged_queries(job.queries, qrels), s, qrels, True,
                                    count, key, flags=True)
    seconds = time.perf_counter() - started
    return metrics, {"queries": count, **({"judged queries": len(qrels)} if qrels is not None else {}),
                     **({"resumed (retrieved before)": resumed} if resumed else {}),
                     "top-k": hits.depth(s.top_k),
                     "vectors": index.ntotal, "search": index.search_settings(s.top_k),
                     "seconds": round(seconds, 2),
                     "queries/s": round((count - resumed) / seconds, 1) if seconds > 0 and count > resumed else "-",
                     "results": s.output or "-", "trec run": s.trec_run or "-"}


def log_choices(job: RetrieveJob, model: str, corpus_path: str, retriever: Any, index: DenseIndex) -> None:
    """One log line of what the run took without being told: the model and corpus the index records, the device,
    the query encoder's precision and CPU threads (on the CPU: ``--threads`` bounds them too, FAISS and torch share
    one OpenMP runtime), the search settings (the efSearch the ``--top-k`` search runs with) and FAISS's threads."""
    from ..base.devices import cpu_threads
    from .index import faiss_threads

    recorded, device = " (recorded in the index)", next(retriever.parameters()).device
    logger.info("questions encoded by %s%s on %s in fp32, batch %d%s; index %s of %s, search %s, FAISS threads %d; "
                "passages from %s%s", model, "" if job.model else recorded, device, job.settings.batch_size,
                cpu_threads(device), index.meta.get("factory"), counted(index.ntotal, "vector"),
                index.search_settings(job.settings.top_k), faiss_threads(), corpus_path, "" if job.corpus else recorded)


def kept_before(first: Path, key: dict) -> int:
    """How many questions an interrupted retrieval with the same ``key`` kept beside ``first`` (read only: the run
    itself resumes them, :func:`retrieve_kept`)."""
    kept = kept_records(first, key)
    saved = kept.saved()
    return kept_count(kept) if saved is not None and kept.key is not None and saved["key"] == kept.key else 0


def retrieval_key(retriever: Any, index: DenseIndex, corpus: Any, job: RetrieveJob) -> dict:
    """What the records of ``job`` depend on -- the questions and qrels by content, the index build and its search
    parameters, the corpus, the query encoder's weights and settings, top-k and answer matching -- so an
    interrupted run resumes only into the same retrieval (see :func:`retrieve_kept`)."""
    from ..data.corpus import corpus_fingerprint, dataset_fingerprint
    from .fingerprint import weights_fingerprint

    return {"queries": corpus_fingerprint(job.queries, QUERIES),
            "qrels": corpus_fingerprint(job.qrels, QRELS) if job.qrels else None,
            "index": [index.meta.get("index_file"), index.meta.get("params"), index.ntotal],
            "corpus": dataset_fingerprint(corpus), "model": [weights_fingerprint(retriever), repr(retriever.config)],
            "top_k": job.settings.top_k, "match": job.settings.match}


def retrieved_depth(top_k: int, index: Any, flags: bool = False) -> int:
    """Passages each question asks for: ``top_k``, or all of a smaller index (named in a warning, since the results
    and the summary would otherwise claim the depth asked for; "at most" where an IVF or HNSW search may reach
    fewer, :class:`HitCount`). ``flags``: the warning names ``--top-k``, else it says top-k in words."""
    vectors = getattr(index, "ntotal", None)
    if vectors is None or top_k <= vectors:
        return top_k
    at_most = "at most " if getattr(index, "search_flags", lambda: [])() else ""
    logger.warning("%s beyond the index's %d vectors: each question gets %sthose %d passages",
                   f"--top-k {top_k}" if flags else f"a top-k of {top_k} is", vectors, at_most, vectors)
    return vectors


def warn_cut_offs_beyond(s: RetrieveSettings, depth: int, flags: bool, judged: bool = False) -> None:
    """Name the cut-offs ``s.ks`` asks for beyond the ``depth`` retrieved, whose figures count only those passages
    (the default cut-offs stop at the top-k, warned of by :func:`retrieved_depth`), and with qrels (``judged``)
    nDCG@10 and MRR@10, reported whatever the cut-offs; ``flags``: as ``--k`` and ``--top-k``, else in words."""
    cutoffs = s.cutoffs(depth)
    beyond = [k for k in s.ks or () if k > depth]
    always = judged and cutoffs is not None and always_beyond(cutoffs, depth)
    if not beyond and not always:
        return
    cut_offs = " ".join(map(str, beyond))
    named = [f"--k {cut_offs}" if flags else f"{'cut-off' if len(beyond) == 1 else 'cut-offs'} {cut_offs}"] \
        if beyond else []
    limit = f"the index's {depth} vectors" if depth < s.top_k else f"--top-k {depth}" if flags else \
        f"the top-k of {depth}"
    logger.warning("%s beyond %s: those figures count only the %d passages retrieved per question",
                   ", ".join(named + ([ALWAYS_REPORTED] if always else [])), limit, depth)


def retrieve_file(retriever: Any, index: DenseIndex, corpus: Any, queries_path: PathLike,
                  qrels_path: Optional[PathLike] = None, trec_run: Optional[PathLike] = None,
                  **options: Any) -> tuple[dict[str, dict[str, float]], int]:
    """:func:`retrieve_to_files` over the questions of a file (only those judged in ``qrels_path`` when given), read
    in two streaming passes -- checks (:func:`queries_to_retrieve`), then retrieval -- so memory does not grow with
    their number. Returns the metrics and the number of questions retrieved."""
    if trec_run:
        options["trec_run"] = trec_run
    fields = {f.name for f in dataclasses.fields(RetrieveSettings)}
    s = dataclasses.replace(options.get("settings") or RetrieveSettings(),
                            **{k: v for k, v in options.items() if k in fields})
    qrels, count = queries_to_retrieve(queries_path, qrels_path, s)  # names patterns that do not compile
    check_inputs(retriever, index, corpus, options.get("check_model", True))
    metrics, _ = write_retrieval(retriever, index, corpus, judged_queries(queries_path, qrels), s, qrels,
                                 options.get("show_progress", True), count, options.get("resume_key"))
    return metrics, count


def retrieve_with_flags(args: argparse.Namespace, index: DenseIndex, index_name: str,
                        index_dir: Optional[PathLike] = None,
                        device: Optional[str] = None,
                        flag_names: Optional[Mapping[str, str]] = None,
                        started: Optional[float] = None) -> dict[str, dict[str, float]]:
    """The command-line side of :func:`run_retrieval`, shared by ``dpr-gc retrieve`` and
    ``scripts/dense_retriever.py``: flags to arguments (``device`` when given replaces ``--device``), then the
    metric tables and the summary table printed, naming each flag as ``flag_names`` spells it (a script's
    spelling, as :func:`~dpr_gc.base.errors.flags_renamed` does for errors and log lines); returns the metrics.
    The summary's time is the command's since ``started`` (its ``time.perf_counter()``; default: this call's
    start), the index read or built included, as every stage's summary times its whole command."""
    from ..base.devices import steady_malloc
    from ..evaluation.evaluate import format_table, metrics_heading

    started = time.perf_counter() if started is None else started
    steady_malloc()
    job = from_args(RetrieveJob, args)
    settings = dataclasses.replace(job.settings, ks=job.settings.ks if job.settings.evaluate else None)
    job = dataclasses.replace(job, device=device or job.device, settings=settings)
    metrics, summary = run_retrieval(index, job, index_dir)
    judged = summary.pop("judged queries", None)
    for name, values in metrics.items():  # each heading says how many queries its figures are averaged over
        count = judged if name == "qrels" and judged is not None else summary["queries"]
        print(f"\n{metrics_heading(name, count, evaluation_match(job.settings.match))}")
        print(format_table(values))
    text = summary_text(summary, index_name, time.perf_counter() - started)
    print(("\n" if metrics else "") + rename_flags(text, flag_names or {}))
    return metrics


def summary_text(summary: dict[str, Any], index_name: str, seconds: Optional[float] = None) -> str:
    """The closing table of :func:`run_retrieval`'s summary (whose keys stay as they are): the questions, the depth
    and the index first, the results file as ``output``, the retrieval's own seconds (encoding, search, writing:
    what ``queries/s`` divides) as ``retrieval``, and the command's ``seconds`` (default: the retrieval's) as the
    time row."""
    rows = {"queries": summary["queries"], "top-k": summary["top-k"], "index": index_name,
            **{k: v for k, v in summary.items() if k not in ("queries", "top-k", "seconds", "results")},
            "output": summary["results"], "retrieval": seconds_text(summary["seconds"])}
    return format_summary(rows, summary["seconds"] if seconds is None else seconds)


APPLIES = {"k": AppliesWhen(lambda a: a.evaluate, "without --evaluate (it sets the cut-offs evaluated)",
                            "add --evaluate"),
           "run_tag": AppliesWhen(lambda a: bool(a.trec_run), "without --trec-run (it tags the run file's lines)",
                                  "add --trec-run FILE"),
           "compact": AppliesWhen(lambda a: bool(a.output), "without --output (it trims the results JSON)",
                                  "add --output FILE.json")}


@guarded(inputs=("index", "model", "corpus", "queries", "qrels"), outputs={"output": "file", "trec_run": "file"})
def _retrieve_cli(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    refuse_flags_that_do_not_apply(RetrieveJob, args, APPLIES)
    set_threads(args.threads)
    require_folder(args.index, "--index folder", "build one with `dpr-gc index`")  # named by its flag
    index = DenseIndex.read(args.index)
    if args.ef_search is not None or args.nprobe is not None:
        index.set_search_params(ef_search=args.ef_search, nprobe=args.nprobe)
    retrieve_with_flags(args, index, f"{index.meta['factory']} in {args.index}", index_dir=args.index,
                        started=started)


@dataclasses.dataclass
class IndexToSearch:
    """``dpr-gc retrieve``'s index: its folder, search-time overrides, FAISS threads."""

    index: str = setting("", "--index", type=input_dir, required=True, help="index folder written by 'dpr-gc index'")
    ef_search: Optional[int] = setting(None, "--ef-search", type=hnsw_ef,
                                       help="override the index's HNSW efSearch (default: the index's own)")
    nprobe: Optional[int] = setting(None, "--nprobe", type=ivf_nprobe,
                                    help="override the index's IVF nprobe (default: the index's own)")
    threads: Optional[int] = setting(None, "--threads", type=positive_int,
                                     help="FAISS threads, at most the CPUs (default: all cores); FAISS and torch "
                                          "share one OpenMP runtime, so this also bounds the question encoder's "
                                          "CPU threads")

    def __post_init__(self) -> None:
        check(self)


def add_retrieve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``dpr-gc retrieve`` other than the index location (generated from :class:`RetrieveJob`)."""
    add_arguments(p, RetrieveJob)


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc retrieve``."""
    p = subparsers.add_parser("retrieve",
                              description=__doc__.splitlines()[0])
    add_arguments(p, IndexToSearch)
    add_retrieve_arguments(p)
    p.set_defaults(func=_retrieve_cli)
