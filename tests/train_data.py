"""A small generated DPR training task with a learnable signal (shared key words), for trainer tests."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from transformers import BertTokenizerFast

from dpr_gc.model.retriever import Retriever, RetrieverConfig
from dpr_gc.train.config import TrainConfig
from dpr_gc.train.validation import DevLimits
from tests.helpers import WORDS, tiny_bert, write_vocab

RENAMED = {"model": ("model", "name"), "grad_cache": ("cache", "enabled"), "dev_file": ("data", "dev_file")}


def make_records(n: int, seed: int, hard: int = 2) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        keys = rng.sample(WORDS, 2) + [str(rng.randint(10, 99))]
        filler = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        question = " ".join(keys)
        positive = {"title": keys[0], "text": f"{filler(4)} {' '.join(keys)} {filler(4)}", "passage_id": f"{seed}-{i}"}
        negatives = [{"title": rng.choice(WORDS), "text": filler(10), "passage_id": f"{seed}-{i}-n{j}"}
                     for j in range(hard)]
        records.append({"question": question, "answers": [keys[2]], "positive_ctxs": [positive],
                        "negative_ctxs": [], "hard_negative_ctxs": negatives})
    return records


def write_dpr(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records))
    return path


def train_config(**flat) -> TrainConfig:
    """A :class:`TrainConfig` from the field names of its groups, each routed to the group that has it (``model``
    names the model, ``grad_cache`` is ``cache.enabled``, ``dev_*`` go to ``data.dev``): short test set-ups."""
    groups = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
    values: dict = {name: {} for name in groups}
    dev = {}
    for key, value in flat.items():
        if key in RENAMED:
            group, field = RENAMED[key]
        elif key.startswith("dev_"):
            dev[key.removeprefix("dev_")] = value
            continue
        else:
            owners = [g for g, make in groups.items() if key in {f.name for f in dataclasses.fields(make())}]
            assert len(owners) == 1, f"no single group has a field {key!r}"
            group, field = owners[0], key
        values[group][field] = value
    if dev:
        values["data"]["dev"] = DevLimits(**dev)
    built = {name: type(make())(**values[name]) for name, make in groups.items()}
    return TrainConfig(**built)


def init_model(folder: Path, dropout: float = 0.0, shared: bool = True, **fields) -> Path:
    """A tiny random retriever saved as ``folder/init`` (the starting model of the trainer tests)."""
    tokenizer = BertTokenizerFast(vocab=str(write_vocab(folder / "vocab.txt")))
    config = RetrieverConfig(**{"pooling": "mean", "query_max_length": 16, "passage_max_length": 32,
                                "shared_encoder": shared, **fields})
    retriever = Retriever(tiny_bert(len(tokenizer), dropout=dropout), None if shared else tiny_bert(len(tokenizer), 1),
                          tokenizer, config)
    retriever.save(folder / "init")
    return folder / "init"


def task_config(task: dict, out: Path, **kw) -> TrainConfig:
    """The training settings of a test task (``init_model`` folder, ``train``/``dev`` files) writing to ``out``."""
    base = dict(train_files=[str(task["train"])], output_dir=str(out), model=str(task["model"]), batch_size=8,
                num_workers=0, learning_rate=1e-3, query_chunk_size=3, passage_chunk_size=5, cache_dir=str(task["dir"] / "cache"))
    if kw.get("grad_cache") is False:  # plain training takes no chunk sizes
        del base["query_chunk_size"], base["passage_chunk_size"]
    base.update(kw)
    return train_config(**base)


def model_params(model_dir: Path) -> dict:
    """A saved retriever's weights by name."""
    return {k: v.clone() for k, v in Retriever.load(model_dir).state_dict().items()}


POSITIVES = {0: 3, 1: 2, 2: 2}  # queries with several positives; the other queries have one


def write_beir(folder: Path, queries: int = 12) -> dict[str, set[str]]:
    """A BEIR folder whose query i is judged relevant to POSITIVES.get(i, 1) passages; returns question -> texts."""
    (folder / "qrels").mkdir(parents=True)
    docs, qrels, pairs = [], ["query-id\tcorpus-id\tscore"], {}
    for i in range(queries):
        for j in range(POSITIVES.get(i, 1)):
            docs.append({"_id": f"d{i}-{j}", "title": "", "text": f"city river {i} passage {j}"})
            qrels.append(f"q{i}\td{i}-{j}\t1")
            pairs.setdefault(f"which city {i}", set()).add(f"city river {i} passage {j}")
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"which city {i}"}) + "\n"
                                                  for i in range(queries)))
    (folder / "qrels" / "train.tsv").write_text("\n".join(qrels) + "\n")
    return pairs
