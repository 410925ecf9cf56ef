"""FAISS indexes over passage embeddings: build from encode shards, save, load, search (inner product throughout).

FAISS row ``r`` of an index is corpus row ``r``: shards are added in ``start_row`` order and must cover a gap-free
range from row 0, so retrieval maps hits straight back to the corpus dataset with no id dictionary. An index folder
holds ``index.faiss`` (``faiss.write_index``), ``ids.txt`` (passage ids, one per row, for convenience) and, written
last, ``index_meta.json`` (model, dim, kind, parameters, row count, shards used). No pickles anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import itertools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping, Optional, Union

import numpy as np
from tqdm.auto import tqdm

from ..base.args import home_expanded, output_dir, positive_int
from ..base.cpus import cap_to_cpus
from ..base.errors import DprGcError, is_disk_full
from ..base.validate import Field, check_fields, count, positive_int as positive_field, text
from ..base.files import (PathLike, check_output_dir, is_stream, open_text, parse_json_file, read_json_object,
                          require_folder)
from ..base.guard import atomic_folder, check_outputs, guarded, remove_stale_folders
from ..base.locks import exclusive_lock
from ..base.tables import format_summary, seconds_text
from ..base.logs import counted, native_stderr_logged
from .index_params import (CENTROID_POINTS, IndexBuild, IndexParams, param_rules, refuse_kind_beside_factory,
                           refuse_training, refuse_training_for, refuse_unused)
from ..base.settings import add_arguments, from_args, setting, to_record
from .fingerprint import LEGACY_KEY, combined, disagreeing, records_agree
from .shards import open_shard, read_manifests, sample_embeddings, shard_ids, shard_name, shard_rows_from

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
META_FILE = "index_meta.json"
IDS_FILE = "ids.txt"
INDEX_FOLDER_FILES = (INDEX_FILE, META_FILE, IDS_FILE)
FORMAT_VERSION = 1
INDEX_META_FIELDS = {"format_version": Field(int), "kind": text(), "factory": text(), "metric": text(),
                     "dim": positive_field(), "ntotal": count(), "params": Field(dict), "model": text(True),
                     "model_from_index": text(True), "corpus": text(True), "corpus_from_index": text(True),
                     "corpus_rows": count(True),
                     "corpus_fingerprint": text(True), "model_fingerprint": text(True), LEGACY_KEY: text(True),
                     "pooling": text(True), "normalize": Field(bool, True), "passage_format": text(True),
                     "query_prefix": text(True), "passage_prefix": text(True), "shards": Field(list),
                     "trained_on": count(True), "trained_from": count(True), "max_length": positive_field(True),
                     "precision": text(True), "dtype": text(True),
                     "first_id": text(True), "last_id": text(True), "index_file": Field(list)}
PARAM_FIELDS = {"kind": text(), "factory": text(True), "pq_nbits": positive_field(True),
                **{key: positive_field(True) for key in ("ef_search", "nprobe", "hnsw_m", "ef_construction", "nlist",
                                                         "pq_m")}}
STAMP_BYTES = 1 << 20
# Compared with ==; the model fingerprint is compared through fingerprint.records_agree.
ENCODING_KEYS = ("dim", "pooling", "normalize", "passage_format")
# Encode's settings the vectors depend on, recorded since they are compared (absent from earlier indexes: an append
# to one compares the shards among themselves only, with a warning).
ENCODE_SETTING_KEYS = ("max_length", "precision", "dtype")
# The prefixes the passages were encoded under (encode's flags included); retrieve and mine default to them.
# Absent from indexes and shards of earlier versions, so they are compared only where both sides record them.
PREFIX_KEYS = ("query_prefix", "passage_prefix")


def _faiss() -> Any:
    import faiss

    return faiss


def cap_threads(threads: int) -> int:
    """``threads`` (a ``--threads`` value; 0 passes through) cut to the usable CPUs (see
    :func:`~dpr_gc.base.cpus.cap_to_cpus`): FAISS search and bm25s scoring are compute-bound, and OpenMP asked for
    tens of thousands of threads aborts ("Thread creation failed", or a segfault)."""
    return cap_to_cpus(threads, "--threads")


def set_threads(threads: Optional[int]) -> None:
    """Limit FAISS's OpenMP threads, at most to the CPUs (see :func:`cap_threads`); ``None`` keeps FAISS's default:
    all cores."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise DprGcError(f"--threads must be a positive integer, got {threads!r}")
        _faiss().omp_set_num_threads(cap_threads(threads))


def faiss_threads() -> int:
    """The OpenMP threads FAISS searches and adds with (``--threads``, else all cores)."""
    return int(_faiss().omp_get_max_threads())


def _search_parts(index: Any) -> tuple[list[str], list[str]]:
    """``(search parameters, what makes the search approximate)`` of a FAISS index, layer by layer; both empty for
    a flat index (exact search)."""
    faiss = _faiss()
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexFlat):
        return [], []
    if isinstance(index, faiss.IndexPreTransform):
        knobs, lossy = _search_parts(index.index)
        steps = [_transform_loss(faiss.downcast_VectorTransform(index.chain.at(i))) for i in range(index.chain.size())]
        steps = [step for step in steps if step]
        return knobs, steps + (lossy or (["flat"] if steps and not knobs else []))
    if isinstance(index, faiss.IndexRefine):
        knobs, lossy = _search_parts(index.base_index)
        refined = "exactly" if not any(_search_parts(index.refine_index)) else "by a finer index"
        return knobs, lossy + [f"{index.k_factor:g}x candidates re-ranked {refined}"]
    if isinstance(index, faiss.IndexHNSW):
        return [f"efSearch {index.hnsw.efSearch}"], _search_parts(index.storage)[1]
    if isinstance(index, faiss.IndexIVF):
        probed = f"nprobe {index.nprobe} of {counted(index.nlist, 'list')}" + \
            (" (all)" if index.nprobe >= index.nlist else "")
        return [probed], [] if isinstance(index, faiss.IndexIVFFlat) else [_codes(index)]
    if isinstance(index, faiss.IndexNSG):
        return [], ["NSG graph"] + _search_parts(index.storage)[1]
    return [], [_codes(index)]


def _other_metric(index: Any) -> str:
    """'' when every layer of a FAISS index ranks by inner product, else which one does not (FAISS gives HNSW over
    PQ codes the L2 metric whatever metric the factory is asked for)."""
    faiss = _faiss()
    other = next((layer for layer in _layers(index) if layer.metric_type != faiss.METRIC_INNER_PRODUCT), None)
    return "" if other is None else f"its {type(other).__name__} part ranking by the L2 distance"


def _layers(index: Any) -> Iterator[Any]:
    """A FAISS index and the indexes inside it (a transform's, a refinement's base, a graph's storage), downcast."""
    index = _faiss().downcast_index(index)
    yield index
    inner = next((getattr(index, name) for name in ("index", "base_index", "storage")
                  if getattr(index, name, None) is not None), None)
    if inner is not None:
        yield from _layers(inner)


def _hnsw_graphs(index: Any) -> Iterator[Any]:
    """The HNSW indexes in a FAISS index: itself, one behind a transform or under a refinement, an IVF quantizer."""
    faiss = _faiss()
    for layer in _layers(index):
        if isinstance(layer, faiss.IndexHNSW):
            yield layer
        if isinstance(layer, faiss.IndexIVF):
            yield from (inner for inner in _layers(layer.quantizer) if isinstance(inner, faiss.IndexHNSW))


def _widening(index: Any, k: int) -> Optional[Any]:
    """FAISS search parameters raising to ``k`` the beam of the HNSW graph whose search gives the hits (the index
    itself, or one behind transforms or under a refinement), for one search; None where there is no such graph or
    its beam is as wide. An IVF quantizer's beam finds the lists to probe, not the hits, and is left as it is."""
    faiss = _faiss()
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(efSearch=k) if index.hnsw.efSearch < k else None
    if isinstance(index, faiss.IndexPreTransform):
        inner = _widening(index.index, k)
        return None if inner is None else faiss.SearchParametersPreTransform(index_params=inner)
    if isinstance(index, faiss.IndexRefine):
        inner = _widening(index.base_index, k)
        return None if inner is None else faiss.IndexRefineSearchParameters(k_factor=index.k_factor,
                                                                             base_index_params=inner)
    return None


def _codes(index: Any) -> str:
    """The compressed codes a FAISS index searches (PQ or scalar quantizer), else its class name."""
    pq, sq = getattr(index, "pq", None), getattr(index, "sq", None)
    if pq is not None:
        return f"PQ{pq.M}{'' if pq.nbits == 8 else f'x{pq.nbits}'} codes"
    if sq is not None:
        names = {getattr(_faiss().ScalarQuantizer, n): n[3:] for n in dir(_faiss().ScalarQuantizer)
                 if n.startswith("QT_")}
        return f"SQ{names.get(sq.qtype, sq.qtype)} codes"
    return type(index).__name__


def _transform_loss(transform: Any) -> str:
    """What a FAISS vector transform loses for inner-product search ("" for a rotation that keeps every vector)."""
    faiss = _faiss()
    if transform.d_out == transform.d_in and (
            isinstance(transform, (faiss.OPQMatrix, faiss.RandomRotationMatrix)) or
            type(transform) is faiss.LinearTransform and transform.is_orthonormal and not transform.have_bias):
        return ""  # a rotation keeps every inner product
    if isinstance(transform, faiss.PCAMatrix) and transform.d_out == transform.d_in:
        return "PCA centring"  # (q - m).(p - m) moves each passage's score by its own -m.p: another ranking
    names = {faiss.PCAMatrix: "PCA", faiss.OPQMatrix: "OPQ", faiss.RandomRotationMatrix: "random rotation",
             faiss.NormalizationTransform: "L2 normalization", faiss.ITQTransform: "ITQ",
             faiss.LinearTransform: "projection"}  # FAISS reads an OPQ matrix back as a LinearTransform
    name = names.get(type(transform), type(transform).__name__)
    return f"{name} to {transform.d_out}" if transform.d_out < transform.d_in else name


def _pair_scores(index: Any, queries: np.ndarray, passages: np.ndarray) -> np.ndarray:
    """Row i: the score a search of the FAISS ``index`` gives ``passages[i]`` for ``queries[i]`` -- both through its
    transforms, the passage through its codes (encoded, then decoded), their inner product; a refined index's scores
    are its refinement's, a graph's its storage's. :class:`Unscorable` names a part that scores otherwise."""
    faiss = _faiss()
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        for i in range(index.chain.size()):
            step = faiss.downcast_VectorTransform(index.chain.at(i))
            queries, passages = step.apply(queries), step.apply(passages)
        return _pair_scores(index.index, queries, passages)
    inner = next((getattr(index, name) for kind, name in ((faiss.IndexRefine, "refine_index"),
                  (faiss.IndexHNSW, "storage"), (faiss.IndexNSG, "storage")) if isinstance(index, kind)), None)
    if inner is not None:
        return _pair_scores(inner, queries, passages)
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise Unscorable(f"its {type(index).__name__} part ranks by another metric than the inner product")
    try:
        decoded = index.sa_decode(index.sa_encode(np.ascontiguousarray(passages, dtype=np.float32)))
    except RuntimeError:
        raise Unscorable(f"its {type(index).__name__} part cannot encode a vector on its own") from None
    return np.einsum("nd,nd->n", queries, decoded)


class Unscorable(DprGcError):
    """A FAISS index whose search scores cannot be computed for given vectors (:meth:`DenseIndex.pair_scores`)."""


class FaissRefused(DprGcError):
    """FAISS refused to add vectors to an index of this factory string (whatever the vectors)."""


class DenseIndex:
    """A FAISS inner-product index plus its metadata (a JSON-ready dict) — small verbs, as in FAISS."""

    def __init__(self, index: Any, meta: dict[str, Any]) -> None:
        self.index = index
        self.meta = meta

    @classmethod
    def build(cls, dim: int, params: IndexParams) -> "DenseIndex":
        """An empty index of ``dim`` dimensions; IVF/PQ kinds must be :meth:`train`-ed before :meth:`add`."""
        faiss = _faiss()
        if dim < 1:
            raise DprGcError(f"embedding dimension must be positive, got {dim}")
        factory = params.factory_string(dim)
        try:
            index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        except (RuntimeError, MemoryError) as e:  # MemoryError: a factory string's sizes too large to allocate
            raise DprGcError(f"FAISS cannot build index {factory!r} for dimension {dim}: "
                             f"{_faiss_message(e)}; check --factory / --pq-m") from None
        other = _other_metric(index)
        if other:
            raise DprGcError(f"FAISS builds index {factory!r} with {other}, whatever metric it is asked for, so its "
                             "search would rank passages by distance, not by score; choose another --factory (e.g. "
                             "'HNSW32,Flat', or 'IVF4096,PQ64' for compressed codes)")
        for graph in _hnsw_graphs(index):  # before anything is added (an IVF quantizer's: before training)
            graph.hnsw.efConstruction = params.ef_construction
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None and hasattr(faiss.downcast_index(ivf), "do_polysemous_training"):
            # Polysemous training (on by default for IVF-PQ) only serves Hamming-filtered search, which is not
            # used here, and makes training ~10x slower.
            faiss.downcast_index(ivf).do_polysemous_training = False
        meta = {"format_version": FORMAT_VERSION, "kind": params.kind, "factory": factory, "metric": "inner_product",
                "dim": dim, "params": dataclasses.asdict(params)}
        dense = cls(index, meta)
        dense._apply_search_params(params.ef_search, params.nprobe, strict=False)
        return dense

    # ------------------------------------------------------------------------------------------- properties
    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self.index.is_trained)

    def search_settings(self, k: Optional[int] = None, flags: bool = True) -> str:
        """How a search runs, read from the FAISS index's structure: HNSW's ``efSearch`` and IVF's ``nprobe`` where
        it has them, then what else makes it approximate (a lossy transform, compressed codes, a graph); "exact"
        only for a flat index over the vectors as given, else "approximate (...)" naming why. With ``k`` (the
        ``--top-k`` of a search, "the top-k" without ``flags``), the ``efSearch`` that search runs with:
        :meth:`search` raises a narrower one to ``k`` (at most the vectors) for that search only."""
        knobs, lossy = _search_parts(self.index)
        widened = self._widened_ef(k) if k is not None else None
        if widened is not None:
            cut = "" if widened == k else f", cut to the {counted(self.ntotal, 'vector')}"
            knobs = [f"efSearch {widened} (raised to {'--top-k' if flags else 'the top-k'} {k}{cut})"] + knobs[1:]
        if knobs:
            return ", ".join(knobs + lossy)
        return f"approximate ({', '.join(lossy)})" if lossy else "exact"

    def search_flags(self, flags: bool = True) -> list[str]:
        """The ``retrieve`` flags that widen this index's search (``--nprobe`` for an IVF part, ``--ef-search`` for
        an HNSW one), or without ``flags`` the FAISS parameters they set (``nprobe``, ``efSearch``, as
        :meth:`set_search_params` takes them): where a search returns fewer hits than asked, raising them reaches
        more."""
        faiss = _faiss()
        layers = list(_layers(self.index))
        return ([flag if flags else name for flag, name, kind in (("--nprobe", "nprobe", faiss.IndexIVF),
                                                                   ("--ef-search", "efSearch", faiss.IndexHNSW))
                 if any(isinstance(layer, kind) for layer in layers)])

    def _widened_ef(self, k: int) -> Optional[int]:
        """The ``efSearch`` a top-``k`` search raises a narrower beam of the HNSW graph giving the hits to (``k``,
        at most the vectors), or None where it searches with the index's own (no such graph, or a beam as wide)."""
        depth = min(k, self.ntotal)
        return depth if _widening(self.index, depth) is not None else None

    # ------------------------------------------------------------------------------------------- verbs
    def _matrix(self, x: np.ndarray, what: str) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.dim:
            model = self.meta.get("model")
            built = f" (built from model {model})" if model else ""
            raise DprGcError(f"{what} have shape {tuple(x.shape)} but the index holds {self.dim}-dimensional "
                             f"vectors{built}; use the same model (and projection) for passages and queries")
        return np.ascontiguousarray(x, dtype=np.float32)

    def train(self, sample: np.ndarray, available: Optional[int] = None) -> None:
        """Train quantizers on ``sample`` (a no-op for Flat/HNSW); must happen before anything is added.
        ``available``: the vectors the sample was drawn from, so a failure's advice says what can help."""
        if self.is_trained:
            return
        sample = self._matrix(sample, "training vectors")
        too_many = self._training_advice(len(sample), available, fixes_only=True)
        if too_many:  # FAISS would fail only after training what comes first (an OPQ rotation: minutes)
            raise DprGcError(f"training the {self.meta['factory']} index on {len(sample)} vectors cannot work "
                             "(each IVF list and PQ centroid needs a training vector of its own), so it was not "
                             f"started; {too_many}")
        try:
            with native_stderr_logged(logger, "FAISS"):  # e.g. its warning on too few training points
                self.index.train(sample)
        except RuntimeError as e:
            raise DprGcError(f"training the {self.meta['factory']} index on {len(sample)} vectors failed: "
                             f"{_faiss_message(e)}; {self._training_advice(len(sample), available)}") from None
        advice = self._training_advice(len(sample), available, CENTROID_POINTS, fixes_only=True)
        if advice:  # FAISS trained, warning of too few points per centroid (its line above names no flag)
            logger.warning("%d training vectors are fewer than the %d per IVF list / PQ centroid k-means wants, "
                           "so the centroids are rough: %s", len(sample), CENTROID_POINTS, advice)

    def _training_advice(self, n: int, available: Optional[int], per_centroid: int = 1,
                         fixes_only: bool = False) -> str:
        """What can make training on ``n`` vectors (of ``available``) work: FAISS trains at most one centroid per
        vector (k-means wants ``per_centroid``), so the IVF lists and PQ centroids (2**bits) too many are lowered,
        written as they were given (a flag or the --factory string); --train-sample is named only where the
        embeddings hold more vectors. With ``fixes_only``, "" where nothing is too many."""
        faiss, factory = _faiss(), self.meta.get("kind") == "factory"
        layers = list(_layers(self.index))
        ivf = next((layer for layer in layers if isinstance(layer, faiss.IndexIVF)), None)
        pq = next((layer.pq for layer in layers if getattr(layer, "pq", None) is not None), None)
        limit = max(n // per_centroid, 1)
        fixes, need, bits = [], 0, max(limit.bit_length() - 1, 1)
        string = f"in --factory {self.meta['factory']!r}"
        if ivf is not None and ivf.nlist > limit:
            need = int(ivf.nlist) * per_centroid
            fixes.append(f"IVF{ivf.nlist} {string} to at most IVF{limit}" if factory
                         else f"--nlist to at most {limit}")
        if pq is not None and pq.ksub > limit:
            need = max(need, int(pq.ksub) * per_centroid)
            fixes.append(f"PQ{pq.M}x{pq.nbits} {string} to at most PQ{pq.M}x{bits}" if factory
                         else f"--pq-nbits to at most {bits}")
        if fixes_only and not fixes:
            return ""
        if not fixes:
            return "check --factory" if factory else "raise --train-sample or lower --nlist / --pq-nbits"
        lower = "lower " + " and ".join(fixes)
        if available is None:
            return f"raise --train-sample or {lower}"
        if n < available and need <= available:
            return f"raise --train-sample to at least {need} (the embeddings hold {available} vectors), or {lower}"
        took = f" and --train-sample takes {n} of them" if n < available else ""
        return f"the embeddings hold only {available} vectors{took}: {lower}"

    def _finite(self, embeddings: np.ndarray) -> np.ndarray:
        """``embeddings`` as the float32 matrix FAISS adds, refused when it holds NaN or infinite values."""
        block = self._matrix(embeddings, "embeddings")
        if not np.isfinite(block).all():
            raise DprGcError("embeddings contain NaN or infinite values; re-encode (fp16 overflow?) before indexing")
        return block

    def add(self, embeddings: np.ndarray) -> None:
        """Append vectors; their FAISS rows continue from :attr:`ntotal`."""
        if not self.is_trained:
            raise DprGcError(f"the {self.meta['factory']} index must be trained before vectors are added")
        block = self._finite(embeddings)
        try:
            self.index.add(block)
        except RuntimeError as e:  # e.g. an NSG graph over fewer than 100 vectors
            raise FaissRefused(f"FAISS cannot build index {self.meta['factory']!r} from these embeddings: "
                               f"{_faiss_message(e)}; check --factory") from None

    def set_search_params(self, ef_search: Optional[int] = None, nprobe: Optional[int] = None) -> None:
        """Change HNSW ``efSearch`` / IVF ``nprobe``; an error if the index has no such parameter."""
        self._apply_search_params(ef_search, nprobe, strict=True)

    def _apply_search_params(self, ef_search: Optional[int], nprobe: Optional[int], strict: bool) -> None:
        space = _faiss().ParameterSpace()
        for name, field, value in (("efSearch", "ef_search", ef_search), ("nprobe", "nprobe", nprobe)):
            if value is None:
                continue
            flag, rule = param_rules()[field]  # the flag's range: FAISS overflows beyond it
            if not rule.accepts(value):
                raise DprGcError(f"{flag} must be {rule.__name__}, got {value!r}")
            try:
                space.set_index_parameter(self.index, name, int(value))
            except RuntimeError:
                if strict:
                    raise DprGcError(f"{flag} does not apply to the {self.meta['factory']} index; drop the "
                                     "flag") from None
                continue
            self.meta["params"][field] = int(value)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` by inner product: ``(scores float32 [n, k], rows int64 [n, k])``; row -1 marks no hit."""
        if k < 1:
            raise DprGcError(f"--top-k must be a positive integer, got {k}")
        if self.ntotal == 0:
            raise DprGcError("the index is empty; build it from encoded passages first (dpr-gc index)")
        queries = self._matrix(queries, "query vectors")
        k = min(k, self.ntotal)
        widened = _widening(self.index, k)  # an HNSW beam narrower than k returns fewer than k hits
        if widened is not None:
            scores, rows = self.index.search(queries, k, params=widened)
        else:
            scores, rows = self.index.search(queries, k)
        return scores, rows.astype(np.int64, copy=False)

    def pair_scores(self, queries: np.ndarray, passages: np.ndarray) -> np.ndarray:
        """Row i: the score a search of this index gives the passage vector ``passages[i]`` for ``queries[i]``, so a
        passage not among a search's hits (a positive) compares with those hits: the inner product after the
        index's transforms (PCA centres and projects), with the passage through its compressed codes -- the dot
        product for a flat index; for fast-scan PQ codes, up to the rounding of their lookup tables. Raises
        :class:`Unscorable` for an index that scores otherwise (HNSW over PQ codes ranks by L2)."""
        q, p = self._matrix(queries, "query vectors"), self._matrix(passages, "passage vectors")
        if len(q) != len(p):
            raise ValueError(f"{len(q)} query vectors for {len(p)} passage vectors; pair_scores takes one of each")
        return _pair_scores(self.index, q, p)

    # ------------------------------------------------------------------------------------------- persistence
    def write(self, folder: PathLike, ids: Optional[Iterable[str]] = None) -> Path:
        """Write ``index.faiss``, ``ids.txt`` (when ``ids`` is given) and ``index_meta.json`` into a new folder that
        then replaces ``folder`` whole (:func:`~dpr_gc.base.guard.atomic_folder`): a reader, a kill or a full disk
        sees the old build or the new one, never parts of both. A non-empty folder holding no index is refused."""
        out = check_index_folder(folder)
        with atomic_folder(out) as tmp:
            self._write_files(tmp, ids, out)
        return out

    def _write_files(self, out: Path, ids: Optional[Iterable[str]], folder: Path) -> None:
        """The three files of an index folder, into the new (still hidden) folder ``out`` that replaces ``folder``
        (the folder errors name)."""
        try:  # through Python's file: FAISS's own writer only prints a failed close (a full disk) and goes on
            with open(out / INDEX_FILE, "wb") as f:
                _faiss().write_index(self.index, _faiss().PyCallbackIOWriter(f.write))
        except RuntimeError as e:
            if is_disk_full(e):
                raise  # atomic_folder names the index folder and removes the unfinished one
            raise DprGcError(f"{out / INDEX_FILE}: cannot write the index ({_faiss_message(e)})") from None
        self.meta["index_file"] = file_stamp(out / INDEX_FILE)  # readers pair this metadata with this very file
        if ids is not None:
            n, first, last = 0, None, None
            with open(out / IDS_FILE, "w", encoding="utf-8") as f:
                for pid in ids:
                    last = pid.rstrip("\r\n")
                    first = last if first is None else first
                    f.write(last + "\n")
                    n += 1
            if n != self.ntotal:
                raise DprGcError(f"{folder}: {n} passage ids for {self.ntotal} index rows; the shards' ids files "
                                 "do not match their embeddings, re-encode them")
            self.meta.update(first_id=first, last_id=last)
        self.meta.update(ntotal=self.ntotal, dim=self.dim, faiss_version=_faiss().__version__)
        with open(out / META_FILE, "w", encoding="utf-8") as f:
            json.dump(self.meta, f, indent=2, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def read(cls, folder: PathLike) -> "DenseIndex":
        """Load an index folder written by :meth:`write`, restoring its search parameters; the metadata and the
        vectors come from one build even while ``index`` replaces the folder (see :func:`_read_one_build`)."""
        folder = Path(folder)
        index, meta = _read_one_build(folder)
        other = _other_metric(index)
        if other:
            raise DprGcError(f"{folder}: its FAISS index ({meta.get('factory')!r}) was built with {other}, so its "
                             "search ranks passages by distance, not by score; rebuild it with dpr-gc index and "
                             "another --factory")
        dense = cls(index, meta)
        params = meta.get("params") or {}
        dense._apply_search_params(params.get("ef_search"), params.get("nprobe"), strict=False)
        return dense


def check_index_folder(folder: PathLike) -> Path:
    """``folder`` as a Path, refused if it holds anything but an index's own files (it is replaced whole, and what
    else it holds -- a model the shards were encoded with, a user's notes -- would go with it)."""
    out = Path(folder)
    if not out.is_dir():
        return out
    others = sorted(p.name for p in out.iterdir() if p.name not in INDEX_FOLDER_FILES)  # hidden ones too
    if others and not index_exists(out):
        raise DprGcError(f"{out} is a folder that holds no index; it would be replaced whole, so give a new or "
                         "empty folder")
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise DprGcError(f"{out} holds {shown} beside its index; the folder is replaced whole, so move them out "
                         "first or give another --output")
    return out


def file_stamp(path: Union[Path, IO[bytes]]) -> list:
    """``[size, digest of the first and last MiB]`` of an index file (a path, or a file open for reading): another
    build has another stamp, a copy of the folder keeps it, and reading it costs 2 MiB however large the index."""
    import hashlib

    with (open(path, "rb") if isinstance(path, Path) else contextlib.nullcontext(path)) as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.blake2b(digest_size=16)
        digest.update(os.pread(f.fileno(), STAMP_BYTES, 0))
        if size > STAMP_BYTES:
            digest.update(os.pread(f.fileno(), STAMP_BYTES, max(STAMP_BYTES, size - STAMP_BYTES)))
    return [size, digest.hexdigest()]


def check_meta(meta: Any, path: PathLike) -> dict:
    """Typed fields and ranges of ``index_meta.json``; a saved parameter outside its flag's range (an edited file, or
    one written before the ranges were checked) is refused, as FAISS would overflow or fail every search on it."""
    check_fields(meta, path, INDEX_META_FIELDS, "index metadata", required=("format_version", "ntotal", "dim"))
    if meta["format_version"] != FORMAT_VERSION:
        raise DprGcError(f"{path}: not a dpr-gc index (format_version {FORMAT_VERSION} expected); rebuild it")
    params = check_fields(meta.get("params") or {}, f"{path} (params)", PARAM_FIELDS, "index parameters")
    for name, (flag, rule) in param_rules().items():
        if params.get(name) is not None and not rule.accepts(params[name]):
            raise DprGcError(f"{path}: the saved {name} {params[name]} is outside what {flag} takes "
                             f"({rule.__name__}), so FAISS would fail on it; rebuild the index with 'dpr-gc index'")
    return meta


class _Replaced(Exception):
    """The index folder was replaced (by rename) while it was being read: read the new one."""


def _read_one_build(folder: Path, attempts: int = 100) -> tuple[Any, dict]:
    """The FAISS index and the metadata of one and the same build. The folder is opened once and both files are
    read through that handle, so a rebuild swapping the folder by rename cannot hand us one build's metadata and
    the other's vectors; a folder replaced while read, or caught between the two renames of a swap, is read again."""
    for _ in range(attempts):
        try:
            return _read_pinned(folder)
        except _Replaced:
            continue
        except FileNotFoundError:
            if not _being_replaced(folder):
                break  # no rebuild under way: the folder or a file is simply missing
        except NotADirectoryError:
            break  # a file where the folder (or one above it) should be
        time.sleep(0.01)
    raise DprGcError(f"no complete index in {folder} (need {INDEX_FILE} and {META_FILE}); build one with "
                     "'dpr-gc index --embeddings DIR --output DIR'")


def _being_replaced(folder: Path) -> bool:
    """Whether a missing ``folder`` is in the middle of a swap: the old build moved aside (``.NAME.*.old``), or the
    swap finished since we looked (the folder is back)."""
    moved = folder.parent.is_dir() and any(folder.parent.glob(f".{glob.escape(folder.name)}.*.old"))
    return moved or folder.is_dir() and (folder / META_FILE).is_file()


def _replaced(folder: Path, dir_fd: int) -> bool:
    """Whether ``folder`` no longer names the folder open as ``dir_fd``."""
    try:
        return os.stat(folder).st_ino != os.fstat(dir_fd).st_ino
    except FileNotFoundError:
        return True


def _read_pinned(folder: Path) -> tuple[Any, dict]:
    """Read ``folder``'s metadata and index through one open handle of the folder (``FileNotFoundError``: missing,
    :class:`_Replaced`: swapped while read)."""
    meta_path, index_path = folder / META_FILE, folder / INDEX_FILE
    dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        with open(os.open(META_FILE, os.O_RDONLY, dir_fd=dir_fd), "rb") as f:
            text = f.read().decode("utf-8", errors="strict")
        meta = check_meta(parse_json_file(text, meta_path), meta_path)
        with open(os.open(INDEX_FILE, os.O_RDONLY, dir_fd=dir_fd), "rb") as f:
            stamp = file_stamp(f)
            try:
                index = _faiss().read_index(_faiss().PyCallbackIOReader(f.read, 1 << 20))
            except RuntimeError as e:
                raise DprGcError(f"{index_path}: cannot read FAISS index ({_faiss_message(e)}); rebuild it") from None
    except UnicodeDecodeError:
        raise DprGcError(f"{meta_path}: not valid UTF-8; rebuild the index") from None
    except FileNotFoundError:
        if _replaced(folder, dir_fd):
            raise _Replaced from None
        raise
    finally:
        os.close(dir_fd)
    if meta.get("index_file", stamp) != stamp:
        raise DprGcError(f"{folder}: {META_FILE} does not belong to this {INDEX_FILE} (the folder was assembled "
                         "from two builds); rebuild the index")
    if index.ntotal != meta.get("ntotal") or index.d != meta.get("dim"):
        raise DprGcError(f"{folder}: {INDEX_FILE} ({index.ntotal} x {index.d}) disagrees with {META_FILE} "
                         f"({meta.get('ntotal')} x {meta.get('dim')}); rebuild the index")
    return index, meta


def _faiss_message(error: Exception) -> str:
    """FAISS's C++ errors span several lines ending in the reason; keep the reason only."""
    lines = str(error).strip().splitlines()
    last = lines[-1] if lines else ""
    reason = re.search(r":\d+: (.*)$", last) if "Error in" in last else None
    return reason.group(1) if reason else last


# ----------------------------------------------------------------------------------------------- from shards
def read_ids(folder: PathLike) -> Iterator[str]:
    """Stream the passage ids of an index folder, one per FAISS row."""
    with open_text(Path(folder) / IDS_FILE) as f:
        for line in f:
            yield line.rstrip("\n")


def _encoding_of(meta: dict) -> dict:
    return {k: meta.get(k) for k in (*ENCODING_KEYS, *ENCODE_SETTING_KEYS)}


def _append_differences(index_meta: dict, manifests: list[dict]) -> list[str]:
    """What shards to be appended record otherwise than the index (each named with both values), else []. Encode
    settings an index of an earlier version does not record are not compared (:func:`_check_shards` warns)."""
    first, found = manifests[0], []
    for key, value in _encoding_of(first).items():
        if (key in index_meta or key not in ENCODE_SETTING_KEYS) and index_meta.get(key) != value:
            found.append(f"{key} {value!r} (the index: {index_meta.get(key)!r})")
    if disagreeing([index_meta, *manifests]):
        found.append(f"the model's weights (model {first.get('model')}; the index: {index_meta.get('model')}; "
                     "their fingerprints differ)")
    if index_meta.get("corpus_rows") != first.get("corpus_rows"):
        found.append(f"{first.get('corpus_rows')} corpus rows (the index: {index_meta.get('corpus_rows')})")
    elif index_meta.get("corpus_fingerprint") != first.get("corpus_fingerprint"):
        found.append(f"the corpus's content ({first.get('corpus')}; the index: {index_meta.get('corpus')}; as many "
                     "rows, other text)")
    return found


def _check_prefixes(records: list[dict], emb_dir: PathLike) -> None:
    """Refuse shards (or shards and an index) encoded under different passage prefixes."""
    seen = {r["passage_prefix"] for r in records if "passage_prefix" in r}
    if len(seen) > 1:
        raise DprGcError(f"embeddings in {emb_dir} and the index were encoded with different passage prefixes "
                         f"({' vs '.join(map(repr, sorted(seen)))}); encode them with one prefix")


def _check_shards(manifests: list[dict], dense: Optional[DenseIndex], emb_dir: PathLike) -> None:
    """Refuse, in one line, shards encoded otherwise than one another or (appending) than the index ``dense``: the
    model, corpus and encode settings (those of one folder's shards are compared as they are read,
    :func:`~.shards.read_manifests`; ``test_an_append_of_shards_encoded_otherwise_is_refused``)."""
    _check_prefixes(manifests + ([dense.meta] if dense is not None else []), emb_dir)
    if dense is None:
        return
    differences = _append_differences(dense.meta, manifests)
    if differences:
        raise DprGcError(f"embeddings in {emb_dir} do not match the index: {'; '.join(differences)}; encode the same "
                         "corpus with the same model and encode settings, or build a new index in another folder")
    unrecorded = [key for key in ENCODE_SETTING_KEYS if key not in dense.meta]
    if unrecorded:
        logger.warning("the index records no %s (built before dpr-gc recorded them), so the shards appended cannot "
                       "be checked against how its passages were encoded; rebuild the index to get that check",
                       ", ".join(unrecorded))


def _shards_to_add(manifests: list[dict], first_row: int, allow_partial: bool, emb_dir: PathLike) -> list[dict]:
    """The shards continuing the index's ``first_row`` rows (:func:`~.shards.shard_rows_from`); with
    ``allow_partial`` those after a shard not encoded yet wait for it, named in a warning
    (``test_allow_partial_indexes_the_shards_before_one_still_being_encoded``)."""
    todo, waiting = shard_rows_from(manifests, first_row, allow_partial)
    if not waiting:
        return todo
    missing = int(todo[-1]["start_row"]) + int(todo[-1]["count"]) if todo else first_row
    names = ", ".join(shard_name(m["shard_id"], m["num_shards"]) for m in waiting)
    if not todo and not first_row:
        raise DprGcError(f"nothing to index in {emb_dir} yet: corpus rows {missing}..{int(waiting[0]['start_row']) - 1}"
                         f" are not encoded, and the shards after them ({names}) wait for them, since FAISS rows must "
                         "equal corpus rows; encode the first shard, then index")
    logger.warning("left out %s (from corpus row %d): they wait for rows %d..%d, whose shard is not encoded yet, "
                   "since FAISS rows must equal corpus rows; a later `dpr-gc index --append` adds them", names,
                   int(waiting[0]["start_row"]), missing, int(waiting[0]["start_row"]) - 1)
    return todo


def add_shards(emb_dir: PathLike, params: IndexParams, dense: Optional[DenseIndex] = None,
               train_sample: int = 100_000, block_size: int = 65_536, seed: int = 0,
               allow_partial: bool = False) -> tuple[DenseIndex, list[dict], dict[str, Any]]:
    """Add the shards of ``emb_dir`` not yet in ``dense`` (a new index when ``None``), in memory.

    A new trained kind first trains on a random sample of ``train_sample`` vectors (``train_sample`` or ``seed``
    other than its default is refused for one that trains nothing, which would ignore it); vectors are then added
    shard by shard in blocks of ``block_size`` rows read from memory-mapped ``.npy`` files, so memory holds the
    index and not every embedding besides -- except for an NSG graph, which FAISS builds in one add of all its
    vectors: they are gathered into one array, and appending to such an index is refused. Returns ``(index, shards
    added, timings)``; the shards added are none when ``dense`` already holds every shard.
    """
    IndexBuild(train_sample=train_sample, block_size=block_size, seed=seed)  # the flags' checks and errors
    manifests = read_manifests(emb_dir, complete=not allow_partial)
    first = manifests[0]
    _check_shards(manifests, dense, emb_dir)
    todo = _shards_to_add(manifests, dense.ntotal if dense else 0, allow_partial, emb_dir)
    if not todo and dense is not None:  # a rerun of a finished append: nothing to do, and no error
        return dense, [], {"train_vectors": 0, "train_seconds": 0.0, "add_seconds": 0.0}
    if not todo:
        raise DprGcError(f"nothing to add: the shards in {emb_dir} hold no rows")
    one_add = _refuse_a_second_add(dense, params, todo, first, emb_dir)
    for m in todo:
        open_shard(m, check_ids=True)
    stats = {"train_vectors": 0, "train_seconds": 0.0}
    fingerprint = combined([*manifests, *([dense.meta] if dense is not None else [])])
    if dense is None:
        dense, stats = _new_index(first, todo, params, train_sample, seed)
    else:
        logger.info("appending to the %s index of %s (search: %s); FAISS threads %d", dense.meta["factory"],
                    counted(dense.ntotal, "vector"), dense.search_settings(), faiss_threads())
        meta = dense.meta
        stats["training_kept"] = ({"trained_on": int(meta["trained_on"]), "trained_from": meta.get("trained_from"),
                                   "held_before": dense.ntotal} if meta.get("trained_on") else None)
    dense.meta.update(fingerprint)
    started = time.perf_counter()
    _add_blocks(dense, todo, block_size, one_add)
    stats["add_seconds"] = round(time.perf_counter() - started, 3)
    if stats.get("training_kept"):
        _warn_kept_training(dense, stats["training_kept"]["held_before"])
    return dense, todo, stats


def _one_add_part(factory: Optional[str]) -> str:
    """The part of an index of ``factory`` that FAISS builds in one add of all its vectors, refusing a second add
    ("NSG graph"), else ""."""
    return "NSG graph" if factory and "NSG" in factory.upper() else ""


def _refuse_a_second_add(dense: Optional[DenseIndex], params: IndexParams, todo: list[dict], first: dict,
                         emb_dir: PathLike) -> str:
    """Refuse, in one line, to append the shards ``todo`` to an index FAISS built in one add (NSG), or to build one
    over some corpus rows only (``--allow-partial``), which could never take the rest; returns the part built in
    one add ("" for an index taking vectors block by block)."""
    factory = dense.meta["factory"] if dense is not None else params.factory
    part = _one_add_part(factory)
    if not part:
        return ""
    if dense is not None and todo:
        vectors = counted(sum(int(m["count"]) for m in todo), "vector")
        raise DprGcError(f"--append: the {factory} index built its {part} in one add and cannot take the {vectors} "
                         f"of {emb_dir} it lacks; build a new index over all the shards without --append")
    end, rows = (int(todo[-1]["start_row"]) + int(todo[-1]["count"]) if todo else 0), first.get("corpus_rows")
    if dense is None and rows is not None and end < int(rows):
        raise DprGcError(f"--allow-partial: the {factory} index builds its {part} in one add and could not take "
                         f"corpus rows {end}..{int(rows) - 1}, not encoded yet, later; wait for their shards, then "
                         "index without --allow-partial")
    return part


def _add_blocks(dense: DenseIndex, todo: list[dict], block_size: int, one_add: str) -> None:
    """Add the rows of the shards ``todo`` to ``dense`` in blocks of ``block_size`` read from memory-mapped files,
    naming the shard and rows of a block refused; an index built in one add (``one_add``: its part, an NSG graph)
    gets them all in one add, gathered in memory block by block."""
    total = sum(int(m["count"]) for m in todo)
    gathered = np.empty((total, dense.dim), np.float32) if one_add else None
    if one_add:
        logger.info("its %s is built in one add: gathering all %s (%.1f MiB as float32) in memory, whatever "
                    "--block-size", one_add, counted(total, "vector"), total * dense.dim * 4 / 2 ** 20)
    at = 0
    with tqdm(total=total, desc="adding to index", unit=" vectors", disable=None) as bar:
        for m in todo:
            arr = open_shard(m)
            for s in range(0, len(arr), block_size):
                block = arr[s:s + block_size]
                try:
                    if gathered is None:
                        dense.add(block)
                    else:
                        gathered[at:at + len(block)] = dense._finite(block)
                except FaissRefused:  # the index's fault (its --factory), not these rows'
                    raise
                except DprGcError as e:  # name the shard (and rows) whose vectors were refused
                    raise DprGcError(f"{m['embeddings']} (rows {s}-{s + len(block) - 1}): {e}") from None
                at += len(block)
                bar.update(len(block))
            dense.meta["shards"].append({"embeddings": Path(m["embeddings"]).name, "start_row": int(m["start_row"]),
                                         "count": int(m["count"])})
    if gathered is not None:
        dense.add(gathered)


def _new_index(first: dict, todo: list[dict], params: IndexParams, train_sample: int,
               seed: int) -> tuple[DenseIndex, dict[str, Any]]:
    """A new index for the shards ``todo`` (``first``: the folder's first manifest), its parameters resolved from
    the data and logged, trained on a sample when its kind needs it; returns it and the training statistics."""
    dim, total = int(first["dim"]), sum(int(m["count"]) for m in todo)
    resolved = params.resolve(dim, total, min(train_sample, total))
    dense = DenseIndex.build(dim, resolved)
    if dense.is_trained:  # FAISS needs no training for it: a training sample or seed given would be ignored
        refuse_training_for(params, IndexBuild(train_sample=train_sample, seed=seed))
    logger.info("building %s over %s%s; search: %s; FAISS threads %d", dense.meta["factory"],
                counted(total, "vector"), resolved.describe_picked(params), dense.search_settings(), faiss_threads())
    dense.meta.update(_encoding_of(first), **{k: first[k] for k in PREFIX_KEYS if k in first},
                      model=first.get("model"), corpus=first.get("corpus"), corpus_rows=first.get("corpus_rows"),
                      corpus_fingerprint=first.get("corpus_fingerprint"), shards=[])
    stats: dict[str, Any] = {"train_vectors": 0, "train_seconds": 0.0}
    if not dense.is_trained:
        started = time.perf_counter()
        sample = sample_embeddings(todo, train_sample, seed)
        logger.info("training %s on %s", dense.meta["factory"], counted(len(sample), "vector"))
        dense.train(sample, available=total)
        stats = {"train_vectors": len(sample), "train_seconds": round(time.perf_counter() - started, 3)}
        dense.meta["trained_from"] = total
    dense.meta["trained_on"] = stats["train_vectors"]
    if stats["train_vectors"]:
        _warn_partial_training(dense, first.get("corpus_rows"), resolved.nlist if params.nlist is None else None)
    return dense, stats


def _trained_parts(dense: DenseIndex) -> str:
    """What training fixed in ``dense`` and an append keeps, in words ("IVF lists", "PQ codebooks", ...)."""
    faiss, parts = _faiss(), []
    for layer in _layers(dense.index):
        if isinstance(layer, faiss.IndexPreTransform):
            parts.append("transform")
        if isinstance(layer, faiss.IndexIVF):
            parts.append("IVF lists")
        if getattr(layer, "pq", None) is not None:
            parts.append("PQ codebooks")
        if getattr(layer, "sq", None) is not None:
            parts.append("scalar quantizer")
    return " and ".join(parts) or "trained parts"


def _training_covered(meta: Mapping[str, Any], before: Optional[int] = None, when: str = " at its build") -> str:
    """The vectors an index's training sample was drawn from, in words: "the N vectors present at its build" (or "a
    sample of S of the N ..."); for an index of an earlier version, which does not record them, at most ``before``
    (the vectors it held before this append)."""
    sample, pool = int(meta.get("trained_on") or 0), meta.get("trained_from")
    if pool is None:
        return f"{sample} vectors, drawn from at most the {before} it held before this append"
    return (f"the {pool} vectors present{when}" if sample >= int(pool)
            else f"a sample of {sample} of the {pool} vectors present{when}")


def _warn_partial_training(dense: DenseIndex, corpus_rows: Optional[int], picked_nlist: Optional[int]) -> None:
    """Warn, in one line, that an index trained over some corpus rows only (``--allow-partial``) keeps that training
    when ``--append`` adds the rest, so it is not the index built all at once (``picked_nlist``: its IVF lists where
    their number was picked from the vectors present)."""
    if corpus_rows is None or int(dense.meta["trained_from"]) >= int(corpus_rows):
        return
    logger.warning("--allow-partial: the %s index's %s are trained on %s (of %d corpus rows%s), and a later --append "
                   "keeps them; once every shard is encoded, build it again without --append for the index built all "
                   "at once", dense.meta["factory"], _trained_parts(dense), _training_covered(dense.meta, when=""),
                   int(corpus_rows),
                   f"; --nlist {picked_nlist} picked for them" if picked_nlist else "")


def _warn_kept_training(dense: DenseIndex, before: int) -> None:
    """Warn, in one line, that ``--append`` kept the training of ``dense`` (which held ``before`` vectors), drawn from
    fewer vectors than it now holds, so it is not the index built all at once over them."""
    pool = dense.meta.get("trained_from")
    if pool is not None and int(pool) >= dense.ntotal:
        return
    logger.warning("--append keeps the training of the %s index: its %s were trained on %s, and it now holds %d; "
                   "build it again without --append for the index built all at once", dense.meta["factory"],
                   _trained_parts(dense), _training_covered(dense.meta, before), dense.ntotal)


def build_index(emb_dir: PathLike, out_dir: PathLike, params: Union[IndexParams, Mapping[str, Any]],
                build: Optional[IndexBuild] = None, *, append: bool = False, allow_partial: bool = False,
                **options: Any) -> dict[str, Any]:
    """Build the index in ``out_dir`` from the encode shards in ``emb_dir`` (see :func:`add_shards`) as ``build``
    says (fields of :class:`IndexBuild` may also be given as keywords, checked as the flags are, before anything
    is read or written).

    With ``append`` an existing index in ``out_dir`` is extended by the shards it lacks, which must continue its
    rows and come from the same model and corpus; it keeps how it was built, so a build parameter given (one of
    ``params`` other than its default, or any in a mapping of the fields given) that differs from the index's is
    refused, and a search parameter given (``ef_search``, ``nprobe``) is set on it. Returns a summary dict.
    """
    build = dataclasses.replace(build or IndexBuild(), **options)
    given = params_given(params)
    out = check_index_folder(check_output_dir(out_dir).absolute())
    if not append or not index_exists(out):
        params = IndexParams(**given) if not isinstance(params, IndexParams) else params  # refused before the lock
        refuse_unused(given, params)
    check_outputs({"--embeddings": emb_dir}, {"--output": out}, whole=["--output"])
    with exclusive_lock(out.with_name(f".{out.name}.lock"), f"index folder {out_dir}"):
        removed = remove_stale_folders(out.parent, out.name)
        if removed:
            logger.info("removed %d unfinished folder(s) of an interrupted run beside %s", len(removed), out)
        existing = DenseIndex.read(out) if append and (out / META_FILE).is_file() else None
        searched: dict[str, int] = {}
        if existing is not None:
            check_ids_file(out, existing.ntotal)
            searched = _keep_how_it_was_built(existing, given, build, out_dir)
        elif not isinstance(params, IndexParams):  # an index that was there before the lock is gone
            params = IndexParams(**given)
        dense, todo, stats = add_shards(emb_dir, params if existing is None else IndexParams(), existing,
                                        build.train_sample, build.block_size, build.seed, allow_partial)
        if not todo and not searched:
            logger.info("%s is already up to date: every shard in %s is in it; nothing written", out_dir, emb_dir)
            return index_summary(out_dir, dense, todo, stats)
        if not todo:
            logger.info("every shard in %s is in %s already; writing its new search settings", emb_dir, out_dir)
        dense.meta["settings"] = _settings_record(existing, params, build, searched, append, allow_partial)
        for key in ("model", "corpus"):  # also relative to the index, for the folders moved together
            recorded = dense.meta.get(key)
            if recorded and Path(recorded).is_absolute() and not is_stream(recorded):
                dense.meta[f"{key}_from_index"] = os.path.relpath(recorded, out.resolve())
        old_ids = read_ids(out) if existing is not None else ()
        dense.write(out, ids=itertools.chain(old_ids, shard_ids(todo)))
    logger.info("wrote %s index with %s to %s", dense.meta["factory"], counted(dense.ntotal, "vector"), out_dir)
    return index_summary(out_dir, dense, todo, stats)


def params_given(params: Union[IndexParams, Mapping[str, Any]]) -> dict[str, Any]:
    """The :class:`IndexParams` fields a caller set: a mapping's (the flags given), else those other than their
    defaults (``kind`` left out where ``factory`` is set)."""
    names = {field.name for field in dataclasses.fields(IndexParams)}
    if not isinstance(params, IndexParams):
        unknown = sorted(set(params) - names)
        if unknown:
            raise DprGcError(f"unknown index parameters {', '.join(unknown)}; see IndexParams")
        if params.get("kind") is not None and params.get("factory") is not None:  # --kind given, even flat
            refuse_kind_beside_factory(params["kind"], params["factory"])
        return {name: value for name, value in params.items() if value is not None}
    default = IndexParams()
    given = {name: getattr(params, name) for name in names if getattr(params, name) != getattr(default, name)}
    if params.factory is not None:
        given.pop("kind", None)
    return given


SEARCH_FIELDS = ("ef_search", "nprobe")
# The build parameters each kind uses, by field ("factory": those beside the string, where the index has HNSW).
BUILT_WITH = {"flat": (), "hnsw": ("hnsw_m", "ef_construction"), "ivf-flat": ("nlist",),
              "ivf-pq": ("nlist", "pq_m", "pq_nbits"), "factory": ("ef_construction",)}


def _keep_how_it_was_built(dense: DenseIndex, given: Mapping[str, Any], build: IndexBuild,
                           out_dir: PathLike) -> dict[str, int]:
    """Refuse, in one line naming each, the build settings given for an append that differ from how ``dense`` was
    built (it is not rebuilt, so they would be ignored); set the search settings given on it and return them."""
    recorded, old_build = dense.meta.get("params") or {}, (dense.meta.get("settings") or {}).get("build") or {}
    rules = param_rules()
    differ, was = [], []
    for name, value in sorted(given.items()):
        have = dense.meta.get(name) if name in ("kind", "factory") else recorded.get(name)
        if name in SEARCH_FIELDS or value == have:
            continue
        flag = rules[name][0] if name in rules else f"--{name.replace('_', '-')}"
        differ.append(f"{flag} {value}")
        if name in ("kind", "factory") or name in BUILT_WITH.get(str(dense.meta.get("kind")), ()):
            was.append(f"{flag} {have}" if name != "factory" else f"{flag} {have!r}")
    if dense.meta.get("trained_on") == 0:  # built without training: it never took a sample
        refuse_training(build, f"the {dense.meta['factory']} index in {out_dir}")
    for name in ("train_sample", "seed"):  # they train an index, and this one is trained already
        value, default = getattr(build, name), getattr(IndexBuild(), name)
        if value != default and name in old_build and value != old_build[name]:
            differ.append(f"--{name.replace('_', '-')} {value}")
            was.append(f"--{name.replace('_', '-')} {old_build[name]}")
    if differ:
        named = differ[0] if len(differ) == 1 else f"{', '.join(differ[:-1])} and {differ[-1]}"
        built = f" (built with {', '.join(was)})" if was else ""
        raise DprGcError(f"{named}: --append only adds vectors to the {dense.meta['factory']} index in {out_dir}"
                         f"{built} and would ignore {'it' if len(differ) == 1 else 'them'}; drop "
                         f"{'it' if len(differ) == 1 else 'them'}, or build a new index in another folder")
    searched = {name: int(given[name]) for name in SEARCH_FIELDS
                if name in given and given[name] != recorded.get(name)}
    dense.set_search_params(**searched)
    return searched


def _settings_record(existing: Optional[DenseIndex], params: Any, build: IndexBuild,
                     searched: Mapping[str, int], append: bool, allow_partial: bool) -> dict[str, Any]:
    """``settings`` of index_meta.json: the index's own (an appended index keeps those it was built with, its
    search settings as now set) and this run's block size, append and allow-partial."""
    if existing is None:
        return {"index": to_record(params), "build": to_record(build), "append": append,
                "allow_partial": allow_partial}
    old = existing.meta.get("settings") or {}
    recorded = dict(existing.meta.get("params") or {})
    if recorded.get("kind") != "ivf-pq":
        recorded["pq_nbits"] = None  # recorded as 8 for every kind by earlier versions, and a setting of ivf-pq only
    index = dict(old.get("index") or to_record(IndexParams(**recorded)))
    return {"index": {**index, **searched}, "build": {**to_record(build), **(old.get("build") or {}),
                                                      "block_size": build.block_size},
            "append": append, "allow_partial": allow_partial}


def index_summary(out_dir: PathLike, dense: DenseIndex, todo: list[dict], stats: dict[str, Any]) -> dict[str, Any]:
    """What :func:`build_index` returns (and ``dpr-gc index`` prints): the index, its search and size, what was
    added, and whether it covers the whole corpus."""
    corpus_rows = dense.meta.get("corpus_rows")
    return {"index": str(out_dir), "factory": dense.meta["factory"], "search": dense.search_settings(),
            "faiss_threads": faiss_threads(), "model": dense.meta.get("model"),
            "dim": dense.dim, "ntotal": dense.ntotal, "added": sum(int(m["count"]) for m in todo),
            "shards_added": len(todo), **stats, "complete": corpus_rows is None or dense.ntotal == int(corpus_rows)}


def check_ids_file(folder: Path, rows: int) -> None:
    """Refuse to append to an index whose ``ids.txt`` no longer holds one passage id per row (edited or damaged):
    the appended ids would be paired with the wrong vectors."""
    n = sum(1 for _ in read_ids(folder))
    if n != rows:
        raise DprGcError(f"{folder / IDS_FILE}: {n} passage ids for {rows} index rows, so the index is damaged; "
                         "rebuild it (without --append)")


def check_built_from(dense: "DenseIndex", emb_dir: PathLike, where: PathLike) -> None:
    """Refuse, in one line naming each difference, a saved index that was not built from the embeddings in
    ``emb_dir``: another model or corpus, or passages encoded otherwise (their encode settings and prefix, compared
    where both record them, as indexes and shards of earlier versions lack them)."""
    first = read_manifests(emb_dir, complete=False)[0]
    differ = []
    for key in ("model_fingerprint", *ENCODING_KEYS, "corpus_rows", "corpus_fingerprint", *ENCODE_SETTING_KEYS,
                "passage_prefix"):
        if dense.meta.get(key) is None or first.get(key) is None:
            continue
        same = records_agree(dense.meta, first) if key == "model_fingerprint" else dense.meta[key] == first[key]
        if not same:
            differ.append(key)
    if differ:
        raise DprGcError(f"the index in {where} was built with "
                         f"{', '.join(f'{key}={dense.meta[key]!r}' for key in differ)} but the embeddings in "
                         f"{emb_dir} have {', '.join(f'{key}={first[key]!r}' for key in differ)}; delete the old "
                         "index or give another --index_path")


def index_exists(folder: Optional[PathLike]) -> bool:
    """Whether ``folder`` holds a finished index (its metadata is written last)."""
    return folder is not None and (Path(folder) / META_FILE).is_file()


def meta_path(folder: PathLike) -> Path:
    """The metadata file of the index in ``folder`` (written last, so it changes whenever the index does)."""
    return Path(folder) / META_FILE


def read_meta(folder: PathLike) -> dict[str, Any]:
    """The metadata of the index in ``folder`` (model, corpus, encoding settings) without loading the index."""
    return check_meta(read_json_object(meta_path(folder), "index metadata"), meta_path(folder))


# ----------------------------------------------------------------------------------------------- command line
def add_index_arguments(p: argparse.ArgumentParser) -> None:
    """Flags choosing and tuning the index (shared by ``dpr-gc index`` and ``scripts/dense_retriever.py``),
    generated from :class:`IndexParams` and :class:`IndexBuild`."""
    add_arguments(p, IndexParams)
    add_arguments(p, IndexBuild)


@dataclasses.dataclass
class IndexJob:
    """``dpr-gc index`` besides the index's parameters: the shards, the index folder, appending, FAISS threads."""

    embeddings: str = setting("", "--embeddings", type=home_expanded, required=True,
                              help="folder of encode shards (shard-*.npy/.ids.txt/.json)")
    output: str = setting("", "--output", type=output_dir, required=True,
                          help=f"index folder to write ({INDEX_FILE}, {IDS_FILE}, {META_FILE})")
    append: bool = setting(False, "--append", help="add new shards to the existing index in --output")
    allow_partial: bool = setting(False, "--allow-partial",
                                  help="index although some shards are not encoded yet: those up to the first "
                                       "missing one (a later --append adds the rest)")
    threads: Optional[int] = setting(None, "--threads", type=positive_int,
                                     help="FAISS threads, at most the CPUs (default: all cores)")


def params_from_args(args: argparse.Namespace) -> IndexParams:
    return from_args(IndexParams, args)


@guarded(inputs=("embeddings",), outputs={"output": "self"})
def _cli(args: argparse.Namespace) -> None:
    """Handler for ``dpr-gc index``: build (or extend) the index from ``--embeddings``, then the closing summary
    (its time the whole command's)."""
    started = time.perf_counter()
    require_folder(args.embeddings, "--embeddings folder", "run `dpr-gc encode` first")  # named by its flag
    set_threads(args.threads)
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(IndexParams)}  # None: not given
    summary = build_index(args.embeddings, args.output, given, from_args(IndexBuild, args),
                          append=args.append, allow_partial=args.allow_partial)
    print(summary_text(summary, time.perf_counter() - started))


def summary_text(summary: dict[str, Any], seconds: Optional[float] = None) -> str:
    """``dpr-gc index``'s closing table of :func:`build_index`'s summary (whose keys stay as they are), in words:
    the index and its search, the vectors added and from how many shards and the training sample, each with the
    seconds FAISS spent on it, whether the index covers the whole corpus, and the ``time`` of the whole command
    (``seconds``: reading the shards and writing the index included; None: training and adding alone)."""
    seconds = summary["train_seconds"] + summary["add_seconds"] if seconds is None else seconds
    trained = (f"{summary['train_vectors']} vectors in {seconds_text(summary['train_seconds'])}"
               if summary["train_vectors"] else "-")
    if summary.get("training_kept") and summary["added"]:
        kept = summary["training_kept"]
        trained = f"kept: {_training_covered(kept, kept['held_before'])}, of {summary['ntotal']}"
    return format_summary({"factory": summary["factory"], "search": summary["search"],
                           "FAISS threads": summary["faiss_threads"], "model": summary["model"],
                           "dimension": summary["dim"], "vectors": summary["ntotal"],
                           "added this run": f"{summary['added']} from {counted(summary['shards_added'], 'shard')} in "
                                             f"{seconds_text(summary['add_seconds'])}",
                           "trained on": trained, "whole corpus": "yes" if summary["complete"] else "no",
                           "output": summary["index"]}, seconds)


def add_cli(subparsers: Any) -> None:
    """Register ``dpr-gc index``."""
    p = subparsers.add_parser("index",
                              description="Build a FAISS inner-product index from the shards written by encode.")
    add_arguments(p, IndexJob)
    add_arguments(p, IndexParams, unset=True)  # unset: --append tells the flags given from the index's own
    add_arguments(p, IndexBuild)
    p.set_defaults(func=_cli)
