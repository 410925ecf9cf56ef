"""A small generated DPR training task with a learnable signal (shared key words), for trainer tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.conftest import WORDS


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
