"""Gradient Cache on a CUDA device: the same exactness as on the CPU, dropout replayed from the CUDA generator,
fp16 with a CUDA GradScaler, bf16, and peak memory that follows the chunk. Skipped without a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BertConfig, BertModel

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.grad_cache import split_input, trim_padding
from dpr_gc.model.retriever import Retriever, RetrieverConfig, enable_gradient_checkpointing
from tests.helpers import MeanOfEmbeddings, grads, make_batch, models_of, rel_err, uneven_batch, zero

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_matmuls():
    """TF32 would make the full-batch reference and the chunked step round differently."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_cuda(retriever, n_queries: int, n_hard: int, seed: int):
    retriever = retriever.cuda()
    q, p = make_batch(retriever, n_queries, n_hard, seed=seed)
    return retriever, {k: v.cuda() for k, v in q.items()}, {k: v.cuda() for k, v in p.items()}


@pytest.mark.parametrize("shared,n_hard,keep_last_graph", [(True, 0, True), (False, 2, True), (True, 1, False)])
def test_cached_step_equals_full_batch_on_cuda(make_retriever, shared, n_hard, keep_last_graph):
    retriever, q, p = on_cuda(make_retriever(shared=shared), 12, n_hard, seed=1)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(n_hard, temperature=0.1, learn_temperature=True).cuda()
    zero(modules + [loss_fn])
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected, expected_t = grads(modules), loss_fn.tau.log_value.grad.clone()
    zero(modules + [loss_fn])
    GradCache(modules, 5, loss_fn, chunking=Chunking(keep_last_graph=keep_last_graph))(q, p)
    assert rel_err(grads(modules), expected) < 1e-5
    assert rel_err(loss_fn.tau.log_value.grad, expected_t) < 1e-5


@pytest.mark.parametrize("budget", [0, 10**12])
def test_later_steps_equal_the_full_batch_on_cuda(make_retriever, budget):
    """From the second step on the kept last chunk runs without the graph meter (and, at a budget, chunks are
    joined): each step's gradient is still the full batch's."""
    retriever, q, p = on_cuda(make_retriever(shared=True), 12, 1, seed=2)
    modules, loss_fn = models_of(retriever), SimpleContrastiveLoss(1)
    zero(modules)
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected = grads(modules)
    engine = GradCache(modules, 3, loss_fn, memory_budget=budget)
    for _ in range(3):
        zero(modules)
        engine(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
    assert engine.last_step.estimated_last == 1


def test_dropout_is_replayed_from_the_cuda_generator(make_retriever):
    retriever, q, p = on_cuda(make_retriever(shared=False, dropout=0.2), 8, 1, seed=2)
    retriever.train()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    chunk = 3
    torch.cuda.manual_seed(7)
    reps = [torch.cat([m(**trim_padding(c)) for c in split_input(x, chunk)]) for m, x in zip(modules, (q, p))]
    zero(modules)
    loss_fn(*reps).backward()
    expected = grads(modules)
    zero(modules)
    torch.cuda.manual_seed(7)
    GradCache(modules, chunk, loss_fn)(q, p)
    assert rel_err(grads(modules), expected) < 1e-5
    zero(modules)
    torch.cuda.manual_seed(8)
    GradCache(modules, chunk, loss_fn)(q, p)
    assert rel_err(grads(modules), expected) > 1e-3, "another dropout draw must give another gradient"


def test_gradient_checkpointing_on_cuda(make_retriever):
    retriever, q, p = on_cuda(make_retriever(shared=True), 8, 1, seed=3)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    zero(modules)
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected = grads(modules)
    enable_gradient_checkpointing(retriever)
    retriever.train()
    zero(modules)
    GradCache(modules, 3, loss_fn)(q, p)
    assert rel_err(grads(modules), expected) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_steps_on_cuda(make_retriever, precision):
    retriever, q, p = on_cuda(make_retriever(shared=True), 8, 1, seed=4)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.05)
    zero(modules)
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected = grads(modules)
    zero(modules)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if precision == "fp16" else None
    loss = GradCache(modules, 3, loss_fn, fp16=precision == "fp16", bf16=precision == "bf16", scaler=scaler)(q, p)
    got = grads(modules) / (scaler.get_scale() if scaler else 1.0)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.isfinite(got).all()
    assert rel_err(got, expected) < 0.1


def peak_step_bytes(retriever, n_queries: int, chunk: int) -> int:
    retriever, q, p = on_cuda(retriever, n_queries, 1, seed=5)
    modules = models_of(retriever)
    gc = GradCache(modules, chunk, SimpleContrastiveLoss(1))
    zero(modules)
    gc(q, p)
    zero(modules)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    gc(q, p)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def wide_retriever(tokenizer) -> Retriever:
    """Wide enough that a chunk's graph, not the batch's representations, sets the peak (as in real models)."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128)
    return Retriever(BertModel(config), None, tokenizer, RetrieverConfig(shared_encoder=True, pooling="mean"))


def test_peak_memory_follows_the_chunk_not_the_batch(tiny_tokenizer):
    small = peak_step_bytes(wide_retriever(tiny_tokenizer), 16, 4)
    large = peak_step_bytes(wide_retriever(tiny_tokenizer), 256, 4)
    assert large < 1.3 * small, (small, large)


def peak_bytes(step) -> int:
    """Peak CUDA memory of ``step()`` above what was allocated before it (after one warm-up call)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_budget_for_the_whole_batch_costs_no_more_than_plain_training(tiny_tokenizer, precision):
    """Keeping every chunk's graph is plain training in chunks: one backward over all kept graphs frees each as it
    goes, and under bf16 the chunks share autocast's weight copies, so the peak is plain training's (+10%)."""
    retriever, q, p = on_cuda(wide_retriever(tiny_tokenizer), 64, 1, seed=6)
    modules, loss_fn, bf16 = models_of(retriever), SimpleContrastiveLoss(1), precision == "bf16"

    def plain() -> None:
        zero(modules)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            reps = modules[0](**q), modules[1](**p)
        loss_fn(*reps).backward()

    engine = GradCache(modules, 4, loss_fn, bf16=bf16, memory_budget=10**12)

    def kept() -> None:
        zero(modules)
        engine(q, p)

    plain_peak, kept_peak = peak_bytes(plain), peak_bytes(kept)
    assert sum(engine.last_step.kept) == sum(engine.last_step.chunks)
    assert kept_peak <= 1.1 * plain_peak, (plain_peak, kept_peak)


def host_syncs(chunk: int, sort_by_length: bool) -> int:
    """Synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode``) in one cached step of 32 queries and 64
    passages of uneven lengths."""
    torch.manual_seed(0)
    model = MeanOfEmbeddings().cuda()
    q, p = uneven_batch("cuda")
    engine = GradCache([model, model], chunk, SimpleContrastiveLoss(1),
                       chunking=Chunking(sort_by_length=sort_by_length, trim=True))
    engine(q, p)  # the first step measures graphs; count a later one
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine(q, p)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own note on turning the mode on (once per process) also speaks of "synchronizing operations"
    return sum("called a synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize("sort_by_length", [False, True])
def test_host_syncs_do_not_grow_with_the_number_of_chunks(sort_by_length):
    """Each sync makes the host wait for every queued kernel, so one per chunk would serialise a launch-bound
    step: a step in chunks of one row (96 chunks) syncs as often as one in chunks of 16 rows (6 chunks)."""
    assert host_syncs(1, sort_by_length) == host_syncs(16, sort_by_length)


def test_auto_chunk_size_probes_the_gpu_up_to_the_whole_batch(make_retriever):
    """``--passage-chunk-size auto``'s probe on a real GPU: a tiny model fits any batch, small ones included, and the
    probe leaves no gradient behind."""
    from dpr_gc.train.chunks import auto_chunk_size

    retriever = make_retriever(shared=True, passage_max_length=32).cuda().train()
    cuda = torch.device("cuda")
    assert [auto_chunk_size(retriever, retriever, cuda, rows, "bf16") for rows in (6, 100)] == [6, 100]
    assert all(p.grad is None for p in retriever.parameters())
