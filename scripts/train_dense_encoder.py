#!/usr/bin/env python
"""GC-DPR/DPR-compatible trainer: their argparse-era command lines run unchanged on ``dpr-gc train``.

Every ``dpr-gc train`` flag works here, and so does every flag of GC-DPR's and DPR's ``train_dense_encoder.py``.
Those with a meaning here are honoured: ``--train_file``/``--dev_file`` (files or glob expressions),
``--pretrained_model_cfg``, ``--model_file`` (initial weights: a dpr-gc folder or a DPR ``.cp`` checkpoint; with
``--dev_file`` and no ``--train_file`` it only validates, as DPR does), ``--projection_dim``, ``--sequence_length``
(question and passage max length), ``--batch_size``, ``--dev_batch_size``, ``--seed``, ``--adam_eps``,
``--adam_betas``, ``--max_grad_norm``, ``--log_batch_step``, ``--weight_decay``, ``--learning_rate``,
``--warmup_steps``, ``--num_train_epochs``, ``--grad_cache``/``--q_chunk_size``/``--ctx_chunk_size`` (without
``--grad_cache`` training is plain, as in GC-DPR), ``--fp16``, ``--no_cuda``, ``--local_rank``,
``--eval_per_epoch``, ``--val_av_rank_*``, ``--hard_negatives``, ``--other_negatives``, ``--shuffle_positive_ctx``,
``--train_files_upsample_rates``, ``--output_dir``. As in DPR the two towers are separate (``--shared-encoder``
shares them). The rest are accepted and named in one warning line. A ``--dev_file`` glob must match one file
(validation reads one dev file). Hydra-era DPR's ``key=value`` words are refused in one line naming the flag of
each key that has one (``train_datasets=`` is ``--train_file``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

try:
    import dpr_gc  # noqa: F401
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpr_gc.cli import model_flag  # noqa: E402
from dpr_gc.train import config as C  # noqa: E402
from dpr_gc.train import trainer as T  # noqa: E402
from dpr_gc.base.args import (ArgumentParser, any_int, flags_as_typed, nonnegative_float,  # noqa: E402
                               nonnegative_int, positive_float, positive_int)
from dpr_gc.base.errors import flags_renamed, model_named_by, report_errors  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.guard import guarded  # noqa: E402
from dpr_gc.base.logs import command_main, infos_from_rank_zero, setup_logging  # noqa: E402
from dpr_gc.base.settings import flags_that_do_not_apply, without_flags  # noqa: E402
from dpr_gc.train.checkpoints import TRAIN_MEMBERS  # noqa: E402

logger = logging.getLogger("train_dense_encoder")

# GC-DPR/DPR flags that change nothing here, with the reason given in the warning.
IGNORED = {
    "do_lower_case": "casing follows the model's tokenizer",
    "encoder_model_type": "the model type is read from the model's config",
    "pretrained_file": "models load from Hugging Face folders",
    "fp16_opt_level": "mixed precision is native autocast, not apex",
    "dropout": "the model config's dropout is used",
    "train_rolling_loss_step": "every step's loss goes to metrics.jsonl",
    "global_loss_buf_sz": "representations are all-gathered as tensors, no buffer",
    "fix_ctx_encoder": "both towers are trained",
    "val_av_rank_start_epoch": "average rank is computed at every dev evaluation",
    "checkpoint_file_name": "checkpoints are checkpoint-STEP/ folders",
}

# A hydra-era DPR override (``train_datasets=[x]``, ``+key=v``), and the flag of each key that has one here.
HYDRA_WORD = re.compile(r"^\+{0,2}[A-Za-z_][\w.]*=")
HYDRA_KEYS = {"train_datasets": "--train_file", "dev_datasets": "--dev_file", "output_dir": "--output_dir",
              "model_file": "--model_file", "seed": "--seed"}

# ``dpr-gc train``'s flags as GC-DPR spells them: the training this script shares names them in its errors and log
# lines. A spelling the user typed (``--batch-size`` or ``--batch_size``) wins (:func:`script_flags`).
SCRIPT_FLAGS = {"--output": "--output_dir", "--train": "--train_file", "--dev": "--dev_file",
                "--batch-size": "--batch_size", "--query-chunk-size": "--q_chunk_size",
                "--passage-chunk-size": "--ctx_chunk_size", "--hard-negatives": "--hard_negatives",
                "--other-negatives": "--other_negatives", "--shuffle-positives": "--shuffle_positive_ctx",
                "--passage-max-length": "--sequence_length", "--dev-batch-size": "--dev_batch_size",
                "--dev-max-questions": "--val_av_rank_max_qs", "--dev-hard-negatives": "--val_av_rank_hard_neg",
                "--dev-other-negatives": "--val_av_rank_other_neg", "--dev-encode-batch-size": "--val_av_rank_bsz",
                "--learning-rate": "--learning_rate", "--weight-decay": "--weight_decay",
                "--warmup-steps": "--warmup_steps", "--epochs": "--num_train_epochs",
                "--max-grad-norm": "--max_grad_norm", "--sampling-rates": "--train_files_upsample_rates"}


def script_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """:data:`SCRIPT_FLAGS` with each flag named as the user typed it (``--model`` as the flag that gave the model;
    ``--query-max-length`` as ``--sequence_length`` where that alone set both lengths)."""
    given = typed_flags(argv)
    names = {**SCRIPT_FLAGS, "--model": model_flag(argv) if model_flag(argv) != "--model" else "--pretrained_model_cfg"}
    if "--sequence_length" in given and not given & {"--query-max-length", "--query_max_length"}:
        names["--query-max-length"] = "--sequence_length"
    return flags_as_typed(train_parser(parser), names, given)


def build_parser() -> ArgumentParser:
    """``dpr-gc train``'s parser plus the GC-DPR/DPR flags it lacks (same names, types and meanings)."""
    parser = ArgumentParser(prog="train_dense_encoder.py", description=__doc__.splitlines()[0])
    T.add_cli(parser.add_subparsers(dest="command"))
    train = train_parser(parser)
    train.prog = parser.prog  # the script runs only train: its lines name the script, not a command never typed
    for action in train._actions:
        if action.dest == "train_files":
            action.required, action.nargs = False, "*"
        if action.dest in ("grad_cache", "separate_encoders"):
            action.default = None
        if action.dest == "output_dir":
            action.required, action.default = False, None  # DPR's validation-only run writes nothing
        if action.dest == "epochs":
            action.type = positive_float  # DPR's --num_train_epochs is a float
    train.set_defaults(grad_cache=None)
    add = train.add_argument
    add("--do_lower_case", action="store_true", help=argparse.SUPPRESS)
    add("--encoder_model_type", default=None, help=argparse.SUPPRESS)
    add("--pretrained_file", default=None, help=argparse.SUPPRESS)
    add("--model_file", default=None, help="initial weights: a dpr-gc retriever folder or a DPR .cp checkpoint")
    add("--projection_dim", type=nonnegative_int, default=0, help=argparse.SUPPRESS)
    add("--no_cuda", action="store_true", help="train on the CPU")
    add("-v", "--verbose", action="store_true", help="debug logging, plus the dependencies' own log lines and progress bars")
    # torch.distributed.launch passes --local-rank=N since torch 2.0, --local_rank=N before
    add("--local_rank", "--local-rank", dest="local_rank", type=any_int, default=-1, help=argparse.SUPPRESS)
    add("--fp16_opt_level", default="O1", help=argparse.SUPPRESS)
    add("--adam_eps", type=positive_float, default=1e-8, help="AdamW epsilon")
    add("--adam_betas", default="(0.9, 0.999)", help="AdamW betas, as GC-DPR writes them (each in [0, 1))")
    add("--log_batch_step", type=positive_int, default=1, help="steps between metrics.jsonl records")
    add("--train_rolling_loss_step", type=positive_int, default=100, help=argparse.SUPPRESS)
    add("--dropout", type=nonnegative_float, default=0.1, help=argparse.SUPPRESS)
    add("--gradient_accumulation_steps", type=positive_int, default=1,
        help="only 1: for more queries per update use a larger --batch_size with --grad_cache")
    add("--eval_per_epoch", type=positive_int, default=None,
        help="dev evaluations (and checkpoints) per epoch (default: 1, none when --eval-every is given)")
    add("--global_loss_buf_sz", type=positive_int, default=150000, help=argparse.SUPPRESS)
    add("--fix_ctx_encoder", action="store_true", help=argparse.SUPPRESS)
    add("--train_files_upsample_rates", default=None, help="per-file rates, e.g. [1,2,1]")
    add("--val_av_rank_start_epoch", type=nonnegative_int, default=10000, help=argparse.SUPPRESS)
    add("--checkpoint_file_name", default="dpr_biencoder", help=argparse.SUPPRESS)
    add("--shared-encoder", dest="separate_encoders", action="store_false", help="one tower for both sides")
    return parser


def train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``train`` sub-parser of :func:`build_parser`'s parser."""
    return parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]


def _expand(patterns: Sequence[str], flag: str) -> list[str]:
    """DPR takes glob expressions for data files; an existing path is kept as it is."""
    out: list[str] = []
    for pattern in patterns:
        matches = [pattern] if Path(pattern).exists() else sorted(glob.glob(pattern))
        if not matches:
            raise DprGcError(f"{flag} {pattern!r} matches no file")
        out.extend(matches)
    return out


def _dev_file(pattern: Optional[str]) -> Optional[str]:
    """The one dev file ``--dev_file`` names: validation reads one file, so a glob matching several is refused (a
    match left out would change the dev metrics silently)."""
    if not pattern:
        return None
    matches = _expand([pattern], "--dev_file")
    if len(matches) > 1:
        raise DprGcError(f"--dev_file {pattern!r} matches {len(matches)} files ({', '.join(matches)}); validation "
                         "reads one dev file: give one of them, or join them into one")
    return matches[0]


def _betas(text: str) -> tuple[float, float]:
    """``--adam_betas`` as AdamW takes them (two numbers, each finite and in [0, 1)), checked before anything loads:
    torch refuses others with a traceback once the model has loaded."""
    try:
        betas = tuple(float(b) for b in ast.literal_eval(text))
        usable = len(betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in betas)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError):  # past a float
        betas, usable = (), False
    if not usable:
        raise DprGcError(f"--adam_betas must be two numbers, each in [0, 1), e.g. '(0.9, 0.999)'; got {text!r}")
    return betas  # type: ignore[return-value]


def _rates(text: Optional[str], files: Sequence[str]) -> Optional[list[float]]:
    """``--train_files_upsample_rates`` as one positive rate per training file, checked before anything loads: a
    malformed value is one line naming the script's flag (not a traceback), a wrong count too (not dpr-gc's
    ``--sampling-rates`` once the model and data have loaded)."""
    if text is None:
        return None
    try:
        value = ast.literal_eval(text)
        numbers = isinstance(value, (list, tuple)) and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError):  # past a float
        value, numbers = None, False
    if not numbers or not value:
        raise DprGcError(f"--train_files_upsample_rates must be a list of positive numbers, one per --train_file, "
                         f"e.g. '[1,2]'; got {text!r}")
    if files and len(value) != len(files):
        raise DprGcError(f"--train_files_upsample_rates needs one rate per --train_file ({len(files)}: "
                         f"{', '.join(files)}), got {len(value)}: {text!r}")
    return [float(r) for r in value]


def _epochs(value: Any) -> int:
    if float(value) != int(float(value)) or float(value) < 1:
        raise DprGcError(f"--num_train_epochs must be a whole number >= 1 here, got {value}")
    return int(float(value))


def refuse_unsupported(args: argparse.Namespace) -> None:
    """GC-DPR settings this trainer cannot honour, refused in one line before anything (a warning included) runs."""
    if args.gradient_accumulation_steps != 1:
        raise DprGcError(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: accumulation would "
                         "shrink the in-batch negatives; use --grad_cache with --batch_size "
                         f"{args.batch_size * args.gradient_accumulation_steps} for the same queries per update")
    if args.encoder_model_type not in (None, "hf_bert", "hf_roberta"):
        raise DprGcError(f"--encoder_model_type {args.encoder_model_type}: only Hugging Face models are supported "
                         "(hf_bert); convert the checkpoint to a Hugging Face folder and pass it as --model")


def config_from_args(args: argparse.Namespace, given: set[str]) -> T.TrainConfig:
    """The :class:`TrainConfig` a GC-DPR/DPR command line asks for (``given``: the flags typed). Flags with a
    ``dpr-gc train`` equivalent are translated to it and go through that command's adapter; GC-DPR's own settings
    then land in their groups. ``args`` is left as parsed."""
    refuse_unsupported(args)
    if args.local_rank >= 0:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    if args.train_files and not args.output_dir:
        raise DprGcError("--output_dir is required for training")
    one_length = "--sequence_length" in given and not given & {"--query-max-length", "--query_max_length"}
    train_files = _expand(args.train_files or [], "--train_file")
    rates = _rates(args.train_files_upsample_rates, train_files)
    translated = argparse.Namespace(**{
        **vars(args), "device": args.device or ("cpu" if args.no_cuda else None),
        "grad_cache": bool(args.grad_cache),  # GC-DPR trains plainly unless --grad_cache is given
        "separate_encoders": args.separate_encoders is not False, "projection_dim": args.projection_dim or None,
        "query_max_length": args.passage_max_length if one_length else args.query_max_length,  # DPR: one length
        "model": args.model_file or args.model, "train_files": train_files,
        "dev_file": _dev_file(args.dev_file),
        "epochs": _epochs(args.epochs), "output_dir": args.output_dir or ""})
    # dpr-gc train refuses a flag that would not apply; a GC-DPR command line carries them: named in the warning
    translated = without_flags(C.TrainConfig, translated, flags_that_do_not_apply(C.TrainConfig, translated, C.APPLIES))
    config = T.config_from_args(translated)
    evals = args.eval_per_epoch or (1 if args.eval_every is None else None)  # GC-DPR: validate and save per epoch
    return capped_chunks(dataclasses.replace(
        config, optim=dataclasses.replace(config.optim, adam_eps=args.adam_eps, adam_betas=_betas(args.adam_betas)),
        data=dataclasses.replace(config.data, sampling_rates=rates or config.data.sampling_rates),
        run=dataclasses.replace(config.run, log_every=args.log_batch_step, eval_per_epoch=evals)))


def capped_chunks(config: T.TrainConfig) -> T.TrainConfig:
    """``config`` with each Gradient Cache chunk size capped at what a batch holds, logged: GC-DPR takes a chunk
    larger than the batch as one chunk, where ``dpr-gc train`` refuses it."""
    cache, data = config.cache, config.data
    if not cache.enabled:
        return config
    sizes = {"query_chunk_size": (cache.query_chunk_size, data.batch_size, "--query-chunk-size",
                                  "is more than --batch-size {batch}", "questions"),
             "passage_chunk_size": (cache.passage_chunk_size, data.batch_size * data.passages_per_query,
                                    "--passage-chunk-size", "is more than the {batch} passages of a batch", "passages")}
    capped = {}
    for field, (chunk, batch, flag, why, rows) in sizes.items():
        if isinstance(chunk, int) and chunk > batch:
            logger.info("%s %d %s: one chunk of %d %s, as in GC-DPR", flag, chunk, why.format(batch=batch), batch, rows)
            capped[field] = batch
    return dataclasses.replace(config, cache=dataclasses.replace(cache, **capped)) if capped else config


def ignored_flags(given: set[str], args: Optional[argparse.Namespace] = None) -> list[str]:
    """The flags typed that change nothing here, with the reason: GC-DPR's own (:data:`IGNORED`) and, with the
    parsed ``args``, those whose rule in ``dpr-gc train`` says they would not apply (that command refuses them; a
    GC-DPR command line carries ``--dev_batch_size`` or ``--q_chunk_size`` whether or not they apply)."""
    named = [f"--{name} ({why})" for name, why in IGNORED.items() if f"--{name}" in given]
    if args is None:
        return named
    settings = argparse.Namespace(**{**vars(args), "grad_cache": bool(args.grad_cache)})  # GC-DPR: plain by default
    why = {id(C.PLAIN): "training is plain without --grad_cache", id(C.DEV): "there is no --dev_file"}
    options = {a.dest: a.option_strings for a in train_parser(build_parser())._actions}
    for dest in flags_that_do_not_apply(C.TrainConfig, settings, C.APPLIES):
        typed = [o for o in options.get(dest, ()) if o in given] or options[dest][:1]
        named.append(f"{typed[0]} ({why.get(id(C.APPLIES[dest]), 'it does not apply ' + C.APPLIES[dest].where)})")
    return named


def validate(config: T.TrainConfig, model_file: str) -> dict:
    """DPR's validation-only run: the model loaded on the run's device, the dev set embedded under its precision
    with a progress bar, and the dev metrics (those of :func:`~dpr_gc.train.validation.evaluate_dev`) printed as the
    closing ``| item | value |`` summary; returns them."""
    import time

    from dpr_gc.base.devices import autocast_dtype, cpu_threads, default_device, warn_if_emulated
    from dpr_gc.base.tables import format_summary
    from dpr_gc.model.retriever import Retriever
    from dpr_gc.train.validation import dev_negatives, evaluate_dev

    started, data, precision = time.perf_counter(), config.data, config.optim.precision
    device = default_device(config.run.device)
    retriever = Retriever.load(config.model.path(), device=device)
    logger.info("validating %s on %s, precision %s%s", model_file, device, precision, cpu_threads(torch.device(device)))
    warn_if_emulated(precision, torch.device(device))
    metrics = evaluate_dev(retriever, data.dev_file, data.dev, data.cache_dir, dtype=autocast_dtype(precision),
                           show_progress=True, negatives=dev_negatives(data))
    print(format_summary({"model": model_file, "dev file": data.dev_file, "questions": metrics["questions"],
                          "passages": metrics["passages"], "loss": f"{metrics['loss']:.4f}",
                          "accuracy": f"{metrics['accuracy']:.4f}", "average rank": f"{metrics['avg_rank']:.4f}",
                          "device": device, "precision": precision}, time.perf_counter() - started))
    return metrics


def refuse_hydra(parser: ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse hydra-era DPR's ``key=value`` words (``train_datasets=[x.json] train=biencoder_local``) in one line:
    only the argparse-era command line is taken; the line names the flag of each key that has one
    (:data:`HYDRA_KEYS`). A word that is a flag's value (``--output_dir a=b``) is no such word."""
    train, words, after = train_parser(parser), [], None
    for word in argv:
        action = train._option_string_actions.get(after or "")
        if HYDRA_WORD.match(word) and (action is None or action.nargs == 0):
            words.append(word)
        after = word if word.startswith("--") and "=" not in word else None
    if not words:
        return
    keys = list(dict.fromkeys(word.split("=", 1)[0].lstrip("+") for word in words))
    named = [f"{key}= is {HYDRA_KEYS[key]}" for key in keys if key in HYDRA_KEYS]
    others = [f"{key}=" for key in keys if key not in HYDRA_KEYS]
    hint = ", ".join(named) + ("; " if named and others else "") + (
        f"for {' '.join(others)} give the settings as flags" if others else "")
    parser.error(f"only the argparse-era command line of DPR/GC-DPR is taken, not hydra's key=value words "
                 f"({' '.join(words)}): {hint}")


def typed_flags(argv: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


@command_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.perf_counter()  # the summary's time is the whole command's
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    refuse_hydra(parser, argv)
    args = parser.parse_args(["train", *argv])
    setup_logging(args.verbose)
    infos_from_rank_zero()  # under torchrun INFO lines come from rank 0 only, as in dpr-gc train
    given = typed_flags(argv)

    @guarded(inputs=("train_files=--train_file", "dev_file=--dev_file", "model_file=--model_file", "model"),
             outputs={"output_dir=--output_dir": "folder"}, members={"output_dir": TRAIN_MEMBERS})
    def run(args: argparse.Namespace) -> None:
        config = config_from_args(args, given)
        data = config.data
        if data.train_files:
            T.train(config, started=started)
        elif data.dev_file and args.model_file:
            validate(config, args.model_file)
        else:
            raise DprGcError("nothing to do: give --train_file (and --output_dir), or --model_file with --dev_file "
                             "to validate a model")
    def checked_run() -> None:
        """Refusals first, so a refused flag is not also named in the warning as accepted."""
        refuse_unsupported(args)
        skipped = ignored_flags(given, args)
        if skipped:
            logger.warning("accepted with no effect here: %s", "; ".join(skipped))
        with flags_renamed(script_flags(parser, argv)), model_named_by(model_flag(argv), args.model_file or args.model):
            run(args)
    return report_errors(checked_run)


if __name__ == "__main__":
    sys.exit(main())
