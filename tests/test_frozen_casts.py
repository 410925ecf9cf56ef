"""Frozen Linear weights (a LoRA base's) in autocast's dtype through a cached step: cast once per step instead of once
per chunk and pass, held by no kept graph, the gradient unchanged to the bit, the fp32 tensors back afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine import grad_cache
from dpr_gc.engine.frozen_casts import FrozenLinearCasts
from dpr_gc.model.lora import LoraSettings, apply_lora
from tests.helpers import WeightCasts, grads, make_batch, models_of, randomise_adapters, rel_err, zero
from tests.llm_models import lora_decoder

CHUNK = 3
WHOLE_BATCH = 10**12
BF16 = {"cpu": torch.bfloat16}


def lora_retriever(make_retriever) -> nn.Module:
    retriever = make_retriever(shared=False)
    apply_lora(retriever, LoraSettings(r=4))
    randomise_adapters(retriever)
    return retriever


def frozen_linear_weights(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The LoRA base layers' weights (their biases are frozen too)."""
    return list({id(m.weight): m.weight for module in modules for m in module.modules()
                 if type(m) is nn.Linear and not m.weight.requires_grad}.values())


def cached_step(modules: list[nn.Module], batch: tuple[dict, dict], budget: int, engine_bf16: bool,
                dtype: torch.dtype = torch.bfloat16) -> GradCache:
    """One step under bf16: the engine's own autocast, or the caller's around the step (in ``dtype``)."""
    engine = GradCache(modules, CHUNK, SimpleContrastiveLoss(1, temperature=0.2), bf16=engine_bf16,
                       memory_budget=budget, chunking=Chunking(sort_by_length=True))
    zero(modules)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=dtype, enabled=not engine_bf16):
        engine(*batch)
    return engine


def without_frozen_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grad_cache, "FrozenLinearCasts", lambda models, dtypes, forwards: FrozenLinearCasts([], {}))


def check_casts_and_gradient(retriever: nn.Module, monkeypatch: pytest.MonkeyPatch, budget: int,
                             engine_bf16: bool, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
    """Each frozen weight cast once in a step (before: once per chunk and pass), the gradient equal to the bit."""
    modules = models_of(retriever.to(device))
    batch = tuple({k: v.to(device) for k, v in x.items()} for x in make_batch(retriever, 8, 1, seed=3))
    frozen = frozen_linear_weights(modules)
    with WeightCasts(frozen) as counter:
        engine = cached_step(modules, batch, budget, engine_bf16, dtype)
    assert sum(engine.last_step.chunks) > 4
    assert dict(counter.casts) == {w.data_ptr(): 1 for w in frozen}
    got = grads(modules)
    without_frozen_casts(monkeypatch)
    with WeightCasts(frozen) as counter:
        cached_step(modules, batch, budget, engine_bf16, dtype)
    assert min(counter.casts.values()) >= min(engine.last_step.chunks) > 1  # before: every chunk cast them again
    assert torch.equal(got, grads(modules))


@pytest.mark.parametrize("engine_bf16", [True, False])
@pytest.mark.parametrize("budget", [0, WHOLE_BATCH])
def test_frozen_weights_are_cast_once_per_step_and_the_gradient_is_unchanged(make_retriever, monkeypatch, budget,
                                                                             engine_bf16):
    check_casts_and_gradient(lora_retriever(make_retriever), monkeypatch, budget, engine_bf16)


def test_fp16_autocast_too(make_retriever, monkeypatch):
    """docs/library.md: frozen weights are cast once per step under fp16 autocast as under bf16."""
    check_casts_and_gradient(lora_retriever(make_retriever), monkeypatch, 0, engine_bf16=False, dtype=torch.float16)


def test_a_lora_decoder_too(monkeypatch):
    check_casts_and_gradient(lora_decoder(), monkeypatch, WHOLE_BATCH, engine_bf16=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [0, WHOLE_BATCH])
def test_on_cuda_too(make_retriever, monkeypatch, budget):
    check_casts_and_gradient(lora_retriever(make_retriever), monkeypatch, budget, engine_bf16=True, device="cuda")


def test_the_step_stays_close_to_the_full_batch_graph_under_bf16(make_retriever):
    retriever = lora_retriever(make_retriever)
    modules = models_of(retriever)
    q, p = make_batch(retriever, 8, 1, seed=5)
    loss_fn = SimpleContrastiveLoss(1, temperature=0.2)
    zero(modules)
    loss_fn(modules[0](**q), modules[1](**p)).backward()
    expected = grads(modules)
    cached_step(modules, (q, p), WHOLE_BATCH, engine_bf16=True)
    assert rel_err(grads(modules), expected) < 0.02


def test_kept_graphs_hold_no_copy_of_a_frozen_weight(make_retriever, monkeypatch):
    """At a budget for the whole batch every chunk keeps its graph: each used to save a bf16 copy of every frozen
    weight (a linear keeps its weight for the input's gradient); now each saves the parameter itself. The word
    embeddings train too here, so that every base linear, the first layer's included, is on the gradient's path."""
    retriever = lora_retriever(make_retriever)
    modules = models_of(retriever)
    for module in modules:
        module.transformer.embeddings.word_embeddings.requires_grad_(True)
    batch = make_batch(retriever, 8, 1, seed=4)
    kept = cached_step(modules, batch, WHOLE_BATCH, engine_bf16=True).last_step
    without_frozen_casts(monkeypatch)
    before = cached_step(modules, batch, WHOLE_BATCH, engine_bf16=True).last_step
    copies = sum(2 * w.numel() for w in frozen_linear_weights(modules))  # one model's per chunk: towers are apart
    assert sum(kept.kept) == sum(before.kept) == sum(kept.chunks)
    assert before.kept_bytes - kept.kept_bytes == sum(kept.kept) * copies // 2


def test_the_linears_are_back_after_a_step_and_after_a_failed_one(make_retriever):
    """The parameters stay as they are throughout; the base layers' forwards use the copies during the step only."""
    retriever = lora_retriever(make_retriever)
    modules = models_of(retriever)
    frozen = frozen_linear_weights(modules)
    linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    before = [(w.data_ptr(), w.dtype) for w in frozen]
    batch = make_batch(retriever, 8, 1, seed=6)
    cached_step(modules, batch, 0, engine_bf16=True)
    assert [(w.data_ptr(), w.dtype) for w in frozen] == before
    assert not any("forward" in vars(m) for m in linears)

    def failing_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert all("forward" in vars(m) for m in linears)  # switched while the step runs
        assert [(w.data_ptr(), w.dtype) for w in frozen] == before
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        GradCache(modules, CHUNK, failing_loss, bf16=True)(*batch)
    assert [(w.data_ptr(), w.dtype) for w in frozen] == before
    assert not any("forward" in vars(m) for m in linears)


class ScaledLinear(nn.Linear):
    """A subclass may read its weight in a forward of its own."""


class Sharded(torch.Tensor):
    """A tensor subclass, as FSDP2's DTensor shards are: cast by FSDP's own mixed-precision policy."""


def test_only_frozen_fp32_linear_tensors_no_other_module_reads_are_switched():
    torch.manual_seed(0)
    frozen, trained, sub, tied = nn.Linear(4, 4), nn.Linear(4, 4), ScaledLinear(4, 4), nn.Linear(4, 10, bias=False)
    embedding = nn.Embedding(10, 4)
    embedding.weight = tied.weight  # a tied table: looked up outside autocast
    wide, sharded = nn.Linear(4, 4).double(), nn.Linear(4, 4, bias=False)
    sharded.weight = nn.Parameter(torch.randn(4, 4).as_subclass(Sharded))
    model = nn.ModuleList([frozen, trained, sub, tied, embedding, wide, sharded])
    for module in (frozen, sub, tied, embedding, wide, sharded):
        module.requires_grad_(False)
    assert {id(p) for p in FrozenLinearCasts([model, model], BF16).params} == {id(frozen.weight), id(frozen.bias)}
    assert FrozenLinearCasts([model], {"cuda": torch.bfloat16}).params == []
    with FrozenLinearCasts([model], {}) as casts:
        assert casts.copies == [] and "forward" not in vars(frozen)
    with FrozenLinearCasts([model], BF16) as casts:
        assert [c.dtype for c in casts.copies] == [torch.bfloat16] * 2 and "forward" in vars(frozen)
        assert not any("forward" in vars(m) for m in (trained, sub, tied, wide, sharded))
        assert frozen.weight.dtype == torch.float32
    assert "forward" not in vars(frozen) and casts.copies == []


def test_a_qwen2_05b_base_casts_072_gb_of_linear_weights_per_call():
    """The figure the docs give for what each kept graph saved before: Qwen2-0.5B's Linear weights in bf16."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2Model(config)
    weights = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear)
    assert round(2 * weights / 1e9, 2) == 0.72


def test_a_frozen_tower_keeps_its_fp32_weights(make_retriever):
    """A tower that does not train runs without a graph, so autocast's casts last only a call: it is left alone."""
    retriever = lora_retriever(make_retriever)
    modules = models_of(retriever)
    modules[1].requires_grad_(False)
    query_side, passage_side = ([m for m in module.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
                                for module in modules)
    switched = []

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        switched.append(({"forward" in vars(m) for m in query_side}, {"forward" in vars(m) for m in passage_side}))
        return SimpleContrastiveLoss(1)(x, y)

    GradCache(modules, CHUNK, loss, bf16=True)(*make_batch(retriever, 8, 1, seed=7))
    assert switched == [({True}, {False})]


class HalfInFp32(nn.Module):
    """A trainable layer, then a frozen one the model runs with autocast turned off (in fp32, as some models run
    their heads); the loss applies a frozen projection of its own, outside the engine's autocast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trained, self.frozen = nn.Linear(6, 8), nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.frozen(self.trained(x).float())


@pytest.mark.parametrize("engine_bf16", [True, False])
def test_a_frozen_linear_called_outside_autocast_runs_in_fp32_as_without_the_step(engine_bf16):
    """It used to meet its bf16 tensors there ("mat1 and mat2 must have the same dtype"), where plain bf16 training
    runs it in fp32."""
    model, projection = HalfInFp32(), nn.Linear(8, 8).requires_grad_(False)
    x, y = torch.randn(8, 6), torch.randn(8, 6)

    def loss_fn(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return SimpleContrastiveLoss()(projection(q), p)

    models = [model, nn.Sequential(model, projection)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reps = models[0](x), models[1](y)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not engine_bf16):  # the engine's own holds no loss
        plain = loss_fn(*reps)
    plain.backward()
    expected = grads([model])
    zero([model])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not engine_bf16):
        loss = GradCache(models, 3, loss_fn, bf16=engine_bf16)(x, y)
    assert torch.allclose(loss, plain.detach(), atol=1e-6) and rel_err(grads([model]), expected) < 1e-6


class FrozenThenTrained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen, self.trained = nn.Linear(16, 32).requires_grad_(False), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.relu(self.frozen(x)))


def test_a_compiled_model_is_not_recompiled_at_every_step():
    """``torch.compile`` guards on a switched layer's forward: each step gives it the same object (a new one every
    step recompiled the model at each step until dynamo's limit, then ran it uncompiled)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(FrozenThenTrained(), backend="eager")
    engine = GradCache([model, model], 4, SimpleContrastiveLoss(), bf16=True)
    for _ in range(5):
        engine(torch.randn(8, 16), torch.randn(8, 16))
    assert counters["frames"]["total"] <= 2  # the forward without and with a graph
