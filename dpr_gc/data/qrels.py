"""Relevance judgments (qrels): the one reader of BEIR TSV and TREC qrels files, for training sets, mining and
evaluation alike.

BEIR writes ``query-id<TAB>corpus-id<TAB>score`` under a header line, TREC ``qid 0 docid rel`` separated by
whitespace, in any mix of tabs and spaces as trec_eval splits (:func:`_fields` tells them apart line by line; trailing
whitespace is dropped). Ids are one word: an id with whitespace inside is refused naming the line. Relevance is an
integer (``1`` or ``1.0``).
"""

from __future__ import annotations

import re
from typing import Iterator, Optional, Union

from ..base.errors import DprGcError, clipped
from ..base.validate import check_id
from ..base.files import PathLike, open_text

Judgment = tuple[str, str, int]  # (query id, passage id, relevance)
RELEVANCE_MAX = 2 ** 31 - 1  # a C int, as trec_eval and pytrec_eval read relevance
QRELS_FORMATS = "expected 'query-id corpus-id score' or 'qid 0 docid rel'"


def _fields(line: str) -> list[str]:
    """The line's fields: its whitespace-separated ones (TREC, as trec_eval splits) when those are its tab-separated
    ones or four words (``qid iter docid rel`` in any mix of tabs and spaces), else its tab-separated ones (BEIR TSV),
    so that a tab field with whitespace inside is kept whole and its id refused. Three tab fields whose middle one
    holds whitespace (``q1<TAB>d 1<TAB>1``) are BEIR's, a corpus id with a space. Trailing whitespace is dropped."""
    line = line.strip()
    words = line.split()
    tabbed = [f.strip() for f in line.split("\t")]
    spaced_corpus_id = len(tabbed) == 3 and any(c.isspace() for c in tabbed[1])
    if "\t" not in line or tabbed == words or (len(words) == 4 and not spaced_corpus_id):
        return words
    return tabbed


def iter_qrels(path: PathLike) -> Iterator[tuple[int, Union[Judgment, str]]]:
    """``(line number, (query id, passage id, relevance))`` for each judgment in file order, or ``(line number,
    what is wrong)`` for a line that is not one, so a caller decides whether a bad line stops it. Blank lines and
    a header (the first non-blank line) are skipped; the header repeated later (two files joined) is a bad line."""
    first = 0  # the first non-blank line's number
    with open_text(path, what="qrels file") as f:
        for line_no, line in enumerate(f, start=1):
            parts = _fields(line)
            if not parts:
                continue
            first = first or line_no
            if parts[0].lower() in ("query-id", "query_id") or parts[-1].lower() == "score":
                if line_no != first:
                    yield line_no, f"line {line_no} repeats the header (files joined?); remove it"
                continue
            if len(parts) not in (3, 4) or not all(parts):
                yield line_no, f"{QRELS_FORMATS}, got {clipped(line.strip())}{another_file(line)}"
                continue
            qid, docid, rel_text = parts[0], parts[-2], parts[-1]
            spaced = [f"{what} {clipped(name)}" for what, name in (("query id", qid), ("document id", docid))
                      if any(c.isspace() for c in name)]
            if spaced:
                yield line_no, (f"{spaced[0]} contains whitespace; ids are one word (passage ids never hold "
                                "whitespace and TREC files separate fields by it), so it could never match; fix the id")
                continue
            rel = relevance(rel_text)
            if isinstance(rel, str) and line_no == first:  # most likely a header of other words (qid docid rel)
                rel += (f" (line {line_no} is read as a judgment: a header is BEIR's 'query-id<TAB>corpus-id<TAB>"
                        "score'; rename its columns so, or remove it)")
            yield line_no, (qid, docid, rel) if isinstance(rel, int) else rel


def another_file(line: str) -> str:
    """What a line that is no qrels line looks like when it is a line of another file the commands take (a results
    JSON, a TREC run), as ``; the line looks like ...``; '' otherwise."""
    text, words = line.strip(), line.split()
    if text[:1] in "[{":
        kind = "a results JSON" if '"ctxs"' in text or '"question"' in text else "JSON"
        return f"; the line looks like {kind}, not qrels"
    if len(words) == 6 and words[1] == "Q0":
        return "; the line looks like a TREC run (qid Q0 docid rank score tag), not qrels"
    return ""


def relevance(text: str) -> Union[int, str]:
    """The relevance a qrels field holds (``1`` or ``1.0``), or what is wrong with it: not an integer, or outside
    the 32-bit range trec_eval and pytrec_eval keep (a larger one also overflows nDCG's float sums)."""
    shown = repr(text) if len(text) <= 24 else f"{text[:12]!r}... ({len(text)} characters)"
    if not re.fullmatch(r"[-+]?\d+(\.0*)?", text):
        return f"relevance {shown} is not an integer"
    digits = text.split(".")[0]
    if len(digits.lstrip("+-").lstrip("0")) > len(str(RELEVANCE_MAX)) or not (
            -RELEVANCE_MAX - 1 <= int(digits) <= RELEVANCE_MAX):
        return f"relevance {shown} out of range; trec_eval takes {-RELEVANCE_MAX - 1} to {RELEVANCE_MAX}"
    return int(digits)


def read_qrels(path: PathLike) -> dict[str, dict[str, int]]:
    """All judgments of a qrels file (BEIR's ``qrels/*.tsv`` or TREC's, see above) as ``{query id: {passage id:
    relevance}}``; a bad line, a judgment given twice with different relevance, or an empty file is an error naming
    the file (and line)."""
    qrels: dict[str, dict[str, int]] = {}
    seen: dict[tuple[str, str], int] = {}
    for line_no, judgment in iter_qrels(path):
        problem = judgment if isinstance(judgment, str) else qrels_line_problem(judgment, f"{path}:{line_no}", seen)
        if problem:
            raise DprGcError(f"{path}:{line_no}: {problem}")
        qid, docid, rel = judgment
        qrels.setdefault(qid, {})[docid] = rel
    if not qrels:
        raise no_judgments(path)
    return qrels


def no_judgments(path: PathLike) -> DprGcError:
    """The error of a qrels file without a judgment (empty, or a header alone), in the words every reader uses."""
    return DprGcError(f"{path}: no relevance judgments found; a qrels file holds one judgment a line, "
                      "'query-id<TAB>corpus-id<TAB>score' after BEIR's header or TREC's 'qid 0 docid relevance'")


def qrels_line_problem(judgment: Judgment, where: str, seen: dict[tuple[str, str], int]) -> Optional[str]:
    """What is wrong with a judgment read at ``where`` (an id that could look like another, see
    :func:`~dpr_gc.base.validate.check_id`; a pair ``seen`` earlier with another relevance), else None, ``seen``
    then recording it: every reader of qrels refuses the same lines."""
    qid, docid, rel = judgment
    try:
        check_id(qid, where, "query id"), check_id(docid, where, "document id")
    except DprGcError as e:
        return str(e).removeprefix(f"{where}: ")
    if seen.setdefault((qid, docid), rel) != rel:
        return f"conflicting relevance for query {clipped(qid)} doc {clipped(docid)}"
    return None
