"""Sparse embedding gradients on the CPU: each chunk's backward adds only the rows its tokens touch into one dense
``.grad``; the gradient stays exactly the full batch's, and embeddings the step must not switch are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine import sparse_grads
from tests.helpers import grads, make_batch, models_of, reference_grads, rel_err, zero

CHUNK = 3
WHOLE_BATCH = 10**12


def embeddings_of(modules: list[nn.Module]) -> list[nn.Embedding]:
    return list({id(e): e for m in modules for e in m.modules() if isinstance(e, nn.Embedding)}.values())


def record_layouts(modules: list[nn.Module]) -> list[torch.layout]:
    """The layout of the gradient each embedding call sends to its weight (sparse from a call with ``sparse=True``),
    in call order. Not a hook on the weight: the step leaves an embedding whose weight has one dense."""
    layouts: list[torch.layout] = []
    for embedding in embeddings_of(modules):
        embedding.register_forward_pre_hook(
            lambda module, args: layouts.append(torch.sparse_coo if module.sparse else torch.strided))
    return layouts


@pytest.mark.parametrize("budget", [0, WHOLE_BATCH])
@pytest.mark.parametrize("shared", [True, False])
def test_cpu_chunks_add_embedding_gradients_sparsely_into_one_dense_grad(make_retriever, budget, shared):
    retriever = make_retriever(shared=shared)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 8, 1, seed=4)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    layouts = record_layouts(modules)
    GradCache(modules, CHUNK, loss_fn, memory_budget=budget, chunking=Chunking(sort_by_length=True))(q, p)
    assert layouts and set(layouts) == {torch.sparse_coo}
    for embedding in embeddings_of(modules):
        assert embedding.weight.grad.layout == torch.strided and not embedding.sparse
    assert rel_err(grads(modules), expected) < 1e-5


def test_gradients_already_there_are_added_to(make_retriever):
    """Two cached steps without zeroing accumulate, as two plain backwards do."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(0)
    q, p = make_batch(retriever, 6, 0, seed=5)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    gc = GradCache(modules, CHUNK, loss_fn)
    gc(q, p)
    gc(q, p)
    assert rel_err(grads(modules), 2 * expected) < 1e-5


def test_a_representation_the_loss_ignores_leaves_its_embeddings_without_a_grad(make_retriever):
    retriever = make_retriever(shared=False)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 6, 0, seed=6)
    GradCache(modules, CHUNK, lambda q_rep, p_rep: q_rep.square().sum())(q, p)
    assert all(e.weight.grad is not None for e in embeddings_of([modules[0]]))
    assert all(e.weight.grad is None for e in embeddings_of([modules[1]]))


def test_embeddings_the_step_must_not_switch_are_left_alone(make_retriever):
    """A user's own sparse embedding keeps its flag and sparse gradient; a frozen one gets none; a bf16 table (whose
    sparse sum would round differently) and one on a device not listed keep dense gradients."""
    retriever = make_retriever(shared=True)
    embeddings = retriever.query_encoder.transformer.embeddings
    embeddings.word_embeddings.sparse = True
    embeddings.token_type_embeddings.weight.requires_grad_(False)
    assert sparse_grads.switchable_embeddings(retriever.query_encoder) == [embeddings.position_embeddings]
    modules = models_of(retriever)
    q, p = make_batch(retriever, 6, 0, seed=7)
    GradCache(modules, CHUNK, SimpleContrastiveLoss(0))(q, p)
    assert embeddings.word_embeddings.sparse and embeddings.word_embeddings.weight.grad.is_sparse
    assert embeddings.token_type_embeddings.weight.grad is None
    assert not embeddings.position_embeddings.sparse and not embeddings.position_embeddings.weight.grad.is_sparse
    assert sparse_grads.switchable_embeddings(nn.Embedding(10, 4).to(torch.bfloat16)) == []


def test_no_switch_where_the_device_is_not_listed(make_retriever, monkeypatch):
    monkeypatch.setattr(sparse_grads, "SPARSE_EMBEDDING_GRAD_DEVICES", ())
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    layouts = record_layouts(modules)
    q, p = make_batch(retriever, 6, 0, seed=8)
    GradCache(modules, CHUNK, SimpleContrastiveLoss(0))(q, p)
    assert layouts and set(layouts) == {torch.strided}


def test_the_flags_come_back_when_a_step_fails(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 6, 0, seed=9)

    def failing_loss(q_rep: torch.Tensor, p_rep: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        GradCache(modules, CHUNK, failing_loss)(q, p)
    assert not any(e.sparse for e in embeddings_of(modules))


def test_an_embedding_with_a_gradient_hook_gets_dense_gradients():
    """A hook written for dense gradients (a clamp) would fail on a sparse one ("Could not run 'aten::clamp' with
    arguments from the 'SparseCPU' backend"): that embedding is not switched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(40, 4))
    layouts = []
    model[0].weight.register_hook(lambda g: layouts.append(g.layout) or g.clamp(-1e6, 1e6))
    model[0].weight.register_post_accumulate_grad_hook(lambda w: layouts.append(w.grad.layout))
    q, p = torch.randint(0, 50, (6, 5)), torch.randint(0, 50, (6, 5))
    SimpleContrastiveLoss()(model(q), model(p)).backward()
    expected = grads([model])
    zero([model])
    layouts.clear()
    GradCache([model, model], 2, SimpleContrastiveLoss())(q, p)
    assert layouts and set(layouts) == {torch.strided}
    assert rel_err(grads([model]), expected) < 1e-5


class WithASpareTable(nn.Module):
    """An encoder holding a table its forward never reads (an optional input's, say)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.spare, self.head = nn.Embedding(50, 8), nn.Embedding(50, 8), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.used(ids).mean(1))


def test_an_embedding_the_forward_never_calls_keeps_no_grad():
    """As in plain training: a zero ``.grad`` would let weight decay move a table the model never read."""
    model = WithASpareTable()
    q, p = torch.randint(0, 50, (6, 5)), torch.randint(0, 50, (6, 5))
    GradCache([model, model], 2, SimpleContrastiveLoss())(q, p)
    assert model.spare.weight.grad is None and model.used.weight.grad is not None
    assert not model.spare.sparse and not model.spare._forward_pre_hooks


def test_a_loss_that_calls_the_models_embedding_leaves_a_dense_grad(make_retriever):
    """library.md: ``.grad`` stays dense. A loss that scores queries against rows of the model's own embedding table
    runs its backward while the step's embeddings are sparse: that gradient is made dense before the chunks add
    theirs (it stayed sparse, and AdamW refused it)."""
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    table = retriever.query_encoder.transformer.embeddings.word_embeddings
    labels = torch.arange(4)
    contrastive = SimpleContrastiveLoss(0)

    def loss_fn(q_rep: torch.Tensor, p_rep: torch.Tensor) -> torch.Tensor:
        label_reps = table(labels)[:, : q_rep.size(1)]
        return contrastive(q_rep, p_rep) + (q_rep[:4] @ label_reps.T).logsumexp(1).mean()

    q, p = make_batch(retriever, 6, 0, seed=8)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    GradCache(modules, CHUNK, loss_fn)(q, p)
    assert table.weight.grad.layout == torch.strided and not table.sparse
    assert rel_err(grads(modules), expected) < 1e-5
    torch.optim.AdamW(retriever.parameters()).step()
