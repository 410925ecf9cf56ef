"""``dpr-gc`` command line: one sub-command per stage; each stage module registers its own parser."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any, Optional, Sequence

from . import __version__
from .base.args import ArgumentParser
from .base.errors import NOTHING_STARTED, DprGcError, alike_on_every_rank, model_named_by, report_errors, say
from .base.logs import command_main, setup_logging

# The flags a command takes its model with, as typed: dpr-gc's, train's DPR name --pretrained_model_cfg, and DPR's
# --model_file, which the DPR-compatible scripts take (dpr-gc's commands answer it with --model: FOREIGN_FLAGS).
MODEL_FLAGS = ("--model", "--model_file", "--pretrained_model_cfg")
# Other tools' flag names that dpr-gc's commands lack -> (whose name it is, the flag of a command taking that setting,
# with its value where the tool's is a switch; alternatives split by | for commands that name it differently); ""
# where dpr-gc has none, for which a command with a DPR-compatible script (Stage.dpr_script) names the script
# (DPR's and GC-DPR's names only). Only names meaning what the dpr-gc flag means are here: Hugging Face's
# TrainingArguments and example scripts, sentence-transformers' training examples, Tevatron's retriever arguments.
# The scripts' parsers are the source of DPR's: tests/test_settings.py checks that each option string of their DPR
# options (--n_docs and its alias --n-docs) that the command lacks is answered.
FOREIGN_FLAGS = {
    **{flag: ("DPR's", target) for flag, target in {
        "--model_file": "--model", "--ctx_file": "--corpus", "--ctx_src": "--corpus", "--ctx_datasets": "--corpus",
        "--ctx_datatsets": "--corpus", "--qa_file": "--queries", "--qa_dataset": "--queries", "--n_docs": "--top-k",
        "--n-docs": "--top-k", "--out_file": "--output", "--encoded_ctx_file": "--embeddings",
        "--encoded_ctx_files": "--embeddings",
        "--index_path": "--index", "--index_buffer": "--block-size", "--hnsw_index": "--kind hnsw",
        "--sequence_length": "--max-length", "--projection_dim": "--projection-dim", "--no_cuda": "--device cpu",
        "--fp16": "--precision fp16", "--train_files_upsample_rates": "--sampling-rates",
        **dict.fromkeys(("--eval_per_epoch", "--log_batch_step", "--gradient_accumulation_steps", "--adam_eps",
                         "--adam_betas", "--do_lower_case", "--encoder_model_type", "--pretrained_model_cfg",
                         "--pretrained_file", "--fp16_opt_level", "--dropout", "--train_rolling_loss_step",
                         "--global_loss_buf_sz", "--fix_ctx_encoder", "--val_av_rank_start_epoch",
                         "--checkpoint_file_name", "--local_rank", "--local-rank", "--save_or_load_index",
                         "--encode_q_and_save", "--re_encode_q", "--q_encoding_path", "--validation_workers"), ""),
    }.items()},
    **{flag: ("Hugging Face's", target) for flag, target in {
        "--model_name_or_path": "--model", "--per_device_train_batch_size": "--batch-size",
        "--per_gpu_train_batch_size": "--batch-size", "--per_device_eval_batch_size": "--dev-encode-batch-size",
        "--save_steps": "--save-every", "--save_total_limit": "--keep-checkpoints", "--eval_steps": "--eval-every",
        "--bf16": "--precision bf16", "--dataloader_num_workers": "--num-workers"}.items()},
    **{flag: ("sentence-transformers'", target) for flag, target in {
        "--lr": "--learning-rate", "--train_batch_size": "--batch-size", "--model_name": "--model",
        "--max_seq_length": "--passage-max-length (and --query-max-length for queries)|--max-length"}.items()},
    **{flag: ("Tevatron's", target) for flag, target in {
        "--q_max_len": "--query-max-length", "--p_max_len": "--passage-max-length|--max-length",
        "--query_max_len": "--query-max-length", "--passage_max_len": "--passage-max-length|--max-length",
        **dict.fromkeys(("--train_n_passages", "--train_group_size"),
                        "--hard-negatives N-1 (Tevatron's N passages per query count its positive)"),
        "--gc_q_chunk_size": "--query-chunk-size", "--gc_p_chunk_size": "--passage-chunk-size",
        "--untie_encoder": "--separate-encoders"}.items()},
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """A sub-command: the stage module (under dpr_gc) whose ``add_cli`` registers its parser, and the one line that
    lists it in ``dpr-gc --help`` (declared here, so that listing the commands imports no stage and no torch)."""

    module: str
    help: str
    distributed: bool = False  # runs under torchrun (one rank per process); the others refuse WORLD_SIZE > 1
    dpr_script: str = ""  # the script in scripts/ that takes DPR's and GC-DPR's command lines for this stage
    joins_group: bool = False  # under torchrun its ranks join a process group (env://: MASTER_ADDR, MASTER_PORT)


# sub-command -> its stage, in the order ``dpr-gc --help`` lists them
STAGES = {
    "demo": Stage("pipeline", "run the whole pipeline end to end on the built-in stdlib dataset"),
    "make-stdlib-data": Stage("data.stdlib_data", "build the default retrieval dataset from Python's stdlib"),
    "prepare-data": Stage("data.training", "validate and cache training data (DPR files, BEIR folders)"),
    "train": Stage("train.trainer", "train a retriever with Gradient Cache (DPR files or BEIR folders)", True,
                   "scripts/train_dense_encoder.py", joins_group=True),
    "verify": Stage("train.verify", "check that the cached step equals the full-batch step on your set-up (train's "
                                    "flags; writes nothing)", True, joins_group=True),
    "encode": Stage("retrieval.encode", "embed a passage corpus into resumable shards", True,
                    "scripts/generate_dense_embeddings.py"),
    "index": Stage("retrieval.index", "build a FAISS index (flat, hnsw, ivf-flat, ivf-pq, factory) from shards"),
    "retrieve": Stage("retrieval.retrieve", "top-k passages for questions: DPR JSON and a TREC run",
                      dpr_script="scripts/dense_retriever.py"),
    "evaluate": Stage("evaluation.evaluate", "top-k answer accuracy and qrels metrics (Recall, nDCG, MRR, MAP)"),
    "mine": Stage("retrieval.mine", "mine hard negatives (BM25 or dense) into a DPR training file"),
    "merge-lora": Stage("model.lora", "write a retriever with its LoRA adapters merged into full weights"),
    "cache": Stage("data.arrow_cache", "list (or --clear) the cache of parsed corpora and training sets"),
}


class _Commands:
    """What a stage's ``add_cli`` registers its parser with: argparse's ``add_parser``, given the command's line from
    ``STAGES`` as its help (and as its description where the stage gives none), the DPR flag names it answers
    (:data:`FOREIGN_FLAGS`, and the stage's script), and ``dpr-gc``'s parser, whose options it names where they go."""

    def __init__(self, parser: ArgumentParser, subparsers: Any) -> None:
        self._parser, self._subparsers = parser, subparsers

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("description", STAGES[name].help[0].upper() + STAGES[name].help[1:] + ".")
        parser = self._subparsers.add_parser(name, help=STAGES[name].help, **kwargs)
        parser.foreign_names, parser.dpr_script, parser.outer = FOREIGN_FLAGS, STAGES[name].dpr_script, self._parser
        return parser


def build_parser(command: Optional[str] = None, listing: bool = False) -> argparse.ArgumentParser:
    """The ``dpr-gc`` parser; given a known ``command``, only that stage is imported and registered, so a command
    loads what it uses and no more (``dpr-gc evaluate`` loads no torch). With ``listing`` no stage is imported: each
    command is a bare entry with its line from ``STAGES``, enough to list them (``dpr-gc --help``) or refuse a
    command line that names none."""
    parser = ArgumentParser(prog="dpr-gc", description="Dense passage retrieval with Gradient Cache.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, plus the dependencies' own log lines and progress bars")
    parser.add_argument("--version", action="version", version=f"dpr-gc {__version__}")
    commands = _Commands(parser, parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    for name, stage in STAGES.items():
        if listing:
            commands.add_parser(name)
        elif command not in STAGES or command == name:
            importlib.import_module(f"{__package__}.{stage.module}").add_cli(commands)
    return parser


def requested_command(argv: Sequence[str]) -> Optional[str]:
    """The sub-command named on the command line (the first argument that is not an option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


@command_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = requested_command(argv)
    try:  # loading a stage imports torch: seconds in which an interrupt must not print a traceback
        parser = build_parser(command, listing=command not in STAGES)
        check_own_options(parser, argv, command)
        args = parser.parse_args(argv)
    except SystemExit as e:  # a refused command line (its one error line is printed) returns 2; --help still exits
        if e.code in (0, None):
            raise
        return int(e.code) if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        say(f"interrupted: {NOTHING_STARTED}")
        return 130
    setup_logging(args.verbose)
    return report_errors(lambda: run_stage(args, model_flag(argv)))


def check_own_options(parser: argparse.ArgumentParser, argv: Sequence[str], command: Optional[str]) -> None:
    """Refuse an unknown option before the command as dpr-gc's own (``dpr-gc -q evaluate``): argparse named it as
    the command's ("dpr-gc evaluate: unrecognized arguments: -q"), though it went to dpr-gc itself."""
    if command not in STAGES:
        return
    own = set(parser._option_string_actions)
    unknown = [word for word in argv[:list(argv).index(command)] if word.split("=", 1)[0] not in own]
    if unknown:
        parser.error(f"unrecognized option {unknown[0]} before the command: dpr-gc's own options are -v/--verbose, "
                     f"--version and -h/--help; {command}'s options go after it (dpr-gc {command} ... {unknown[0]})")


def model_flag(argv: Sequence[str]) -> str:
    """The flag the command line gave the model with (a DPR name, ``--model_file``, as typed), else ``--model``."""
    return next((flag for flag in (arg.split("=", 1)[0] for arg in argv) if flag in MODEL_FLAGS), "--model")


def run_stage(args: argparse.Namespace, model_flag: str = "--model") -> Any:
    """Run the parsed command; a stage without a distributed mode refuses a torchrun launch, whose ranks would each
    do all the work (and write the same files, or find each other's locks). An error about the model given names it
    by ``model_flag``, the flag it came with (the model layer, which library callers reach too, says "model")."""
    check_launch(args.command)
    model = getattr(args, "model", None)
    with model_named_by(model_flag, model if isinstance(model, str) else None):
        return args.func(args)


def check_launch(command: str, program: str = "") -> None:
    """Refuse, in one line, a launch environment torchrun would not have set: a non-integer WORLD_SIZE, RANK or
    LOCAL_RANK (read by the logging and by the device choice), a stage without a distributed mode under WORLD_SIZE
    above 1, and there a RANK (LOCAL_RANK; for a stage joining a process group MASTER_ADDR, MASTER_PORT) that is
    missing or a RANK not below WORLD_SIZE: torch would stop with a rendezvous traceback, or each rank take RANK 0.
    ``program`` names what was launched where it is not ``dpr-gc COMMAND`` (a DPR-style script running the stage);
    ``command`` '' is a script that runs no stage (download_dpr_data.py), which has no distributed mode either."""
    env = os.environ
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if env.get(name) and not env[name].strip().isdigit():
            raise DprGcError(f"the environment's {name} must be a whole number (torchrun sets it), got {env[name]!r}; "
                             "unset it to run in one process")
    world = int(env.get("WORLD_SIZE") or 1)
    if world <= 1:
        return
    stage = STAGES.get(command)
    if stage is None or not stage.distributed:
        ranked = ", ".join(name for name, stage in STAGES.items() if stage.distributed)
        with alike_on_every_rank():
            raise DprGcError(f"run {program or 'dpr-gc ' + command} without torchrun: it has no distributed mode "
                             f"(only {ranked} run under torchrun)")
    needed = ("RANK", "LOCAL_RANK") + (("MASTER_ADDR", "MASTER_PORT") if stage.joins_group else ())
    missing = [name for name in needed if not env.get(name)]
    if missing:
        unset = f"{missing[0]} is" if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]} are"
        raise DprGcError(f"WORLD_SIZE={world} is set but {unset} not: launch with torchrun, or unset WORLD_SIZE")
    if int(env["RANK"]) >= world:
        raise DprGcError(f"RANK={env['RANK']} is not below WORLD_SIZE={world}: launch with torchrun, or unset "
                         "WORLD_SIZE")


if __name__ == "__main__":
    sys.exit(main())
