"""FSDP2 under two gloo processes: a Gradient Cache step on a LoRA decoder sharded over 2 ranks (batch 4 each) ends
with the weights of one process at batch 8, and a sharded checkpoint resumes to the uninterrupted result."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpr_gc import DistributedContrastiveLoss, Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.chunking import take_rows
from dpr_gc.base.errors import DprGcError
from dpr_gc.model.fsdp import full_state_dict, load_sharded, mixed_precision, save_sharded, shard_retriever
from tests.helpers import make_batch
from tests.ranks import rank_errors, run_ranks
from tests.llm_models import lora_decoder

WORLD, LOCAL = 2, 4


def join(rank: int, tmp: str, world: int = WORLD) -> None:
    """This process into a gloo group of ``world`` ranks meeting in ``tmp`` (a rendezvous file per group size)."""
    name = "rendezvous" if world == WORLD else f"rendezvous-{world}"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/{name}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))


def batches(retriever, steps: int):
    return [make_batch(retriever, WORLD * LOCAL, 1, seed=20 + s) for s in range(steps)]


def optimizer_for(retriever):
    return torch.optim.AdamW([p for p in retriever.parameters() if p.requires_grad], lr=1e-2)


def reference_weights(steps: int) -> dict:
    """One process, the global batch of 8 at once, ``steps`` AdamW steps."""
    torch.manual_seed(0)
    retriever = lora_decoder()
    optimizer, loss_fn = optimizer_for(retriever), SimpleContrastiveLoss(1)
    for q, p in batches(retriever, steps):
        optimizer.zero_grad()
        loss_fn(retriever("query", **q), retriever("passage", **p)).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in retriever.state_dict().items()}


def sharded_steps(rank: int, retriever, optimizer, data) -> None:
    loss_fn = DistributedContrastiveLoss(1)
    cache = GradCache([retriever, retriever], 3, loss_fn, chunking=Chunking(sort_by_length=True))
    for q, p in data:
        q_local = take_rows(dict(q, kind="query"), torch.arange(rank * LOCAL, (rank + 1) * LOCAL))
        p_local = take_rows(dict(p, kind="passage"), torch.arange(rank * 2 * LOCAL, (rank + 1) * 2 * LOCAL))
        optimizer.zero_grad()
        cache(q_local, p_local, no_sync_except_last=True)
        optimizer.step()


def compare(rank: int, retriever, expected: dict, what: str) -> None:
    full = full_state_dict(retriever)
    if rank == 0:
        trained = [k for k in expected if "lora_" in k or "tau" in k]
        for key in trained:
            got, want = full[key].float(), expected[key].float()
            err = float((got - want).norm() / want.norm().clamp(min=1e-12))
            assert err < 1e-4, f"{what}: {key} differs by {err:.2e}"
        assert len(trained) > 4


def worker(rank: int, tmp: str, expected_1: dict, expected_2: dict) -> None:
    join(rank, tmp)
    try:
        torch.manual_seed(0)
        retriever = shard_retriever(lora_decoder())
        optimizer = optimizer_for(retriever)
        data = batches(lora_decoder(), 2)
        sharded_steps(rank, retriever, optimizer, data[:1])
        compare(rank, retriever, expected_1, "one step")
        save_sharded(Path(tmp) / "ckpt", retriever, optimizer)
        sharded_steps(rank, retriever, optimizer, data[1:])
        compare(rank, retriever, expected_2, "uninterrupted")

        torch.manual_seed(0)
        resumed = shard_retriever(lora_decoder())
        resumed_optimizer = optimizer_for(resumed)
        load_sharded(Path(tmp) / "ckpt", resumed, resumed_optimizer)
        sharded_steps(rank, resumed, resumed_optimizer, data[1:])
        compare(rank, resumed, expected_2, "resumed")
        dist.barrier()  # neither rank tears its process group down while the other still uses it
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise  # the parent then stops the other rank at once, not at its collective's timeout


def one_rank_reader(rank: int, tmp: str, expected_1: dict) -> None:
    """Read the 2-rank sharded checkpoint into a model sharded over 1 rank: the weights after one step."""
    join(rank, tmp, 1)
    try:
        torch.manual_seed(0)
        retriever = shard_retriever(lora_decoder())
        load_sharded(Path(tmp) / "ckpt", retriever, optimizer_for(retriever))
        compare(rank, retriever, expected_1, "read back on 1 rank")
    except Exception:
        Path(tmp, f"error-reader-{rank}.txt").write_text(traceback.format_exc())
        raise  # the parent then stops the other rank at once, not at its collective's timeout


def test_fsdp_gradient_cache_step_equals_one_process_and_resumes(tmp_path):
    """2 ranks x 4 end where one process at batch 8 does, and resume from their sharded checkpoint, which also reads
    back at another world size (fsdp.py: any world size can read it); a folder that is not one is refused first."""
    expected_1, expected_2 = reference_weights(1), reference_weights(2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(worker, (str(tmp_path), expected_1, expected_2), WORLD)
    errors = rank_errors(tmp_path)
    assert not errors, errors
    run_ranks(one_rank_reader, (str(tmp_path), expected_1), 1)
    errors = rank_errors(tmp_path)
    assert not errors, errors
    with pytest.raises(DprGcError, match="not a sharded checkpoint \\(no .metadata\\)"):
        load_sharded(tmp_path, None, None)


def snapshot_worker(rank: int, tmp: str) -> None:
    """``full_state_dict`` kept from before a step, then the step: the kept weights are those from before (the
    replicated temperature was the live parameter on the CPU), while the step moved the temperature."""
    join(rank, tmp)
    try:
        torch.manual_seed(0)
        retriever = shard_retriever(lora_decoder())
        kept = full_state_dict(retriever)
        before = {k: v.clone() for k, v in kept.items()}
        sharded_steps(rank, retriever, optimizer_for(retriever), batches(lora_decoder(), 1))
        after = full_state_dict(retriever)
        if rank == 0:
            changed = [k for k in before if not torch.equal(kept[k], before[k])]
            assert not changed, f"the kept state dict changed with the step: {changed}"
            assert not torch.equal(after["tau.log_value"], before["tau.log_value"]), "the step left tau as it was"
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
    dist.barrier()  # rank 1 waits for rank 0's checks, failed or not


def test_fsdp_full_state_dict_is_a_snapshot(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(snapshot_worker, (str(tmp_path),), WORLD, limit_s=180)
    errors = rank_errors(tmp_path)
    assert not errors, errors


def sharded_model_and_local_batch(rank: int) -> tuple:
    """The seed-0 LoRA decoder sharded over the ranks, and this rank's rows of the first global batch."""
    torch.manual_seed(0)
    retriever = shard_retriever(lora_decoder())
    q, p = batches(lora_decoder(), 1)[0]
    q_local = take_rows(dict(q, kind="query"), torch.arange(rank * LOCAL, (rank + 1) * LOCAL))
    p_local = take_rows(dict(p, kind="passage"), torch.arange(rank * 2 * LOCAL, (rank + 1) * 2 * LOCAL))
    return retriever, q_local, p_local


def check_blocks_are_resharded_units(retriever, batch: dict) -> None:
    """fsdp.py: every transformer block is an FSDP unit, so one block's full weights exist at a time: after a
    forward each block holds its shard again (its parameters are DTensors, not the gathered weights)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from dpr_gc.model.fsdp import transformer_blocks

    blocks = transformer_blocks(retriever.query_encoder.transformer)
    assert blocks and all(isinstance(b, FSDPModule) for b in blocks), "a transformer block is not an FSDP unit"
    with torch.no_grad():
        retriever(**batch)
    gathered = [name for block in blocks for name, p in block.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered, f"blocks kept their full weights after the forward: {gathered[:3]}"


def reductions_worker(rank: int, tmp: str) -> None:
    """The gradient reductions (reduce-scatters, all-reduces) of one backward of plain training, then of a cached
    step with ``no_sync_except_last`` and without it, and with it under a memory budget that keeps graphs, written to
    ``reductions-RANK.txt``. First, each transformer block is a unit resharded after its forward."""
    join(rank, tmp)
    calls = []
    for name in ("reduce_scatter_single", "all_reduce"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    try:
        retriever, q_local, p_local = sharded_model_and_local_batch(rank)
        check_blocks_are_resharded_units(retriever, q_local)
        counts = []
        retriever(**q_local).float().sum().add(retriever(**p_local).float().sum()).backward()
        counts.append(calls.count("reduce_scatter_single"))
        for last_only, budget in ((True, 0), (False, 0), (True, 10**12)):
            calls.clear()
            cache = GradCache([retriever, retriever], 2, DistributedContrastiveLoss(1), memory_budget=budget)
            cache(q_local, p_local, no_sync_except_last=last_only)
            assert budget == 0 or sum(cache.last_step.kept) > 0, "no graph was kept"
            counts.append(calls.count("reduce_scatter_single"))
        Path(tmp, f"reductions-{rank}.txt").write_text(" ".join(map(str, counts)))
        dist.barrier()
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise  # the parent then stops the other rank at once, not at its collective's timeout


def test_fsdp_syncs_gradients_on_the_last_chunk_only(tmp_path):
    """docs/distributed.md: under FSDP the cached step reduce-scatters gradients in each model's last chunk's
    backward only (``set_requires_gradient_sync(False)`` for the others): the tied towers listed twice make two
    plain backwards' worth (exact, see ``cache_step``), where syncing every chunk makes one per chunk (6 here). Kept
    graphs (a memory budget) are backpropagated without sync too (``cache_step``): still two plain backwards'
    worth. (fsdp.py: every transformer block is an FSDP unit, resharded after its forward.)"""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(reductions_worker, (str(tmp_path),), WORLD)
    errors = rank_errors(tmp_path)
    assert not errors, errors
    for rank in range(WORLD):
        plain, last_only, every_chunk, kept = map(int, (tmp_path / f"reductions-{rank}.txt").read_text().split())
        assert plain > 0 and (last_only, every_chunk, kept) == (2 * plain, 6 * plain, 2 * plain), \
            (plain, last_only, every_chunk, kept)


CLIP_NORMS = (1e-3, 7.5e-4)  # far below the gradient's norm, then three quarters of the clipped one's


def clipping_worker(rank: int, tmp: str, expected_norms: list[float], expected: dict) -> None:
    """A cached step on 2 ranks, then ``fsdp.clip_grad_norm`` at each of ``CLIP_NORMS``: its norms and the clipped
    gradients (gathered) must be one process's ``torch.nn.utils.clip_grad_norm_`` over the global batch."""
    from dpr_gc.model.fsdp import clip_grad_norm

    join(rank, tmp)
    try:
        retriever, q_local, p_local = sharded_model_and_local_batch(rank)
        GradCache([retriever, retriever], 3, DistributedContrastiveLoss(1))(q_local, p_local, no_sync_except_last=True)
        trained = {n: t for n, t in retriever.named_parameters() if t.requires_grad}
        for max_norm, expected_norm in zip(CLIP_NORMS, expected_norms):
            norm = float(clip_grad_norm(list(trained.values()), max_norm))
            assert abs(norm - expected_norm) < 1e-4 * expected_norm, (max_norm, norm, expected_norm)
        for name, param in trained.items():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            err = float((grad - expected[name]).norm() / expected[name].norm().clamp(min=1e-12))
            assert err < 1e-4, f"{name}: clipped gradient differs by {err:.2e}"
        dist.barrier()
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise  # the parent then stops the other rank at once, not at its collective's timeout


def test_fsdp_gradient_clipping_is_one_processs(tmp_path):
    """docs/distributed.md: gradients are clipped over all shards, by the same rule as one process: by a factor far
    below 1, and by one just below it."""
    torch.manual_seed(0)
    retriever = lora_decoder()
    q, p = batches(retriever, 1)[0]
    SimpleContrastiveLoss(1)(retriever(kind="query", **q), retriever(kind="passage", **p)).backward()
    trained = {n: t for n, t in retriever.named_parameters() if t.requires_grad}
    norms = [float(torch.nn.utils.clip_grad_norm_(list(trained.values()), m)) for m in CLIP_NORMS]
    assert norms[0] > 10 * CLIP_NORMS[0] and CLIP_NORMS[1] < norms[1] < 2 * CLIP_NORMS[1]  # both clips scale
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(clipping_worker, (str(tmp_path), norms, {n: t.grad.clone() for n, t in trained.items()}), WORLD)
    errors = rank_errors(tmp_path)
    assert not errors, errors


def test_fsdp_settings_are_checked():
    assert mixed_precision("bf16").param_dtype == torch.bfloat16 and mixed_precision("bf16").reduce_dtype == torch.float32
    with pytest.raises(DprGcError, match="fp16"):
        mixed_precision("fp16")
    with pytest.raises(DprGcError, match="torchrun"):
        shard_retriever(lora_decoder())
