"""Measure: how many in-batch scores pit a question against a copy of one of its own positives (duplicate positives).

Several SciFact claims cite one abstract, so a batch can hold the same passage as the positive of two questions, or
a question's other positive as another question's positive. Each such score is a false negative unless the loss
drops it. This script replays epochs of the real sampler and training examples (no model), builds the passage ids the
collator gives the loss, and counts the scores the loss's mask drops, per epoch; it ends with a ``| item | value |``
table of the means per epoch, the results file and the machine.

    python benchmarks/duplicate_positives.py --data ../shared/data/scifact --batch-size 256 --hard-negatives 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import (default_output, machine_info, output_help, parser, run_script, setup_logging,  # noqa: E402
                          summary_table)
from dpr_gc.base.args import nonnegative_int, positive_int  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.data.sampling import MixedBatchSampler  # noqa: E402
from dpr_gc.data.training import TrainingExamples, key_ids, load_training_data  # noqa: E402
from dpr_gc.engine.loss import Exclusion  # noqa: E402


def batch_ids(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Passage ids [P, 2], positive ids [B, K] and targets of one batch, as the collator and the loss build them."""
    passage_ids = key_ids([keys for item in items for keys in item["passage_keys"]], 2)
    positive_ids = key_ids([item["positive_keys"] for item in items])
    targets = torch.arange(len(items)) * len(items[0]["passage_keys"])
    return passage_ids, positive_ids, targets


def count(data, batch_size: int, hard: int, epochs: int, seed: int) -> list[dict]:
    """Per epoch: batches, scores, dropped scores (all; those that are a copy of the question's sampled positive)
    and questions with at least one dropped score."""
    sampler = MixedBatchSampler(data.sizes, batch_size, seed=seed)
    examples = TrainingExamples(data.dataset, hard, 0, seed=seed, global_batch=sampler.global_batch)
    per_epoch = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        row = {"epoch": epoch, "batches": 0, "scores": 0, "masked": 0, "masked_same_sampled_positive": 0,
               "questions_affected": 0}
        for batch in sampler:
            items = [examples[key] for key in batch]
            passage_ids, positive_ids, targets = batch_ids(items)
            own = passage_ids[targets]
            everything = Exclusion(torch.cat([own, positive_ids], 1), passage_ids, targets).dense()
            sampled = Exclusion(own, passage_ids, targets).dense()
            row["batches"] += 1
            row["scores"] += everything.numel()
            row["masked"] += int(everything.sum())
            row["masked_same_sampled_positive"] += int(sampled.sum())
            row["questions_affected"] += int(everything.any(1).sum())
        per_epoch.append(row)
    return per_epoch


def replay_args(doc: str, stem: str, argv: Optional[list[str]]) -> argparse.Namespace:
    """The flags of a sampler replay (this script and filled_negatives.py): data, batch, epochs, seed, output
    (``benchmarks/results/STEM.json`` for the committed run's sizes: the defaults)."""
    p = parser(doc)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"), help="BEIR folder")
    p.add_argument("--batch-size", type=positive_int, default=256, help="questions per global batch")
    p.add_argument("--hard-negatives", type=nonnegative_int, default=1, help="hard negatives per question")
    p.add_argument("--epochs", type=positive_int, default=6, help="epochs to replay")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--output", help=output_help(stem))
    args = p.parse_args(argv)
    args.output = default_output(stem, p.parse_args, args, ("batch_size", "hard_negatives", "epochs", "seed"))
    return args


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    return replay_args(__doc__, "duplicate-positives", argv)


def load_replay_data(folder: str, cache: str) -> Any:
    """The training examples of the BEIR folder ``folder`` (``--data``), refused in one line if it is no folder."""
    if not Path(folder).is_dir():
        raise DprGcError(f"--data {folder}: not a folder; give a BEIR folder (corpus.jsonl, queries.jsonl, qrels/), "
                         "e.g. ../shared/data/scifact")
    return load_training_data([folder], cache)


def summary_items(report: dict) -> dict[str, str]:
    """The closing table's rows: the scores the loss's mask drops per epoch, their share of all scores, and the
    questions they touch."""
    mean = report["mean_per_epoch"]
    return {"questions": str(report["questions"]), "scores per epoch": f"{mean['scores']:.0f}",
            "scores masked per epoch": f"{mean['masked']:.1f} ({mean['masked_same_sampled_positive']:.1f} a copy of "
                                       "the sampled positive)",
            "share of scores masked": f"{mean['masked'] / max(mean['scores'], 1):.3%}",
            "questions affected per epoch": f"{mean['questions_affected']:.1f} of {report['questions']}"}


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    setup_logging("%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as cache:
        data = load_replay_data(args.data, cache)
        epochs = count(data, args.batch_size, args.hard_negatives, args.epochs, args.seed)
    total = {k: sum(e[k] for e in epochs) for k in epochs[0] if k != "epoch"}
    report = {"machine": machine_info(), "data": args.data, "questions": len(data), "batch_size": args.batch_size,
              "hard_negatives": args.hard_negatives, "epochs": args.epochs, "seed": args.seed,
              "per_epoch": epochs, "mean_per_epoch": {k: v / args.epochs for k, v in total.items()}}
    write_json(args.output, report)
    print(summary_table(summary_items(report), args.output, report["machine"], time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
