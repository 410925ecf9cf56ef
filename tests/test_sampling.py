"""Filled-in negatives: never a positive or an answer-bearing passage of any question in the same global batch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dpr_gc.data import training as D
from dpr_gc.evaluation.evaluate import has_answer
from dpr_gc.data.sampling import BatchExclusion, MixedBatchSampler


def positives_only(n: int, cross_answers: bool) -> list[dict]:
    """Questions without negatives (like a BEIR folder); with ``cross_answers`` each positive also contains the
    next question's answer, so a fill taken from it would be answer-bearing for that question."""
    out = []
    for i in range(n):
        text = f"passage about topic{i} with answer{i}" + (f" and answer{(i + 1) % n}" if cross_answers else "")
        out.append({"question": f"which topic{i}?", "answers": [f"answer{i}"],
                    "positive_ctxs": [{"passage_id": f"p{i}", "title": f"t{i}", "text": text}]})
    return out


def global_batches(data: D.TrainingData, batch_size: int, world_size: int, hard: int, epochs: int = 3) -> list:
    """Every global batch as a list of raw examples (all ranks), from the real DataLoader of each rank."""
    loaders = [D.make_dataloader(data, lambda examples: examples, batch_size=batch_size, hard_negatives=hard, seed=3,
                                 rank=r, world_size=world_size) for r in range(world_size)]
    out = []
    for epoch in range(epochs):
        for loader in loaders:
            loader.batch_sampler.set_epoch(epoch)
        out.extend([e for part in parts for e in part] for parts in zip(*loaders))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_filled_negatives_are_no_positive_of_the_global_batch(tmp_path: Path, world_size: int) -> None:
    recs = positives_only(40, cross_answers=False)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = D.load_dpr_files([path], cache_dir=tmp_path / "cache")
    batches = global_batches(data, 16 // world_size, world_size, hard=2)
    assert len(batches) == 6 and all(len(b) == 16 for b in batches)
    for batch in batches:
        batch_positives = {e["passages"][0] for e in batch}
        for example in batch:
            fills = example["passages"][1:]
            assert len(fills) == 2 and not batch_positives & set(fills)


def test_filled_negatives_bear_no_answer_of_the_global_batch(tmp_path: Path, caplog) -> None:
    recs = positives_only(40, cross_answers=True)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = D.load_dpr_files([path], cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="dpr_gc.data.sampling"):
        batches = global_batches(data, 8, 2, hard=1)
    for batch in batches:
        answers = [a for e in batch for a in recs[int(e["question"][len("which topic"):-1])]["answers"]]
        for example in batch:
            assert not has_answer(answers, example["passages"][1][1])
    assert "40 of 40 questions have fewer than 1 negatives: 40 of the 40 negative slots" in caplog.text


def test_fill_excludes_the_questions_own_positives_and_duplicates(tmp_path: Path) -> None:
    recs = positives_only(12, cross_answers=False)
    recs[5]["question"] = recs[4]["question"]  # the same question twice: row 5's positive is row 4's too
    recs[7]["positive_ctxs"] = [dict(recs[6]["positive_ctxs"][0])]  # a passage shared by two questions
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = D.load_dpr_files([path], cache_dir=tmp_path / "cache")
    examples = D.TrainingExamples(data.dataset, hard_negatives=3, seed=0)
    for row in range(12):
        for epoch in range(20):
            fills = {p[1] for p in examples[(row, epoch, row)]["passages"][1:]}
            own = {c["text"] for c in recs[row]["positive_ctxs"]}
            assert not fills & own
            if row in (4, 5):
                assert not fills & {recs[4]["positive_ctxs"][0]["text"], recs[5]["positive_ctxs"][0]["text"]}


def test_a_copy_of_a_batch_positive_under_another_id_or_none_fills_no_slot() -> None:
    """``BatchExclusion.allows``: a passage is a batch positive by its id or by its text, so a copy of one with the
    same text under another id, or under none, never fills a negative slot; another text under another id may."""
    positives = [[{"id": "p1", "title": "T", "text": "gold text"}]]
    exclusion = BatchExclusion([0], {"question": ["q0"], "answers": [[]], "positives": positives})
    assert exclusion.allows(5, "q5", {"id": "p9", "title": "T", "text": "other text"})
    assert not exclusion.allows(5, "q5", {"id": "p1", "title": "T", "text": "other text"})
    for other_id in ("p9", ""):
        assert not exclusion.allows(5, "q5", {"id": other_id, "title": "T", "text": "gold text"}), other_id


def test_global_batch_spans_all_ranks() -> None:
    sampler = MixedBatchSampler([30], 4, seed=2, rank=1, world_size=3)
    order = sampler.epoch_order(1)
    start, rows = sampler.global_batch(1, 13)
    assert start == 12 and list(rows) == list(order[12:24])
    sampler.set_epoch(1)
    first = next(iter(sampler))
    assert [p for _, _, p in first] == [4, 5, 6, 7] and all(sampler.global_batch(1, p)[0] == 0 for _, _, p in first)


def test_filled_slots_count_the_examples_an_epoch_draws(tmp_path: Path, caplog) -> None:
    """The fill line counts an epoch's draws as the "an epoch" line does: a BEIR folder's (query, positive) pairs
    (12 queries, 16 pairs, no negatives) and --sampling-rates (a DPR file of 12 questions with a negative each at
    rate 0.5 draws 6), not the 24 rows: 16 of the 22 slots (72.7%), not 12 of 24 (50%)."""
    from tests.train_data import write_beir

    write_beir(tmp_path / "beir")
    recs = positives_only(12, cross_answers=False)
    for i, rec in enumerate(recs):
        rec["hard_negative_ctxs"] = [{"passage_id": f"n{i}", "title": "", "text": f"unrelated {i}"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = D.load_training_data([tmp_path / "beir", path], tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="dpr_gc.data.sampling"):
        D.make_dataloader(data, lambda examples: examples, batch_size=4, hard_negatives=1, rates=[1.0, 0.5],
                          beir_positives="pairs")
    assert ("12 of 24 questions have fewer than 1 negatives: 16 of the 22 negative slots of an epoch (22 examples; "
            "72.7%) are filled") in caplog.text
