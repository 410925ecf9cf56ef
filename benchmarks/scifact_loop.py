"""Benchmark: the toolkit's quality loop on SciFact (BEIR), through its command line only.

Round 0 is all-MiniLM-L6-v2 zero-shot. Round 1 trains on hard negatives mined with the zero-shot model (dense and/or
BM25, positive-aware: ``dpr-gc mine --max-negative-ratio``), round 2 on negatives mined with the round-1 model.
Every step is one ``python -m dpr_gc.cli ...`` subprocess (encode, index, retrieve, evaluate, mine, train); its
command, wall time and peak RSS (``os.wait4``'s resource usage of that process) are recorded. After each round:
nDCG@10, MRR@10 and Recall@100 on the 300 SciFact test queries and on the dev queries (one retrieval for both).

Nothing is tuned on the test qrels. The 809 training queries are split by a hash of their id (``sha256(seed:qid)``,
``--dev-fraction`` of them to ``dev``, the rest to ``fit``). Each choice is made on the dev nDCG@10 of models
trained on ``fit`` (their test figures are recorded as the choice's measured effect, never used to choose):

1. the mining filter: each ``--filters`` choice (``none`` or a ratio R for ``--max-negative-ratio``) mines the fit
   queries with the zero-shot model and trains round 1 on them;
2. the round-2 recipe: each ``--round2`` candidate ``INIT:NEGATIVES[:FILTER]`` trains round 2 on the fit queries
   from INIT (``base``: the zero-shot model; ``round1``: the chosen filter's fit round-1 model) on NEGATIVES
   (``round1``: mined for the fit queries by that round-1 model; ``union``: those and the round-0 ones, deduplicated
   per query), mined under FILTER (default: the filter chosen in 1); the fit round 1 is scored beside them.

With ``--refit`` (default) round 1 and then the chosen round-2 recipe are trained on all training queries; a choice
with one option is not trained on fit. ``--parallel N`` runs independent commands N at a time (the options of a
choice side by side, the refit round 1 beside the round-2 choice); results keep the sequential order.
``--train-seeds N ...`` then trains the refit rounds 1 and 2 again with each training seed (tags ``seed<N>-round1``,
``seed<N>-round2``; round 1 on the same negatives, round 2 on those its own round-1 model mines) and records each
round's nDCG@10 over the seeds (``seed_spread``); they may be added to a finished run's folder.

    python benchmarks/scifact_loop.py --quick          # smoke test, a few minutes on a CPU; runs/scifact-loop-quick/
    python benchmarks/scifact_loop.py --device cuda --model PATH --output DIR --parallel 4

Each command's record is kept under ``<output>/phases``: a rerun with the same settings skips finished commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import machine_info, parser, setup_logging  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import read_json, write_json  # noqa: E402
from dpr_gc.cli import report_errors  # noqa: E402
from scifact import write_quick_data  # noqa: E402

logger = logging.getLogger("scifact_loop")
METRICS = {"ndcg@10": "nDCG@10", "mrr@10": "MRR@10", "recall@100": "Recall@100"}


def opt(default: Any, help_text: str, kind: Optional[type] = None) -> Any:
    """A setting: its default, help and (where the default cannot tell: None, an empty tuple) its flag's value type."""
    return dataclasses.field(default=default, metadata={"help": help_text, "kind": kind})


@dataclasses.dataclass
class LoopSettings:
    """What every command of the loop depends on (a work folder holds one set: changed settings need another)."""

    query_max_length: int = opt(48, "query max length (tokens), training and retrieval")
    max_length: int = opt(256, "passage max length (tokens) when encoding the corpus (evaluation and mining)")
    train_max_length: int = opt(128, "passage max length (tokens) in training")
    batch_size: int = opt(256, "queries per training step (Gradient Cache)")
    chunk_size: int = opt(32, "Gradient Cache chunk: query and passage rows per forward/backward")
    epochs: int = opt(6, "training epochs per round")
    learning_rate: float = opt(3e-4, "peak learning rate")
    warmup_ratio: float = opt(0.1, "linear warm-up as a fraction of the steps, then linear decay")
    hard_negatives: int = opt(1, "hard negatives per query and step (drawn from the mined ones)")
    precision: str = opt("bf16", "training precision: fp32, bf16 or fp16")
    mine_source: str = opt("dense", "round-1 candidates: dense (zero-shot model), bm25, or both")
    mine_top_k: int = opt(30, "candidates retrieved per query when mining")
    mine_skip: int = opt(0, "skip candidates ranked 1..N when mining")
    mine_keep: int = opt(8, "negatives kept per query")
    min_margin: Optional[float] = opt(None, "also --min-margin M when mining (absolute, below the lowest positive)",
                                      float)
    filters: tuple = opt(("none", "0.95"), "positive-aware choices tried on the dev split: none or a ratio R")
    round2: tuple = opt(("base:round1", "round1:round1", "base:union"),
                        "round-2 recipes tried on the dev split, INIT:NEGATIVES[:FILTER]: INIT base (zero-shot model) "
                        "or round1 (round-1 model), NEGATIVES round1 (mined by the round-1 model) or union (those and "
                        "the round-0 ones, deduplicated per query), FILTER none or a ratio R for the round-1 model's "
                        "mining (default: the filter chosen for round 1)")
    refit: bool = opt(True, "after choosing on dev, train rounds 1 and 2 on all training queries")
    dev_fraction: float = opt(0.2, "share of the training queries held out as dev")
    encode_batch_size: int = opt(64, "encoding batch size")
    seed: int = opt(0, "random seed (training and the dev split)")
    train_seeds: tuple = opt((), "after the refit, rounds 1 and 2 on all training queries again with each of these "
                                 "training seeds (the dev split, the choices and round 1's negatives stay --seed's): "
                                 "how far the seed alone moves each round", int)


# --quick: tiny lengths and batches in fp32, one filter and two round-2 recipes (both inits, both kinds of negatives)
QUICK = dict(query_max_length=24, max_length=32, train_max_length=32, batch_size=8, chunk_size=4, epochs=1,
             mine_top_k=10, mine_keep=3, encode_batch_size=32, precision="fp32", filters=("none",),
             round2=("round1:round1", "base:union"))
# the settings of the committed benchmarks/results/scifact-loop.json (benchmarks/README.md's command)
COMMITTED = LoopSettings(filters=("none",), round2=("round1:round1", "round1:union", "round1:round1:0.95",
                                                    "round1:union:0.95"))


# ----------------------------------------------------------------------------------------------- running commands
class Stopped(DprGcError):
    """A command cut short, or never started, because another command of the benchmark failed."""


class Runner:
    """Runs toolkit commands as subprocesses, one record each (command, wall time, peak RSS) kept for reruns; at
    most ``parallel`` of them at once (:meth:`map` runs independent jobs side by side)."""

    def __init__(self, work: Path, device: Optional[str], parallel: int = 1) -> None:
        self.work, self.device, self.parallel, self.phases = work, device, parallel, []
        self.program = [sys.executable, "-m", "dpr_gc.cli"]  # what every command runs (tests put a stand-in)
        self._slots = threading.BoundedSemaphore(parallel)
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        self._stopped = False
        (work / "phases").mkdir(parents=True, exist_ok=True)

    def cli(self, name: str, args: list[Any], capture: bool = False) -> dict:
        """``python -m dpr_gc.cli ARGS`` unless an earlier run finished it; returns its record."""
        record_path = self.work / "phases" / f"{name}.json"
        if record_path.is_file():
            record = read_json(record_path)
            logger.info("%s: done before (%s)", name, record_path)
        else:
            record = self._run(name, [str(a) for a in args], capture)
            write_json(record_path, record)
        self.phases.append(record)
        return record

    def threads_per_job(self) -> Optional[int]:
        """CPU threads each command gets when several run at once (None: the toolkit's own choice)."""
        return max(1, (os.cpu_count() or 1) // self.parallel) if self.parallel > 1 else None

    def env(self) -> dict[str, str]:
        """The commands' environment: this checkout first on PYTHONPATH, sparse progress bars, and with
        ``parallel`` > 1 the cores shared out (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, unless set already)."""
        env = dict(os.environ, TQDM_MININTERVAL=os.environ.get("TQDM_MININTERVAL", "30"),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if self.threads_per_job():
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.setdefault(name, str(self.threads_per_job()))
        return env

    def _start(self, name: str, cmd: list[str], capture: bool) -> tuple[subprocess.Popen, int, float]:
        with self._lock:
            if self._stopped:
                raise Stopped(f"{name}: not started, another command failed")
            logger.info("%s: %s", name, " ".join(cmd[1:]))
            began = time.perf_counter()
            proc = subprocess.Popen(cmd, env=self.env(), cwd=ROOT, stdout=subprocess.PIPE if capture else None,
                                    text=True)
            self._live.add(proc)
            return proc, len(self._live), began

    def _run(self, name: str, args: list[str], capture: bool) -> dict:
        cmd = [*self.program, *args]
        with self._slots:
            proc, running, began = self._start(name, cmd, capture)
            out = proc.stdout.read() if capture else ""
            if capture:
                proc.stdout.close()
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited; reaped below, where stop() looks
            with self._lock:
                _, status, usage = os.wait4(proc.pid, 0)
                self._live.discard(proc)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            stopped = self._stopped
            if code != 0:
                self.stop()  # before the slot is free: nothing else starts after a failure
        wall = time.perf_counter() - began
        if capture:
            print(out, end="")
        if code != 0:
            raise (Stopped if stopped else DprGcError)(
                f"{name} failed (exit {code}): {' '.join(cmd)}; fix and rerun to continue")
        logger.info("%s: %.0f s, peak RSS %.0f MB", name, wall, usage.ru_maxrss / 1024)
        return {"name": name, "command": "python -m dpr_gc.cli " + " ".join(args), "wall_s": round(wall, 2),
                "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "concurrent": running,
                "stdout": out if capture else None}

    def stop(self) -> None:
        """Start no more commands and terminate the running ones (another one failed)."""
        with self._lock:  # a child in _live is not reaped yet, so its pid is still its own
            self._stopped = True
            for proc in self._live:
                os.kill(proc.pid, signal.SIGTERM)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], workers: Optional[int] = None) -> list:
        """``fn`` over ``items``: one after the other (``parallel`` 1), else each on its own thread (at most
        ``workers`` items at a time; default all) with at most ``parallel`` commands running at once. Results in the
        order of ``items``; the first failure stops every other command and is raised."""
        items = list(items)
        if self.parallel == 1 or len(items) < 2:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(workers or len(items), len(items)), thread_name_prefix="job") as pool:
            futures = [pool.submit(fn, item) for item in items]
            wait(futures, return_when=FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futures):
                self.stop()
                wait(futures)
                errors = [f.exception() for f in futures if f.exception() is not None]
                raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
            return [f.result() for f in futures]

    def all(self, *jobs: Callable[[], Any]) -> list:
        """Run independent jobs (see :meth:`map`); their results in order."""
        return self.map(lambda job: job(), jobs)

    def phases_of(self, *prefixes: str) -> list[dict]:
        """The records of the commands whose names start with one of ``prefixes``, in the order they ran."""
        return [p for p in self.phases if p["name"].startswith(prefixes)]

    def device_args(self) -> list[str]:
        return ["--device", self.device] if self.device else []


def table_rows(text: Optional[str]) -> dict:
    """The ``| key | value |`` rows of a summary table the toolkit printed (numbers as numbers, header left out)."""
    rows: dict[str, Any] = {}
    for line in (text or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0] or set(cells[1]) <= set("-: ") or cells == ["item", "value"]:
            continue
        try:
            rows[cells[0]] = float(cells[1]) if any(c in cells[1] for c in ".e") else int(cells[1])
        except ValueError:
            rows[cells[0]] = cells[1]
    return rows


# ----------------------------------------------------------------------------------------------- data
def dev_split(qrels_path: Path, fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Training qrels lines into (fit, dev): a query is dev when sha256("seed:qid") mod 10,000 < fraction x 10,000."""
    fit, dev = [], []
    for i, line in enumerate(qrels_path.read_text(encoding="utf-8").splitlines()):
        if not line.strip() or (i == 0 and line.split("\t")[-1].strip().lower() == "score"):
            continue
        qid = line.split("\t")[0]
        bucket = int(hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest(), 16) % 10_000
        (dev if bucket < fraction * 10_000 else fit).append(line)
    return fit, dev


def prepare_data(source: Path, work: Path, quick: bool, fraction: float, seed: int) -> Path:
    """A BEIR folder for the loop: links to the corpus and queries, qrels train/test and the fit/dev split."""
    if quick:
        source_quick = work / "quick-source"
        write_quick_data(SimpleNamespace(data=str(source_quick)), source)
        source = source_quick
    if not (source / "corpus.jsonl.gz").is_file():
        raise DprGcError(f"SciFact not found in {source} (no corpus.jsonl.gz); pass --data")
    data = work / "data"
    (data / "qrels").mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl.gz", "queries.jsonl"):
        if not (data / name).exists():
            (data / name).symlink_to((source / name).resolve())
    for split in ("train", "test"):
        (data / "qrels" / f"{split}.tsv").write_text((source / "qrels" / f"{split}.tsv").read_text("utf-8"), "utf-8")
    fit, dev = dev_split(source / "qrels" / "train.tsv", fraction, seed)
    test = [line for line in (data / "qrels" / "test.tsv").read_text("utf-8").splitlines()[1:] if line.strip()]
    shared = {line.split("\t")[0] for line in test} & {line.split("\t")[0] for line in dev}
    if shared:
        raise DprGcError(f"{len(shared)} query ids are in both the test and the training qrels (e.g. "
                         f"{sorted(shared)[0]!r}); the loop needs them apart")
    header = "query-id\tcorpus-id\tscore\n"
    for split, lines in (("fit", fit), ("dev", dev), ("test+dev", test + dev)):
        (data / "qrels" / f"{split}.tsv").write_text(header + "".join(line + "\n" for line in lines), "utf-8")
    return data


def count_queries(qrels: Path) -> int:
    return len({line.split("\t")[0] for line in qrels.read_text("utf-8").splitlines()[1:] if line.strip()})


# ----------------------------------------------------------------------------------------------- the steps
@dataclasses.dataclass
class Loop:
    """The runner, the settings and the data folder every step needs."""

    run: Runner
    s: LoopSettings
    data: Path

    @property
    def cache(self) -> Path:
        return self.run.work / "cache"

    def index(self, tag: str, model: str) -> Path:
        """Encode the corpus with ``model`` and build a flat (exact) index: ``<work>/<tag>/index``."""
        folder = self.run.work / tag
        self.run.cli(f"{tag}-encode", ["encode", "--model", model, "--corpus", self.data / "corpus.jsonl.gz",
                                       "--output", folder / "emb", "--max-length", self.s.max_length,
                                       "--batch-size", self.s.encode_batch_size, "--cache-dir", self.cache,
                                       *self.run.device_args()])
        self.run.cli(f"{tag}-index", ["index", "--embeddings", folder / "emb", "--output", folder / "index"])
        return folder / "index"

    def evaluate(self, tag: str, model: str, index: Path, splits: tuple[str, ...] = ("test", "dev")) -> dict:
        """Retrieve the top 100 for the judged queries of every split at once (``qrels/test+dev.tsv``), then score
        each split on its own qrels: ``{split: {metric: value}}``."""
        folder, qrels = self.run.work / tag, self.data / "qrels"
        self.run.cli(f"{tag}-retrieve", [
            "retrieve", "--index", index, "--model", model, "--queries", self.data / "queries.jsonl",
            "--qrels", qrels / f"{'+'.join(splits)}.tsv", "--trec-run", folder / "run.trec", "--top-k", 100,
            "--match", "none", "--batch-size", self.s.encode_batch_size, "--cache-dir", self.cache,
            *self.run.device_args()])

        def score(split: str) -> dict:
            self.run.cli(f"{tag}-evaluate-{split}", [
                "evaluate", "--run", folder / "run.trec", "--qrels", qrels / f"{split}.tsv", "--k", 10, 100,
                "--output", folder / f"metrics-{split}.json"])
            return qrels_metrics(read_json(folder / f"metrics-{split}.json"))

        return dict(zip(splits, self.run.map(score, splits)))

    def mine(self, tag: str, split: str, ratio: Optional[float], dense: Optional[tuple[str, Path]],
             bm25: bool, append_to: Optional[Path] = None) -> tuple[Path, dict]:
        """Hard negatives for the queries of qrels ``split``: BM25 and/or dense (``(model, index)``) candidates,
        positive-aware with ``ratio``; BM25 first, then dense appended when both. ``append_to``: a training file of
        those queries whose negatives are kept, the new ones added after them (``mine --append``: one copy of each
        passage per query). Returns the file and the counts."""
        folder, counts, previous = self.run.work / tag, {}, append_to
        common = ["--n-negatives", self.s.mine_keep, "--top-k", self.s.mine_top_k, "--skip-top", self.s.mine_skip,
                  "--cache-dir", self.cache, "--corpus", self.data / "corpus.jsonl.gz"]
        common += ["--max-negative-ratio", ratio] if ratio is not None else []
        common += ["--min-margin", self.s.min_margin] if self.s.min_margin is not None else []
        sources = ([("bm25", ["--source", "bm25", "--bm25-index", self.run.work / "bm25"])] if bm25 else []) + \
            ([("dense", ["--source", "dense", "--model", dense[0], "--index", dense[1], "--batch-size",
                         self.s.encode_batch_size, *self.run.device_args()])] if dense else [])
        for kind, args in sources:
            output = folder / f"train-{kind}.jsonl"
            given = (["--train-file", previous, "--append", "--qrels", self.data / "qrels" / f"{split}.tsv"]
                     if previous else ["--beir-dir", self.data, "--beir-split", split])
            record = self.run.cli(f"{tag}-mine-{kind}", ["mine", *given, "--output", output, *common, *args],
                                  capture=True)
            counts[kind] = table_rows(record["stdout"])
            previous = output
        return previous, counts

    def train(self, tag: str, train_file: Path, init: str, hard_negatives: Optional[int] = None,
              batch_size: Optional[int] = None, mask: bool = True, seed: Optional[int] = None) -> tuple[str, dict]:
        """Train from ``init`` on ``train_file`` (``mask``: duplicate positives masked, else the loss of DPR and
        GC-DPR; ``seed``: the training seed, default ``--seed``); returns the final model folder and the train
        command's record."""
        s = self.s
        batch = batch_size or s.batch_size
        queries = sum(1 for line in open(train_file, encoding="utf-8") if line.strip())
        steps = (queries // batch) * s.epochs
        if steps < 1:
            raise DprGcError(f"{queries} training queries give no full batch of {batch}; lower --batch-size")
        out = self.run.work / tag / "model"
        resume = ["--resume", "latest"] if any(out.glob("checkpoint-*")) else []  # an interrupted run continues
        record = self.run.cli(f"{tag}-train", [
            "train", "--train", train_file, "--output", out, "--model", init, "--pooling", "mean", "--normalize",
            "--passage-format", "concat", "--temperature", 0.05, "--query-max-length", s.query_max_length,
            "--passage-max-length", s.train_max_length, "--batch-size", batch, "--query-chunk-size", s.chunk_size,
            "--passage-chunk-size", s.chunk_size, "--hard-negatives",
            s.hard_negatives if hard_negatives is None else hard_negatives, "--learning-rate", s.learning_rate,
            "--epochs", s.epochs, "--warmup-steps", max(1, round(s.warmup_ratio * steps)), "--precision",
            s.precision, "--seed", s.seed if seed is None else seed, "--cache-dir", self.cache,
            *self.run.device_args(), *resume, *([] if mask else ["--no-mask-duplicate-positives"])])
        record.update(steps=steps, training_queries=queries, batch_size=batch, mask_duplicate_positives=mask,
                      masked_scores=masked_scores(out / "metrics.jsonl"))
        return str(out / "final"), record


def masked_scores(metrics: Path) -> Optional[int]:
    """The scores the duplicate-positive mask dropped over a run (``masked_scores`` of metrics.jsonl's steps)."""
    if not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text("utf-8").splitlines() if line.strip()]
    return sum(int(r.get("masked_scores", 0)) for r in records)


def negatives_per_query(train_file: Path) -> float:
    """Mean number of hard negatives per query of a mined training file."""
    counts = [len(json.loads(line).get("hard_negative_ctxs") or []) for line in open(train_file, encoding="utf-8")
              if line.strip()]
    return round(sum(counts) / max(1, len(counts)), 2)


def qrels_metrics(report: dict) -> dict:
    """nDCG@10, MRR@10, Recall@100 from an ``evaluate --output`` report."""
    found = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in METRICS.values() and isinstance(v, (int, float)):
                    found[k] = v
                else:
                    walk(v)

    walk(report)
    missing = [m for m in METRICS.values() if m not in found]
    if missing:
        raise DprGcError(f"the evaluate report has no {', '.join(missing)}")
    return {key: round(float(found[name]), 4) for key, name in METRICS.items()}


def parse_filter(choice: str) -> Optional[float]:
    if choice == "none":
        return None
    try:
        value = float(choice)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise DprGcError(f"--filters: {choice!r} is neither 'none' nor a ratio > 0 (e.g. 0.95)")
    return value


# ----------------------------------------------------------------------------------------------- the loop
def round_entry(name: str, metrics: dict, train: Optional[dict], phases: list[dict], **extra: Any) -> dict:
    return {"name": name, **metrics["test"], "dev": metrics.get("dev"),
            "train_s": train["wall_s"] if train else None, "peak_rss_mb": max(p["peak_rss_mb"] for p in phases),
            "train_peak_rss_mb": train["peak_rss_mb"] if train else None,
            "steps": train.get("steps") if train else None, "phases": [p["name"] for p in phases], **extra}


def held_out_entry(name: str, trained: dict, **extra: Any) -> dict:
    """A round whose model is an option trained on ``fit`` (``--no-refit``): its figures as measured then."""
    return {"name": name, **trained["test"], "dev": trained["dev"], "train_s": trained["train_s"],
            "peak_rss_mb": trained["peak_rss_mb"], "steps": trained["steps"], "trained_on": "fit",
            "dev_held_out": True, "phases": trained["phases"], **extra}


def parse_candidate(text: str) -> tuple[str, str, Optional[str]]:
    """A ``--round2`` recipe ``INIT:NEGATIVES[:FILTER]`` as ``(init, negatives, filter or None)``."""
    init, negatives, *rest = text.split(":")
    if init not in ("base", "round1") or negatives not in ("round1", "union") or len(rest) > 1:
        raise DprGcError(f"--round2: {text!r} is not INIT:NEGATIVES[:FILTER] with INIT base or round1, NEGATIVES "
                         "round1 or union and FILTER none or a ratio (e.g. base:union or round1:round1:0.95)")
    if rest:
        try:
            parse_filter(rest[0])
        except DprGcError:
            raise DprGcError(f"--round2: {text!r}: FILTER must be none or a ratio > 0 (e.g. 0.95)") from None
    return init, negatives, rest[0] if rest else None


def round2_filter(recipe: str, chosen: str) -> tuple[str, str, str, str]:
    """``(init, negatives, filter, suffix)`` of a round-2 recipe: its filter (that chosen for round 1 unless the
    recipe names one) and the suffix its mining and candidate tags carry (empty for the chosen filter)."""
    init, kind, choice = parse_candidate(recipe)
    choice = choice or chosen
    return init, kind, choice, "" if choice == chosen else f"-{choice}"


def choose(options: list[dict], key: str) -> dict:
    """The option with the best dev nDCG@10 (the first of equals)."""
    best = max(options, key=lambda o: o["dev"]["ndcg@10"])
    logger.info("chosen on dev nDCG@10: %s %s (%s)", key, best[key],
                ", ".join(f"{o[key]}: {o['dev']['ndcg@10']:.4f}" for o in options))
    return best


def trained_option(loop: Loop, tag: str, file: Path, init: str, score: bool = True) -> dict:
    """Train ``tag`` from ``init`` on ``file``, index its corpus embeddings, score it on test and dev (unless
    ``score`` is False: an only option, needed for its model and index)."""
    model, trained = loop.train(tag, file, init)
    index = loop.index(tag, model)
    metrics = loop.evaluate(tag, model, index) if score else {}
    return {"dev": metrics.get("dev"), "test": metrics.get("test"), "train_s": trained["wall_s"],
            "steps": trained["steps"],
            "peak_rss_mb": trained["peak_rss_mb"], "masked_scores": trained.get("masked_scores"), "model": model,
            "index": str(index), "file": str(file), "negatives_per_query": negatives_per_query(file)}


def round1_negatives(loop: Loop, tag: str, split: str, choice: str, base_model: str, zero_index: Path
                     ) -> tuple[Path, dict]:
    """Negatives for round 1, mined by the zero-shot model (``--mine-source``) under the filter ``choice``."""
    s = loop.s
    dense = (base_model, zero_index) if s.mine_source in ("dense", "both") else None
    return loop.mine(tag, split, parse_filter(choice), dense, s.mine_source in ("bm25", "both"))


def round2_negatives(loop: Loop, tag: str, split: str, round1: dict, kinds: Sequence[tuple[str, str, str]]
                     ) -> dict[tuple[str, str], tuple[Path, dict]]:
    """Negatives mined by the round-1 model ``round1`` for the queries of ``split``, per ``(kind, filter,
    suffix)``: kind ``round1`` (its own) or ``union`` (added to its round-0 file ``round1["file"]``, one copy of
    each passage per query), under the positive-aware ``filter``; keyed by ``(kind, filter)``."""
    kinds = list(dict.fromkeys(kinds))

    def mine(key: tuple[str, str, str]) -> tuple[Path, dict]:
        kind, choice, suffix = key
        return loop.mine(f"{tag}-{kind}{suffix}", split, parse_filter(choice),
                         (round1["model"], Path(round1["index"])), False,
                         append_to=Path(round1["file"]) if kind == "union" else None)

    return {(kind, choice): mined for (kind, choice, _), mined in zip(kinds, loop.run.map(mine, kinds))}


def select_filter(loop: Loop, base_model: str, zero_index: Path, choice: str, score: bool = True) -> dict:
    """Round 1 on the fit queries with negatives mined under one ``--filters`` choice, scored on dev and test
    (``score``)."""
    tag = f"select-{choice}"
    file, counts = round1_negatives(loop, f"{tag}-mine", "fit", choice, base_model, zero_index)
    option = trained_option(loop, f"{tag}-round1", file, base_model, score)
    return {"filter": choice, **option, "mining": counts, "phases": [p["name"] for p in loop.run.phases_of(tag + "-")]}


def select_round2(loop: Loop, base_model: str, fit_round1: dict) -> list[dict]:
    """Each ``--round2`` recipe trained on the fit queries (negatives mined by the chosen filter's fit round-1
    model), scored on dev and test."""
    recipes = {text: round2_filter(text, fit_round1["filter"]) for text in loop.s.round2}
    files = round2_negatives(loop, "cand-mine", "fit", fit_round1, [r[1:] for r in recipes.values()])

    def candidate(text: str) -> dict:
        init, kind, choice, suffix = recipes[text]
        tag = f"cand-{init}-{kind}{suffix}"
        file, counts = files[(kind, choice)]
        option = trained_option(loop, tag, file, base_model if init == "base" else fit_round1["model"])
        return {"candidate": text, "init": init, "negatives": kind, "filter": choice, **option, "mining": counts,
                "phases": [p["name"] for p in loop.run.phases_of(f"cand-mine-{kind}{suffix}-mine", tag + "-")]}

    return loop.run.map(candidate, loop.s.round2)


def replicate_tag(seed: Optional[int]) -> tuple[str, dict]:
    """The tag prefix (``seed<N>-``) and round-entry fields (``seed``) of a replicate; none for the main run."""
    return (f"seed{seed}-", {"seed": seed}) if seed is not None else ("", {})


def refit_round1(loop: Loop, base_model: str, zero_index: Optional[Path], choice: str, seed: Optional[int] = None,
                 mined: Optional[tuple[Path, dict]] = None) -> dict:
    """Round 1 on all training queries with the chosen filter: its round entry, model, index and file. With a
    training ``seed`` (a replicate) its tags start ``seed<N>-`` and ``mined`` (round 1's file and counts) is reused."""
    prefix, extra = replicate_tag(seed)
    file, counts = mined or round1_negatives(loop, "round1-mine", "train", choice, base_model, zero_index)
    model, trained = loop.train(f"{prefix}round1", file, base_model, seed=seed)
    index = loop.index(f"{prefix}round1", model)
    entry = round_entry("round1", loop.evaluate(f"{prefix}round1", model, index), trained,
                        loop.run.phases_of(f"{prefix}round1-"), filter=choice, trained_on="train",
                        dev_held_out=False, mining=counts, **extra)
    return {"entry": entry, "model": model, "index": str(index), "file": str(file)}


def refit_round2(loop: Loop, base_model: str, round1: dict, recipe: str, chosen_filter: str,
                 seed: Optional[int] = None) -> dict:
    """Round 2 on all training queries with the chosen recipe, its negatives mined by the refit round-1 model
    ``round1`` (a replicate's with a training ``seed``: tags ``seed<N>-round2...``)."""
    prefix, extra = replicate_tag(seed)
    init, kind, choice, _ = round2_filter(recipe, chosen_filter)
    file, counts = round2_negatives(loop, f"{prefix}round2-mine", "train", round1,
                                    [(kind, choice, "")])[(kind, choice)]
    model, trained = loop.train(f"{prefix}round2", file, base_model if init == "base" else round1["model"],
                                seed=seed)
    index = loop.index(f"{prefix}round2", model)
    return round_entry("round2", loop.evaluate(f"{prefix}round2", model, index), trained,
                       loop.run.phases_of(f"{prefix}round2-"), recipe=recipe, init=init, negatives=kind,
                       filter=choice, negatives_per_query=negatives_per_query(file), trained_on="train",
                       dev_held_out=False, mining=counts, **extra)


def replicate(loop: Loop, base_model: str, round1: dict, recipe: str, chosen_filter: str, seed: int) -> dict:
    """Rounds 1 and 2 refit again with training seed ``seed``: round 1 on the main run's round-1 negatives, round 2
    on negatives mined by this seed's round-1 model."""
    again = refit_round1(loop, base_model, None, chosen_filter, seed,
                         (Path(round1["file"]), round1["entry"]["mining"]))
    return {"seed": seed, "rounds": [again["entry"], refit_round2(loop, base_model, again, recipe, chosen_filter,
                                                                  seed)]}


def seed_spread(seed: int, rounds: list[dict], replicates: list[dict]) -> dict:
    """Test nDCG@10 of the refit rounds 1 and 2 per training seed (``seed``'s, then the replicates'): the values,
    their mean, sample standard deviation, range, how many reach 0.80, and round 2 minus round 1 per seed."""
    runs = [(seed, rounds[-2:])] + [(r["seed"], r["rounds"]) for r in replicates]
    spread: dict[str, Any] = {"seeds": [n for n, _ in runs]}
    for i, name in enumerate(("round1", "round2")):
        values = [r[i]["ndcg@10"] for _, r in runs]
        spread[name] = {"ndcg@10": values, "mean": round(statistics.mean(values), 4),
                        "sd": round(statistics.stdev(values), 4), "min": min(values), "max": max(values),
                        "at_least_0.80": sum(v >= 0.80 for v in values)}
    gains = [round(r[1]["ndcg@10"] - r[0]["ndcg@10"], 4) for _, r in runs]
    spread["round2_minus_round1"] = {"per_seed": gains, "mean": round(statistics.mean(gains), 4),
                                     "sd": round(statistics.stdev(gains), 4), "positive": sum(g > 0 for g in gains)}
    return spread


def run_loop(loop: Loop, base_model: str, save: Callable[[dict], Any] = lambda out: None) -> dict:
    """Round 0, the filter choice on dev, the round-2 choice on dev, then (``refit``) rounds 1 and 2 on every
    training query; the results' ``rounds``, ``selection`` (filters) and ``round2_selection`` (``save`` gets those
    known so far after each stage, so a run cut short leaves them)."""
    s = loop.s
    out: dict[str, Any] = {"rounds": [], "selection": [], "chosen_filter": None, "round2_selection": [],
                           "chosen_round2": None}
    zero_index = loop.index("round0", base_model)
    out["rounds"].append(round_entry("round0 zero-shot", loop.evaluate("round0", base_model, zero_index), None,
                                     loop.run.phases_of("round0-"), dev_held_out=True))
    save(out)
    fit_round1 = [{"filter": s.filters[0]}]  # round 1 on fit: the filter options, or the only one for round 2
    # a fit round 1 is scored when it is compared: with other filters, or on dev with the round-2 candidates
    score = len(s.filters) > 1 or len(s.round2) > 1 or not s.refit
    if score:
        fit_round1 = loop.run.map(lambda c: select_filter(loop, base_model, zero_index, c, score), s.filters)
    out["selection"] = fit_round1 if score else []
    best = choose(fit_round1, "filter") if score else fit_round1[0]
    out["chosen_filter"] = best["filter"]
    save(out)
    jobs = [lambda: select_round2(loop, base_model, best) if len(s.round2) > 1 or not s.refit else []]
    if s.refit:
        jobs.append(lambda: refit_round1(loop, base_model, zero_index, best["filter"]))
    out["round2_selection"], *refit = loop.run.all(*jobs)
    chosen = choose(out["round2_selection"], "candidate") if out["round2_selection"] else {"candidate": s.round2[0]}
    out["chosen_round2"] = chosen["candidate"]
    if not s.refit:
        out["rounds"] += [held_out_entry("round1", best, filter=best["filter"]),
                          held_out_entry("round2", chosen, recipe=chosen["candidate"], init=chosen["init"],
                                         negatives=chosen["negatives"], filter=chosen["filter"])]
        return out
    out["rounds"].append(refit[0]["entry"])
    save(out)
    out["rounds"].append(refit_round2(loop, base_model, refit[0], chosen["candidate"], best["filter"]))
    if s.train_seeds:
        save(out)
        out["replicates"] = loop.run.map(lambda n: replicate(loop, base_model, refit[0], chosen["candidate"],
                                                             best["filter"], n), s.train_seeds)
        out["seed_spread"] = seed_spread(s.seed, out["rounds"], out["replicates"])
    return out


def machine(device: Optional[str]) -> dict:
    """bench_common's machine record for ``device`` (default: cuda where torch sees one, else cpu)."""
    import torch

    return machine_info(device or ("cuda" if torch.cuda.is_available() else "cpu"))


# ----------------------------------------------------------------------------------------------- command line
def add_settings_flags(p: argparse.ArgumentParser, settings_class: type, skip: tuple = ()) -> None:
    """One flag per settings field but ``skip`` (``--no-FIELD`` for booleans, several values for tuples)."""
    for f in (f for f in dataclasses.fields(settings_class) if f.name not in skip):
        flag, value, text = "--" + f.name.replace("_", "-"), f.default, f.metadata["help"]
        if isinstance(value, bool):
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                           help="do not: " + text)
        elif isinstance(value, tuple):
            action = p.add_argument(flag, nargs="+", type=f.metadata["kind"] or type(value[0]), default=None,
                                    help=text)
            action.shown_default = value  # --help shows the settings' value; None tells --quick the flag is not given
        else:
            action = p.add_argument(flag, type=f.metadata["kind"] or type(value), default=None, help=text)
            action.shown_default = value


def common_parser(description: str, results_name: str) -> argparse.ArgumentParser:
    p = parser(description)
    default = next((d for d in (ROOT.parent / "shared" / "data" / "scifact",
                                ROOT.parents[1] / "shared" / "data" / "scifact") if d.is_dir()),
                   ROOT.parent / "shared" / "data" / "scifact")
    p.add_argument("--data", default=str(default), help="BEIR SciFact folder (default: ../shared/data/scifact)")
    p.add_argument("--model", help="the base model folder (default: the offline all-MiniLM-L6-v2)")
    p.add_argument("--output", help="work folder for every command's outputs (default: runs/<benchmark>[-quick])")
    p.add_argument("--results", help=f"results JSON (default: benchmarks/results/{results_name}.json for the "
                   "committed run's settings; --quick or other settings: results.json in the --output folder)")
    p.add_argument("--device", help="torch device for every command (default: the toolkit's choice)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 48 training / 20 test queries, 200 passages, tiny lengths and batches, fp32, "
                        "fewer options (flags given still apply)")
    p.add_argument("--parallel", type=positive_int, default=1,
                   help="independent commands run at once; with N > 1 each gets cores/N CPU threads "
                        "and the recorded timings are those of N concurrent jobs")
    return p


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def concurrency(runner: Runner) -> dict:
    """How the timings were taken: ``--parallel`` N commands at once, the CPU threads each got."""
    return {"parallel": runner.parallel, "threads_per_job": runner.threads_per_job(),
            "note": (f"wall times were measured with up to {runner.parallel} toolkit commands running at once "
                     "(each phase's 'concurrent': how many were running when it started, itself included)"
                     if runner.parallel > 1 else "one toolkit command at a time")}


def settings_from(args: argparse.Namespace, settings_class: type, quick: dict) -> Any:
    """Settings from the flags; ``--quick`` swaps in small values for the flags not given."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_class)
              if getattr(args, f.name, None) is not None}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    if args.quick:
        values = {**quick, **values}
    return settings_class(**values)


def default_results(args: argparse.Namespace, name: str, settings: Any, committed: Any) -> Optional[Path]:
    """The results file a run writes outside its work folder: ``--results``, else benchmarks/results/NAME.json for
    the ``committed`` settings; None for a trial run (``--quick`` or other settings), whose go to WORK/results.json."""
    if args.results:
        return Path(args.results)
    trial = args.quick or settings != committed
    return None if trial else ROOT / "benchmarks" / "results" / f"{name}.json"


def open_work(args: argparse.Namespace, name: str, settings: Any, committed: Any,
              free: tuple = ()) -> tuple[Path, Path, str]:
    """The work folder (refusing one made with other settings but the ``free`` ones, which only add or drop
    commands), the results path and the base model. The results default to benchmarks/results/NAME.json only for
    the ``committed`` settings (those of the committed file); a ``--quick`` run's, or one with any other settings,
    to ``WORK/results.json``, so a trial run never replaces the committed results."""
    from dpr_gc.model.pretrained import default_model_path

    suffix = "-quick" if args.quick else ""
    work = Path(args.output or ROOT / "runs" / f"{name}{suffix}").resolve()
    results = default_results(args, name, settings, committed) or work / "results.json"
    model = args.model or default_model_path()
    fixed = {k: v for k, v in dataclasses.asdict(settings).items() if k not in free}
    key = {"settings": fixed, "model": str(model), "data": str(Path(args.data).resolve()),
           "quick": args.quick}
    saved = work / "settings.json"
    if saved.is_file() and read_json(saved) != json.loads(json.dumps(key)):
        raise DprGcError(f"{work} holds a run with other settings ({saved}); give another --output or delete it")
    work.mkdir(parents=True, exist_ok=True)
    write_json(saved, key)
    return work, results, str(model)


def check(s: LoopSettings) -> None:
    if s.mine_source not in ("dense", "bm25", "both"):
        raise DprGcError(f"--mine-source must be dense, bm25 or both, got {s.mine_source!r}")
    for recipe in s.round2:
        parse_candidate(recipe)
    for name, values in (("--filters", s.filters), ("--round2", s.round2)):
        if not values or len(set(values)) != len(values):
            raise DprGcError(f"{name} needs one or more different choices, got {' '.join(values) or 'none'}")
    if not 0 < s.dev_fraction < 1:
        raise DprGcError(f"--dev-fraction must be between 0 and 1, got {s.dev_fraction}")
    for choice in s.filters:
        parse_filter(choice)
    if s.train_seeds and (len(set(s.train_seeds)) != len(s.train_seeds) or s.seed in s.train_seeds):
        raise DprGcError(f"--train-seeds needs different seeds other than --seed {s.seed}, got "
                         f"{' '.join(map(str, s.train_seeds))}")
    if s.train_seeds and not s.refit:
        raise DprGcError("--train-seeds repeats the refit rounds: it cannot go with --no-refit")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """The loop's command line (its settings flags among them), read without running anything."""
    p = common_parser(__doc__.splitlines()[0], "scifact-loop")
    add_settings_flags(p, LoopSettings)
    return p.parse_args(argv)


def results_file(args: argparse.Namespace) -> Optional[Path]:
    """The results file a run with ``args`` writes outside its work folder (see :func:`default_results`)."""
    return default_results(args, "scifact-loop", settings_from(args, LoopSettings, QUICK), COMMITTED)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    return report_errors(lambda: run(args))


@dataclasses.dataclass
class ReportHead:
    """What every report of a SciFact benchmark run starts with: its title, flags, loop, settings, base model and
    start time."""

    title: str
    args: argparse.Namespace
    loop: Loop
    settings: dict
    model: str
    began: float


def write_report(results: Path, head: ReportHead, body: dict, complete: bool) -> dict:
    """Write the results file: ``head``'s fields, ``body``, then every phase with its command and the wall times."""
    args = head.args
    phases = [dict(p) for p in list(head.loop.run.phases)]  # copies: commands still running may add to them
    report = {"benchmark": head.title + (
                  " -- SMOKE RUN (--quick: 48 training / 20 test queries, 200 passages; numbers mean nothing)"
                  if args.quick else ""),
              "smoke_run": args.quick, "complete": complete,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(args.device),
              "settings": head.settings, "base_model": head.model, "concurrency": concurrency(head.loop.run),
              **body, "phases": phases, "commands": [p["command"] for p in phases],
              "wall_s_all_phases": round(sum(p["wall_s"] for p in phases), 1),
              "wall_s_this_invocation": round(time.perf_counter() - head.began, 1)}
    results.parent.mkdir(parents=True, exist_ok=True)
    write_json(results, report)
    return report


def run(args: argparse.Namespace) -> None:
    s = settings_from(args, LoopSettings, QUICK)
    check(s)
    began = time.perf_counter()
    work, results, model = open_work(args, "scifact-loop", s, COMMITTED, free=("train_seeds",))
    data = prepare_data(Path(args.data), work, args.quick, s.dev_fraction, s.seed)
    loop = Loop(Runner(work, args.device, args.parallel), s, data)

    def save(out: dict, complete: bool = False) -> dict:
        dev_split = {"rule": "a training query is dev when int(sha256(f'{seed}:{qid}')) % 10000 < "
                             "dev_fraction * 10000; fit = the other training queries",
                     "fit_queries": count_queries(data / "qrels" / "fit.tsv"),
                     "dev_queries": count_queries(data / "qrels" / "dev.tsv"),
                     "test_queries": count_queries(data / "qrels" / "test.tsv")}
        return write_report(results, ReportHead("SciFact (BEIR) quality loop", args, loop, dataclasses.asdict(s),
                                                model, began),
                            {"dev_split": dev_split, **out}, complete)

    out = run_loop(loop, model, save)
    report = save(out, complete=True)
    for r in report["rounds"]:
        print(f"{r['name']:<18} nDCG@10 {r['ndcg@10']:.4f}  MRR@10 {r['mrr@10']:.4f}  Recall@100 "
              f"{r['recall@100']:.4f}  train {r['train_s'] or 0:.0f} s  peak RSS {r['peak_rss_mb']:.0f} MB")
    for key, options in (("filter", out["selection"]), ("candidate", out["round2_selection"])):
        print(f"{key} on dev: " + ", ".join(f"{o[key]} {o['dev']['ndcg@10']:.4f}" for o in options))
    for name in ("round1", "round2") if "seed_spread" in out else ():
        spread = out["seed_spread"][name]
        print(f"{name} nDCG@10 over seeds {out['seed_spread']['seeds']}: mean {spread['mean']:.4f} sd "
              f"{spread['sd']:.4f} ({' '.join(f'{v:.4f}' for v in spread['ndcg@10'])})")
    print(f"wall {report['wall_s_this_invocation']:.0f} s with --parallel {args.parallel}\nresults: {results}")


if __name__ == "__main__":
    sys.exit(main())
