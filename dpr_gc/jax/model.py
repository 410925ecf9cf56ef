"""A small Flax Transformer encoder for retrieval, laid out like BERT so BERT-family checkpoints load into it.

Post-LayerNorm Transformer (token + position + segment embeddings, multi-head self-attention, exact-GELU MLP),
mean or CLS pooling. It starts from random weights (any size) or from a BERT safetensors checkpoint such as the
offline all-MiniLM-L6-v2 (:func:`load_bert`, read with ``safetensors.numpy``: nothing is unpickled). Dropout takes
the ``"dropout"`` PRNG stream, so Gradient Cache can hand each chunk its own key.
"""

from __future__ import annotations

import dataclasses
import numbers
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..base.errors import DprGcError
from ..base.files import read_json_object

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Sizes and behaviour of :class:`Encoder`; the defaults are a tiny random model for tests."""

    vocab_size: int = 30522
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    pooling: str = "mean"

    def __post_init__(self) -> None:
        """Refuse sizes the model cannot have (a head count of 0 would divide by zero), naming the field."""
        for name in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "max_positions",
                     "type_vocab_size", "num_layers"):
            value, least = getattr(self, name), 0 if name == "num_layers" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                kind = "an integer >= 0" if least == 0 else "a positive integer"
                raise DprGcError(f"EncoderConfig: {name} must be {kind}, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise DprGcError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        if self.pooling not in ("mean", "cls"):
            raise DprGcError(f"pooling must be 'mean' or 'cls', got {self.pooling!r}")
        if not 0.0 <= self.dropout < 1.0:  # 1 or more zeroes every activation, below 0 silently means none
            raise DprGcError(f"dropout must lie in [0, 1), got {self.dropout}")


class Layer(nn.Module):
    """One post-LN Transformer layer (BERT's)."""

    config: EncoderConfig

    @nn.compact
    def __call__(self, h: Array, mask_bias: Array, deterministic: bool) -> Array:
        c = self.config
        head_dim = c.hidden_size // c.num_heads

        def heads(name: str) -> Array:
            return nn.Dense(c.hidden_size, name=name)(h).reshape(h.shape[:2] + (c.num_heads, head_dim))

        q, k, v = heads("query"), heads("key"), heads("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(head_dim) + mask_bias
        probs = nn.Dropout(c.dropout)(jax.nn.softmax(scores, axis=-1).astype(h.dtype), deterministic=deterministic)
        context = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(h.shape)
        attended = nn.Dropout(c.dropout)(nn.Dense(c.hidden_size, name="attention_out")(context),
                                         deterministic=deterministic)
        h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="attention_norm")(h + attended)
        ff = nn.gelu(nn.Dense(c.intermediate_size, name="ff_in")(h), approximate=False)
        ff = nn.Dropout(c.dropout)(nn.Dense(c.hidden_size, name="ff_out")(ff), deterministic=deterministic)
        return nn.LayerNorm(epsilon=c.layer_norm_eps, name="ff_norm")(h + ff)


class Encoder(nn.Module):
    """Token ids ``[B, L]`` and attention mask ``[B, L]`` to one representation per sequence ``[B, hidden]``."""

    config: EncoderConfig

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array, deterministic: bool = True) -> Array:
        c = self.config
        if input_ids.shape[1] > c.max_positions:
            raise DprGcError(f"sequences of {input_ids.shape[1]} tokens exceed the model's {c.max_positions} "
                             "positions; truncate them (max_length)")
        positions = jnp.arange(input_ids.shape[1])[None, :]
        h = (nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
             + nn.Embed(c.max_positions, c.hidden_size, name="position_embeddings")(positions)
             + nn.Embed(c.type_vocab_size, c.hidden_size, name="token_type_embeddings")(jnp.zeros_like(input_ids)))
        h = nn.LayerNorm(epsilon=c.layer_norm_eps, name="embedding_norm")(h)
        h = nn.Dropout(c.dropout)(h, deterministic=deterministic)
        mask = attention_mask.astype(jnp.float32)
        mask_bias = ((1.0 - mask) * jnp.finfo(jnp.float32).min)[:, None, None, :]
        for i in range(c.num_layers):
            h = Layer(c, name=f"layer_{i}")(h, mask_bias, deterministic)
        if c.pooling == "cls":
            return h[:, 0]
        summed = jnp.einsum("bld,bl->bd", h.astype(jnp.float32), mask)
        return (summed / jnp.maximum(mask.sum(1, keepdims=True), 1.0)).astype(h.dtype)


def encoder_fn(model: Encoder, subtree: str | None = None, train: bool = True) -> Callable[[Any, dict, Array], Array]:
    """``f(params, batch, key) -> reps`` for the Gradient Cache steps: ``params[subtree]`` (or all of ``params``)
    applied to ``batch["input_ids"]``/``batch["attention_mask"]``, with dropout from ``key`` when ``train`` (without
    ``train`` the key is not used and may be ``None``)."""
    def encode(params: Any, batch: dict, key: Array | None) -> Array:
        weights = params[subtree] if subtree is not None else params
        if not train:
            return model.apply({"params": weights}, batch["input_ids"], batch["attention_mask"], deterministic=True)
        if key is None:
            raise DprGcError("encoder_fn(model, train=True) needs a PRNG key for dropout (e.g. jax.random.key(0)); "
                             "got None: pass a key, or use encoder_fn(model, train=False) for inference")
        return model.apply({"params": weights}, batch["input_ids"], batch["attention_mask"], deterministic=False,
                           rngs={"dropout": key})

    return encode


def cast_params(params: Any, dtype: Any) -> Any:
    """Every floating-point leaf cast to ``dtype`` (e.g. ``jnp.bfloat16`` for bf16 training)."""
    return jax.tree_util.tree_map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _bert_names(num_layers: int) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name (without the ``.weight``/``.bias`` suffix) to the Flax module path."""
    names = {"embeddings.word_embeddings": ("word_embeddings",),
             "embeddings.position_embeddings": ("position_embeddings",),
             "embeddings.token_type_embeddings": ("token_type_embeddings",),
             "embeddings.LayerNorm": ("embedding_norm",)}
    parts = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
             "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
             "intermediate.dense": "ff_in", "output.dense": "ff_out", "output.LayerNorm": "ff_norm"}
    for i in range(num_layers):
        for src, dst in parts.items():
            names[f"encoder.layer.{i}.{src}"] = (f"layer_{i}", dst)
    return names


def _flax_leaf(module: str, suffix: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    if module.endswith("embeddings"):
        return "embedding", value
    if "norm" in module:
        return {"weight": "scale", "bias": "bias"}[suffix], value
    return {"weight": "kernel", "bias": "bias"}[suffix], value.T if suffix == "weight" else value


# transformers' BertConfig defaults, used for the fields a config.json leaves out (as transformers does).
BERT_DEFAULTS: dict[str, int | float] = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1}


def _bert_fields(hf: dict, config_file: Path) -> dict[str, int | float]:
    """The encoder's fields of a BERT ``config.json``: BERT's defaults for missing ones, each of the right type."""
    fields = {}
    for name, default in BERT_DEFAULTS.items():
        value = hf.get(name, default)
        kinds, kind = ((int, float), "a number") if isinstance(default, float) else ((int,), "an integer")
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise DprGcError(f"{config_file}: {name} must be {kind}, got {value!r}")
        fields[name] = value
    return fields


def load_bert(path: str | Path, pooling: str = "mean", dropout: float | None = None) -> tuple[EncoderConfig, Any]:
    """Read a BERT folder (``config.json`` + ``model.safetensors``) into an :class:`EncoderConfig` and Flax params."""
    from safetensors.numpy import load_file

    folder = Path(path)
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    if not (config_file.is_file() and weights_file.is_file()):
        raise DprGcError(f"{folder}: expected a BERT folder with config.json and model.safetensors")
    hf = read_json_object(config_file, "a BERT config")
    if hf.get("model_type") != "bert" or hf.get("hidden_act", "gelu") != "gelu":
        raise DprGcError(f"{config_file}: only BERT models with exact GELU load into the Flax encoder")
    fields = _bert_fields(hf, config_file)
    config = EncoderConfig(vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"],
                           num_layers=fields["num_hidden_layers"], num_heads=fields["num_attention_heads"],
                           intermediate_size=fields["intermediate_size"],
                           max_positions=fields["max_position_embeddings"], type_vocab_size=fields["type_vocab_size"],
                           layer_norm_eps=fields["layer_norm_eps"],
                           dropout=fields["hidden_dropout_prob"] if dropout is None else dropout, pooling=pooling)
    tensors = {k.removeprefix("bert."): v for k, v in load_file(str(weights_file)).items()}
    params: dict[str, Any] = {}
    for src, dst in _bert_names(config.num_layers).items():
        for suffix in ("weight", "bias"):
            if f"{src}.{suffix}" not in tensors:
                if suffix == "bias" and src.endswith("embeddings"):
                    continue
                raise DprGcError(f"{weights_file}: tensor {src}.{suffix} is missing; is this a BERT checkpoint?")
            leaf, value = _flax_leaf(dst[-1], suffix, tensors[f"{src}.{suffix}"])
            node = params
            for key in dst:
                node = node.setdefault(key, {})
            node[leaf] = jnp.asarray(value, jnp.float32)
    return config, params
