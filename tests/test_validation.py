"""Bounded dev validation: DPR's caps on questions and negatives, blocked scoring, one share of the work per rank."""

from __future__ import annotations

from datetime import timedelta

import gzip
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpr_gc.train import validation as V
from dpr_gc.base.errors import DprGcError
from dpr_gc.model.retriever import Retriever
from dpr_gc.cli import build_parser
from dpr_gc.train.config import config_from_args
from tests.ranks import run_ranks
from tests.train_data import init_model, write_beir


def dev_records(n: int) -> list[dict]:
    ctx = lambda pid, text: {"passage_id": pid, "title": "", "text": text}  # noqa: E731
    return [{"question": f"city river {i}", "answers": [str(i)], "positive_ctxs": [ctx(f"p{i}", f"the city {i} river")],
             "hard_negative_ctxs": [ctx(f"h{i}-{j}", f"war king {i} {j}") for j in range(5)],
             "negative_ctxs": [ctx(f"n{i}-{j}", f"music film {i} {j}") for j in range(5)]} for i in range(n)]


def write_dev(path: Path, n: int) -> str:
    path.write_text(json.dumps(dev_records(n)))
    return str(path)


def brute_force(retriever: Retriever, records: list[dict], hard: int, other: int) -> float:
    """DPR's average rank as DPR's ``validate_average_rank`` computes it: the full score matrix of the capped pool
    sorted per question, each gold passage's 0-based place in that order (``(indices[i] == gold).nonzero()``)."""
    pool: dict = {}
    gold = []
    for r in records:
        for c in r["positive_ctxs"][:1] + r["hard_negative_ctxs"][:hard] + r["negative_ctxs"][:other]:
            pool.setdefault(c["passage_id"], (len(pool), c["text"]))
        gold.append(pool[r["positive_ctxs"][0]["passage_id"]][0])
    q = retriever.embed("query", [r["question"] for r in records])
    p = retriever.embed("passage", [t for _, t in pool.values()])
    scores = torch.from_numpy(q) @ torch.from_numpy(p).T
    _, indices = torch.sort(scores, dim=1, descending=True)
    return sum((indices[i] == g).nonzero().item() for i, g in enumerate(gold)) / len(gold)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("validation"))


def test_caps_bound_questions_and_pool_whatever_the_dev_size(model: Path, tmp_path: Path, monkeypatch) -> None:
    retriever = Retriever.load(model)
    embedded: list[int] = []
    original = Retriever.embed
    monkeypatch.setattr(Retriever, "embed", lambda self, kind, texts, *a, **k: (embedded.append(len(texts)),
                                                                                  original(self, kind, texts, *a, **k))[1])
    limits = V.DevLimits(max_questions=10, hard_negatives=2, other_negatives=1, batch_size=4)
    small = V.evaluate_dev(retriever, write_dev(tmp_path / "small.json", 20), limits, str(tmp_path / "cache"))
    seen_small, embedded[:] = list(embedded), []
    large = V.evaluate_dev(retriever, write_dev(tmp_path / "large.json", 300), limits, str(tmp_path / "cache"))
    assert embedded == seen_small == [10, 10 * (1 + 2 + 1)]
    assert small == large and small["questions"] == 10 and small["passages"] == 40
    monkeypatch.setattr(Retriever, "embed", original)
    assert small["avg_rank"] == pytest.approx(brute_force(retriever, dev_records(10), 2, 1))


def dpr_validate_nll(retriever: Retriever, records: list[dict], batch: int, hard: int, other: int) -> tuple:
    """DPR's ``validate_nll`` (its ``create_biencoder_input`` with ``shuffle=False``): each batch's questions scored
    against each one's first positive, first ``other`` negatives and first ``hard`` hard negatives (the first negatives
    where it has no hard ones), the batch's mean NLL averaged over the batches; scores over the retriever's
    temperature, as its training loss takes them."""
    losses, correct = [], 0
    for start in range(0, len(records), batch):
        ctxs, positions = [], []
        for r in records[start:start + batch]:
            hards = r["hard_negative_ctxs"] or r["negative_ctxs"][:hard]
            positions.append(len(ctxs))
            ctxs += r["positive_ctxs"][:1] + r["negative_ctxs"][:other] + hards[:hard]
        q = torch.from_numpy(retriever.embed("query", [r["question"] for r in records[start:start + batch]]))
        p = torch.from_numpy(retriever.embed("passage", [c["text"] for c in ctxs], [c["title"] for c in ctxs]))
        log_probs = torch.log_softmax(q @ p.T / float(retriever.temperature), dim=1)
        target = torch.tensor(positions)
        losses.append(float(torch.nn.functional.nll_loss(log_probs, target)))
        correct += int((log_probs.argmax(1) == target).sum())
    return sum(losses) / len(losses), correct / len(records)


@pytest.mark.parametrize("pool_hard, pool_other", [(5, 5), (0, 0)])
def test_dev_loss_and_accuracy_are_dprs_validate_nll(model: Path, tmp_path: Path, pool_hard, pool_other) -> None:
    """dev_loss and dev_accuracy scored each question against the batch's gold passages only (ln 4 for a random model
    with batches of 4) where DPR's validate_nll adds each question's --hard_negatives and --other_negatives; they are
    DPR's, whatever the average-rank pool holds (which the loss's negatives leave as it was)."""
    retriever = Retriever.load(model)
    records = dev_records(8)
    records[1]["hard_negative_ctxs"] = []  # DPR takes its first negatives in their place
    dev = tmp_path / "dev.json"
    dev.write_text(json.dumps(records))
    limits = V.DevLimits(hard_negatives=pool_hard, other_negatives=pool_other, batch_size=4)
    got = V.evaluate_dev(retriever, str(dev), limits, str(tmp_path / "cache"), negatives=(2, 1))
    loss, accuracy = dpr_validate_nll(retriever, records, 4, 2, 1)
    assert (got["loss"], got["accuracy"]) == (pytest.approx(loss, rel=1e-5), pytest.approx(accuracy))
    plain = V.evaluate_dev(retriever, str(dev), limits, str(tmp_path / "cache"))
    assert plain["loss"] == pytest.approx(dpr_validate_nll(retriever, records, 4, 0, 0)[0], rel=1e-5)
    assert (got["avg_rank"], got["passages"]) == (plain["avg_rank"], plain["passages"])


def test_blocked_ranks_equal_the_full_matrix(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    q, p = torch.randn(37, 8, generator=gen), torch.randn(91, 8, generator=gen)
    gold = torch.randint(0, 91, (37,), generator=gen)
    scores = q @ p.T
    expected = (scores > scores[torch.arange(37), gold][:, None]).sum(1)  # 0-based, as DPR's
    monkeypatch.setattr(V, "SCORE_BLOCK_ELEMENTS", 91 * 5)  # five questions per block
    assert torch.equal(V.gold_ranks(q, p, gold), expected)


def test_dev_flags_and_bad_values(tmp_path: Path) -> None:
    args = build_parser().parse_args(["train", "--train", "t", "--output", "o", "--dev", "d", "--dev-max-questions",
                                      "5", "--dev-hard-negatives", "0", "--dev-other-negatives", "2", "--dev-batch-size",
                                      "3"])
    assert config_from_args(args).data.dev == V.DevLimits(5, 0, 2, 3, None)
    with pytest.raises(DprGcError, match="--dev-max-questions"):
        V.DevLimits(max_questions=0)
    with pytest.raises(DprGcError, match="--dev-hard-negatives"):
        V.DevLimits(hard_negatives=-1)


def worker(rank: int, tmp: str, model: str, dev: str, world: int) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        limits = V.DevLimits(max_questions=7, hard_negatives=3, other_negatives=0, batch_size=4)
        metrics = V.evaluate_dev(Retriever.load(model), dev, limits, f"{tmp}/cache-{rank}")
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(metrics))
    except Exception:
        Path(tmp, f"error{rank}").write_text(traceback.format_exc())
        raise


@pytest.mark.slow  # ~20 CPU-seconds or more (measured)
@pytest.mark.parametrize("world", [3])
def test_sharded_validation_equals_one_process(model: Path, tmp_path: Path, world: int) -> None:
    dev = write_dev(tmp_path / "dev.json", 9)
    limits = V.DevLimits(max_questions=7, hard_negatives=3, other_negatives=0, batch_size=4)
    expected = V.evaluate_dev(Retriever.load(model), dev, limits, str(tmp_path / "cache"))
    run_ranks(worker, (str(tmp_path), str(model), dev, world), world)
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key


def test_dev_caps_are_the_same_in_the_library_the_help_and_the_docs() -> None:
    """DPR's dev caps (10,000 questions, 30 hard and 30 other negatives each) are ``DevLimits()``'s defaults, what
    ``dpr-gc train --help`` states and what docs/stages.md says, so none of the three can drift from the others."""
    import re

    limits = V.DevLimits()
    caps = {"--dev-max-questions": limits.max_questions, "--dev-hard-negatives": limits.hard_negatives,
            "--dev-other-negatives": limits.other_negatives}
    assert list(caps.values()) == [10000, 30, 30]
    train = next(a for a in build_parser("train")._actions if a.dest == "command").choices["train"]
    entries = {e.split()[0].rstrip(","): " ".join(e.split()) for e in re.split(r"\n  (?=--)", train.format_help())}
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "stages.md").read_text().split())
    for flag, value in caps.items():
        assert f"(default: {value})" in entries[flag], entries[flag]
        stated = re.findall(rf"`{flag}` \(([\d,]+)\)", docs)
        assert [int(n.replace(",", "")) for n in stated] == [value], (flag, stated)


def test_a_beir_folder_given_as_dev_is_validated_on_its_dev_split_not_its_training_queries(tmp_path):
    """``--dev BEIR_DIR`` read the folder's training qrels (the split ``--train`` reads), so validation and the best
    checkpoint were measured on training queries; it reads ``qrels/dev.tsv`` (``--dev-beir-split``), and a folder
    without that split is refused in one line that names the splits it has."""
    folder = tmp_path / "beir"
    write_beir(folder, queries=12)
    cache = str(tmp_path / "cache")
    with pytest.raises(DprGcError, match=r"^--dev .*beir: a BEIR folder is validated on qrels/dev\.tsv, which it "
                                         r"lacks \(its splits: train\); give --dev-beir-split SPLIT"):
        V.load_dev_data(str(folder), cache)
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq3\td3-0\t1\nq7\td7-0\t1\n")
    assert sorted(V.load_dev_data(str(folder), cache)["question"]) == ["which city 3", "which city 7"]
    assert len(V.load_dev_data(str(folder), cache, beir_split="train")) == 12
    (folder / "qrels" / "test.tsv.gz").write_bytes(gzip.compress(b"q5\td5-0\t1\n"))  # gzipped as any text file
    assert V.load_dev_data(str(folder), cache, beir_split="test")["question"] == ["which city 5"]
    args = build_parser("train").parse_args(["train", "--train", str(folder), "--dev", str(folder), "--output", "o"])
    assert config_from_args(args).data.dev.beir_split == "dev"
