"""Dev-set validation during training, bounded the way DPR bounds it.

At most ``max_questions`` dev questions are read (the first ones, in file order), each bringing its first positive,
its first ``hard_negatives`` hard negatives and first ``other_negatives`` other negatives into one passage pool
(deduplicated by id, else text); DPR's average rank is the mean 0-based rank of each gold passage among the whole
pool (0: scored above every other passage), as DPR's ``validate_average_rank`` computes it. The in-batch loss and
accuracy are DPR's ``validate_nll``: each batch of questions scored against the gold passages and the training's
hard and other negatives of every question in it.
The score matrix is computed in row blocks, so memory depends on these caps and never on the dev set's size. Under
``torch.distributed`` each rank embeds and ranks its own share (the work is done once, not once per rank).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..base.args import nonnegative_int, positive_int, qrels_split
from ..base.errors import DiskFullError, DprGcError
from ..base.logs import nested_bar_disabled
from ..base.settings import FREE, check, setting

SCORE_BLOCK_ELEMENTS = 1 << 24  # questions x passages scored at once (64 MB of fp32)


@dataclasses.dataclass
class DevLimits:
    """DPR's ``val_av_rank_*`` caps: questions read, and negatives of each kind each question adds to the pool;
    and the qrels split a BEIR folder given as ``--dev`` is validated on (never its training split by default)."""

    max_questions: int = setting(10000, "--dev-max-questions", "--val_av_rank_max_qs", type=positive_int,
                                 help="dev questions used for validation (the first ones), as DPR's cap")
    hard_negatives: int = setting(30, "--dev-hard-negatives", "--val_av_rank_hard_neg", type=nonnegative_int,
                                  help="hard negatives per dev question added to the average-rank passage pool")
    other_negatives: int = setting(30, "--dev-other-negatives", "--val_av_rank_other_neg", type=nonnegative_int,
                                   help="other negatives per dev question added to the average-rank passage pool")
    batch_size: int = setting(64, "--dev-batch-size", "--dev_batch_size", type=positive_int,
                              help="dev questions per in-batch loss/accuracy group (and per encoding batch)")
    encode_batch_size: Optional[int] = setting(None, "--dev-encode-batch-size", "--val_av_rank_bsz",
                                               type=positive_int, resume=FREE,
                                               help="encoding batch of dev validation (default: --dev-batch-size)")
    beir_split: str = setting("dev", "--dev-beir-split", type=qrels_split,
                              help="the qrels split (qrels/SPLIT.tsv) a BEIR folder given as --dev is validated on")

    def __post_init__(self) -> None:
        check(self)
        if self.max_questions < 1 or self.batch_size < 1 or (self.encode_batch_size or 1) < 1:
            raise DprGcError("--dev-max-questions, --dev-batch-size and --dev-encode-batch-size must be >= 1")
        if self.hard_negatives < 0 or self.other_negatives < 0:
            raise DprGcError("--dev-hard-negatives and --dev-other-negatives must be >= 0")


def load_dev_data(dev_file: str, cache_dir: Optional[str], beir_split: str = "dev") -> Any:
    """The questions of the ``--dev`` file, or of a BEIR folder's ``beir_split`` qrels (a dataset; parsed once into
    its Arrow cache, which later calls reuse). Its errors name ``--dev``, so that they are not taken for the training
    data's, and a bad record's says to fix it, without the training data's advice to pass ``--skip-bad-records`` (no
    flag skips the dev file's records)."""
    from ..data.training import BadRecord, beir_splits, load_training_data

    splits = beir_splits(Path(dev_file)) if Path(dev_file).is_dir() else [beir_split]
    if beir_split not in splits:
        raise DprGcError(f"--dev {dev_file}: a BEIR folder is validated on qrels/{beir_split}.tsv, which it lacks "
                         f"(its splits: {', '.join(splits) or 'none'}); give --dev-beir-split SPLIT, or a DPR dev file")
    try:
        return load_training_data([dev_file], cache_dir, beir_split=beir_split).dataset
    except DiskFullError:
        raise
    except BadRecord as e:
        raise DprGcError(f"--dev: {e.where}: {e.problem}; fix the record") from None
    except DprGcError as e:
        raise DprGcError(f"--dev: {e}") from None


@dataclasses.dataclass
class DevPool:
    """The dev questions and the passages validation embeds, as (title, text): the average-rank pool first
    (``ranked`` of them), then those only the in-batch loss scores; per question, its gold passage and its loss
    candidates (DPR's order: gold, other negatives, hard negatives) as indices into ``passages``."""

    questions: list[str]
    passages: list[tuple[str, str]]
    ranked: int
    gold: list[int]
    candidates: list[list[int]]


def dev_pool(dataset: Any, limits: DevLimits, negatives: tuple[int, int] = (0, 0)) -> DevPool:
    """The :class:`DevPool` within ``limits``; ``negatives``: the hard and other negatives per question that the
    in-batch loss adds to the batch's gold passages, as DPR's ``validate_nll`` takes them (:func:`loss_contexts`)."""
    head = dataset.select(range(min(limits.max_questions, len(dataset))))
    rows = list(head.select_columns(["question", "positives", "hard_negatives", "negatives"]))
    pool: dict[str, tuple[int, str, str]] = {}

    def index(ctx: dict) -> int:
        return pool.setdefault(ctx["id"] or ctx["text"], (len(pool), ctx["title"], ctx["text"]))[0]

    gold = [[index(ctx) for ctx in row["positives"][:1] + row["hard_negatives"][:limits.hard_negatives]
             + row["negatives"][:limits.other_negatives]][0] for row in rows]
    ranked = len(pool)
    candidates = [[index(ctx) for ctx in loss_contexts(row, *negatives)] for row in rows]
    return DevPool([row["question"] for row in rows], [(title, text) for _, title, text in pool.values()], ranked,
                   gold, candidates)


def dev_negatives(data: Any) -> tuple[int, int]:
    """The (hard, other) negatives per question that the dev loss scores, those training takes (``data``: the run's
    :class:`~dpr_gc.train.config.DataConfig`; an unset ``--hard-negatives`` takes its default)."""
    return data.passages_per_query - 1 - data.other_negatives, data.other_negatives


def loss_contexts(row: dict, hard: int, other: int) -> list[dict]:
    """A dev question's in-batch loss candidates as DPR's ``create_biencoder_input`` takes them for validation (no
    shuffling): its first positive, its first ``other`` negatives and first ``hard`` hard negatives (its first
    negatives in their place when it has no hard ones)."""
    hards = row["hard_negatives"] or row["negatives"][:hard]
    return row["positives"][:1] + row["negatives"][:other] + hards[:hard]


def batch_losses(q: torch.Tensor, p: torch.Tensor, pool: DevPool, batch_size: int, temperature: float) -> torch.Tensor:
    """The in-batch loss summed over the questions and the number of them scoring their gold passage first: each
    batch of ``batch_size`` questions scored against the candidates of all of them (DPR's ``validate_nll``)."""
    totals = torch.zeros(2, dtype=torch.float64, device=q.device)
    for start in range(0, len(pool.gold), batch_size):
        block = pool.candidates[start:start + batch_size]
        starts = torch.tensor([0, *itertools.accumulate(len(c) for c in block)][:-1], device=q.device)
        candidates = torch.tensor([i for c in block for i in c], device=q.device)
        logits = q[start:start + batch_size] @ p[candidates].T / temperature
        totals[0] += nn.functional.cross_entropy(logits, starts, reduction="sum").double()
        totals[1] += (logits.argmax(1) == starts).sum()
    return totals


def gold_ranks(q: torch.Tensor, p: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """0-based rank of each question's gold passage among all passages (how many score above it: DPR's place in the
    sorted scores), scoring a block of questions at a time."""
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, len(p)))
    ranks = []
    for start in range(0, len(q), block):
        scores = q[start:start + block] @ p.T
        gold_scores = scores[torch.arange(len(scores)), gold[start:start + block]]
        ranks.append((scores > gold_scores[:, None]).sum(1))
    return torch.cat(ranks)


@torch.no_grad()
def evaluate_dev(retriever: Any, dev_file: Union[str, Any], limits: DevLimits, cache_dir: Optional[str],
                 split_over_ranks: bool = True, dtype: Optional[torch.dtype] = None,
                 show_progress: bool = False, negatives: tuple[int, int] = (0, 0)) -> dict:
    """DPR's in-batch loss and top-1 accuracy (``validate_nll``) over the dev questions in batches of
    ``limits.batch_size``, each scored against the batch's gold passages and ``negatives`` (hard, other) of each
    question (:func:`loss_contexts`), averaged over the questions; and DPR's average rank of each gold passage in
    the bounded pool.

    ``dev_file``: the ``--dev`` file, or its questions as :func:`load_dev_data` returned them (the trainer loads
    them once: each load fingerprints the file again and logs its counts), or their :func:`dev_pool` (built with
    its ``negatives``, which this then ignores: the trainer names the pool's size before the work).

    Under ``torch.distributed`` each rank embeds and ranks its own share and the results are gathered, so every
    rank returns the same metrics for the work of one; ``split_over_ranks=False`` has every rank do all of it (an
    FSDP model, whose forwards are collective). ``dtype``: the autocast dtype texts are embedded under (None: the
    weights' own); ``show_progress``: one bar over the questions and passages this rank embeds.
    """
    if isinstance(dev_file, DevPool):
        pool = dev_file
    else:
        dataset = (load_dev_data(dev_file, cache_dir, limits.beir_split) if isinstance(dev_file, (str, os.PathLike))
                   else dev_file)
        pool = dev_pool(dataset, limits, negatives)
    device = next(retriever.parameters()).device
    split = dist.is_initialized() and split_over_ranks
    rank, world = (dist.get_rank(), dist.get_world_size()) if split else (0, 1)
    encode_batch = limits.encode_batch_size or limits.batch_size
    mine = sum(hi - lo for lo, hi in (_share(len(rows), rank, world) for rows in (pool.questions, pool.passages)))
    with tqdm(total=mine, desc="dev validation", unit=" texts",
              disable=nested_bar_disabled(show_progress and rank == 0)) as bar:
        embed = functools.partial(_embed_shared, retriever, batch_size=encode_batch, device=device, rank=rank,
                                  world=world, dtype=dtype, bar=bar)
        q = embed("query", pool.questions, None)
        titles, texts = (list(column) for column in zip(*pool.passages))
        p = embed("passage", texts, titles)
    gold_t = torch.tensor(pool.gold, device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, rank sum
    totals[:2] = batch_losses(q, p, pool, limits.batch_size, float(retriever.temperature))
    lo, hi = _share(len(pool.gold), rank, world)
    totals[2] = gold_ranks(q[lo:hi], p[:pool.ranked], gold_t[lo:hi]).double().sum() if hi > lo else 0.0
    if world > 1:
        ranks_sum = totals[2:].clone()
        dist.all_reduce(ranks_sum)
        totals[2] = ranks_sum[0]
    n = len(pool.gold)
    return {"loss": float(totals[0]) / n, "accuracy": float(totals[1]) / n, "avg_rank": float(totals[2]) / n,
            "questions": n, "passages": pool.ranked}


def _share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``n`` rows (the last parts may be short or empty)."""
    size = -(-n // world)
    return min(n, rank * size), min(n, (rank + 1) * size)


def _embed_shared(retriever: Any, kind: str, texts: list[str], titles: Optional[list[str]], batch_size: int,
                  device: torch.device, rank: int, world: int, dtype: Optional[torch.dtype], bar: Any) -> torch.Tensor:
    """All rows' embeddings on ``device`` (under ``dtype`` autocast, advancing ``bar``); with several ranks each
    embeds its share and the shares are gathered."""
    lo, hi = _share(len(texts), rank, world)
    if hi > lo:
        mine = retriever.embed(kind, texts[lo:hi], titles[lo:hi] if titles else None, batch_size=batch_size,
                               dtype=dtype, progress=bar)
        mine_t = torch.from_numpy(mine).to(device)
    else:
        mine_t = torch.zeros(0, retriever.dim, device=device)
    if world == 1:
        return mine_t
    size = -(-len(texts) // world)
    padded = torch.zeros(size, mine_t.shape[1], device=device)
    padded[:len(mine_t)] = mine_t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[:len(texts)]
