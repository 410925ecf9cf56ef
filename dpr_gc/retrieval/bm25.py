"""BM25 candidates for hard-negative mining (bm25s), as DPR made its first-round negatives."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from tqdm.auto import tqdm

from ..base.errors import DprGcError
from ..base.logs import counted
from ..base.files import PathLike, read_json_object, remove_stale_temporaries, write_json
from ..base.locks import wait_lock

logger = logging.getLogger(__name__)

BM25_BLOCK = 50_000
BM25_META = "bm25_meta.json"
BM25_TOKENIZER = "bm25s Tokenizer: lowercase, regex (?u)\\b\\w\\w+\\b, English stopwords, no stemming"
# What a BM25 index folder holds: bm25s's score matrix (CSC arrays), vocabulary and parameters, the tokenizer's
# vocabulary, and the metadata written last (plus, after a kill, the metadata's hidden temporary ``.NAME.*.tmp``, which
# the next run deletes under the folder's lock).
BM25_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "nonoccurrence_array.index.npy",
              "vocab.index.json", "params.index.json", "vocab.tokenizer.json", BM25_META)
Gold = tuple[Optional[int], str, str]  # (corpus row if known, title, text)


def import_bm25s() -> Any:
    """bm25s, imported so that it does not start JAX.

    Where JAX is installed, bm25s imports it at import time and runs a top-k on it, which starts XLA's thread pools
    in this process; mining then forks its answer-matching workers from a multithreaded process (JAX warns that this
    "will likely lead to a deadlock"). With ``jax`` marked absent while bm25s loads (and put back after, if this
    process had imported it), bm25s takes its numpy top-k: the same candidates whether JAX is installed or not.
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    jax = sys.modules.get("jax")
    sys.modules["jax"] = None  # type: ignore[assignment]  # the import system's "not installed"
    try:
        import bm25s
    except ImportError:
        raise DprGcError("BM25 needs the package bm25s: pip install 'dpr-gc[bm25]' (or bm25s)") from None
    finally:
        if jax is None:
            del sys.modules["jax"]
        else:
            sys.modules["jax"] = jax
    return bm25s


def bm25_index_exists(folder: PathLike) -> bool:
    """Whether ``folder`` holds a saved BM25 index (its metadata is written last), which is loaded rather than built."""
    return (Path(folder) / BM25_META).is_file()


def check_bm25_folder(folder: PathLike, flag: str = "--bm25-index") -> None:
    """Refuse a folder a BM25 index would be built into that holds anything besides a BM25 index's own files
    (:data:`BM25_FILES`, which an interrupted build leaves and a rebuild writes over) and no finished index: the
    index would be written among the user's files. A folder holding a finished index is read, not written."""
    root = Path(folder)
    if not root.is_dir() or bm25_index_exists(root):
        return
    foreign = sorted(p.name for p in root.iterdir() if not _own_file(p.name))  # hidden ones too
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise DprGcError(f"{flag} {root} holds {foreign[0]}{more} and no BM25 index; the index's files would be "
                         "written beside them, so give a new or empty folder")


def _own_file(name: str) -> bool:
    """Whether ``name`` is a file of a BM25 index folder (one of :data:`BM25_FILES` or the metadata's temporary)."""
    return name in BM25_FILES or (name.startswith(f".{BM25_META}.") and name.endswith(".tmp"))


class BM25Source:
    """Candidates from BM25 (bm25s, k1/b as Anserini's defaults) over ``title + " " + text`` of each corpus row.

    Tokenisation is bm25s's tokenizer: lowercase, words of 2+ word characters, English stopwords removed, no
    stemming. The corpus is tokenised block by block from the memory-mapped dataset; bm25s then holds the token ids
    while it builds its sparse score matrix, which is all that stays in memory (or is memory-mapped after a reload).
    With ``index_dir`` an index saved there for the same corpus (its rows, first and last ids and content fingerprint)
    and parameters is loaded, one saved for another is refused, as is a damaged one (its files are checked against
    each other), and without one it is built and saved there (a folder holding other files is refused first,
    :func:`check_bm25_folder`).
    A positive's score is its row of bm25s's score vector for the question, so only positives in the corpus get one.
    Passages sharing no term with the question (score 0) are not candidates. :meth:`retrieve` returns, per question,
    the scores of its positives that have one (for the margin and positive-aware rules of mining).
    """

    def __init__(self, corpus: Any, k1: float = 0.9, b: float = 0.4, index_dir: Optional[PathLike] = None,
                 block_size: int = BM25_BLOCK, n_threads: int = 0, show_progress: bool = True) -> None:
        from ..data.corpus import dataset_fingerprint

        bm25s = import_bm25s()
        self.n_threads = n_threads
        self.meta = {"corpus_rows": len(corpus), "first_id": str(corpus[0]["id"]) if len(corpus) else None,
                     "last_id": str(corpus[len(corpus) - 1]["id"]) if len(corpus) else None,
                     "corpus_fingerprint": dataset_fingerprint(corpus), "k1": k1, "b": b,
                     "tokenizer": BM25_TOKENIZER, "bm25s_version": bm25s.__version__}
        self.tokenizer = bm25s.tokenization.Tokenizer(stopwords="english")
        if index_dir is None:
            self._build(corpus, bm25s, block_size, show_progress)
            return
        folder = Path(index_dir)
        # One process at a time loads or builds the folder: two mining runs sharing it would otherwise write each
        # other's files in turn, and a later load could pair one corpus's vocabulary with another's matrix.
        with wait_lock(folder.with_name(f".{folder.name}.lock")):
            remove_stale_temporaries(folder, [BM25_META])  # a killed run's, the lock being ours
            if bm25_index_exists(folder):
                self._check_saved(folder)
                self._load(folder, bm25s, len(corpus))
                logger.info("loaded the BM25 index of %s from %s", counted(len(corpus), "passage"), folder)
                return
            check_bm25_folder(folder)
            self._build(corpus, bm25s, block_size, show_progress)
            folder.mkdir(parents=True, exist_ok=True)
            self.bm25.save(str(folder), show_progress=False)
            self.tokenizer.save_vocab(str(folder))
            write_json(folder / BM25_META, self.meta)  # last: a folder without it is rebuilt
            logger.info("saved the BM25 index to %s", folder)

    def _check_saved(self, folder: Path) -> None:
        """Refuse an index saved for another corpus or other parameters."""
        saved = read_json_object(folder / BM25_META, "BM25 index metadata")
        diff = [k for k in ("corpus_rows", "first_id", "last_id", "corpus_fingerprint", "k1", "b", "tokenizer")
                if saved.get(k) != self.meta[k] and (k != "corpus_fingerprint" or k in saved)]
        if diff:
            raise DprGcError(f"the BM25 index in {folder} was built with other {', '.join(diff)} "
                             f"({', '.join(f'{k}={saved.get(k)!r}' for k in diff)}); give the same corpus and "
                             "parameters, or another --bm25-index folder")

    def _build(self, corpus: Any, bm25s: Any, block_size: int, show_progress: bool) -> None:
        """Tokenise the corpus block by block and build bm25s's score matrix."""
        if len(corpus) == 0:
            raise DprGcError("the corpus is empty; BM25 needs passages")
        ids: list[list[int]] = []
        with tqdm(total=len(corpus), desc="BM25 tokenise", unit=" passages", disable=not show_progress) as bar:
            for s in range(0, len(corpus), block_size):
                rows = corpus[s:s + block_size]
                texts = [f"{t} {x}" if t else x for t, x in zip(rows["title"], rows["text"])]
                ids.extend(self.tokenizer.streaming_tokenize(texts))
                bar.update(len(texts))
        logger.info("BM25: building the score matrix of %s (bm25s, k1=%s, b=%s)", counted(len(corpus), "passage"),
                    self.meta["k1"], self.meta["b"])
        start = time.perf_counter()
        self.bm25 = bm25s.BM25(k1=self.meta["k1"], b=self.meta["b"])
        self.bm25.index(bm25s.tokenization.Tokenized(ids=ids, vocab=self.tokenizer.get_vocab_dict()),
                        show_progress=False)
        del ids
        logger.info("BM25: score matrix built in %.1f s", time.perf_counter() - start)

    def _load(self, folder: Path, bm25s: Any, passages: int) -> None:
        """Load the index saved in ``folder`` (arrays memory-mapped, never unpickled) and check it before any use, so a
        damaged file is refused in one line here rather than failing deep inside bm25s while mining. The vocabularies
        are read with the standard JSON reader: bm25s's (orjson) crashes the process on deeply nested input."""
        try:
            backend = read_json_object(folder / "params.index.json", "BM25 parameters").get("backend", "numpy")
            if backend != "numpy":  # bm25s would import (or fail to import) another backend's library
                raise DprGcError(f"params.index.json has backend={backend!r}, where this index is 'numpy'")
            vocab = read_json_object(folder / "vocab.index.json", "BM25 vocabulary")
            words = read_json_object(folder / "vocab.tokenizer.json", "BM25 tokenizer vocabulary").get("word_to_id")
            bm25 = bm25s.BM25.load(str(folder), mmap=True, load_vocab=False, show_progress=False)
        except DprGcError as e:
            raise damaged(folder, str(e)) from None
        except (ValueError, OSError, KeyError, TypeError, ImportError) as e:
            why = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise damaged(folder, f"cannot read it: {why}; pickled arrays are never loaded") from None
        expected = bm25s.BM25(k1=self.meta["k1"], b=self.meta["b"])
        problem = (params_problem(bm25, expected) or vocab_problem(vocab, words)
                   or csc_problem(bm25.scores, len(vocab), passages))
        if problem:
            raise damaged(folder, problem)
        bm25.vocab_dict, bm25.unique_token_ids_set = vocab, set(vocab.values())
        self.bm25, self.tokenizer.word_to_id = bm25, words

    def retrieve(self, questions: list[str], k: int,
                 positives: Optional[list[list[Gold]]] = None) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
        """Per question the top ``k`` corpus rows and scores (row -1: none), and its known positives' scores.

        A question with no word in the index's vocabulary (unseen words, or stopwords only) shares no term with any
        passage: it gets no candidate and its positives score 0, where bm25s would match it, through its placeholder
        token for empty texts, to the passages that have no indexed word (or fail where that token is absent)."""
        qids = self.tokenizer.tokenize(questions, update_vocab=False, return_as="ids", show_progress=False)
        placeholder = self.tokenizer.word_to_id.get("")
        has_term = [any(t != placeholder for t in q) for q in qids]
        k = min(k, int(self.bm25.scores["num_docs"]))
        scores, rows = np.zeros((len(questions), k), dtype=np.float32), np.full((len(questions), k), -1, np.int64)
        asked = [i for i, term in enumerate(has_term) if term]
        if asked:
            found, found_scores = self.bm25.retrieve([qids[i] for i in asked], k=k, n_threads=self.n_threads,
                                                     show_progress=False)
            rows[asked], scores[asked] = found, found_scores
        positive_scores: list[list[float]] = [[] for _ in questions]
        for i, golds in enumerate(positives or []):
            known = [g[0] for g in golds if g[0] is not None]
            if known:
                positive_scores[i] = (self.bm25.get_scores_from_ids(qids[i])[known].astype(float).tolist()
                                      if has_term[i] else [0.0] * len(known))
        rows[scores <= 0] = -1  # no query term in common: not retrieved (as in Lucene), and no hard negative
        return scores, rows, positive_scores


# ----------------------------------------------------------------------------------- checks of a saved index
SCORING_PARAMS = ("k1", "b", "method", "idf_method", "dtype", "int_dtype")
CHECK_BLOCK = 1 << 24  # array elements checked at a time: memory stays flat however large the memory-mapped index


def damaged(folder: Path, why: str) -> DprGcError:
    """The one error for a BM25 index folder that cannot be used: what is wrong, and to rebuild it."""
    return DprGcError(f"{folder}: damaged BM25 index ({why}); delete the folder to rebuild it")


def params_problem(loaded: Any, expected: Any) -> Optional[str]:
    """What differs in params.index.json from the parameters this index was built with (``expected``: a fresh
    bm25s.BM25 with the recorded k1 and b), or None."""
    wrong = [k for k in SCORING_PARAMS if getattr(loaded, k, None) != getattr(expected, k)]
    if wrong:
        return f"params.index.json has {', '.join(f'{k}={getattr(loaded, k, None)!r}' for k in wrong)}"
    return None


def vocab_problem(vocab: Any, word_to_id: Any) -> Optional[str]:
    """What is wrong with the vocabulary, or None: vocab.index.json must map words to the ids 0..N-1, each once (bm25s
    gives token id i column i of the score matrix), and the tokenizer's word_to_id (vocab.tokenizer.json) must be the
    same map, since both are saved from one dictionary."""
    if not isinstance(vocab, dict) or not vocab:
        return "vocab.index.json is not a non-empty JSON object"
    n = len(vocab)
    if not all(type(w) is str and type(i) is int and 0 <= i < n for w, i in vocab.items()):
        return f"vocab.index.json must map words to integer ids from 0 to {n - 1}"
    if len(set(vocab.values())) != n:
        return "vocab.index.json gives two words the same id"
    if not isinstance(word_to_id, dict) or word_to_id != vocab:
        return "the word_to_id of vocab.tokenizer.json is not the vocabulary of vocab.index.json"
    return None


def csc_problem(scores: dict, words: int, passages: int) -> Optional[str]:
    """What is inconsistent in bm25s's score matrix (passages x words, CSC: ``indptr`` has one entry per word plus
    one, column w's passages are ``indices[indptr[w]:indptr[w + 1]]`` with scores ``data[...]``), or None."""
    num_docs, data, indices, indptr = (scores[k] for k in ("num_docs", "data", "indices", "indptr"))
    if type(num_docs) is not int or num_docs != passages:
        return f"params.index.json records num_docs={num_docs!r}, the corpus has {passages} passages"
    for name, array, kinds in (("indptr", indptr, "iu"), ("indices", indices, "iu"), ("data", data, "f")):
        if array.ndim != 1 or array.dtype.kind not in kinds:
            kind = "integer" if kinds == "iu" else "floating-point"
            return f"{name}.csc.index.npy holds a {array.ndim}-D {array.dtype} array, not a 1-D {kind} one"
    if len(indptr) != words + 1:
        return f"indptr.csc.index.npy has {len(indptr)} entries for a vocabulary of {words} words (needs {words + 1})"
    if len(data) != len(indices) or int(indptr[0]) != 0 or int(indptr[-1]) != len(indices):
        return (f"indptr.csc.index.npy runs from {int(indptr[0])} to {int(indptr[-1])}, while indices and data hold "
                f"{len(indices)} and {len(data)} entries")
    if not _all_blocks(indptr, lambda a: bool(np.all(a[1:] >= a[:-1])), overlap=1):
        return "indptr.csc.index.npy decreases somewhere"
    if not _all_blocks(indices, lambda a: bool(a.min() >= 0 and a.max() < passages)):
        return f"indices.csc.index.npy points outside the {passages} passages"
    if not _all_blocks(data, lambda a: bool(np.isfinite(a).all())):
        return "data.csc.index.npy holds a score that is not a finite number"
    return None


def _all_blocks(array: np.ndarray, ok: Callable[[np.ndarray], bool], overlap: int = 0) -> bool:
    """Whether ``ok`` holds for every non-empty block of ``array`` (each block also holds the first ``overlap``
    elements of the next, so a check between neighbours sees every pair)."""
    for start in range(0, len(array), CHECK_BLOCK):
        block = np.asarray(array[start:start + CHECK_BLOCK + overlap])
        if len(block) and not ok(block):
            return False
    return True
