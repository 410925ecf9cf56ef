"""Evaluate retrieval: DPR-style top-k answer accuracy, and qrels metrics that match trec_eval.

Two kinds of ground truth are supported:

* answers (open-domain QA, DPR's protocol): a passage "has the answer" when an answer string occurs in its text
  as a whole-token, uncased sequence after Unicode NFD (``string`` mode), or when an answer regex matches it
  (``regex`` mode, CuratedTREC). Top-k accuracy is the fraction of questions with such a passage in the top k.
* relevance judgments (qrels, BEIR / TREC): Recall@k, nDCG@k, MRR@10, MAP@k and Accuracy@k, computed with
  trec_eval's definitions and tie-breaking so they equal pytrec_eval to floating-point precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from tqdm import tqdm

from .answers import (STORED, AccuracyCounter, AnswerMatcher, UncompiledPatterns, answer_flags, check_ks,
                      default_workers, iter_blocks, resolve_mode)
from .answers import MATCH_MODES, evaluate_answers, has_answer, top_k_accuracy  # noqa: F401 (the API of evaluation)
from ..base.args import home_expanded, nonnegative_int, output_file, plot_file, plot_format, positive_int
from ..base.errors import DprGcError
from ..base.guard import guarded
from ..base.files import PathLike, atomic_path, atomic_paths, dump_json, open_text, require_file
from ..base.settings import add_arguments, check, setting
from .results import check_question, ctx_score, iter_results
from ..base.validate import check_id
from ..base.tables import format_summary, markdown_table
from ..base.logs import counted
from ..data.qrels import read_qrels

logger = logging.getLogger(__name__)
ALWAYS_AT, ALWAYS_REPORTED = 10, "nDCG@10 and MRR@10"  # qrels metrics reported whatever the cut-offs


def read_results(path: PathLike) -> list[dict[str, Any]]:
    """All records of a results file in memory (small files; :func:`dpr_gc.evaluation.results.iter_results` streams)."""
    return list(iter_results(path))


# ----------------------------------------------------------------------------------------------- qrels and runs
def read_run(path: PathLike) -> dict[str, dict[str, float]]:
    """Read a TREC run file (``qid Q0 docid rank score tag``) into ``{qid: {docid: score}}``."""
    run: dict[str, dict[str, float]] = {}
    with open_text(path, what="run file") as f:
        for line_no, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 6:
                raise DprGcError(f"{path}:{line_no}: expected 6 fields 'qid Q0 docid rank score tag', "
                                 f"got {len(parts)}")
            qid, _, docid, rank, score_text, _ = parts
            check_id(qid, f"{path}:{line_no}", "query id"), check_id(docid, f"{path}:{line_no}", "document id")
            try:
                int(rank)
                score = float(score_text)
            except ValueError:
                raise DprGcError(f"{path}:{line_no}: rank {rank!r} must be an integer and score "
                                 f"{score_text!r} a number") from None
            if not math.isfinite(score):
                raise DprGcError(f"{path}:{line_no}: score {score_text!r} is not finite")
            docs = run.setdefault(qid, {})
            if docid in docs:
                raise DprGcError(f"{path}:{line_no}: document {docid!r} listed twice for query {qid!r}")
            docs[docid] = score
    if not run:
        raise DprGcError(f"{path}: the run is empty")
    return run


def result_scores(entry: dict[str, Any], i: int, source: str,
                  docs: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Add one checked result's ``{passage id: score}`` to ``docs``; ctx ``score`` may be a string (as DPR writes)."""
    if "id" not in entry:
        raise DprGcError(f"{source}: question {i} has no 'id', so it cannot be joined with qrels; use --run instead")
    docs = {} if docs is None else docs
    for j, ctx in enumerate(entry["ctxs"]):
        where = f"{source}: question {i}, ctx {j}"
        if "id" not in ctx:
            raise DprGcError(f"{where}: missing passage 'id'")
        score = ctx_score(ctx["score"], where) if "score" in ctx else float(len(entry["ctxs"]) - j)
        if str(ctx["id"]) in docs:
            raise DprGcError(f"{where}: passage {ctx['id']!r} listed twice")
        docs[str(ctx["id"])] = score
    return docs


def run_from_results(results: Iterable[Any], source: str = "results") -> dict[str, dict[str, float]]:
    """Turn DPR results whose questions carry an ``id`` into a run (questions with the same id are merged)."""
    run: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(results):
        entry = check_question(entry, i, source)
        result_scores(entry, i, source, run.setdefault(str(entry.get("id")), {}))
    return run


def rank_documents(scores: dict[str, float]) -> list[str]:
    """Order documents as trec_eval does: score descending, ties broken by docid descending. trec_eval holds each
    score as a C ``float``, so scores equal in float32 (0.712345671 and 0.712345670) tie there too."""
    def key(item: tuple[str, float]) -> tuple[float, str]:
        return struct.unpack("f", struct.pack("f", item[1]))[0], item[0]

    return [d for d, _ in sorted(scores.items(), key=key, reverse=True)]


def query_metrics(scores: dict[str, float], judged: dict[str, int], ks: Iterable[int]) -> dict[str, float]:
    """Metrics of one query: Recall@k, nDCG@k, MAP@k, Accuracy@k for each k, plus nDCG@10 and MRR@10.

    A document is relevant when its judgment is >= 1 (trec_eval's default relevance level). nDCG uses the
    judgment as linear gain with log2(rank + 1) discount; MAP@k divides by all relevant documents, as map_cut.
    """
    ks = check_ks(ks)
    ranking = rank_documents(scores)
    rels = [judged.get(d, 0) for d in ranking]
    n_rel = sum(r > 0 for r in judged.values())
    ideal = sorted((r for r in judged.values() if r > 0), reverse=True)

    def dcg(gains: list[int], k: int) -> float:
        return sum(g / math.log2(i + 2) for i, g in enumerate(gains[:k]) if g > 0)

    out: dict[str, float] = {}
    for k in ks:
        found = [i for i, r in enumerate(rels[:k]) if r > 0]
        out[f"Recall@{k}"] = len(found) / n_rel if n_rel else 0.0
        ideal_dcg = dcg(ideal, k)
        out[f"nDCG@{k}"] = dcg(rels, k) / ideal_dcg if ideal_dcg > 0 else 0.0
        out[f"MAP@{k}"] = sum((n + 1) / (i + 1) for n, i in enumerate(found)) / n_rel if n_rel else 0.0
        out[f"Accuracy@{k}"] = 1.0 if found else 0.0
    ideal_dcg = dcg(ideal, 10)
    out["nDCG@10"] = dcg(rels, 10) / ideal_dcg if ideal_dcg > 0 else 0.0
    first = next((i for i, r in enumerate(rels[:10]) if r > 0), None)
    out["MRR@10"] = 1.0 / (first + 1) if first is not None else 0.0
    return out


class QrelsAccumulator:
    """Mean of :func:`query_metrics` over every query in ``qrels``, fed one ranked query at a time.

    Queries in the qrels but absent from the run score 0 on every metric (trec_eval ``-c``; the right choice
    when a retriever silently drops queries), and queries judged all-non-relevant also score 0 and still count,
    as in pytrec_eval. Run queries without judgments are ignored.
    """

    def __init__(self, qrels: dict[str, dict[str, int]], ks: Iterable[int]) -> None:
        self.qrels, self.ks = qrels, check_ks(ks)
        if not qrels:
            raise DprGcError("the qrels are empty; nothing to evaluate")
        self.totals: dict[str, float] = {}
        self.seen: set[str] = set()

    def add(self, qid: str, scores: dict[str, float], source: str = "the run") -> None:
        if qid in self.seen:
            raise DprGcError(f"{source}: query {qid!r} appears twice; give each question one record")
        self.seen.add(qid)
        if qid in self.qrels:
            for name, value in query_metrics(scores, self.qrels[qid], self.ks).items():
                self.totals[name] = self.totals.get(name, 0.0) + value

    def result(self) -> dict[str, float]:
        missing = [q for q in self.qrels if q not in self.seen]
        if missing:
            logger.warning("%d of %d judged queries are missing from the run and count as 0 (e.g. %r)",
                           len(missing), len(self.qrels), missing[0])
        totals = dict.fromkeys(query_metrics({}, {}, self.ks), 0.0) | self.totals
        order = ["Recall", "nDCG", "MRR", "MAP", "Accuracy"]
        names = sorted(totals, key=lambda n: (order.index(n.split("@")[0]), int(n.split("@")[1])))
        return {name: totals[name] / len(self.qrels) for name in names}


class RunEvaluation:
    """``--evaluate`` fed one retrieved record at a time: answer accuracy from the ``has_answer`` flags already
    computed (or matched here with ``matcher`` when retrieval did not match), reported when any question has
    answers (the others count as misses); qrels metrics when qrels are given."""

    def __init__(self, ks: list[int], qrels: Optional[dict[str, dict[str, int]]],
                 matcher: Optional[AnswerMatcher] = None) -> None:
        self.ks, self.matcher = check_ks(ks), matcher
        self.answers, self.with_answers = AccuracyCounter(), False
        self.qrels = QrelsAccumulator(qrels, ks) if qrels is not None else None

    def write(self, record: dict) -> None:
        ctxs = record["ctxs"]
        if not record["answers"]:
            self.answers.add(())
        elif self.matcher is not None:
            self.answers.add(self.matcher.flags([(record["answers"], [(c["id"], c["text"]) for c in ctxs])])[0])
        else:
            self.answers.add(c["has_answer"] for c in ctxs)
        self.with_answers = self.with_answers or bool(record["answers"])
        if self.qrels is not None:
            self.qrels.add(record["id"], {c["id"]: float(c["score"]) for c in ctxs})

    def report(self) -> dict[str, dict[str, float]]:
        out = {}
        if self.with_answers:
            out["answers"] = {f"Accuracy@{k}": v for k, v in self.answers.accuracy(self.ks).items()}
        if self.qrels is not None:
            out["qrels"] = self.qrels.result()
        if not out:  # the command line refuses this up front (retrieve.queries_to_retrieve); code is told here
            logger.warning("nothing evaluated: no question has answers and no qrels were given")
        return out


def qrels_metrics(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]], ks: Iterable[int]
) -> dict[str, float]:
    """Mean of :func:`query_metrics` over every query in ``qrels`` (see :class:`QrelsAccumulator`)."""
    acc = QrelsAccumulator(qrels, ks)
    for qid, scores in run.items():
        acc.add(qid, scores)
    return acc.result()


# ----------------------------------------------------------------------------------------------- reporting
def format_table(metrics: dict[str, float]) -> str:
    """Markdown table with one row per metric name and one column per cut-off k (from ``"Name@k"`` keys)."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        name, _, k = key.partition("@")
        rows.setdefault(name, {})[k] = value
    cols = sorted({k for cells in rows.values() for k in cells}, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
    return markdown_table(["metric"] + [f"@{k}" if k else "value" for k in cols],
                          [[name] + [f"{cells[k]:.4f}" if k in cells else "" for k in cols] for name, cells in rows.items()])


def plot_metrics(curves: dict[str, dict[int, float]], path: PathLike) -> Path:
    """Write a plot of each curve (e.g. accuracy or recall) against k (see :func:`save_plot`), atomically, in the
    format its name ends in (:func:`~dpr_gc.base.args.plot_format`)."""
    with atomic_path(path) as tmp:
        save_plot(curves, tmp, plot_format(os.fspath(path)))
    return Path(path)


def save_plot(curves: dict[str, dict[int, float]], path: PathLike, fmt: str = "png") -> None:
    """Draw each curve (e.g. accuracy or recall) against k into the file ``path`` in format ``fmt`` (png, pdf or
    svg); log x-axis when k spans a wide range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {label: points for label, points in curves.items() if points}
    if not curves:
        raise DprGcError("nothing to plot: no accuracy or recall values were computed")
    fig, ax = plt.subplots(figsize=(6, 4))
    all_ks = []
    for label, points in curves.items():
        ks = sorted(points)
        all_ks.extend(ks)
        ax.plot(ks, [points[k] for k in ks], marker="o", label=label)
    if max(all_ks) / min(all_ks) >= 20:
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(sorted(set(all_ks)), [str(k) for k in sorted(set(all_ks))])
    ax.set_xlabel("k (passages retrieved)")
    ax.set_ylabel("value")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, format=fmt, dpi=120)
    finally:
        plt.close(fig)


def curve(metrics: dict[str, float], name: str) -> dict[int, float]:
    """Extract ``{k: value}`` for one metric name (e.g. "Recall") from a flat ``"Name@k"`` dict."""
    return {int(key.split("@")[1]): v for key, v in metrics.items() if key.split("@")[0] == name}


def scan_results(path: PathLike, ks: list[int], mode: Optional[str], workers: int = 1,
                 qrels: Optional[dict[str, dict[str, int]]] = None,
                 answers_optional: bool = False) -> tuple[Optional[dict], Optional[dict]]:
    """One streaming pass over a results file: answer accuracy (``None`` when ``answers_optional`` and no question
    has answers) and, with ``qrels``, qrels metrics of the run the results hold. Questions that all have empty
    answers (retrieved for BEIR queries) have no answer accuracy: refused unless ``answers_optional``, and then
    their passages need neither text nor flags (compact results of ``retrieve --match none`` are scored on qrels).
    Regex patterns that do not compile never match, as in DPR, and are named in one warning."""
    source = str(path)
    counter, acc = AccuracyCounter(), QrelsAccumulator(qrels, ks) if qrels is not None else None
    uncompiled, judging = UncompiledPatterns(), not answers_optional
    answered, announced, depth = 0, False, 0
    with AnswerMatcher(workers=workers) as string, AnswerMatcher("regex", workers=workers) as regex:
        for block in iter_blocks(tqdm(iter_results(path), desc="evaluating", unit=" q", disable=None), source):
            depth = max([depth] + [len(entry.get("ctxs") or ()) for _, entry in block])
            judging = judging or any(entry.get("answers") for _, entry in block)  # from the first with answers
            if not judging:  # no question so far has answers: each is a miss, whatever its passages hold
                for _ in block:
                    counter.add(())
            else:
                asked, mode = mode, resolve_mode(mode, block)
                if not announced and mode != "auto":  # decided: say how these answers (and all later) are judged
                    announce_mode(asked, mode, workers, source)
                    announced = True
                for row in answer_flags(block, mode, source, regex if mode == "regex" else string, uncompiled):
                    counter.add(row)
                answered += sum(1 for _, entry in block if entry.get("answers"))
            for i, entry in block if acc is not None else ():
                acc.add(str(entry.get("id")), result_scores(entry, i, source), source)
    if not counter.questions:
        raise DprGcError(f"{source}: no questions to evaluate (the results list is empty)")
    uncompiled.warn(source)
    warn_beyond_depth(ks, depth, source, qrels=acc is not None)
    if not answered and not answers_optional:
        raise DprGcError(f"{source}: none of its {counter.questions} questions has answers, so there is no answer "
                         "accuracy: score the results against relevance judgments with --qrels FILE")
    if answered and mode == "auto":
        logger.warning("%s: no question has retrieved passages, so every accuracy is 0", source)
    answers = None
    if answered:
        answers = {"match": mode or "stored", "questions": counter.questions,
                   "metrics": {f"Accuracy@{k}": v for k, v in counter.accuracy(ks).items()}}
    return answers, acc.result() if acc is not None else None


def always_beyond(ks: Iterable[int], depth: int) -> bool:
    """Whether qrels metrics at cut-offs ``ks`` report nDCG@10 and MRR@10 (always reported) beyond ``depth``
    retrieved passages without a cut-off of 10 among ``ks`` to name them."""
    return depth < ALWAYS_AT and ALWAYS_AT not in ks


def warn_beyond_depth(ks: list[int], depth: int, source: str, qrels: bool = False) -> None:
    """Say when a cut-off is deeper than any question's retrieved list: its metric counts only what was retrieved
    (a Recall@1000 over 100 passages is Recall@100), which a table would not show; ``qrels``: qrels metrics are
    reported, whose nDCG@10 and MRR@10 the warning names too."""
    deeper = [f"@{k}" for k in ks if k > depth] + ([ALWAYS_REPORTED] if qrels and always_beyond(ks, depth) else [])
    if deeper and depth:
        logger.warning("%s holds at most %s per question: %s count%s only those", source,
                       counted(depth, "retrieved passage"), ", ".join(deeper),
                       "" if len(deeper) > 1 or deeper == [ALWAYS_REPORTED] else "s")


def announce_mode(asked: Optional[str], chosen: Optional[str], workers: int, source: str) -> None:
    """Log how answers are judged: ``auto``'s choice and why, and the processes that match them when they are."""
    how = (f"answers matched with {chosen} matching in {counted(workers, 'process', 'processes')}" if chosen
           else f"the has_answer flags stored in {source}")
    why = "" if asked != "auto" else (" (--match auto: the file holds them; --match string or regex recomputes them)"
                                      if chosen is STORED else " (--match auto: not every passage of the first "
                                      "question with passages has a has_answer flag)")
    logger.info("%s%s", how, why)


def evaluate(
    ks: Iterable[int],
    results_path: Optional[PathLike] = None,
    run_path: Optional[PathLike] = None,
    qrels_path: Optional[PathLike] = None,
    mode: Optional[str] = "auto",
    workers: int = 1,
) -> dict[str, Any]:
    """Run every evaluation the inputs allow and return a JSON-ready report.

    ``results_path`` gives answer accuracy (when questions have answers), read as a stream; ``mode`` ``auto``
    uses the file's ``has_answer`` flags when it has them, ``string``/``regex`` recompute them (``workers``
    processes, 0: all cores, as ``--workers``), ``"stored"`` (or ``None``) insists on the stored ones. With
    ``qrels_path`` the run comes from ``run_path``, or else from the results' question and passage ids.
    """
    ks = check_ks(ks)
    mode = STORED if mode == "stored" else mode
    if mode not in (STORED, "auto", *MATCH_MODES):
        raise DprGcError(f"--match must be one of auto, stored (or None), {', '.join(MATCH_MODES)}, got {mode!r}")
    if not nonnegative_int.accepts(workers):
        raise DprGcError(f"--workers must be an integer >= 0 (0: all cores), got {workers!r}")
    workers = int(workers) or default_workers(0)
    if results_path is None and run_path is None:
        raise DprGcError("give --results FILE and/or --run FILE with --qrels FILE")
    if run_path is not None and qrels_path is None:
        raise DprGcError("--run needs --qrels FILE to score it against")
    report: dict[str, Any] = {"k": ks}
    qrels = read_qrels(qrels_path) if qrels_path is not None else None
    from_results = None
    if results_path is not None:
        answers, from_results = scan_results(results_path, ks, mode, workers, qrels if run_path is None else None,
                                             answers_optional=qrels is not None)
        if answers is not None:
            report["answers"] = {"results": str(results_path), **answers}
    if qrels is not None:
        metrics = from_results
        if run_path is not None:
            run = read_run(run_path)
            warn_beyond_depth(ks, max(map(len, run.values()), default=0), str(run_path), qrels=True)
            metrics = qrels_metrics(run, qrels, ks)
        report["qrels"] = {"qrels": str(qrels_path), "run": str(run_path or results_path), "queries": len(qrels),
                           "metrics": metrics}
    return report


def metrics_heading(kind: str, count: int, match: Optional[str] = None) -> str:
    """The heading over a metric table, the same in ``evaluate`` and ``retrieve --evaluate``: ``answer accuracy
    (2 questions, match=string)`` or ``qrels metrics (2 judged queries)``, the count being what its figures are
    averaged over."""
    if kind == "answers":
        return f"answer accuracy ({counted(count, 'question')}, match={match})"
    return f"qrels metrics ({counted(count, 'judged query', 'judged queries')})"


@guarded(inputs=("results", "run", "qrels"), outputs={"output": "file", "plot": "file"})
def _cli(args: argparse.Namespace) -> None:
    """Handler for ``dpr_gc evaluate``: evaluate, print the metric tables, write JSON and the optional plot, then
    the closing summary (inputs, outputs, time)."""
    started = time.perf_counter()
    for flag in ("results", "run", "qrels"):  # a missing file is named by its flag, as every command names it
        if getattr(args, flag):
            require_file(getattr(args, flag), f"--{flag} file")
    mode = None if args.match == "stored" else args.match
    report = evaluate(args.k, args.results, args.run, args.qrels, mode, default_workers(args.workers))
    curves = {}
    for key, names in (("answers", ["Accuracy"]), ("qrels", ["Recall", "Accuracy"])):
        if key in report:
            part = report[key]
            heading = metrics_heading(key, part["questions" if key == "answers" else "queries"], part.get("match"))
            print(f"\n{heading}\n{format_table(part['metrics'])}")
            curves.update({f"{key}: {name}@k": curve(report[key]["metrics"], name) for name in names})
    write_report(report, curves, args.output, args.plot)
    print("\n" + format_summary({"results": args.results or "-", "run": args.run or "-", "qrels": args.qrels or "-",
                          "output": args.output or "-", "plot": args.plot or "-"}, time.perf_counter() - started))


def plot_record(plot: PathLike, written: Path) -> dict[str, str]:
    """What a metrics JSON records of the plot written beside it: the plot's path and the SHA-256 of ``written``
    (its bytes, still under a temporary name), so a reader can tell that the plot there is the JSON's own."""
    return {"file": str(plot), "sha256": hashlib.sha256(written.read_bytes()).hexdigest()}


def write_report(report: dict[str, Any], curves: dict[str, dict[int, float]], output: Optional[PathLike],
                 plot: Optional[PathLike]) -> None:
    """Write the metrics JSON and/or the plot of ``curves`` as one output (:func:`~dpr_gc.base.files.atomic_paths`,
    the JSON last). The JSON records the plot's file and SHA-256, so the plot beside it is provably its own; an
    error or Ctrl-C keeps the earlier pair whole, and a kill leaves no JSON beside another run's plot."""
    paths = [p for p in (plot, output) if p]
    if not paths:
        return
    with atomic_paths(*paths) as tmps:
        if plot:
            save_plot(curves, tmps[0], plot_format(os.fspath(plot)))
            report = {**report, "plot": plot_record(plot, tmps[0])}
        if output:
            with open(tmps[-1], "w", encoding="utf-8") as f:
                dump_json(report, f)
    for what, path in (("plot", plot), ("metrics", output)):
        if path:
            logger.info("wrote %s to %s", what, path)


@dataclasses.dataclass
class EvaluateSettings:
    """``dpr-gc evaluate``: what is evaluated (a results file and/or a TREC run with qrels), at which cut-offs, how
    answers are matched, and where the report goes."""

    results: Optional[str] = setting(None, "--results", type=home_expanded,
                                     help="DPR retriever output JSON: [{question, answers, ctxs: [...]}]")
    run: Optional[str] = setting(None, "--run", type=home_expanded,
                                 help="TREC run file 'qid Q0 docid rank score tag' (needs --qrels)")
    qrels: Optional[str] = setting(None, "--qrels", type=home_expanded,
                                   help="BEIR qrels TSV (query-id corpus-id score) or TREC qrels "
                                        "(qid 0 docid rel)")
    k: list[int] = setting(None, "--k", type=positive_int, nargs="+", extend=True,
                           default_factory=lambda: [1, 5, 10, 20, 100],
                           help="cut-offs (nDCG@10 and MRR@10 are always reported)")
    match: str = setting("auto", "--match", choices=("auto", "stored") + MATCH_MODES,
                         help="answer flags: auto (the file's has_answer fields when present, else string), stored, "
                              "or recompute them with string (NQ/TriviaQA) or regex (CuratedTREC) matching")
    workers: int = setting(0, "--workers", type=nonnegative_int,
                           help="processes that tokenise passages when recomputing flags (0: all cores)")
    output: Optional[str] = setting(None, "--output", type=output_file, help="write the metrics report here as JSON")
    plot: Optional[str] = setting(None, "--plot", type=plot_file,
                                  help="write a plot of accuracy/recall against k here (.png, .pdf or .svg)")

    def __post_init__(self) -> None:
        check(self)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``evaluate`` sub-command (flags generated from :class:`EvaluateSettings`)."""
    p = subparsers.add_parser("evaluate",
                              description="Evaluate retrieval output against answers and/or relevance judgments.")
    add_arguments(p, EvaluateSettings)
    p.set_defaults(func=_cli)
    return p
