"""How much of a padded SciFact batch is padding: the figures behind the frontier's length-grouping gains.

For each max length, every text is tokenized once (all-MiniLM-L6-v2's tokenizer, truncated); then ``--samples``
random batches of ``--batch`` rows report the tokens a batch padded to its longest row computes, against its real
tokens and against the same rows grouped by length in chunks of ``--chunk`` rows, each trimmed to its own longest
(what dpr-gc computes when it keeps chunks apart). Passages are SciFact's title + " " + text, queries its claims.
It ends with a ``| item | value |`` table of each shape's ratios (their range over the batch and chunk sizes), the
results file and the machine.

    python benchmarks/scifact_padding.py --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import (default_output, machine_info, output_help, parser, run_script,  # noqa: E402
                          summary_table)
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import write_json  # noqa: E402


def padding_ratios(lengths: list[int], batch: int, chunk: int, samples: int, seed: int = 0) -> dict:
    """Mean over ``samples`` random batches: padded tokens / real tokens, and padded / length-grouped chunk tokens."""
    rng, padded, real, grouped = random.Random(seed), 0, 0, 0
    for _ in range(samples):
        rows = sorted(rng.sample(lengths, batch), reverse=True)
        padded += batch * rows[0]
        real += sum(rows)
        grouped += sum(len(rows[i:i + chunk]) * rows[i] for i in range(0, batch, chunk))
    return {"batch": batch, "chunk": chunk, "padded_vs_real": round(padded / real, 3),
            "padded_vs_grouped_chunks": round(padded / grouped, 3)}


def length_stats(lengths: list[int], max_length: int) -> dict:
    return {"max_length": max_length, "count": len(lengths), "mean_tokens": round(sum(lengths) / len(lengths), 1),
            "share_at_max_length": round(sum(n == max_length for n in lengths) / len(lengths), 3)}


def read_texts(data: Path) -> dict[str, list[str]]:
    corpus, queries = data / "corpus.jsonl.gz", data / "queries.jsonl"
    for path in (corpus, queries):
        if not path.is_file():
            raise DprGcError(f"{path}: not found; give --data the SciFact folder (see ../shared/data/README.md)")
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        passages = [f"{d['title']} {d['text']}" for d in map(json.loads, f)]
    with open(queries, encoding="utf-8") as f:
        return {"passages": passages, "queries": [json.loads(line)["text"] for line in f]}


def summary_items(shapes: list[dict]) -> dict[str, str]:
    """The closing table's rows: per text kind and max length, the range over the batch and chunk sizes of the
    padded batch's tokens against the real ones and against the length-grouped chunks'."""
    items = {}
    for shape in shapes:
        for key, what in (("padded_vs_real", "padded vs real"), ("padded_vs_grouped_chunks", "padded vs grouped "
                                                                                              "chunks")):
            values = [b[key] for b in shape["batches"]]
            if values:
                low, high = min(values), max(values)
                items[f"{shape['texts']} {shape['max_length']} tokens: {what}"] = (
                    f"{low:.2f}x" if low == high else f"{low:.2f}x to {high:.2f}x")
    return items


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "scifact",
                   help="BEIR SciFact folder (default: ../shared/data/scifact)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64, 256, 512], help="rows per batch")
    p.add_argument("--chunk", type=int, nargs="+", default=[8, 32], help="rows per length-grouped chunk")
    p.add_argument("--samples", type=int, default=200, help="random batches per shape")
    p.add_argument("--output", help=output_help("scifact-padding"))
    args = p.parse_args(argv)
    args.output = default_output("scifact-padding", p.parse_args, args, ("batch", "chunk", "samples"))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    for flag, values in (("--batch", args.batch), ("--chunk", args.chunk), ("--samples", [args.samples])):
        if min(values) < 1:
            raise DprGcError(f"{flag} {min(values)}: must be at least 1")
    texts = read_texts(args.data)
    if max(args.batch) > min(map(len, texts.values())):
        raise DprGcError(f"--batch {max(args.batch)}: more rows than the {min(map(len, texts.values()))} texts to "
                         "sample from; give a smaller batch")
    from transformers import AutoTokenizer

    from dpr_gc.model.pretrained import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    report = {"machine": machine_info(), "tokenizer": "all-MiniLM-L6-v2", "samples": args.samples, "shapes": []}
    for kind, rows in texts.items():
        for max_length in ((32,) if kind == "queries" else (128, 256, 512)):
            lengths = [len(ids) for ids in tokenizer(rows, truncation=True, max_length=max_length)["input_ids"]]
            ratios = [padding_ratios(lengths, b, c, args.samples) for b in args.batch for c in args.chunk if c < b]
            report["shapes"].append({"texts": kind, **length_stats(lengths, max_length), "batches": ratios})
            print(json.dumps(report["shapes"][-1]))
    write_json(args.output, report)
    print(summary_table(summary_items(report["shapes"]), args.output, report["machine"], time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
