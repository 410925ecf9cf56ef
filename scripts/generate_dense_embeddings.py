"""Embed a passage corpus into shards: ``dpr-gc encode`` under DPR's script name, taking DPR's command lines.

DPR's and GC-DPR's flags work unchanged, and so does DPR's Hydra ``key=value`` style (a switch as ``fp16=true``
or ``=false``)::

    python scripts/generate_dense_embeddings.py --model_file CHECKPOINT --ctx_file psgs_w100.tsv \\
        --shard_id 0 --num_shards 50 --out_file emb/wiki --batch_size 512 --fp16

``--model_file`` is a dpr-gc retriever folder, a Hugging Face model, or a DPR ``.cp`` checkpoint. As DPR writes
``{out_file}_{shard_id}``, shard K goes to the folder ``emb/wiki_K`` (``shard-K-of-N.npy``, ``.ids.txt`` and the
``.json`` manifest), so ``dense_retriever.py --encoded_ctx_file "emb/wiki_*"`` finds every shard; an ``--out_file``
that is an existing folder (or ends in ``/``) receives the shard files directly. ``--fp16`` encodes under fp16
autocast, ``--sequence_length`` caps the passage length, ``--no_cuda`` stays on the CPU; DPR's flags that describe
the model (``--pretrained_model_cfg``, ``--encoder_model_type``, ``--projection_dim``, ``--do_lower_case`` ...) are
read from the checkpoint instead; they, apex's ``--fp16_opt_level`` and a launcher's ``--local_rank`` (the shard comes
from ``--shard_id``/``--num_shards``, else torchrun) are named in one warning line, each with why it has no effect.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpr_gc.base.args import ArgumentParser, flags_as_typed, positive_int  # noqa: E402
from dpr_gc.base.errors import flags_renamed, model_named_by, report_errors  # noqa: E402
from dpr_gc.base.logs import command_main, setup_logging  # noqa: E402
from dpr_gc.retrieval.encode import add_arguments, resolve_shard, run_cli  # noqa: E402

HYDRA_ARG = re.compile(r"^([A-Za-z_][\w.-]*)=(.*)$")
logger = logging.getLogger("generate_dense_embeddings")
# DPR's flags this script takes with no effect, each with why: the model file defines the encoder; --fp16 is torch
# autocast, not apex; the shard comes from --shard_id/--num_shards or torchrun, not from a launcher's --local_rank.
MODEL_DEFINES = "the model file defines them"
IGNORED = {"pretrained_model_cfg": MODEL_DEFINES, "encoder_model_type": MODEL_DEFINES, "pretrained_file": MODEL_DEFINES,
           "projection_dim": MODEL_DEFINES, "do_lower_case": MODEL_DEFINES,
           "fp16_opt_level": "an apex setting: --fp16 encodes under torch autocast",
           "local_rank": "the shard comes from --shard_id/--num_shards, else torchrun's RANK and WORLD_SIZE"}

# ``dpr-gc encode``'s flags as DPR spells them: the encoding this script shares names them in its messages. A
# spelling the user typed (``--sequence_length`` or ``--max_length``, ``--ctx_src`` or ``--ctx_file``) wins.
SCRIPT_FLAGS = {"--output": "--out_file", "--shard-id": "--shard_id", "--num-shards": "--num_shards",
                "--batch-size": "--batch_size", "--max-length": "--sequence_length", "--model": "--model_file",
                "--corpus": "--ctx_file", "--cache-dir": "--cache_dir"}


def script_flags(parser: argparse.ArgumentParser, typed: set[str]) -> dict[str, str]:
    """:data:`SCRIPT_FLAGS`, with each dpr-gc flag named as the user typed it where they typed another spelling."""
    return flags_as_typed(parser, SCRIPT_FLAGS, typed)


def hydra_to_flags(argv: Sequence[str], parser: Optional[ArgumentParser] = None) -> list[str]:
    """Turn DPR's ``key=value`` arguments into ``--key value``, a switch's ``key=true`` into ``--key`` and its
    ``key=false`` into nothing (:meth:`~dpr_gc.base.args.ArgumentParser.hydra_switch` of ``parser``, default
    :func:`build_parser`'s); other arguments pass through."""
    parser = parser or build_parser()
    out: list[str] = []
    for arg in argv:
        m = HYDRA_ARG.match(arg)
        if not m or arg.startswith("-"):
            out.append(arg)
            continue
        switch = parser.hydra_switch(m.group(1), m.group(2))
        out.extend([f"--{m.group(1)}", m.group(2)] if switch is None else switch)
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, dpr_aliases=True)
    parser.add_argument("--sequence_length", dest="max_length", type=positive_int,
                        help="passage max tokens (DPR's name)")
    parser.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                        help="encode under fp16 autocast (as GC-DPR)")
    parser.add_argument("--no_cuda", action="store_true", help="encode on the CPU")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, plus the dependencies' own log lines and progress bars")
    parser.add_argument("--pretrained_model_cfg", "--encoder_model_type", "--pretrained_file", "--fp16_opt_level",
                        dest="unused", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--projection_dim", "--local_rank", dest="unused", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--do_lower_case", dest="unused", action="store_true", help=argparse.SUPPRESS)
    return parser


def output_folder(out_file: str, shard_id: Optional[int], num_shards: Optional[int]) -> str:
    """DPR's ``{out_file}_{shard_id}`` naming, unless ``out_file`` is a folder already."""
    if Path(out_file).is_dir() or out_file.endswith(("/", "\\")):
        return out_file
    shard, _ = resolve_shard(shard_id, num_shards)
    return f"{out_file}_{shard}"


def ignored_flags(typed: set[str]) -> str:
    """The flags of :data:`IGNORED` among ``typed`` (names without dashes), grouped by their reason:
    ``--projection_dim --do_lower_case (the model file defines them); --local_rank (...)``."""
    groups: dict[str, list[str]] = {}
    for name, reason in IGNORED.items():
        if name in typed:
            groups.setdefault(reason, []).append(f"--{name}")
    return "; ".join(f"{' '.join(flags)} ({reason})" for reason, flags in groups.items())


@command_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    flags = hydra_to_flags(sys.argv[1:] if argv is None else argv, parser)
    args = parser.parse_args(flags)
    setup_logging(args.verbose)
    typed = {f.split("=", 1)[0].lstrip("-") for f in flags if f.startswith("--")}
    names = script_flags(parser, {f"--{name}" for name in typed})
    unused = ignored_flags(typed)
    if unused:
        logger.warning("accepted with no effect here: %s", unused)
    device = args.device or ("cpu" if args.no_cuda else None)

    def run() -> dict:
        """The shard's output folder (a shard outside --num_shards is refused here, as one error line), encoded."""
        with flags_renamed(names), model_named_by("--model", args.model):
            args.output = output_folder(args.output, args.shard_id, args.num_shards)
            return run_cli(args, args.output, device)

    return report_errors(run)


if __name__ == "__main__":
    sys.exit(main())
