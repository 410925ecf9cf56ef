"""The library's engine arguments: GradCache, Chunking and the losses refuse what they cannot use when they are
built, each with one DprGcError naming the argument and what to pass, and take numpy integers as ints."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.base.errors import DprGcError
from dpr_gc.engine.loss import Temperature
from tests.helpers import grads, rel_err, zero


@pytest.mark.parametrize("models,match", [
    (nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), r"got one module.*pass \[model\].*\[model, model\]"),
    (nn.Linear(8, 4), r"got one module.*pass \[model\].*\[model, model\]"),
    ([], "at least one model"),
    ((m for m in [nn.Linear(8, 4)]), "a list or tuple"),
    ([nn.Linear(8, 4), "encoder"], r"models\[1\] is a str, not a torch.nn.Module"),
])
def test_models_must_be_a_list_of_modules(models, match):
    with pytest.raises(DprGcError, match=match):
        GradCache(models, 2, SimpleContrastiveLoss())


def test_a_module_list_is_a_list_of_models():
    torch.manual_seed(0)
    model, q, p = nn.Linear(8, 4), torch.randn(6, 8), torch.randn(6, 8)
    loss_fn = SimpleContrastiveLoss()
    loss_fn(model(q), model(p)).backward()
    expected = grads([model])
    zero([model])
    GradCache(nn.ModuleList([model, model]), np.int64(4), loss_fn)(q, p)
    assert rel_err(grads([model]), expected) < 1e-5


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_fn": None}, "loss_fn must be callable"),
    ({"get_rep_fn": "pooler_output"}, r"get_rep_fn must be callable.*lambda out: out.pooler_output"),
    # a loss named by a string is not an attribute of the model output to read: the loss's own example is shown
    ({"loss_fn": "contrastive"}, r"loss_fn must be callable, got str 'contrastive': pass e\.g\. "
                                 r"loss_fn=SimpleContrastiveLoss\(\)"),
    ({"split_input_fn": 4}, "split_input_fn must be callable"),
    ({"fp16": "yes", "scaler": torch.amp.GradScaler("cpu")}, "fp16 must be True or False"),
    ({"bf16": "yes"}, "bf16 must be True or False"),
    ({"fp16": True, "scaler": "scaler"}, "scaler must be a torch.amp.GradScaler"),
])
def test_bad_grad_cache_arguments_are_refused_when_it_is_built(kwargs, match):
    model = nn.Linear(8, 4)
    arguments = {"loss_fn": SimpleContrastiveLoss(), **kwargs}
    with pytest.raises(DprGcError, match=match):
        GradCache([model, model], 2, **arguments)


def test_a_disabled_scaler_without_fp16_is_accepted_quietly():
    """The trainer passes its GradScaler(enabled=fp16) whatever the precision."""
    model = nn.Linear(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradCache([model, model], 2, SimpleContrastiveLoss(), scaler=torch.amp.GradScaler("cpu", enabled=False))


@pytest.mark.parametrize("bf16", [False, True])
def test_an_enabled_scaler_without_fp16_is_accepted_as_the_original_does_and_named_unused(bf16):
    model = nn.Linear(8, 4)
    with pytest.warns(UserWarning, match="GradScaler without fp16=True: it is not used"):
        GradCache([model, model], 2, SimpleContrastiveLoss(), bf16=bf16, scaler=torch.amp.GradScaler("cpu"))


def test_the_docs_say_an_enabled_scaler_without_fp16_is_accepted_with_a_warning():
    """docs/library.md and GradCache's docstring state what the check does: accepted, warned about, not refused."""
    library = Path(__file__).resolve().parents[1] / "docs" / "library.md"
    said = "accepted, as the original package accepts it, with a warning that it goes unused"
    for text in (library.read_text(), GradCache.__init__.__doc__ or "", GradCache.__doc__ or ""):
        assert "without fp16 is refused" not in " ".join(text.split()).replace("`", "").replace("=True", "")
    assert said in " ".join(library.read_text().split())
    assert said in " ".join(((GradCache.__doc__ or "") + (GradCache.__init__.__doc__ or "")).split())


def test_no_sync_except_last_must_be_a_bool():
    model = nn.Linear(8, 4)
    with pytest.raises(DprGcError, match="no_sync_except_last must be True or False"):
        GradCache([model, model], 2, SimpleContrastiveLoss())(torch.randn(4, 8), torch.randn(4, 8),
                                                               no_sync_except_last="no")


def test_numpy_integers_are_chunk_sizes_and_token_limits():
    assert Chunking(tokens=np.int64(4)).tokens == 4
    assert Chunking(tokens=[np.int32(4), None]).tokens == (4, None)
    assert type(Chunking(tokens=np.int64(4)).tokens) is int
    model = nn.Linear(8, 4)
    assert GradCache([model, model], [np.int64(2), np.int16(3)], SimpleContrastiveLoss()).chunk_sizes == [2, 3]


@pytest.mark.parametrize("kwargs,match", [
    ({"n_hard_negatives": "1"}, "n_hard_negatives must be an integer >= 0, got '1'"),
    ({"n_hard_negatives": 1.5}, "n_hard_negatives must be an integer >= 0"),
    ({"n_hard_negatives": True}, "n_hard_negatives must be an integer >= 0"),
    ({"temperature": "0.05"}, "temperature must be a number in"),
    ({"temperature": float("nan")}, "temperature must be a number in"),
    ({"learn_temperature": "yes"}, "learn_temperature must be True or False"),
    ({"symmetric": 1}, "symmetric must be True or False"),
])
def test_bad_loss_arguments_are_refused(kwargs, match):
    with pytest.raises(DprGcError, match=match):
        SimpleContrastiveLoss(**kwargs)


def test_numpy_numbers_are_loss_arguments():
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=np.int64(1), temperature=np.float32(0.5))
    assert loss_fn.n_hard_negatives == 1 and type(loss_fn.n_hard_negatives) is int
    assert loss_fn.temperature.item() == pytest.approx(0.5)
    with pytest.raises(DprGcError, match="temperature must be a number"):
        Temperature("1.0")
