"""Measure: how many filled-in negatives are false negatives, without and with the global-batch exclusion.

A training question with fewer negatives than the step needs (every question of a BEIR folder) gets the positive of a
random other question in each missing slot. Drawing over the whole data set (the question's own positives excluded,
as before the fix) lets a fill be the positive of another question *in the same batch*, which then meets a copy of
its own gold passage as a negative. This script replays epochs of the real sampler and counts those fills for both
rules; no model is involved, so it takes seconds. It ends with a ``| item | value |`` table of both rules' false
negatives, the results file and the machine.

    python benchmarks/filled_negatives.py --data ../shared/data/scifact --batch-size 256 --hard-negatives 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dpr_gc.data.training import TrainingExamples  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.data.sampling import MixedBatchSampler  # noqa: E402
from bench_common import machine_info, run_script, setup_logging, summary_table  # noqa: E402
from duplicate_positives import load_replay_data, replay_args  # noqa: E402


def count(data, batch_size: int, hard: int, epochs: int, seed: int, global_batch: bool) -> dict:
    """Fills, and fills that are a positive of a question of the same global batch, over ``epochs``."""
    sampler = MixedBatchSampler(data.sizes, batch_size, seed=seed)
    examples = TrainingExamples(data.dataset, hard, 0, seed=seed,
                                global_batch=sampler.global_batch if global_batch else None)
    fills = false = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in sampler:
            items = [examples[key] for key in batch]
            positives = {p for row, _, _ in batch for p in
                         ((c["title"], c["text"]) for c in data.dataset[int(row)]["positives"])}
            for item in items:
                for passage in item["passages"][1:]:
                    fills += 1
                    false += passage in positives
    return {"fills": fills, "false_negatives": false, "share": false / max(fills, 1)}


def summary_items(report: dict) -> dict[str, str]:
    """The closing table's rows: the false negatives among the fills under each rule."""
    items = {"questions": str(report["questions"])}
    for key in ("whole_data_set_draw", "global_batch_exclusion"):
        rule = report[key]
        items[f"false negatives, {key.replace('_', ' ')}"] = (f"{rule['false_negatives']} ({rule['share']:.3%}) of "
                                                              f"{rule['fills']} fills")
    return items


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    return replay_args(__doc__, "filled-negatives", argv)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    setup_logging("%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as cache:
        data = load_replay_data(args.data, cache)
        report = {"machine": machine_info(), "data": args.data, "questions": len(data), "batch_size": args.batch_size,
                  "hard_negatives": args.hard_negatives, "epochs": args.epochs, "seed": args.seed,
                  "whole_data_set_draw": count(data, args.batch_size, args.hard_negatives, args.epochs, args.seed,
                                               False),
                  "global_batch_exclusion": count(data, args.batch_size, args.hard_negatives, args.epochs,
                                                  args.seed, True)}
    write_json(args.output, report)
    print(summary_table(summary_items(report), args.output, report["machine"], time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
