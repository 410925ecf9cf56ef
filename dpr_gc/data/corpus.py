"""Read passage corpora and query files in the formats DPR and BEIR use.

A corpus becomes a memory-mapped Arrow :class:`datasets.Dataset` with string columns ``id``, ``title`` and ``text``.
It is parsed once, streamed into an Arrow file in a cache folder (keyed by the source file's path, size,
modification time and content fingerprint) and memory-mapped from then on, so even DPR's 21M-passage Wikipedia never
sits in Python lists. Row ``i`` of that dataset is "corpus row i" everywhere in the toolkit.

TSV files are read one physical line per row, so a stray quote can never swallow the rows after it: a field written
CSV-style (``"say ""hi"" now"``, as in DPR's ``psgs_w100.tsv``) is unquoted, and a field that begins with
``"`` but does not close its quote within itself is read literally and logged with its line number. Passage ids must
be unique and free of whitespace (TREC runs and id files are whitespace-separated).
"""

from __future__ import annotations

import array
import ast
import hashlib
import json
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from ..base.errors import DprGcError, clipped
from ..base.logs import counted
from .arrow_cache import cache_file, cached_dataset, write_stream
from ..base.files import (JSON_ERRORS, PathLike, check_unicode, copied_from, iter_jsonl_objects, json_problem,
                          open_text, require_file)
from ..base.streams import TsvCounts, iter_tsv_lines, log_tsv_counts, not_jsonl
from ..base.validate import blank_id, check_id, given_id

logger = logging.getLogger(__name__)

COLUMNS = ("id", "title", "text")
CACHE_VERSION = "4"
WRITE_BATCH_ROWS = 10_000
FULL_HASH_BYTES = 256 << 20
SAMPLE_BLOCKS = 1024
SAMPLE_BLOCK_BYTES = 64 << 10
_BAD_ID = re.compile(r"\s")


def corpus_format(path: PathLike) -> str:
    """``"tsv"`` or ``"jsonl"``, from the extension (``.gz`` ignored) or else from the first non-empty line."""
    p = Path(path)
    name = p.name[:-3] if p.name.endswith(".gz") else p.name
    suffix = Path(name).suffix.lower()
    if suffix in (".tsv", ".csv"):
        return "tsv"
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    with open_text(p) as f:
        for line in f:
            if line.strip():
                return "jsonl" if line.lstrip().startswith("{") else "tsv"
    return "tsv"


def source_files(path: PathLike, split: str = "train", every_qrels: bool = False) -> dict[str, str]:
    """The :func:`corpus_fingerprint` of each file a training source reads, by its path: the file, or a BEIR
    folder's corpus, queries and ``qrels/<split>.tsv`` (or ``.tsv.gz``) files, in the order of their paths relative
    to it; whatever else the folder holds (other splits' qrels, a BM25 index) does not count. ``every_qrels``: every
    ``qrels/*`` file instead, as fingerprints of earlier versions counted them. A piped file is named as given
    (:func:`~dpr_gc.base.files.copied_from`), not by its temporary copy."""
    p = Path(path)
    if not p.is_dir():
        return {copied_from(p) or str(p): corpus_fingerprint(p)}
    qrels = p.glob("qrels/*") if every_qrels else [p / "qrels" / f"{split}.tsv", p / "qrels" / f"{split}.tsv.gz"]
    files = sorted(f for f in [*p.glob("corpus*"), *p.glob("queries*"), *qrels]
                   if f.is_file() and not f.name.startswith("."))
    return {str(f): corpus_fingerprint(f) for f in files}


def source_fingerprint(path: PathLike, split: str = "train", files: Optional[dict[str, str]] = None) -> str:
    """The content fingerprint of a training source: :func:`corpus_fingerprint` of a file, or a hash of a BEIR
    folder's :func:`source_files` (``files`` when the caller has them) with their paths relative to it."""
    p = Path(path)
    files = source_files(p, split) if files is None else files
    if not p.is_dir():
        return next(iter(files.values()))
    digest = hashlib.blake2b(digest_size=16)
    for name, fingerprint in files.items():
        digest.update(f"{Path(name).relative_to(p)}\0{fingerprint}\0".encode())
    return digest.hexdigest()


def file_stamp(path: PathLike) -> list:
    """A file's size and modification time (ns), keyed beside its :func:`corpus_fingerprint` (training caches,
    ``mine``'s resume): above 256 MiB the fingerprint hashes sampled blocks only, so an edit between them changes
    only these. A pipe's temporary copy (:func:`~dpr_gc.base.files.copied_from`) is new at every run: its stamp is
    its size and a hash of all its bytes, so the same text piped again finds its cache and its interrupted run."""
    st = Path(path).stat()
    if copied_from(path) is None:
        return [st.st_size, st.st_mtime_ns]
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return [st.st_size, f"piped-{digest.hexdigest()}"]


def corpus_fingerprint(path: PathLike, what: str = "corpus file") -> str:
    """A content fingerprint of the corpus file: a hash of its bytes, or of 1,024 evenly spaced 64 KiB blocks and the
    size when it is larger than 256 MiB (so checking a 13 GB ``psgs_w100.tsv`` costs well under a second).

    Recorded in the corpus cache key, the encode manifests and the index metadata, so an edit that keeps the file's
    size and modification time still cannot pair new passage text with old vectors. ``what`` names the file in the
    error when it is missing (the questions and qrels files are fingerprinted too).
    """
    p = require_file(path, what)
    size = p.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(p, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            kind = "full"
        else:
            step = (size - SAMPLE_BLOCK_BYTES) / (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                f.seek(int(i * step))
                digest.update(f.read(SAMPLE_BLOCK_BYTES))
            kind = "sampled"
    return f"{kind}-{digest.hexdigest()}"


# --------------------------------------------------------------------------------------------- passages
def iter_passages(path: PathLike) -> Iterator[tuple[str, str, str]]:
    """Stream ``(id, title, text)`` from a DPR passages TSV, a BEIR ``corpus.jsonl`` or an ``id/text/title`` JSONL."""
    for _, pid, title, text in iter_passage_lines(require_file(path, "corpus file")):
        yield pid, title, text


def iter_passage_lines(path: Path) -> Iterator[tuple[int, str, str, str]]:
    """Like :func:`iter_passages`, with the line number of each passage first; ids are checked here."""
    rows = _iter_tsv_passages(path) if corpus_format(path) == "tsv" else _iter_jsonl_passages(path)
    for line_no, pid, title, text in rows:
        if not pid or _BAD_ID.search(pid):
            raise DprGcError(f"{path}:{line_no}: passage id {clipped(pid)} is empty or contains whitespace; ids must "
                             "be one word (TREC runs and id files separate fields by whitespace); rename it")
        check_id(pid, f"{path}:{line_no}", "passage id")  # as evaluate checks the runs and results made from it
        yield line_no, pid, title, text


def _iter_tsv_passages(path: Path) -> Iterator[tuple[int, str, str, str]]:
    counts = TsvCounts()
    lines = iter_tsv_lines(path, counts)
    first = next(lines, None)
    if first is None:
        raise DprGcError(f"corpus is empty: {path} (expected a header line 'id<TAB>text<TAB>title')")
    counts.header = 1
    header_line, header = first
    names = [h.strip().lower() for h in header]
    missing = [c for c in ("id", "text") if c not in names]
    if missing:
        raise DprGcError(f"{path}:{header_line}: header lacks column(s) {', '.join(missing)} "
                         f"(got {clipped(str(header))}); a passages TSV starts with 'id<TAB>text<TAB>title'")
    i_id, i_text = names.index("id"), names.index("text")
    i_title = names.index("title") if "title" in names else None
    for line_no, row in lines:
        if len(row) != len(names):
            hint = ("; a field there begins with '\"': CSV-quoted fields cannot hold tabs or line breaks"
                    if counts.last_literal == line_no else "")
            raise DprGcError(f"{path}:{line_no}: expected {len(names)} tab-separated fields ({', '.join(names)}), "
                             f"got {len(row)}{hint}; fix or remove that line")
        counts.rows += 1
        yield line_no, row[i_id], row[i_title] if i_title is not None else "", row[i_text]
    log_tsv_counts(path, counts, "passages")


def _jsonl_objects(path: Path, item: str, what: str) -> Iterator[tuple[int, dict]]:
    """The objects of a JSONL file (``what`` each is); a JSON list or one pretty-printed object is refused as what
    it is (:func:`~dpr_gc.base.streams.not_jsonl`), not as invalid JSON at line 1."""
    holds = not_jsonl(path)
    if holds:
        raise DprGcError(f"{path} holds {holds}, not one {item} a line: this reader takes JSONL (one JSON object a "
                         f"line); write each {item} as one JSON object on a line of its own")
    return iter_jsonl_objects(path, what)


def _iter_jsonl_passages(path: Path) -> Iterator[tuple[int, str, str, str]]:
    for line_no, obj in _jsonl_objects(path, "passage", "a passage with id, title and text"):
        pid = given_id(obj)
        if pid is None:  # none given, or only an empty one: refused as empty where ids are checked
            pid = obj.get("_id", obj.get("id"))
        if pid is None:
            raise DprGcError(f"{path}:{line_no}: missing passage id (need '_id' or 'id')")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise DprGcError(f"{path}:{line_no}: passage id must be a string or an integer, got {clipped(str(pid))}")
        text = obj.get("text")
        if not isinstance(text, str):
            raise DprGcError(f"{path}:{line_no}: missing or non-string 'text'")
        title = obj.get("title")
        if title is not None and not isinstance(title, str):  # false, 0, [] are no empty title: refused as 5 is
            raise DprGcError(f"{path}:{line_no}: 'title' must be a string, got {type(title).__name__}")
        yield line_no, str(pid), title or "", text


# --------------------------------------------------------------------------------------------- Arrow cache
def corpus_cache_path(path: PathLike, cache_dir: Optional[PathLike] = None,
                      fingerprint: Optional[str] = None) -> Path:
    """The Arrow cache file for ``path``; it changes whenever the file's path, size, mtime or content changes (a
    pipe's copy: its content only, :func:`file_stamp`, as a pipe's name says nothing of what it holds)."""
    p = Path(path).resolve()
    size, stamp = file_stamp(p)
    fingerprint = fingerprint or corpus_fingerprint(p)
    where = "piped" if copied_from(p) else p
    return cache_file(cache_dir, "corpora", p.name, f"{CACHE_VERSION}|{where}|{size}|{stamp}|{fingerprint}")


def load_corpus(path: PathLike, cache_dir: Optional[PathLike] = None) -> Any:
    """Return the corpus as a memory-mapped ``datasets.Dataset`` (columns id, title, text), parsing it once.

    ``path``: a DPR passages TSV (``psgs_w100.tsv``), a BEIR ``corpus.jsonl`` or an ``id/text/title`` JSONL; the
    Arrow file is kept in ``cache_dir`` (default: ``$DPR_GC_CACHE/corpora``, else ``~/.cache/dpr_gc/corpora``).

    The source's content fingerprint is part of the cache key and stored in the Arrow schema metadata
    (``dpr_gc_fingerprint``), so an edited file is parsed again even if its size and mtime were restored.
    """
    p = require_file(path, "corpus file")
    fingerprint = corpus_fingerprint(p)
    cache = corpus_cache_path(p, cache_dir, fingerprint)
    return cached_dataset(cache, lambda: _build_arrow(p, cache, fingerprint), {"dpr_gc_fingerprint": fingerprint})


def dataset_fingerprint(corpus: Any) -> Optional[str]:
    """The content fingerprint of the source file recorded in a corpus dataset's Arrow cache (None if absent)."""
    import pyarrow as pa

    files = getattr(corpus, "cache_files", None) or []
    if len(files) != 1:
        return None
    with pa.OSFile(files[0]["filename"], "rb") as source:
        metadata = pa.ipc.open_stream(source).schema.metadata or {}
    value = metadata.get(b"dpr_gc_fingerprint")
    return value.decode() if value else None


def _build_arrow(path: Path, cache: Path, fingerprint: str) -> None:
    """Stream the corpus into its Arrow cache file; refuse an empty corpus or duplicate passage ids before the file
    gets its final name."""
    import pyarrow as pa
    from tqdm.auto import tqdm

    schema = pa.schema([(c, pa.string()) for c in COLUMNS],
                       metadata={"dpr_gc_source": str(path.resolve()), "dpr_gc_fingerprint": fingerprint})
    total = 0

    def batches() -> Iterator[Any]:
        nonlocal total
        cols: tuple[list[str], list[str], list[str]] = ([], [], [])
        for row in tqdm(iter_passages(path), desc=f"reading {path.name}", unit=" passages", mininterval=2.0,
                        disable=None):
            for col, value in zip(cols, row):
                col.append(value)
            if len(cols[0]) >= WRITE_BATCH_ROWS:
                total += len(cols[0])
                yield pa.record_batch([pa.array(c, pa.string()) for c in cols], schema=schema)
                cols = ([], [], [])
        if cols[0]:
            total += len(cols[0])
            yield pa.record_batch([pa.array(c, pa.string()) for c in cols], schema=schema)

    def check(tmp: Path) -> None:
        if total == 0:
            raise DprGcError(f"corpus is empty: {path} has no passages")
        _check_unique_ids(tmp, path)

    write_stream(cache, schema, batches(), check)
    logger.info("cached %s from %s in %s", counted(total, "passage"), path, cache)


def _check_unique_ids(arrow_file: Path, source: Path) -> None:
    """Refuse a corpus in which a passage id repeats, naming the file and both lines (counted in Arrow, in C)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    with pa.memory_map(str(arrow_file)) as mapped:
        ids = pa.ipc.open_stream(mapped).read_all().column("id")
        if pc.count_distinct(ids).as_py() == len(ids):
            return
        counts = pc.value_counts(ids)
        repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
        rows = np.flatnonzero(pc.is_in(ids, value_set=repeated).to_numpy(zero_copy_only=False))
        seen: dict[str, int] = {}
        for row in rows.tolist():
            pid = ids[row].as_py()
            if pid in seen:
                first, second = seen[pid], row
                break
            seen[pid] = row
    lines = _lines_of_rows(source, {first, second})
    raise DprGcError(f"{source}:{lines[second]}: passage id {clipped(pid)} repeats the one at line {lines[first]} "
                     f"({len(repeated)} id(s) occur more than once); passage ids must be unique, so rename or "
                     "remove the duplicates")


def _lines_of_rows(path: Path, rows: set[int]) -> dict[int, int]:
    """Line numbers of the given corpus rows (read again; used only to report an error)."""
    found: dict[int, int] = {}
    for row, (line_no, *_) in enumerate(iter_passage_lines(path)):
        if row in rows:
            found[row] = line_no
            if len(found) == len(rows):
                break
    return found


def rows_for_ids(corpus: Any, ids: Iterable[str], block_size: int = 1_000_000) -> dict[str, int]:
    """Corpus rows of the given passage ids (ids not in the corpus are left out), by one scan of the id column."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    wanted, found = pa.array(sorted(set(map(str, ids))), pa.string()), {}
    table = corpus.with_format("arrow")
    for s in range(0, len(corpus), block_size):
        col = table[s:s + block_size]["id"]
        mask = pc.is_in(col, value_set=wanted)
        rows = np.flatnonzero(np.asarray(mask, dtype=bool)) + s
        for pid, row in zip(pc.filter(col, mask).to_pylist(), rows.tolist()):
            found.setdefault(pid, row)
    return found


# --------------------------------------------------------------------------------------------- queries
def read_queries(path: PathLike) -> list[dict]:
    """Read questions as ``{"id", "question", "answers"}`` dicts (all of them: see :func:`iter_queries`).

    Accepts DPR QA files (``question<TAB>["answer", ...]``, no header; an optional third column is the id,
    otherwise the id is the line number), NQ-open JSONL (``question``, ``answer``/``answers``, optional ``id``)
    and BEIR ``queries.jsonl`` (``_id``, ``text``; no answers).
    """
    p = require_file(path, "queries file")
    queries = list(iter_queries(p))
    if not queries:
        raise DprGcError(f"no queries in {p} (the file is empty)")
    return queries


def iter_queries(path: PathLike, log: bool = True) -> Iterator[dict]:
    """The questions of :func:`read_queries` one at a time, in file order, so a run over millions of them holds one
    (``log``: say how many lines a TSV file had, once the file is read). A repeated query id is refused once the
    file is read, naming both lines (``retrieve`` reads the file once to check it before retrieving anything)."""
    for _, query in iter_numbered_queries(path, log):
        yield query


def iter_numbered_queries(path: PathLike, log: bool = True) -> Iterator[tuple[int, dict]]:
    """:func:`iter_queries` with each question's line number, for messages that name the line."""
    p = require_file(path, "queries file")
    hashes = array.array("q")  # 8 bytes a question: the check for repeated ids keeps memory flat
    for line_no, query in _query_rows(p, log):
        hashes.append(_id_hash(query["id"]))
        yield line_no, query
    _refuse_repeated_ids(p, hashes)


def _query_rows(path: Path, log: bool) -> Iterator[tuple[int, dict]]:
    return _iter_jsonl_queries(path) if corpus_format(path) == "jsonl" else _iter_tsv_queries(path, log)


def _id_hash(qid: str) -> int:
    return int.from_bytes(hashlib.blake2b(qid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little",
                          signed=True)


def _refuse_repeated_ids(path: Path, hashes: "array.array[int]") -> None:
    """Refuse a questions file in which a query id repeats, naming the file, both lines and the id (found by reading
    the file again, only when the ids' hashes repeat)."""
    import numpy as np

    values, counts = np.unique(np.frombuffer(hashes, dtype=np.int64), return_counts=True)
    repeated = set(values[counts > 1].tolist())
    if not repeated:
        return
    first: dict[str, int] = {}
    for line_no, query in _query_rows(path, False):
        if _id_hash(query["id"]) in repeated:
            if query["id"] in first:
                raise DprGcError(f"{path}:{line_no}: query id {clipped(query['id'])} repeats the one at line "
                                 f"{first[query['id']]}; every question needs its own id (results, runs and qrels "
                                 "are joined by it), so rename or remove the duplicate")
            first[query["id"]] = line_no


def _iter_tsv_queries(path: Path, log: bool) -> Iterator[tuple[int, dict]]:
    counts = TsvCounts()
    first = 0  # the first non-blank line's number: the header, if any
    for line_no, row in iter_tsv_lines(path, counts):
        first = first or line_no
        if [c.strip().lower() for c in row[:2]] == ["question", "answers"]:
            if line_no != first:
                raise DprGcError(f"{path}:{line_no}: line {line_no} repeats the header (files joined?); remove it")
            counts.header = 1
            continue
        if len(row) not in (2, 3):
            raise DprGcError(f"{path}:{line_no}: expected 'question<TAB>answers' (optionally <TAB>id), "
                             f"got {len(row)} field(s)")
        answers = _parse_answers(row[1], f"{path}:{line_no}")
        counts.rows += 1
        qid = row[2] if len(row) == 3 and not blank_id(row[2]) else str(line_no)
        yield line_no, _query(f"{path}:{line_no}", qid, row[0], answers)
    if log:
        log_tsv_counts(path, counts, "questions")


def _query(where: str, qid: Any, question: str, answers: list[str]) -> dict:
    """A question record, its id and text checked as ``evaluate`` checks the results and runs made from it."""
    if not question.strip():
        raise DprGcError(f"{where}: the question is empty; remove the line or give its text")
    return {"id": check_id(qid, where, "query id"), "question": question, "answers": answers}


def _parse_answers(field: str, where: str) -> list[str]:
    """Parse a Python-literal list of answer strings, as DPR's ``eval`` reads it (never ``eval`` itself: ``"AC\\/DC"``
    keeps its backslash), or, where the field is no literal, JSON (``true``, ``false``, ``null``)."""
    value: Any
    try:
        value = _literal(field)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        try:
            value = json.loads(field)
        except JSON_ERRORS as e:
            if not isinstance(e, (json.JSONDecodeError, RecursionError)):  # JSON, but an integer Python cannot read
                raise DprGcError(f"{where}: {json_problem(e, field)[0]}") from None
            raise DprGcError(f"{where}: answers must be a list like [\"a\", \"b\"], got {field[:60]!r}") from None
    return _answer_list(check_unicode(value, where), where)


def _literal(field: str) -> Any:
    """``ast.literal_eval`` of ``field`` without Python's compile warnings: a CuratedTREC pattern (``'\\d+'``) is an
    invalid escape to the compiler, which would print a raw SyntaxWarning for the value read as DPR reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(field)


def _answer_list(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        return list(value)
    raise DprGcError(f"{where}: answers must be a string or a list of strings, got {str(value)[:60]!r}")


def _iter_jsonl_queries(path: Path) -> Iterator[tuple[int, dict]]:
    for line_no, obj in _jsonl_objects(path, "question", "a question"):
        where = f"{path}:{line_no}"
        question = obj.get("question", obj.get("text", obj.get("query")))
        if not isinstance(question, str):
            raise DprGcError(f"{where}: missing question (need 'question', or BEIR's 'text')")
        raw = obj.get("answers", obj.get("answer", []))
        answers = _answer_list(raw, where) if raw is not None else []
        qid = given_id(obj)
        yield line_no, _query(where, qid if qid is not None else str(line_no), question, answers)
