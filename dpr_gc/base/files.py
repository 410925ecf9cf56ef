"""Small file helpers shared by every stage: gzip-aware reading, JSONL with line numbers, atomic writes.

Every reader goes through :func:`open_text`, so a UTF-8 byte-order mark is skipped everywhere, and invalid UTF-8,
a truncated or fake ``.gz`` and other read failures become one-line :class:`DprGcError` messages that name the file
(and, for bad bytes, the line) instead of tracebacks.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import logging
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from .errors import DiskFullError, DprGcError, is_disk_full, setting_text

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
READ_ERRORS = (UnicodeDecodeError, EOFError, OSError, zlib.error)
DECODE_CHUNK = 1 << 20


def require_file(path: PathLike, what: str = "file") -> Path:
    """Return ``path`` as a Path, or raise a one-line error naming it as ``what`` if it is no file; a command names
    its flag (``--queries file not found: X``), a library call what the file is."""
    p = Path(path)
    if p.is_dir():
        inside = beir_file_inside(p, what)
        if inside:
            flag = what.split()[0] + " " if what.startswith("--") else ""
            raise DprGcError(f"{what} {p} is a BEIR folder, not a file; give the file inside it: {flag}{inside}")
        raise DprGcError(f"{what} {p} is a folder, not a file (check the path)")
    if p.exists() and not p.is_file():
        raise DprGcError(f"{what} {p} is a pipe or device, which is read more than once here; save it to a file "
                         "(on the command line dpr-gc copies such an input first)")
    if not p.is_file():
        raise DprGcError(f"{what} not found: {p} (check the path)")
    return p


def beir_file_inside(folder: Path, what: str) -> Optional[str]:
    """The file(s) of the BEIR folder ``folder`` (``corpus.jsonl``, ``queries.jsonl`` or ``qrels/`` inside) that
    ``what`` ("--qrels file", "corpus file") reads, joined by "or": a command given the folder for a file says
    which to give; None when ``folder`` is no BEIR folder or ``what`` none of its files."""
    kind = next((k for k in ("corpus", "queries", "qrels") if k in what), None)
    plain = ("corpus.jsonl", "corpus.jsonl.gz", "queries.jsonl", "queries.jsonl.gz")
    if kind is None or not ((folder / "qrels").is_dir() or any((folder / n).is_file() for n in plain)):
        return None
    if kind == "qrels":
        found = sorted(f for f in (folder / "qrels").glob("*.tsv*") if f.name.endswith((".tsv", ".tsv.gz")))
    else:
        found = [folder / f"{kind}.jsonl", folder / f"{kind}.jsonl.gz"]
    return " or ".join(str(f) for f in found if f.is_file() and not f.name.startswith(".")) or None


def require_folder(path: PathLike, what: str = "folder", advice: str = "check the path") -> Path:
    """Return ``path`` as a Path, or raise a one-line error naming it as ``what`` (a command names its flag:
    ``--embeddings folder``) if nothing is there, worded as :func:`require_file` words a missing file; a file there
    is left to the caller, which knows what folder to ask for."""
    p = Path(path)
    if not p.is_dir() and not p.is_file():
        raise DprGcError(f"{what} not found: {p} ({advice})")
    return p


def is_stream(path: PathLike) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a folder: a pipe (``<(...)``), ``/dev/stdin``,
    ``/dev/null`` or another device, which can be read only once."""
    p = Path(path)
    return p.exists() and not p.is_file() and not p.is_dir()


def endless_device(path: Path) -> bool:
    """Whether ``path`` is a character device other than ``/dev/null`` and a terminal (``/dev/zero``,
    ``/dev/urandom``): copied to its end, it would fill the disk."""
    if not stat.S_ISCHR(os.stat(path).st_mode) or os.path.realpath(path) == os.devnull:
        return False
    with open(path, "rb", buffering=0) as f:
        return not os.isatty(f.fileno())


SPOOL_PREFIX = "dpr-gc-input-"  # the temporary folder of :func:`spooled`'s copies


@contextlib.contextmanager
def spooled(paths: Iterable[Path]) -> Iterator[dict[Path, Path]]:
    """Copy each stream of ``paths`` (:func:`is_stream`) into a temporary folder under its own name, so readers that
    read a file twice (format sniffing, a checking pass, fingerprints) can take it; yields ``{stream: copy}`` and
    deletes the copies after the block. Each copy's folder records the stream it came from
    (:func:`copied_from`), so what a stage records names the input given, not a copy deleted when it ends."""
    import shutil

    streams = list(dict.fromkeys(p for p in paths if is_stream(p)))
    for stream in streams:
        if endless_device(stream):
            raise DprGcError(f"{stream} is a device that never ends (such as /dev/zero); give a file, a pipe or "
                             "/dev/null")
    if not streams:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix=SPOOL_PREFIX) as folder:
        copies = {}
        for i, stream in enumerate(streams):
            copies[stream] = Path(folder) / str(i) / stream.name
            copies[stream].parent.mkdir()
            (Path(folder) / f"{i}.source").write_bytes(os.fsencode(stream))
            try:
                with open(stream, "rb") as src, open(copies[stream], "wb") as dst:
                    shutil.copyfileobj(src, dst, DECODE_CHUNK)
            except OSError as e:
                raise read_failure(stream, e) from None
        yield copies


def copied_from(path: Any) -> Optional[str]:
    """The pipe or device (as given) that ``path`` is :func:`spooled`'s temporary copy of, None for any other path:
    a record names the input the user gave (``/dev/fd/63``), never a copy deleted when the command ends."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        return None
    copy = Path(path)
    source = copy.parent.parent / f"{copy.parent.name}.source"
    if not copy.parent.parent.name.startswith(SPOOL_PREFIX) or not source.is_file():
        return None
    given = os.fsdecode(source.read_bytes())
    return given if Path(given).name == copy.name else None


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def bad_utf8_line(path: Path) -> Optional[int]:
    """The line number of the first invalid UTF-8 byte of ``path`` (decompressed), or None if it decodes."""
    import codecs

    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    try:
        with _open_binary(path) as f:
            while True:
                chunk = f.read(DECODE_CHUNK)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    return line + chunk.count(b"\n", 0, max(e.start, 0))
                if not chunk:
                    return None
                line += chunk.count(b"\n")
    except READ_ERRORS:
        return None


def misnamed_gzip(path: Path) -> Optional[str]:
    """What is wrong with ``path`` when it is a regular file that starts with gzip's magic bytes (1f 8b) though its
    name lacks ``.gz`` (so it would be read as text, and fail as bad UTF-8 or bad records), with the rename to make;
    None otherwise."""
    if path.name.endswith(".gz"):
        return None
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            if f.read(2) != b"\x1f\x8b":
                return None
    except OSError:
        return None
    return f"{path} is gzipped, though its name does not end in .gz; rename it {path.name}.gz"


def read_failure(path: Path, error: BaseException) -> DprGcError:
    """Turn an exception raised while reading ``path`` into a one-line error naming the file."""
    misnamed = misnamed_gzip(path) if isinstance(error, UnicodeDecodeError) else None
    if misnamed:
        return DprGcError(misnamed)
    if isinstance(error, UnicodeDecodeError):
        line = bad_utf8_line(path)
        where = f"{path}:{line}" if line is not None else str(path)
        return DprGcError(f"{where}: not valid UTF-8 ({error.reason}); save the file as UTF-8")
    if isinstance(error, (EOFError, zlib.error, gzip.BadGzipFile)) or (
            isinstance(error, OSError) and path.suffix == ".gz" and "gzip" in str(error).lower()):
        return DprGcError(f"{path}: not a complete gzip file ({str(error) or type(error).__name__}); "
                          "download or compress it again")
    if isinstance(error, OSError):
        return DprGcError(f"{path}: cannot read ({error.strerror or error})")
    return DprGcError(f"{path}: cannot read ({error})")


class TextReader:
    """A read-only text stream whose read failures are :class:`DprGcError` messages naming the file."""

    def __init__(self, path: Path, newline: Optional[str] = None) -> None:
        self.path = path
        try:
            if path.suffix == ".gz":
                self._f: IO[str] = gzip.open(path, "rt", encoding="utf-8-sig", newline=newline)
            else:
                self._f = open(path, encoding="utf-8-sig", newline=newline)
        except READ_ERRORS as e:
            raise read_failure(path, e) from None

    def __enter__(self) -> "TextReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(*READ_ERRORS):
            self._f.close()

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._f
        except READ_ERRORS as e:
            raise read_failure(self.path, e) from None

    def _guarded(self, method: Callable[..., Any], *args: Any) -> Any:
        """Call a method of the open file, a read failure turned into one error naming the file."""
        try:
            return method(*args)
        except READ_ERRORS as e:
            raise read_failure(self.path, e) from None

    def read(self, size: int = -1) -> str:
        return self._guarded(self._f.read, size)

    def seek(self, offset: int) -> int:
        return self._guarded(self._f.seek, offset)

    def readline(self, size: int = -1) -> str:
        return self._guarded(self._f.readline, size)


def open_text(path: PathLike, newline: Optional[str] = None, what: str = "file") -> TextReader:
    """Open a UTF-8 text file for reading (``.gz`` decompressed, a byte-order mark skipped), failing in one line
    that names it as ``what`` ("run file") where it is missing or a folder."""
    return TextReader(require_file(path, what), newline)


# What ``json.loads`` raises on text it cannot read: a JSONDecodeError, the ValueError of an integer longer than
# Python converts (4,300 digits), a RecursionError for nesting deeper than Python's stack.
JSON_ERRORS = (ValueError, RecursionError)
MAX_INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
_LONG_INTEGER = re.compile(r"\d{%d,}" % (MAX_INT_DIGITS + 1)) if MAX_INT_DIGITS else None


def json_problem(error: BaseException, text: str, start: int = 0) -> tuple[str, int]:
    """What is wrong with the JSON ``text`` (parsed from offset ``start``) that raised ``error`` (one of
    :data:`JSON_ERRORS`), and the offset it is at: every JSON reader words the same failure the same way."""
    if isinstance(error, json.JSONDecodeError):
        return f"invalid JSON ({error.msg})", error.pos
    if isinstance(error, RecursionError):
        return "JSON nested too deeply to read", start
    long_integer = _LONG_INTEGER.search(text, start) if _LONG_INTEGER else None
    if long_integer is not None:
        return (f"invalid JSON (an integer of {long_integer.end() - long_integer.start()} digits, longer than the "
                f"{MAX_INT_DIGITS} digits Python reads; write it as a string)", long_integer.start())
    return f"invalid JSON ({str(error).splitlines()[0] if str(error) else type(error).__name__})", start


def line_at(text: str, offset: int, start: int = 0, first: int = 1) -> int:
    """The line number of ``offset`` in ``text``, counting from line ``first`` at offset ``start``."""
    return first + text.count("\n", start, offset)


def parse_json(text: str, where: str) -> Any:
    """``json.loads`` whose failures (bad syntax, an integer too long for Python, nesting too deep) name ``where``."""
    try:
        return json.loads(text)
    except JSON_ERRORS as e:
        problem, _ = json_problem(e, text)
        advice = "flatten that record" if isinstance(e, RecursionError) else "fix or remove that line"
        raise DprGcError(f"{where}: {problem}; {advice}") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(obj: Any, raw: Optional[str] = None) -> Optional[str]:
    """What is wrong if the parsed JSON ``obj`` holds a lone surrogate (``"\\ud800"``: half of a UTF-16 pair, no
    character, and no UTF-8 output can hold it), else None. With ``raw`` (the JSON text ``obj`` came from) text
    without a surrogate escape is passed without a look at ``obj``."""
    if raw is not None and not _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        around = e.object[max(e.start - 30, 0):e.end + 30]
        return (f"holds a lone surrogate {ascii(e.object[e.start:e.end])} (half of a UTF-16 pair, not a character) "
                f"near {ascii(around)}; fix or remove that escape")
    return None


def check_unicode(obj: Any, where: str, raw: Optional[str] = None) -> Any:
    """``obj``, refused in one line naming ``where`` if it holds a lone surrogate (see :func:`lone_surrogate`)."""
    problem = lone_surrogate(obj, raw)
    if problem:
        raise DprGcError(f"{where}: {problem}")
    return obj


def iter_jsonl(path: PathLike, text_only: bool = False) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` for each non-empty line; a bad line raises naming file and line
    (``text_only``: also a line holding a lone surrogate, for inputs whose text is tokenised or written out)."""
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                obj = parse_json(line, f"{path}:{line_no}")
                yield line_no, check_unicode(obj, f"{path}:{line_no}", line) if text_only else obj


def iter_jsonl_objects(path: PathLike, what: str = "record") -> Iterator[tuple[int, dict]]:
    """Like :func:`iter_jsonl`, but every line must hold a JSON object without lone surrogates."""
    for line_no, obj in iter_jsonl(path, text_only=True):
        if not isinstance(obj, dict):
            raise DprGcError(f"{path}:{line_no}: expected a JSON object ({what}), got {type(obj).__name__}")
        yield line_no, obj


def _given_path(path: PathLike, flag: str, what: str) -> Path:
    """``path`` as a Path; an empty one is refused (``Path("")`` would be the working folder, written into or
    replaced whole)."""
    if not os.fspath(path).strip():
        raise DprGcError(f"{flag} is empty; give {what}")
    return Path(path)


NAME_MAX, PATH_MAX = 255, 4095  # bytes in one name and in a whole path that Linux and macOS file systems take
# The most bytes a writer adds to an output's name for a file it keeps beside it: the temporary file of retrieve's
# progress record, "..NAME.retrieved.progress.json.XXXXXXXX.tmp" (a lock ".NAME.lock", a temporary ".NAME.*.tmp" or
# ".NAME.*.new", a partial ".NAME.retrieved.partial" add fewer).
BESIDE_BYTES = len("..") + len(".retrieved.progress.json") + len(".XXXXXXXX.tmp")


def beside(path: PathLike, suffix: str) -> Path:
    """The hidden file ``.NAME<suffix>`` a writer keeps beside output ``path`` (NAME its name): its lock, partial
    file, progress record and temporaries are all named so, which is how :func:`written_beside` knows them."""
    return Path(path).with_name(f".{Path(path).name}{suffix}")


def written_beside(candidate: PathLike, output: PathLike) -> bool:
    """Whether ``candidate`` (what it resolves to) is a name a run writing ``output`` keeps beside it (or beside
    the file a link ``output`` points to): ``.NAME.*`` (:func:`beside`), or ``..NAME.*``, a temporary of one."""
    real = os.path.realpath(candidate)
    folder, name = os.path.dirname(real), os.path.basename(real)
    out = Path(output)
    for place in (os.path.join(os.path.realpath(out.parent), out.name), os.path.realpath(out)):
        out_folder, out_name = os.path.split(place)
        if folder == out_folder and name.startswith((f".{out_name}.", f"..{out_name}.")):
            return True
    return False


def check_path_length(path: PathLike, flag: str, beside: int = 0) -> None:
    """Refuse a path no file system can hold (a name over :data:`NAME_MAX` bytes, or a whole path over
    :data:`PATH_MAX`) naming ``flag``: looking at it would otherwise fail with "File name too long" anywhere.
    ``beside``: the bytes a writer adds to the last name for the files it keeps beside it (:data:`BESIDE_BYTES` for
    an output given on the command line), so that such a name is refused before any work, not when they are made."""
    parts = Path(path).parts
    longest = max(parts, key=lambda part: len(os.fsencode(part)), default="")
    if len(os.fsencode(longest)) > NAME_MAX:
        raise DprGcError(f"{flag} {path}: file name too long ({len(os.fsencode(longest))} bytes in "
                         f"{longest[:20]!r}..., file systems take at most {NAME_MAX}); give a shorter name")
    name = len(os.fsencode(parts[-1])) if parts else 0
    if beside and name > NAME_MAX - beside:
        raise DprGcError(f"{flag} {path}: file name too long ({name} bytes; an output's name may take at most "
                         f"{NAME_MAX - beside}, as the lock and temporary files beside it add {beside} to it and file "
                         f"systems take {NAME_MAX}); give a shorter name")
    if len(os.fsencode(path)) + beside > PATH_MAX:
        raise DprGcError(f"{flag} {str(path)[:40]}...: file name too long ({len(os.fsencode(path))} bytes, file "
                         f"systems take at most {PATH_MAX}{f' with the {beside} added beside it' if beside else ''}); "
                         "give a shorter path")


def output_target(path: PathLike, flag: str = "--output") -> Path:
    """Where an output given as ``path`` is written: through a symbolic link to its target (the link stays a link),
    and never over a device, pipe or socket: outputs are written to a new file or folder and renamed into place,
    which would put a regular file where ``/dev/null`` or a FIFO was."""
    check_path_length(path, flag)
    given = Path(path)
    p = Path(os.path.realpath(given)) if given.is_symlink() else given
    if p.is_symlink():
        raise DprGcError(f"{flag} {given} is a loop of symbolic links; give a file or folder path")
    if p != given and not p.parent.is_dir():
        raise DprGcError(f"{flag} {given} is a symbolic link into {p.parent}, which is not a folder; give a file or "
                         "folder path")
    if p.exists() and not (p.is_file() or p.is_dir()):
        raise DprGcError(f"{flag} {given} is a device, pipe or socket, not a file; give the path of a file or folder "
                         "(outputs are written whole and renamed into place)")
    return p


def missing_folders(folder: PathLike) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for p in (Path(folder), *Path(folder).parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    return missing


def remove_empty_folders(folders: Iterable[Path]) -> None:
    """Remove each of ``folders`` (deepest first) that is an empty folder: what a refused run created."""
    for folder in folders:
        with contextlib.suppress(OSError):
            if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
                folder.rmdir()


@contextlib.contextmanager
def folders_made(folder: PathLike) -> Iterator[Path]:
    """Create ``folder`` and its missing parents for the block; if the block fails, the folders made here that are
    still empty are removed again, so a run refused for bad input leaves no empty folder behind."""
    made = missing_folders(folder)
    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        yield Path(folder)
    except BaseException:
        remove_empty_folders(made)
        raise


def check_output_file(path: PathLike, flag: str = "--output") -> Path:
    """Refuse an output file path that is empty, an existing folder, or a device, pipe or socket (an existing file
    is replaced atomically; a symbolic link's target is); returns the path written (:func:`output_target`)."""
    p = output_target(_given_path(path, flag, "a file name"), flag)
    if p.is_dir():
        raise DprGcError(f"{flag} {p} is a folder; give a file name (an existing file is replaced)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DprGcError(f"{flag} {p}: {parent} is a file, not a folder")
            break
    return p


def check_output_dir(path: PathLike, flag: str = "--output") -> Path:
    """Refuse an output folder path that is empty or an existing file (or lies under one); returns the path
    written (:func:`output_target`)."""
    p = output_target(_given_path(path, flag, "a folder"), flag)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise DprGcError(f"{flag} {p}: {q} is a file, not a folder; give a folder")
            break
    return p


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it is renamed onto ``path`` only if the block succeeds.

    Readers therefore never see a half-written file under the final name. An existing file is replaced; a folder
    under that name is refused.
    """
    final = check_output_file(path, "output")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = temporary_beside(final)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    except Exception as e:
        if is_disk_full(e):
            raise DiskFullError(final) from None
        raise
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def temporary_beside(final: Path) -> Path:
    """A new empty hidden file ``.NAME.*.tmp`` beside ``final``, with the permissions a new file gets: the name
    :func:`remove_stale_temporaries` (run by a later run's output lock) deletes when the process that made it died."""
    fd, tmp = tempfile.mkstemp(prefix=beside(final, ".").name, suffix=".tmp", dir=final.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return Path(tmp)


@contextlib.contextmanager
def atomic_paths(*paths: PathLike) -> Iterator[list[Path]]:
    """Like :func:`atomic_path` for files that make one output, whose last is its record (a metrics JSON naming
    its plot): yield a temporary path beside each; when the block succeeds they replace ``paths`` together
    (:func:`replace_together`), otherwise none of ``paths`` changes."""
    finals = [check_output_file(p, "output") for p in paths]
    tmps: list[Path] = []
    try:
        for final in finals:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmps.append(temporary_beside(final))
        yield tmps
        replace_together(tmps, finals)
    except Exception as e:
        if is_disk_full(e):
            raise DiskFullError(" and ".join(map(str, finals))) from None
        raise
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def replace_together(news: list[Path], finals: list[Path]) -> None:
    """Rename each of ``news`` onto its ``finals`` (same folders) as one output whose last file is its record.

    The old record is withdrawn first (moved aside), then the other files are replaced and the record is put in
    last, so whenever a record is there the files beside it are its own; in between a reader finds the record
    missing. An error or interrupt on the way puts every old file back: the earlier output stays whole. A kill
    leaves at most hidden ``.NAME.*.tmp`` files, which the next run's output lock deletes. One file is simply
    renamed (atomic on its own).
    """
    if len(finals) == 1:
        os.replace(news[0], finals[0])
        return
    aside: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    try:
        for final in [finals[-1], *finals[:-1]]:
            if final.exists():
                aside.append((temporary_beside(final), final))
                os.replace(final, aside[-1][0])
        for new, final in zip(news, finals):
            os.replace(new, final)
            placed.append(final)
    except BaseException:
        for final in placed:
            final.unlink(missing_ok=True)
        for old, final in reversed(aside):
            if final.exists():  # not moved aside: its own rename failed
                old.unlink()
            else:
                os.replace(old, final)
        raise
    for old, _ in aside:
        old.unlink(missing_ok=True)


@contextlib.contextmanager
def gzip_text(path: Path, final: Path, mode: str = "w") -> Iterator[IO[str]]:
    """UTF-8 text written gzipped to ``path`` (``mode`` "w" or "a": a new gzip member), a temporary file that becomes
    ``final``: the header records ``final``'s name without ``.gz``, as ``gzip FILE`` does, never the temporary one
    (``gunzip -N`` and ``file`` show it)."""
    with open(path, mode + "b") as raw, gzip.GzipFile(filename=final.name, mode=mode + "b", fileobj=raw) as packed, \
            io.TextIOWrapper(packed, encoding="utf-8") as f:
        yield f


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a file for writing that appears under ``path`` only when closed without error."""
    with atomic_path(path) as tmp:
        encoding = None if "b" in mode else "utf-8"
        with open(tmp, mode, encoding=encoding) as f:
            yield f


def write_json(path: PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_open(path) as f:
        dump_json(obj, f)


def dump_json(obj: Any, f: IO[str]) -> None:
    """Write ``obj`` to the open text file ``f`` as :func:`write_json` lays it out (indented, UTF-8 as is)."""
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")


def read_json(path: PathLike) -> Any:
    """Read a JSON file, naming the file (and line) in the error if it is malformed."""
    with open_text(path) as f:
        return parse_json_file(f.read(), path)


def parse_json_file(text: str, path: PathLike) -> Any:
    """``json.loads`` of the whole of file ``path``'s ``text``; a failure names the file and the line it is at
    (:func:`parse_json` is for one record whose place the caller names)."""
    try:
        return json.loads(text)
    except JSON_ERRORS as e:
        problem, offset = json_problem(e, text)
        where = path if isinstance(e, RecursionError) else f"{path}:{line_at(text, offset)}"
        raise DprGcError(f"{where}: {problem}") from None


def read_json_object(path: PathLike, what: str = "JSON file") -> dict:
    """Read a JSON file that must hold an object (manifests, metadata, configs)."""
    return _read_json_of(path, dict, what)


def read_json_list(path: PathLike, what: str = "JSON file") -> list:
    """Read a JSON file that must hold a list (a sentence-transformers ``modules.json``)."""
    return _read_json_of(path, list, what)


def _read_json_of(path: PathLike, kind: type, what: str) -> Any:
    obj = read_json(path)
    if not isinstance(obj, kind):
        noun = "object" if kind is dict else "list"
        raise DprGcError(f"{path}: expected a JSON {noun} ({what}), got a {type(obj).__name__}; "
                         "the file is damaged or not one dpr-gc wrote")
    return obj


# ----------------------------------------------------------------------------------------- tensors, locks, temps
def torch_load_weights(path: PathLike) -> Any:
    """``torch.load(weights_only=True)`` on the CPU, without torch's warnings (e.g. on an old pickle protocol): the
    file is only ever read as plain data, and a refusal is one error line."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def weights_only_reason(error: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in a few words: the first sentence naming the unsupported
    global or operation, without torch's advice to allowlist it or to load with ``weights_only=False`` (which would
    run the file's code); a longer one is cut at a word, marked ``...``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = next((line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")), None)
    if named is None and lines and lines[0].startswith("Weights only load failed"):
        named = "not a file of plain tensors"
    named = re.sub(r"^WeightsUnpickler error: ", "", named or "").split(" was not an allowed global")[0]
    reason = re.split(r"(?<=\.)\s", named or (lines[0] if lines else type(error).__name__), maxsplit=1)[0].rstrip(".")
    return reason if len(reason) <= 200 else reason[:200].rsplit(" ", 1)[0] + "..."


def read_tensors(path: PathLike) -> dict:
    """Load a ``.safetensors`` file, or a torch file restricted to plain tensors (``weights_only=True``).

    Nothing is ever unpickled: a file that holds code or other objects is refused with a one-line error.
    """
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .validate import check_safetensors

    p = require_file(path)
    if p.suffix == ".safetensors":
        check_safetensors(p)
    try:
        tensors = load_file(p) if p.suffix == ".safetensors" else torch_load_weights(p)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise DprGcError(f"{p}: refused to load, not a plain tensor file ({weights_only_reason(e)}); "
                         "re-create it with dpr-gc, and never load files of unknown origin with pickle") from None
    if not isinstance(tensors, dict):
        raise DprGcError(f"{p}: expected a dictionary of tensors, found {type(tensors).__name__}")
    return tensors


def remove_folder(path: PathLike) -> None:
    """Delete the folder ``path`` with what it holds; a symbolic link is removed as a link, never its target (a
    folder kept elsewhere that the link names). Nothing there is nothing to do."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def remove_stale_temporaries(folder: PathLike, names: Iterable[str]) -> list[Path]:
    """Delete the temporary files :func:`atomic_path` left beside ``folder/NAME`` (``.NAME.*.tmp``) for each name.

    Call it only while holding the lock that guards those names: the files then belong to a run that died.
    """
    removed = []
    root = Path(folder)
    if not root.is_dir():
        return removed
    for name in names:
        for tmp in root.glob(f".{glob.escape(name)}.*.tmp"):
            if tmp.is_file():
                tmp.unlink()
                removed.append(tmp)
    return removed


# ----------------------------------------------------------------------------------------- process lifetime
def die_with_parent(worker_id: int = 0, parent: Optional[int] = None) -> None:
    """DataLoader ``worker_init_fn``: end this worker as soon as the process that started it dies, ``kill -9``
    included. A worker whose parent is gone can otherwise hang for ever at exit, its queue feeder blocked on a full
    pipe that a sibling worker keeps open. Linux: the kernel's parent-death signal; everywhere: a watchdog thread.
    ``parent`` (bind it with ``functools.partial`` when building the DataLoader): the pid to outlive no longer;
    a worker whose parent died before this ran ends at once (neither guard would ever fire for it)."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(parent,), name="die-with-parent", daemon=True).start()


def _watch_parent(parent: int, interval: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os.kill(os.getpid(), signal.SIGKILL)


class ChunkedOutput:
    """A text file written chunk by chunk that a re-run can continue after ``kill -9``.

    Chunks are appended to a hidden partial file beside ``path`` (each a gzip member of its own for ``.gz``, so
    the file stays valid whatever chunk it ends on); after each chunk a progress file records the partial file's
    size and the caller's state. A run with the same ``key`` (the settings it depends on) truncates the partial
    file to the last finished chunk and continues; any other run starts over. ``path`` appears only when finished.
    Use it while holding a lock on ``path`` (see :func:`dpr_gc.base.locks.output_lock`). ``output``: the output a
    full disk's message names (default ``path``), where the file written is a step towards it.
    """

    def __init__(self, path: PathLike, key: Any, output: Optional[PathLike] = None) -> None:
        self.path = Path(path)
        self.output = Path(output or path)
        self.partial = beside(self.path, ".partial")
        self.progress = beside(self.path, ".progress.json")
        self.key = json.loads(json.dumps(key))
        self.gz = self.path.suffix == ".gz"

    def resume(self) -> Any:
        """The state recorded with the last finished chunk of an earlier run with the same key, else None (and
        whatever an earlier run left is deleted). A key of None never resumes."""
        saved = self.saved()
        if self.key is None or saved is None or saved["key"] != self.key:
            self.discard()
            return None
        os.truncate(self.partial, saved["bytes"])
        return saved["state"]

    def saved(self) -> Optional[dict]:
        """The progress file's record (``key``, ``bytes``, ``state``) when the partial file holds the chunks it
        counts, else None: no run can continue from what is there."""
        try:
            saved = json.loads(self.progress.read_text(encoding="utf-8"))
            size = self.partial.stat().st_size
        except (OSError, ValueError):
            return None
        if not isinstance(saved, dict) or not {"key", "bytes", "state"} <= saved.keys():
            return None
        return saved if type(saved["bytes"]) is int and 0 <= saved["bytes"] <= size else None

    def append(self, text: str, state: Any) -> None:
        """Append one chunk durably, then record ``state`` as the point a re-run continues from. A full disk cuts
        the partial file back to the last recorded chunk (deletes it when none is, or a re-run cannot continue) and
        is one :class:`DiskFullError` naming the output."""
        try:
            with (gzip_text(self.partial, self.path, "a") if self.gz else
                  open(self.partial, "a", encoding="utf-8")) as f:
                f.write(text)
            with open(self.partial, "rb") as f:
                os.fsync(f.fileno())
            write_json(self.progress, {"key": self.key, "bytes": self.partial.stat().st_size, "state": state})
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise DiskFullError(self.output, self._rewind()) from None

    def _rewind(self) -> str:
        """Cut the partial file back to its last recorded chunk (or delete it, and its progress, when no run can
        continue from it); returns what to do once space is freed."""
        saved = self.saved() if self.key is not None else None
        if saved is None:
            self.discard()
            return "free space or write somewhere else, then run the same command again"
        os.truncate(self.partial, saved["bytes"])
        return (f"the finished part is kept in {self.partial}; free space, then run the same command again to "
                "continue after it")

    def finish(self) -> None:
        """Move the completed file to its name and forget the progress."""
        self.partial.touch()
        os.replace(self.partial, self.path)
        self.progress.unlink(missing_ok=True)

    def discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.progress.unlink(missing_ok=True)

    def discarded_note(self, done: str, flags: Mapping[str, str], names: Optional[Mapping[str, str]] = None,
                       noun: str = "question") -> Optional[str]:
        """The line that says an interrupted run's kept work is about to be dropped, as :meth:`resume` does when
        its key differs, or None (nothing kept, or the same key): the ``noun``s it kept were ``done`` ("retrieved",
        "mined") with other settings, those changed named as ``flags`` spell them (``--top-k 20 -> 10``), the rest
        of the key as ``names`` (or its own) name them (:func:`resume_key_changes`); this run starts over."""
        saved = self.saved()
        if saved is None or self.key is None or saved["key"] == self.key:
            return None
        changed = resume_key_changes(saved["key"], self.key, flags, names or {})
        count = saved["state"].get("count", 0) if isinstance(saved["state"], dict) else 0
        return (f"starting over: the {count} {noun if count == 1 else noun + 's'} an interrupted run kept in "
                f"{self.partial} were {done} with other settings ({', '.join(changed) or 'another version'})")


def resume_key_changes(old: Any, new: Any, flags: Mapping[str, str], names: Mapping[str, str]) -> list[str]:
    """What differs between two resume keys, each once, in the new key's order: a setting ``flags`` spells as
    ``FLAG old -> new`` (:func:`~dpr_gc.base.errors.setting_text`), a nested key's own changes, any other as "the
    NAME" (``names``, else the key with spaces)."""
    old = old if isinstance(old, dict) else {}
    changed: list[str] = []
    for name in [*new, *(k for k in old if k not in new)]:
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict) and name not in flags:
            lines = resume_key_changes(before, after, flags, names)
        elif name in flags:
            lines = [f"{flags[name]} {setting_text(before)} -> {setting_text(after)}"]
        else:
            lines = [f"the {names.get(name, name.replace('_', ' '))}"]
        changed += [line for line in lines if line not in changed]
    return changed
