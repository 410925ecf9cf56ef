"""Gradient Cache for JAX: cached gradients equal full-batch ``jax.grad``, data parallel equals one device, memory is
flat in the batch, the original package's API works on current JAX, and the Flax encoder matches BERT.

Two fake CPU devices come from ``XLA_FLAGS``, which JAX reads when its backend starts; if another test started the
backend first with one device, the data-parallel test re-runs itself in a subprocess with the flag set.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Callable
from pathlib import Path

import numpy as np
import pytest

DEVICE_FLAG = "--xla_force_host_platform_device_count=2"
SUBPROCESS_SECONDS = 600  # a hung process is killed, never waited for
if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}".strip()

jax = pytest.importorskip("jax")
import jax.flatten_util  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dpr_gc.base.errors import DprGcError  # noqa: E402
from dpr_gc.jax import (ContrastiveLoss, Encoder, EncoderConfig, blocked_nll, cache_grad, cache_train_step,  # noqa: E402
                        cached_value_and_grad, cast_params, chunk_encode, data_mesh, data_parallel_value_and_grad,
                        encoder_fn, grad_cached, load_bert, remat_value_and_grad, tree_chunk, tree_unchunk,
                        unchunk_args)

REPO = Path(__file__).resolve().parents[1]
VOCAB, LENGTH = 50, 8
TINY = EncoderConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                     max_positions=LENGTH, dropout=0.0)


@pytest.fixture(scope="module", autouse=True)
def quick_compiles():
    """Compile with XLA's optimisations off: these tests check numbers and memory layout, not speed, and compiling
    is most of their time (the memory figures are the same either way; benchmarks/bench_jax_memory.py measures
    them with full optimisation)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def make_params(config: EncoderConfig, names: tuple[str, ...], length: int = LENGTH) -> dict:
    init = jax.jit(Encoder(config).init)
    ones = jnp.ones((2, length), jnp.int32)
    return {name: init(jax.random.key(i), ones, ones)["params"] for i, name in enumerate(names)}


def make_batch(rng: np.random.Generator, n: int, length: int = LENGTH) -> dict:
    lengths = rng.integers(1, length + 1, n)
    return {"input_ids": jnp.asarray(rng.integers(1, VOCAB, (n, length)), jnp.int32),
            "attention_mask": jnp.asarray(np.arange(length)[None] < lengths[:, None], jnp.int32)}


def rel_error(a, b) -> float:
    fa, fb = jax.flatten_util.ravel_pytree(a)[0], jax.flatten_util.ravel_pytree(b)[0]
    return float(jnp.linalg.norm(fa - fb) / jnp.linalg.norm(fb))


def full_batch(encoders, loss, chunk: int | None):
    """Reference: the plain full-batch loss, ``jax.grad``-ed. With ``chunk`` every encoder is applied per chunk
    with the per-chunk dropout keys Gradient Cache uses (the batch must divide), otherwise to the whole batch."""
    def total(params, loss_params, batches, key):
        reps = []
        for enc, batch, k in zip(encoders, batches, jax.random.split(key, len(encoders))):
            if chunk is None:
                reps.append(enc(params, batch, k))
                continue
            n = batch["input_ids"].shape[0] // chunk
            keys = jax.random.split(k, n)
            reps.append(jnp.concatenate([enc(params, jax.tree_util.tree_map(lambda v: v[i * chunk:(i + 1) * chunk],
                                                                             batch), keys[i]) for i in range(n)]))
        return loss(loss_params, *reps)

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1)))


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


def sgd_step_setup(rows: int) -> tuple:
    """For cache_train_step's tests: the tiny encoder's parameters, an SGD (lr 1) train state over them, a batch of
    ``rows`` queries and passages, the loss and its per-query form (every row the batch's loss)."""
    optax = pytest.importorskip("optax")
    from flax.training.train_state import TrainState

    model = Encoder(TINY)
    params = make_params(TINY, ("shared",))["shared"]
    rng = np.random.default_rng(3)
    queries, passages = make_batch(rng, rows), make_batch(rng, rows)
    loss = ContrastiveLoss(temperature=0.2)
    state = TrainState.create(apply_fn=lambda params, **x: model.apply({"params": params}, **x), params=params,
                              tx=optax.sgd(1.0))

    def per_query(xx, yy, axis):
        return loss({}, xx, yy)[None].repeat(xx.shape[0])

    return params, state, queries, passages, loss, per_query


def test_cache_train_step_updates_like_sgd_on_the_full_batch():
    params, state, queries, passages, loss, per_query = sgd_step_setup(6)
    step = jax.vmap(lambda s, ss, tt: cache_train_step(per_query, s, ss, tt, axis="device"), in_axes=(None, 0, 0),
                    axis_name="device")
    loss_value, new_state = jax.jit(step)(state, tree_chunk(tree_chunk(queries, 3), 1), tree_chunk(
        tree_chunk(passages, 3), 1))
    grads = jax.jit(jax.grad(lambda p: loss({}, state.apply_fn(p, **queries), state.apply_fn(p, **passages))))(params)
    expected = jax.tree_util.tree_map(lambda p, g: p - g, params, grads)
    assert rel_error(jax.tree_util.tree_map(lambda v: v[0], new_state.params), expected) < 1e-6


def test_cache_train_step_averages_loss_and_gradients_over_its_axis():
    """cache_train_step's docstring: loss and gradients are averaged over ``axis``. Two vmapped devices, each with
    its own half of the batch in two chunks and a loss of its own half, make the SGD step of the two halves' mean."""
    params, state, queries, passages, loss, per_query = sgd_step_setup(8)

    def on_devices(batch):  # [device, chunk, rows, ...]: each device's half, in two chunks
        return tree_chunk(tree_chunk(batch, 2), 2, axis=1)

    def half_loss(p, half):
        rows = jax.tree_util.tree_map(lambda v: v[half * 4:(half + 1) * 4], (queries, passages))
        return loss({}, state.apply_fn(p, **rows[0]), state.apply_fn(p, **rows[1]))

    step = jax.vmap(lambda s, ss, tt: cache_train_step(per_query, s, ss, tt, axis="device"), in_axes=(None, 0, 0),
                    axis_name="device")
    values, new_state = jax.jit(step)(state, on_devices(queries), on_devices(passages))
    want_loss, grads = jax.jit(jax.value_and_grad(lambda p: (half_loss(p, 0) + half_loss(p, 1)) / 2))(params)
    expected = jax.tree_util.tree_map(lambda p, g: p - g, params, grads)
    assert np.allclose(np.asarray(values), float(want_loss), rtol=1e-5)
    for device in (0, 1):
        assert rel_error(jax.tree_util.tree_map(lambda v: v[device], new_state.params), expected) < 1e-6


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


def test_bf16_compute_from_fp32_master_weights_gives_fp32_gradients_and_loss():
    """An encoder that casts fp32 master weights to bf16 for its forward: the loss is fp32 and the gradients come
    back fp32, ready for an fp32 optimizer update (bf16 parameters given directly get bf16 gradients)."""
    model = Encoder(TINY)
    params = make_params(TINY, ("shared",))
    rng = np.random.default_rng(5)
    encode = encoder_fn(model, "shared")
    encoders = [lambda p, b, k: encode(cast_params(p, jnp.bfloat16), b, k)] * 2
    loss = ContrastiveLoss(temperature=0.1)
    batches = [make_batch(rng, 8), make_batch(rng, 8)]
    value, (grads, _) = jax.jit(cached_value_and_grad(encoders, loss, 4))(params, {}, batches, jax.random.key(0))
    assert value.dtype == jnp.float32 and bool(jnp.isfinite(value))
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(jnp.float32)}
    _, (bf16_grads, _) = jax.jit(cached_value_and_grad([encode] * 2, loss, 4))(
        cast_params(params, jnp.bfloat16), {}, batches, jax.random.key(0))
    assert {g.dtype for g in jax.tree_util.tree_leaves(bf16_grads)} == {jnp.dtype(jnp.bfloat16)}


def test_the_examples_bf16_training_updates_fp32_master_weights(tiny_tokenizer, monkeypatch):
    """``--precision bf16`` computes in bf16 but keeps fp32 weights for AdamW: every kernel and LayerNorm scale
    moves (in bf16 storage an update of ~lr rounds away) and the update is about the fp32 run's size."""
    from dpr_gc.jax import example

    monkeypatch.setattr(example, "RANDOM_MODEL", dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    words = ["city", "river", "king", "war", "protein", "cell", "gene", "music"]
    questions = [f"what is the {w}" for w in words]
    groups = [[f"the {w} is {w}", f"a film about {o}"] for w, o in zip(words, reversed(words))]
    updates = {}
    for precision in ("fp32", "bf16"):
        config = example.ExampleConfig(init="random", train_queries=8, batch_size=4, chunk_size=2, hard_negatives=1,
                                       epochs=2, dropout=0.0, query_max_length=8, passage_max_length=8,
                                       precision=precision)
        model, params = example.initial_params(config, "", len(tiny_tokenizer))
        trained, _ = example.train(model, params, tiny_tokenizer, questions, groups, config)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        for (path, before), after in zip(flat, jax.tree_util.tree_leaves(trained)):
            assert before.dtype == after.dtype == jnp.float32, (precision, path)
            moved = float(jnp.mean(before != after))
            if path[-1].key in ("kernel", "scale"):
                assert moved > 0.9, (precision, jax.tree_util.keystr(path), moved)
        updates[precision] = rel_error(trained, params)
    assert 0.5 < updates["bf16"] / updates["fp32"] < 2, updates


def test_the_examples_bf16_evaluation_encodes_with_bf16_weights(tiny_tokenizer, monkeypatch):
    """docs/jax.md: ``--precision bf16`` runs the encoder in bf16 in evaluation too (fp32 under fp32): the passages
    and the questions are encoded with the weights in the run's precision."""
    from dpr_gc.jax import example

    model = Encoder(EncoderConfig(**{**TINY.__dict__, "vocab_size": len(tiny_tokenizer)}))
    params = make_params(model.config, ("x",))["x"]
    corpus = [("p0", "", "the city is city"), ("p1", "", "the river is river")]
    questions = [{"question": "what is the city", "answers": ["city"]}]
    seen, encode = [], example.encode_texts
    monkeypatch.setattr(example, "encode_texts", lambda model, weights, *args, **kwargs: seen.append(
        {leaf.dtype for leaf in jax.tree_util.tree_leaves(weights)}) or encode(model, weights, *args, **kwargs))
    for precision, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        seen.clear()
        config = example.ExampleConfig(precision=precision, query_max_length=8, passage_max_length=8)
        accuracy = example.evaluate_model(model, params, tiny_tokenizer, corpus, questions, config)
        assert seen == [{jnp.dtype(dtype)}] * 2 and accuracy, (precision, seen)


def _data_parallel_matches_one_device() -> None:
    model = Encoder(TINY)
    params = make_params(TINY, ("query", "passage"))
    rng = np.random.default_rng(6)
    batches = [make_batch(rng, 8), make_batch(rng, 16)]
    encoders = [encoder_fn(model, "query", train=False), encoder_fn(model, "passage", train=False)]
    kwargs = dict(n_hard_negatives=1, temperature=0.3, learn_temperature=True, symmetric=True)
    single = ContrastiveLoss(**kwargs)
    want_loss, want = jax.jit(cached_value_and_grad(encoders, single, 2))(params, single.init(), batches,
                                                                           jax.random.key(0))
    mesh = data_mesh(jax.devices()[:2])
    spread = ContrastiveLoss(**kwargs, axis_name="data")
    for remat, key in ((False, jax.random.key(0)), (True, jax.random.key(0)), (False, None)):
        step = jax.jit(data_parallel_value_and_grad(encoders, spread, 2, mesh, remat=remat))
        got_loss, got = step(params, spread.init(), batches, key)
        assert abs(float(got_loss - want_loss)) < 1e-5 * abs(float(want_loss))
        assert rel_error(got, want) < 1e-5


def on_two_devices(check: Callable[[], None], call: str) -> None:
    """Run ``check`` here when JAX has two devices, else ``t.CALL`` in a subprocess with two XLA host devices
    (killed after ``SUBPROCESS_SECONDS``)."""
    if len(jax.devices()) >= 2:
        check()
        return
    env = {**os.environ, "XLA_FLAGS": DEVICE_FLAG, "PYTHONPATH": str(REPO)}
    code = ("import tests.test_jax as t, jax; assert len(jax.devices()) == 2; "
            f"jax.config.update('jax_disable_most_optimizations', True); t.{call}")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]


def test_data_parallel_on_two_devices_equals_the_global_batch():
    on_two_devices(_data_parallel_matches_one_device, "_data_parallel_matches_one_device()")


def _data_parallel_dropout_keys_are_per_device() -> None:
    """With dropout, each device draws from ``fold_in(key, device index)`` (data_parallel_value_and_grad's
    docstring): the step equals the global-batch loss whose device shares are encoded with those keys, chunk by
    chunk as one device's step draws them, so no two devices share a dropout mask."""
    def encode(params, batch, key):
        keep = jax.random.bernoulli(key, 0.5, (batch.shape[0], params["w"].shape[1]))
        return jnp.where(keep, jnp.tanh(batch @ params["w"]), 0.0) * 2

    rng = np.random.default_rng(8)
    params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
    queries, passages = (jnp.asarray(rng.normal(size=(n, 6)), jnp.float32) for n in (4, 8))
    key, single = jax.random.key(5), ContrastiveLoss(n_hard_negatives=1, temperature=0.5)

    def global_loss(params):
        reps = [[], []]
        for device in (0, 1):
            for i, (batch, k) in enumerate(zip((queries, passages), jax.random.split(jax.random.fold_in(key, device)))):
                share = batch[device * len(batch) // 2:(device + 1) * len(batch) // 2]
                chunks = len(share) // 2
                reps[i] += [encode(params, share[c * 2:(c + 1) * 2], ck)
                            for c, ck in enumerate(jax.random.split(k, chunks))]
        return single({}, jnp.concatenate(reps[0]), jnp.concatenate(reps[1]))

    want_loss, want = jax.value_and_grad(global_loss)(params)
    spread = ContrastiveLoss(n_hard_negatives=1, temperature=0.5, axis_name="data")
    for remat in (False, True):
        step = data_parallel_value_and_grad([encode, encode], spread, 2, data_mesh(jax.devices()[:2]), remat=remat)
        got_loss, (got, _) = jax.jit(step)(params, {}, [queries, passages], key)
        assert abs(float(got_loss - want_loss)) < 1e-5 * abs(float(want_loss)), remat
        assert rel_error(got, want) < 1e-5, remat


def test_data_parallel_devices_draw_their_own_dropout_keys():
    on_two_devices(_data_parallel_dropout_keys_are_per_device, "_data_parallel_dropout_keys_are_per_device()")


def test_compiled_memory_is_flat_in_the_batch():
    """Temporary memory of the compiled Gradient Cache step at batch 1,024 is within 1.3x of batch 64 (chunk 16),
    while the plain full-batch step's grows with the batch."""
    length = 64
    config = EncoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=128,
                           max_positions=length, dropout=0.0)
    model = Encoder(config)
    params = make_params(config, ("shared",), length)
    encoders = [encoder_fn(model, "shared")] * 2
    loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.05, similarity="cos", block=32)

    def plain(params, loss_params, batches, key):
        return jax.value_and_grad(lambda p: loss(loss_params, *[e(p, b, key) for e, b in zip(encoders, batches)]))(
            params)

    def temp_bytes(step, batch: int) -> int:
        ones = jnp.ones((batch, length), jnp.int32)
        batches = [{"input_ids": ones, "attention_mask": ones}, {"input_ids": ones.repeat(2, 0),
                                                                  "attention_mask": ones.repeat(2, 0)}]
        compiled = jax.jit(step).lower(params, {}, batches, jax.random.key(0)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    cached = cached_value_and_grad(encoders, loss, 16)
    small, large = temp_bytes(cached, 64), temp_bytes(cached, 1024)
    assert large <= 1.3 * small, (small, large)
    plain_small, plain_large = temp_bytes(plain, 64), temp_bytes(plain, 1024)
    assert plain_large > 8 * plain_small and plain_large > 20 * large, (plain_small, plain_large, large)


def test_flax_encoder_loads_a_bert_checkpoint_and_matches_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.helpers import tiny_bert

    bert = tiny_bert(VOCAB, seed=3).eval()
    bert.save_pretrained(tmp_path)
    config, params = load_bert(tmp_path, dropout=0.0)
    assert config.num_layers == 2 and config.hidden_size == 32
    rng = np.random.default_rng(7)
    batch = make_batch(rng, 4, 12)
    with torch.no_grad():
        out = bert(input_ids=torch.as_tensor(np.array(batch["input_ids"])).long(),
                   attention_mask=torch.as_tensor(np.array(batch["attention_mask"])).long()).last_hidden_state
    mask = np.asarray(batch["attention_mask"], np.float32)[:, :, None]
    want = (out.numpy() * mask).sum(1) / mask.sum(1)
    got = Encoder(config).apply({"params": params}, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(DprGcError, match="only BERT"):
        load_bert(tmp_path)


def test_cls_pooling_is_the_first_tokens_state_as_in_torch(tmp_path):
    """The encoder's other pooling (model.py: mean or CLS): ``load_bert(..., pooling="cls")`` gives the torch BERT's
    first-token state."""
    torch = pytest.importorskip("torch")
    from tests.helpers import tiny_bert

    bert = tiny_bert(VOCAB, seed=3).eval()
    bert.save_pretrained(tmp_path)
    config, params = load_bert(tmp_path, pooling="cls", dropout=0.0)
    batch = make_batch(np.random.default_rng(7), 4, 12)
    with torch.no_grad():
        out = bert(input_ids=torch.as_tensor(np.array(batch["input_ids"])).long(),
                   attention_mask=torch.as_tensor(np.array(batch["attention_mask"])).long()).last_hidden_state
    got = Encoder(config).apply({"params": params}, batch["input_ids"], batch["attention_mask"])
    np.testing.assert_allclose(np.asarray(got), out[:, 0].numpy(), atol=1e-5)


def test_importing_dpr_gc_does_not_import_jax():
    code = "import sys, dpr_gc, dpr_gc.cli, dpr_gc.train; assert 'jax' not in sys.modules, 'jax imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=SUBPROCESS_SECONDS)
    assert done.returncode == 0, done.stderr[-2000:]


def test_example_training_lowers_the_loss(tiny_tokenizer):
    """The example's training loop (Gradient Cache, AdamW, dropout keys) on one repeated batch of 8 questions."""
    from dpr_gc.jax.example import ExampleConfig, encode_texts, padded_token_ids, train

    words = ["city", "river", "king", "war", "protein", "cell", "gene", "music"]
    questions = [f"what is the {w}" for w in words]
    groups = [[f"the {w} is {w}", f"a film about {other}"] for w, other in zip(words, reversed(words))]
    config = ExampleConfig(train_queries=8, batch_size=8, chunk_size=3, hard_negatives=1, epochs=4,
                           learning_rate=3e-3, temperature=0.1, dropout=0.0, query_max_length=8,
                           passage_max_length=8)
    model = Encoder(EncoderConfig(**{**TINY.__dict__, "vocab_size": len(tiny_tokenizer)}))
    params = make_params(model.config, ("x",))["x"]
    trained, losses = train(model, params, tiny_tokenizer, questions, groups, config)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05, losses
    assert rel_error(trained, params) > 1e-3
    reps = encode_texts(model, trained, tiny_tokenizer, questions[:5], 8, batch_size=4)
    batch = padded_token_ids(tiny_tokenizer, questions[:5], 8)
    direct = np.asarray(model.apply({"params": trained}, batch["input_ids"], batch["attention_mask"]))
    np.testing.assert_allclose(reps, direct / np.linalg.norm(direct, axis=1, keepdims=True), atol=1e-5)


def test_the_example_trains_with_dropout_new_keys_shuffled_batches_and_linear_decay(tiny_tokenizer, monkeypatch):
    """docs/jax.md's example and its --help: dropout is on in training (the first step's loss is not the
    dropout-free one), every step draws a new dropout key, every epoch takes the questions in a new order (--seed's
    batch order), and AdamW's learning rate decays linearly from --learning-rate to 0 over the steps."""
    from dpr_gc.jax import example

    words = ["city", "river", "king", "war", "protein", "cell", "gene", "music"]
    questions = [f"what is the {w}" for w in words]
    groups = [[f"the {w} is {w}", f"a film about {other}"] for w, other in zip(words, reversed(words))]
    keys, rows, schedules = [], [], []
    build_step, adamw = example.cached_value_and_grad, example.optax.adamw

    def spied_build(encoders, loss, chunk_sizes):
        step = build_step(encoders, loss, chunk_sizes)

        def spied(params, loss_params, batches, key, ids):  # every passage is its own: id // 2 is its question
            jax.debug.callback(lambda k, i: (keys.append(np.asarray(k)), rows.append(np.asarray(i)[::2] // 2)),
                               jax.random.key_data(key), ids)
            return step(params, loss_params, batches, key, ids)

        return spied

    monkeypatch.setattr(example, "cached_value_and_grad", spied_build)
    monkeypatch.setattr(example.optax, "adamw", lambda rate, **kwargs: schedules.append(rate) or adamw(rate, **kwargs))
    config = example.ExampleConfig(train_queries=8, batch_size=4, chunk_size=2, hard_negatives=1, epochs=2,
                                   learning_rate=1e-3, temperature=0.1, dropout=0.3, query_max_length=8,
                                   passage_max_length=8)
    model = Encoder(EncoderConfig(**{**TINY.__dict__, "vocab_size": len(tiny_tokenizer), "dropout": 0.3}))
    params = make_params(model.config, ("x",))["x"]
    _, losses = example.train(model, params, tiny_tokenizer, questions, groups, config)
    assert len(losses) == len(keys) == len({k.tobytes() for k in keys}) == 4
    epochs = [np.concatenate(rows[:2]), np.concatenate(rows[2:])]
    assert all(sorted(order) == list(range(8)) for order in epochs) and not np.array_equal(*epochs), epochs
    first = [questions[i] for i in rows[0]], [t for i in rows[0] for t in groups[i]]
    batches = [example.padded_token_ids(tiny_tokenizer, texts, 8, pad_to=8, kind=kind)
               for texts, kind in zip(first, ("query", "passage"))]
    reps = [model.apply({"params": params}, b["input_ids"], b["attention_mask"]) for b in batches]
    no_dropout = float(ContrastiveLoss(n_hard_negatives=1, temperature=0.1, similarity="cos")({}, *reps))
    assert abs(losses[0] - no_dropout) > 1e-3 * abs(no_dropout), (losses[0], no_dropout)
    assert [float(schedules[0](i)) for i in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


def test_example_refuses_bad_flags_with_a_one_line_error(capsys):
    from dpr_gc.jax.example import main

    assert main(["--train-queries", "10", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --train-queries 10 must be at least --batch-size 64") and "\n" not in err


def test_the_example_logs_its_backend_and_chunks_and_ends_with_the_summary_table(tiny_tokenizer, tmp_path, caplog,
                                                                                   capsys, monkeypatch):
    """As the dpr-gc commands: the toolkit's log with JAX's own INFO lines (a TPU backend it did not find) kept
    quiet, a line on backend, precision, steps and chunks, and the before/after table followed by the closing
    ``| item | value |`` summary naming the report.json written."""
    import logging

    from dpr_gc.jax import example
    from dpr_gc.model import pretrained
    from tests.helpers import summary_rows

    tiny_tokenizer.save_pretrained(tmp_path / "tokenizer")
    monkeypatch.setattr(pretrained, "default_model_path", lambda: str(tmp_path / "tokenizer"))
    monkeypatch.setattr(example, "RANDOM_MODEL", dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    argv = ["--output", str(tmp_path / "run"), "--init", "random", "--max-examples", "12", "--train-queries", "4",
            "--batch-size", "4", "--chunk-size", "3", "--query-max-length", "16", "--passage-max-length", "32"]
    caplog.set_level(logging.INFO)
    during = []  # whether JAX's backend logger passes INFO lines while the example runs (after it: as before it)
    run_example = example.run_example
    monkeypatch.setattr(example, "run_example", lambda config: during.append(
        logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.INFO)) or run_example(config))
    assert example.main(argv) == 0
    assert during == [False]
    messages = [r.getMessage() for r in caplog.records if r.name == example.__name__]
    assert any(re.fullmatch(r"training on JAX \S+'s cpu backend \((1 device|\d devices), the step on one\), precision "
                            r"fp32, 1 step of 4 queries and 8 passages, Gradient Cache chunks of 3 queries and 3 "
                            r"passages", m)
               for m in messages), messages
    printed = capsys.readouterr().out
    assert "| metric (held-out test) | before training | after training |" in printed
    rows = summary_rows(printed)
    assert rows["report"] == str(tmp_path / "run" / "report.json") and (tmp_path / "run" / "report.json").is_file()
    assert (rows["precision"], rows["steps"], rows["batch (queries)"], rows["chunk size"]) == ("fp32", "1", "4", "3")
    assert re.match(r"cpu \((1 device|\d devices), the step on one\)", rows["backend"]), rows


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


def test_the_jax_pages_code_runs_as_written(tiny_tokenizer, tmp_path):
    """docs/jax.md's code block, run as printed with a tiny BERT folder where it names the offline MiniLM: its loss
    is the full-batch loss and its gradient that of jax.grad over the whole batch (chunks of 2 with their keys)."""
    from tests.helpers import tiny_bert

    page = (REPO / "docs" / "jax.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 1 and "default_model_path()" in blocks[0]
    tiny_bert(len(tiny_tokenizer), seed=2).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    scope: dict = {}
    exec(blocks[0].replace("default_model_path()", repr(str(tmp_path))), scope)  # noqa: S102 (the page's own code)
    loss, encode, params = scope["loss"], scope["encode"], scope["params"]
    batches, key = [scope["query_batch"], scope["passage_batch"]], scope["key"]
    want_loss, want = full_batch([encode, encode], loss, 2)(params, loss.init(), batches, key)
    assert float(scope["value"]) == pytest.approx(float(want_loss), rel=1e-5)
    assert rel_error((scope["grads"], scope["loss_grads"]), want) < 1e-5


def test_the_docs_describe_the_examples_defaults():
    """docs/jax.md: batch 64 in chunks of 16, one hard negative, dropout 0.1, temperature 0.05, fp32, 1,024 training
    questions (the demo's): ExampleConfig's defaults."""
    from dpr_gc.jax.example import ExampleConfig, parse_args

    page = " ".join((REPO / "docs" / "jax.md").read_text().split())
    c = parse_args(["--output", "x"])
    assert dataclasses.replace(c, output_dir=ExampleConfig().output_dir) == ExampleConfig()
    assert (f"(batch {c.batch_size} in chunks of {c.chunk_size}, one hard negative, dropout {c.dropout:g} with "
            f"per-chunk keys, cosine at temperature {c.temperature:g}, AdamW with linear decay, {c.precision})") in page
    assert c.hard_negatives == 1 and f"({c.train_queries:,} training questions)" in page


def test_example_refuses_zero_epochs_before_any_work(capsys, monkeypatch):
    """``--epochs 0`` would build the dataset, evaluate and then have no loss to report: refused up front."""
    from dpr_gc.jax import example

    monkeypatch.setattr(example, "run_example", lambda config: pytest.fail("work started"))
    assert example.main(["--epochs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --epochs must be at least 1, got 0") and "\n" not in err


def _uneven_global_batch_is_refused() -> None:
    def encode(params, batch, key):
        return batch @ params["w"]

    params = {"w": jnp.ones((8, 4))}
    loss = ContrastiveLoss(n_hard_negatives=1, axis_name="data")
    step = data_parallel_value_and_grad([encode, encode], loss, 2, data_mesh(jax.devices()[:2]))
    batches = [jnp.ones((5, 8)), jnp.ones((10, 8))]
    for run in (step, jax.jit(step)):
        with pytest.raises(DprGcError, match="global batch 0 has 5 rows, which 2 devices do not split evenly"):
            run(params, loss.init(), batches, jax.random.key(0))
    where = r"data_parallel_value_and_grad \(2 devices\): "
    for batches, ids, message in (
            ([jnp.ones((4, 8)), jnp.ones((6, 8))], (), r"the global batch's 4 queries need 8 passages \(1 positive "
                                                        r"\+ 1 hard negative each\), got 6"),
            ([jnp.ones((0, 8)), jnp.ones((0, 8))], (), r"global batch 0 is empty \(0 rows\)"),
            ([jnp.ones((4, 8))], (), "2 encoders need 2 global batches, got 1"),
            ([jnp.ones((4, 8)), jnp.ones((8, 8))], (jnp.arange(6),),
             r"passage_ids must hold one integer id per passage row of the global batch \(8\), got shape \(6,\)"),
            ([jnp.ones((4, 8)), jnp.ones((8, 8))], (jnp.ones(8),),  # named with the global batch's rows, not 4
             r"passage_ids must hold one integer id per passage row of the global batch \(8\), got shape \(8,\) "
             "of float32")):
        with pytest.raises(DprGcError, match="^" + where + message):
            step(params, loss.init(), batches, None, *ids)
    with pytest.raises(DprGcError, match="key must be a PRNG key"):  # was JAX's TypeError from fold_in
        step(params, loss.init(), [jnp.ones((4, 8)), jnp.ones((8, 8))], 5)


def test_data_parallel_refuses_a_global_batch_the_devices_do_not_divide():
    """A global batch the devices do not split, or that each device's step would refuse, is refused before it is
    split, naming the global sizes and the device count (not one device's share)."""
    on_two_devices(_uneven_global_batch_is_refused, "_uneven_global_batch_is_refused()")


def test_data_parallel_refuses_a_contrastive_loss_that_does_not_gather_over_its_axis():
    """Without ``axis_name`` each device's queries would meet only its own passages, another loss than the global
    batch's (the data-parallel step equals the one-device one only with it: test_data_parallel_on_two_devices_...)."""
    def encode(params, batch, key):
        return batch @ params["w"]

    mesh = data_mesh(jax.devices()[:1])
    for loss in (ContrastiveLoss(n_hard_negatives=1), ContrastiveLoss(n_hard_negatives=1, axis_name="other")):
        with pytest.raises(DprGcError, match=f"ContrastiveLoss\\(axis_name={loss.axis_name!r}\\) would score each "
                                             r"device's queries against its own passages only.* pass "
                                             r"ContrastiveLoss\(\.\.\., axis_name='data'\)"):
            data_parallel_value_and_grad([encode, encode], loss, 2, mesh)


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


def test_every_option_of_the_examples_help_has_help_and_shows_its_default(capsys):
    """docs/jax.md's entry point: its flags are generated from ExampleConfig's declarations (12 of 15 once showed
    neither help nor default), and ``--help`` gives each one's help and default."""
    import argparse

    from dpr_gc.jax.example import ExampleConfig, build_parser, parse_args

    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(options) == len(dataclasses.fields(ExampleConfig)) == 15
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for action in options:
        shown = " ".join(parser._get_formatter()._expand_help(action).split())
        assert action.help and "(default: " in shown and shown in text, (action.option_strings, shown)
    assert "--train-queries TRAIN_QUERIES training questions used (default: 1024)" in text
    assert parse_args(["--batch-size", "32", "--init", "random", "--output", "o"]) == dataclasses.replace(
        ExampleConfig(), batch_size=32, init="random", output_dir="o")


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


def test_the_example_masks_copies_of_a_questions_own_positive(tiny_tokenizer, tmp_path):
    """The example keys passages as the torch trainer does (the same passage id, or title and text, a copy without
    an id included) and its first step's loss is the masked loss: two questions sharing a positive do not score it
    as each other's negative."""
    from dpr_gc.base.files import write_json
    from dpr_gc.jax.example import (ExampleConfig, masked_copies, padded_token_ids, passage_id_array, train,
                                    training_examples)

    words = ["city", "river", "king", "war"]
    ctx = [{"title": "", "text": f"the {w} is {w}", "passage_id": f"p{i}"} for i, w in enumerate(words)]
    records = [{"question": f"what is the {w}", "answers": [w], "positive_ctxs": [ctx[min(i, 2)]],
                "hard_negative_ctxs": [ctx[3 - i] if i != 1 else {"title": "", "text": "the city is city"}]}
               for i, w in enumerate(words)]  # questions 2 and 3 share p2; question 1's negative: p0's text, no id
    write_json(tmp_path / "train.json", records)
    questions, groups, keys = training_examples(tmp_path / "train.json", 4, 1)
    ids = passage_id_array(groups, keys)
    assert ids.tolist() == [0, 1, 2, 0, 3, 2, 3, 0]  # (p0, p3), (p1, p0's text), (p2, p1), (p2, p0)
    assert masked_copies(ids, 2) == 5  # q0: rows 3 and 7; q1: row 5; q2 and q3: each other's positive
    config = ExampleConfig(train_queries=4, batch_size=4, chunk_size=3, hard_negatives=1, epochs=1,
                           temperature=0.1, dropout=0.0, query_max_length=8, passage_max_length=8)
    model = Encoder(EncoderConfig(**{**TINY.__dict__, "vocab_size": len(tiny_tokenizer)}))
    params = make_params(model.config, ("x",))["x"]
    _, losses = train(model, params, tiny_tokenizer, questions, groups, config, keys)
    q = padded_token_ids(tiny_tokenizer, questions, 8, pad_to=8)
    p = padded_token_ids(tiny_tokenizer, [t for g in groups for t in g], 8, pad_to=8, kind="passage")
    reps = [model.apply({"params": params}, b["input_ids"], b["attention_mask"]) for b in (q, p)]
    loss = ContrastiveLoss(n_hard_negatives=1, temperature=0.1, similarity="cos")
    assert losses[0] == pytest.approx(float(loss({}, *reps, jnp.asarray(ids))), rel=1e-5)
    assert abs(losses[0] - float(loss({}, *reps))) > 1e-3


def test_dropout_outside_zero_to_one_is_refused():
    """A dropout of 1 or more zeroes the encoder's output (then a NaN loss); a negative one silently meant none."""
    from dpr_gc.jax.example import ExampleConfig

    for bad in (1.5, 1.0, -0.3):
        with pytest.raises(DprGcError, match=r"dropout must lie in \[0, 1\)"):
            EncoderConfig(dropout=bad)
        with pytest.raises(DprGcError, match=r"--dropout must lie in \[0, 1\)"):
            ExampleConfig(dropout=bad)


def test_the_example_stops_on_a_non_finite_loss(tiny_tokenizer):
    """As ``dpr-gc train``: a loss that stops being finite ends training with one "training diverged" error."""
    from dpr_gc.jax.example import ExampleConfig, train

    words = ["city", "river", "king", "war"]
    questions = [f"what is the {w}" for w in words]
    groups = [[f"the {w} is {w}", f"a film about {w}"] for w in words]
    config = ExampleConfig(train_queries=4, batch_size=4, chunk_size=2, hard_negatives=1, epochs=4,
                           learning_rate=1e30, dropout=0.0, query_max_length=8, passage_max_length=8)
    model = Encoder(EncoderConfig(**{**TINY.__dict__, "vocab_size": len(tiny_tokenizer)}))
    with pytest.raises(DprGcError, match=r"training diverged at step [234]: loss nan \(fp32\); stopped without "
                                         "writing report.json"):
        train(model, make_params(model.config, ("x",))["x"], tiny_tokenizer, questions, groups, config)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], r"--temperature must lie in \[0.01, 10.0\], got 0.0"),
    (["--hard-negatives", "-1"], r"--hard-negatives must lie in \[0, 3\] \(the stdlib dataset's"),
    (["--hard-negatives", "4"], r"--hard-negatives must lie in \[0, 3\]"),
    (["--query-max-length", "513"], r"--query-max-length must lie in \[1, 512\]"),
    (["--passage-max-length", "1024"], r"--passage-max-length must lie in \[1, 512\]"),
    (["--passage-max-length", "0"], r"--passage-max-length must lie in \[1, 512\]"),
    (["--max-examples", "2"], r"--max-examples must be at least 3 \(got 2\)"),
    (["--max-examples", "200", "--train-queries", "256"], r"--train-queries 256 exceeds --max-examples 200"),
    (["--learning-rate=-1e-4"], r"--learning-rate must be a positive number"),
    (["--seed", "-1"], r"--seed must be 0 or more"),
    (["--chunk-size", "0"], r"^error: --chunk-size must be at least 1, got 0"),
    (["--batch-size", "0"], r"^error: --batch-size must be at least 1, got 0"),
    (["--batch-size", "-4", "--chunk-size", "0"], r"^error: --batch-size must be at least 1, got -4"),
    (["--train-queries", "0"], r"^error: --train-queries must be at least 1, got 0"),
    (["--train-queries", "16"], r"^error: --train-queries 16 must be at least --batch-size 32"),
    (["--epochs", "0"], r"^error: --epochs must be at least 1, got 0"),
    (["--dropout", "1"], r"^error: --dropout must lie in \[0, 1\)"),
    (["--query-max-length", "0"], r"--query-max-length must lie in \[1, 512\]"),
    (["--max-examples", "-5"], r"--max-examples must be at least 3"),
])
def test_example_refuses_each_bad_flag_by_name_before_any_work(argv, message, capsys, monkeypatch):
    """Bad example flags are refused up front in one line naming the flag, not after the dataset, the model and a
    first evaluation."""
    from dpr_gc.jax import example

    monkeypatch.setattr(example, "run_example", lambda config: pytest.fail("work started"))
    monkeypatch.setattr(example, "build_stdlib_dataset", lambda *a, **k: pytest.fail("dataset built"))
    assert example.main(["--output", "x", "--batch-size", "32", "--train-queries", "64", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    assert re.search(message, err), err


def test_example_refuses_train_queries_beyond_the_training_split_in_one_line(tmp_path, capsys, monkeypatch):
    """How many questions the split gives training is known once the dataset is built: more --train-queries than
    that is refused then, in one line naming the flag, before the model loads."""
    import json

    from dpr_gc.jax import example
    from dpr_gc.model import pretrained

    def build(folder: Path, **kwargs) -> dict:
        folder.mkdir(parents=True)
        records = [{"question": f"q{i}", "positive_ctxs": [{"title": "t", "text": f"p{i}"}],
                    "hard_negative_ctxs": [{"title": "t", "text": f"n{i}"}]} for i in range(3)]
        (folder / "train.json").write_text(json.dumps(records))
        return {"files": {"dpr_train": "train.json"}, "counts": {}}

    monkeypatch.setattr(example, "build_stdlib_dataset", build)
    monkeypatch.setattr(pretrained, "default_model_path", lambda: pytest.fail("the model loads"))
    argv = ["--output", str(tmp_path), "--max-examples", "4", "--train-queries", "4", "--batch-size", "4"]
    assert example.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    assert re.search(r"only 3 questions have a positive and 1 hard negative, fewer than --train-queries 4 ", err), err


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


def test_load_bert_takes_berts_defaults_for_missing_config_fields(tmp_path):
    """A config.json without layer_norm_eps, type_vocab_size or the dropout fields loads with BERT's defaults, as
    transformers loads it; a field of the wrong type is named."""
    import json

    from tests.helpers import tiny_bert

    pytest.importorskip("torch")
    tiny_bert(VOCAB, seed=3).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    hf = json.loads(config_file.read_text())
    for name in ("layer_norm_eps", "type_vocab_size", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        hf.pop(name, None)
    config_file.write_text(json.dumps(hf))
    config, _ = load_bert(tmp_path)
    assert (config.layer_norm_eps, config.type_vocab_size, config.dropout) == (1e-12, 2, 0.1)
    config_file.write_text(json.dumps({**hf, "hidden_size": "32"}))
    with pytest.raises(DprGcError, match="config.json: hidden_size must be an integer, got '32'"):
        load_bert(tmp_path)


def test_bench_jax_memory_ends_with_each_methods_memory_against_plain(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """In this file, run last (tests/conftest.py): the benchmark starts JAX's backend in this process, after which
    a test that forks (DataLoader workers) would fork JAX's threads."""
    from unittest import mock

    from tests.helpers import summary_rows

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_jax_memory
    finally:
        sys.path.pop(0)

    def fake(step: str, params: object, batch: int, *shape: int) -> dict:
        temp = {"plain": 8, "gradcache": 2, "remat": 4}[step] * batch * 2**20
        return {"temp_bytes": temp, "argument_bytes": 0, "output_bytes": 0, "compile_seconds": 0.1}

    steps = {name: name for name in ("plain", "gradcache", "remat")}  # each step stands in by its name
    out = tmp_path / "jax.json"
    with mock.patch.object(bench_jax_memory, "plan", fake), \
            mock.patch.object(bench_jax_memory, "build_steps", lambda *a: steps):
        bench_jax_memory.main(["--batches", "1,4", "--output", str(out)])
    rows = summary_rows(capsys.readouterr().out)
    assert rows["batch 4"] == "plain 32 MiB; gradcache 8.0 MiB (0.25x plain); remat 16 MiB (0.50x plain)", rows
    assert rows["results file"] == str(out) and rows["machine"]
