"""Training data: DPR JSON/JSONL files and BEIR folders -> Arrow, mixed sampling, per-step examples, tokenisation.

Each source is validated record by record while it streams into an Arrow file in a cache folder (keyed by path
and content fingerprint), then memory-mapped, so a multi-GB NQ file never lives as Python objects and a restart
does not re-parse it. :class:`MixedBatchSampler` draws each epoch from several sources at per-source rates, shards it across
ranks and can resume mid-epoch; :class:`TrainingExamples` (both in ``sampling.py``) picks one positive and ``N + M`` negatives per draw with
randomness derived from ``(seed, epoch, position)``; :class:`Collator` tokenises in DataLoader workers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from .arrow_cache import cache_file, cached_dataset, write_stream
from .corpus import file_stamp, source_fingerprint
from .qrels import iter_qrels, no_judgments, qrels_line_problem, read_qrels
from ..base.args import nonnegative_int, positive_float, positive_int, qrels_split
from ..base.errors import DprGcError, clipped
from ..base.guard import guarded
from ..base.files import (JSON_ERRORS, PathLike, check_unicode, copied_from, die_with_parent, iter_jsonl,
                          json_problem, misnamed_gzip, open_text, read_json_object, require_file, write_json)
from ..base.settings import add_arguments, cache_dir_setting, check, setting
from ..base.streams import iter_json_list, opens_object, sniff_json
from ..model.retriever import Retriever, RetrieverConfig
from .sampling import (MixedBatchSampler, TrainingExamples,  # noqa: F401 (TrainingExamples is re-exported)
                       question_groups)
from ..base.tables import format_summary, markdown_table
from ..base.validate import given_id
from ..model.tokenize import token_ids

logger = logging.getLogger(__name__)

FORMAT_VERSION = 5  # 2: negatives that are the question's own positive are dropped; 3: a row count ends the file;
# 4: an empty question is a bad record; 5: an empty id is no id (the next id key is read)
BEIR_VERSION = 2  # a BEIR folder's cache besides FORMAT_VERSION; 1: read by the corpus and query readers (ids unique);
# 2: qrels lines checked as read_qrels checks them
ID_KEYS = ("passage_id", "id", "psg_id", "_id")
WRITE_BATCH = 256
Row = dict[str, Any]
Produced = Iterator[tuple[str, Union[Row, str]]]  # (where, normalised row or error message)


class BadRecord(DprGcError):
    """A record that cannot be trained on: ``where`` it is (file, line, record) and ``problem``. Its message advises
    fixing it or passing ``--skip-bad-records``; a reader with no such flag (the ``--dev`` file) words its own from
    the two fields."""

    def __init__(self, where: str, problem: str) -> None:
        self.where, self.problem = where, problem
        super().__init__(f"{where}: {problem}; fix the record or pass --skip-bad-records")


def _schema() -> Any:
    import pyarrow as pa

    ctx = pa.list_(pa.struct([("id", pa.string()), ("title", pa.string()), ("text", pa.string())]))
    return pa.schema([("question", pa.string()), ("answers", pa.list_(pa.string())),
                      ("positives", ctx), ("hard_negatives", ctx), ("negatives", ctx)])


@dataclasses.dataclass
class TrainingData:
    """Normalised questions of all sources in one memory-mapped dataset; ``sizes[i]`` rows came from source ``i``."""

    dataset: Any
    sizes: list[int]
    stats: list[dict]
    formats: list[str] = dataclasses.field(default_factory=list)  # "beir" or "dpr", per source

    def source_format(self, i: int) -> str:
        return self.formats[i] if i < len(self.formats) else "dpr"

    def __len__(self) -> int:
        return len(self.dataset)


DIGEST_ROWS = 64  # rows read by :func:`data_digest`, spread over the data


def data_digest(data: TrainingData) -> str:
    """A short digest of loaded training data: its sizes per source and the question and passage ids of
    ``DIGEST_ROWS`` rows spread over it. Cheap (it reads those rows only), for comparing what each torchrun rank
    loaded: ranks on other machines parse their own copies of the files, keyed by rank 0's fingerprints."""
    digest = hashlib.blake2b(json.dumps(data.sizes).encode("utf-8"), digest_size=16)
    n = len(data)
    for i in sorted({j * n // DIGEST_ROWS for j in range(DIGEST_ROWS)} if n else ()):
        row = data.dataset[i]
        ids = [ctx["id"] for key in ("positives", "hard_negatives", "negatives") for ctx in row[key] or ()]
        digest.update(json.dumps([row["question"], ids]).encode("utf-8"))
    return digest.hexdigest()


def combine(parts: Sequence[TrainingData]) -> TrainingData:
    """Concatenate loaded sources (no copy), keeping one size and one stats entry per source."""
    import datasets

    dataset = datasets.concatenate_datasets([p.dataset for p in parts]) if len(parts) > 1 else parts[0].dataset
    return TrainingData(dataset, [s for p in parts for s in p.sizes], [s for p in parts for s in p.stats],
                        [p.source_format(i) for p in parts for i in range(len(p.sizes))])


# ----------------------------------------------------------------- validation
def _contexts(record: dict, key: str, required: bool) -> list[dict]:
    value = record.get(key)
    if value is None:
        if required:
            raise ValueError(f"missing field '{key}'")
        return []
    if not isinstance(value, list):
        raise ValueError(f"field '{key}' must be a list, got {type(value).__name__}")
    out = []
    for j, ctx in enumerate(value):
        if not isinstance(ctx, dict):
            raise ValueError(f"{key}[{j}] must be an object, got {type(ctx).__name__}")
        text, title = ctx.get("text"), ctx.get("title")  # only a null title is empty: false, 0, [] are refused
        pid = context_id(ctx)
        if not isinstance(text, str):
            raise ValueError(f"{key}[{j}].text must be a string, got {type(text).__name__}")
        if not isinstance(title, (str, type(None))) or isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise ValueError(f"{key}[{j}] has a title that is not a string or an id that is not a string/int")
        out.append({"id": str(pid), "title": title or "", "text": text})
    return out


def context_id(ctx: dict) -> Any:
    """A DPR context's passage id as given: the first of :data:`ID_KEYS` it holds other than null or an empty
    string (DPR files use ``passage_id``), else ``""`` (no id)."""
    pid = given_id(ctx, ID_KEYS)
    return "" if pid is None else pid


def normalise_record(record: Any) -> Row:
    """Turn one DPR record into the Arrow row layout; raises ``ValueError`` saying which field is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    question, answers = record.get("question"), record.get("answers", [])
    if question is None:
        raise ValueError("missing field 'question'")
    if not isinstance(question, str):
        raise ValueError(f"field 'question' must be a string, got {type(question).__name__}")
    if not question.strip():  # refused as retrieve --queries and BEIR queries.jsonl refuse it
        raise ValueError("the question is empty")
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError("field 'answers' must be a list of strings")
    return {"question": question, "answers": answers, "positives": _contexts(record, "positive_ctxs", True),
            "hard_negatives": _contexts(record, "hard_negative_ctxs", False),
            "negatives": _contexts(record, "negative_ctxs", False)}


def drop_own_positives(row: Row) -> int:
    """Remove from ``row``'s hard and other negatives every passage that is one of its positives (the same passage
    id, or the same title and text); returns how many were removed."""
    def keys(ctx: dict) -> set:
        return ({("id", ctx["id"])} if ctx["id"] else set()) | {("text", ctx["title"], ctx["text"])}

    positive = set().union(*(keys(c) for c in row["positives"]))
    dropped = 0
    for pool in ("hard_negatives", "negatives"):
        kept = [c for c in row[pool] if not keys(c) & positive]
        dropped += len(row[pool]) - len(kept)
        row[pool] = kept
    return dropped


# ----------------------------------------------------------------- readers
def _dpr_records(path: Path) -> Produced:
    """Records of a DPR training file: a JSON list or JSONL, optionally gzipped."""
    if sniff_json(path) == "list":
        with open_text(path) as f:
            for k, (line, obj) in enumerate(iter_json_list(f, path, text_only=True)):
                yield from _checked(f"{path}:{line} (record {k})", obj)
        return
    with open_text(path) as f:
        for line_no, text in enumerate(f, start=1):
            if text.strip():
                try:
                    obj = json.loads(text)
                except JSON_ERRORS as e:
                    yield f"{path}:{line_no}", json_problem(e, text)[0]
                    continue
                yield from _checked(f"{path}:{line_no}", check_unicode(obj, f"{path}:{line_no}", text))


def _checked(where: str, obj: Any) -> Produced:
    try:
        yield where, normalise_record(obj)
    except ValueError as e:
        yield where, str(e)


def find_beir_file(folder: Path, name: str) -> Path:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DprGcError(f"{folder} has no {name} (or {name}.gz); expected a BEIR folder")


def beir_splits(folder: Path) -> list[str]:
    """The qrels splits of a BEIR folder: the names of its ``qrels/SPLIT.tsv`` and ``qrels/SPLIT.tsv.gz`` files."""
    names = (f.name for f in (folder / "qrels").glob("*.tsv*") if f.is_file() and not f.name.startswith("."))
    return sorted({n.removesuffix(".gz").removesuffix(".tsv") for n in names if n.endswith((".tsv", ".tsv.gz"))})


def find_beir_qrels(folder: Path, split: str) -> Path:
    """``qrels/<split>.tsv`` of a BEIR folder, or ``qrels/<split>.tsv.gz`` (as :func:`find_beir_file` finds the
    corpus and queries); refused naming the splits the folder has."""
    for candidate in (folder / "qrels" / f"{split}.tsv", folder / "qrels" / f"{split}.tsv.gz"):
        if candidate.is_file():
            return candidate
    raise DprGcError(f"{folder} has no qrels/{split}.tsv (or qrels/{split}.tsv.gz); its qrels splits: "
                     f"{', '.join(beir_splits(folder)) or 'none'}")


def _beir_records(corpus: Path, queries: Path, qrels: Path, cache_dir: Optional[PathLike]) -> Produced:
    """One record per query of ``qrels``, in first-appearance order; positives are pairs with score > 0.

    Queries and passages are read by the readers every other command uses and qrels lines checked as
    :func:`~dpr_gc.data.qrels.read_qrels` checks them, so training refuses what ``mine --beir-dir`` refuses (a
    repeated query or passage id, a passage without text, a judgment given again with another relevance); the corpus
    lands in the Arrow cache in ``cache_dir`` that encoding and mining map later.
    """
    from .corpus import iter_queries, load_corpus, rows_for_ids

    pairs, first_line, bad = _qrels_positives(qrels)
    yield from bad
    needed = {p for entry in pairs.values() for p, _ in entry}
    questions = {q["id"]: q["question"] for q in iter_queries(queries, log=False) if q["id"] in pairs}
    passages = load_corpus(corpus, cache_dir)
    rows = sorted(rows_for_ids(passages, needed).values())
    found = passages[rows] if rows else {"id": [], "title": [], "text": []}
    docs = {pid: {"id": pid, "title": title or "", "text": text}
            for pid, title, text in zip(found["id"], found["title"], found["text"])}
    for qid, entry in pairs.items():
        where = f"{qrels}:{first_line[qid]}"
        if not entry:  # judged, none relevant: counted as a question without a positive (its text is not read)
            yield where, normalise_record(beir_dpr_record(qid, qid, [], []))
            continue
        if not isinstance(questions.get(qid), str):
            yield where, f"query id {clipped(qid)} has no text in {queries.name}"
            continue
        missing = [(p, n) for p, n in entry if not isinstance(docs.get(p, {}).get("text"), str)]
        if missing:
            yield f"{qrels}:{missing[0][1]}", f"corpus id {clipped(missing[0][0])} has no text in {corpus.name}"
            continue
        yield where, normalise_record(beir_dpr_record(qid, questions[qid], [], [docs[p] for p, _ in entry]))


def _qrels_positives(qrels: Path) -> tuple[dict[str, list[tuple[str, int]]], dict[str, int], list[tuple[str, str]]]:
    """``(query id -> [(positive passage id, line)], query id -> its first line, bad lines as (where, problem))``
    of a qrels file, each line checked as :func:`~dpr_gc.data.qrels.read_qrels` checks it (ids, a judgment given
    again with another relevance); a bad line is left out, so the first judgment of a pair stands."""
    pairs: dict[str, list[tuple[str, int]]] = {}
    first_line: dict[str, int] = {}
    relevance: dict[tuple[str, str], int] = {}
    bad: list[tuple[str, str]] = []
    for line_no, judgment in iter_qrels(qrels):
        where = f"{qrels}:{line_no}"
        problem = judgment if isinstance(judgment, str) else qrels_line_problem(judgment, where, relevance)
        if problem:
            bad.append((where, problem))
            continue
        qid, pid, score = judgment
        entry = pairs.setdefault(qid, [])
        first_line.setdefault(qid, line_no)
        if score > 0 and pid not in [p for p, _ in entry]:
            entry.append((pid, line_no))
    return pairs, first_line, bad


def beir_dpr_record(qid: str, question: str, answers: Sequence[str], positives: Sequence[dict]) -> dict:
    """The DPR training record of a BEIR query, its qrels positives (``{id, title, text}``) as ``positive_ctxs`` and
    no negatives (empty ``negative_ctxs`` and ``hard_negative_ctxs``: DPR's loaders read every key of its training
    files): the one BEIR -> DPR builder, for training sets and for mining."""
    return {"id": qid, "question": question, "answers": list(answers),
            "positive_ctxs": [{"title": p["title"] or "", "text": p["text"], "passage_id": p["id"]} for p in positives],
            "negative_ctxs": [], "hard_negative_ctxs": []}


def iter_training_file(path: PathLike) -> Iterator[dict]:
    """Stream the records of a DPR training file (JSON list or JSONL, optionally .gz) unchanged, each checked as the
    training reader checks it; a bad record raises naming file and line."""
    return (record for _, record in iter_numbered_training_file(path))


def iter_numbered_training_file(path: PathLike) -> Iterator[tuple[int, dict]]:
    """:func:`iter_training_file` with the line each record starts on, for messages naming it."""
    p = require_file(path, "training file")
    refuse_other_formats(p)
    is_list = sniff_json(p) == "list"
    with open_text(p) as f:
        for line, record in (iter_json_list(f, p, text_only=True) if is_list else iter_jsonl(p, text_only=True)):
            try:
                normalise_record(record)
            except ValueError as e:
                raise DprGcError(f"{p}:{line}: {e}; fix the record") from None
            yield line, record


def beir_training_records(queries_path: PathLike, qrels_path: PathLike,
                          corpus: Any) -> tuple[list[dict], dict[str, int]]:
    """DPR records for the queries judged in BEIR qrels: positives are the qrels pairs with relevance > 0, their text
    taken from ``corpus``. Returns ``(records, passage id -> corpus row)`` for the positives."""
    from .corpus import read_queries, rows_for_ids

    qrels = read_qrels(qrels_path)
    positives = {q: [d for d, rel in judged.items() if rel > 0] for q, judged in qrels.items()}
    id_to_row = rows_for_ids(corpus, (d for ds in positives.values() for d in ds))
    missing = sorted({d for ds in positives.values() for d in ds} - set(id_to_row))
    if missing:
        raise DprGcError(f"{qrels_path}: {len(missing)} positive passage id(s) are not in the corpus (e.g. "
                         f"{clipped(missing[0])}); give the corpus these qrels judge")
    records = []
    for q in read_queries(queries_path):
        ids = positives.get(str(q["id"]))
        if ids:
            rows = corpus[[id_to_row[d] for d in ids]]
            ctxs = [{"id": d, "title": t, "text": x} for d, t, x in zip(ids, rows["title"], rows["text"])]
            records.append(beir_dpr_record(str(q["id"]), q["question"], q["answers"], ctxs))
    if not records:
        raise DprGcError(f"no query of {queries_path} has a positive in {qrels_path}; check that the ids match")
    return records, id_to_row


# ----------------------------------------------------------------- Arrow cache
def _build(source: Path, files: Sequence[Path], tag: str, produce: Callable[[], Produced],
           cache_dir: Optional[PathLike], skip_bad: bool, fingerprint: Optional[str]) -> TrainingData:
    """Stream ``produce()`` into an Arrow file cached by the ``files`` it reads (or reuse it); memory-map it. The key
    holds each file's path (a pipe's copy: "piped"), :func:`~dpr_gc.data.corpus.file_stamp` and the source's
    content fingerprint, as the corpus cache's."""
    stamps = [["piped" if copied_from(p) else str(p.resolve()), *file_stamp(p)] for p in files]
    key = [FORMAT_VERSION, tag, skip_bad, stamps, fingerprint or source_fingerprint(source)]
    key += [BEIR_VERSION] if tag == "beir" else []  # DPR files keep their caches
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", source.name)
    arrow = cache_file(cache_dir, "train", stem, json.dumps(key))
    stats_file = arrow.with_name(arrow.stem + ".stats.json")
    parsed: list[bool] = []  # whether this call parsed the source (else an earlier run's cache is reused)
    dataset = cached_dataset(arrow, lambda: (parsed.append(True), _parse(source, stem, produce, skip_bad, arrow,
                                                                         stats_file)), ready=stats_file.is_file)
    # The source as this run names it: the cache is keyed by content, and an earlier run may have spelt it otherwise.
    stats = {**read_json_object(stats_file, "training cache statistics"),
             "source": copied_from(source) or str(source), "parsed_now": bool(parsed)}
    logger.info("%s: %d records, %d kept, %d without a positive (skipped), %d bad (skipped); %s %s", stats["source"],
                stats["records"], stats["kept"], stats["no_positive"], stats["bad"],
                "parsed into" if parsed else "read from the parse cached in", arrow)
    if stats.get("dropped_negatives"):
        logger.warning("%s: dropped %d (hard) negatives that are their question's own positive (same passage id, "
                       "or same title and text)", stats["source"], stats["dropped_negatives"])
    if stats["records"] == 0:  # a BEIR folder's qrels (files[0]) judge nothing, or a DPR file is empty
        raise no_judgments(files[0]) if tag == "beir" else DprGcError(
            f"{stats['source']}: the file holds no training records (it is empty or an empty JSON list); "
            f"{TRAINING_FORMATS}")
    if stats["kept"] == 0:
        raise DprGcError(f"{stats['source']}: no usable training question ({stats['records']} records, "
                         f"{stats['no_positive']} without a positive, {stats['bad']} bad)")
    return TrainingData(dataset, [stats["kept"]], [stats], [tag])


def _parse(source: Path, stem: str, produce: Callable[[], Produced], skip_bad: bool, arrow: Path,
           stats_file: Path) -> None:
    """Write the rows of ``produce()`` with a positive to ``arrow`` and the counts to ``stats_file`` (last)."""
    import pyarrow as pa

    stats = {"source": str(source), "records": 0, "kept": 0, "no_positive": 0, "bad": 0, "dropped_negatives": 0}
    schema = _schema()

    def batches() -> Iterator[Any]:
        rows = []
        for where, row in tqdm(produce(), desc=f"parse {stem}", unit=" rec", disable=None):
            stats["records"] += 1
            if isinstance(row, str):
                if not skip_bad:
                    raise BadRecord(where, row)
                stats["bad"] += 1
                if stats["bad"] <= 5:
                    logger.warning("skipping bad record at %s: %s", where, row)
            elif not row["positives"]:
                stats["no_positive"] += 1
            else:
                stats["kept"] += 1
                stats["dropped_negatives"] += drop_own_positives(row)
                rows.append(row)
                if len(rows) == WRITE_BATCH:
                    yield pa.RecordBatch.from_pylist(rows, schema=schema)
                    rows = []
        if rows:
            yield pa.RecordBatch.from_pylist(rows, schema=schema)

    write_stream(arrow, schema, batches())
    write_json(stats_file, stats)


def load_dpr_files(paths: Sequence[PathLike], cache_dir: Optional[PathLike] = None, skip_bad: bool = False,
                   fingerprints: Optional[Sequence[str]] = None) -> TrainingData:
    """Load DPR training files (JSON list or JSONL, optionally .gz); one size/stats entry per file, in order.
    ``fingerprints``: each file's :func:`~dpr_gc.data.corpus.source_fingerprint` when the caller has them (the
    parse cache is keyed by it), else computed here."""
    if not paths:
        raise DprGcError("no training file given")
    parts = []
    for path, fingerprint in zip(paths, fingerprints or [None] * len(paths)):
        p = require_file(path, "training file")
        refuse_table_files(p)
        refuse_other_formats(p)
        parts.append(_build(p, [p], "dpr", functools.partial(_dpr_records, p), cache_dir, skip_bad, fingerprint))
    return combine(parts)


def refuse_table_files(path: Path) -> None:
    """A TSV or CSV given as training data (a DPR passages file, a QA file, pairs) is refused by its name: read as
    JSON its first line would be a bad record, and ``--skip-bad-records`` would skip every line."""
    suffix = Path(path.name.removesuffix(".gz")).suffix.lower()
    if suffix in (".tsv", ".csv"):
        raise DprGcError(f"{path} is a {suffix[1:].upper()} file: training data is DPR JSON or JSONL (.json, .jsonl, "
                         "optionally .gz) or a BEIR folder; see docs/formats.md")


DPR_FIELDS = ("question", "positive_ctxs", "negative_ctxs", "hard_negative_ctxs")
TRAINING_FORMATS = ("training data is DPR records (a JSON list or JSONL of {question, answers, positive_ctxs, "
                    "negative_ctxs, hard_negative_ctxs}, optionally .gz) or a BEIR folder; see docs/formats.md")
_UNREADABLE, _OPENS_OBJECT = object(), object()  # a first line that is not JSON; one that is "{" alone


def refuse_other_formats(path: Path) -> None:
    """A file that holds no DPR training records at all (gzipped under a name without ``.gz``, one pretty-printed
    JSON object, sentence-transformers or FlagEmbedding pairs, a BEIR corpus, retrieval results) is refused in one
    line saying what it looks like, by its first record: read on, every record would be a bad one, which
    ``--skip-bad-records`` skips."""
    misnamed = misnamed_gzip(path)
    if misnamed:
        raise DprGcError(f"{misnamed}; {TRAINING_FORMATS}")
    is_list = sniff_json(path) == "list"
    line, record = _first_record(path, is_list)
    looks = _looks_like(record, is_list)
    if looks:
        raise DprGcError(f"{path}:{line}: {looks}; {TRAINING_FORMATS}")


def _first_record(path: Path, is_list: bool) -> tuple[int, Any]:
    """``(line, first record)`` of a training file; ``_UNREADABLE`` where the readers will name what is wrong."""
    try:
        with open_text(path) as f:
            if is_list:
                return next(iter_json_list(f, path, text_only=True), (1, _UNREADABLE))
            for line_no, text in enumerate(f, start=1):
                if text.strip():
                    try:
                        return line_no, json.loads(text)
                    except JSON_ERRORS:
                        return line_no, _OPENS_OBJECT if opens_object(text) else _UNREADABLE
    except DprGcError:
        pass
    return 1, _UNREADABLE


def _looks_like(record: Any, is_list: bool) -> Optional[str]:
    """What a first record that is no DPR training record (it has no passage list) says the file is, or None."""
    if record is _UNREADABLE:
        return None
    if record is _OPENS_OBJECT:
        return "it holds one JSON object spread over several lines, not a JSON list or JSONL of records"
    if not isinstance(record, dict):
        return f"it holds {'a list' if is_list else 'lines'} of {type(record).__name__}, not of records"
    keys = set(record)
    if keys & set(DPR_FIELDS[1:]):  # a passage list: a DPR record, bad or good
        return None
    wrapped = [k for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], dict)
               and set(v[0]) & set(DPR_FIELDS)]
    if wrapped:
        return f"it holds one JSON object with the records under {wrapped[0]!r}, not a JSON list or JSONL of records"
    def named(*names: str) -> str:
        return ", ".join(k for k in names if k in keys)

    if {"anchor", "positive"} <= keys:
        guess = f"sentence-transformers ({named('anchor', 'positive', 'negative')}) records"
    elif {"query", "pos"} <= keys:
        guess = f"FlagEmbedding ({named('query', 'pos', 'neg')}) records"
    elif {"_id", "text"} <= keys:
        guess = f"a BEIR corpus or queries file ({named('_id', 'text', 'title')})"
    elif "ctxs" in keys:
        return (f"it looks like retrieval results ({named('question', 'answers', 'ctxs')}: what retrieve --output and "
                "DPR's dense_retriever.py write), not DPR training records (no positive_ctxs); evaluate --results "
                "reads it, and mine --train-file mines hard negatives into training records")
    elif "question" in keys:
        guess = f"a questions file ({named('question', 'answer', 'answers', 'id')}) without passages"
    else:
        guess = f"records with the fields {', '.join(sorted(keys)[:8])}"
    return f"it looks like {guess}, not DPR training records (its first record has none of {', '.join(DPR_FIELDS[1:])})"


def load_beir_training(beir_dir: PathLike, split: str = "train", cache_dir: Optional[PathLike] = None,
                       skip_bad: bool = False, fingerprint: Optional[str] = None) -> TrainingData:
    """Training questions from a BEIR folder: positives are ``qrels/<split>.tsv`` (or ``.tsv.gz``) pairs with score
    > 0.

    There are no hard or other negatives; :class:`TrainingExamples` fills those slots (see there).
    """
    folder = Path(beir_dir)
    corpus, queries = find_beir_file(folder, "corpus.jsonl"), find_beir_file(folder, "queries.jsonl")
    qrels = find_beir_qrels(folder, split)
    produce = functools.partial(_beir_records, corpus, queries, qrels, cache_dir)
    fingerprint = fingerprint or source_fingerprint(folder, split)
    return _build(folder, [qrels, queries, corpus], "beir", produce, cache_dir, skip_bad, fingerprint)


def load_training_data(sources: Sequence[PathLike], cache_dir: Optional[PathLike] = None, skip_bad: bool = False,
                       beir_split: str = "train", fingerprints: Optional[Sequence[str]] = None) -> TrainingData:
    """Load several sources in order: a folder is read as BEIR, a file as DPR training data (DPR's
    ``biencoder-*.json``, JSON or JSONL). Returns a :class:`TrainingData` (the questions of all sources in one
    memory-mapped dataset, and per-source sizes and statistics). Each source's parse is cached under its content
    fingerprint (:func:`~dpr_gc.data.corpus.source_fingerprint`; ``fingerprints`` when the caller has them)."""
    if not sources:
        raise DprGcError("no training data given (pass DPR files or BEIR folders)")
    given = fingerprints or [None] * len(sources)
    return combine([load_beir_training(s, beir_split, cache_dir, skip_bad, f) if Path(s).is_dir()
                    else load_dpr_files([s], cache_dir, skip_bad, [f] if f else None) for s, f in zip(sources, given)])


# ----------------------------------------------------------------- examples and tokenisation
class Collator:
    """DataLoader ``collate_fn``: ``{"query": [B, Lq], "passage": [B*(1+N+M), Lp]}``, passages grouped per query.

    Holds only the tokenizer and a :class:`RetrieverConfig` (so it is cheap to send to workers) and tokenises with
    :func:`dpr_gc.model.tokenize.token_ids`, as encoding and retrieval do (prefixes, per-passage format, max lengths).
    """

    def __init__(self, source: Any, config: Optional[RetrieverConfig] = None, query_max_length: Optional[int] = None,
                 passage_max_length: Optional[int] = None, passage_format: Optional[str] = None) -> None:
        if isinstance(source, Retriever):
            source, config = source.tokenizer, config or source.config
        overrides = {"query_max_length": query_max_length, "passage_max_length": passage_max_length,
                     "passage_format": passage_format}
        overrides = {k: v for k, v in overrides.items() if v is not None}
        self.tokenizer = source
        self.config = dataclasses.replace(config or RetrieverConfig(), **overrides)

    def tokenize_queries(self, questions: Sequence[str], max_length: Optional[int] = None) -> Any:
        return token_ids(self.tokenizer, self.config, "query", questions, max_length=max_length)

    def tokenize_passages(self, titles: Sequence[Optional[str]], texts: Sequence[str],
                          max_length: Optional[int] = None) -> Any:
        return token_ids(self.tokenizer, self.config, "passage", texts, titles, max_length)

    def __call__(self, examples: Sequence[dict]) -> dict:
        """Tokenised queries and passages; with the examples' passage keys also ``passage_ids`` (``[P, 2]``: each
        passage's keys, by id and by title and text, -1 padding where it has no id) and ``positive_ids`` (``[B, K]``,
        -1 padding), the loss's arguments for dropping duplicate positives (ids are hashes of the keys, so they agree
        across ranks; two passages are the same when any key is)."""
        titles, texts = zip(*[p for e in examples for p in e["passages"]])
        batch = {"query": self.tokenize_queries([e["question"] for e in examples]),
                 "passage": self.tokenize_passages(titles, texts)}
        if all("passage_keys" in e for e in examples):
            passages = [keys for e in examples for keys in e["passage_keys"]]
            batch["passage_ids"] = key_ids(passages, 2)
            batch["positive_ids"] = key_ids([e.get("positive_keys", ()) for e in examples])
        return batch


def key_ids(rows: Sequence[Sequence[str]], width: int = 0) -> torch.Tensor:
    """``[len(rows), max(width, longest row)]``: the :func:`key_id` of each row's keys, -1 padding."""
    out = torch.full((len(rows), max([width, *map(len, rows)])), -1, dtype=torch.long)
    for i, keys in enumerate(rows):
        if keys:
            out[i, :len(keys)] = torch.tensor([key_id(k) for k in keys], dtype=torch.long)
    return out


def key_id(key: str) -> int:
    """A non-negative 63-bit id of a passage key, the same in every process (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little") >> 1


BEIR_POSITIVES = ("pairs", "sample")


def example_index(data: TrainingData, beir_positives: Optional[str]) -> Optional[tuple[np.ndarray, list[int]]]:
    """What one epoch's examples are, as ``(examples, examples per source)``; ``examples[i] = (row, positive)``.

    A BEIR folder's question with k judged positives gives, with ``"pairs"``, k examples, one per (query, positive)
    pair (sentence-transformers' way: every qrels pair is trained on each epoch), or with ``"sample"`` one example
    whose positive is drawn afresh at each draw. DPR files keep one example per question (their first positive, or
    a drawn one with ``--shuffle-positives``). None when that is every source's case (nothing to expand).
    """
    import pyarrow.compute as pc

    from .sampling import FIRST_POSITIVE, SAMPLED_POSITIVE

    formats = [data.source_format(i) for i in range(len(data.sizes))]
    if beir_positives is None or "beir" not in formats:
        return None
    if beir_positives not in BEIR_POSITIVES:
        raise DprGcError(f"--beir-positives must be one of {', '.join(BEIR_POSITIVES)}, got {beir_positives!r}")
    counts = pc.list_value_length(data.dataset.data.column("positives")).to_numpy(zero_copy_only=False)
    parts, sizes, offset = [], [], 0
    for size, kind in zip(data.sizes, formats):
        rows = np.arange(offset, offset + size)
        if kind == "beir" and beir_positives == "pairs":
            k = counts[offset:offset + size].astype(np.int64)
            which = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
            part = np.stack([np.repeat(rows, k), which], axis=1)
        else:
            code = SAMPLED_POSITIVE if kind == "beir" else FIRST_POSITIVE
            part = np.stack([rows, np.full(size, code)], axis=1)
        parts.append(part)
        sizes.append(len(part))
        offset += size
    return np.concatenate(parts).astype(np.int64), sizes


@dataclasses.dataclass
class Batching:
    """How training batches are drawn: queries per rank, negatives per query, positive and negative shuffling,
    per-source sampling ``rates``, the seed, and whether each batch comes from one source (``per_file_batches``)."""

    batch_size: int = setting(32, type=positive_int, help="queries per batch and rank")
    hard_negatives: int = setting(1, type=nonnegative_int, help="hard negatives per query")
    other_negatives: int = setting(0, type=nonnegative_int, help="other negatives per query")
    shuffle_positives: bool = setting(False, help="draw a random positive per query (else the first)")
    shuffle_negatives: bool = setting(True, help="draw negatives at random (else the first ones)")
    rates: Optional[Sequence[float]] = setting(None, type=positive_float, nargs="+", help="per-source sampling rates")
    seed: int = setting(0, type=nonnegative_int, help="seed of the sampling")
    shuffle: bool = setting(True, help="shuffle the order of examples each epoch")
    per_file_batches: bool = setting(False, help="each batch from one source")
    beir_positives: Optional[str] = setting(None, choices=BEIR_POSITIVES,
                                            help="BEIR folders: one example per (query, positive) pair, or one per "
                                                 "query with a positive drawn each time (None: one per query)")

    def __post_init__(self) -> None:
        check(self)


def worker_watch() -> Callable[[int], None]:
    """The workers' ``worker_init_fn``: :func:`die_with_parent` told this process's pid where the workers are its
    own children (``fork``, ``spawn``); under ``forkserver`` their parent is the server, found by the worker."""
    if torch.multiprocessing.get_start_method() in ("fork", "spawn"):
        return functools.partial(die_with_parent, parent=os.getpid())
    return die_with_parent


def make_dataloader(data: TrainingData, collator: Collator, settings: Optional[Batching] = None, *, rank: int = 0,
                    world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
                    **options: Any) -> torch.utils.data.DataLoader:
    """A DataLoader of tokenised per-rank batches drawn as ``settings`` says (fields of :class:`Batching` may also
    be given as keywords); reach the sampler (``set_epoch``, state) as ``.batch_sampler``.

    ``beir_positives`` (``pairs`` or ``sample``, see :func:`example_index`; None: one example per question) says
    what a BEIR source's examples are. Its own seeded generator draws the workers' base seed at each ``iter()``:
    without it that draw comes from the global torch RNG, and a run resumed mid-epoch would draw once more than an
    uninterrupted one (other dropout).
    """
    s = dataclasses.replace(settings or Batching(), **options)
    batch_size, rates, seed, shuffle = s.batch_size, s.rates, s.seed, s.shuffle
    index = example_index(data, s.beir_positives)
    items, sizes = index if index is not None else (None, data.sizes)
    questions = question_groups(data.dataset.select_columns(["question"])[:]["question"])
    groups = questions[items[:, 0]] if items is not None else questions  # each item's question
    groups = groups if len(np.unique(groups)) < len(groups) else None  # None: no question is drawn twice
    sampler = MixedBatchSampler(sizes, batch_size, rates, seed, rank, world_size, shuffle, s.per_file_batches, groups)
    examples = TrainingExamples(data.dataset, s.hard_negatives, s.other_negatives, s.shuffle_positives,
                                s.shuffle_negatives, seed, sampler.global_batch, items, sizes, sampler.rates, questions)
    if num_workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    watch = worker_watch() if num_workers else None
    return torch.utils.data.DataLoader(examples, batch_sampler=sampler, collate_fn=collator, num_workers=num_workers,
                                       pin_memory=pin_memory, worker_init_fn=watch,
                                       generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- CLI
@dataclasses.dataclass
class PrepareSettings:
    """``dpr-gc prepare-data`` besides the sources: the cache, bad records, the BEIR split."""

    cache_dir: Optional[str] = cache_dir_setting("where Arrow caches go, a BEIR folder's corpus beside the training "
                                                 "sets (default: $DPR_GC_CACHE/train and $DPR_GC_CACHE/corpora, "
                                                 "else ~/.cache/dpr_gc/train and ~/.cache/dpr_gc/corpora)")
    skip_bad_records: bool = setting(False, "--skip-bad-records",
                                     help="skip and count bad records instead of stopping")
    beir_split: str = setting("train", "--beir-split", type=qrels_split, hidden=[("--split", {"type": qrels_split})],
                              help="qrels split used for BEIR folders (qrels/SPLIT.tsv)")


def add_cli(subparsers: Any) -> None:
    """Register ``prepare-data``: parse and cache training sources ahead of training, printing their statistics."""
    p = subparsers.add_parser("prepare-data")
    p.add_argument("sources", nargs="+", help="DPR training files (.json/.jsonl[.gz]) or BEIR folders")
    add_arguments(p, PrepareSettings)
    p.set_defaults(func=_cli_prepare)


@guarded(inputs=("sources=the training source",))
def _cli_prepare(args: Any) -> None:
    """Handler for ``prepare-data``: a table of each source's counts, then the closing summary of them all."""
    started = time.perf_counter()
    data = load_training_data(args.sources, args.cache_dir, args.skip_bad_records, args.beir_split)
    print(markdown_table(("source", "records", "kept", "no positive", "bad", "negatives that were a positive", "parse"),
                         [[*(s[k] for k in ("source", "records", "kept", "no_positive", "bad")),
                           s.get("dropped_negatives", 0), "new" if s["parsed_now"] else "cached"]
                          for s in data.stats]))
    print()  # two tables apart: pasted together they would render as one
    print(format_summary({"sources": len(data.stats), "records": sum(s["records"] for s in data.stats),
                          "kept": sum(s["kept"] for s in data.stats),
                          "parsed this run": sum(1 for s in data.stats if s["parsed_now"])},
                         time.perf_counter() - started))
