"""Train a retriever with JAX Gradient Cache on the built-in stdlib dataset, and measure it before and after.

``python -m dpr_gc.jax.example --output runs/jax-example`` builds (or reuses) the stdlib retrieval task
(:mod:`dpr_gc.data.stdlib_data`), tokenises it with the offline all-MiniLM-L6-v2 tokenizer, starts the Flax encoder from
the offline MiniLM weights (``--init minilm``) or from random weights (``--init random``), evaluates top-k answer
accuracy on the held-out questions with the toolkit's :func:`dpr_gc.evaluation.answers.evaluate_answers`, trains with
:func:`dpr_gc.jax.cached_value_and_grad` (batch several times the chunk, hard negatives, dropout with per-chunk
keys, AdamW from optax) logging its backend, precision and chunks and the loss of every step, evaluates again,
writes ``report.json`` and ends with the before/after table and the closing ``| item | value |`` summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from ..base.args import ArgumentParser
from ..base.errors import DprGcError, report_errors
from ..base.files import read_json, write_json
from ..base.logs import command_main, counted, setup_logging
from ..base.tables import format_summary, markdown_table
from ..base.settings import add_arguments, from_args, setting
from ..data.stdlib_data import N_HARD_NEGATIVES, build_stdlib_dataset, check_max_examples
from ..model.retriever import RetrieverConfig
from ..model.tokenize import token_ids
from .grad_cache import cached_value_and_grad
from .loss import TEMPERATURE_RANGE, ContrastiveLoss
from .model import Encoder, EncoderConfig, cast_params, encoder_fn, load_bert

logger = logging.getLogger(__name__)

KS = (1, 5, 20, 100)
# Queries and passages as all-MiniLM-L6-v2 was trained: no prefixes, a passage as "title text".
TEXT_FORMAT = RetrieverConfig(passage_format="concat")
MAX_LENGTH = 512  # all-MiniLM-L6-v2's positions (its tokenizer's model_max_length)
RANDOM_MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)


@dataclasses.dataclass
class ExampleConfig:
    """Defaults: the demo's setting (1,024 training questions, batch 64 in chunks of 16) plus one hard negative. Each
    field is declared once with its flag, type, default and help (:func:`dpr_gc.base.settings.setting`), so every
    flag of ``--help`` shows them."""

    output_dir: str = setting("runs/jax-example", "--output", help="output folder (the dataset is reused)")
    init: str = setting("minilm", "--init", choices=("minilm", "random"),
                        help="start from the offline MiniLM weights or from a random 4-layer encoder")
    max_examples: Optional[int] = setting(None, "--max-examples", type=int,
                                          help="subsample the dataset, a quicker, rougher run (default: all of it)")
    train_queries: int = setting(1024, "--train-queries", type=int, help="training questions used")
    batch_size: int = setting(64, "--batch-size", type=int,
                              help="training queries per step (the Gradient Cache batch)")
    chunk_size: int = setting(16, "--chunk-size", type=int,
                              help="rows per Gradient Cache chunk, of queries and passages")
    hard_negatives: int = setting(1, "--hard-negatives", type=int, help="hard negatives per training query")
    epochs: int = setting(1, "--epochs", type=int, help="passes over the training questions")
    learning_rate: float = setting(5e-5, "--learning-rate", type=float,
                                   help="AdamW peak learning rate (linear decay to 0)")
    temperature: float = setting(0.05, "--temperature", type=float, help="scores are divided by it before the softmax")
    dropout: float = setting(0.1, "--dropout", type=float, help="the encoder's dropout in training (keys per chunk)")
    query_max_length: int = setting(48, "--query-max-length", type=int, help="query max tokens")
    passage_max_length: int = setting(128, "--passage-max-length", type=int, help="passage max tokens, title included")
    precision: str = setting("fp32", "--precision", choices=("fp32", "bf16"),
                             help="the encoder's compute; bf16 runs on bf16 copies of fp32 master weights, which "
                                  "AdamW updates in fp32 (the loss is fp32 either way)")
    seed: int = setting(0, "--seed", type=int, help="seed of the dataset, initial weights, batch order and dropout")

    def __post_init__(self) -> None:
        if self.init not in ("minilm", "random"):
            raise DprGcError(f"--init must be 'minilm' or 'random', got {self.init!r}")
        if self.precision not in ("fp32", "bf16"):
            raise DprGcError(f"--precision must be 'fp32' or 'bf16', got {self.precision!r}")
        for flag, value in (("--batch-size", self.batch_size), ("--chunk-size", self.chunk_size),
                            ("--train-queries", self.train_queries)):
            if value < 1:
                raise DprGcError(f"{flag} must be at least 1, got {value}")
        if self.train_queries < self.batch_size:
            raise DprGcError(f"--train-queries {self.train_queries} must be at least --batch-size {self.batch_size} "
                             "(a step takes --batch-size training questions)")
        if self.epochs < 1:
            raise DprGcError(f"--epochs must be at least 1, got {self.epochs} (the example trains, then compares "
                             "accuracy before and after)")
        if not 0.0 <= self.dropout < 1.0:
            raise DprGcError(f"--dropout must lie in [0, 1), got {self.dropout} (1 or more drops every activation)")
        self.check_data_flags()
        self.check_loss_flags()

    def check_data_flags(self) -> None:
        """The data and length flags, refused before the dataset is built or the model loaded."""
        check_max_examples(self.max_examples)
        if self.max_examples is not None and self.train_queries > self.max_examples:
            raise DprGcError(f"--train-queries {self.train_queries} exceeds --max-examples {self.max_examples} (the "
                             "training questions are a share of the examples); lower one or raise the other")
        if not 0 <= self.hard_negatives <= N_HARD_NEGATIVES:
            raise DprGcError(f"--hard-negatives must lie in [0, {N_HARD_NEGATIVES}] (the stdlib dataset's hard "
                             f"negatives per question), got {self.hard_negatives}")
        for flag, value in (("--query-max-length", self.query_max_length),
                            ("--passage-max-length", self.passage_max_length)):
            if not 1 <= value <= MAX_LENGTH:
                raise DprGcError(f"{flag} must lie in [1, {MAX_LENGTH}] (the MiniLM tokenizer's and model's "
                                 f"positions), got {value}")
        if self.seed < 0:
            raise DprGcError(f"--seed must be 0 or more, got {self.seed}")

    def check_loss_flags(self) -> None:
        """The loss and optimiser flags, refused before any work."""
        lo, hi = TEMPERATURE_RANGE
        if not lo <= self.temperature <= hi:
            raise DprGcError(f"--temperature must lie in [{lo}, {hi}], got {self.temperature}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise DprGcError(f"--learning-rate must be a positive number, got {self.learning_rate}")


def padded_token_ids(tokenizer: Any, texts: Sequence[str], max_length: int, pad_to: Optional[int] = None,
                     rows: Optional[int] = None, kind: str = "query",
                     titles: Optional[Sequence[str]] = None) -> dict:
    """Token ids and attention mask as int32 arrays from the toolkit's one tokenisation
    (:func:`dpr_gc.model.tokenize.token_ids`; a passage as ``title text``, the sentence-transformers format all-MiniLM-L6-v2
    was trained with), padded to ``pad_to`` (fixed shapes compile once) or to the longest text rounded up to a
    multiple of 32 (few distinct shapes when encoding), and with empty rows up to ``rows``."""
    enc = token_ids(tokenizer, TEXT_FORMAT, kind, list(texts), titles, max_length)
    kept = enc["attention_mask"].bool()
    lengths = kept.sum(1).tolist()
    width = pad_to or min(max_length, -(-max(lengths) // 32) * 32)
    shape = (max(rows or 0, len(texts)), width)
    ids = np.full(shape, tokenizer.pad_token_id or 0, np.int32)
    mask = np.zeros(shape, np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = enc["input_ids"][i][kept[i]].numpy(), 1
    return {"input_ids": ids, "attention_mask": mask}


def passage_text(ctx: dict) -> str:
    """``title + " " + text``, the sentence-transformers format all-MiniLM-L6-v2 was trained with."""
    title, text = ctx.get("title") or "", ctx.get("text") or ""
    return f"{title} {text}" if title else text


def passage_keys(ctx: dict) -> tuple[str, ...]:
    """What makes two passages the same one, as the torch trainer keys them, any key in common: the passage id
    (when it has one) or the title and text."""
    pid, text = ctx.get("passage_id"), f"text:{ctx.get('title') or ''}\t{ctx.get('text') or ''}"
    return (f"id:{pid}", text) if pid not in (None, "") else (text,)


def training_examples(path: Path, limit: int,
                      hard_negatives: int) -> tuple[list[str], list[list[str]], list[list[tuple[str, ...]]]]:
    """Questions, their passage groups (positive first, then ``hard_negatives`` hard negatives) and the groups'
    passage keys (:func:`passage_keys`: a key in common, the same passage). Fewer than ``limit`` usable questions
    is refused naming --train-queries: the split's size is known only once the dataset is built."""
    questions, groups, keys = [], [], []
    for record in read_json(path):
        negatives = record.get("hard_negative_ctxs") or []
        if not record.get("positive_ctxs") or len(negatives) < hard_negatives:
            continue
        questions.append(record["question"])
        ctxs = [record["positive_ctxs"][0]] + negatives[:hard_negatives]
        groups.append([passage_text(c) for c in ctxs])
        keys.append([passage_keys(c) for c in ctxs])
        if len(questions) == limit:
            break
    if len(questions) < limit:
        plural = "" if hard_negatives == 1 else "s"
        raise DprGcError(f"{path}: only {len(questions)} questions have a positive and {hard_negatives} hard "
                         f"negative{plural}, fewer than --train-queries {limit} (the training split is a share of the "
                         "examples); lower --train-queries or --hard-negatives")
    return questions, groups, keys


@functools.partial(jax.jit, static_argnums=0)
def _forward(model: Encoder, params: Any, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """The encoder's inference pass, compiled once per model and input shape (reused before and after training)."""
    return model.apply({"params": params}, input_ids, attention_mask)


def encode_texts(model: Encoder, params: Any, tokenizer: Any, texts: Sequence[str], max_length: int,
                 batch_size: int = 64, desc: str = "encoding", kind: str = "query",
                 titles: Optional[Sequence[str]] = None) -> np.ndarray:
    """Normalised fp32 representations, encoded in length-sorted batches by a jitted forward pass."""
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), model.config.hidden_size), np.float32)
    with tqdm(total=len(texts), desc=desc, unit=" texts", disable=None) as bar:
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            batch = padded_token_ids(tokenizer, [texts[i] for i in rows], max_length, rows=batch_size, kind=kind,
                                     titles=[titles[i] for i in rows] if titles is not None else None)
            reps = _forward(model, params, batch["input_ids"], batch["attention_mask"])
            out[rows] = np.asarray(reps, np.float32)[:len(rows)]
            bar.update(len(rows))
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def compute_params(params: Any, config: ExampleConfig) -> Any:
    """The weights the encoder runs with: bf16 copies of the fp32 master weights under ``--precision bf16`` (an
    AdamW step of about the learning rate would round away in bf16 storage), else the weights themselves."""
    return cast_params(params, jnp.bfloat16) if config.precision == "bf16" else params


def evaluate_model(model: Encoder, params: Any, tokenizer: Any, corpus: list[tuple[str, str, str]],
                   questions: list[dict], config: ExampleConfig) -> dict[str, float]:
    """Exact top-100 retrieval over the corpus, in ``--precision``, scored by the toolkit's top-k answer accuracy."""
    from ..evaluation.answers import evaluate_answers

    params = compute_params(params, config)
    passages = encode_texts(model, params, tokenizer, [text for _, _, text in corpus], config.passage_max_length,
                            desc="encoding passages", kind="passage", titles=[title for _, title, _ in corpus])
    queries = encode_texts(model, params, tokenizer, [q["question"] for q in questions], config.query_max_length,
                           desc="encoding questions")
    scores = queries @ passages.T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :max(KS)]
    results = [{"question": q["question"], "answers": q["answers"],
                "ctxs": [{"id": corpus[j][0], "title": corpus[j][1], "text": corpus[j][2], "score": float(s[j])}
                         for j in row]} for q, row, s in zip(questions, top, scores)]
    return evaluate_answers(results, KS, "string", source="JAX example retrieval")


def initial_params(config: ExampleConfig, model_path: str, vocab_size: int) -> tuple[Encoder, Any]:
    """The encoder and its fp32 weights (the master weights under ``--precision bf16`` too): MiniLM's or random."""
    if config.init == "minilm":
        enc_config, params = load_bert(model_path, dropout=config.dropout)
    else:
        enc_config = EncoderConfig(vocab_size=vocab_size, max_positions=max(config.query_max_length,
                                                                            config.passage_max_length),
                                   dropout=config.dropout, **RANDOM_MODEL)
        ones = jnp.ones((1, 8), jnp.int32)
        params = jax.jit(Encoder(enc_config).init)(jax.random.key(config.seed), ones, ones)["params"]
    return Encoder(enc_config), params


def passage_id_array(groups: list[list[str]], keys: Optional[list[list[tuple[str, ...]]]] = None) -> np.ndarray:
    """One int32 id per passage row (groups flattened), equal for rows with a key in common, directly or through
    other rows (the passages' texts when ``keys`` is None): what the loss masks duplicate positives by."""
    flat = [k for g in keys for k in g] if keys is not None else [(text,) for g in groups for text in g]
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for row in flat:
        for key in row[1:]:
            parent[root(key)] = root(row[0])
    index: dict[str, int] = {}
    return np.asarray([index.setdefault(root(row[0]), len(index)) for row in flat], np.int32)


def masked_copies(ids: np.ndarray, group: int) -> int:
    """How many scores of one batch the duplicate-positive mask drops: per query, the other rows holding its
    positive's passage (the torch loss's ``masked_scores``)."""
    return int((ids[::group, None] == ids[None, :]).sum()) - len(ids) // group


def check_finite(loss: float, step: int, config: ExampleConfig) -> None:
    """Stop on a non-finite loss as ``dpr-gc train`` does: the parameters it updated are broken."""
    if not math.isfinite(loss):
        raise DprGcError(f"training diverged at step {step}: loss {loss:.4g} ({config.precision}); stopped without "
                         "writing report.json; try a lower --learning-rate")


def describe_run(config: ExampleConfig, steps: int) -> str:
    """The log line that says how training runs: backend and devices, precision, steps, batch and chunking."""
    group = 1 + config.hard_negatives
    return (f"training on JAX {jax.__version__}'s {jax.default_backend()} backend ("
            f"{counted(len(jax.devices()), 'device')}, the step on one), precision {config.precision}, "
            f"{counted(steps, 'step')} of {config.batch_size} queries and {config.batch_size * group} passages, "
            f"Gradient Cache chunks of {min(config.chunk_size, config.batch_size)} queries and "
            f"{min(config.chunk_size, config.batch_size * group)} passages")


def train(model: Encoder, params: Any, tokenizer: Any, questions: list[str], groups: list[list[str]],
          config: ExampleConfig, keys: Optional[list[list[tuple[str, ...]]]] = None) -> tuple[Any, list[float]]:
    """Gradient Cache training (tied encoder); returns the trained parameters and the loss of every step. A copy of
    a question's own positive in its batch (equal ``keys``; the texts without them) is masked, not a negative.
    ``params`` stay fp32, as do the gradients and AdamW's state; ``--precision bf16`` runs each chunk's forward and
    backward on bf16 copies (:func:`compute_params`)."""
    loss = ContrastiveLoss(n_hard_negatives=config.hard_negatives, temperature=config.temperature, similarity="cos")
    steps_per_epoch = len(questions) // config.batch_size
    total = steps_per_epoch * config.epochs
    schedule = optax.linear_schedule(config.learning_rate, 0.0, total)
    optimizer = optax.adamw(schedule, weight_decay=0.01)
    run_encoder = encoder_fn(model, train=config.dropout > 0)

    def encode(params: Any, batch: dict, key: jax.Array) -> jax.Array:
        return run_encoder(compute_params(params, config), batch, key)

    value_and_grad = cached_value_and_grad([encode, encode], loss, config.chunk_size)

    @jax.jit
    def step(params: Any, opt_state: Any, batches: list, ids: jax.Array,
             key: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, (grads, _) = value_and_grad(params, {}, batches, key, ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    q_tok = padded_token_ids(tokenizer, questions, config.query_max_length, pad_to=config.query_max_length)
    p_tok = padded_token_ids(tokenizer, [p for g in groups for p in g], config.passage_max_length,
                             pad_to=config.passage_max_length, kind="passage")
    group = 1 + config.hard_negatives
    passage_ids = passage_id_array(groups, keys)
    logger.info("%s", describe_run(config, total))
    opt_state, losses = optimizer.init(params), []
    rng, key = np.random.default_rng(config.seed), jax.random.key(config.seed)
    for epoch in range(config.epochs):
        order, masked = rng.permutation(len(questions)), 0
        for i in tqdm(range(steps_per_epoch), desc=f"training epoch {epoch + 1}", unit=" steps", disable=None):
            rows = order[i * config.batch_size:(i + 1) * config.batch_size]
            p_rows = (rows[:, None] * group + np.arange(group)[None]).reshape(-1)
            batches = [{k: v[rows] for k, v in q_tok.items()}, {k: v[p_rows] for k, v in p_tok.items()}]
            masked += masked_copies(passage_ids[p_rows], group)
            params, opt_state, value = step(params, opt_state, batches, passage_ids[p_rows],
                                            jax.random.fold_in(key, len(losses)))
            losses.append(float(value))
            logger.info("step %d/%d loss %.4f", len(losses), total, losses[-1])
            check_finite(losses[-1], len(losses), config)
        logger.info("epoch %d: %d in-batch copies of a question's own positive masked (not scored as negatives)",
                    epoch + 1, masked)
    return params, losses


def run_example(config: ExampleConfig) -> dict:
    """Build the data, measure, train, measure again; returns (and writes) the report."""
    from transformers import AutoTokenizer

    from ..data.corpus import iter_passages, read_queries
    from ..model.pretrained import default_model_path

    started = time.perf_counter()
    out = Path(config.output_dir)
    manifest = build_stdlib_dataset(out / "data", max_examples=config.max_examples, seed=config.seed)
    files = {k: out / "data" / v for k, v in manifest["files"].items()}
    # Read before the model loads and the first evaluation runs, so too few usable questions are said at once.
    questions, groups, keys = training_examples(files["dpr_train"], config.train_queries, config.hard_negatives)
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    model, params = initial_params(config, model_path, len(tokenizer))
    corpus = list(iter_passages(files["corpus"]))
    test_questions = read_queries(files["test_qa"])
    before = evaluate_model(model, params, tokenizer, corpus, test_questions, config)
    logger.info("before training: %s", before)
    train_started = time.perf_counter()
    params, losses = train(model, params, tokenizer, questions, groups, config, keys)
    train_seconds = time.perf_counter() - train_started
    after = evaluate_model(model, params, tokenizer, corpus, test_questions, config)
    logger.info("after training: %s", after)
    report = {"config": dataclasses.asdict(config), "dataset": manifest["counts"], "backend": jax.default_backend(),
              "devices": len(jax.devices()), "jax_version": jax.__version__, "before": before, "after": after,
              "training_loss": losses, "train_seconds": round(train_seconds, 1),
              "seconds": round(time.perf_counter() - started, 1)}
    write_json(out / "report.json", report)
    return report


def format_report(report: dict, report_file: Path) -> str:
    """The before/after accuracy table, then the closing ``| item | value |`` summary every command prints: backend,
    precision, steps, batch and chunks, the first and last step's loss, and the ``report.json`` written."""
    metrics = markdown_table(("metric (held-out test)", "before training", "after training"),
                             [(k, f"{report['before'][k]:.4f}", f"{report['after'][k]:.4f}") for k in report["before"]])
    config, losses = report["config"], report["training_loss"]
    rows = {"backend": f"{report['backend']} ({counted(report['devices'], 'device')}, the step on one), JAX "
                       f"{report['jax_version']}",
            "precision": config["precision"], "steps": len(losses),
            "batch (queries)": config["batch_size"], "chunk size": config["chunk_size"],
            "hard negatives": config["hard_negatives"],
            "loss (first → last step)": f"{losses[0]:.4f} → {losses[-1]:.4f}",
            "training time": f"{report['train_seconds']:.1f} s", "report": str(report_file)}
    return f"{metrics}\n\n{format_summary(rows, report['seconds'])}"


def build_parser() -> argparse.ArgumentParser:
    """The example's flags, generated from :class:`ExampleConfig` as the ``dpr-gc`` commands' are from theirs:
    every flag with its help and default, a bad command line as one ``error:`` line."""
    parser = ArgumentParser(prog="python -m dpr_gc.jax.example", description=__doc__.split("\n")[0])
    add_arguments(parser, ExampleConfig)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> ExampleConfig:
    """The :class:`ExampleConfig` of a command line."""
    return from_args(ExampleConfig, build_parser().parse_args(argv))


@command_main
def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command: the toolkit's log (dependencies quiet), the run, the tables; a bad flag is one ``error:`` line."""
    setup_logging(verbose=False)

    def run() -> None:
        config = parse_args(argv)
        report = run_example(config)
        print(format_report(report, Path(config.output_dir) / "report.json"))

    return report_errors(run)


if __name__ == "__main__":
    sys.exit(main())
