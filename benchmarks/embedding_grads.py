"""Benchmark: a cached step with sparse per-chunk embedding gradients on the CPU and with dense ones, beside plain.

On the CPU a cached step gives each trainable embedding sparse gradients: every chunk adds only the rows its tokens
touch into one dense ``.grad`` (:mod:`dpr_gc.engine.sparse_grads`), where a dense backward fills and adds a fresh
vocabulary-sized table per chunk. This script measures what that buys in a whole step: bench_frontier.py's SciFact
step (all-MiniLM-L6-v2, claims and cited abstracts, one hard negative, chunks grouped by length) at budget 0 (every
chunk but the last replayed) and at a budget that holds the whole batch's graphs, each with sparse and with dense
embedding gradients, and plain training (one graph) beside them. Fresh processes, rotating order, and medians as in
join_limit.py, whose flags it shares.

    python benchmarks/embedding_grads.py --passage-lengths 128 256 --precisions fp32 bf16 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_frontier import OURS, PLAIN  # noqa: E402
from bench_gradcache import machine_info  # noqa: E402
from dpr_gc.engine.sparse_grads import SPARSE_EMBEDDING_GRAD_DEVICES  # noqa: E402
from join_limit import WHOLE_BATCH, check_grid_args, grid_main, grid_parser, medians, run_grid  # noqa: E402

BUDGETS = {"budget 0": 0, "whole batch": WHOLE_BATCH}
VARIANTS = {"plain": {"method": PLAIN, "budget": None},
            "budget 0 sparse": {"method": OURS, "budget": 0},
            "budget 0 dense": {"method": OURS, "budget": 0, "sparse_embedding_grads": False},
            "whole batch sparse": {"method": OURS, "budget": WHOLE_BATCH},
            "whole batch dense": {"method": OURS, "budget": WHOLE_BATCH, "sparse_embedding_grads": False}}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each variant's medians; per budget the speed-up of sparse gradients and the sparse step against plain."""
    out = medians(runs)
    for name in BUDGETS:
        sparse, dense, plain = (out.get(f"{name} sparse", {}), out.get(f"{name} dense", {}), out.get("plain", {}))
        if "step_s" in sparse and "step_s" in dense:
            out[f"{name}: speed-up of sparse gradients"] = dense["step_s"] / sparse["step_s"]
        if "step_s" in sparse and "step_s" in plain:
            out[f"{name}: sparse vs plain"] = plain["step_s"] / sparse["step_s"]
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    return check_grid_args(grid_parser(__doc__.splitlines()[0], "embedding-grads"), argv)


def run(argv: Optional[list[str]]) -> None:
    args = parse_args(argv)
    report = {"benchmark": "a cached step with sparse and with dense embedding gradients, and plain training",
              "machine": machine_info(args.device, args.threads), "settings": dict(vars(args)),
              "engine_sparse_embedding_grad_devices": list(SPARSE_EMBEDDING_GRAD_DEVICES)}
    run_grid(args, report, VARIANTS, summarize)
    print("| passage tokens | precision | plain s | budget | dense s | sparse s | speed-up | sparse vs plain |\n"
          "|---:|---|---:|---|---:|---:|---:|---:|")
    for r in report["runs"]:
        for name in BUDGETS:
            if f"{name}: speed-up of sparse gradients" in r and "step_s" in r["plain"]:
                print(f"| {r['passage_length']} | {r['precision']} | {r['plain']['step_s']:.2f} | {name} | "
                      f"{r[f'{name} dense']['step_s']:.2f} | {r[f'{name} sparse']['step_s']:.2f} | "
                      f"{r[f'{name}: speed-up of sparse gradients']:.2f} | {r[f'{name}: sparse vs plain']:.2f} |")


def main(argv: Optional[list[str]] = None) -> int:
    return grid_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
