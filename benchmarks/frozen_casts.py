"""Benchmark: a LoRA cached step whose frozen Linear weights are cast once per step, against autocast's cast per call.

Under autocast a cached step holds each frozen ``nn.Linear`` weight (a LoRA base layer's) in the autocast dtype for
the step (:mod:`dpr_gc.engine.frozen_casts`); otherwise autocast casts every frozen weight afresh at every chunk's
forward, and every graph kept under a memory budget saves a copy of its own. This script measures what that buys:
bench_frontier.py's LLM step (bench_llm.py's Qwen2-shaped LoRA retriever, ``--small`` for its 4-layer CPU size,
random token ids of uneven lengths) at budget 0, at a fixed budget (``--budget-mb``) and at a budget for the whole
batch, each with the per-step cast and with autocast's per-call casts, and plain training beside them. Fresh
processes, rotating order, medians and the other flags as in join_limit.py (fp32 runs no autocast: nothing to
compare, so bf16 is the default).

    python benchmarks/frozen_casts.py --shape llm --small --passage-lengths 128 --precisions bf16 --rounds 3
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
from dpr_gc.base.errors import DprGcError  # noqa: E402
from join_limit import WHOLE_BATCH, check_grid_args, grid_main, grid_parser, medians, run_grid  # noqa: E402



def variants(budget_mb: float) -> dict[str, dict]:
    """Plain training; each budget with the per-step cast ("once") and with autocast's casts ("per call")."""
    budgets = {"budget 0": 0, f"budget {budget_mb:g} MiB": int(budget_mb * 2**20), "whole batch": WHOLE_BATCH}
    out = {"plain": {"method": PLAIN, "budget": None}}
    for name, budget in budgets.items():
        out[f"{name} once"] = {"method": OURS, "budget": budget}
        out[f"{name} per call"] = {"method": OURS, "budget": budget, "frozen_linear_casts": False}
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each variant's medians; per budget the speed-up and the peak ratio of casting once."""
    out = medians(runs)
    for name in [n[:-len(" once")] for n in runs if n.endswith(" once")]:
        once, per_call = out.get(f"{name} once", {}), out.get(f"{name} per call", {})
        if "step_s" in once and "step_s" in per_call:
            out[f"{name}: speed-up of casting once"] = per_call["step_s"] / once["step_s"]
            out[f"{name}: peak once / per call"] = once["peak_mb"] / per_call["peak_mb"]
    return out


COMMITTED = (("--small", "--rounds", "3", "--steps", "3"),)  # the committed frozen-casts-cpu.json's sizes


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = grid_parser(__doc__.splitlines()[0], "frozen-casts")
    p.set_defaults(shape="llm", precisions=["bf16"], passage_lengths=[128])
    p.add_argument("--budget-mb", type=float, default=128.0, help="the fixed budget between 0 and the whole batch")
    args = check_grid_args(p, argv, COMMITTED)
    if args.budget_mb <= 0:
        raise DprGcError(f"--budget-mb {args.budget_mb:g}: give a positive size in MiB")
    return args


def run(argv: Optional[list[str]]) -> None:
    args = parse_args(argv)
    report = {"benchmark": "a LoRA cached step with frozen weights cast once per step and per call, and plain",
              "machine": machine_info(args.device, args.threads), "settings": dict(vars(args))}
    run_grid(args, report, variants(args.budget_mb), summarize)
    print("| passage tokens | precision | budget | per call s (MB) | once s (MB) | speed-up | "
          "kept chunks, once / per call |\n|---:|---|---|---:|---:|---:|---:|")
    for r in report["runs"]:
        for name in [k[:-len(": speed-up of casting once")] for k in r if k.endswith(": speed-up of casting once")]:
            once, per_call = r[f"{name} once"], r[f"{name} per call"]
            print(f"| {r['passage_length']} | {r['precision']} | {name} | {per_call['step_s']:.2f} "
                  f"({per_call['peak_mb']:.0f}) | {once['step_s']:.2f} ({once['peak_mb']:.0f}) | "
                  f"{r[f'{name}: speed-up of casting once']:.2f} | "
                  f"{once['kept_chunks']}/{per_call['kept_chunks']} of {once['chunks']} |")


def main(argv: Optional[list[str]] = None) -> int:
    return grid_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
