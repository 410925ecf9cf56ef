"""Streaming parsers for user files, with line numbers: a TSV read one row per line (CSV-quoted fields unquoted, a
stray quote read literally and logged, never joined with the next line) and a top-level JSON list read record by
record (any record size up to ``MAX_RECORD_CHARS``, nothing allowed after the closing ``]``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from .errors import DprGcError
from .files import JSON_ERRORS, PathLike, check_unicode, json_problem, line_at, open_text

logger = logging.getLogger(__name__)

LOGGED_LITERALS = 5
CHUNK_CHARS = 1 << 20
MAX_RECORD_CHARS = 1 << 30
_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclasses.dataclass
class TsvCounts:
    """What a TSV read saw, to reconcile the rows read with the lines in the file."""

    lines: int = 0
    blank: int = 0
    header: int = 0
    rows: int = 0
    literal: int = 0
    first_literal: int = 0
    last_literal: int = 0


def _unquote(field: str) -> Optional[str]:
    """The value of a CSV-quoted field (``"a ""b"" c"`` is ``a "b" c``), or None if it is not one quoted field."""
    if len(field) >= 2 and field[-1] == '"':
        inner = field[1:-1]
        if '"' not in inner.replace('""', ""):
            return inner.replace('""', '"')
    return None


def iter_tsv_lines(path: Path, counts: TsvCounts) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(line_number, fields)`` for each non-blank line of a TSV file, one physical line per row.

    Fields that are CSV-quoted on their own are unquoted; a field that begins with ``"`` but is not (its quote
    would run across a tab or line break) is kept literally and logged, so no line can swallow the next ones.
    """
    with open_text(path, newline="\n") as f:
        _refuse_cr_only(f, path)
        for line in f:
            counts.lines += 1
            line = line[:-1] if line.endswith("\n") else line
            line = line[:-1] if line.endswith("\r") else line
            if "\r" in line:  # as csv and pandas read it, a line break: rows glued together, fields miscounted
                raise DprGcError(f"{path}:{counts.lines}: the line holds a carriage return (CR) before its end, as "
                                 "lines ending in CR only do (mixed with LF ones); convert the file to LF or CRLF "
                                 "line endings, e.g. tr '\\r' '\\n'")
            if not line.strip():
                counts.blank += 1
                continue
            fields = line.split("\t")
            if '"' in line:
                fields = [_field(path, counts, value, i) for i, value in enumerate(fields)]
            yield counts.lines, fields


def _refuse_cr_only(f: Any, path: Path) -> None:
    """Refuse a file whose lines end in a lone carriage return (classic Mac OS): read by line feeds it would be one
    line, so every row but the first would vanish. Only the first ``CHUNK_CHARS`` are looked at."""
    head = f.read(CHUNK_CHARS)
    f.seek(0)
    if "\n" not in head and "\r" in head.rstrip("\r"):
        raise DprGcError(f"{path}: lines end in a carriage return only (CR, classic Mac OS line endings), so the "
                         "file reads as one line; convert it to LF or CRLF line endings, e.g. tr '\\r' '\\n'")


def _field(path: Path, counts: TsvCounts, value: str, column: int) -> str:
    if not value.startswith('"'):
        return value
    unquoted = _unquote(value)
    if unquoted is not None:
        return unquoted
    counts.literal += 1
    counts.first_literal = counts.first_literal or counts.lines
    counts.last_literal = counts.lines
    if counts.literal <= LOGGED_LITERALS:
        logger.warning("%s:%d: field %d begins with '\"' but is not a closed CSV-quoted field (a quoted field "
                       "cannot run across a tab or line break); read literally", path, counts.lines, column + 1)
    return value


def log_tsv_counts(path: Path, counts: TsvCounts, what: str) -> None:
    """Reconcile rows with lines and say what was read; a literal read of quote-like fields is summarised."""
    if counts.rows + counts.header + counts.blank != counts.lines:
        raise DprGcError(f"{path}: read {counts.rows} {what} from {counts.lines} lines ({counts.header} header, "
                         f"{counts.blank} blank) and they do not add up; please report this file")
    logger.info("%s: %d %s from %d lines (%d header, %d blank)", path, counts.rows, what, counts.lines,
                counts.header, counts.blank)
    if counts.literal:
        logger.warning("%s: %d field(s) begin with '\"' without being closed CSV-quoted fields (first at line %d); "
                       "they were read literally, one row per line", path, counts.literal, counts.first_literal)


def sniff_json(path: PathLike) -> str:
    """``"list"`` when a JSON file (optionally .gz) holds a top-level list (its first non-blank character in the first
    ``CHUNK_CHARS`` is ``[``), ``"empty"`` when that stretch is blank, else ``"lines"`` (JSONL)."""
    with open_text(path) as f:
        head = f.read(CHUNK_CHARS).lstrip()
    return "list" if head.startswith("[") else "lines" if head else "empty"


def opens_object(line: str) -> bool:
    """Whether a first line that is no JSON opens one JSON object pretty-printed over several lines (``{`` alone)."""
    return line.strip() == "{"


def not_jsonl(path: PathLike) -> Optional[str]:
    """What a file read as one JSON object a line holds instead: ``"a JSON list"`` (a first non-blank line that is
    a whole list, or incomplete JSON opening one, see :func:`sniff_json`), ``"one JSON object spread over several
    lines"`` (:func:`opens_object`), else None (a line that parses to another value, or fails otherwise, is left to
    the reader to judge)."""
    with open_text(path) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return "a JSON list" if isinstance(json.loads(first), list) else None  # a whole list on one line
    except json.JSONDecodeError:
        pass
    except JSON_ERRORS:  # nested too deeply, an integer too long: the reader names the line
        return None
    if sniff_json(path) == "list":
        return "a JSON list"
    return "one JSON object spread over several lines" if opens_object(first) else None


def iter_json_list(f: IO[str], path: Path, text_only: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, object)`` for each item of a top-level JSON list, reading ``CHUNK_CHARS`` at a time
    (``text_only``: an item holding a lone surrogate is refused naming its line).

    A record may be up to ``MAX_RECORD_CHARS`` (1,024 MiB) long: when one does not parse yet, the buffer grows by
    doubling reads, so a huge record costs linear time. Anything but whitespace after the closing ``]`` is refused.
    """
    decode = json.JSONDecoder().raw_decode
    buf, pos, line, eof, want, state = "", 0, 1, False, 0, "start"  # state: start | first | item | sep | end
    while True:
        end = _WHITESPACE.match(buf, pos).end()
        line, pos = line + buf.count("\n", pos, end), end
        if pos == len(buf) or want:
            if eof:
                if state == "end":
                    return
                raise DprGcError(f"{path}:{line}: file ends inside the JSON list; is it truncated?")
            chunk = f.read(max(CHUNK_CHARS, want))
            buf, pos, eof, want = buf[pos:] + chunk, 0, not chunk, 0
            continue
        ch = buf[pos]
        if state == "end":
            raise DprGcError(f"{path}:{line}: unexpected text after the end of the JSON list; remove it")
        if state == "start":
            if ch != "[":
                raise DprGcError(f"{path}:{line}: expected a JSON list of records or one JSON record per line")
            pos, state = pos + 1, "first"
        elif state == "sep" or (state == "first" and ch == "]"):
            if ch == "]":
                pos, state = pos + 1, "end"
                continue
            if ch != ",":
                raise DprGcError(f"{path}:{line}: invalid JSON (expected ',' or ']'); fix the file")
            pos, state = pos + 1, "item"
        else:
            try:
                obj, end = decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof or _surely_invalid(e, len(buf)) or len(buf) - pos > MAX_RECORD_CHARS:
                    raise DprGcError(_json_list_error(path, line + buf.count("\n", pos, e.pos), e.msg,
                                                      len(buf) - pos > MAX_RECORD_CHARS)) from None
                want = 2 * (len(buf) - pos)  # the record may just continue in the next chunk
                continue
            except JSON_ERRORS as e:  # nesting too deep, an integer too long: more text cannot cure either
                problem, at = json_problem(e, buf, pos)
                advice = "flatten that record" if isinstance(e, RecursionError) else "fix the file"
                raise DprGcError(f"{path}:{line_at(buf, at, pos, line)}: {problem}; {advice}") from None
            if end == len(buf) and not eof:  # so may a number or literal
                want = 2 * (len(buf) - pos)
                continue
            yield line, check_unicode(obj, f"{path}:{line}", buf[pos:end]) if text_only else obj
            line, pos, state = line + buf.count("\n", pos, end), end, "sep"


def _surely_invalid(error: json.JSONDecodeError, size: int) -> bool:
    """A syntax error well before the end of the buffer cannot be cured by reading more (a string may still be)."""
    return error.pos < size - 64 and not error.msg.startswith("Unterminated string")


def _json_list_error(path: Path, line: int, msg: str, too_long: bool) -> str:
    limit = f"; or a record is longer than the {MAX_RECORD_CHARS >> 20} MiB limit per record" if too_long else ""
    return (f"{path}:{line}: invalid JSON ({msg}){limit}; fix the file (broken syntax in a JSON list cannot be "
            "skipped)")
