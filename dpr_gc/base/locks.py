"""Kernel locks on output files and folders: a second run on the same output is refused at once, a process that
needs a shared cache another is building waits for it.

``flock`` locks are dropped by the kernel when their holder exits in any way (``kill -9`` included), so a lock file
left behind never blocks a re-run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from .errors import DprGcError
from .files import PathLike, beside, folders_made, output_target, remove_stale_temporaries


@contextlib.contextmanager
def exclusive_lock(lock_file: PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the block, or fail at once with a one-line error.

    The kernel drops the lock when its holder exits in any way (``kill -9`` included), so a lock file left behind
    never blocks a re-run; the holder deletes it when done. The file keeps the holder's pid for the message. The
    folders made for the lock file are removed again if the block fails and leaves them empty.
    """
    p = Path(lock_file)
    with folders_made(p.parent), _flock(p, what):
        yield


@contextlib.contextmanager
def _flock(p: Path, what: str) -> Iterator[None]:
    """:func:`exclusive_lock` in a folder that exists."""
    import fcntl

    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(p).st_ino:
                raise BlockingIOError  # the holder deleted this file as we opened it: another run is starting
        except (BlockingIOError, FileNotFoundError):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DprGcError(f"{what} is in use by another run (pid {holder}, lock {p}); wait for it to finish, "
                             "or write somewhere else") from None
        with contextlib.suppress(OSError):  # the pid is for messages only; a full disk fails the real writes
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            p.unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_folder(folder: PathLike, lock_name: str, what: str) -> Iterator[Path]:
    """Create ``folder`` if needed and hold :func:`exclusive_lock` on ``folder/lock_name`` for the block.

    If the block fails, the folders created here (``folder`` and its missing parents) that are still empty are
    removed again, so a run refused for bad input leaves nothing behind.
    """
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise DprGcError(f"{what} is a file; give a folder")
    with folders_made(out), exclusive_lock(out / lock_name, what):
        yield out


@contextlib.contextmanager
def output_lock(path: PathLike) -> Iterator[Path]:
    """Hold a lock on output file ``path`` (a hidden lock file beside it) and delete the temporaries that dead runs
    of :func:`atomic_path` left for it (beside the target of a symbolic link, where they are written)."""
    final = Path(path)
    if final.is_dir():
        raise DprGcError(f"{final} is a folder; give a file name for the output")
    with exclusive_lock(beside(final, ".lock"), str(final)):
        target = output_target(final, "output")
        remove_stale_temporaries(target.parent, [target.name])
        yield final


@contextlib.contextmanager
def wait_lock(lock_file: PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` for the block, waiting while another process holds it: one
    process (e.g. one torchrun rank) builds a shared cache while the others wait for its file. Without ``fcntl``
    (not POSIX) builders simply race; each writes a complete file and renames it atomically."""
    p = Path(lock_file)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(p, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
