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
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from .args import device_arg, nonnegative_float, nonnegative_int, output_dir, positive_float, positive_int
from .data import Collator, load_training_data, make_dataloader
from .dpr_hub import find_dpr_pair
from .errors import DprGcError
from .grad_cache import GradCache
from .loss import DistributedContrastiveLoss, SimpleContrastiveLoss, check_loss_chunk_size
from .model import (Retriever, RetrieverConfig, add_prefix_arguments, enable_gradient_checkpointing,
                    freeze_position_embeddings)
from .train_utils import (Checkpointer, Towers, auto_chunk_size, capture_rng, gather_rng, restore_rng, seed_everything,
                          setup_distributed, summary_table, tensorboard_writer)
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


def describe_training(config: TrainConfig, data: Any, world: int, chunks: Optional[tuple], total_steps: int) -> dict:
    """What the model card records about this run (steps and dev metrics are added as they happen)."""
    n_neg = config.hard_negatives + config.other_negatives
    return {"base_model": config.model,
            "train_data": [{"file": s["source"], "records": s["records"], "kept": s["kept"]} for s in data.stats],
            "dev_file": config.dev_file,
            "loss": f"InfoNCE (softmax cross-entropy of scores / temperature) over the batch's {1 + n_neg} passages "
                    "per query and every other query's passages" + (", symmetric" if config.symmetric else ""),
            "batch_size": config.batch_size * world, "batch_size_per_rank": config.batch_size, "world_size": world,
            "hard_negatives": config.hard_negatives, "other_negatives": config.other_negatives,
            "grad_cache": config.grad_cache, "query_chunk_size": chunks[0] if chunks else None,
            "passage_chunk_size": chunks[1] if chunks else None, "learning_rate": config.learning_rate,
            "warmup_steps": config.warmup_steps, "epochs": config.epochs, "total_steps": total_steps,
            "precision": config.precision, "seed": config.seed, "steps": 0}


def check_sources(config: TrainConfig) -> None:
    """Refuse a missing training or dev source before anything is built."""
    for source in config.train_files + ([config.dev_file] if config.dev_file else []):
        if not Path(source).exists():
            raise DprGcError(f"training data not found: {source} (give DPR files or BEIR folders)")


class Trainer:
    """One training run, one method per concern (the shape of DPR's ``BiEncoderTrainer``).

    The constructor builds the parts in order -- :meth:`build_model`, :meth:`build_data`, :meth:`build_loss`,
    :meth:`wrap_model`, :meth:`chunk_sizes`, :meth:`build_optimizer`, :meth:`build_scheduler`, :meth:`build_cache`
    (no :class:`GradCache` in plain training) -- and :meth:`fit` runs the loop: :meth:`resume` (or a fresh start),
    :meth:`train_step` per batch, :meth:`evaluate` on the dev set, :meth:`save` for checkpoints. ``on_backward(step,
    retriever)`` is called after each step's gradients are complete, before clipping and the optimizer step (used to
    compare gradients in tests).
    """

    def __init__(self, config: TrainConfig, on_backward: Optional[Callable[[int, Retriever], None]] = None) -> None:
        self.config, self.on_backward = config, on_backward
        check_sources(config)
        self.rank, self.world, self.device = setup_distributed(config.device)
        seed_everything(config.seed)
        self.out = Path(config.output_dir)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self.retriever = self.build_model()
        self.data, self.collator, self.loader = self.build_data()
        self.sampler = self.loader.batch_sampler
        self.steps_per_epoch = self.sampler.batches_per_epoch
        self.total_steps = config.max_steps or self.steps_per_epoch * config.epochs
        self.eval_every, self.save_every = self.schedule()
        self.passages_per_query = 1 + config.hard_negatives + config.other_negatives
        self.effective_batch = config.batch_size * self.world
        self.loss_fn = self.build_loss()
        self.towers, self.model = self.wrap_model()
        self.chunks = self.chunk_sizes() if config.grad_cache else None
        self.params, self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.cache = self.build_cache()
        self.checkpointer = Checkpointer(self.out, config.keep_checkpoints, config.best_metric, self.rank == 0)
        self.metrics_file = self.out / "metrics.jsonl"
        self.step, self.epoch, self.examples, self.last_loss = 0, 0, 0, float("nan")
        self.started, self.board, self.bar = time.perf_counter(), None, None

    # ----------------------------------------------------------------- building
    def build_model(self) -> Retriever:
        """The retriever in training mode on this rank's device, with gradient checkpointing or frozen position
        embeddings when asked."""
        retriever = build_retriever(self.config).to(self.device)
        retriever.train()
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(retriever)
        if self.config.freeze_position_embeddings:
            logger.info("froze %d position-embedding weights", freeze_position_embeddings(retriever))
        return retriever

    def build_data(self) -> tuple[Any, Collator, torch.utils.data.DataLoader]:
        """The parsed training sources, the collator that tokenises them, and this rank's DataLoader."""
        config = self.config
        data = load_training_data(config.train_files, config.cache_dir, config.skip_bad_records)
        collator = Collator(self.retriever.tokenizer, self.retriever.config)
        loader = make_dataloader(data, collator, config.batch_size, hard_negatives=config.hard_negatives,
                                 other_negatives=config.other_negatives, shuffle_positives=config.shuffle_positives,
                                 rates=config.sampling_rates, seed=config.seed, rank=self.rank, world_size=self.world,
                                 num_workers=config.num_workers, pin_memory=self.device.type == "cuda")
        return data, collator, loader

    def schedule(self) -> tuple[Optional[int], Optional[int]]:
        """Steps between dev evaluations and between checkpoints (GC-DPR's ``--eval_per_epoch`` evaluates and saves
        N times an epoch)."""
        eval_every, save_every = self.config.eval_every, self.config.save_every
        if self.config.eval_per_epoch:
            eval_every = max(1, -(-self.steps_per_epoch // self.config.eval_per_epoch))
            save_every = save_every or eval_every
            logger.info("%d dev evaluation(s) per epoch: every %d steps", self.config.eval_per_epoch, eval_every)
        return eval_every, save_every

    def build_loss(self) -> SimpleContrastiveLoss:
        """In-batch-negative InfoNCE, over the global batch of every rank under torchrun."""
        loss_cls = DistributedContrastiveLoss if self.world > 1 else SimpleContrastiveLoss
        return loss_cls(self.passages_per_query - 1, symmetric=self.config.symmetric,
                        loss_chunk_size=self.config.loss_chunk_size)

    def wrap_model(self) -> tuple[Towers, nn.Module]:
        """The towers module, and what the step calls: the towers themselves or their DDP wrapper."""
        towers = Towers(self.retriever)
        if self.world == 1:
            return towers, towers
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return towers, DistributedDataParallel(towers, device_ids=device_ids,
                                               find_unused_parameters=not self.retriever.config.shared_encoder)

    def chunk_sizes(self) -> tuple[int, int]:
        """Gradient Cache's query and passage chunk sizes (``auto`` probes the device), checked against the batch."""
        config, passages = self.config, self.config.batch_size * self.passages_per_query
        q_chunk, p_chunk = config.query_chunk_size, config.passage_chunk_size
        if "auto" in (q_chunk, p_chunk):
            auto = auto_chunk_size(self.towers, self.collator, self.device, passages, config.precision)
            q_chunk = min(auto, config.batch_size) if q_chunk == "auto" else q_chunk
            p_chunk = auto if p_chunk == "auto" else p_chunk
            logger.info("auto chunk size: query %s, passage %s", q_chunk, p_chunk)
        if q_chunk > config.batch_size:
            raise DprGcError(f"--query-chunk-size {q_chunk} is larger than --batch-size {config.batch_size}: "
                             "use a chunk of at most the batch (or --no-grad-cache)")
        if p_chunk > passages:
            raise DprGcError(f"--passage-chunk-size {p_chunk} is larger than the {passages} passages of a batch: "
                             "use a chunk of at most that (or --no-grad-cache)")
        return int(q_chunk), int(p_chunk)

    def build_optimizer(self) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        """The trainable parameters and AdamW over them, without weight decay on biases, LayerNorm weights and the
        temperature."""
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "tau.log_value")
        named = [(n, p) for n, p in self.towers.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if not any(k in n for k in no_decay)]
        rest = [p for n, p in named if any(k in n for k in no_decay)]
        config = self.config
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}],
                                      lr=config.learning_rate, eps=config.adam_eps, betas=tuple(config.adam_betas))
        return [p for _, p in named], optimizer

    def build_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warm-up to the learning rate, then linear decay to zero at the last step."""
        warmup, total = self.config.warmup_steps, self.total_steps
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min((s + 1) / max(1, warmup), max(0.0, (total - s) / max(1, total - warmup))))

    def build_cache(self) -> Optional[GradCache]:
        """Gradient Cache over the (possibly DDP-wrapped) towers; None in plain training."""
        if self.chunks is None:
            return None
        precision = self.config.precision
        return GradCache([self.model, self.model], list(self.chunks), self.loss_fn, fp16=precision == "fp16",
                         scaler=self.scaler, bf16=precision == "bf16", sort_by_length=True)

    # ----------------------------------------------------------------- state
    def start_fresh(self) -> None:
        """A new run: refuse a folder that holds checkpoints, and clear an old metrics file."""
        if self.checkpointer.checkpoints():
            raise DprGcError(f"{self.out} already holds checkpoints: pass --resume latest to continue, "
                             "or choose a new --output")
        if self.rank == 0:
            self.metrics_file.unlink(missing_ok=True)

    def resume(self, checkpoint: str) -> None:
        """Continue from a checkpoint folder (or ``latest``): weights, optimizer, schedule, scaler, the sampler's
        place in its epoch and this rank's RNG state, so the run goes on exactly as if never stopped."""
        state = self.checkpointer.load(checkpoint, self.retriever, self.optimizer, self.scheduler, self.scaler,
                                       self.device)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.epoch = state["step"], state["sampler"]["epoch"]
        restore_rng(state["rng"][self.rank] if isinstance(state["rng"], list) else state["rng"])
        logger.info("resumed from step %d (epoch %d, %d batches into it)", self.step, self.epoch,
                    state["sampler"]["batches_done"])

    def save(self, record: dict, done_in_epoch: int, rng: dict) -> None:
        """Write ``checkpoint-STEP/`` with everything :meth:`resume` needs (``rng``: the state after this step)."""
        self.checkpointer.save(self.step, self.retriever, self.optimizer, self.scheduler, self.scaler,
                               self.sampler.state_dict(done_in_epoch), gather_rng(rng, self.world), record)

    # ----------------------------------------------------------------- the step
    def train_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on one batch: the gradient (cached, or one plain graph), clipping, AdamW and the
        schedule; returns the detached loss and the gradient norm before clipping."""
        query, passage = dict(batch["query"]), dict(batch["passage"])
        self.optimizer.zero_grad(set_to_none=True)
        if self.cache is not None:
            loss = self.cache(dict(query, kind="query"), dict(passage, kind="passage"),
                              no_sync_except_last=self.world > 1)
        else:
            loss = self.plain_backward(query, passage)
        if self.on_backward is not None:
            self.on_backward(self.step, self.retriever)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss, grad_norm

    def plain_backward(self, query: dict, passage: dict) -> torch.Tensor:
        """The full-batch gradient in one graph (no Gradient Cache): the baseline that Gradient Cache must equal."""
        query = {k: v.to(self.device) for k, v in query.items()}
        passage = {k: v.to(self.device) for k, v in passage.items()}
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.config.precision)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            q, p = self.model(query=query, passage=passage)
        loss = self.loss_fn(q.float(), p.float())
        self.scaler.scale(loss).backward()
        return loss.detach()

    def evaluate(self) -> dict:
        """Dev validation (DPR's in-batch loss and accuracy, and average rank) as ``dev_*`` metrics."""
        config = self.config
        metrics = evaluate_dev(self.retriever, config.dev_file, config.dev_limits(), config.cache_dir)
        logger.info("dev validation over %d questions and %d passages", metrics.pop("questions"),
                    metrics.pop("passages"))
        self.retriever.train()
        return {f"dev_{k}": v for k, v in metrics.items()}

    # ----------------------------------------------------------------- the loop
    def fit(self) -> dict:
        """Train to the last step (continuing ``config.resume`` when given); returns the run's summary."""
        if self.config.resume:
            self.resume(self.config.resume)
        else:
            self.start_fresh()
        self.retriever.training_info.update(describe_training(self.config, self.data, self.world, self.chunks,
                                                              self.total_steps))
        self.retriever.training_info["steps"] = self.step
        self.announce()
        if self.config.dev_file and self.step == 0:
            initial = {"step": 0, **self.evaluate()}
            self.checkpointer.log(self.metrics_file, initial)
            logger.info("dev before training: %s", {k: round(v, 4) for k, v in initial.items()})
        self.board = tensorboard_writer(self.out) if self.rank == 0 else None
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=self.rank != 0, desc="train",
                        dynamic_ncols=True)
        self.started = time.perf_counter()
        while self.step < self.total_steps:
            self.train_epoch()
            self.epoch += 1
        self.bar.close()
        if self.board is not None:
            self.board.close()
        return self.finish()

    def announce(self) -> None:
        if self.rank == 0:
            config = self.config
            logger.info("training %d steps: batch %d per rank x %d rank(s) = %d queries, %d passages per query, %s, "
                        "%s", self.total_steps, config.batch_size, self.world, self.effective_batch,
                        self.passages_per_query, f"Gradient Cache chunks {self.chunks[0]}/{self.chunks[1]}"
                        if self.chunks else "plain training", config.precision)

    def train_epoch(self) -> None:
        """The rest of the current epoch (all of it, unless resumed inside it), stopping at the last step."""
        self.sampler.set_epoch(self.epoch)
        done_in_epoch = self.steps_per_epoch - len(self.sampler)
        for batch in self.loader:
            loss, grad_norm = self.train_step(batch)
            self.step, done_in_epoch = self.step + 1, done_in_epoch + 1
            self.examples += self.effective_batch
            self.after_step(self.record(loss, grad_norm), done_in_epoch)
            if self.step >= self.total_steps:
                break

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The step's metrics record (and the progress bar's line)."""
        self.last_loss = float(loss)
        rate = self.examples / (time.perf_counter() - self.started)
        lr = self.scheduler.get_last_lr()[0]
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.last_loss:.4f}", lr=f"{lr:.2e}", ex_s=f"{rate:.1f}")
        return {"step": self.step, "epoch": self.epoch, "loss": self.last_loss, "lr": lr,
                "grad_norm": float(grad_norm), "examples_per_s": rate,
                "temperature": float(self.retriever.temperature.detach())}

    def after_step(self, record: dict, done_in_epoch: int) -> None:
        """Evaluate, log and save when due. Dev validation must not move the training RNG, so the state after the
        step is captured first, saved with the checkpoint and put back."""
        rng = capture_rng()
        last = self.step >= self.total_steps
        self.retriever.training_info["steps"] = self.step
        if self.config.dev_file and ((self.eval_every and self.step % self.eval_every == 0) or last):
            record.update(self.evaluate())
            self.retriever.training_info.update(dev_metrics={k: v for k, v in record.items() if k.startswith("dev_")},
                                                dev_metrics_step=self.step)
            self.checkpointer.update_best(self.step, self.retriever, record)
        if self.step % self.config.log_every == 0 or last:
            self.checkpointer.log(self.metrics_file, record)
            if self.board is not None:
                for key, value in record.items():
                    self.board.add_scalar(f"train/{key}", value, self.step)
        if (self.save_every and self.step % self.save_every == 0) or last:
            self.save(record, done_in_epoch, rng)
        restore_rng(rng)

    def finish(self) -> dict:
        """Save ``final/``, print the summary table, and return the summary."""
        seconds = time.perf_counter() - self.started
        summary = {"steps": self.step, "effective_batch": self.effective_batch,
                   "passages_per_query": self.passages_per_query,
                   "chunk_sizes": list(self.chunks) if self.chunks else None, "precision": self.config.precision,
                   "final_loss": self.last_loss, "seconds": seconds,
                   "examples_per_s": self.examples / max(seconds, 1e-9), "final_model": str(self.out / "final"),
                   "best_model": self.checkpointer.best_path, "best": self.checkpointer.best_value,
                   "metrics_file": str(self.metrics_file)}
        if self.rank == 0:
            self.retriever.save(self.out / "final")
            print(summary_table(summary))
        if dist.is_initialized():
            dist.barrier()
        return summary


def train(config: TrainConfig, on_backward: Optional[Callable[[int, Retriever], None]] = None) -> dict:
    """Run training (see :class:`Trainer`); returns a summary (steps, examples/s, best metric, output folders)."""
    return Trainer(config, on_backward).fit()


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
