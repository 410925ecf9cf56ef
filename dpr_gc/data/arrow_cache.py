"""The one Arrow cache: corpora and training sets are parsed once into an Arrow IPC stream file, then memory-mapped.

A cache file's name holds a hash of a key naming what was read (paths, sizes, modification times, a content
fingerprint, format versions), so a changed source gets a new file. The file is written atomically (temporary file +
rename) while holding a lock beside it: of several processes that need the same cache (torchrun's ranks) one parses
and the others wait, then map its file. The kernel drops the lock of a holder that dies, so a crash leaves none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ..base.files import PathLike, atomic_path
from ..base.locks import wait_lock


def default_cache_dir(kind: str) -> Path:
    """Where parsed sources are cached: ``$DPR_GC_CACHE/KIND`` or ``~/.cache/dpr_gc/KIND`` (``corpora`` for
    passage corpora, ``train`` for training sets)."""
    return Path(os.environ.get("DPR_GC_CACHE") or Path.home() / ".cache" / "dpr_gc") / kind


def cache_file(cache_dir: Optional[PathLike], kind: str, name: str, key: str) -> Path:
    """``NAME-HASH.arrow`` in ``cache_dir`` (default: :func:`default_cache_dir` of ``kind``), ``HASH`` from ``key``."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(kind)
    return folder / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.arrow"


def build_once(cache: Path, ready: Callable[[], bool], build: Callable[[], Any]) -> bool:
    """Run ``build`` unless ``ready()``, holding the cache's lock and checking ``ready()`` again once it is held
    (another process may have built the cache meanwhile). Returns whether this call built it."""
    if ready():
        return False
    with wait_lock(cache.with_name(cache.name + ".lock")):
        if ready():
            return False
        build()
        return True


def write_stream(path: Path, schema: Any, batches: Iterable[Any],
                 check: Optional[Callable[[Path], None]] = None) -> None:
    """Write record ``batches`` as an Arrow IPC stream (the layout ``datasets.Dataset.from_file`` maps) atomically;
    ``check(temporary file)`` may refuse the result before it gets its final name."""
    import pyarrow as pa

    with atomic_path(path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        if check is not None:
            check(tmp)


def map_dataset(path: Path) -> Any:
    """The cache file as a memory-mapped ``datasets.Dataset``."""
    import datasets

    return datasets.Dataset.from_file(str(path))


# ----------------------------------------------------------------- the ``cache`` command
CACHE_KINDS = ("corpora", "train")


def cache_root() -> Path:
    """The folder holding every kind of cache (``$DPR_GC_CACHE`` or ``~/.cache/dpr_gc``)."""
    return default_cache_dir(CACHE_KINDS[0]).parent


def cache_usage(root: Path) -> list[tuple[str, int, int]]:
    """``(kind, cached sources, bytes)`` of each cache kind under ``root``."""
    rows = []
    for kind in CACHE_KINDS:
        files = [p for p in (root / kind).glob("*") if p.is_file()] if (root / kind).is_dir() else []
        rows.append((kind, sum(p.suffix == ".arrow" for p in files), sum(p.stat().st_size for p in files)))
    return rows


def clear_cache(root: Path) -> tuple[int, int, list[Path]]:
    """Delete the cached files under ``root`` (each kind folder's files); a cache another process is building
    right now (its lock is held) is kept. Returns ``(files removed, bytes freed, caches kept)``."""
    import fcntl

    removed, freed, busy = 0, 0, []
    for kind in CACHE_KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for lock in sorted(folder.glob("*.lock")):
            with open(lock, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    busy.append(lock.with_suffix(""))
        keep = {p for b in busy if b.parent == folder for p in folder.glob(b.stem + "*")}
        for path in folder.iterdir():
            if path.is_file() and path not in keep:
                freed += path.stat().st_size
                path.unlink()
                removed += 1
    return removed, freed, busy


def add_cli(subparsers: Any) -> None:
    """Register ``cache``: list the parsed-data cache, or clear it."""
    p = subparsers.add_parser(
        "cache", help="list (or --clear) the cache of parsed corpora and training sets",
        description="Corpora and training sets are parsed once into memory-mapped Arrow files under $DPR_GC_CACHE "
                    "(default ~/.cache/dpr_gc): corpora/ and train/, each file named by its source and a hash of "
                    "its content. They are safe to delete at any time: the next run parses its source again.")
    p.add_argument("--clear", action="store_true", help="delete the cached files (a cache being built now is kept)")
    p.set_defaults(func=_cli_cache)


def _cli_cache(args: Any) -> None:
    from ..base.tables import markdown_table

    root = cache_root()
    if args.clear:
        removed, freed, busy = clear_cache(root)
        print(f"removed {removed} file(s), {freed / 2**20:.1f} MiB, from {root}"
              + (f"; kept {len(busy)} cache(s) another run is building" if busy else ""))
        return
    rows = cache_usage(root)
    print(markdown_table(("cache", "sources", "MiB", "folder"),
                         [(k, n, f"{b / 2**20:.1f}", root / k) for k, n, b in rows] +
                         [("total", sum(n for _, n, _ in rows), f"{sum(b for *_, b in rows) / 2**20:.1f}", root)]))
