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
