"""Engine edge cases under two gloo processes: the gather's backward, compiled DDP modules, checkpointed towers."""

from __future__ import annotations

from datetime import timedelta

import functools
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import BertTokenizerFast

from dpr_gc import DistributedContrastiveLoss, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.grad_cache import take_rows
from dpr_gc.engine.loss import all_gather_with_grad
from tests.helpers import tiny_bert, write_vocab
from tests.ranks import run_ranks
from tests.helpers import MeanOfEmbeddings, grads, make_batch, rel_err

WORLD = 2


def check_gather_leaves_other_consumers_alone(rank: int) -> None:
    """The gather's backward must not all-reduce autograd's gradient in place: a sibling branch reads it too."""
    weights = torch.zeros(6, 4, requires_grad=True)
    sibling = weights * 2  # created before the gather, so its backward runs after the gather's
    x = torch.randn(3, 4, requires_grad=True)
    c = torch.arange(24.0).reshape(6, 4)
    ((all_gather_with_grad(x) + sibling) * c).sum().backward()
    assert torch.equal(weights.grad, 2 * c), "the sibling's gradient was changed by the gather's backward"
    assert torch.equal(x.grad, WORLD * c[rank * 3:(rank + 1) * 3])


def check_compiled_ddp(rank: int) -> None:
    """``torch.compile`` around DDP: recognised as DDP (no_sync_except_last allowed, no kept graph), exact."""
    torch.manual_seed(0)
    towers = [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in range(2)]
    q, p = torch.randn(8, 5), torch.randn(8, 5)
    reference = SimpleContrastiveLoss(temperature=0.5)
    reference(towers[0](q), towers[1](p)).backward()
    expected = grads(towers)
    for t in towers:
        t.zero_grad(set_to_none=True)
    models = [torch.compile(DistributedDataParallel(t), backend="eager") for t in towers]
    rows = slice(rank * 4, (rank + 1) * 4)
    loss_fn = DistributedContrastiveLoss(temperature=0.5)
    GradCache(models, 3, loss_fn)(q[rows], p[rows], no_sync_except_last=True)
    assert rel_err(grads(towers), expected) < 1e-5, rel_err(grads(towers), expected)


def check_global_target(rank: int) -> None:
    """docs/library.md: DistributedContrastiveLoss takes ``target`` over the global batch, as the original does:
    with one index per query of all ranks into the gathered passages, the cached DDP step equals the full batch's
    gradient with that target. Unlike the original's, the loss it returns is the mean over this rank's queries."""
    torch.manual_seed(0)
    towers = [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in range(2)]
    q, p = torch.randn(8, 5), torch.randn(12, 5)  # no fixed layout: 12 passages for 8 queries
    target = torch.tensor([11, 0, 5, 5, 2, 9, 7, 3])
    reference = SimpleContrastiveLoss(temperature=0.5)
    per_query = reference(towers[0](q), towers[1](p), target=target, reduction="none")
    per_query.mean().backward()
    expected = grads(towers)
    for t in towers:
        t.zero_grad(set_to_none=True)
    models = [DistributedDataParallel(t) for t in towers]
    q_rows, p_rows = slice(rank * 4, (rank + 1) * 4), slice(rank * 6, (rank + 1) * 6)
    loss = GradCache(models, 3, DistributedContrastiveLoss(temperature=0.5))(q[q_rows], p[p_rows], target=target,
                                                                             no_sync_except_last=True)
    assert rel_err(grads(towers), expected) < 1e-5, rel_err(grads(towers), expected)
    torch.testing.assert_close(loss, per_query[q_rows].mean().detach())


def check_embeddings_under_ddp(rank: int) -> None:
    """Trainable embeddings under DDP (dense gradients there; the sparse per-chunk ones are single-process): their
    gradient reaches the reducer's all-reduce like any other, so the cached step equals the global batch's."""
    torch.manual_seed(0)
    towers = [MeanOfEmbeddings() for _ in range(2)]
    ids = torch.randint(1, 100, (16, 6))
    mask = (torch.arange(6)[None] < torch.randint(2, 7, (16, 1))).long()
    q, p = {"input_ids": ids[:8], "attention_mask": mask[:8]}, {"input_ids": ids[8:], "attention_mask": mask[8:]}
    reference = SimpleContrastiveLoss(temperature=0.5)
    reference(towers[0](**q), towers[1](**p)).backward()
    expected = grads(towers)
    for t in towers:
        t.zero_grad(set_to_none=True)
    rows = slice(rank * 4, (rank + 1) * 4)
    local = [{k: v[rows] for k, v in x.items()} for x in (q, p)]
    GradCache([DistributedDataParallel(t) for t in towers], 3, DistributedContrastiveLoss(temperature=0.5))(
        *local, no_sync_except_last=True)
    assert rel_err(grads(towers), expected) < 1e-5, rel_err(grads(towers), expected)


def reentrant_by_default(original):
    """What transformers before the non-reentrant default did when no checkpointing kwargs were given."""

    @functools.wraps(original)
    def enable(self, activation_checkpointing_kwargs=None, *args, **kwargs):
        return original(self, activation_checkpointing_kwargs or {"use_reentrant": True}, *args, **kwargs)
    return enable


def check_checkpointed_separate_towers(rank: int, tmp: str) -> None:
    """Gradient checkpointing + DDP + separate towers (the trainer's setting) must work whatever transformers'
    default checkpointing is."""
    from transformers.modeling_utils import PreTrainedModel

    from dpr_gc.model.retriever import Retriever, RetrieverConfig, enable_gradient_checkpointing
    from dpr_gc.train.trainer import Towers

    PreTrainedModel._activation_checkpointing_enable = reentrant_by_default(
        PreTrainedModel._activation_checkpointing_enable)
    tokenizer = BertTokenizerFast(vocab=str(Path(tmp) / "vocab.txt"))
    retriever = Retriever(tiny_bert(len(tokenizer)), tiny_bert(len(tokenizer), 1), tokenizer,
                          RetrieverConfig(shared_encoder=False, pooling="mean"))
    q, p = make_batch(retriever, WORLD * 3, 1, seed=41)
    reference = SimpleContrastiveLoss(1, temperature=0.3)
    reference(retriever("query", **q), retriever("passage", **p)).backward()
    expected = grads([retriever])
    retriever.zero_grad(set_to_none=True)
    enable_gradient_checkpointing(retriever)
    retriever.train()
    ddp = DistributedDataParallel(Towers(retriever), find_unused_parameters=True)
    q_local = take_rows(dict(q, kind="query"), torch.arange(rank * 3, rank * 3 + 3))
    p_local = take_rows(dict(p, kind="passage"), torch.arange(rank * 6, rank * 6 + 6))
    GradCache([ddp, ddp], 2, DistributedContrastiveLoss(1, temperature=0.3))(q_local, p_local,
                                                                            no_sync_except_last=True)
    assert rel_err(grads([retriever]), expected) < 1e-5, rel_err(grads([retriever]), expected)


def worker(rank: int, tmp: str) -> None:
    """Every check runs on both ranks (one start of the ranks: starting them costs more than the checks)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    checks = {"gather": lambda: check_gather_leaves_other_consumers_alone(rank),
              "compiled DDP": lambda: check_compiled_ddp(rank),
              "global target": lambda: check_global_target(rank),
              "embeddings": lambda: check_embeddings_under_ddp(rank),
              "checkpointing": lambda: check_checkpointed_separate_towers(rank, tmp)}
    for name, check in checks.items():
        torch.manual_seed(rank)
        try:
            check()
        except Exception:
            Path(tmp, f"error-{name}-{rank}.txt").write_text(f"{name}:\n{traceback.format_exc()}")
        dist.barrier()


def test_two_ranks(tmp_path):
    write_vocab(tmp_path / "vocab.txt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(worker, (str(tmp_path),), WORLD)
    errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
    assert not errors, f"a check failed:\n{errors}"
