"""Small file helpers shared by every stage: gzip-aware reading, JSONL with line numbers, atomic writes."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Union

from .errors import DprGcError

PathLike = Union[str, "os.PathLike[str]"]


def require_file(path: PathLike, what: str = "file") -> Path:
    """Return ``path`` as a Path, or raise a one-line error if it does not exist."""
    p = Path(path)
    if not p.is_file():
        raise DprGcError(f"{what} not found: {p} (check the path)")
    return p


def open_text(path: PathLike, mode: str = "rt") -> IO[str]:
    """Open a text file for reading, transparently decompressing ``.gz``."""
    p = require_file(path)
    if p.suffix == ".gz":
        return gzip.open(p, mode, encoding="utf-8")
    return open(p, mode, encoding="utf-8")


def iter_jsonl(path: PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` for each non-empty line; a bad line raises naming file and line."""
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise DprGcError(f"{path}:{line_no}: invalid JSON ({e.msg}); fix or remove that line") from None


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it is renamed onto ``path`` only if the block succeeds.

    Readers therefore never see a half-written file under the final name.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


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
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def read_json(path: PathLike) -> Any:
    """Read a JSON file, naming the file in the error if it is malformed."""
    with open_text(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise DprGcError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
