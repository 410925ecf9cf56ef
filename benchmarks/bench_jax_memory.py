"""Benchmark: XLA's memory plan of one JAX contrastive step against the batch size (dpr_gc.jax).

Compiles, without running, three steps for each batch size and reads ``compiled.memory_analysis()``:

* ``plain``: ``jax.value_and_grad`` of the loss over the whole batch (the baseline, measured in the same run);
* ``gradcache``: :func:`dpr_gc.jax.cached_value_and_grad` (no-gradient pass, cached representation gradients,
  per-chunk VJP replay);
* ``remat``: :func:`dpr_gc.jax.remat_value_and_grad` (the single-decorator form, ``jax.checkpoint`` per chunk).

Model: the all-MiniLM-L6-v2 architecture (6 layers, hidden 384, random weights: the plan depends on shapes only),
mean pooling, tied towers, dropout on, fp32; queries 32 tokens, one hard negative per query, passages 128 tokens;
cosine scores at temperature 0.05. ``temp`` is XLA's temporary buffer size (activations, gradients, workspace);
arguments (parameters, token ids) are the same for all methods. Full XLA optimisation, CPU backend. It ends with a
``| item | value |`` table of each batch's temporary buffers against plain's, the results file and the machine.

    python benchmarks/bench_jax_memory.py --batches 64,256,1024,4096 --chunk 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_common import (default_output, int_list, machine_info, output_help, parser, run_script,  # noqa: E402
                          summary_table)
from dpr_gc.base.args import nonnegative_int, positive_int  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.jax import (ContrastiveLoss, Encoder, EncoderConfig, cached_value_and_grad, encoder_fn,  # noqa: E402
                        remat_value_and_grad)

MINILM = EncoderConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536,
                       max_positions=512, dropout=0.1)


def build_steps(model: Encoder, loss: ContrastiveLoss, chunk: int) -> dict:
    encode = encoder_fn(model)

    def plain(params, loss_params, batches, key):
        keys = jax.random.split(key, 2)
        return jax.value_and_grad(lambda p: loss(loss_params, encode(p, batches[0], keys[0]),
                                                 encode(p, batches[1], keys[1])))(params)

    return {"plain": plain, "gradcache": cached_value_and_grad([encode, encode], loss, chunk),
            "remat": remat_value_and_grad([encode, encode], loss, chunk)}


def plan(step, params, batch: int, query_length: int, passage_length: int, group: int) -> dict:
    def tokens(n: int, length: int) -> dict:
        ids = jax.ShapeDtypeStruct((n, length), jnp.int32)
        return {"input_ids": ids, "attention_mask": ids}

    started = time.perf_counter()
    compiled = jax.jit(step).lower(params, {}, [tokens(batch, query_length), tokens(batch * group, passage_length)],
                                   jax.random.key(0)).compile()
    stats = compiled.memory_analysis()
    return {"temp_bytes": int(stats.temp_size_in_bytes), "argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes), "compile_seconds": round(time.perf_counter() - started, 1)}


# the flags that size a run, and the command of the committed jax_memory.json (benchmarks/README.md)
SIZING = ("batches", "chunk", "hard_negatives", "query_length", "passage_length")
COMMITTED = (("--batches", "64,1024", "--chunk", "16"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--batches", type=int_list, default=[64, 256, 1024, 4096],
                   help="comma-separated batch sizes (queries)")
    p.add_argument("--chunk", type=positive_int, default=16, help="rows per Gradient Cache chunk")
    p.add_argument("--hard-negatives", type=nonnegative_int, default=1, help="hard negatives per query")
    p.add_argument("--query-length", type=positive_int, default=32, help="query tokens")
    p.add_argument("--passage-length", type=positive_int, default=128, help="passage tokens")
    p.add_argument("--output", help=output_help("jax_memory"))
    args = p.parse_args(argv)
    args.output = default_output("jax_memory", p.parse_args, args, SIZING, COMMITTED)
    return args


def summary_items(rows: list[dict]) -> dict[str, str]:
    """The closing table's rows: per batch size, each method's temporary buffers against plain's at that batch."""
    items: dict[str, list[str]] = {}
    plain = {r["batch"]: r["temp_bytes"] for r in rows if r["method"] == "plain"}
    for r in rows:
        mib = r["temp_bytes"] / 2**20
        text = f"{r['method']} {mib:,.0f} MiB" if mib >= 10 else f"{r['method']} {mib:.1f} MiB"
        if r["method"] != "plain" and plain.get(r["batch"]):
            text += f" ({r['temp_bytes'] / plain[r['batch']]:.2f}x plain)"
        items.setdefault(f"batch {r['batch']}", []).append(text)
    return {key: "; ".join(texts) for key, texts in items.items()}


def main(argv: Optional[list[str]] = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    batches = args.batches
    model = Encoder(MINILM)
    ones = jnp.ones((1, 8), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ones, ones)["params"]
    loss = ContrastiveLoss(n_hard_negatives=args.hard_negatives, temperature=0.05, similarity="cos")
    rows = []
    for name, step in build_steps(model, loss, args.chunk).items():
        for batch in batches:
            row = {"method": name, "batch": batch, "chunk": args.chunk,
                   **plan(step, params, batch, args.query_length, args.passage_length, 1 + args.hard_negatives)}
            rows.append(row)
            print(f"{name:10s} batch {batch:5d}: temp {row['temp_bytes'] / 2**20:10.1f} MiB "
                  f"(compiled in {row['compile_seconds']} s)", flush=True)
    base = {r["method"]: r["temp_bytes"] for r in rows if r["batch"] == batches[0]}
    for r in rows:
        r["temp_vs_smallest_batch"] = round(r["temp_bytes"] / base[r["method"]], 3)
    machine = machine_info("cpu")
    write_json(args.output, {"machine": machine, "jax": jax.__version__, "backend": jax.default_backend(),
                             "settings": vars(args), "model": MINILM.__dict__, "results": rows})
    print(f"wrote {args.output}")
    print(summary_table(summary_items(rows), args.output, machine, time.perf_counter() - started))


if __name__ == "__main__":
    sys.exit(run_script(main))
