"""Issue 30: every positive of a BEIR folder is used. By default an epoch holds one example per (query, positive)
qrels pair (never two of one query in a global batch); ``sample`` holds one per query with a positive drawn at each
draw; the log says how many pairs/queries an epoch uses and how many the last partial batch leaves out."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import dpr_gc.data.training as D
from dpr_gc.train.config import DataConfig
from dpr_gc.train.trainer import Trainer
from tests.train_data import train_config, write_beir

def epoch_batches(loader, epoch: int) -> list[list[tuple[str, str]]]:
    loader.batch_sampler.set_epoch(epoch)
    return [[(e["question"], e["passages"][0][1]) for e in batch] for batch in loader]


def test_pairs_every_positive_each_epoch_no_query_twice_in_a_batch(tmp_path: Path) -> None:
    pairs = write_beir(tmp_path / "beir")
    data = D.load_training_data([tmp_path / "beir"], tmp_path / "cache")
    total = sum(len(v) for v in pairs.values())  # 12 queries, 16 pairs
    assert (len(data), total) == (12, 16)
    loader = D.make_dataloader(data, lambda examples: examples, batch_size=4, hard_negatives=0, seed=1, beir_positives="pairs")
    assert loader.batch_sampler.batches_per_epoch == 4  # 16 examples, four whole batches of 4: nothing left out
    for epoch in range(10):
        batches = epoch_batches(loader, epoch)
        seen = [pair for batch in batches for pair in batch]
        assert Counter(seen) == Counter((q, t) for q, texts in pairs.items() for t in texts)
        for batch in batches:
            assert len({q for q, _ in batch}) == len(batch)  # one query never twice in a batch


def test_a_global_batch_larger_than_the_distinct_queries_is_refused_up_front(tmp_path: Path) -> None:
    """12 queries, 16 pairs: a global batch of 13 must hold a query twice (spread_groups gave up and the batch
    silently repeated one); it is refused naming --batch-size and the count, per rank under DDP, and per source
    with per-file batches. A batch of all 12 queries spreads the pairs: no query twice."""
    from dpr_gc.base.errors import DprGcError

    write_beir(tmp_path / "beir")
    write_beir(tmp_path / "small", queries=6)
    data = D.load_training_data([tmp_path / "beir"], tmp_path / "cache")
    make = lambda **kw: D.make_dataloader(data, lambda examples: examples, hard_negatives=0, seed=1,  # noqa: E731
                                          beir_positives="pairs", **kw)
    with pytest.raises(DprGcError, match=r"^--batch-size 13 is more than the 12 distinct queries of the training "
                                         r"data: a global batch would hold a query twice .*; use --batch-size 12 or "
                                         r"less$"):
        make(batch_size=13)
    with pytest.raises(DprGcError, match=r"^--batch-size 7 x 2 ranks = 14 is more than the 12 distinct .*; use "
                                         r"--batch-size 6 or less$"):
        make(batch_size=7, world_size=2)
    for epoch in range(5):
        assert all(len({q for q, _ in batch}) == 12 for batch in epoch_batches(make(batch_size=12), epoch))
    both = D.load_training_data([tmp_path / "beir", tmp_path / "small"], tmp_path / "cache")
    with pytest.raises(DprGcError, match="the 6 distinct queries of a training source"):
        D.make_dataloader(both, lambda examples: examples, batch_size=8, hard_negatives=0, beir_positives="pairs",
                          per_file_batches=True)
    D.make_dataloader(both, lambda examples: examples, batch_size=8, hard_negatives=0, beir_positives="pairs")


def test_sample_one_example_per_query_with_drawn_positives(tmp_path: Path) -> None:
    pairs = write_beir(tmp_path / "beir")
    data = D.load_training_data([tmp_path / "beir"], tmp_path / "cache")
    loader = D.make_dataloader(data, lambda examples: examples, batch_size=4, hard_negatives=0, seed=1, beir_positives="sample")
    assert loader.batch_sampler.batches_per_epoch == 3  # 12 queries
    drawn = {}
    for epoch in range(12):
        seen = [pair for batch in epoch_batches(loader, epoch) for pair in batch]
        assert sorted(q for q, _ in seen) == sorted(pairs)
        for q, t in seen:
            assert t in pairs[q]
            drawn.setdefault(q, set()).add(t)
    assert drawn["which city 0"] == pairs["which city 0"]  # over epochs each of its three positives comes up


def test_the_default_is_pairs_and_the_log_counts_the_epoch(tmp_path: Path, make_retriever, caplog) -> None:
    assert DataConfig().beir_positives == "pairs"
    write_beir(tmp_path / "beir")
    make_retriever().save(tmp_path / "model")
    config = train_config(model=str(tmp_path / "model"), train_files=[str(tmp_path / "beir")], batch_size=5,
                          hard_negatives=0, num_workers=0, output_dir=str(tmp_path / "out"),
                          cache_dir=str(tmp_path / "cache"), query_chunk_size=5, passage_chunk_size=5)
    with caplog.at_level(logging.INFO, logger="dpr_gc"):
        trainer = Trainer(config)
    assert trainer.steps_per_epoch == 3
    assert "16 (query, positive) pairs of 12 queries (--beir-positives pairs); 3 steps of 5 use 15 of the 16 " \
           "examples, 1 left out" in caplog.text


def test_resume_refuses_another_choice(tmp_path: Path) -> None:
    write_beir(tmp_path / "beir")
    data = D.load_training_data([tmp_path / "beir"], tmp_path / "cache")
    state = D.make_dataloader(data, lambda e: e, batch_size=4, beir_positives="pairs").batch_sampler.state_dict(1)
    from dpr_gc.base.errors import DprGcError

    with pytest.raises(DprGcError, match="the data setup changed"):
        D.make_dataloader(data, lambda e: e, batch_size=4, beir_positives="sample").batch_sampler.load_state_dict(state)


def test_spread_groups_only_moves_what_repeats() -> None:
    from dpr_gc.data.sampling import spread_groups

    groups = np.array([0, 0, 1, 2, 3, 4])
    assert spread_groups(np.array([0, 1, 2, 3, 4, 5]), groups, 2).tolist() == [0, 2, 1, 3, 4, 5]
    assert spread_groups(np.array([0, 2, 1, 3]), groups, 2).tolist() == [0, 2, 1, 3]
    assert spread_groups(np.array([2, 3, 0, 1]), groups, 2).tolist() == [1, 3, 0, 2]  # the last batch: swapped back
    # SciFact's shape: 809 queries, some with 2-5 positives, batches of 128: no batch repeats a query
    k = np.ones(809, dtype=np.int64)
    k[:80], k[:15], k[:3] = 2, 3, 5
    groups = np.repeat(np.arange(809), k)
    for seed in range(3):
        order = spread_groups(np.random.default_rng(seed).permutation(len(groups)), groups, 128)
        assert sorted(order) == list(range(len(groups)))
        assert all(len(set(groups[order[b:b + 128]])) == 128 for b in range(0, len(order) // 128 * 128, 128))
