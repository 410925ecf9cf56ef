"""Build the default retrieval dataset from Python's standard library source.

Every machine with Python has the standard library, so the demo pipeline needs no download. Each public
function, method or class with an informative docstring becomes one question: the query is the docstring's
summary (first sentence) and the gold passage is the rest of the docstring followed by the definition's code
with the whole docstring removed, so the summary cannot leak into its own passage. The answer is the short
name (e.g. ``splitext``): DPR-style answer matching then counts a passage as a hit when it mentions that name.

The data is written in the formats users bring (BEIR corpus/queries/qrels, DPR training JSON, DPR QA TSV and
DPR passages TSV), so the rest of the pipeline runs on it exactly as it would on theirs.
"""

from __future__ import annotations

import argparse
import ast
import copy
import csv
import hashlib
import json
import logging
import random
import re
import sys
import sysconfig
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from tqdm import tqdm

from ..base.args import output_dir, positive_int, seed_int
from ..base.errors import DprGcError
from ..base.guard import guarded
from ..base.files import PathLike, atomic_open, read_json_object, write_json
from ..base.settings import add_arguments, check, setting
from ..base.tables import format_summary

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "dev", "test")
N_HARD_NEGATIVES = 3
N_RANDOM_NEGATIVES = 2
DISTRACTORS_PER_EXAMPLE = 1.0
MIN_SUMMARY_WORDS = 4
MAX_SUMMARY_WORDS = 50
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "encodings",
                       "ensurepip", "turtledemo", "pydoc_data", "lib-dynload", "__pycache__", "__phello__"})
SKIP_FILES = frozenset({"__main__.py", "this.py", "antigravity.py", "__hello__.py"})
# Removed from the stdlib in Python 3.12/3.13 (PEP 594, PEP 632): skipped so the data barely depends on the version.
SKIP_MODULES = frozenset({"distutils", "asynchat", "asyncore", "imp", "smtpd", "aifc", "audioop", "cgi", "cgitb",
                          "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis", "nntplib", "ossaudiodev", "pipes",
                          "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib", "tkinter.tix"})
MAX_QUERIES_PER_MODULE = 30
BOILERPLATE = ("docstring", "return self", "implement ", "see ", "same as", "deprecated", "alias for",
               "undocumented", "xxx", "todo", "override", "for internal use", "internal", "used internally",
               "helper", "not implemented", "dummy", "placeholder", "unused", "for backward", "for backwards",
               "for compatibility", "do not use", "stub", "this method is", "this function is", "abstract method")
OUTPUT_FILES = {"corpus": "corpus.jsonl", "queries": "queries.jsonl", "qrels_train": "qrels/train.tsv",
                "qrels_dev": "qrels/dev.tsv", "qrels_test": "qrels/test.tsv", "dpr_train": "dpr_train.json",
                "dpr_dev": "dpr_dev.json", "test_qa": "test_qa.tsv", "test_queries": "test_queries.jsonl",
                "passages": "passages.tsv"}
BUILD_MARKER = ".make-stdlib-data.building"
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


@dataclass(frozen=True)
class Definition:
    """One public definition: its passage, and its query summary when that summary is usable."""

    pid: str
    module: str
    name: str
    text: str
    summary: Optional[str]

    @property
    def group(self) -> str:
        """Top-level package: the unit of the train/dev/test split, so sibling modules never straddle splits."""
        return self.module.split(".")[0]


def _folded(text: str) -> str:
    """``text`` lower-cased, every run of whitespace made one space (summaries compare by this)."""
    return " ".join(text.lower().split())


def _seeded_key(seed: int, text: str) -> str:
    """A stable pseudo-random sort key (Python's ``hash`` is salted per process, so it is not used)."""
    return hashlib.sha1(f"{seed}:{text}".encode("utf-8")).hexdigest()


def _stdlib_modules(root: Path) -> list[tuple[str, Path]]:
    """Sorted ``(module name, path)`` of public stdlib source files, skipping tests, data tables and tools."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if path.name in SKIP_FILES or path.name.startswith("test_"):
            continue
        if any(d in SKIP_DIRS or d.startswith(("config-", "_", ".")) for d in dirs):
            continue
        if path.stem.startswith("_") and path.name != "__init__.py":
            continue
        parts = dirs if path.name == "__init__.py" else dirs + (path.stem,)
        name = ".".join(parts)
        dead = any(name == m or name.startswith(m + ".") for m in SKIP_MODULES)
        if parts and all(p.isidentifier() for p in parts) and not dead:
            found.append((name, path))
    return sorted(found)


def split_docstring(doc: str) -> tuple[str, str]:
    """Split a cleaned docstring into its summary (first sentence of the first paragraph) and the rest."""
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    first = " ".join(paragraphs[0].split())
    match = _SENTENCE_END.search(first)
    summary, rest = (first[:match.start()], first[match.end():]) if match else (first, "")
    if len(paragraphs) > 1:
        rest = f"{rest}\n\n{paragraphs[1]}".strip()
    return summary, rest


def is_informative(summary: str, name: str) -> bool:
    """Whether a summary makes a fair query: a real sentence, not boilerplate or a call signature."""
    words = summary.split()
    low = summary.lower()
    return (MIN_SUMMARY_WORDS <= len(words) <= MAX_SUMMARY_WORDS and summary[0].isalpha()
            and not low.startswith(BOILERPLATE) and not summary.startswith(f"{name}(")
            and ">>>" not in summary and "->" not in summary)


def _code_without_docstrings(lines: list[bytes], node: ast.AST) -> str:
    """Source of a function with every docstring inside it blanked (AST columns are UTF-8 byte offsets)."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    seg = [bytearray(line) for line in lines[start - 1:node.end_lineno]]
    for sub in ast.walk(node):
        if isinstance(sub, _DEFS) and ast.get_docstring(sub, clean=False) is not None:
            d = sub.body[0]
            for ln in range(d.lineno, d.end_lineno + 1):
                row = seg[ln - start]
                lo = d.col_offset if ln == d.lineno else 0
                hi = d.end_col_offset if ln == d.end_lineno else len(row)
                row[lo:hi] = b" " * (hi - lo)
    return b"\n".join(bytes(row) for row in seg).decode("utf-8", "replace")


def _skeleton(node: ast.ClassDef) -> ast.ClassDef:
    """A class with docstrings dropped and method bodies elided, so method summaries cannot leak into it."""
    body: list[ast.stmt] = []
    for stmt in node.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, ast.ClassDef):
            stmt = _skeleton(stmt)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stmt = copy.copy(stmt)
            stmt.body = [ast.Expr(ast.Constant(Ellipsis))]
        body.append(stmt)
    out = copy.copy(node)
    out.body = body or [ast.Expr(ast.Constant(Ellipsis))]
    return out


def _passage_text(doc_rest: str, code: str, max_words: int) -> str:
    """Docstring remainder (at most half the budget, so the definition line with its name always fits) + code."""
    doc_words = doc_rest.split()[:max_words // 2]
    return " ".join((doc_words + code.split())[:max_words])


def _definitions(module: str, source: bytes, tree: ast.Module, max_words: int) -> Iterator[Definition]:
    """Public top-level functions and classes of a module and the public methods of its public classes."""
    lines = source.splitlines()
    todo: list[tuple[str, ast.AST]] = [(module, n) for n in tree.body if isinstance(n, _DEFS)]
    while todo:
        prefix, node = todo.pop(0)
        if node.name.startswith("_"):
            continue
        pid = f"{prefix}.{node.name}"
        if isinstance(node, ast.ClassDef):
            todo.extend((pid, n) for n in node.body if isinstance(n, _DEFS))
            code = ast.unparse(_skeleton(node))
        else:
            code = _code_without_docstrings(lines, node)
        doc = ast.get_docstring(node, clean=True) or ""
        summary, rest = split_docstring(doc) if doc.strip() else ("", "")
        if summary and is_informative(summary, node.name) and _folded(summary) not in _folded(f"{rest} {code}"):
            yield Definition(pid, module, node.name, _passage_text(rest, code, max_words), summary)
        else:
            yield Definition(pid, module, node.name, _passage_text(doc, code, max_words), None)


def collect_definitions(root: PathLike, max_passage_words: int = 200) -> tuple[list[Definition], int]:
    """Parse every public stdlib module under ``root``; return sorted unique definitions and files skipped."""
    by_pid: dict[str, Definition] = {}
    skipped = 0
    for module, path in tqdm(_stdlib_modules(Path(root)), desc="parse stdlib", unit=" files", disable=None):
        try:
            source = path.read_bytes()
            tree = ast.parse(source, filename=str(path))
        except (SyntaxError, ValueError, OSError):
            skipped += 1
            continue
        for d in _definitions(module, source, tree, max_passage_words):
            by_pid.setdefault(d.pid, d)
    defs = [by_pid[k] for k in sorted(by_pid)]
    counts: dict[str, int] = {}
    for d in defs:
        if d.summary:
            counts[_folded(d.summary)] = counts.get(_folded(d.summary), 0) + 1
    defs = [d if not d.summary or counts[_folded(d.summary)] == 1 else Definition(d.pid, d.module, d.name, d.text, None)
            for d in defs]
    return defs, skipped


def assign_splits(examples: list[Definition], seed: int, dev_fraction: float,
                  test_fraction: float) -> dict[str, str]:
    """Map each top-level package to a split: packages in seeded-hash order fill test, then dev, rest train.

    Only packages of at most a quarter of a split's target may join dev or test, so no single big package
    (tkinter, asyncio) becomes a whole evaluation split; an empty split takes the smallest train package.
    """
    sizes: dict[str, int] = {}
    for e in examples:
        sizes[e.group] = sizes.get(e.group, 0) + 1
    targets = {"test": test_fraction * len(examples), "dev": dev_fraction * len(examples)}
    filled = {"test": 0, "dev": 0}
    out = {}
    for group in sorted(sizes, key=lambda g: _seeded_key(seed, g)):
        out[group] = "train"
        for split in ("test", "dev"):
            n, size, target = filled[split], sizes[group], targets[split]
            if n < target and n + size <= 1.2 * target and size <= max(1.0, target / 4):
                out[group], filled[split] = split, n + size
                break
    for split in ("test", "dev"):
        train = [g for g in sorted(out, key=lambda g: (sizes[g], _seeded_key(seed, g))) if out[g] == "train"]
        if split not in out.values() and len(train) > 1:
            out[train[0]] = split
    return out


def select_examples(usable: list[Definition], seed: int, max_examples: Optional[int]) -> list[Definition]:
    """At most ``MAX_QUERIES_PER_MODULE`` per module (so GUI wrappers do not dominate), then at most
    ``max_examples`` overall; both are seeded subsamples. Returned sorted by passage id."""
    ranked = sorted(usable, key=lambda d: _seeded_key(seed, d.pid))
    per_module: dict[str, int] = {}
    kept = []
    for d in ranked:
        per_module[d.module] = per_module.get(d.module, 0) + 1
        if per_module[d.module] <= MAX_QUERIES_PER_MODULE:
            kept.append(d)
    return sorted(kept[:max_examples], key=lambda d: d.pid)


def _ctx(d: Definition) -> dict[str, str]:
    return {"title": d.pid, "text": d.text, "passage_id": d.pid}


def _pick(rng: random.Random, pool: list[Definition], n: int, taken: set[str], answer: str,
          lower: dict[str, str]) -> list[Definition]:
    """Up to ``n`` random passages of ``pool`` not yet taken and not mentioning ``answer``; marks them taken."""
    if n <= 0:
        return []
    cands = rng.sample(pool, min(len(pool), 8 * n + 8))
    out = [d for d in cands if d.pid not in taken and answer not in lower[d.pid]][:n]
    taken.update(d.pid for d in out)
    return out


def _dpr_records(examples: list[Definition], corpus: list[Definition], split_of: dict[str, str],
                 seed: int) -> list[dict[str, Any]]:
    """DPR training records. Hard negatives are siblings from the same module (topped up from the same package,
    then the split), playing DPR's BM25 negatives; random negatives come from the same split. Like DPR's BM25
    negatives, no negative mentions the answer name."""
    lower = {d.pid: d.text.lower() for d in corpus}
    by_module: dict[str, list[Definition]] = {}
    by_group: dict[str, list[Definition]] = {}
    by_split: dict[str, list[Definition]] = {}
    for d in corpus:
        by_module.setdefault(d.module, []).append(d)
        by_group.setdefault(d.group, []).append(d)
        by_split.setdefault(split_of.get(d.group, "train"), []).append(d)
    records = []
    for ex in examples:
        rng = random.Random(f"{seed}:{ex.pid}")
        taken, answer, split_pool = {ex.pid}, ex.name.lower(), by_split[split_of[ex.group]]
        hard: list[Definition] = []
        for pool in (by_module[ex.module], by_group[ex.group], split_pool):
            hard += _pick(rng, pool, N_HARD_NEGATIVES - len(hard), taken, answer, lower)
        rand = _pick(rng, split_pool, N_RANDOM_NEGATIVES, taken, answer, lower)
        records.append({"question": ex.summary, "answers": [ex.name], "positive_ctxs": [_ctx(ex)],
                        "negative_ctxs": [_ctx(d) for d in rand], "hard_negative_ctxs": [_ctx(d) for d in hard]})
    return records


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _write_outputs(out: Path, corpus: list[Definition], queries: list[tuple[str, str, Definition]],
                   split_of: dict[str, str], seed: int) -> None:
    """Write every file of ``OUTPUT_FILES``; ``queries`` holds ``(query id, split, example)``."""
    _write_jsonl(out / OUTPUT_FILES["corpus"], [{"_id": d.pid, "title": d.pid, "text": d.text} for d in corpus])
    _write_jsonl(out / OUTPUT_FILES["queries"], [{"_id": qid, "text": ex.summary} for qid, _, ex in queries])
    for split in SPLITS:
        with atomic_open(out / OUTPUT_FILES[f"qrels_{split}"]) as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{qid}\t{ex.pid}\t1\n" for qid, s, ex in queries if s == split)
    for split in ("train", "dev"):
        records = _dpr_records([ex for _, s, ex in queries if s == split], corpus, split_of, seed)
        write_json(out / OUTPUT_FILES[f"dpr_{split}"], records)
    test = [(qid, ex) for qid, s, ex in queries if s == "test"]
    with atomic_open(out / OUTPUT_FILES["test_qa"]) as f:
        f.writelines(f"{ex.summary}\t{json.dumps([ex.name])}\n" for _, ex in test)
    _write_jsonl(out / OUTPUT_FILES["test_queries"],
                 [{"id": qid, "question": ex.summary, "answers": [ex.name]} for qid, ex in test])
    with atomic_open(out / OUTPUT_FILES["passages"], "w") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["id", "text", "title"])
        writer.writerows([d.pid, d.text, d.pid] for d in corpus)


def _refuse_foreign_files(out: Path) -> None:
    """Refuse a folder without this dataset's manifest that holds a file the build would write: it is the user's,
    not an earlier build's, and would be overwritten."""
    taken = [name for name in (*OUTPUT_FILES.values(), "manifest.json") if (out / name).exists()]
    if taken:
        raise DprGcError(f"{out} already holds {', '.join(taken[:3])}{' and more' if len(taken) > 3 else ''}, not "
                         "written by make-stdlib-data; give a new or empty --output folder")


def _earlier_build(out: Path, params: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Return the manifest of a finished build in ``out`` with these ``params`` and all its files, to reuse it; else
    ``None``. An interrupted build (its marker present) is never reused, as its files may be another build's; a
    folder neither left by one nor holding this command's manifest is checked for files the build would overwrite."""
    if (out / BUILD_MARKER).is_file():
        return None
    old = _own_manifest(out / "manifest.json")
    if old is None:
        _refuse_foreign_files(out)
        return None
    if old["params"] == params and all((out / p).is_file() for p in old["files"].values()):
        return old
    return None


def _own_manifest(path: Path) -> Optional[dict[str, Any]]:
    """Return the manifest at ``path`` when it has this command's shape (a format version, these output files), else
    ``None``: any other ``manifest.json`` is the user's (a project's), not an earlier build's to overwrite."""
    if not path.is_file():
        return None
    try:
        old = read_json_object(path, "a dataset manifest")
    except DprGcError:
        return None
    params = old.get("params")
    if isinstance(params, dict) and "format_version" in params and old.get("files") == OUTPUT_FILES:
        return old
    return None


def check_max_examples(max_examples: Optional[int]) -> None:
    """Refuse a subsample too small to split three ways (train, dev, test); the demo checks it before it records
    its settings."""
    if max_examples is not None and max_examples < 3:
        raise DprGcError(f"--max-examples must be at least 3 (got {max_examples})")


def build_stdlib_dataset(out_dir: PathLike, max_examples: Optional[int] = None, seed: int = 0,
                         dev_fraction: float = 0.1, test_fraction: float = 0.15,
                         max_passage_words: int = 200) -> dict[str, Any]:
    """Build (or resume) the stdlib retrieval dataset in ``out_dir`` and return its manifest.

    Queries are docstring summaries; gold passages hold the rest of the docstring and the code without any
    docstring. Answers are the definition's short name, so token-level answer matching counts a passage that
    mentions the name as a hit (the gold passage always does). Splits are by top-level package, chosen in a
    seeded-hash order, so near-duplicate siblings never straddle splits. Summaries shared by two definitions are
    dropped as queries (identical queries with different gold passages are unanswerable). Definitions without a
    usable summary join the corpus as distractors (about one per query, from the same modules). The output
    depends only on the arguments and the Python version; file paths in the manifest are relative to ``out_dir``.
    """
    check_max_examples(max_examples)
    if not (0 < dev_fraction and 0 < test_fraction and dev_fraction + test_fraction < 1):
        raise DprGcError("dev and test fractions must be positive and sum to less than 1")
    if max_passage_words < 16:
        raise DprGcError(f"max_passage_words must be at least 16 (got {max_passage_words})")
    out = Path(out_dir)
    params = {"format_version": FORMAT_VERSION, "python_version": sys.version.split()[0],
              "max_examples": max_examples, "seed": seed, "dev_fraction": dev_fraction,
              "test_fraction": test_fraction, "max_passage_words": max_passage_words}
    old = _earlier_build(out, params)
    if old is not None:
        logger.info("stdlib dataset already built in %s; reusing it", out)
        return old
    start = time.perf_counter()
    root = Path(sysconfig.get_paths()["stdlib"])
    defs, skipped = collect_definitions(root, max_passage_words)
    usable = select_examples([d for d in defs if d.summary], seed, max_examples)
    if len(usable) < 3:
        raise DprGcError(f"only {len(usable)} usable docstrings found under {root}; is the standard library source "
                         "installed?")
    split_of = assign_splits(usable, seed, dev_fraction, test_fraction)
    chosen = {d.pid for d in usable}
    modules = {d.module for d in usable}
    spare = sorted((d for d in defs if d.pid not in chosen and d.module in modules),
                   key=lambda d: _seeded_key(seed, d.pid))
    distractors = spare[:round(DISTRACTORS_PER_EXAMPLE * len(usable))]
    corpus = sorted(usable + distractors, key=lambda d: d.pid)
    queries = [(f"q{i:05d}", split_of[ex.group], ex) for i, ex in enumerate(usable)]
    out.mkdir(parents=True, exist_ok=True)
    (out / BUILD_MARKER).touch()  # an interrupted build's files are this command's to overwrite on the re-run
    (out / "manifest.json").unlink(missing_ok=True)  # an earlier build's, no longer true of the files once one changes
    _write_outputs(out, corpus, queries, split_of, seed)
    counts: dict[str, int] = {f"{s}_queries": sum(1 for _, q, _ in queries if q == s) for s in SPLITS}
    counts.update({f"{s}_packages": sum(1 for g in split_of.values() if g == s) for s in SPLITS})
    counts.update({"corpus_passages": len(corpus), "distractor_passages": len(distractors),
                   "definitions_seen": len(defs), "usable_summaries": sum(1 for d in defs if d.summary),
                   "files_skipped": skipped})
    manifest = {"params": params, "stdlib": str(root), "counts": counts, "files": dict(OUTPUT_FILES),
                "build_seconds": round(time.perf_counter() - start, 2)}
    write_json(out / "manifest.json", manifest)
    (out / BUILD_MARKER).unlink(missing_ok=True)
    logger.info("stdlib dataset: %s", counts)
    return manifest


@guarded(outputs={"output": "folder"})
def _run_cli(args: argparse.Namespace) -> None:
    manifest = build_stdlib_dataset(args.output, max_examples=args.max_examples, seed=args.seed)
    counts = {key.replace("_", " "): value for key, value in manifest["counts"].items()}  # manifest.json keeps its keys
    print(format_summary({**counts, "output": args.output}, manifest["build_seconds"]))


@dataclasses.dataclass
class StdlibDataSettings:
    """``dpr-gc make-stdlib-data``: where the dataset goes, how many queries, and the seed."""

    output: str = setting("", "--output", type=output_dir, required=True,
                          help="output folder (BEIR + DPR files and manifest.json)")
    max_examples: Optional[int] = setting(None, "--max-examples", type=positive_int,
                                          help="keep at most N queries (seeded subsample; default: all)")
    seed: int = setting(0, "--seed", type=seed_int, help="seed for the split, subsample and negatives")

    def __post_init__(self) -> None:
        check(self)


def add_cli(subparsers: Any) -> None:
    """Register ``make-stdlib-data`` (flags generated from :class:`StdlibDataSettings`)."""
    p = subparsers.add_parser("make-stdlib-data",
                              description=__doc__.splitlines()[0])
    add_arguments(p, StdlibDataSettings)
    p.set_defaults(func=_run_cli)
