"""The main job: train -> encode -> index -> retrieve -> evaluate, before and after training, on real text.

``dpr-gc demo`` builds the default dataset from Python's standard library (:mod:`dpr_gc.data.stdlib_data`), measures the
offline all-MiniLM-L6-v2 zero-shot, fine-tunes it with Gradient Cache at a batch several times the chunk, measures
again, and writes everything to one folder. Every stage goes through the same library functions the sub-commands
use, on files in the formats users bring, and every stage resumes: run the command again after an interruption.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .base.args import home_expanded, nonnegative_int, output_dir, positive_float, positive_int, seed_int
from .base.errors import DiskFullError, DprGcError, Interrupted, setting_text
from .base.guard import guarded, with_temporaries
from .base.files import atomic_path, atomic_paths, dump_json, read_json, read_json_object, write_json
from .model.retriever import RetrieverConfig
from .base.settings import add_arguments, flat_record, from_args, setting
from .base.tables import format_summary, markdown_table
from .train.config import CacheConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

logger = logging.getLogger(__name__)

KS = (1, 5, 10, 20, 100)
TABLE_KS = (1, 5, 20, 100)  # the Accuracy@k rows of the printed table (and the ticks of report.png)


def demo_training() -> TrainConfig:
    """The demo's training recipe: mean-pooled, normalised MiniLM at temperature 0.05, a batch four times the
    Gradient Cache chunk, a warm-up of 2 steps (at most the run's), a checkpoint every four steps, DataLoader workers
    as ``dpr-gc train`` chooses them (``auto``: none on the CPU) (the data and output paths, and the model trained,
    are filled in by :func:`run_demo`)."""
    retriever = RetrieverConfig(pooling="mean", normalize=True, passage_format="concat", temperature=0.05,
                                query_max_length=48, passage_max_length=128)
    return TrainConfig(model=ModelConfig(retriever=retriever), data=DataConfig(batch_size=64, hard_negatives=0),
                       optim=OptimConfig(learning_rate=5e-5, warmup_steps=2, epochs=1),
                       cache=CacheConfig(query_chunk_size=16, passage_chunk_size=16),
                       run=RunConfig(save_every=4, keep_checkpoints=1))


@dataclasses.dataclass
class DemoConfig:
    """The demo's own sizes around a training config; the defaults take a few minutes on 2 CPU cores (see the
    README for a measured run). ``training.model.name`` is the model measured before training (None: the offline
    MiniLM), ``training.model.retriever`` its settings, and ``training.run.seed`` seeds the dataset too."""

    output_dir: str = "runs/demo"
    max_examples: Optional[int] = None
    train_queries: Optional[int] = 1024
    top_k: int = 100
    encode_batch_size: int = 64
    training: TrainConfig = dataclasses.field(default_factory=demo_training)

    def __post_init__(self) -> None:
        """Refuse sizes the demo cannot run with before anything is written: fewer ``--train-queries`` than one
        batch is known from the flags alone (a dataset subsampled by ``--max-examples`` is checked once built)."""
        from .data.sampling import too_few_questions
        from .data.stdlib_data import check_max_examples

        check_max_examples(self.max_examples)
        batch, cache = self.training.data.batch_size, self.training.cache
        chunk = max((c for c in (cache.query_chunk_size, cache.passage_chunk_size) if isinstance(c, int)), default=0)
        if batch < 4 * chunk:
            raise DprGcError(f"--batch-size {batch} should be at least 4x --chunk-size {chunk}: "
                             "the demo exists to show Gradient Cache at a batch larger than what one chunk holds")
        if self.train_queries is not None and self.train_queries < batch:
            raise DprGcError(f"--train-queries {self.train_queries}: {too_few_questions(self.train_queries, batch)}")


def _subset_training_file(source: Path, target: Path, limit: Optional[int]) -> Path:
    """The first ``limit`` questions of a DPR training file (the builder already shuffled them deterministically)."""
    if limit is None:
        return source
    if not target.is_file():
        records = read_json(source)[:limit]
        with atomic_path(target) as tmp:
            tmp.write_text(json.dumps(records, ensure_ascii=False))
    return target


SETTINGS_FILE = "demo_settings.json"
SECONDS_FILE = ".seconds.json"  # the demo's time over every invocation (see demo_clock)
ENCODE_SECONDS_FILE = ".encode_seconds.json"  # a measured stage's corpus encoding time, the same way
CLOCK_SAVE_SECONDS = 10.0  # how often demo_clock saves a running total: what a killed run loses at most
SAME_RESULTS = ("training.data.num_workers",)  # settings that change no result: workers give the same batches
NO_STAGE = ("data", SETTINGS_FILE, "cache")  # the dataset and training's parse cache check their own settings
REBUILT = ("train_subset.json",)  # cut from the dataset again under new settings (training, which reads it, not begun)
MODEL_SETTINGS = ("training.model.name", "training.model.retriever.")
# what the demo writes or removes in --output (its temporaries too): an input may not be or lie in one
DEMO_MEMBERS = with_temporaries("data", "base_model", "before", "after", "training", "cache", SETTINGS_FILE,
                                SECONDS_FILE, *REBUILT, "metrics.json", "report.png")
# the settings (a key, or a prefix ending in ".") that the work a stage holds depends on; any other entry (after/,
# the report) depends on them all
STAGE_SETTINGS = {"base_model": MODEL_SETTINGS,
                  "before": ("max_examples", "training.run.seed", "top_k", "encode_batch_size", *MODEL_SETTINGS),
                  "training": ("max_examples", "train_queries", "training.")}


def started_stages(out: Path) -> list[str]:
    """The entries of a demo folder that hold work a rerun reuses (:func:`holds_work`): all but the dataset, the
    settings record, training's parse cache, the training subset (:data:`REBUILT`) and hidden files such as the
    guard's lock."""
    return sorted(p.name for p in out.iterdir()
                  if not p.name.startswith(".") and p.name not in NO_STAGE + REBUILT and holds_work(p))


def holds_work(path: Path) -> bool:
    """Whether the stage output ``path`` holds work a rerun reuses: the base model once saved, training once it has
    a checkpoint or its trained model (one stopped before its first checkpoint, e.g. diverged, starts afresh), a
    measured stage once it holds a file (encoded blocks, the index, the results), any other file."""
    from .train.checkpoints import finished_checkpoints

    if path.name == "base_model":
        return (path / "retriever_config.json").is_file()
    if path.name == "training":
        return bool(finished_checkpoints(path)) or (path / "final" / "retriever_config.json").is_file()
    if path.is_dir():
        return any(p.is_file() and not p.name.startswith(".") for p in path.rglob("*"))
    return True


def depends_on(stage: str, key: str) -> bool:
    """Whether the work of ``stage`` depends on the setting ``key`` (:data:`STAGE_SETTINGS`)."""
    settings = STAGE_SETTINGS.get(stage)
    return settings is None or any(key == s or (s.endswith(".") and key.startswith(s)) for s in settings)


def check_demo_settings(out: Path, config: DemoConfig) -> None:
    """Resume only the same demo: record its settings in ``out`` the first time, and refuse a folder that holds a
    demo run with other settings that a stage holding work depends on (:func:`started_stages`; that work would be
    reused as it is, beside a report of the new settings; :data:`SAME_RESULTS` aside), or other files and no
    record. Settings only stages not started depend on (the learning rate, after a training that stopped before its
    first checkpoint) are recorded anew, so a rerun with corrected settings goes ahead; the demo's time restarts
    when no stage holds work."""
    record = demo_record(config)
    path = out / SETTINGS_FILE
    if not path.is_file():
        if out.is_dir() and any(not p.name.startswith(".") for p in out.iterdir()):  # the guard's lock is hidden
            raise DprGcError(f"{out} holds files but no {SETTINGS_FILE} of a demo run; give a new or empty --output")
        write_json(path, record)
        return
    old, new = flat_record(read_json_object(path, "demo settings")), flat_record(record)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in SAME_RESULTS)
    started = started_stages(out)
    kept = [stage for stage in started if any(depends_on(stage, k) for k in changed)]
    if kept:
        flags = demo_flag_names()
        held = list(dict.fromkeys(flags.get(k, k) for k in changed if any(depends_on(stage, k) for stage in kept)))
        first = {flags.get(k, k): k for k in reversed(changed)}  # a flag's values: those of the first key it sets
        shown = "; ".join(f"{name} {setting_text(old.get(key))} there, {setting_text(new.get(key))} now"
                          for name, key in ((name, first[name]) for name in held[:3]))
        names = [stage + "/" * (out / stage).is_dir() for stage in kept]
        raise DprGcError(f"{out} holds a demo run with other settings ({shown}"
                         f"{f' and {len(held) - 3} more' if len(held) > 3 else ''}); its "
                         f"{' and '.join(filter(None, [', '.join(names[:-1]), names[-1]]))} would be reused as "
                         f"{'they are' if len(kept) > 1 else 'it is'}, so give another --output, or the same settings "
                         "to resume it")
    if changed:
        logger.info("%s: the earlier run's settings changed only for stages it had not started; recording the new "
                    "ones", out)
        record_new_settings(out, record, started)


def demo_flag_names() -> dict[str, str]:
    """The demo flag that sets each key of the settings record (``training.cache.query_chunk_size``:
    ``--chunk-size``), found by changing each :class:`DemoFlags` field in turn and seeing which keys
    :meth:`DemoFlags.config` changes, so the names follow the flags' declarations; a key no flag sets is absent."""
    base = flat_record(demo_record(DemoFlags().config()))
    names: dict[str, str] = {}
    for field in dataclasses.fields(DemoFlags):
        flag = field.metadata["setting"].flags[0]
        for value in _other_values(field.metadata["setting"], field.default):
            try:
                config = dataclasses.replace(DemoFlags(), **{field.name: value}).config()
            except DprGcError:  # e.g. a chunk over a quarter of the batch: try the next value
                continue
            names.update({k: flag for k, v in flat_record(demo_record(config)).items() if base.get(k) != v})
            break
    return names


def _other_values(decl: Any, default: Any) -> list[Any]:
    """Values other than ``default`` a demo flag declared as ``decl`` takes, to try in turn."""
    if decl.choices:
        return [c for c in decl.choices if c != default]
    if isinstance(default, bool) or default is None or isinstance(default, str):
        return [not default] if isinstance(default, bool) else [decl.type("1000") if decl.type else "1000"]
    return [default * 2] if isinstance(default, float) else [default + 1, default - 1]


def demo_record(config: DemoConfig) -> dict:
    """The settings record of a demo run (:data:`SETTINGS_FILE`): ``config`` as JSON, the output folder left out."""
    return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k != "output_dir"}))


def record_new_settings(out: Path, record: dict, started: list[str]) -> None:
    """Replace the settings record of ``out``, where no stage in ``started`` depends on what changed, and remove
    what was made for the old settings and no stage reuses: the training subset, the encoding time of a measured
    stage not started, and the demo's time when no stage holds work (it was another demo's)."""
    write_json(out / SETTINGS_FILE, record)
    for name in REBUILT:
        (out / name).unlink(missing_ok=True)
    for stage in ("before", "after"):
        if stage not in started:
            (out / stage / ENCODE_SECONDS_FILE).unlink(missing_ok=True)
    if not started:
        (out / SECONDS_FILE).unlink(missing_ok=True)


def measure(model_dir: Path, name: str, out: Path, data: Path, manifest: dict, top_k: int,
            encode_batch_size: int) -> dict:
    """Encode the corpus with the retriever saved in ``model_dir`` (on the GPU when there is one, as training),
    index it (exact inner product), retrieve for the test questions and evaluate, into ``out/name``. The index
    records ``model_dir``, so ``dpr-gc retrieve --index`` finds the model without ``--model``."""
    from .data.corpus import load_corpus, read_queries
    from .retrieval.encode import encode_corpus
    from .evaluation.answers import default_workers
    from .data.qrels import read_qrels
    from .base.devices import default_device
    from .model.retriever import Retriever
    from .retrieval.index import DenseIndex, IndexParams, build_index, index_exists
    from .retrieval.retrieve import retrieve_to_files

    stage = out / name
    metrics_file = stage / "metrics.json"
    if metrics_file.is_file():
        logger.info("%s: already measured (%s)", name, metrics_file)
        return read_json_object(metrics_file, "demo metrics")
    corpus_path = data / manifest["files"]["corpus"]
    retriever = Retriever.load(model_dir, device=default_device())  # where training runs too: a GPU if there is one
    with demo_clock(stage / ENCODE_SECONDS_FILE) as encoding:  # over every run that encoded, as the demo's time
        encode_corpus(retriever, corpus_path, stage / "embeddings", batch_size=encode_batch_size, precision="auto",
                      model_name=str(model_dir))
        encode_seconds = encoding()
    if not index_exists(stage / "index"):
        build_index(stage / "embeddings", stage / "index", IndexParams(kind="flat"))
    index = DenseIndex.read(stage / "index")
    queries = read_queries(data / manifest["files"]["test_queries"])
    qrels = read_qrels(data / manifest["files"]["qrels_test"])
    metrics = retrieve_to_files(retriever, index, load_corpus(corpus_path), queries, top_k=top_k,
                                output=stage / "results.json", trec_run=stage / "run.trec", run_tag=name, ks=list(KS),
                                qrels=qrels, workers=default_workers(), total=len(queries))
    metrics.update({"encode_seconds": round(encode_seconds, 1), "passages": index.ntotal, "questions": len(queries)})
    write_json(metrics_file, metrics)
    return metrics


def save_base_model(model: ModelConfig, base_dir: Path) -> None:
    """Build the retriever measured before training from ``model`` and save it in ``base_dir``, unless saved there
    already. Its max lengths are checked first to leave a text a token beside the special tokens
    (:func:`~dpr_gc.model.tokenize.check_length_room`; the passage's named by ``--passage-max-length``), so a length
    without one is refused before the model is saved, not by the first encoding once it is."""
    from .model.retriever import Retriever
    from .model.tokenize import check_length_room
    from .train.setup import chosen_fields

    if (base_dir / "retriever_config.json").is_file():
        return
    retriever = Retriever.from_pretrained(model.path(), model.retriever, chosen_fields(model))
    config = retriever.config
    check_length_room(retriever.tokenizer, config, "passage", config.passage_max_length, "--passage-max-length")
    retriever.check_room("query").save(base_dir)


def warmup_within_run(training: TrainConfig, questions: int) -> TrainConfig:
    """``training`` with its warm-up cut to the run's steps (``questions`` a batch each, per epoch): the demo's short
    warm-up outlasted a run of fewer steps, which train warns of by a ``--warmup-steps`` the demo has not."""
    optim = training.optim
    steps = optim.epochs * (questions // training.data.batch_size)
    return dataclasses.replace(training, optim=dataclasses.replace(optim, warmup_steps=min(optim.warmup_steps, steps)))


def train_demo(training: TrainConfig, out: Path, train_file: Path) -> None:
    """Train the base model saved in ``out/base_model`` on ``train_file`` into ``out/training``, from its latest
    checkpoint when an earlier run left one: the demo resumes by itself, so a full disk says to run it again (train's
    own advice names its ``--resume``, which the demo has not)."""
    from .train.checkpoints import finished_checkpoints
    from .train.trainer import train

    base_dir, train_out = out / "base_model", out / "training"
    resume = "latest" if finished_checkpoints(train_out) else None
    try:
        train(dataclasses.replace(
            training, model=dataclasses.replace(training.model, name=str(base_dir), retriever=None),
            data=dataclasses.replace(training.data, train_files=[str(train_file)], cache_dir=str(out / "cache")),
            run=dataclasses.replace(training.run, output_dir=str(train_out), resume=resume)))
    except DiskFullError as e:
        raise DiskFullError(e.path, "free space, then run the same command again: the demo resumes from its last "
                            "checkpoint") from None


def run_demo(config: DemoConfig) -> dict:
    """Run the whole pipeline; returns the before/after metrics and where every output is."""
    import torch

    from .data.sampling import too_few_questions
    from .data.stdlib_data import build_stdlib_dataset
    from .train.checkpoints import finished_checkpoints

    training = config.training
    torch.manual_seed(training.run.seed)
    out = Path(config.output_dir)
    if not (out / "base_model" / "retriever_config.json").is_file():  # a resumed run has its own copy
        check_start_model(training.model.path())
    check_demo_settings(out, config)
    with demo_clock(out / SECONDS_FILE) as clock:
        data = out / "data"
        manifest = build_stdlib_dataset(data, max_examples=config.max_examples, seed=training.run.seed)
        available = manifest["counts"]["train_queries"]
        questions = min(available, config.train_queries or available)
        if questions < training.data.batch_size:  # refused before any stage, so the corrected rerun is not blocked
            raise too_few_questions(questions, training.data.batch_size)
        base_dir = out / "base_model"
        save_base_model(training.model, base_dir)
        before = measure(base_dir, "before", out, data, manifest, config.top_k, config.encode_batch_size)

        train_file = _subset_training_file(data / manifest["files"]["dpr_train"], out / "train_subset.json",
                                           config.train_queries)
        train_out = out / "training"
        final = train_out / "final"
        if not (final / "retriever_config.json").is_file():
            train_demo(warmup_within_run(training, questions), out, train_file)
        for checkpoint in finished_checkpoints(train_out):  # only a resume needs them, and final/ is there
            shutil.rmtree(checkpoint)
            logger.info("removed %s (the trained model is in %s)", checkpoint, final)
        after = measure(final, "after", out, data, manifest, config.top_k, config.encode_batch_size)

        curve = [json.loads(line) for line in (train_out / "metrics.jsonl").read_text().splitlines()]
        report = {"config": dataclasses.asdict(config), "dataset": manifest["counts"], "before": before, "after": after,
                  "training_loss": [[r["step"], r["loss"]] for r in curve if "loss" in r],
                  "seconds": round(clock(), 1),
                  "outputs": {"model": str(final), "index": str(out / "after" / "index"),
                              "run": str(out / "after" / "run.trec"), "results": str(out / "after" / "results.json"),
                              "metrics": str(out / "metrics.json"), "plot": str(out / "report.png")}}
        return write_report(report, out)


def check_start_model(name: str) -> None:
    """Refuse, before anything is written, a ``--model`` the base model could not be built from: what every stage
    refuses (a link loop, a folder holding no model, a missing folder, a Hub name while the Hub is off or out of
    reach: :func:`~dpr_gc.model.hub.check_model_source`), a missing relative path inside a folder that exists
    here (``runs/modle`` beside ``runs/``) that the Hugging Face cache does not hold: a path, not a Hub name, and a
    file: the base model is built from a folder or a Hub name (a DPR ``.cp`` checkpoint loads as it is, in train)."""
    from .model.hub import check_model_source, in_hub_cache
    from .model.pretrained import check_model_files, check_model_folder

    path = Path(name)
    check_model_folder(name)
    if path.is_file():
        raise DprGcError(f"cannot load model {name!r}: a file, not a model folder; the demo starts from a model "
                         "folder or a Hugging Face model name (a DPR .cp checkpoint: train from it with dpr-gc train)")
    beside = not path.is_absolute() and path.parent != Path(".") and path.parent.is_dir()
    if beside and not path.exists() and not in_hub_cache(name):
        raise DprGcError(f"cannot load model {name!r}: no such folder (give a model folder or a Hugging Face model "
                         "name)")
    check_model_files(path)
    check_model_source(name)


@contextlib.contextmanager
def demo_clock(path: Path) -> Iterator[Callable[[], float]]:
    """The seconds a piece of the demo has run over every invocation, an interrupted or killed one's included, kept
    in ``path``: the demo's in ``out/.seconds.json`` (:data:`SECONDS_FILE`), so ``metrics.json``'s ``seconds`` is the
    demo's time, not the last rerun's alone (a finished demo run again recorded 0.1 s, a resumed one the resumed
    part), and each measured stage's corpus encoding (``encode_seconds``). The total is saved every
    :data:`CLOCK_SAVE_SECONDS` while the block runs (a thread) and as it ends, however it ends: a run killed
    (SIGKILL, the OOM killer) loses at most that period; SIGTERM stops the demo as Ctrl-C does
    (:func:`sigterm_as_interrupt`), so it loses nothing."""
    before = float(read_json_object(path, "demo time").get("seconds", 0.0)) if path.is_file() else 0.0
    started, ended, lock = time.perf_counter(), threading.Event(), threading.Lock()

    def total() -> float:
        return before + time.perf_counter() - started

    def save() -> None:
        with lock:  # the thread's save and the last one never race for the file
            write_json(path, {"seconds": round(total(), 1)})

    def keep_saving() -> None:
        while not ended.wait(CLOCK_SAVE_SECONDS):
            with contextlib.suppress(OSError):  # a full disk: the save at the end says so
                save()

    saver = threading.Thread(target=keep_saving, name="demo clock", daemon=True)
    saver.start()
    try:
        yield total
    finally:
        ended.set()
        saver.join()
        save()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (``timeout``, Slurm, ``docker stop``) stops this process as Ctrl-C does: the demo
    saves its time and says what it kept (:func:`demo_kept`) rather than vanishing. A process forked inside (a
    worker) that gets SIGTERM dies of it as it would have. Outside the main thread, where no handler can be set,
    nothing changes."""
    owner = os.getpid()

    def interrupt(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    earlier = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, earlier)


def write_report(report: dict, out: Path) -> dict:
    """Write ``report.png`` (:func:`report_figure`) and ``metrics.json`` (``report``, with the plot's file and
    SHA-256 under ``plot`` as ``dpr-gc evaluate --plot`` records them) into ``out`` as one output
    (:func:`~dpr_gc.base.files.atomic_paths`, the JSON last): an error or Ctrl-C keeps the earlier pair whole, and a
    kill leaves no new metrics beside an old report. Returns the report as written."""
    import matplotlib.pyplot as plt

    from .evaluation.evaluate import plot_record

    fig = report_figure(report)
    try:
        with atomic_paths(out / "report.png", out / "metrics.json") as (plot, metrics):
            fig.savefig(plot, format="png", dpi=100)
            report = {**report, "plot": plot_record(out / "report.png", plot)}
            with open(metrics, "w", encoding="utf-8") as f:
                dump_json(report, f)
    finally:
        plt.close(fig)
    return report


def report_figure(report: dict) -> Any:
    """Training loss against step, and top-k answer accuracy before and after training, ticked at the k the table
    reports, under a title saying what was trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, losses = zip(*report["training_loss"]) if report["training_loss"] else ((), ())
    left.plot(steps, losses, marker=".")
    left.set(title="training loss (Gradient Cache)", xlabel="step", ylabel="loss")
    ks: list[int] = []
    for name in ("before", "after"):
        acc = report[name]["answers"]
        ks = sorted(int(k.split("@")[1]) for k in acc)
        right.plot(ks, [acc[f"Accuracy@{k}"] for k in ks], marker="o", label=name)
    right.set(title="top-k accuracy on held-out questions", xlabel="k", ylabel="accuracy", xscale="log")
    right.minorticks_off()
    right.set_xticks(TABLE_KS, [str(k) for k in TABLE_KS])
    right.legend()
    training = report.get("config", {}).get("training", {})
    data, cache = training.get("data", {}), training.get("cache", {})
    fig.suptitle(f"dpr-gc demo: {report.get('dataset', {}).get('test_queries', '?')} held-out questions; "
                 f"fine-tuned with Gradient Cache, batch {data.get('batch_size', '?')}, "
                 f"chunk {cache.get('passage_chunk_size', '?')}")
    fig.tight_layout()
    return fig


def format_report(report: dict) -> str:
    rows = [(f"Accuracy@{k}", "answers") for k in TABLE_KS] + [("nDCG@10", "qrels"), ("MRR@10", "qrels"),
                                                                ("Recall@100", "qrels")]
    values = [(metric, report["before"][group].get(metric), report["after"][group].get(metric)) for metric, group in rows]
    return markdown_table(("metric (held-out test)", "before training", "after training"),
                          [(m, f"{b:.4f}", f"{a:.4f}") for m, b, a in values if b is not None and a is not None])


_RECIPE = demo_training()


@dataclasses.dataclass
class DemoFlags:
    """The ``dpr-gc demo`` flags: the demo's sizes and the parts of its training recipe (:func:`demo_training`)
    worth changing from the command line; the defaults are the recipe's."""

    output: str = setting(DemoConfig.output_dir, "--output", type=output_dir, help="output folder (resumable)")
    model: Optional[str] = setting(None, "--model", type=home_expanded,
                                   help="Hugging Face model name or folder (default: offline MiniLM)")
    max_examples: Optional[int] = setting(None, "--max-examples", type=positive_int,
                                          help="subsample the dataset (a quicker, rougher run)")
    train_queries: Optional[int] = setting(DemoConfig.train_queries, "--train-queries", type=positive_int,
                                           help="training questions used")
    batch_size: int = setting(_RECIPE.data.batch_size, "--batch-size", type=positive_int,
                              help="training queries per step (the Gradient Cache batch); at least 4x --chunk-size, "
                                   "so that Gradient Cache shows at a batch larger than one chunk")
    chunk_size: int = setting(_RECIPE.cache.passage_chunk_size, "--chunk-size", type=positive_int,
                              help="rows per Gradient Cache chunk, of queries and of passages; --batch-size must be "
                                   "at least 4x --chunk-size")
    hard_negatives: int = setting(_RECIPE.data.hard_negatives, "--hard-negatives", type=nonnegative_int,
                                  help="hard negatives per training query")
    epochs: int = setting(_RECIPE.optim.epochs, "--epochs", type=positive_int, help="passes over the training data")
    learning_rate: float = setting(_RECIPE.optim.learning_rate, "--learning-rate", type=positive_float,
                                   help="AdamW peak learning rate")
    passage_max_length: int = setting(_RECIPE.model.retriever.passage_max_length, "--passage-max-length",
                                      type=positive_int, help="passage max tokens")
    precision: str = setting(_RECIPE.optim.precision, "--precision", choices=("fp32", "bf16", "fp16"),
                             help="autocast precision of training")
    seed: int = setting(_RECIPE.run.seed, "--seed", type=seed_int, help="seed of the dataset and of training")

    def config(self) -> DemoConfig:
        """The :class:`DemoConfig` these flags ask for: the recipe with the flags' values put in."""
        training, r = demo_training(), dataclasses.replace
        training = r(training, model=r(training.model, name=self.model, retriever=r(
                         training.model.retriever, passage_max_length=self.passage_max_length)),
                     data=r(training.data, batch_size=self.batch_size, hard_negatives=self.hard_negatives),
                     optim=r(training.optim, epochs=self.epochs, learning_rate=self.learning_rate,
                             precision=self.precision),
                     cache=r(training.cache, query_chunk_size=self.chunk_size, passage_chunk_size=self.chunk_size),
                     run=r(training.run, seed=self.seed))
        return DemoConfig(output_dir=self.output, max_examples=self.max_examples, train_queries=self.train_queries,
                          training=training)


def add_cli(subparsers: Any) -> None:
    """Register ``demo``: the whole pipeline on the stdlib dataset, before and after Gradient Cache training."""
    p = subparsers.add_parser(
        "demo",
        description="Build a retrieval task from Python's standard library, measure the offline all-MiniLM-L6-v2, "
                    "fine-tune it with Gradient Cache and measure again. Disk: about 270 MB under --output (the "
                    "dataset, the base and trained models, two corpus encodings and indexes; the training "
                    "checkpoint is deleted once the trained model is saved), plus the parsed-data cache under "
                    "$DPR_GC_CACHE or ~/.cache/dpr_gc (see dpr-gc cache; --clear empties it).")
    add_arguments(p, DemoFlags)
    p.set_defaults(func=_cli_demo)


# what a finished stage of the demo leaves (written last), and its name in the Ctrl-C message
FINISHED_STAGES = (("data/manifest.json", "the dataset"), ("base_model/retriever_config.json", "the base model"),
                   ("before/metrics.json", "the 'before' measurement"),
                   ("training/final/retriever_config.json", "the trained model"),
                   ("after/metrics.json", "the 'after' measurement"))


def demo_kept(out: Path, interrupt: KeyboardInterrupt) -> Optional[str]:
    """What an interrupted demo in ``out`` keeps, from what is there: its finished stages, training's latest
    checkpoint, and the interrupted stage's own line (the blocks a corpus encoding kept, the questions a retrieval
    kept; not training's, which names ``--resume``, a flag the demo does without); None when nothing is kept."""
    from .train.checkpoints import finished_checkpoints

    if not out.is_dir():
        return None
    done = [name for path, name in FINISHED_STAGES if (out / path).is_file()]
    parts = [f"{', '.join(done[:-1])} and {done[-1]} are kept in {out}" if len(done) > 1 else
             f"{done[0]} is kept in {out}"] if done else []
    training = out / "training"
    in_training = training.is_dir() and "the trained model" not in done
    checkpoints = finished_checkpoints(training) if in_training else []
    if checkpoints:
        parts.append(f"training's {checkpoints[-1].name} is kept in {training} and training resumes from it")
    if isinstance(interrupt, Interrupted) and str(interrupt) and not in_training:
        return "; ".join([*parts, str(interrupt)])  # the stage's own line says what it kept and how to go on
    return "; ".join([*parts, "run the same command again to resume"]) if parts else None


@guarded(inputs=("model",), outputs={"output": "folder"}, members={"output": DEMO_MEMBERS})
def _cli_demo(args: Any) -> None:
    """The demo; its closing ``time`` row is this run's, as every command's (``metrics.json``'s ``seconds`` counts
    every run of the demo in its folder)."""
    started = time.perf_counter()
    config = from_args(DemoFlags, args).config()
    try:
        with sigterm_as_interrupt():
            report = run_demo(config)
    except KeyboardInterrupt as interrupt:
        kept = demo_kept(Path(config.output_dir), interrupt)
        if kept is None:
            raise  # nothing to resume from: the general line
        raise Interrupted(kept) from None
    print(f"\n{format_report(report)}")  # a table of its own: training's summary table may end just above
    outputs = report["outputs"]
    print("\n" + format_summary({"output": config.output_dir, "trained retriever": outputs["model"],
                                 "index": outputs["index"], "run file": outputs["run"], "metrics": outputs["metrics"],
                                 "plot": outputs["plot"]}, time.perf_counter() - started))
