"""Benchmark: step time and peak memory of one contrastive training step against the batch size.

Methods (each configuration runs in a fresh Python process so peak memory is that configuration's alone):

* ``plain``: the whole batch through the encoder with one graph, the loss, one backward;
* ``dpr-gc``: ``dpr_gc.GradCache`` as shipped (trimmed chunks, chunks grouped by length, last graph kept);
* ``dpr-gc-features-off``: dpr-gc's own engine with ``trim=False, sort_by_length=False, keep_last_graph=False``:
  an ablation to show where the speed comes from, NOT a third-party peer;
* ``grad_cache-original``: the original package (``grad_cache.GradCache`` from github.com/luyug/GradCache, when it
  is importable) on the same encoder, with its own ``SimpleContrastiveLoss`` on the cosine scores / temperature;
* ``st-cmnrl``: sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with ``mini_batch_size=chunk`` on
  a ``SentenceTransformer`` built from the same model folder.

All use the offline all-MiniLM-L6-v2 (mean pooling, L2-normalised), one hard negative per query, cosine scores
at temperature 0.05 (sentence-transformers' scale 20), dropout on (train mode), fp32. A step is ``zero_grad``
then forward + backward; tokenisation and moving inputs to the device are outside the timing for every method.
Each process runs one warm-up step on a single chunk, then ``--steps`` timed steps (median): wall time and the
process's CPU time (user + sys, steadier than wall time on a shared machine when run with one thread). Peak
memory: see :class:`PeakMemory`. See benchmarks/README.md for the results and how to read them.

    python benchmarks/bench_gradcache.py --batches 32,128,512 --chunk 32 --memory-check
    python benchmarks/bench_gradcache.py --quick --tiny        # smoke run with a tiny random BERT
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
import json
import logging
import os
import random
import resource
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine_info as common_machine_info  # noqa: E402
from bench_common import (committed_size, int_list, name_list, output_help, parser, require_cuda,  # noqa: E402
                          results_path, run_script, setup_logging)
from dpr_gc.base.args import positive_float, positive_int  # noqa: E402
from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.base.files import iter_jsonl, read_json_object, write_json  # noqa: E402

logger = logging.getLogger(__name__)

OURS = "dpr-gc"
ORIGINAL = "grad_cache-original"
METHODS = ("plain", OURS, "dpr-gc-features-off", ORIGINAL, "st-cmnrl")
PEERS = (ORIGINAL, "st-cmnrl")  # third-party packages only
INPUTS = ("fixed", "uneven")
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"
TEMPERATURE = 0.05
WORDS = ("cell protein gene expression tumour patients study results increased risk mice treatment clinical "
         "analysis response levels disease model associated receptor activity signalling pathway the of and in "
         "with was for by").split()
RESULT_TAG = "RESULT "


# ----------------------------------------------------------------------------------------------- inputs
def load_pairs(batch: int, seed: int) -> tuple[list[str], list[str], list[str], str]:
    """``batch`` (claim, gold abstract, random other abstract) triples from SciFact train+test qrels, shuffled.

    Pairs are reused cyclically when the batch is larger than SciFact (1,258 pairs); each reuse draws a new
    negative. Without SciFact, generated text of uneven length stands in (reported as ``generated``).
    """
    rng = random.Random(seed)
    if not (SCIFACT / "corpus.jsonl.gz").is_file():
        words = lambda lo, hi: " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))  # noqa: E731
        return ([words(3, 30) for _ in range(batch)], [words(10, 300) for _ in range(batch)],
                [words(10, 300) for _ in range(batch)], "generated")
    queries = {o["_id"]: o["text"] for _, o in iter_jsonl(SCIFACT / "queries.jsonl")}
    corpus = {o["_id"]: f"{o.get('title') or ''} {o['text']}".strip() for _, o in iter_jsonl(SCIFACT / "corpus.jsonl.gz")}
    pairs = []
    for split in ("train", "test"):
        lines = (SCIFACT / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
        pairs += [(q, d) for q, d, *_ in (line.split("\t") for line in lines) if q in queries and d in corpus]
    rng.shuffle(pairs)
    doc_ids = sorted(corpus)
    q, p, n = [], [], []
    for i in range(batch):
        qid, did = pairs[i % len(pairs)]
        neg = rng.choice(doc_ids)
        while neg == did:
            neg = rng.choice(doc_ids)
        q.append(queries[qid])
        p.append(corpus[did])
        n.append(corpus[neg])
    return q, p, n, "scifact"


def synthetic(rows: int, length: int, tokenizer: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random token ids of exactly ``length`` tokens ([CLS] ... [SEP]), no padding."""
    low = 1000 if len(tokenizer) > 2000 else max(tokenizer.all_special_ids) + 1
    ids = torch.randint(low, len(tokenizer), (rows, length), generator=gen)
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def tokenize(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    return dict(tokenizer(texts, max_length=max_length, truncation=True, padding=True, return_tensors="pt"))


def build_inputs(cfg: dict, tokenizer: Any, batch: int) -> tuple[list[dict[str, torch.Tensor]], str]:
    """``[queries, positives, negatives]`` token dicts, each padded to its own longest row."""
    if cfg["input"] == "fixed":
        gen = torch.Generator().manual_seed(cfg["seed"])
        return [synthetic(batch, cfg["q_len"], tokenizer, gen)] + [
            synthetic(batch, cfg["p_len"], tokenizer, gen) for _ in range(2)], "synthetic"
    q, p, n, source = load_pairs(batch, cfg["seed"])
    return [tokenize(tokenizer, q, cfg["q_len"]), tokenize(tokenizer, p, cfg["p_len"]),
            tokenize(tokenizer, n, cfg["p_len"])], source


def interleave(pos: dict[str, torch.Tensor], neg: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """One passage input laid out as ``dpr_gc`` expects: ``[pos_0, neg_0, pos_1, neg_1, ...]``, right-padded."""
    width = max(pos["input_ids"].size(1), neg["input_ids"].size(1))
    out = {}
    for key in pos:
        a, b = (torch.nn.functional.pad(t[key], (0, width - t[key].size(1)), value=pad_id if key == "input_ids" else 0)
                for t in (pos, neg))
        out[key] = torch.stack([a, b], dim=1).flatten(0, 1)
    return out


def token_slots(masks: list[torch.Tensor], chunk: Optional[int], sort: bool, trim: bool) -> int:
    """Token positions one encoder pass computes over these inputs (padding included) under a chunking policy."""
    total = 0
    for mask in masks:
        lengths = mask.sum(1)
        if sort:
            lengths = lengths.sort(descending=True).values
        size = chunk or len(lengths)
        for start in range(0, len(lengths), size):
            part = lengths[start:start + size]
            total += len(part) * (int(part.max()) if trim else mask.size(1))
    return total


# ----------------------------------------------------------------------------------------------- memory
def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def release_free_heap() -> None:
    """Hand glibc's free heap pages back to the kernel (``malloc_trim``), so the baseline resident set holds no
    freed memory that the measured steps could reuse unseen; a no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory above a baseline, in MB.

    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation at :meth:`start`. CPU: the kernel's resident-set
    high-water mark (``VmHWM``), reset at :meth:`start` by writing 5 to ``/proc/self/clear_refs``, minus the
    resident set at that moment (taken after ``malloc_trim``); where the reset is refused, a thread samples
    ``VmRSS`` every millisecond instead.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.base, self.method = device, 0, ""
        self._peak, self._stop, self._thread = 0, threading.Event(), None

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base, self.method = torch.cuda.memory_allocated(self.device), "cuda max_memory_allocated"
            return
        release_free_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM reset via clear_refs"
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self.base = self._peak = proc_status_kb("VmRSS") * 1024
        if self._thread is not None:
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, proc_status_kb("VmRSS") * 1024)

    def stop(self) -> float:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = self._peak
        else:
            peak = proc_status_kb("VmHWM") * 1024
        return (peak - self.base) / 2**20


# ----------------------------------------------------------------------------------------------- one configuration
def make_step(cfg: dict, device: torch.device) -> tuple[Callable[[list], Callable[[], float]], Any, torch.nn.Module, str]:
    """Load the model for ``cfg['method']``; return (prepare(inputs) -> step(), tokenizer, module, attention impl)."""
    if cfg["method"] == "st-cmnrl":
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

        st = SentenceTransformer(cfg["model"], device=str(device))
        st.train()
        loss_mod = CachedMultipleNegativesRankingLoss(st, scale=1 / TEMPERATURE, mini_batch_size=cfg["chunk"])

        def prepare_st(inputs: list) -> Callable[[], float]:
            features = [{k: v.to(device) for k, v in x.items()} for x in inputs]

            def step() -> float:
                loss = loss_mod([dict(f) for f in features], None)
                loss.backward()
                return loss.item()
            return step
        return prepare_st, st.tokenizer, st, st[0].auto_model.config._attn_implementation

    from dpr_gc.model.retriever import Retriever, RetrieverConfig

    config = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", query_max_length=cfg["q_len"],
                             passage_max_length=cfg["p_len"], temperature=TEMPERATURE)
    retriever = Retriever.from_pretrained(cfg["model"], config).to(device).train()
    encoder = retriever.query_encoder  # tied towers: passage_encoder is the same module
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1, temperature=TEMPERATURE, similarity="cos").to(device)
    engine = None
    if cfg["method"] == ORIGINAL:
        from grad_cache import GradCache as OriginalGradCache
        from grad_cache.loss import SimpleContrastiveLoss as OriginalLoss

        original_loss = OriginalLoss(n_hard_negatives=1)  # dot product: the encoder normalises, we scale
        engine = OriginalGradCache([encoder, retriever.passage_encoder], cfg["chunk"],
                                   lambda x, y: original_loss(x / TEMPERATURE, y))
    elif cfg["method"] != "plain":
        ours = cfg["method"] == OURS
        engine = GradCache([encoder, retriever.passage_encoder], cfg["chunk"], loss_fn,
                           chunking=Chunking(sort_by_length=ours, trim=ours, keep_last_graph=ours))

    def prepare(inputs: list) -> Callable[[], float]:
        q = {k: v.to(device) for k, v in inputs[0].items()}
        p = {k: v.to(device) for k, v in interleave(inputs[1], inputs[2], retriever.tokenizer.pad_token_id).items()}

        def step() -> float:
            if engine is not None:
                return float(engine.cache_step(q, p))
            loss = loss_fn(encoder(**q), retriever.passage_encoder(**p))
            loss.backward()
            return loss.item()
        return step
    return prepare, retriever.tokenizer, retriever, encoder.transformer.config._attn_implementation


def run_one(cfg: dict) -> dict:
    """Time ``cfg['steps']`` steps after one warm-up step on a single chunk; measure the peak memory of them all."""
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    prepare, tokenizer, module, attn = make_step(cfg, device)
    inputs, source = build_inputs(cfg, tokenizer, cfg["batch"])
    warm_inputs, _ = build_inputs(cfg, tokenizer, min(cfg["batch"], cfg["chunk"]))
    q_mask = inputs[0]["attention_mask"]
    p_mask = interleave(inputs[1], inputs[2], 0)["attention_mask"]
    warm_step, step = prepare(warm_inputs), prepare(inputs)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    meter = PeakMemory(device)
    meter.start()
    module.zero_grad(set_to_none=True)
    warm_step()
    times, cpu_times, sys_times, faults, losses = [], [], [], [], []
    for _ in range(cfg["steps"]):
        module.zero_grad(set_to_none=True)
        sync()
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        losses.append(step())
        sync()
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        sys_times.append(after.ru_stime - usage.ru_stime)
        cpu_times.append(after.ru_utime - usage.ru_utime + sys_times[-1])
        faults.append(after.ru_minflt - usage.ru_minflt)
    peak_mb = meter.stop()
    median, cpu = statistics.median(times), statistics.median(cpu_times)
    chunk = None if cfg["method"] == "plain" else cfg["chunk"]
    ours = cfg["method"] == OURS
    st = cfg["method"] == "st-cmnrl"
    # dpr_gc sees one interleaved passage input; sentence-transformers chunks positives and negatives separately.
    p_masks = [inputs[1]["attention_mask"], inputs[2]["attention_mask"]] if st else [p_mask]
    return {**cfg, "data": source, "step_s": median, "step_times_s": times, "examples_per_s": cfg["batch"] / median,
            "cpu_s": cpu, "cpu_times_s": cpu_times, "examples_per_cpu_s": cfg["batch"] / cpu,
            "sys_s": statistics.median(sys_times), "minor_faults": statistics.median(faults),
            "peak_mb": peak_mb, "memory_method": meter.method, "baseline_rss_mb": meter.base / 2**20,
            "losses": losses, "attn_implementation": attn,
            "real_tokens": int(q_mask.sum() + p_mask.sum()),
            "token_slots": token_slots([q_mask] + p_masks, chunk, sort=ours, trim=ours or st)}


# ----------------------------------------------------------------------------------------------- driver
def tiny_model(folder: Path) -> str:
    """Save a random 2-layer BERT (hidden 32) and a WordPiece tokenizer covering ASCII text into ``folder``."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + chars + [f"##{c}" for c in chars]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=37, max_position_embeddings=512)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def encoder_model(tiny: bool, folder: Path) -> str:
    """The benchmarks' encoder: the tiny random BERT saved into ``folder`` (smoke runs), else all-MiniLM-L6-v2."""
    if tiny:
        return tiny_model(folder)
    from dpr_gc.model.pretrained import default_model_path

    return default_model_path()


def launch(cfg: dict, timeout: int) -> dict:
    """Run one configuration in a fresh process; its result is the line of stdout tagged ``RESULT``."""
    return run_child(__file__, cfg, child_env(cfg), timeout)


def child_env(cfg: dict) -> dict[str, str]:
    """The environment of a configuration's process: ``cfg["threads"]`` threads, no progress bars, and glibc's mmap
    threshold fixed at ``cfg["mmap_threshold"]`` (0: glibc's dynamic default)."""
    # The tokenizer keeps its own worker threads (TOKENIZERS_PARALLELISM left on): tokenising thousands of texts on
    # the main thread leaves its heap fragmented, and the step's small allocations then fault in scattered pages
    # (+180 MB of resident set at batch 4,096, whatever the method) that are the allocator's, not the step's.
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg["threads"]), "MKL_NUM_THREADS": str(cfg["threads"]),
           "TQDM_DISABLE": "1"}
    env.pop("TOKENIZERS_PARALLELISM", None)
    if cfg["mmap_threshold"]:
        # A fixed threshold stops glibc from keeping freed large blocks, so the resident set follows live memory.
        env["MALLOC_MMAP_THRESHOLD_"] = str(cfg["mmap_threshold"])
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    return env


def run_child(script: str, cfg: dict, env: dict, timeout: int) -> dict:
    """``python SCRIPT --one CFG`` with ``env``: its stdout line tagged ``RESULT``, else ``cfg`` with an ``error``
    (the time limit, or the exit status and the last line of stderr)."""
    try:
        proc = subprocess.run([sys.executable, script, "--one", json.dumps(cfg)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**cfg, "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {**cfg, "error": f"exit {proc.returncode}: {tail}"}


def rotated(grid: list[dict], rnd: int) -> list[tuple[int, dict]]:
    """The grid with the methods of each (input, batch) group rotated by ``rnd``, so no method always runs first."""
    groups: dict[tuple, list[tuple[int, dict]]] = {}
    for n, cfg in enumerate(grid):
        groups.setdefault((cfg["input"], cfg["batch"]), []).append((n, cfg))
    out = []
    for group in groups.values():
        k = rnd % len(group)
        out += group[k:] + group[:k]
    return out


def aggregate(runs: list[dict]) -> dict:
    """One configuration over its rounds: medians of the per-round step medians, raw rounds kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out = dict(ok[0])
    for key in ("step_s", "cpu_s", "sys_s", "peak_mb"):
        out[key] = statistics.median(r[key] for r in ok)
    out["examples_per_s"], out["examples_per_cpu_s"] = out["batch"] / out["step_s"], out["batch"] / out["cpu_s"]
    out["rounds"] = [{k: r.get(k) for k in ("step_s", "cpu_s", "sys_s", "peak_mb", "step_times_s", "cpu_times_s",
                                            "losses", "load_average")} for r in ok]
    for key in ("step_times_s", "cpu_times_s", "losses", "load_average"):
        out.pop(key, None)
    return out


def machine_info(device: str, threads: int) -> dict:
    """bench_common's machine record, with the peers' versions (sentence-transformers, the original GradCache)."""
    info = common_machine_info(device, threads)
    info["sentence_transformers"] = st_version()
    info["grad_cache_original"] = original_version()
    return info


def original_version() -> Optional[str]:
    """The installed original GradCache package (distribution ``GradCache``, module ``grad_cache``), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("grad_cache")
        return None if spec is None else f"{importlib.metadata.version('GradCache')} ({spec.origin})"
    except importlib.metadata.PackageNotFoundError:
        return None


def st_version() -> Optional[str]:
    """The installed sentence-transformers version, without importing it (that import takes seconds)."""
    try:
        return importlib.metadata.version("sentence-transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def ratio(a: Optional[dict], b: Optional[dict], key: str) -> Optional[float]:
    if a is None or b is None or "error" in a or "error" in b:
        return None
    return a[key] / b[key]


def summarise(results: list[dict], memory: list[dict], clock: str, uneven_target: float) -> tuple[list[str], dict]:
    """Markdown table lines (ratios on ``clock``: wall or process CPU time) and the target verdicts."""
    speed = "examples_per_s" if clock == "wall" else "examples_per_cpu_s"
    by = {(r["method"], r["input"], r["batch"], r["chunk"], r["q_len"], r["p_len"]): r for r in results}
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"| method | input q/p | batch | chunk | wall s/step | CPU s/step (sys) | examples/{clock} s | peak MB "
             "| token slots | speed vs plain | speed vs grad_cache (original) | speed vs st-cmnrl | memory vs plain "
             "| memory vs grad_cache (original) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    targets: dict[str, Any] = {"clock": clock, "fixed_at_or_below_best_peer": [], "uneven_speedup_vs_best_peer": [],
                               "dpr_gc_peak_mb_by_batch": {}}
    for r in results + memory:
        key = r["input"], r["batch"], r["chunk"], r["q_len"], r["p_len"]
        plain, original, st = (by.get((m,) + key) for m in ("plain", ORIGINAL, "st-cmnrl"))
        if "error" in r:
            lines.append(f"| {r['method']} | {r['input']} | {r['batch']} | {r['chunk']} | {r['error']} |||||||||")
            continue
        chunk = "-" if r["method"] == "plain" else r["chunk"]
        lines.append(f"| {r['method']} | {r['input']} {r['q_len']}/{r['p_len']} | {r['batch']} | {chunk} "
                     f"| {r['step_s']:.2f} | {r['cpu_s']:.2f} ({fmt(r.get('sys_s'), '.2f')}) | {r[speed]:.2f} "
                     f"| {r['peak_mb']:.0f} | {r['token_slots']} | {fmt(ratio(r, plain, speed), '.2f')} "
                     f"| {fmt(ratio(r, original, speed), '.2f')} | {fmt(ratio(r, st, speed), '.2f')} "
                     f"| {fmt(ratio(r, plain, 'peak_mb'), '.2f')} | {fmt(ratio(r, original, 'peak_mb'), '.2f')} |")
        if r["method"] != OURS or r in memory:
            continue
        targets["dpr_gc_peak_mb_by_batch"].setdefault(r["input"], {})[r["batch"]] = round(r["peak_mb"], 1)
        peers = [p for p in (by.get((m,) + key) for m in PEERS) if p is not None and "error" not in p]
        if peers:
            best = max(peers, key=lambda p: p[speed])
            speedup = r[speed] / best[speed]
            entry = {"batch": r["batch"], "chunk": r["chunk"], "best_peer": best["method"], "speedup": round(speedup, 3)}
            if r["input"] == "fixed":
                targets["fixed_at_or_below_best_peer"].append({**entry, "met": speedup >= 1.0})
            else:
                targets["uneven_speedup_vs_best_peer"].append({**entry, "met": speedup >= uneven_target})
    for name, peaks in targets["dpr_gc_peak_mb_by_batch"].items():
        lo, hi = min(peaks), max(peaks)
        targets[f"peak_growth_{name}_batch_{lo}_to_{hi}"] = round(peaks[hi] / peaks[lo], 3)
    ok = [m for m in memory if "error" not in m]
    if len(ok) == 2:
        small, large = sorted(ok, key=lambda m: m["batch"])
        growth = large["peak_mb"] / small["peak_mb"]
        targets["memory_check"] = {"batches": [small["batch"], large["batch"]], "chunk": large["chunk"],
                                   "q_len/p_len": [large["q_len"], large["p_len"]],
                                   "peak_mb": [round(small["peak_mb"], 1), round(large["peak_mb"], 1)],
                                   "ratio": round(growth, 3), "met": growth <= 1.3}
    return lines, targets


def verdicts(targets: dict, uneven_target: float) -> list[str]:
    """One line per target, for the end of the printed summary."""
    out = []
    for name, peaks in targets["dpr_gc_peak_mb_by_batch"].items():
        lo, hi = min(peaks), max(peaks)
        out.append(f"- peak memory, dpr-gc {name}: {peaks[lo]:.0f} MB at batch {lo} -> {peaks[hi]:.0f} MB at batch "
                   f"{hi} ({peaks[hi] / peaks[lo]:.2f}x)")
    for key, label, bar in (("fixed_at_or_below_best_peer", "fixed", 1.0),
                            ("uneven_speedup_vs_best_peer", "uneven", uneven_target)):
        for e in targets[key]:
            out.append(f"- {label}, batch {e['batch']} chunk {e['chunk']}: dpr-gc {e['speedup']:.2f}x the speed of "
                       f"{e['best_peer']} (target >= {bar:.2f}x: {'met' if e['met'] else 'NOT met'})")
    check = targets.get("memory_check")
    if check:
        out.append(f"- memory check, batch {check['batches'][1]} vs {check['batches'][0]} (chunk {check['chunk']}): "
                   f"{check['peak_mb'][1]:.0f} / {check['peak_mb'][0]:.0f} MB = {check['ratio']:.2f}x "
                   f"(target <= 1.30x: {'met' if check['met'] else 'NOT met'})")
    return out


# the flags that size a run, and the command of the committed gradcache.json (benchmarks/README.md)
SIZING = ("batches", "chunk", "inputs", "methods", "plain_max_batch", "fixed_lengths", "uneven_lengths", "steps",
          "rounds", "memory_check", "memory_lengths", "memory_batches", "skip_grid", "tiny", "quick")
COMMITTED = (("--batches", "32,128", "--chunk", "32", "--plain-max-batch", "32", "--steps", "1", "--threads", "1",
              "--clock", "cpu"),)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ints, names = int_list, name_list
    p = parser(__doc__)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=ints, default=[32, 128, 512])
    p.add_argument("--chunk", type=positive_int, default=32, help="rows per chunk")
    p.add_argument("--inputs", type=names, default=None, help="fixed,uneven (default: both; --quick: uneven)")
    p.add_argument("--methods", type=names, default=list(METHODS), help=",".join(METHODS))
    p.add_argument("--plain-max-batch", type=int, default=128, help="skip plain above this batch (its memory grows)")
    p.add_argument("--fixed-lengths", type=ints, default=[32, 128], help="query,passage tokens for 'fixed'")
    p.add_argument("--uneven-lengths", type=ints, default=[32, 256], help="query,passage max tokens for 'uneven'")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per configuration (median reported)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="repeat the grid, methods rotated; medians over rounds")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per process (default: all; --quick: 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-check", action="store_true", help="also run dpr-gc at batch 64 and 4096 (chunk 16)")
    p.add_argument("--memory-lengths", type=ints, default=[16, 32], help="query,passage max tokens for that check")
    p.add_argument("--memory-batches", type=ints, default=[64, 4096])
    p.add_argument("--skip-grid", action="store_true", help="run only the memory check")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ for the children (0: glibc's default, dynamic threshold)")
    p.add_argument("--uneven-target", type=positive_float, default=None,
                   help="dpr-gc's speed over the best peer's on uneven inputs (default: 1.15; --merge: the runs')")
    p.add_argument("--clock", choices=("wall", "cpu"), default=None, help="time the ratios use: wall, or process CPU "
                   "time (steadier on a shared machine, 1 thread) (default: wall; --merge: the runs' clock)")
    p.add_argument("--tiny", action="store_true", help="a tiny random BERT instead of MiniLM (smoke runs)")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 8, chunk 4, short lengths, one step")
    p.add_argument("--timeout", type=positive_int, default=3600, help="seconds per configuration")
    p.add_argument("--output", default=None, help=output_help("gradcache")[:-1] + "; --merge: required)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine the results of runs made side by side (one per method) into --output (required); "
                   "runs nothing")
    args = p.parse_args(argv)
    full = committed_size(p.parse_args, args, SIZING, COMMITTED)
    if args.inputs is None:
        args.inputs = ["uneven"] if args.quick else list(INPUTS)
    if args.threads is None:
        args.threads = 1 if args.quick else torch.get_num_threads()
    if args.quick:
        args.batches, args.chunk, args.steps = [8], 4, 1
        args.fixed_lengths, args.uneven_lengths, args.memory_batches = [16, 32], [16, 64], [8, 32]
    bad = [m for m in args.methods if m not in METHODS] + [i for i in args.inputs if i not in INPUTS]
    if bad:
        p.error(f"unknown method/input {bad}; choose from {METHODS} and {INPUTS}")
    if args.skip_grid and not args.memory_check and not args.merge:
        p.error("--skip-grid without --memory-check leaves nothing to run; add --memory-check or drop --skip-grid")
    if not args.merge:
        args.clock, args.uneven_target = args.clock or "wall", args.uneven_target or 1.15
        check_plan(args)
    require_cuda(args.device)
    args.output = output_path(args, full)
    return args


def check_plan(args: argparse.Namespace) -> None:
    """Refuse a run with no configuration to measure (plain alone, every batch above --plain-max-batch; no
    --memory-check), before any model loads, rather than ending without a table."""
    if args.memory_check or any(m != "plain" or b <= args.plain_max_batch for m in args.methods for b in args.batches):
        return
    raise DprGcError(f"nothing to run: --methods {','.join(args.methods) or '(none)'} at --batches "
                     f"{','.join(map(str, args.batches))}, and plain runs only up to --plain-max-batch "
                     f"{args.plain_max_batch}; give a smaller batch, a higher --plain-max-batch or another method")


def output_path(args: argparse.Namespace, full: bool) -> str:
    """--output, else gradcache.json for a ``full`` run (sized as the committed one), gradcache-quick.json for any
    other (a --quick or --tiny run among them); a --merge names its own,
    never one of the files it reads, so no run replaces the results it merges."""
    if not args.merge:
        return args.output or results_path("gradcache", not full)
    if args.output is None:
        raise DprGcError("--merge needs --output: name the merged results file (e.g. --output "
                         "benchmarks/results/gradcache-merged.json)")
    if any(Path(args.output).resolve() == Path(f).resolve() for f in args.merge):
        raise DprGcError(f"--output {args.output} is one of the --merge files; the merge would replace its own "
                         "input: give another file")
    return args.output


def merge(args: argparse.Namespace) -> None:
    """One report from several runs made at the same time (each measured in its own processes): their results
    and memory checks side by side, each run's machine record and settings kept (a merged file's parts as they
    are), the ratios on the clock and target the runs were given unless --clock or --uneven-target says."""
    reports = [read_json_object(f, "bench_gradcache.py results file") for f in args.merge]
    parts = []
    for f, rep in zip(args.merge, reports):
        shape = (("machine", dict), ("results", list), ("memory_check", list))
        if not all(isinstance(rep.get(k), t) for k, t in shape) or not (
                isinstance(rep.get("settings"), dict) or isinstance(rep.get("merged_from"), list)):
            raise DprGcError(f"--merge {f}: not a bench_gradcache.py results file (no 'machine', 'results', "
                             "'memory_check' and 'settings'); give the files its runs wrote")
        own = {"file": Path(f).name, "machine": rep["machine"], "settings": rep.get("settings")}
        parts += rep.get("merged_from") or [own]
    clock = args.clock or parts_setting(parts, "clock", "--clock")
    target = args.uneven_target or parts_setting(parts, "uneven_target", "--uneven-target")
    results = [r for rep in reports for r in rep["results"]]
    memory = [r for rep in reports for r in rep["memory_check"]]
    lines, targets = summarise(results, memory, clock, target)
    write_json(args.output, {"machine": reports[0]["machine"], "merged_from": parts, "results": results,
                             "memory_check": memory, "targets": targets})
    print("\n".join(lines + [""] + verdicts(targets, target)))
    print(f"\nwritten {args.output}")


def parts_setting(parts: list[dict], name: str, flag: str) -> Any:
    """The setting ``name`` the merged runs share; runs given different ones are refused, naming ``flag``."""
    values = {json.dumps(p["settings"].get(name)): p["file"] for p in parts}
    if len(values) > 1:
        given = ", ".join(f"{file} {json.loads(v)}" for v, file in values.items())
        raise DprGcError(f"--merge: the runs were measured with different {flag} ({given}); give {flag} to "
                         "choose the one the ratios and targets use")
    value = json.loads(next(iter(values)))
    return value if value is not None else {"clock": "wall", "uneven_target": 1.15}[name]


def installed_methods(methods: list[str], skip_grid: bool) -> list[str]:
    """``methods`` less the peers whose package is not installed (each skipped with a warning); refused when none
    is left to run the grid with."""
    missing = {"st-cmnrl": ("sentence-transformers", st_version), ORIGINAL: ("the original GradCache package "
                                                                          "(module grad_cache)", original_version)}
    kept = []
    for method in methods:
        package, installed = missing.get(method, ("", lambda: "yes"))
        if installed() is None:
            logger.warning("%s is not installed: %s skipped", package, method)
        else:
            kept.append(method)
    if not kept and not skip_grid:
        raise DprGcError(f"--methods {','.join(methods)}: none is installed here ({ORIGINAL}: pip install --no-deps "
                         "git+https://github.com/luyug/GradCache; st-cmnrl: pip install sentence-transformers); "
                         "install one or name other methods")
    return kept


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    setup_logging("%(message)s")
    if args.one:
        print(RESULT_TAG + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    if args.merge:
        merge(args)
        return
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    args.methods = installed_methods(args.methods, args.skip_grid)
    check_plan(args)
    with tempfile.TemporaryDirectory(prefix="bench_gc_") as tmp:
        model = encoder_model(args.tiny, Path(tmp))
        base = {"model": "tiny-random-bert" if args.tiny else model, "threads": args.threads, "device": device,
                "seed": args.seed, "steps": args.steps, "mmap_threshold": args.mmap_threshold}
        lengths = {"fixed": args.fixed_lengths, "uneven": args.uneven_lengths}
        grid = [] if args.skip_grid else [
            {**base, "method": m, "input": i, "batch": b, "chunk": args.chunk, "q_len": lengths[i][0], "p_len": lengths[i][1]}
            for i in args.inputs for b in args.batches for m in args.methods
            if not (m == "plain" and b > args.plain_max_batch)]
        memory = [{**base, "method": OURS, "input": "uneven", "batch": b, "chunk": 4 if args.quick else 16,
                   "q_len": args.memory_lengths[0], "p_len": args.memory_lengths[1], "steps": 1}
                  for b in args.memory_batches] if args.memory_check else []
        report = {"machine": machine_info(device, args.threads), "settings": vars(args), "results": [], "memory_check": []}
        runs: dict[int, list[dict]] = {}
        plan = [(n, cfg) for rnd in range(args.rounds) for n, cfg in rotated(grid, rnd)]
        plan += [(len(grid) + n, cfg) for n, cfg in enumerate(memory)]
        for done, (n, cfg) in enumerate(plan, start=1):
            logger.info("[%d/%d] %s %s batch %d chunk %d ...", done, len(plan), cfg["method"], cfg["input"],
                        cfg["batch"], cfg["chunk"])
            out = {**launch({**cfg, "model": model}, args.timeout), "model": base["model"], "load_average": os.getloadavg()}
            runs.setdefault(n, []).append(out)
            logger.info("    %s", out.get("error") or f"{out['step_s']:.2f} s/step ({out['cpu_s']:.2f} CPU s), "
                        f"peak {out['peak_mb']:.0f} MB")
            merged = [aggregate(runs[i]) for i in sorted(runs)]
            report["results"] = [r for i, r in zip(sorted(runs), merged) if i < len(grid)]
            report["memory_check"] = [r for i, r in zip(sorted(runs), merged) if i >= len(grid)]
            report["machine"]["load_average_at_end"] = os.getloadavg()
            lines, report["targets"] = summarise(report["results"], report["memory_check"], args.clock,
                                                 args.uneven_target)
            write_json(args.output, report)
    print(f"\nratios on {args.clock} time; {args.threads} threads; device {device}\n")
    print("\n".join(lines))
    print("\n" + "\n".join(verdicts(report["targets"], args.uneven_target)))
    print(f"\nwritten {args.output}")


if __name__ == "__main__":
    sys.exit(run_script(main))
