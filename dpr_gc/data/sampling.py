"""What each training step draws: which questions (several sources at per-source rates, rank shards, and a position
in the epoch that a checkpoint can save and a resumed run can continue from), and for each question its positive and
negatives, filled-in negatives never being a positive or answer-bearing passage of the same global batch."""

from __future__ import annotations

import logging
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ..base.errors import DprGcError
from .answer_text import nfd, simple_tokens

logger = logging.getLogger(__name__)

FIRST_POSITIVE, SAMPLED_POSITIVE = -1, -2  # an example's positive: its question's first, or one drawn per draw


def passage_keys(ctx: dict) -> list[str]:
    """What makes two passages the same one, any key in common: their passage id (when they have one) or their
    title and text, so a copy without an id is still the passage (as the load-time drop of a question's own
    positive from its negatives matches them)."""
    text = f"text:{ctx.get('title') or ''}\n{ctx['text']}"
    return [f"id:{ctx['id']}", text] if ctx.get("id") else [text]


def question_key(question: str) -> str:
    """What makes two training rows ask the same question: their text in Unicode NFC, case folded, whitespace
    collapsed (a DPR file repeating a question with another positive; BEIR queries of other ids and one text)."""
    return " ".join(unicodedata.normalize("NFC", question).casefold().split())


def question_groups(questions: Sequence[str]) -> np.ndarray:
    """One int64 group per row, equal for rows asking the same question (:func:`question_key`), numbered in order
    of first appearance: rows of one group are one question for the loss."""
    index: dict[str, int] = {}
    return np.asarray([index.setdefault(question_key(q), len(index)) for q in questions], dtype=np.int64)


def too_few_questions(questions: int, batch_size: int, world_size: int = 1) -> DprGcError:
    """The refusal of training data too small for one global batch (the sampler's, and the demo's before it
    measures anything)."""
    return DprGcError(f"too few training questions ({questions}) for one batch of {batch_size} x {world_size} "
                      "rank(s); lower --batch-size")


class MixedBatchSampler(torch.utils.data.Sampler):
    """Batch sampler over concatenated sources with per-source rates, rank sharding and mid-epoch resume.

    Rate ``r`` draws ``int(r * size)`` rows of a source per epoch (whole shuffled passes, then a random part).
    The epoch order depends only on ``(seed, epoch)``; step ``s`` uses positions ``[s*B*W, (s+1)*B*W)`` of it
    and rank ``k`` takes the ``k``-th slice of ``B``, so ranks see disjoint equal parts and the tail is dropped.
    With ``per_file_batches`` every step's global batch comes from one source (as DPR's multi-set iterator).
    Each yielded item is ``(row, epoch, position)`` so examples can derive their own randomness.
    """

    def __init__(self, sizes: Sequence[int], batch_size: int, rates: Optional[Sequence[float]] = None, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, per_file_batches: bool = False,
                 groups: Optional[np.ndarray] = None) -> None:
        rates = list(rates) if rates is not None else [1.0] * len(sizes)
        if len(rates) != len(sizes) or any(r <= 0 for r in rates):
            raise DprGcError(f"--sampling-rates needs one positive rate per training source ({len(sizes)}), "
                             f"got {rates}")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise DprGcError(f"bad batch size {batch_size} or rank {rank} of world size {world_size}")
        self.sizes, self.rates, self.batch_size, self.seed = [int(s) for s in sizes], rates, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.per_file_batches = rank, world_size, shuffle, per_file_batches
        self.groups = groups  # the query of each item: no global batch holds one query twice (see spread_groups)
        self.epoch, self.skip, self._resume = 0, 0, None
        self.data_fingerprints: list[str] = []  # the training sources' content (set by the trainer), checked on resume
        self.data_files: list[dict] = []  # per source {"source": path, "files": {path: fingerprint}} (idem)
        self._order: Optional[tuple[int, np.ndarray]] = None
        if self.batches_per_epoch == 0:
            raise too_few_questions(sum(self.sizes), batch_size, world_size)
        if groups is not None:
            self.check_distinct_queries(groups)

    def check_distinct_queries(self, groups: np.ndarray) -> None:
        """Refuse a global batch larger than the distinct queries it draws from (all sources, or each source with
        ``per_file_batches``; ``groups``: the query of each item, rows asking the same question one): it would hold
        a query twice, each copy scoring the other's positive as a negative, which :func:`spread_groups` cannot
        avoid."""
        step, offsets = self.batch_size * self.world_size, np.cumsum([0, *self.sizes])
        pools = ([groups[a:b] for a, b, size, rate in zip(offsets[:-1], offsets[1:], self.sizes, self.rates)
                  if int(rate * size) >= step] if self.per_file_batches else [groups])  # those that fill a batch
        distinct = min(len(np.unique(pool)) for pool in pools)
        if step <= distinct:
            return
        ranks = f" x {self.world_size} ranks = {step}" if self.world_size > 1 else ""
        fix = (f"use --batch-size {distinct // self.world_size} or less" if distinct >= self.world_size
               else "use fewer ranks")
        where = "a training source" if self.per_file_batches and len(self.sizes) > 1 else "the training data"
        raise DprGcError(f"--batch-size {self.batch_size}{ranks} is more than the {distinct} distinct queries of "
                         f"{where}: a global batch would hold a query twice (each copy scoring the other's positive "
                         f"as a negative); {fix}")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All rows drawn in ``epoch``, in order (the same on every rank)."""
        rng = np.random.default_rng([self.seed, epoch])
        parts, offset = [], 0
        for size, rate in zip(self.sizes, self.rates):
            count = int(rate * size)
            passes = [rng.permutation(size) if self.shuffle else np.arange(size) for _ in range(-(-count // size))]
            parts.append(offset + np.concatenate(passes or [np.zeros(0, dtype=np.int64)])[:count])
            offset += size
        step = self.batch_size * self.world_size
        if not self.per_file_batches:
            order = np.concatenate(parts)
            return self._spread(rng.permutation(order) if self.shuffle else order, step)
        parts = [self._spread(p, step) for p in parts]
        chunks = [c for p in parts for c in p[:len(p) // step * step].reshape(-1, step)]
        chunk_order = rng.permutation(len(chunks)) if self.shuffle else range(len(chunks))
        return np.concatenate([chunks[i] for i in chunk_order]) if chunks else np.zeros(0, dtype=np.int64)

    def _spread(self, order: np.ndarray, step: int) -> np.ndarray:
        return order if self.groups is None else spread_groups(order, self.groups, step)

    def global_batch(self, epoch: int, position: int) -> tuple[int, np.ndarray]:
        """``(start, rows)`` of the global batch (all ranks) that holds ``position`` of ``epoch``'s order."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.epoch_order(epoch))
        step = self.batch_size * self.world_size
        start = position // step * step
        return start, self._order[1][start:start + step]

    @property
    def batches_per_epoch(self) -> int:
        """Full steps per epoch (use this for LR schedules; ``len()`` is what the next iteration yields)."""
        step, counts = self.batch_size * self.world_size, [int(r * s) for r, s in zip(self.rates, self.sizes)]
        return sum(c // step for c in counts) if self.per_file_batches else sum(counts) // step

    def set_epoch(self, epoch: int, skip: Optional[int] = None) -> None:
        """Select the epoch and how many of its batches to skip (by default, what ``load_state_dict`` asked for)."""
        if skip is None:
            skip = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        self.epoch, self.skip, self._resume = epoch, skip, None

    def __len__(self) -> int:
        return max(self.batches_per_epoch - self.skip, 0)

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        order, b, step = self.epoch_order(self.epoch), self.batch_size, self.batch_size * self.world_size
        for s in range(self.skip, len(order) // step):
            start = s * step + self.rank * b
            yield [(int(order[p]), self.epoch, p) for p in range(start, start + b)]

    def state_dict(self, batches_done: int) -> dict:
        """State after ``batches_done`` batches of the current epoch (count what the trainer consumed)."""
        epoch, done = (self.epoch + 1, 0) if batches_done >= self.batches_per_epoch else (self.epoch, batches_done)
        return {"epoch": epoch, "batches_done": done, "seed": self.seed, "batch_size": self.batch_size,
                "world_size": self.world_size, "sizes": self.sizes, "rates": self.rates,
                "shuffle": self.shuffle, "per_file_batches": self.per_file_batches,
                "data_fingerprints": self.data_fingerprints, "data_files": self.data_files}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``set_epoch(state['epoch'])`` skips the batches already done. The data setup must be the
        checkpoint's, the training sources' content included (a state without fingerprints predates them)."""
        mine = self.state_dict(0)
        changed = [k for k in mine if k not in ("epoch", "batches_done", "data_fingerprints", "data_files")
                   and state.get(k) != mine[k]]
        if changed:
            raise DprGcError(f"cannot resume: the data setup changed ({', '.join(changed)}); "
                             "use the same training files, rates, batch size, world size and seed")
        if state.get("data_fingerprints") and state["data_fingerprints"] != self.data_fingerprints:
            what = changed_sources(state, self.data_fingerprints, self.data_files)
            if what:
                raise DprGcError(f"cannot resume: the content of the training files changed since the checkpoint "
                                 f"({what}); resume with the files it was trained on, or train into a new --output")
        self.epoch, self.skip = state["epoch"], state["batches_done"]
        self._resume = (self.epoch, self.skip)


def changed_sources(state: dict, fingerprints: list[str], files: list[dict]) -> str:
    """What changed in the training sources since a sampler ``state`` whose fingerprints differ from
    ``fingerprints`` (``files``: this run's :func:`~dpr_gc.data.corpus.source_files` per source): the files whose
    content changed, came or went, by the state's record of each; for a state of an earlier version (no such
    record) the sources, unless their fingerprints as that version took them (every qrels split of a BEIR folder)
    are the recorded ones, then ``""``: nothing changed."""
    from .corpus import source_files, source_fingerprint

    recorded = state.get("data_files")
    if recorded:
        then = {name: value for source in recorded for name, value in source["files"].items()}
        now = {name: value for source in files for name, value in source["files"].items()}
        names = [f"{n} {'added' if n not in then else 'removed' if n not in now else 'changed'}"
                 for n in sorted({*then, *now}) if then.get(n) != now.get(n)]
        return "; ".join(names) or "their fingerprints differ"
    if not files:
        return "their fingerprints differ"
    old = [source_fingerprint(f["source"], files=source_files(f["source"], every_qrels=True))
           if Path(f["source"]).is_dir() else value for f, value in zip(files, fingerprints)]
    if old == state["data_fingerprints"]:
        return ""
    return "; ".join(f"{f['source']} changed" for f, a, b in zip(files, old, state["data_fingerprints"]) if a != b)


def spread_groups(order: np.ndarray, groups: np.ndarray, step: int) -> np.ndarray:
    """``order`` with items swapped so that no whole batch of ``step`` items holds two of the same group (two
    examples of one query, with different positives, would each score the other's positive as a negative). An item
    whose group is already in its batch swaps with the nearest later item whose group is not, else with an earlier
    one whose batch lacks the item's group; deterministic, and a no-op when no batch repeats a group."""
    order, whole = order.copy(), len(order) // step * step
    for start in range(0, whole, step):
        seen: set = set()
        for p in range(start, start + step):
            group = int(groups[order[p]])
            if group in seen:
                q = _swap_partner(order, groups, step, start, seen, group)
                if q is not None:
                    order[p], order[q] = order[q], order[p]
            seen.add(int(groups[order[p]]))
    return order


def _swap_partner(order: np.ndarray, groups: np.ndarray, step: int, start: int, seen: set,
                  group: int) -> Optional[int]:
    """A position outside the batch at ``start`` whose item may take the place of a repeated ``group``'s item."""
    for q in range(start + step, len(order)):
        if int(groups[order[q]]) not in seen:
            return q
    for other in range(0, start, step):
        members = {int(groups[order[q]]) for q in range(other, other + step)}
        if group not in members:
            for q in range(other, other + step):
                if int(groups[order[q]]) not in seen:
                    return q
    return None


class BatchExclusion:
    """What a filled-in negative of one global batch must not be.

    A negative slot that the training data cannot fill takes the positive of some other question; that passage must
    not be a positive of any question in the same global batch (all ranks), nor contain an answer of one when
    answers are known, or the loss would push a question away from its own gold passage. ``rows`` are the batch's
    training rows and ``records`` their ``question``, ``answers`` and ``positives`` columns; the positive of a row
    asking one of the batch's questions (:func:`question_key`) is never taken either.
    """

    def __init__(self, rows: Sequence[int], records: dict[str, list]) -> None:
        self.rows = {int(r) for r in rows}
        self.questions = {question_key(q) for q in records["question"]}
        contexts = [c for group in records["positives"] for c in group]
        self.ids = {c["id"] for c in contexts if c["id"]}
        self.texts = {c["text"] for c in contexts}
        answers = (tuple(simple_tokens(nfd(a))) for group in records.get("answers", []) for a in group)
        self.answers = {a for a in answers if a}
        self.lengths = sorted({len(a) for a in self.answers})

    def allows(self, row: int, question: str, ctx: dict) -> bool:
        """May ``ctx`` (the positive of training row ``row``, asked as ``question``) fill a negative slot?"""
        if row in self.rows or question_key(question) in self.questions:
            return False
        if (ctx["id"] and ctx["id"] in self.ids) or ctx["text"] in self.texts:
            return False
        return not self.answers or not self._bears_answer(ctx["text"])

    def _bears_answer(self, text: str) -> bool:
        tokens = simple_tokens(nfd(text))
        return any(tuple(tokens[i:i + n]) in self.answers for n in self.lengths for i in range(len(tokens) - n + 1))


def twin_rows(groups: np.ndarray) -> dict[int, list[int]]:
    """Row -> every row of its group (itself included), for the groups of more than one row."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(np.asarray(groups).tolist()):
        members.setdefault(group, []).append(row)
    return {row: rows for rows in members.values() if len(rows) > 1 for row in rows}


def epoch_shortfall(missing: np.ndarray, examples: Optional[np.ndarray], sizes: Optional[Sequence[int]],
                    rates: Optional[Sequence[float]]) -> tuple[float, int]:
    """``(negative slots an epoch fills, examples it draws)``: the epoch of :class:`MixedBatchSampler` over
    ``sizes`` examples per source (consecutive; default: all in one) at ``rates``, each example
    (``examples[i] = (row, positive)``, default one per row) short of ``missing[row]`` negatives. A source drawn
    at a rate other than 1 fills the expected count (``rate x`` its examples' shortfall); the examples are counted
    as :func:`~dpr_gc.train.report.describe_epoch` counts them (``int(rate x size)``)."""
    per_example = missing if examples is None else missing[np.asarray(examples, dtype=np.int64)[:, 0]]
    sizes = list(sizes) if sizes is not None else [len(per_example)]
    rates = list(rates) if rates is not None else [1.0] * len(sizes)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    filled = sum(rate * float(per_example[a:b].sum()) for a, b, rate in zip(bounds[:-1], bounds[1:], rates))
    return filled, sum(int(rate * size) for rate, size in zip(rates, sizes))


class TrainingExamples(torch.utils.data.Dataset):
    """One query and ``1 + N + M`` passages per draw: the positive, N hard negatives, M other negatives.

    A draw is a training row (or, with ``examples``, an item ``(row, positive)`` of
    :func:`~dpr_gc.data.training.example_index`: a fixed positive, the first, or one drawn at each draw). The
    positive is the first (or a random one with ``shuffle_positives``). Hard slots take the hard pool, other
    slots the negatives pool (shuffled with ``shuffle_negatives``, else in file order); a short pool is topped up
    from the other pool's leftovers. If both pools together are short, the remaining slots take the first positive
    of randomly drawn other questions (a random negative, as in-batch negatives are; draws may repeat), so batches
    stay rectangular -- never a passage that is a positive of, or contains an answer of, any question in the same
    global batch (``global_batch(epoch, position) -> (start, rows)``, all ranks; without it only this question's
    own positives are excluded). Each draw also carries the :func:`passage_keys` of every passage and of every
    positive of its question, those of every row asking the same question (:func:`question_key`) included, so the
    loss can drop duplicate positives from the negatives. All choices derive from ``(seed, epoch, position)``, so
    workers and resumed runs make the same ones.
    """

    def __init__(self, dataset: Any, hard_negatives: int = 1, other_negatives: int = 0, shuffle_positives: bool = False,
                 shuffle_negatives: bool = True, seed: int = 0,
                 global_batch: Optional[Callable[[int, int], tuple[int, np.ndarray]]] = None,
                 examples: Optional[np.ndarray] = None, sizes: Optional[Sequence[int]] = None,
                 rates: Optional[Sequence[float]] = None, groups: Optional[np.ndarray] = None) -> None:
        import pyarrow.compute as pc

        # ``examples[i] = (row, positive)``: the positive's index, FIRST_POSITIVE or SAMPLED_POSITIVE (None: one
        # example per row, its first positive or, with shuffle_positives, a sampled one)
        self.examples = examples

        if hard_negatives < 0 or other_negatives < 0:
            raise DprGcError("--hard-negatives and --other-negatives must be >= 0")
        self.dataset, self.n_hard, self.n_other, self.seed = dataset, hard_negatives, other_negatives, seed
        self.shuffle_positives, self.shuffle_negatives = shuffle_positives, shuffle_negatives
        self.global_batch = global_batch
        self.candidates = dataset.select_columns(["question", "positives"])
        # rows asking the same question (``groups``: :func:`question_groups` of the rows, computed when not given)
        self.twins = twin_rows(question_groups(self.candidates[:]["question"]) if groups is None else groups)
        self._exclusion: Optional[tuple[tuple[int, int], BatchExclusion]] = None
        counts = (pc.list_value_length(dataset.data.column("hard_negatives")).to_numpy(zero_copy_only=False)
                  + pc.list_value_length(dataset.data.column("negatives")).to_numpy(zero_copy_only=False))
        missing = np.maximum(hard_negatives + other_negatives - counts, 0)
        if missing.any():
            if len(dataset) < 2:
                raise DprGcError("one training question with too few negatives; add negatives or questions")
            filled, drawn = epoch_shortfall(missing, examples, sizes, rates)
            slots = drawn * (hard_negatives + other_negatives)
            logger.info("%d of %d questions have fewer than %d negatives: %s%d of the %d negative slots of an epoch "
                        "(%d examples; %.1f%%) are filled with the positive of a random other question, never a "
                        "positive or an answer-bearing passage of a question in the same global batch",
                        int((missing > 0).sum()), len(dataset), hard_negatives + other_negatives,
                        "" if float(filled).is_integer() else "about ", round(filled), slots, drawn,
                        100.0 * filled / slots if slots else 0.0)

    def __len__(self) -> int:
        return len(self.dataset) if self.examples is None else len(self.examples)

    def __getitem__(self, key: Union[int, tuple[int, int, int]]) -> dict:
        item, epoch, position = key if isinstance(key, tuple) else (key, 0, key)
        row, which = (int(item), FIRST_POSITIVE) if self.examples is None else map(int, self.examples[int(item)])
        record = self.dataset[row]
        rng = np.random.default_rng([self.seed, epoch, position])
        positives = record["positives"]
        if which == SAMPLED_POSITIVE or (which == FIRST_POSITIVE and self.shuffle_positives):
            positive = positives[int(rng.integers(len(positives)))]
        else:
            positive = positives[max(which, 0)]
        hard, other = (self._order(record[k], rng) for k in ("hard_negatives", "negatives"))
        hard_sel, other_sel = hard[:self.n_hard], other[:self.n_other]
        hard_sel = hard_sel + other[self.n_other:][:self.n_hard - len(hard_sel)]
        other_sel = other_sel + hard[self.n_hard:][:self.n_other - len(other_sel)]
        missing = self.n_hard + self.n_other - len(hard_sel) - len(other_sel)
        fill = self._fill(missing, row, self._excluded(row, epoch, position), rng) if missing else []
        cut = self.n_hard - len(hard_sel)
        chosen = [positive] + hard_sel + fill[:cut] + other_sel + fill[cut:]
        twins = [c for r in self.twins.get(row, ()) if r != row for c in self.candidates[r]["positives"]]
        return {"question": record["question"], "passages": [(c["title"], c["text"]) for c in chosen],
                "passage_keys": [passage_keys(c) for c in chosen],
                "positive_keys": [k for c in positives + twins for k in passage_keys(c)]}

    def _order(self, pool: list, rng: np.random.Generator) -> list:
        return [pool[i] for i in rng.permutation(len(pool))] if self.shuffle_negatives else list(pool)

    def _excluded(self, row: int, epoch: int, position: int) -> BatchExclusion:
        """The exclusion of the global batch holding this draw (built once per batch and worker)."""
        start, rows = self.global_batch(epoch, position) if self.global_batch else (-1 - row, np.array([row]))
        if self.global_batch and self.examples is not None:
            rows = self.examples[np.asarray(rows, dtype=np.int64), 0]  # items -> their questions' rows
        if self._exclusion is None or self._exclusion[0] != (epoch, start):
            columns = self.dataset.select_columns(["question", "answers", "positives"])[[int(r) for r in rows]]
            self._exclusion = ((epoch, start), BatchExclusion(rows, columns))
        return self._exclusion[1]

    def _fill(self, count: int, row: int, excluded: BatchExclusion, rng: np.random.Generator) -> list:
        out: list = []
        for _ in range(100 * count):
            j = int(rng.integers(len(self.dataset)))
            candidate = self.candidates[j]
            ctx = candidate["positives"][0]
            if excluded.allows(j, candidate["question"], ctx):
                out.append(ctx)
                if len(out) == count:
                    return out
        raise DprGcError(f"cannot find {count} negatives for training row {row}: the other questions are in the "
                         "same batch or share its positives; add negatives to the training data or questions")
