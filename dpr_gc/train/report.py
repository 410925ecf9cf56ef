"""What a training run tells: the model card's account of the run, TensorBoard, the summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from ..base.tables import format_summary, seconds_text
from ..base.logs import counted
from .chunks import rows_and_tokens
from .config import HIGHER_IS_BETTER, TrainConfig


def describe_epoch(data: Any, sampler: Any, beir_positives: str) -> str:
    """What one epoch trains on, for the log: examples per source (BEIR pairs or queries, DPR questions), and how
    many the whole steps use and how many are left out (the last partial global batch, other ones each epoch)."""
    parts = []
    for i, (stats, queries, examples, rate) in enumerate(zip(data.stats, data.sizes, sampler.sizes, sampler.rates)):
        drawn, kind = int(rate * examples), data.source_format(i)
        if kind == "beir" and beir_positives == "pairs":
            what = f"{counted(examples, '(query, positive) pair')} of {counted(queries, 'query', 'queries')}"
        elif kind == "beir":
            what = f"{counted(queries, 'query', 'queries')}, a positive drawn each time"
        else:
            what = counted(queries, "question")
        parts.append(f"{stats['source']}: {what}" + (f" x rate {rate:g} = {drawn}" if rate != 1 else ""))
    drawn = sum(int(r * n) for r, n in zip(sampler.rates, sampler.sizes))
    step = sampler.batch_size * sampler.world_size
    used = sampler.batches_per_epoch * step
    flag = f" (--beir-positives {beir_positives})" if "beir" in map(data.source_format, range(len(data.sizes))) else ""
    return (f"an epoch: {'; '.join(parts)}{flag}; {counted(sampler.batches_per_epoch, 'step')} "
            f"of {step} use {used} of the {drawn} examples, {drawn - used} left out (the last partial batch; "
            "the shuffle leaves out others each epoch)")


def describe_training(config: TrainConfig, stats: list[dict], world: int, chunks: Optional[tuple[int, int]],
                      total_steps: int) -> dict:
    """What the model card records about this run (steps and dev metrics are added as they happen)."""
    data, optim = config.data, config.optim
    return {"base_model": config.model.path(),
            "train_data": [{"file": s["source"], "records": s["records"], "kept": s["kept"]} for s in stats],
            "dev_file": data.dev_file,
            "loss": f"InfoNCE (softmax cross-entropy of scores / temperature) over the batch's "
                    f"{data.passages_per_query} passages per query and every other query's passages"
                    + (", symmetric" if optim.symmetric else ""),
            "batch_size": data.batch_size * world, "batch_size_per_rank": data.batch_size, "world_size": world,
            "hard_negatives": data.hard_negatives, "other_negatives": data.other_negatives,
            "grad_cache": config.cache.enabled, "query_chunk_size": chunks[0] if chunks else None,
            "passage_chunk_size": chunks[1] if chunks else None, **chunk_limits(config.cache),
            "learning_rate": optim.learning_rate,
            "warmup_steps": optim.warmup_for(total_steps), "epochs": 0, "total_steps": total_steps,
            "precision": optim.precision, "seed": config.run.seed, "steps": 0}


def epochs_done(steps: int, steps_per_epoch: int) -> float | int:
    """The epochs ``steps`` make (three significant digits, as the log gives them; whole ones as an int): the card
    records what ran, which ``--max-steps`` or a stop can make differ from ``--epochs``."""
    epochs = float(f"{steps / max(steps_per_epoch, 1):.3g}")
    return int(epochs) if epochs.is_integer() else epochs


def chunk_limits(cache: Any) -> dict:
    """The token limits and memory budget a Gradient Cache run chunked with (None where not set; none without
    Gradient Cache)."""
    if not cache.enabled:
        return {}
    return {"query_chunk_tokens": cache.query_chunk_tokens, "passage_chunk_tokens": cache.passage_chunk_tokens,
            "memory_budget": cache.memory_budget}


def tensorboard_writer(out: Path, purge_step: Optional[int] = None) -> Any:
    """A TensorBoard writer into ``out/tensorboard`` when the tensorboard package is installed, else None.
    ``purge_step``: the first step a resumed run logs; the events a stopped run logged from it on are purged, as the
    resumed run logs those steps again."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"), purge_step=purge_step)


def best_dev(summary: dict) -> str:
    """The summary's best dev value with its metric, which way is better, where ``best/`` is, and at which step
    (the starting model, when no step beat its score before training)."""
    if summary["best"] is None:
        return "none (no --dev)" if summary.get("dev") is None else "none"
    metric = summary["best_metric"]
    better = "higher" if metric in HIGHER_IS_BETTER else "lower"
    step = summary.get("best_step")
    where = {None: "", 0: ": the starting model, no step beat it"}.get(step, f" (step {step})")
    return f"{metric} {summary['best']:.4f} ({better} is better) in {summary['best_model']}{where}"


def summary_table(summary: dict) -> str:
    """train's closing table: steps (a resumed run's, with those this invocation trained), batch, chunks and the
    graphs kept under the memory budget, the ranks and precision (:func:`describe_parallel`; under fp16, or where
    there were any, the steps the GradScaler skipped), device, loss, this invocation's speed, the best and (with a
    dev set) the last dev values, the model, and this invocation's time: ``training`` the steps', which examples/s
    divides, ``dev validation`` (with a dev set) the validations', ``time`` the whole run's (loading the model and
    data, validation and saving ``final/`` included)."""
    rows = [("steps", steps_trained(summary)), ("effective batch (queries)", summary["effective_batch"]),
            ("passages per query", summary["passages_per_query"]),
            ("chunk sizes (query/passage)", chunk_sizes_cell(summary)),
            ("graphs kept (last step, budget)", summary.get("graphs_kept") or "-"),
            ("ranks", summary.get("parallel") or "one process"),
            ("precision", describe_precision(summary.get("fsdp", False), summary["precision"])),
            *skipped_steps(summary), ("device", summary.get("device", "-")),
            ("final loss", loss_cell(summary["final_loss"])), ("training", seconds_text(summary["seconds"])),
            ("examples/s", examples_cell(summary)), *validation_time(summary),
            ("best dev", best_dev(summary))]
    if summary.get("dev") is not None or summary.get("last_dev"):
        rows.append(("last dev", last_dev(summary)))
    rows.append(("output", summary["final_model"]))
    return format_summary(dict(rows), summary.get("total_seconds", summary["seconds"]))


def loss_cell(loss: float) -> str:
    """The final loss to 4 places, or '-' where none was recorded (a finished run resumed, its metrics.jsonl
    without the last step's line)."""
    return f"{loss:.4f}" if math.isfinite(loss) else "-"


def examples_cell(summary: dict) -> str:
    """This invocation's training speed, '-' where it trained no step (a finished run resumed)."""
    return "-" if summary["steps"] == summary.get("resumed_from") else f"{summary['examples_per_s']:.2f}"


def validation_time(summary: dict) -> list[tuple[str, str]]:
    """The summary's row of seconds spent in dev validation (none without a dev set)."""
    seconds = summary.get("validation_seconds")
    return [] if seconds is None else [("dev validation", seconds_text(seconds))]


def chunk_sizes_cell(summary: dict) -> str:
    """The summary's chunk sizes in the first step's words, query then passage: "8 rows / 2 tokens, 16 rows", or
    "off (plain)" without Gradient Cache."""
    if not summary["chunk_sizes"]:
        return "off (plain)"
    tokens = summary.get("chunk_tokens") or [None] * len(summary["chunk_sizes"])
    return ", ".join(rows_and_tokens(rows, limit) for rows, limit in zip(summary["chunk_sizes"], tokens))


def describe_parallel(fsdp: bool, world: int) -> str:
    """How the model runs over the ranks: sharded (``--fsdp``, FSDP2), replicated (DDP) or in one process."""
    if fsdp:
        return f"FSDP2 over {counted(world, 'rank')} (the model sharded)"
    return f"DDP over {counted(world, 'rank')}" if world > 1 else "one process"


def describe_precision(fsdp: bool, precision: str) -> str:
    """What ``--precision`` means: under ``--fsdp`` bf16 is the parameters' own dtype with gradients reduced in fp32
    (FSDP2's ``MixedPrecisionPolicy``), elsewhere autocast over fp32 parameters (said as the flag's value)."""
    return "bf16 parameters, fp32 gradient reduction (FSDP2)" if fsdp and precision == "bf16" else precision


def steps_trained(summary: dict) -> str:
    """The run's steps, and for a resumed run how many of them this invocation trained (its time and examples/s are
    theirs) after which checkpoint."""
    steps, resumed = summary["steps"], summary.get("resumed_from")
    return str(steps) if resumed is None else f"{steps} ({steps - resumed} this run, resumed from step {resumed})"


def skipped_steps(summary: dict) -> list[tuple[str, str]]:
    """The summary's row of steps fp16's GradScaler skipped, of all the run's steps (none outside fp16 without any)."""
    skipped = summary.get("skipped_steps") or 0
    if summary["precision"] != "fp16" and not skipped:
        return []
    why = " (inf/NaN gradients: the weights stayed as they were)" if skipped else ""
    return [("skipped steps", f"{skipped} of {summary['steps']}{why}")]


def last_dev(summary: dict) -> str:
    """The run's latest dev value after a step, by the best-model metric, and its step: beside the best, it says
    how the model trained last compares (the best may be the starting model's score)."""
    last = summary.get("last_dev")
    value = (last or {}).get(f"dev_{summary['best_metric']}")
    return "-" if value is None else f"{summary['best_metric']} {value:.4f} (step {last['step']})"


def recorded_lines(metrics: Path) -> list[dict]:
    """The records ``metrics.jsonl`` holds (none when it is missing; a line that is no JSON object is passed over)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [record for record in records if isinstance(record, dict)]


def recorded_loss(records: list[dict], step: int) -> float:
    """The loss ``metrics.jsonl``'s ``records`` (:func:`recorded_lines`) hold for ``step`` (NaN when they hold none:
    a run logging every N steps, or a file removed), for the summary of a run resumed after its last step."""
    losses = [record["loss"] for record in records
              if record.get("step") == step and isinstance(record.get("loss"), (int, float))]
    return float(losses[-1]) if losses else float("nan")


def recorded_dev(records: list[dict], metric: str) -> Optional[dict]:
    """The latest dev evaluation after a step in ``metrics.jsonl``'s ``records`` (``{"step", "dev_METRIC": ...}``,
    as :func:`last_dev` reads it), None when they hold none: the last dev of a run resumed after its last step."""
    devs = [record for record in records
            if (record.get("step") or 0) > 0 and isinstance(record.get(f"dev_{metric}"), (int, float))]
    return devs[-1] if devs else None
