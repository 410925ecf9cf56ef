"""The one place where queries and passages become token ids: training batches, corpus encoding and queries.

Every passage is tokenised on its own, so its ids (and so its embedding) never depend on the other passages of its
batch: with ``passage_format="pair"`` a passage with a title becomes ``[CLS] title [SEP] text [SEP]`` and one without
a title ``[CLS] text [SEP]``, decided per passage as DPR does. A sequence longer than the max length loses tokens from
the end of the text first and then from the end of the title, so a title longer than the limit is cut instead of
failing. Under last-token pooling every sequence ends with the tokenizer's EOS (appended, within the max length,
when the tokenizer does not add it). The encoded sequences are then padded together to the longest one, on the
tokenizer's padding side.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from ..base.errors import DprGcError

QUERY, PASSAGE = "query", "passage"
# No tokenizer makes a token of more characters than this (WordPiece turns a longer word into [UNK] at 100), and
# whitespace makes none, so text beyond max_length * CHARS_PER_TOKEN characters that are not whitespace cannot reach
# the model; it is cut before tokenising, so a 100 MB passage costs what a short one does. (Characters tokenizers drop
# without a token -- control and zero-width ones -- count as if they made one: a text of mostly those may lose words.)
CHARS_PER_TOKEN = 128


def cut(text: str, bound: int) -> str:
    """``text`` cut after its first ``bound`` characters that are not whitespace (see :data:`CHARS_PER_TOKEN`)."""
    if len(text) <= bound:
        return text
    seen = 0
    for word in re.finditer(r"\S+", text):
        seen += word.end() - word.start()
        if seen >= bound:
            return text[:word.end()]
    return text


def check_prefix(tokenizer: Any, prefix: str, kind: str, limit: int, length: str) -> None:
    """Refuse a prefix that fills the whole max length (``limit`` tokens, from ``length``: the flag or setting and
    its value, as the stage names it): every text would be cut away and all look the same."""
    if not prefix:
        return
    ids = tokenizer(prefix, add_special_tokens=False, truncation=True, max_length=limit)["input_ids"]
    used = len(ids) + tokenizer.num_special_tokens_to_add()
    if used >= limit:
        raise DprGcError(f"the {kind} prefix {prefix[:60]!r} takes {used} of the {limit} tokens a {kind} has under "
                         f"{length} and leaves none for the {kind} itself; give a shorter --{kind}-prefix or a longer "
                         "max length")


def check_kind(kind: str) -> None:
    """Refuse a text kind other than ``"query"`` and ``"passage"`` (another would pick a tower silently)."""
    if kind not in (QUERY, PASSAGE):
        raise DprGcError(f"unknown text kind {kind!r}; expected {QUERY!r} or {PASSAGE!r}")


def token_ids(tokenizer: Any, config: Any, kind: str, texts: Sequence[str],
             titles: Optional[Sequence[Optional[str]]] = None, max_length: Optional[int] = None) -> Any:
    """Padded ``BatchEncoding`` (PyTorch tensors) of queries or passages under ``config``'s format and prefixes.

    ``config`` is a :class:`~dpr_gc.model.config.RetrieverConfig`; ``max_length`` overrides its query/passage max
    length.
    Titles are ignored for queries; a missing or empty title means an untitled passage.
    """
    check_kind(kind)
    eos = eos_to_append(tokenizer, config)
    limit = check_length_room(tokenizer, config, kind,
                              max_length or (config.query_max_length if kind == QUERY else config.passage_max_length))
    bound = limit * CHARS_PER_TOKEN
    texts = [cut(t, bound) for t in texts]
    if kind == QUERY:
        encoded = _singles(tokenizer, [config.query_prefix + q for q in texts], limit)
    else:
        titles = [cut(t or "", bound) for t in titles] if titles is not None else [""] * len(texts)
        if len(titles) != len(texts):
            raise DprGcError(f"{len(titles)} titles for {len(texts)} passage texts")
        encoded = _passages(tokenizer, config, titles, list(texts), limit)
    if not encoded:
        raise DprGcError(f"nothing to tokenize: the list of {kind}s is empty")
    if eos is not None:
        encoded = [_append_token(row, eos) for row in encoded]
    return tokenizer.pad(encoded, padding=True, return_tensors="pt")


def check_length_room(tokenizer: Any, config: Any, kind: str, length: int, flag: Optional[str] = None) -> int:
    """The tokens a ``kind`` text may take at max length ``length`` (given as ``flag``, by default the retriever's
    ``KIND_max_length``: a stage without a length flag names the model's own) once the EOS that last-token pooling
    appends is set aside. Refused where the text would keep no token of its own: no room for that EOS, a prefix that
    fills the length, no room beside the special tokens, or, for passages of the pair format, none for a title and a
    text beside the pair's special tokens. Stages call it before writing anything."""
    flag = flag or f"the retriever's {kind}_max_length"
    limit = length - (eos_to_append(tokenizer, config) is not None)
    if limit < 1:
        raise DprGcError(f"{flag} {length} leaves no room for the EOS token that last-token pooling needs; raise it")
    check_prefix(tokenizer, config.query_prefix if kind == QUERY else config.passage_prefix, kind, limit,
                 f"{flag} {length}")
    special = tokenizer.num_special_tokens_to_add()
    if limit - special < 1:
        raise DprGcError(f"{flag} {length} leaves no room for the {kind}'s text beside the tokenizer's {special} "
                         "special tokens; raise it")
    pair = kind == PASSAGE and config.passage_format == "pair"
    if pair and limit - tokenizer.num_special_tokens_to_add(pair=True) < 1:
        raise DprGcError(f"{flag} {length} leaves no room for a title and a text; raise it")
    return limit


def eos_to_append(tokenizer: Any, config: Any) -> Optional[int]:
    """The EOS id to end every sequence with under last-token pooling, when the tokenizer does not add it itself
    (Llama, Mistral and Qwen2 tokenizers do not): the pooled state is then the one that has read the whole text."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if config.pooling != "last" or eos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return None if ids and ids[-1] == eos else eos


def _append_token(row: dict, token: int) -> dict:
    """One unpadded encoding with ``token`` added at its end (a real, attended token)."""
    out = {}
    for key, values in row.items():
        values = list(values)
        extra = token if key == "input_ids" else 1 if key in ("attention_mask", "special_tokens_mask") else (
            values[-1] if values else 0)
        out[key] = values + [extra]
    return out


def _passages(tokenizer: Any, config: Any, titles: list[str], texts: list[str], limit: int) -> list[dict]:
    """Unpadded encodings of passages in input order, the pair/single choice made for each passage alone."""
    prefix = config.passage_prefix
    if config.passage_format != "pair":
        return _singles(tokenizer, [prefix + (f"{t} {x}" if t else x) for t, x in zip(titles, texts)], limit)
    out: list[Optional[dict]] = [None] * len(texts)
    untitled = [i for i, t in enumerate(titles) if not t]
    titled = [i for i, t in enumerate(titles) if t]
    _place(out, untitled, _singles(tokenizer, [prefix + texts[i] for i in untitled], limit))
    if not titled:
        return out  # type: ignore[return-value]
    budget = limit - tokenizer.num_special_tokens_to_add(pair=True)  # at least 1: check_length_room
    title_lengths = _lengths(tokenizer, [prefix + titles[i] for i in titled])
    # A title shorter than the budget keeps at least one text token, so only the text is cut; otherwise the text
    # is dropped and the title itself is cut ("[CLS] title [SEP] [SEP]").
    fits = [i for i, n in zip(titled, title_lengths) if n < budget]
    long = [i for i, n in zip(titled, title_lengths) if n >= budget]
    _place(out, fits, _pairs(tokenizer, [prefix + titles[i] for i in fits], [texts[i] for i in fits], limit,
                             "only_second"))
    _place(out, long, _pairs(tokenizer, [prefix + titles[i] for i in long], [""] * len(long), limit, "only_first"))
    return out  # type: ignore[return-value]


def _singles(tokenizer: Any, texts: list[str], limit: int) -> list[dict]:
    if not texts:
        return []
    return _rows(tokenizer(texts, max_length=limit, truncation=True, padding=False))


def _pairs(tokenizer: Any, first: list[str], second: list[str], limit: int, truncation: str) -> list[dict]:
    if not first:
        return []
    return _rows(tokenizer(first, second, max_length=limit, truncation=truncation, padding=False))


def _lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False, padding=False)["input_ids"]]


def _rows(encoding: Any) -> list[dict]:
    keys = list(encoding.keys())
    return [dict(zip(keys, values)) for values in zip(*(encoding[k] for k in keys))]


def _place(out: list, positions: list[int], rows: list[dict]) -> None:
    for i, row in zip(positions, rows):
        out[i] = row


def lowercases(tokenizer: Any) -> bool:
    """Whether a fast tokenizer's normalizer (or one in its sequence) is a ``Lowercase``, as
    :func:`dpr_gc.model.folder.lower_case` puts it: a save then writes ``do_lower_case``, since transformers rebuilds
    a BERT tokenizer's normalizer at load."""
    from tokenizers.normalizers import Lowercase

    return any(isinstance(n, Lowercase) for n in normalizers(tokenizer))


def normalizers(tokenizer: Any) -> list:
    """A fast tokenizer's normalizers, in order (none for a slow tokenizer)."""
    from tokenizers.normalizers import Sequence

    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return list(normalizer) if isinstance(normalizer, Sequence) else [] if normalizer is None else [normalizer]
