"""Mine hard negatives: retrieve top-K passages per training question, drop false negatives, keep N per question.

Candidates come from BM25 (bm25s; how DPR made its first negatives) or from a trained encoder and a FAISS index.
False negatives are dropped before anything is chosen: the question's gold passages (same id, or same text), passages
that contain an answer (``answers.AnswerMatcher``, the matching evaluation uses: each candidate passage tokenised once
per run) and qrels positives. Of the rest,
ranks ``<= skip_top`` are skipped and, with ``margin``, so is any candidate scoring above ``best positive score -
margin``. Positive-aware mining (NV-Retriever, 2024) then removes likely unlabelled positives: ``max_negative_ratio``
drops candidates scoring above R x the question's lowest-scoring positive ("TopK-PercPos", e.g. 0.95), ``min_margin``
those scoring above that positive's score - M. Positive scores come from the same source as the candidates (BM25
score, or the dense index's score: the model's dot product, the positive embedded as the index's passages were,
through the index's transforms and codes). The first
``n_negatives`` left (by rank) become ``hard_negative_ctxs``. Training files stream through in chunks of questions
and are rewritten record by record, so memory holds one chunk, not the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from .bm25 import BM25Source, bm25_index_exists, check_bm25_folder
from ..data.corpus import file_stamp, rows_for_ids, source_fingerprint
from ..data.training import beir_training_records, context_id, iter_numbered_training_file, iter_training_file
from ..base.args import (any_float, home_expanded, nonnegative_float, nonnegative_int, output_dir, output_file,
                         positive_float, positive_int, qrels_split, unit_float)
from ..base.errors import DprGcError, Interrupted, flags_renamed
from ..base.logs import counted
from ..base.guard import check_outputs, guarded
from ..base.files import ChunkedOutput, PathLike, require_file, require_folder
from ..base.locks import output_lock
from ..base.validate import given_id
from ..base.settings import (AppliesWhen, add_arguments, cache_dir_setting, check, device_setting, flag_values,
                             from_args, group, passage_prefix_setting, query_prefix_setting,
                             refuse_flags_that_do_not_apply, setting)
from ..evaluation.answers import MATCH_MODES, UncompiledPatterns
from .index import cap_threads
from .retrieve import DenseSource

logger = logging.getLogger(__name__)

CHUNK = 1024
# encode's flags in the messages of the encoding dense mining runs: it writes to mine's --embeddings, and settings
# mine does not take are encode's, for a run of it by hand
ENCODE_FLAGS = {"--output": "--embeddings", "--block-size": "dpr-gc encode --block-size",
                "--dtype": "dpr-gc encode --dtype", "--max-length": "dpr-gc encode --max-length",
                "--precision": "dpr-gc encode --precision", "--shard-id": "dpr-gc encode --shard-id",
                "--num-shards": "dpr-gc encode --num-shards"}
SOURCES = ("dense", "bm25")
# What an answer pattern that does not compile (it never matches) does to mining, for its warning.
UNMATCHED_EFFECT = ", so a passage holding such an answer may be mined as a hard negative"


@dataclasses.dataclass
class MineSettings:
    """Which candidates become hard negatives: ``top_k`` retrieved, ranks ``<= skip_top`` and (with ``margin``)
    those scoring above ``best positive - margin`` skipped, the first ``n_negatives`` kept; answer matching and
    its ``workers`` (0: all cores); ``chunk_size`` questions per resumable chunk."""

    n_negatives: int = setting(30, "--n-negatives", type=positive_int, help="hard negatives per question")
    top_k: int = setting(100, "--top-k", type=positive_int, help="candidates retrieved per question")
    skip_top: int = setting(0, "--skip-top", type=nonnegative_int,
                            help="skip candidates ranked 1..N (likely false negatives)")
    margin: Optional[float] = setting(None, "--margin", type=any_float,
                                      help="drop candidates scoring above (best positive score - MARGIN)")
    match: str = setting("string", "--match", choices=MATCH_MODES,
                         help="answer matching: string (NQ/TriviaQA) or regex (CuratedTREC)")
    append: bool = setting(False, "--append", help="keep existing hard_negative_ctxs and add the new ones (existing "
                                                   "ones that are gold, answer-bearing or --qrels positives dropped)")
    workers: int = setting(1, "--workers", type=nonnegative_int, cli_default=0,
                           help="processes that tokenise candidates for answer matching (0: all cores; default: 0 on "
                                "the command line, 1 in code)")
    chunk_size: int = setting(CHUNK, type=positive_int, help="questions per resumable chunk")
    max_negative_ratio: Optional[float] = setting(None, "--max-negative-ratio", type=positive_float,
                                                  help="positive-aware: drop candidates scoring above R x the "
                                                       "question's lowest positive score (e.g. 0.95; scored by the "
                                                       "candidates' own source: BM25 score or the dense index's "
                                                       "score)")
    min_margin: Optional[float] = setting(None, "--min-margin", type=any_float,
                                          help="positive-aware: drop candidates scoring above (lowest positive "
                                               "score - M)")

    def __post_init__(self) -> None:
        check(self)
        _check_filters(self.max_negative_ratio, self.min_margin)
        if not self.skip_top < self.top_k:
            raise DprGcError(f"need 0 <= --skip-top < --top-k, got top-k {self.top_k}, skip-top {self.skip_top}")


@dataclasses.dataclass
class SourceSettings:
    """Where candidates come from: BM25 (``k1``, ``b``, a saved index), or a trained retriever over a FAISS index
    (built from encode shards, which are encoded first when missing)."""

    model: Optional[str] = setting(None, "--model", type=home_expanded,
                                   help="trained retriever folder (dense source; default: the model "
                                        "recorded in --index)")
    index: Optional[PathLike] = setting(None, "--index", type=output_dir,
                                        help="index folder from 'dpr-gc index'; built here from --embeddings if "
                                             "missing")
    embeddings: Optional[PathLike] = setting(None, "--embeddings", type=output_dir,
                                             help="encode shards folder (encoded here if it has none), for a new "
                                                  "flat index in --index")
    bm25_index: Optional[PathLike] = setting(None, "--bm25-index", type=output_dir,
                                             help="folder to save the BM25 index to, or load it from if built already")
    k1: float = setting(0.9, "--bm25-k1", type=nonnegative_float, help="BM25 k1 (as Anserini)")
    b: float = setting(0.4, "--bm25-b", type=unit_float, help="BM25 b, 0 to 1: length normalisation (as Anserini)")
    batch_size: int = setting(64, "--batch-size", type=positive_int, help="questions/passages per encoder batch")
    device: Optional[str] = device_setting()
    cache_dir: Optional[PathLike] = cache_dir_setting()
    threads: int = setting(0, "--threads", type=nonnegative_int,
                           help="BM25 / FAISS search threads, at most the CPUs (0: bm25s 1, FAISS all); FAISS and "
                                "torch share one OpenMP runtime, so this also bounds the question encoder's CPU "
                                "threads")
    check_model: bool = setting(True, "--skip-model-check", dest="skip_model_check", negate=True,
                                help="do not refuse a model whose weights differ from the one that encoded the "
                                     "passages")
    query_prefix: Optional[str] = query_prefix_setting()
    passage_prefix: Optional[str] = passage_prefix_setting()

    def __post_init__(self) -> None:
        check(self)


@dataclasses.dataclass
class MineJob:
    """``dpr-gc mine``: the questions (a DPR training file or a BEIR folder), the corpus, the output, and how."""

    output: str = setting("", "--output", type=output_file, required=True,
                          help="DPR training file to write (.jsonl -> JSONL, else a JSON list)")
    source: str = setting("bm25", "--source", choices=SOURCES, help="where candidates come from: bm25 (bm25s) or "
                                                                     "dense")
    train_file: Optional[str] = setting(None, "--train-file", type=home_expanded,
                                        help="DPR training file (.json/.jsonl, optionally .gz) "
                                             "whose questions to mine for")
    beir_dir: Optional[str] = setting(None, "--beir-dir", type=home_expanded,
                                      help="BEIR folder (queries.jsonl, qrels/SPLIT.tsv, "
                                           "corpus.jsonl); positives: qrels")
    split: str = setting("train", "--beir-split", dest="split", type=qrels_split,
                         hidden=[("--split", {"type": qrels_split})],
                         help="qrels split of --beir-dir (qrels/SPLIT.tsv)")
    corpus: Optional[str] = setting(None, "--corpus", type=home_expanded,
                                    help="passages to mine from (default: the BEIR corpus, or with "
                                         "--source dense the one recorded in --index)")
    qrels: Optional[str] = setting(None, "--qrels", type=home_expanded,
                                   help="relevance judgments: their positives (by question id) are "
                                        "never negatives")
    candidates: SourceSettings = group(SourceSettings, "candidates")
    mining: MineSettings = group(MineSettings, "mining")


@dataclasses.dataclass
class MiningSummary:
    """Counts over all mined questions and statistics of the chosen negatives' scores; ``judged``: the questions with
    an entry in the ``qrels`` filter (None when mined without one)."""

    questions: int = 0
    judged: Optional[int] = None
    candidates: int = 0
    no_candidates: int = 0
    gold_dropped: int = 0
    answer_dropped: int = 0
    qrels_dropped: int = 0
    rank_skipped: int = 0
    margin_dropped: int = 0
    ratio_dropped: int = 0
    min_margin_dropped: int = 0
    unscored: int = 0
    ratio_unapplied: int = 0
    short: int = 0
    written: int = 0
    already_there: int = 0
    existing_dropped: int = 0
    score_sum: float = 0.0
    score_min: float = math.inf
    score_max: float = -math.inf

    def merge(self, other: "MiningSummary") -> None:
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is None or b is None:  # judged: counted only with a qrels filter
                setattr(self, f.name, b if a is None else a)
                continue
            setattr(self, f.name, {"score_min": min, "score_max": max}.get(f.name, lambda x, y: x + y)(a, b))

    def table(self, mining: Optional[MineSettings] = None) -> dict[str, Any]:
        """The rows of the closing summary table; given the ``mining`` settings, without the rows of rules they
        leave off (``--skip-top 0``, no ``--margin``, ...), which could only read 0."""
        def stat(v: float) -> Any:
            return round(v, 4) if self.written else "-"

        judged, judged_dropped = {}, {}
        if self.judged is not None:  # --qrels given (a BEIR folder's own qrels positives count as gold)
            judged, judged_dropped = ({"questions judged in --qrels": self.judged},
                                      {"qrels positives dropped": self.qrels_dropped})
        rows = {"questions": self.questions, **judged, "candidates seen": self.candidates,
                "questions without a candidate": self.no_candidates,
                "gold dropped": self.gold_dropped, "answer-bearing dropped": self.answer_dropped,
                **judged_dropped, "skipped by rank": self.rank_skipped,
                "dropped by margin": self.margin_dropped, "dropped by max negative ratio": self.ratio_dropped,
                "dropped by min margin": self.min_margin_dropped,
                "questions without a positive score": self.unscored,
                "questions the ratio skipped (positive score <= 0)": self.ratio_unapplied,
                "questions short of N": self.short,
                "negatives already in the record (not added)": self.already_there,
                "existing negatives dropped": self.existing_dropped,
                "negatives written": self.written, "mean score": stat(self.score_sum / max(self.written, 1)),
                "min score": stat(self.score_min), "max score": stat(self.score_max)}
        return rows if mining is None else {k: v for k, v in rows.items() if k not in rules_off(mining)}


def rules_off(mining: MineSettings) -> set[str]:
    """The summary rows of the rules ``mining`` leaves off."""
    off = set() if mining.skip_top else {"skipped by rank"}
    off |= set() if mining.margin is not None else {"dropped by margin"}
    off |= set() if mining.max_negative_ratio is not None else {"dropped by max negative ratio",
                                                                  "questions the ratio skipped (positive score <= 0)"}
    off |= set() if mining.min_margin is not None else {"dropped by min margin"}
    off |= set() if mining.append else {"negatives already in the record (not added)", "existing negatives dropped"}
    if not needs_positive_scores(mining.margin, mining.max_negative_ratio, mining.min_margin):
        off.add("questions without a positive score")
    return off


# ----------------------------------------------------------------------------------------------------- mining
def ctx_id(ctx: dict) -> str:
    """A DPR context's passage id (DPR files use ``passage_id``; others ``id``/``psg_id``/``_id``), or ''."""
    return str(context_id(ctx))


def _qid(record: dict) -> str:
    """A record's query id (``_id``, else ``id``, as every questions reader takes it), '' when it has none."""
    qid = given_id(record)
    return "" if qid is None else str(qid)


def _collapsed(text: str) -> str:
    """``text`` with every run of whitespace made one space (gold passages compare by this)."""
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class Limits:
    """One question's score ceilings for candidates (None: no ceiling): ``margin`` (best positive - margin),
    ``ratio`` (R x lowest positive), ``min_margin`` (lowest positive - M)."""

    margin: Optional[float] = None
    ratio: Optional[float] = None
    min_margin: Optional[float] = None


def _limits(positive_scores: Sequence[float], margin: Optional[float], max_negative_ratio: Optional[float],
            min_margin: Optional[float]) -> Limits:
    """The ceilings from one question's positive scores; a ratio needs a positive score above 0 to mean anything."""
    if not positive_scores:
        return Limits()
    low = min(positive_scores)
    return Limits(max(positive_scores) - margin if margin is not None else None,
                  max_negative_ratio * low if max_negative_ratio is not None and low > 0 else None,
                  low - min_margin if min_margin is not None else None)


def _check_filters(max_negative_ratio: Optional[float], min_margin: Optional[float]) -> None:
    if max_negative_ratio is not None and not (math.isfinite(max_negative_ratio) and max_negative_ratio > 0):
        raise DprGcError(f"--max-negative-ratio must be a number > 0 (e.g. 0.95), got {max_negative_ratio}")
    if min_margin is not None and not math.isfinite(min_margin):
        raise DprGcError(f"--min-margin must be a finite number (e.g. 0.05), got {min_margin}")


def _check_settings(n_negatives: int, top_k: int, skip_top: int, match_mode: str) -> None:
    from ..evaluation.answers import MATCH_MODES

    if n_negatives < 1:
        raise DprGcError(f"--n-negatives must be a positive integer, got {n_negatives}")
    if top_k < 1 or not 0 <= skip_top < top_k:
        raise DprGcError(f"need --top-k >= 1 and 0 <= --skip-top < --top-k, got top-k {top_k}, skip-top {skip_top}")
    if match_mode not in MATCH_MODES:
        raise DprGcError(f"--match must be one of {', '.join(MATCH_MODES)}, got {match_mode!r}")


def mine_hard_negatives(questions: Sequence[dict], source: Any, corpus: Any, settings: Optional[MineSettings] = None,
                        *, qrels: Optional[dict[str, dict[str, int]]] = None, id_to_row: Optional[dict[str, int]] = None,
                        matcher: Optional[Any] = None, show_progress: bool = False,
                        **options: Any) -> tuple[list[dict], MiningSummary]:
    """Hard negatives for DPR-style question records (``question``, ``answers``, ``positive_ctxs``, optional ``id``).

    Returns one ``{"id", "question", "hard_negative_ctxs"}`` per question -- each ctx ``{title, text, passage_id,
    score, rank}`` with ``score`` the source's (BM25's, or the index's search score: the dot product for a flat
    index) and ``rank`` the 1-based position in the retrieved list -- and a :class:`MiningSummary`.
    ``settings`` (fields of :class:`MineSettings` may also be given as keywords) say which candidates are kept:
    ``margin`` drops candidates scoring above the best positive's score minus ``margin``; questions whose positive
    has no score (BM25: positive not in the corpus) keep their candidates. ``max_negative_ratio`` (R) and
    ``min_margin`` (M) drop candidates scoring above R x, or M below, the lowest-scoring positive's score (the ratio
    only where that score is > 0), a positive scored as the source scores candidates (a dense index that cannot is
    refused); each removal is counted under the first rule that applies, in the order gold,
    answer, qrels, rank, margin, ratio, min margin. ``id_to_row`` maps positive ids to corpus rows for BM25 positive
    scores (looked up here when missing). ``matcher``, an ``AnswerMatcher`` for ``settings.match`` kept
    across calls, caches tokenised candidates between chunks. ``show_progress``: a bar counting the questions.
    """
    from ..evaluation.answers import AnswerMatcher

    s = dataclasses.replace(settings or MineSettings(), **options)
    n_negatives, top_k, skip_top, margin = s.n_negatives, s.top_k, s.skip_top, s.margin
    max_negative_ratio, min_margin = s.max_negative_ratio, s.min_margin
    _check_settings(n_negatives, top_k, skip_top, s.match)
    if matcher is None:
        with AnswerMatcher(s.match) as own:
            return mine_hard_negatives(questions, source, corpus, s, qrels=qrels, id_to_row=id_to_row, matcher=own,
                                       show_progress=show_progress)
    scored = needs_positive_scores(margin, max_negative_ratio, min_margin)
    if scored and isinstance(source, DenseSource):
        source.check_positive_scores()  # before any search
    if scored and id_to_row is None and isinstance(source, BM25Source):
        id_to_row = rows_for_ids(corpus, (ctx_id(c) for q in questions for c in q.get("positive_ctxs") or []))
    summary, records = MiningSummary(), []
    bar = tqdm(total=len(questions), desc="mining", unit=" q", disable=not show_progress)
    for start in range(0, len(questions), CHUNK):
        chunk = questions[start:start + CHUNK]
        rows_of = id_to_row or {}
        golds = [[(rows_of.get(ctx_id(c)), c.get("title") or "", c.get("text") or "")
                  for c in q.get("positive_ctxs") or []] for q in chunk]
        scores, rows, positive_scores = source.retrieve([q["question"] for q in chunk], top_k,
                                                        golds if scored else None)
        unique = np.unique(rows[rows >= 0]).tolist()
        cols = corpus[unique] if unique else {"id": [], "title": [], "text": []}
        where = {r: i for i, r in enumerate(unique)}
        all_hits = [[(rank, score, str(cols["id"][i]), cols["title"][i] or "", cols["text"][i])
                     for rank, (score, i) in enumerate(zip(q_scores, (where.get(r) for r in q_rows)), start=1)
                     if i is not None] for q_scores, q_rows in zip(scores.tolist(), rows.tolist())]
        flags = matcher.flags([(q.get("answers") or [], [(h[2], h[4]) for h in hits])
                               for q, hits in zip(chunk, all_hits)])
        for q, gold, pos, hits, has in zip(chunk, golds, positive_scores, all_hits, flags):
            summary.unscored += int(scored and not pos)
            limits = _limits(pos, margin, max_negative_ratio, min_margin)
            summary.ratio_unapplied += int(bool(pos) and max_negative_ratio is not None and limits.ratio is None)
            chosen = _select(q, hits, has, n_negatives, skip_top, limits, qrels, summary)
            records.append({"id": q.get("id"), "question": q["question"], "hard_negative_ctxs": chosen})
        bar.update(len(chunk))
    bar.close()
    return records, summary


def needs_positive_scores(margin: Optional[float], max_negative_ratio: Optional[float],
                          min_margin: Optional[float]) -> bool:
    """Whether any rule compares candidates with the positives' scores (BM25 then needs the positives' rows)."""
    return any(v is not None for v in (margin, max_negative_ratio, min_margin))


@dataclasses.dataclass(frozen=True)
class NeverNegative:
    """One question's passages that are never its negatives: its gold ids and texts (whitespace collapsed) and its
    ``--qrels`` positives."""

    ids: frozenset[str]
    texts: frozenset[str]
    judged: frozenset[str]

    @classmethod
    def of(cls, q: dict, qrels: Optional[dict[str, dict[str, int]]]) -> "NeverNegative":
        gold = q.get("positive_ctxs") or []
        judged = (qrels or {}).get(_qid(q), {})
        return cls(frozenset({ctx_id(c) for c in gold} - {""}),
                   frozenset(_collapsed(c.get("text") or "") for c in gold),
                   frozenset(d for d, rel in judged.items() if rel > 0))

    def rule(self, pid: str, text: Optional[str], answer: bool) -> Optional[str]:
        """The summary field counting the first rule that makes a passage a false negative (gold by id or by
        ``text``, None: unknown; answer-bearing; qrels positive), or None: a fair negative."""
        if pid in self.ids or (text is not None and _collapsed(text) in self.texts):
            return "gold_dropped"
        if answer:
            return "answer_dropped"
        return "qrels_dropped" if pid in self.judged else None


def _select(q: dict, hits: list[tuple[int, float, str, str, str]], has_answer: list[bool], n_negatives: int,
            skip_top: int, limits: Limits, qrels: Optional[dict[str, dict[str, int]]],
            summary: MiningSummary) -> list[dict]:
    """Drop false negatives among one question's ranked hits (``has_answer``: their answer flags), then keep the
    first ``n_negatives`` in range."""
    never, judged = NeverNegative.of(q, qrels), (qrels or {}).get(_qid(q), {})
    chosen: list[dict] = []
    for (rank, score, pid, title, text), answer in zip(hits, has_answer):
        rule = never.rule(pid, text, answer)
        if rule is not None:
            setattr(summary, rule, getattr(summary, rule) + 1)
        elif rank <= skip_top:
            summary.rank_skipped += 1
        elif limits.margin is not None and score > limits.margin:
            summary.margin_dropped += 1
        elif limits.ratio is not None and score > limits.ratio:
            summary.ratio_dropped += 1
        elif limits.min_margin is not None and score > limits.min_margin:
            summary.min_margin_dropped += 1
        elif len(chosen) < n_negatives:
            chosen.append({"title": title, "text": text, "passage_id": pid, "score": float(score), "rank": rank})
    scores = [c["score"] for c in chosen]
    summary.merge(MiningSummary(questions=1, judged=int(bool(judged)) if qrels is not None else None,
                                candidates=len(hits), no_candidates=int(not hits),
                                short=int(len(chosen) < n_negatives), written=len(chosen),
                                score_sum=sum(scores),
                                score_min=min(scores, default=math.inf), score_max=max(scores, default=-math.inf)))
    return chosen


def _merge(old: list, new: list[dict]) -> list:
    seen = {ctx_id(c) for c in old if isinstance(c, dict)}
    return list(old) + [c for c in new if c["passage_id"] not in seen]


def _existing_kept(records: Sequence[dict], matcher: Any, qrels: Optional[dict[str, dict[str, int]]],
                   part: MiningSummary) -> list[list]:
    """``--append``: each record's own hard negatives less the false negatives among them, by the rules mined ones
    go through (gold id or text, an answer in the text, a ``qrels`` positive), so the record's positives never
    stay negatives; those dropped are counted under ``part.existing_dropped``."""
    olds = [list(r.get("hard_negative_ctxs") or []) for r in records]
    checked = [[c for c in old if isinstance(c, dict)] for old in olds]
    flags = matcher.flags([(r.get("answers") or [], [(ctx_id(c), c.get("text") or "") for c in ctxs])
                           for r, ctxs in zip(records, checked)])
    kept = []
    for record, old, ctxs, has in zip(records, olds, checked, flags):
        never, answer = NeverNegative.of(record, qrels), {id(c): a for c, a in zip(ctxs, has)}
        kept.append([c for c in old if not isinstance(c, dict)
                     or never.rule(ctx_id(c), c.get("text") or None, answer[id(c)]) is None])
        part.existing_dropped += len(old) - len(kept[-1])
    return kept


def _appended(records: Sequence[dict], mined: Sequence[dict], part: MiningSummary, n_negatives: int,
              matcher: Any, qrels: Optional[dict[str, dict[str, int]]]) -> list[list]:
    """``--append``: each record's hard negatives (the false negatives among them dropped, :func:`_existing_kept`)
    with the mined ones added, and ``part`` made to count what was added, not what was mined: a negative already in
    the record is counted under ``already_there``, and ``written``, the score statistics and ``short`` (fewer than
    ``n_negatives`` added) cover the added ones only."""
    merged, added = [], []
    for old, m in zip(_existing_kept(records, matcher, qrels, part), mined):
        merged.append(_merge(old, m["hard_negative_ctxs"]))
        added.extend(merged[-1][len(old):])
        part.already_there += len(m["hard_negative_ctxs"]) - (len(merged[-1]) - len(old))
        part.short -= int(len(m["hard_negative_ctxs"]) < n_negatives) - int(len(merged[-1]) - len(old) < n_negatives)
    scores = [c["score"] for c in added]
    part.written, part.score_sum = len(added), sum(scores)
    part.score_min, part.score_max = min(scores, default=math.inf), max(scores, default=-math.inf)
    return merged


def in_chunks(records: Iterable[dict], chunk_size: int, flush: Callable[[list[dict]], None],
              kept: Callable[[], Optional[str]]) -> None:
    """Hand ``records`` to ``flush`` in lists of ``chunk_size``; interrupted, the message says what ``kept()`` says
    the finished chunks hold (nothing specific when it says None)."""
    buffer: list[dict] = []
    with kept_on_interrupt(kept):
        for record in records:
            buffer.append(record)
            if len(buffer) >= chunk_size:
                flush(buffer)
                buffer = []
        if buffer:
            flush(buffer)


@contextlib.contextmanager
def kept_on_interrupt(kept: Callable[[], Optional[str]]) -> Iterator[None]:
    """An interrupt within the block becomes :class:`Interrupted` with ``kept()``'s message (what finished work is
    kept and how to go on), or stays as it is when that says None."""
    try:
        yield
    except KeyboardInterrupt:
        advice = kept()
        if advice is None:
            raise
        raise Interrupted(advice) from None


def _record_texts(records: Sequence[dict], negatives: Sequence[list], first: int, jsonl: bool) -> str:
    """``records`` with their ``hard_negative_ctxs`` replaced by ``negatives``, as the output's text: JSON lines, or
    the items of a JSON list whose ``first``-th item (0: the list opens) is the first of them."""
    texts = []
    for i, (record, negs) in enumerate(zip(records, negatives), start=first):
        new = dict(record)
        new["hard_negative_ctxs"] = negs
        text = json.dumps(new, ensure_ascii=False)
        texts.append(text + "\n" if jsonl else ("[\n" if i == 0 else ",\n") + text)
    return "".join(texts)


def _kept_message(writer: ChunkedOutput, count: int, closed: bool) -> Optional[str]:
    """What an interrupted run into ``writer`` keeps for the next one to go on from, or None (nothing): ``count``
    questions mined; ``closed``: all of them, the file complete but for its rename."""
    if not count or not writer.partial.exists():
        return None
    if closed:
        return (f"all {counted(count, 'question')} are mined into {writer.partial}; run the same command again to "
                f"finish {writer.path}")
    return (f"{counted(count, 'question')} mined are kept in {writer.partial}; run the same command again to "
            "continue after them")


def _resumed(writer: ChunkedOutput, final: Path) -> tuple[MiningSummary, int, bool]:
    """Where a run into ``writer`` starts: the summary and count of the questions an interrupted run with the same
    key mined (logged), and whether it mined them all, the list closed and only the rename left; else nothing, and
    a line naming what changed when an interrupted run with other settings kept questions (they are dropped)."""
    note = writer.discarded_note("mined", RESUME_FLAG_NAMES, RESUME_NAMES)
    if note:
        logger.info("%s", note)
    state = writer.resume()
    summary, count = (MiningSummary(**state["summary"]), state["count"]) if state else (MiningSummary(), 0)
    if count:
        logger.info("resuming an interrupted run: %s already mined into %s", counted(count, "question"), final)
    return summary, count, bool(state and state.get("closed"))


def mine_to_file(records: Iterable[dict], output: PathLike, source: Any, corpus: Any,
                 settings: Optional[MineSettings] = None, *, qrels: Optional[dict[str, dict[str, int]]] = None,
                 id_to_row: Optional[dict[str, int]] = None, show_progress: bool = True,
                 resume_key: Optional[dict] = None, total: Optional[int] = None, **options: Any) -> MiningSummary:
    """Mine ``records`` chunk by chunk with ``settings`` (fields of :class:`MineSettings` may also be given as
    keywords) and write them with ``hard_negative_ctxs`` replaced (``append``: old ones kept but for those that are
    gold, answer-bearing or ``qrels`` positives, new ones added unless their id is already there), every other field
    kept. A JSON list, or JSONL when the name ends in ``.jsonl``
    (``.gz`` compresses); the file appears only when complete.

    Each finished chunk is kept (:class:`~dpr_gc.base.files.ChunkedOutput`): a run with the same ``resume_key`` (the
    inputs and settings; ``None`` never resumes) continues after the last finished chunk of an interrupted one.
    ``total``: the number of ``records`` when they are an iterator (the progress bar's total; a sequence gives its
    length). ``workers`` processes tokenise new candidate passages for answer matching (one matcher for the whole run)."""
    from ..evaluation.answers import AnswerMatcher, default_workers

    s = dataclasses.replace(settings or MineSettings(), **options)
    chunk_size, append = s.chunk_size, s.append
    jsonl = Path(output).name.removesuffix(".gz").endswith(".jsonl")
    with output_lock(output) as final, AnswerMatcher(s.match, default_workers(s.workers)) as matcher:
        writer = ChunkedOutput(final, {"settings": resume_key, "chunk_size": chunk_size, "append": append}
                               if resume_key is not None else None)
        summary, count, closed = _resumed(writer, final)
        total = len(records) if isinstance(records, Sequence) else total

        def flush(buffer: list[dict]) -> None:
            nonlocal count
            mined, part = mine_hard_negatives(buffer, source, corpus, s, qrels=qrels, id_to_row=id_to_row,
                                              matcher=matcher)
            negatives = (_appended(buffer, mined, part, s.n_negatives, matcher, qrels) if append
                         else [m["hard_negative_ctxs"] for m in mined])
            summary.merge(part)
            writer.append(_record_texts(buffer, negatives, count, jsonl),
                          {"count": count + len(buffer), "summary": dataclasses.asdict(summary)})
            count += len(buffer)  # once recorded: an interrupt names the questions a re-run goes on after
            bar.update(len(buffer))

        def kept() -> Optional[str]:
            return _kept_message(writer, count, closed) if resume_key is not None else None

        with tqdm(total=None if total is None else total - count, desc="mining", unit=" q",
                  disable=not show_progress or closed) as bar:
            if not closed:
                in_chunks(itertools.islice(records, count, None), chunk_size, flush, kept)
        if count == 0:
            writer.discard()
            raise DprGcError(f"no training questions to mine (the input is empty); nothing written to {final}")
        with kept_on_interrupt(kept):
            if not closed:
                writer.append("" if jsonl else "\n]\n",
                              {"count": count, "summary": dataclasses.asdict(summary), "closed": True})
                closed = True
            writer.finish()
    _log_removals(summary, s.margin, s.max_negative_ratio, s.min_margin)
    return summary


def _log_removals(summary: MiningSummary, margin: Optional[float], max_negative_ratio: Optional[float],
                  min_margin: Optional[float]) -> None:
    """One log line: the candidates each rule removed out of those seen."""
    rules = [("gold", summary.gold_dropped), ("answer-bearing", summary.answer_dropped),
             ("qrels positives", summary.qrels_dropped), ("--skip-top", summary.rank_skipped)]
    rules += [(f"--margin {margin:g}", summary.margin_dropped)] if margin is not None else []
    rules += [(f"--max-negative-ratio {max_negative_ratio:g}", summary.ratio_dropped)] \
        if max_negative_ratio is not None else []
    rules += [(f"--min-margin {min_margin:g}", summary.min_margin_dropped)] if min_margin is not None else []
    already = f" ({summary.already_there} already in the record, not added)" if summary.already_there else ""
    if summary.existing_dropped:
        already += (f"; {counted(summary.existing_dropped, 'existing negative')} dropped (gold, answer-bearing or "
                    "qrels positives)")
    logger.info("mined %s: of %s, removed %s; %s written%s", counted(summary.questions, "question"),
                counted(summary.candidates, "candidate"), ", ".join(f"{n} by {name}" for name, n in rules),
                counted(summary.written, "negative"), already)
    if summary.no_candidates:
        logger.warning("%s without a candidate (BM25: no word of the question is in the corpus's vocabulary, e.g. "
                       "unseen words or stopwords only): no negatives mined for them",
                       counted(summary.no_candidates, "question"))
    if summary.unscored and needs_positive_scores(margin, max_negative_ratio, min_margin):
        logger.warning("%s without a positive score (positive not in the corpus): the margin and positive-aware "
                       "rules did not apply to them", counted(summary.unscored, "question"))
    if summary.ratio_unapplied:
        logger.warning("%s with a lowest positive score <= 0 (BM25: no word in common with the question; dense: "
                       "as the index scores, e.g. after a PCA's centring): "
                       "--max-negative-ratio did not apply to them", counted(summary.ratio_unapplied, "question"))


# ----------------------------------------------------------------------------------------------------- command line
RESUME_FLAGS = ("source", "split", "model", "index", "bm25_k1", "bm25_b", "n_negatives", "top_k", "skip_top", "margin",
                "match", "append", "max_negative_ratio", "min_margin")
# How the line saying an interrupted run's kept questions are dropped names what changed: the settings by their flags,
# the rest of the resume key (inputs by content, the query encoder, the chunk size) in words
RESUME_FLAG_NAMES = {name: "--beir-split" if name == "split" else "--" + name.replace("_", "-")
                     for name in RESUME_FLAGS}
RESUME_NAMES = {"train_file": "--train-file file", "corpus": "--corpus file", "qrels": "--qrels file",
                "queries": "--beir-dir queries", "split_qrels": "--beir-dir qrels", "index_meta": "--index record",
                "encoder": "query encoder (its weights or prefixes)"}


def resume_key(args: argparse.Namespace, inputs: dict[str, Optional[PathLike]], source: Any) -> dict:
    """What a re-run must share with an interrupted one to continue it: each input's content fingerprint (an input
    edited in place with its size and modification time restored mines other negatives) and its size and
    modification time (the fingerprint of a file over 256 MiB samples blocks), the query encoder and the settings in
    ``RESUME_FLAGS``."""
    return {"inputs": {role: [source_fingerprint(p), *file_stamp(p)] for role, p in inputs.items() if p},
            "encoder": encoder_identity(source), **{k: v for k, v in vars(args).items() if k in RESUME_FLAGS}}


def encoder_identity(source: Any) -> Optional[list]:
    """A dense source's query encoder by its weights and settings (prefixes included): a retrained model in the same
    folder, or another --query-prefix, mines other candidates, so a run does not resume into it. None for BM25."""
    from .fingerprint import weights_fingerprint

    retriever = getattr(source, "retriever", None)
    return None if retriever is None else [weights_fingerprint(retriever), repr(retriever.config)]


def open_source(kind: str, corpus: Any, settings: Optional[SourceSettings] = None, *,
                corpus_path: Optional[PathLike] = None, show_progress: bool = True, **options: Any) -> Any:
    """A :class:`BM25Source`, or a :class:`DenseSource` over the index in ``settings.index`` -- built first (flat)
    from the shards in ``embeddings``, which are encoded first when that folder has none -- checked against model
    and corpus (fields of :class:`SourceSettings` may also be given as keywords). ``query_prefix`` /
    ``passage_prefix`` replace the model's own (None keeps them)."""
    s = dataclasses.replace(settings or SourceSettings(), **options)
    model, index, embeddings, device, batch_size = s.model, s.index, s.embeddings, s.device, s.batch_size
    query_prefix, passage_prefix = s.query_prefix, s.passage_prefix
    if kind in SOURCES:  # the command line's rules: a setting the other source takes is refused, not ignored
        refuse_flags_that_do_not_apply(SourceSettings, argparse.Namespace(**vars(flag_values(s)), source=kind),
                                       APPLIES)
    if kind == "bm25":
        return BM25Source(corpus, s.k1, s.b, index_dir=s.bm25_index, n_threads=cap_threads(s.threads),
                          show_progress=show_progress)
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
    set_threads(s.threads or None)
    if index_exists(index):
        query_prefix, passage_prefix = recorded_prefixes(read_meta(index), query_prefix, passage_prefix)
    retriever = Retriever.load(model, default_device(device), query_prefix, passage_prefix).check_room("query")
    if not index_exists(index):
        check_dense_inputs(index, embeddings)
        emb = Path(embeddings)
        if not has_shards(emb):
            if corpus_path is None:
                raise DprGcError("encoding the corpus needs --corpus")
            with flags_renamed(ENCODE_FLAGS):
                encode_corpus(retriever, corpus_path, emb, shard_id=0, num_shards=1, batch_size=batch_size,
                              cache_dir=s.cache_dir, model_name=str(model), show_progress=show_progress)
        with flags_renamed({"--output": "--index"}):
            build_index(emb, index, IndexParams("flat"))
    dense = DenseIndex.read(index)
    check_compatible(retriever, dense, s.check_model, s.passage_prefix, verb="mine")
    check_corpus(dense, corpus)
    return DenseSource(retriever, dense, batch_size, show_progress)


def describe_source(source: Any, top_k: Optional[int] = None) -> str:
    """For the log: how candidates are found -- BM25's parameters and scoring threads, or the dense model's device,
    precision, batch and CPU threads and the index's search settings (the efSearch a ``top_k`` search runs with)
    and FAISS threads."""
    if isinstance(source, BM25Source):
        return (f"BM25 (k1 {source.meta['k1']:g}, b {source.meta['b']:g}, "
                f"{counted(max(1, source.n_threads), 'scoring thread')})")
    from ..base.devices import cpu_threads
    from .index import faiss_threads

    index, device = source.index, next(source.retriever.parameters()).device
    return (f"dense (questions encoded on {device} in fp32, batch {source.batch_size}{cpu_threads(device)}; index "
            f"{index.meta.get('factory')} of {counted(index.ntotal, 'vector')}, search "
            f"{index.search_settings(top_k)}, FAISS threads {faiss_threads()})")


# What mine reads, by destination and flag; of these, folders it builds when they hold nothing yet are its outputs.
MINE_INPUTS = {dest: "--" + dest.replace("_", "-")
               for dest in ("train_file", "beir_dir", "corpus", "model", "index", "embeddings", "bm25_index", "qrels")}


def require_input_files(args: argparse.Namespace) -> None:
    """Refuse a missing --train-file, --corpus or --qrels in one line naming its flag, before anything is read."""
    for flag, what in (("train_file", "--train-file"), ("corpus", "--corpus file"), ("qrels", "--qrels file")):
        if getattr(args, flag):
            require_file(getattr(args, flag), what)


def built_folders(args: argparse.Namespace) -> dict[str, str]:
    """The folders this run writes, by flag (each is read, an input, once built): the BM25 index when
    ``--bm25-index`` holds none yet; for ``--source dense`` without an index in ``--index``, that index (built from
    ``--embeddings``) and the shards folder when it holds none (the corpus is encoded into it)."""
    from .index import index_exists
    from .shards import has_shards

    built = {}
    if args.source == "bm25" and args.bm25_index and not bm25_index_exists(args.bm25_index):
        built["--bm25-index"] = args.bm25_index
    if args.source == "dense" and args.embeddings and not index_exists(args.index):
        if args.index:
            built["--index"] = args.index
        if not has_shards(args.embeddings):
            built["--embeddings"] = args.embeddings
    return built


def check_built_folders(args: argparse.Namespace) -> None:
    """Refuse, before anything is written, a folder this run would write (:func:`built_folders`) that is an input or
    lies inside an input folder (``--bm25-index B/bm25`` with ``--beir-dir B``), and an index folder, replaced
    whole, that holds an input; and a BM25 folder holding other files than an index's (:func:`check_bm25_folder`).
    The guard took these flags for inputs, which they are when already built (an index and the shards it is built
    from are checked against each other by ``build_index``)."""
    built = built_folders(args)
    inputs = {flag: getattr(args, dest) for dest, flag in MINE_INPUTS.items() if flag not in built}
    check_outputs(inputs, {"--output": args.output, **built}, whole=["--index"])
    check_nothing_inside_built(args, built)
    if "--bm25-index" in built:
        check_bm25_folder(built["--bm25-index"])


def check_nothing_inside_built(args: argparse.Namespace, built: dict[str, str]) -> None:
    """Refuse ``--output`` or ``--cache-dir`` inside a folder this run builds: built, that folder is an input the
    same command then refuses to write inside (no resume), and ``index`` refuses a folder holding other files."""
    for flag, value in (("--output", args.output), ("--cache-dir", getattr(args, "cache_dir", None))):
        if not value:
            continue
        real = os.path.realpath(value)
        for built_flag, folder in built.items():
            root = os.path.realpath(folder)
            if real != root and os.path.commonpath([real, root]) == root:
                raise DprGcError(f"{flag} {value} lies inside {built_flag} {folder}, a folder this run builds to "
                                 "hold nothing else (and reads when run again); write it outside that folder")


def scan_training_file(path: PathLike, positive_ids: bool = False, match: Optional[str] = None,
                       qrels: Optional[dict[str, dict[str, int]]] = None,
                       qrels_path: Optional[PathLike] = None) -> tuple[int, set[str]]:
    """One streaming pass over a DPR training file before mining: every record checked (a bad one fails before any
    is mined) and counted (the progress bar's total), and with ``positive_ids`` its positives' ids gathered (BM25
    scores them for the positive-aware rules). With ``match`` "regex", answer patterns that do not compile are named
    in one warning (file and lines), as ``retrieve`` names them: they never match, so the passage holding the answer
    may be mined as a hard negative. A file holding no record, or ``qrels`` (read from ``qrels_path``) judging none
    of its question ids (:func:`refuse_unjudged`), is refused naming it."""
    count, ids, uncompiled, qids = 0, set(), UncompiledPatterns(), []
    for line, record in iter_numbered_training_file(path):
        count += 1
        if positive_ids:
            ids.update(ctx_id(c) for c in record.get("positive_ctxs") or [])
        if match == "regex":
            uncompiled.check(record.get("answers") or (), f"line {line}")
        if qrels is not None and len(qids) < 2 and (not qids or qids[0] not in qrels):
            qids.append(_qid(record))  # the first id, then the first judged one
    if count == 0:
        raise DprGcError(f"--train-file {path} holds no training questions to mine; give a DPR training file")
    uncompiled.warn(str(path), UNMATCHED_EFFECT)
    if qrels is not None:
        refuse_unjudged(qids, qrels, qrels_path, f"question id of --train-file {path} (the first")
    return count, ids


def refuse_unjudged(qids: Iterable[str], qrels: dict[str, dict[str, int]], qrels_path: Optional[PathLike],
                    named: str) -> None:
    """Refuse, in one line, a ``--qrels`` filter none of whose question ids is among ``qids`` (the questions mined,
    ``named`` with its first id): it would remove nothing, and the ids of the two files most likely differ."""
    first = None
    for qid in qids:
        if qid in qrels:
            return
        first = qid if first is None else first
    example = f"{named}: {first!r})" if first else f"{named} has no id)"
    raise DprGcError(f"no {example} appears in --qrels {qrels_path} (the first judged: {next(iter(qrels), None)!r}), "
                     "so it would remove nothing; give the qrels of these questions (the same ids), or drop --qrels")


def scan_beir_queries(queries: PathLike, qrels_path: PathLike) -> None:
    """For ``--match regex`` with a BEIR folder, before the corpus is read: name in one warning (file and lines) the
    answer patterns that do not compile of the queries mined for (those with a positive in ``qrels_path``), as
    :func:`scan_training_file` does for a training file."""
    from ..data.corpus import iter_numbered_queries
    from ..data.qrels import read_qrels

    mined = {q for q, judged in read_qrels(qrels_path).items() if any(rel > 0 for rel in judged.values())}
    uncompiled = UncompiledPatterns()
    for line, query in iter_numbered_queries(queries, log=False):
        if str(query["id"]) in mined:
            uncompiled.check(query.get("answers") or (), f"line {line}")
    uncompiled.warn(str(queries), UNMATCHED_EFFECT)


DENSE, BM25 = (AppliesWhen(lambda a: a.source == "dense", "to --source bm25 (the default)", "add --source dense"),
               AppliesWhen(lambda a: a.source == "bm25", "to --source dense"))
BEIR_ONLY = AppliesWhen(lambda a: bool(a.beir_dir), "without --beir-dir (it picks a BEIR folder's qrels split)")
APPLIES = {**dict.fromkeys(("model", "index", "embeddings", "skip_model_check", "batch_size", "device",
                            "query_prefix", "passage_prefix"), DENSE),
           **dict.fromkeys(("bm25_index", "bm25_k1", "bm25_b"), BM25), "split": BEIR_ONLY}


def check_dense_inputs(index: Optional[PathLike], embeddings: Optional[PathLike]) -> None:
    """Refuse a dense source given neither an existing ``--index`` nor ``--embeddings``, in one line saying what
    serves (``--index`` alone does: it records the model and corpus), an ``--index`` alone that is not there as a
    missing input named by its flag, and ``--embeddings`` without the ``--index`` folder its flat index goes to,
    before anything loads."""
    from .index import index_exists

    if embeddings is None and index is not None:
        require_folder(index, "--index folder", "build one with `dpr-gc index`")
    if embeddings is None and not index_exists(index):
        where = f"no index in {index}; " if index is not None else ""
        raise DprGcError(f"{where}--source dense needs --index DIR (from dpr-gc index; it records the model and "
                         "corpus) or --embeddings DIR with --model and --corpus")
    if index is None and embeddings is not None:
        raise DprGcError(f"give --index DIR for the flat index built from --embeddings {Path(embeddings)} (a folder "
                         "outside it, e.g. beside it)")


def recorded_inputs(args: argparse.Namespace, beir: Optional[Path]) -> str:
    """The corpus to mine from (``--corpus``, the BEIR folder's, else the one ``--index`` records) and, for a dense
    source without ``--model``, the model ``--index`` records (into ``args.model``, said in the log), as ``retrieve``
    takes them; each recorded one is checked not to hold an output. Refused before the corpus is read when missing."""
    from ..data.training import find_beir_file
    from .index import index_exists, read_meta
    from .retrieve import recorded_corpus, recorded_model

    if args.source == "dense":
        check_dense_inputs(args.index, args.embeddings)
    corpus_path = args.corpus or (find_beir_file(beir, "corpus.jsonl") if beir is not None else None)
    meta = read_meta(args.index) if index_exists(args.index) else {}
    recorded = {}
    if corpus_path is None and meta:
        corpus_path = recorded["the index's recorded --corpus"] = recorded_corpus(meta, args.index)
    if args.source == "dense" and not args.model and meta:
        args.model = recorded["the index's recorded --model"] = recorded_model(args.index, meta)
        if args.model:
            logger.info("model %s (recorded in the index)", args.model)
    if recorded:
        check_outputs(recorded, {"--output": args.output, **built_folders(args)})
    if not corpus_path:
        raise DprGcError("give --corpus (the passages to mine from)")
    if args.source == "dense" and not args.model:
        raise DprGcError("--source dense needs --model (the trained retriever folder; an index built by dpr-gc index "
                         "records it)")
    return corpus_path


@guarded(inputs=tuple(MINE_INPUTS), outputs={"output": "self"})
def _cli(args: argparse.Namespace) -> None:
    from ..data.corpus import load_corpus
    from ..data.training import find_beir_file, find_beir_qrels
    from ..base.devices import steady_malloc
    from ..data.qrels import read_qrels
    from .index import index_exists, meta_path
    from ..base.tables import format_summary
    from ..evaluation.answers import default_workers

    started = time.perf_counter()
    if bool(args.train_file) == bool(args.beir_dir):
        raise DprGcError("give exactly one of --train-file (DPR training file) or --beir-dir (BEIR folder)")
    refuse_flags_that_do_not_apply(MineJob, args, APPLIES)
    require_input_files(args)
    check_built_folders(args)
    mining = from_args(MineSettings, args)
    mining = dataclasses.replace(mining, workers=default_workers(mining.workers))  # cut to the CPUs once, said once
    steady_malloc()
    beir = Path(args.beir_dir) if args.beir_dir else None
    bm25_scored = needs_positive_scores(args.margin, args.max_negative_ratio, args.min_margin) and \
        args.source == "bm25"
    total, golds = None, set()
    qrels = read_qrels(args.qrels) if args.qrels else None
    if beir is not None:
        queries = find_beir_file(beir, "queries.jsonl")
        split_qrels = find_beir_qrels(beir, args.split)
        if args.match == "regex":
            scan_beir_queries(queries, split_qrels)
    else:  # checked and counted before the corpus is read or encoded
        total, golds = scan_training_file(args.train_file, bm25_scored, args.match, qrels, args.qrels)
    corpus_path = recorded_inputs(args, beir)
    corpus = load_corpus(corpus_path, args.cache_dir)
    if beir is not None:  # qrels checked against the corpus and queries before it is encoded or indexed
        records, id_to_row = beir_training_records(queries, split_qrels, corpus)
        if qrels is not None:
            refuse_unjudged((_qid(r) for r in records), qrels, args.qrels,
                            f"query id of --beir-dir {beir} (the first with a positive in {split_qrels}")
    source = open_source(args.source, corpus, from_args(SourceSettings, args), corpus_path=corpus_path)
    if beir is None:
        records, id_to_row = iter_training_file(args.train_file), rows_for_ids(corpus, golds) if bm25_scored else None
    inputs = {"train_file": args.train_file, "corpus": corpus_path, "qrels": args.qrels}
    if beir is not None:
        inputs.update(queries=queries, split_qrels=split_qrels)
    if index_exists(args.index):
        inputs["index_meta"] = meta_path(args.index)
    logger.info("candidates: %s, top %d per question; answers matched with %s matching in %s",
                describe_source(source, mining.top_k),
                mining.top_k, mining.match, counted(mining.workers, "process", "processes"))
    summary = mine_to_file(records, args.output, source, corpus, mining, qrels=qrels, id_to_row=id_to_row,
                           resume_key=resume_key(args, inputs, source), total=total)
    print(format_summary({"source": args.source, **summary.table(mining), "output": args.output},
                         time.perf_counter() - started))


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc mine``."""
    p = subparsers.add_parser("mine",
                              description=__doc__.splitlines()[0] + " Interrupted, the same command resumes after "
                              "the last finished chunk of 1,024 questions.")
    add_arguments(p, MineJob)
    p.set_defaults(func=_cli)
