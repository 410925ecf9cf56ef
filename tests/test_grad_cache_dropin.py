"""GradCache as a drop-in for the original package: users' own models, inputs, losses and settings.

Every gradient is compared with one full-batch graph (fp32, relative error < 1e-5).
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from tests.helpers import Batch, BatchEncoder, random_texts, split_batch, tiny_bert
from tests.helpers import MeanOfEmbeddings, grads, make_batch, models_of, reference_grads, rel_err, zero


def hidden_states(output) -> torch.Tensor:
    return output.last_hidden_state


def late_interaction(q: torch.Tensor, p: torch.Tensor, q_mask: torch.Tensor, p_mask: torch.Tensor) -> torch.Tensor:
    """ColBERT-style loss on token representations: each query token's best passage token, padding masked out."""
    sim = torch.einsum("qid,pjd->qpij", q, p).masked_fill(~p_mask.bool()[None, :, None, :], -1e4)
    scores = (sim.max(-1).values * q_mask[:, None, :]).sum(-1)
    targets = torch.arange(q.size(0)) * (p.size(0) // q.size(0))
    return nn.functional.cross_entropy(scores, targets)


@pytest.mark.parametrize("keep_last_graph,sort", [(True, False), (False, True)])
def test_token_level_representations_with_trimming(tiny_tokenizer, make_retriever, keep_last_graph, sort):
    retriever = make_retriever(shared=False)
    towers = [tiny_bert(len(tiny_tokenizer), 0), tiny_bert(len(tiny_tokenizer), 1)]
    q, p = make_batch(retriever, 6, 1, seed=31)
    masks = {"q_mask": q["attention_mask"], "p_mask": p["attention_mask"]}
    zero(towers)
    late_interaction(towers[0](**q).last_hidden_state, towers[1](**p).last_hidden_state, **masks).backward()
    expected = grads(towers)
    zero(towers)
    seen = []

    def loss_fn(x, y, **kw):
        seen.append((x.shape, y.shape))
        return late_interaction(x, y, **kw)

    chunking = Chunking(keep_last_graph=keep_last_graph, sort_by_length=sort, trim=True, token_states=True)
    GradCache(towers, 4, loss_fn, get_rep_fn=hidden_states, chunking=chunking)(q, p, **masks)
    assert seen == [((6, q["input_ids"].size(1), 32), (12, p["input_ids"].size(1), 32))]
    assert rel_err(grads(towers), expected) < 1e-5


def test_custom_split_input_fn_on_an_object(tiny_tokenizer, make_retriever):
    q, p = make_batch(make_retriever(), 5, 1, seed=32)
    q, p = (Batch(x["input_ids"], x["attention_mask"]) for x in (q, p))
    model = BatchEncoder(len(tiny_tokenizer))
    loss_fn = SimpleContrastiveLoss(1)
    zero([model])
    loss_fn(model(q), model(p)).backward()
    expected = grads([model])
    zero([model])
    GradCache([model, model], 3, loss_fn, split_input_fn=split_batch)(q, p)
    assert rel_err(grads([model]), expected) < 1e-5


class CountCalls:
    def __init__(self, module: nn.Module) -> None:
        self.calls = []
        module.register_forward_hook(lambda mod, args, out: self.calls.append(torch.is_grad_enabled()))


@pytest.mark.parametrize("frozen", [0, 1])
@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_frozen_tower_runs_once_without_graph(make_retriever, frozen, keep_last_graph):
    retriever = make_retriever(shared=False)
    towers = models_of(retriever)
    towers[frozen].requires_grad_(False)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    q, p = make_batch(retriever, 6, 1, seed=33)
    expected = reference_grads(towers, loss_fn, q, p)
    zero(towers)
    counter = CountCalls(towers[frozen])
    GradCache(towers, 4, loss_fn, chunking=Chunking(keep_last_graph=keep_last_graph))(q, p)
    assert rel_err(grads(towers), expected) < 1e-5
    assert all(param.grad is None for param in towers[frozen].parameters())
    assert counter.calls == [False] * len(counter.calls) and len(counter.calls) == (2 if frozen == 0 else 3)


def test_loss_target_and_reduction_follow_the_original():
    torch.manual_seed(0)
    x, y = torch.randn(5, 8), torch.randn(7, 8)
    target = torch.tensor([0, 3, 3, 6, 1])
    for block in (0, None, 2):
        loss_fn = SimpleContrastiveLoss(temperature=0.5, loss_chunk_size=block)
        for reduction in ("mean", "sum", "none"):
            xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
            got = loss_fn(xr, yr, target=target, reduction=reduction)
            xe, ye = x.clone().requires_grad_(), y.clone().requires_grad_()
            want = nn.functional.cross_entropy(xe @ ye.T / 0.5, target, reduction=reduction)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
            weights = torch.arange(1.0, 6.0) if reduction == "none" else torch.tensor(1.0)
            (got * weights).sum().backward()
            (want * weights).sum().backward()
            assert rel_err(xr.grad, xe.grad) < 1e-5 and rel_err(yr.grad, ye.grad) < 1e-5
        with pytest.raises(DprGcError, match="reduction"):
            loss_fn(x, y, target=target, reduction="avg")
    with pytest.raises(DprGcError, match="target"):
        SimpleContrastiveLoss()(x, y, target=torch.tensor([0, 1]))
    with pytest.raises(DprGcError, match="target"):
        SimpleContrastiveLoss()(x, y, target=torch.tensor([0, 1, 2, 3, 7]))


def test_a_subclass_of_the_original_losses_finds_their_attributes_and_gather_hook(tmp_path):
    """A loss subclass written against the original reads ``target_per_qry`` (and, distributed, ``word_size`` and
    ``rank``) and may override ``gather_tensor``, which the distributed loss gathers its representations with."""
    import torch.distributed as dist

    from dpr_gc import DistributedContrastiveLoss

    class Checked(SimpleContrastiveLoss):
        def forward(self, x, y, **kwargs):
            assert y.size(0) == x.size(0) * self.target_per_qry
            return super().forward(x, y, **kwargs)

    x, y = torch.randn(3, 8), torch.randn(6, 8)
    loss = Checked(n_hard_negatives=1)
    assert loss.target_per_qry == 2 and torch.isfinite(loss(x, y))
    loss.target_per_qry = 3
    assert loss.n_hard_negatives == 2
    gathered = []

    class OwnGather(DistributedContrastiveLoss):
        def gather_tensor(self, t):
            gathered.append(tuple(t.shape))
            return super().gather_tensor(t)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        own = OwnGather(n_hard_negatives=1)
        assert (own.word_size, own.rank) == (1, 0)
        assert torch.allclose(own(x, y), SimpleContrastiveLoss(n_hard_negatives=1)(x, y))
    finally:
        dist.destroy_process_group()
    assert gathered == [(3, 8), (6, 8)]


def test_target_through_grad_cache(make_retriever):
    retriever = make_retriever(shared=True)
    towers = models_of(retriever)
    q, p = make_batch(retriever, 6, 0, seed=34)
    p = {k: v[:4] for k, v in p.items()}  # six queries over four passages
    target = torch.tensor([0, 1, 1, 2, 3, 3])
    loss_fn = SimpleContrastiveLoss(temperature=0.2, symmetric=True)
    zero(towers)
    loss_fn(towers[0](**q), towers[1](**p), target=target).backward()
    expected = grads(towers)
    zero(towers)
    GradCache(towers, 4, loss_fn)(q, p, target=target)
    assert rel_err(grads(towers), expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block,similarity,learn", [(None, "dot", False), (2, "cos", True), (0, "dot", True)])
def test_loss_is_fp32_inside_an_outer_autocast(dtype, block, similarity, learn):
    torch.manual_seed(1)
    x, y = torch.randn(6, 16) * 3, torch.randn(12, 16) * 3
    results = []
    for autocast in (False, True):
        loss_fn = SimpleContrastiveLoss(1, temperature=0.05, learn_temperature=learn, similarity=similarity,
                                        symmetric=learn, loss_chunk_size=block)
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = loss_fn(xr, yr)
        loss.backward()
        extra = [loss_fn.tau.log_value.grad.reshape(1)] if learn else []
        results.append((loss.detach(), torch.cat([xr.grad.flatten(), yr.grad.flatten()] + extra)))
    (ref_loss, ref_grad), (loss, grad) = results
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref_loss, rtol=1e-5)
    assert rel_err(grad, ref_grad) < 1e-5


@pytest.mark.parametrize("block", [1, 3, 7])
def test_blocked_cross_entropy_matches_cross_entropy_in_float64(block):
    """The blocked loss and its hand-written backward, in float64: gradcheck against finite differences, and values
    and gradients equal to ``F.cross_entropy`` over the dense score matrix to rounding."""
    from dpr_gc.engine.loss import blocked_cross_entropy

    gen = torch.Generator().manual_seed(block)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen).requires_grad_()
    y = torch.randn(16, 5, dtype=torch.float64, generator=gen).requires_grad_()
    scale = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 16, (7,), generator=gen)
    assert torch.autograd.gradcheck(lambda a, b, s: blocked_cross_entropy(a, b, s, targets, block), (x, y, scale))
    weights = torch.rand(7, dtype=torch.float64, generator=gen)  # a non-uniform upstream gradient
    got = blocked_cross_entropy(x, y, scale, targets, block)
    want = nn.functional.cross_entropy((x @ y.T) * scale, targets, reduction="none")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    for g, w in zip(torch.autograd.grad((got * weights).sum(), (x, y, scale)),
                    torch.autograd.grad((want * weights).sum(), (x, y, scale))):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for low in (torch.float16, torch.bfloat16):  # reduced precisions are still computed in fp32
        assert blocked_cross_entropy(x.detach().to(low), y.detach().to(low), scale.detach(), targets,
                                     block).dtype == torch.float32


@pytest.mark.parametrize("size", [-1, -4, 1.5])
def test_bad_loss_chunk_size_is_refused(size):
    with pytest.raises(DprGcError, match="loss_chunk_size"):
        SimpleContrastiveLoss(loss_chunk_size=size)


def test_bad_loss_chunk_size_is_refused_on_the_cli(tmp_path, capsys):
    from dpr_gc.cli import main

    code = main(["train", "--train", str(tmp_path / "t.json"), "--output", str(tmp_path / "o"), "--model", "m",
                 "--loss-chunk-size", "-1"])
    assert code == 2 and "--loss-chunk-size" in capsys.readouterr().err


class NormEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(5, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_running_statistics_see_each_example_once(keep_last_graph):
    torch.manual_seed(2)
    model = NormEncoder()
    x, y = torch.randn(8, 5), torch.randn(8, 5) + 1
    reference = NormEncoder()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for chunk in list(x.split(3)) + list(y.split(3)):
            reference(chunk)
    GradCache([model, model], 3, SimpleContrastiveLoss(), chunking=Chunking(keep_last_graph=keep_last_graph))(x, y)
    for name, buffer in reference.named_buffers():
        assert torch.allclose(dict(model.named_buffers())[name], buffer), name


def test_learnable_temperature_recovers_from_its_bound():
    from dpr_gc.engine.loss import TEMPERATURE_RANGE, Temperature

    tau = Temperature(0.05, learnable=True)
    with torch.no_grad():
        tau.log_value.fill_(torch.log(torch.tensor(TEMPERATURE_RANGE[0] / 4)))
    optimizer = torch.optim.SGD(tau.parameters(), lr=0.5)
    torch.log(tau()).backward()  # a loss that wants it lower still: no push further past the bound
    assert float(tau.log_value.grad) == 0.0
    for _ in range(20):  # a loss that wants it higher: it must come back into the range and rise
        optimizer.zero_grad()
        (-torch.log(tau())).backward()
        optimizer.step()
    assert float(tau().detach()) > TEMPERATURE_RANGE[0] * 1.5


def test_gradient_checkpointing_is_not_reentrant(make_retriever, monkeypatch):
    from dpr_gc.model.retriever import enable_gradient_checkpointing

    retriever = make_retriever(shared=False)
    seen = []
    for encoder in models_of(retriever):
        model = encoder.transformer
        # Wrap only the entry point the code calls: transformers routes a wrapped deprecated alias through itself.
        name = next(n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(model, n))
        original = getattr(model, name)
        monkeypatch.setattr(model, name, lambda *a, _f=original, **kw: (seen.append(kw), _f(*a, **kw))[1])
    enable_gradient_checkpointing(retriever)
    assert len(seen) >= 2
    for kwargs in seen:
        assert {"use_reentrant": False} in kwargs.values(), kwargs


def test_empty_batch_is_a_clear_error(make_retriever):
    retriever = make_retriever()
    q, p = make_batch(retriever, 4, 0)
    empty = {k: v[:0] for k, v in p.items()}
    with pytest.raises(DprGcError, match="empty"):
        GradCache(models_of(retriever), 2, SimpleContrastiveLoss())(q, empty)


@pytest.mark.parametrize("keep_last_graph", [True, False])
def test_a_loss_that_ignores_a_representation(make_retriever, keep_last_graph):
    retriever = make_retriever(shared=False)
    towers = models_of(retriever)
    q, p = make_batch(retriever, 4, 0, seed=35)

    def loss_fn(x, y):
        return (x ** 2).mean()

    expected = reference_grads(towers, loss_fn, q, p)
    zero(towers)
    counter = CountCalls(towers[1])
    GradCache(towers, 3, loss_fn, chunking=Chunking(keep_last_graph=keep_last_graph))(q, p)
    assert rel_err(grads(towers), expected) < 1e-5
    assert all(param.grad is None for param in towers[1].parameters())
    assert len(counter.calls) == 2, "no replay of a representation the loss ignored"


class ClsModel(nn.Module):
    """A user's model fed a 3-D (per query position) attention mask, mean-pooling its states."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.bert = tiny_bert(vocab, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        mask = attention_mask[:, 0]
        states = self.bert(input_ids, attention_mask=mask, **batch).last_hidden_state
        return (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def test_sort_by_length_with_a_3d_attention_mask(tiny_tokenizer, make_retriever):
    q, p = make_batch(make_retriever(), 6, 0, seed=36)
    q3, p3 = ({**x, "attention_mask": x["attention_mask"][:, None, :].expand(-1, x["input_ids"].size(1), -1)}
              for x in (q, p))
    model = ClsModel(len(tiny_tokenizer))
    loss_fn = SimpleContrastiveLoss()
    zero([model])
    loss_fn(model(**q3), model(**p3)).backward()
    expected = grads([model])
    zero([model])
    seen = []
    record = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"]), with_kwargs=True)
    GradCache([model, model], 4, loss_fn, chunking=Chunking(sort_by_length=True))(q3, p3)
    record.remove()
    assert rel_err(grads([model]), expected) < 1e-5
    # a 3-D mask is not grouped: the first pass's chunks are the input's rows in their own order
    first_pass = seen[:4]  # 2 query chunks, then 2 passage chunks (6 rows each, chunks of 4)
    assert torch.equal(torch.cat(first_pass[:2]), q3["input_ids"]) and torch.equal(torch.cat(first_pass[2:]),
                                                                                     p3["input_ids"])


def test_rng_is_captured_on_every_cuda_device_a_parameter_lives_on(monkeypatch):
    from dpr_gc.engine.grad_cache import RandState, rng_devices

    fake = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", i))
                                                          for i in (0, 1, 1)]),
                                 buffers=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 2))]))
    devices = rng_devices(fake, {"x": torch.zeros(1)})
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2), torch.device("cpu")}
    captured = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: captured.append(d) or torch.zeros(1))
    state = RandState(devices)
    assert sorted(state.cuda) == [0, 1, 2]


def test_replay_is_refused_where_it_cannot_be_guaranteed():
    from dpr_gc.engine.grad_cache import rng_devices

    fake = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("mps"))]),
                                 buffers=lambda: iter([]))
    with pytest.raises(DprGcError, match="mps"):
        rng_devices(fake, None)


def test_compiled_modules_are_unwrapped_when_detecting_ddp():
    from dpr_gc.engine.grad_cache import is_ddp

    inner = nn.Linear(2, 2)
    assert not is_ddp(torch.compile(inner))
    ddp_like = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp_like)
    assert is_ddp(ddp_like) and is_ddp(torch.compile(ddp_like))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, *, factor: float) -> torch.Tensor:
        return self.linear(x) * factor


def test_the_original_args_kwargs_input():
    """The original package's ``([args], {kwargs})`` input is called as ``model(*args, **kwargs)``."""
    torch.manual_seed(3)
    model, x, y = Scaled(), torch.randn(6, 5), torch.randn(6, 5)
    loss_fn = SimpleContrastiveLoss()
    loss_fn(model(x, factor=2.0), model(y, factor=0.5)).backward()
    expected = grads([model])
    zero([model])
    GradCache([model, model], 4, loss_fn)(([x], {"factor": 2.0}), ([y], {"factor": 0.5}))
    assert rel_err(grads([model]), expected) < 1e-5


@pytest.mark.parametrize("form", ["list", "tuple", "BatchEncoding"])
def test_list_tuple_and_batch_encoding_inputs_give_the_full_batch_gradient(form):
    """docs/library.md: lists/tuples of tensors and BatchEncodings are split automatically, row by row."""
    from transformers import BatchEncoding

    torch.manual_seed(0)
    q_model, p_model = MeanOfEmbeddings(), MeanOfEmbeddings()  # called as model(ids, mask) or with keywords
    ids = torch.randint(1, 30, (12, 7))
    mask = (torch.arange(7)[None] < torch.randint(2, 8, (12, 1))).long()
    q_ids, q_mask, p_ids, p_mask = ids[:6], mask[:6], ids[6:], mask[6:]
    loss_fn = SimpleContrastiveLoss(0)
    loss_fn(q_model(q_ids, q_mask), p_model(p_ids, p_mask)).backward()
    expected = [p.grad.clone() for p in (*q_model.parameters(), *p_model.parameters())]
    q_model.zero_grad()
    p_model.zero_grad()
    wrap = {"list": lambda i, m: [i, m], "tuple": lambda i, m: (i, m),
            "BatchEncoding": lambda i, m: BatchEncoding({"input_ids": i, "attention_mask": m})}[form]
    GradCache([q_model, p_model], 4, loss_fn)(wrap(q_ids, q_mask), wrap(p_ids, p_mask))
    for got, want in zip((p.grad for p in (*q_model.parameters(), *p_model.parameters())), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_replay_draws_the_captured_numbers_and_puts_the_current_state_back():
    """``RandState.replay``: the block draws what was drawn after the capture; after it, the random stream goes on
    from where it was before the block (a cached step leaves the caller's RNG as one forward per chunk left it)."""
    from dpr_gc.engine.grad_cache import RandState

    torch.manual_seed(3)
    state = RandState([torch.device("cpu")])
    first = torch.rand(4)
    torch.manual_seed(8)
    expected_next = torch.rand(4)
    torch.manual_seed(8)
    with state.replay():
        torch.testing.assert_close(torch.rand(4), first, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(4), expected_next, rtol=0, atol=0)


class FeaturesModel(nn.Module):
    """A model in sentence-transformers' manner: ``forward(features)`` takes the tokenizer's dict whole and returns
    it with ``sentence_embedding`` added."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MeanOfEmbeddings()

    def forward(self, features: dict, **kwargs: object) -> dict:
        return dict(features, sentence_embedding=self.inner(features["input_ids"], features["attention_mask"]))


def test_a_model_that_takes_the_features_dict_whole_gets_it_sorted_and_trimmed():
    """GradCache's docstring: a SentenceTransformer is given its features dicts (its forward takes the dict whole),
    as CachedMultipleNegativesRankingLoss does; the dicts are still sorted by length and trimmed (it was called
    with the dict's entries as keywords and failed in forward)."""
    torch.manual_seed(1)
    model = FeaturesModel()
    q, p = right_padded([3, 7, 2, 5, 4, 6], width=9), right_padded([6, 2, 7, 3, 5, 4], width=9)
    loss_fn = SimpleContrastiveLoss(0)
    loss_fn(model(q)["sentence_embedding"], model(p)["sentence_embedding"]).backward()
    expected = grads([model])
    zero([model])
    widths = []
    model.register_forward_pre_hook(lambda module, args: widths.append(args[0]["input_ids"].size(1)))
    GradCache([model, model], 4, loss_fn, get_rep_fn=lambda out: out["sentence_embedding"],
              chunking=Chunking(sort_by_length=True, trim=True))(q, p)
    assert rel_err(grads([model]), expected) < 1e-5
    assert max(widths) < 9


def tiny_sentence_transformer(tokenizer, folder) -> nn.Module:
    """A SentenceTransformer of a tiny random BERT (saved to ``folder``, no hub) and mean pooling, in eval mode."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    tiny_bert(len(tokenizer), 4).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = SentenceTransformer(modules=[Transformer(str(folder)), Pooling(32, "mean")], device="cpu")
    return model.eval()


@pytest.mark.parametrize("hard_negatives", [0, 1])
def test_cached_mnrl_is_grad_cache_with_the_simple_contrastive_loss(tiny_tokenizer, tmp_path, hard_negatives):
    """SimpleContrastiveLoss's and GradCache's References: sentence-transformers' CachedMultipleNegativesRankingLoss
    (scale 20, mini-batches of 3) is GradCache over the SentenceTransformer's features dicts with
    ``SimpleContrastiveLoss(similarity="cos", temperature=1/scale)`` and ``out["sentence_embedding"]``: the same
    loss and parameter gradients, with and without a hard negative column (laid out per query here, positive
    first; a column each there)."""
    import copy

    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    theirs = tiny_sentence_transformer(tiny_tokenizer, tmp_path / "bert")
    ours = copy.deepcopy(theirs)
    columns = [random_texts(8, 50, 2, 8)] + [random_texts(8, 51 + c, 4, 30) for c in range(1 + hard_negatives)]
    expected_loss = CachedMultipleNegativesRankingLoss(theirs, scale=20.0, mini_batch_size=3)(
        [theirs.tokenize(column) for column in columns], torch.zeros(8))
    expected_loss.backward()
    passages = [column[i] for i in range(8) for column in columns[1:]]
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=hard_negatives, similarity="cos", temperature=1 / 20.0)
    loss = GradCache([ours, ours], 3, loss_fn, get_rep_fn=lambda out: out["sentence_embedding"])(
        ours.tokenize(columns[0]), ours.tokenize(passages))
    assert abs(float(loss) - expected_loss.item()) / expected_loss.item() < 1e-5
    assert rel_err(grads([ours]), grads([theirs])) < 1e-5


class PolyCodes(nn.Module):
    """A fixed number of vectors per row whatever the width (poly-encoder codes): 4 learned codes attend over the
    tokens, ``[rows, 4, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.codes = nn.Embedding(50, 8), nn.Parameter(torch.randn(4, 8))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.embed(input_ids)
        weights = (self.codes @ states.transpose(1, 2)).masked_fill(attention_mask[:, None] == 0, -1e9).softmax(-1)
        return weights @ states


def right_padded(lengths: list[int], width: int = 12) -> dict[str, torch.Tensor]:
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(1, 50, (len(lengths), width)) * mask, "attention_mask": mask}


def test_a_fixed_number_of_vectors_per_row_is_never_padded_as_token_states():
    """Chunking.token_states: a ``[rows, 4, D]`` output whose 4 happens to be the length the queries were trimmed to
    is refused unless told (it was padded to the batch's width as if per token: a wrong loss and gradient with no
    error); token_states=False gives the full batch's gradient, and True refuses it as not per token."""
    torch.manual_seed(0)
    model = PolyCodes()
    q, p = right_padded([4, 3, 4, 2]), right_padded([9, 4, 11, 7])

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(x.mean(1) @ y.mean(1).T, torch.arange(x.size(0)))

    loss_fn(model(**q), model(**p)).backward()
    expected = grads([model])
    with pytest.raises(DprGcError, match=r"say whether its dimension 1 runs over the tokens"):
        GradCache([model, model], 4, loss_fn, chunking=Chunking(trim=True))(q, p)
    with pytest.raises(DprGcError, match=r"its dimension 1 is not per token"):
        GradCache([model, model], 4, loss_fn, chunking=Chunking(trim=True, token_states=True))(q, p)
    zero([model])
    GradCache([model, model], 4, loss_fn, chunking=Chunking(trim=True, token_states=False))(q, p)
    assert rel_err(grads([model]), expected) < 1e-5


def test_two_dimensional_token_scores_are_padded_back_with_token_states():
    """Chunking(token_states=True) pads a ``[rows, tokens]`` output (one score per token) back too, so chunks that
    trim to different widths give the full batch's gradient (without it they are refused: see test_grad_cache)."""
    torch.manual_seed(1)
    embed = nn.Embedding(50, 4)

    class TokenScores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = embed

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.embed(input_ids).sum(-1) * attention_mask

    model, batch = TokenScores(), right_padded([9, 4, 11, 2, 6, 3])
    seen = []

    def loss_fn(scores: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(scores.shape))
        return (scores ** 2).sum()

    loss_fn(model(**batch)).backward()
    expected = grads([model])
    zero([model])
    GradCache([model], 2, loss_fn, chunking=Chunking(sort_by_length=True, trim=True, token_states=True))(batch)
    assert seen[-1] == (6, 12) and rel_err(grads([model]), expected) < 1e-5


class KeywordModel(nn.Module):
    """An ordinary model taking the dict's entries as keywords, with a child layer named ``module`` (as a data
    parallel wrapper names its model) whose forward takes one argument."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.module = MeanOfEmbeddings(), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.module(self.inner(input_ids, attention_mask))


def test_a_child_named_module_does_not_make_a_model_take_the_dict_whole():
    """Only data parallel and torch.compile wrappers are looked inside when deciding how to call a model with a
    dict: a child layer named ``module`` took the model for a wrapper, and it was called with the dict whole."""
    torch.manual_seed(2)
    model = KeywordModel()
    q, p = right_padded([2, 6, 3, 5], width=6), right_padded([4, 2, 6, 3], width=6)
    loss_fn = SimpleContrastiveLoss(0)
    loss_fn(model(**q), model(**p)).backward()
    expected = grads([model])
    zero([model])
    GradCache([model, model], 2, loss_fn)(q, p)
    assert rel_err(grads([model]), expected) < 1e-5


class ScaledByInput(nn.Module):
    """A model given a 0-d tensor beside its rows: ``forward(x, scale)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


@pytest.mark.parametrize("mapping", [dict, lambda items: collections.defaultdict(list, items)])
def test_a_tensor_without_the_batchs_rows_goes_whole_to_every_chunk(mapping):
    """A 0-d tensor in an input dict is not a row of the batch: every chunk gets it whole (it was sliced: an
    IndexError). A defaultdict input is rebuilt as a dict (its class cannot be built from one)."""
    torch.manual_seed(4)
    model, q, p = ScaledByInput(), torch.randn(6, 8), torch.randn(6, 8)
    loss_fn = SimpleContrastiveLoss()
    two, half = torch.tensor(2.0), torch.tensor(0.5)
    loss_fn(model(q, two), model(p, half)).backward()
    expected = grads([model])
    zero([model])
    GradCache([model, model], 4, loss_fn)(mapping({"x": q, "scale": two}), mapping({"scale": half, "x": p}))
    assert rel_err(grads([model]), expected) < 1e-5


@pytest.mark.parametrize("first", [False, True])
def test_broadcast_position_ids_go_whole_to_every_chunk(tiny_tokenizer, first):
    """HF-style ``position_ids`` of shape ``[1, T]`` broadcast over the rows: each chunk gets them whole, trimmed
    with its columns (they were sliced by rows: a size mismatch inside BERT), also when they come first in the dict
    (the rows are counted on a tensor of more than one row)."""
    model = tiny_bert(len(tiny_tokenizer), 5)
    torch.manual_seed(5)
    q, p = right_padded([3, 7, 2, 5, 4, 6]), right_padded([9, 4, 11, 2, 6, 8])
    positions = {"position_ids": torch.arange(12)[None]}
    q, p = ({**positions, **x} if first else {**x, **positions} for x in (q, p))
    loss_fn = SimpleContrastiveLoss()
    cls = lambda out: out.last_hidden_state[:, 0]  # noqa: E731
    loss_fn(cls(model(**q)), cls(model(**p))).backward()
    expected = grads([model])
    zero([model])
    GradCache([model, model], 4, loss_fn, get_rep_fn=cls, chunking=Chunking(sort_by_length=True, trim=True))(q, p)
    assert rel_err(grads([model]), expected) < 1e-5
