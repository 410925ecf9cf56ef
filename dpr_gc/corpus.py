"""Read passage corpora and query files in the formats DPR and BEIR use.

A corpus becomes a memory-mapped Arrow :class:`datasets.Dataset` with string columns ``id``, ``title`` and ``text``.
It is parsed once, streamed into an Arrow file in a cache folder (keyed by the source file's path, size and
modification time) and memory-mapped from then on, so even DPR's 21M-passage Wikipedia never sits in Python lists.
Row ``i`` of that dataset is "corpus row i" everywhere in the toolkit.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from .errors import DprGcError
from .files import PathLike, atomic_path, iter_jsonl, open_text, require_file

logger = logging.getLogger(__name__)

COLUMNS = ("id", "title", "text")
CACHE_VERSION = "1"
WRITE_BATCH_ROWS = 10_000


def default_cache_dir() -> Path:
    """Where parsed corpora are cached: ``$DPR_GC_CACHE/corpora`` or ``~/.cache/dpr_gc/corpora``."""
    root = os.environ.get("DPR_GC_CACHE") or Path.home() / ".cache" / "dpr_gc"
    return Path(root) / "corpora"


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


def iter_passages(path: PathLike) -> Iterator[tuple[str, str, str]]:
    """Stream ``(id, title, text)`` from a DPR passages TSV, a BEIR ``corpus.jsonl`` or an ``id/text/title`` JSONL."""
    p = require_file(path, "corpus file")
    rows = _iter_tsv_passages(p) if corpus_format(p) == "tsv" else _iter_jsonl_passages(p)
    for line_no, pid, title, text in rows:
        if "\n" in pid or "\r" in pid:
            raise DprGcError(f"{p}:{line_no}: passage id {pid!r} contains a line break; ids must be one line")
        yield pid, title, text


def _iter_tsv_passages(path: Path) -> Iterator[tuple[int, str, str, str]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open_text(path) as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None:
            raise DprGcError(f"corpus is empty: {path} (expected a header line 'id<TAB>text<TAB>title')")
        names = [h.strip().lower() for h in header]
        missing = [c for c in ("id", "text") if c not in names]
        if missing:
            raise DprGcError(f"{path}:1: header lacks column(s) {', '.join(missing)} (got {header!r}); "
                             "a passages TSV starts with 'id<TAB>text<TAB>title'")
        i_id, i_text = names.index("id"), names.index("text")
        i_title = names.index("title") if "title" in names else None
        start = reader.line_num
        for row in reader:
            line_no, start = start + 1, reader.line_num
            if not row or row == [""]:
                continue
            if len(row) != len(names):
                raise DprGcError(f"{path}:{line_no}: expected {len(names)} tab-separated fields "
                                 f"({', '.join(names)}), got {len(row)}; fix or remove that line")
            title = row[i_title] if i_title is not None else ""
            yield line_no, row[i_id], title, row[i_text]


def _iter_jsonl_passages(path: Path) -> Iterator[tuple[int, str, str, str]]:
    for line_no, obj in iter_jsonl(path):
        if not isinstance(obj, dict):
            raise DprGcError(f"{path}:{line_no}: expected a JSON object with id, title and text")
        pid = obj.get("_id", obj.get("id"))
        if pid is None:
            raise DprGcError(f"{path}:{line_no}: missing passage id (need '_id' or 'id')")
        text = obj.get("text")
        if not isinstance(text, str):
            raise DprGcError(f"{path}:{line_no}: missing or non-string 'text'")
        title = obj.get("title") or ""
        if not isinstance(title, str):
            raise DprGcError(f"{path}:{line_no}: 'title' must be a string")
        yield line_no, str(pid), title, text


def corpus_cache_path(path: PathLike, cache_dir: Optional[PathLike] = None) -> Path:
    """The Arrow cache file for ``path``; it changes whenever the file's path, size or mtime changes."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha1(f"{CACHE_VERSION}|{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return folder / f"{p.name}-{key}.arrow"


def load_corpus(path: PathLike, cache_dir: Optional[PathLike] = None) -> Any:
    """Return the corpus as a memory-mapped ``datasets.Dataset`` (columns id, title, text), parsing it once."""
    import datasets

    p = require_file(path, "corpus file")
    cache = corpus_cache_path(p, cache_dir)
    if not cache.is_file():
        with _build_lock(cache):
            if not cache.is_file():
                rows = _build_arrow(p, cache)
                logger.info("cached %d passages from %s in %s", rows, p, cache)
    return datasets.Dataset.from_file(str(cache))


@contextlib.contextmanager
def _build_lock(cache: Path) -> Iterator[None]:
    """Let one process (e.g. one torchrun rank) parse the corpus while the others wait for its cache file.

    ``flock`` is released by the OS if the holder dies, so a crash never leaves a stale lock. Without ``fcntl``
    (not POSIX) builders simply race; each writes a complete file and renames it atomically.
    """
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(cache.with_name(cache.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_arrow(path: Path, cache: Path) -> int:
    """Stream the corpus into an Arrow IPC stream file (the layout ``Dataset.from_file`` maps), atomically."""
    import pyarrow as pa
    from tqdm.auto import tqdm

    schema = pa.schema([(c, pa.string()) for c in COLUMNS])
    total = 0
    with atomic_path(cache) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            cols: tuple[list[str], list[str], list[str]] = ([], [], [])
            for pid, title, text in tqdm(iter_passages(path), desc=f"reading {path.name}", unit=" passages",
                                         mininterval=2.0, disable=None):
                cols[0].append(pid)
                cols[1].append(title)
                cols[2].append(text)
                if len(cols[0]) >= WRITE_BATCH_ROWS:
                    total += _flush(writer, schema, cols)
            total += _flush(writer, schema, cols)
        if total == 0:
            raise DprGcError(f"corpus is empty: {path} has no passages")
    return total


def _flush(writer: Any, schema: Any, cols: tuple[list[str], list[str], list[str]]) -> int:
    import pyarrow as pa

    n = len(cols[0])
    if n:
        writer.write_batch(pa.record_batch([pa.array(c, pa.string()) for c in cols], schema=schema))
        for c in cols:
            c.clear()
    return n


# --------------------------------------------------------------------------------------------- queries
def read_queries(path: PathLike) -> list[dict]:
    """Read questions as ``{"id", "question", "answers"}`` dicts.

    Accepts DPR QA files (``question<TAB>["answer", ...]``, no header; an optional third column is the id,
    otherwise the id is the line number), NQ-open JSONL (``question``, ``answer``/``answers``, optional ``id``)
    and BEIR ``queries.jsonl`` (``_id``, ``text``; no answers).
    """
    p = require_file(path, "queries file")
    queries = _read_jsonl_queries(p) if corpus_format(p) == "jsonl" else _read_tsv_queries(p)
    if not queries:
        raise DprGcError(f"no queries in {p} (the file is empty)")
    return queries


def _read_tsv_queries(path: Path) -> list[dict]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    out = []
    with open_text(path) as f:
        reader = csv.reader(f, delimiter="\t")
        start = reader.line_num
        for row in reader:
            line_no, start = start + 1, reader.line_num
            if not row or row == [""]:
                continue
            if line_no == 1 and [c.strip().lower() for c in row[:2]] == ["question", "answers"]:
                continue
            if len(row) not in (2, 3):
                raise DprGcError(f"{path}:{line_no}: expected 'question<TAB>answers' (optionally <TAB>id), "
                                 f"got {len(row)} field(s)")
            answers = _parse_answers(row[1], f"{path}:{line_no}")
            qid = row[2] if len(row) == 3 else str(line_no)
            out.append({"id": qid, "question": row[0], "answers": answers})
    return out


def _parse_answers(field: str, where: str) -> list[str]:
    """Parse a JSON or Python-literal list of answer strings (never ``eval``)."""
    value: Any
    try:
        value = json.loads(field)
    except json.JSONDecodeError:
        try:
            value = ast.literal_eval(field)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise DprGcError(f"{where}: answers must be a list like [\"a\", \"b\"], got {field[:60]!r}") from None
    return _answer_list(value, where)


def _answer_list(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        return list(value)
    raise DprGcError(f"{where}: answers must be a string or a list of strings, got {str(value)[:60]!r}")


def _read_jsonl_queries(path: Path) -> list[dict]:
    out = []
    for line_no, obj in iter_jsonl(path):
        where = f"{path}:{line_no}"
        if not isinstance(obj, dict):
            raise DprGcError(f"{where}: expected a JSON object")
        question = obj.get("question", obj.get("text", obj.get("query")))
        if not isinstance(question, str):
            raise DprGcError(f"{where}: missing question (need 'question', or BEIR's 'text')")
        raw = obj.get("answers", obj.get("answer", []))
        answers = _answer_list(raw, where) if raw is not None else []
        qid = obj.get("_id", obj.get("id"))
        out.append({"id": str(qid) if qid is not None else str(line_no), "question": question, "answers": answers})
    return out
