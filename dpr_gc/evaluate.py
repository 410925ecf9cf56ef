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
import functools
import logging
import math
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Optional

from tqdm import tqdm

from .errors import DprGcError
from .files import PathLike, atomic_path, iter_jsonl, open_text, read_json, write_json

logger = logging.getLogger(__name__)

MATCH_MODES = ("string", "regex")
REGEX_FLAGS = re.IGNORECASE | re.UNICODE | re.MULTILINE


# ----------------------------------------------------------------------------------------------- answer matching
def _class_ranges(codepoints: list[int]) -> str:
    """Render sorted code points as the body of a regex character class, merging consecutive runs."""
    parts = []
    start = prev = codepoints[0]
    for cp in codepoints[1:] + [-1]:
        if cp != prev + 1:
            parts.append(f"\\U{start:08x}" if start == prev else f"\\U{start:08x}-\\U{prev:08x}")
            start = cp
        prev = cp
    return "".join(parts)


@functools.lru_cache(maxsize=1)
def _token_pattern() -> re.Pattern[str]:
    """Tokens are runs of letters/numbers/marks, or any single char that is not a separator or control.

    These are DPR's SimpleTokenizer classes (``[\\p{L}\\p{N}\\p{M}]+`` | ``[^\\p{Z}\\p{C}]``), built from
    ``unicodedata`` so the stdlib ``re`` suffices. Combining marks count as word characters, so after NFD
    "café" stays one token ("cafe" + U+0301) and does not match "cafe". Built once per process (~0.5 s).
    """
    word, blank = [], []
    for cp in range(sys.maxunicode + 1):
        major = unicodedata.category(chr(cp))[0]
        if major in "LNM":
            word.append(cp)
        elif major in "ZC":
            blank.append(cp)
    return re.compile(f"[{_class_ranges(word)}]+|[^{_class_ranges(blank)}]")


def normalize(text: str) -> str:
    """Unicode NFD, as DPR applies to passages and answers before matching."""
    return unicodedata.normalize("NFD", text)


def tokenize(text: str, uncased: bool = True) -> list[str]:
    """Split ``text`` into DPR simple-tokenizer tokens (lower-cased when ``uncased``)."""
    tokens = _token_pattern().findall(text)
    return [t.lower() for t in tokens] if uncased else tokens


def has_answer(answers: list[str], text: str, mode: str = "string") -> bool:
    """True if any answer occurs in the passage ``text``.

    ``string``: the answer's NFD, uncased tokens appear as a contiguous run of the passage's tokens, so "art"
    does not match "artist" and "U.S." needs the periods. ``regex``: the answer is a pattern searched in the NFD
    text with IGNORECASE|UNICODE|MULTILINE (the pattern itself is not normalized, as in DPR). Unlike DPR, an
    answer with no tokens (or an empty pattern) never matches instead of matching everything.
    """
    if mode not in MATCH_MODES:
        raise DprGcError(f"unknown match mode {mode!r}; use one of {', '.join(MATCH_MODES)}")
    text = normalize(text)
    if mode == "regex":
        for pattern in answers:
            if not pattern:
                continue
            try:
                compiled = re.compile(pattern, REGEX_FLAGS)
            except re.error as e:
                raise DprGcError(f"invalid answer regex {pattern!r}: {e}; fix the pattern or use --match string")
            if compiled.search(text):
                return True
        return False
    passage = tokenize(text)
    for answer in answers:
        target = tokenize(normalize(answer))
        n = len(target)
        if n == 0 or n > len(passage):
            continue
        if any(passage[i : i + n] == target for i in range(len(passage) - n + 1)):
            return True
    return False


def _check_ks(ks: Iterable[int]) -> list[int]:
    """Validate cut-offs (positive ints) and return them sorted and de-duplicated."""
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise DprGcError(f"--k needs one or more positive integers, got {ks}")
    return sorted(set(ks))


def top_k_accuracy(hits: list[list[bool]], ks: Iterable[int]) -> dict[int, float]:
    """Fraction of questions whose first ``k`` ranked passages contain a hit, for each ``k``."""
    ks = _check_ks(ks)
    if not hits:
        raise DprGcError("no questions to evaluate (the results are empty)")
    first = [next((i for i, h in enumerate(row) if h), math.inf) for row in hits]
    return {k: sum(f < k for f in first) / len(first) for k in ks}


def read_results(path: PathLike) -> list[dict[str, Any]]:
    """Read DPR retriever output: a JSON list (or JSONL) of ``{question, answers, ctxs: [...]}``."""
    name = str(path)
    if name.endswith((".jsonl", ".jsonl.gz")):
        results = [obj for _, obj in iter_jsonl(path)]
    else:
        results = read_json(path)
    if not isinstance(results, list):
        raise DprGcError(f"{path}: expected a JSON list of questions with 'answers' and 'ctxs'")
    return results


def _question(results: list[Any], i: int, source: str) -> dict[str, Any]:
    """Return entry ``i`` after checking it has the shape of a DPR result."""
    entry = results[i]
    where = f"{source}: question {i}"
    if not isinstance(entry, dict) or not isinstance(entry.get("ctxs"), list):
        raise DprGcError(f"{where}: expected an object with a 'ctxs' list")
    if not all(isinstance(c, dict) for c in entry["ctxs"]):
        raise DprGcError(f"{where}: every entry of 'ctxs' must be an object")
    return entry


def evaluate_answers(
    results: list[dict[str, Any]], ks: Iterable[int], mode: Optional[str] = "string", source: str = "results"
) -> dict[str, float]:
    """Top-k answer accuracy over DPR results, as ``{"Accuracy@k": value}``.

    With ``mode`` ("string"/"regex") ``has_answer`` is recomputed from each passage's text; with ``mode=None``
    the stored ``has_answer`` fields are used. ``source`` names the input in error messages.
    """
    if mode is not None and mode not in MATCH_MODES:
        raise DprGcError(f"unknown match mode {mode!r}; use one of {', '.join(MATCH_MODES)}")
    hits = []
    for i in tqdm(range(len(results)), desc="matching answers", disable=None):
        entry = _question(results, i, source)
        answers = entry.get("answers")
        if mode and (not isinstance(answers, list) or not all(isinstance(a, str) for a in answers)):
            raise DprGcError(f"{source}: question {i}: 'answers' must be a list of strings")
        row = []
        for j, ctx in enumerate(entry["ctxs"]):
            field = "text" if mode else "has_answer"
            if not isinstance(ctx.get(field), str if mode else bool):
                need = "passage 'text' to match answers" if mode else "boolean 'has_answer'; give a match mode"
                raise DprGcError(f"{source}: question {i}, ctx {j}: missing {need}")
            row.append(has_answer(answers, ctx["text"], mode) if mode else ctx["has_answer"])
        hits.append(row)
    return {f"Accuracy@{k}": v for k, v in top_k_accuracy(hits, ks).items()}


# ----------------------------------------------------------------------------------------------- qrels and runs
def _fields(line: str) -> list[str]:
    """Split on tabs when the line has any (BEIR TSV), otherwise on whitespace (TREC)."""
    line = line.rstrip("\r\n")
    return [f.strip() for f in line.split("\t")] if "\t" in line else line.split()


def read_qrels(path: PathLike) -> dict[str, dict[str, int]]:
    """Read BEIR TSV qrels (``query-id corpus-id score`` with header) or TREC qrels (``qid 0 docid rel``)."""
    qrels: dict[str, dict[str, int]] = {}
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            parts = _fields(line)
            if not parts:
                continue
            if line_no == 1 and parts[0].lower() in ("query-id", "query_id"):
                continue
            if len(parts) not in (3, 4) or not all(parts):
                raise DprGcError(f"{path}:{line_no}: expected 'query-id corpus-id score' or 'qid 0 docid rel', "
                                 f"got {line.strip()!r}")
            qid, docid, rel_text = parts[0], parts[-2], parts[-1]
            if not re.fullmatch(r"[-+]?\d+(\.0*)?", rel_text):
                raise DprGcError(f"{path}:{line_no}: relevance {rel_text!r} is not an integer")
            rel = int(rel_text.split(".")[0])
            judged = qrels.setdefault(qid, {})
            if judged.get(docid, rel) != rel:
                raise DprGcError(f"{path}:{line_no}: conflicting relevance for query {qid!r} doc {docid!r}")
            judged[docid] = rel
    if not qrels:
        raise DprGcError(f"{path}: no relevance judgments found")
    return qrels


def read_run(path: PathLike) -> dict[str, dict[str, float]]:
    """Read a TREC run file (``qid Q0 docid rank score tag``) into ``{qid: {docid: score}}``."""
    run: dict[str, dict[str, float]] = {}
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 6:
                raise DprGcError(f"{path}:{line_no}: expected 6 fields 'qid Q0 docid rank score tag', "
                                 f"got {len(parts)}")
            qid, _, docid, rank, score_text, _ = parts
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


def run_from_results(results: list[dict[str, Any]], source: str = "results") -> dict[str, dict[str, float]]:
    """Turn DPR results whose questions carry an ``id`` into a run; ctx ``score`` may be a string (as DPR writes)."""
    run: dict[str, dict[str, float]] = {}
    for i in range(len(results)):
        entry = _question(results, i, source)
        if "id" not in entry:
            raise DprGcError(f"{source}: question {i} has no 'id', so it cannot be joined with qrels; "
                             "use --run instead")
        docs = run.setdefault(str(entry["id"]), {})
        for j, ctx in enumerate(entry["ctxs"]):
            where = f"{source}: question {i}, ctx {j}"
            if "id" not in ctx:
                raise DprGcError(f"{where}: missing passage 'id'")
            try:
                score = float(ctx["score"]) if "score" in ctx else float(len(entry["ctxs"]) - j)
            except (TypeError, ValueError):
                raise DprGcError(f"{where}: score {ctx['score']!r} is not a number") from None
            if str(ctx["id"]) in docs:
                raise DprGcError(f"{where}: passage {ctx['id']!r} listed twice")
            docs[str(ctx["id"])] = score
    return run


def rank_documents(scores: dict[str, float]) -> list[str]:
    """Order documents as trec_eval does: score descending, ties broken by docid descending."""
    return [d for d, _ in sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)]


def query_metrics(scores: dict[str, float], judged: dict[str, int], ks: Iterable[int]) -> dict[str, float]:
    """Metrics of one query: Recall@k, nDCG@k, MAP@k, Accuracy@k for each k, plus nDCG@10 and MRR@10.

    A document is relevant when its judgment is >= 1 (trec_eval's default relevance level). nDCG uses the
    judgment as linear gain with log2(rank + 1) discount; MAP@k divides by all relevant documents, as map_cut.
    """
    ks = _check_ks(ks)
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


def qrels_metrics(
    run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]], ks: Iterable[int]
) -> dict[str, float]:
    """Mean of :func:`query_metrics` over every query in ``qrels``.

    Queries in the qrels but absent from the run score 0 on every metric (trec_eval ``-c``; the right choice
    when a retriever silently drops queries), and queries judged all-non-relevant also score 0 and still count,
    as in pytrec_eval. Run queries without judgments are ignored.
    """
    ks = _check_ks(ks)
    if not qrels:
        raise DprGcError("the qrels are empty; nothing to evaluate")
    missing = [q for q in qrels if q not in run]
    if missing:
        logger.warning("%d of %d judged queries are missing from the run and count as 0 (e.g. %r)",
                       len(missing), len(qrels), missing[0])
    totals: dict[str, float] = {}
    for qid, judged in qrels.items():
        for name, value in query_metrics(run.get(qid, {}), judged, ks).items():
            totals[name] = totals.get(name, 0.0) + value
    order = ["Recall", "nDCG", "MRR", "MAP", "Accuracy"]
    names = sorted(totals, key=lambda n: (order.index(n.split("@")[0]), int(n.split("@")[1])))
    return {name: totals[name] / len(qrels) for name in names}


# ----------------------------------------------------------------------------------------------- reporting
def format_table(metrics: dict[str, float]) -> str:
    """Markdown table with one row per metric name and one column per cut-off k (from ``"Name@k"`` keys)."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        name, _, k = key.partition("@")
        rows.setdefault(name, {})[k] = value
    cols = sorted({k for cells in rows.values() for k in cells}, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
    lines = ["| metric | " + " | ".join(f"@{k}" if k else "value" for k in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for name, cells in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{cells[k]:.4f}" if k in cells else "" for k in cols) + " |")
    return "\n".join(lines)


def plot_metrics(curves: dict[str, dict[int, float]], path: PathLike) -> Path:
    """Write a PNG of each curve (e.g. accuracy or recall) against k; log x-axis when k spans a wide range."""
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return Path(path)


def curve(metrics: dict[str, float], name: str) -> dict[int, float]:
    """Extract ``{k: value}`` for one metric name (e.g. "Recall") from a flat ``"Name@k"`` dict."""
    return {int(key.split("@")[1]): v for key, v in metrics.items() if key.split("@")[0] == name}


def evaluate(
    ks: Iterable[int],
    results_path: Optional[PathLike] = None,
    run_path: Optional[PathLike] = None,
    qrels_path: Optional[PathLike] = None,
    mode: Optional[str] = "string",
) -> dict[str, Any]:
    """Run every evaluation the inputs allow and return a JSON-ready report.

    ``results_path`` gives answer accuracy (when questions have answers); with ``qrels_path`` the run comes
    from ``run_path``, or else from the results' question and passage ids.
    """
    ks = _check_ks(ks)
    if results_path is None and run_path is None:
        raise DprGcError("give --results FILE and/or --run FILE with --qrels FILE")
    if run_path is not None and qrels_path is None:
        raise DprGcError("--run needs --qrels FILE to score it against")
    report: dict[str, Any] = {"k": ks}
    results = read_results(results_path) if results_path is not None else None
    if results is not None and (qrels_path is None or any("answers" in r for r in results if isinstance(r, dict))):
        report["answers"] = {"results": str(results_path), "match": mode or "stored", "questions": len(results),
                             "metrics": evaluate_answers(results, ks, mode, source=str(results_path))}
    if qrels_path is not None:
        qrels = read_qrels(qrels_path)
        run = read_run(run_path) if run_path is not None else run_from_results(results, str(results_path))
        report["qrels"] = {"qrels": str(qrels_path), "run": str(run_path or results_path), "queries": len(qrels),
                           "metrics": qrels_metrics(run, qrels, ks)}
    return report


def _cli(args: argparse.Namespace) -> None:
    """Handler for ``dpr_gc evaluate``: evaluate, print tables, write JSON and the optional plot."""
    mode = None if args.match == "stored" else args.match
    report = evaluate(args.k, args.results, args.run, args.qrels, mode)
    curves = {}
    for key, title, names in (("answers", "answer accuracy ({questions} questions, match={match})", ["Accuracy"]),
                              ("qrels", "qrels metrics ({queries} judged queries)", ["Recall", "Accuracy"])):
        if key in report:
            print(f"\n{title.format(**report[key])}\n{format_table(report[key]['metrics'])}")
            curves.update({f"{key}: {name}@k": curve(report[key]["metrics"], name) for name in names})
    if args.output:
        write_json(args.output, report)
        logger.info("wrote metrics to %s", args.output)
    if args.plot:
        plot_metrics(curves, args.plot)
        logger.info("wrote plot to %s", args.plot)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``evaluate`` sub-command."""
    p = subparsers.add_parser("evaluate", help="top-k answer accuracy and qrels metrics (Recall, nDCG, MRR, MAP)",
                              description="Evaluate retrieval output against answers and/or relevance judgments.")
    p.add_argument("--results", help="DPR retriever output JSON: [{question, answers, ctxs: [...]}]")
    p.add_argument("--run", help="TREC run file 'qid Q0 docid rank score tag' (needs --qrels)")
    p.add_argument("--qrels", help="BEIR qrels TSV (query-id corpus-id score) or TREC qrels (qid 0 docid rel)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 5, 20, 100], help="cut-offs (default: 1 5 20 100)")
    p.add_argument("--match", choices=MATCH_MODES + ("stored",), default="string",
                   help="answer matching: string (NQ/TriviaQA), regex (CuratedTREC), or stored has_answer fields")
    p.add_argument("--output", help="write the metrics report here as JSON")
    p.add_argument("--plot", help="write a PNG of accuracy/recall against k here")
    p.set_defaults(func=_cli)
    return p
