"""What a training run depends on, grouped by concern: the model, the data, the optimisation, Gradient Cache and the
run (output, seed, schedule of evaluations and checkpoints). Every setting is declared once, as a field made with
:func:`~dpr_gc.base.settings.setting` (type, default, help, flags with their GC-DPR aliases, and whether ``--resume``
may change it); each group checks its own fields when built, so a library caller gets the same one-line errors as
the command line, whose ``dpr-gc train`` flags are generated from the groups (:func:`add_train_arguments`,
:func:`config_from_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from ..base.args import (auto_or, closest, device_arg, home_expanded, nonnegative_float, nonnegative_int, output_dir,
                         positive_float, positive_int, proper_fraction, seed_int)
from ..base.errors import DprGcError
from ..base.files import read_json_object, write_json
from ..base.settings import FIXED, FREE, AppliesWhen, Change, add_arguments, changed_settings, check, from_args, group
from ..base.settings import cache_dir_setting, flag_values, refuse_flags_that_do_not_apply, setting, to_record
from ..engine.budget import parse_memory
from ..engine.loss import check_loss_chunk_size
from ..model.lora import LoraSettings
from ..model.retriever import RetrieverConfig
from .validation import DevLimits

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
SETTINGS_FILE = "train_config.json"  # the resolved settings of the run, in the output folder and each checkpoint
BEST_METRICS = ("avg_rank", "loss", "accuracy")
HIGHER_IS_BETTER = ("accuracy",)  # of BEST_METRICS; the others are better lower


chunk_arg = auto_or(positive_int)  # a chunk size flag: a positive integer or auto
workers_arg = auto_or(nonnegative_int)  # a --num-workers flag: an integer >= 0 or auto


def memory_arg(value: str) -> Union[int, str]:
    """A memory size flag: bytes with a unit (``12GB``, ``512MiB``) or ``auto`` (named where the word is close)."""
    try:
        return parse_memory(value)
    except DprGcError as e:
        hint = "; did you mean auto?" if closest(value.lower(), ["auto"]) else ""
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None


@dataclasses.dataclass
class ModelConfig:
    """The model: ``name`` is a Hugging Face model name or folder, a saved retriever, an official DPR pair or a DPR
    ``.cp`` file (None: the offline all-MiniLM-L6-v2); ``retriever`` sets up a new one (a saved one keeps its own
    settings, except prefixes given here)."""

    name: Optional[str] = setting(None, "--model", "--pretrained_model_cfg", dest="model", path=True,
                                  help="Hugging Face model name or folder, a saved retriever, an official DPR pair "
                                       "or a DPR .cp file (default: offline all-MiniLM-L6-v2)")
    retriever: Optional[RetrieverConfig] = group(
        RetrieverConfig, "retriever recipe", given="retriever_flags",
        shown="{} for a plain Hugging Face model, else the model's own",
        about="A plain Hugging Face model starts from the defaults below; a sentence-transformers folder, like the "
              "default model, brings its own recipe, which the flags given replace; a saved dpr-gc retriever keeps "
              "its own.")
    query_prefix: Optional[str] = setting(None, "--query-prefix",
                                          help="text put before every query, e.g. 'query: ' (default: the model's "
                                               "own, else none)")
    passage_prefix: Optional[str] = setting(None, "--passage-prefix",
                                            help="text put before every passage, e.g. 'passage: ' (default: the "
                                                 "model's own, else none)")
    gradient_checkpointing: bool = setting(False, "--gradient-checkpointing", resume=FREE,
                                           help="recompute activations in backward to save memory (same gradients)")
    freeze_position_embeddings: bool = setting(False, "--freeze-position-embeddings",
                                               help="keep the position-embedding table as loaded (refused for a "
                                                    "model without one, e.g. rotary)")
    lora: Optional[LoraSettings] = group(LoraSettings, "LoRA (only the adapters train in the transformers)",
                                         when="lora_r", off="LoRA is off: full fine-tuning", fix="add --lora-r N")

    # The ``retriever`` fields the user set (the flags given); a sentence-transformers folder supplies the others.
    # None: every field of ``retriever`` when it is given, the folder's recipe when it is None.
    retriever_flags: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        check(self)

    def path(self) -> str:
        """The model to start from (the offline default when none is named)."""
        from ..model.pretrained import default_model_path

        return self.name or default_model_path()


@dataclasses.dataclass
class DataConfig:
    """The data: sources, per-rank batch of queries, negatives per query, loading; ``dev`` bounds dev validation
    (DPR's ``val_av_rank_*``)."""

    train_files: list[str] = setting(None, "--train", "--train_file", dest="train_files", nargs="+", required=True,
                                     default_factory=list, path=True,
                                     help="DPR training files (.json/.jsonl[.gz]) or BEIR folders (qrels/train.tsv)")
    dev_file: Optional[str] = setting(None, "--dev", "--dev_file", dest="dev_file", path=True,
                                      help="DPR dev file, or BEIR folder (its --dev-beir-split qrels), for "
                                           "validation (default: none, no validation)")
    batch_size: int = setting(32, "--batch-size", "--batch_size", type=positive_int, help="queries per step and rank")
    hard_negatives: Optional[int] = setting(None, "--hard-negatives", "--hard_negatives", type=nonnegative_int,
                                            help="hard negatives per query (default: 0 when every --train source "
                                                 "is a BEIR folder, which has none: in-batch negatives only, as "
                                                 "sentence-transformers' MultipleNegativesRankingLoss; else 1, the "
                                                 "hard negatives of DPR files; on --resume the recorded value)")
    other_negatives: int = setting(0, "--other-negatives", "--other_negatives", type=nonnegative_int,
                                   help="other (random) negatives per query")
    shuffle_positives: bool = setting(False, "--shuffle-positives", "--shuffle_positive_ctx",
                                      help="draw a random positive per query (else the first)")
    beir_positives: str = setting("pairs", "--beir-positives", choices=("pairs", "sample"),
                                  help="BEIR folders: one example per (query, positive) qrels pair each epoch "
                                       "(pairs, as sentence-transformers), or one per query with a positive drawn "
                                       "each time (sample)")
    sampling_rates: Optional[list[float]] = setting(None, "--sampling-rates", type=positive_float, nargs="+",
                                                    help="per-source sampling rates (one per --train source; "
                                                         "default: every example once per epoch)")
    num_workers: Union[int, str] = setting("auto", "--num-workers", type=workers_arg, resume=FREE,
                                           help="DataLoader workers that tokenise ahead of the step (auto: 0 on the "
                                                "CPU, where they share the step's cores and add to its memory; 2 on "
                                                "a GPU)")
    skip_bad_records: bool = setting(False, "--skip-bad-records", resume=FREE,
                                     help="skip (and count) malformed training records instead of stopping")
    cache_dir: Optional[str] = cache_dir_setting("where parsed training data are cached, a BEIR folder's corpus "
                                                 "beside the training sets (default: $DPR_GC_CACHE/train and "
                                                 "$DPR_GC_CACHE/corpora, else ~/.cache/dpr_gc/train and "
                                                 "~/.cache/dpr_gc/corpora)")
    dev: DevLimits = group(DevLimits, "dev validation (DPR's val_av_rank_*)")

    def __post_init__(self) -> None:
        check(self)
        if self.num_workers != "auto" and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            raise DprGcError(f"--num-workers must be an integer >= 0 or 'auto', got {self.num_workers!r}")

    @property
    def passages_per_query(self) -> int:
        hard = self.default_hard_negatives() if self.hard_negatives is None else self.hard_negatives
        return 1 + hard + self.other_negatives

    def default_hard_negatives(self) -> int:
        """``hard_negatives`` when not given: 0 when every training source is a BEIR folder (no negatives, so each
        slot would hold another question's positive: the batch already has those), else 1 (DPR files carry BM25
        hard negatives)."""
        return 0 if self.train_files and all(Path(s).is_dir() for s in self.train_files) else 1

    def resolve_workers(self, device_type: str) -> int:
        """``num_workers``, with ``auto`` resolved for the device: 0 on the CPU, where workers share the step's cores
        and add to its memory (benchmarks/README.md, "DataLoader workers"), 2 on a GPU."""
        if self.num_workers != "auto":
            return int(self.num_workers)
        return 2 if device_type == "cuda" else 0


@dataclasses.dataclass
class OptimConfig:
    """The optimisation: AdamW, linear warm-up and decay, clipping, length, mixed precision, and the loss: the
    symmetric (passage-to-query) term and the duplicate-positive mask."""

    learning_rate: float = setting(2e-5, "--learning-rate", "--learning_rate", type=positive_float,
                                   help="AdamW peak learning rate")
    weight_decay: float = setting(0.0, "--weight-decay", "--weight_decay", type=nonnegative_float,
                                  help="AdamW weight decay (not on biases, normalisation weights or the "
                                       "temperature)")
    adam_eps: float = setting(1e-8, type=positive_float, help="AdamW epsilon")
    adam_betas: tuple[float, float] = setting((0.9, 0.999), type=proper_fraction, nargs=2, help="AdamW betas")
    warmup_steps: Optional[int] = setting(None, "--warmup-steps", "--warmup_steps", type=nonnegative_int,
                                          help="steps of linear learning-rate warm-up (default: 0, or "
                                               "--warmup-ratio)")
    warmup_ratio: Optional[float] = setting(None, "--warmup-ratio", type=nonnegative_float,
                                            help="warm-up as a fraction of all steps, rounded up (0.1: the first "
                                                 "10%), instead of --warmup-steps")
    epochs: int = setting(1, "--epochs", "--num_train_epochs", type=positive_int, resume=FREE,
                          help="passes over the training data")
    max_steps: Optional[int] = setting(None, "--max-steps", type=positive_int, resume=FREE,
                                       help="train this many steps, over as many epochs as that takes; "
                                            "given, it decides the length instead of --epochs (default: --epochs "
                                            "decides)")
    max_grad_norm: float = setting(2.0, "--max-grad-norm", "--max_grad_norm", type=positive_float,
                                   help="clip the gradient norm to this")
    precision: str = setting("fp32", "--precision", choices=PRECISIONS,
                             hidden=[("--fp16", {"action": "store_const", "const": "fp16"})],
                             help="autocast precision of the forward and backward passes")
    symmetric: bool = setting(False, "--symmetric", help="add the passage-to-query loss term")
    mask_duplicate_positives: bool = setting(True, "--mask-duplicate-positives", negatable=True,
                                             help="drop each in-batch score of a query against a copy of one of its "
                                                  "own positives (same passage id; title and text without one); "
                                                  "--no-mask-duplicate-positives scores them as negatives, as DPR "
                                                  "and GC-DPR do")

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: ``warmup_steps``, or ``ceil(warmup_ratio * total_steps)``
        (as Hugging Face's and sentence-transformers' trainers count it)."""
        if self.warmup_ratio is None:
            return self.warmup_steps or 0
        return math.ceil(self.warmup_ratio * total_steps)

    def __post_init__(self) -> None:
        check(self)
        if self.warmup_ratio is not None:
            if self.warmup_steps is not None:
                raise DprGcError("give --warmup-steps or --warmup-ratio, not both")
            if not 0 <= self.warmup_ratio < 1:
                raise DprGcError(f"--warmup-ratio must lie in [0, 1), got {self.warmup_ratio}")


@dataclasses.dataclass
class CacheConfig:
    """Gradient Cache: rows per chunk of queries and of passages (``auto`` probes the device), or plain full-batch
    training when ``enabled`` is False; ``loss_chunk_size`` is rows per block of the loss's score matrix;
    ``memory_budget`` is bytes of first-pass graphs kept instead of replayed (``"12GB"``, ``"auto"``; 0: only the
    last chunk's); ``*_chunk_tokens`` cap each chunk's tokens (rows times its longest sequence) instead of rows."""

    enabled: bool = setting(True, "--no-grad-cache", dest="grad_cache", resume=FREE,
                            hidden=[("--grad_cache", {"action": "store_true"})],
                            help="plain training without Gradient Cache (the baseline; same gradients)")
    query_chunk_size: Union[int, str] = setting("auto", "--query-chunk-size", "--q_chunk_size", type=chunk_arg,
                                                resume=FREE,
                                                help="queries per Gradient Cache chunk (auto: probe the device; "
                                                     "a non-zero --memory-budget joins chunks past it from step 2)")
    passage_chunk_size: Union[int, str] = setting("auto", "--passage-chunk-size", "--ctx_chunk_size",
                                                  type=chunk_arg, resume=FREE,
                                                  help="passages per Gradient Cache chunk (auto: probe the device; "
                                                       "a non-zero --memory-budget joins chunks past it from step 2)")
    loss_chunk_size: Optional[int] = setting(None, "--loss-chunk-size", type=nonnegative_int, resume=FREE,
                                             help="rows per block of the score matrix (0: the dense matrix; "
                                                  "default: automatic)")
    memory_budget: Union[int, str] = setting(0, "--memory-budget", type=memory_arg, resume=FREE,
                                             help="memory for first-pass graphs kept instead of replayed, e.g. "
                                                  "12GB, 512MiB, or auto (free GPU memory minus a margin; half the "
                                                  "available RAM on CPU, shared by the machine's ranks); 0: replay "
                                                  "all but the last chunk")
    query_chunk_tokens: Optional[int] = setting(None, "--query-chunk-tokens", type=positive_int, resume=FREE,
                                                help="tokens per query chunk (rows x longest sequence; rows at "
                                                     "most --query-chunk-size; a longer query runs alone; a "
                                                     "non-zero --memory-budget joins chunks past both from step 2)")
    passage_chunk_tokens: Optional[int] = setting(None, "--passage-chunk-tokens", type=positive_int,
                                                  resume=FREE, help="tokens per passage chunk (rows x longest "
                                                  "sequence; rows at most --passage-chunk-size; a longer passage "
                                                  "runs alone; a non-zero --memory-budget joins chunks past both "
                                                  "from step 2)")

    def __post_init__(self) -> None:
        self.memory_budget = parse_memory(self.memory_budget)
        for flag, value in (("--query-chunk-tokens", self.query_chunk_tokens),
                            ("--passage-chunk-tokens", self.passage_chunk_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DprGcError(f"{flag} must be a positive number of tokens, got {value!r}")
        for flag, value in (("--query-chunk-size", self.query_chunk_size),
                            ("--passage-chunk-size", self.passage_chunk_size)):
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise DprGcError(f"{flag} must be a positive integer or 'auto', got {value!r}")
        check(self)
        check_loss_chunk_size(self.loss_chunk_size)


@dataclasses.dataclass
class RunConfig:
    """The run: output folder, seed, device, resuming, and when it evaluates, logs and saves (``eval_per_epoch``
    is GC-DPR's: evaluate and save N times an epoch)."""

    output_dir: str = setting("", "--output", "--output_dir", type=output_dir, dest="output_dir", required=True,
                              resume=FREE, path=True, help="output folder")
    seed: int = setting(0, "--seed", type=seed_int, help="seed of initialisation, sampling and dropout")
    device: Optional[str] = setting(None, "--device", type=device_arg, resume=FREE,
                                    help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    resume: Optional[str] = setting(None, "--resume", type=home_expanded, resume=FREE,
                                    help="checkpoint folder, or 'latest' in --output; settings that change the "
                                         "model or the training signal must match the recorded run")
    eval_every: Optional[int] = setting(None, "--eval-every", type=positive_int, resume=FREE,
                                        help="steps between dev evaluations (default: with --dev, before training and at the end)")
    eval_per_epoch: Optional[int] = setting(None, type=positive_int, resume=FREE,
                                            help="dev evaluations and checkpoints per epoch (GC-DPR)")
    save_every: Optional[int] = setting(None, "--save-every", type=positive_int, resume=FREE,
                                        help="steps between checkpoints (default: at the end only)")
    keep_checkpoints: int = setting(2, "--keep-checkpoints", type=positive_int, resume=FREE,
                                    help="checkpoints kept (older ones are deleted)")
    best_metric: str = setting("avg_rank", "--best-metric", choices=BEST_METRICS,
                               help="dev metric that chooses best/")
    log_every: int = setting(1, type=positive_int, resume=FREE, help="steps between metrics.jsonl records")
    fsdp: bool = setting(False, "--fsdp",
                         help="under torchrun: shard the model over the ranks (FSDP2, one unit per transformer block)")
    fsdp_cpu_offload: bool = setting(False, "--fsdp-cpu-offload", resume=FREE,
                                     help="with --fsdp: keep parameters, gradients and optimizer state on the CPU "
                                          "between uses")

    def __post_init__(self) -> None:
        check(self)
        if self.fsdp_cpu_offload and not self.fsdp:
            raise DprGcError("--fsdp-cpu-offload needs --fsdp")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on, one group per concern, as ``dpr-gc train``'s flags are grouped.

    Args:
        model: the model trained (:class:`ModelConfig`; default: the offline all-MiniLM-L6-v2).
        data: training sources and batch (:class:`DataConfig`; ``train_files`` is required).
        optim: AdamW, schedule, precision and loss options (:class:`OptimConfig`).
        cache: Gradient Cache chunks and memory budget (:class:`CacheConfig`).
        run: output folder (required), seed, device, evaluation and checkpoints (:class:`RunConfig`).

    Every field is checked as its flag is, when the group is built; GC-DPR's flag names are the flags' aliases.
    :class:`~dpr_gc.train.trainer.Trainer` has an example.
    """

    model: ModelConfig = group(ModelConfig, "model")
    data: DataConfig = group(DataConfig, "data")
    optim: OptimConfig = group(OptimConfig, "optimisation")
    cache: CacheConfig = group(CacheConfig, "Gradient Cache")
    run: RunConfig = group(RunConfig, "run")

    def __post_init__(self) -> None:
        if self.run.fsdp and self.optim.precision not in ("fp32", "bf16"):
            raise DprGcError(f"--fsdp trains in --precision fp32 or bf16, not {self.optim.precision}")
        refuse_flags_that_do_not_apply(TrainConfig, flag_values(self), APPLIES)


PLAIN = AppliesWhen(lambda a: a.grad_cache, "to plain training (--no-grad-cache: one graph over the whole batch)",
                    "drop --no-grad-cache")
DEV = AppliesWhen(lambda a: a.dev_file is not None, "without --dev (there is no dev set to evaluate)",
                  "add --dev FILE")
BEIR_TRAIN = AppliesWhen(lambda a: not all(Path(f).is_file() for f in a.train_files),
                         "without a BEIR folder among --train (a DPR file's record is one example)",
                         "add a BEIR folder to --train")
BEIR_DEV = AppliesWhen(lambda a: a.dev_file is not None and not Path(a.dev_file).is_file(),
                       "without a BEIR folder as --dev (it names the folder's qrels split)", "give --dev a BEIR folder")
# When a setting takes effect, by flag destination: one set otherwise (to other than its default) is refused, in code
# and on the command line alike, as it would be ignored. --loss-chunk-size applies to plain training too;
# --eval_per_epoch also sets the checkpoints: it applies without --dev.
APPLIES = {**{dest: PLAIN for dest in ("query_chunk_size", "passage_chunk_size", "memory_budget", "query_chunk_tokens",
                                       "passage_chunk_tokens")},
           **{dest: DEV for dest in ("eval_every", "best_metric", "dev_max_questions", "dev_hard_negatives",
                                     "dev_other_negatives", "dev_batch_size", "dev_encode_batch_size")},
           "beir_positives": BEIR_TRAIN, "dev_beir_split": BEIR_DEV}


def add_train_arguments(p: argparse.ArgumentParser, resume_kinds: bool = True) -> None:
    """The ``dpr-gc train`` flags, generated from :class:`TrainConfig` (GC-DPR's flag names are accepted as
    aliases, see scripts/train_dense_encoder.py); with ``resume_kinds`` each help says whether ``--resume`` may
    change the setting."""
    add_arguments(p, TrainConfig, resume_kinds=resume_kinds)


def config_from_args(args: Any) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``dpr-gc train`` flags, each flag into its group."""
    return from_args(TrainConfig, args)


def record_settings(config: TrainConfig, folder: Union[str, Path]) -> Path:
    """Write the run's resolved settings (:func:`~dpr_gc.base.settings.to_record`) as ``folder/train_config.json``,
    atomically, its files and folders as absolute paths (so a resume from another folder compares the places);
    ``--resume`` compares them with its own."""
    path = Path(folder) / SETTINGS_FILE
    write_json(path, to_record(config, places=True))
    return path


def recorded_settings(checkpoint: Union[str, Path], output: Union[str, Path]) -> Optional[tuple[Path, dict]]:
    """The settings recorded by the run being resumed and their file (in the checkpoint, else in the output
    folder); None when no file records them (an older version)."""
    for folder in (Path(checkpoint), Path(output)):
        if (folder / SETTINGS_FILE).is_file():
            path = folder / SETTINGS_FILE
            return path, read_json_object(path, "recorded training settings")
    return None


def resolve_defaults(config: TrainConfig, recorded: Optional[Mapping[str, Any]] = None) -> tuple[TrainConfig, str]:
    """``config`` with the default that depends on the data resolved, and why it has its value (for the log).
    ``--hard-negatives`` not given is the value ``recorded`` by the run being resumed (so a run resumes as it
    started, one recorded by an earlier version included), else :meth:`DataConfig.default_hard_negatives`. The
    resolved value is what the run records, its model card states and ``--resume`` compares."""
    data = config.data
    if data.hard_negatives is not None:
        return config, "given"
    section = recorded.get("data") if isinstance(recorded, Mapping) else None
    old = section.get("hard_negatives") if isinstance(section, Mapping) else None
    if isinstance(old, int) and not isinstance(old, bool) and old >= 0:
        value, why = old, "not given: the value the resumed run recorded"
    else:
        value = data.default_hard_negatives()
        why = ("not given: every --train source is a BEIR folder, which has no negatives, so in-batch negatives "
               "only" if value == 0 else "not given: DPR training files carry hard negatives")
        why += "; give --hard-negatives N to choose"
    return dataclasses.replace(config, data=dataclasses.replace(data, hard_negatives=value)), why


def check_resume_settings(config: TrainConfig, checkpoint: Union[str, Path],
                          found: Optional[tuple[Path, dict]]) -> list[Change]:
    """Compare ``config`` with the settings recorded by the run being resumed (``found``: what
    :func:`recorded_settings` read for ``checkpoint``). A changed setting that changes the model or the training
    signal (:data:`FIXED`) is refused in one line naming each (old -> new); the others (steps, cadence, workers,
    logging, memory layout) are returned and logged. A run recorded by no file (an older version) is resumed as it
    is, with a warning."""
    if found is None:
        logger.warning("%s holds no %s (written by an older version): the settings of the resumed run are not "
                       "compared with these", checkpoint, SETTINGS_FILE)
        return []
    path, recorded = found
    return compare_recorded(config, recorded, path)


def compare_recorded(config: TrainConfig, recorded: Mapping[str, Any], where: Union[str, Path]) -> list[Change]:
    """:func:`check_resume_settings` against a record already read (``where``: its file, named in the error)."""
    changes = changed_settings(TrainConfig, recorded, to_record(config))
    fixed = _unique([c for c in changes if c.resume == FIXED])
    if fixed:
        raise DprGcError(f"--resume: {where} records a run with other settings that change the model or the "
                         f"training signal: {'; '.join(map(str, fixed))}; resume with the recorded values, or train "
                         "into a new --output")
    free = _unique([c for c in changes if c.resume == FREE and c.name not in ("--resume", "--output")])
    if free:
        logger.info("resuming with changed settings: %s", "; ".join(map(str, free)))
    return free


def _unique(changes: list[Change]) -> list[Change]:
    """One change per flag (an optional group appearing names its flag once)."""
    seen: dict[str, Change] = {}
    for change in changes:
        seen.setdefault(change.name, change)
    return list(seen.values())
