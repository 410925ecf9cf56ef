"""Memory budget under two gloo processes: kept graphs under DDP (tied and separate towers) and FSDP2 give the
gradient of one process on the global batch (the kept graphs run without sync, the replayed last chunk syncs)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import BertTokenizerFast

from dpr_gc import DistributedContrastiveLoss, Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.chunking import take_rows
from tests.helpers import tiny_bert, write_vocab
from tests.ranks import rank_errors, run_ranks
from tests.helpers import grads, make_batch, rel_err

WORLD, LOCAL = 2, 4


def local_rows(rank: int, q: dict, p: dict) -> tuple[dict, dict]:
    return (take_rows(dict(q, kind="query"), torch.arange(rank * LOCAL, (rank + 1) * LOCAL)),
            take_rows(dict(p, kind="passage"), torch.arange(rank * 2 * LOCAL, (rank + 1) * 2 * LOCAL)))


def check_ddp(rank: int, tmp: str, shared: bool) -> None:
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from dpr_gc.train.trainer import Towers

    tokenizer = BertTokenizerFast(vocab=str(Path(tmp) / "vocab.txt"))
    retriever = Retriever(tiny_bert(len(tokenizer)), None if shared else tiny_bert(len(tokenizer), 1), tokenizer,
                          RetrieverConfig(shared_encoder=shared, pooling="mean", learn_temperature=True))
    q, p = make_batch(retriever, WORLD * LOCAL, 1, seed=51)
    SimpleContrastiveLoss(1)(retriever("query", **q), retriever("passage", **p)).backward()
    expected = grads([retriever])
    ddp = DistributedDataParallel(Towers(retriever), find_unused_parameters=not shared)
    syncs = []
    ddp.register_comm_hook(None, lambda state, bucket: syncs.append(1) or allreduce_hook(None, bucket))
    q_local, p_local = local_rows(rank, q, p)
    GradCache([ddp, ddp], 3, DistributedContrastiveLoss(1), chunking=Chunking(sort_by_length=True))(q_local, p_local,
                                                                                 no_sync_except_last=True)
    syncs_without_budget, largest = len(syncs), 0
    for budget, steps in ((10**12, 2), (None, 1)):  # every graph (its second step joins chunks), then two graphs'
        budget = 2 * largest if budget is None else budget
        gc = GradCache([ddp, ddp], 3, DistributedContrastiveLoss(1), memory_budget=budget,
                       chunking=Chunking(sort_by_length=True))
        for step in range(steps):
            retriever.zero_grad(set_to_none=True)
            syncs.clear()
            gc(q_local, p_local, no_sync_except_last=True)
            assert sum(gc.last_step.kept) > 0, f"step {step + 1}: no graph was kept"
            assert sum(gc.last_step.kept) < sum(gc.last_step.chunks), "the last chunks must be replayed"
            largest = largest if step else gc.last_step.largest_graph
            assert len(syncs) == syncs_without_budget, "kept graphs must not add gradient syncs"
            err = rel_err(grads([retriever]), expected)
            assert err < 1e-5, f"DDP shared={shared} budget {budget} step {step + 1}: {err:.2e}"


def check_fsdp(rank: int) -> None:
    from dpr_gc.model.fsdp import shard_retriever
    from tests.llm_models import lora_decoder

    torch.manual_seed(0)
    reference = lora_decoder()
    q, p = make_batch(reference, WORLD * LOCAL, 1, seed=52)
    SimpleContrastiveLoss(1)(reference("query", **q), reference("passage", **p)).backward()
    expected = {n: t.grad.clone() for n, t in reference.named_parameters() if t.grad is not None}
    torch.manual_seed(0)
    retriever = shard_retriever(lora_decoder())
    q_local, p_local = local_rows(rank, q, p)
    gc = GradCache([retriever, retriever], 3, DistributedContrastiveLoss(1),
                   memory_budget=10**12, chunking=Chunking(sort_by_length=True))
    gc(q_local, p_local, no_sync_except_last=True)
    assert sum(gc.last_step.kept) > 0
    got = {n: getattr(t.grad, "full_tensor", lambda: t.grad)() for n, t in retriever.named_parameters()
           if t.grad is not None}
    assert got.keys() == expected.keys()
    flat = torch.cat([got[n].flatten() for n in expected])
    err = rel_err(flat, torch.cat([expected[n].flatten() for n in expected]))
    assert err < 1e-5, f"FSDP: {err:.2e}"


def worker(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    checks = {"ddp-shared": lambda: check_ddp(rank, tmp, True), "ddp-separate": lambda: check_ddp(rank, tmp, False),
              "fsdp": lambda: check_fsdp(rank)}
    for name, check in checks.items():
        torch.manual_seed(0)
        try:
            check()
        except Exception:
            Path(tmp, f"error-{name}-{rank}.txt").write_text(f"{name}:\n{traceback.format_exc()}")
        dist.barrier()


@pytest.mark.slow  # 26 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_budget_under_ddp_and_fsdp(tmp_path):
    write_vocab(tmp_path / "vocab.txt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(worker, (str(tmp_path),), WORLD, limit_s=300)
    errors = rank_errors(tmp_path)
    assert not errors, errors
