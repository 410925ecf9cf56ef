"""The one Arrow cache: corpora and training sets are parsed once into an Arrow IPC stream file, then memory-mapped.

A cache file's name holds a hash of a key naming what was read (paths, sizes, modification times, a content
fingerprint, format versions), so a changed source gets a new file. The file is written atomically (temporary file +
rename) while holding a lock beside it: of several processes that need the same cache (torchrun's ranks) one parses
and the others wait, then map its file. The kernel drops the lock of a holder that dies, so a crash leaves none.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from ..base.args import input_dir
from ..base.errors import DprGcError
from ..base.files import PathLike, atomic_path, remove_stale_temporaries
from ..base.guard import default_cache_root
from ..base.locks import wait_lock

logger = logging.getLogger(__name__)
ROWS_KEY = "dpr_gc_rows"  # custom metadata of the empty batch that ends every cache file: the rows written


def default_cache_dir(kind: str) -> Path:
    """Where parsed sources are cached: ``$DPR_GC_CACHE/KIND`` or ``~/.cache/dpr_gc/KIND`` (``corpora`` for
    passage corpora, ``train`` for training sets)."""
    root = default_cache_root()[0]
    if root.exists() and not root.is_dir():
        raise DprGcError(f"the cache folder {root} ($DPR_GC_CACHE, else ~/.cache/dpr_gc) is a file; point "
                         "DPR_GC_CACHE at a folder")
    return root / kind


def cache_file(cache_dir: Optional[PathLike], kind: str, name: str, key: str) -> Path:
    """``NAME-HASH.arrow`` in ``cache_dir`` (default: :func:`default_cache_dir` of ``kind``), ``HASH`` from ``key``."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(kind)
    return folder / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.arrow"


def build_once(cache: Path, ready: Callable[[], bool], build: Callable[[], Any]) -> bool:
    """Run ``build`` unless ``ready()``, holding the cache's lock and checking ``ready()`` again once it is held
    (another process may have built the cache meanwhile). Returns whether this call built it. Under the lock the
    temporaries a killed build of this cache left (``.NAME.*.tmp``, as large as the cache) are deleted first."""
    if ready():
        return False
    with wait_lock(cache.with_name(cache.name + ".lock")):
        remove_stale_temporaries(cache.parent, [cache.name])
        if ready():
            return False
        build()
        return True


def write_stream(path: Path, schema: Any, batches: Iterable[Any],
                 check: Optional[Callable[[Path], None]] = None) -> None:
    """Write record ``batches`` as an Arrow IPC stream (the layout ``datasets.Dataset.from_file`` maps) atomically,
    ending in an empty batch that records the row count (so a damaged copy can be told, see :func:`cache_damage`);
    ``check(temporary file)`` may refuse the result before it gets its final name."""
    import pyarrow as pa

    with atomic_path(path) as tmp:
        rows = 0
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
            writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema), custom_metadata={ROWS_KEY: str(rows)})
        if check is not None:
            check(tmp)


def cache_damage(path: Path, expected: Mapping[str, str]) -> Optional[str]:
    """What is wrong with the cache file ``path``, or None: unreadable, cut short (no row count at its end), a row
    count other than the one written, or schema metadata other than ``expected`` (e.g. the source's fingerprint).
    Reads the batches' headers and checks their structure (memory-mapped: cheap however large the cache)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            metadata = reader.schema.metadata or {}
            for key, value in expected.items():
                if metadata.get(key.encode()) != value.encode():
                    return f"its {key} is not the source's"
            rows, recorded = 0, None
            for batch, custom in iter(reader.read_next_batch_with_custom_metadata, None):  # ends on StopIteration
                batch.validate()
                rows += batch.num_rows
                recorded = int(custom[ROWS_KEY.encode()]) if custom and ROWS_KEY.encode() in custom else None
    except (pa.ArrowException, OSError, ValueError) as e:
        return f"unreadable: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    if recorded is None:
        return "cut short (no row count at its end)"
    return None if recorded == rows else f"{rows} rows where {recorded} were written"


def cached_dataset(cache: Path, build: Callable[[], Any], expected: Optional[Mapping[str, str]] = None,
                   ready: Callable[[], bool] = lambda: True) -> Any:
    """The cache file memory-mapped, built first by ``build`` if it is missing or damaged (:func:`cache_damage`
    against the ``expected`` schema metadata; one warning line, then rebuilt), or ``ready()`` is false."""
    warned: list[str] = []

    def usable() -> bool:
        if not cache.is_file():
            return False
        problem = cache_damage(cache, expected or {})
        if problem and not warned:
            logger.warning("%s: the cached copy is damaged (%s); rebuilding it from its source", cache, problem)
            warned.append(problem)
        return problem is None and ready()

    build_once(cache, usable, build)
    return map_dataset(cache)


def map_dataset(path: Path) -> Any:
    """The cache file as a memory-mapped ``datasets.Dataset``."""
    import datasets

    return datasets.Dataset.from_file(str(path))


# ----------------------------------------------------------------- the ``cache`` command
CACHE_KINDS = ("corpora", "train")
# what the cache holds: NAME-HASH.arrow (:func:`cache_file`), its lock, a training parse's NAME-HASH.stats.json
# (dpr_gc.data.training), and the hidden temporaries their builds write (``.NAME-HASH.arrow.*.tmp``, ...)
CACHE_FILE = re.compile(r"(.+-[0-9a-f]{16}\.(arrow(\.lock)?|stats\.json)|"
                        r"\..+-[0-9a-f]{16}\.(arrow|stats\.json)\..+\.tmp)")


def cache_root() -> Path:
    """The folder holding every kind of cache (``$DPR_GC_CACHE`` or ``~/.cache/dpr_gc``)."""
    return default_cache_dir(CACHE_KINDS[0]).parent


def cache_folders(root: Path, flat: bool = False) -> list[tuple[str, Path]]:
    """``(label, folder)`` of each folder of caches under ``root``: one per kind (``root/corpora``, ``root/train``),
    or, ``flat``, ``root`` itself holding every kind, as a folder given to a command's ``--cache-dir`` does."""
    return [(" and ".join(CACHE_KINDS), root)] if flat else [(kind, root / kind) for kind in CACHE_KINDS]


def cache_usage(root: Path, flat: bool = False) -> list[tuple[str, int, int]]:
    """``(label, cached sources, bytes)`` of each folder of :func:`cache_folders`: the files ``--clear`` deletes
    (:data:`CACHE_FILE`), no file of the user's."""
    rows = []
    for label, folder in cache_folders(root, flat):
        files = [p for p in folder.iterdir() if p.is_file() and CACHE_FILE.fullmatch(p.name)] if folder.is_dir() \
            else []
        rows.append((label, sum(p.suffix == ".arrow" for p in files), sum(p.stat().st_size for p in files)))
    return rows


def clear_cache(root: Path, flat: bool = False) -> tuple[int, int, list[Path]]:
    """Delete the cached files in each folder of :func:`cache_folders` (caches, their locks and a killed build's
    temporaries; nothing else a user may have put there); a cache another process is building right now (its lock,
    a file named as :data:`CACHE_FILE` names one, is held) is kept. Returns ``(files removed, bytes freed, caches
    kept)``."""
    import fcntl

    removed, freed, busy = 0, 0, []
    for _, folder in cache_folders(root, flat):
        if not folder.is_dir():
            continue
        for lock in sorted(folder.glob("*.lock")):
            if not (CACHE_FILE.fullmatch(lock.name) and lock.is_file() and not lock.is_symlink()):
                continue  # not a lock of the cache's: a user's file or folder, left alone
            with open(lock, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    busy.append(lock.with_suffix(""))
        patterns = [pattern for b in busy if b.parent == folder  # its files, and the hidden temporaries it writes
                    for pattern in (glob.escape(b.stem) + "*", "." + glob.escape(b.stem) + "*")]
        keep = {p for pattern in patterns for p in folder.glob(pattern)}
        for path in folder.iterdir():
            if path.is_file() and path not in keep and CACHE_FILE.fullmatch(path.name):
                freed += path.stat().st_size
                path.unlink()
                removed += 1
    return removed, freed, busy


def add_cli(subparsers: Any) -> None:
    """Register ``cache``: list the parsed-data cache, or clear it."""
    p = subparsers.add_parser(
        "cache",
        description="Corpora and training sets are parsed once into memory-mapped Arrow files under $DPR_GC_CACHE "
                    "(default: ~/.cache/dpr_gc): corpora/ and train/, each file named by its source and a hash of "
                    "what was read (path, size, modification time, a fingerprint of the content), so a changed "
                    "source, or a copy elsewhere, gets a file of its own. They are safe to delete at any time: the "
                    "next run parses its source again.")
    p.add_argument("--clear", action="store_true", help="delete the cached files (a cache being built now is kept)")
    p.add_argument("--cache-dir", "--cache_dir", type=input_dir,
                   help="the folder given to another command's --cache-dir, whose caches it holds side by side "
                        "(default: the corpora/ and train/ folders under $DPR_GC_CACHE, else ~/.cache/dpr_gc)")
    p.set_defaults(func=_cli_cache)


def cache_listing(rows: list[tuple[str, int, int]], folders: Mapping[str, Path]) -> str:
    """The detail table of ``dpr-gc cache``: the cached sources, MiB and folder of each kind of cache."""
    from ..base.tables import markdown_table

    return markdown_table(("cache", "sources", "MiB", "folder"),
                          [(k, n, f"{b / 2**20:.1f}", folders[k]) for k, n, b in rows])


def _cli_cache(args: Any) -> None:
    """List the caches (a detail table per kind), or with ``--clear`` empty them; either ends with the closing
    summary every command prints."""
    import time

    from ..base.tables import format_summary

    started = time.perf_counter()
    flat = args.cache_dir is not None
    root = Path(args.cache_dir).expanduser() if flat else cache_root()
    if flat and not root.is_dir():
        raise DprGcError(f"--cache-dir {args.cache_dir}: no such folder; give the folder another command's "
                         "--cache-dir wrote its caches to")
    if args.clear:
        removed, freed, busy = clear_cache(root, flat)
        kept = {"kept": f"{len(busy)} cache(s) another run is building"} if busy else {}
        print(format_summary({"removed": f"{removed} file(s)", "MiB": f"{freed / 2**20:.1f}", **kept, "folder": root},
                             time.perf_counter() - started))
        return
    rows = cache_usage(root, flat)
    print(cache_listing(rows, dict(cache_folders(root, flat))) + "\n")
    print(format_summary({"sources": sum(n for _, n, _ in rows), "MiB": f"{sum(b for *_, b in rows) / 2**20:.1f}",
                          "folder": root}, time.perf_counter() - started))
