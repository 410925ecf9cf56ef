"""Encode a passage corpus into embedding shards that can be resumed, sharded and indexed.

Shard ``k`` of ``n`` covers corpus rows ``[k*N//n, (k+1)*N//n)`` so every row is encoded exactly once. A shard is
encoded in blocks: each block is sorted by length, tokenised in large chunks, run in tightly padded batches under
``torch.inference_mode`` (optionally bf16/fp16 autocast) and saved atomically as a part file. A rerun skips finished
parts. When all parts exist they are assembled into ``shard-K-of-N.npy`` and ``.ids.txt``, and the JSON manifest is
written last -- a shard without a manifest is unfinished, whatever else lies in the folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import IO, Any, Callable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.corpus import dataset_fingerprint, load_corpus
from ..base.args import home_expanded, nonnegative_int, output_dir, positive_int
from ..base.devices import (PRECISIONS, autocast_dtype, cpu_has_native_bf16, cpu_threads, default_device,
                            pick_precision, warn_if_emulated)
from ..base.errors import DprGcError, Interrupted, alike_on_every_rank
from ..base.guard import guarded
from ..base.files import (PathLike, atomic_open, atomic_path, copied_from, read_json_object, remove_stale_temporaries,
                          require_file, write_json)
from ..base.locks import locked_folder
from ..base.settings import (add_arguments as add_setting_arguments, cache_dir_setting, check, device_setting,
                             from_args, group, passage_prefix_setting, query_prefix_setting, setting, to_record)
from .fingerprint import bridge_legacy, model_fingerprint, records_agree
from .shards import MANIFEST_RE, PROGRESS_RE, SHARD_MEMBERS, read_manifest, resolve_shard, shard_name, shard_range
from ..base.tables import format_summary, seconds_text
from ..base.logs import counted, infos_from_rank_zero

logger = logging.getLogger(__name__)

DTYPES = ("float16", "float32")
# Settings that must match for parts/shards in one folder to be combined (batch size and device may differ).
MUST_MATCH = ("model_fingerprint", "pooling", "normalize", "passage_format", "passage_prefix", "max_length", "precision", "dim",
              "dtype", "num_shards", "corpus_name", "corpus_bytes", "corpus_rows", "corpus_fingerprint")


ENCODE_PRECISIONS = ("auto", *PRECISIONS)


@dataclasses.dataclass
class EncodeSettings:
    """How passages are encoded (recorded in each shard's manifest under ``settings``); ``precision`` ``auto``
    picks bf16 on GPUs and CPUs that support it, fp16 on older GPUs, else fp32 (the library's default is fp32)."""

    shard_id: Optional[int] = setting(None, "--shard-id", type=nonnegative_int, aliases=("--shard_id",),
                                      help="this shard (default: 0; under torchrun RANK, and the flag is refused)")
    num_shards: Optional[int] = setting(None, "--num-shards", type=positive_int, aliases=("--num_shards",),
                                        help="number of shards (default: 1; under torchrun WORLD_SIZE, no other)")
    batch_size: int = setting(64, "--batch-size", type=positive_int, aliases=("--batch_size",),
                              help="passages per encoder batch")
    max_length: Optional[int] = setting(None, "--max-length", type=positive_int, aliases=("--max_length",),
                                        help="passage max tokens (default: the retriever's passage_max_length)")
    dtype: str = setting("float16", "--dtype", choices=DTYPES, help="stored embedding dtype")
    precision: str = setting("fp32", "--precision", choices=ENCODE_PRECISIONS, cli_default="auto",
                             help="autocast precision (auto: bf16 on GPUs and CPUs that support it, fp16 on older "
                                  "GPUs, else fp32); int8: int8 Linear layers on CPU, for CPUs without native bf16")
    block_size: int = setting(16384, "--block-size", type=positive_int, help="rows per resumable part file")
    cache_dir: Optional[PathLike] = cache_dir_setting()

    def __post_init__(self) -> None:
        check(self)


@dataclasses.dataclass
class EncodeJob:
    """``dpr-gc encode``: which model encodes which corpus into which folder, on which device, and how."""

    model: str = setting("", "--model", type=home_expanded, required=True, aliases=("--model_file",),
                         help="trained retriever folder, or any Hugging Face model folder/name")
    corpus: str = setting("", "--corpus", type=home_expanded, required=True, aliases=("--ctx_src", "--ctx_file"),
                          help="passages TSV (id, text, title), BEIR corpus.jsonl(.gz) or JSONL with id/text/title")
    output: str = setting("", "--output", type=output_dir, required=True, aliases=("--out_file",),
                          help="output folder")
    device: Optional[str] = device_setting()
    query_prefix: Optional[str] = query_prefix_setting()
    passage_prefix: Optional[str] = passage_prefix_setting()
    settings: EncodeSettings = group(EncodeSettings, "encoding")

    def __post_init__(self) -> None:
        check(self)


def encode_block(retriever: Any, titles: Sequence[str], texts: Sequence[str], batch_size: int = 64,
                 max_length: Optional[int] = None, autocast: Optional[str] = None,
                 progress: Optional[Any] = None) -> np.ndarray:
    """Embed passages (float32 ``[N, D]``, input order) with :meth:`~dpr_gc.model.retriever.Retriever.embed`, the one
    embedding loop (length-sorted, tightly padded batches), under ``autocast`` precision (``bf16``/``fp16``)."""
    return retriever.embed("passage", texts, titles, batch_size, autocast_dtype(autocast), max_length=max_length,
                           progress=progress, progress_in_tokens=True)


class PassagesAsEncoded:
    """Embeds passages as encode embedded those of an index or shard recording ``meta``: at its ``max_length``, under
    its ``precision`` (``int8``: a quantized copy on the CPU, made once) and rounded to its stored ``dtype`` (each
    absent: the retriever's own length, fp32, float32), so a passage scored beside the index's hits (a positive)
    gets the vector the index holds for it (under int8, up to its activation scales, which are set per batch)."""

    def __init__(self, retriever: Any, meta: Optional[dict] = None) -> None:
        self.retriever, self.meta, self.int8 = retriever, meta or {}, None

    def embed(self, titles: Sequence[str], texts: Sequence[str], batch_size: int = 64,
              show_progress: bool = False) -> np.ndarray:
        """Float32 ``[N, D]`` vectors of the passages, input order (``show_progress``: under a bar of their own)."""
        precision, encoder = self.meta.get("precision") or "fp32", self.retriever
        if precision == "int8":
            if self.int8 is None:
                import copy

                cpu = next(self.retriever.parameters()).device.type == "cpu"
                self.int8 = quantize_int8(self.retriever if cpu else copy.deepcopy(self.retriever).cpu())
            encoder = self.int8
        emb = encoder.embed("passage", texts, titles, batch_size, autocast_dtype(precision), show_progress,
                            max_length=self.meta.get("max_length"))
        dtype = self.meta.get("dtype")
        return emb.astype(dtype).astype(np.float32) if dtype and dtype != "float32" else emb


def shard_tokens(corpus: Any, start: int, stop: int, max_length: int) -> np.ndarray:
    """The :func:`~dpr_gc.model.retriever.estimated_tokens` of corpus rows ``start:stop`` (title + text
    characters, counted by Arrow without reading the texts into Python): the units of encode's progress bar."""
    import pyarrow.compute as pc

    from ..model.retriever import estimated_tokens

    mapped = hasattr(corpus, "data") and getattr(corpus, "_indices", None) is None
    table = corpus.data.slice(start, stop - start) if mapped else None
    if table is None:
        rows = corpus[start:stop]
        chars = [len(t or "") + len(x) for t, x in zip(rows["title"], rows["text"])]
    else:
        chars = sum(pc.fill_null(pc.utf8_length(table.column(c)), 0).to_numpy(zero_copy_only=False)
                    for c in ("title", "text"))
    return estimated_tokens(np.asarray(chars), max_length)


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


def encode_corpus(retriever: Any, corpus_path: PathLike, out_dir: PathLike, shard_id: Optional[int] = None,
                  num_shards: Optional[int] = None, settings: Optional[EncodeSettings] = None, *,
                  model_name: Optional[str] = None, show_progress: bool = True, dtype_flag: str = "",
                  **options: Any) -> dict:
    """Encode shard ``shard_id`` of ``num_shards`` of a corpus into ``out_dir`` with ``settings`` (fields of
    :class:`EncodeSettings` may also be given as keywords); returns its manifest.

    Unset shard arguments come from the settings, else shard 0 of 1; under torchrun each rank encodes shard ``RANK``
    of ``WORLD_SIZE`` and given ones are refused (:func:`~.shards.resolve_shard`).
    Finished blocks from an interrupted run with the same settings are reused; a folder holding parts or shards
    made with another model or other settings is refused rather than mixed. The manifest returned also holds
    ``encoded``: the passages this call encoded (fewer than ``count`` when it resumed, 0 when the shard was done),
    and ``encoding_seconds``: the seconds encoding them took (loading and fingerprinting the corpus and the model,
    and assembling the shard, left out).
    ``dtype_flag`` names the caller's flag for ``dtype`` in the log's hint that float32 keeps full precision (no hint
    without one: the demo and mine have no such flag).
    """
    from ..model.retriever import check_max_length
    from ..model.tokenize import check_length_room

    settings = dataclasses.replace(settings or EncodeSettings(), **options)
    device = next(retriever.parameters()).device
    with alike_on_every_rank():  # settings, model and corpus are every torchrun rank's alike
        refuse_foreign_folder(out_dir)
        autocast = pick_precision(settings.precision, device)
        warn_if_emulated(settings.precision, device)
        if settings.max_length is not None:
            check_max_length("--max-length", settings.max_length, retriever.positions("passage"))
        flag = "--max-length" if settings.max_length is not None else None  # None: the retriever's own, named so
        settings = dataclasses.replace(settings, max_length=retriever.max_length("passage", settings.max_length))
        check_length_room(retriever.tokenizer, retriever.config, "passage", settings.max_length, flag)
        shard_id, num_shards = resolve_shard(settings.shard_id if shard_id is None else shard_id,
                                             settings.num_shards if num_shards is None else num_shards)
        corpus = load_corpus(corpus_path, settings.cache_dir)
    name = shard_name(shard_id, num_shards)
    with locked_folder(out_dir, f".{name}.lock", f"{out_dir} (shard {shard_id} of {num_shards})") as out:
        return _encode_shard(retriever, corpus, corpus_path, out, (shard_id, num_shards), settings, autocast,
                             model_name, show_progress=show_progress, dtype_flag=dtype_flag)


def _encode_shard(retriever: Any, corpus: Any, corpus_path: PathLike, out: Path, shard: tuple[int, int],
                  settings: EncodeSettings, autocast: Optional[str], model_name: Optional[str], *,
                  show_progress: bool, dtype_flag: str) -> dict:
    """The body of :func:`encode_corpus`, run while holding the shard's lock: files of a dead run are ours to clean."""
    (shard_id, num_shards), block_size = shard, settings.block_size
    start, count = shard_range(len(corpus), shard_id, num_shards)
    name = shard_name(shard_id, num_shards)
    removed = remove_stale_temporaries(out, [name])
    if removed:
        logger.info("removed %d temporary file(s) of an interrupted run from %s", len(removed), out)
    manifest = _manifest(retriever, corpus, corpus_path, (shard_id, num_shards), settings, autocast, model_name)
    _check_folder(out, manifest, retriever.passage_encoder)
    done = out / f"{name}.json"
    progress_file = out / f"{name}.parts.json"
    if done.is_file() and (out / manifest["embeddings"]).is_file() and (out / manifest["ids"]).is_file():
        _remove_parts(out, name)
        logger.info("%s is already finished in %s; nothing to do", name, out)
        return {**read_manifest(done), "encoded": 0, "encoding_seconds": 0.0}
    write_json(progress_file, manifest)
    device = next(retriever.parameters()).device
    logger.info("%s: %s on %s in %s compute, stored as %s%s; batch %d, max length %d tokens%s", name,
                counted(count, "passage"), device, autocast or "fp32", settings.dtype,
                f" ({dtype_flag} float32 keeps full precision)" if settings.dtype == "float16" and dtype_flag else "",
                settings.batch_size,
                manifest["max_length"], cpu_threads(device))
    blocks = [(s, min(s + block_size, start + count)) for s in range(start, start + count, block_size)]
    parts = [out / f"{name}.part{b:05d}.npy" for b in range(len(blocks))]
    todo = [b for b, p in enumerate(parts) if not _part_ok(p, blocks[b][1] - blocks[b][0], retriever.dim)]
    if len(todo) < len(blocks):
        logger.info("%s: resuming, %d of %d blocks already encoded", name, len(blocks) - len(todo), len(blocks))
    was_training = retriever.training
    retriever.eval()
    bar = tqdm(total=int(sum(shard_tokens(corpus, *blocks[b], manifest["max_length"]).sum() for b in todo)), unit=" tokens",
               desc=f"encode {name} (~tokens)", unit_scale=True, disable=not show_progress, smoothing=0.05)
    encoder = quantize_int8(retriever) if autocast == "int8" and todo else retriever
    try:
        seconds = _encode_parts(encoder, corpus, [(blocks[b], parts[b]) for b in todo], settings, autocast, bar,
                                lambda n: f"{name}: {n} of {len(blocks)} blocks of {block_size} passages are kept "
                                          f"in {out}", len(blocks) - len(todo))
    finally:
        bar.close()
        retriever.train(was_training)
    _assemble(out, manifest, corpus, parts)
    write_json(done, manifest)
    _remove_parts(out, name)
    logger.info("%s: %s written to %s", name, counted(count, "passage"), out / manifest["embeddings"])
    return {**manifest, "encoded": sum(blocks[b][1] - blocks[b][0] for b in todo), "encoding_seconds": seconds}


def _encode_parts(encoder: Any, corpus: Any, todo: list[tuple[tuple[int, int], Path]], settings: EncodeSettings,
                  autocast: Optional[str], bar: Any, kept: Callable[[int], str], finished: int) -> float:
    """Encode each (rows, part file) of ``todo``; returns the seconds it took, the passages' encoding alone (the
    ``encoding`` row of encode's summary: reading the corpus and fingerprinting it, before, are not in it). Ctrl-C
    after a part is finished says what is kept (``kept`` of the count of blocks finished, ``finished`` before)."""
    started = time.perf_counter()
    try:
        for rows, part in todo:
            _encode_part(encoder, corpus, rows, part, settings, autocast, bar)
            finished += 1
    except KeyboardInterrupt:
        if not finished:
            raise
        raise Interrupted(f"{kept(finished)}; run the same command again to encode the rest") from None
    return time.perf_counter() - started


def _encode_part(encoder: Any, corpus: Any, rows: tuple[int, int], part: Path, settings: EncodeSettings,
                 autocast: Optional[str], bar: Any) -> None:
    """Encode the corpus rows ``rows`` (start, end) into the part file ``part``, whole or not at all."""
    block = corpus[rows[0]:rows[1]]
    emb = encode_block(encoder, block["title"], block["text"], settings.batch_size, settings.max_length, autocast, bar)
    with np.errstate(over="ignore"):  # checked on the next line, with its own one-line error
        emb = emb.astype(settings.dtype)
    if not np.isfinite(emb).all():
        raise DprGcError(f"embeddings overflow {settings.dtype} in rows {rows[0]}..{rows[1] - 1}; use --dtype float32")
    with atomic_open(part, "wb") as f:
        _save_npy(f, emb)


def _save_npy(f: IO[bytes], arr: np.ndarray) -> None:
    """Write ``arr`` to ``f`` as a ``.npy`` with plain writes: a full disk is then an ``OSError`` with its errno (one
    error line naming the file), where ``np.save`` on a file reports a short write without one."""
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(arr.dtype),
                                             "fortran_order": False, "shape": arr.shape})
    f.write(np.ascontiguousarray(arr).tobytes())


def _manifest(retriever: Any, corpus: Any, corpus_path: PathLike, shard: tuple[int, int], settings: EncodeSettings,
              autocast: Optional[str], model_name: Optional[str]) -> dict:
    """What a shard records: the model and how it encoded, the corpus, the rows, the files, and the settings."""
    (shard_id, num_shards), cfg, name = shard, retriever.config, shard_name(*shard)
    start, count = shard_range(len(corpus), shard_id, num_shards)
    model = model_name or retriever.query_encoder.transformer.config.name_or_path or "unnamed"
    record = dataclasses.replace(settings, shard_id=shard_id, num_shards=num_shards, precision=autocast or "fp32",
                                 cache_dir=None if settings.cache_dir is None else str(settings.cache_dir))
    return {
        "model": str(Path(model).resolve()) if Path(model).exists() else model,
        "model_fingerprint": model_fingerprint(retriever), "pooling": cfg.pooling, "normalize": cfg.normalize,
        "passage_format": cfg.passage_format, "query_prefix": cfg.query_prefix, "passage_prefix": cfg.passage_prefix,
        "max_length": settings.max_length,
        "precision": autocast or "fp32", "dim": retriever.dim, "dtype": settings.dtype, "count": count,
        "start_row": start, "shard_id": shard_id, "num_shards": num_shards, "corpus": corpus_as_recorded(corpus_path),
        "corpus_name": Path(corpus_path).name, "corpus_bytes": Path(corpus_path).stat().st_size,
        "corpus_rows": len(corpus), "corpus_fingerprint": dataset_fingerprint(corpus),
        "block_size": settings.block_size, "embeddings": f"{name}.npy", "ids": f"{name}.ids.txt",
        "settings": to_record(record),
    }


def corpus_as_recorded(corpus_path: PathLike) -> str:
    """The corpus a shard records: its absolute path, or the pipe given for it (``/dev/fd/63``), never the temporary
    copy read in its place (:func:`~dpr_gc.base.files.copied_from`)."""
    source = copied_from(corpus_path)
    return os.path.abspath(source) if source else str(Path(corpus_path).resolve())


def _part_ok(path: Path, rows: int, dim: int) -> bool:
    if not path.is_file():
        return False
    try:
        return np.lib.format.open_memmap(path, mode="r").shape == (rows, dim)  # np.load also opens zips
    except (ValueError, OSError):
        return False


# Files that make a folder an index's or a model's: embedding shards written among them would mix two outputs.
INDEX_FILES = ("index.faiss", "index_meta.json")
FOREIGN_FILES = (*INDEX_FILES, "config.json", "retriever_config.json", "model.safetensors")


def refuse_foreign_folder(out: PathLike) -> None:
    """Refuse an output folder that holds an index or a model (encode writes shards into the folder it is given),
    or that lies inside an index folder (a rebuild of the index replaces its folder whole, and refuses one holding
    anything else)."""
    found = [name for name in FOREIGN_FILES if (Path(out) / name).is_file()]
    if found:
        kind = "an index" if found[0].startswith("index") else "a model"
        raise DprGcError(f"the output folder {out} holds {kind} ({found[0]}); give the embeddings a folder of "
                         "their own")
    index = next((parent for parent in Path(os.path.abspath(out)).parents
                  if any((parent / name).is_file() for name in INDEX_FILES)), None)
    if index is not None:
        raise DprGcError(f"the output folder {out} lies inside the index folder {index}, which a rebuild of the "
                         "index replaces whole; give the embeddings a folder outside it")


def _check_folder(out: Path, manifest: dict, encoder: Any) -> None:
    """Refuse a folder whose shards or in-progress parts were made with different settings or another model (a
    record of the legacy fingerprint form is compared through the legacy fingerprint ``encoder`` adds to
    ``manifest``)."""
    with alike_on_every_rank():  # the folder's records are every torchrun rank's alike (its own shard's is below)
        records = _folder_records(out)
        bridge_legacy(manifest, encoder, [r for _, r in records])
        for p, other in records:
            for key in MUST_MATCH:
                same = records_agree(other, manifest) if key == "model_fingerprint" else other.get(key) == manifest[key]
                if not same:
                    raise DprGcError(f"{p} was made with {key}={other.get(key)!r} but this run has "
                                     f"{manifest[key]!r}; use a new --output folder or delete the old shards")
    name = shard_name(manifest["shard_id"], manifest["num_shards"])
    progress = out / f"{name}.parts.json"
    started = read_json_object(progress, "encode progress").get("block_size") if progress.is_file() else None
    if progress.is_file() and started != manifest["block_size"]:
        raise DprGcError(f"{progress} was started with --block-size {started}; resume with that block size")
    if not progress.is_file() and any(out.glob(f"{name}.part*.npy")):
        logger.warning("%s: deleting part files that have no %s (left by a run that died); re-encoding them",
                       out, progress.name)
        _remove_parts(out, name)


def _folder_records(out: Path) -> list[tuple[Path, dict]]:
    """The manifests and progress files in ``out``, with their paths (one another run removes meanwhile is skipped)."""
    records = []
    for p in sorted(out.iterdir()):
        if not (MANIFEST_RE.match(p.name) or PROGRESS_RE.match(p.name)):
            continue
        try:
            records.append((p, read_json_object(p, "an encode manifest")))
        except (DprGcError, FileNotFoundError):
            if p.exists():
                raise
    return records


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
            block = np.lib.format.open_memmap(p, mode="r")
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
                _save_npy(f, np.zeros((0, dim), dtype=manifest["dtype"]))
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
    """The ``encode`` flags (generated from :class:`EncodeJob`); with ``dpr_aliases`` also DPR's ``--model_file``,
    ``--ctx_file``, ``--out_file``..."""
    add_setting_arguments(parser, EncodeJob, dpr_aliases=dpr_aliases)


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc encode``."""
    parser = subparsers.add_parser("encode",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def describe_auto_precision(device: str) -> str:
    """Why ``--precision auto`` chose what it did on ``device`` (see :func:`~dpr_gc.base.devices.pick_precision`)."""
    if torch.device(device).type == "cuda":
        return "the GPU's fastest half precision"
    if cpu_has_native_bf16():
        return "this CPU computes bf16 natively; --precision fp32 for full precision"
    return "this CPU has no native bf16"


def encode_with_model(job: EncodeJob) -> tuple[dict, float]:
    """Load the retriever ``job.model`` (prefixes replaced when given) on ``job.device`` (default: see
    :func:`~dpr_gc.base.devices.default_device`) and encode one shard (:func:`encode_corpus`) with
    ``job.settings``. Returns ``(manifest, seconds)``: the seconds encoding the passages took, its
    ``encoding_seconds``."""
    from ..model.retriever import Retriever

    device = default_device(job.device)
    with alike_on_every_rank():  # every torchrun rank loads the same model
        retriever = Retriever.load(job.model, device, job.query_prefix, job.passage_prefix)
    if job.settings.precision == "auto":
        chosen = pick_precision("auto", torch.device(device))
        logger.info("--precision auto on %s: %s (%s)", device, chosen or "fp32", describe_auto_precision(device))
    manifest = encode_corpus(retriever, job.corpus, job.output, settings=job.settings, model_name=str(job.model),
                             dtype_flag="--dtype")
    return manifest, manifest["encoding_seconds"]


@guarded(inputs=("model", "corpus"), outputs={"output": "self"}, members={"output": SHARD_MEMBERS})
def run_cli(args: argparse.Namespace, output: Optional[str] = None, device: Optional[str] = None) -> dict:
    """Handler for ``encode`` (and ``scripts/generate_dense_embeddings.py``, whose ``output`` and ``device`` replace
    the flags'): flags to :func:`encode_with_model`, then a summary table naming the shard (its ``time`` the whole
    command's, model load included; ``encoding`` the seconds ``passages/s`` divides: encoding the passages, reading
    and fingerprinting the corpus left out, as ``retrieve``'s ``retrieval`` row leaves out loading). The output
    folder, the shard pair and the corpus path are checked before the model loads (which takes seconds to minutes).
    Under torchrun ranks other than 0 log warnings only, and each rank prints its own shard's table."""
    infos_from_rank_zero()  # under torchrun the ranks' lines would come once per rank
    started = time.perf_counter()
    job = from_args(EncodeJob, args)
    job = dataclasses.replace(job, output=output or job.output, device=device or job.device)
    with alike_on_every_rank():  # every torchrun rank checks the same flags and paths
        refuse_foreign_folder(job.output)
        resolve_shard(job.settings.shard_id, job.settings.num_shards)
        require_file(job.corpus, "--corpus file")
    manifest, seconds = encode_with_model(job)
    encoded = manifest["encoded"]  # a resumed or finished shard encoded fewer than its passages in this run
    rate = f"{encoded / seconds:.1f}" if encoded and seconds > 0 else "-"
    print(format_summary({"shard": f"{manifest['shard_id']} of {manifest['num_shards']}",
                          "passages": manifest["count"], "encoded this run": encoded, "encoding": seconds_text(seconds),
                          "passages/s": rate, "output": Path(job.output) / manifest["embeddings"]},
                         time.perf_counter() - started))
    return manifest
