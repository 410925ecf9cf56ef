"""Chunking.trim: chunks are cut to their longest sequence by default only for models that declare their output
ignores padding (dpr-gc's retrievers); a raw model runs its chunks at the batch's width, as the original package
runs them, so a representation that reads padding positions keeps the full batch's loss and gradient."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from dpr_gc import Chunking, GradCache, SimpleContrastiveLoss
from dpr_gc.engine.grad_cache import trims_exactly
from dpr_gc.train.distributed import Towers
from tests.helpers import grads, make_batch, models_of, rel_err, tiny_bert, zero


def right_padded(rows: int, seed: int, width: int = 12) -> dict[str, torch.Tensor]:
    """Right-padded ids of random lengths 3..width, the first row full (so every chunk but the first is narrower)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return {"input_ids": torch.randint(5, 100, (rows, width), generator=g) * mask, "attention_mask": mask}


def unmasked_mean(out) -> torch.Tensor:
    return out.last_hidden_state.mean(1)


def last_column(out) -> torch.Tensor:
    return out.last_hidden_state[:, -1]


def widths_seen(model: torch.nn.Module) -> list[int]:
    """The sequence widths ``model`` is called with, from now on."""
    widths: list[int] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].size(1)),
                                    with_kwargs=True)
    return widths


@pytest.mark.parametrize("rep", [unmasked_mean, last_column])
def test_a_raw_model_whose_representation_reads_padding_gets_the_full_batch_loss_and_gradient(
        rep: Callable[[object], torch.Tensor]) -> None:
    """A user's ``get_rep_fn`` over a raw transformer that reads padding positions (a mean without the mask, the
    last column): the default step runs every chunk at the batch's width, so its loss and gradient are the full
    batch's (trimmed, each chunk saw less padding: 2.37 for 2.58)."""
    model = tiny_bert(100)
    q, p = right_padded(6, 1), right_padded(12, 2)
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1)
    expected_loss = loss_fn(rep(model(**q)), rep(model(**p)))
    expected_loss.backward()
    expected = grads([model])
    zero([model])
    widths = widths_seen(model)
    loss = GradCache([model, model], 4, loss_fn, get_rep_fn=rep)(q, p)
    assert abs(float(loss) - expected_loss.item()) < 1e-6
    assert rel_err(grads([model]), expected) < 1e-5
    assert set(widths) == {12}


def test_dropout_on_a_raw_model_draws_the_masks_of_untrimmed_chunks() -> None:
    """Under dropout the default step on a raw model draws the same masks as chunks left at the batch's width (as
    the original package draws them): same seed, same loss."""
    model = tiny_bert(100, dropout=0.1)
    q, p = right_padded(6, 1), right_padded(12, 2)
    loss_fn = SimpleContrastiveLoss(n_hard_negatives=1)
    losses = []
    for chunking in (Chunking(), Chunking(trim=False)):
        torch.manual_seed(7)
        losses.append(float(GradCache([model, model], 4, loss_fn, get_rep_fn=unmasked_mean, chunking=chunking)(q, p)))
    assert losses[0] == losses[1]


def test_trim_true_cuts_a_raw_models_chunks_as_the_user_vouches() -> None:
    """``Chunking(trim=True)`` cuts a raw model's chunks (its user says the representation masks padding) and
    ``trim=False`` never cuts a retriever's."""
    model = tiny_bert(100)
    q, p = right_padded(6, 1), right_padded(12, 2)
    widths = widths_seen(model)
    GradCache([model, model], 4, SimpleContrastiveLoss(1), get_rep_fn=lambda out: out.last_hidden_state[:, 0],
              chunking=Chunking(trim=True))(q, p)
    assert min(widths) < 12
    assert not trims_exactly(model, q) and trims_exactly(model, q, trim=True) and not trims_exactly(model, q, False)


def test_a_retriever_still_trims_by_default(make_retriever) -> None:
    """dpr-gc's retrievers pool with the mask (``ignores_padding``), so their chunks are cut by default: through
    its encoders, the retriever itself, the trainer's towers and torch.compile's wrapper."""
    retriever = make_retriever(shared=False)
    q, p = make_batch(retriever, 6, 1, seed=3)
    widths = widths_seen(retriever.passage_encoder.transformer)
    GradCache(models_of(retriever), 4, SimpleContrastiveLoss(1))(q, p)
    assert min(widths) < p["input_ids"].size(1)
    towers = Towers(retriever)
    for model in (retriever, retriever.query_encoder, towers, torch.compile(retriever), torch.compile(towers)):
        assert trims_exactly(model, p), type(model).__name__
        assert not trims_exactly(model, p, trim=False)


def test_the_trainers_towers_cut_a_left_padded_decoders_chunks_as_its_retriever_does() -> None:
    """The trainer's towers report their retriever's ``counts_positions_from_mask``: a left-padded decoder's chunks
    are cut to their longest rows in training as through the retriever (the same step, fewer columns)."""
    from tests.llm_models import decoder_retriever

    retriever = decoder_retriever(padding_side="left", passage_max_length=12)
    q, p = make_batch(retriever, 6, 1, seed=3)
    assert not bool(p["attention_mask"][:, 0].all())  # some row starts with padding
    for model in (retriever, Towers(retriever), torch.compile(Towers(retriever))):
        assert trims_exactly(model, p), type(model).__name__
