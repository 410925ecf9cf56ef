"""A small generated DPR training task with a learnable signal (shared key words), for trainer tests."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from dpr_gc.train.config import TrainConfig
from dpr_gc.train.validation import DevLimits
from tests.conftest import WORDS

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
