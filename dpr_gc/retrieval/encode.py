"""Encode a passage corpus into embedding shards that can be resumed, sharded and indexed.

Shard ``k`` of ``n`` covers corpus rows ``[k*N//n, (k+1)*N//n)`` so every row is encoded exactly once. A shard is
encoded in blocks: each block is sorted by length, tokenised in large chunks, run in tightly padded batches under
``torch.inference_mode`` (optionally bf16/fp16 autocast) and saved atomically as a part file. A rerun skips finished
parts. When all parts exist they are assembled into ``shard-K-of-N.npy`` and ``.ids.txt``, and the JSON manifest is
written last -- a shard without a manifest is unfinished, whatever else lies in the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.corpus import dataset_fingerprint, load_corpus
from ..base.args import device_arg, nonnegative_int, output_dir, positive_int
from ..base.devices import PRECISIONS, autocast_dtype, default_device, pick_precision
from ..base.errors import DprGcError
from ..base.guard import guarded
from ..base.files import PathLike, atomic_open, atomic_path, read_json_object, remove_stale_temporaries, write_json
from ..base.locks import locked_folder
from .shards import MANIFEST_RE, PROGRESS_RE, read_manifest, resolve_shard, shard_name, shard_range
from ..model.retriever import add_prefix_arguments
from ..base.tables import markdown_table

logger = logging.getLogger(__name__)

DTYPES = ("float16", "float32")
# Settings that must match for parts/shards in one folder to be combined (batch size and device may differ).
MUST_MATCH = ("model_fingerprint", "pooling", "normalize", "passage_format", "passage_prefix", "max_length", "precision", "dim",
              "dtype", "num_shards", "corpus_name", "corpus_bytes", "corpus_rows", "corpus_fingerprint")


def model_fingerprint(retriever: Any) -> str:
    """A short hash of the passage encoder's weights (a strided sample of each tensor), to detect model changes."""
    h = hashlib.sha1()
    for name, tensor in sorted(retriever.passage_encoder.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 256)].float().cpu().numpy()
        h.update(f"{name}{tuple(tensor.shape)}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:16]


def encode_block(retriever: Any, titles: Sequence[str], texts: Sequence[str], batch_size: int = 64,
                 max_length: Optional[int] = None, autocast: Optional[str] = None,
                 progress: Optional[Any] = None) -> np.ndarray:
    """Embed passages (float32 ``[N, D]``, input order) with :meth:`~dpr_gc.model.Retriever.embed`, the one
    embedding loop (length-sorted, tightly padded batches), under ``autocast`` precision (``bf16``/``fp16``)."""
    return retriever.embed("passage", texts, titles, batch_size, autocast_dtype(autocast), max_length=max_length,
                           progress=progress)


def quantize_int8(retriever: Any) -> Any:
    """A copy of ``retriever`` whose Linear layers compute in int8 (dynamic quantization: weights per output
    channel, activations per batch), for CPUs without native bf16. Quality cost on SciFact: see the README."""
    import copy
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if next(retriever.parameters()).device.type != "cpu":
        raise DprGcError("--precision int8 is a CPU path; on a GPU use bf16 or fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return quantize_dynamic(copy.deepcopy(retriever).eval(), {torch.nn.Linear: per_channel_dynamic_qconfig})


def encode_corpus(retriever: Any, corpus_path: PathLike, out_dir: PathLike,
                  shard_id: Optional[int] = None, num_shards: Optional[int] = None, batch_size: int = 64,
                  dtype: str = "float16", autocast: Optional[str] = None,
                  block_size: int = 16384, max_length: Optional[int] = None, cache_dir: Optional[PathLike] = None,
                  model_name: Optional[str] = None, show_progress: bool = True) -> dict:
    """Encode shard ``shard_id`` of ``num_shards`` of a corpus into ``out_dir``; returns its manifest.

    Unset shard arguments come from torchrun's ``RANK`` / ``WORLD_SIZE`` (else shard 0 of 1).
    Finished blocks from an interrupted run with the same settings are reused; a folder holding parts or shards
    made with another model or other settings is refused rather than mixed.
    """
    if dtype not in DTYPES:
        raise DprGcError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if autocast is not None and autocast not in PRECISIONS:
        raise DprGcError(f"--precision must be one of fp32, bf16, fp16, int8, got {autocast!r}")
    if batch_size < 1 or block_size < 1:
        raise DprGcError("--batch-size and the block size must be positive")
    limit = getattr(retriever.passage_encoder.transformer.config, "max_position_embeddings", None) or 10**9
    if max_length is not None and max_length < 1:
        raise DprGcError(f"--max-length must be a positive number of tokens, got {max_length}")
    if max_length is not None and max_length > limit:
        raise DprGcError(f"--max-length {max_length} exceeds the model's limit of {limit} positions")
    max_length = max_length or min(retriever.config.passage_max_length, limit)
    shard_id, num_shards = resolve_shard(shard_id, num_shards)
    corpus = load_corpus(corpus_path, cache_dir)
    name = shard_name(shard_id, num_shards)
    with locked_folder(out_dir, f".{name}.lock", f"{out_dir} (shard {shard_id} of {num_shards})") as out:
        return _encode_shard(retriever, corpus, corpus_path, out, shard_id, num_shards, batch_size, dtype, autocast,
                             block_size, max_length, model_name, show_progress)


def _encode_shard(retriever: Any, corpus: Any, corpus_path: PathLike, out: Path, shard_id: int, num_shards: int,
                  batch_size: int, dtype: str, autocast: Optional[str], block_size: int, max_length: int,
                  model_name: Optional[str], show_progress: bool) -> dict:
    """The body of :func:`encode_corpus`, run while holding the shard's lock: files of a dead run are ours to clean."""
    start, count = shard_range(len(corpus), shard_id, num_shards)
    name = shard_name(shard_id, num_shards)
    removed = remove_stale_temporaries(out, [name])
    if removed:
        logger.info("removed %d temporary file(s) of an interrupted run from %s", len(removed), out)
    cfg = retriever.config
    model = model_name or retriever.query_encoder.transformer.config.name_or_path or "unnamed"
    manifest = {
        "model": str(Path(model).resolve()) if Path(model).exists() else model,
        "model_fingerprint": model_fingerprint(retriever), "pooling": cfg.pooling, "normalize": cfg.normalize,
        "passage_format": cfg.passage_format, "query_prefix": cfg.query_prefix, "passage_prefix": cfg.passage_prefix,
        "max_length": max_length,
        "precision": autocast or "fp32", "dim": retriever.dim, "dtype": dtype, "count": count, "start_row": start,
        "shard_id": shard_id, "num_shards": num_shards, "corpus": str(Path(corpus_path).resolve()),
        "corpus_name": Path(corpus_path).name, "corpus_bytes": Path(corpus_path).stat().st_size,
        "corpus_rows": len(corpus), "corpus_fingerprint": dataset_fingerprint(corpus), "block_size": block_size,
        "embeddings": f"{name}.npy", "ids": f"{name}.ids.txt",
    }
    _check_folder(out, manifest)
    done = out / f"{name}.json"
    progress_file = out / f"{name}.parts.json"
    if done.is_file() and (out / manifest["embeddings"]).is_file() and (out / manifest["ids"]).is_file():
        _remove_parts(out, name)
        logger.info("%s is already finished in %s; nothing to do", name, out)
        return read_manifest(done)
    write_json(progress_file, manifest)
    blocks = [(s, min(s + block_size, start + count)) for s in range(start, start + count, block_size)]
    parts = [out / f"{name}.part{b:05d}.npy" for b in range(len(blocks))]
    todo = [b for b, p in enumerate(parts) if not _part_ok(p, blocks[b][1] - blocks[b][0], retriever.dim)]
    if len(todo) < len(blocks):
        logger.info("%s: resuming, %d of %d blocks already encoded", name, len(blocks) - len(todo), len(blocks))
    was_training = retriever.training
    retriever.eval()
    bar = tqdm(total=sum(blocks[b][1] - blocks[b][0] for b in todo), desc=f"encode {name}", unit=" passages",
               disable=not show_progress, smoothing=0.05)
    encoder = quantize_int8(retriever) if autocast == "int8" and todo else retriever
    try:
        for b in todo:
            rows = corpus[blocks[b][0]:blocks[b][1]]
            emb = encode_block(encoder, rows["title"], rows["text"], batch_size, manifest["max_length"], autocast,
                               bar).astype(dtype)
            if not np.isfinite(emb).all():
                raise DprGcError(f"embeddings overflow {dtype} in rows {blocks[b][0]}..{blocks[b][1] - 1}; "
                                 "use --dtype float32")
            with atomic_open(parts[b], "wb") as f:
                np.save(f, emb)
    finally:
        bar.close()
        retriever.train(was_training)
    _assemble(out, manifest, corpus, parts)
    write_json(done, manifest)
    _remove_parts(out, name)
    logger.info("%s: %d passages written to %s", name, count, out / manifest["embeddings"])
    return manifest


def _part_ok(path: Path, rows: int, dim: int) -> bool:
    if not path.is_file():
        return False
    try:
        return np.load(path, mmap_mode="r").shape == (rows, dim)
    except (ValueError, OSError):
        return False


def _check_folder(out: Path, manifest: dict) -> None:
    """Refuse a folder whose shards or in-progress parts were made with different settings."""
    for p in sorted(out.iterdir()):
        if not (MANIFEST_RE.match(p.name) or PROGRESS_RE.match(p.name)):
            continue
        try:
            other = read_json_object(p, "an encode manifest")
        except (DprGcError, FileNotFoundError):
            if p.exists():
                raise
            continue  # another shard's run finished meanwhile and removed its progress file
        for key in MUST_MATCH:
            if other.get(key) != manifest[key]:
                raise DprGcError(f"{p} was made with {key}={other.get(key)!r} but this run has {manifest[key]!r}; "
                                 "use a new --output folder or delete the old shards")
    name = shard_name(manifest["shard_id"], manifest["num_shards"])
    progress = out / f"{name}.parts.json"
    started = read_json_object(progress, "encode progress").get("block_size") if progress.is_file() else None
    if progress.is_file() and started != manifest["block_size"]:
        raise DprGcError(f"{progress} was started with --block-size {started}; resume with that block size")
    if not progress.is_file() and any(out.glob(f"{name}.part*.npy")):
        logger.warning("%s: deleting part files that have no %s (left by a run that died); re-encoding them",
                       out, progress.name)
        _remove_parts(out, name)


def _remove_parts(out: Path, name: str) -> None:
    """Delete shard ``name``'s part files and progress file (after assembly, or when they cannot be trusted)."""
    for p in out.glob(f"{name}.part*.npy"):
        p.unlink(missing_ok=True)
    (out / f"{name}.parts.json").unlink(missing_ok=True)


def _write_npy(path: Path, parts: list[Path], dtype: np.dtype, count: int, dim: int) -> None:
    """Write the parts one after the other into a ``.npy`` with plain writes: a full disk is then an ``OSError``
    (one error line), where writing through a memory map of a sparse file dies of SIGBUS."""
    with open(path, "wb") as f:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count, dim)}
        np.lib.format.write_array_header_1_0(f, header)
        rows = 0
        for p in parts:
            block = np.load(p, mmap_mode="r")
            for s in range(0, len(block), 65_536):
                f.write(np.ascontiguousarray(block[s:s + 65_536], dtype=dtype).tobytes())
            rows += len(block)
        if rows != count:
            raise DprGcError(f"{path.parent}: the part files hold {rows} rows, the shard needs {count}; re-run encode")
        f.flush()
        os.fsync(f.fileno())


def _assemble(out: Path, manifest: dict, corpus: Any, parts: list[Path]) -> None:
    """Concatenate part files into the shard ``.npy`` and write the ids, both atomically."""
    count, dim = manifest["count"], manifest["dim"]
    with atomic_path(out / manifest["embeddings"]) as tmp:
        if count == 0:
            with open(tmp, "wb") as f:
                np.save(f, np.zeros((0, dim), dtype=manifest["dtype"]))
        else:
            _write_npy(tmp, parts, np.dtype(manifest["dtype"]), count, dim)
    start = manifest["start_row"]
    id_column = corpus.select_columns(["id"])
    with atomic_open(out / manifest["ids"]) as f:
        for s in range(start, start + count, 100_000):
            ids = id_column[s:min(s + 100_000, start + count)]["id"]
            f.write("".join(f"{i}\n" for i in ids))


# --------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser, dpr_aliases: bool = False) -> None:
    """The ``encode`` flags; with ``dpr_aliases`` also DPR's ``--model_file``, ``--ctx_file``, ``--out_file``..."""
    def names(flag: str, *aliases: str) -> list[str]:
        return [flag, *aliases] if dpr_aliases else [flag]

    parser.add_argument(*names("--model", "--model_file"), dest="model", required=True,
                        help="trained retriever folder, or any Hugging Face model folder/name")
    parser.add_argument(*names("--corpus", "--ctx_src", "--ctx_file"), dest="corpus", required=True,
                        help="passages TSV (id, text, title), BEIR corpus.jsonl(.gz) or JSONL with id/text/title")
    parser.add_argument(*names("--output", "--out_file"), type=output_dir, dest="output", required=True,
                        help="output folder")
    parser.add_argument(*names("--shard-id", "--shard_id"), dest="shard_id", type=nonnegative_int, default=None,
                        help="this shard (default: torchrun's RANK, else 0)")
    parser.add_argument(*names("--num-shards", "--num_shards"), dest="num_shards", type=positive_int, default=None,
                        help="number of shards (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument(*names("--batch-size", "--batch_size"), dest="batch_size", type=positive_int, default=64)
    parser.add_argument(*names("--max-length", "--max_length"), dest="max_length", type=positive_int, default=None,
                        help="passage max tokens (default: the retriever's passage_max_length)")
    parser.add_argument("--dtype", choices=DTYPES, default="float16", help="stored embedding dtype")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16", "int8"), default="auto",
                        help="autocast precision (auto: bf16 on GPUs and CPUs that support it, fp16 on older GPUs, else "
                             "fp32); int8: int8 Linear layers on CPU, for CPUs without native bf16")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    parser.add_argument("--block-size", type=positive_int, default=16384, help="rows per resumable part file")
    parser.add_argument("--cache-dir", default=None, help="where parsed corpora are cached")
    add_prefix_arguments(parser)


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc encode``."""
    parser = subparsers.add_parser("encode", help="embed a passage corpus into resumable shards",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def encode_with_model(model: str, corpus: PathLike, output: PathLike, *, shard_id: Optional[int] = None,
                      num_shards: Optional[int] = None, batch_size: int = 64, dtype: str = "float16",
                      precision: str = "auto", device: Optional[str] = None, block_size: int = 16384,
                      max_length: Optional[int] = None, cache_dir: Optional[PathLike] = None,
                      query_prefix: Optional[str] = None, passage_prefix: Optional[str] = None) -> tuple[dict, float]:
    """Load the retriever ``model`` (prefixes replaced when given) on ``device`` (default: see
    :func:`~dpr_gc.devices.default_device`) and encode one shard (:func:`encode_corpus`) under ``precision``
    (``auto``: see :func:`~dpr_gc.devices.pick_precision`). Returns ``(manifest, seconds)``."""
    from ..model.retriever import Retriever

    device = default_device(device)
    retriever = Retriever.load(model, device, query_prefix, passage_prefix)
    began = time.perf_counter()
    manifest = encode_corpus(retriever, corpus, output, shard_id, num_shards, batch_size=batch_size, dtype=dtype,
                             autocast=pick_precision(precision, torch.device(device)), block_size=block_size,
                             max_length=max_length, cache_dir=cache_dir, model_name=str(model))
    return manifest, time.perf_counter() - began


@guarded(inputs=("model", "corpus"), outputs={"output": "self"})
def run_cli(args: argparse.Namespace, output: Optional[str] = None, device: Optional[str] = None) -> dict:
    """Handler for ``encode`` (and ``scripts/generate_dense_embeddings.py``, whose ``output`` and ``device`` replace
    the flags'): flags to :func:`encode_with_model`, then a summary table."""
    output = output or args.output
    manifest, seconds = encode_with_model(
        args.model, args.corpus, output, shard_id=args.shard_id, num_shards=args.num_shards,
        batch_size=args.batch_size, dtype=args.dtype, precision=args.precision, device=device or args.device,
        block_size=args.block_size, max_length=args.max_length, cache_dir=args.cache_dir,
        query_prefix=args.query_prefix, passage_prefix=args.passage_prefix)
    rate = manifest["count"] / seconds if seconds > 0 else float("nan")
    print(markdown_table(("passages", "seconds", "passages/s", "shard file"),
                         [(manifest["count"], f"{seconds:.1f}", f"{rate:.1f}", Path(output) / manifest["embeddings"])],
                         ("---:", "---:", "---:", "---")))
    return manifest
