"""Encode shards on disk: names, row ranges, manifests, and reading their embeddings and ids.

Shard ``k`` of ``n`` (``shard-0000k-of-0000n``) covers corpus rows ``[k*N//n, (k+1)*N//n)``; its ``.npy`` embeddings
and ``.ids.txt`` passage ids are valid once its JSON manifest exists (written last by ``encode``). ``index`` reads
shards only through these functions.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..base.errors import DprGcError
from ..base.files import PathLike, open_text, read_json_object, require_folder
from ..base.validate import Field, check_fields, count, inside, positive_int, text
from .fingerprint import LEGACY_KEY, disagreeing

# How the passages were encoded, beside the model (encode's MUST_MATCH): shards indexed together agree on them.
SHARD_SETTINGS = ("pooling", "normalize", "passage_format", "passage_prefix", "max_length", "precision", "dtype")
SHARD_RE = r"shard-(\d{5})-of-(\d{5})"  # what shard_name writes
MANIFEST_RE = re.compile(rf"^{SHARD_RE}\.json$")
PROGRESS_RE = re.compile(rf"^{SHARD_RE}\.parts\.json$")
# What encode writes or removes in its output folder for a shard NAME: NAME.npy, NAME.ids.txt, the manifest
# NAME.json, NAME.parts.json and the part files NAME.partNNNNN.npy, and beside them its lock .NAME.lock and the
# temporaries .NAME.*.tmp; an input may be none of them.
SHARD_MEMBERS = (re.compile(rf"{SHARD_RE}\.(npy|ids\.txt|json|parts\.json|part\d{{5}}\.npy)"),
                 re.compile(rf"\.{SHARD_RE}\..+"))


def shard_name(shard_id: int, num_shards: int) -> str:
    return f"shard-{shard_id:05d}-of-{num_shards:05d}"


def shard_range(num_rows: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """``(start_row, count)`` of shard ``shard_id``: contiguous, balanced, no remainder dropped."""
    start = shard_id * num_rows // num_shards
    return start, (shard_id + 1) * num_rows // num_shards - start


def resolve_shard(shard_id: Optional[int], num_shards: Optional[int]) -> tuple[int, int]:
    """Explicit values, else torchrun's ``RANK`` / ``WORLD_SIZE``, else shard 0 of 1; validated. Under torchrun
    (``WORLD_SIZE`` above 1) each rank encodes shard ``RANK`` of ``WORLD_SIZE``: a ``--shard-id`` (every rank would
    encode that one shard) or another ``--num-shards`` (rows left out, or a shard id past the count) is refused."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world > 1:
        given = (f"--shard-id {shard_id}" if shard_id is not None else
                 f"--num-shards {num_shards}" if num_shards not in (None, world) else None)
        if given:
            raise DprGcError(f"{given} under torchrun ({world} ranks): torchrun gives each rank its shard (shard RANK "
                             f"of WORLD_SIZE, here of {world}); drop {given.split()[0]}, or run without torchrun to "
                             "encode a chosen shard")
    if shard_id is None:
        shard_id = int(os.environ.get("RANK", 0))
    if num_shards is None:
        num_shards = world
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise DprGcError(f"--shard-id must be in [0, --num-shards); got shard {shard_id} of {num_shards}")
    return shard_id, num_shards


MANIFEST_FIELDS = {"start_row": count(), "count": count(), "shard_id": count(), "num_shards": positive_int(),
                   "dim": positive_int(), "embeddings": text(), "ids": text(), "corpus_rows": count(True),
                   "model": text(True), "corpus": text(True), "dtype": text(True), "max_length": positive_int(True),
                   "passage_prefix": text(True), "query_prefix": text(True), "pooling": text(True),
                   "normalize": Field(bool, True), "passage_format": text(True), "corpus_fingerprint": text(True),
                   "model_fingerprint": text(True), LEGACY_KEY: text(True)}


def read_manifest(path: Path) -> dict:
    """A finished shard's manifest, checked for the fields indexing relies on."""
    manifest = read_json_object(path, "an encode manifest")
    for key, kind in (("start_row", int), ("count", int), ("shard_id", int), ("num_shards", int), ("dim", int),
                      ("embeddings", str), ("ids", str)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise DprGcError(f"{path}: not an encode manifest ({key!r} missing or not {kind.__name__}); "
                             "delete it and re-run that encode shard")
    check_fields(manifest, path, MANIFEST_FIELDS, "an encode manifest")
    if manifest["shard_id"] >= manifest["num_shards"]:
        raise DprGcError(f"{path}: shard_id {manifest['shard_id']} is not below num_shards {manifest['num_shards']}; "
                         "delete it and re-run that encode shard")
    for key in ("embeddings", "ids"):
        inside(path.parent, manifest[key], path, key)
    return manifest


def looks_pickled(path: Path) -> bool:
    """Whether ``path`` starts like a pickle of protocol 2 to 5 (DPR's embedding files): two bytes are read, nothing
    is unpickled."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def no_shards_message(root: Path) -> str:
    """Why ``root`` gives no embeddings and what to run; DPR's pickled embedding files are named as never read."""
    pickles = [p.name for p in sorted(root.iterdir()) if p.is_file() and looks_pickled(p)]
    if not pickles:
        return f"no finished embedding shards in {root} (run `dpr-gc encode --output {root}` first)"
    shown = ", ".join(pickles[:3]) + (" ..." if len(pickles) > 3 else "")
    return (f"no finished embedding shards in {root}, only what look like DPR's pickled embedding files ({shown}); "
            "dpr-gc never reads them (it never unpickles a file): re-encode the passages with "
            "`dpr-gc encode --output DIR` or scripts/generate_dense_embeddings.py --out_file PREFIX, and give that")


def read_manifests(folder: PathLike, complete: bool = True) -> list[dict]:
    """Finished shard manifests in ``folder`` sorted by start_row, with absolute ``embeddings``/``ids`` paths.

    Raises if there are none, if they disagree on model (:func:`~.fingerprint.records_agree`) or dimension, or
    (``complete=True``) if some corpus rows are not covered yet -- FAISS row r must equal corpus row r, so a gap would
    misalign every later shard.
    """
    root = Path(folder)
    if root.is_file():
        raise DprGcError(f"{root} is a file; give the folder that `dpr-gc encode --output` wrote")
    require_folder(root, "embeddings folder", "run `dpr-gc encode` first")
    manifests = [read_manifest(p) for p in sorted(root.iterdir()) if MANIFEST_RE.match(p.name)]
    if not manifests:
        raise DprGcError(no_shards_message(root))
    first, pair = manifests[0], disagreeing(manifests)
    if pair:
        raise DprGcError(f"shards in {root} disagree on model_fingerprint ({pair[0].get('model_fingerprint')!r} vs "
                         f"{pair[1].get('model_fingerprint')!r}); re-encode them into one folder with one model")
    for m in manifests[1:]:
        for key in ("dim", "num_shards", "corpus_rows", "corpus_fingerprint", *SHARD_SETTINGS):
            if m.get(key) != first.get(key):
                raise DprGcError(f"shards in {root} disagree on {key} ({first.get(key)!r} vs {m.get(key)!r}); "
                                 "re-encode them into one folder with one model and the same encode settings")
    manifests.sort(key=lambda m: m["start_row"])
    for m in manifests:
        for key in ("embeddings", "ids"):
            path = root / m[key]
            if not path.is_file():
                raise DprGcError(f"{path} is missing although its manifest exists; re-run that encode shard")
            m[key] = str(path.resolve())
    if complete:
        have = {m["shard_id"] for m in manifests}
        missing = [k for k in range(first["num_shards"]) if k not in have]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise DprGcError(f"{root} lacks finished shard(s) {shown} of {first['num_shards']}; "
                             "run `dpr-gc encode --shard-id K` for them")
    return manifests

def has_shards(folder: PathLike) -> bool:
    """Whether ``folder`` holds at least one finished shard (a manifest)."""
    root = Path(folder)
    return root.is_dir() and any(MANIFEST_RE.match(p.name) for p in root.iterdir())


def shard_rows_from(manifests: list[dict], first_row: int,
                    allow_partial: bool = False) -> tuple[list[dict], list[dict]]:
    """Shards to add: those holding rows from ``first_row`` on, which must continue it without gaps or overlaps (a
    shard holding no row, more shards than passages, adds nothing and is not one of them). With ``allow_partial`` a
    gap (a shard still being encoded) ends them instead: the shards after it wait for it. Returns ``(shards to add,
    shards waiting)``."""
    todo, expected = [], first_row
    for i, m in enumerate(manifests):
        start, count = int(m["start_row"]), int(m["count"])
        if start + count <= first_row:
            continue
        if start > expected and allow_partial:
            return todo, manifests[i:]
        if start != expected:
            what = "overlaps indexed rows" if start < expected else f"leaves rows {expected}..{start - 1} missing"
            raise DprGcError(f"{m['embeddings']}: shard starting at corpus row {start} {what}; FAISS rows must equal "
                             "corpus rows, so finish (or re-run) the missing shards first")
        if count:
            todo.append(m)
        expected = start + count
    return todo, []


def open_shard(m: dict, check_ids: bool = False) -> np.ndarray:
    """Memory-map a shard's embeddings, checking them (and optionally its ids file) against its manifest."""
    path = Path(m["embeddings"])
    try:
        arr = np.lib.format.open_memmap(path, mode="r")  # np.load would open a zip (np.savez) as an archive
    except ValueError:
        raise DprGcError(f"{path}: cannot read embeddings: not a .npy array (an archive, pickle or other bytes); "
                         "re-encode this shard") from None
    except OSError as e:
        raise DprGcError(f"{path}: cannot read embeddings ({e}); re-encode this shard") from None
    if arr.shape != (int(m["count"]), int(m["dim"])):
        raise DprGcError(f"{path}: holds {arr.dtype} {arr.shape} but its manifest says {m['count']} x {m['dim']}; "
                         "re-encode this shard")
    if arr.dtype not in (np.float16, np.float32):
        raise DprGcError(f"{path}: holds {arr.dtype} values where encode writes float16 or float32 (its manifest "
                         f"says {m['dtype']}); re-encode this shard")
    if check_ids:
        with open(m["ids"], "rb") as f:
            n_ids = sum(1 for _ in f)
        if n_ids != len(arr):
            raise DprGcError(f"{m['ids']}: {n_ids} ids for {len(arr)} embeddings; re-encode this shard")
    return arr


def sample_embeddings(manifests: list[dict], n: int, seed: int = 0) -> np.ndarray:
    """A uniform random sample of ``n`` rows across shards, as float32; only the sample is held in memory."""
    total = sum(int(m["count"]) for m in manifests)
    n = min(n, total)
    rng = np.random.default_rng(seed)
    picks = np.arange(total) if n == total else np.sort(rng.choice(total, size=n, replace=False))
    out = np.empty((n, int(manifests[0]["dim"])), dtype=np.float32)
    offset = filled = 0
    for m in manifests:
        count = int(m["count"])
        local = picks[(picks >= offset) & (picks < offset + count)] - offset
        if len(local):
            out[filled:filled + len(local)] = open_shard(m)[local]
            filled += len(local)
        offset += count
    return out


def shard_ids(manifests: list[dict]) -> Iterator[str]:
    """Stream the passage ids of shards in order (one per embedding row)."""
    for m in manifests:
        with open_text(m["ids"]) as f:
            yield from (line.rstrip("\r\n") for line in f)
