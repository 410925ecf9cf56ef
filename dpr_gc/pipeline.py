"""The main job: train -> encode -> index -> retrieve -> evaluate, before and after training, on real text.

``dpr-gc demo`` builds the default dataset from Python's standard library (:mod:`dpr_gc.stdlib_data`), measures the
offline all-MiniLM-L6-v2 zero-shot, fine-tunes it with Gradient Cache at a batch several times the chunk, measures
again, and writes everything to one folder. Every stage goes through the same library functions the sub-commands
use, on files in the formats users bring, and every stage resumes: run the command again after an interruption.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from .args import nonnegative_int, output_dir, positive_float, positive_int
from .errors import DprGcError
from .files import atomic_path, read_json, read_json_object, write_json

logger = logging.getLogger(__name__)

KS = (1, 5, 10, 20, 100)


@dataclasses.dataclass
class DemoConfig:
    """Sizes chosen so the whole job takes about ten minutes on 2 CPU cores (see the README for a measured run)."""

    output_dir: str = "runs/demo"
    model: Optional[str] = None
    max_examples: Optional[int] = None
    train_queries: Optional[int] = 1024
    batch_size: int = 64
    chunk_size: int = 16
    hard_negatives: int = 0
    epochs: int = 1
    learning_rate: float = 5e-5
    temperature: float = 0.05
    query_max_length: int = 48
    passage_max_length: int = 128
    precision: str = "fp32"
    top_k: int = 100
    seed: int = 0
    encode_batch_size: int = 64

    def __post_init__(self) -> None:
        if self.batch_size < 4 * self.chunk_size:
            raise DprGcError(f"--batch-size {self.batch_size} should be at least 4x --chunk-size {self.chunk_size}: "
                             "the demo exists to show Gradient Cache at a batch larger than what one chunk holds")


def _subset_training_file(source: Path, target: Path, limit: Optional[int]) -> Path:
    """The first ``limit`` questions of a DPR training file (the builder already shuffled them deterministically)."""
    if limit is None:
        return source
    if not target.is_file():
        records = read_json(source)[:limit]
        with atomic_path(target) as tmp:
            tmp.write_text(json.dumps(records, ensure_ascii=False))
    return target


def measure(retriever: Any, name: str, out: Path, data: Path, manifest: dict, top_k: int,
            encode_batch_size: int) -> dict:
    """Encode the corpus, index it (exact inner product), retrieve for the test questions and evaluate."""
    from .corpus import load_corpus, read_queries
    from .encode import encode_corpus, pick_precision
    from .answers import default_workers
    from .evaluate import read_qrels
    from .index import DenseIndex, IndexParams, build_index
    from .retrieve import retrieve_to_files

    stage = out / name
    metrics_file = stage / "metrics.json"
    if metrics_file.is_file():
        logger.info("%s: already measured (%s)", name, metrics_file)
        return read_json_object(metrics_file, "demo metrics")
    corpus_path = data / manifest["files"]["corpus"]
    started = time.perf_counter()
    device = next(retriever.parameters()).device
    encode_corpus(retriever, corpus_path, stage / "embeddings", batch_size=encode_batch_size, model_name=name,
                  autocast=pick_precision("auto", device))
    encode_seconds = time.perf_counter() - started
    if not (stage / "index" / "index_meta.json").is_file():
        build_index(stage / "embeddings", stage / "index", IndexParams(kind="flat"))
    index = DenseIndex.read(stage / "index")
    queries = read_queries(data / manifest["files"]["test_queries"])
    qrels = read_qrels(data / manifest["files"]["qrels_test"])
    metrics = retrieve_to_files(retriever, index, load_corpus(corpus_path), queries, top_k=top_k,
                                output=stage / "results.json", trec_run=stage / "run.trec", run_tag=name, ks=list(KS),
                                qrels=qrels, workers=default_workers())
    metrics.update({"encode_seconds": round(encode_seconds, 1), "passages": index.ntotal, "questions": len(queries)})
    write_json(metrics_file, metrics)
    return metrics


def run_demo(config: DemoConfig) -> dict:
    """Run the whole pipeline; returns the before/after metrics and where every output is."""
    import torch

    from .model import Retriever, RetrieverConfig, default_model_path
    from .stdlib_data import build_stdlib_dataset
    from .train import TrainConfig, train
    from .train_utils import finished_checkpoints

    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = out / "data"
    manifest = build_stdlib_dataset(data, max_examples=config.max_examples, seed=config.seed)
    model_path = config.model or default_model_path()
    rconf = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", temperature=config.temperature,
                            query_max_length=config.query_max_length,
                            passage_max_length=config.passage_max_length)
    base = Retriever.from_pretrained(model_path, rconf)
    before = measure(base, "before", out, data, manifest, config.top_k, config.encode_batch_size)

    train_file = _subset_training_file(data / manifest["files"]["dpr_train"], out / "train_subset.json",
                                       config.train_queries)
    train_out = out / "training"
    final = train_out / "final"
    if not (final / "retriever_config.json").is_file():
        base_dir = out / "base_model"
        if not (base_dir / "retriever_config.json").is_file():
            base.save(base_dir)
        resume = "latest" if finished_checkpoints(train_out) else None
        train(TrainConfig(train_files=[str(train_file)], output_dir=str(train_out), model=str(base_dir), batch_size=config.batch_size,
                          hard_negatives=config.hard_negatives, query_chunk_size=config.chunk_size,
                          passage_chunk_size=config.chunk_size, learning_rate=config.learning_rate,
                          warmup_steps=2, epochs=config.epochs, precision=config.precision, seed=config.seed,
                          save_every=4, keep_checkpoints=1, resume=resume, num_workers=1,
                          cache_dir=str(out / "cache")))
    trained = Retriever.load(final)
    after = measure(trained, "after", out, data, manifest, config.top_k, config.encode_batch_size)

    curve = [json.loads(line) for line in (train_out / "metrics.jsonl").read_text().splitlines()]
    report = {"config": dataclasses.asdict(config), "dataset": manifest["counts"], "before": before, "after": after,
              "training_loss": [[r["step"], r["loss"]] for r in curve if "loss" in r],
              "seconds": round(time.perf_counter() - started, 1),
              "outputs": {"model": str(final), "index": str(out / "after" / "index"),
                          "run": str(out / "after" / "run.trec"), "results": str(out / "after" / "results.json"),
                          "metrics": str(out / "metrics.json"), "plot": str(out / "report.png")}}
    write_json(out / "metrics.json", report)
    plot_report(report, out / "report.png")
    return report


def plot_report(report: dict, path: Path) -> None:
    """Training loss against step, and top-k answer accuracy before and after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, losses = zip(*report["training_loss"]) if report["training_loss"] else ((), ())
    left.plot(steps, losses, marker=".")
    left.set(title="training loss (Gradient Cache)", xlabel="step", ylabel="loss")
    for name in ("before", "after"):
        acc = report[name]["answers"]
        ks = sorted(int(k.split("@")[1]) for k in acc)
        right.plot(ks, [acc[f"Accuracy@{k}"] for k in ks], marker="o", label=name)
    right.set(title="top-k accuracy on held-out questions", xlabel="k", ylabel="accuracy", xscale="log")
    right.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def format_report(report: dict) -> str:
    rows = [("Accuracy@1", "answers"), ("Accuracy@5", "answers"), ("Accuracy@20", "answers"),
            ("Accuracy@100", "answers"), ("nDCG@10", "qrels"), ("MRR@10", "qrels"), ("Recall@100", "qrels")]
    lines = ["| metric (held-out test) | before training | after training |", "|---|---|---|"]
    for metric, group in rows:
        b, a = report["before"][group].get(metric), report["after"][group].get(metric)
        if b is not None and a is not None:
            lines.append(f"| {metric} | {b:.4f} | {a:.4f} |")
    return "\n".join(lines)


def add_cli(subparsers: Any) -> None:
    """Register ``demo``: the whole pipeline on the stdlib dataset, before and after Gradient Cache training."""
    p = subparsers.add_parser("demo", help="run the whole pipeline end to end on the built-in stdlib dataset")
    defaults = DemoConfig()
    p.add_argument("--output", type=output_dir, default=defaults.output_dir, help="output folder (resumable)")
    p.add_argument("--model", default=None, help="Hugging Face model name or folder (default: offline MiniLM)")
    p.add_argument("--max-examples", type=positive_int, default=None,
                   help="subsample the dataset (a quicker, rougher run)")
    p.add_argument("--train-queries", type=positive_int, default=defaults.train_queries, help="training questions used")
    p.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    p.add_argument("--chunk-size", type=positive_int, default=defaults.chunk_size)
    p.add_argument("--hard-negatives", type=nonnegative_int, default=defaults.hard_negatives)
    p.add_argument("--epochs", type=positive_int, default=defaults.epochs)
    p.add_argument("--learning-rate", type=positive_float, default=defaults.learning_rate)
    p.add_argument("--passage-max-length", type=positive_int, default=defaults.passage_max_length)
    p.add_argument("--precision", default=defaults.precision, choices=["fp32", "bf16", "fp16"])
    p.add_argument("--seed", type=nonnegative_int, default=defaults.seed)
    p.set_defaults(func=_cli_demo)


def _cli_demo(args: Any) -> None:
    config = DemoConfig(output_dir=args.output, model=args.model, max_examples=args.max_examples,
                        train_queries=args.train_queries,
                        batch_size=args.batch_size, chunk_size=args.chunk_size, hard_negatives=args.hard_negatives,
                        epochs=args.epochs, learning_rate=args.learning_rate,
                        passage_max_length=args.passage_max_length, precision=args.precision, seed=args.seed)
    report = run_demo(config)
    print(format_report(report))
    outputs = report["outputs"]
    print(f"\nfinished in {report['seconds']:.0f} s; trained retriever: {outputs['model']}\n"
          f"index: {outputs['index']}\nrun file: {outputs['run']}\nmetrics: {outputs['metrics']}\n"
          f"plot: {outputs['plot']}")
