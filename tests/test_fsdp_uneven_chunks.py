"""FSDP2 under two gloo processes whose rows have very different lengths: each rank plans its own chunks (by tokens,
kept or replayed under a memory budget, joined from the second step on), while every chunk's forward and backward
under FSDP are collectives. The plans are agreed over the ranks, so the steps finish (they deadlocked or aborted)
and the gradient stays that of one process on the global batch."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpr_gc import Chunking, DistributedContrastiveLoss, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.chunking import take_rows
from tests.helpers import random_texts, rel_err
from tests.ranks import rank_errors, run_ranks

WORLD, LOCAL, STEPS = 2, 4, 2


def uneven_batch(retriever) -> tuple[dict, dict]:
    """Rank 0's rows are a few tokens long, rank 1's several dozen."""
    queries = random_texts(LOCAL, 1, 1, 2) + random_texts(LOCAL, 2, 12, 20)
    titles = random_texts(4 * LOCAL, 3, 1, 2)
    texts = random_texts(2 * LOCAL, 4, 1, 3) + random_texts(2 * LOCAL, 5, 30, 60)
    return dict(retriever.tokenize_queries(queries)), dict(retriever.tokenize_passages(titles, texts))


def local_rows(rank: int, q: dict, p: dict) -> tuple[dict, dict]:
    return (take_rows(dict(q, kind="query"), torch.arange(rank * LOCAL, (rank + 1) * LOCAL)),
            take_rows(dict(p, kind="passage"), torch.arange(rank * 2 * LOCAL, (rank + 1) * 2 * LOCAL)))


def largest_chunk_graph(q: dict, p: dict) -> int:
    """The largest one-row chunk graph of the global batch, measured in one process (the same on both ranks)."""
    from tests.llm_models import lora_decoder

    torch.manual_seed(0)
    gc = GradCache([lora_decoder()] * 2, 1, SimpleContrastiveLoss(1), memory_budget=10**12)
    gc(dict(q, kind="query"), dict(p, kind="passage"))
    return gc.last_step.largest_graph


def check_uneven_plans(rank: int) -> None:
    from dpr_gc.model.fsdp import shard_retriever
    from tests.llm_models import lora_decoder

    torch.manual_seed(0)
    reference = lora_decoder()
    q, p = uneven_batch(reference)
    SimpleContrastiveLoss(1)(reference("query", **q), reference("passage", **p)).backward()
    expected = {n: t.grad.clone() for n, t in reference.named_parameters() if t.grad is not None}
    largest = largest_chunk_graph(q, p)
    torch.manual_seed(0)
    retriever = shard_retriever(lora_decoder())
    q_local, p_local = local_rows(rank, q, p)
    settings = {"one row, a budget of three graphs": (1, 3 * largest, None),
                "tokens, no budget": ([4, 8], 0, [16, 64]),
                "tokens, a whole budget (joins)": ([4, 8], 10**12, [16, 64])}
    for name, (rows, budget, tokens) in settings.items():
        gc = GradCache([retriever, retriever], rows, DistributedContrastiveLoss(1), memory_budget=budget,
                       chunking=Chunking(sort_by_length=True, tokens=tokens))
        for step in range(STEPS):
            retriever.zero_grad(set_to_none=True)
            gc(q_local, p_local, no_sync_except_last=True)
            got = {n: getattr(t.grad, "full_tensor", lambda: t.grad)() for n, t in retriever.named_parameters()
                   if t.grad is not None}
            assert got.keys() == expected.keys(), name
            err = rel_err(torch.cat([got[n].flatten() for n in expected]),
                          torch.cat([expected[n].flatten() for n in expected]))
            assert err < 1e-5, f"{name}, step {step + 1}: {err:.2e}"


def worker(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        check_uneven_plans(rank)
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise  # the parent then stops the other rank at once, not at its collective's timeout


@pytest.mark.slow
def test_fsdp_ranks_with_uneven_rows_agree_on_their_chunks_and_stay_exact(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(worker, (str(tmp_path),), WORLD, limit_s=240)
    errors = rank_errors(tmp_path)
    assert not errors, errors
