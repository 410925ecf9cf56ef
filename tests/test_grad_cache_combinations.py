"""Gradient Cache where its features meet: every memory budget with chunks by tokens, dropout, hard negatives, either
kind of towers, gradient checkpointing, LoRA under bf16/fp16 and with dropout, uneven batches and chunks of one row,
repeated passages, a custom split, gradients accumulated over several cached steps, and a learnable temperature at its
bounds. Each parameter's gradient (the temperature's included) is compared with one graph over the whole batch: fp32
to a relative error below 1e-5, bf16/fp16 within the bound ``dpr-gc verify`` states."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from dpr_gc.engine.loss import TEMPERATURE_RANGE
from dpr_gc.model.lora import LoraSettings, apply_lora
from dpr_gc.model.retriever import enable_gradient_checkpointing
from dpr_gc.train.verify import TOLERANCES
from tests.helpers import (Batch, BatchEncoder, grads, make_batch, models_of, randomise_adapters, reference_grads,
                           rel_err, split_batch, tiny_bert, zero)

CHUNK = 3
WHOLE_BATCH = 10**12
BUDGETS = ["0", "one chunk", "half", "whole batch"]


def budget_bytes(name: str, modules: list[nn.Module], loss_fn: nn.Module, inputs: tuple, chunk: int = CHUNK,
                 **options) -> int:
    """The bytes of a named budget, from a step that keeps every graph (it measures them all)."""
    if name == "0":
        return 0
    engine = GradCache(modules, chunk, loss_fn, memory_budget=WHOLE_BATCH, **options)
    engine(*inputs)
    zero(modules + [loss_fn])
    report = engine.last_step
    return {"one chunk": report.largest_graph, "half": report.kept_bytes // 2, "whole batch": WHOLE_BATCH}[name]


def chunk_plans(engine: GradCache, inputs: tuple) -> list:
    """The chunks the engine's last step ran for each model input (grouped, split, joined and trimmed as it did)."""
    return [engine._plan(m, x, engine.joined_tokens[m]) for m, x in enumerate(inputs)]


def chunk_by_chunk(engine: GradCache, modules: list[nn.Module], plans: list) -> list[torch.Tensor]:
    """Representations with their graph, forwarded chunk by chunk in the cached step's order (dropout draws the
    masks the cached step drew), put back in row order: the reference graph when the model has dropout."""
    reps = []
    for model, plan in zip(modules, plans):
        rep = torch.cat([engine._forward(model, chunk, width) for chunk, width in zip(plan.chunks, plan.widths)])
        reps.append(rep if plan.order is None else rep[torch.argsort(plan.order)])
    return reps


def check_against_dropout_reference(engine: GradCache, modules: list[nn.Module], loss_fn: nn.Module,
                                   steps: list[tuple], seed: int) -> list[list[int]]:
    """Run the cached steps ``steps`` from ``seed`` without zeroing, then the reference graphs of the same chunks from
    the same seed, and check that the accumulated gradients agree; returns each cached step's chunks per model."""
    params = modules + [loss_fn]
    zero(params)
    torch.manual_seed(seed)
    plans, chunks = [], []
    for inputs in steps:
        engine(*inputs)
        plans.append(chunk_plans(engine, inputs))
        chunks.append(list(engine.last_step.chunks))
    cached = grads(params)
    zero(params)
    torch.manual_seed(seed)
    for step_plans in plans:
        loss_fn(*chunk_by_chunk(engine, modules, step_plans)).backward()
    err = rel_err(cached, grads(params))
    assert err < 1e-5, err
    return chunks


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("shared", [True, False])
def test_every_budget_with_chunks_by_tokens_dropout_hard_negatives_and_either_towers(make_retriever, shared, budget):
    retriever = make_retriever(shared=shared, dropout=0.2).train()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(2, temperature=0.2, learn_temperature=True)
    inputs = make_batch(retriever, 7, 2, seed=3)
    chunking = Chunking(sort_by_length=True, tokens=[20, 50])
    nbytes = budget_bytes(budget, modules, loss_fn, inputs, 4, chunking=chunking)
    engine = GradCache(modules, 4, loss_fn, memory_budget=nbytes, chunking=chunking)
    check_against_dropout_reference(engine, modules, loss_fn, [inputs], seed=5)
    kept, chunks = sum(engine.last_step.kept), sum(engine.last_step.chunks)
    assert kept >= 1 and (kept == chunks) == (budget == "whole batch"), engine.last_step


@pytest.mark.parametrize("budget", ["0", "half", "whole batch"])
def test_every_budget_with_gradient_checkpointing_and_dropout(make_retriever, budget):
    """Checkpointed layers recompute their activations in the backward under the RNG state of their forward, in a
    kept graph as in a replayed one: the dropout masks are those of the reference graph, built without it."""
    retriever = make_retriever(shared=False, dropout=0.2).train()
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1)
    inputs = make_batch(retriever, 6, 1, seed=6)
    nbytes = budget_bytes(budget, modules, loss_fn, inputs)
    engine = GradCache(modules, CHUNK, loss_fn, memory_budget=nbytes)
    zero(modules)
    torch.manual_seed(2)
    plans = [engine._plan(m, x) for m, x in enumerate(inputs)]  # a first step's chunks: none joined
    loss_fn(*chunk_by_chunk(engine, modules, plans)).backward()
    expected = grads(modules)
    enable_gradient_checkpointing(retriever)
    retriever.train()
    zero(modules)
    torch.manual_seed(2)
    engine(*inputs)
    assert rel_err(grads(modules), expected) < 1e-5
    assert (sum(engine.last_step.kept) > 1) == (budget != "0")


@pytest.mark.parametrize("budget", ["0", "half", "whole batch"])
@pytest.mark.parametrize("lora", [False, True])
def test_accumulated_cached_steps_equal_the_references_steps(make_retriever, lora, budget):
    """Three cached steps on three batches without zeroing (gradient accumulation) equal the reference's three
    backwards, dropout included: each step continues the random stream where the last left it, and from the second
    step on a budget joins the chunks it holds. Embeddings (sparse per chunk on the CPU) and the loss's learnable
    temperature accumulate too."""
    retriever = make_retriever(shared=False, dropout=0.1).train()
    if lora:
        apply_lora(retriever, LoraSettings(r=4))
        randomise_adapters(retriever)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.3, learn_temperature=True)
    steps = [make_batch(retriever, 7, 1, seed=s) for s in (1, 2, 3)]
    chunking = Chunking(sort_by_length=True, tokens=[30, 60])
    nbytes = budget_bytes(budget, modules, loss_fn, steps[0], 4, chunking=chunking)
    engine = GradCache(modules, 4, loss_fn, memory_budget=nbytes, chunking=chunking)
    chunks = check_against_dropout_reference(engine, modules, loss_fn, steps, seed=11)
    assert loss_fn.tau.log_value.grad is not None
    assert (engine.joined_tokens[1] is not None) == (budget != "0"), chunks  # later steps join what a budget holds


@pytest.mark.parametrize("kind, side, shared, checkpointing, budget", [
    ("llama", "left", True, False, "0"), ("llama", "left", False, True, "half"),
    ("qwen2", "right", True, True, "whole batch")])
def test_lora_dropout_is_replayed_as_the_reference_draws_it(kind, side, shared, checkpointing, budget):
    """docs/distributed.md: Gradient Cache replays the adapters' dropout like any other. LoRA towers with dropout
    0.3 on decoders whose own layers have none (so the adapters' masks are the only randomness), over two accumulated
    cached steps, under each kind of towers, gradient checkpointing and budget, equal the reference graphs that draw
    the same masks."""
    from tests.llm_models import decoder_retriever

    retriever = decoder_retriever(kind, side, shared=shared, learn_temperature=True, temperature=0.2)
    apply_lora(retriever, LoraSettings(r=4, dropout=0.3))
    randomise_adapters(retriever)
    if checkpointing:
        enable_gradient_checkpointing(retriever)
    retriever.train()
    modules = models_of(retriever)
    inputs = make_batch(retriever, 7, 2, seed=3)
    with torch.no_grad():  # the adapters' dropout is live: the same batch embeds otherwise each time
        assert not torch.equal(modules[0](**inputs[0]), modules[0](**inputs[0]))
    loss_fn = SimpleContrastiveLoss(2)
    chunking = Chunking(sort_by_length=True, tokens=[30, 80])
    nbytes = budget_bytes(budget, modules, loss_fn, inputs, 3, chunking=chunking)
    engine = GradCache(modules, 3, loss_fn, memory_budget=nbytes, chunking=chunking)
    check_against_dropout_reference(engine, modules, loss_fn, [inputs, make_batch(retriever, 7, 2, seed=4)], seed=5)


def plain_low_precision(modules: list[nn.Module], loss_fn: nn.Module, q: dict, p: dict, dtype: torch.dtype,
                        scale: float) -> torch.Tensor:
    """The whole batch in one graph under autocast, the loss in fp32 (scaled by ``scale``, as a GradScaler does)."""
    zero(modules + [loss_fn])
    with torch.autocast("cpu", dtype=dtype):
        reps = [model(**x) for model, x in zip(modules, (q, p))]
    (loss_fn(*reps) * scale).backward()
    return grads(modules + [loss_fn]) / scale


@pytest.mark.parametrize("budget", ["0", "half", "whole batch"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_under_autocast_and_every_budget_stays_within_the_stated_bound(make_retriever, precision, budget):
    """LoRA towers (their frozen base weights held in the autocast dtype for the step) under bf16, or fp16 with a
    GradScaler given positionally as in the original package: whatever the budget, the gradients, the temperature's
    included, stay within ``dpr-gc verify``'s bound of the whole batch under the same autocast, and the loss is fp32.
    Not exact by design: a chunk's matmuls round to 8/11 bits apart from the whole batch's, and kept graphs, sharing
    autocast's one copy of each weight, sum that copy's gradient over their chunks in its precision."""
    retriever = make_retriever(shared=False)
    apply_lora(retriever, LoraSettings(r=4))
    randomise_adapters(retriever)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2, learn_temperature=True)
    q, p = make_batch(retriever, 8, 1, seed=5)
    scale = 2.0 ** 10 if precision == "fp16" else 1.0
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    expected = plain_low_precision(modules, loss_fn, q, p, dtype, scale)

    def engine(memory_budget: int) -> GradCache:
        if precision == "fp16":
            scaler = torch.amp.GradScaler("cpu", init_scale=scale)
            return GradCache(modules, CHUNK, loss_fn, None, None, True, scaler, memory_budget=memory_budget)
        return GradCache(modules, CHUNK, loss_fn, bf16=True, memory_budget=memory_budget)

    nbytes = 0
    if budget != "0":
        measuring = engine(WHOLE_BATCH)
        measuring(q, p)
        nbytes = WHOLE_BATCH if budget == "whole batch" else measuring.last_step.kept_bytes // 2
    zero(modules + [loss_fn])
    loss = engine(nbytes)(q, p)
    got = grads(modules + [loss_fn]) / scale
    assert loss.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got, expected) < TOLERANCES[precision]
    assert rel_err(got[-1:], expected[-1:]) < TOLERANCES[precision]  # the temperature, last of the parameters


def late_interaction(q: torch.Tensor, p: torch.Tensor, q_mask: torch.Tensor, p_mask: torch.Tensor) -> torch.Tensor:
    """A ColBERT-style loss on token representations, padding masked out."""
    sim = torch.einsum("qid,pjd->qpij", q, p).masked_fill(~p_mask.bool()[None, :, None, :], -1e4)
    scores = (sim.max(-1).values * q_mask[:, None, :]).sum(-1)
    return nn.functional.cross_entropy(scores, torch.arange(q.size(0)) * (p.size(0) // q.size(0)))


@pytest.mark.parametrize("budget", ["0", "whole batch"])
@pytest.mark.parametrize("rep", ["pooled", "tokens"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_uneven_batches_and_chunks_of_one_row(tiny_tokenizer, make_retriever, chunk, rep, budget):
    """7 queries and 14 passages in chunks of 3 (the last chunk shorter) or of one row (each trimmed to its own
    length; token-level states padded back row by row), sorted by length, two steps (the second joins chunks under a
    budget): the full batch's gradient each time."""
    retriever = make_retriever(shared=False)
    q, p = make_batch(retriever, 7, 1, seed=31)
    loss_kwargs, get_rep = {}, None
    if rep == "tokens":
        towers, loss_fn = [tiny_bert(len(tiny_tokenizer), 0), tiny_bert(len(tiny_tokenizer), 1)], late_interaction
        loss_kwargs = {"q_mask": q["attention_mask"], "p_mask": p["attention_mask"]}
        get_rep = (lambda out: out.last_hidden_state)
    else:
        towers, loss_fn = models_of(retriever), SimpleContrastiveLoss(1, temperature=0.2)
    zero(towers)
    reps = [tower(**x) for tower, x in zip(towers, (q, p))]
    loss_fn(*(reps if get_rep is None else map(get_rep, reps)), **loss_kwargs).backward()
    expected = grads(towers)
    engine = GradCache(towers, chunk, loss_fn, get_rep_fn=get_rep, memory_budget=0 if budget == "0" else WHOLE_BATCH,
                       chunking=Chunking(sort_by_length=True, trim=True, token_states=rep == "tokens" or None))
    for _ in range(2):
        zero(towers)
        engine(q, p, **loss_kwargs)
        assert rel_err(grads(towers), expected) < 1e-5


@pytest.mark.parametrize("budget", ["0", "half", "whole batch"])
def test_repeated_passages_are_never_negatives_under_every_chunking(make_retriever, budget):
    """Passage 4 repeats passage 0 (queries 0 and 2 share a positive) and passage 11 repeats passage 10 (query 5's
    hard negative is its own positive): with ``passage_ids`` no query scores a copy of its positive as a negative,
    whatever the budget, chunks by tokens and grouping by length do to the rows, over two steps."""
    retriever = make_retriever(shared=False)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 6, 1, seed=5)
    for rows in ((4, 0), (11, 10)):
        for tensor in p.values():
            tensor[rows[0]] = tensor[rows[1]]
    ids = torch.tensor([10, 11, 12, 13, 10, 14, 13, 15, 16, 17, 18, 18])
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2, symmetric=True, learn_temperature=True)
    zero(modules + [loss_fn])
    expected_loss = loss_fn(modules[0](**q), modules[1](**p), passage_ids=ids)
    expected_loss.backward()
    expected = grads(modules + [loss_fn])
    assert loss_fn.masked_scores == 4  # query 0: column 4; query 2: column 0; query 3: column 3; query 5: column 11
    chunking = Chunking(sort_by_length=True, tokens=[30, 50])
    nbytes = budget_bytes(budget, modules, loss_fn, (q, p), 4, chunking=chunking)
    engine = GradCache(modules, 4, loss_fn, memory_budget=nbytes, chunking=chunking)
    for _ in range(2):
        zero(modules + [loss_fn])
        loss = engine(q, p, passage_ids=ids)
        assert torch.allclose(loss, expected_loss.detach(), rtol=1e-6) and loss_fn.masked_scores == 4
        assert rel_err(grads(modules + [loss_fn]), expected) < 1e-5


@pytest.mark.parametrize("budget", ["half", "whole batch"])
def test_a_custom_split_under_a_budget(tiny_tokenizer, make_retriever, budget):
    """Chunks from the user's ``split_input_fn`` (rows counted on the representations) keep their graphs under a
    budget like any others, over two steps."""
    q, p = (Batch(x["input_ids"], x["attention_mask"]) for x in make_batch(make_retriever(), 5, 1, seed=32))
    model = BatchEncoder(len(tiny_tokenizer))
    loss_fn = SimpleContrastiveLoss(1)
    zero([model])
    loss_fn(model(q), model(p)).backward()
    expected = grads([model])
    nbytes = budget_bytes(budget, [model, model], loss_fn, (q, p), split_input_fn=split_batch)
    engine = GradCache([model, model], CHUNK, loss_fn, split_input_fn=split_batch, memory_budget=nbytes)
    for _ in range(2):
        zero([model])
        engine(q, p)
        assert rel_err(grads([model]), expected) < 1e-5
        assert sum(engine.last_step.kept) > 1


LO, HI = TEMPERATURE_RANGE
AT_AND_PAST_THE_BOUNDS = [LO, LO / 2, HI, HI * 2]


def set_temperature(module: nn.Module, value: float) -> None:
    with torch.no_grad():
        module.tau.log_value.fill_(math.log(value))


@pytest.mark.parametrize("value", AT_AND_PAST_THE_BOUNDS)
def test_a_loss_temperature_at_or_past_its_bound_gets_the_full_batch_gradient(make_retriever, value):
    """The loss runs once per step, on the whole batch of representations: its temperature's gradient, the bound's
    rule included (past a bound, a gradient that would push it further out is dropped), is the full batch's."""
    retriever = make_retriever(shared=False)
    modules = models_of(retriever)
    loss_fn = SimpleContrastiveLoss(1, learn_temperature=True)
    set_temperature(loss_fn, value)
    q, p = make_batch(retriever, 8, 1, seed=4)
    zero(modules + [loss_fn])
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected = grads(modules + [loss_fn])
    for chunk in (1, 3):
        zero(modules + [loss_fn])
        GradCache(modules, chunk, loss_fn, memory_budget=WHOLE_BATCH if chunk == 3 else 0)(q, p)
        assert rel_err(grads(modules + [loss_fn]), expected) < 1e-5
        assert torch.allclose(loss_fn.tau.log_value.grad, expected[-1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", AT_AND_PAST_THE_BOUNDS)
def test_a_temperature_inside_the_model_at_its_bound_is_trained_exactly(make_retriever, value):
    """The retriever applies its temperature in every forward, so a cached step calls it once per chunk. On a bound
    its gradient is the plain one and exact whatever the chunking; a value an optimizer step moved past a bound is put
    back onto it by ``keep_in_range_()`` (the trainer's projection before each step)."""
    retriever = make_retriever(shared=True, learn_temperature=True)
    set_temperature(retriever, value)
    retriever.tau.keep_in_range_()
    assert float(retriever.tau.log_value.detach()) == float(torch.tensor(math.log(min(max(value, LO), HI))))
    loss_fn = SimpleContrastiveLoss(1)
    q, p = make_batch(retriever, 8, 1, seed=4)
    q, p = dict(q, kind="query"), dict(p, kind="passage")
    modules = [retriever, retriever]
    expected = reference_grads(modules, loss_fn, q, p)
    assert retriever.tau.log_value.grad.abs() > 0
    for chunk in (1, 3):
        zero(modules)
        GradCache(modules, chunk, loss_fn)(q, p)
        assert rel_err(grads(modules), expected) < 1e-5
        assert torch.allclose(retriever.tau.log_value.grad, expected[-1], rtol=1e-5)


@pytest.fixture(scope="module")
def temperature_task(tmp_path_factory) -> dict:
    from tests.train_data import init_model, make_records, write_dpr

    d = tmp_path_factory.mktemp("temperature")
    return {"dir": d, "model": init_model(d, learn_temperature=True, temperature=LO),
            "train": write_dpr(d / "train.json", make_records(16, 1))}


@pytest.mark.parametrize("value", [LO / 2, HI * 2])
def test_the_trainers_cached_and_plain_steps_agree_with_a_temperature_past_its_bound(temperature_task, tmp_path,
                                                                                      value):
    """A learnable temperature that a step left past its bound (or a loaded model holds there) is put back onto the
    bound before the next step: the cached step, calling it once per chunk, then gets the plain step's gradient, and
    so does ``dpr-gc verify``. Before, each chunk dropped its own outward-pointing part of the gradient (6-10 % off).
    The towers run in float64: at the lower bound (logits scaled by 100) fp32 roundoff of differently padded chunks
    can move the two steps' gradients apart by more than fp32's tolerance; in float64 they agree to 1e-12."""
    from dpr_gc.train.trainer import Trainer
    from dpr_gc.train.verify import verify
    from tests.train_data import task_config

    def first_grad(out: str, **settings) -> torch.Tensor:
        trainer = Trainer(task_config(temperature_task, tmp_path / out, max_steps=1, **settings))
        trainer.retriever.double()
        set_temperature(trainer.retriever, value)
        seen = []
        trainer.on_backward = lambda step, retriever: seen.append(grads([retriever]))
        trainer.fit()
        return seen[0]

    plain = first_grad("plain", grad_cache=False)
    cached = first_grad("cached", query_chunk_size=1, passage_chunk_size=2)
    assert plain.dtype == torch.float64 and plain[-1] != 0 and rel_err(cached, plain) < 1e-12
    config = task_config(temperature_task, tmp_path / "verify", query_chunk_size=1, passage_chunk_size=2)
    report = verify(config, hook=lambda trainer: set_temperature(trainer.retriever, value))
    assert report.passed, report.table()


@pytest.mark.parametrize("loss_fn", [lambda x, y: (SimpleContrastiveLoss()(x, y), x @ y.T),
                                     lambda x, y: SimpleContrastiveLoss()(x, y, reduction="none")],
                         ids=["extra outputs", "one loss per query"])
def test_a_loss_that_does_not_return_a_scalar_is_refused(make_retriever, loss_fn):
    """The drop-in's loss returns the scalar to backpropagate, as in the original package; anything else is named."""
    retriever = make_retriever()
    q, p = make_batch(retriever, 4, 0)
    with pytest.raises(DprGcError, match="loss_fn must return the loss as a scalar tensor"):
        GradCache(models_of(retriever), 2, loss_fn)(q, p)
