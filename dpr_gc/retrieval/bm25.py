"""BM25 candidates for hard-negative mining (bm25s), as DPR made its first-round negatives."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm.auto import tqdm

from ..base.errors import DprGcError
from ..base.logs import counted
from ..base.files import PathLike, read_json_object, write_json

logger = logging.getLogger(__name__)

BM25_BLOCK = 50_000
BM25_META = "bm25_meta.json"
BM25_TOKENIZER = "bm25s Tokenizer: lowercase, regex (?u)\\b\\w\\w+\\b, English stopwords, no stemming"
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


class BM25Source:
    """Candidates from BM25 (bm25s, k1/b as Anserini's defaults) over ``title + " " + text`` of each corpus row.

    Tokenisation is bm25s's tokenizer: lowercase, words of 2+ word characters, English stopwords removed, no
    stemming. The corpus is tokenised block by block from the memory-mapped dataset; bm25s then holds the token ids
    while it builds its sparse score matrix, which is all that stays in memory (or is memory-mapped after a reload).
    With ``index_dir`` an index saved there for the same corpus (its rows, first and last ids and content fingerprint)
    and parameters is loaded, one saved for another is refused, and without one it is built and saved there.
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
        folder = Path(index_dir) if index_dir is not None else None
        if folder is not None and (folder / BM25_META).is_file():
            saved = read_json_object(folder / BM25_META, "BM25 index metadata")
            diff = [k for k in ("corpus_rows", "first_id", "last_id", "corpus_fingerprint", "k1", "b", "tokenizer")
                    if saved.get(k) != self.meta[k] and (k != "corpus_fingerprint" or k in saved)]
            if diff:
                raise DprGcError(f"the BM25 index in {folder} was built with other {', '.join(diff)} "
                                 f"({', '.join(f'{k}={saved.get(k)!r}' for k in diff)}); give the same corpus and "
                                 "parameters, or another --bm25-index folder")
            try:
                self.bm25 = bm25s.BM25.load(str(folder), mmap=True, show_progress=False)
                self.tokenizer.load_vocab(str(folder))
            except (ValueError, OSError, KeyError) as e:
                raise DprGcError(f"cannot read the BM25 index in {folder} ({str(e).splitlines()[0][:200]}); "
                                 "delete the folder to rebuild it (pickled arrays are never loaded)") from None
            logger.info("loaded the BM25 index of %s from %s", counted(len(corpus), "passage"), folder)
            return
        if len(corpus) == 0:
            raise DprGcError("the corpus is empty; BM25 needs passages")
        ids: list[list[int]] = []
        with tqdm(total=len(corpus), desc="BM25 tokenise", unit=" passages", disable=not show_progress) as bar:
            for s in range(0, len(corpus), block_size):
                rows = corpus[s:s + block_size]
                texts = [f"{t} {x}" if t else x for t, x in zip(rows["title"], rows["text"])]
                ids.extend(self.tokenizer.streaming_tokenize(texts))
                bar.update(len(texts))
        logger.info("BM25: building the score matrix of %s (bm25s, k1=%s, b=%s)", counted(len(corpus), "passage"), k1,
                    b)
        start = time.perf_counter()
        self.bm25 = bm25s.BM25(k1=k1, b=b)
        self.bm25.index(bm25s.tokenization.Tokenized(ids=ids, vocab=self.tokenizer.get_vocab_dict()),
                        show_progress=False)
        del ids
        logger.info("BM25: score matrix built in %.1f s", time.perf_counter() - start)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / BM25_META).unlink(missing_ok=True)
            self.bm25.save(str(folder), show_progress=False)
            self.tokenizer.save_vocab(str(folder))
            write_json(folder / BM25_META, self.meta)
            logger.info("saved the BM25 index to %s", folder)

    def retrieve(self, questions: list[str], k: int,
                 positives: Optional[list[list[Gold]]] = None) -> tuple[np.ndarray, np.ndarray, list[list[float]]]:
        qids = self.tokenizer.tokenize(questions, update_vocab=False, return_as="ids", show_progress=False)
        k = min(k, int(self.bm25.scores["num_docs"]))
        rows, scores = self.bm25.retrieve(qids, k=k, n_threads=self.n_threads, show_progress=False)
        positive_scores: list[list[float]] = [[] for _ in questions]
        for i, golds in enumerate(positives or []):
            known = [g[0] for g in golds if g[0] is not None]
            if known:
                positive_scores[i] = self.bm25.get_scores_from_ids(qids[i])[known].astype(float).tolist()
        scores, rows = np.asarray(scores, dtype=np.float32), np.asarray(rows, dtype=np.int64)
        rows[scores <= 0] = -1  # no query term in common: not retrieved (as in Lucene), and no hard negative
        return scores, rows, positive_scores
