#!/usr/bin/env python
"""DPR-compatible front end of ``dpr-gc retrieve``: DPR's flag names, the same library calls.

    python scripts/dense_retriever.py --model_file MODEL --ctx_file psgs_w100.tsv --qa_file nq-test.qa.csv \\
        --encoded_ctx_file "emb/wiki_*" --out_file results.json --n-docs 100 --validation_workers 32 --batch_size 64

``--encoded_ctx_file`` is an encode output folder or a glob: of its ``shard-*`` files, or of the ``{out_file}_N``
folders that ``generate_dense_embeddings.py --out_file PREFIX`` writes (one per shard, as DPR's ``_N`` files). The
index is built in memory (exact, or HNSW with ``--hnsw_index``, ``--index_buffer`` rows at a time), or loaded from /
saved to ``--index_path`` (``--save_or_load_index``: the folder ``PREFIX.index`` beside the shards, as DPR does); a
saved index of another kind than asked for, built with other settings of its kind (``--nlist``, ``--hnsw-m``)
or from other shards, is refused rather than reused.
Questions with answers are evaluated unasked (top-k answer accuracy, as DPR prints it), others with ``--evaluate``.
``--model_file`` may be a DPR ``.cp`` checkpoint. Hydra-style ``key=value`` arguments (as newer DPR versions take)
are accepted too, lists as DPR's README writes them (``encoded_ctx_files=[\\"emb1/wiki_*\\",\\"emb2/wiki_*\\"]``:
``--encoded_ctx_file`` takes several globs; a switch as ``hnsw_index=true`` or ``=false``). Flags DPR has and
this script does not need are named in one warning line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

try:
    import dpr_gc  # noqa: F401
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpr_gc.base.args import (ArgumentParser, ExtendGiven, device_arg, flags_as_typed, nonnegative_int, output_dir,
                              output_file, positive_int)
from dpr_gc.base.errors import DprGcError, flags_renamed, model_named_by, report_errors
from dpr_gc.base.guard import guarded
from dpr_gc.base.files import require_file
from dpr_gc.base.logs import command_main, setup_logging
from dpr_gc.cli import check_launch
from dpr_gc.data.corpus import iter_queries
from dpr_gc.model.hub import check_model_source
from dpr_gc.retrieval.index import (BUILT_WITH, DenseIndex, IndexBuild, IndexParams, add_index_arguments, add_shards,
                                    check_built_from, index_exists, params_from_args, set_threads, shard_ids)
from dpr_gc.retrieval.index_params import param_rules
from dpr_gc.retrieval.shards import has_shards, no_shards_message, read_manifests
from dpr_gc.model.retriever import add_prefix_arguments
from dpr_gc.base.settings import refuse_flags_that_do_not_apply
from dpr_gc.retrieval.retrieve import (APPLIES, MATCH_CHOICES, QRELS, QUERIES, RetrieveJob, RetrieveSettings,
                                       retrieve_with_flags)

logger = logging.getLogger("dense_retriever")
# DPR/GC-DPR flags with no effect here: the model file defines the encoder; answers are matched in-process.
IGNORED_VALUE = ("--pretrained_model_cfg", "--encoder_model_type", "--pretrained_file", "--projection_dim",
                 "--sequence_length", "--local_rank", "--fp16_opt_level", "--validation_workers", "--q_encoding_path")
IGNORED_SWITCH = ("--do_lower_case", "--fp16", "--encode_q_and_save", "--re_encode_q")
# ``dpr-gc retrieve``'s flags as this script spells them: the retrieval it shares, and the output guard, name them in
# their messages. A spelling the user typed (``--qa_dataset`` or ``--qa_file``, ``--n-docs`` or ``--n_docs``) wins
# (:func:`script_flags`).
SCRIPT_FLAGS = {"--output": "--out_file", "--trec-run": "--trec_run", "--cache-dir": "--cache_dir",
                "--model": "--model_file", "--corpus": "--ctx_file", "--queries": "--qa_file", "--top-k": "--n_docs",
                "--batch-size": "--batch_size", "--run-tag": "--run_tag", "--skip-model-check": "--skip_model_check",
                "--block-size": "--index_buffer", "--embeddings": "--encoded_ctx_file"}


def script_flags(parser: argparse.ArgumentParser, typed: set[str]) -> dict[str, str]:
    """:data:`SCRIPT_FLAGS`, with each dpr-gc flag named as the user typed it where they typed another spelling."""
    return flags_as_typed(parser, SCRIPT_FLAGS, typed)


def embeddings_folders(specs: Sequence[str]) -> list[Path]:
    """Encode output folders, each spec given as one folder, a glob of shard files inside one, or a glob of
    ``PREFIX_N`` folders (one per shard, as ``generate_dense_embeddings.py --out_file PREFIX`` writes them); a
    folder two specs match is counted once. Errors name the flag ``--embeddings``, which the script's
    :func:`~dpr_gc.base.errors.flags_renamed` spells as typed (``--encoded_ctx_file`` or ``--encoded_ctx_files``)."""
    folders: dict[str, Path] = {}
    for spec in specs:
        matched = [Path(spec)] if Path(spec).is_dir() else [Path(p) if Path(p).is_dir() else Path(p).parent
                                                            for p in glob.glob(spec)]
        if not matched:
            raise DprGcError(f"--embeddings {spec!r} matches no files; give the encode output folder(s)")
        folders.update((os.path.realpath(folder), folder) for folder in matched)
    return sorted(folders.values())


def merged_view(folders: list[Path], view: Path) -> Path:
    """One folder of links to the shard files (``shard-*``) of ``folders``, so all shards form one index; other files
    beside them are left out. A folder without finished shards is refused, naming it."""
    for folder in folders:
        if not has_shards(folder):
            raise DprGcError(no_shards_message(folder))
    linked: dict[str, Path] = {}  # a shard file's name -> the folder its link in ``view`` points into
    for folder in folders:
        for item in folder.iterdir():
            if item.is_file() and item.name.startswith("shard-"):
                if item.name in linked:
                    raise DprGcError(shard_clash(item, linked[item.name]))
                os.symlink(item.resolve(), view / item.name)
                linked[item.name] = folder
    return view


def manifest_corpus(path: Path) -> Optional[tuple[str, str]]:
    """The corpus the shard manifest ``path`` names and its fingerprint; None where it names none or is unreadable."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not manifest.get("corpus_fingerprint"):
        return None
    return str(manifest.get("corpus")), str(manifest["corpus_fingerprint"])


def shard_clash(item: Path, other: Path) -> str:
    """Why the shard file ``item`` cannot join a view that links the file of that name in the folder ``other``: the
    two folders look like separate encodings where their manifests name corpora of different fingerprints, else the
    shard is in both."""
    shard = re.sub(r"(\.ids\.txt|\.json|\.npy)$", "", item.name)
    corpora = [manifest_corpus(folder / f"{shard}.json") for folder in (other, item.parent)]
    if corpora[0] and corpora[1] and corpora[0][1] != corpora[1][1]:
        return (f"{item.name} is in {other} and {item.parent}, which look like separate encodings (of "
                f"{corpora[0][0]} and {corpora[1][0]}): give the --embeddings folders of one encoding of one corpus")
    return f"{item.name} is in more than one of the --embeddings folders; each shard must be encoded once"


def dpr_index_path(folders: list[Path]) -> str:
    """Where ``--save_or_load_index`` keeps the index: ``PREFIX.index`` for ``PREFIX_N`` folders, as DPR does, else
    ``FOLDER.index`` beside the first folder (never inside an input folder)."""
    m = re.match(r"^(.*)_\d+$", str(folders[0]))
    return f"{m.group(1)}.index" if m else f"{folders[0]}.index"


def hydra_values(value: str) -> list[str]:
    """The values of a hydra override: the items of a list ``[a,b]`` or ``["a","b"]`` (quotes the shell kept from
    DPR's ``[\\"a\\"]`` removed), else the one value, unquoted."""
    if not (value.startswith("[") and value.endswith("]")):
        return [hydra_unquoted(value)]
    inner = value[1:-1].strip()
    try:
        items = ast.literal_eval(f"[{inner}]")
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        items = [hydra_unquoted(item.strip()) for item in inner.split(",")] if inner else []
    return items


def hydra_unquoted(value: str) -> str:
    """``value`` without one pair of quotes around it."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value


def hydra_to_flags(argv: list[str], parser: Optional[ArgumentParser] = None) -> list[str]:
    """Turn DPR/hydra ``key=value`` arguments into ``--key=value``; a list ``key=[a,b]`` into ``--key a b`` (the
    flags that take several values take them all, one that takes one refuses several, :func:`refuse_several`, an
    unknown one's rest is named in the no-effect warning); a switch's ``key=true`` into ``--key``, its ``key=false``
    into nothing (:meth:`~dpr_gc.base.args.ArgumentParser.hydra_switch` of ``parser``, default
    :func:`build_parser`'s)."""
    parser = parser or build_parser()
    out = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            out.append(arg)
            continue
        key, value = arg.split("=", 1)
        switch = parser.hydra_switch(key, hydra_unquoted(value))
        if switch is not None:
            out.extend(switch)
            continue
        values = hydra_values(value)
        refuse_several(parser, key, value, values)
        out.extend([f"--{key}={values[0]}"] if len(values) == 1 else [f"--{key}", *values] if values else
                   [f"--{key}="])
    return out


def refuse_several(parser: ArgumentParser, key: str, value: str, values: list[str]) -> None:
    """Refuse a hydra list of several ``values`` for a flag of ``parser`` that takes one (``ctx_datatsets=[a,b]``),
    naming ``key``: the values after the first would be left out (a flag with no effect here takes any)."""
    action = parser._option_string_actions.get(f"--{key}")
    if len(values) < 2 or action is None or action.nargs is not None or action.dest.startswith("ignored_"):
        return
    why = "; the passages come from one file: join them into one (and encode that)" if action.dest == "corpus" else ""
    parser.error(f"{key}={value} gives {len(values)} values but --{key} takes one{why}")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_file", "--model", dest="model", help="retriever folder or HF model")
    p.add_argument("--qa_dataset", "--qa_file", dest="queries", required=True,
                   help="questions: DPR QA TSV/CSV, NQ-open JSONL or BEIR queries.jsonl")
    p.add_argument("--ctx_datatsets", "--ctx_datasets", "--ctx_file", dest="corpus",
                   help="passages TSV / corpus.jsonl (default: the corpus recorded with the embeddings)")
    p.add_argument("--encoded_ctx_file", "--encoded_ctx_files", dest="embeddings", nargs="+",
                   help="encode output folder(s), or globs of their shard files or of PREFIX_N shard folders")
    p.add_argument("--index_path", type=output_dir,
                   help="load the index from this folder if it holds one, else save it there")
    p.add_argument("--hnsw_index", action="store_true", help="build an HNSW index instead of an exact one")
    p.add_argument("--save_or_load_index", action="store_true",
                   help="load the index from PREFIX.index beside the shards if there, else build and save it there")
    p.add_argument("--no_cuda", action="store_true", help="encode questions on the CPU")
    p.add_argument("--out_file", type=output_file, dest="output", help="DPR retriever JSON output")
    p.add_argument("--compact", action="store_true", help="results without passage text (ids, scores, has_answer)")
    p.add_argument("--workers", type=nonnegative_int, default=0,
                   help="answer-matching processes (0: all cores)")
    p.add_argument("--n-docs", "--n_docs", dest="top_k", type=positive_int, default=100,
                   help="passages per question")
    p.add_argument("--batch_size", dest="batch_size", type=positive_int, default=64, help="questions per encoder batch")
    p.add_argument("--match", choices=MATCH_CHOICES, default="string", help="answer matching for has_answer")
    p.add_argument("--trec_run", "--trec-run", type=output_file, dest="trec_run", help="also write a TREC run file")
    p.add_argument("--run_tag", dest="run_tag", help=f"TREC run tag (default: {RetrieveSettings().run_tag})")
    p.add_argument("--qrels", help="relevance judgments (BEIR/TREC): retrieve judged queries, use in --evaluate")
    p.add_argument("--evaluate", action="store_true", help="print answer accuracy and/or qrels metrics (answer "
                                                           "accuracy is printed unasked where the questions have "
                                                           "answers, as DPR does)")
    p.add_argument("--k", type=positive_int, nargs="+", action=ExtendGiven,
                   help="cut-offs for --evaluate (default: those of 1 5 10 20 100 below --n-docs, and --n-docs)")
    p.add_argument("--device", type=device_arg, help="torch device for the question encoder")
    p.add_argument("--cache_dir", dest="cache_dir", type=output_dir, help="where parsed corpora are cached")
    p.add_argument("--skip_model_check", dest="skip_model_check", action="store_true",
                   help="allow a model whose weights differ from the one that encoded the passages")
    p.add_argument("--threads", type=positive_int, help="FAISS threads")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, plus the dependencies' own log lines and progress bars")
    add_index_arguments(p)
    add_prefix_arguments(p)
    p.add_argument("--index_buffer", dest="block_size", type=positive_int,
                   help="rows added to the index per block (DPR's name)")
    for flag in IGNORED_VALUE:
        p.add_argument(flag, dest="ignored_" + flag.strip("-").replace("-", "_"), default=None, help=argparse.SUPPRESS)
    for flag in IGNORED_SWITCH:
        p.add_argument(flag, dest="ignored_" + flag.strip("-"), action="store_true", help=argparse.SUPPRESS)
    return p


def kind_asked(params: IndexParams, hnsw_flag: bool) -> tuple[str, str, str]:
    """The index kind ``params`` ask for, the flag that asks for it as a phrase, and what undoes that flag."""
    if params.factory:
        return "factory", f"--factory {params.factory!r} asks for that index", f"drop --factory {params.factory!r}"
    if hnsw_flag:
        return "hnsw", "--hnsw_index asks for an hnsw index", "drop --hnsw_index"
    if params.kind != "flat":
        return params.kind, f"--kind {params.kind} asks for an {params.kind} index", f"drop --kind {params.kind}"
    return "flat", "a flat index is asked for (no --hnsw_index)", "add --hnsw_index"


def built_otherwise(dense: DenseIndex, params: IndexParams, kind: str) -> list[tuple[str, Any, Any]]:
    """``(flag, saved value, asked value)`` for each build setting of ``kind`` (``--nlist``, ``--hnsw-m``, ...) that
    the saved index ``dense`` was built with otherwise than ``params`` ask (one left to its default, None, as for
    ``--nlist``, takes what the index has)."""
    recorded, rules = dense.meta.get("params") or {}, param_rules()
    return [(rules[name][0], recorded[name], getattr(params, name)) for name in BUILT_WITH.get(kind, ())
            if getattr(params, name) is not None and recorded.get(name) not in (None, getattr(params, name))]


def check_saved_index(dense: DenseIndex, folders: list[Path], where: str, params: IndexParams,
                      hnsw_flag: bool) -> None:
    """Refuse, in one line, a saved index of another kind (or factory) than the flags ask for, or built with other
    settings of that kind (:func:`built_otherwise`: ``--nlist``, ``--hnsw-m``), or built from other
    shards than the ``--encoded_ctx_file`` folders hold (a subset would answer from shards not given), or from
    shards encoded otherwise (:func:`check_built_from`)."""
    kind, asked, undo = kind_asked(params, hnsw_flag)
    if dense.meta.get("kind") != kind or (kind == "factory" and dense.meta.get("factory") != params.factory):
        article = "an" if str(dense.meta.get("kind"))[:1] in "aeioh" else "a"
        raise DprGcError(f"the index in {where} is {article} {dense.meta.get('kind')} index "
                         f"({dense.meta.get('factory')}) but {asked}; delete {where} to build it anew, or {undo}")
    for flag, was, asked_now in built_otherwise(dense, params, kind):
        raise DprGcError(f"the index in {where} was built with {flag} {was} but {flag} {asked_now} is asked for; "
                         f"delete {where} to build it anew, or give {flag} {was}")
    built = [shard["embeddings"] for shard in dense.meta.get("shards") or ()]
    given = sorted(Path(m["embeddings"]).name for folder in folders for m in read_manifests(folder, complete=False))
    if built and folders and sorted(built) != given:
        raise DprGcError(f"the index in {where} was built from the shards {', '.join(sorted(built))} but "
                         f"--embeddings gives {', '.join(given)}; delete {where} to build it anew, or give "
                         "the --embeddings it was built from")
    for folder in folders:
        check_built_from(dense, folder, where)


def load_or_build_index(embeddings: Optional[list[str]], index_path: Optional[str], save_or_load: bool,
                        params: IndexParams, build: IndexBuild, hnsw_flag: bool = False,
                        label: Optional[str] = None) -> tuple[DenseIndex, str]:
    """The index in ``index_path`` if complete (with ``save_or_load``, default ``PREFIX.index`` beside the shards;
    refused where it is not what the flags and shards ask for, :func:`check_saved_index`), else one built from the
    encode output folders ``embeddings`` (:func:`embeddings_folders`) and saved to ``index_path`` when given; with
    its name in the summary (``label``: the ``--encoded_ctx_file`` typed)."""
    folders = [Path(folder) for folder in embeddings or ()]
    if save_or_load and not index_path and folders:
        index_path = dpr_index_path(folders)
    if index_exists(index_path):
        logger.info("loading the index from %s", index_path)
        dense = DenseIndex.read(index_path)
        check_saved_index(dense, folders, str(index_path), params, hnsw_flag)
        return dense, index_path
    if not folders:
        raise DprGcError("give --embeddings (the encode output folder) or an --index_path holding an index")
    with tempfile.TemporaryDirectory(prefix="dense-retriever-") as tmp:
        folder = folders[0] if len(folders) == 1 else merged_view(folders, Path(tmp))
        index, shards, _ = add_shards(folder, params, None, build.train_sample, build.block_size, build.seed)
        if index_path:
            index.write(index_path, ids=shard_ids(shards))
            logger.info("saved the index to %s", index_path)
    return index, f"{index.meta['factory']} over {label or ', '.join(map(str, folders))}"


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse a missing --qa_file, --qrels, --ctx_file or --model_file (named as typed) before the index is built,
    which takes hours over a large corpus."""
    require_file(args.queries, QUERIES)
    if args.qrels:
        require_file(args.qrels, QRELS)
    if args.corpus:
        require_file(args.corpus, "--corpus file")
    if args.model:
        check_model_source(str(args.model))


def has_answers(queries: str) -> bool:
    """Whether a question of ``queries`` has answers (the first one that does ends the reading); a file that cannot
    be read says nothing here, and the retrieval's own check names its fault."""
    try:
        return any(query.get("answers") for query in iter_queries(queries, log=False))
    except DprGcError:
        return False


def evaluate_as_dpr(args: argparse.Namespace) -> None:
    """Turn on ``--evaluate`` where the questions have answers, as DPR's dense_retriever always prints its top-k
    accuracy for them, saying so in one line."""
    if not args.evaluate and has_answers(args.queries):
        args.evaluate = True
        logger.info("the questions have answers: their top-k accuracy is evaluated as DPR's dense_retriever does")


def refuse_ignored_flags(args: argparse.Namespace) -> None:
    """Refuse, as ``dpr-gc retrieve`` does, a flag that would be ignored (its ``APPLIES``): ``--k`` without
    ``--evaluate`` (after questions with answers turned it on), ``--run_tag`` without ``--trec_run``, ``--compact``
    without ``--out_file``; a ``--run_tag`` typed counts even at the default tag, which a run_tag not typed (None)
    takes here."""
    default = RetrieveSettings().run_tag
    typed_tag = args.run_tag is not None
    seen = argparse.Namespace(**{**vars(args), "run_tag": (args.run_tag,) if typed_tag else default})
    refuse_flags_that_do_not_apply(RetrieveJob, seen, APPLIES)
    args.run_tag = args.run_tag if typed_tag else default


def named_unknowns(parser: Any, unknown: list[str]) -> list[str]:
    """Each unknown flag with the values typed after it, and the closest flag of ours where one is close:
    ``--n_dosc 5 (did you mean --n_docs?)``."""
    groups: list[list[str]] = []
    for word in unknown:
        if word.startswith("-") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    named = []
    for flag, *values in groups:
        close = parser.closest_option(flag) if flag.startswith("-") else None
        named.append(" ".join([flag, *values]) + (f" (did you mean {close}?)" if close else ""))
    return named


@command_main
def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    flags = hydra_to_flags(list(sys.argv[1:] if argv is None else argv), parser)
    args, unknown = parser.parse_known_args(flags)
    setup_logging(args.verbose)
    typed = {f.split("=", 1)[0] for f in flags if f.startswith("--")}
    ignored = [f for f in IGNORED_VALUE + IGNORED_SWITCH if f in typed] + named_unknowns(parser, unknown)
    if ignored:
        logger.warning("accepted with no effect here: %s", " ".join(ignored))

    names = script_flags(parser, typed)

    @guarded(inputs=("model", "queries", "corpus", "embeddings", "qrels"),  # dpr-gc's names, renamed as typed
             outputs={"output": "file", "trec_run": "file", "index_path=--index_path": "whole", "cache_dir": "self"})
    def run(args: argparse.Namespace) -> None:
        started = time.perf_counter()
        check_inputs(args)
        evaluate_as_dpr(args)
        refuse_ignored_flags(args)
        set_threads(args.threads)
        params = params_from_args(args)
        index, name = load_or_build_index(args.embeddings, args.index_path, args.save_or_load_index,
                                          dataclasses.replace(params, kind="hnsw") if args.hnsw_index else params,
                                          IndexBuild(args.train_sample, args.block_size, args.seed),
                                          args.hnsw_index, args.embeddings_given)
        retrieve_with_flags(args, index, name, device=args.device or ("cpu" if args.no_cuda else None),
                            flag_names=names, started=started)

    def run_named() -> None:
        """The folders ``--encoded_ctx_file`` matches in its place, so that the guard compares the outputs with each."""
        check_launch("retrieve", program="dense_retriever.py")  # as dpr-gc retrieve: every rank would do all of it
        with flags_renamed(names), model_named_by("--model", args.model):
            args.embeddings_given = " ".join(args.embeddings or ())
            if args.embeddings and all(args.embeddings):  # an empty one is refused by the guard
                args.embeddings = [str(folder) for folder in embeddings_folders(args.embeddings)]
            run(args)
    return report_errors(run_named)


if __name__ == "__main__":
    sys.exit(main())
