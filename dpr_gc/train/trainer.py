"""Train a DPR retriever with Gradient Cache: one process or several under ``torchrun`` (DDP).

The step: tokenised batches of B queries and B·(1+N+M) passages from :mod:`dpr_gc.data`, representations from
:class:`~dpr_gc.model.retriever.Retriever` (the temperature is applied inside its forward, so a learnable one is trained
and all-reduced like every other weight), the in-batch-negative loss from :mod:`dpr_gc.engine.loss` over the global
batch, and :class:`~dpr_gc.GradCache` to compute its exact gradient in chunk-sized memory (or one plain graph, for
comparison). Checkpoints hold everything needed to continue mid-epoch with the same result. The settings are grouped in
:mod:`dpr_gc.train.config`; checkpoints, RNG states, chunk sizes and the other pieces around the step live in the other
modules of :mod:`dpr_gc.train`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..data.corpus import source_files, source_fingerprint
from ..data.training import Collator, data_digest, load_training_data, make_dataloader
from ..base.devices import autocast_dtype, cpu_threads, warn_if_emulated
from ..base.errors import DprGcError, Interrupted, alike_on_every_rank
from ..base.logs import counted, infos_from_rank_zero, infos_hidden
from ..base.files import copied_from, remove_folder
from ..base.guard import guarded
from ..model.fsdp import clip_grad_norm, shard_retriever, unsharded_copy
from ..engine.budget import format_bytes
from ..engine.chunking import Chunking
from ..engine.grad_cache import GradCache
from ..model.card import card_training
from ..model.lora import apply_lora, has_adapters, resolve_lora, train_adapters
from ..engine.loss import DistributedContrastiveLoss, SimpleContrastiveLoss
from ..model.retriever import Retriever, enable_gradient_checkpointing, freeze_position_embeddings
from .config import TrainConfig, add_train_arguments, check_resume_settings, config_from_args, record_settings
from .config import SETTINGS_FILE, recorded_settings, resolve_defaults
from .checkpoints import Checkpointer, check_layout, check_start, finished_checkpoints, left_at_start
from .checkpoints import BEST, METRICS_FILE, TRAIN_MEMBERS, finite_or_null, remove_temporaries, resolve_checkpoint
from .chunks import auto_chunk_reason, auto_chunk_rows, auto_chunk_size, both_chunk_sizes, chunk_sizes
from .chunks import longest_row_tokens
from .distributed import Towers, every_rank, from_rank0, refused_together, same_on_every_rank, setup_distributed
from .report import (describe_epoch, describe_parallel, describe_precision, describe_training, epochs_done,
                     recorded_dev, recorded_lines, recorded_loss, summary_table, tensorboard_writer)
from .rng import capture_rng, gather_rng, restore_rng, seed_everything
from .setup import build_retriever, check_sources, resolve_recipe, resolve_recorded_recipe, weight_decay_groups
from .validation import dev_negatives, dev_pool, evaluate_dev, load_dev_data

logger = logging.getLogger(__name__)

# Under fp16 the GradScaler skips a step whose gradient overflowed and halves its scale; a run of more skips than
# this (the scale fell by 2**25) is divergence, not scale-finding.
MAX_SKIPPED_STEPS = 25
# what torch warns, once, when the first step the GradScaler skips (no optimizer.step()) is followed by
# scheduler.step(): the schedule advances every step, skipped or not, as torch's own AMP recipe does
SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
# the trainer's on_backward(step, retriever) hook, called once a step's gradients are complete
OnBackward = Optional[Callable[[int, Retriever], None]]


@dataclasses.dataclass
class SkippedSteps:
    """The steps fp16's GradScaler skipped (inf/NaN gradients: the weights stayed as they were): over the whole run
    (kept in checkpoints), the latest of them in a row (more than ``MAX_SKIPPED_STEPS`` is divergence), and this
    invocation's (its first is logged)."""

    total: int = 0
    in_a_row: int = 0
    this_run: int = 0


class TrainingDiverged(DprGcError):
    """The loss or the gradient norm stopped being finite; training stops without saving the broken weights."""


class Trainer:
    """One training run, one method per concern (the shape of DPR's ``BiEncoderTrainer``).

    The constructor builds the parts in order -- :meth:`build_model`, :meth:`build_data`, :meth:`build_loss`,
    :meth:`wrap_model`, :meth:`chunk_sizes`, :meth:`build_optimizer`, :meth:`build_scheduler`, :meth:`build_cache`
    (no :class:`GradCache` in plain training) -- and :meth:`fit` runs the loop: :meth:`resume` (or a fresh start),
    :meth:`train_step` per batch, :meth:`evaluate` on the dev set, :meth:`save` for checkpoints. ``on_backward(step,
    retriever)`` is called after each step's gradients are complete, before clipping and the optimizer step (used to
    compare gradients in tests).

    Args:
        config: the run's settings (:class:`~dpr_gc.train.config.TrainConfig`), as ``dpr-gc train``'s flags.
        on_backward: the hook above (None: none).
        started: the ``time.perf_counter()`` the summary's whole time counts from (None: this construction;
            ``dpr-gc train`` gives its own start).

    Returns:
        :meth:`fit` returns the run's summary dict (``steps``, ``final_loss``, ``final_model``, ``best_model``,
        ...), prints it as a table, and leaves ``final/`` (a retriever folder, :meth:`Retriever.load`), checkpoints
        and ``metrics.jsonl`` in ``config.run.output_dir``.

    References:
        DPR's ``train_dense_encoder.py`` (Karpukhin et al. 2020) and its Gradient Cache version in GC-DPR (Gao et
        al. 2021); ``dpr-gc train`` accepts GC-DPR's flag names as aliases.

    Example (one step of the offline all-MiniLM-L6-v2 on four questions, chunks of two):
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> from dpr_gc import Trainer, TrainConfig
        >>> from dpr_gc.train.config import CacheConfig, DataConfig, OptimConfig, RunConfig
        >>> work = Path(tempfile.mkdtemp())
        >>> records = [{"question": f"what is fact {i}?", "answers": [str(i)],
        ...             "positive_ctxs": [{"title": f"fact {i}", "text": f"fact {i} is the number {i}"}]}
        ...            for i in range(4)]
        >>> _ = (work / "train.json").write_text(json.dumps(records))
        >>> config = TrainConfig(data=DataConfig(train_files=[str(work / "train.json")], batch_size=4,
        ...                                      hard_negatives=0),
        ...                      optim=OptimConfig(max_steps=1),
        ...                      cache=CacheConfig(query_chunk_size=2, passage_chunk_size=2),
        ...                      run=RunConfig(output_dir=str(work / "run")))
        >>> summary = Trainer(config).fit()                     # prints the summary table
        | item | value |
        ...
        >>> summary["steps"], Path(summary["final_model"]).name
        (1, 'final')
    """

    def __init__(self, config: TrainConfig, on_backward: OnBackward = None, started: Optional[float] = None) -> None:
        self.began = time.perf_counter() if started is None else started  # the summary's time counts from here
        self.config, self.on_backward = config, on_backward
        self.owns_group = not dist.is_initialized()
        self.rank, self.world, self.device = setup_distributed(config.run.device)
        self.owns_group = self.owns_group and dist.is_initialized()
        # after joining the group: a rank refusing alone would leave other machines' ranks waiting to join
        refused_together(lambda: check_sources(config.data, config.run.output_dir))
        seed_everything(config.run.seed)
        self.out = Path(config.run.output_dir)
        check_start(self.out, config.run.resume, self.inputs())  # before minutes of loading the model and the data
        checkpoint = resolve_checkpoint(self.out, config.run.resume) if config.run.resume else None
        recorded = recorded_settings(checkpoint, self.out) if checkpoint else None
        recorded = (recorded[0], resolve_recorded_recipe(recorded[1], checkpoint)) if recorded else None
        self.hard_negatives_given = config.data.hard_negatives is not None
        self.config = config = self.resolve(config, recorded[1] if recorded else None)
        if checkpoint:
            self.check_resume(checkpoint, recorded)
        check_fsdp_launch(config, self.world, self.device)  # the launch and the device alone: before the model loads
        self.retriever = self.build_model()
        self.workers = config.data.resolve_workers(self.device.type)
        # rank 0 reads the training files for their fingerprints (the parse cache's key, the resume check's record)
        self.data_files = from_rank0(lambda: [{"source": copied_from(f) or str(f), "files": source_files(f)}
                                              for f in config.data.train_files])
        self.data_fingerprints = [source_fingerprint(f["source"], files=f["files"]) for f in self.data_files]
        self.data, self.collator, self.loader = self.build_data()
        same_on_every_rank(data_digest(self.data), "the training data (--train)",
                           "give every rank the same files (a copy on each machine must be byte for byte the same)")
        # parsed now, so a bad dev file is refused here, and kept: each evaluation reuses it (loaded and logged once)
        self.dev_data = (load_dev_data(config.data.dev_file, config.data.cache_dir, config.data.dev.beir_split)
                         if config.data.dev_file else None)
        self.sampler = self.loader.batch_sampler
        self.sampler.data_fingerprints, self.sampler.data_files = self.data_fingerprints, self.data_files
        self.steps_per_epoch = self.sampler.batches_per_epoch
        self.total_steps = config.optim.max_steps or self.steps_per_epoch * config.optim.epochs
        self.eval_every, self.save_every = self.schedule()
        self.passages_per_query = config.data.passages_per_query
        self.effective_batch = config.data.batch_size * self.world
        self.loss_fn = self.build_loss()
        self.towers, self.model = self.wrap_model()
        self.chunks = self.chunk_sizes() if config.cache.enabled else None
        self.params, self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.optim.precision == "fp16")
        self.cache = self.build_cache()
        self.checkpointer = Checkpointer(self.out, config.run.keep_checkpoints, config.run.best_metric,
                                         self.rank == 0, self.retriever if config.run.fsdp else None)
        self.checkpointer.settings = lambda folder: record_settings(config, folder)
        self.metrics_file = self.out / METRICS_FILE
        self.step, self.epoch, self.examples, self.last_loss = 0, 0, 0, float("nan")
        self.resumed_from: Optional[int] = None  # the step of the checkpoint resumed (None: a fresh run)
        self.last_dev: Optional[dict] = None  # this run's latest dev evaluation after a step: {"step", "dev_...": ..}
        self.skipped, self.step_skipped = SkippedSteps(), False  # fp16 steps the GradScaler skipped; the last step
        self.noted_limits: set[str] = set()  # sides whose chunk token limit was said to be below a row's length
        self.step_lr = float("nan")  # the learning rate the last step used (the scheduler has moved on since)
        self.started, self.board, self.bar = time.perf_counter(), None, None
        self.validated = self.validated_before = 0.0  # seconds of dev validation: this invocation's, before the loop
        self.created_out = not self.out.exists()  # a fresh run refused before its first step removes it again
        if self.rank == 0:  # only once the model and data are checked: a refused run leaves nothing in --output
            self.out.mkdir(parents=True, exist_ok=True)

    def inputs(self) -> dict[str, Any]:
        """The run's inputs by flag (the model, the training and dev data), which it never removes."""
        data = self.config.data
        return {"--model": self.config.model.name, "--train": data.train_files, "--dev": data.dev_file}

    # ----------------------------------------------------------------- building
    def resolve(self, config: TrainConfig, recorded: Optional[dict]) -> TrainConfig:
        """``config`` with its data-dependent default resolved (:func:`resolve_defaults`; ``recorded``: the
        settings of the run being resumed), saying so when a default was taken, a sentence-transformers folder's
        recipe put in (:func:`resolve_recipe`) and a saved adapter's LoRA settings (:func:`resolve_lora`): what the
        run records and ``--resume`` compares."""
        config, why = resolve_defaults(config, recorded)
        model = resolve_recipe(config.model, warn=self.rank == 0)
        model = dataclasses.replace(model, lora=resolve_lora(model.path(), model.lora))
        config = dataclasses.replace(config, model=model)
        if self.rank == 0 and not self.hard_negatives_given:
            logger.info("--hard-negatives %d (%s)", config.data.hard_negatives, why)
        return config

    def check_resume(self, checkpoint: Path, recorded: Optional[tuple[Path, dict]]) -> None:
        """Before minutes of loading the model and parsing the data: the settings that change the model or the
        training signal are those the resumed run ``recorded`` (:func:`recorded_settings`), and ``checkpoint`` was
        written with this run's ``--fsdp`` (checked before the ranks are, so one process refuses as every rank of a
        launch would)."""
        check_resume_settings(self.config, checkpoint, recorded)
        check_layout(checkpoint, self.config.run.fsdp)

    def build_model(self) -> Retriever:
        """The retriever in training mode on this rank's device, with LoRA adapters (only they train in the
        transformers), gradient checkpointing or frozen position embeddings when asked."""
        beside = [("hard_negatives", self.config.data.hard_negatives, self.hard_negatives_given)]
        retriever = build_retriever(self.config.model, beside).to(self.device)
        if self.config.model.lora is not None:
            apply_lora(retriever, self.config.model.lora)
        elif has_adapters(retriever):  # a saved LoRA retriever trains its adapter further, as with --lora-r
            train_adapters(retriever)
        retriever.train()
        if self.config.model.gradient_checkpointing:
            enable_gradient_checkpointing(retriever)
            logger.info("gradient checkpointing: activations are recomputed in the backward pass")
        if self.config.model.freeze_position_embeddings:
            frozen = freeze_position_embeddings(retriever)
            if not frozen:
                model = self.config.model.name or "the model"
                raise DprGcError(f"--freeze-position-embeddings: {model} has no position-embedding weights (its "
                                 "positions are computed, e.g. rotary); drop the flag")
            logger.info("froze %d position-embedding weights", frozen)
        return retriever

    def build_data(self) -> tuple[Any, Collator, torch.utils.data.DataLoader]:
        """The parsed training sources, the collator that tokenises them, and this rank's DataLoader."""
        config = self.config.data
        data = load_training_data(config.train_files, config.cache_dir, config.skip_bad_records,
                                  fingerprints=self.data_fingerprints)
        collator = Collator(self.retriever.tokenizer, self.retriever.config,  # lengths at most the model's positions
                            query_max_length=self.retriever.max_length("query"),
                            passage_max_length=self.retriever.max_length("passage"))
        loader = make_dataloader(data, collator, batch_size=config.batch_size, hard_negatives=config.hard_negatives,
                                 other_negatives=config.other_negatives, shuffle_positives=config.shuffle_positives,
                                 rates=config.sampling_rates, seed=self.config.run.seed, rank=self.rank,
                                 world_size=self.world, num_workers=self.workers,
                                 pin_memory=self.device.type == "cuda", beir_positives=config.beir_positives)
        if self.rank == 0:
            logger.info(describe_epoch(data, loader.batch_sampler, config.beir_positives))
        return data, collator, loader

    def schedule(self) -> tuple[Optional[int], Optional[int]]:
        """Steps between dev evaluations and between checkpoints (GC-DPR's ``--eval_per_epoch`` evaluates and saves
        N times an epoch, every ceil(steps per epoch / N) steps). The log line says how many happen an epoch, which
        that rounding can make fewer than N (3 asked of 4 steps: every 2 steps, twice)."""
        run = self.config.run
        eval_every, save_every = run.eval_every, run.save_every
        if run.eval_per_epoch:
            eval_every = max(1, -(-self.steps_per_epoch // run.eval_per_epoch))
            save_every = save_every or eval_every
            fewest, most = self.steps_per_epoch // eval_every, -(-self.steps_per_epoch // eval_every)
            count = f"{fewest}" if fewest == most else f"{fewest} to {most}"
            many = most > 1
            what = (f"{count} dev evaluation{'s' if many else ''} and checkpoint{'s' if many else ''}"
                    if self.config.data.dev_file else
                    f"{count} checkpoint{'s' if many else ''} (no --dev_file: nothing to evaluate)")
            asked = "" if fewest == most == run.eval_per_epoch else f" (--eval_per_epoch {run.eval_per_epoch})"
            logger.info("%s per epoch: every %s%s", what, counted(eval_every, "step"), asked)
        return eval_every, save_every

    def build_loss(self) -> SimpleContrastiveLoss:
        """In-batch-negative InfoNCE, over the global batch of every rank under torchrun."""
        loss_cls = DistributedContrastiveLoss if self.world > 1 else SimpleContrastiveLoss
        return loss_cls(self.passages_per_query - 1, symmetric=self.config.optim.symmetric,
                        loss_chunk_size=self.config.cache.loss_chunk_size)

    def wrap_model(self) -> tuple[Towers, nn.Module]:
        """The towers module, and what the step calls: the towers themselves or their DDP wrapper. Under ``--fsdp``
        the retriever is sharded in place (it is the FSDP root, so Gradient Cache and dev validation call it
        directly) and the towers hold it for plain training."""
        towers = Towers(self.retriever)
        if self.config.run.fsdp:
            shard_retriever(self.retriever, self.config.optim.precision, self.config.run.fsdp_cpu_offload)
            return towers, towers
        if self.world == 1:
            return towers, towers
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return towers, DistributedDataParallel(towers, device_ids=device_ids,
                                               find_unused_parameters=not self.retriever.config.shared_encoder)

    def chunk_sizes(self) -> tuple[int, int]:
        """Gradient Cache's query and passage chunk sizes (``auto`` probes the device; under DDP/FSDP with a memory
        budget at most half the per-rank rows: :func:`auto_chunk_rows`), checked against the batch."""
        batch_size, cache = self.config.data.batch_size, self.config.cache
        passages = batch_size * self.passages_per_query
        keep_before_last = self.world > 1 and cache.memory_budget != 0
        q_chunk, p_chunk = cache.query_chunk_size, cache.passage_chunk_size
        if cache.query_chunk_tokens is not None and q_chunk == "auto":
            q_chunk = auto_chunk_rows(batch_size, batch_size, keep_before_last)  # the token limit sizes the chunks
        if cache.passage_chunk_tokens is not None and p_chunk == "auto":
            p_chunk = auto_chunk_rows(passages, passages, keep_before_last)
        if "auto" in (q_chunk, p_chunk):
            auto = auto_chunk_size(self.towers, self.collator, self.device,
                                   auto_chunk_rows(passages, passages, keep_before_last), self.config.optim.precision)
            q_chunk = auto_chunk_rows(auto, batch_size, keep_before_last) if q_chunk == "auto" else q_chunk
            p_chunk = auto_chunk_rows(auto, passages, keep_before_last) if p_chunk == "auto" else p_chunk
            parallel = ("FSDP2" if self.config.run.fsdp else "DDP") if self.world > 1 else ""
            logger.info("auto chunk size: query %s, passage %s (%s)", q_chunk, p_chunk,
                        auto_chunk_reason(self.device.type == "cuda", parallel, keep_before_last))
        if q_chunk > batch_size:
            raise DprGcError(f"--query-chunk-size {q_chunk} is larger than --batch-size {batch_size}: "
                             "use a chunk of at most the batch (or --no-grad-cache)")
        if p_chunk > passages:
            raise DprGcError(f"--passage-chunk-size {p_chunk} is larger than the {passages} passages of a batch: "
                             "use a chunk of at most that (or --no-grad-cache)")
        return int(q_chunk), int(p_chunk)

    def build_optimizer(self) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        """The trainable parameters and AdamW over them, without weight decay on biases, normalisation weights and
        the temperature (:func:`weight_decay_groups`)."""
        optim = self.config.optim
        optimizer = torch.optim.AdamW(weight_decay_groups(self.towers, optim.weight_decay), lr=optim.learning_rate,
                                      eps=optim.adam_eps, betas=tuple(optim.adam_betas))
        return [p for p in self.towers.parameters() if p.requires_grad], optimizer

    def build_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warm-up to the learning rate, then linear decay to zero at the last step."""
        warmup, total = self.config.optim.warmup_for(self.total_steps), self.total_steps
        if self.config.optim.warmup_ratio is not None:
            logger.info("--warmup-ratio %g of %s: %s", self.config.optim.warmup_ratio, counted(total, "step"),
                        counted(warmup, "warm-up step"))
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min((s + 1) / max(1, warmup), max(0.0, (total - s) / max(1, total - warmup))))

    def build_cache(self, model: Optional[nn.Module] = None) -> Optional[GradCache]:
        """Gradient Cache over ``model``, by default the (possibly DDP-wrapped) towers; None in plain training."""
        if self.chunks is None:
            return None
        precision = self.config.optim.precision
        model = model if model is not None else self.retriever if self.config.run.fsdp else self.model
        cache = self.config.cache
        return GradCache([model, model], list(self.chunks), self.loss_fn, fp16=precision == "fp16",
                         scaler=self.scaler, bf16=precision == "bf16", memory_budget=cache.memory_budget,
                         chunking=Chunking(sort_by_length=True,
                                           tokens=[cache.query_chunk_tokens, cache.passage_chunk_tokens]))

    # ----------------------------------------------------------------- state
    def start_fresh(self) -> None:
        """A new run: refuse a folder that holds checkpoints or an earlier run's final/ or best/ (checked again: the
        constructor checked before loading), and clear an old metrics file and the starting model that a run
        stopped before its first checkpoint left in best/."""
        check_start(self.out, None, self.inputs())
        if self.rank == 0:
            self.metrics_file.unlink(missing_ok=True)
            if left_at_start(self.out):
                remove_folder(self.out / BEST)

    def resume(self, checkpoint: str) -> None:
        """Continue from a checkpoint folder (or ``latest``): weights, optimizer, schedule, scaler, the sampler's
        place in its epoch and this rank's RNG state, so the run goes on exactly as if never stopped. Settings that
        change the model or the training signal were checked against the run's record by :meth:`check_resume`."""
        state = self.checkpointer.load(checkpoint, self.retriever, self.optimizer, self.scheduler, self.scaler,
                                       self.device)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.epoch = state["step"], state["sampler"]["epoch"]
        self.resumed_from = self.step
        self.follow_schedule()
        restore_rng(state["rng"][self.rank] if isinstance(state["rng"], list) else state["rng"])
        self.restore_cache(state.get("grad_cache"))
        self.skipped = SkippedSteps(state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0))
        logger.info("resumed from step %d (epoch %d, %d batches into it)", self.step, self.epoch,
                    state["sampler"]["batches_done"])

    def restore_cache(self, saved: Any) -> None:
        """Give Gradient Cache what it learnt before the checkpoint (bytes per token, graph sizes), so the resumed
        steps join chunks and keep graphs as the uninterrupted run did (a checkpoint from before it was saved, or of
        plain training, has none: the next step measures afresh)."""
        if self.cache is None or saved is None:
            return
        try:
            self.cache.load_state_dict(saved[self.rank] if isinstance(saved, list) else saved)
        except (DprGcError, IndexError) as e:
            raise DprGcError(f"--resume {self.config.run.resume}: the checkpoint's Gradient Cache state does not fit "
                             f"this run ({e}); resume from another checkpoint") from None

    def follow_schedule(self) -> None:
        """Give the optimizer this run's scheduled rate for the next step. The checkpoint restored the rate of the
        schedule it was saved with; a resume that changes the length (``--max-steps``, ``--epochs``, hence a
        ``--warmup-ratio``'s warm-up) has another, and an extended run's next step ran at the old one's end, 0.0."""
        scheduler = self.scheduler
        rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() reports; torch keeps it only there

    def save(self, record: dict, done_in_epoch: int, rng: dict) -> None:
        """Write ``checkpoint-STEP/`` with everything :meth:`resume` needs (``rng``: the state after this step)."""
        cache = every_rank(self.cache.state_dict(), self.world) if self.cache is not None else None
        self.checkpointer.save(self.step, self.retriever, self.optimizer, self.scheduler, self.scaler,
                               self.sampler.state_dict(done_in_epoch), gather_rng(rng, self.world), record, cache,
                               skipped=(self.skipped.total, self.skipped.in_a_row))

    def export(self) -> Optional[Retriever]:
        """The retriever to save, on rank 0 (None elsewhere): the trained one, or under ``--fsdp`` an unsharded
        copy gathered from every rank (so all ranks must call this)."""
        if not self.config.run.fsdp:
            return self.retriever if self.rank == 0 else None
        def build() -> Retriever:
            copy = build_retriever(self.config.model, quiet=True)  # the start-up log said its recipe
            if self.config.model.lora is not None:
                with infos_hidden(logging.getLogger(apply_lora.__module__)):  # said once, at the start
                    apply_lora(copy, self.config.model.lora)
            copy.training_info = self.retriever.training_info
            return copy

        return unsharded_copy(self.retriever, build, self.rank == 0)

    # ----------------------------------------------------------------- the step
    def train_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on one batch: the gradient (cached, or one plain graph), clipping, AdamW and the
        schedule; returns the detached loss and the gradient norm before clipping."""
        query, passage = dict(batch["query"]), dict(batch["passage"])
        ids = self.loss_ids(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.retriever.tau.keep_in_range_()  # past a bound its gradient would depend on the chunking
        if self.cache is not None:
            self.note_token_limits(query, passage)
            loss = self.cache(dict(query, kind="query"), dict(passage, kind="passage"),
                              no_sync_except_last=self.world > 1, **ids)
        else:
            loss = self.plain_backward(query, passage, ids)
        if self.cache is not None and self.step == (self.resumed_from or 0) and self.rank == 0:
            self.log_chunking()  # the first step of each run, a resumed one's too
        if self.on_backward is not None:
            self.on_backward(self.step, self.retriever)
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        self.check_finite(loss, grad_norm)
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # before the scheduler sets the next step's
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.count_skipped(scale)
        with warnings.catch_warnings():  # a skipped first step called no optimizer.step(), which torch warns of
            warnings.filterwarnings("ignore", SCHEDULER_ORDER_WARNING, UserWarning)
            self.scheduler.step()
        return loss, grad_norm

    def count_skipped(self, scale: float) -> None:
        """Count the step as skipped when fp16's GradScaler lowered its loss ``scale`` (it found inf/NaN gradients and
        left the weights as they were); this invocation's first skip is logged."""
        self.step_skipped = self.scaler.is_enabled() and self.scaler.get_scale() < scale
        if not self.step_skipped:
            return
        self.skipped.total, self.skipped.this_run = self.skipped.total + 1, self.skipped.this_run + 1
        if self.skipped.this_run == 1 and self.rank == 0:
            logger.info("step %d skipped by fp16's GradScaler: inf/NaN gradients at loss scale %g; it lowers the "
                        "scale and goes on (metrics.jsonl marks each skipped step, the summary counts them)",
                        self.step + 1, scale)

    def loss_ids(self, batch: dict) -> dict[str, torch.Tensor]:
        """The batch's passage and positive ids, by which the loss drops a query's other positives from its
        negatives (none under ``--no-mask-duplicate-positives``: DPR's unmasked loss)."""
        if not self.config.optim.mask_duplicate_positives:
            return {}
        return {k: batch[k] for k in ("passage_ids", "positive_ids") if k in batch}

    def all_ranks(self, flag: bool) -> bool:
        """``flag`` on every rank (so all ranks take the same decision)."""
        if self.world == 1:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value)

    def check_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Stop before the optimizer step on a non-finite loss or gradient norm (fp32, bf16), or after more than
        ``MAX_SKIPPED_STEPS`` consecutive steps the fp16 GradScaler skipped (it skips the odd overflow by design)."""
        finite = self.all_ranks(bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm)))
        if finite:
            self.skipped.in_a_row = 0
            return
        what = f"loss {float(loss):.4g}, gradient norm {float(grad_norm):.4g}"
        if not self.scaler.is_enabled():
            raise self.diverged(f"{what} ({self.config.optim.precision})")
        self.skipped.in_a_row += 1
        if self.skipped.in_a_row > MAX_SKIPPED_STEPS:
            raise self.diverged(f"{what}; the fp16 GradScaler skipped {self.skipped.in_a_row} steps in a row")

    def diverged(self, what: str) -> TrainingDiverged:
        """The error naming the step and the last checkpoint written (whose weights were finite)."""
        found = self.checkpointer.checkpoints()
        last = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was written"
        return TrainingDiverged(f"training diverged at step {self.step + 1}: {what}; stopped without saving "
                                f"final/ or best/; {last}")

    def check_finite_weights(self) -> None:
        """Refuse to save non-finite weights (checked on every rank's part)."""
        local = all(bool(torch.isfinite(getattr(p, "_local_tensor", p).detach()).all()) for p in self.params)
        if not self.all_ranks(local):
            raise self.diverged("the weights are not finite")

    def note_token_limits(self, query: dict, passage: dict) -> None:
        """Say once per run and side where ``--*-chunk-tokens`` is below the longest row of a step's batch: such a
        row cannot share a chunk, so each runs alone (slower), which the chunk sizes logged do not show."""
        cache = self.config.cache
        for side, batch, limit in (("query", query, cache.query_chunk_tokens),
                                   ("passage", passage, cache.passage_chunk_tokens)):
            if limit is None or side in self.noted_limits:
                continue
            longest = longest_row_tokens(self.cache.models[0], dict(batch, kind=side), self.cache.chunking.trim)
            if longest is not None and longest > limit:
                self.noted_limits.add(side)
                logger.info("--%s-chunk-tokens %d is below the longest %s (%s) of step %d's batch: such %s run one "
                            "per chunk", side, limit, side, counted(longest, "token"), self.step + 1,
                            "queries" if side == "query" else "passages")

    def log_chunking(self) -> None:
        """Say what the first cached step chose and measured: chunking, the share of graphs kept under the memory
        budget, and the peak graph memory (plus the device's peak allocation on CUDA)."""
        report, cache = self.cache.last_step, self.config.cache
        sides = [f"{name} {chunk_sizes(rows, tokens)} ({n} this step)"
                 for name, rows, tokens, n in zip(("query", "passage"), self.chunks,
                                                  (cache.query_chunk_tokens, cache.passage_chunk_tokens),
                                                  report.chunks)]
        peak = (f", device peak {format_bytes(torch.cuda.max_memory_allocated(self.device))}"
                if self.device.type == "cuda" else "")
        budget = f"auto ({report.auto})" if cache.memory_budget == "auto" else format_bytes(cache.memory_budget)
        logger.info("Gradient Cache: %s; memory budget %s: %s%s", ", ".join(sides), budget, report.describe(), peak)
        self.retriever.training_info["grad_cache_first_step"] = {
            "chunks": report.chunks, "kept": report.kept, "kept_token_share": report.kept_share,
            "budget_bytes": report.budget, "kept_bytes": report.kept_bytes, "largest_graph_bytes": report.largest_graph,
            "peak_graph_bytes": report.peak_graph_bytes}

    def clip_gradients(self) -> torch.Tensor:
        """Clip the global gradient norm of the trainable parameters to ``optim.max_grad_norm``; returns the norm
        before clipping."""
        if self.config.run.fsdp:
            return clip_grad_norm(self.params, self.config.optim.max_grad_norm)
        return torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.max_grad_norm)

    def plain_backward(self, query: dict, passage: dict, ids: dict) -> torch.Tensor:
        """The full-batch gradient in one graph (no Gradient Cache): the baseline that Gradient Cache must equal."""
        query = {k: v.to(self.device) for k, v in query.items()}
        passage = {k: v.to(self.device) for k, v in passage.items()}
        dtype = autocast_dtype(self.config.optim.precision)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            q, p = self.model(query=query, passage=passage)
        loss = self.loss_fn(q, p, **ids)  # the loss raises fp16/bf16 to fp32 itself
        self.scaler.scale(loss).backward()
        return loss.detach()

    def evaluate(self) -> dict:
        """Dev validation (DPR's in-batch loss and accuracy over the gold passages plus each question's first
        ``--hard-negatives`` and ``--other-negatives``, and average rank) as ``dev_*`` metrics. A sharded model runs
        the same forwards on every rank (each all-gathers its blocks), so each rank evaluates the whole set."""
        config, started = self.config, time.perf_counter()
        pool = dev_pool(self.dev_data, config.data.dev, dev_negatives(config.data))
        logger.info("dev validation over %s and %s", counted(len(pool.gold), "question"),
                    counted(pool.ranked, "passage"))  # before the work, which its bar (rank 0's) then shows
        metrics = evaluate_dev(self.retriever, pool, config.data.dev, config.data.cache_dir,
                               split_over_ranks=not config.run.fsdp, show_progress=self.rank == 0)
        del metrics["questions"], metrics["passages"]
        self.retriever.train()
        self.validated += time.perf_counter() - started
        return {f"dev_{k}": v for k, v in metrics.items()}

    # ----------------------------------------------------------------- the loop
    def fit(self) -> dict:
        """Train to the last step (continuing ``config.run.resume`` when given); returns the run's summary. A fresh
        run refused before its first step (the first batch's negatives cannot be found, on any rank:
        :meth:`first_batch`) leaves --output as it found it (:meth:`discard_refused_start`)."""
        try:
            return self.fit_steps()
        except TrainingDiverged:
            raise
        except DprGcError:
            self.discard_refused_start()
            raise

    def discard_refused_start(self) -> None:
        """Remove what a fresh run wrote before it was refused at its first step: the output folder it created, else
        the settings record and metrics file it wrote into the folder it found (docs/formats.md: a refused train
        leaves no output folder)."""
        if self.rank != 0 or self.config.run.resume or self.step > 0:
            return
        if self.created_out:
            shutil.rmtree(self.out, ignore_errors=True)
        else:
            (self.out / SETTINGS_FILE).unlink(missing_ok=True)
            self.metrics_file.unlink(missing_ok=True)

    def fit_steps(self) -> dict:
        """:meth:`fit`'s work: start or resume (removing what a killed run left half-written), evaluate the starting
        model, train, finish."""
        if self.config.run.resume:
            self.resume(self.config.run.resume)
        else:
            self.start_fresh()
        if self.rank == 0:
            remove_temporaries(self.out)
        if self.config.run.resume and self.step >= self.total_steps:
            return self.already_finished()
        if self.rank == 0:
            record_settings(self.config, self.out)
        self.describe_run()
        self.announce()
        if self.config.data.dev_file and self.step == 0:
            initial = {"step": 0, **self.evaluate()}
            self.checkpointer.log(self.metrics_file, initial)
            logger.info("dev before training: %s", {k: round(v, 4) for k, v in initial.items()})
            before = finite_or_null({k: v for k, v in initial.items() if k != "step"})
            self.retriever.training_info.update(dev_metrics=before, dev_metrics_step=0)
            self.checkpointer.update_best(0, self.export, initial)  # the baseline: a step must beat it
        purge = None if self.resumed_from is None else self.resumed_from + 1  # the steps it logs again
        self.board = tensorboard_writer(self.out, purge) if self.rank == 0 else None
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=self.rank != 0, desc="train", unit=" steps",
                        dynamic_ncols=True)
        self.started, self.validated_before = time.perf_counter(), self.validated
        try:
            with logging_redirect_tqdm():  # a line logged mid-run goes above the bar, not onto its line
                while self.step < self.total_steps:
                    self.train_epoch()
                    self.epoch += 1
        except TrainingDiverged:
            self.close()  # every rank took the same decision, so the group can be torn down in order
            raise
        finally:
            self.bar.close()
            if self.board is not None:
                self.board.close()
        summary = self.finish()
        self.close()
        return summary

    def describe_run(self) -> None:
        """Put the run's account (data, batch, chunks, steps done) into the model's ``training_info``: its card."""
        self.retriever.training_info.update(describe_training(self.config, self.data.stats, self.world,
                                                              self.chunks, self.total_steps))
        self.record_steps()

    def record_steps(self) -> None:
        """Put the steps done and the epochs they make into the model's ``training_info`` (its card)."""
        self.retriever.training_info.update(steps=self.step, epochs=epochs_done(self.step, self.steps_per_epoch))

    def announce_length(self) -> None:
        """Say that ``--max-steps`` sets the run's length (``--epochs`` then counts for nothing), and warn of a
        warm-up that the run never finishes (the rate never reaches ``--learning-rate``)."""
        optim, total = self.config.optim, self.total_steps
        if optim.max_steps is not None:
            logger.info("--max-steps %d: %.3g epochs of %s each (--max-steps decides the run's length, not --epochs)",
                        total, total / self.steps_per_epoch, counted(self.steps_per_epoch, "step"))
        warmup = optim.warmup_for(total)
        if optim.warmup_ratio is None and warmup > total:
            logger.warning("--warmup-steps %d is longer than the run's %s: the learning rate never reaches "
                           "--learning-rate %g (the last step runs at %g)", warmup, counted(total, "step"),
                           optim.learning_rate, optim.learning_rate * total / warmup)

    def announce(self) -> None:
        """Log what the run trains: its steps (a resumed run's, those after its checkpoint), batch, chunks,
        precision, device and workers."""
        if self.rank == 0:
            config, total = self.config, self.total_steps
            steps = (counted(total, "step") if not self.step else f"step {total} of {total}" if self.step + 1 == total
                     else f"steps {self.step + 1}-{total} of {total}")
            ranks = counted(self.world, "rank") + (" (FSDP2)" if config.run.fsdp else "")
            logger.info("training %s: batch %d per rank x %s = %s, %s per query, %s, %s on %s, %s%s%s",
                        steps, config.data.batch_size, ranks,
                        counted(self.effective_batch, "query", "queries"), counted(self.passages_per_query, "passage"),
                        f"Gradient Cache {both_chunk_sizes(self.chunks, self.chunk_tokens(), ' and ')}"
                        if self.chunks else "plain training",
                        describe_precision(config.run.fsdp, config.optim.precision), self.device,
                        counted(self.workers, "DataLoader worker"),
                        " (auto)" if config.data.num_workers == "auto" else "", cpu_threads(self.device))
            warn_if_emulated(config.optim.precision, self.device)
            self.announce_length()
            if not config.optim.mask_duplicate_positives:
                logger.info("--no-mask-duplicate-positives: a copy of a query's own positive elsewhere in the batch "
                            "scores as one of its negatives (DPR's and GC-DPR's loss)")

    def train_epoch(self) -> None:
        """The rest of the current epoch (all of it, unless resumed inside it), stopping at the last step."""
        self.sampler.set_epoch(self.epoch)
        done_in_epoch = self.steps_per_epoch - len(self.sampler)
        batches = iter(self.loader)
        if self.step == 0:
            batches = itertools.chain(self.first_batch(batches), batches)
        for batch in batches:
            loss, grad_norm = self.train_step(batch)
            self.step, done_in_epoch = self.step + 1, done_in_epoch + 1
            self.examples += self.effective_batch
            self.after_step(self.record(loss, grad_norm), done_in_epoch)
            if self.step >= self.total_steps:
                break

    def first_batch(self, batches: Iterator[dict]) -> list[dict]:
        """The run's first batch (none where the epoch has none), drawn on every rank before the first step's
        collectives. A refusal while drawing it (a negative that cannot be found) is shared: every rank raises it, as
        at start-up (:func:`~dpr_gc.train.distributed.refused_together`), and the others wait until rank 0 has
        removed what the run wrote (:meth:`discard_refused_start`): torchrun stops the job once one rank exits."""
        drawn: list[dict] = []
        try:
            refused_together(lambda: drawn.extend(itertools.islice(batches, 1)))
        except DprGcError:
            self.discard_refused_start()
            if dist.is_initialized():
                dist.barrier()
            raise
        return drawn

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The step's metrics record (and the progress bar's line). Under torchrun each rank's loss is the mean over
        its own queries, so the record holds their mean: the loss of the global batch. ``masked_scores``: how many
        scores of the global batch were dropped because the passage is one of the query's own positives."""
        masked = torch.tensor(float(self.loss_fn.masked_scores), device=loss.device)
        if self.world > 1:
            both = torch.stack([loss.detach().float(), masked])
            dist.all_reduce(both)
            loss, masked = both[0] / self.world, both[1]
        self.last_loss = float(loss)
        rate = self.examples / max(self.training_seconds(), 1e-9)
        lr = self.step_lr
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.last_loss:.4f}", lr=f"{lr:.2e}", ex_s=f"{rate:.1f}")
        skipped = {"skipped": self.step_skipped} if self.scaler.is_enabled() else {}
        return {"step": self.step, "epoch": self.epoch, "loss": self.last_loss, "lr": lr,
                "grad_norm": float(grad_norm), "examples_per_s": rate, "masked_scores": int(masked),
                "temperature": float(self.retriever.temperature.detach()), **skipped}

    def after_step(self, record: dict, done_in_epoch: int) -> None:
        """Evaluate, log and save when due. Dev validation must not move the training RNG, so the state after the
        step is captured first, saved with the checkpoint and put back."""
        rng = capture_rng()
        last = self.step >= self.total_steps
        self.record_steps()
        due = (self.save_every and self.step % self.save_every == 0) or last
        evaluate = self.config.data.dev_file and ((self.eval_every and self.step % self.eval_every == 0) or last)
        if due or evaluate:
            self.check_finite_weights()
        if evaluate:
            dev = self.evaluate()
            record.update(dev)
            self.last_dev = {"step": self.step, **dev}
            logger.info("dev at step %d: %s", self.step, {k: round(v, 4) for k, v in dev.items()})
            self.retriever.training_info.update(dev_metrics=finite_or_null(dev), dev_metrics_step=self.step)
            self.checkpointer.update_best(self.step, self.export, record)
        if self.step % self.config.run.log_every == 0 or last:
            self.checkpointer.log(self.metrics_file, record)
            if self.board is not None:
                for key, value in record.items():
                    self.board.add_scalar(f"train/{key}", value, self.step)
        if due:
            self.save(record, done_in_epoch, rng)
        restore_rng(rng)

    def already_finished(self) -> dict:
        """A resumed run with no step left: say so, train nothing and print the summary table of what the run
        holds: no step trained now, the loss and last dev value metrics.jsonl recorded, the best one from the
        checkpoint, no training time and this call's whole time. ``final/`` is written only when it does not hold
        this step's model (the run stopped between its last checkpoint and ``final/``)."""
        if self.rank == 0:
            logger.info("the run already finished at step %d (of %s): nothing to train; to train further, resume "
                        "with a larger --max-steps or --epochs", self.step, counted(self.total_steps, "step"))
        final = self.out / "final"
        if not self.all_ranks(self.rank != 0 or card_training(final).get("steps") == self.step):
            self.describe_run()
            self.check_finite_weights()
            exported = self.export()
            if exported is not None:
                exported.save(final)
                logger.info("wrote %s (the model of step %d)", final, self.step)
        records = recorded_lines(self.metrics_file)
        summary = {**self.summary(0.0), "final_loss": recorded_loss(records, self.step),
                   "last_dev": recorded_dev(records, self.config.run.best_metric), "already_finished": True}
        if self.rank == 0:
            print(summary_table(summary))
        self.close()
        return summary

    def finish(self) -> dict:
        """Save ``final/``, print the summary table, and return the summary."""
        training = self.training_seconds()
        self.check_finite_weights()
        final = self.export()
        if final is not None:
            final.save(self.out / "final")
        summary = self.summary(training)
        if final is not None:
            print(summary_table(summary))
        return summary

    def training_seconds(self) -> float:
        """This invocation's seconds of training: the step loop's time less the dev validations inside it, so
        examples/s measures the steps (and their logging and checkpoints) alone."""
        return time.perf_counter() - self.started - (self.validated - self.validated_before)

    def summary(self, seconds: float) -> dict:
        """The run's summary (``seconds``: the time this call trained, dev validation left out, ``examples_per_s``
        its speed; ``validation_seconds``: its dev validations', None without ``--dev``; ``total_seconds``: the
        whole run's, from ``started`` or the construction, loading, validation and saving included;
        ``steps``: the run's, of which a resumed one trained those after ``resumed_from``), as :meth:`fit` returns
        it."""
        return {"steps": self.step, "resumed_from": self.resumed_from, "effective_batch": self.effective_batch,
                "passages_per_query": self.passages_per_query,
                "chunk_sizes": list(self.chunks) if self.chunks else None,
                "chunk_tokens": self.chunk_tokens() if self.chunks else None, "precision": self.config.optim.precision,
                "parallel": describe_parallel(self.config.run.fsdp, self.world), "fsdp": self.config.run.fsdp,
                "device": str(self.device), "graphs_kept": self.kept_graphs(), "skipped_steps": self.skipped.total,
                "final_loss": self.last_loss, "seconds": seconds, "total_seconds": time.perf_counter() - self.began,
                "examples_per_s": self.examples / max(seconds, 1e-9),
                "validation_seconds": self.validated if self.config.data.dev_file else None,
                "final_model": str(self.out / "final"),
                "best_model": self.checkpointer.best_path, "best": self.checkpointer.best_value,
                "best_step": self.checkpointer.best_step, "last_dev": self.last_dev,
                "best_metric": self.config.run.best_metric, "dev": self.config.data.dev_file,
                "metrics_file": str(self.metrics_file)}

    def chunk_tokens(self) -> list[Optional[int]]:
        """The query and passage chunk token limits (``--*-chunk-tokens``; None where chunks are by rows only)."""
        return [self.config.cache.query_chunk_tokens, self.config.cache.passage_chunk_tokens]

    def kept_graphs(self) -> Optional[str]:
        """What the last cached step kept under the memory budget (None in plain training, or before any step)."""
        report = self.cache.last_step if self.cache is not None else None
        return report.brief() if report is not None else None

    def close(self) -> None:
        """Free the DDP wrapper, then tear down the process group this trainer started. In that order: DDP's
        reducer holds the group, and freeing it after ``destroy_process_group`` made it the group's last owner, so
        gloo's destructor ran (and could deadlock joining its threads) wherever the reducer happened to be freed."""
        self.model, self.cache = self.towers, None
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
        if self.owns_group:  # torn down here, not at interpreter exit (where gloo's threads could abort the rank)
            dist.destroy_process_group()


def check_fsdp_launch(config: TrainConfig, world: int, device: torch.device) -> None:
    """Refuse ``--fsdp`` settings that the launch or the device rule out, before the model loads: offload on the CPU,
    and FSDP in one process (nothing to shard over)."""
    if not config.run.fsdp:
        return
    if config.run.fsdp_cpu_offload and device.type == "cpu":
        raise DprGcError("--fsdp-cpu-offload moves GPU weights to the CPU between uses; this run is already on the "
                         "CPU: drop the flag")
    if world == 1:
        raise DprGcError("--fsdp shards the model over the ranks of torchrun: launch with torchrun --nproc_per_node N "
                         "(N > 1), or train without --fsdp")


def train(config: TrainConfig, on_backward: OnBackward = None, started: Optional[float] = None) -> dict:
    """Run training (see :class:`Trainer`, whose ``started`` this passes); returns a summary (steps, examples/s,
    best metric, output folders). Raises :class:`TrainingDiverged` (an ``error:`` line on the command line) when the
    loss or gradient stops being finite."""
    with alike_on_every_rank():  # its setup refuses from the command line and the files alone, alike on every rank
        trainer = Trainer(config, on_backward, started)
    return trainer.fit()


def add_cli(subparsers: Any) -> None:
    """Register ``train`` (its flags: :func:`dpr_gc.train.config.add_train_arguments`)."""
    p = subparsers.add_parser("train")
    add_train_arguments(p)
    p.set_defaults(func=_cli_train)


@guarded(inputs=("train_files=--train", "dev_file=--dev", "model"), outputs={"output_dir=--output": "folder"},
         members={"output_dir": TRAIN_MEMBERS})
def _cli_train(args: Any) -> None:
    infos_from_rank_zero()
    started = time.perf_counter()  # the summary's time is the whole command's
    with alike_on_every_rank():
        config = config_from_args(args)
    try:
        train(config, started=started)
    except KeyboardInterrupt:
        raise Interrupted(resume_advice(config)) from None


def resume_advice(config: TrainConfig) -> str:
    """What to run after an interrupt: a fresh run refuses a folder with checkpoints, so say ``--resume latest``."""
    if config.run.resume:
        return "finished work is kept; run the same command again to resume"
    out = Path(config.run.output_dir)
    done = finished_checkpoints(out)
    if not done and (out / "best").is_dir() and not left_at_start(out):  # a fresh run refuses a trained best/
        step = card_training(out / "best").get("steps")
        return (f"no checkpoint was saved yet and {out / 'best'} holds the best model so far (step {step}); move or "
                "delete it, then run the same command again to start over")
    if not done:
        return "no checkpoint was saved yet; run the same command again to start over"
    return f"{done[-1].name} is kept; add --resume latest to the same command to continue from it"
