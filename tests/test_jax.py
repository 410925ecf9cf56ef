"""Gradient Cache for JAX: cached gradients equal full-batch ``jax.grad`` (tied and separate towers, chunks that do
and do not divide the batch, dropout keys, passage ids), the loss matches the torch one, the original package's API
works on current JAX, and bad arguments are refused. The example trainer, bf16 training, data parallel, memory and
the Flax BERT loader: test_jax_training.py (tests/jax_common.py sets up the two fake devices both files use).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.jax_common import (REPO, SUBPROCESS_SECONDS, TINY, full_batch, jax, jnp, make_batch,  # first: XLA_FLAGS
                              make_params, on_two_devices, rel_error)
from dpr_gc.base.errors import DprGcError
from dpr_gc.jax import (ContrastiveLoss, Encoder, EncoderConfig, blocked_nll, cache_grad, cached_value_and_grad,
                        chunk_encode, data_mesh, data_parallel_value_and_grad, encoder_fn, grad_cached,
                        remat_value_and_grad, tree_chunk, tree_unchunk, unchunk_args)

pytestmark = pytest.mark.usefixtures("jax_quick_compiles")


def check_step(encoders, loss, params, batches, chunk, reference, key=None):
    key = jax.random.key(7) if key is None else key
    want_loss, want = reference(params, loss.init(), batches, key)
    for build in (cached_value_and_grad, remat_value_and_grad):
        got_loss, got = jax.jit(build(encoders, loss, chunk))(params, loss.init(), batches, key)
        assert abs(float(got_loss - want_loss)) < 1e-5 * abs(float(want_loss))
        assert rel_error(got, want) < 1e-5, build.__name__
    return want


@pytest.mark.slow  # ~20 CPU-seconds or more (measured)
def test_separate_encoders_hard_negatives_learnable_temperature_with_dropout():
    """Separate towers, two hard negatives, learnable temperature, dropout on with the same per-chunk keys."""
    config = EncoderConfig(**{**TINY.__dict__, "dropout": 0.2})
    model = Encoder(config)
    params = make_params(config, ("query", "passage"))
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, 6), make_batch(rng, 18)]
    encoders = [encoder_fn(model, "query"), encoder_fn(model, "passage")]
    loss = ContrastiveLoss(n_hard_negatives=2, temperature=0.5, learn_temperature=True, similarity="cos")
    reference = full_batch(encoders, loss, 3)
    grads = check_step(encoders, loss, params, batches, chunk=3, reference=reference)
    assert abs(float(grads[1]["log_temperature"])) > 1e-4
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grads[0]))
    other_key = reference(params, loss.init(), batches, jax.random.key(8))[1]
    assert rel_error(other_key, grads) > 1e-3, "dropout must matter, or this test proves nothing about its keys"


def test_tied_encoder_with_a_chunk_that_does_not_divide_the_batch():
    """Tied towers; 10 queries / 20 passages in chunks of 4 are padded, the padding dropped before the loss."""
    model = Encoder(TINY)
    params = make_params(TINY, ("shared",))
    rng = np.random.default_rng(1)
    batches = [make_batch(rng, 10), make_batch(rng, 20)]
    encoders = [encoder_fn(model, "shared")] * 2
    loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.1, symmetric=True)
    check_step(encoders, loss, params, batches, chunk=4, reference=full_batch(encoders, loss, None))


def test_tree_chunk_refuses_an_uneven_split_clearly():
    tree = {"input_ids": jnp.zeros((10, 3)), "attention_mask": jnp.zeros((10, 3))}
    with pytest.raises(DprGcError, match="cannot split a batch of 10 into 4 equal chunks"):
        tree_chunk(tree, 4)
    chunked = tree_chunk(tree, 5)
    assert chunked["input_ids"].shape == (5, 2, 3)
    assert tree_unchunk(chunked)["input_ids"].shape == (10, 3)
    with pytest.raises(DprGcError, match="same size"):
        tree_chunk({"a": jnp.zeros((4,)), "b": jnp.zeros((6,))}, 2)


def test_bad_sizes_are_refused_naming_the_argument():
    """A chunk count that is not an integer, a multiple of 0, and an EncoderConfig size below 1 (a head count of 0
    divided by zero, a hidden size of 0 was taken) are refused in one DprGcError naming the argument."""
    from dpr_gc.jax import pad_to_multiple

    tree = {"input_ids": jnp.zeros((4, 3))}
    for bad in (2.0, "2", True):
        with pytest.raises(DprGcError, match=f"n_chunk must be a positive integer, got {bad!r}"):
            tree_chunk(tree, bad)
    for bad in (0, -2, 1.5):
        with pytest.raises(DprGcError, match=f"multiple must be a positive integer, got {bad!r}"):
            pad_to_multiple(tree, bad)
    for field in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "max_positions", "type_vocab_size"):
        with pytest.raises(DprGcError, match=f"EncoderConfig: {field} must be a positive integer, got 0"):
            EncoderConfig(**{field: 0})
    with pytest.raises(DprGcError, match="EncoderConfig: num_layers must be an integer >= 0, got -1"):
        EncoderConfig(num_layers=-1)


def test_pad_to_multiple_repeats_the_last_row():
    """pad_to_multiple's docstring: the rows added are copies of the last row (valid inputs, no empty attention
    mask), the real rows are kept as they are, and the real size is returned; a size already a multiple is kept."""
    from dpr_gc.jax import pad_to_multiple

    tree = {"input_ids": jnp.arange(1, 11, dtype=jnp.int32).reshape(5, 2),
            "attention_mask": jnp.asarray([[1, 1]] * 4 + [[1, 0]], jnp.int32)}
    padded, size = pad_to_multiple(tree, 4)
    assert size == 5
    for name, rows in tree.items():
        assert padded[name].shape == (8, 2) and padded[name].dtype == rows.dtype
        np.testing.assert_array_equal(np.asarray(padded[name][:5]), np.asarray(rows))
        np.testing.assert_array_equal(np.asarray(padded[name][5:]), np.repeat(np.asarray(rows[-1:]), 3, axis=0))
    kept, size = pad_to_multiple(tree, 5)
    assert size == 5 and all(kept[name] is rows for name, rows in tree.items())


def test_a_chunk_larger_than_the_batch_is_the_batch():
    """A chunk of 100 on a batch of 8 runs one chunk of 8 rows (not 100, 92 of them padding), with the same numbers
    as a chunk of 8."""
    seen = []

    def encode(params, batch, key):
        seen.append(batch.shape[0])
        return jnp.tanh(batch @ params["w"])

    params = {"w": jax.random.normal(jax.random.key(0), (6, 4))}
    batches = [jax.random.normal(jax.random.key(1), (8, 6)), jax.random.normal(jax.random.key(2), (16, 6))]
    loss = ContrastiveLoss(n_hard_negatives=1)
    for build in (cached_value_and_grad, remat_value_and_grad):
        want_loss, want = build([encode, encode], loss, [8, 16])(params, {}, batches, jax.random.key(3))
        seen.clear()
        got_loss, got = build([encode, encode], loss, 100)(params, {}, batches, jax.random.key(3))
        assert set(seen) == {8, 16}, (build.__name__, seen)
        assert float(got_loss) == float(want_loss) and rel_error(got, want) == 0


def test_original_api_two_pass_and_single_decorator():
    """The original package's functions, used as its README/training code uses them, give jax.grad's result."""
    model = Encoder(TINY)
    params = make_params(TINY, ("shared",))["shared"]
    rng = np.random.default_rng(2)
    queries, passages = make_batch(rng, 8), make_batch(rng, 8)
    loss = ContrastiveLoss(temperature=0.2)

    def apply(params, input_ids, attention_mask):
        return model.apply({"params": params}, input_ids, attention_mask)

    @jax.jit
    @jax.grad
    def plain(params):
        return loss({}, apply(params, **queries), apply(params, **passages))

    want = plain(params)
    q_chunks, p_chunks = tree_chunk(queries, 4), tree_chunk(passages, 4)

    @jax.jit
    def two_pass(params):
        encode = chunk_encode(lambda **x: apply(params, **x))
        q_reps, p_reps = encode(**q_chunks), encode(**p_chunks)
        assert q_reps.shape == (4, 2, TINY.hidden_size)
        mean_loss = unchunk_args(axis=0, argnums=(0, 1))(lambda x, y: loss({}, x, y))
        q_grad, p_grad = jax.grad(mean_loss, argnums=(0, 1))(q_reps, p_reps)
        accumulate = cache_grad(apply)
        grads = jax.tree_util.tree_map(jnp.zeros_like, params)
        return accumulate(params, accumulate(params, grads, q_grad, **q_chunks), p_grad, **p_chunks)

    fwd = grad_cached(lambda params, batch: apply(params, **batch))
    remat = jax.jit(jax.grad(lambda params: loss({}, fwd(params, q_chunks), fwd(params, p_chunks))))(params)
    assert rel_error(two_pass(params), want) < 1e-5
    assert rel_error(remat, want) < 1e-5


def test_loss_is_fp32_under_bf16_and_blocks_match_dense():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(10, 8)), jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(20, 8)), jnp.bfloat16)
    loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.05, learn_temperature=True)
    value = loss(loss.init(), x, y)
    assert value.dtype == jnp.float32
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scores = x64 @ y64.T / 0.05
    m = scores.max(1, keepdims=True)
    lse = (m + np.log(np.exp(scores - m).sum(1, keepdims=True)))[:, 0]
    want = float(np.mean(lse - scores[np.arange(10), np.arange(10) * 2]))
    assert abs(float(value) - want) < 1e-6 * want
    targets = jnp.arange(10) * 2
    dense = blocked_nll(x, y, 20.0, targets, block=0)
    for block in (3, 5, 64):
        assert float(jnp.abs(blocked_nll(x, y, 20.0, targets, block=block) - dense).max()) < 1e-4
    grad = jax.grad(lambda lp: loss(lp, x, y))(loss.init())
    assert grad["log_temperature"].dtype == jnp.float32
    with pytest.raises(DprGcError, match="need 30 passages"):
        ContrastiveLoss(n_hard_negatives=2)({}, x, y)


def test_cosine_loss_and_scores_are_fp32_under_bf16():
    """docs/jax.md: scores in fp32 whatever the dtype, cosine normalised as ``F.normalize``: bf16 representations
    give the float64 cosine loss, and ``scores`` is the matrix the loss's softmax takes (similarity / temperature,
    fp32, a learnt temperature's too)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(10, 8)), jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(20, 8)), jnp.bfloat16)
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    dot = x64 @ y64.T
    cos = dot / np.linalg.norm(x64, axis=1)[:, None] / np.linalg.norm(y64, axis=1)[None, :]
    for similarity, similarities in (("dot", dot), ("cos", cos)):
        for learn in (False, True):
            loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.05, learn_temperature=learn,
                                   similarity=similarity)
            want = similarities / 0.05
            scores = loss.scores(loss.init(), x, y)
            assert scores.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(scores), want, rtol=1e-5, atol=1e-4)
            m = want.max(1, keepdims=True)
            lse = (m + np.log(np.exp(want - m).sum(1, keepdims=True)))[:, 0]
            want_loss = float(np.mean(lse - want[np.arange(10), np.arange(10) * 2]))
            assert float(loss(loss.init(), x, y)) == pytest.approx(want_loss, rel=1e-5), (similarity, learn)


def test_the_automatic_loss_blocks_hold_about_a_million_scores():
    """docs/jax.md: scores in row blocks of at most about a million (``block=None``), so the compiled loss and
    gradient of 2,048 queries against 4,096 passages (8M scores, 32 MiB in fp32) never hold the whole matrix, as the
    dense path (``block=0``) does. The plans are compiled, not run."""
    x, y = jax.ShapeDtypeStruct((2048, 8), jnp.float32), jax.ShapeDtypeStruct((4096, 8), jnp.float32)

    def temp_mib(block):
        loss = ContrastiveLoss(n_hard_negatives=1, block=block)
        step = jax.jit(jax.value_and_grad(lambda a, b: loss({}, a, b), argnums=(0, 1)))
        return step.lower(x, y).compile().memory_analysis().temp_size_in_bytes / 2**20

    auto, dense = temp_mib(None), temp_mib(0)
    assert auto <= 3 * 4 and dense >= 32, (auto, dense)  # a block of a million fp32 scores is 4 MiB


def test_importing_dpr_gc_does_not_import_jax():
    code = "import sys, dpr_gc, dpr_gc.cli, dpr_gc.train; assert 'jax' not in sys.modules, 'jax imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=SUBPROCESS_SECONDS)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_learnable_temperature_is_fp32_and_clamped():
    """docs/jax.md: the learnable temperature is kept in fp32 and clamped to the torch loss's range in every use."""
    import math

    from dpr_gc.jax.loss import TEMPERATURE_RANGE, temperature_from_log

    loss = ContrastiveLoss(temperature=0.05, learn_temperature=True)
    params = loss.init()
    assert params["log_temperature"].dtype == jnp.float32
    lo, hi = TEMPERATURE_RANGE
    for log_t, want in ((math.log(1e4), hi), (math.log(1e-6), lo), (math.log(0.05), 0.05)):
        got = loss.current_temperature({"log_temperature": jnp.asarray(log_t, jnp.bfloat16)})
        assert got.dtype == jnp.float32 and abs(float(got) - want) < 1e-2 * want  # a bf16 log value, rounded
    assert float(temperature_from_log(jnp.asarray(100.0))) == pytest.approx(hi)
    with pytest.raises(DprGcError, match=r"temperature must be a number in \[0.01, 10.0\], got 100.0"):
        ContrastiveLoss(temperature=100.0)


def test_a_temperature_past_its_bound_can_come_back_as_in_torch():
    """Past a bound the clamp keeps the gradient that moves the value back into the range and drops the one that
    pushes it further out, as the torch twin's ``Temperature`` does (a plain clip's gradient there is 0 for ever)."""
    import math

    import torch

    from dpr_gc.engine.loss import Temperature
    from dpr_gc.jax.loss import temperature_from_log

    for log_t in (math.log(20.0), math.log(1e-3)):
        for sign in (1.0, -1.0):
            got = float(jax.grad(lambda v: sign * temperature_from_log(v))(jnp.asarray(log_t, jnp.float32)))
            tau = Temperature(1.0, learnable=True)
            with torch.no_grad():
                tau.log_value.fill_(log_t)
            (sign * tau()).backward()
            assert got == pytest.approx(float(tau.log_value.grad), abs=1e-6)
            assert (got != 0.0) == ((log_t > 0) == (sign > 0))  # descent moves it back inside: kept


def test_chunk_sizes_take_numpy_integers_and_refuse_non_integers():
    """A numpy integer chunk size is one int for every encoder; a float or a bool is refused in one clear line."""
    params = make_params(TINY, ("shared",))["shared"]
    encode = encoder_fn(Encoder(TINY))
    loss = ContrastiveLoss(n_hard_negatives=1)
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, 4), make_batch(rng, 8)]
    want = cached_value_and_grad([encode, encode], loss, 4)(params, loss.init(), batches, jax.random.key(0))
    for sizes in (np.int64(4), [np.int32(4), 4], np.array([4, 4])):
        got = cached_value_and_grad([encode, encode], loss, sizes)(params, loss.init(), batches, jax.random.key(0))
        assert float(got[0]) == float(want[0]) and rel_error(got[1], want[1]) == 0
    for bad in (4.0, True, "4", [4, 2.5], np.float32(4), None):
        for build in (cached_value_and_grad, remat_value_and_grad):
            with pytest.raises(DprGcError, match="chunk sizes must be one positive integer"):
                build([encode, encode], loss, bad)


def test_an_inference_encoder_needs_no_key_and_a_training_one_says_it_does():
    """encoder_fn's docstring: dropout comes from the key only when ``train``; without it None is a fine key."""
    params = make_params(TINY, ("shared",))["shared"]
    batch = make_batch(np.random.default_rng(0), 2)
    model = Encoder(dataclasses.replace(TINY, dropout=0.1))
    reps = encoder_fn(model, train=False)(params, batch, None)
    direct = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(np.asarray(reps), np.asarray(direct), atol=1e-6)
    with pytest.raises(DprGcError, match="needs a PRNG key for dropout"):
        encoder_fn(model)(params, batch, None)


def test_a_step_without_a_key_serves_encoders_that_draw_no_dropout():
    """cached_value_and_grad's docstring: a ``key`` of None reaches every encoder as None, which an inference
    encoder_fn takes (the same numbers as with a key) and a training one refuses in one line; another kind of key
    is named, not handed to ``jax.random.split``."""
    params = make_params(TINY, ("shared",))["shared"]
    model = Encoder(dataclasses.replace(TINY, dropout=0.1))
    loss = ContrastiveLoss(n_hard_negatives=1)
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, 3), make_batch(rng, 6)]
    inference, training = encoder_fn(model, train=False), encoder_fn(model)
    for build in (cached_value_and_grad, remat_value_and_grad):
        step = build([inference, inference], loss, 2)
        want_loss, want = step(params, {}, batches, jax.random.key(0))
        got_loss, got = jax.jit(step)(params, {}, batches, None)
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6) and rel_error(got, want) < 1e-6
        with pytest.raises(DprGcError, match="needs a PRNG key for dropout"):
            build([training, training], loss, 2)(params, {}, batches, None)
        with pytest.raises(DprGcError, match="key must be a PRNG key .* or None when no encoder draws dropout; got"):
            step(params, {}, batches, 0)


def test_a_learnable_temperature_without_its_params_says_to_pass_loss_init():
    loss = ContrastiveLoss(n_hard_negatives=1, learn_temperature=True)
    queries, passages = jnp.ones((2, 4)), jnp.ones((4, 4))
    for given in ({}, None, {"temperature": 0.1}):
        with pytest.raises(DprGcError, match=r"pass the params from loss\.init\(\)"):
            loss(given, queries, passages)
    assert loss.init()["log_temperature"].dtype == jnp.float32


def test_a_zero_representation_keeps_cosine_gradients_finite_as_in_torch():
    """An all-zero representation under ``similarity="cos"`` (an all-padding row under mean pooling) normalises as
    torch's ``F.normalize`` does: finite gradients equal to the torch loss's, also through the cached step."""
    import torch

    from dpr_gc import SimpleContrastiveLoss

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(6, 8)).astype(np.float32)
    y[5], y[4] = 0.0, 1e-14  # a zero row and one below F.normalize's eps
    loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.1, similarity="cos")
    value, (gx, gy) = jax.value_and_grad(lambda a, b: loss({}, a, b), argnums=(0, 1))(x, y)
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    want = SimpleContrastiveLoss(1, temperature=0.1, similarity="cos")(tx, ty)
    want.backward()
    assert float(value) == pytest.approx(want.item(), rel=1e-6)
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gy), ty.grad.numpy(), rtol=1e-5, atol=1e-6)

    params = make_params(TINY, ("shared",))["shared"]
    encode = encoder_fn(Encoder(TINY), train=False)
    batches = [make_batch(rng, 4), make_batch(rng, 8)]
    batches[1]["attention_mask"] = batches[1]["attention_mask"].at[7].set(0)  # a passage row of padding only
    _, (grads, _) = jax.jit(cached_value_and_grad([encode, encode], loss, 3))(params, {}, batches, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
    _, (want_grads, _) = full_batch([encode, encode], loss, None)(params, {}, batches, jax.random.key(0))
    assert rel_error(grads, want_grads) < 1e-5


def _duplicate_ids_batch(queries: int, group: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Representations and passage ids with every kind of copy: queries sharing a positive, a hard negative that is
    another query's positive and one that is the query's own, an unknown id (-1), across both halves of the batch."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(queries, 8)).astype(np.float32)
    ids = np.arange(100, 100 + queries * group)
    ids[group] = ids[0]                    # queries 0 and 1 share a positive
    ids[-1] = ids[0]                       # the last hard negative (second half) is query 0's positive
    if group > 1:
        ids[1] = ids[0]                    # query 0's hard negative is its own positive
        ids[2 * group + 1] = ids[group * (queries - 1)]  # a first-half query's negative: the last query's positive
    ids[3 * group] = -1                    # an unknown id masks nothing
    y = rng.normal(size=(queries * group, 8)).astype(np.float32)
    return x, y, ids


def test_passage_ids_mask_duplicate_positives_as_the_torch_loss():
    """``ContrastiveLoss(...)(lp, q, p, passage_ids)`` masks exactly the copies the torch loss masks: same loss and
    gradients (queries, passages, temperature) for dot/cos, hard negatives, symmetric, blocked and dense."""
    import torch

    from dpr_gc import SimpleContrastiveLoss
    from dpr_gc.jax.example import masked_copies

    for n, kwargs in ((1, dict(similarity="cos", temperature=0.1)), (0, dict(symmetric=True, temperature=0.5)),
                      (2, dict(similarity="cos", temperature=0.05, learn_temperature=True, symmetric=True)),
                      (1, dict(temperature=0.2, learn_temperature=True, symmetric=True))):
        x, y, ids = _duplicate_ids_batch(6, 1 + n)
        for block in (None, 0, 4):
            loss = ContrastiveLoss(n, block=block, **kwargs)
            value, grads = jax.value_and_grad(lambda lp, a, b: loss(lp, a, b, jnp.asarray(ids)), argnums=(0, 1, 2))(
                loss.init(), x, y)
            twin = SimpleContrastiveLoss(n, loss_chunk_size=block, **kwargs)
            tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
            want = twin(tx, ty, passage_ids=torch.tensor(ids))
            want.backward()
            assert twin.masked_scores == masked_copies(ids, 1 + n) > 0
            assert float(value) == pytest.approx(want.item(), rel=1e-5), (n, kwargs, block)
            assert float(value) != pytest.approx(float(loss(loss.init(), x, y)), rel=1e-3)  # the mask mattered
            np.testing.assert_allclose(np.asarray(grads[1]), tx.grad.numpy(), rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(np.asarray(grads[2]), ty.grad.numpy(), rtol=1e-4, atol=1e-6)
            if kwargs.get("learn_temperature"):
                assert float(grads[0]["log_temperature"]) == pytest.approx(float(twin.tau.log_value.grad), rel=1e-4)


def test_unknown_passage_ids_mask_nothing_as_in_torch():
    """``-1`` is an unknown id (docs/jax.md): rows of unknown id are no copies of each other. All unknown, the loss
    is the unmasked one; some unknown, it is the torch loss's with the same ids."""
    import torch

    from dpr_gc import SimpleContrastiveLoss

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)
    y[4] = y[2]                            # queries 1 and 2 share passage 7, and score near it
    x[1:3] = y[2] + 0.3 * rng.normal(size=(2, 8)).astype(np.float32)
    for kwargs in (dict(similarity="cos", temperature=0.1), dict(temperature=0.5, symmetric=True)):
        loss = ContrastiveLoss(1, **kwargs)
        unknown = jnp.full((8,), -1, jnp.int32)
        assert float(loss({}, x, y, unknown)) == pytest.approx(float(loss({}, x, y)), rel=1e-6), kwargs
        ids = np.asarray([-1, -1, 7, -1, 7, 3, -1, -1])
        twin = SimpleContrastiveLoss(1, **kwargs)
        want = twin(torch.tensor(x), torch.tensor(y), passage_ids=torch.tensor(ids)).item()
        assert float(loss({}, x, y, jnp.asarray(ids, jnp.int32))) == pytest.approx(want, rel=1e-5), kwargs
        assert want != pytest.approx(float(loss({}, x, y)), rel=1e-3)  # the two copies of 7 were masked


def _ids_steps_match_full_batch(data_parallel: bool) -> None:
    """The cached and rematerialised steps (on one device, or on two with the ids split with the batch) given
    ``passage_ids`` equal ``jax.grad`` of the full-batch masked loss."""
    def encode_q(params, batch, key):
        return jnp.tanh(batch @ params["q"])

    def encode_p(params, batch, key):
        return jnp.tanh(batch @ params["p"])

    rng = np.random.default_rng(1)
    params = {"q": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
              "p": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)}
    queries, passages, ids = _duplicate_ids_batch(8, 2)
    ids = jnp.asarray(ids)
    kwargs = dict(n_hard_negatives=1, temperature=0.2, learn_temperature=True, similarity="cos", symmetric=True)
    single = ContrastiveLoss(**kwargs)
    want_loss, want = jax.value_and_grad(
        lambda p, lp: single(lp, encode_q(p, queries, None), encode_p(p, passages, None), ids), argnums=(0, 1))(
        params, single.init())
    unmasked = single(single.init(), encode_q(params, queries, None), encode_p(params, passages, None))
    assert abs(float(want_loss - unmasked)) > 1e-3
    for remat in (False, True):
        if data_parallel:
            loss = ContrastiveLoss(**kwargs, axis_name="data")
            step = data_parallel_value_and_grad([encode_q, encode_p], loss, [3, 4], data_mesh(jax.devices()[:2]),
                                                remat=remat)
        else:
            loss = single
            step = (remat_value_and_grad if remat else cached_value_and_grad)([encode_q, encode_p], loss, [3, 5])
        got_loss, got = jax.jit(step)(params, loss.init(), [queries, passages], jax.random.key(0), ids)
        assert abs(float(got_loss - want_loss)) < 1e-5 * abs(float(want_loss)), remat
        assert rel_error(got, want) < 1e-5, remat


def test_passage_ids_through_the_cached_steps_equal_the_full_batch_gradient():
    _ids_steps_match_full_batch(data_parallel=False)


def test_passage_ids_through_the_data_parallel_step_equal_the_full_batch_gradient():
    on_two_devices(lambda: _ids_steps_match_full_batch(data_parallel=True), "_ids_steps_match_full_batch(True)")


def test_dropout_outside_zero_to_one_is_refused():
    """A dropout of 1 or more zeroes the encoder's output (then a NaN loss); a negative one silently meant none."""
    from dpr_gc.jax.example import ExampleConfig

    for bad in (1.5, 1.0, -0.3):
        with pytest.raises(DprGcError, match=r"dropout must lie in \[0, 1\)"):
            EncoderConfig(dropout=bad)
        with pytest.raises(DprGcError, match=r"--dropout must lie in \[0, 1\)"):
            ExampleConfig(dropout=bad)


def test_bad_library_arguments_are_refused_with_a_clear_error():
    """ContrastiveLoss's block and n_hard_negatives, a switch that is not True or False, a temperature that is not a
    number in range, and an empty batch are refused in one clear DprGcError (as the torch loss refuses a negative
    loss_chunk_size, symmetric="no" or temperature="0.05"); a Python float log temperature is taken as fp32."""
    for name in ("learn_temperature", "symmetric"):
        for bad in ("no", 1, None):
            with pytest.raises(DprGcError, match=f"{name} must be True or False, got {bad!r}"):
                ContrastiveLoss(1, **{name: bad})
    for bad in ("0.05", None, True, 100.0, float("nan")):
        with pytest.raises(DprGcError, match=r"temperature must be a number in \[0.01, 10.0\], got "):
            ContrastiveLoss(1, temperature=bad)
    assert ContrastiveLoss(1, temperature=np.float32(0.05), symmetric=True, learn_temperature=True).symmetric
    for block in (-1, -3, 2.5, True):
        with pytest.raises(DprGcError, match="block must be a positive number of score rows per block, 0 for the"):
            ContrastiveLoss(1, block=block)
    for n in (1.5, -1, True):
        with pytest.raises(DprGcError, match="n_hard_negatives must be an integer >= 0"):
            ContrastiveLoss(n)
    x, y = jnp.ones((4, 8)), jnp.ones((8, 8))
    assert float(ContrastiveLoss(1, block=np.int64(2))({}, x, y)) == pytest.approx(float(ContrastiveLoss(1)({}, x, y)))
    loss = ContrastiveLoss(1, learn_temperature=True)
    assert float(loss({"log_temperature": 0.0}, x, y)) == pytest.approx(float(ContrastiveLoss(1)({}, x, y)))

    def encode(params, batch, key):
        return batch @ params["w"]

    for build in (cached_value_and_grad, remat_value_and_grad):
        with pytest.raises(DprGcError, match=r"batch 1 is empty \(0 rows\)"):
            build([encode, encode], ContrastiveLoss(), 2)({"w": jnp.ones((8, 4))}, {},
                                                          [jnp.ones((2, 8)), jnp.ones((0, 8))], jax.random.key(0))
