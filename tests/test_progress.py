"""Honest progress: encode's bar counts estimated tokens, so while the longest passages go first its fraction done
tracks the fraction of the work done (a count of passages would be far behind, and its ETA far too long)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import dpr_gc.retrieval.encode as encode
from dpr_gc.model.retriever import estimated_tokens


class RecordingBar:
    """A tqdm stand-in that records its total and each update."""

    def __init__(self, total: float = 0, **kwargs) -> None:
        self.total, self.updates, self.unit = total, [], kwargs.get("unit")

    def update(self, n: float) -> None:
        self.updates.append(n)

    def close(self) -> None:
        pass


def test_encode_progress_tracks_the_work_not_the_passages(tmp_path: Path, make_retriever, monkeypatch) -> None:
    words = "the city river king war science protein cell gene paris london france music film book water".split()
    rng = np.random.default_rng(0)
    long = [" ".join(rng.choice(words, 60)) for _ in range(8)]
    short = [" ".join(rng.choice(words, 2)) for _ in range(56)]
    texts = long + short
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(f"p{i}\t{t}\t\n" for i, t in enumerate(texts)))
    bars: list[RecordingBar] = []
    monkeypatch.setattr(encode, "tqdm", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    retriever = make_retriever(passage_max_length=128)
    encode.encode_corpus(retriever, corpus, tmp_path / "out", batch_size=8, cache_dir=tmp_path / "c")
    (bar,) = bars
    assert bar.unit == " tokens" and sum(bar.updates) == bar.total  # the bar ends at exactly 100%
    assert bar.total == estimated_tokens(np.array([len(t) for t in texts]), 128).sum()
    # the real work: tokens of each passage, the longest first (the order the embedding loop takes)
    lengths = sorted((len(retriever.tokenizer(t, truncation=True, max_length=128)["input_ids"]) for t in texts),
                     reverse=True)
    work = np.cumsum(lengths) / sum(lengths)
    done = np.cumsum(bar.updates) / bar.total
    rows = np.cumsum([8] * len(bar.updates))
    by_passages = rows / len(texts)
    assert np.abs(done - work[rows - 1]).max() < 0.1
    assert np.abs(by_passages - work[rows - 1]).max() > 0.3  # what a bar in passages showed: far behind


def test_on_the_cpu_the_encode_bar_advances_after_every_batch(tmp_path: Path, make_retriever, monkeypatch) -> None:
    """On the CPU a batch's embeddings are ready when its forward returns, so the bar advances batch by batch; it
    advanced only once per 16 batches (all at once), and its rate and ETA were off by an order of magnitude until
    then (on a GPU finished batches are copied back a tokenised chunk at a time, so tokenising overlaps them)."""
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("id\ttext\ttitle\n" + "".join(f"p{i}\t{'word ' * (1 + i % 9)}\t\n" for i in range(40)))
    bars: list[RecordingBar] = []
    monkeypatch.setattr(encode, "tqdm", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    retriever = make_retriever(passage_max_length=32)
    forwards: list[int] = []
    retriever.register_forward_hook(lambda *args: forwards.append(1))
    seen: list[int] = []
    real_update = RecordingBar.update
    monkeypatch.setattr(RecordingBar, "update", lambda self, n: seen.append(len(forwards)) or real_update(self, n))
    encode.encode_corpus(retriever, corpus, tmp_path / "out", batch_size=8, cache_dir=tmp_path / "c")
    assert seen == [1, 2, 3, 4, 5], seen


def test_dev_validation_in_training_says_its_size_first_and_draws_a_bar(tmp_path: Path, monkeypatch) -> None:
    """Dev validation during train drew no bar (evaluate_dev's show_progress left False) and logged its 'dev
    validation over N questions and M passages' line after the work; the line comes first and rank 0 draws a bar
    (a log file hides it while train's bar is open: nested_bar_disabled)."""
    import logging

    import dpr_gc.train.trainer as trainer_module
    from tests.train_data import make_records, task_config, write_dpr, init_model

    task = {"dir": tmp_path, "model": init_model(tmp_path), "dev": write_dpr(tmp_path / "dev.json", make_records(6, 2)),
            "train": write_dpr(tmp_path / "t.json", make_records(16, 1))}
    events: list[str] = []
    evaluate_dev = trainer_module.evaluate_dev

    def watched(*args, **kwargs) -> dict:
        events.append(f"validation, show_progress={kwargs.get('show_progress')}")
        return evaluate_dev(*args, **kwargs)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("dev validation over"):
                events.append(record.getMessage())

    monkeypatch.setattr(trainer_module, "evaluate_dev", watched)
    handler, log = Said(), logging.getLogger("dpr_gc")
    monkeypatch.setattr(log, "level", logging.INFO)
    log.addHandler(handler)
    try:
        trainer_module.Trainer(task_config(task, tmp_path / "run", max_steps=1, dev_file=str(task["dev"]))).fit()
    finally:
        log.removeHandler(handler)
    said = "dev validation over 6 questions and 18 passages"
    assert events == [said, "validation, show_progress=True"] * 2, events  # before training and after its step


def test_every_bar_names_its_unit_after_a_space() -> None:
    """Train's bar, dev validation's, Retriever.embed's and the JAX example's counted anonymous "it"s (``3/12
    [00:06, 1.78it/s]``) and the stdlib parser's unit had no space before it ("12file/s"); every tqdm bar in
    dpr_gc/ and scripts/ names what it counts, after a space, as the others do (" q/s", " passages")."""
    import ast

    repo = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted([*(repo / "dpr_gc").rglob("*.py"), *(repo / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "tqdm":
                unit = next((k.value for k in node.keywords if k.arg == "unit"), None)
                if not (isinstance(unit, ast.Constant) and str(unit.value).startswith(" ")):
                    bad.append(f"{path.relative_to(repo)}:{node.lineno}")
    assert not bad, f"tqdm bars without a ' unit': {bad}"


def test_embeds_own_bar_in_tokens_ends_at_its_total(make_retriever, monkeypatch) -> None:
    """``Retriever.embed(progress_in_tokens=True)`` with no bar given opens its own: counted in estimated tokens
    with their total (it counted texts while advancing by tokens, ending far past 100%)."""
    import dpr_gc.model.retriever as retriever_module

    bars: list[RecordingBar] = []
    monkeypatch.setattr(retriever_module, "tqdm", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    texts = ["word " * (1 + i % 30) for i in range(20)]
    make_retriever(passage_max_length=64).embed("passage", texts, batch_size=4, progress_in_tokens=True)
    (bar,) = bars
    assert bar.unit == " tokens" and sum(bar.updates) == bar.total
    assert bar.total == estimated_tokens(np.array([len(t) for t in texts]), 64).sum()
