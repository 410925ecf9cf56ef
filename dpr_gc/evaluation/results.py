"""Retriever results files, written and read one question at a time so memory does not grow with the questions.

Two forms of the same records (a JSON list, or JSONL when the name ends in ``.jsonl``; ``.gz`` compresses):

* DPR's retriever JSON: ``{id, question, answers, ctxs: [{id, title, text, score, has_answer}]}`` per question;
* the compact form (``--compact``): the same without ``title`` and ``text``, i.e. ``ctxs: [{id, score,
  has_answer}]`` -- passage ids, scores and answer flags, all that evaluation and mining need, at a few percent of
  the size.

A TREC run (``qid Q0 docid rank score tag``) carries the same ranking.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from ..base.errors import DprGcError
from ..base.files import PathLike, atomic_path, gzip_text, iter_jsonl, open_text, require_file
from ..base.validate import check_id, no_lone_surrogates

COMPACT_KEYS = ("id", "score", "has_answer")


def is_jsonl(path: PathLike) -> bool:
    return Path(path).name.removesuffix(".gz").endswith(".jsonl")


@contextlib.contextmanager
def _atomic_text(path: PathLike) -> Iterator[IO[str]]:
    """A text file (gzip when named ``.gz``) that appears under ``path`` only when closed without error."""
    with atomic_path(path) as tmp:
        with (gzip_text(tmp, Path(path)) if Path(path).suffix == ".gz"
              else open(tmp, "w", encoding="utf-8")) as f:
            yield f


class ResultsWriter:
    """Append question records to a results file (DPR JSON list or JSONL; ``compact`` drops title and text)."""

    def __init__(self, f: IO[str], jsonl: bool, compact: bool = False) -> None:
        self.f, self.jsonl, self.compact, self.count = f, jsonl, compact, 0
        if not jsonl:
            f.write("[\n")

    def write(self, record: dict) -> None:
        if self.compact:
            record = {**record, "ctxs": [{k: c[k] for k in COMPACT_KEYS if k in c} for c in record["ctxs"]]}
        if self.jsonl:
            self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            self.f.write(("" if self.count == 0 else ",\n") + json.dumps(record, indent=2, ensure_ascii=False))
        self.count += 1

    def finish(self) -> None:
        if not self.jsonl:
            self.f.write("\n]\n")


@contextlib.contextmanager
def open_results(path: PathLike, compact: bool = False) -> Iterator[ResultsWriter]:
    """A :class:`ResultsWriter` whose file appears only when the block completes."""
    with _atomic_text(path) as f:
        writer = ResultsWriter(f, is_jsonl(path), compact)
        yield writer
        writer.finish()


def check_run_tag(tag: str) -> None:
    if not tag or any(c.isspace() for c in tag):
        raise DprGcError(f"--run-tag must be one word without spaces, got {tag!r}")


class TrecWriter:
    """Append one question's ranking at a time to a TREC run; query ids must be unique one-word strings."""

    def __init__(self, f: IO[str], tag: str) -> None:
        check_run_tag(tag)
        self.f, self.tag, self.seen = f, tag, set()

    def write(self, record: dict) -> None:
        qid = str(record["id"])
        if not qid or any(c.isspace() for c in qid) or qid in self.seen:
            problem = "appears twice" if qid in self.seen else "is empty or contains whitespace"
            raise DprGcError(f"query id {qid!r} {problem}; a TREC run needs unique one-word query ids")
        self.seen.add(qid)
        for rank, ctx in enumerate(record["ctxs"], start=1):
            docid = str(ctx["id"])
            if not docid or any(c.isspace() for c in docid):
                raise DprGcError(f"passage id {docid!r} is empty or has whitespace; a TREC run cannot hold it")
            self.f.write(f"{qid} Q0 {docid} {rank} {float(ctx['score'])!r} {self.tag}\n")


@contextlib.contextmanager
def open_trec_run(path: PathLike, tag: str = "dpr-gc") -> Iterator[TrecWriter]:
    """A :class:`TrecWriter` whose file appears only when the block completes."""
    check_run_tag(tag)
    with _atomic_text(path) as f:
        yield TrecWriter(f, tag)


def iter_results(path: PathLike) -> Iterator[dict]:
    """Stream the question records of a results file (JSON list or JSONL, DPR or compact form)."""
    from ..base.streams import iter_json_list, sniff_json

    p = require_file(path, "results file")
    if is_jsonl(p):
        if sniff_json(p) == "list":
            gz = ".gz" if p.name.endswith(".gz") else ""
            raise DprGcError(f"{p} holds a JSON list, not one question a line; name it "
                             f"{p.name.removesuffix(gz).removesuffix('.jsonl')}.json{gz}")
        for _, record in iter_jsonl(p):
            yield record
        return
    kind = sniff_json(p)
    if kind == "empty":  # no questions, as an empty .jsonl holds none: the caller says so
        return
    if kind == "lines":
        raise DprGcError(f"{p}:1: invalid JSON results: expected a JSON list of questions with 'answers' and "
                         "'ctxs' (or one per line in a file named .jsonl)")
    with open_text(p) as f:
        for _, record in iter_json_list(f, p):
            yield record


def check_question(entry: Any, i: int, source: str) -> dict[str, Any]:
    """Return result ``i`` after checking it has the shape of a DPR result."""
    where = f"{source}: question {i}"
    if not isinstance(entry, dict) or not isinstance(entry.get("ctxs"), list):
        raise DprGcError(f"{where}: expected an object with a 'ctxs' list")
    if not all(isinstance(c, dict) for c in entry["ctxs"]):
        raise DprGcError(f"{where}: every entry of 'ctxs' must be an object")
    if "id" in entry:
        check_id(entry["id"], where, "question id")
    question = entry.get("question", "x")
    if not isinstance(question, str) or not question.strip() or not no_lone_surrogates(question):
        raise DprGcError(f"{where}: 'question' must be a non-empty string, got {ascii(question)[:60]}")
    for j, ctx in enumerate(entry["ctxs"]):
        _check_ctx(ctx, f"{where}, ctx {j}")
    return entry


def _check_ctx(ctx: dict, where: str) -> None:
    """A ranked passage: an id that is a real id, a finite score, a boolean has_answer."""
    if "id" in ctx:
        check_id(ctx["id"], where, "passage id")
    if "has_answer" in ctx and not isinstance(ctx["has_answer"], bool):
        raise DprGcError(f"{where}: has_answer must be true or false, got {ascii(ctx['has_answer'])[:40]}")
    if "score" in ctx:
        ctx_score(ctx["score"], where)


def ctx_score(value: Any, where: str) -> float:
    """A ranked passage's score as a float: a finite number, or a string of one (as DPR writes); anything else (an
    integer too large for a float included) is refused naming ``where``."""
    try:
        score = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        score = math.nan
    if not math.isfinite(score):
        raise DprGcError(f"{where}: score {ascii(value)[:40]} is not a finite number")
    return score


def passage_key(ctx: dict) -> Optional[str]:
    """The id answer matching caches a passage under (None: no id, cache by text)."""
    return None if ctx.get("id") is None else str(ctx["id"])
