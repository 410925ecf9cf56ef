"""Benchmark: the attention kernel's forward and backward per backend and dtype, the figure behind the CPU bf16 step.

``torch.nn.functional.scaled_dot_product_attention`` as a transformers encoder calls it (queries, keys and values
laid out (rows, tokens, heads, dim) and transposed, a key-padding mask, a gradient of the output's layout) for each
shape of ``--shapes``, each dtype of ``--dtypes`` and each backend of ``--backends``: the median of ``--repeats``
forward and backward timings after one warm-up. On a CPU with AMX the flash backend's bf16 backward can take several
times its fp32 backward (benchmarks/README.md, the LLM frontier on the Intel Xeon), which no cached step can win back.
Results: JSON in benchmarks/results/attention-backward-DEVICE.json.

    python benchmarks/attention_backward.py --threads 2
    python benchmarks/attention_backward.py --shapes 64,4,128,64 --dtypes bf16 --backends flash math
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gradcache import machine_info  # noqa: E402
from bench_common import default_output, output_help, parser, setup_logging  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402

logger = logging.getLogger("attention_backward")
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``rows,heads,tokens,dim`` -> four positive ints."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise DprGcError(f"--shapes {text}: give rows,heads,tokens,dim as four positive integers, e.g. 64,4,128,64")
    rows, heads, tokens, dim = (int(p) for p in parts)
    return rows, heads, tokens, dim


def time_attention(shape: tuple[int, int, int, int], dtype: torch.dtype, backend: SDPBackend, repeats: int,
                   device: torch.device) -> dict:
    """Median forward and backward milliseconds of one configuration (one warm-up first)."""
    rows, heads, tokens, dim = shape
    q, k, v = (torch.randn(rows, tokens, heads, dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
               for _ in range(3))
    mask = torch.ones(rows, 1, 1, tokens, dtype=torch.bool, device=device)
    grad = torch.randn(rows, tokens, heads, dim, dtype=dtype, device=device).transpose(1, 2)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    forward, backward = [], []
    for _ in range(repeats + 1):
        q.grad = k.grad = v.grad = None
        sync()
        start = time.perf_counter()
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        sync()
        middle = time.perf_counter()
        out.backward(grad)
        sync()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return {"forward_ms": 1e3 * statistics.median(forward[1:]), "backward_ms": 1e3 * statistics.median(backward[1:])}


SIZING = ("shapes", "dtypes", "backends", "repeats")  # the flags that size a run (the committed one: defaults)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shapes", nargs="+", default=["64,4,128,64", "64,12,128,32", "16,12,256,32", "8,12,512,32"],
                   help="rows,heads,tokens,dim each (default: the LLM shape's and three MiniLM ones)")
    p.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--backends", nargs="+", choices=tuple(BACKENDS), default=["flash", "math"])
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--output", default=None, help=output_help("attention-backward-DEVICE"))
    args = p.parse_args(argv)
    args.output = default_output(f"attention-backward-{args.device}", p.parse_args, args, SIZING)
    args.shapes = [parse_shape(text) for text in args.shapes]
    if args.repeats < 1 or args.threads < 1:
        raise DprGcError(f"--repeats {args.repeats} / --threads {args.threads}: give positive counts")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DprGcError("--device cuda: torch sees no CUDA device on this machine; run it where one is, or drop "
                         "the flag for the CPU")
    return args


def run(args: argparse.Namespace) -> dict:
    """Every shape x dtype x backend; a backend that refuses a configuration is recorded with its error."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    report = {"machine": machine_info(args.device, args.threads), "settings": vars(args),
              "runs": []}
    for shape in args.shapes:
        for dtype in args.dtypes:
            for backend in args.backends:
                row = {"rows_heads_tokens_dim": list(shape), "dtype": dtype, "backend": backend}
                try:
                    row.update(time_attention(shape, DTYPES[dtype], BACKENDS[backend], args.repeats, device))
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0]
                logger.info("%s", row)
                report["runs"].append(row)
    write_json(Path(args.output), report)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    def go() -> None:
        setup_logging()
        report = run(parse_args(argv))
        print("| rows × heads × tokens × dim | dtype | backend | forward ms | backward ms |\n|---|---|---|---:|---:|")
        for r in report["runs"]:
            cells = f"{r['forward_ms']:.1f} | {r['backward_ms']:.1f}" if "error" not in r else f"{r['error']} | -"
            shape = " × ".join(map(str, r["rows_heads_tokens_dim"]))
            print(f"| {shape} | {r['dtype']} | {r['backend']} | {cells} |")
    return report_errors(go)


if __name__ == "__main__":
    sys.exit(main())
