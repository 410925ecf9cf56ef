"""Training-signal fidelity end to end: duplicate positives are masked in the trainer's loss (and counted in
metrics.jsonl), a question's own positive never serves as its hard negative, and a diverging run stops with one
``error:`` line instead of saving NaN weights."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpr_gc.cli import main
from dpr_gc.data.training import Collator, load_dpr_files, make_dataloader
from dpr_gc.train.trainer import train
from tests.train_data import init_model, train_config
from tests.train_data import make_records, write_dpr


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("fidelity"))


def shared_positive_records(n: int) -> list[dict]:
    """``n`` questions whose positive is the same passage (same id, title and text), as several SciFact claims cite
    one abstract."""
    positive = {"title": "paris", "text": "paris is the city of the river", "passage_id": "doc-1"}
    return [{"question": f"what city {i}", "answers": [], "positive_ctxs": [dict(positive)],
             "hard_negative_ctxs": []} for i in range(n)]


def train_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--train", str(data), "--output", str(out), "--model", str(model), "--num-workers", "0",
            "--cache-dir", str(out.parent / "cache"), *extra]


@pytest.mark.parametrize("cache", [True, False])
def test_questions_sharing_a_positive_do_not_see_it_as_a_negative(tmp_path, model, cache):
    data = write_dpr(tmp_path / "shared.json", shared_positive_records(8))
    flags = ["--batch-size", "8", "--hard-negatives", "0", "--max-steps", "1", "--temperature", "0.05"]
    if cache:
        flags += ["--query-chunk-size", "3", "--passage-chunk-size", "3"]
    else:
        flags += ["--no-grad-cache"]
    assert main(train_args(data, model, tmp_path / "out", *flags)) == 0
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["masked_scores"] == 8 * 7  # every question drops the 7 copies of its positive
    assert record["loss"] < 1e-5  # unmasked it is log 8 = 2.08 or more


@pytest.mark.parametrize("mask", [True, False])
def test_duplicate_positive_mask_switches_the_same_way_from_the_cli_and_the_library(tmp_path, model, mask):
    """``--no-mask-duplicate-positives`` (``OptimConfig(mask_duplicate_positives=False)``) gives DPR's loss: 8
    questions sharing one positive see 8 equal scores, log 8; masked, the 7 copies are dropped."""
    data = write_dpr(tmp_path / "shared.json", shared_positive_records(8))
    flags = ["--batch-size", "8", "--hard-negatives", "0", "--max-steps", "1", "--query-chunk-size", "3",
             "--passage-chunk-size", "3"]
    switch = "--mask-duplicate-positives" if mask else "--no-mask-duplicate-positives"
    assert main(train_args(data, model, tmp_path / "cli", *flags, switch)) == 0
    config = train_config(train_files=[str(data)], output_dir=str(tmp_path / "lib"), model=str(model),
                          num_workers=0, cache_dir=str(tmp_path / "cache"), batch_size=8, hard_negatives=0,
                          max_steps=1, query_chunk_size=3, passage_chunk_size=3, mask_duplicate_positives=mask)
    train(config)
    first = [json.loads((tmp_path / side / "metrics.jsonl").read_text().splitlines()[0]) for side in ("cli", "lib")]
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], abs=1e-6)
    assert first[0]["masked_scores"] == first[1]["masked_scores"] == (8 * 7 if mask else 0)
    assert first[0]["loss"] < 1e-5 if mask else first[0]["loss"] == pytest.approx(math.log(8), abs=1e-4)
    recorded = json.loads((tmp_path / "cli" / "train_config.json").read_text())
    assert recorded["optim"]["mask_duplicate_positives"] is mask  # recorded, and fixed on --resume


def test_hard_negative_that_is_the_own_positive_is_dropped_at_load(tmp_path, model, caplog):
    records = make_records(6, 4, hard=2)
    records[0]["hard_negative_ctxs"][1] = dict(records[0]["positive_ctxs"][0])  # same id, title and text
    records[1]["hard_negative_ctxs"][0]["passage_id"] = records[1]["positive_ctxs"][0]["passage_id"]  # same id
    records[2]["negative_ctxs"] = [{k: v for k, v in records[2]["positive_ctxs"][0].items() if k != "passage_id"}]
    path = write_dpr(tmp_path / "t.json", records)
    with caplog.at_level(logging.WARNING, logger="dpr_gc.data.training"):
        data = load_dpr_files([path], tmp_path / "cache")
    assert data.stats[0]["dropped_negatives"] == 3
    assert "dropped 3 (hard) negatives that are their question's own positive" in caplog.text
    rows = data.dataset[:3]
    assert [len(r) for r in rows["hard_negatives"]] == [1, 1, 2] and rows["negatives"][2] == []
    from dpr_gc.model.retriever import Retriever

    collator = Collator(Retriever.load(model))
    batch = next(iter(make_dataloader(data, collator, batch_size=6, hard_negatives=1, shuffle=False)))
    ids = batch["passage_ids"].view(6, 2, 2)  # per question its positive and hard negative, each keyed two ways
    assert not (ids[:, 1, None, :] == ids[:, 0, :, None]).any()  # no question's hard negative is its positive
    assert torch.equal(batch["positive_ids"], ids[:, 0])  # the keys of its one positive


SEINE = {"title": "Seine", "text": "the seine is a river in paris"}
COPIES = {"with its id": {**SEINE, "passage_id": "p1"}, "without an id": dict(SEINE),
          "with its id under id": {**SEINE, "id": "p1"},
          "with an empty passage_id": {**SEINE, "passage_id": "", "id": "p1"},
          "with its id and other text": {"title": "Seine", "text": "the seine river", "passage_id": "p1"}}


@pytest.mark.parametrize("copy", COPIES)
def test_a_copy_of_a_positive_is_masked_whether_or_not_it_has_an_id(tmp_path, model, copy):
    """Question 1's hard negative is question 0's positive: a copy with the same passage id, or with the same title
    and text when either copy has no id, is dropped from question 0's negatives (one masked score), and the loss is
    the same as with the id; an empty ``passage_id`` is no id (the next id key is read)."""
    from dpr_gc import SimpleContrastiveLoss
    from dpr_gc.model.retriever import Retriever

    def record(question: str, positive: dict, hard: dict) -> dict:
        return {"question": question, "answers": [], "positive_ctxs": [positive], "hard_negative_ctxs": [hard]}

    other = {"title": "x", "text": "music film book", "passage_id": "n1"}
    london = {"title": "Thames", "text": "the thames is a river in london", "passage_id": "p2"}
    collator = Collator(Retriever.load(model))
    losses = {}
    for name in ("with its id", copy):
        path = write_dpr(tmp_path / f"{len(losses)}.json", [record("which river flows through paris",
                                                                   {**SEINE, "passage_id": "p1"}, other),
                                                            record("which river flows through london", london,
                                                                   COPIES[name])])
        data = load_dpr_files([path], tmp_path / "cache")
        batch = next(iter(make_dataloader(data, collator, batch_size=2, hard_negatives=1, shuffle=False)))
        torch.manual_seed(0)
        loss_fn = SimpleContrastiveLoss(1)
        losses[name] = float(loss_fn(torch.randn(2, 8), torch.randn(4, 8), passage_ids=batch["passage_ids"],
                                     positive_ids=batch["positive_ids"]))
        assert loss_fn.masked_scores == 1, name
    assert losses[copy] == losses["with its id"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_diverging_run_stops_without_saving(tmp_path, model, capsys, precision):
    data = write_dpr(tmp_path / "t.json", make_records(64, 5))
    out = tmp_path / "out"
    code = main(train_args(data, model, out, "--batch-size", "8", "--learning-rate", "1e9", "--max-steps", "8",
                           "--save-every", "1", "--precision", precision, "--query-chunk-size", "4",
                           "--passage-chunk-size", "8", "--weight-decay", "0.1"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: training diverged at step "), err
    print(err[0])
    step = int(err[0].split("at step ")[1].split(":")[0])
    assert f"last good checkpoint is {out / f'checkpoint-{step - 1}'}" in err[0] or step == 1
    assert not (out / "final").exists() and not (out / "best").exists()
    for checkpoint in out.glob("checkpoint-*"):
        weights = load_file(next(checkpoint.glob("model/**/*.safetensors")))
        assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow  # 26 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_fp16_stops_after_a_run_of_skipped_steps(tmp_path, model, capsys):
    from dpr_gc.train.trainer import MAX_SKIPPED_STEPS

    data = write_dpr(tmp_path / "t.json", make_records(64, 5))
    out = tmp_path / "out"
    code = main(train_args(data, model, out, "--batch-size", "8", "--learning-rate", "1e9", "--max-steps", "60",
                           "--precision", "fp16", "--query-chunk-size", "8", "--passage-chunk-size", "16"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    assert f"the fp16 GradScaler skipped {MAX_SKIPPED_STEPS + 1} steps in a row" in err[0]
    assert "no checkpoint was written" in err[0]
    assert not (out / "final").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r["skipped"]]
    assert len(skipped) == MAX_SKIPPED_STEPS  # logged; the next one stopped the run
    assert all(r["grad_norm"] is None for r in skipped)  # NaN or infinite, written as null
