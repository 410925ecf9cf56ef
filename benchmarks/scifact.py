"""Benchmark: SciFact (BEIR) nDCG@10 of all-MiniLM-L6-v2 zero-shot and after fine-tuning with Gradient Cache.

Every step goes through the toolkit: ``Retriever`` (mean pooling + L2 normalisation, ``title + " " + text``),
``encode_block`` for the corpus, a FAISS flat (exact inner-product) index, ``mine_to_file`` for hard negatives from
the zero-shot run, ``train`` for Gradient Cache and plain training, and ``qrels_metrics`` for nDCG@10 / MRR@10 /
Recall@100 on the 300 test queries. Phases, each in a fresh subprocess so its peak memory and failures are its own:

1. ``eval zeroshot`` (and a max-length sweep) -> corpus embeddings, run, metrics;
2. ``mine`` -> a DPR training file: the 809 training queries, their qrels positives and hard negatives taken from
   the zero-shot ranks ``skip+1 .. depth`` minus the qrels positives;
3. ``train gc`` at a large batch with small chunks; its peak memory (RSS on CPU, CUDA max allocated on GPU) fixes
   the budget; ``probe`` plain steps at growing batch sizes find the largest batch whose peak fits that budget;
   ``train plain`` at that batch (same data, lr, epochs, warm-up fraction);
4. ``eval`` of each trained model at the same max lengths as the zero-shot model.

Each phase writes ``<out>/<phase>/result.json`` last, so a rerun skips finished phases (delete a folder to redo it).

    python benchmarks/scifact.py                # full run, results in benchmarks/results/scifact.{json,md}
    python benchmarks/scifact.py --quick        # smoke test on a 200-passage subset, a few steps; runs/scifact-quick/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_common import committed_size, machine_info, parser, setup_logging  # noqa: E402
from dpr_gc.base.errors import report_errors  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import iter_jsonl, read_json, write_json  # noqa: E402

logger = logging.getLogger("scifact")
BM25_BEIR = {"nDCG@10": 0.665}  # BEIR paper (Thakur et al., 2021), Table 2; MRR@10 / Recall@100 not given there
METRICS = ("nDCG@10", "MRR@10", "Recall@100")


def opt(default: Any, help_text: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass
class Settings:
    """Everything the phases depend on (saved as ``<out>/<phase>/settings.json`` and read back by the subprocess)."""

    data: str
    out: str
    quick: bool = False
    query_max_length: int = opt(48, "query max length (tokens), training and evaluation")
    passage_max_length: int = opt(256, "passage max length (tokens) at evaluation and for mining")
    train_passage_max_length: int = opt(128, "passage max length (tokens) in training")
    sweep_lengths: tuple = opt((128,), "extra passage max lengths for the zero-shot sweep")
    batch_size: int = opt(256, "Gradient Cache batch (queries per step)")
    chunk_size: int = opt(32, "Gradient Cache chunk (query and passage rows per forward/backward)")
    plain_batch_size: Optional[int] = opt(None, "plain control batch; unset: the largest that fits the GC peak")
    probe_batches: tuple = opt((8, 16, 32, 64), "plain batch sizes to probe, doubling (one midpoint is added)")
    probe_steps: int = opt(2, "training steps per memory probe")
    epochs: int = opt(6, "training epochs (both runs)")
    learning_rate: float = opt(3e-4, "peak learning rate (both runs)")
    warmup_ratio: float = opt(0.1, "linear warm-up as a fraction of the steps, then linear decay")
    negatives: str = opt("mined", "mined (from the zero-shot run), random (other queries' positives) or none")
    hard_negatives: int = opt(1, "hard negatives per query and step")
    mine_depth: int = opt(30, "mine from the zero-shot top-k")
    mine_skip: int = opt(2, "skip this many top ranks when mining (likely unjudged positives)")
    mine_keep: int = opt(8, "mined negatives kept per query (one is drawn per step)")
    precision: str = opt("bf16", "training precision: fp32, bf16 or fp16 (autocast)")
    eval_precision: str = opt("bf16", "encoding precision for evaluation: fp32, bf16 or fp16")
    timing_queries: int = opt(512, "queries per back-to-back timing run of the GC and plain setups (0: skip)")
    precision_check: bool = opt(True, "also run the shortest sweep length in fp32 (quality/speed of bf16)")
    eval_batch_size: int = opt(32, "encoding batch size")
    device: Optional[str] = opt(None, "torch device (default: cuda if available, else cpu)")
    threads: Optional[int] = opt(None, "torch CPU threads (default: torch's choice)")
    seed: int = opt(0, "random seed")


VARIANT_FIELDS = ("batch_size", "chunk_size", "epochs", "learning_rate", "warmup_ratio", "negatives", "hard_negatives",
                  "train_passage_max_length", "precision", "seed")


# ----------------------------------------------------------------------------------------------- helpers
def device_of(s: Settings) -> str:
    from dpr_gc.base.devices import default_device

    return default_device(s.device)


def peak_memory_mb(device: str) -> dict:
    """This process's peak RSS (ru_maxrss, KiB on Linux) and, on CUDA, the peak allocated GPU memory."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.startswith("cuda"):
        import torch

        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def peak_of(result: dict) -> float:
    """The memory the plain batch must fit: CUDA peak on GPU, else peak RSS."""
    return result.get("peak_cuda_mb", result["peak_rss_mb"])


def retriever_config(s: Settings, passage_length: int) -> Any:
    from dpr_gc.model.retriever import RetrieverConfig

    return RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", temperature=0.05,
                           query_max_length=s.query_max_length, passage_max_length=passage_length)


def load_model(path: Optional[str], s: Settings, passage_length: int) -> Any:
    """The offline MiniLM with its own recipe (``path`` None) or a trained retriever, set to the eval lengths."""
    from dpr_gc.model.pretrained import default_model_path
    from dpr_gc.model.retriever import Retriever

    device = device_of(s)
    if path is None:
        return Retriever.from_pretrained(default_model_path(), retriever_config(s, passage_length)).to(device)
    retriever = Retriever.load(path, device)
    retriever.config.query_max_length, retriever.config.passage_max_length = s.query_max_length, passage_length
    return retriever


def flat_index(emb: Any) -> Any:
    """The toolkit's exact inner-product index over ``emb``."""
    from dpr_gc.retrieval.index import DenseIndex, IndexParams

    index = DenseIndex.build(emb.shape[1], IndexParams(kind="flat"))
    index.add(emb)
    return index


# ----------------------------------------------------------------------------------------------- phases
def phase_eval(s: Settings, name: str, model: Optional[str], passage_length: int, precision: str) -> dict:
    """Encode the corpus and the test queries, search exactly, score against the test qrels."""
    import numpy as np

    from dpr_gc.data.corpus import load_corpus, read_queries
    from dpr_gc.retrieval.encode import encode_block
    from dpr_gc.evaluation.evaluate import qrels_metrics, read_qrels

    data, folder = Path(s.data), Path(s.out) / name
    retriever = load_model(model, s, passage_length)
    corpus = load_corpus(data / "corpus.jsonl.gz", cache_dir=Path(s.out) / "cache")
    qrels = read_qrels(data / "qrels" / "test.tsv")
    queries = [q for q in read_queries(data / "queries.jsonl") if q["id"] in qrels]
    titles, texts, autocast = list(corpus["title"]), list(corpus["text"]), None if precision == "fp32" else precision
    encode_block(retriever, titles[:8], texts[:8], batch_size=8, max_length=passage_length, autocast=autocast)
    began = time.perf_counter()  # after a warm-up batch: the first bf16 call on CPU spends seconds preparing kernels
    emb = encode_block(retriever, titles, texts, batch_size=s.eval_batch_size, max_length=passage_length,
                       autocast=autocast)
    encode_s = time.perf_counter() - began
    qemb = retriever.embed("query", [q["question"] for q in queries], batch_size=s.eval_batch_size)
    scores, rows = flat_index(emb).search(qemb, min(100, len(corpus)))
    ids = list(corpus["id"])
    run = {q["id"]: {ids[r]: float(v) for v, r in zip(sc, rw) if r >= 0} for q, sc, rw in zip(queries, scores, rows)}
    metrics = qrels_metrics(run, qrels, [10, 100])
    np.save(folder / "corpus.npy", emb)
    write_json(folder / "run.json", run)
    return {"metrics": metrics, "passage_max_length": passage_length, "query_max_length": s.query_max_length,
            "precision": precision, "encode_s": encode_s, "passages": len(ids), "queries": len(queries),
            "passages_per_s": len(ids) / encode_s, "seconds": time.perf_counter() - began}


def phase_mine(s: Settings) -> dict:
    """Hard negatives for the training queries from the zero-shot corpus embeddings (a DPR training file)."""
    import numpy as np

    from dpr_gc.data.corpus import load_corpus
    from dpr_gc.evaluation.evaluate import read_qrels
    from dpr_gc.retrieval.mine import DenseSource, beir_training_records, mine_to_file

    data, out = Path(s.data), Path(s.out)
    corpus = load_corpus(data / "corpus.jsonl.gz", cache_dir=out / "cache")
    emb = np.load(out / "zeroshot" / "corpus.npy")
    retriever = load_model(None, s, s.passage_max_length)
    records, id_to_row = beir_training_records(data / "queries.jsonl", data / "qrels" / "train.tsv", corpus)
    source = DenseSource(retriever, flat_index(emb), s.eval_batch_size)
    summary = mine_to_file(records, out / "mine" / "train.json", source, corpus, n_negatives=s.mine_keep,
                           top_k=s.mine_depth, skip_top=s.mine_skip, qrels=read_qrels(data / "qrels" / "train.tsv"),
                           id_to_row=id_to_row, show_progress=False)
    return {"training_queries": len(records), "file": str(out / "mine" / "train.json"), **summary.table()}


def train_source(s: Settings) -> str:
    return str(Path(s.out) / "mine" / "train.json") if s.negatives == "mined" else s.data


def phase_train(s: Settings, name: str, batch_size: int, grad_cache: bool, max_steps: Optional[int] = None) -> dict:
    """One training run through ``dpr_gc.train``; returns its summary plus the lr schedule actually used."""
    from dpr_gc.data.training import load_training_data
    from dpr_gc.model.pretrained import default_model_path
    from dpr_gc.train.trainer import train
    from dpr_gc.train.config import CacheConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

    folder = Path(s.out) / name
    shutil.rmtree(folder / "train", ignore_errors=True)
    source, cache = train_source(s), str(Path(s.out) / "cache")
    questions = len(load_training_data([source], cache))
    steps = max_steps or (questions // batch_size) * s.epochs
    if steps < 1:
        raise DprGcError(f"{questions} training queries give no full batch of {batch_size}; lower --batch-size")
    warmup = max(1, round(s.warmup_ratio * steps))
    config = TrainConfig(
        model=ModelConfig(name=default_model_path(), retriever=retriever_config(s, s.train_passage_max_length)),
        data=DataConfig(train_files=[source], batch_size=batch_size, cache_dir=cache,
                        hard_negatives=s.hard_negatives if s.negatives != "none" else 0),
        optim=OptimConfig(learning_rate=s.learning_rate, epochs=s.epochs, max_steps=max_steps, warmup_steps=warmup,
                          precision=s.precision),
        cache=(CacheConfig(query_chunk_size=s.chunk_size, passage_chunk_size=s.chunk_size) if grad_cache
               else CacheConfig(enabled=False)),
        run=RunConfig(output_dir=str(folder / "train"), device=device_of(s), seed=s.seed, log_every=1))
    summary = train(config)
    for old in (folder / "train").glob("checkpoint-*"):
        shutil.rmtree(old)  # the optimizer state is not needed for evaluation
    return {"summary": summary, "training_queries": questions, "steps": steps, "warmup_steps": warmup,
            "batch_size": batch_size, "grad_cache": grad_cache, "chunk_size": s.chunk_size if grad_cache else None,
            "model": str(folder / "train" / "final"), "seconds": summary["seconds"],
            "seconds_per_step": summary["seconds"] / max(summary["steps"], 1)}


def child(s: Settings, phase: str, name: str, extra: dict) -> None:
    """Run one phase in this (fresh) process and write its result.json, with the process's peak memory, last."""
    import torch

    torch.manual_seed(s.seed)
    began, load_start = time.perf_counter(), os.getloadavg()
    if phase == "eval":
        result = phase_eval(s, name, extra.get("model"), extra["passage_length"], extra["precision"])
    elif phase == "mine":
        result = phase_mine(s)
    elif phase in ("train", "probe"):
        result = phase_train(s, name, extra["batch_size"], extra["grad_cache"], extra.get("max_steps"))
        if phase == "probe":
            shutil.rmtree(Path(s.out) / name / "train", ignore_errors=True)
    else:
        raise DprGcError(f"unknown phase {phase!r}")
    result.update(phase=phase, name=name, wall_s=time.perf_counter() - began, **peak_memory_mb(device_of(s)),
                  load_average={"start": load_start, "end": os.getloadavg()})
    write_json(Path(s.out) / name / "result.json", result)


# ----------------------------------------------------------------------------------------------- orchestration
def run_phase(s: Settings, phase: str, name: str, **extra: Any) -> dict:
    """Run a phase in a subprocess unless its result.json exists; returns the result."""
    done = Path(s.out) / name / "result.json"
    if done.is_file():
        logger.info("%s: cached (%s)", name, done)
        return read_json(done)
    write_json(Path(s.out) / name / "settings.json", dataclasses.asdict(s))
    logger.info("%s: running %s %s", name, phase, extra or "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--name", name,
           "--settings", str(Path(s.out) / name / "settings.json"), "--extra", json.dumps(extra)]
    env = dict(os.environ, TQDM_MININTERVAL=os.environ.get("TQDM_MININTERVAL", "30"))
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not done.is_file():
        raise DprGcError(f"phase {name} failed (exit {proc.returncode}); see the log above, fix, and rerun to resume")
    result = read_json(done)
    logger.info("%s: done in %.0f s, peak memory %.0f MB", name, result["wall_s"], peak_of(result))
    return result


def pick_plain_batch(s: Settings, budget_mb: float) -> tuple[int, list[dict]]:
    """The largest probed plain batch whose peak memory fits ``budget_mb``: doubling, then one midpoint."""
    probes: list[dict] = []

    def probe(b: int) -> bool:
        r = run_phase(s, "probe", f"probe-plain-b{b}", batch_size=b, grad_cache=False, max_steps=s.probe_steps)
        fits = peak_of(r) <= budget_mb
        probes.append({"batch_size": b, "peak_mb": peak_of(r), "fits": fits, "seconds_per_step": r["seconds_per_step"],
                       "wall_s": r["wall_s"]})
        return fits

    fit, over = None, None
    for b in sorted(s.probe_batches):
        if not probe(b):
            over = b
            break
        fit = b
    if fit is None:
        raise DprGcError(f"even a plain batch of {min(s.probe_batches)} exceeds the GC peak; probe smaller batches")
    if over is not None and over - fit > 2 and probe((fit + over) // 2):
        fit = (fit + over) // 2
    return fit, probes


def timing_runs(s: Settings, plain_batch: int) -> dict:
    """GC and plain training on the same number of queries, back to back, so their speeds meet the same load."""
    out = {}
    for label, batch, grad_cache in (("gc", s.batch_size, True), ("plain", plain_batch, False)):
        name = f"timing-{label}-{run_tag(s, batch)}" + (f"-c{s.chunk_size}" if grad_cache else "")
        out[label] = run_phase(s, "probe", name, batch_size=batch, grad_cache=grad_cache,
                               max_steps=max(1, s.timing_queries // batch))
    return out


def write_quick_data(s: Settings, source: Path, docs: int = 200) -> None:
    """A small BEIR folder: 20 test and 48 training queries, their positives, filler passages up to ``docs``."""
    from dpr_gc.evaluation.evaluate import read_qrels

    out = Path(s.data)
    if (out / "qrels" / "test.tsv").is_file():
        return
    picked = {split: dict(list(read_qrels(source / "qrels" / f"{split}.tsv").items())[:n])
              for split, n in (("test", 20), ("train", 48))}
    needed = {d for qrels in picked.values() for judged in qrels.values() for d in judged}
    corpus = [o for _, o in iter_jsonl(source / "corpus.jsonl.gz")]
    rows = [o for o in corpus if o["_id"] in needed]
    rows += [o for o in corpus if o["_id"] not in needed][:max(0, docs - len(rows))]
    qids = {q for qrels in picked.values() for q in qrels}
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    import gzip

    with gzip.open(out / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in rows)
    with open(out / "queries.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for _, o in iter_jsonl(source / "queries.jsonl") if o["_id"] in qids)
    for split, qrels in picked.items():
        with open(out / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{q}\t{d}\t{r}\n" for q, judged in qrels.items() for d, r in judged.items())


def run_tag(s: Settings, batch_size: int) -> str:
    """The folder name part shared by a training run's phases (so changed settings never reuse a stale run)."""
    return (f"b{batch_size}-e{s.epochs}-lr{s.learning_rate:g}-{s.negatives}{s.hard_negatives}"
            f"-p{s.train_passage_max_length}-{s.precision}" + (f"-seed{s.seed}" if s.seed else ""))


def train_and_eval(s: Settings, grad_cache: bool, batch_size: int) -> tuple[dict, dict]:
    name = f"gc-{run_tag(s, batch_size)}-c{s.chunk_size}" if grad_cache else f"plain-{run_tag(s, batch_size)}"
    trained = run_phase(s, "train", name, batch_size=batch_size, grad_cache=grad_cache)
    evaluated = run_phase(s, "eval", f"{name}-eval", model=trained["model"], passage_length=s.passage_max_length,
                          precision=s.eval_precision)
    return trained, evaluated


def orchestrate(s: Settings, results_dir: Path, variants: list[dict]) -> dict:
    """All phases in order (cached ones skipped), then the results JSON and markdown table."""
    began, load_start = time.perf_counter(), os.getloadavg()
    zero = run_phase(s, "eval", "zeroshot", passage_length=s.passage_max_length, precision=s.eval_precision)
    mined = run_phase(s, "mine", "mine") if s.negatives == "mined" else None
    gc, gc_eval = train_and_eval(s, True, s.batch_size)
    if s.plain_batch_size:
        plain_batch, probes = s.plain_batch_size, []
    else:
        plain_batch, probes = pick_plain_batch(s, peak_of(gc))
    plain, plain_eval = train_and_eval(s, False, plain_batch)
    rows = [row("MiniLM-L6-v2 zero-shot", zero), row(f"GC fine-tuned (batch {s.batch_size}, chunk {s.chunk_size})",
                                                      gc_eval, gc),
            row(f"plain fine-tuned (batch {plain_batch}, control)", plain_eval, plain)]
    phases = [zero, gc, gc_eval, plain, plain_eval] + ([mined] if mined else [])
    mined = run_variants(s, variants, mined, rows, phases)
    sweep = run_sweep(s, zero)
    phases += [v for v in sweep.values() if v is not zero]
    timing = timing_runs(s, plain_batch) if s.timing_queries else {}
    phases += list(timing.values())
    rows.append({"model": "BM25 (BEIR paper)", **{m: BM25_BEIR.get(m) for m in METRICS}})
    report = {
        "benchmark": "SciFact (BEIR) test split: 300 queries, 5,183 passages" if not s.quick else "quick subset",
        "machine": machine(s, load_start), "settings": dataclasses.asdict(s), "variants": variants, "rows": rows,
        "length_sweep": [{"passage_max_length": k[0], "precision": k[1], **{m: v["metrics"][m] for m in METRICS},
                          "encode_s": v["encode_s"], "passages_per_s": v["passages_per_s"]}
                         for k, v in sorted(sweep.items())],
        "plain_batch": {"chosen": plain_batch, "budget_mb": peak_of(gc), "probes": probes,
                        "rule": "largest probed plain batch whose peak (RSS on CPU, CUDA max allocated on GPU) "
                                "is <= the GC run's measured peak"},
        "timing": {k: {"batch_size": v["batch_size"], "steps": v["steps"], "seconds": v["seconds"],
                       "seconds_per_1000_queries": 1000 * v["seconds"] / (v["steps"] * v["batch_size"]),
                       "load_average": v.get("load_average")} for k, v in timing.items()},
        "mining": mined, "phases": {p["name"]: p for p in phases},
        "targets": targets(rows, zero, plain_eval),
        "wall_s_this_invocation": time.perf_counter() - began,
        "wall_s_all_phases": sum(p["wall_s"] for p in phases) + sum(p["wall_s"] for p in probes),
    }
    stem = "scifact-quick" if s.quick else "scifact"
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json(results_dir / f"{stem}.json", report)
    (results_dir / f"{stem}.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return report


def run_variants(s: Settings, variants: list[dict], mined: Optional[dict], rows: list, phases: list) -> Optional[dict]:
    """Train and score each ``--variant`` (mining first when a variant needs it and nothing was mined); their rows
    and phases are appended. Returns the mining phase, if any."""
    for overrides in variants:
        sv = dataclasses.replace(s, **overrides)
        if sv.negatives == "mined" and mined is None:
            mined = run_phase(sv, "mine", "mine")
            phases.append(mined)
        v_train, v_eval = train_and_eval(sv, True, sv.batch_size)
        label = ", ".join(f"{k.replace('_', ' ')} {v:g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                          for k, v in overrides.items())
        rows.append(row(f"GC variant ({label})", v_eval, v_train))
        phases += [v_train, v_eval]
    return mined


def run_sweep(s: Settings, zero: dict) -> dict:
    """Zero-shot scores per (passage length, precision): the main one, ``--sweep-lengths``, and the fp32 check."""
    sweep = {(s.passage_max_length, s.eval_precision): zero}
    for length in s.sweep_lengths:
        sweep[(length, s.eval_precision)] = run_phase(s, "eval", f"zeroshot-p{length}-{s.eval_precision}",
                                                      passage_length=length, precision=s.eval_precision)
    if s.precision_check and s.eval_precision != "fp32":
        length = min(s.sweep_lengths or (s.passage_max_length,))
        sweep[(length, "fp32")] = run_phase(s, "eval", f"zeroshot-p{length}-fp32", passage_length=length,
                                            precision="fp32")
    return sweep


def machine(s: Settings, load_start: tuple) -> dict:
    """Where the figures came from, with the load average at the start and the end."""
    import torch

    device = device_of(s)
    return {**machine_info(device, torch.get_num_threads()), "load_average_at_start": load_start,
            "load_average_end": os.getloadavg()}


def targets(rows: list[dict], zero: dict, plain_eval: dict) -> dict:
    """Per Gradient Cache row: above zero-shot, above BM25, at least 0.70 and above the plain control (nDCG@10)."""
    zero_ndcg, plain_ndcg = zero["metrics"]["nDCG@10"], plain_eval["metrics"]["nDCG@10"]
    return {r["model"]: {"beats_zeroshot": r["nDCG@10"] > zero_ndcg, "beats_bm25": r["nDCG@10"] > BM25_BEIR["nDCG@10"],
                         "at_least_0.70": r["nDCG@10"] >= 0.70, "beats_plain": r["nDCG@10"] > plain_ndcg}
            for r in rows if r["model"].startswith("GC")}


def row(label: str, ev: dict, trained: Optional[dict] = None) -> dict:
    out = {"model": label, **{m: ev["metrics"][m] for m in METRICS}}
    if trained is not None:
        out.update(train_s=trained["seconds"], steps=trained["steps"], peak_mb=peak_of(trained),
                   batch_size=trained["batch_size"], chunk_size=trained["chunk_size"])
    return out


def markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    mem = "GPU MB, max allocated" if m["device"].startswith("cuda") else "RSS MB"

    def fmt(v: Any, spec: str = ".4f") -> str:
        return "–" if v is None else format(v, spec)

    lines = [f"## {report['benchmark']}", "",
             f"| model | nDCG@10 | MRR@10 | Recall@100 | train time (s) | steps | peak train memory ({mem}) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {fmt(r['nDCG@10'])} | {fmt(r['MRR@10'])} | {fmt(r['Recall@100'])} | "
              f"{fmt(r.get('train_s'), '.0f')} | {r.get('steps', '–')} | {fmt(r.get('peak_mb'), '.0f')} |"
              for r in report["rows"]]
    lines += ["", "Zero-shot by passage max length and encoding precision:", "",
              "| passage max length | precision | nDCG@10 | MRR@10 | Recall@100 | corpus encode s | passages/s |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['passage_max_length']} | {r['precision']} | {r['nDCG@10']:.4f} | {r['MRR@10']:.4f} | "
              f"{r['Recall@100']:.4f} | {r['encode_s']:.0f} | {r['passages_per_s']:.1f} |"
              for r in report["length_sweep"]]
    if report["timing"]:
        lines += ["", "Training speed measured back to back on the same number of queries (the full runs above met "
                  "different loads on this shared machine):", "",
                  "| setup | batch | steps | seconds | s per 1000 queries | load average (start) |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {k} | {v['batch_size']} | {v['steps']} | {v['seconds']:.0f} | "
                  f"{v['seconds_per_1000_queries']:.0f} | {(v['load_average'] or {'start': [0]})['start'][0]:.1f} |"
                  for k, v in report["timing"].items()]
    pb = report["plain_batch"]
    probes = ", ".join(f"batch {p['batch_size']}: {p['peak_mb']:.0f} MB{'' if p['fits'] else ' (over)'}"
                       for p in pb["probes"]) or "none (batch given)"
    negatives = (f"{s['hard_negatives']} {s['negatives']} hard negative per query and step" +
                 (f" (drawn from {s['mine_keep']} mined from ranks {s['mine_skip'] + 1}-{s['mine_depth']} of the "
                  "zero-shot run, qrels positives removed)" if s["negatives"] == "mined" else ""))
    lines += ["", f"Plain control batch {pb['chosen']}: the {pb['rule']} ({pb['budget_mb']:.0f} MB). Probes: {probes}.",
              "", f"Settings: max length query {s['query_max_length']} / passage {s['passage_max_length']} tokens at "
              f"evaluation and mining, passage {s['train_passage_max_length']} in training; mean pooling, L2 "
              f"normalisation, temperature 0.05, title + ' ' + text; {s['epochs']} epochs at lr "
              f"{s['learning_rate']:g} (warm-up {s['warmup_ratio']:.0%} of the steps, then linear decay); "
              f"{negatives}; training precision {s['precision']}, encoding precision {s['eval_precision']}; "
              f"device {m['device']}{' (' + m['gpu'] + ')' if m.get('gpu') else ''}.",
              f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['threads']} torch threads), run "
              f"{m['date']}, load average {m['load_average_at_start'][0]:.1f} at start and "
              f"{m['load_average_end'][0]:.1f} at the end (shared "
              f"machine). Wall time: {report['wall_s_all_phases'] / 60:.1f} min over all phases.",
              "", "Targets (nDCG@10): " + "; ".join(f"{name}: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                                                         for k, v in t.items())
                                                  for name, t in report["targets"].items())]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- command line
QUICK = dict(query_max_length=32, passage_max_length=64, train_passage_max_length=48, sweep_lengths=(32,),
             batch_size=16, chunk_size=4, probe_batches=(2, 4, 8), epochs=1, mine_depth=20, mine_keep=4,
             eval_batch_size=16, timing_queries=32)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, paragraph=True)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"), help="BEIR SciFact folder")
    p.add_argument("--out", default=str(ROOT / "runs" / "scifact"), help="cache folder for every phase")
    p.add_argument("--results", help="folder the JSON/markdown go to (default: benchmarks/results for the "
                   "committed run's settings; --quick or others: the out folder, so a trial run never replaces a "
                   "committed file)")
    p.add_argument("--quick", action="store_true", help="smoke test: 200-passage subset, tiny lengths and batches "
                   "(out folder gets a -quick suffix, results go to scifact-quick.* there)")
    for f in dataclasses.fields(Settings):
        if f.name in ("data", "out", "quick"):
            continue
        flag, value, text = "--" + f.name.replace("_", "-"), f.default, f.metadata["help"]
        if isinstance(value, bool):
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                           help="do not " + text)
        elif isinstance(value, tuple):
            p.add_argument(flag, type=int, nargs="*", default=value, help=text)
        else:
            kind = str if f.name == "device" else int if value is None else type(value)
            p.add_argument(flag, type=kind, default=value, help=text)
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="FIELD=VALUE",
                   help="an extra GC run with these settings changed, reported beside the first (repeatable); "
                        f"fields: {', '.join(VARIANT_FIELDS)}")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def parse_variant(items: list[str]) -> dict:
    """``["learning_rate=2e-4", "epochs=4"]`` -> ``{"learning_rate": 2e-4, "epochs": 4}`` (typed like Settings)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in VARIANT_FIELDS or not value:
            raise DprGcError(f"--variant {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(VARIANT_FIELDS)}")
        default = next(f.default for f in dataclasses.fields(Settings) if f.name == key)
        try:
            out[key] = type(default)(value)
        except ValueError:
            raise DprGcError(f"--variant {item!r}: {value!r} is not a valid {type(default).__name__}") from None
    return out


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the flags; ``--quick`` swaps in small defaults for flags left at their default."""
    parser_defaults = vars(parse_args([]))
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if f.name not in ("data", "out")}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    if args.quick:
        values.update({k: v for k, v in QUICK.items() if values[k] == parser_defaults[k]})
    s = Settings(data=args.data, out=args.out, **values)
    source = Path(s.data)
    if not (source / "corpus.jsonl.gz").is_file():
        raise DprGcError(f"SciFact not found in {source}; pass --data (see ../shared/data/README.md)")
    if args.quick:
        s.out = str(Path(args.out).with_name(Path(args.out).name + "-quick"))
        s.data = str(Path(s.out) / "data")
        write_quick_data(s, source)
    if s.negatives not in ("mined", "random", "none"):
        raise DprGcError(f"--negatives must be mined, random or none, got {s.negatives!r}")
    for flag, value in (("--precision", s.precision), ("--eval-precision", s.eval_precision)):
        if value not in ("fp32", "bf16", "fp16"):
            raise DprGcError(f"{flag} must be fp32, bf16 or fp16, got {value!r}")
    return s


# the command of the committed scifact.{json,md} (benchmarks/README.md); every setting but where a run reads and
# writes and what it runs on sizes it
COMMITTED = (("--sweep-lengths", "--no-precision-check", "--timing-queries", "256", "--variant", "epochs=3",
              "learning_rate=1e-4", "--variant", "batch_size=128", "learning_rate=2e-4", "epochs=4"),)
SIZING = tuple(f.name for f in dataclasses.fields(Settings) if f.name not in ("data", "out", "device", "threads"))


def results_file(args: argparse.Namespace) -> Path:
    """The results JSON a run with ``args`` writes (its markdown beside it): scifact.json, scifact-quick.json for
    --quick, in :func:`results_folder`."""
    return results_folder(args) / f"scifact{'-quick' if args.quick else ''}.json"


def results_folder(args: argparse.Namespace) -> Path:
    """Where the JSON/markdown go: ``--results``, else the committed folder for the committed run's settings, or
    the out folder for any other run (``--quick``: its ``-quick`` one), so a trial run never replaces them."""
    if args.results:
        return Path(args.results)
    if args.quick:
        return Path(args.out).with_name(Path(args.out).name + "-quick")
    if not committed_size(parse_args, args, (*SIZING, "variant"), COMMITTED):
        return Path(args.out)
    return ROOT / "benchmarks" / "results"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    setup_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    return report_errors(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    """The orchestrator (no ``--phase``) or one phase in its own process."""
    if args.phase:
        saved = read_json(args.settings)
        s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    else:
        s = settings_from_args(args)
    if s.threads:
        import torch

        torch.set_num_threads(s.threads)
    if args.phase:
        child(s, args.phase, args.name, json.loads(args.extra))
    else:
        orchestrate(s, results_folder(args), [parse_variant(v) for v in args.variant])

if __name__ == "__main__":
    sys.exit(main())
