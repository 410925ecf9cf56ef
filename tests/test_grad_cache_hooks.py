"""GradCache subclasses that override the original package's hooks (luyug/GradCache: ``compute_loss``, ``get_reps``,
``model_call``, ``split_inputs``, ``get_input_tensors``): each is called as there, and the gradient is the full-batch
gradient of the overridden computation. The original's per-model phase methods are refused at class creation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from tests.helpers import grads, rel_err, zero


def linear_batch(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(8, 4), torch.randn(6, 8), torch.randn(6, 8)


def reference(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The gradient of ``loss`` (one full-batch graph) on ``model``'s parameters; the grads are cleared after."""
    zero([model])
    loss.backward()
    expected = grads([model])
    zero([model])
    return expected


def test_an_overridden_compute_loss_is_the_loss_of_the_step():
    class Regularised(GradCache):
        def compute_loss(self, *reps, **loss_kwargs):
            return self.loss_fn(*reps, **loss_kwargs) + 10.0 * reps[0].pow(2).mean()

    model, q, p = linear_batch()
    loss_fn = SimpleContrastiveLoss()
    full = loss_fn(model(q), model(p)) + 10.0 * model(q).pow(2).mean()
    expected = reference(model, full)
    loss = Regularised([model, model], 2, loss_fn)(q, p)
    assert loss.item() == pytest.approx(full.item(), rel=1e-5)
    assert rel_err(grads([model]), expected) < 1e-5


class TupleModel(nn.Module):
    """A model returning ``(representation, extra)``, as many do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(x), x.sum(1)


def test_an_overridden_get_reps_makes_each_chunks_representation():
    class FirstNormalised(GradCache):
        def get_reps(self, model_out):
            return nn.functional.normalize(model_out[0], dim=-1) * 3.0

    model, q, p = linear_batch(1)
    wrapped = TupleModel(model)
    loss_fn = SimpleContrastiveLoss()
    rep = lambda x: nn.functional.normalize(model(x), dim=-1) * 3.0  # noqa: E731
    expected = reference(model, loss_fn(rep(q), rep(p)))
    FirstNormalised([wrapped, wrapped], 4, loss_fn)(q, p)
    assert rel_err(grads([model]), expected) < 1e-5


def test_an_overridden_model_call_runs_every_chunk():
    calls = []

    class Squashed(GradCache):
        def model_call(self, model, model_input):
            calls.append(torch.is_grad_enabled())
            return torch.tanh(model(model_input["x"]) * model_input["x"].size(1))

    model, q, p = linear_batch(2)
    loss_fn = SimpleContrastiveLoss()
    expected = reference(model, loss_fn(torch.tanh(model(q) * 8), torch.tanh(model(p) * 8)))
    Squashed([model, model], 4, loss_fn, chunking=Chunking(keep_last_graph=False))({"x": q}, {"x": p})
    assert rel_err(grads([model]), expected) < 1e-5
    assert calls == [False] * 4 + [True] * 4  # two chunks per model, first without a graph, then replayed


def test_an_overridden_split_inputs_makes_the_chunks():
    seen = []

    class Uneven(GradCache):
        def split_inputs(self, model_input, chunk_size):
            seen.append(chunk_size)
            return [model_input[:1], *super().split_inputs(model_input[1:], chunk_size)]

    model, q, p = linear_batch(3)
    loss_fn = SimpleContrastiveLoss()
    expected = reference(model, loss_fn(model(q), model(p)))
    sizes = []
    model.register_forward_hook(lambda mod, args, out: sizes.append(args[0].size(0)))
    Uneven([model, model], [4, 3], loss_fn, chunking=Chunking(keep_last_graph=False))(q, p)
    assert rel_err(grads([model]), expected) < 1e-5
    assert seen == [4, 3] and sizes == [1, 4, 1, 1, 3, 2] + [1, 3, 2, 1, 4, 1]  # replayed models last to first


def test_an_overridden_split_inputs_is_refused_with_chunk_tokens():
    class Mine(GradCache):
        def split_inputs(self, model_input, chunk_size):
            return [model_input]

    model, _, _ = linear_batch()
    with pytest.raises(DprGcError, match="split_inputs"):
        Mine([model, model], 2, SimpleContrastiveLoss(), chunking=Chunking(tokens=16))


def test_an_overridden_get_input_tensors_names_the_devices_whose_rng_is_recorded(monkeypatch):
    from dpr_gc.engine import grad_cache

    recorded, captured = [], []
    real = grad_cache.RandState
    monkeypatch.setattr(grad_cache, "RandState", lambda devices: captured.append(set(devices)) or real(devices))
    marker = torch.empty(1, device="meta")

    class Marked(GradCache):
        def get_input_tensors(self, model_input):
            recorded.append(model_input.size(0))
            return [*super().get_input_tensors(model_input), marker]

    model, q, p = linear_batch(4)
    loss_fn = SimpleContrastiveLoss()
    expected = reference(model, loss_fn(model(q), model(p)))
    Marked([model, model], 4, loss_fn)(q, p)
    assert rel_err(grads([model]), expected) < 1e-5
    assert recorded == [4, 2, 4, 2]
    first_pass = captured[:4]  # then each replay saves the current state
    assert all({torch.device("cpu"), torch.device("meta")} <= devices for devices in first_pass)


def original_forward_no_grad(self, model, model_inputs):
    raise AssertionError("never called")


def original_build_cache(self, *reps, **loss_kwargs):
    raise AssertionError("never called")


def original_forward_backward(self, model, model_inputs, cached_gradients, random_states, no_sync_except_last=False):
    raise AssertionError("never called")


@pytest.mark.parametrize("phase,method,alternative", [
    ("forward_no_grad", original_forward_no_grad, "model_call"),
    ("build_cache", original_build_cache, "compute_loss"),
    ("forward_backward", original_forward_backward, "model_call")])
def test_the_originals_per_model_phases_are_refused_at_class_creation(phase, method, alternative):
    with pytest.raises(DprGcError, match=f"{phase}.*{alternative}"):
        type("Original", (GradCache,), {phase: method})


def test_a_subclass_may_wrap_dpr_gcs_own_phases():
    calls = []

    class Counting(GradCache):
        def build_cache(self, reps, **loss_kwargs):
            calls.append(len(reps))
            return super().build_cache(reps, **loss_kwargs)

    model, q, p = linear_batch(5)
    loss_fn = SimpleContrastiveLoss()
    expected = reference(model, loss_fn(model(q), model(p)))
    Counting([model, model], 4, loss_fn)(q, p)
    assert calls == [2] and rel_err(grads([model]), expected) < 1e-5
