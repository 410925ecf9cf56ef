"""The contrastive loss is exact where users put it: under their own autocast (forward and backward stay fp32),
and with duplicate positives in a batch (a query's own positive is never one of its negatives)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from tests.helpers import grads, make_batch, models_of, rel_err, zero

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def loss_grads(loss_fn, x, y, autocast, dtype, device, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    xr, yr = x.clone().to(device).requires_grad_(), y.clone().to(device).requires_grad_()
    loss_fn.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        loss = loss_fn(xr, yr, **kwargs)
        loss.backward()  # inside the autocast, as GradCache calls it inside a user's step
    extra = [loss_fn.tau.log_value.grad.reshape(1)] if loss_fn.tau.log_value.requires_grad else []
    return loss.detach().cpu(), torch.cat([xr.grad.flatten(), yr.grad.flatten()] + extra).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block,symmetric", [(None, False), (3, True), (0, False), (0, True)])
def test_loss_backward_inside_an_autocast_is_fp32(device, dtype, block, symmetric):
    torch.manual_seed(0)
    x, y = torch.randn(12, 32) * 3, torch.randn(24, 32) * 3
    loss_fn = SimpleContrastiveLoss(1, temperature=0.05, learn_temperature=True, symmetric=symmetric,
                                    loss_chunk_size=block).to(device)
    ref_loss, ref = loss_grads(loss_fn, x, y, False, dtype, device)
    loss, got = loss_grads(loss_fn, x, y, True, dtype, device)
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert rel_err(got, ref) < 1e-5  # backward in bf16/fp16 was 2e-3 (dense) to 1e3 (blocked) away


@pytest.mark.parametrize("block,symmetric", [(None, False), (3, True), (0, False), (0, True)])
def test_float64_representations_keep_float64(block, symmetric):
    """fp16/bf16 are raised to fp32, float64 is kept (``dpr-gc verify`` re-measures in float64): the loss and
    every gradient, the temperature's included, equal a float64 reference written out by hand."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.01, learn_temperature=True, symmetric=symmetric,
                                    loss_chunk_size=block).double()
    loss, got = loss_grads(loss_fn, x, y, False, None, "cpu")
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    log_tau = torch.tensor(math.log(0.01), dtype=torch.float64, requires_grad=True)
    targets = torch.arange(6) * 2
    want = nn.functional.cross_entropy(xr @ yr.T / log_tau.exp(), targets)
    if symmetric:
        want = (want + nn.functional.cross_entropy(yr[targets] @ xr.T / log_tau.exp(), torch.arange(6))) / 2
    want.backward()
    ref = torch.cat([xr.grad.flatten(), yr.grad.flatten(), log_tau.grad.reshape(1)])
    assert loss.dtype == torch.float64 and got.dtype == torch.float64
    assert abs(float(loss - want.detach())) < 1e-12 * abs(float(want.detach())) and rel_err(got, ref) < 1e-12  # fp32 loss: 1e-8


def test_grad_cache_inside_a_users_autocast_equals_its_own_bf16(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1, temperature=0.05)
    q, p = make_batch(retriever, 32, 1, seed=3)
    zero(modules)
    GradCache(modules, 8, loss_fn)(q, p)
    fp32 = grads(modules)
    zero(modules)
    GradCache(modules, 8, loss_fn, bf16=True)(q, p)
    own_bf16 = grads(modules)
    zero(modules)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        GradCache(modules, 8, loss_fn)(q, p)
    outer = grads(modules)
    assert rel_err(outer, own_bf16) < 1e-6  # was 3e-2: the loss's backward ran in bf16
    assert rel_err(outer, fp32) < 1e-2


# ----------------------------------------------------------------- duplicate positives
def masked_reference(x, y, targets, ids, positive_ids, temperature, symmetric) -> torch.Tensor:
    """The masked loss written out densely: query i drops every column j != t_i holding one of its positives."""
    own = ids[targets][:, None]
    keys = own if positive_ids is None else torch.cat([own, positive_ids], 1)
    mask = ((ids[None, :, None] == keys[:, None, :]) & (keys[:, None, :] >= 0)).any(-1)
    mask[torch.arange(len(targets)), targets] = False
    loss = torch.nn.functional.cross_entropy((x @ y.T / temperature).masked_fill(mask, float("-inf")), targets)
    if symmetric:
        back = ((own[:, None, :] == keys[None, :, :]) & (own[:, None, :] >= 0)).any(-1)
        back.fill_diagonal_(False)
        scores = (y[targets] @ x.T / temperature).masked_fill(back, float("-inf"))
        loss = (loss + torch.nn.functional.cross_entropy(scores, torch.arange(len(targets)))) / 2
    return loss


# 6 queries, 1 hard negative each: queries 0, 2 and 4 share their positive (id 10); query 1's hard negative is query
# 3's positive (id 13), which query 1 also counts as a positive; query 5's hard negative repeats its own positive.
IDS = torch.tensor([10, 11, 12, 13, 10, 14, 13, 15, 10, 16, 17, 17])
POSITIVE_IDS = torch.tensor([[-1], [13], [-1], [-1], [-1], [-1]])


@pytest.mark.parametrize("block", [None, 1, 4, 0])
@pytest.mark.parametrize("symmetric,with_positives", [(False, False), (True, True), (False, True)])
def test_masked_loss_and_gradients_equal_the_dense_reference(block, symmetric, with_positives):
    torch.manual_seed(2)
    x, y = torch.randn(6, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64)
    positive_ids = POSITIVE_IDS if with_positives else None
    targets = torch.arange(6) * 2
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    expected = masked_reference(xr, yr, targets, IDS, positive_ids, 0.5, symmetric)
    expected.backward()
    loss_fn = SimpleContrastiveLoss(1, temperature=0.5, symmetric=symmetric, loss_chunk_size=block)
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss = loss_fn(xg, yg, passage_ids=IDS, positive_ids=positive_ids)
    loss.backward()
    assert torch.allclose(loss.double(), expected.double(), rtol=1e-6)
    assert rel_err(xg.grad, xr.grad) < 1e-6 and rel_err(yg.grad, yr.grad) < 1e-6
    # query 0: ids 10 at columns 4 and 8; query 2: columns 0 and 8; query 4: 0 and 4; query 1: 13 at 3 and 6;
    # query 3: 13 at column 3; query 5: 17 at column 11.
    assert loss_fn.masked_scores == 2 + 2 + 2 + (2 if with_positives else 0) + 1 + 1
    unmasked = SimpleContrastiveLoss(1, temperature=0.5, symmetric=symmetric, loss_chunk_size=block)(x, y)
    assert float(unmasked) > float(loss.detach())


@pytest.mark.parametrize("block", [None, 0, 3])
def test_eight_questions_with_one_positive_have_zero_loss(block):
    """With every copy of its positive masked, a query scores one passage: its loss is exactly 0 on every path (the
    target's score is read from the same product as the log-sum-exp, not recomputed in another summation order)."""
    torch.manual_seed(0)
    x, passage = torch.randn(8, 16), torch.randn(1, 16)
    y = passage.expand(8, 16)  # the same passage eight times
    loss_fn = SimpleContrastiveLoss(0, temperature=0.05, loss_chunk_size=block)
    assert abs(float(loss_fn(x, y)) - torch.log(torch.tensor(8.0)).item()) < 1e-4  # unmasked: log 8
    assert torch.equal(loss_fn(x, y, passage_ids=torch.full((8,), 3), reduction="none"), torch.zeros(8))
    assert loss_fn.masked_scores == 8 * 7


@pytest.mark.parametrize("block", [None, 5])
def test_blocked_per_query_losses_are_never_negative_and_match_the_dense_path(block):
    """A query far closer to its positive than to any other passage has a loss of about 0, never below: the
    blocked loss agrees with cross-entropy over the dense score matrix row by row."""
    torch.manual_seed(0)
    x = 3 * torch.randn(64, 48)
    y = x + 0.01 * torch.randn(64, 48)
    blocked = SimpleContrastiveLoss(0, temperature=0.05, loss_chunk_size=block)(x, y, reduction="none")
    dense = SimpleContrastiveLoss(0, temperature=0.05, loss_chunk_size=0)(x, y, reduction="none")
    assert bool((blocked >= 0).all()), blocked.min()
    assert torch.allclose(blocked, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_masked_cached_step_equals_the_full_batch(make_retriever, keep_last_graph):
    retriever = make_retriever(shared=False)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 6, 1, seed=5)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2, symmetric=True)
    zero(modules)
    x, y = modules[0](**q), modules[1](**p)
    masked_reference(x, y, torch.arange(6) * 2, IDS, POSITIVE_IDS, 0.2, True).backward()
    expected = grads(modules)
    zero(modules)
    GradCache(modules, 4, loss_fn, chunking=Chunking(keep_last_graph=keep_last_graph))(q, p, passage_ids=IDS,
                                                                                       positive_ids=POSITIVE_IDS)
    assert rel_err(grads(modules), expected) < 1e-5


def test_bad_ids_are_refused():
    loss_fn = SimpleContrastiveLoss(0)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(DprGcError, match="one integer id per passage row"):
        loss_fn(x, y, passage_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(DprGcError, match="positive_ids needs passage_ids"):
        loss_fn(x, y, positive_ids=torch.tensor([[1], [2]]))
    with pytest.raises(DprGcError, match="positive_ids must be integer ids"):
        loss_fn(x, y, passage_ids=torch.tensor([1, 2]), positive_ids=torch.tensor([1, 2]))


def distributed_worker(rank: int, tmp: str) -> None:
    """Rank ``rank`` of 2 holds 3 of the 6 queries of the tests above: the masked distributed loss gives every rank
    the gradient of the global masked loss (the duplicates of id 10 and 13 sit on both ranks)."""
    import traceback
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from dpr_gc import DistributedContrastiveLoss

    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        torch.manual_seed(2)
        x, y = torch.randn(6, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64)
        for block, symmetric in ((None, True), (1, False), (0, True)):
            xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
            expected = masked_reference(xr, yr, torch.arange(6) * 2, IDS, POSITIVE_IDS, 0.5, symmetric)
            expected.backward()
            loss_fn = DistributedContrastiveLoss(1, temperature=0.5, symmetric=symmetric, loss_chunk_size=block)
            q_rows, p_rows = slice(3 * rank, 3 * rank + 3), slice(6 * rank, 6 * rank + 6)
            xl, yl = x[q_rows].clone().requires_grad_(), y[p_rows].clone().requires_grad_()
            positive_ids = POSITIVE_IDS[q_rows, :1] if rank else POSITIVE_IDS[q_rows]  # widths may differ by rank
            loss = loss_fn(xl, yl, passage_ids=IDS[p_rows], positive_ids=positive_ids)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            assert abs(float(total) / 2 - float(expected)) < 1e-5 * abs(float(expected)), (float(total), float(expected))
            assert rel_err(xl.grad / 2, xr.grad[q_rows]) < 1e-5 and rel_err(yl.grad / 2, yr.grad[p_rows]) < 1e-5
            masked = torch.tensor(loss_fn.masked_scores)
            dist.all_reduce(masked)
            assert int(masked) == 10
            keyed = torch.stack([torch.full_like(IDS[p_rows], -1), IDS[p_rows]], dim=1)  # [N, K] ids gather alike
            assert torch.equal(loss_fn(xl, yl, passage_ids=keyed, positive_ids=positive_ids), loss.detach())
        dist.barrier()
    except Exception:
        Path(tmp, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.slow  # 23 s in a full run under load 7-10 on 2 cores (2026-11-24)
def test_distributed_loss_masks_duplicates_across_ranks(tmp_path, monkeypatch):
    from tests.ranks import rank_errors, run_ranks

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        run_ranks(distributed_worker, (str(tmp_path),), 2, limit_s=180)
    except Exception:
        pytest.fail(f"a rank failed:\n{rank_errors(tmp_path)}")


def test_the_automatic_loss_blocks_hold_at_most_a_million_scores():
    """With ``loss_chunk_size=None`` no product of the loss, forward or backward, holds more than 2**20 values
    (the README's "row blocks of at most about a million scores"), while the dense path builds the whole matrix."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                self.most = max(self.most, out.numel())
            return out

    x = torch.randn(1100, 8, requires_grad=True)
    y = torch.randn(2200, 8, requires_grad=True)
    for block, bound in ((None, 2 ** 20), (0, 1100 * 2200)):
        with Largest() as seen:
            SimpleContrastiveLoss(1, temperature=0.05, loss_chunk_size=block)(x, y).backward()
        assert seen.most <= bound and (block is None or seen.most == bound), (block, seen.most)


@pytest.mark.parametrize("block", [None, 0, 3])
def test_passage_id_minus_one_is_unknown_and_never_masked(block):
    """``passage_ids`` of -1 mean "unknown": passages all marked -1 share no id, so nothing is masked and the loss
    is the unmasked one; the same rows with one real id in common are masked."""
    torch.manual_seed(3)
    x, y = torch.randn(6, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.5, loss_chunk_size=block)
    unknown = loss_fn(x, y, passage_ids=torch.full((12,), -1))
    assert loss_fn.masked_scores == 0
    torch.testing.assert_close(unknown, SimpleContrastiveLoss(1, temperature=0.5, loss_chunk_size=block)(x, y))
    shared = torch.full((12,), -1)
    shared[[0, 2]] = 7  # queries 0 and 1 share their positive
    loss_fn(x, y, passage_ids=shared)
    assert loss_fn.masked_scores == 2


@pytest.mark.parametrize("block,symmetric", [(None, False), (0, True), (1, True)])
def test_passage_ids_with_several_keys_per_row_mask_on_any_key(block, symmetric):
    """``passage_ids`` of ``[N, K]``: two rows hold the same passage when any key is equal (a copy keyed by its text
    alone is the passage keyed by id and text), masked as one id per row masks them; -1 is no key."""
    torch.manual_seed(4)
    x, y = torch.randn(2, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.5, symmetric=symmetric, loss_chunk_size=block)
    keyed = loss_fn(x, y, passage_ids=torch.tensor([[10, 20], [11, 21], [12, 22], [-1, 20]]))
    assert loss_fn.masked_scores == 1  # query 0 drops row 3
    one_id = loss_fn(x, y, passage_ids=torch.tensor([10, 11, 12, 10]))
    torch.testing.assert_close(keyed, one_id)
    loss_fn(x, y, passage_ids=torch.tensor([[10, -1], [11, -1], [12, -1], [-1, 20]]))
    assert loss_fn.masked_scores == 0
    with pytest.raises(DprGcError, match="one integer id per passage row"):
        loss_fn(x, y, passage_ids=torch.zeros(5, 2, dtype=torch.long))


def test_blocked_cross_entropy_is_fp32_forward_and_backward_under_an_outer_autocast():
    """``blocked_cross_entropy``'s docstring: fp32 forward and backward whatever autocast is active (called
    directly, not only through SimpleContrastiveLoss, which switches autocast off itself)."""
    from dpr_gc.engine.loss import blocked_cross_entropy

    torch.manual_seed(5)
    x, y = torch.randn(12, 64) * 3, torch.randn(24, 64) * 3
    targets, scale = torch.arange(12) * 2, torch.tensor(20.0)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    expected = blocked_cross_entropy(xr, yr, scale, targets, 5)
    expected.sum().backward()
    xa, ya = x.clone().requires_grad_(), y.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = blocked_cross_entropy(xa, ya, scale, targets, 5)
        got.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("block", [0, 2])
def test_a_target_of_any_integer_dtype_gives_the_int64_targets_loss(dtype, block):
    """The docstring's ``target`` (integer ``[B]``): any integer dtype is the passage index it holds (int32 failed on
    the dense path, int16 and uint8 on the blocked one, with torch's own errors)."""
    torch.manual_seed(3)
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    target = torch.tensor([1, 0, 7, 5])
    loss = SimpleContrastiveLoss(loss_chunk_size=block)
    assert torch.equal(loss(x, y, target=target.to(dtype)), loss(x, y, target=target))


@pytest.mark.parametrize("block", [None, 0, 2])
def test_a_zero_passage_row_under_symmetric_cosine_has_the_single_normalisation_gradient(block):
    """Symmetric cosine normalises each representation once: a zero (all-padding) positive row's gradient is that of
    one ``F.normalize``, as in the query→passage direction, not of a normalisation applied twice."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 8), torch.randn(6, 8)
    y[2] = 0.0  # the second query's positive
    loss_fn = SimpleContrastiveLoss(1, temperature=0.1, similarity="cos", symmetric=True, loss_chunk_size=block)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss_fn(xr, yr).backward()
    xa, ya = x.clone().requires_grad_(), y.clone().requires_grad_()
    qn, pn = nn.functional.normalize(xa, dim=-1), nn.functional.normalize(ya, dim=-1)
    targets = torch.arange(3) * 2
    scores = qn @ pn.T / 0.1
    want = (nn.functional.cross_entropy(scores, targets) + nn.functional.cross_entropy(scores[:, targets].T,
                                                                                      torch.arange(3))) / 2
    want.backward()
    assert rel_err(yr.grad, ya.grad) < 1e-5 and rel_err(xr.grad, xa.grad) < 1e-5
