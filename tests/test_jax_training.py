"""Gradient Cache for JAX in training: cache_train_step's update, bf16 compute from fp32 master weights, data
parallel on two devices equal to one device's global batch, the compiled step's memory flat in the batch, the Flax
encoder loading BERT weights as torch computes them, and the example trainer (dpr_gc.jax.example) with docs/jax.md's
code and defaults. The cached step itself: test_jax.py.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.jax_common import (REPO, TINY, VOCAB, full_batch, jax, jnp, make_batch, make_params,  # first: XLA_FLAGS
                              on_two_devices, rel_error)
from dpr_gc.base.errors import DprGcError
from dpr_gc.jax import (ContrastiveLoss, Encoder, EncoderConfig, cache_train_step, cached_value_and_grad,
                        cast_params, data_mesh, data_parallel_value_and_grad, encoder_fn, load_bert, tree_chunk)

pytestmark = pytest.mark.usefixtures("jax_quick_compiles")


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
