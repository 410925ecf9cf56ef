"""Gradient Cache engine: parameter gradients after a cached step equal those of one full-batch pass."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from dpr_gc.engine.functional import cat_input_tensor, cached
from dpr_gc.engine.chunking import chunk_widths, trimmed_width
from dpr_gc.engine.grad_cache import split_input, trim_padding
from dpr_gc.model.retriever import enable_gradient_checkpointing
from tests.helpers import (MeanOfEmbeddings, grads, make_batch, models_of, reference_grads, rel_err,
                           uneven_batch, zero)
from tests.llm_models import lora_decoder


CASES = [
    # shared, n_hard, chunk, similarity, learn_temperature, loss_chunk_size
    (True, 0, 4, "dot", False, None),
    (True, 2, 3, "dot", False, None),
    (False, 0, 3, "cos", False, None),
    (False, 1, 4, "dot", True, None),
    (True, 1, 5, "cos", True, 0),
    (True, 3, 2, "dot", False, 3),
    (False, 2, 8, "cos", False, 1),
    (True, 1, 3, "dot", True, 2),
]


@pytest.mark.parametrize("shared,n_hard,chunk,similarity,learn_t,loss_chunk", CASES)
@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_cached_step_equals_full_batch(make_retriever, shared, n_hard, chunk, similarity, learn_t, loss_chunk, keep_last_graph):
    retriever = make_retriever(shared=shared)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(n_hard, temperature=0.2, learn_temperature=learn_t, similarity=similarity,
                                    loss_chunk_size=loss_chunk)
    q, p = make_batch(retriever, 8, n_hard)
    ref_loss = loss_fn(modules[0](**q), modules[1](**p)).detach()
    expected = reference_grads(modules, loss_fn, q, p)
    expected_t = loss_fn.tau.log_value.grad.clone() if learn_t else None
    zero(modules + [loss_fn])

    gc = GradCache(modules, chunk, loss_fn, chunking=Chunking(keep_last_graph=keep_last_graph))
    loss = gc(q, p)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert not loss.requires_grad
    assert rel_err(grads(modules), expected) < 1e-5
    if learn_t:
        assert torch.allclose(loss_fn.tau.log_value.grad, expected_t, rtol=1e-4, atol=1e-7)


def test_separate_chunk_sizes_sorting_and_symmetric_loss(make_retriever):
    retriever = make_retriever(shared=False)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, symmetric=True, temperature=0.5)
    q, p = make_batch(retriever, 10, 1, seed=3)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    GradCache(modules, [3, 7], loss_fn, chunking=Chunking(sort_by_length=True))(q, p)
    assert rel_err(grads(modules), expected) < 1e-5


def test_temperature_inside_the_model_is_trained_exactly(make_retriever):
    """The trainer's path: one module for both towers, a learnable temperature applied in its forward."""
    retriever = make_retriever(shared=True, learn_temperature=True, temperature=0.1)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 6, 1, seed=4)
    q_in, p_in = dict(q, kind="query"), dict(p, kind="passage")
    retriever.zero_grad()
    loss_fn(retriever(**q_in), retriever(**p_in)).backward()
    expected = grads([retriever])
    assert retriever.tau.log_value.grad is not None and retriever.tau.log_value.grad.abs() > 0
    retriever.zero_grad()
    GradCache([retriever, retriever], 4, loss_fn)(q_in, p_in)
    assert rel_err(grads([retriever]), expected) < 1e-5


def test_dropout_is_replayed(make_retriever):
    retriever = make_retriever(shared=False, dropout=0.2)
    retriever.train()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=5)
    chunk = 3

    torch.manual_seed(123)
    reps = [torch.cat([m(**trim_padding(c)) for c in split_input(x, chunk)]) for m, x in zip(modules, (q, p))]
    zero(modules)
    loss_fn(*reps).backward()
    expected = grads(modules)

    for keep in (True, False):
        zero(modules)
        torch.manual_seed(123)
        GradCache(modules, chunk, loss_fn, chunking=Chunking(keep_last_graph=keep))(q, p)
        assert rel_err(grads(modules), expected) < 1e-5

    zero(modules)
    torch.manual_seed(999)
    GradCache(modules, chunk, loss_fn)(q, p)
    assert rel_err(grads(modules), expected) > 1e-3, "a different dropout mask must give a different gradient"


def test_gradient_checkpointing_composes(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 6, 1, seed=6)
    expected = reference_grads(modules, loss_fn, q, p)
    enable_gradient_checkpointing(retriever)
    model = retriever.query_encoder.transformer
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing  # transformers 5 / 4
    retriever.train()
    zero(modules)
    GradCache(modules, 4, loss_fn)(q, p)
    assert rel_err(grads(modules), expected) < 1e-5


def test_bf16_close_to_fp32_and_finite(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, learn_temperature=True, temperature=0.05)
    q, p = make_batch(retriever, 8, 1, seed=7)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules + [loss_fn])
    loss = GradCache(modules, 3, loss_fn, bf16=True)(q, p)
    got = grads(modules)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.isfinite(got).all()
    assert rel_err(got, expected) < 0.1


def test_fp16_with_grad_scaler(make_retriever):
    retriever = make_retriever(shared=True)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=8)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    GradCache(modules, 3, loss_fn, fp16=True, scaler=scaler)(q, p)
    got = grads(modules) / scaler.get_scale()
    assert torch.isfinite(got).all()
    assert rel_err(got, expected) < 0.1


def test_plain_tensor_inputs_and_get_rep_fn():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    x, y = torch.randn(6, 5), torch.randn(12, 5)
    loss_fn = SimpleContrastiveLoss(1)
    loss_fn(net(x), net(y)).backward()
    expected = grads([net])
    net.zero_grad()
    GradCache([net, net], [4, 5], loss_fn, get_rep_fn=lambda out: out * 2 / 2)(x, y)
    assert rel_err(grads([net]), expected) < 1e-5


def test_representation_views_do_not_keep_chunk_outputs_alive():
    """A get_rep_fn that returns a view (the [CLS] row) must not keep each chunk's whole output until the loss."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    net = torch.nn.Linear(5, 4)
    outputs: list[StorageWeakRef] = []
    seen_alive: list[int] = []

    def first_row(out: torch.Tensor) -> torch.Tensor:
        outputs.append(StorageWeakRef(out.untyped_storage()))
        return out[:, 0]

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen_alive.append(sum(not ref.expired() for ref in outputs))
        outputs.clear()
        return SimpleContrastiveLoss(0)(x, y)

    x, y = torch.randn(12, 3, 5), torch.randn(12, 3, 5)
    GradCache([net, net], 4, loss_fn, get_rep_fn=first_row, chunking=Chunking(keep_last_graph=False))(x, y)
    assert seen_alive == [0]
    net.zero_grad()
    GradCache([net, net], 4, loss_fn, get_rep_fn=first_row, chunking=Chunking(sort_by_length=True))(x, y)
    assert seen_alive[1] <= 1  # only the kept last chunk's output, whose graph is reused


def test_functional_decorators_match_the_class(make_retriever):
    retriever = make_retriever(shared=False, dropout=0.1)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=9)
    torch.manual_seed(7)
    GradCache(modules, 4, loss_fn, chunking=Chunking(keep_last_graph=False, trim=False))(q, p)
    expected = grads(modules)
    zero(modules)

    @cached
    def encode(model, input_ids, attention_mask, token_type_ids):
        return model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)

    @cat_input_tensor
    def contrastive(x, y=None):
        return loss_fn(x, y)

    torch.manual_seed(7)
    q_cache = [encode(modules[0], **c) for c in split_input(q, 4)]
    p_cache = [encode(modules[1], **c) for c in split_input(p, 4)]
    contrastive([r for r, _ in q_cache], y=[r for r, _ in p_cache]).backward()
    for rep, closure in q_cache + p_cache:
        closure(rep)
    assert rel_err(grads(modules), expected) < 1e-5


def test_cached_refuses_a_model_it_cannot_replay_by_keyword_too_and_needs_the_backward_first():
    """``cached``'s docstring: every parameter and buffer of a model passed in, positionally or by keyword, counts
    for the RNG devices (a device whose RNG cannot be replayed is refused); the closure needs the loss's backward."""
    meta = torch.nn.Linear(2, 2, device="meta")

    @cached
    def encode(model, x):
        return model(x)

    for call in (lambda: encode(meta, torch.zeros(1, 2)), lambda: encode(model=meta, x=torch.zeros(1, 2))):
        with pytest.raises(DprGcError, match="replays random state .* on CPU and CUDA only"):
            call()
    buffered = torch.nn.BatchNorm1d(2).to("meta").requires_grad_(False)
    with pytest.raises(DprGcError, match="meta"):
        encode(model=buffered, x=torch.zeros(3, 2))
    rep, closure = encode(torch.nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="run the loss's backward first"):
        closure(rep)


def test_cached_takes_a_model_call_returning_several_representations():
    """``cached`` as the original: a call returning a tuple gives ``(*leaves, closure)``, the closure takes the tuple
    of leaves (a leaf the loss did not use adds nothing), and the gradient is the whole batch's; a call returning
    something else is refused."""
    torch.manual_seed(0)
    tower = torch.nn.Linear(8, 4)
    head = torch.nn.Linear(4, 4)

    @cached
    def encode(x):
        rep = tower(x)
        return rep, head(rep), head(rep) * 0  # the last one is left out of the loss

    def loss(a, b):
        return SimpleContrastiveLoss()(a, b)

    x = torch.randn(6, 8)
    loss(*encode.__wrapped__(x)[:2]).backward()
    expected = [p.grad.clone() for p in (*tower.parameters(), *head.parameters())]
    tower.zero_grad()
    head.zero_grad()
    chunks = [encode(c) for c in x.split(2)]
    assert all(len(entry) == 4 for entry in chunks)
    cat_input_tensor(loss)([c[0] for c in chunks], [c[1] for c in chunks]).backward()
    for *leaves, closure in chunks:
        closure(tuple(leaves))
    got = [p.grad for p in (*tower.parameters(), *head.parameters())]
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, expected))
    with pytest.raises(DprGcError, match="3 cached representation"):
        chunks[0][-1](chunks[0][0])
    with pytest.raises(DprGcError, match="must return a tensor or a tuple of tensors, got dict"):
        cached(lambda x: {"rep": x})(x)


def test_clear_errors(make_retriever):
    retriever = make_retriever()
    modules = models_of(retriever)
    with pytest.raises(DprGcError, match="chunk size"):
        GradCache(modules, 0, SimpleContrastiveLoss())
    with pytest.raises(DprGcError, match="chunk size"):
        GradCache(modules, [4, -1], SimpleContrastiveLoss())
    for size in (16.0, torch.tensor(16), [4, 2.0], [4, True]):
        with pytest.raises(DprGcError, match=r"chunk(_| )size"):
            GradCache(modules, size, SimpleContrastiveLoss())
    q, p = make_batch(retriever, 4, 0)
    with pytest.raises(DprGcError, match="need 8 passages"):
        GradCache(modules, 2, SimpleContrastiveLoss(n_hard_negatives=1))(q, p)
    with pytest.raises(DprGcError, match="not a tensor"):
        GradCache(modules, 2, SimpleContrastiveLoss(), get_rep_fn=lambda out: {"rep": out})(q, p)
    with pytest.raises(DprGcError, match="DistributedDataParallel"):
        GradCache(modules, 2, SimpleContrastiveLoss())(q, p, no_sync_except_last=True)
    with pytest.raises(DprGcError, match="GradScaler"):
        GradCache(modules, 2, SimpleContrastiveLoss(), fp16=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_float_or_bool_attention_mask_is_chunked_sorted_and_trimmed_as_an_integer_one(make_retriever, dtype):
    """Hugging Face models take float masks; their lengths were float slice bounds ("slice indices must be
    integers")."""
    retriever = make_retriever()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1)
    q, p = ({k: v.to(dtype) if k == "attention_mask" else v for k, v in batch.items()} for batch in (q, p))
    expected = reference_grads(modules, loss_fn, q, p)
    for chunking in (Chunking(), Chunking(sort_by_length=True, tokens=40)):
        zero(modules)
        GradCache(modules, 3, loss_fn, chunking=chunking)(q, p)
        assert rel_err(grads(modules), expected) < 1e-5


def test_trim_padding_cuts_padding_columns_only():
    batch = {"input_ids": torch.tensor([[5, 6, 0, 0], [5, 0, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])}
    trimmed = trim_padding(batch)
    assert trimmed["input_ids"].shape == (2, 2)
    full = {"input_ids": torch.tensor([[4, 5, 6]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    assert trim_padding(full) is full


def test_exact_in_float64_with_sdpa_attention(tiny_tokenizer):
    """In float64 the cached gradient equals the full-batch one to rounding, whatever the attention kernel."""
    from dpr_gc.model.retriever import Retriever, RetrieverConfig
    from tests.helpers import tiny_bert

    retriever = Retriever(tiny_bert(len(tiny_tokenizer), attn="sdpa"), tiny_bert(len(tiny_tokenizer), 1, attn="sdpa"),
                          tiny_tokenizer, RetrieverConfig(shared_encoder=False)).double()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(2, temperature=0.1, loss_chunk_size=0)
    q, p = make_batch(retriever, 8, 2, seed=11)
    expected = reference_grads(modules, loss_fn, q, p)
    zero(modules)
    GradCache(modules, 3, loss_fn, chunking=Chunking(sort_by_length=True))(q, p)
    assert rel_err(grads(modules), expected) < 1e-10


@pytest.mark.parametrize("settings,message", [
    (dict(trim="yes"), "Chunking.trim must be True, False or None"),
    (dict(sort_by_length=1), "Chunking.sort_by_length must be True or False"),
    (dict(tokens=[8, -1]), "chunk tokens must be a positive integer"),
    (dict(tokens=True), "chunk tokens must be a positive integer"),
])
def test_chunking_settings_are_checked_where_they_are_declared(settings, message) -> None:
    with pytest.raises(DprGcError, match=message):
        Chunking(**settings)


def test_chunking_is_one_settings_object() -> None:
    loss_fn = SimpleContrastiveLoss()
    with pytest.raises(DprGcError, match="chunking must be a dpr_gc.engine.chunking.Chunking"):
        GradCache([torch.nn.Linear(2, 2)], 2, loss_fn, chunking={"trim": False})
    with pytest.raises(TypeError):
        GradCache([torch.nn.Linear(2, 2)], 2, loss_fn, trim=False)  # the options live in Chunking, not beside it
    assert GradCache([torch.nn.Linear(2, 2)] * 2, 2, loss_fn, chunking=Chunking(tokens=[4, 8])).chunk_tokens == [4, 8]


def test_chunk_widths_read_once_equal_each_chunks_own():
    """The widths the engine reads from the whole input's mask in one go are those each chunk's own mask gives:
    right and left padding, rows with holes, empty rows, full rows."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 13, (40,), generator=gen)
    right = (torch.arange(12) < lengths[:, None]).long()
    left = right.flip(1)
    holes = right.clone()
    holes[::7, 0] = 0
    full = torch.ones(6, 12, dtype=torch.long)
    for mask in (right, left, holes, full, torch.cat([right[:20], left[20:]])):
        model_input = {"input_ids": mask * 5, "attention_mask": mask}
        for chunk in (1, 3, 8, 40):
            chunks = split_input(model_input, chunk)
            assert chunk_widths(model_input, chunks) == [trimmed_width(c) for c in chunks]


class ReadsBack(TorchDispatchMode):
    """Counts the operators that read a tensor's value back to the host (``.item()``, ``int()``, ``bool()``): on a
    GPU each waits for every queued kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sort_by_length, budget", [(False, 0), (True, 0), (True, 10**12)])
def test_a_step_reads_no_value_back_per_chunk_or_row(sort_by_length, budget):
    """Forming, joining and trimming chunks reads the batch's lengths once per input, never per chunk or row: chunks
    of one row (96 chunks), of 16 rows (6 chunks) and of at most 64 tokens read back as often, whether or not a budget
    joins them (counted in the third step: from the second on a budget joins chunks)."""
    def reads_back(chunk: int, tokens=None) -> int:
        torch.manual_seed(0)
        model = MeanOfEmbeddings()
        engine = GradCache([model, model], chunk, SimpleContrastiveLoss(1), memory_budget=budget,
                           chunking=Chunking(sort_by_length=sort_by_length, trim=True, tokens=tokens))
        q, p = uneven_batch()
        engine(q, p)  # the first step measures graphs
        engine(q, p)
        with ReadsBack() as reads:
            engine(q, p)
        return reads.count

    counts = [reads_back(1), reads_back(16), reads_back(16, tokens=64)]
    assert counts[0] == counts[1] == counts[2], counts


class TokenScores(torch.nn.Module):
    """One score per token, ``[rows, tokens]``: a per-token representation of two dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).sum(-1) * attention_mask


def test_a_two_dimensional_per_token_representation_is_refused_when_trimmed_chunks_differ():
    """A ``[rows, tokens]`` output cannot be told from a pooled one, so trimming does not pad it back; where chunks
    trim to different widths the step is refused with the fix, and ``trim=False`` gives the full-batch gradient."""
    model = TokenScores()
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    batch = {"input_ids": torch.randint(1, 20, (4, 6)) * mask, "attention_mask": mask}

    def loss_fn(scores: torch.Tensor) -> torch.Tensor:
        return (scores ** 2).sum()

    with pytest.raises(DprGcError, match="pass token_states=True, or trim=False"):
        GradCache([model], 2, loss_fn, chunking=Chunking(trim=True))(batch)
    loss_fn(model(**batch)).backward()
    expected = model.embed.weight.grad.clone()
    model.zero_grad()
    GradCache([model], 2, loss_fn, chunking=Chunking(trim=False))(batch)
    torch.testing.assert_close(model.embed.weight.grad, expected)


@pytest.mark.parametrize("budget", [0, 10**12])
def test_a_step_walks_the_modules_of_tied_towers_a_few_times(monkeypatch, budget):
    """A step lists a model's parameters and buffers once, however many inputs the model takes and chunks it runs:
    walking the modules of a LoRA decoder (about 2,000 in Qwen2-0.5B's shape) costs host time that a GPU step
    waits for. Tied towers under bf16, counted in the third step: fewer than 8 full walks (16 before the listing)."""
    retriever = lora_decoder()
    engine = GradCache([retriever, retriever], 3, SimpleContrastiveLoss(1), bf16=True, memory_budget=budget)
    q, p = make_batch(retriever, 6, 1)
    q, p = dict(q, kind="query"), dict(p, kind="passage")
    engine(q, p)
    engine(q, p)
    real, visits = nn.Module.named_modules, []

    def counted(self, memo=None, prefix="", remove_duplicate=True):
        for item in real(self, memo, prefix, remove_duplicate):
            visits.extend([1] if memo is None else [])  # top-level walks only (children recurse with a memo)
            yield item

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    engine(q, p)
    monkeypatch.setattr(nn.Module, "named_modules", real)
    walks = len(visits) / len(list(retriever.modules()))
    assert 1 <= walks < 8, walks


def test_a_step_holds_none_of_the_models_tensors_after_it():
    """The step's listing of parameters and buffers ends with the step: a buffer the caller replaces afterwards (as
    ``.to()`` does) is freed, not kept alive by the engine until its next step."""
    import gc  # imported here: tests above call their engines gc

    model = MeanOfEmbeddings()
    model.register_buffer("counts", torch.zeros(4))
    engine = GradCache([model, model], 8, SimpleContrastiveLoss(1))
    engine(*uneven_batch())
    old = weakref.ref(model.counts)
    model.counts = torch.zeros(4)
    gc.collect()
    assert old() is None


class MeanPooledBert(nn.Module):
    """A tiny BERT, mean-pooled over real tokens (an all-padding row pools to zeros)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.helpers import tiny_bert

        self.bert = tiny_bert(100, layers=1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (hidden * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True).clamp(min=1)


@pytest.mark.parametrize("sort_by_length", [False, True])
def test_a_chunk_of_padding_rows_only_keeps_one_column_and_the_gradient_exact(sort_by_length):
    """Empty placeholder passages (a missing hard negative) can make a whole chunk padding: it was trimmed to width 0,
    which BERT cannot reshape (a raw error where the full batch runs); a chunk keeps at least one column."""
    torch.manual_seed(0)
    encoder = MeanPooledBert()
    ids, mask = torch.randint(1, 100, (8, 6)), torch.ones(8, 6, dtype=torch.long)
    ids[6:], mask[6:] = 0, 0
    q, p = {"input_ids": ids[:4], "attention_mask": mask[:4]}, {"input_ids": ids, "attention_mask": mask}
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1)
    expected = reference_grads([encoder, encoder], loss_fn, q, p)
    zero([encoder])
    GradCache([encoder, encoder], 2, loss_fn, chunking=Chunking(sort_by_length=sort_by_length, trim=True))(q, p)
    assert rel_err(grads([encoder]), expected) < 1e-5
    assert trimmed_width(slice_of(p, 6, 8)) == (6, 1, "right")
    assert chunk_widths(p, [slice_of(p, 0, 6), slice_of(p, 6, 8)])[1] == (6, 1, "right")


def slice_of(batch: dict, start: int, end: int) -> dict:
    return {k: v[start:end] for k, v in batch.items()}
