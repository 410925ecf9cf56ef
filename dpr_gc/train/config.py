"""What a training run depends on, grouped by concern: the model, the data, the optimisation, Gradient Cache and the
run (output, seed, schedule of evaluations and checkpoints). Each group checks its own fields when built, so a
library caller gets the same one-line errors as the command line; :func:`config_from_args` adapts the ``dpr-gc
train`` flags (:func:`add_train_arguments`) into the groups.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Optional, Union

from ..base.args import device_arg, nonnegative_float, nonnegative_int, output_dir, positive_float, positive_int
from ..base.errors import DprGcError
from ..model.lora import LoraSettings, add_lora_arguments, lora_settings
from ..engine.loss import check_loss_chunk_size
from ..model.retriever import RetrieverConfig, add_prefix_arguments
from .validation import DevLimits

PRECISIONS = ("fp32", "bf16", "fp16")
BEST_METRICS = ("avg_rank", "loss", "accuracy")


def _at_least(*checks: tuple[str, Optional[int], int]) -> None:
    for flag, value, low in checks:
        if value is not None and value < low:
            raise DprGcError(f"{flag} must be >= {low}, got {value}")


@dataclasses.dataclass
class ModelConfig:
    """The retriever trained: ``name`` is a Hugging Face model name or folder, a saved retriever, an official DPR
    pair or a DPR ``.cp`` file (None: the offline all-MiniLM-L6-v2); ``retriever`` sets up a new one (a saved one
    keeps its own settings, except prefixes given here)."""

    name: Optional[str] = None
    retriever: Optional[RetrieverConfig] = None
    query_prefix: Optional[str] = None
    passage_prefix: Optional[str] = None
    gradient_checkpointing: bool = False
    freeze_position_embeddings: bool = False
    lora: Optional[LoraSettings] = None  # LoRA adapters (only they train in the transformers), see dpr_gc.lora
    # The ``retriever`` fields the user set (the flags given); a sentence-transformers folder supplies the others.
    # None: every field of ``retriever`` when it is given, the folder's recipe when it is None.
    retriever_flags: Optional[tuple[str, ...]] = None

    def path(self) -> str:
        """The model to start from (the offline default when none is named)."""
        from ..model.retriever import default_model_path

        return self.name or default_model_path()


@dataclasses.dataclass
class DataConfig:
    """Training and dev data: sources, per-rank batch of queries, negatives per query, loading; ``dev`` bounds dev
    validation (DPR's ``val_av_rank_*``)."""

    train_files: list[str] = dataclasses.field(default_factory=list)
    dev_file: Optional[str] = None
    batch_size: int = 32
    hard_negatives: int = 1
    other_negatives: int = 0
    shuffle_positives: bool = False
    # a BEIR folder's examples: one per (query, positive) pair ("pairs"), or one per query with a positive drawn
    # at each draw ("sample"); see dpr_gc.data.training.example_index
    beir_positives: str = "pairs"
    sampling_rates: Optional[list[float]] = None
    # DataLoader workers; "auto": 0 on the CPU (workers would compete with the step for the same cores and copy the
    # training process's memory), 2 on a GPU (tokenising ahead of the step); see resolve_workers
    num_workers: Union[int, str] = "auto"
    skip_bad_records: bool = False
    cache_dir: Optional[str] = None
    dev: DevLimits = dataclasses.field(default_factory=DevLimits)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise DprGcError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.beir_positives not in ("pairs", "sample"):
            raise DprGcError(f"--beir-positives must be pairs or sample, got {self.beir_positives!r}")
        if self.num_workers != "auto" and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            raise DprGcError(f"--num-workers must be an integer >= 0 or 'auto', got {self.num_workers!r}")
        _at_least(("--hard-negatives", self.hard_negatives, 0),
                  ("--other-negatives", self.other_negatives, 0))

    @property
    def passages_per_query(self) -> int:
        return 1 + self.hard_negatives + self.other_negatives

    def resolve_workers(self, device_type: str) -> int:
        """``num_workers``, with ``auto`` resolved for the device: 0 on the CPU, where workers measured no faster
        and cost memory (benchmarks/README.md, "DataLoader workers"), 2 on a GPU."""
        if self.num_workers != "auto":
            return int(self.num_workers)
        return 2 if device_type == "cuda" else 0


@dataclasses.dataclass
class OptimConfig:
    """The objective and its minimisation: AdamW, linear warm-up and decay, clipping, length, mixed precision, and
    the symmetric (passage-to-query) loss term."""

    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    warmup_ratio: Optional[float] = None  # warm-up as a fraction of all steps (HF's), instead of warmup_steps
    epochs: int = 1
    max_steps: Optional[int] = None
    max_grad_norm: float = 2.0
    precision: str = "fp32"
    symmetric: bool = False

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: ``warmup_steps``, or ``ceil(warmup_ratio * total_steps)``
        (as Hugging Face's and sentence-transformers' trainers count it)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total_steps)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DprGcError(f"--precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.epochs < 1 and not self.max_steps:
            raise DprGcError("--epochs must be >= 1 (or give --max-steps)")
        _at_least(("--max-steps", self.max_steps, 1), ("--warmup-steps", self.warmup_steps, 0))
        if self.warmup_ratio is not None:
            if self.warmup_steps:
                raise DprGcError("give --warmup-steps or --warmup-ratio, not both")
            if not 0 <= self.warmup_ratio < 1:
                raise DprGcError(f"--warmup-ratio must lie in [0, 1), got {self.warmup_ratio}")
        if not (self.learning_rate > 0 and self.weight_decay >= 0 and self.max_grad_norm > 0):
            raise DprGcError("--learning-rate and --max-grad-norm must be positive and --weight-decay >= 0")


@dataclasses.dataclass
class CacheConfig:
    """Gradient Cache: rows per chunk of queries and of passages (``auto`` probes the device), or plain full-batch
    training when ``enabled`` is False; ``loss_chunk_size`` is rows per block of the loss's score matrix."""

    enabled: bool = True
    query_chunk_size: Union[int, str] = "auto"
    passage_chunk_size: Union[int, str] = "auto"
    loss_chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        for flag, value in (("--query-chunk-size", self.query_chunk_size),
                            ("--passage-chunk-size", self.passage_chunk_size)):
            if value != "auto" and (not isinstance(value, int) or value < 1):
                raise DprGcError(f"{flag} must be a positive integer or 'auto', got {value!r}")
        check_loss_chunk_size(self.loss_chunk_size)


@dataclasses.dataclass
class RunConfig:
    """Where and how the run goes: output folder, seed, device, resuming, and when it evaluates, logs and saves
    (``eval_per_epoch`` is GC-DPR's: evaluate and save N times an epoch)."""

    output_dir: str = ""
    seed: int = 0
    device: Optional[str] = None
    resume: Optional[str] = None
    eval_every: Optional[int] = None
    eval_per_epoch: Optional[int] = None
    save_every: Optional[int] = None
    keep_checkpoints: int = 2
    best_metric: str = "avg_rank"
    log_every: int = 1
    fsdp: bool = False
    fsdp_cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.best_metric not in BEST_METRICS:
            raise DprGcError(f"--best-metric must be avg_rank, loss or accuracy, got {self.best_metric!r}")
        _at_least(("--eval-every", self.eval_every, 1), ("--save-every", self.save_every, 1))
        if self.fsdp_cpu_offload and not self.fsdp:
            raise DprGcError("--fsdp-cpu-offload needs --fsdp")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on, one group per concern."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.run.fsdp and self.optim.precision not in ("fp32", "bf16"):
            raise DprGcError(f"--fsdp trains in --precision fp32 or bf16, not {self.optim.precision}")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``dpr-gc train`` flags; GC-DPR's flag names are accepted as aliases (see scripts/train_dense_encoder.py)."""
    p.add_argument("--train", "--train_file", dest="train_files", nargs="+", required=True,
                   help="DPR training files (.json/.jsonl[.gz]) or BEIR folders (qrels/train.tsv)")
    p.add_argument("--dev", "--dev_file", dest="dev_file", help="DPR dev file for validation")
    p.add_argument("--output", "--output_dir", type=output_dir, dest="output_dir", required=True, help="output folder")
    p.add_argument("--model", "--pretrained_model_cfg", dest="model", default=None,
                   help="Hugging Face model name or folder, or a saved retriever (default: offline all-MiniLM-L6-v2)")
    recipe = " (default: a sentence-transformers --model folder's own, else %s)"
    p.add_argument("--pooling", default=None, choices=["cls", "mean", "pooler", "last"],
                   help="last: the last non-padding token's state (decoder-only models; EOS appended when absent)"
                        + recipe % "cls")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise representations (cosine similarity)" + recipe % "off")
    p.add_argument("--projection-dim", type=positive_int, default=None)
    p.add_argument("--separate-encoders", action="store_true", help="two towers instead of one shared")
    p.add_argument("--query-max-length", "--query_max_length", type=positive_int, default=None, help=recipe % 32)
    p.add_argument("--passage-max-length", "--sequence_length", type=positive_int, default=None, help=recipe % 256)
    p.add_argument("--passage-format", default=None, choices=["pair", "concat"], help=recipe % "pair")
    add_prefix_arguments(p)
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="scores are divided by it (default: 0.05 for a normalised sentence-transformers --model "
                        "folder, as its MultipleNegativesRankingLoss; else 1.0)")
    p.add_argument("--learn-temperature", action="store_true")
    p.add_argument("--batch-size", "--batch_size", type=positive_int, default=32, help="queries per step and rank")
    p.add_argument("--hard-negatives", "--hard_negatives", type=nonnegative_int, default=1)
    p.add_argument("--other-negatives", "--other_negatives", type=nonnegative_int, default=0)
    p.add_argument("--shuffle-positives", "--shuffle_positive_ctx", action="store_true",
                   help="DPR files: draw a random positive per question (else the first)")
    p.add_argument("--beir-positives", choices=["pairs", "sample"], default="pairs",
                   help="BEIR folders: one example per (query, positive) qrels pair each epoch (pairs, the default, "
                        "as sentence-transformers), or one per query with a positive drawn each time (sample)")
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
    warmup = p.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", "--warmup_steps", type=nonnegative_int, default=None,
                        help="steps of linear learning-rate warm-up (default 0)")
    warmup.add_argument("--warmup-ratio", type=nonnegative_float, default=None,
                        help="warm-up as a fraction of all steps, rounded up (0.1: the first 10%%), instead of "
                             "--warmup-steps")
    p.add_argument("--epochs", "--num_train_epochs", type=positive_int, default=1)
    p.add_argument("--max-steps", type=positive_int, default=None)
    p.add_argument("--max-grad-norm", "--max_grad_norm", type=positive_float, default=2.0)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help=argparse.SUPPRESS)
    p.add_argument("--gradient-checkpointing", action="store_true")
    add_lora_arguments(p)
    p.add_argument("--freeze-position-embeddings", action="store_true")
    add_run_arguments(p)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of dev validation, checkpoints, resuming, loading and the device."""
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
    p.add_argument("--best-metric", default="avg_rank", choices=list(BEST_METRICS))
    p.add_argument("--resume", default=None, help="checkpoint folder, or 'latest' in --output")
    p.add_argument("--num-workers", type=workers_arg, default="auto",
                   help="DataLoader workers that tokenise ahead of the step (auto: 0 on the CPU, where they cost "
                        "memory and measured no faster; 2 on a GPU)")
    p.add_argument("--skip-bad-records", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--device", type=device_arg, default=None)
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model over the ranks (FSDP2, one unit per transformer block)")
    p.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="with --fsdp: keep parameters, gradients and optimizer state on the CPU between uses")


def workers_arg(value: str) -> Union[int, str]:
    """A --num-workers flag: an integer >= 0 or ``auto``."""
    return value if value == "auto" else nonnegative_int(value)


def chunk_arg(value: str) -> Union[int, str]:
    """A chunk size flag: a positive integer or ``auto``."""
    return value if value == "auto" else positive_int(value)


def config_from_args(args: Any) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``dpr-gc train`` flags, each flag into its group."""
    given = {k: getattr(args, k) for k in ("pooling", "normalize", "projection_dim", "query_max_length",
                                           "passage_max_length", "temperature", "passage_format")
             if getattr(args, k) is not None}
    given.update({"shared_encoder": False} if args.separate_encoders else {},
                 **{"learn_temperature": True} if args.learn_temperature else {})
    given.update({k: getattr(args, k) for k in ("query_prefix", "passage_prefix") if getattr(args, k) is not None})
    model = ModelConfig(name=args.model, retriever=RetrieverConfig(**given), query_prefix=args.query_prefix,
                        passage_prefix=args.passage_prefix, gradient_checkpointing=args.gradient_checkpointing,
                        freeze_position_embeddings=args.freeze_position_embeddings, lora=lora_settings(args),
                        retriever_flags=tuple(given))
    dev = DevLimits(max_questions=args.dev_max_questions, hard_negatives=args.dev_hard_negatives,
                    other_negatives=args.dev_other_negatives, batch_size=args.dev_batch_size,
                    encode_batch_size=args.dev_encode_batch_size)
    data = DataConfig(train_files=args.train_files, dev_file=args.dev_file, batch_size=args.batch_size,
                      hard_negatives=args.hard_negatives, other_negatives=args.other_negatives,
                      shuffle_positives=args.shuffle_positives, beir_positives=args.beir_positives,
                      sampling_rates=args.sampling_rates,
                      num_workers=args.num_workers, skip_bad_records=args.skip_bad_records, cache_dir=args.cache_dir,
                      dev=dev)
    optim = OptimConfig(learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                        warmup_steps=args.warmup_steps or 0, warmup_ratio=args.warmup_ratio, epochs=args.epochs,
                        max_steps=args.max_steps,
                        max_grad_norm=args.max_grad_norm, precision=args.precision, symmetric=args.symmetric)
    cache = CacheConfig(enabled=args.grad_cache, query_chunk_size=args.query_chunk_size,
                        passage_chunk_size=args.passage_chunk_size, loss_chunk_size=args.loss_chunk_size)
    run = RunConfig(output_dir=args.output_dir, seed=args.seed, device=args.device, resume=args.resume,
                    eval_every=args.eval_every, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
                    best_metric=args.best_metric, fsdp=args.fsdp,
                    fsdp_cpu_offload=args.fsdp_cpu_offload)
    return TrainConfig(model=model, data=data, optim=optim, cache=cache, run=run)
