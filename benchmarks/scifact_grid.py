"""Benchmark: what batch size buys once hard negatives are there -- SciFact, batch x hard negatives per query.

One mining run (zero-shot all-MiniLM-L6-v2 dense candidates over all 809 training queries, positive-aware with
``--max-negative-ratio``), then one training run per cell: batch {32, 128, 512} x hard negatives per query and step
{0, 1, 3} x duplicate-positive masking (``--masking on off``: the same recipe with ``dpr-gc train
--no-mask-duplicate-positives`` beside it, DPR's loss), the same epochs, learning rate and warm-up fraction, Gradient
Cache with the same chunk in every cell (so activation memory stays flat and the batch is the only thing that
grows). Each cell's model is evaluated on the 300 test queries (nDCG@10, MRR@10, Recall@100); train time, peak RSS
and the scores the mask dropped per cell. Nothing is chosen from these figures. Every step is a ``python -m
dpr_gc.cli`` subprocess (the pieces come from ``scifact_loop.py``); ``--parallel N`` trains and scores N cells at
once (results in grid order).

    python benchmarks/scifact_grid.py --quick                       # smoke test on a CPU; runs/scifact-grid-quick/
    python benchmarks/scifact_grid.py --device cuda --model PATH --output DIR --parallel 4
    python benchmarks/scifact_grid.py --batches 256 --negatives 1 --masking on off ...   # the masking pair
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scifact_loop import (LoopSettings, Loop, ReportHead, Runner, add_settings_flags, common_parser,  # noqa: E402
                          count_queries, default_results, open_work, opt, prepare_data, report_errors, settings_from,
                          write_report)
from bench_common import setup_logging  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402

logger = logging.getLogger("scifact_grid")


@dataclasses.dataclass
class GridSettings(LoopSettings):
    """The loop's settings plus the grid's axes and the one mining filter."""

    batches: tuple = opt((32, 128, 512), "batch sizes (queries per step)")
    negatives: tuple = opt((0, 1, 3), "hard negatives per query and step")
    masking: tuple = opt(("on",), "duplicate-positive masking per cell: on, off (DPR's loss), or both: on off")
    ratio: float = opt(0.95, "--max-negative-ratio of the one mining run (0: no positive-aware filter)")


QUICK = dict(query_max_length=24, max_length=32, train_max_length=32, chunk_size=4, epochs=1, mine_top_k=10,
             mine_keep=3, encode_batch_size=32, precision="fp32", batches=(8,), negatives=(1,), masking=("on", "off"))
COMMITTED = GridSettings()  # the committed scifact-grid-cpu.json's settings (benchmarks/README.md's command)
GRID_ONLY = ("filters", "round2", "refit", "dev_fraction", "batch_size", "hard_negatives", "mine_source",
             "train_seeds")


def run_grid(loop: Loop, s: GridSettings, base_model: str, save: Callable[[dict], None]) -> dict:
    """Zero-shot index, its test metrics beside one mining run, then every cell trained and evaluated on test,
    ``--parallel`` cells at once, each to its end before the next cell starts (``save`` gets the results so far, in
    grid order, after each cell, so a run cut short still leaves its finished cells)."""
    zero_index = loop.index("zeroshot", base_model)
    zero, (file, counts) = loop.run.all(
        lambda: loop.evaluate("zeroshot", base_model, zero_index, ("test",))["test"],
        lambda: loop.mine("mine", "train", s.ratio or None, (base_model, zero_index), False))
    grid = [(b, h, m) for b in s.batches for h in s.negatives for m in s.masking]
    done: dict[tuple, dict] = {}
    lock = threading.Lock()

    def cell(key: tuple) -> dict:
        batch, negatives, masking = key
        tag = f"b{batch}-h{negatives}" + ("-nomask" if masking == "off" else "")
        model, trained = loop.train(tag, file, base_model, hard_negatives=negatives, batch_size=batch,
                                    mask=masking == "on")
        metrics = loop.evaluate(tag, model, loop.index(tag, model), ("test",))["test"]
        out = {"batch_size": batch, "hard_negatives": negatives, "masking": masking, **metrics,
               "train_s": trained["wall_s"], "steps": trained["steps"], "peak_rss_mb": trained["peak_rss_mb"],
               "masked_scores": trained.get("masked_scores"), "chunk_size": s.chunk_size}
        logger.info("%s: nDCG@10 %.4f, train %.0f s", tag, metrics["ndcg@10"], trained["wall_s"])
        with lock:
            done[key] = out
            save({"zeroshot": zero, "mining": counts, "cells": [done[k] for k in grid if k in done]})
        return out

    cells = loop.run.map(cell, grid, workers=loop.run.parallel)  # a cell ends before the next one starts
    return {"zeroshot": zero, "mining": counts, "cells": cells}


def table(cells: list[dict], batches: tuple, negatives: tuple, masking: tuple) -> str:
    """nDCG@10 (train seconds) with one row per batch (and masking, when both are run) and one column per
    hard-negative count."""
    at = {(c["batch_size"], c["hard_negatives"], c.get("masking", "on")): c for c in cells}

    def cell(b: int, h: int, m: str) -> str:
        c = at.get((b, h, m))
        return f"{c['ndcg@10']:.4f} ({c['train_s']:.0f} s)" if c else "not run"

    rows = [(b, m) for b in batches for m in masking]
    label = (lambda b, m: f"{b}, masking {m}") if len(masking) > 1 else (lambda b, m: str(b))
    lines = ["| batch | " + " | ".join(f"{h} hard negatives" for h in negatives) + " |",
             "|---:|" + "---:|" * len(negatives)]
    lines += [f"| {label(b, m)} | " + " | ".join(cell(b, h, m) for h in negatives) + " |" for b, m in rows]
    return "\n".join(lines)


def masking_effect(cells: list[dict]) -> list[dict]:
    """For each cell run with masking on and off: both nDCG@10, on minus off, and the scores the mask dropped."""
    at = {(c["batch_size"], c["hard_negatives"], c.get("masking", "on")): c for c in cells}
    return [{"batch_size": b, "hard_negatives": h, "ndcg@10_masked": on["ndcg@10"],
             "ndcg@10_unmasked": at[b, h, "off"]["ndcg@10"],
             "masked_minus_unmasked": round(on["ndcg@10"] - at[b, h, "off"]["ndcg@10"], 4),
             "masked_scores": on.get("masked_scores")}
            for (b, h, m), on in at.items() if m == "on" and (b, h, "off") in at]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """The grid's command line (its settings flags among them), read without running anything."""
    p = common_parser(__doc__.splitlines()[0], "scifact-grid")
    add_settings_flags(p, GridSettings, skip=GRID_ONLY)
    return p.parse_args(argv)


def results_file(args: argparse.Namespace) -> Optional[Path]:
    """The results file a run with ``args`` writes outside its work folder (see :func:`default_results`)."""
    return default_results(args, "scifact-grid", settings_from(args, GridSettings, QUICK), COMMITTED)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    return report_errors(lambda: run(args))


def run(args: argparse.Namespace) -> Any:
    s = settings_from(args, GridSettings, QUICK)
    if (s.ratio < 0 or any(b < 1 for b in s.batches) or any(h < 0 for h in s.negatives)
            or not s.masking or not set(s.masking) <= {"on", "off"}):
        raise DprGcError("need --ratio >= 0, --batches >= 1, --negatives >= 0 and --masking on and/or off")
    began = time.perf_counter()
    work, results, model = open_work(args, "scifact-grid", s, COMMITTED,
                                     free=("batches", "negatives", "masking", "train_seeds"))
    data = prepare_data(Path(args.data), work, args.quick, s.dev_fraction, s.seed)
    loop = Loop(Runner(work, args.device, args.parallel), s, data)
    settings = {k: v for k, v in dataclasses.asdict(s).items() if k not in GRID_ONLY}

    def save(out: dict, complete: bool = False) -> dict:
        body = {"training_queries": count_queries(data / "qrels" / "train.tsv"),
                "test_queries": count_queries(data / "qrels" / "test.tsv"), **out,
                "table_ndcg@10": table(out["cells"], s.batches, s.negatives, s.masking),
                "masking_effect": masking_effect(out["cells"])}
        return write_report(results, ReportHead("SciFact (BEIR) batch x hard negatives", args, loop, settings, model,
                                                began), body, complete)

    out = run_grid(loop, s, model, save)
    report = save(out, complete=True)
    print(f"zero-shot nDCG@10 {out['zeroshot']['ndcg@10']:.4f}\n" + report["table_ndcg@10"])
    print(f"wall {report['wall_s_this_invocation']:.0f} s with --parallel {args.parallel}\nresults: {results}")


if __name__ == "__main__":
    sys.exit(main())
