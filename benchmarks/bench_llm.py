"""Benchmark: step time and peak memory against the batch size for a decoder-only (Qwen2-shaped) retriever with LoRA.

Methods, each with LoRA adapters on every attention and MLP projection (rank ``--lora-r``), last-token pooling,
one hard negative per query, in-batch negatives, fp32 scores:

* ``plain``: the whole batch through the model with one graph, the loss, one backward;
* ``gc``: ``dpr_gc.GradCache`` with chunks of ``--chunk`` sequences (as shipped: trimmed, length-sorted, last graph
  kept);
* ``gc+ckpt``: the same with gradient checkpointing in the transformer (activations recomputed in backward).

Each (method, batch) runs in a fresh Python process, so its peak memory is its own (see
``bench_gradcache.PeakMemory``: CUDA ``max_memory_allocated``; on CPU the resident-set high-water mark, both
above the memory held before the step). The weights are random (the speed and memory of a step do not depend on
their values); the default shape is Qwen2-0.5B's (494M parameters), ``--small`` a 4-layer one for CPUs. Token ids
are random with random lengths (queries up to ``--query-length``, passages up to ``--passage-length``), right-padded.
One warm-up step, then ``--steps`` timed steps (median wall time, and the CPU time of the process). The run ends
with a ``| item | value |`` table of each configuration against plain at its batch, the results file and the machine.

    python benchmarks/bench_llm.py --device cuda --precision bf16 --batches 8,32,128 --chunk 8
    python benchmarks/bench_llm.py --small --batches 8,16,32 --chunk 4          # a CPU-sized run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import (check_choices, default_output, int_list, machine_info, name_list, output_help,  # noqa: E402
                          parser, require_cuda, run_script, summary_table)
from bench_gradcache import PeakMemory  # noqa: E402
from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402
from dpr_gc.model.lora import LoraSettings, apply_lora  # noqa: E402
from dpr_gc.model.retriever import Retriever, RetrieverConfig, enable_gradient_checkpointing  # noqa: E402

METHODS = ("plain", "gc", "gc+ckpt")
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
SMALL = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def build(args: argparse.Namespace, device: torch.device) -> Retriever:
    return build_shape(SMALL if args.small else QWEN2_05B, args.lora_r, device)


def build_shape(shape: dict, lora_r: int, device: torch.device) -> Retriever:
    """A random-weight Qwen2 decoder of ``shape`` (a Qwen2Config's fields) with LoRA rank ``lora_r`` adapters on
    every attention and MLP projection, last-token pooling, in train mode on ``device``."""
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    model = Qwen2Model(Qwen2Config(**shape, attn_implementation="sdpa"))
    retriever = Retriever(model, None, None, RetrieverConfig(pooling="last", temperature=0.05, normalize=True))
    apply_lora(retriever, LoraSettings(r=lora_r))
    return retriever.to(device).train()


def random_batch(n: int, max_len: int, vocab: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 4, max_len + 1, (n,), generator=gen)
    mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    return {"input_ids": torch.randint(3, vocab, (n, max_len), generator=gen) * mask, "attention_mask": mask}


def one_run(args: argparse.Namespace) -> dict:
    """One method at one batch size, in this process."""
    device = torch.device(args.device)
    retriever = build(args, device)
    if args.method == "gc+ckpt":
        enable_gradient_checkpointing(retriever)
    vocab = retriever.query_encoder.transformer.config.vocab_size
    q = {k: v.to(device) for k, v in random_batch(args.batch, args.query_length, vocab, 1).items()}
    p = {k: v.to(device) for k, v in random_batch(2 * args.batch, args.passage_length, vocab, 2).items()}
    loss_fn = SimpleContrastiveLoss(1)
    bf16 = args.precision == "bf16"
    cache = GradCache([retriever, retriever], args.chunk, loss_fn, bf16=bf16, chunking=Chunking(sort_by_length=True))

    def step() -> None:
        retriever.zero_grad(set_to_none=True)
        if args.method == "plain":
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                reps = retriever(kind="query", **q), retriever(kind="passage", **p)
            loss_fn(reps[0].float(), reps[1].float()).backward()
        else:
            cache(dict(q, kind="query"), dict(p, kind="passage"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up
    retriever.zero_grad(set_to_none=True)
    memory = PeakMemory(device)
    memory.start()
    walls, cpus = [], []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    peak = memory.stop()
    params = sum(p.numel() for p in retriever.parameters())
    trainable = sum(p.numel() for p in retriever.parameters() if p.requires_grad)
    return {"method": args.method, "batch": args.batch, "passages": 2 * args.batch, "chunk": args.chunk,
            "step_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "peak_mb": round(peak, 1),
            "memory_method": memory.method, "parameters": params, "trainable_parameters": trainable}


# the flags that size a run (llm.json holds one device's), and the two commands of the committed llm.json
SIZING = ("device", "precision", "batches", "chunk", "query_length", "passage_length", "lora_r", "steps", "small",
          "methods")
COMMITTED = tuple(("--small", "--device", "cpu", "--precision", "fp32", "--batches", batches, "--chunk", "4",
                   "--steps", "2") for batches in ("4,8,16", "32"))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--batches", type=int_list, default=[8, 32, 128], help="comma-separated query batch sizes")
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--passage-length", type=int, default=128)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a 4-layer, 256-wide model instead of Qwen2-0.5B's shape")
    p.add_argument("--methods", type=name_list, default=list(METHODS), help=",".join(METHODS))
    p.add_argument("--output", help=output_help("llm"))
    p.add_argument("--append", action="store_true",
                   help="add the rows to those already in --output (each invocation's settings are kept)")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.output = default_output("llm", p.parse_args, args, SIZING, COMMITTED)
    check_choices("--methods", args.methods, METHODS)
    require_cuda(args.device)
    return args


def run_children(args: argparse.Namespace, given: list[str]) -> list[dict]:
    """Each (batch, method) in a fresh process (``given``: this command line); a failed one is a row with its error."""
    rows = []
    for batch in args.batches:
        for method in args.methods:
            cmd = [sys.executable, __file__, "--method", method, "--batch", str(batch)] + given
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                rows.append({"method": method, "batch": batch, "error": tail})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summary_items(rows: list[dict]) -> dict[str, str]:
    """The closing table's rows: each (batch, method)'s step time and peak memory, against plain training at the
    same batch where it ran."""
    plain = {r["batch"]: r for r in rows if r["method"] == "plain" and "error" not in r}
    items = {}
    for r in rows:
        base, key = plain.get(r["batch"]), f"batch {r['batch']} {r['method']}"
        if "error" in r:
            items[key] = f"failed: {r['error']}"
        elif base is None or base is r:
            items[key] = f"{r['step_s']:.2f} s/step, {r['peak_mb']:.0f} MB"
        else:
            memory = f"{r['peak_mb'] / base['peak_mb']:.2f}x" if base["peak_mb"] else "-"
            items[key] = (f"{r['step_s']:.2f} s/step ({base['step_s'] / r['step_s']:.2f}x plain's speed), "
                          f"{r['peak_mb']:.0f} MB ({memory} plain's memory)")
    return items


def main(argv: Optional[list[str]] = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.method:  # a child process: one configuration, its result as JSON on the last line
        print(json.dumps(one_run(args)))
        return 0
    rows = run_children(args, sys.argv[1:] if argv is None else list(argv))
    if all("error" in r for r in rows):
        print(f"error: every configuration failed, nothing written to {args.output}; the last said: "
              f"{rows[-1]['error']}", file=sys.stderr)
        return 1
    report = {"machine": machine_info(args.device, torch.get_num_threads()), "settings": vars(args) | {"method": None},
              "results": rows}
    if args.append and Path(args.output).is_file():
        before = json.loads(Path(args.output).read_text())
        report["results"] = before["results"] + rows
        report["invocations"] = before.get("invocations", [before["settings"]]) + [report["settings"]]
    write_json(args.output, report)
    print(summary_table(summary_items(rows), args.output, report["machine"], time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
