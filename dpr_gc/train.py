"""Train a DPR retriever with Gradient Cache: one process or several under ``torchrun`` (DDP).

The step: tokenised batches of B queries and B·(1+N+M) passages from :mod:`dpr_gc.data`, representations from
:class:`~dpr_gc.model.Retriever` (the temperature is applied inside its forward, so a learnable one is trained and
all-reduced like every other weight), the in-batch-negative loss from :mod:`dpr_gc.loss` over the global batch, and
:class:`~dpr_gc.GradCache` to compute its exact gradient in chunk-sized memory (or one plain graph, for
comparison). Checkpoints hold everything needed to continue mid-epoch with the same result.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from .args import device_arg, nonnegative_float, nonnegative_int, output_dir, positive_float, positive_int
from .dpr_hub import find_dpr_pair
from .errors import DprGcError
from .grad_cache import GradCache
from .loss import DistributedContrastiveLoss, SimpleContrastiveLoss, check_loss_chunk_size
from .model import (Retriever, RetrieverConfig, add_prefix_arguments, enable_gradient_checkpointing,
                    freeze_position_embeddings)
from .train_utils import Checkpointer, auto_chunk_size, capture_rng, restore_rng, summary_table
from .validation import DevLimits, evaluate_dev

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on (the CLI flags map one to one onto these fields)."""

    train_files: list[str]
    output_dir: str
    model: str
    dev_file: Optional[str] = None
    retriever: Optional[RetrieverConfig] = None
    batch_size: int = 32
    hard_negatives: int = 1
    other_negatives: int = 0
    shuffle_positives: bool = False
    sampling_rates: Optional[list[float]] = None
    grad_cache: bool = True
    query_chunk_size: Union[int, str] = "auto"
    passage_chunk_size: Union[int, str] = "auto"
    loss_chunk_size: Optional[int] = None
    symmetric: bool = False
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: Optional[int] = None
    max_grad_norm: float = 2.0
    seed: int = 0
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    freeze_position_embeddings: bool = False
    eval_every: Optional[int] = None
    eval_per_epoch: Optional[int] = None
    save_every: Optional[int] = None
    keep_checkpoints: int = 2
    best_metric: str = "avg_rank"
    resume: Optional[str] = None
    num_workers: int = 2
    skip_bad_records: bool = False
    cache_dir: Optional[str] = None
    device: Optional[str] = None
    dev_batch_size: int = 64
    dev_encode_batch_size: Optional[int] = None
    dev_max_questions: int = 10000
    dev_hard_negatives: int = 30
    dev_other_negatives: int = 30
    log_every: int = 1
    query_prefix: Optional[str] = None
    passage_prefix: Optional[str] = None

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise DprGcError(f"--precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.batch_size < 1:
            raise DprGcError(f"--batch-size must be >= 1, got {self.batch_size}")
        for flag, value in (("--query-chunk-size", self.query_chunk_size), ("--passage-chunk-size", self.passage_chunk_size)):
            if value != "auto" and (not isinstance(value, int) or value < 1):
                raise DprGcError(f"{flag} must be a positive integer or 'auto', got {value!r}")
        if self.best_metric not in ("avg_rank", "loss", "accuracy"):
            raise DprGcError(f"--best-metric must be avg_rank, loss or accuracy, got {self.best_metric!r}")
        if self.epochs < 1 and not self.max_steps:
            raise DprGcError("--epochs must be >= 1 (or give --max-steps)")
        check_loss_chunk_size(self.loss_chunk_size)
        for flag, value, low in (("--max-steps", self.max_steps, 1), ("--eval-every", self.eval_every, 1),
                                 ("--save-every", self.save_every, 1), ("--num-workers", self.num_workers, 0),
                                 ("--warmup-steps", self.warmup_steps, 0),
                                 ("--hard-negatives", self.hard_negatives, 0),
                                 ("--other-negatives", self.other_negatives, 0)):
            if value is not None and value < low:
                raise DprGcError(f"{flag} must be >= {low}, got {value}")
        if not (self.learning_rate > 0 and self.weight_decay >= 0 and self.max_grad_norm > 0):
            raise DprGcError("--learning-rate and --max-grad-norm must be positive and --weight-decay >= 0")
        self.dev_limits()

    def dev_limits(self) -> DevLimits:
        """The bounds of dev validation (DPR's ``val_av_rank_*``)."""
        return DevLimits(self.dev_max_questions, self.dev_hard_negatives, self.dev_other_negatives,
                         self.dev_batch_size, self.dev_encode_batch_size)


class Towers(nn.Module):
    """What DDP wraps: ``forward(kind=..., **batch)`` encodes one side (Gradient Cache chunks);
    ``forward(query=..., passage=...)`` encodes both in one call (plain training needs one forward per backward)."""

    def __init__(self, retriever: Retriever) -> None:
        super().__init__()
        self.retriever = retriever

    def forward(self, kind: Optional[str] = None, query: Any = None, passage: Any = None, **batch: torch.Tensor) -> Any:
        if kind is not None:
            return self.retriever(kind, **batch)
        return self.retriever("query", **query), self.retriever("passage", **passage)


def setup_distributed(device: Optional[str]) -> tuple[int, int, torch.device]:
    """Join the ``torchrun`` process group when its environment is set (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, (dist.get_world_size() if dist.is_initialized() else 1), dev


def build_retriever(config: TrainConfig) -> Retriever:
    """A saved retriever folder, an official DPR pair or a DPR ``.cp`` file loads as it is (prefixes given as flags
    replace its own); any other model name or folder starts a new one from the flags."""
    model = Path(config.model)
    if (model / "retriever_config.json").is_file() or model.is_file() or find_dpr_pair(model):
        retriever = Retriever.load(config.model, query_prefix=config.query_prefix,
                                   passage_prefix=config.passage_prefix)
        if config.retriever is not None:
            logger.info("%s is a saved retriever: its own pooling/temperature/lengths are used", config.model)
        return retriever
    rconf = config.retriever or RetrieverConfig()
    prefixes = {k: v for k, v in (("query_prefix", config.query_prefix), ("passage_prefix", config.passage_prefix))
                if v is not None}
    return Retriever.from_pretrained(config.model, dataclasses.replace(rconf, **prefixes))


def describe_training(config: TrainConfig, data: Any, world: int, chunks: tuple, total_steps: int) -> dict:
    """What the model card records about this run (steps and dev metrics are added as they happen)."""
    n_neg = config.hard_negatives + config.other_negatives
    return {"base_model": config.model,
            "train_data": [{"file": s["source"], "records": s["records"], "kept": s["kept"]} for s in data.stats],
            "dev_file": config.dev_file,
            "loss": f"InfoNCE (softmax cross-entropy of scores / temperature) over the batch's {1 + n_neg} passages "
                    "per query and every other query's passages" + (", symmetric" if config.symmetric else ""),
            "batch_size": config.batch_size * world, "batch_size_per_rank": config.batch_size, "world_size": world,
            "hard_negatives": config.hard_negatives, "other_negatives": config.other_negatives,
            "grad_cache": config.grad_cache, "query_chunk_size": chunks[0] if config.grad_cache else None,
            "passage_chunk_size": chunks[1] if config.grad_cache else None, "learning_rate": config.learning_rate,
            "warmup_steps": config.warmup_steps, "epochs": config.epochs, "total_steps": total_steps,
            "precision": config.precision, "seed": config.seed, "steps": 0}


def train(config: TrainConfig, on_backward: Optional[Callable[[int, Retriever], None]] = None) -> dict:
    """Run training; returns a summary (steps, examples/s, best metric, output folders).

    ``on_backward(step, retriever)`` is called after each step's gradients are complete, before clipping and the
    optimizer step (used to compare gradients in tests).
    """
    from .data import Collator, load_training_data, make_dataloader

    for source in config.train_files + ([config.dev_file] if config.dev_file else []):
        if not Path(source).exists():
            raise DprGcError(f"training data not found: {source} (give DPR files or BEIR folders)")
    rank, world, device = setup_distributed(config.device)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    retriever = build_retriever(config).to(device)
    retriever.train()
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(retriever)
    if config.freeze_position_embeddings:
        logger.info("froze %d position-embedding weights", freeze_position_embeddings(retriever))
    rconf = retriever.config

    data = load_training_data(config.train_files, config.cache_dir, config.skip_bad_records)
    collator = Collator(retriever.tokenizer, rconf)
    loader = make_dataloader(data, collator, config.batch_size, hard_negatives=config.hard_negatives,
                             other_negatives=config.other_negatives, shuffle_positives=config.shuffle_positives,
                             rates=config.sampling_rates, seed=config.seed, rank=rank, world_size=world,
                             num_workers=config.num_workers, pin_memory=device.type == "cuda")
    loader.generator = torch.Generator().manual_seed(config.seed)
    sampler = loader.batch_sampler
    steps_per_epoch = sampler.batches_per_epoch
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    eval_every, save_every = config.eval_every, config.save_every
    if config.eval_per_epoch:  # GC-DPR's --eval_per_epoch: evaluate and save a checkpoint N times an epoch
        eval_every = max(1, -(-steps_per_epoch // config.eval_per_epoch))
        save_every = save_every or eval_every
        logger.info("%d dev evaluation(s) per epoch: every %d steps", config.eval_per_epoch, eval_every)

    n_neg = config.hard_negatives + config.other_negatives
    loss_cls = DistributedContrastiveLoss if world > 1 else SimpleContrastiveLoss
    loss_fn = loss_cls(n_neg, symmetric=config.symmetric, loss_chunk_size=config.loss_chunk_size)
    towers = Towers(retriever)
    model: nn.Module = towers
    if world > 1:
        model = DistributedDataParallel(towers, device_ids=[device.index] if device.type == "cuda" else None,
                                        find_unused_parameters=not rconf.shared_encoder)

    q_chunk, p_chunk = config.query_chunk_size, config.passage_chunk_size
    if config.grad_cache and "auto" in (q_chunk, p_chunk):
        auto = auto_chunk_size(towers, collator, device, config.batch_size * (1 + n_neg), config.precision)
        q_chunk = min(auto, config.batch_size) if q_chunk == "auto" else q_chunk
        p_chunk = auto if p_chunk == "auto" else p_chunk
        logger.info("auto chunk size: query %s, passage %s", q_chunk, p_chunk)
    if config.grad_cache and q_chunk > config.batch_size:
        raise DprGcError(f"--query-chunk-size {q_chunk} is larger than --batch-size {config.batch_size}: "
                         "use a chunk of at most the batch (or --no-grad-cache)")
    if config.grad_cache and p_chunk > config.batch_size * (1 + n_neg):
        raise DprGcError(f"--passage-chunk-size {p_chunk} is larger than the {config.batch_size * (1 + n_neg)} "
                         "passages of a batch: use a chunk of at most that (or --no-grad-cache)")

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "tau.log_value")
    params = [p for p in towers.parameters() if p.requires_grad]
    decay = [p for n, p in towers.named_parameters() if p.requires_grad and not any(k in n for k in no_decay)]
    decay_ids = {id(p) for p in decay}
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": [p for p in params if id(p) not in decay_ids], "weight_decay": 0.0}],
                                  lr=config.learning_rate, eps=config.adam_eps, betas=tuple(config.adam_betas))
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / max(1, warmup), max(0.0, (total_steps - s) / max(1, total_steps - warmup))))
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    gc = GradCache([model, model], [int(q_chunk), int(p_chunk)] if config.grad_cache else [1, 1], loss_fn,
                   fp16=config.precision == "fp16", scaler=scaler, bf16=config.precision == "bf16",
                   sort_by_length=True)

    checkpointer = Checkpointer(out, config.keep_checkpoints, config.best_metric, rank == 0)
    metrics_file = out / "metrics.jsonl"
    step, epoch = 0, 0
    if not config.resume and checkpointer.checkpoints():
        raise DprGcError(f"{out} already holds checkpoints: pass --resume latest to continue, or choose a new --output")
    if not config.resume and rank == 0:
        metrics_file.unlink(missing_ok=True)
    if config.resume:
        state = checkpointer.load(config.resume, retriever, optimizer, scheduler, scaler, device)
        sampler.load_state_dict(state["sampler"])
        step, epoch = state["step"], state["sampler"]["epoch"]
        restore_rng(state["rng"][rank] if isinstance(state["rng"], list) else state["rng"])
        logger.info("resumed from step %d (epoch %d, %d batches into it)", step, epoch, state["sampler"]["batches_done"])

    effective = config.batch_size * world
    retriever.training_info.update(describe_training(config, data, world, (q_chunk, p_chunk), total_steps))
    retriever.training_info["steps"] = step
    if rank == 0:
        logger.info("training %d steps: batch %d per rank x %d rank(s) = %d queries, %d passages per query, %s, %s",
                    total_steps, config.batch_size, world, effective, 1 + n_neg,
                    f"Gradient Cache chunks {q_chunk}/{p_chunk}" if config.grad_cache else "plain training",
                    config.precision)
    if config.dev_file and step == 0:
        initial = {"step": 0, **dev_metrics(retriever, config, collator)}
        checkpointer.log(metrics_file, initial)
        logger.info("dev before training: %s", {k: round(v, 4) for k, v in initial.items()})
    board = tensorboard_writer(out) if rank == 0 else None
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, desc="train", dynamic_ncols=True)
    started, examples, last_loss = time.perf_counter(), 0, float("nan")
    while step < total_steps:
        sampler.set_epoch(epoch)
        done_in_epoch = steps_per_epoch - len(sampler)
        for batch in loader:
            query, passage = dict(batch["query"]), dict(batch["passage"])
            optimizer.zero_grad(set_to_none=True)
            if config.grad_cache:
                loss = gc(dict(query, kind="query"), dict(passage, kind="passage"), no_sync_except_last=world > 1)
            else:
                loss = plain_step(model, loss_fn, query, passage, device, config.precision, scaler)
            if on_backward is not None:
                on_backward(step, retriever)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step, done_in_epoch, examples = step + 1, done_in_epoch + 1, examples + effective
            last_loss = float(loss)
            rate = examples / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", ex_s=f"{rate:.1f}")
            record = {"step": step, "epoch": epoch, "loss": last_loss, "lr": scheduler.get_last_lr()[0],
                      "grad_norm": float(grad_norm), "examples_per_s": rate,
                      "temperature": float(retriever.temperature.detach())}
            rng = capture_rng()
            last = step >= total_steps
            retriever.training_info["steps"] = step
            if config.dev_file and ((eval_every and step % eval_every == 0) or last):
                record.update(dev_metrics(retriever, config, collator))
                retriever.training_info.update(dev_metrics={k: v for k, v in record.items() if k.startswith("dev_")},
                                               dev_metrics_step=step)
                checkpointer.update_best(step, retriever, record)
            if step % config.log_every == 0 or last:
                checkpointer.log(metrics_file, record)
                if board is not None:
                    for key, value in record.items():
                        board.add_scalar(f"train/{key}", value, step)
            if (save_every and step % save_every == 0) or last:
                checkpointer.save(step, retriever, optimizer, scheduler, scaler, sampler.state_dict(done_in_epoch),
                                  gather_rng(rng, world), record)
            restore_rng(rng)
            if last:
                break
        epoch += 1
    bar.close()
    if board is not None:
        board.close()
    seconds = time.perf_counter() - started
    summary = {"steps": step, "effective_batch": effective, "passages_per_query": 1 + n_neg,
               "chunk_sizes": [q_chunk, p_chunk] if config.grad_cache else None, "precision": config.precision,
               "final_loss": last_loss, "seconds": seconds, "examples_per_s": examples / max(seconds, 1e-9),
               "final_model": str(out / "final"), "best_model": checkpointer.best_path,
               "best": checkpointer.best_value, "metrics_file": str(metrics_file)}
    if rank == 0:
        retriever.save(out / "final")
        print(summary_table(summary))
    if dist.is_initialized():
        dist.barrier()
    return summary


def tensorboard_writer(out: Path) -> Any:
    """A TensorBoard writer into ``out/tensorboard`` when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def dev_metrics(retriever: Retriever, config: TrainConfig, collator: Any) -> dict:
    metrics = evaluate_dev(retriever, config.dev_file, config.dev_limits(), config.cache_dir)
    logger.info("dev validation over %d questions and %d passages", metrics.pop("questions"), metrics.pop("passages"))
    retriever.train()
    return {f"dev_{k}": v for k, v in metrics.items()}


def plain_step(model: nn.Module, loss_fn: nn.Module, query: dict, passage: dict, device: torch.device,
               precision: str, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """One full-graph step (no Gradient Cache), the baseline that Gradient Cache must equal."""
    query = {k: v.to(device) for k, v in query.items()}
    passage = {k: v.to(device) for k, v in passage.items()}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        q, p = model(query=query, passage=passage)
    loss = loss_fn(q.float(), p.float())
    scaler.scale(loss).backward()
    return loss.detach()


def gather_rng(rng: dict, world: int) -> Union[dict, list]:
    """Every rank's RNG state (a checkpoint restores each rank's own)."""
    if world == 1:
        return rng
    states: list = [None] * world
    dist.all_gather_object(states, rng)
    return states


def add_cli(subparsers: Any) -> None:
    """Register ``train``; GC-DPR's flag names are accepted as aliases (see scripts/train_dense_encoder.py)."""
    p = subparsers.add_parser("train", help="train a retriever with Gradient Cache (DPR files or BEIR folders)")
    p.add_argument("--train", "--train_file", dest="train_files", nargs="+", required=True,
                   help="DPR training files (.json/.jsonl[.gz]) or BEIR folders (qrels/train.tsv)")
    p.add_argument("--dev", "--dev_file", dest="dev_file", help="DPR dev file for validation")
    p.add_argument("--output", "--output_dir", type=output_dir, dest="output_dir", required=True, help="output folder")
    p.add_argument("--model", "--pretrained_model_cfg", dest="model", default=None,
                   help="Hugging Face model name or folder, or a saved retriever (default: offline all-MiniLM-L6-v2)")
    p.add_argument("--pooling", default="cls", choices=["cls", "mean", "pooler", "last"],
                   help="last: the last non-padding token's state (decoder-only models; EOS appended when absent)")
    p.add_argument("--normalize", action="store_true", help="L2-normalise representations (cosine similarity)")
    p.add_argument("--projection-dim", type=positive_int, default=None)
    p.add_argument("--separate-encoders", action="store_true", help="two towers instead of one shared")
    p.add_argument("--query-max-length", "--query_max_length", type=positive_int, default=32)
    p.add_argument("--passage-max-length", "--sequence_length", type=positive_int, default=256)
    p.add_argument("--passage-format", default="pair", choices=["pair", "concat"])
    add_prefix_arguments(p)
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--learn-temperature", action="store_true")
    p.add_argument("--batch-size", "--batch_size", type=positive_int, default=32, help="queries per step and rank")
    p.add_argument("--hard-negatives", "--hard_negatives", type=nonnegative_int, default=1)
    p.add_argument("--other-negatives", "--other_negatives", type=nonnegative_int, default=0)
    p.add_argument("--shuffle-positives", "--shuffle_positive_ctx", action="store_true")
    p.add_argument("--sampling-rates", type=positive_float, nargs="+", default=None)
    p.add_argument("--no-grad-cache", dest="grad_cache", action="store_false", help="plain training (baseline)")
    p.add_argument("--grad_cache", dest="grad_cache", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--query-chunk-size", "--q_chunk_size", type=chunk_arg, default="auto")
    p.add_argument("--passage-chunk-size", "--ctx_chunk_size", type=chunk_arg, default="auto")
    p.add_argument("--loss-chunk-size", type=nonnegative_int, default=None,
                   help="rows per block of the score matrix (0: the dense matrix; default: automatic)")
    p.add_argument("--symmetric", action="store_true", help="add the passage-to-query loss term")
    p.add_argument("--learning-rate", "--learning_rate", type=positive_float, default=2e-5)
    p.add_argument("--weight-decay", "--weight_decay", type=nonnegative_float, default=0.0)
    p.add_argument("--warmup-steps", "--warmup_steps", type=nonnegative_int, default=0)
    p.add_argument("--epochs", "--num_train_epochs", type=positive_int, default=1)
    p.add_argument("--max-steps", type=positive_int, default=None)
    p.add_argument("--max-grad-norm", "--max_grad_norm", type=positive_float, default=2.0)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help=argparse.SUPPRESS)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--freeze-position-embeddings", action="store_true")
    p.add_argument("--eval-every", type=positive_int, default=None, help="steps between dev evaluations")
    p.add_argument("--dev-batch-size", "--dev_batch_size", type=positive_int, default=64,
                   help="dev questions per in-batch loss/accuracy group (and per encoding batch)")
    p.add_argument("--dev-encode-batch-size", "--val_av_rank_bsz", type=positive_int, default=None,
                   help="encoding batch of dev validation (default: --dev-batch-size)")
    p.add_argument("--dev-max-questions", "--val_av_rank_max_qs", type=positive_int, default=10000,
                   help="dev questions used for validation (the first ones), as DPR's cap")
    p.add_argument("--dev-hard-negatives", "--val_av_rank_hard_neg", type=nonnegative_int, default=30,
                   help="hard negatives per dev question added to the average-rank passage pool")
    p.add_argument("--dev-other-negatives", "--val_av_rank_other_neg", type=nonnegative_int, default=30,
                   help="other negatives per dev question added to the average-rank passage pool")
    p.add_argument("--save-every", type=positive_int, default=None, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2)
    p.add_argument("--best-metric", default="avg_rank", choices=["avg_rank", "loss", "accuracy"])
    p.add_argument("--resume", default=None, help="checkpoint folder, or 'latest' in --output")
    p.add_argument("--num-workers", type=nonnegative_int, default=2,
                   help="DataLoader workers that tokenise ahead of the step")
    p.add_argument("--skip-bad-records", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", type=device_arg, default=None)
    p.set_defaults(func=_cli_train)


def chunk_arg(value: str) -> Union[int, str]:
    """A chunk size flag: a positive integer or ``auto``."""
    return value if value == "auto" else positive_int(value)


def config_from_args(args: Any) -> TrainConfig:
    from .model import default_model_path

    retriever = RetrieverConfig(pooling=args.pooling, normalize=args.normalize, projection_dim=args.projection_dim,
                                shared_encoder=not args.separate_encoders, query_max_length=args.query_max_length,
                                passage_max_length=args.passage_max_length, temperature=args.temperature,
                                learn_temperature=args.learn_temperature, passage_format=args.passage_format)
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"retriever", "model"}
    values = {k: v for k, v in vars(args).items() if k in fields}
    return TrainConfig(model=args.model or default_model_path(), retriever=retriever, **values)


def _cli_train(args: Any) -> None:
    train(config_from_args(args))
