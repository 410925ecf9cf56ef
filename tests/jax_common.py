"""What the JAX test files (test_jax.py, test_jax_training.py) share: two fake CPU devices, the tiny encoder
config, parameter and batch builders, the full-batch reference step and the two-device runner.

Two fake CPU devices come from ``XLA_FLAGS``, which JAX reads when its backend starts, so this module sets it before
it imports JAX; if another test started the backend first with one device, a data-parallel test re-runs itself in a
subprocess with the flag set.
"""

from __future__ import annotations

import os
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

from dpr_gc.jax import Encoder, EncoderConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB, LENGTH = 50, 8
TINY = EncoderConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                     max_positions=LENGTH, dropout=0.0)


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


def on_two_devices(check: Callable[[], None], call: str) -> None:
    """Run ``check`` here when JAX has two devices, else ``CALL`` of ``check``'s test module in a subprocess with two
    XLA host devices (killed after ``SUBPROCESS_SECONDS``)."""
    if len(jax.devices()) >= 2:
        check()
        return
    env = {**os.environ, "XLA_FLAGS": DEVICE_FLAG, "PYTHONPATH": str(REPO)}
    code = (f"import {check.__module__} as t, jax; assert len(jax.devices()) == 2; "
            f"jax.config.update('jax_disable_most_optimizations', True); t.{call}")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
